"""Remapping in the resource manager's state machine, with no sockets: slices follow
their virtual devices off lost and draining hosts, break clearly when an island
shrinks below them, heal when capacity returns, and survive an RM restart."""

from __future__ import annotations

import dataclasses

import pytest
from test_placement import executor, started

from pwmesh.errors import InvalidArgument, NotFound
from pwmesh.rm.state import ResourceManagerState
from pwmesh.wire.messages import (
    AllocateSlice,
    DrainExecutor,
    DrainStarted,
    ExecutorJoined,
    ExecutorLost,
    Heartbeat,
    Message,
    Ok,
    PleaseRegister,
    RegisterExecutor,
    RegisterScheduler,
    SliceAllocated,
    SliceInfo,
    SliceRemapped,
    UnregisterExecutor,
    WatchCluster,
)


def allocate(state: ResourceManagerState, owner: str, devices: int) -> SliceInfo:
    reply = state.handle(AllocateSlice(owner=owner, devices=devices), now=0.0)
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
    state.handle(UnregisterExecutor(executor_id="i0h0", reason="gone"), now=1.0)
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
    state.handle(UnregisterExecutor(executor_id="i0h1", reason="gone"), now=1.0)
    (note,) = remaps(state.take_notifications())
    # One device left in the island, and the slice already uses it: it cannot double up.
    assert note.moves == [] and "cannot replace" in note.slice.broken


def test_a_cluster_that_shrinks_below_a_slice_breaks_it_clearly_and_heals_later() -> None:
    state = started(islands=1, hosts=2, devices=2)
    sl = allocate(state, "alice", 4)
    state.take_notifications()
    state.handle(UnregisterExecutor(executor_id="i0h1", reason="gone"), now=1.0)
    (note,) = remaps(state.take_notifications())
    assert note.moves == []
    assert "2 of its 4 devices have no live backing" in note.slice.broken
    # Nothing changes, and nobody is told again, until capacity returns.
    state.handle(UnregisterExecutor(executor_id="i0h1", reason="again"), now=2.0)
    assert remaps(state.take_notifications()) == []
    assert state.handle(RegisterExecutor(info=executor("i0h2", 0, 2)), now=3.0) == Ok()
    (healed,) = remaps(state.take_notifications())
    assert healed.slice.broken == "" and [m.new.executor_id for m in healed.moves] == ["i0h2", "i0h2"]
    assert sorted(hosts_of(state.slices[sl.slice_id])) == ["i0h0", "i0h0", "i0h2", "i0h2"]


def test_drain_moves_slices_off_and_keeps_new_ones_away() -> None:
    state = started(islands=1, hosts=2, devices=2)
    first = allocate(state, "alice", 2)
    assert hosts_of(first) == ["i0h0", "i0h0"]
    state.take_notifications()
    reply = state.handle(DrainExecutor(executor="host-i0h0"), now=1.0)  # by host label
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
        state.handle(WatchCluster(role="proxy", name="proxy", slices=[sl, huge]), now=0.0)
    assert state.slices == {} and state.map_version == version, "nothing of the refused restore was taken"
    assert allocate(state, "bob", 2).map_version < 2**62, "it allocates on, with ids it can encode"


def test_drain_names_must_be_known_and_alive() -> None:
    state = started(islands=1, hosts=1, devices=1)
    with pytest.raises(NotFound):
        state.handle(DrainExecutor(executor="nobody"), now=0.0)
    state.handle(UnregisterExecutor(executor_id="i0h0", reason="gone"), now=0.0)
    with pytest.raises(NotFound, match="not alive"):
        state.handle(DrainExecutor(executor="i0h0"), now=0.0)


def test_a_restarted_rm_rebuilds_from_registrants() -> None:
    old = started(islands=1, hosts=2, devices=2)
    sl = allocate(old, "alice", 2)
    fresh = ResourceManagerState(heartbeat_timeout_seconds=10.0, first_slice_id=1)
    # Everyone it does not know is asked to register, then does.
    assert fresh.handle(Heartbeat(role="proxy", name="proxy"), now=0.0) == PleaseRegister()
    for info in old.executors.values():
        assert fresh.handle(RegisterExecutor(info=info), now=0.0) == Ok()
    for sched in old.schedulers.values():
        assert fresh.handle(RegisterScheduler(info=sched), now=0.0) == Ok()
    assert fresh.handle(WatchCluster(role="proxy", name="proxy", slices=[sl]), now=0.0) == Ok()
    assert fresh.handle(Heartbeat(role="proxy", name="proxy"), now=0.0) is None
    assert fresh.slices[sl.slice_id].devices == sl.devices
    assert fresh.map_version > sl.map_version
    # New slices get fresh ids and see the restored slice as load.
    other = allocate(fresh, "bob", 2)
    assert other.slice_id > sl.slice_id
    assert set(hosts_of(other)).isdisjoint(hosts_of(sl))


def test_an_executor_back_from_the_dead_is_announced() -> None:
    state = started(islands=1, hosts=1, devices=1)
    info = state.executors["i0h0"]
    assert state.expire(now=10.5) == ["i0h0"]
    state.take_notifications()
    assert state.handle(Heartbeat(role="executor", name="i0h0"), now=11.0) == PleaseRegister()
    assert state.handle(RegisterExecutor(info=info), now=11.0) == Ok()
    joined = [n for n in state.take_notifications() if isinstance(n, ExecutorJoined)]
    assert [(j.executor_id, j.control) for j in joined] == [("i0h0", info.control)]
    assert state.executors["i0h0"].alive
