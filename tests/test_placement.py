"""Slice placement (a pure function) and the resource manager's state machine, with no sockets."""

from __future__ import annotations

import collections

import pytest
from rm_driver import DrivenRM

from pwmesh.errors import InvalidArgument, NotFound, ResourceExhausted
from pwmesh.rm.placement import DeviceRef, place
from pwmesh.wire.messages import (
    AllocateSlice,
    ClusterStateReply,
    DeviceInfo,
    ExecutorInfo,
    GetClusterState,
    Heartbeat,
    Ok,
    Ping,
    PleaseRegister,
    RegisterExecutor,
    RegisterScheduler,
    ReleaseSlices,
    SchedulerInfo,
    SliceAllocated,
    SliceInfo,
    UnregisterExecutor,
)


def executor(name: str, island: int = 0, devices: int = 2, *, alive: bool = True, host: str = "") -> ExecutorInfo:
    return ExecutorInfo(
        executor_id=name, island=island, host=host or f"host-{name}", control=f"tcp://{name}:1",
        data=f"tcp://{name}:2", devices=[DeviceInfo(index=i) for i in range(devices)], alive=alive,
    )


def cluster(islands: int, hosts: int, devices: int) -> list[ExecutorInfo]:
    return [executor(f"i{i}h{h}", i, devices) for i in range(islands) for h in range(hosts)]


def executors_of(refs: list[DeviceRef]) -> set[str]:
    return {ex for ex, _ in refs}


# --------------------------------------------------------------- place()


def test_picks_the_least_loaded_devices() -> None:
    load = {("a", 0): 2, ("a", 1): 0, ("b", 0): 1, ("b", 1): 3}
    island, refs = place([executor("a"), executor("b")], load, 2)
    assert island == 0
    assert sorted(refs) == [("a", 1), ("b", 0)]


def test_unloaded_devices_count_as_zero() -> None:
    _, refs = place([executor("a", devices=3)], {("a", 0): 1, ("a", 2): 1}, 1)
    assert refs == [("a", 1)]


def test_a_slice_stays_inside_one_island() -> None:
    # Two islands of 2 devices each: 3 devices exist in total, but never in one island.
    execs = [executor("a", 0), executor("b", 1)]
    with pytest.raises(ResourceExhausted):
        place(execs, {}, 3)
    for n in (1, 2):
        island, refs = place(execs, {}, n)
        assert {ex.island for ex in execs if ex.executor_id in executors_of(refs)} == {island}


def test_packs_onto_one_host_among_equally_loaded_devices() -> None:
    execs = cluster(islands=1, hosts=3, devices=4)
    _, refs = place(execs, {}, 4)
    assert len(executors_of(refs)) == 1
    _, refs = place(execs, {}, 3)
    assert len(executors_of(refs)) == 1
    _, refs = place(execs, {}, 6)
    assert len(executors_of(refs)) == 2


def test_packs_onto_one_host_when_another_host_is_partly_busy() -> None:
    """Host a has one busy device; b has two idle ones. Two idle devices on one host beat two on two hosts."""
    execs = [executor("a", devices=2), executor("b", devices=2)]
    load = {("a", 0): 1}
    _, refs = place(execs, load, 2)
    assert all(load.get(r, 0) == 0 for r in refs), "only idle devices are needed"
    assert len(executors_of(refs)) == 1, f"{refs} spans two hosts though host b has two idle devices"


def test_returned_devices_are_distinct() -> None:
    _, refs = place(cluster(islands=1, hosts=2, devices=4), {}, 8)
    assert len(set(refs)) == 8


def test_successive_slices_spread_across_islands() -> None:
    execs = cluster(islands=2, hosts=2, devices=2)
    load: collections.Counter[DeviceRef] = collections.Counter()
    islands = []
    for _ in range(4):
        island, refs = place(execs, load, 1)
        islands.append(island)
        load.update(refs)
    assert islands == [0, 1, 0, 1]
    assert all(count == 1 for count in load.values())


def test_ties_go_to_the_lower_island() -> None:
    assert place(cluster(islands=3, hosts=1, devices=2), {}, 2)[0] == 0


def test_prefers_the_island_whose_chosen_devices_carry_less_load() -> None:
    execs = [executor("a", 0, 4), executor("b", 1, 2)]
    load = {("a", 0): 1, ("a", 1): 1, ("a", 2): 1, ("a", 3): 1, ("b", 0): 1}
    # Island 0: its best two devices carry 1+1; island 1: 0+1. Island 1 wins though it is smaller.
    assert place(execs, load, 2)[0] == 1


def test_ties_on_chosen_load_go_to_the_island_with_lower_average_load() -> None:
    execs = [executor("a", 0, 3), executor("b", 1, 3)]
    load = {("a", 2): 5, ("b", 2): 1}
    assert place(execs, load, 2) == (1, [("b", 0), ("b", 1)])


def test_honours_the_requested_island() -> None:
    execs = cluster(islands=3, hosts=1, devices=2)
    for wanted in (2, 1, 0):
        island, refs = place(execs, {}, 2, island=wanted)
        assert island == wanted
        assert executors_of(refs) == {f"i{wanted}h0"}


def test_requested_island_is_used_even_when_busier() -> None:
    execs = cluster(islands=2, hosts=1, devices=2)
    load = {("i1h0", 0): 4, ("i1h0", 1): 4}
    island, refs = place(execs, load, 1, island=1)
    assert island == 1 and executors_of(refs) == {"i1h0"}


def test_more_devices_than_any_island_has() -> None:
    with pytest.raises(ResourceExhausted, match="at most 4"):
        place(cluster(islands=2, hosts=2, devices=2), {}, 5)


def test_more_devices_than_the_requested_island_has() -> None:
    execs = [executor("a", 0, 8), executor("b", 1, 2)]
    with pytest.raises(ResourceExhausted, match="island 1"):
        place(execs, {}, 3, island=1)


def test_unknown_island() -> None:
    with pytest.raises(ResourceExhausted, match="island 7"):
        place(cluster(islands=2, hosts=1, devices=2), {}, 1, island=7)


def test_no_executors_at_all() -> None:
    with pytest.raises(ResourceExhausted):
        place([], {}, 1)


@pytest.mark.parametrize("devices", [0, -1])
def test_a_slice_needs_at_least_one_device(devices: int) -> None:
    with pytest.raises(InvalidArgument):
        place(cluster(islands=1, hosts=1, devices=2), {}, devices)


def test_ignores_dead_executors() -> None:
    execs = [executor("a", alive=False), executor("b")]
    _, refs = place(execs, {}, 2)
    assert executors_of(refs) == {"b"}
    with pytest.raises(ResourceExhausted):
        place(execs, {}, 3)


def test_an_island_with_only_dead_executors_is_unknown() -> None:
    execs = [executor("a", 0), executor("b", 1, alive=False)]
    with pytest.raises(ResourceExhausted):
        place(execs, {}, 1, island=1)
    assert place(execs, {}, 1)[0] == 0


# --------------------------------------------------------------- ResourceManagerState


def started(islands: int = 2, hosts: int = 2, devices: int = 2, timeout: float = 10.0) -> DrivenRM:
    state = DrivenRM(heartbeat_timeout_seconds=timeout)
    for island in range(islands):
        assert state.ask(RegisterScheduler(info=SchedulerInfo(island=island, address=f"tcp://sched{island}")),
                            now=0.0) == Ok()
    for ex in cluster(islands, hosts, devices):
        assert state.ask(RegisterExecutor(info=ex), now=0.0) == Ok()
    state.take_notifications()  # the registrations' own announcements
    return state


def beat_schedulers(state: DrivenRM, now: float) -> None:
    """Schedulers heartbeat too; tests about executors keep them alive."""
    for info in state.schedulers.values():
        state.ask(Heartbeat(role="scheduler", name=info.name), now=now)


def allocate(state: DrivenRM, owner: str, devices: int, island: int | None = None,
             now: float = 0.0) -> SliceInfo:
    reply = state.ask(AllocateSlice(owner=owner, devices=devices, island=island), now=now)
    assert isinstance(reply, SliceAllocated)
    return reply.slice


def test_registering_executors_bumps_the_map_version() -> None:
    state = DrivenRM()
    assert state.map_version == 0
    state.ask(RegisterExecutor(info=executor("a")), now=0.0)
    assert state.map_version == 1
    state.ask(RegisterExecutor(info=executor("b")), now=0.0)
    assert state.map_version == 2
    assert set(state.executors) == {"a", "b"}


def test_registering_a_scheduler_records_it() -> None:
    state = DrivenRM()
    state.ask(RegisterScheduler(info=SchedulerInfo(island=3, address="tcp://s")), now=0.0)
    assert state.schedulers[3].address == "tcp://s"


def test_allocation_bumps_the_map_version_and_adds_load() -> None:
    state = started()
    before = state.map_version
    sl = allocate(state, "alice", 2)
    assert state.map_version == before + 1
    assert sl.map_version == state.map_version
    assert state.load() == {(d.executor_id, d.device): 1 for d in sl.devices}
    assert state.slices == {sl.slice_id: sl}


def test_allocated_slice_describes_where_it_lives() -> None:
    state = started(islands=2, hosts=2, devices=2)
    sl = allocate(state, "alice", 2, island=1)
    assert sl.owner == "alice"
    assert sl.island == 1
    assert sl.scheduler == "tcp://sched1"
    assert len(sl.devices) == 2
    for d in sl.devices:
        ex = state.executors[d.executor_id]
        assert (d.island, d.host, d.control, d.data) == (1, ex.host, ex.control, ex.data)
        assert d.device in {dev.index for dev in ex.devices}


def test_slice_ids_are_unique() -> None:
    state = started()
    ids = [allocate(state, "alice", 1).slice_id for _ in range(5)]
    assert len(set(ids)) == 5


def test_successive_allocations_spread_load() -> None:
    state = started(islands=2, hosts=2, devices=2)
    slices = [allocate(state, "alice", 1) for _ in range(8)]
    assert [sl.island for sl in slices[:4]] == [0, 1, 0, 1]
    assert sorted(state.load().values()) == [1] * 8, "every device carries exactly one slice"


def test_a_gang_slice_lands_on_one_host_when_one_can_hold_it() -> None:
    """After a 1-device slice, a 2-device slice still fits host b's two idle devices.

    Spanning hosts here is not a matter of taste: lower() refuses an spmd function
    over a slice that spans executors, so the second slice would be unusable for it.
    """
    state = started(islands=1, hosts=2, devices=2)
    allocate(state, "alice", 1)
    gang = allocate(state, "bob", 2)
    assert len({d.executor_id for d in gang.devices}) == 1, gang.devices


def test_island_without_a_scheduler() -> None:
    state = DrivenRM()
    state.ask(RegisterExecutor(info=executor("a")), now=0.0)
    version = state.map_version
    with pytest.raises(NotFound):
        state.ask(AllocateSlice(owner="alice", devices=1), now=0.0)
    assert state.map_version == version and not state.slices


def test_allocation_errors_change_nothing() -> None:
    state = started(islands=1, hosts=1, devices=2)
    version = state.map_version
    with pytest.raises(ResourceExhausted):
        state.ask(AllocateSlice(owner="alice", devices=3), now=0.0)
    with pytest.raises(ResourceExhausted):
        state.ask(AllocateSlice(owner="alice", devices=1, island=5), now=0.0)
    with pytest.raises(InvalidArgument):
        state.ask(AllocateSlice(owner="alice", devices=0), now=0.0)
    assert state.map_version == version and not state.slices


def test_release_by_owner_frees_only_that_owners_slices() -> None:
    state = started()
    mine = [allocate(state, "alice", 1) for _ in range(2)]
    theirs = allocate(state, "bob", 2)
    version = state.map_version
    assert state.ask(ReleaseSlices(owner="alice"), now=0.0) == Ok()
    assert state.map_version == version + 1
    assert list(state.slices) == [theirs.slice_id]
    assert state.load() == {(d.executor_id, d.device): 1 for d in theirs.devices}
    assert all(sl.slice_id not in state.slices for sl in mine)


def test_release_of_chosen_ids() -> None:
    state = started()
    a1, a2 = allocate(state, "alice", 1), allocate(state, "alice", 1)
    b = allocate(state, "bob", 1)
    state.ask(ReleaseSlices(owner="alice", slice_ids=[a1.slice_id, b.slice_id]), now=0.0)
    assert set(state.slices) == {a2.slice_id, b.slice_id}, "bob's slice is not alice's to release"


def test_release_of_nothing_keeps_the_map_version() -> None:
    state = started()
    allocate(state, "alice", 1)
    version = state.map_version
    state.ask(ReleaseSlices(owner="carol"), now=0.0)
    state.ask(ReleaseSlices(owner="alice", slice_ids=[]), now=0.0)
    assert state.map_version == version
    assert len(state.slices) == 1


def test_released_devices_are_reused() -> None:
    state = started(islands=1, hosts=1, devices=2)
    first = allocate(state, "alice", 2)
    state.ask(ReleaseSlices(owner="alice"), now=0.0)
    assert state.load() == {}
    again = allocate(state, "bob", 2)
    assert {(d.executor_id, d.device) for d in again.devices} == {(d.executor_id, d.device) for d in first.devices}


def test_expire_marks_silent_executors_lost_after_the_timeout() -> None:
    state = started(islands=1, hosts=2, devices=2, timeout=10.0)
    state.ask(Heartbeat(role="executor", name="i0h1"), now=8.0)
    version = state.map_version
    beat_schedulers(state, 10.0)
    assert state.expire(now=10.0) == [], "exactly the timeout is not yet late"
    assert state.map_version == version
    beat_schedulers(state, 10.5)
    assert state.expire(now=10.5) == ["i0h0"]
    assert state.executors["i0h0"].alive is False
    assert state.executors["i0h1"].alive is True
    assert state.map_version == version + 1
    beat_schedulers(state, 10.6)
    assert state.expire(now=10.6) == [], "a lost executor is reported once"
    beat_schedulers(state, 18.5)
    assert state.expire(now=18.5) == ["i0h1"]
    assert state.map_version == version + 2


def test_heartbeats_keep_an_executor_alive() -> None:
    state = started(islands=1, hosts=1, devices=1, timeout=10.0)
    for t in range(5, 60, 5):
        state.ask(Heartbeat(role="executor", name="i0h0"), now=float(t))
        assert state.expire(now=t + 9.9) == []
    assert state.executors["i0h0"].alive


def test_heartbeats_from_others_do_not_count() -> None:
    state = started(islands=1, hosts=1, devices=1, timeout=10.0)
    # Unknown senders are asked to register (after a restart, that rebuilds the state)...
    assert state.ask(Heartbeat(role="scheduler", name="i0h0"), now=9.0) == PleaseRegister()
    assert state.ask(Heartbeat(role="executor", name="stranger"), now=9.0) == PleaseRegister()
    # ...and keep nobody alive.
    assert state.expire(now=10.5) == ["i0h0"]
    assert "stranger" not in state.executors
    # One it declared lost is told so: everyone wrote off what it held (it starts over, as a new executor).
    back = state.ask(Heartbeat(role="executor", name="i0h0"), now=11.0)
    assert isinstance(back, PleaseRegister) and "declared it lost" in back.written_off


def test_placement_ignores_lost_executors() -> None:
    state = started(islands=1, hosts=2, devices=2, timeout=10.0)
    state.ask(Heartbeat(role="executor", name="i0h1"), now=5.0)
    beat_schedulers(state, 11.0)
    state.expire(now=11.0)
    sl = allocate(state, "alice", 2, now=11.0)
    assert {d.executor_id for d in sl.devices} == {"i0h1"}
    assert {d.executor_id for d in allocate(state, "bob", 1, now=11.0).devices} == {"i0h1"}
    with pytest.raises(ResourceExhausted):
        state.ask(AllocateSlice(owner="alice", devices=3), now=11.0)


def test_re_registration_revives_a_lost_executor() -> None:
    state = started(islands=1, hosts=1, devices=2, timeout=10.0)
    beat_schedulers(state, 11.0)
    assert state.expire(now=11.0) == ["i0h0"]
    version = state.map_version
    state.ask(RegisterExecutor(info=executor("i0h0", 0, 2, alive=False)), now=12.0)
    assert state.executors["i0h0"].alive is True
    assert state.map_version == version + 1
    beat_schedulers(state, 21.0)
    assert state.expire(now=21.0) == []
    assert allocate(state, "alice", 2, now=21.0).devices[0].executor_id == "i0h0"


def test_snapshot() -> None:
    state = DrivenRM()
    for island in (1, 0):
        state.ask(RegisterScheduler(info=SchedulerInfo(island=island, address=f"tcp://s{island}")), now=0.0)
    for ex in cluster(islands=2, hosts=1, devices=2):
        state.ask(RegisterExecutor(info=ex), now=0.0)
    sl = allocate(state, "alice", 2)
    reply = state.ask(GetClusterState(), now=0.0)
    assert isinstance(reply, ClusterStateReply)
    snap = reply.state
    assert snap.map_version == state.map_version == 3
    assert [s.island for s in snap.schedulers] == [0, 1]
    assert [e.executor_id for e in snap.executors] == ["i0h0", "i1h0"]
    assert all(e.alive for e in snap.executors)
    assert snap.slices == [sl]
    assert state.snapshot() == snap


def test_unhandled_message() -> None:
    with pytest.raises(InvalidArgument, match="ping"):
        DrivenRM().ask(Ping(), now=0.0)


def test_losses_are_announced_once_with_their_cause() -> None:
    state = started(islands=1, hosts=2)
    assert state.take_notifications() == []
    assert state.ask(UnregisterExecutor(executor_id="i0h0", reason="drained"), now=1.0) == Ok()
    version = state.map_version
    (left,) = state.take_notifications()
    assert (left.executor_id, left.reason, left.graceful) == ("i0h0", "drained", True)
    assert left.control == state.executors["i0h0"].control
    assert state.ask(UnregisterExecutor(executor_id="i0h0", reason="again"), now=1.0) == Ok()
    assert state.take_notifications() == [] and state.map_version == version
    # A crash is only seen as silence, and is not graceful: data it sent may be lost.
    beat_schedulers(state, 10.5)
    assert state.expire(now=10.5) == ["i0h1"]
    (crashed,) = state.take_notifications()
    assert (crashed.executor_id, crashed.graceful) == ("i0h1", False)
    assert "heartbeats" in crashed.reason
    assert state.take_notifications() == []


def test_unregistering_an_unknown_executor_changes_nothing() -> None:
    state = started(islands=1, hosts=1)
    version = state.map_version
    assert state.ask(UnregisterExecutor(executor_id="nobody", reason="x"), now=0.0) == Ok()
    assert state.map_version == version and state.take_notifications() == []
