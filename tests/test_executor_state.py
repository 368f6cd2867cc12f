"""The executor's pure core (``pwmesh/executor/state.py``), driven by events alone: no JAX, no sockets, no
loop. Admission in the island's order, cancelled and reclaimed runs, completions batched as the daemon
and the simulator send them, and the event log a misbehaviour can be replayed from."""

from __future__ import annotations

from pwmesh.core.contract import Send, Timer
from pwmesh.errors import PwmeshError, Unavailable
from pwmesh.executor.state import (
    Admit,
    Cancelled,
    CancelWork,
    Completed,
    ExecutorState,
    Flush,
    Forgotten,
    Leaving,
    PartEnded,
    Received,
    Reclaimed,
    StartedOver,
)
from pwmesh.wire.messages import Computation, Enqueue, NodeDone, RunPartDone, ShardRun
from pwmesh.wire.parts import run_parts


def enqueue(run_id: str, seq: int, *, scheduler: str = "sched", epoch: str = "e1", nodes: int = 1) -> Enqueue:
    (part,) = run_parts([Computation(node=n, fn_id="f", executor_id="x", control="c", runs=[ShardRun(device=0, shard=0)],
                                     inputs=[], outputs=[f"o{n}"]) for n in range(nodes)])
    return Enqueue(run_id=run_id, proxy="proxy", scheduler=scheduler, epoch=epoch, executor_seq=seq,
                   nodes=part.nodes, computations=part.computations)


def admitted(actions: list) -> list[str]:
    return [a.message.run_id for a in actions if isinstance(a, Admit)]


def sent(actions: list) -> list:
    return [a.message for a in actions if isinstance(a, Send)]


def test_enqueues_are_admitted_in_the_islands_order_whatever_order_they_arrive_in() -> None:
    core = ExecutorState("x")
    assert admitted(core.handle(Received(enqueue("r2", 2)), 0.0)) == []
    assert admitted(core.handle(Received(enqueue("r1", 1)), 0.0)) == []
    assert admitted(core.handle(Received(enqueue("r0", 0)), 0.0)) == ["r0", "r1", "r2"]
    # A restarted scheduler (a new epoch) is a new source: it counts from 0 again.
    assert admitted(core.handle(Received(enqueue("n0", 0, epoch="e2")), 0.0)) == ["n0"]
    assert core.expected_seq() == {"sched|e1": 3, "sched|e2": 1}


def test_an_executor_that_starts_over_admits_from_zero_again() -> None:
    core = ExecutorState("x")
    core.handle(Received(enqueue("r0", 0)), 0.0)
    core.handle(Received(enqueue("r5", 5)), 0.0)  # held: 1..4 never come (their scheduler forgot them)
    core.handle(StartedOver(), 1.0)
    assert admitted(core.handle(Received(enqueue("s0", 0)), 2.0)) == ["s0"]


def test_a_cancelled_run_fails_its_work_here_and_what_of_it_arrives_later_at_once() -> None:
    core = ExecutorState("x")
    err = Unavailable("peer lost")
    (cancel,) = core.handle(Cancelled("r0", err), 0.0)
    assert isinstance(cancel, CancelWork) and cancel.run_id == "r0" and cancel.error is err
    actions = core.handle(Received(enqueue("r0", 0, nodes=2)), 0.0)
    assert admitted(actions) == []
    (done,) = sent(actions)
    assert isinstance(done, NodeDone) and done.nodes == [0, 1] and done.error is not None
    assert done.error.code == Unavailable.code and "peer lost" in done.error.message
    (part,) = sent(core.handle(Flush(), 0.0))  # after this instant's replies
    assert isinstance(part, RunPartDone) and part.run_id == "r0"  # the scheduler's window slot comes back
    # A node it dispatched one by one (``r0#1``) is the same run.
    assert admitted(core.handle(Received(enqueue("r0#1", -1)), 0.0)) == []


def test_runs_of_a_proxy_before_a_restart_fail_and_the_new_proxys_go_on() -> None:
    core = ExecutorState("x")
    core.handle(Reclaimed("s1", "r1a.", Unavailable("the proxy restarted")), 0.0)
    assert core.old_run("s1:0-abcd") is not None
    assert core.old_run("s1:r1a.0-abcd") is None  # named by the new proxy
    assert core.old_run("s2:0-abcd") is None  # another session
    assert admitted(core.handle(Received(enqueue("s1:0-abcd", -1)), 0.0)) == []
    assert admitted(core.handle(Received(enqueue("s1:r1a.0-abcd", -1)), 0.0)) == ["s1:r1a.0-abcd"]
    core.handle(Forgotten("s1"), 0.0)
    assert core.old_run("s1:0-abcd") is None


def test_completions_leave_together_after_the_instant_and_the_part_after_them() -> None:
    core = ExecutorState("x")
    first = core.handle(Completed("r", "proxy", 0), 0.0)
    assert first == [Timer(0.0, Flush(), first[0].stimulus)]  # one flush asked for the instant
    assert core.handle(Completed("r", "proxy", 1), 0.0) == []
    assert core.handle(PartEnded("r", "sched", 2.5), 0.0) == []  # waits behind the completions
    done, part = sent(core.handle(Flush(), 0.0))
    assert isinstance(done, NodeDone) and done.nodes == [0, 1] and done.error is None
    assert isinstance(part, RunPartDone) and part.device_seconds == 2.5


def test_a_failure_is_reported_at_once_and_quiet_nodes_go_with_their_parts_end() -> None:
    core = ExecutorState("x")
    (failed,) = sent(core.handle(Completed("r", "proxy", 3, error=PwmeshError("boom")), 0.0))
    assert failed.nodes == [3] and failed.error.message == "boom"
    assert core.handle(Completed("r", "proxy", 4, quiet=True), 0.0) == []  # nobody outside the run waits
    actions = core.handle(PartEnded("r", "sched", 0.0), 0.0)
    assert [type(a) for a in actions] == [Timer]  # its quiet completion now leaves, the part after it
    done, part = sent(core.handle(Flush(), 0.0))
    assert done.nodes == [4] and isinstance(part, RunPartDone)


def test_leaving_sends_every_completion_held_quiet_ones_too() -> None:
    core = ExecutorState("x")
    core.handle(Completed("r", "proxy", 1, quiet=True), 0.0)
    core.handle(Completed("q", "proxy", 2), 0.0)
    messages = sent(core.handle(Leaving(), 0.0))
    assert sorted((m.run_id, m.nodes) for m in messages) == [("q", [2]), ("r", [1])]


def test_the_event_log_replays_into_the_same_decisions() -> None:
    """``pwmesh debug events`` dumps a core's latest events; handed to a fresh core, they make the same
    actions: a misbehaviour seen in a daemon can be replayed in a test."""
    core = ExecutorState("x")
    script = [Received(enqueue("r1", 1)), Cancelled("r9", PwmeshError("gone")), Received(enqueue("r0", 0, nodes=3)),
              Completed("r0", "proxy", 0), Completed("r0", "proxy", 1, quiet=True), Completed("r0", "proxy", 2),
              PartEnded("r0", "sched", 1.0), Flush(), Received(enqueue("r9", 2))]
    first = [core.handle(event, float(t)) for t, event in enumerate(script)]
    assert core.events is not None and core.events.events() == script
    assert len(core.events.entries) == len(script) - 2, "a run's successive completions are one entry"
    lines = core.events.lines()
    assert lines[0].startswith("0.000000 enqueue-1 Received(message=exec.enqueue(run_id='r1'")
    again = ExecutorState("x")
    replayed = [again.handle(event, float(t)) for t, event in enumerate(core.events.events())]
    strip = [[type(a).__name__ + repr(getattr(a, "message", getattr(a, "run_id", ""))) for a in acts]
             for acts in first]
    assert strip == [[type(a).__name__ + repr(getattr(a, "message", getattr(a, "run_id", ""))) for a in acts]
                     for acts in replayed]


def test_the_event_log_keeps_no_large_part() -> None:
    """A big program's part (hundreds of KiB) is logged as a line: 2,000 of them kept would hold gigabytes."""
    core = ExecutorState("x")
    big = enqueue("big", 0, nodes=3000)
    assert len(big.computations) > 64 << 10
    core.handle(Received(big), 0.0)
    core.handle(Received(enqueue("small", 1)), 0.0)
    assert core.events is not None
    logged, small = core.events.events()
    assert isinstance(logged, str) and "run_id='big'" in logged
    assert isinstance(small, Received)
