"""What an executor runs: one computation of one run, all of its local shards (``Work``),
and the record of when it ran (``Span``)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, NamedTuple

from pwmesh.errors import PwmeshError
from pwmesh.wire.messages import Computation


@dataclasses.dataclass(eq=False)
class Work:
    """One computation of one run on this executor: all of its local shards."""

    run_id: str
    proxy: str
    scheduler: str
    comp: Computation
    devices: list[int]  # its local devices, one per shard
    shards: list[int]  # the shard each of them runs
    queued: bool = False  # it went through the device queues (not run at once: see ``Runner.enqueue``)
    finished: bool = False  # completed and reported
    error: PwmeshError | None = None
    cancelled: PwmeshError | None = None  # its run was cancelled: it never waits for memory
    device_seconds: float = 0.0
    landed: asyncio.Future[None] | None = None  # streamed: resolved once its outputs are computed
    # Only work that goes through the queues waits, so only it has this (``queue``): it fails when
    # its run is cancelled, so that whatever it waits for (inputs, its function) stops holding it.
    cancel: asyncio.Future[None] = dataclasses.field(init=False)

    def queue(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make the future its waits need: it goes through the device queues."""
        self.queued = True
        self.cancel = loop.create_future()
        self.cancel.add_done_callback(_retrieve)

    @property
    def label(self) -> str:
        return f"run {self.run_id} node {self.comp.node} (seq {self.comp.seq})"


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class Span(NamedTuple):
    """When one computation ran on this executor's devices, for ``pwmesh trace``.

    Wall-clock (``time.time()``) seconds, so the spans of processes on one machine
    line up; across hosts they are only as aligned as the hosts' clocks."""

    arrived: float  # every local device had reached it at the head of its queue
    start: float  # inputs, function and memory were there and (streamed) what was ahead on its devices ended
    end: float
    run_id: str
    node: int
    seq: int
    fn_id: str
    devices: tuple[int, ...]
    error: str  # empty when it succeeded
