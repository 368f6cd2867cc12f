"""One core contract (issue #29 item 2) for the resource manager and the island scheduler: one entry,
``handle(event, now) -> actions``; the stimulus id of the event on every action it caused; and a bounded
log of the events (``pwmesh debug events``) that, handed to a fresh core, brings it to the same state
with the same actions: a misbehaviour seen in a daemon can be replayed in a test.

The simulated cluster (``pwmesh.sim``) runs the very cores the daemons run, through the same entry, so
its cores' logs are what a small cluster's daemons keep."""

from __future__ import annotations

from typing import Any

import pytest

from pwmesh.core.contract import EventLog, Received, Reply, Send, replay
from pwmesh.rm.state import Heartbeats, Notify, ResourceManagerState, Tick
from pwmesh.scheduler.group import Form, Formed, IslandGroup
from pwmesh.scheduler.order import IslandOrder
from pwmesh.scheduler.state import SchedulerState
from pwmesh.scheduler.state import Tick as SchedulerTick
from pwmesh.sim.cluster import SimCluster, SimConfig
from pwmesh.sim.island import schedule_run
from pwmesh.sim.workloads import Workload, install
from pwmesh.wire.messages import (
    AllocateSlice,
    ClaimProxy,
    DeviceInfo,
    DrainExecutor,
    Enqueue,
    ExecutorInfo,
    ExecutorJoined,
    ExecutorLost,
    Heartbeat,
    Ok,
    RegisterExecutor,
    RegisterScheduler,
    ReleaseSlices,
    RunPartDone,
    SchedulerInfo,
    SliceAllocated,
    UnregisterExecutor,
    WatchCluster,
)
from pwmesh.wire.schema import Record


def wire(message: Record | None) -> Any:
    """A message (or record) as its bytes would carry it (taken at once: a notice may name a slice that
    changes later)."""
    return None if message is None else (getattr(message, "op", type(message).__name__), message.to_wire())


def outcome(action: Any) -> Any:
    """What an action does, without its stimulus id (a replay numbers its events anew)."""
    match action:
        case Send(to=to, message=message):
            return ("send", to, wire(message))
        case Reply(message=message, error=error):
            return ("reply", wire(message), None if error is None else (type(error).__name__, error.message))
        case Notify(message=message):
            return ("notify", wire(message))
        case Form() | Formed():
            return (type(action).__name__, action.epoch, action.members)
    raise AssertionError(f"unexpected action {action!r}")


def executor(name: str, island: int = 0, devices: int = 2) -> ExecutorInfo:
    return ExecutorInfo(executor_id=name, island=island, host=f"host-{name}", control=f"tcp://{name}:1",
                        data=f"tcp://{name}:2", devices=[DeviceInfo(index=i) for i in range(devices)])


# ------------------------------------------------------------------ the resource manager


def rm_script() -> list[tuple[float, Any]]:
    """A cluster's life: registrations, a watcher, slices, beats, a silent host found lost, a drain."""
    script: list[tuple[float, Any]] = [
        (0.0, Received(RegisterScheduler(info=SchedulerInfo(island=0, address="tcp://sched", name="sched")))),
        *[(0.0, Received(RegisterExecutor(info=executor(f"h{i}")))) for i in range(4)],
        (0.5, Received(WatchCluster(role="proxy", name="proxy"))),
        (0.5, Received(ClaimProxy(name="proxy", address="tcp://proxy"))),
        (1.0, Received(AllocateSlice(owner="alice", devices=4, request="1"))),
        (1.0, Received(AllocateSlice(owner="bob", devices=2))),
    ]
    for t in (2.0, 4.0, 6.0, 8.0):  # h3 stops beating after t = 2
        script += [(t, Received(Heartbeat(role=role, name=name)))
                   for role, name in [("scheduler", "sched"), ("proxy", "proxy"), ("executor", "h0"),
                                      ("executor", "h1"), ("executor", "h2"), ("executor", "h3")]
                   if not (name == "h3" and t > 2.0)]
        script.append((t + 0.5, Tick()))
    script += [
        (12.5, Tick()),  # h3 silent for 10.5 s: lost, its slices remapped
        (13.0, Received(DrainExecutor(executor="h2", request="d1"))),
        (13.5, Received(AllocateSlice(owner="carol", devices=99))),  # refused: an error is an outcome too
        (14.0, Received(ReleaseSlices(owner="alice", requests=["1"]))),
        (14.5, Received(UnregisterExecutor(executor_id="h2", reason="drained"))),
        (15.0, Received(RegisterExecutor(info=executor("h3")))),  # back, as a new registration
    ]
    return script


def run_rm(script: list[tuple[float, Any]]) -> tuple[ResourceManagerState, list[list[Any]]]:
    core = ResourceManagerState(heartbeat_timeout_seconds=10.0, first_slice_id=100)
    return core, [[outcome(a) for a in core.handle(event, now)] for now, event in script]


def test_every_rm_action_carries_the_id_of_the_event_that_caused_it() -> None:
    core, _ = run_rm(rm_script()[:7])
    actions = core.handle(Received(AllocateSlice(owner="dave", devices=1)), 2.0)
    (reply,) = actions
    assert isinstance(reply, Reply) and isinstance(reply.message, SliceAllocated)
    (line,) = [line for line in core.events.lines() if f" {reply.stimulus} " in line]
    assert reply.stimulus.startswith("rm.allocate_slice-") and "Received(message=rm.allocate_slice" in line
    # A loss found by a tick: its notice carries the tick's id, which the log shows.
    lost = core.handle(Tick(), 30.0)
    assert lost and all(isinstance(a, Notify) and a.stimulus == lost[0].stimulus for a in lost)
    assert lost[0].stimulus.startswith("tick-") and any(f" {lost[0].stimulus} Tick()" in line
                                                        for line in core.events.lines())


def test_heartbeats_in_a_row_are_one_entry_of_the_latest_beats() -> None:
    core = ResourceManagerState()
    core.handle(Received(RegisterExecutor(info=executor("a"))), 0.0)
    for t in range(1, 50):
        for name in ("a", "b"):
            reply = core.handle(Received(Heartbeat(role="executor", name=name)), float(t))
            assert [type(r) for r in reply] == [Reply]
    core.handle(Tick(), 50.0)  # nobody silent: it changed nothing, and is not kept
    _, beats = core.events.events()
    assert isinstance(beats, Heartbeats) and beats.latest == {("executor", "a"): 49.0, ("executor", "b"): 49.0}
    assert len(core.events.entries) == 2, "a registration, then one entry for 98 heartbeats"


def test_the_rm_log_replays_into_the_same_state_and_actions() -> None:
    """A fresh core handed the log (``EventLog.timed``) ends where the original did, having said the same:
    the notices to watchers, the replies, the errors, the remaps."""
    script = rm_script()
    core, said = run_rm(script)
    assert any(o[0] == "notify" and o[1][0] == "rm.executor_lost" for out in said for o in out), "h3 was lost"
    assert any(o[0] == "reply" and o[2] is not None for out in said for o in out), "one request was refused"
    fresh = ResourceManagerState(heartbeat_timeout_seconds=10.0, first_slice_id=100)
    again = replay(lambda event, now: [outcome(a) for a in fresh.handle(event, now)], core.events.timed())
    assert wire(fresh.snapshot()) == wire(core.snapshot())

    def not_beats(outcomes: list[list[Any]], events: list[tuple[float, Any]]) -> list[Any]:
        return [o for out, (_, e) in zip(outcomes, events, strict=True)
                if not (isinstance(e, Received) and isinstance(e.message, Heartbeat)) for o in out]

    assert not_beats(again, core.events.timed()) == not_beats(said, script)
    assert (fresh.executors_lost, fresh.executors_left, fresh.heartbeat_misses) == \
        (core.executors_lost, core.executors_left, core.heartbeat_misses)


def test_what_the_rm_keeps_of_a_request_does_not_change_in_its_log() -> None:
    """The state keeps (and changes) an executor's info: the log holds it as it arrived."""
    core = ResourceManagerState()
    info = executor("a")
    core.handle(Received(RegisterExecutor(info=info)), 0.0)
    core.handle(Received(UnregisterExecutor(executor_id="a", reason="gone")), 1.0)
    assert not core.executors["a"].alive
    logged, _ = core.events.events()
    assert logged.message.info.alive, "logged as it arrived"


# ------------------------------------------------------------------ the island scheduler


def scheduler(epoch: str = "e1", group: bool = True) -> SchedulerState:
    return SchedulerState(IslandOrder(0, window=1, scheduler="tcp://sched", epoch=epoch),
                          IslandGroup() if group else None)


def joined(name: str, epoch: int = 0, fresh: bool = False) -> Received:
    return Received(ExecutorJoined(executor_id=name, control=f"tcp://{name}:1", island=0, group="g",
                                   group_epoch=epoch, fresh=fresh))


def done(run_id: str, name: str, seconds: float = 1.0) -> Received:
    return Received(RunPartDone(run_id=run_id, executor_id=name, device_seconds=seconds))


def scheduler_script() -> list[tuple[float, Any]]:
    """Two executors join and form a group (the work meanwhile held), runs from two clients contend for a
    window of one, an executor is lost mid-run and the group forms again without it."""
    return [
        (0.0, joined("a")), (0.1, joined("b")),
        (0.2, Received(schedule_run("r1", [(0, "a"), (1, "b")], session="s1"))),  # held: the group forms
        (0.3, SchedulerTick()),  # not settled yet: nothing
        (0.7, SchedulerTick()),  # settled: forming 1
        (0.8, Received(schedule_run("r2", [(0, "a")], session="s2"))),
        (1.0, joined("a", 1)), (1.1, joined("b", 1)),  # both in forming 1: formed, the held work leaves
        (1.2, Received(schedule_run("r3", [(0, "a")], session="s1"))),
        (1.3, done("r1", "a", 2.0)),
        (1.4, done("r1", "b", 2.0)),
        (1.5, Received(ExecutorLost(executor_id="a", host="a", control="tcp://a:1", reason="gone"))),
        (2.5, SchedulerTick()),  # forming 2, of b alone
        (2.6, joined("b", 2)),
        (2.7, Received(schedule_run("r4", [(0, "b")], session="s2"))),
    ]


def test_a_scheduler_holds_the_island_s_work_while_its_group_forms_and_ties_actions_to_events() -> None:
    core = scheduler()
    out = {i: core.handle(event, now) for i, (now, event) in enumerate(scheduler_script()[:8])}
    assert out[2] == [] and out[3] == [], "held while the group forms"
    (form,) = out[4]
    assert isinstance(form, Form) and form.members == ("a", "b") and form.stimulus.startswith("tick-")
    assert core.controls == {"a": "tcp://a:1", "b": "tcp://b:1"}
    formed, *sends = out[7]
    assert isinstance(formed, Formed) and formed.stimulus.startswith("joined-")
    assert [(s.to, s.message.run_id) for s in sends if isinstance(s.message, Enqueue)] == \
        [("tcp://a:1", "r1"), ("tcp://b:1", "r1")], "r1 leaves once formed; r2 waits for a's window"
    # Sequenced when r1 arrived, sent once formed: each names the ScheduleRun it was made for.
    assert all(s.stimulus == "schedule-3" for s in sends)
    assert any(" schedule-3 Received(message=sched.schedule_run(run_id='r1'" in line for line in core.events.lines())
    released = core.handle(done("r1", "a"), 3.0)
    (line,) = [line for line in core.events.lines() if f" {released[0].stimulus} " in line]
    assert "Received(message=sched.run_part_done(run_id='r1'" in line


def test_a_scheduler_refuses_a_run_it_cannot_place_and_goes_on() -> None:
    core = scheduler(group=False)
    bad = schedule_run("bad", [(0, "a")])
    bad.parts[0].devices[0].count = 0
    (refused,) = core.handle(Received(bad), 0.0)
    assert isinstance(refused, Reply) and refused.error is not None and "bad" in refused.error.message
    assert [type(a) for a in core.handle(Received(schedule_run("ok", [(0, "a")])), 0.0)] == [Send]


def test_the_scheduler_log_replays_into_the_same_order() -> None:
    script = scheduler_script()
    core = scheduler()
    said = [outcome(a) for now, event in script for a in core.handle(event, now)]
    assert len(core.events.entries) == len(script) - 1, "the tick that did nothing is not kept"
    fresh = scheduler()
    again = [o for out in replay(lambda event, now: [outcome(a) for a in fresh.handle(event, now)],
                                 core.events.timed()) for o in out]
    assert again == said
    assert list(fresh.order.history) == list(core.order.history) and fresh.order.next_seq == core.order.next_seq
    assert fresh.order.usage() == core.order.usage() and fresh.group is not None and core.group is not None
    assert (fresh.group.formed, fresh.group.formed_epoch) == (core.group.formed, core.group.formed_epoch)


def test_a_large_run_is_logged_as_a_line_and_refused_to_replay() -> None:
    core = scheduler(group=False)
    big = schedule_run("big", [(n, "a") for n in range(3000)])
    assert sum(len(p.computations) for p in big.parts) > 64 << 10
    core.handle(Received(big), 0.0)
    (logged,) = core.events.events()
    assert isinstance(logged, str) and "run_id='big'" in logged
    with pytest.raises(ValueError, match="logged as a line"):
        replay(scheduler(group=False).handle, core.events.timed())


# ------------------------------------------------------------------ a small cluster's logs


def test_a_simulated_cluster_s_logs_replay_into_fresh_cores() -> None:
    """The simulator's RM and schedulers are the daemons' cores behind its shells: after a workload of two
    clients, each core's log, replayed into a fresh core, rebuilds the same map and the same island order."""
    sim = SimCluster(SimConfig(islands=2, hosts_per_island=2, devices_per_host=2))
    install(sim, Workload(name="clients", clients=2, devices=4, backlog=2, duration_seconds=0.01))
    report = sim.run()
    assert all(c["failure"] is None and c["errors"] == 0 for c in report["clients"].values()), report["clients"]
    assert sim.schedulers[0].order.next_seq > 10, "the island's order was busy"
    rm = ResourceManagerState()
    replay(rm.handle, sim.rm.state.events.timed())
    assert wire(rm.snapshot()) == wire(sim.rm.state.snapshot())
    for shell in sim.schedulers:
        kept = shell.state
        fresh = SchedulerState(IslandOrder(kept.island, policy=kept.order.policy, window=kept.order.window,
                                           scheduler=kept.order.scheduler, epoch=kept.order.epoch))
        replay(fresh.handle, kept.events.timed())
        assert list(fresh.order.history) == list(kept.order.history)
        assert fresh.order.usage() == kept.order.usage() and fresh.order.in_flight == kept.order.in_flight


def test_an_event_log_refuses_to_replay_a_line() -> None:
    log = EventLog()
    log.record(0.0, "x-1", "a line", 0)
    with pytest.raises(ValueError, match="a line"):
        replay(lambda event, now: [], log.timed())
    assert replay(lambda event, now: [Ok()], [(0.0, object())]) == [[Ok()]]


# ------------------------------------------------------------------ from a real daemon's dump


@pytest.mark.timeout(120)
def test_a_resource_managers_dumped_events_replay_into_the_cluster_it_holds(tmp_path: Any) -> None:
    """``pwmesh debug events rm --raw FILE`` on a real cluster: the events, replayed into a fresh core,
    rebuild the map the running resource manager answers with (executors, slices and their owners)."""
    import numpy as np  # noqa: PLC0415

    import pwmesh as pw  # noqa: PLC0415
    from pwmesh.cli.commands import debug_events, fetch_status, load_events  # noqa: PLC0415
    from pwmesh.core.contract import recorded  # noqa: PLC0415

    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=1, heartbeat_timeout_seconds=5.0)
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address) as client:
        devs = client.make_virtual_device_set()
        kept, dropped = devs.add_slice(devices=2), devs.add_slice(devices=1)
        assert float(np.asarray(pw.pmap(lambda x: x + 1.0, devices=kept)(np.zeros((2, 1), np.float32))).sum()) == 2.0
        del dropped
        live = fetch_status(cluster.address).cluster
        path = tmp_path / "rm-events.msgpack"
        debug_events(cluster.address, "rm", 0, raw=str(path))
    events = recorded(load_events(str(path)), kinds=[Tick])
    assert any(isinstance(e, Received) and isinstance(e.message, RegisterExecutor) for _, e in events)
    fresh = ResourceManagerState(heartbeat_timeout_seconds=5.0,
                                 first_slice_id=min(s.slice_id for s in live.slices))
    replay(fresh.handle, events)
    again = fresh.snapshot()

    def held(state: Any) -> Any:
        return (sorted((e.executor_id, e.alive) for e in state.executors),
                sorted((s.slice_id, s.owner, [d.executor_id for d in s.devices]) for s in state.slices))

    assert held(again) == held(live)
