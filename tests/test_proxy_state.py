"""The proxy's pure core, with no sockets: ``ProxyState.handle(event, now) -> actions``.

The other cores are real too: the resource manager's (``ResourceManagerState``) allocates the
slices and produces the losses and remaps, and the island scheduler's (``IslandOrder``) turns a
``ScheduleRun`` into the executors' ``Enqueue``s. Only the executors are played by the test: it
answers an ``Enqueue`` with the ``NodeDone`` an executor would post.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import pytest
from rm_driver import DrivenRM

from pwmesh.errors import DeviceLost, InvalidArgument, NotFound, ProtocolError, PwmeshError, ResourceExhausted
from pwmesh.ir.keys import function_id
from pwmesh.proxy import state as state_module
from pwmesh.proxy.state import (
    Ask,
    FetchEnded,
    Fetching,
    FetchingAll,
    Inbound,
    Inventoried,
    Inventory,
    Lowered,
    LowerOffLoop,
    Notice,
    PeerLost,
    ProxyState,
    Reply,
    Resolve,
    Send,
    SliceGranted,
    Tick,
    Wait,
    settled,
    sources,
)
from pwmesh.proxy.tenants import TenantLimits, TenantPolicy
from pwmesh.scheduler.order import IslandOrder
from pwmesh.wire import Message, encode
from pwmesh.wire.codec import unpack_records
from pwmesh.wire.messages import (
    AwaitBuffers,
    BuffersState,
    CancelRun,
    CloseSession,
    Computation,
    CreateSlice,
    DeleteShards,
    DeviceInfo,
    DrainExecutor,
    Enqueue,
    ErrorInfo,
    ExecutorInfo,
    ExecutorJoined,
    ExecutorLost,
    Fetch,
    FetchBuffers,
    ForgetOwner,
    FreeShards,
    Heartbeat,
    InstallTemplate,
    IslandDone,
    NodeDone,
    NodeSpec,
    Ok,
    OpenSession,
    ProgramInput,
    ProgramSpec,
    PutBuffer,
    PutShards,
    QueryBuffers,
    RegisterExecutor,
    RegisterFunction,
    RegisterGang,
    RegisterProgram,
    RegisterProgramFunction,
    RegisterScheduler,
    ReleaseBuffers,
    ReleaseSlices,
    RunProgram,
    RunTemplate,
    SchedulerInfo,
    ScheduleRun,
    SendShards,
    SessionOpened,
    SliceAllocated,
    SliceCreated,
    SliceInfo,
    ValueSpec,
)

pytestmark = pytest.mark.timeout(30)

SCHEDULER = "tcp://sched-0:6100"
CLIENT = b"client-1"


class World:
    """An RM core with three executors of two devices on one island, its scheduler's core, and a proxy core.
    ``group``: the executors' JAX group ("": none), in which an SPMD program may span them."""

    def __init__(self, group: str = "") -> None:
        self.now = 0.0
        self.rm = DrivenRM(heartbeat_timeout_seconds=10.0)
        self.rm.ask(RegisterScheduler(info=SchedulerInfo(island=0, address=SCHEDULER, name="sched-0")), 0.0)
        self.controls: dict[str, str] = {}
        for e in range(3):
            info = ExecutorInfo(executor_id=f"ex{e}", island=0, host=f"host{e}", control=f"tcp://ex{e}:7000",
                                data=f"tcp://ex{e}:7001", devices=[DeviceInfo(index=i) for i in range(2)],
                                group=group)
            self.rm.ask(RegisterExecutor(info=info), 0.0)
            self.controls[info.control] = info.executor_id
        self.rm.take_notifications()
        self.order = IslandOrder(island=0)
        self.proxy = ProxyState(rm="tcp://rm:5000", address="tcp://proxy:5555", session_timeout_seconds=30.0)

    def handle(self, event: Any) -> list[Any]:
        return self.proxy.handle(event, self.now)

    def ask(self, peer: bytes, message: Message) -> Any:
        """A client request: its answer (raises the error it failed with)."""
        actions = self.handle(Inbound(peer, message))
        asks = [a for a in actions if isinstance(a, Ask)]
        for ask in asks:  # the shell's part: the RM answers, and the answer goes back in
            actions = self.handle(SliceGranted(ask.peer, allocated(self.rm.ask(ask.message, self.now))))
        replies = [a for a in actions if isinstance(a, Reply | Wait | Fetching | FetchingAll)]
        assert len(replies) <= 1, actions
        if replies and isinstance(replies[0], Reply):
            if replies[0].error is not None:
                raise replies[0].error
            return replies[0].message
        return replies[0] if replies else None

    def notices(self) -> list[Any]:
        """Feed the RM's notifications to the proxy; every action they cause."""
        out: list[Any] = []
        for note in self.rm.take_notifications():
            out += self.handle(Notice(note))
        return out

    def open(self, peer: bytes = CLIENT, devices: int = 4) -> tuple[str, int]:
        opened = self.ask(peer, OpenSession(name="test"))
        assert isinstance(opened, SessionOpened)
        created = self.ask(peer, CreateSlice(devices=devices))
        assert isinstance(created, SliceCreated)
        return opened.session_id, created.slice.slice_id

    def function(self, peer: bytes, slice_id: int, name: bytes, spmd: bool = False) -> str:
        fn_id = function_id(name, spmd)
        assert self.ask(peer, RegisterProgramFunction(fn_id=fn_id, exported=name, slice_id=slice_id, spmd=spmd)) == Ok()
        return fn_id

    def executors(self, actions: list[Any], run_id: str | None = None) -> list[NodeDone]:
        """What the executors would report for the ScheduleRuns among ``actions``: every node's NodeDone."""
        done = []
        released = []
        for action in actions:
            if isinstance(action, Send) and isinstance(action.message, ScheduleRun):
                assert action.to == SCHEDULER
                released += self.order.submit(action.message)
            elif isinstance(action, Send) and isinstance(action.message, InstallTemplate):
                self.order.install(action.message)
            elif isinstance(action, Send) and isinstance(action.message, RunTemplate):
                assert action.to == SCHEDULER
                released += self.order.submit_template(action.message)
        while released:  # each part reports to the scheduler too, which may release more
            send = released.pop(0)
            enq, executor_id = send.message, self.controls[send.to]
            assert isinstance(enq, Enqueue)
            done.append(NodeDone(run_id=enq.run_id, nodes=enq.nodes, executor_id=executor_id))
            released += self.order.part_done(enq.run_id, executor_id, 0.0)
        return done


def freed_buffers(actions: list[Any]) -> set[str]:
    """The buffers ``actions`` delete: per executor (``DeleteShards``) or per island (``FreeShards``)."""
    return ({p for a in sent(actions, DeleteShards) for p in a.message.buffers}
            | {p for a in sent(actions, FreeShards) for g in a.message.groups for p in g.buffers})


def allocated(reply: Message | None) -> SliceInfo:
    assert isinstance(reply, SliceAllocated), reply
    return reply.slice


def sent(actions: list[Any], kind: type[Message]) -> list[Send]:
    return [a for a in actions if isinstance(a, Send) and isinstance(a.message, kind)]


def runs_sent(actions: list[Any]) -> list[Send]:
    """The runs sent to islands' schedulers: whole (``ScheduleRun``) or of an installed template."""
    return [a for a in actions if isinstance(a, Send) and isinstance(a.message, ScheduleRun | RunTemplate)]


def chain(fns: list[str], slice_id: int, rows: int = 8) -> ProgramSpec:
    """``x -> fns[0] -> fns[1] -> ...``, every value split over the slice's 4 devices."""
    values = [ValueSpec(shape=[rows, 2], dtype="float32", shards=4) for _ in range(len(fns) + 1)]
    nodes = [NodeSpec(fn_id=fn, slice_id=slice_id, inputs=[k], outputs=[k + 1]) for k, fn in enumerate(fns)]
    return ProgramSpec(values=values, inputs=[0], outputs=[len(fns)], nodes=nodes)


@pytest.fixture
def world() -> World:
    return World()


def test_a_session_lives_while_it_beats_and_its_end_frees_everything(world: World) -> None:
    sid, slice_id = world.open()
    assert world.ask(CLIENT, PutBuffer(buffer=7, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    world.now = 20.0
    assert world.ask(CLIENT, Heartbeat(role="client", name="test")) == Ok()
    world.now = 45.0  # 25 s since the beat: inside the 30 s timeout
    assert world.handle(Tick()) == []
    world.now = 51.0
    actions = world.handle(Tick())
    assert world.proxy.sessions_expired == 1 and not world.proxy.sessions
    # Its slice goes back to the RM, its buffer is deleted where it lives, and then executors forget the owner.
    assert [a.message for a in sent(actions, ReleaseSlices)] == [ReleaseSlices(owner=sid)]
    deleted = {a.to for a in sent(actions, DeleteShards)}
    assert deleted and all(a.message.buffers[0].startswith(f"{sid}/") for a in sent(actions, DeleteShards))
    assert {a.to for a in sent(actions, ForgetOwner)} >= deleted
    with pytest.raises(NotFound, match="no session"):
        world.ask(CLIENT, QueryBuffers(buffers=[7]))


def test_a_program_runs_completes_and_its_buffers_are_freed_by_reference(world: World) -> None:
    sid, slice_id = world.open()
    fns = [world.function(CLIENT, slice_id, name) for name in (b"f", b"g")]
    program = chain(fns, slice_id)
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    assert world.handle(Inbound(CLIENT, RegisterProgram(program_id="p", program=program))) == []

    actions = world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[2], program_id="p")))
    # Each function once per executor site, then its template and one run for the island; all program traffic.
    assert len(sent(actions, RegisterFunction)) == 2 * 4  # two functions, on each of the slice's four devices
    assert len(sent(actions, InstallTemplate)) == 1
    assert len(sent(actions, RunTemplate)) == 1 and all(a.dispatch for a in actions if isinstance(a, Send))
    assert world.ask(CLIENT, QueryBuffers(buffers=[1, 2])) == BuffersState(ready=[True, False])
    wait = world.ask(CLIENT, AwaitBuffers(buffers=[2]))
    assert isinstance(wait, Wait) and not wait.buffers[0].done

    reports = world.executors(actions)  # each executor reports both nodes at once (the chain ran together)
    assert len({d.executor_id for d in reports}) == 2
    for done in reports[:-1]:  # the output waits for its every executor
        assert not any(isinstance(a, Resolve) for a in world.handle(Inbound(b"ex", done)))
    last = world.handle(Inbound(b"ex", reports[-1]))
    resolved = [a.buffer for a in last if isinstance(a, Resolve)]
    assert wait.buffers[0] in resolved and settled(wait.buffers) is None
    assert not world.proxy.runs  # finished: the intermediate value is deleted, the output kept
    # One message to the island's scheduler, which sends each executor holding it its DeleteShards.
    (free,) = sent(last, FreeShards)
    assert free.to == SCHEDULER and not sent(last, DeleteShards)
    (group,) = free.message.groups
    assert len(group.buffers) == 1 and group.buffers[0].startswith(f"{sid}/")
    assert len(group.controls) == 2 and set(group.controls) <= set(world.controls)
    assert world.ask(CLIENT, QueryBuffers(buffers=[2])) == BuffersState(ready=[True])

    fetching = world.ask(CLIENT, Fetch(buffer=2))
    assert isinstance(fetching, Fetching)
    assert [key for _, key in sources(sid, fetching.buffer)] == fetching.buffer.keys(sid)
    assert world.handle(Inbound(CLIENT, ReleaseBuffers(buffers=[2]))) == []  # pinned by the fetch: kept
    freed = world.handle(FetchEnded(fetching.session_id, fetching.buffer))
    assert freed_buffers(freed) == {f"{sid}/{fetching.buffer.name}"}

    again = world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[3], program_id="p")))
    assert not sent(again, RegisterFunction)  # registered once per site, for every later run
    # Every action carries the id of the event that caused it, and the event log has that event (summarised).
    (stimulus,) = {a.stimulus for a in again if isinstance(a, Send)}
    assert stimulus.startswith("proxy.run_program-")
    (line,) = [line for line in world.proxy.events.lines() if f" {stimulus} " in line]
    assert "Inbound(proxy.run_program from " in line and f"-> {len(again)} actions" in line
    with pytest.raises(NotFound, match="buffer 2 does not exist"):
        world.ask(CLIENT, QueryBuffers(buffers=[2]))


def test_a_gang_goes_once_to_each_of_its_executors_and_again_to_a_new_process() -> None:
    """Issue #30 item 3: an SPMD program spanning executors names its gang by id; the devices go once per
    executor and slice version (``RegisterGang``), not in every run's parts."""
    world = World(group="island-0")
    _, slice_id = world.open()
    fns = [world.function(CLIENT, slice_id, name, spmd=True) for name in (b"f", b"g")]
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    world.handle(Inbound(CLIENT, RegisterProgram(program_id="p", program=chain(fns, slice_id))))

    def run(output: int) -> list[Any]:
        actions = world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[output],
                                                          program_id="p")))
        for done in world.executors(actions):
            world.handle(Inbound(b"ex", done))
        return actions

    first = run(2)
    gangs = sent(first, RegisterGang)
    (gang_id,) = {a.message.gang_id for a in gangs}  # both nodes run over the slice: one gang
    controls = {loc.control for loc in world.proxy.sessions[CLIENT].slices[slice_id].devices}
    assert sorted(a.to for a in gangs) == sorted(controls), "once to each of its executors"
    mesh = [(r.executor_id, r.first + k) for r in gangs[0].message.devices for k in range(r.count)]
    assert mesh == [(d.executor_id, d.device) for d in world.proxy.sessions[CLIENT].slices[slice_id].devices]
    assert first.index(gangs[-1]) < first.index(sent(first, RunTemplate)[0]), "sent before the run"
    (schedule,) = sent(first, InstallTemplate)
    comps = [c for part in schedule.message.parts
             for c in unpack_records(part.computations, Computation, "test")]
    assert comps and all(c.gang == gang_id for c in comps), "the computations carry its id only"

    assert sent(run(3), RegisterGang) == [], "not again for a later run"
    victim = gangs[0].to
    world.handle(Notice(ExecutorJoined(executor_id=world.controls[victim], control=victim, island=0,
                                       group="island-0", fresh=True)))  # a new process there: it knows none
    again = sent(run(4), RegisterGang)
    assert [(a.to, a.message.gang_id) for a in again] == [(victim, gang_id)], "again, to the new process only"


def test_a_refused_run_fails_its_outputs_with_the_cause(world: World) -> None:
    _, slice_id = world.open()
    fn = world.function(CLIENT, slice_id, b"f")
    program = chain([fn], slice_id)
    actions = world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=99)], outputs=[5], program=program)))
    (reply,) = actions
    assert isinstance(reply, Reply) and isinstance(reply.error, NotFound)
    wait = world.ask(CLIENT, AwaitBuffers(buffers=[5]))
    assert wait.buffers[0].done and settled(wait.buffers) is reply.error
    with pytest.raises(InvalidArgument, match="positive"):
        world.ask(b"other", OpenSession(name="x", weight=0))


def silence(world: World, victim: str) -> None:
    """The RM's core finds ``victim`` silent (the scheduler and the other executors beat) at t = 12 s."""
    world.now = 5.0
    world.rm.ask(Heartbeat(role="scheduler", name="sched-0"), world.now)
    for e in world.controls.values():
        if e != victim:
            world.rm.ask(Heartbeat(role="executor", name=e), world.now)
    world.now = 12.0
    assert world.rm.expire(world.now) == [victim]


def test_a_failure_in_a_run_with_a_gang_aborts_it_at_once_with_its_cause() -> None:
    """A run with a gang is aborted at the first failure its scheduler reports: its output fails with the
    failure's own cause, its input is let go of (a reshape behind it goes on), and every executor of it is
    told to cancel it (one still in a collective its failed peer could not join is restarted to take its
    devices back). Before, it waited for the island's end, which never came if a peer waited in a collective."""
    world = World(group="island-0")
    _, slice_id = world.open()  # 4 devices: two executors of one JAX group
    fn = world.function(CLIENT, slice_id, b"f", spmd=True)
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    actions = world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[2],
                                                      program=chain([fn], slice_id))))
    assert sent(actions, RegisterGang), "a gang over the slice's two executors"
    (run,) = runs_sent(actions)
    run_id = run.message.run_id
    executors = set(world.proxy.runs[run_id][1].executors)
    wait = world.ask(CLIENT, AwaitBuffers(buffers=[2]))
    cause = NotFound("object s/b1.0/0 was deleted")
    out = world.handle(Inbound(b"sched", IslandDone(run_id=run_id, scheduler=SCHEDULER, nodes=[0],
                                                    executor_id="ex0", error=ErrorInfo.of(cause))))
    assert {a.to for a in sent(out, CancelRun)} == executors and len(executors) == 2
    assert isinstance(settled(wait.buffers), NotFound) and "was deleted" in str(settled(wait.buffers))
    assert not world.proxy.runs
    assert world.proxy.sessions[CLIENT].buffers[1].pins == 0, "its input is let go of"


def test_losing_an_executor_mid_run_fails_the_run_and_what_lived_there(world: World) -> None:
    _, slice_id = world.open()
    fn = world.function(CLIENT, slice_id, b"f")
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    actions = world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[2],
                                                      program=chain([fn], slice_id))))
    wait = world.ask(CLIENT, AwaitBuffers(buffers=[2]))
    reports = world.executors(actions)
    victim = reports[0].executor_id
    survivor = next(e for e in world.controls.values() if e != victim and e in {d.executor_id for d in reports})
    world.handle(Inbound(b"ex", reports[1] if reports[1].executor_id == survivor else reports[0]))
    silence(world, victim)  # and the RM says so with the slice's new map
    out = world.notices()
    (lost,) = [a for a in out if isinstance(a, PeerLost)]
    assert world.controls[lost.control] == victim and isinstance(lost.error, DeviceLost)
    assert wait.buffers[0].done and isinstance(settled(wait.buffers), DeviceLost)
    assert any(isinstance(a, Resolve) and a.buffer is wait.buffers[0] for a in out)
    # The survivors drop the run; nothing is sent to the dead host, ever again.
    cancels = sent(out, CancelRun)
    assert cancels and all(world.controls[a.to] != victim for a in cancels)
    assert all(world.controls.get(a.to) != victim for a in out if isinstance(a, Send))
    assert not world.proxy.runs
    with pytest.raises(DeviceLost, match=victim):
        world.ask(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[3], program=chain([fn], slice_id)))
    # The slice itself was remapped onto live devices: a new buffer lands on them only.
    assert world.ask(CLIENT, PutBuffer(buffer=4, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()


def test_an_executor_back_from_a_stall_makes_its_buffers_whole_and_has_the_rest_deleted(world: World) -> None:
    """Issue #28 item 2: a host declared lost while it stalled comes back with what it held."""
    sid, slice_id = world.open()
    for cid in (1, 5):
        assert world.ask(CLIENT, PutBuffer(buffer=cid, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    session = world.proxy.sessions[CLIENT]
    kept, released = session.buffers[1], session.buffers[5]
    victim = kept.locations[0].executor_id
    silence(world, victim)
    world.notices()
    assert isinstance(kept.lost, DeviceLost)
    world.handle(Inbound(CLIENT, ReleaseBuffers(buffers=[5])))  # while its host is away: deleted on its return
    # It comes back: the RM says it was declared lost; it registers as a new executor, keeping what it held.
    info = dataclasses.replace(world.rm.executors[victim], fresh=True, incarnation="after-the-stall")
    assert world.rm.ask(Heartbeat(role="executor", name=victim), world.now).written_off
    world.rm.ask(RegisterExecutor(info=info), world.now)
    (inventory,) = [a for a in world.notices() if isinstance(a, Inventory)]
    assert world.controls[inventory.control] == victim
    here = [i for i, loc in enumerate(kept.locations) if loc.executor_id == victim]
    keys = [f"{sid}/{kept.name}/{i}" for i in here] + [f"{sid}/{released.name}/{i}" for i in here]
    keys.append(f"{sid}/t99/0")  # made by a run aborted while it was away
    out = world.handle(Inventoried(inventory.control, victim, keys))
    assert kept.lost is None, "whole again: every shard it had there is there"
    (delete,) = sent(out, DeleteShards)
    assert delete.to == inventory.control and delete.message.buffers == sorted([f"{sid}/{released.name}",
                                                                                 f"{sid}/t99"])
    assert world.ask(CLIENT, QueryBuffers(buffers=[1])) == BuffersState(ready=[True])


def test_a_cached_runs_temporaries_are_names_live_while_it_runs_and_freed_with_it(world: World) -> None:
    """A run of a cached lowering keeps its temporaries as names, not a buffer each (``Run.named_temps``): an
    executor's inventory meanwhile keeps them, and the run's end frees them with its other buffers."""
    sid, slice_id = world.open()
    fns = [world.function(CLIENT, slice_id, name) for name in (b"f", b"g", b"h")]
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    world.handle(Inbound(CLIENT, RegisterProgram(program_id="p", program=chain(fns, slice_id))))
    session = world.proxy.sessions[CLIENT]
    seen: list[str] = []
    for out in (2, 3):  # the first run, then a warm one
        actions = world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[out],
                                                          program_id="p")))
        ((_, run),) = world.proxy.runs.values()
        names = [name for _, _, group in run.named_temps for name in group]
        assert len(names) == 2 and not run.temporaries and not set(names) & set(seen)  # fresh names a run
        seen += names
        control = next(iter(world.controls))
        stale = f"{sid}/t999"
        kept = world.handle(Inventoried(control, world.controls[control], [f"{sid}/{n}/0" for n in names] + [f"{stale}/0"]))
        (delete,) = sent(kept, DeleteShards)
        assert delete.message.buffers == [stale], "the run's own temporaries are live while it runs"
        done: list[Any] = []
        for report in world.executors(actions):
            done += world.handle(Inbound(b"ex", report))
        freed = freed_buffers(done)
        assert freed >= {f"{sid}/{n}" for n in names} and f"{sid}/{session.buffers[out].name}" not in freed
        assert not world.proxy.runs


def test_a_value_whose_completion_was_on_its_way_when_its_host_was_lost_is_whole_again(world: World) -> None:
    """The race tests/faults/test_partition.py lost to, one run in three: a run's result had been fetched (early,
    from the executor) but its completion had not reached the proxy when the host's link went down; the run was
    failed with the loss, and its output stayed failed after the host came back holding every shard of it. Now an
    output failed by that loss alone, made only on that host, is whole again if the host holds all of it."""
    sid, slice_id = world.open(devices=2)
    fn = world.function(CLIENT, slice_id, b"double")
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    program = ProgramSpec(values=[ValueSpec(shape=[8, 2], dtype="float32", shards=2) for _ in range(2)],
                          nodes=[NodeSpec(fn_id=fn, slice_id=slice_id, inputs=[0], outputs=[1])], inputs=[0], outputs=[1])
    world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[2], program=program)))
    session = world.proxy.sessions[CLIENT]
    out = session.buffers[2]
    victims = {loc.executor_id for loc in out.locations}
    assert len(victims) == 1, "the test wants a value made on one host"
    (victim,) = victims
    silence(world, victim)  # lost before any NodeDone came
    world.notices()
    assert isinstance(out.error, DeviceLost) and out.error is out.lost
    info = dataclasses.replace(world.rm.executors[victim], fresh=True, incarnation="after-the-stall")
    assert world.rm.ask(Heartbeat(role="executor", name=victim), world.now).written_off
    world.rm.ask(RegisterExecutor(info=info), world.now)
    (inventory,) = [a for a in world.notices() if isinstance(a, Inventory)]
    keys = [f"{sid}/{b.name}/{i}" for b in (session.buffers[1], out) for i in range(len(b.locations))]
    world.handle(Inventoried(inventory.control, victim, keys))
    assert out.error is None and out.lost is None
    assert world.ask(CLIENT, QueryBuffers(buffers=[2])) == BuffersState(ready=[True])


def test_a_vanished_client_is_ended_and_its_runs_cancelled(world: World) -> None:
    _, slice_id = world.open()
    fn = world.function(CLIENT, slice_id, b"f")
    actions = world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(array=np.ones((8, 2), np.float32))],
                                                      outputs=[2], program=chain([fn], slice_id))))
    executors = {a.to for a in sent(actions, PutShards)}
    world.now = 31.0
    out = world.handle(Tick())
    assert {a.to for a in sent(out, CancelRun)} == executors
    assert sent(out, ReleaseSlices) and not world.proxy.runs and not world.proxy.sessions
    # A completion that was on its way when the session ended is ignored.
    for done in world.executors(actions):
        assert world.handle(Inbound(b"ex", done)) == []


def test_a_drain_remaps_the_slice_and_moves_its_live_buffers(world: World) -> None:
    sid, slice_id = world.open(devices=2)
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((4, 2), np.float32))) == Ok()
    (held,) = world.proxy.sessions[CLIENT].buffers.values()
    old = held.locations[0]
    started = world.rm.ask(DrainExecutor(executor=old.executor_id), world.now)
    assert started.remapped == 1
    out = world.notices()
    moves = sent(out, SendShards)
    assert moves and all(a.to == old.control and a.message.prefix == f"{sid}/{held.name}" for a in moves)
    assert all(loc.executor_id != old.executor_id for loc in held.locations)
    # The copies on the draining host go once every shard it held has moved.
    assert [a.to for a in sent(out, DeleteShards)] == [old.control]
    assert world.proxy.moved_buffers == 1


def test_sequential_dispatch_sends_each_node_once_its_inputs_are_done(world: World) -> None:
    _, slice_id = world.open()
    fns = [world.function(CLIENT, slice_id, name) for name in (b"f", b"g", b"h")]
    actions = world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(array=np.ones((8, 2), np.float32))],
                                                      outputs=[9], program=chain(fns, slice_id), sequential=True)))
    for node in range(3):
        scheduled = sent(actions, ScheduleRun)
        assert len(scheduled) == 1 and scheduled[0].message.run_id.endswith(f"#{node}")
        reports = world.executors(actions)
        assert {n for d in reports for n in d.nodes} == {node}
        actions = []
        for done in reports:
            actions += world.handle(Inbound(b"ex", done))
    assert not sent(actions, ScheduleRun) and not world.proxy.runs
    assert world.ask(CLIENT, QueryBuffers(buffers=[9])) == BuffersState(ready=[True])


def test_completions_from_a_client_connection_are_refused(world: World) -> None:
    world.open()
    with pytest.raises(PwmeshError, match="executors"):
        world.ask(CLIENT, NodeDone(run_id="r", nodes=[0], executor_id="ex0"))
    assert world.ask(CLIENT, CloseSession()) == Ok()
    assert not world.proxy.sessions


def test_a_report_of_a_closed_sessions_run_is_dropped_quietly_and_an_unknown_run_is_logged(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    """A client that fetched its values (an early fetch's reply leaves the executor before its part's end) and
    closed its session: the completions still on their way are nobody's business. A live session's unknown
    run is still a warning."""
    sid, _ = world.open()
    assert world.ask(CLIENT, CloseSession()) == Ok()
    with caplog.at_level(logging.WARNING, logger="pwmesh.proxy.state"):
        assert world.handle(Inbound(b"ex", NodeDone(run_id=f"{sid}:7-abcd", nodes=[0], executor_id="ex0"))) == []
        assert caplog.records == []
        other, _ = world.open()
        world.handle(Inbound(b"ex", NodeDone(run_id=f"{other}:7-abcd", nodes=[0], executor_id="ex0")))
    assert [r.getMessage() for r in caplog.records] == [f"completion for unknown run {other}:7-abcd from ex0"]


def test_an_executor_that_left_cleanly_is_no_warning_and_one_lost_with_values_is(
        world: World, caplog: pytest.LogCaptureFixture) -> None:
    """A drained executor leaving (a clean stop) is logged at INFO; one lost with a live buffer on it, at
    WARNING, saying what went with it."""
    _, slice_id = world.open()
    assert world.ask(CLIENT, PutBuffer(buffer=7, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    held = {loc.executor_id for loc in world.proxy.session(CLIENT).buffers[7].locations}
    idle = next(e for e in ("ex0", "ex1", "ex2") if e not in held)
    with caplog.at_level(logging.INFO, logger="pwmesh.proxy.state"):
        world.handle(Notice(ExecutorLost(executor_id=idle, host="h", control=f"tcp://{idle}:7000", reason="drained",
                                         graceful=True)))
        assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
            ("INFO", f"executor {idle} on host h is gone (drained)")]
        caplog.clear()
        gone = sorted(held)[0]
        world.handle(Notice(ExecutorLost(executor_id=gone, host="h", control=f"tcp://{gone}:7000", reason="drained",
                                         graceful=True)))
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", f"executor {gone} on host h is gone (drained): 1 buffer(s) and run(s) lost with it")]


def test_an_executor_lost_notice_for_an_unknown_run_changes_nothing_else(world: World) -> None:
    world.open()
    out = world.handle(Notice(ExecutorLost(executor_id="ex2", host="host2", control="tcp://ex2:7000", reason="test")))
    assert [type(a) for a in out] == [PeerLost]
    assert world.proxy.lost_controls == {"tcp://ex2:7000"}


def test_a_program_too_big_for_one_message_is_refused_whole(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 330,000-node program once packed into a ScheduleRun over the 64 MiB message limit, which the
    scheduler dropped unread: the run hung. The proxy now refuses it before it sends anything, and its
    outputs fail with the reason. (The limit is made small here: the real one needs ~10^5 nodes.)"""
    monkeypatch.setattr(state_module, "MAX_PART_BYTES", 64)
    _, slice_id = world.open()
    fns = [world.function(CLIENT, slice_id, name) for name in (b"f", b"g")]
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    actions = world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[2],
                                                      program=chain(fns, slice_id))))
    (reply,) = actions
    assert isinstance(reply, Reply) and isinstance(reply.error, ResourceExhausted)
    assert "one message may carry" in reply.error.message
    assert sent(actions, ScheduleRun) == [] and sent(actions, RegisterFunction) == [], "nothing half-sent"
    wait = world.ask(CLIENT, AwaitBuffers(buffers=[2]))
    assert wait.buffers[0].done and settled(wait.buffers) is reply.error


def test_a_message_over_the_limit_is_never_encoded() -> None:
    with pytest.raises(ProtocolError, match="was not sent"):
        encode(RegisterFunction(fn_id="f", exported=b"x" * (65 << 20), spmd=False, devices=[0]), msg_id=1)


def test_a_big_program_is_lowered_off_the_loop_and_then_runs(world: World) -> None:
    """Past ``lower_off_loop_nodes`` a program not lowered yet comes back as a job for the shell's thread:
    nothing is sent and nothing recorded until its template is in, then the same request runs as any
    other, and its next run finds the template (no job)."""
    world.proxy.lower_off_loop_nodes = 2
    _, slice_id = world.open()
    fns = [world.function(CLIENT, slice_id, name) for name in (b"f", b"g")]
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    run = Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[2], program=chain(fns, slice_id),
                                     program_id="p"))
    (deferred,) = world.handle(run)
    assert isinstance(deferred, LowerOffLoop)
    assert world.proxy.programs == 0 and world.proxy.runs == {} and 2 not in world.proxy.sessions[CLIENT].buffers
    other = world.ask(b"client-2", OpenSession(name="other"))  # the loop serves others meanwhile
    assert isinstance(other, SessionOpened)
    deferred.job.run()  # the shell's thread
    assert world.handle(Lowered(CLIENT, deferred.session_id, deferred.job)) == []
    actions = world.handle(run)
    assert len(runs_sent(actions)) == 1 and world.proxy.programs == 1
    for done in world.executors(actions):
        world.handle(Inbound(b"", done))
    assert world.ask(CLIENT, AwaitBuffers(buffers=[2])).buffers[0].done
    again = world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=2)], outputs=[3],
                                                    program=chain(fns, slice_id), program_id="p")))
    assert not any(isinstance(a, LowerOffLoop) for a in again) and len(runs_sent(again)) == 1


def test_a_program_that_fails_to_lower_off_the_loop_fails_its_outputs(world: World) -> None:
    world.proxy.lower_off_loop_nodes = 1
    _, slice_id = world.open()
    fn = world.function(CLIENT, slice_id, b"f")
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    bad = chain([fn], slice_id)
    bad.nodes[0].slice_id = slice_id + 100  # no such slice: lowering fails
    run = Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[2], program=bad, program_id="q"))
    (deferred,) = world.handle(run)
    deferred.job.run()
    assert deferred.job.error is not None
    world.handle(Lowered(CLIENT, deferred.session_id, deferred.job))
    (reply,) = world.handle(run)
    assert isinstance(reply, Reply) and reply.error is deferred.job.error
    assert world.ask(CLIENT, AwaitBuffers(buffers=[2])).buffers[0].done
    assert sent([], ScheduleRun) == [] and world.proxy.runs == {}


def test_a_program_in_parts_is_assembled_in_order_and_checked_against_max_nodes_as_it_comes(world: World) -> None:
    """``RegisterProgram.parts``: what the client library sends for a big program (``PROGRAM_PART_ITEMS``)."""
    _, slice_id = world.open()
    fns = [world.function(CLIENT, slice_id, name) for name in (b"f", b"g", b"h", b"k")]
    program = chain(fns, slice_id)
    parts = [ProgramSpec(values=program.values[:2], nodes=program.nodes[:1], inputs=[], outputs=[]),
             ProgramSpec(values=program.values[2:], nodes=program.nodes[1:], inputs=program.inputs,
                         outputs=program.outputs)]
    assert world.handle(Inbound(CLIENT, RegisterProgram(program_id="p", program=parts[0], part=0, parts=2))) == []
    assert "p" not in world.proxy.sessions[CLIENT].programs, "not before its last part"
    assert world.handle(Inbound(CLIENT, RegisterProgram(program_id="p", program=parts[1], part=1, parts=2))) == []
    assert world.proxy.sessions[CLIENT].programs["p"] == program
    with pytest.raises(InvalidArgument, match="part 1 of 2 came where part 0 was due"):
        world.ask(CLIENT, RegisterProgram(program_id="q", program=parts[1], part=1, parts=2))
    world.proxy.policy = TenantPolicy({"*": TenantLimits(max_nodes=2)})
    big = chain([fns[0]] * 3, slice_id)
    halves = [ProgramSpec(values=big.values[:2], nodes=big.nodes[:2], inputs=[], outputs=[]),
              ProgramSpec(values=big.values[2:], nodes=big.nodes[2:], inputs=big.inputs, outputs=big.outputs)]
    for k, half in enumerate(halves):
        assert world.handle(Inbound(CLIENT, RegisterProgram(program_id="big", program=half, part=k, parts=2))) == []
    with pytest.raises(ResourceExhausted, match="more than 2 computations"):
        world.ask(CLIENT, RunProgram(inputs=[ProgramInput(array=np.ones((8, 2), np.float32))], outputs=[9],
                                     program_id="big"))
    assert not world.proxy.sessions[CLIENT].arriving, "nothing held of what was refused"


def test_one_fetch_of_several_buffers_pins_them_all_or_none() -> None:
    """``FetchBuffers`` (``pw.get`` of many small values): every buffer is looked up before any is pinned, so a
    request naming one that does not exist fails whole and leaves the others as they were."""
    world = World()
    _, slice_id = world.open()
    for cid in (1, 2):
        assert world.ask(CLIENT, PutBuffer(buffer=cid, slice_id=slice_id, array=np.full((8, 2), cid, np.float32))) == Ok()
    session = world.proxy.sessions[CLIENT]
    with pytest.raises(NotFound, match="buffer 9 does not exist"):
        world.ask(CLIENT, FetchBuffers(buffers=[1, 9, 2]))
    assert [session.buffers[cid].pins for cid in (1, 2)] == [0, 0]
    with pytest.raises(InvalidArgument, match="names no buffer"):
        world.ask(CLIENT, FetchBuffers(buffers=[]))

    both = world.ask(CLIENT, FetchBuffers(buffers=[2, 1]))
    assert isinstance(both, FetchingAll)
    assert [f.buffer for f in both.fetches] == [session.buffers[2], session.buffers[1]]
    assert world.handle(Inbound(CLIENT, ReleaseBuffers(buffers=[1, 2]))) == []  # pinned by the fetch: kept
    freed = world.handle(FetchEnded(both.fetches[0].session_id, both.fetches[0].buffer))
    freed += world.handle(FetchEnded(both.fetches[1].session_id, both.fetches[1].buffer))
    assert freed_buffers(freed) == {f"{both.fetches[0].session_id}/{f.buffer.name}" for f in both.fetches}
