"""Periodic duties and the event loop's lag (``Liveness``, the pure part, is in ``pwmesh.core.liveness``)."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable


async def every(interval_seconds: float, fn: Callable[[], Awaitable[None]]) -> None:
    """Call ``fn`` every ``interval_seconds`` until cancelled (a periodic duty, not a wait)."""
    while True:
        await asyncio.sleep(interval_seconds)
        await fn()


class LoopLag:
    """How long this process's event loop was kept from running a ready task: what everything it serves
    (heartbeats, status, cancels, signals) waits at worst. A task asks to wake every ``interval_seconds``
    and records how late it woke; a late wake-up is a callback that held the loop, or a starved process."""

    def __init__(self, interval_seconds: float = 0.025, stall_seconds: float = 0.05, keep: int = 64) -> None:
        self.interval_seconds = interval_seconds
        self.stall_seconds = stall_seconds  # a wake-up this late counts as a stall
        self.max_seconds = 0.0  # the longest since start
        self.stalls = 0
        self.recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=keep)  # (wall clock, s)

    def woke(self, late_seconds: float, wall: float) -> None:
        self.max_seconds = max(self.max_seconds, late_seconds)
        if late_seconds >= self.stall_seconds:
            self.stalls += 1
            self.recent.append((wall, late_seconds))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(self.interval_seconds)
            self.woke(max(0.0, loop.time() - asked - self.interval_seconds), time.time())
