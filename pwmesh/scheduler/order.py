"""The island's single order, as an explicit structure (no sockets).

Every computation that reaches the island gets the next sequence number, in
the order the scheduler accepts runs; each executor receives its computations
of a run as one ``Enqueue`` in that order. The policy that picks *which* run
goes next is FIFO today: sharing policies (weights, priorities) and gang
semantics replace ``FifoPolicy`` without changing the executors.
"""

from __future__ import annotations

import collections
import dataclasses

from pwmesh.wire.messages import Computation, Enqueue, ScheduleRun


@dataclasses.dataclass(frozen=True, slots=True)
class OrderEntry:
    seq: int
    run_id: str
    node: int
    executor_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class SendEnqueue:
    """Action: deliver ``enqueue`` to the executor at ``control``."""

    control: str
    enqueue: Enqueue


class FifoPolicy:
    """Runs are ordered by their arrival at the scheduler."""

    def __init__(self) -> None:
        self._ready: collections.deque[ScheduleRun] = collections.deque()

    def submit(self, run: ScheduleRun) -> None:
        self._ready.append(run)

    def next_run(self) -> ScheduleRun | None:
        return self._ready.popleft() if self._ready else None


class IslandOrder:
    def __init__(self, island: int, history: int = 10_000) -> None:
        self.island = island
        self.next_seq = 0
        self.policy = FifoPolicy()
        self.history: collections.deque[OrderEntry] = collections.deque(maxlen=history)

    def handle(self, run: ScheduleRun) -> list[SendEnqueue]:
        """Accept a run and emit, per executor, its computations in island order."""
        self.policy.submit(run)
        actions: list[SendEnqueue] = []
        while (nxt := self.policy.next_run()) is not None:
            actions.extend(self._sequence(nxt))
        return actions

    def _sequence(self, run: ScheduleRun) -> list[SendEnqueue]:
        per_executor: dict[str, list[Computation]] = {}
        controls: dict[str, str] = {}
        for comp in run.computations:
            comp.seq = self.next_seq
            self.next_seq += 1
            self.history.append(OrderEntry(comp.seq, run.run_id, comp.node, comp.executor_id))
            per_executor.setdefault(comp.executor_id, []).append(comp)
            controls[comp.executor_id] = comp.control
        return [
            SendEnqueue(controls[ex], Enqueue(run_id=run.run_id, proxy=run.proxy, computations=comps))
            for ex, comps in per_executor.items()
        ]
