"""Frees and reports per island that a lost scheduler or a forger must not spoil (issue 30, item 2 follow-up).

- A ``FreeShards`` in flight when its island's scheduler dies would be lost, and its buffers would stay on
  the executors until the session ends: the proxy keeps each free it sent a scheduler until a report on a
  later run shows the scheduler read it, and sends what is still kept again, per executor, when the
  scheduler is lost (deletes are idempotent).
- An ``IslandDone`` is taken only from the key the scheduler's address advertises: another daemon's key is
  refused, logged, and changes nothing.

The pure-core cases drive the proxy's core event by event; the last two use real daemons.
"""

from __future__ import annotations

import logging
import re
import signal
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_island_completions import island
from test_proxy_state import CLIENT, SCHEDULER, World, chain

import pwmesh as pw
from helpers import HEARTBEAT_TIMEOUT_SECONDS, eventually
from pwmesh.cli.commands import fetch_status
from pwmesh.client.connection import ClientConnection
from pwmesh.errors import PermissionDenied, PwmeshError
from pwmesh.proxy.state import Inbound, Notice, Reply, settled
from pwmesh.proxy.state import Send as ProxySend
from pwmesh.scheduler.order import IslandOrder
from pwmesh.scheduler.state import SchedulerState
from pwmesh.service import keys as cluster_keys
from pwmesh.wire.messages import (
    AwaitBuffers,
    DeleteShards,
    ErrorInfo,
    FreeShards,
    GetEvents,
    IslandDone,
    Ok,
    ProgramInput,
    PutBuffer,
    RegisterProgram,
    ReleaseBuffers,
    RunProgram,
    SchedulerLost,
)

pytestmark = pytest.mark.timeout(120)

LOST = SchedulerLost(island=0, address=SCHEDULER, reason="it missed its heartbeats")


def sent(actions: list[Any], kind: type) -> list[tuple[str, Any]]:
    return [(a.to, a.message) for a in actions if isinstance(a, ProxySend) and isinstance(a.message, kind)]


def put_and_release(world: World, slice_id: int, buffer: int) -> FreeShards:
    """A buffer over two executors, released: the island's one ``FreeShards`` for it."""
    assert world.ask(CLIENT, PutBuffer(buffer=buffer, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    ((to, free),) = sent(world.handle(Inbound(CLIENT, ReleaseBuffers(buffers=[buffer]))), FreeShards)
    assert to == SCHEDULER and len(free.groups[0].controls) == 2
    return free


def test_a_free_in_flight_when_its_scheduler_is_lost_goes_again_to_each_executor() -> None:
    world = World()
    sid, slice_id = world.open()
    free = put_and_release(world, slice_id, 1)
    (prefix,) = free.groups[0].buffers
    # The scheduler dies before it fans the free out: once it is found lost, each holder is told itself.
    again = sent(world.handle(Notice(LOST)), DeleteShards)
    assert sorted(again) == sorted((control, DeleteShards(buffers=[prefix])) for control in free.groups[0].controls)
    assert world.proxy.frees.resent == 1 and len(world.proxy.frees) == 0
    assert sent(world.handle(Notice(LOST)), DeleteShards) == [], "sent again once"
    # While the island has no scheduler, frees go per executor at once.
    assert world.ask(CLIENT, PutBuffer(buffer=2, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    direct = sent(world.handle(Inbound(CLIENT, ReleaseBuffers(buffers=[2]))), DeleteShards)
    assert len(direct) == 2 and not sent(world.handle(Notice(LOST)), DeleteShards)


def test_a_report_on_a_later_run_shows_the_scheduler_read_the_frees_before_it() -> None:
    world = World()
    sid, slice_id = world.open()
    put_and_release(world, slice_id, 1)
    second = put_and_release(world, slice_id, 2)
    fns = [world.function(CLIENT, slice_id, name) for name in (b"f", b"g")]
    assert world.ask(CLIENT, PutBuffer(buffer=3, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    assert world.handle(Inbound(CLIENT, RegisterProgram(program_id="p", program=chain(fns, slice_id)))) == []
    core = SchedulerState(IslandOrder(island=0, scheduler=SCHEDULER, window=8))
    actions = world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=3)], outputs=[4], program_id="p")))
    assert len(world.proxy.frees) == 2
    (done,) = island(world, actions, core)
    out = world.handle(Inbound(b"scheduler", done))
    # The run's own temporaries are freed as it ends: kept until a later run confirms them.
    kept = [f for _, f in sent(out, FreeShards)]
    assert len(world.proxy.frees) == len(kept) and second not in kept
    again = sent(world.handle(Notice(LOST)), DeleteShards)
    resent = {b for _, d in again for b in d.buffers}
    assert resent == {b for f in kept for g in f.groups for b in g.buffers}, "only what came after the run"


def test_an_islands_report_from_another_daemons_key_is_refused_logged_and_changes_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    world = World()
    sid, slice_id = world.open()
    fns = [world.function(CLIENT, slice_id, name) for name in (b"f", b"g")]
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    assert world.handle(Inbound(CLIENT, RegisterProgram(program_id="p", program=chain(fns, slice_id)))) == []
    world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[2], program_id="p")))
    (run_id,) = world.proxy.runs
    wait = world.ask(CLIENT, AwaitBuffers(buffers=[2]))
    forged = [IslandDone(run_id=run_id, scheduler=SCHEDULER, nodes=[0, 1]),
              IslandDone(run_id=run_id, scheduler=SCHEDULER, nodes=[1], executor_id="ex0",
                         error=ErrorInfo.of(PwmeshError("forged"))),
              IslandDone(run_id=run_id, scheduler=SCHEDULER, nodes=[0, 1], lost=True)]
    with caplog.at_level(logging.WARNING, logger="pwmesh.proxy.state"):
        for message in forged:  # the scheduler serves with the cluster's key: "rogue", a host's, is not it
            (reply,) = world.handle(Inbound(b"rogue", message, user="rogue"))
            assert isinstance(reply, Reply) and isinstance(reply.error, PermissionDenied)
            assert "'rogue' cannot report for the scheduler at" in str(reply.error)
    assert [r for r in caplog.records if "refused completions of run" in r.getMessage()], "logged"
    assert len(caplog.records) == 1, "rate-limited: one line per key"
    assert run_id in world.proxy.runs and settled(wait.buffers) is None, "nothing changed"
    # A scheduler serving with a key of its own: only that key speaks for it.
    own = cluster_keys.keyed(SCHEDULER, b"rJ1ahg.%JvYAU)o/c3]tMP9U6=fP:}w7oH[G*0Mu")
    world.proxy.key_holder = lambda public: "sched-host" if public == cluster_keys.unkeyed(own)[1] else None
    for user, allowed in (("rogue", False), ("sched-host", True), ("cluster", True)):
        out = world.handle(Inbound(b"peer", IslandDone(run_id="s9-000000:1-x", scheduler=own, nodes=[0]), user=user))
        assert (out == []) is allowed, (user, out)
    # From the scheduler's own key the report counts.
    world.handle(Inbound(b"scheduler", IslandDone(run_id=run_id, scheduler=SCHEDULER, nodes=[0, 1])))
    assert not world.proxy.runs and settled(wait.buffers) is None and wait.buffers[0].done


# ------------------------------------------------------------------ real daemons



def test_buffers_freed_while_the_scheduler_dies_are_deleted_without_closing_the_session(
        fragile: pw.LocalCluster) -> None:
    address = fragile.address
    with pw.Client(address) as client:
        sl = client.make_virtual_device_set().add_slice(devices=2)
        assert len({d.executor for d in sl.devices}) == 2
        before = [s.objects for s in client.status().executor_stats]
        x = client.put(np.arange(4.0, dtype=np.float32).reshape(2, 2), sl)
        y = pw.pmap(lambda v: v * 2.0, devices=sl)(x)
        np.testing.assert_array_equal(np.asarray(y), [[0, 2], [4, 6]])
        assert all(s.objects > b for s, b in zip(client.status().executor_stats, before, strict=True))
        scheduler = fragile.child("scheduler-0")
        scheduler.popen.send_signal(signal.SIGSTOP)  # it reads nothing more: the free waits in its socket
        del x, y
        client.status()  # answered after the proxy handled the release before it: the free was sent
        scheduler.popen.send_signal(signal.SIGKILL)  # and dies with it unread
        scheduler.popen.wait()
        # Found lost within the heartbeat timeout: the proxy frees on each executor itself.
        eventually(lambda: [s.objects for s in client.status().executor_stats] == before,
                   4 * HEARTBEAT_TIMEOUT_SECONDS + 10)
        fragile.restart("scheduler-0")
        inc = pw.pmap(lambda v: v + 1.0, devices=sl)

        def runs() -> bool:
            try:
                return np.asarray(inc(np.zeros(2, np.float32))).tolist() == [1.0, 1.0]
            except pw.DeviceLost:
                return False
        eventually(runs, 30)


@pytest.fixture(scope="module")
def key_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cluster = cluster_keys.init(tmp_path_factory.mktemp("island-keys") / "cluster")
    return {"cluster": cluster, "alice": cluster_keys.add_client(cluster, "alice"),
            "root": cluster_keys.add_client(cluster, "root", admin=True),
            "rogue": cluster_keys.add_daemon(cluster, "rogue")}


def slow(x):
    # A second or more of real work on one CPU core.
    m = jnp.full((192, 192), 0.01, jnp.float32)
    v = jnp.full((192, 192), 0.5, jnp.float32) * x
    return jax.lax.fori_loop(0, 3000, lambda i, a: jnp.tanh(a @ m), v).sum()[None]


def eventually_run_id(scheduler: str, root: Path) -> str:
    """The id of the first run the island's scheduler receives (as its event log shows it)."""
    found: list[str] = []
    admin = ClientConnection(scheduler, name="root", open_session=False, keys=str(root))

    def received() -> bool:
        lines = admin.request(GetEvents(limit=0), timeout_seconds=10.0).lines
        found[:] = [m for line in lines for m in re.findall(r"run_id='([^'#]+)'", line)]
        return bool(found)
    try:
        eventually(received, 60)
    finally:
        admin.close()
    return found[0]


def test_a_forged_island_report_from_another_daemons_key_is_refused(key_dirs: dict[str, Path]) -> None:
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=1, devices_per_host=1, keys=str(key_dirs["cluster"]),
                               daemon_keys=True)
    with pw.LocalCluster(spec) as hosts, pw.Client(hosts.address, name="alice", keys=str(key_dirs["alice"])) as alice:
        sl = alice.make_virtual_device_set().add_slice(devices=1)
        y = pw.pmap(slow, devices=sl)(np.ones(1, np.float32))  # seconds of work: the run is in flight
        (scheduler,) = fetch_status(hosts.address, keys=str(key_dirs["root"])).cluster.schedulers
        run_id = eventually_run_id(scheduler.address, key_dirs["root"])
        rogue = ClientConnection(hosts.address, name="rogue", open_session=False, keys=str(key_dirs["rogue"]))
        try:
            cause = ErrorInfo.of(PwmeshError("forged by rogue"))
            for forged in (IslandDone(run_id=run_id, scheduler=scheduler.address, nodes=[0], executor_id="x",
                                      error=cause),
                           IslandDone(run_id=run_id, scheduler=scheduler.address, nodes=[0], lost=True, error=cause)):
                with pytest.raises(pw.PermissionDenied, match="'rogue' cannot report for the scheduler"):
                    rogue.request(forged, timeout_seconds=10.0)
        finally:
            rogue.close()
        # Nothing changed: the run finishes with its own value.
        assert np.asarray(y).shape == (1, 1) and np.isfinite(np.asarray(y)).all()
