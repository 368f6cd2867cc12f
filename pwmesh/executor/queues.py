"""The executor's device queues as a pure state machine: no threads, no JAX, no event loop.

Each device has one non-preemptive FIFO queue, as a TPU core has one stream. A
computation (``Work``: all of its local shards) is put on each of its devices'
queues, in the island's order; it *starts* once it is at the head of all of them,
and holds them until it is *released* (run, or handed to its devices' streams),
so the work behind it on any of its devices waits. It *completes* when its
outputs are stored (or failed): then it is counted out of its run. A run's part
on this executor ends once every computation of it that was enqueued has
completed, and no more are being enqueued.

``Runner`` is the shell: it turns ``Start`` into running the work (waiting for its
inputs, function and memory), and ``PartDone`` into a message to the scheduler.
"""

from __future__ import annotations

import collections
import dataclasses

from pwmesh.executor.work import Work


@dataclasses.dataclass(frozen=True)
class Start:
    """Every local device of ``work`` has reached it: run it now."""

    work: Work


@dataclasses.dataclass(frozen=True)
class PartDone:
    """Every computation of ``run_id`` enqueued here has completed: its part on this executor is done."""

    run_id: str
    scheduler: str
    device_seconds: float


class DeviceQueues:
    def __init__(self, devices: int) -> None:
        self.fifos: list[collections.deque[Work]] = [collections.deque() for _ in range(devices)]
        self.load = [0] * devices  # per device: computations added and not completed (0: free now)
        self.outstanding = 0  # computations added and not completed
        # Ever, for the metrics: computations started (on the runner's fast path too: it counts those),
        # completed (ok or failed), failed, and per device the seconds it computed.
        self.started = 0
        self.executed = 0
        self.failed = 0
        self.busy_seconds = [0.0] * devices
        self._started: set[Work] = set()
        self._runs: dict[str, list[Work]] = {}  # queued work not yet completed, by run
        self._run_seconds: dict[str, float] = {}
        self._admitting: set[str] = set()  # runs whose computations are being enqueued

    def admitting(self, run_id: str) -> None:
        """``run_id``'s computations are being enqueued: its part cannot end before ``admitted``."""
        self._admitting.add(run_id)
        self._run_seconds.setdefault(run_id, 0.0)

    def admitted(self, run_id: str, scheduler: str) -> list[PartDone]:
        self._admitting.discard(run_id)
        return self._end_if_done(run_id, scheduler)

    def add(self, work: Work) -> None:
        """Count ``work`` in: it runs now (the caller checked its devices are free) or is ``queue``d next."""
        self.outstanding += 1
        self._run_seconds.setdefault(work.run_id, 0.0)
        for device in work.devices:
            self.load[device] += 1

    def free(self, work: Work) -> bool:
        """Whether nothing but ``work`` (added) is on its devices: it may run at once, ahead of no one."""
        load = self.load
        for d in work.devices:  # (a loop: a generator cost ~1 us of a chain node's ~30)
            if load[d] > 1:
                return False
        return True

    def ran(self, run_id: str, devices: tuple[int, ...], seconds: float) -> None:
        """A computation of ``run_id`` that ran and completed on idle ``devices`` without being added (the
        runner's warm path for a part, ``Runner._run_chain``): counted as started and completed."""
        self.started += 1
        self.executed += 1
        share = seconds / len(devices)
        for device in devices:
            self.busy_seconds[device] += share
        self._run_seconds[run_id] = self._run_seconds.get(run_id, 0.0) + seconds

    def queue(self, work: Work) -> list[Start]:
        """Put an added ``work`` at the back of its devices' queues."""
        self._runs.setdefault(work.run_id, []).append(work)
        for device in work.devices:
            self.fifos[device].append(work)
        return self._startable([work])

    def release(self, work: Work) -> list[Start]:
        """``work`` no longer holds its devices: the work behind it may start."""
        self._started.discard(work)
        behind = []
        for device in work.devices:
            fifo = self.fifos[device]
            if fifo and fifo[0] is work:
                fifo.popleft()
                if fifo:
                    behind.append(fifo[0])
        return self._startable(behind)

    def complete(self, work: Work) -> list[PartDone]:
        """``work``'s outputs are stored (or failed): count it out, and end its run's part if it was the last."""
        work.finished = True
        self.executed += 1
        if work.error is not None:
            self.failed += 1
        self.outstanding -= 1
        share = work.device_seconds / len(work.devices) if work.devices else 0.0
        for device in work.devices:
            self.load[device] -= 1
            self.busy_seconds[device] += share
        self._run_seconds[work.run_id] = self._run_seconds.get(work.run_id, 0.0) + work.device_seconds
        works = self._runs.get(work.run_id)
        if works and work.queued:
            works.remove(work)
        return self._end_if_done(work.run_id, work.scheduler)

    def of_run(self, run_id: str) -> list[Work]:
        """The queued, incomplete work of ``run_id``, and of the nodes it dispatched one by one (``run_id#node``)."""
        return [w for rid, ws in self._runs.items() if rid == run_id or rid.startswith(f"{run_id}#") for w in ws]

    def incomplete(self) -> list[Work]:
        """Every queued computation not completed yet, in the order they were queued per run."""
        return [w for works in self._runs.values() for w in works]

    def queued(self) -> list[int]:
        """Per device: computations waiting behind the one at the head of its queue (or for it to start)."""
        return [len(fifo) - (1 if fifo and fifo[0] in self._started else 0) for fifo in self.fifos]

    def _startable(self, candidates: list[Work]) -> list[Start]:
        starts = []
        for work in dict.fromkeys(candidates):  # once each, in order
            if work not in self._started and all(self.fifos[d][0] is work for d in work.devices):
                self._started.add(work)
                self.started += 1
                starts.append(Start(work))
        return starts

    def _end_if_done(self, run_id: str, scheduler: str) -> list[PartDone]:
        if self._runs.get(run_id) or run_id in self._admitting:
            return []
        self._runs.pop(run_id, None)
        return [PartDone(run_id, scheduler, self._run_seconds.pop(run_id, 0.0))]
