"""Elastic slices (issue #31, item 3): a slice suspended gives its devices to others, resumed it takes
devices again (other hosts, if others took its own) with its arrays moved there, reshaped it goes on on
another number of devices; an admin suspends and resumes another tenant's session. Real daemons; the
resource manager's side also as its pure core."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from jax.sharding import PartitionSpec as P
from rm_driver import DrivenRM
from test_placement import allocate, started
from test_proxy_state import CLIENT, World, chain, sent
from test_readme import block_under
from test_tenants import key_dirs, keyed, raw, status  # noqa: F401 - fixtures, used by name

import pwmesh as pw
from helpers import eventually, last_event, slow
from pwmesh.cli.commands import fetch_status
from pwmesh.cli.main import main
from pwmesh.errors import NoSession
from pwmesh.proxy.state import (
    MAX_PARKED_PER_SESSION,
    SETTLE_WAIT_SECONDS,
    Ask,
    FetchEnded,
    Inbound,
    Park,
    Reply,
    SlicesPlaced,
    Tick,
    Unpark,
)
from pwmesh.wire import Message
from pwmesh.wire.messages import (
    BuffersState,
    CloseSession,
    DeleteShards,
    Fetch,
    FreeShards,
    Ok,
    ProgramInput,
    PutBuffer,
    QueryBuffers,
    RegrantSlices,
    ResumeSlices,
    ResumeSuspended,
    RunProgram,
    SendShards,
    Sharding,
    SliceInfo,
    SlicesChanged,
    SlicesUpdated,
    SuspendSession,
    SuspendSlices,
    VacateSlices,
)

STEPS = 12  # 3 on 4 devices, 3 after a resume on other hosts, 3 on 2 devices, 3 on 4 again
LEARNING_RATE = 0.1


# ----------------------------------------------------------------- the resource manager's core


def _ask(state: DrivenRM, message: VacateSlices | RegrantSlices) -> list[SliceInfo]:
    reply = state.ask(message, now=0.0)
    assert isinstance(reply, SlicesUpdated)
    return reply.slices


def test_a_suspended_slice_frees_its_devices_and_is_placed_anew_when_resumed() -> None:
    state = started(islands=1, hosts=2, devices=2)
    low = allocate(state, "low", 2)
    held = [(d.executor_id, d.device) for d in low.devices]
    (suspended,) = _ask(state, VacateSlices(owner="low", slice_ids=[low.slice_id]))
    assert suspended.suspended and all(state.load().get(ref, 0) == 0 for ref in held)
    high = allocate(state, "high", 2)  # the freed devices are the least loaded: the high tenant gets them
    assert [(d.executor_id, d.device) for d in high.devices] == held
    assert state.snapshot().slices[0].suspended  # what a restarted proxy hands back says so too

    (back,) = _ask(state, RegrantSlices(owner="low", slice_ids=[low.slice_id]))
    assert back.slice_id == low.slice_id and not back.suspended and len(back.devices) == 2
    assert not {(d.executor_id, d.device) for d in back.devices} & set(held)  # on the other host
    version = back.map_version
    (smaller,) = _ask(state, RegrantSlices(owner="low", slice_ids=[low.slice_id], devices=1))
    assert len(smaller.devices) == 1 and smaller.map_version > version

    with pytest.raises(pw.NotFound, match="not one of high's"):
        state.ask(VacateSlices(owner="high", slice_ids=[low.slice_id]), now=0.0)
    with pytest.raises(pw.ResourceExhausted):
        state.ask(RegrantSlices(owner="low", slice_ids=[low.slice_id], devices=5), now=0.0)
    assert len(state.slices[low.slice_id].devices) == 1  # a refused reshape changes nothing


def test_a_suspended_slice_is_not_remapped_when_its_host_is_lost() -> None:
    state = started(islands=1, hosts=2, devices=2)
    low = allocate(state, "low", 2)
    _ask(state, VacateSlices(owner="low", slice_ids=[low.slice_id]))
    assert state.expire(now=100.0)  # every executor silent: lost
    assert state.slices[low.slice_id].suspended and not state.slices[low.slice_id].broken


# ----------------------------------------------------------------- the proxy's core


def _placed(world: World, peer: bytes, message: Message, ask: Ask | None = None) -> tuple[SlicesChanged, list[Any]]:
    """A client's or admin's request whose Ask (``ask``: the one its ``Unpark`` gave, if it was parked) the RM
    answers (as the proxy's shell does): the reply, and every action along the way."""
    if ask is None:
        actions = world.handle(Inbound(peer, message))
        (ask,) = [a for a in actions if isinstance(a, Ask)]
    reply = world.rm.ask(ask.message, world.now)
    assert isinstance(reply, SlicesUpdated)
    out = world.handle(SlicesPlaced(ask.peer, reply.slices, ask.reshape))
    (answer,) = [a for a in out if isinstance(a, Reply)]
    assert answer.error is None and isinstance(answer.message, SlicesChanged)
    return answer.message, out


def test_the_proxy_refuses_a_suspended_slice_and_copies_its_buffers_when_it_is_reshaped() -> None:
    world = World()
    sid, slice_id = world.open(devices=2)
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((4, 2), np.float32))) == Ok()
    before = world.proxy.sessions[CLIENT].buffers[1]
    changed, _ = _placed(world, CLIENT, SuspendSlices(slice_ids=[slice_id]))
    assert changed.slices[0].suspended and world.proxy.sessions[CLIENT].slices[slice_id].suspended
    fn = world.function(CLIENT, slice_id, b"f")
    run = RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[2], program=chain([fn], slice_id, rows=4))
    with pytest.raises(pw.SliceSuspended, match=f"slice {slice_id} is suspended"):
        world.ask(CLIENT, run)
    with pytest.raises(pw.SliceSuspended, match="put was not made"):
        world.ask(CLIENT, PutBuffer(buffer=3, slice_id=slice_id, array=np.ones((4, 2), np.float32)))
    with pytest.raises(pw.InvalidArgument, match="does not have 4 devices"):
        world.ask(CLIENT, ResumeSlices(slice_ids=[slice_id], devices=4, mesh=[2]))

    pinned = world.ask(CLIENT, Fetch(buffer=1))  # a fetch under way: nothing moves under it, the reshape waits
    reshape = ResumeSlices(slice_ids=[slice_id], devices=4, mesh=[4], buffers=[1],
                           shardings=[Sharding(mesh=[4], spec=[[0]])])
    (park,) = world.handle(Inbound(CLIENT, reshape))
    assert isinstance(park, Park)
    assert not [a for a in world.handle(Tick()) if isinstance(a, Unpark)]  # still read
    (unpark,) = [a for a in world.handle(FetchEnded(pinned.session_id, pinned.buffer)) if isinstance(a, Unpark)]
    assert unpark.key == park.key and unpark.error is None and unpark.ask is not None

    changed, out = _placed(world, CLIENT, reshape, unpark.ask)
    assert len(changed.slices[0].devices) == 4 and not changed.slices[0].suspended
    after = world.proxy.sessions[CLIENT].buffers[1]
    assert after is not before and after.name != before.name and after.spec.shards == 4
    assert [loc.executor_id for loc in after.locations] == [d.executor_id for d in changed.slices[0].devices]
    moves = sent(out, SendShards)  # from each executor holding it, cut to the new layout, under the new name
    assert {a.to for a in moves} == {loc.control for loc in before.locations}
    assert all(a.message.emits[0].targets[0].prefix == f"{sid}/{after.name}" for a in moves)
    deleted = sent(out, DeleteShards)  # the old copies, right behind the sends
    assert {p for a in deleted for p in a.message.buffers} == {f"{sid}/{before.name}"}
    assert out.index(deleted[0]) > max(out.index(m) for m in moves)
    assert world.ask(CLIENT, QueryBuffers(buffers=[1])) == BuffersState(ready=[True])


def test_an_array_moved_off_several_executors_is_deleted_behind_each_holder_s_send_on_the_same_connection() -> None:
    """The old copies go straight to each holder, right behind its ``SendShards``, never as a ``FreeShards``
    through the island's scheduler: that reaches the executor from another peer, with no order against the
    proxy's send, and an executor that read the delete first had nothing to send (the copy failed,
    ``NotFound`` "was deleted", or the next step's collective waited for a member that had failed: a 30 s
    hang in the README's example on a busy machine, found under load)."""
    world = World()
    sid, slice_id = world.open(devices=4)  # two executors of two devices
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((8, 2), np.float32),
                                       sharding=Sharding(mesh=[4], spec=[[0]]))) == Ok()
    before = world.proxy.sessions[CLIENT].buffers[1]
    holders = {loc.control for loc in before.locations}
    assert len(holders) == 2
    _placed(world, CLIENT, SuspendSlices(slice_ids=[slice_id]))
    _, out = _placed(world, CLIENT, ResumeSlices(slice_ids=[slice_id], devices=4, mesh=[4], buffers=[1],
                                                 shardings=[Sharding(mesh=[4], spec=[[0]])]))
    assert not sent(out, FreeShards), "not through the scheduler"
    for holder in holders:
        mine = [a for a in out if getattr(a, "to", None) == holder and isinstance(a.message, SendShards | DeleteShards)]
        assert [type(a.message) for a in mine] == [SendShards, DeleteShards], holder
        assert mine[1].message.buffers == [f"{sid}/{before.name}"]


def test_a_resume_waits_for_its_arrays_to_be_let_go_of_for_a_bounded_time() -> None:
    """A run or fetch holding a slice's array parks a resume (the shell answers it when its ``Unpark`` comes);
    one still held after ``SETTLE_WAIT_SECONDS`` fails saying why, and one whose session ends fails too; a session
    has at most ``MAX_PARKED_PER_SESSION`` waiting (each is checked after every event)."""
    world = World()
    _, slice_id = world.open(devices=2)
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((4, 2), np.float32))) == Ok()
    _placed(world, CLIENT, SuspendSlices(slice_ids=[slice_id]))
    world.ask(CLIENT, Fetch(buffer=1))  # read, and never let go of here
    (park,) = world.handle(Inbound(CLIENT, ResumeSlices(slice_ids=[slice_id])))
    assert isinstance(park, Park)
    world.now += SETTLE_WAIT_SECONDS - 1
    assert not [a for a in world.handle(Tick()) if isinstance(a, Unpark)]
    world.now += 1
    (unpark,) = [a for a in world.handle(Tick()) if isinstance(a, Unpark)]
    assert unpark.key == park.key and unpark.ask is None and isinstance(unpark.error, pw.Unavailable)
    assert "pw.Array 1 (computed, 1 pin(s), 1 reader(s), runs holding it: none; and 0 more)" in unpark.error.message
    assert "waited 30 s" in unpark.error.message
    assert not [a for a in world.handle(Tick()) if isinstance(a, Unpark)]  # answered once

    parks = [world.handle(Inbound(CLIENT, ResumeSlices(slice_ids=[slice_id])))[0] for _ in range(MAX_PARKED_PER_SESSION)]
    assert all(isinstance(p, Park) for p in parks)
    with pytest.raises(pw.ResourceExhausted, match="resumes waiting"):  # a bounded number waits
        world.ask(CLIENT, ResumeSlices(slice_ids=[slice_id]))
    ended = [a for a in world.handle(Inbound(CLIENT, CloseSession())) if isinstance(a, Unpark)]  # at once
    assert sorted(u.key for u in ended) == sorted(p.key for p in parks)
    assert all(isinstance(u.error, NoSession) for u in ended)


# ----------------------------------------------------------------- real daemons


@pytest.fixture
def two_hosts() -> Iterator[pw.LocalCluster]:
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=4, session_timeout_seconds=10.0)
    with pw.LocalCluster(spec) as c:
        yield c


def _data(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    return x, (x @ np.linspace(-1.0, 1.0, 8, dtype=np.float32)[:, None]).astype(np.float32)


def _train_step(w: jax.Array, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return w - LEARNING_RATE * grad, loss


def _uninterrupted() -> list[float]:
    w = jnp.zeros((8, 1), jnp.float32)
    losses = []
    step = jax.jit(_train_step)
    for i in range(STEPS):
        w, loss = step(w, *_data(i))
        losses.append(float(loss))
    return losses


def _timed(call: object) -> float:
    start = time.perf_counter()
    call()  # type: ignore[operator]
    return (time.perf_counter() - start) * 1e3


def _device_bytes(address: str, executors: set[str]) -> int:
    """The bytes the executors hold on their devices (what their memory limits count)."""
    return sum(s.bytes for s in fetch_status(address).executor_stats if s.executor_id in executors)


def test_training_suspended_resumed_elsewhere_and_reshaped_keeps_its_losses(two_hosts: pw.LocalCluster) -> None:
    """The issue's test: a loop suspended (its devices taken by another tenant), resumed on the other host,
    reshaped 4 -> 2 -> 4 devices, with the same ``pw.Array`` and ``pw.jit`` objects throughout, makes the
    losses of the uninterrupted run. The pauses are printed (``-s``)."""
    expected = _uninterrupted()
    with pw.Client(two_hosts.address, name="low") as low:
        sl = low.make_virtual_device_set().add_slice(devices=4, mesh={"data": 4})
        first_hosts = {d.executor for d in sl.devices}
        step = pw.jit(_train_step, devices=sl, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()))
        w = low.put(np.zeros((8, 1), np.float32), sl)
        losses: list[float] = []
        pauses: dict[str, float] = {}

        def run(steps: range) -> None:
            nonlocal w
            for i in steps:
                w, loss = step(w, *_data(i))
                losses.append(float(loss))

        run(range(0, 3))
        held = _device_bytes(two_hosts.address, first_hosts)
        assert held > 0
        pauses["suspend"] = _timed(sl.suspend)
        assert sl.suspended
        # Its buffers left the devices for host memory: the devices are free for the next tenant.
        eventually(lambda: _device_bytes(two_hosts.address, first_hosts) == 0, 20)
        with pytest.raises(pw.SliceSuspended, match=f"slice {sl.slice_id} is suspended"):
            step(w, *_data(3))
        with pytest.raises(pw.SliceSuspended, match="put was not made"):
            low.put(np.ones(4, np.float32), sl)
        before = np.asarray(w).copy()  # still readable where it waits
        handle = w

        with pw.Client(two_hosts.address, name="high", priority=10) as high:
            taken = high.make_virtual_device_set().add_slice(devices=4)
            assert {d.executor for d in taken.devices} == first_hosts  # the freed devices went to the other tenant
            pauses["resume"] = _timed(sl.resume)
            assert not sl.suspended and not {d.executor for d in sl.devices} & first_hosts  # on the other host
            assert w is handle
            handle._value = None  # read again: from where it was moved
            np.testing.assert_array_equal(np.asarray(w), before)
            run(range(3, 6))

            pauses["reshape 4->2"] = _timed(lambda: sl.reshape(2, mesh={"data": 2}))
            assert len(sl.devices) == 2 and sl.mesh == {"data": 2} and w.sharding.slice is sl
            assert w.sharding.mesh == {"data": 2}
            run(range(6, 9))
            pauses["reshape 2->4"] = _timed(lambda: sl.reshape(4, mesh={"data": 4}))
            assert len(sl.devices) == 4 and len(w.sharding.slice.devices) == 4
            # Its first step after a move waits for the copies (they travel behind the call's return), and
            # its function is exported again for the new mesh; the next is an ordinary step.
            pauses["first step after (loss read)"] = _timed(lambda: run(range(9, 10)))
            pauses["next step (loss read)"] = _timed(lambda: run(range(10, 11)))
            run(range(11, STEPS))
            np.testing.assert_allclose(losses, expected, rtol=1e-5)
        print("\nelastic slice pauses (ms, 1 island, 2 hosts x 4 CPU devices, 8x1 float32 weights):",
              {k: round(v, 1) for k, v in pauses.items()})


def test_reshape_keeps_specs_the_new_mesh_can_hold_and_replicates_the_rest(two_hosts: pw.LocalCluster) -> None:
    with pw.Client(two_hosts.address) as client:
        sl = client.make_virtual_device_set().add_slice(devices=4, mesh={"data": 2, "model": 2})
        value = np.arange(24.0, dtype=np.float32).reshape(4, 6)
        both = client.put(value, sl, P("data", "model"))
        odd = client.put(np.arange(6.0, dtype=np.float32), sl, P("data"))
        sl.reshape(3, mesh={"data": 3})
        assert both.sharding.spec == P() and odd.sharding.spec == P("data")  # "model" is gone; 6 splits by 3
        np.testing.assert_array_equal(np.asarray(both), value)
        np.testing.assert_array_equal(np.asarray(odd), np.arange(6.0))
        total = pw.jit(lambda a, b: a.sum() + b.sum(), devices=sl)(both, odd)
        assert float(total) == value.sum() + 15.0
        with pytest.raises(pw.InvalidArgument, match="has 2 devices, the slice asks for 3"):
            sl.reshape(3, mesh={"data": 2})


def test_a_resume_asked_while_a_run_computes_is_answered_once_the_run_has_ended(client: pw.Client) -> None:
    """The real shell's side of ``Park``: a resume that arrives while a run still makes the slice's array is
    answered, not refused, once the run's end reached the proxy, after the executor computed it."""
    sl = client.make_virtual_device_set().add_slice(devices=1)
    y = pw.pmap(slow, devices=sl)(np.ones(1))  # returns at once; computes for a while
    (info,) = sl.session.resume_slices([sl.slice_id])
    answered = time.monotonic()
    assert info.slice_id == sl.slice_id and not info.suspended
    executor = sl.devices[0].executor
    assert last_event(client.address, executor, "Completion") < answered
    assert np.isfinite(np.asarray(y)).all()


def test_an_admin_suspends_and_resumes_a_tenant_s_session(keyed: pw.LocalCluster,  # noqa: F811
                                                          key_dirs: dict[str, Path],  # noqa: F811
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``pwmesh suspend``/``resume``: an admin preempts a tenant; the tenant's runs fail with SliceSuspended
    meanwhile, and go on after, with its arrays. Another tenant's key may not do it."""
    with pw.Client(keyed.address, name="alice", keys=str(key_dirs["alice"])) as alice:
        sl = alice.make_virtual_device_set().add_slice(devices=1)
        a = alice.put(np.arange(4.0, dtype=np.float32), sl)
        double = pw.jit(lambda x: x * 2.0, devices=sl)
        np.testing.assert_array_equal(np.asarray(double(a)), np.arange(4.0) * 2.0)
        (session,) = [s.session_id for s in status(keyed.address, key_dirs["alice"]).sessions]

        bob = raw(keyed.address, key_dirs["bob"])
        try:
            for message in (SuspendSession(session_id=session), ResumeSuspended(session_id=session)):
                with pytest.raises(pw.PermissionDenied, match=f"{message.op} from bob"):
                    bob.request(message, timeout_seconds=10.0)
        finally:
            bob.close()

        # The admin's keys as the CLI reads them; set here, so that they leave with the test (``--keys`` sets
        # them in this process's environment for the command's connections, and would leak into later
        # tests' clusters).
        monkeypatch.setenv("PWMESH_KEYS", str(key_dirs["root"]))
        admin = ["--address", keyed.address]
        result = CliRunner().invoke(main, ["suspend", session, *admin])
        assert result.exit_code == 0, result.output
        assert f"session {session} suspended: 1 slice(s), 1 device(s) freed" in result.output
        with pytest.raises(pw.SliceSuspended, match="is suspended"):
            np.asarray(double(a))  # her client was not told: the proxy refuses the run
        np.testing.assert_array_equal(np.asarray(a), np.arange(4.0))  # her array waits, readable

        result = CliRunner().invoke(main, ["resume", session, *admin])
        assert result.exit_code == 0, result.output
        assert f"session {session} resumed: 1 slice(s)" in result.output
        np.testing.assert_array_equal(np.asarray(double(a)), np.arange(4.0) * 2.0)
        result = CliRunner().invoke(main, ["resume", session, *admin])
        assert result.exit_code != 0 and "has no suspended slice" in result.output


@pytest.mark.timeout(300)
def test_the_readme_example_runs_on_a_plain_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's "Elastic slices" snippet, as written, on the default embedded cluster (its 4-device
    slice spans two hosts of an island's JAX group)."""
    monkeypatch.delenv("PWMESH_ADDRESS", raising=False)  # its pw.connect() starts the embedded cluster
    scope: dict[str, object] = {}
    try:
        exec(compile(block_under("## Elastic slices"), "README.md", "exec"), scope)  # noqa: S102
        sl = scope["sl"]
        assert isinstance(sl, pw.Slice) and len(sl.devices) == 4 and not sl.suspended
        w = scope["w"]
        assert isinstance(w, pw.Array) and w.sharding.slice is sl
        first = float(np.mean(np.asarray(scope["y"]) ** 2))  # the loss at w = 0
        assert float(np.asarray(scope["loss"])) < first  # it learns, across the moves
    finally:
        pw.disconnect()
