"""Completions per island (issue 30, item 2), with the real cores and no sockets.

Executors report a run's completions to their island's scheduler (``NodeDone``, ``RunPartDone``); the
scheduler's core (``scheduler/completions.py`` in ``SchedulerState``) tells the proxy once per run per
island (``IslandDone``), an output early once every executor of the island completed it, and a failure at
once with its ``ErrorInfo`` unchanged; a drained executor's parts not ended fail their runs; frees come as
one ``FreeShards`` per island and leave as one ``DeleteShards`` per executor. Each completion counts once,
however often it is reported.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_proxy_state import CLIENT, SCHEDULER, World, chain

from pwmesh.core.contract import Received, Send
from pwmesh.errors import DeviceLost, PwmeshError
from pwmesh.executor.state import Completed, ExecutorState, Flush, PartEnded
from pwmesh.executor.state import Received as Arrived
from pwmesh.proxy.state import Inbound, Resolve, settled
from pwmesh.proxy.state import Send as ProxySend
from pwmesh.scheduler.order import IslandOrder
from pwmesh.scheduler.state import SchedulerState
from pwmesh.sim.island import schedule_run
from pwmesh.wire.messages import (
    AwaitBuffers,
    DeleteShards,
    Enqueue,
    ErrorInfo,
    ExecutorLost,
    FreeGroup,
    FreeShards,
    InstallTemplate,
    IslandDone,
    NodeDone,
    Ok,
    ProgramInput,
    PutBuffer,
    RegisterProgram,
    RunPartDone,
    RunProgram,
    RunTemplate,
)

pytestmark = pytest.mark.timeout(30)

PROXY = "tcp://proxy"  # where ``schedule_run`` says its runs come from


def scheduler() -> SchedulerState:
    return SchedulerState(IslandOrder(island=0, scheduler=SCHEDULER, window=8))


def told(actions: list[Any]) -> list[IslandDone]:
    """What the scheduler's core tells the proxy among ``actions``."""
    out = [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, IslandDone)]
    assert all(a.to == PROXY for a in actions if isinstance(a, Send) and isinstance(a.message, IslandDone))
    return out


def part_done(core: SchedulerState, run_id: str, executor_id: str) -> list[Any]:
    return core.handle(Received(RunPartDone(run_id=run_id, executor_id=executor_id, device_seconds=0.0)), 0.0)


def node_done(core: SchedulerState, run_id: str, executor_id: str, nodes: list[int],
              error: ErrorInfo | None = None) -> list[Any]:
    return core.handle(Received(NodeDone(run_id=run_id, nodes=nodes, executor_id=executor_id, error=error)), 0.0)


# Node 0 on a, b and c; node 1 (the program's output, say) on a and b; node 2 on c.
PLACEMENTS = [(0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"), (2, "c")]


def started(core: SchedulerState, run_id: str = "r1") -> None:
    enqueues = [a for a in core.handle(Received(schedule_run(run_id, PLACEMENTS)), 0.0)
                if isinstance(a, Send) and isinstance(a.message, Enqueue)]
    assert len(enqueues) == 3


def test_a_run_over_three_executors_is_one_message_to_the_proxy_whatever_is_reported_twice() -> None:
    core = scheduler()
    started(core)
    assert told(part_done(core, "r1", "a")) == []
    assert told(part_done(core, "r1", "a")) == []  # sent twice (a retry): counted once
    assert told(part_done(core, "r1", "b")) == []
    (done,) = told(part_done(core, "r1", "c"))
    assert done == IslandDone(run_id="r1", scheduler=SCHEDULER, nodes=[0, 1, 2])
    # Told once: a report after the run ended (a restarted executor's, a retry) changes nothing.
    assert told(part_done(core, "r1", "c")) == []
    assert told(node_done(core, "r1", "c", [2])) == []
    assert len(core.completions) == 0 and core.order.in_flight == 0


def test_an_output_is_told_early_once_every_executor_of_the_island_completed_it() -> None:
    core = scheduler()
    started(core)
    assert told(node_done(core, "r1", "a", [1])) == []  # b has not completed it yet
    assert told(node_done(core, "r1", "a", [1])) == []  # twice: still once
    # b's part ends (it stands for b's node 1): node 1 is complete on the island, though c still runs.
    (early,) = told(part_done(core, "r1", "b"))
    assert early.nodes == [1] and early.error is None
    assert told(part_done(core, "r1", "a")) == []
    (done,) = told(part_done(core, "r1", "c"))
    assert done.nodes == [0, 2], "what was told early is not told again"


def test_a_failure_reaches_the_proxy_at_once_with_its_cause_and_the_islands_end_still_ends_the_node() -> None:
    core = scheduler()
    started(core)
    cause = ErrorInfo.of(PwmeshError("boom: the function raised ValueError('bad row 3')"))
    (failed,) = told(node_done(core, "r1", "c", [2], error=cause))
    assert failed == IslandDone(run_id="r1", scheduler=SCHEDULER, nodes=[2], executor_id="c", error=cause)
    assert failed.error is cause  # forwarded as the executor sent it
    for ex in ("a", "b"):
        assert told(part_done(core, "r1", ex)) == []
    (done,) = told(part_done(core, "r1", "c"))
    assert done.nodes == [0, 1, 2] and done.error is None


def test_a_drained_executor_that_had_not_ended_its_part_fails_the_run_and_one_that_had_does_not() -> None:
    core = scheduler()
    started(core, "r1")
    started(core, "r2")
    assert told(part_done(core, "r1", "c")) == []  # c ended its part of r1 before it left (a barrier)
    lost = ExecutorLost(executor_id="c", host="host-c", control="tcp://c:1", reason="drained", graceful=True)
    (failed,) = told(core.handle(Received(lost), 0.0))
    assert failed.run_id == "r2" and failed.lost and failed.executor_id == "c" and failed.nodes == [0, 2]
    assert failed.error is not None and failed.error.code == DeviceLost.code
    assert "executor c on host host-c is gone (drained)" in failed.error.message
    # r1 ends with a and b as usual; r2 too (its part on c counts as ended), so no slot stays taken.
    assert told(part_done(core, "r1", "a")) == []
    assert [d.run_id for d in told(part_done(core, "r1", "b"))] == ["r1"]
    assert told(part_done(core, "r2", "a")) == []
    assert [d.run_id for d in told(part_done(core, "r2", "b"))] == ["r2"]
    assert core.order.in_flight == 0 and not core.order.busy
    # A run sequenced for it after it left fails as it is sequenced, and its part there holds no slot: the
    # run ends when a and b have (it held c's slots for good, and the run stayed in flight, before).
    actions = core.handle(Received(schedule_run("r3", PLACEMENTS)), 0.0)
    assert [(d.run_id, d.lost) for d in told(actions)] == [("r3", True)]
    assert all(busy == 1 for busy in core.order.busy.values()) and ("c", 0) not in core.order.busy
    assert told(part_done(core, "r3", "a")) == []
    assert [(d.run_id, d.lost) for d in told(part_done(core, "r3", "b"))] == [("r3", False)]
    assert core.order.in_flight == 0 and not core.order.busy


def test_a_restarted_scheduler_drops_what_executors_report_of_runs_it_never_ordered() -> None:
    core = scheduler()  # a new instance: the runs its predecessor ordered failed with it (SchedulerLost)
    assert part_done(core, "old", "a") == []
    assert node_done(core, "old", "a", [0], error=ErrorInfo.of(PwmeshError("late"))) == []


def test_frees_come_per_island_and_leave_per_executor() -> None:
    core = scheduler()
    free = FreeShards(groups=[FreeGroup(buffers=["s/t1", "s/t2"], controls=["tcp://a:1", "tcp://b:1"]),
                              FreeGroup(buffers=["s/t3"], controls=["tcp://c:1"])])
    actions = core.handle(Received(free), 0.0)
    assert [(a.to, a.message) for a in actions] == [
        ("tcp://a:1", DeleteShards(buffers=["s/t1", "s/t2"])), ("tcp://b:1", DeleteShards(buffers=["s/t1", "s/t2"])),
        ("tcp://c:1", DeleteShards(buffers=["s/t3"]))]


def test_an_executor_reports_to_its_scheduler_and_its_parts_end_stands_for_what_completed_with_it() -> None:
    core = ExecutorState("a")
    enq = Enqueue(run_id="r1", proxy=PROXY, nodes=[0, 1], computations=b"", scheduler=SCHEDULER)
    core.handle(Arrived(enq), 0.0)  # (its computations are not read here)
    core.handle(Flush(), 0.0)  # (its empty part's end: admitting nothing ended it)
    # A quiet node (no program output): nothing sent. An output: after the turn, to the scheduler.
    assert core.handle(Completed("r1", PROXY, 0, quiet=True, scheduler=SCHEDULER), 0.0) == []
    core.handle(Completed("r1", PROXY, 1, scheduler=SCHEDULER), 0.0)
    out = core.handle(Flush(), 0.0)
    assert [(a.to, a.message) for a in out] == [(SCHEDULER, NodeDone(run_id="r1", nodes=[1], executor_id="a"))]
    # The output and the part's end in the same turn: the part's end alone (it stands for both).
    core.handle(Completed("r2", PROXY, 1, scheduler=SCHEDULER), 0.0)
    out = core.handle(PartEnded("r2", SCHEDULER, 0.5), 0.0) + core.handle(Flush(), 0.0)
    assert [(a.to, a.message) for a in out] == [
        (SCHEDULER, RunPartDone(run_id="r2", executor_id="a", device_seconds=0.5))]
    # A failure goes at once, to the scheduler, its cause as it is.
    error = PwmeshError("boom")
    (sent,) = core.handle(Completed("r3", PROXY, 4, error=error, scheduler=SCHEDULER), 0.0)
    assert isinstance(sent, Send) and sent.to == SCHEDULER
    assert sent.message == NodeDone(run_id="r3", nodes=[4], executor_id="a", error=ErrorInfo.of(error))


# ------------------------------------------------------------------ the proxy's side, end to end


def island(world: World, actions: list[Any], core: SchedulerState) -> list[Any]:
    """Hand the scheduler's core what the proxy sent it; every executor's part ends, in the island's order.
    Returns the scheduler's ``IslandDone`` messages for the proxy."""
    released: list[Any] = []
    for action in actions:
        if isinstance(action, ProxySend) and isinstance(action.message, InstallTemplate | RunTemplate):
            assert action.to == SCHEDULER
            released += core.handle(Received(action.message), 0.0)
    reports: list[Any] = []
    while released:
        action = released.pop(0)
        if isinstance(action.message, Enqueue):
            out = part_done(core, action.message.run_id, world.controls[action.to])
            released += [a for a in out if isinstance(a.message, Enqueue)]
            reports += [a.message for a in out if isinstance(a.message, IslandDone)]
    return reports


def test_the_proxy_finishes_a_run_on_the_islands_one_message_and_counts_it_once() -> None:
    world = World()
    sid, slice_id = world.open()
    fns = [world.function(CLIENT, slice_id, name) for name in (b"f", b"g")]
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    assert world.handle(Inbound(CLIENT, RegisterProgram(program_id="p", program=chain(fns, slice_id)))) == []
    core = SchedulerState(IslandOrder(island=0, scheduler=SCHEDULER, window=8))
    core.completions.scheduler = SCHEDULER
    actions = world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[2], program_id="p")))
    wait = world.ask(CLIENT, AwaitBuffers(buffers=[2]))
    (done,) = island(world, actions, core)  # two executors of the island: one message
    assert done.nodes == [0, 1]
    out = world.handle(Inbound(b"scheduler", done))
    assert wait.buffers[0] in [a.buffer for a in out if isinstance(a, Resolve)] and settled(wait.buffers) is None
    assert not world.proxy.runs and any(isinstance(a, ProxySend) and isinstance(a.message, FreeShards) for a in out)
    assert world.handle(Inbound(b"scheduler", done)) == [], "told twice: nothing happens again"


def test_the_proxy_fails_an_output_with_its_cause_and_aborts_a_run_a_drained_executor_left() -> None:
    world = World()
    sid, slice_id = world.open()
    fns = [world.function(CLIENT, slice_id, name) for name in (b"f", b"g")]
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    assert world.handle(Inbound(CLIENT, RegisterProgram(program_id="p", program=chain(fns, slice_id)))) == []
    world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[2], program_id="p")))
    (run_id,) = world.proxy.runs
    wait = world.ask(CLIENT, AwaitBuffers(buffers=[2]))
    cause = ErrorInfo.of(PwmeshError("the function raised ValueError('bad row 3')"))
    world.handle(Inbound(b"scheduler", IslandDone(run_id=run_id, scheduler=SCHEDULER, nodes=[1], executor_id="ex0",
                                                 error=cause)))
    failed = settled(wait.buffers)
    assert failed is not None and "bad row 3" in str(failed)
    # The island's end: the run finishes; the output keeps its failure (its first outcome).
    world.handle(Inbound(b"scheduler", IslandDone(run_id=run_id, scheduler=SCHEDULER, nodes=[0, 1])))
    assert not world.proxy.runs and "bad row 3" in str(settled(wait.buffers))

    world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[3], program_id="p")))
    (run_id,) = world.proxy.runs
    wait = world.ask(CLIENT, AwaitBuffers(buffers=[3]))
    lost = ErrorInfo.of(DeviceLost("executor ex0 on host host0 is gone (drained)"))
    world.handle(Inbound(b"scheduler", IslandDone(run_id=run_id, scheduler=SCHEDULER, nodes=[0, 1], executor_id="ex0",
                                                 error=lost, lost=True)))
    assert not world.proxy.runs
    assert isinstance(settled(wait.buffers), DeviceLost)
