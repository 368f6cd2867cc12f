"""A large run's fan-out tree (issue 30, item 1): the island scheduler sends a run over more than
``$PWMESH_FANOUT`` executors as one ``FanOut`` per subtree head, heads send their children their parts and
send their subtree's completions up as one ``PartsDone``; a head that dies mid-run fails the runs of its
subtree with ``DeviceLost`` naming it, never a hang nor a doubled completion. The cores driven event by
event first, then real daemons (an island of 4 one-device hosts, width 2: two heads of two)."""

from __future__ import annotations

import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pwmesh as pw
from helpers import HEARTBEAT_TIMEOUT_SECONDS, eventually
from pwmesh.cli.commands import debug_events, fetch_status
from pwmesh.core.contract import Received, Send
from pwmesh.executor.fanout import FanOutRelay, split_frees
from pwmesh.scheduler.order import IslandOrder
from pwmesh.scheduler.state import SchedulerState
from pwmesh.scheduler.tree import fanout_width, frees
from pwmesh.sim.island import schedule_run
from pwmesh.wire.messages import (
    DeleteShards,
    Enqueue,
    ErrorInfo,
    ExecutorLost,
    ExecutorRestarting,
    FanOut,
    FanOutFrees,
    IslandDone,
    Message,
    NodeDone,
    PartsDone,
    RunPartDone,
    SubtreeLost,
)

pytestmark = pytest.mark.timeout(240)
EXECUTORS = [f"e{i}" for i in range(7)]


def core(width: int = 2) -> SchedulerState:
    return SchedulerState(IslandOrder(0, scheduler="tcp://sched", window=4), fanout=width)


def run_over_all(state: SchedulerState, run_id: str = "r1") -> list[Send]:
    actions = state.handle(Received(schedule_run(run_id, [(n, ex) for n, ex in enumerate(EXECUTORS)])), 0.0)
    return [a for a in actions if isinstance(a, Send)]


def deliver(relays: dict[str, FanOutRelay], sends: list[tuple[str, Message]], enqueues: dict[str, Enqueue]) -> None:
    """Carry the tree's messages down to every executor (relays at the heads), as a network would."""
    while sends:
        to, message = sends.pop(0)
        ex = to.removeprefix("tcp://").removesuffix(":1")
        if isinstance(message, FanOut):
            own, more = relays.setdefault(ex, FanOutRelay(ex)).fan_out(message)
            enqueues[ex] = own
            sends += more
        else:
            assert isinstance(message, Enqueue)
            enqueues[ex] = message


def test_a_run_wider_than_the_fanout_goes_through_heads_and_its_completions_come_up_as_one_per_head() -> None:
    state = core(2)
    sends = run_over_all(state)
    assert len(sends) == 2 and all(isinstance(s.message, FanOut) for s in sends)  # the scheduler sends 2, not 7
    relays: dict[str, FanOutRelay] = {}
    enqueues: dict[str, Enqueue] = {}
    deliver(relays, [(s.to, s.message) for s in sends], enqueues)
    assert sorted(enqueues) == EXECUTORS
    assert [enqueues[e].executor_seq for e in EXECUTORS] == [0] * 7  # the island's order, as the order made it
    to_scheduler: list[Message] = []

    def report(msg: Message, to: str) -> None:
        if to in ("", "tcp://sched"):
            to_scheduler.append(msg)
            return
        head = to.removeprefix("tcp://").removesuffix(":1")
        for up_to, up in relays[head].handle(msg):
            report(up, up_to)

    for ex in reversed(EXECUTORS):
        report(RunPartDone(run_id="r1", executor_id=ex, device_seconds=1.0), enqueues[ex].report)
    assert len(to_scheduler) == 4  # two heads: their own part's end and their subtree's
    told: list[IslandDone] = []
    for msg in to_scheduler:
        told += [a.message for a in state.handle(Received(msg), 0.0)
                 if isinstance(a, Send) and isinstance(a.message, IslandDone)]
    assert [(t.run_id, t.nodes, t.error) for t in told] == [("r1", list(range(7)), None)]
    assert state.order.in_flight == 0 and not state.trees
    assert sum(u.device_seconds for u in state.order.usage()) == 7.0
    assert not any(len(r) for r in relays.values())


def a_leaf_under_a_head() -> tuple[SchedulerState, dict[str, FanOutRelay], str, str]:
    """A run over every executor, delivered down the tree (width 2): the core, the heads' relays, a leaf that
    reports to a head, and that head."""
    state = core(2)
    relays: dict[str, FanOutRelay] = {}
    enqueues: dict[str, Enqueue] = {}
    deliver(relays, [(s.to, s.message) for s in run_over_all(state)], enqueues)
    leaf = next(e for e in EXECUTORS if enqueues[e].report and e not in relays)
    return state, relays, leaf, enqueues[leaf].report.removeprefix("tcp://").removesuffix(":1")


def test_a_failure_goes_up_at_once_unchanged_and_a_report_sent_twice_counts_once() -> None:
    state, relays, leaf, head = a_leaf_under_a_head()
    error = ErrorInfo(code="internal", message="boom on the leaf")
    (up,) = relays[head].handle(NodeDone(run_id="r1", nodes=[EXECUTORS.index(leaf)], executor_id=leaf, error=error))
    assert isinstance(up[1], PartsDone) and not up[1].last and up[1].reports[0].error == error
    relays[head].handle(RunPartDone(run_id="r1", executor_id=leaf, device_seconds=0.0))
    assert relays[head].handle(RunPartDone(run_id="r1", executor_id=leaf, device_seconds=0.0)) == []  # counted


def test_a_dead_head_fails_its_subtree_naming_it_once_and_frees_the_window() -> None:
    state = core(2)
    sends = run_over_all(state)
    top = [s.message.executors[0] for s in sends if isinstance(s.message, FanOut)]
    gone = top[0]
    actions = state.handle(Received(ExecutorLost(executor_id=gone, control=f"tcp://{gone}:1", host="h", reason="killed")), 0.0)
    told = [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, IslandDone)]
    assert told and all(t.lost and t.error is not None and gone in t.error.message for t in told)
    below = next(s.message for s in sends if isinstance(s.message, FanOut) and s.message.executors[0] == gone)
    assert {n for t in told for n in t.nodes} == {EXECUTORS.index(e) for e in below.executors}
    # The other head's subtree ends as usual; the run is over, nothing told twice.
    other = next(s.message for s in sends if isinstance(s.message, FanOut) and s.message.executors[0] != gone)
    done = state.handle(Received(RunPartDone(run_id="r1", executor_id=other.executors[0], device_seconds=0.0)), 0.0)
    done += state.handle(Received(PartsDone(run_id="r1", head=other.executors[0], ended=other.executors[1:])), 0.0)
    done += state.handle(Received(PartsDone(run_id="r1", head=gone, ended=below.executors[1:])), 0.0)  # late: dropped
    final = [a.message for a in done if isinstance(a, Send) and isinstance(a.message, IslandDone)]
    assert len(final) == 1 and final[0].error is None
    assert state.order.in_flight == 0 and not state.trees


def test_a_dead_leaf_under_a_head_is_asked_of_the_head_and_what_it_had_still_counts() -> None:
    state, relays, leaf, head = a_leaf_under_a_head()
    relays[head].handle(RunPartDone(run_id="r1", executor_id=leaf, device_seconds=1.0))  # it ended, then left
    actions = state.handle(Received(ExecutorLost(executor_id=leaf, control=f"tcp://{leaf}:1", host="h", reason="drained")), 0.0)
    assert not any(isinstance(a, Send) and isinstance(a.message, IslandDone) for a in actions)  # not failed yet
    (ask,) = [a for a in actions if isinstance(a, Send) and isinstance(a.message, SubtreeLost)]
    answer = relays[head].handle(ask.message)
    while answer:  # up the tree to the scheduler
        to, msg = answer.pop(0)
        if to == "tcp://sched":
            acts = state.handle(Received(msg), 0.0)
            assert not any(isinstance(a, Send) and isinstance(a.message, IslandDone) and a.message.error
                           for a in acts), "its end was on its way: the run does not fail"
        else:
            answer += relays[to.removeprefix("tcp://").removesuffix(":1")].handle(msg)


def test_frees_of_many_executors_go_through_heads_and_reach_every_one_once() -> None:
    controls = [f"tcp://e{i}:1" for i in range(23)]
    sends = frees(["o/b1", "o/b2"], controls, 4, last=lambda c: c == "tcp://e0:1")  # e0 is gone: not a head
    assert len(sends) == 4 and "tcp://e0:1" not in [s.to for s in sends if isinstance(s.message, FanOutFrees)]
    reached: list[str] = []
    pending: list[tuple[str, Message]] = [(s.to, s.message) for s in sends]
    while pending:
        to, msg = pending.pop()
        reached.append(to)
        if isinstance(msg, FanOutFrees):
            assert msg.controls[0] == to
            pending += split_frees(msg)
        else:
            assert isinstance(msg, DeleteShards) and msg.buffers == ["o/b1", "o/b2"]
    assert sorted(reached) == sorted(controls)


def test_the_fanout_width_is_checked() -> None:
    assert fanout_width(16) == 16
    with pytest.raises(pw.InvalidArgument):
        fanout_width(1)
    with pytest.raises(pw.InvalidArgument):
        fanout_width("x")


# ------------------------------------------------------------------ real daemons


def _spin(x):
    m = jnp.full((192, 192), 0.01, jnp.float32)
    v = jnp.full((192, 192), 0.5, jnp.float32)
    return x + 0.0 * jax.lax.fori_loop(0, x.astype(jnp.int32)[0], lambda i, a: jnp.tanh(a @ m), v).sum()


# ``leaf`` (~12 s) runs under ``-m long``: the core's test of a dead leaf under a head covers its logic in CI.
@pytest.mark.parametrize("killed", ["head", pytest.param("leaf", marks=pytest.mark.long)])
def test_real_daemons_run_through_a_tree_and_a_killed_head_fails_its_subtrees_runs_naming_it(
        killed: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``head``: the first subtree's head dies while the executor below it computes (the scheduler fails
    the subtree at once); ``leaf``: that executor itself dies (its head is asked, ``SubtreeLost``, and
    answers with what it had)."""
    monkeypatch.setenv("PWMESH_FANOUT", "2")  # 4 executors: two heads of two
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=4, devices_per_host=1,
                               heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_SECONDS)
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address, name="tree") as client:
        sl = client.make_virtual_device_set().add_slice(devices=4)
        hosts = [d.executor for d in sl.devices]
        assert len(set(hosts)) == 4
        step = pw.pmap(_spin, devices=sl)
        ones = np.ones((4, 1))
        for k in range(3):
            np.testing.assert_array_equal(np.asarray(step(ones + k)), ones + k)
        # Frees of buffers on all 4 executors go through the tree (FanOutFrees): each executor drops its shard.
        held = {st.executor_id: st.objects for st in fetch_status(cluster.address).executor_stats}
        out = step(ones)
        np.testing.assert_array_equal(np.asarray(out), ones)
        del out
        eventually(lambda: {st.executor_id: st.objects for st in fetch_status(cluster.address).executor_stats}
                   == held, 30)
        events = debug_events(cluster.address, "scheduler-0", 0)
        assert "parts-done-" in events, "the heads reported their subtrees (PartsDone)"
        # The first head (the slice's first executor) or the executor below it, which computes for seconds, dies.
        work = np.array([[1.0], [3000.0], [1.0], [1.0]])
        outs = [step(work + k) for k in range(2)]
        eventually(lambda: any(s.executor_id == hosts[1] and s.outstanding
                               for s in fetch_status(cluster.address).executor_stats), 30)
        gone = hosts[0] if killed == "head" else hosts[1]
        process = cluster.child(gone).popen
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        for out in outs:
            with pytest.raises(pw.DeviceLost, match=gone):
                np.asarray(out)
        (session,) = [s for s in fetch_status(cluster.address).sessions if s.name == "tree"]
        assert session.programs == 0, "no run is left waiting for a completion"


def test_a_head_restarting_into_a_group_forming_fails_its_subtree_naming_it_but_not_its_own_part() -> None:
    state = core(2)
    sends = run_over_all(state)
    first = next(s.message for s in sends if isinstance(s.message, FanOut))
    head = first.executors[0]
    actions = state.handle(Received(ExecutorRestarting(executor_id=head, control=f"tcp://{head}:1", epoch=3)), 0.0)
    (told,) = [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, IslandDone)]
    assert told.lost and told.executor_id == head and "restarted" in (told.error.message if told.error else "")
    assert set(told.nodes) == {EXECUTORS.index(e) for e in first.executors[1:]}  # its own part goes on
    assert state.completions.running("r1")


# ------------------------------------------------------------------ the simulator


@pytest.mark.parametrize("name", ["chained", "opbyop"])
def test_the_simulator_runs_wide_programs_through_the_same_tree_with_the_same_results(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """20 hosts, width 4: every run goes through heads; it computes what the direct sends do, and the
    scheduler sends at most 4 messages a run and hears 2 per head, not 20 each way."""
    from pwmesh.sim.cluster import SimCluster, SimConfig
    from pwmesh.sim.workloads import Workload, install

    reports = {}
    traffic = {}
    for width in ("4", "1000"):
        monkeypatch.setenv("PWMESH_FANOUT", width)
        cluster = SimCluster(SimConfig(islands=1, hosts_per_island=20, devices_per_host=2))
        install(cluster, Workload(name=name, steps=2, k=4, devices=40, compute_seconds=1e-4))
        reports[width] = cluster.run()
        assert all(c["failure"] is None and c["errors"] == 0 for c in reports[width]["clients"].values())
        (sched,) = [a for a in cluster.network.received if "scheduler" in a]
        traffic[width] = (cluster.network.sent[sched].by_op, cluster.network.received[sched].by_op)
    assert reports["4"]["computations"] == reports["1000"]["computations"] > 0
    sent, received = traffic["4"]
    runs = received["sched.run_template"] + received["sched.schedule_run"]
    assert sent["exec.fan_out"] == 4 * runs and sent["exec.enqueue"] == 0
    assert received["sched.parts_done"] == 4 * runs and received["sched.run_part_done"] == 4 * runs
    # The island's frees of each run's temporaries (on every executor) go through the tree too.
    assert sent["exec.fan_out_frees"] > 0 and sent["exec.delete_shards"] == 0
    direct_sent, direct_received = traffic["1000"]
    assert direct_sent["exec.enqueue"] == 20 * runs and direct_received["sched.run_part_done"] == 20 * runs


def test_the_simulator_can_charge_a_controllers_codec_per_message() -> None:
    """``charge_codec``: each controller daemon's busy time includes the real CPU of decoding what it handles
    and encoding what it sends (its shell's per-message work), counted apart from its core's."""
    from pwmesh.sim.cluster import SimCluster, SimConfig
    from pwmesh.sim.workloads import Workload, install

    cluster = SimCluster(SimConfig(islands=1, hosts_per_island=4, devices_per_host=2, charge_codec=True))
    install(cluster, Workload(name="chained", steps=2, k=4, devices=8, compute_seconds=1e-4))
    report = cluster.run()
    assert all(c["failure"] is None and c["errors"] == 0 for c in report["clients"].values())
    (sched,) = cluster.schedulers
    assert sched.codec_seconds > 0 and cluster.proxy.codec_seconds > 0
    assert sched.cpu_seconds > 0 and sched.busy_seconds >= sched.codec_seconds  # (charge_cpu off: codec alone)
