"""Owned background tasks: nothing is fire-and-forget.

Like ``asyncio.TaskGroup`` but long-lived: tasks may be added at any time, a
task that dies with an exception is logged (and, for ``critical`` ones, stops
the service), and ``stop()`` cancels every task and waits for all of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)


class TaskGroup:
    def __init__(self, on_crash: Callable[[BaseException], None] | None = None) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._on_crash = on_crash

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str, critical: bool = False) -> asyncio.Task[Any]:
        if self._closed:
            coro.close()
            raise RuntimeError(f"task group is stopped; cannot start {name}")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, critical))
        return task

    def _done(self, task: asyncio.Task[Any], critical: bool) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("task %s failed", task.get_name(), exc_info=exc)
            if critical and self._on_crash is not None:
                self._on_crash(exc)

    def __len__(self) -> int:
        return len(self._tasks)

    async def stop(self, timeout_seconds: float = 5.0) -> None:
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=timeout_seconds)
            for task in pending:
                log.error("task %s did not stop within %s seconds", task.get_name(), timeout_seconds)
