"""Streamed computations: handed to their devices without waiting, seen computed by a thread.

An accelerator's stream runs what it is given in order, with no host work in
between; XLA on CPU does the same for a computation whose inputs are outputs
still being computed. The runner streams slow computations
(``Runner._stream``); here a thread per device waits for them in the order they
were handed over and gives the event loop each batch found computed together.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from pwmesh.executor.calls import Whole, computed, is_computed, last_outputs

if TYPE_CHECKING:
    from pwmesh.executor.functions import CompiledFunction
    from pwmesh.executor.work import Work


class Streamed(NamedTuple):
    """A computation handed to its devices and not yet seen computed (see ``Runner._stream``)."""

    work: Work
    fn: CompiledFunction
    per_shard: list[list[Any]]
    outs: list[list[Any]] | Whole  # per shard, or kept whole (an SPMD computation's)
    times: tuple[float, float]  # arrived, start
    reserved: int


class Landed(NamedTuple):
    """A streamed computation seen computed (or failed) by its landing thread."""

    streamed: Streamed
    end: float  # when it was seen computed (wall clock)
    error: BaseException | None
    timed: bool  # ``end`` is about when it was computed (once the thread had the interpreter back)


class Landings:
    """One thread per device that waits for its streamed computations in the order they were
    handed over, and gives the loop each batch it found computed together (one wake-up)."""

    def __init__(self, device: int, landed: Callable[[list[Landed]], None]) -> None:
        self._queue: queue.SimpleQueue[Streamed | None] = queue.SimpleQueue()
        self._loop = asyncio.get_running_loop()
        self._landed = landed
        self._thread = threading.Thread(target=self._wait, name=f"pwmesh-landings{device}", daemon=True)
        self._thread.start()

    def put(self, streamed: Streamed) -> None:
        self._queue.put(streamed)

    def close(self) -> None:
        self._queue.put(None)

    def _wait(self) -> None:
        batch: list[Landed] = []
        while True:
            try:
                streamed = self._queue.get(block=not batch)
            except queue.Empty:  # nothing more is computed yet: hand over what is
                self._hand_over(batch)
                batch = []
                continue
            if streamed is None:
                self._hand_over(batch)
                return
            waits = not all(is_computed(leaf) for leaf in last_outputs(streamed.outs))
            if batch and waits:
                self._hand_over(batch)  # do not hold those back while this one computes
                batch = []
            try:
                # Timed if this thread waited for it, or found it computed as it took it: not if
                # it was computed while this thread waited for the ones ahead (it ended then, unseen).
                batch.append(Landed(streamed, computed(streamed.outs), None, waits or not batch))
            except Exception as exc:  # it fails its computation, not this thread
                batch.append(Landed(streamed, time.time(), exc, False))

    def _hand_over(self, batch: list[Landed]) -> None:
        if batch:
            try:
                self._loop.call_soon_threadsafe(self._landed, batch)
            except RuntimeError:  # the loop is closed: the executor is leaving
                pass


