"""Remapping in the resource manager's state machine, with no sockets: slices follow
their virtual devices off lost and draining hosts, break clearly when an island
shrinks below them, heal when capacity returns, and survive an RM restart."""

from __future__ import annotations

import dataclasses

import pytest
from rm_driver import DrivenRM
from test_placement import executor, started

from pwmesh.errors import InvalidArgument, NotFound, Unavailable
from pwmesh.wire.messages import (
    AllocateSlice,
    ClaimProxy,
    DrainExecutor,
    DrainStarted,
    ExecutorJoined,
    ExecutorLost,
    Heartbeat,
    Message,
    Ok,
    PleaseRegister,
    ProxyLease,
    ProxyLost,
    RegisterExecutor,
    RegisterScheduler,
    ReleaseSlices,
    SchedulerJoined,
    SchedulerLost,
    SliceAllocated,
    SliceInfo,
    SliceRemapped,
    UnregisterExecutor,
    WatchCluster,
)
from pwmesh.wire.records import SchedulerInfo


def allocate(state: DrivenRM, owner: str, devices: int) -> SliceInfo:
    reply = state.ask(AllocateSlice(owner=owner, devices=devices), now=0.0)
    assert isinstance(reply, SliceAllocated)
    return reply.slice


def remaps(notes: list[Message]) -> list[SliceRemapped]:
    """Every remap announced, whether on its own or inside the loss that caused it."""
    found: list[SliceRemapped] = []
    for n in notes:
        found += n.remapped if isinstance(n, ExecutorLost) else [n] if isinstance(n, SliceRemapped) else []
    return found


def hosts_of(sl: SliceInfo) -> list[str]:
    return [d.executor_id for d in sl.devices]


def test_lost_host_remap_keeps_survivors_and_is_announced_inside_the_loss() -> None:
    state = started(islands=1, hosts=3, devices=2)
    sl = allocate(state, "alice", 2)
    state.take_notifications()
    state.ask(UnregisterExecutor(executor_id="i0h0", reason="gone"), now=1.0)
    # One message: a watcher never sees the loss without where the devices went.
    (lost,) = state.take_notifications()
    assert isinstance(lost, ExecutorLost) and lost.executor_id == "i0h0"
    (note,) = lost.remapped
    assert note.slice.slice_id == sl.slice_id and not note.slice.broken
    assert [m.index for m in note.moves] == [0, 1]
    assert {m.old.executor_id for m in note.moves} == {"i0h0"}
    # Packed onto one surviving host, as a gang computation wants.
    assert len(set(hosts_of(state.slices[sl.slice_id]))) == 1
    assert "i0h0" not in hosts_of(state.slices[sl.slice_id])
    assert state.slices[sl.slice_id].map_version == state.map_version


def test_a_slice_never_doubles_up_on_one_device() -> None:
    state = started(islands=1, hosts=2, devices=1)
    sl = allocate(state, "alice", 2)
    assert sorted(hosts_of(sl)) == ["i0h0", "i0h1"]
    state.take_notifications()
    state.ask(UnregisterExecutor(executor_id="i0h1", reason="gone"), now=1.0)
    (note,) = remaps(state.take_notifications())
    # One device left in the island, and the slice already uses it: it cannot double up.
    assert note.moves == [] and "cannot replace" in note.slice.broken


def test_a_cluster_that_shrinks_below_a_slice_breaks_it_clearly_and_heals_later() -> None:
    state = started(islands=1, hosts=2, devices=2)
    sl = allocate(state, "alice", 4)
    state.take_notifications()
    state.ask(UnregisterExecutor(executor_id="i0h1", reason="gone"), now=1.0)
    (note,) = remaps(state.take_notifications())
    assert note.moves == []
    assert "2 of its 4 devices have no live backing" in note.slice.broken
    # Nothing changes, and nobody is told again, until capacity returns.
    state.ask(UnregisterExecutor(executor_id="i0h1", reason="again"), now=2.0)
    assert remaps(state.take_notifications()) == []
    assert state.ask(RegisterExecutor(info=executor("i0h2", 0, 2)), now=3.0) == Ok()
    (healed,) = remaps(state.take_notifications())
    assert healed.slice.broken == "" and [m.new.executor_id for m in healed.moves] == ["i0h2", "i0h2"]
    assert sorted(hosts_of(state.slices[sl.slice_id])) == ["i0h0", "i0h0", "i0h2", "i0h2"]


def test_drain_moves_slices_off_and_keeps_new_ones_away() -> None:
    state = started(islands=1, hosts=2, devices=2)
    first = allocate(state, "alice", 2)
    assert hosts_of(first) == ["i0h0", "i0h0"]
    state.take_notifications()
    reply = state.ask(DrainExecutor(executor="host-i0h0"), now=1.0)  # by host label
    assert isinstance(reply, DrainStarted)
    assert (reply.executor_id, reply.remapped, reply.control) == ("i0h0", 1, "tcp://i0h0:1")
    notes = state.take_notifications()
    assert not any(isinstance(n, ExecutorLost) for n in notes)  # draining is not lost
    (note,) = remaps(notes)
    assert {m.old.executor_id for m in note.moves} == {"i0h0"} and hosts_of(note.slice) == ["i0h1", "i0h1"]
    assert state.executors["i0h0"].draining and state.executors["i0h0"].alive
    assert hosts_of(allocate(state, "bob", 2)) == ["i0h1", "i0h1"]  # shares, never the draining host


@pytest.mark.parametrize("field", ["slice_id", "map_version"])
def test_a_restore_the_rm_could_not_count_past_is_refused_and_changes_nothing(field: str) -> None:
    """Found by fuzzing: restoring a slice at 2^64 - 1 made the RM hold 2^64, which no reply could encode."""
    old = started(islands=1, hosts=2, devices=2)
    sl = allocate(old, "alice", 2)
    state = started(islands=1, hosts=2, devices=2)
    version = state.map_version
    huge = dataclasses.replace(sl, **{field: 2**64 - 1})
    with pytest.raises(InvalidArgument, match="ids and versions must be below 2"):
        state.ask(WatchCluster(role="proxy", name="proxy", slices=[sl, huge]), now=0.0)
    assert state.slices == {} and state.map_version == version, "nothing of the refused restore was taken"
    assert allocate(state, "bob", 2).map_version < 2**62, "it allocates on, with ids it can encode"


def test_drain_names_must_be_known_and_alive() -> None:
    state = started(islands=1, hosts=1, devices=1)
    with pytest.raises(NotFound):
        state.ask(DrainExecutor(executor="nobody"), now=0.0)
    state.ask(UnregisterExecutor(executor_id="i0h0", reason="gone"), now=0.0)
    with pytest.raises(NotFound, match="not alive"):
        state.ask(DrainExecutor(executor="i0h0"), now=0.0)


def test_a_restarted_rm_rebuilds_from_registrants() -> None:
    old = started(islands=1, hosts=2, devices=2)
    sl = allocate(old, "alice", 2)
    fresh = DrivenRM(heartbeat_timeout_seconds=10.0, first_slice_id=1)
    # Everyone it does not know is asked to register, then does.
    assert fresh.ask(Heartbeat(role="proxy", name="proxy"), now=0.0) == PleaseRegister()
    for info in old.executors.values():
        assert fresh.ask(RegisterExecutor(info=info), now=0.0) == Ok()
    for sched in old.schedulers.values():
        assert fresh.ask(RegisterScheduler(info=sched), now=0.0) == Ok()
    assert fresh.ask(WatchCluster(role="proxy", name="proxy", slices=[sl]), now=0.0) == Ok()
    # Known now: answered, with the lease, free after the restart (the proxy claims it again).
    assert fresh.ask(Heartbeat(role="proxy", name="proxy"), now=0.0) == ProxyLease(active=False, holder="",
                                                                                     address="")
    assert fresh.ask(ClaimProxy(name="proxy", address="tcp://proxy"), now=0.0).active
    assert fresh.slices[sl.slice_id].devices == sl.devices
    assert fresh.map_version > sl.map_version
    # New slices get fresh ids and see the restored slice as load.
    other = allocate(fresh, "bob", 2)
    assert other.slice_id > sl.slice_id
    assert set(hosts_of(other)).isdisjoint(hosts_of(sl))


def test_one_proxy_holds_the_lease_and_a_standby_gets_it_when_that_one_is_lost() -> None:
    """Issue #28 item 1: the active proxy and its standbys (``pwmesh-proxy --standby``)."""
    state = started(islands=1, hosts=1, devices=1)
    for name in ("primary", "standby"):
        assert state.ask(WatchCluster(role="proxy", name=name), now=0.0) == Ok()
    assert state.ask(ClaimProxy(name="primary", address="tcp://a"), now=0.0) == ProxyLease(active=True, holder="primary", address="tcp://a")
    assert state.ask(ClaimProxy(name="standby", address="tcp://b"), now=0.0) == ProxyLease(active=False, holder="primary", address="tcp://a")
    assert state.ask(ClaimProxy(name="primary", address="tcp://a"), now=1.0).active, "restarted under its name"
    for now in (5.0, 9.0):  # beating: kept, and the standby's beats say who holds it
        assert state.ask(Heartbeat(role="proxy", name="primary"), now=now).active
        assert state.ask(Heartbeat(role="proxy", name="standby"), now=now) == ProxyLease(active=False, holder="primary", address="tcp://a")
        state.expire(now)
    state.take_notifications()
    state.expire(19.5)
    assert [n for n in state.take_notifications() if isinstance(n, ProxyLost)] == [
        ProxyLost(name="primary", address="tcp://a", reason="missed heartbeats for 10.0 seconds")]
    assert state.heartbeat_misses[("proxy",)] == 1
    assert state.ask(ClaimProxy(name="standby", address="tcp://b"), now=20.0).active
    # The one that was lost (a pause, say) hears it is no longer the active proxy: it stops.
    assert state.ask(Heartbeat(role="proxy", name="primary"), now=21.0) == ProxyLease(active=False, holder="standby", address="tcp://b")
    assert not state.ask(ClaimProxy(name="primary", address="tcp://a"), now=21.0).active


def test_an_executor_back_from_the_dead_is_announced() -> None:
    state = started(islands=1, hosts=1, devices=1)
    info = state.executors["i0h0"]
    assert state.expire(now=10.5) == ["i0h0"]
    state.take_notifications()
    back = state.ask(Heartbeat(role="executor", name="i0h0"), now=11.0)
    assert isinstance(back, PleaseRegister) and back.written_off  # what it held is written off: it starts over
    assert state.ask(RegisterExecutor(info=info), now=11.0) == Ok()
    joined = [n for n in state.take_notifications() if isinstance(n, ExecutorJoined)]
    assert [(j.executor_id, j.control) for j in joined] == [("i0h0", info.control)]
    assert state.executors["i0h0"].alive


def test_a_slice_request_its_caller_gave_up_on_leaves_no_slice() -> None:
    """Issue #28, item 5 in part: a proxy that timed out waiting for the RM (it was down) releases what its
    request makes, behind it on the same connection; or, if that release comes first, the request is
    refused when it arrives. Before, a timed-out ``add_slice`` left a slice no session held."""
    state = started()
    made = state.ask(AllocateSlice(owner="s1", devices=2, request="7"), now=0.0)
    assert isinstance(made, SliceAllocated) and made.slice.slice_id in state.slices
    assert state.ask(ReleaseSlices(owner="s1", requests=["7"]), now=0.0) == Ok()
    assert made.slice.slice_id not in state.slices
    kept = allocate(state, "s1", 1)  # releasing by request touches nothing else of the owner's
    assert state.ask(ReleaseSlices(owner="s1", requests=["8"]), now=0.0) == Ok()  # not arrived yet
    with pytest.raises(Unavailable, match="given up"):
        state.ask(AllocateSlice(owner="s1", devices=2, request="8"), now=0.0)
    assert list(state.slices) == [kept.slice_id]


def test_an_executor_restarted_before_it_was_found_lost_is_lost_then_new() -> None:
    """A new process under a live executor's name (fresh, another incarnation): the old one is declared
    lost first, and watchers hear ``ExecutorJoined(fresh=True)``. A retry of the same registration, or a
    registration after an RM restart (not fresh), is nothing new."""
    state = started(islands=1, hosts=2)
    first = dataclasses.replace(executor("i0h0"), fresh=True, incarnation="a")
    assert state.ask(RegisterExecutor(info=first), now=0.0) == Ok()
    again = state.take_notifications()
    assert [type(n) for n in again] == [ExecutorLost, ExecutorJoined]  # it had registered (not fresh) in started()
    assert state.ask(RegisterExecutor(info=first), now=1.0) == Ok()  # a retry: the same incarnation
    assert [(type(n), getattr(n, "fresh", None)) for n in state.take_notifications()] == [(ExecutorJoined, False)]
    newer = dataclasses.replace(first, incarnation="b")
    assert state.ask(RegisterExecutor(info=newer), now=2.0) == Ok()
    notes = state.take_notifications()
    assert [type(n) for n in notes] == [ExecutorLost, ExecutorJoined] and notes[1].fresh
    assert "restarted" in notes[0].reason
    not_fresh = dataclasses.replace(newer, fresh=False)
    assert state.ask(RegisterExecutor(info=not_fresh), now=3.0) == Ok()
    assert [type(n) for n in state.take_notifications()] == [ExecutorJoined]


def test_a_scheduler_of_a_new_epoch_ends_the_live_one() -> None:
    state = started(islands=1, hosts=1)
    state.ask(RegisterScheduler(info=SchedulerInfo(island=0, address="tcp://s", name="s", epoch="e1")), now=0.0)
    state.take_notifications()
    state.ask(RegisterScheduler(info=SchedulerInfo(island=0, address="tcp://s", name="s", epoch="e1")), now=1.0)
    assert [type(n) for n in state.take_notifications()] == [SchedulerJoined]  # the same instance again
    state.ask(RegisterScheduler(info=SchedulerInfo(island=0, address="tcp://s", name="s", epoch="e2")), now=2.0)
    notes = state.take_notifications()
    assert [type(n) for n in notes] == [SchedulerLost, SchedulerJoined] and "restarted" in notes[0].reason


def test_a_drain_its_caller_gave_up_on_is_undone_or_refused() -> None:
    state = started(islands=1, hosts=2)
    assert isinstance(state.ask(DrainExecutor(executor="i0h0", request="1"), now=0.0), DrainStarted)
    assert state.executors["i0h0"].draining
    assert state.ask(DrainExecutor(executor="i0h0", request="1", cancel=True), now=0.0) == Ok()
    assert not state.executors["i0h0"].draining  # takes new slices again
    assert state.ask(DrainExecutor(executor="i0h1", request="2", cancel=True), now=0.0) == Ok()  # first
    with pytest.raises(Unavailable, match="given up"):
        state.ask(DrainExecutor(executor="i0h1", request="2"), now=0.0)
    assert not state.executors["i0h1"].draining
