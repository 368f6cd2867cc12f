"""A large run's fan-out tree (issue 30, item 1): the island scheduler sends a run over more than
``$PWMESH_FANOUT`` executors as one ``FanOut`` per subtree head, heads send their children their parts and
send their subtree's completions up as one ``PartsDone``; a head that dies mid-run fails the runs of its
subtree with ``DeviceLost`` naming it, never a hang nor a doubled completion. The cores driven event by
event first, then real daemons (an island of 4 one-device hosts, width 2: two heads of two)."""

from __future__ import annotations

import dataclasses
import signal

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest

import pwmesh as pw
from helpers import HEARTBEAT_TIMEOUT_SECONDS, eventually
from pwmesh.cli.commands import debug_events, fetch_status
from pwmesh.core.contract import Received, Send
from pwmesh.errors import ProtocolError
from pwmesh.executor.fanout import FanOutRelay, split_frees
from pwmesh.scheduler.order import IslandOrder
from pwmesh.scheduler.state import SchedulerState
from pwmesh.scheduler.tree import fanout_width, frees
from pwmesh.sim.island import schedule_run
from pwmesh.wire import Envelope, decode, encode
from pwmesh.wire.codec import FrameError
from pwmesh.wire.messages import (
    DeleteShards,
    Enqueue,
    ErrorInfo,
    ExecutorLost,
    ExecutorRestarting,
    FanOut,
    FanOutFrees,
    InstallTemplate,
    IslandDone,
    Message,
    NodeDone,
    PartsDone,
    RunPartDone,
    RunTemplate,
    SubtreeLost,
    TemplateRun,
    enqueue_body,
    packed,
)

pytestmark = pytest.mark.timeout(240)
EXECUTORS = [f"e{i}" for i in range(7)]


def core(width: int = 2) -> SchedulerState:
    return SchedulerState(IslandOrder(0, scheduler="tcp://sched", window=4), fanout=width, above=width)


def run_over_all(state: SchedulerState, run_id: str = "r1") -> list[Send]:
    actions = state.handle(Received(schedule_run(run_id, [(n, ex) for n, ex in enumerate(EXECUTORS)])), 0.0)
    return [a for a in actions if isinstance(a, Send)]


def wire(message: Message) -> Message:
    """``message`` as its receiver gets it: encoded, then decoded (a ``FanOut``'s parts become bodies)."""
    return decode(encode(message, msg_id=1)).message


def deliver(relays: dict[str, FanOutRelay], sends: list[tuple[str, Message]], enqueues: dict[str, Enqueue],
            out: list[tuple[str, Message]] | None = None) -> None:
    """Carry the tree's messages down to every executor (relays at the heads), through the codec, as a
    network would; what goes elsewhere (a part's failure) is added to ``out``."""
    while sends:
        to, message = sends.pop(0)
        message = wire(message)
        ex = to.removeprefix("tcp://").removesuffix(":1")
        if isinstance(message, FanOut):
            own, more = relays.setdefault(ex, FanOutRelay(ex)).fan_out(message)
            if own is not None:
                enqueues[ex] = own
            sends += [(t, m) for t, m in more if isinstance(m, FanOut)]
            if out is not None:
                out += [(t, m) for t, m in more if not isinstance(m, FanOut)]
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

    heads = {ex for ex, relay in relays.items() if relay.control}
    assert {ex for ex in EXECUTORS if enqueues[ex].report == f"tcp://{ex}:1"} == heads == {"e0", "e3", "e5"}, \
        "a head's own part reports to the head itself"
    for ex in reversed(EXECUTORS):
        report(RunPartDone(run_id="r1", executor_id=ex, device_seconds=1.0), enqueues[ex].report)
    # One message per top-level head, its own part's end in it.
    assert [(m.head, sorted(m.ended)) for m in to_scheduler if isinstance(m, PartsDone)] == \
        [("e3", ["e3", "e4", "e5", "e6"]), ("e0", ["e0", "e1", "e2"])]
    assert len(to_scheduler) == 2
    told: list[IslandDone] = []
    for msg in to_scheduler:
        told += [a.message for a in state.handle(Received(msg), 0.0)
                 if isinstance(a, Send) and isinstance(a.message, IslandDone)]
    assert [(t.run_id, t.nodes, t.error) for t in told] == [("r1", list(range(7)), None)]
    assert state.order.in_flight == 0 and not state.trees
    assert sum(u.device_seconds for u in state.order.usage()) == 7.0
    assert not any(len(r) for r in relays.values())


def test_parts_travel_as_the_bodies_the_scheduler_encoded_once_and_heads_forward_them_unread() -> None:
    """Each part crosses the wire as its Enqueue's body: it decodes to the Enqueue the order made, and a
    head's children get the very bytes it received (sliced, never decoded nor re-encoded there)."""
    state = core(2)
    sends = run_over_all(state)
    made = {ex: p for s in sends if isinstance(s.message, FanOut)
            for ex, p in zip(s.message.executors, s.message.parts, strict=True)}
    assert sorted(made) == EXECUTORS
    for send in sends:
        sent = wire(send.message)
        assert isinstance(sent, FanOut) and not sent.parts and sent.count() == len(sent.executors)
        assert [enqueue_body(b) for b in sent.bodies] == [made[ex] for ex in sent.executors]
        head = sent.executors[0]
        own, more = FanOutRelay(head).fan_out(sent)
        assert own == dataclasses.replace(made[head], report=sent.controls[0])  # (a head's own part reports to it)
        children = [m for _, m in more]
        assert all(isinstance(m, FanOut) and m.parent == sent.controls[0] for m in children)
        # Every child's bytes are the head's own slice of what it received: the same objects, unread.
        carried = [b for m in children if isinstance(m, FanOut) for b in m.bodies]
        assert len(carried) == len(sent.bodies) - 1
        assert all(a is b for a, b in zip(carried, sent.bodies[1:], strict=True))


def test_a_warm_template_run_goes_down_the_tree_as_one_message_per_subtree_and_heads_expand_its_parts() -> None:
    """Once every executor holds its part of a template, a run of it is one ``FanOut`` per top-level subtree
    whose parts are said together (``TemplateRun``: the run's fields once, per part its nodes, places and
    ``executor_seq``): no body per executor. Each executor, down the tree, gets the ``Enqueue`` the island's
    order makes: its template, the run's names, its places in the run, its own running count, and where to
    report (its head; "": the scheduler)."""
    state = core(2)
    placements = [(n, ex) for n, ex in enumerate(EXECUTORS)] + [(7, "e3"), (8, "e5")]
    parts = schedule_run("x", placements).parts
    for p in parts:
        p.refs = [0]
    state.handle(Received(InstallTemplate(template_id="t", parts=parts)), 0.0)
    sent_by_run: list[list[Send]] = []
    for k in range(3):
        actions = state.handle(Received(RunTemplate(template_id="t", run_id=f"r{k}", proxy="tcp://proxy",
                                                    names=[f"b{k}"], session="s")), 0.0)
        sent_by_run.append([a for a in actions if isinstance(a, Send)])
        for ex in EXECUTORS:  # each part ends (its head relays aside: the core alone here)
            state.handle(Received(RunPartDone(run_id=f"r{k}", executor_id=ex, device_seconds=0.0)), 0.0)
    first, *warm = sent_by_run
    assert all(isinstance(s.message, FanOut) and s.message.run is None for s in first)  # parts go as bodies once
    for k, sends in enumerate(warm, start=1):
        assert len(sends) == 2 and all(isinstance(s.message, FanOut) and s.message.run is not None
                                       and not s.message.bodies for s in sends)
        relays: dict[str, FanOutRelay] = {}
        enqueues: dict[str, Enqueue] = {}
        deliver(relays, [(s.to, s.message) for s in sends], enqueues)
        assert sorted(enqueues) == EXECUTORS
        seqs = [q for ex in EXECUTORS for q in enqueues[ex].seqs]
        assert seqs == list(range(9 * k, 9 * k + 9)), "the run's places, in the island's order"
        for ex, part in zip(EXECUTORS, parts, strict=True):
            got = enqueues[ex]
            assert (got.run_id, got.template, got.names, got.nodes, got.executor_seq, got.computations, got.refs) == \
                (f"r{k}", "t", [f"b{k}"], part.nodes, k, b"", [])
        heads = {s.message.executors[0] for s in sends if isinstance(s.message, FanOut)}
        assert all(enqueues[h].report == f"tcp://{h}:1" for h in heads)  # to its own relay
        assert all(enqueues[ex].report.startswith("tcp://e") for ex in EXECUTORS if ex not in heads)
        # A head expects each child's report: the relay waits on the run as for bodies.
        assert all(len(r) == 1 for r in relays.values() if r.name in heads)


def test_a_fanout_whose_parts_said_together_do_not_line_up_is_refused_whole() -> None:
    run = TemplateRun(proxy="p", names=["b"], scheduler="tcp://sched", epoch="e", template="t", seq=5,
                      counts=packed([1, 2, 1]), nodes=packed([0, 1, 2, 3]), executor_seqs=packed([4, 0]))
    fan = FanOut(run_id="r", parent="tcp://sched", bodies=[], executors=["e0", "e1", "e2"],
                 controls=["tcp://e0:1", "tcp://e1:1", "tcp://e2:1"], sizes=[3, 1, 1], run=run)
    with pytest.raises(ProtocolError, match="16 of executor_seqs"):
        FanOutRelay("e0").fan_out(wire(fan))
    run.executor_seqs = packed([4, 0, 9])
    run.nodes = packed([0, 1, 2])
    with pytest.raises(ProtocolError, match="counts of 4 nodes and 24 bytes of nodes"):
        FanOutRelay("e0").fan_out(wire(fan))
    run.nodes = packed([0, 1, 2, 3])
    both = FanOut(run_id="r", parent="tcp://sched", bodies=[b"x", b"y", b"z"], executors=fan.executors,
                  controls=fan.controls, sizes=fan.sizes, run=run)
    with pytest.raises(ProtocolError, match="3 bodies as well"):
        FanOutRelay("e0").fan_out(wire(both))
    own, more = FanOutRelay("e0").fan_out(wire(fan))
    assert own is not None and (own.nodes, own.seqs, own.executor_seq, own.report) == ([0], [5], 4, "tcp://e0:1")
    cut = [(to, m.run.seq, m.run.unpacked()) for to, m in more if isinstance(m, FanOut) and m.run]
    assert cut == [("tcp://e1:1", 6, ([[1, 2]], [0])), ("tcp://e2:1", 8, ([[3]], [9]))]


def test_a_part_that_does_not_decode_fails_that_part_alone_with_the_codecs_error() -> None:
    """A malformed body (the bytes a head forwards unread): the head and the other parts go on; the child
    it was for (a head itself) fails its own part (NodeDone with the error, then RunPartDone, to its own
    relay: the error goes up at once), still relays its own children's, and the run ends with that error,
    once, no hang."""
    state = core(2)
    sends = run_over_all(state)
    # A head below a top-level one (width 2: 7 = (1 + 2 leaves) + (1 + a leaf + (1 + a leaf))).
    k, i = next((k, i) for k, s in enumerate(sends) if isinstance(s.message, FanOut)
                for i, size in enumerate(s.message.sizes) if i > 0 and size > 1)
    first = wire(sends[k].message)
    assert isinstance(first, FanOut)
    victim = first.executors[i]
    first.bodies[i] = b"\x81\xa6run_id\xc1"  # a map whose value is a byte msgpack never writes
    relays: dict[str, FanOutRelay] = {}
    enqueues: dict[str, Enqueue] = {}
    failed: list[tuple[str, Message]] = []
    deliver(relays, [(s.to, first if j == k else s.message) for j, s in enumerate(sends)], enqueues, failed)
    assert sorted(enqueues) == sorted(set(EXECUTORS) - {victim})  # every other part arrived, the head's too
    ((up, to),) = [(m, t) for t, m in failed]  # its failure, up at once to its head (a child of the top)
    assert to == first.controls[0] and isinstance(up, PartsDone) and up.head == victim and not up.last
    (node_done,) = up.reports
    assert isinstance(node_done, NodeDone) and node_done.executor_id == victim and node_done.error is not None
    assert "unreadable" in node_done.error.message and victim in node_done.error.message
    to_scheduler: list[Message] = []

    def report(msg: Message, to: str) -> None:
        if to in ("", "tcp://sched"):
            to_scheduler.append(msg)
            return
        for up_to, up in relays[to.removeprefix("tcp://").removesuffix(":1")].handle(msg):
            report(up, up_to)

    report(up, to)
    for ex, enqueue in enqueues.items():
        report(RunPartDone(run_id="r1", executor_id=ex, device_seconds=0.0), enqueue.report)
    told = [a.message for msg in to_scheduler for a in state.handle(Received(msg), 0.0)
            if isinstance(a, Send) and isinstance(a.message, IslandDone)]
    errors = [t for t in told if t.error is not None]
    assert len(errors) == 1 and errors[0].executor_id == victim and "unreadable" in errors[0].error.message
    assert len(told) == 2 and told[-1].error is None  # the island's end, once
    assert state.order.in_flight == 0 and not state.trees


def test_a_fanout_frame_must_carry_its_parts_as_bodies_in_lists_of_one_length() -> None:
    state = core(2)
    fan = next(s.message for s in run_over_all(state) if isinstance(s.message, FanOut))
    assert isinstance(fan, FanOut)
    frames = encode(fan, msg_id=1)
    body = msgpack.unpackb(frames[1], raw=False)
    body["parts"] = [fan.parts[0].to_wire()]  # decoded parts on the wire: refused, not trusted
    with pytest.raises(FrameError, match="travel as bodies"):
        decode([frames[0], msgpack.packb(body)])
    short = wire(fan)
    assert isinstance(short, FanOut)
    short.controls = short.controls[:-1]
    with pytest.raises(ProtocolError, match="bodies for"):
        FanOutRelay("x").fan_out(short)


def a_leaf_under_a_head() -> tuple[SchedulerState, dict[str, FanOutRelay], str, str]:
    """A run over every executor, delivered down the tree (width 2): the core, the heads' relays, a leaf that
    reports to a head, and that head."""
    state = core(2)
    relays: dict[str, FanOutRelay] = {}
    enqueues: dict[str, Enqueue] = {}
    deliver(relays, [(s.to, s.message) for s in run_over_all(state)], enqueues)
    leaf = next(e for e in EXECUTORS if enqueues[e].report and not (e in relays and len(relays[e])))
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
    monkeypatch.setenv("PWMESH_FANOUT_ABOVE", "2")
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=4, devices_per_host=1,
                               heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_SECONDS)
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address, name="tree") as client:
        sl = client.make_virtual_device_set().add_slice(devices=4)
        hosts = [d.executor for d in sl.devices]
        assert len(set(hosts)) == 4
        step = pw.pmap(_spin, devices=sl)
        ones = np.ones((4, 1))
        def objects() -> dict[str, int]:
            return {st.executor_id: st.objects for st in fetch_status(cluster.address).executor_stats}

        for k in range(3):
            done = step(ones + k)
            np.testing.assert_array_equal(np.asarray(done), ones + k)
            # Freed now: a dropped array's release waits for the client's next message or heartbeat, which
            # made what the executors held at any instant here a race.
            done.delete()
        # Frees of buffers on all 4 executors go through the tree (FanOutFrees): each executor drops its shard.
        nothing = dict.fromkeys(hosts, 0)
        eventually(lambda: objects() == nothing, 30)
        out = step(ones)
        np.testing.assert_array_equal(np.asarray(out), ones)
        eventually(lambda: objects() == dict.fromkeys(hosts, 1), 30)  # its shard each (the input's freed)
        out.delete()
        eventually(lambda: objects() == nothing, 30)
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


def test_a_head_restarting_into_a_group_forming_fails_its_subtree_and_its_own_part_naming_it() -> None:
    """Its own part's end would reach its next process's relay, which never heard of the run: it fails with
    the subtree (the run fails anyway), and the other subtree's parts go on."""
    state = core(2)
    sends = run_over_all(state)
    first = next(s.message for s in sends if isinstance(s.message, FanOut))
    head = first.executors[0]
    actions = state.handle(Received(ExecutorRestarting(executor_id=head, control=f"tcp://{head}:1", epoch=3)), 0.0)
    (told,) = [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, IslandDone)]
    assert told.lost and told.executor_id == head and "restarted" in (told.error.message if told.error else "")
    assert set(told.nodes) == {EXECUTORS.index(e) for e in first.executors}
    assert state.completions.running("r1")


@pytest.mark.long  # ~9 s of real daemons: the relay's own test of a malformed part runs in CI
@pytest.mark.asyncio
async def test_real_executors_fail_only_the_part_whose_body_does_not_decode_and_go_on_serving() -> None:
    """A hostile ``FanOut`` to a real executor (a daemon-role connection, as on a cluster without keys): its
    own body and its child's are garbage. The head still forwards the child's bytes unread; each fails its
    own part with the codec's error, reported where its part reports (both up through the head, to
    ``parent``, as ``PartsDone``s: each failure at once, then both ends); neither daemon is harmed: a program
    runs after."""
    import asyncio

    from pwmesh.service.rpc import Connection, Server
    from pwmesh.service.tasks import TaskGroup
    from pwmesh.service.transport import Context

    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=1)
    with pw.LocalCluster(spec) as cluster:
        ctx, tasks = Context(), TaskGroup()
        got: list[Message] = []
        last = asyncio.Event()

        def note(peer: bytes, env: Envelope) -> None:
            got.append(env.message)
            if isinstance(env.message, PartsDone) and env.message.last:
                last.set()

        parent = Server(ctx, "tcp://127.0.0.1:0", {NodeDone: note, RunPartDone: note, PartsDone: note},
                        tasks=tasks, name="parent")
        parent.start()
        head, child = fetch_status(cluster.address).cluster.executors[:2]
        conn = Connection(ctx, head.control, tasks=tasks, name="hostile")
        try:
            conn.post(FanOut(run_id="hostile-1", parent=parent.address, bodies=[b"\xc1", b"\x92\x01"],
                             executors=[head.executor_id, child.executor_id], controls=[head.control, child.control],
                             sizes=[2, 1]))
            await asyncio.wait_for(last.wait(), 60)
        finally:
            await tasks.stop()
            ctx.close()
        errors = {m.executor_id: m.error for m in got if isinstance(m, NodeDone)}
        errors.update({r.executor_id: r.error for m in got if isinstance(m, PartsDone) for r in m.reports})
        assert set(errors) == {head.executor_id, child.executor_id}
        assert all(e is not None and "unreadable" in e.message for e in errors.values()), errors
        assert not [m for m in got if isinstance(m, RunPartDone | NodeDone)], "all of it through the head's relay"
        assert [sorted(m.ended) for m in got if isinstance(m, PartsDone) and m.last] == \
            [sorted([head.executor_id, child.executor_id])]
        with pw.Client(cluster.address, name="after") as client:
            sl = client.make_virtual_device_set().add_slice(devices=2)
            ones = np.ones((2, 1))
            np.testing.assert_array_equal(np.asarray(pw.pmap(lambda x: x + 1, devices=sl)(ones)), ones + 1)


# ------------------------------------------------------------------ the simulator


@pytest.mark.parametrize("name", ["chained", "opbyop"])
def test_the_simulator_runs_wide_programs_through_the_same_tree_with_the_same_results(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """20 hosts, width 4: every run goes through heads; it computes what the direct sends do, and the
    scheduler sends at most 4 messages a run and hears one per head (its own part's end in it), not 20
    each way."""
    from pwmesh.sim.cluster import SimCluster, SimConfig
    from pwmesh.sim.workloads import Workload, install

    reports = {}
    traffic = {}
    for width in ("4", "1000"):
        monkeypatch.setenv("PWMESH_FANOUT", width)
        monkeypatch.setenv("PWMESH_FANOUT_ABOVE", width)
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
    assert received["sched.parts_done"] == 4 * runs and received.get("sched.run_part_done", 0) == 0
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
