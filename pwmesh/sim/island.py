"""An island's order (``IslandOrder``, in the scheduler's core ``SchedulerState``) driven in a closed loop,
with no executors and no clocks.

The sharing policies are promises about the long run ("each client gets device time in
proportion to its weight", "fifo ignores weights"), which only a loop that keeps every
client's queue full can check: ``saturate`` is that loop. The runs carry placeholder
computations: the order looks at their placements and their clients, never at what they
compute, and each part reports the device time it is given to have taken.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping

from pwmesh.core.contract import Received, Send
from pwmesh.errors import InvalidArgument
from pwmesh.scheduler.order import IslandOrder
from pwmesh.scheduler.state import Action, SchedulerState
from pwmesh.wire.messages import Computation, Enqueue, IslandDone, RunPartDone, ScheduleRun, ShardRun
from pwmesh.wire.parts import run_parts

MakeRun = Callable[[str, str, float, int], ScheduleRun]  # (run_id, session, weight, priority) -> the run


def computation(node: int, executor: str, devices: Iterable[int] = (0,)) -> Computation:
    """Node ``node`` on ``devices`` of ``executor``, one shard each: all the order needs of one."""
    return Computation(node=node, fn_id=f"fn{node}", executor_id=executor, control=f"tcp://{executor}:1",
                       runs=[ShardRun(device=d, shard=i) for i, d in enumerate(devices)], inputs=[], outputs=[])


def schedule_run(run_id: str, placements: Iterable[tuple[int, str]], session: str = "s", weight: float = 1.0,
                 priority: int = 0) -> ScheduleRun:
    """A run of ``session`` whose nodes sit at ``placements`` ((node, executor): device 0 of each)."""
    return ScheduleRun(run_id=run_id, proxy="tcp://proxy", parts=run_parts(computation(n, ex) for n, ex in placements),
                       session=session, weight=weight, priority=priority)


def one_device_run(run_id: str, session: str, weight: float, priority: int) -> ScheduleRun:
    """One computation on device 0 of executor ``a``: every client competing for the same device."""
    return schedule_run(run_id, [(0, "a")], session, weight, priority)


def saturate(order: IslandOrder, clients: Mapping[str, tuple[float, int]], steps: int, cost: float = 1.0,
             backlog: int = 4, make_run: MakeRun = one_device_run) -> dict[str, float]:
    """Each client's share of the device time ``order`` hands out while no client ever runs dry.

    ``clients``: session -> (weight, priority). Each starts with ``backlog`` runs waiting
    (``make_run`` builds them; by default all on one device). Each step completes the oldest
    part in flight, taking ``cost`` device-seconds, and a client whose run completes submits
    another, so every client always has work waiting.
    """
    if not clients or steps < 1 or backlog < 1:
        raise InvalidArgument(f"saturate needs clients, steps >= 1 and backlog >= 1 (got {len(clients)} clients, "
                              f"{steps} steps, backlog {backlog})")
    submitted = collections.Counter[str]()
    session_of: dict[str, str] = {}  # run id -> its client, while the run is not done
    parts_left: dict[str, int] = {}  # run id -> parts not yet completed
    executor_of: dict[str, dict[str, str]] = {}  # run id -> control address -> executor id
    in_flight: collections.deque[tuple[str, str]] = collections.deque()  # (run id, executor id), oldest first

    core = SchedulerState(order)  # driven as the daemon drives it

    def send(actions: list[Action]) -> None:
        for a in actions:
            assert isinstance(a, Send), a
            if isinstance(a.message, IslandDone):  # the run's completion, for its proxy: none here
                continue
            assert isinstance(a.message, Enqueue), a
            in_flight.append((a.message.run_id, executor_of[a.message.run_id][a.to]))

    def submit(session: str) -> None:
        weight, priority = clients[session]
        submitted[session] += 1
        run = make_run(f"{session}-{submitted[session]}", session, weight, priority)
        session_of[run.run_id] = session
        parts_left[run.run_id] = len(run.parts)
        executor_of[run.run_id] = {p.control: p.executor_id for p in run.parts}
        send(core.handle(Received(run), 0.0))

    for session in clients:
        for _ in range(backlog):
            submit(session)
    used = collections.defaultdict[str, float](float)  # device-seconds per session
    for _ in range(steps):
        if not in_flight:
            raise RuntimeError("nothing in flight although every client has work waiting: the order stalled")
        run_id, executor = in_flight.popleft()
        session = session_of[run_id]
        used[session] += cost
        parts_left[run_id] -= 1
        if not parts_left[run_id]:
            del parts_left[run_id], session_of[run_id], executor_of[run_id]
            submit(session)  # every client always has work waiting
        send(core.handle(Received(RunPartDone(run_id=run_id, executor_id=executor, device_seconds=cost)), 0.0))
    total = sum(used.values())
    return {s: used[s] / total if total else 0.0 for s in clients}
