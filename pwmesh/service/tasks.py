"""Owned background tasks: nothing is fire-and-forget.

Like ``asyncio.TaskGroup`` but long-lived: tasks may be added at any time, a
task that dies with an exception is logged (and, for ``critical`` ones, stops
the service), and ``stop()`` cancels every task and waits for all of them.
Failures are logged once per kind of task and exception per interval: a task a
peer's message spawned may fail the same way for every such message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from pwmesh.core.ratelimit import RejectedLog

log = logging.getLogger(__name__)


class TaskGroup:
    def __init__(self, on_crash: Callable[[BaseException], None] | None = None) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._on_crash = on_crash
        self._failures = RejectedLog("tasks", logger=log)

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
            name = task.get_name()
            # Its kind: the name up to its first "-" ("send-s1:7/b3" is a "send" task).
            more = "" if critical else self._failures.allow((name.partition("-")[0], type(exc)), alike="like it")
            if more is not None:
                log.error("task %s failed%s", name, more, exc_info=exc, extra={"task": name, "reason": str(exc)})
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
