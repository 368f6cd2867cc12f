"""Sessions that outlive their proxy (issue #28, item 1), in the proxy's pure core.

A proxy is "restarted" by making a new ``ProxyState`` with the same secret beside the same
resource manager core (which kept the slices); the executors are played by the test, which
answers ``ReclaimOwner`` with the keys an executor would hold. The shell's part (holding what
a client sends before it resumes) is tested with real daemons in ``tests/faults``.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_proxy_state import CLIENT, World, chain, runs_sent, sent

from pwmesh.errors import InvalidArgument, NotFound, PermissionDenied, Unavailable
from pwmesh.proxy.resume import resume_token
from pwmesh.proxy.state import Inbound, Inherited, ProxyState, Reclaim, Reclaimed, Reply, Tick
from pwmesh.wire.messages import (
    CreateSlice,
    DeleteShards,
    Heartbeat,
    Ok,
    OpenSession,
    OwnedShards,
    ProgramInput,
    PutBuffer,
    QueryBuffers,
    RegisterProgram,
    ReleaseSlices,
    ResumedBuffer,
    ResumeSession,
    RunProgram,
    SessionOpened,
    SessionResumed,
    ValueSpec,
)

SECRET = b"s" * 32
NEW = b"client-after-restart"
SPEC = ValueSpec(shape=[8, 2], dtype="float32", shards=4)


def restarted(world: World, now: float) -> ProxyState:
    """The proxy killed and started again: nothing of it survives but its secret and the RM's slices."""
    proxy = ProxyState(rm="tcp://rm:5000", address="tcp://proxy:5555", session_timeout_seconds=30.0, secret=SECRET)
    assert proxy.handle(Inherited(world.rm.snapshot().slices), now) == []
    world.proxy = proxy
    return proxy


def held_by_executors(world: World, sid: str, names: list[str]) -> dict[str, OwnedShards]:
    """What the executors hold of ``sid``: every shard of ``names`` where its first slice's devices put them
    (and nothing on its other slices' executors)."""
    sl, *others = [s for s in world.rm.snapshot().slices if s.owner == sid]
    held = {d.control: OwnedShards(keys=[], devices=[]) for each in (sl, *others) for d in each.devices}
    for name in names:
        for shard, device in enumerate(sl.devices):
            got = held.setdefault(device.control, OwnedShards(keys=[], devices=[]))
            got.keys.append(f"{sid}/{name}/{shard}")
            got.devices.append(device.device)
    return held


def resume(world: World, peer: bytes, message: ResumeSession, held: dict[str, OwnedShards]) -> SessionResumed:
    (reclaim,) = world.handle(Inbound(peer, message))
    assert isinstance(reclaim, Reclaim) and reclaim.resume == message
    assert reclaim.message.prefix == f"{message.session_id}/" and reclaim.message.marker.startswith("r")
    assert set(reclaim.controls) == set(held) and not reclaim.message.drop
    actions = world.handle(Reclaimed(peer, "", message, {c: held.get(c) for c in reclaim.controls}))
    replies = [a for a in actions if isinstance(a, Reply)]
    assert len(replies) == 1 and replies[0].error is None, replies
    assert isinstance(replies[0].message, SessionResumed)
    world.last_actions = actions  # type: ignore[attr-defined]
    return replies[0].message


@pytest.fixture
def world() -> World:
    w = World()
    w.proxy = ProxyState(rm="tcp://rm:5000", address="tcp://proxy:5555", session_timeout_seconds=30.0, secret=SECRET)
    return w


def test_a_session_opened_with_a_secret_gets_a_token_only_its_key_can_use(world: World) -> None:
    opened = world.ask(CLIENT, OpenSession(name="a"))
    assert isinstance(opened, SessionOpened)
    assert opened.resume_token == resume_token(SECRET, opened.session_id, "")
    assert resume_token(SECRET, opened.session_id, "bob") != opened.resume_token
    assert resume_token(b"", opened.session_id, "") == "", "no secret, no token: sessions end with the proxy"


def test_a_restarted_proxy_takes_a_session_back_from_the_executors(world: World) -> None:
    sid, slice_id = world.open()
    token = resume_token(SECRET, sid, "")
    assert world.ask(CLIENT, PutBuffer(buffer=7, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    kept_name = world.proxy.sessions[CLIENT].buffers[7].name
    world.now = 5.0
    restarted(world, world.now)
    assert sid in world.proxy.orphans

    # Buffer 7's shards are all there; buffer 8's run was in flight (nothing of it); a temporary of that run
    # is there too, and nobody claims it.
    held = held_by_executors(world, sid, [kept_name, "t3"])
    message = ResumeSession(session_id=sid, token=token, name="a", slices=[slice_id],
                            buffers=[ResumedBuffer(buffer=7, spec=SPEC), ResumedBuffer(buffer=8, spec=SPEC)])
    resumed = resume(world, NEW, message, held)
    assert resumed.failed == [8] and "restarted" in resumed.why
    session = world.proxy.sessions[NEW]
    assert session.session_id == sid and set(session.slices) == {slice_id} and sid not in world.proxy.orphans
    kept = session.buffers[7]
    assert kept.name == kept_name and kept.done and kept.error is None
    assert [loc.control for loc in kept.locations] == [d.control for d in session.slices[slice_id].devices]
    assert isinstance(session.buffers[8].error, Unavailable)
    deleted = {b for a in sent(world.last_actions, DeleteShards) for b in a.message.buffers}  # type: ignore[attr-defined]
    assert deleted == {f"{sid}/t3"}, "what nobody claims is freed"
    assert world.ask(NEW, QueryBuffers(buffers=[7, 8])).ready == [True, True]

    # The session works as before: a run reads the kept buffer; its names carry the new marker.
    fns = [world.function(NEW, slice_id, b"f")]
    assert world.handle(Inbound(NEW, RegisterProgram(program_id="p", program=chain(fns, slice_id)))) == []
    actions = world.handle(Inbound(NEW, RunProgram(inputs=[ProgramInput(buffer=7)], outputs=[9], program_id="p")))
    (schedule,) = runs_sent(actions)  # (the template's run: the proxy before installed none of this one's)
    assert schedule.message.run_id.startswith(f"{sid}:{session.marker}")
    assert session.buffers[9].name.startswith(session.marker)
    with pytest.raises(InvalidArgument, match="never lost"):
        world.ask(NEW, message)


def test_undeclared_slices_are_released_and_unresumed_sessions_freed_after_the_timeout(world: World) -> None:
    sid, slice_id = world.open()
    other = b"client-other"
    other_sid, other_slice = world.open(other)
    extra = world.ask(CLIENT, CreateSlice(devices=2)).slice.slice_id
    restarted(world, 0.0)
    message = ResumeSession(session_id=sid, token=resume_token(SECRET, sid, ""), slices=[slice_id])
    resume(world, NEW, message, held_by_executors(world, sid, []))
    released = [a.message for a in sent(world.last_actions, ReleaseSlices)]  # type: ignore[attr-defined]
    assert released == [ReleaseSlices(owner=sid, slice_ids=[extra])]

    world.now = 29.0
    assert not sent(world.handle(Tick()), ReleaseSlices), "kept for the session timeout"
    assert world.ask(NEW, Heartbeat(role="client", name="a")) == Ok()  # the resumed session lives as any does
    world.now = 31.0
    actions = world.handle(Tick())
    assert [a.message for a in sent(actions, ReleaseSlices)] == [ReleaseSlices(owner=other_sid)]
    (drop,) = [a for a in actions if isinstance(a, Reclaim)]
    assert drop.message.drop and drop.message.prefix == f"{other_sid}/" and drop.resume is None
    assert not world.proxy.orphans and other_slice
    with pytest.raises(NotFound, match="is gone"):
        world.ask(other, ResumeSession(session_id=other_sid, token=resume_token(SECRET, other_sid, "")))


def test_a_resume_needs_the_sessions_token_and_key(world: World) -> None:
    sid, _ = world.open()
    restarted(world, 0.0)
    with pytest.raises(PermissionDenied, match="token"):
        world.ask(NEW, ResumeSession(session_id=sid, token="0" * 64))
    # The right token, but from another key's connection.
    (reply,) = world.handle(Inbound(NEW, ResumeSession(session_id=sid, token=resume_token(SECRET, sid, "")),
                                    user="mallory"))
    assert isinstance(reply.error, PermissionDenied)
    without = ProxyState(rm="tcp://rm:5000", address="tcp://proxy:5555")
    assert without.handle(Inherited([]), 0.0) == []
    (reply,) = without.handle(Inbound(NEW, ResumeSession(session_id=sid, token=resume_token(SECRET, sid, ""))), 0.0)
    assert isinstance(reply.error, PermissionDenied), "a proxy with no secret resumes nothing"

