"""What an executor runs: one computation of one run, all of its local shards (``Work``),
and the record of when it ran (``Span``)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from pwmesh.errors import PwmeshError
from pwmesh.wire.messages import Computation


@dataclasses.dataclass(eq=False)
class Work:
    """One computation of one run on this executor: all of its local shards. A plain record (no futures:
    what waits on it is the runner's), so the pure cores (``DeviceQueues``, ``ExecutorState``) and the
    simulator share it."""

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
    streamed: bool = False  # handed to its devices' streams without waiting (``Runner._stream``)

    @property
    def label(self) -> str:
        return f"run {self.run_id} node {self.comp.node} (seq {self.comp.seq})"


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
