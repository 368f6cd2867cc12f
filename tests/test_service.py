"""The one lifecycle every daemon shares: in-process semantics, then real signals."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

import pwmesh as pw
from helpers import eventually, ping_status, slow_then_after
from pwmesh.client.connection import ClientConnection
from pwmesh.service.lifecycle import Service, Status, stop_process, wait_ready
from pwmesh.service.rpc import Connection
from pwmesh.service.tasks import TaskGroup
from pwmesh.service.transport import Context
from pwmesh.wire import decode, encode
from pwmesh.wire.messages import Error, Heartbeat, NodeDone, Ping, Pong


class Recording(Service):
    role = "test"

    def __init__(self, setup_delay: asyncio.Event | None = None) -> None:
        super().__init__("recording")
        self.setups = 0
        self.drains = 0
        self.block_setup = setup_delay
        self.background_cancelled = asyncio.Event()

    async def setup(self) -> None:
        self.setups += 1
        if self.block_setup is not None:
            await self.block_setup.wait()
        self.tasks.spawn(self._background(), name="background")

    async def _background(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            self.background_cancelled.set()

    async def drain(self) -> None:
        self.drains += 1


@pytest.mark.asyncio
async def test_start_is_idempotent_and_close_cancels_owned_tasks() -> None:
    svc = Recording()
    await asyncio.gather(svc.start(), svc.start())
    await svc.start()
    assert svc.setups == 1 and svc.status is Status.RUNNING
    assert len(svc.tasks) == 1
    await asyncio.gather(svc.close(), svc.close())
    assert svc.status is Status.CLOSED and svc.drains == 1
    assert svc.background_cancelled.is_set() and len(svc.tasks) == 0
    await asyncio.wait_for(svc.wait_closed(), 1)


@pytest.mark.asyncio
async def test_startup_timeout_closes_the_half_started_service() -> None:
    svc = Recording(setup_delay=asyncio.Event())  # never set: setup hangs
    svc.startup_timeout_seconds = 0.2
    with pytest.raises(TimeoutError):
        await svc.start()
    assert svc.status is Status.CLOSED and svc.drains == 0


@pytest.mark.asyncio
async def test_async_with() -> None:
    async with Recording() as svc:
        assert svc.status is Status.RUNNING
    assert svc.status is Status.CLOSED


# ------------------------------------------------------------ real processes


@pytest.fixture
def two_hosts() -> Iterator[pw.LocalCluster]:
    """A cluster of its own (these tests stop one of its executors): one island, two hosts."""
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=1)
    with pw.LocalCluster(spec) as c:
        yield c


def _start_slow_then_fast(cluster: pw.LocalCluster) -> tuple[pw.Client, pw.Array, pw.Array]:
    client = pw.Client(cluster.address)
    _, _, _, x, y = slow_then_after(client, cluster.address)
    return client, x, y


def test_first_sigterm_drains_in_flight_work(two_hosts: pw.LocalCluster) -> None:
    client, x, y = _start_slow_then_fast(two_hosts)
    host0 = two_hosts.child("island0-host0").popen
    try:
        host0.send_signal(signal.SIGTERM)
        # The in-flight computation finished and its result left the host before it exited.
        assert np.isfinite(np.asarray(y)).all()
        assert host0.wait(timeout=30) == 0
        # What lived only on the drained host is gone, and says so at once.
        with pytest.raises(pw.DeviceLost, match="island0-host0"):
            np.asarray(x)
    finally:
        client.close()


def test_second_signal_forces_exit(two_hosts: pw.LocalCluster) -> None:
    client, x, y = _start_slow_then_fast(two_hosts)
    host0 = two_hosts.child("island0-host0")
    try:
        host0.popen.send_signal(signal.SIGTERM)
        # Signals of one kind coalesce: wait until the first was heard before sending the second.
        eventually(lambda: ping_status(host0.info["address"]) == "draining", 15)
        start = time.monotonic()
        host0.popen.send_signal(signal.SIGTERM)
        assert host0.popen.wait(timeout=30) == 1
        assert time.monotonic() - start < 5.0
    finally:
        client.close()


@pytest.mark.parametrize("role", ["rm", "proxy"])
def test_idle_daemons_stop_cleanly_on_sigint(two_hosts: pw.LocalCluster, role: str) -> None:
    daemon = two_hosts.child(role).popen
    daemon.send_signal(signal.SIGINT)
    assert daemon.wait(timeout=15) == 0


def test_daemon_cli_rejects_missing_options() -> None:
    done = subprocess.run([sys.executable, "-m", "pwmesh.cli.daemons", "executor", "--devices", "1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--island" in done.stderr or "--rm" in done.stderr


# ------------------------------------------------------------ the socket layer, across processes

ROOT = Path(__file__).resolve().parent.parent

# The peer of the socket-layer tests (what it answers is in its docstring).
ECHO_DAEMON = Path(__file__).resolve().with_name("echo_daemon.py")


def start_echo(high_water_mark: int = 100_000) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "PWMESH_PARENT_PID": str(os.getpid())}
    proc = subprocess.Popen([sys.executable, str(ECHO_DAEMON), str(high_water_mark)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        return proc, wait_ready(proc, 60.0, "the echo daemon")["address"]
    except BaseException:
        stop_process(proc)
        raise


def stop_echo(proc: subprocess.Popen[bytes]) -> None:
    assert stop_process(proc) == 0, "a clean stop"


@pytest.fixture
def echo() -> Iterator[str]:
    proc, address = start_echo()
    try:
        yield address
    finally:
        stop_echo(proc)


@pytest.fixture
def raw() -> Iterator[Any]:
    """Raw DEALER sockets, each ``raw(address, identity)``: peers that misbehave on purpose."""
    ctx = zmq.Context()
    sockets = []

    def make(address: str, identity: bytes, rcvhwm: int = 1000) -> zmq.Socket[bytes]:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 20_000)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(address)
        sockets.append(sock)
        return sock

    yield make
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()


def command(conn: ClientConnection, name: str, pad: str = "") -> tuple[int, int, int, int]:
    """(received, out_of_order, backlog, unreachable) from the echo daemon."""
    reply = conn.request(Heartbeat(role=pad, name=name), timeout_seconds=30.0)
    assert isinstance(reply, Pong)
    backlog, unreachable = reply.status.split(":")
    return int(reply.role), int(reply.name), int(backlog), int(unreachable)


def ping_raw(sock: zmq.Socket[bytes], msg_id: int) -> None:
    sock.send_multipart([b"", *encode(Ping(), msg_id=msg_id)])
    env = decode(sock.recv_multipart()[1:])
    assert isinstance(env.message, Pong) and env.reply_to == msg_id


@pytest.mark.asyncio
async def test_posts_and_pushes_arrive_in_order_before_the_reply_behind_them(echo: str) -> None:
    ctx, tasks = Context(), TaskGroup()
    pushed: list[int] = []
    conn = Connection(ctx, echo, tasks=tasks, name="test",
                      on_message=lambda env: pushed.append(env.message.nodes[0]))
    try:
        for i in range(5000):
            conn.post(NodeDone(run_id="r", nodes=[i], executor_id="test"))
        reply = await conn.request(Heartbeat(role="r", name="push:3000"), timeout_seconds=60.0)
        assert isinstance(reply, Pong)
        assert (reply.role, reply.name) == ("5000", "0")  # every post arrived, in order, before the request
        assert pushed == list(range(3000))  # every push arrived, in order, before the reply
        assert not conn.unconfirmed
    finally:
        await tasks.stop()
        ctx.close()


@pytest.mark.asyncio
async def test_a_reply_after_its_request_timed_out_is_dropped_not_taken_for_a_notice(echo: str) -> None:
    """A late answer goes to nobody. It used to reach ``on_message`` as a notice: an executor back from a
    partition took a late ``PleaseRegister(written_off)`` to a heartbeat that had timed out for a second
    order to start over, and the resource manager wrote off what it held (a CI failure, under load)."""
    ctx, tasks = Context(), TaskGroup()
    noticed: list[Any] = []
    conn = Connection(ctx, echo, tasks=tasks, name="test", on_message=noticed.append)
    try:
        with pytest.raises(pw.PwTimeoutError):  # its answer waits behind 20,000 pushes: it comes too late
            await conn.request(Heartbeat(role="r", name="push:20000"), timeout_seconds=0.001)
        # Answers come in order: once this one is here, the late one arrived before it.
        assert isinstance(await conn.request(Heartbeat(role="r", name="next"), timeout_seconds=30.0), Pong)
        assert len(noticed) == 20_000 and all(isinstance(m.message, NodeDone) for m in noticed), \
            "the pushes are notices; the late Pong is not"
    finally:
        await tasks.stop()
        ctx.close()


@pytest.mark.asyncio
async def test_sends_between_arrivals_never_hide_a_message(echo: str) -> None:
    """Every send may consume the socket's readiness signal (ZeroMQ's FD is edge-triggered):
    many tasks posting and requesting while pushes stream in must never leave one unread."""
    ctx, tasks = Context(), TaskGroup()
    pushed = 0

    def on_push(env: Any) -> None:
        nonlocal pushed
        pushed += 1

    conn = Connection(ctx, echo, tasks=tasks, name="test", on_message=on_push)

    async def chatter(k: int) -> None:
        for _ in range(150):
            conn.post(NodeDone(run_id="r", nodes=[k], executor_id="test"))
            await conn.request(Heartbeat(role="r", name="push:3"), timeout_seconds=30.0)

    try:
        await asyncio.gather(*(chatter(k) for k in range(8)))
        assert pushed == 8 * 150 * 3
    finally:
        await tasks.stop()
        ctx.close()


def test_a_full_peer_waits_in_the_backlog_in_order_while_others_are_served(raw: Any) -> None:
    proc, address = start_echo(high_water_mark=4)
    control = ClientConnection(address, name="control", open_session=False)
    try:
        stalled = raw(address, b"stalled", rcvhwm=1)
        ping_raw(stalled, 1)  # now the daemon knows it; from here on it reads nothing
        # Zero-copy frames (over 64 KiB each), far more than socket buffers and high-water marks hold.
        pad = "x" * (70 << 10)
        count = 800
        _, _, backlog, unreachable = command(control, f"push:{count}:{b'stalled'.hex()}", pad)
        assert backlog > 0 and unreachable == 0  # it waits for the stalled peer, and this peer is answered
        got = []
        for _ in range(count):
            env = decode(stalled.recv_multipart(copy=False)[1:])
            assert isinstance(env.message, NodeDone) and env.message.run_id == pad
            got.append(env.message.nodes[0])
        assert got == list(range(count))  # all of it, in order, none dropped
        assert command(control, "push:0")[2:] == (0, 0)
    finally:
        control.close()
        stop_echo(proc)


def test_a_vanished_or_unknown_peer_is_reported_and_the_rest_served(echo: str, raw: Any) -> None:
    control = ClientConnection(echo, name="control", open_session=False)
    try:
        command(control, f"push:1:{b'never-was'.hex()}")  # ROUTER_MANDATORY: refused at once
        # The hook runs from the loop just after the refused post, but the reader may take the next
        # command in the same batch, before it: wait for it, one round trip at a time.
        deadline = time.monotonic() + 20
        while (unreachable := command(control, "push:0")[3]) < 1:
            assert time.monotonic() < deadline, "the refused post was never reported"
        assert unreachable == 1
        gone = raw(echo, b"gone")
        ping_raw(gone, 1)
        gone.close(linger=0)
        # Posts right after the close may still be taken (ZeroMQ notices the peer left a moment
        # later); each round trip is one more post, until it is refused.
        while command(control, f"push:1:{b'gone'.hex()}")[3] < 2:
            assert time.monotonic() < deadline, "a post to a vanished peer was never refused"
        assert control.request(Ping(), timeout_seconds=10.0).status == "running"
    finally:
        control.close()


def test_malformed_frames_are_answered_or_dropped_and_the_rest_served(echo: str, raw: Any) -> None:
    bad = raw(echo, b"bad")
    bad.send_multipart([b"", b"\xc1 not msgpack"])  # no readable header: dropped
    bad.send_multipart([b"", msgpack.packb([1, "heartbeat", 7, None, ""]), b"\xc1"])  # header, broken body
    bad.send_multipart([b"", msgpack.packb([1, "no.such.op", 8, None, ""]), msgpack.packb({})])
    bad.send_multipart([b"no delimiter", *encode(Ping(), msg_id=9)])  # no envelope: dropped
    bad.send_multipart([b"", *encode(Ping(), msg_id=10)])
    replies = [decode(bad.recv_multipart()[1:]) for _ in range(3)]
    assert [r.reply_to for r in replies] == [7, 8, 10]  # answers, in order, to all that could be answered
    assert all(isinstance(r.message, Error) and r.message.code == "protocol" for r in replies[:2])
    assert isinstance(replies[2].message, Pong)


def test_client_connection_serves_many_threads_at_once(echo: str) -> None:
    conn = ClientConnection(echo, name="threads", open_session=False)
    failures: list[BaseException] = []

    def hammer() -> None:
        try:
            for _ in range(300):
                assert isinstance(conn.request(Ping(), timeout_seconds=30.0), Pong)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not failures and not any(t.is_alive() for t in threads)
    finally:
        conn.close()


@pytest.mark.timeout(60)
def test_a_reply_that_lands_just_before_a_heartbeat_is_not_hidden_by_it() -> None:
    """ZeroMQ's FD is edge-triggered and any send may consume its signal: the I/O thread must
    look at the socket after sending a heartbeat, or a reply that arrived just before waits
    for the next beat. The peer is a bare ROUTER socket in the test, not a daemon: only that
    lets the reply land at that instant."""
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as peer:
        port = peer.bind_to_random_port("tcp://127.0.0.1")
        conn = ClientConnection(f"tcp://127.0.0.1:{port}", name="beats", open_session=False)
        real_send_now = conn._send_now
        beats = 0
        second_beat = threading.Event()

        def send_now(frames: list[Any]) -> bool:
            nonlocal beats
            env = decode(frames[1:])
            if isinstance(env.message, Ping) and env.msg_id != asked:
                beats += 1
                if beats == 1:
                    conn.heartbeat_interval_seconds = 120.0  # the beat after the next is far away
                elif beats == 2:
                    second_beat.set()  # the test replies now; wait until the reply is in the socket
                    readable, _, _ = select.select([conn._fd], [], [], 20.0)
                    assert readable, "the reply never reached the client's socket"
            return real_send_now(frames)

        try:
            asked = -1
            conn._send_now = send_now  # type: ignore[method-assign]
            fut = conn.submit(Ping())
            assert fut is not None
            identity, empty, *request = peer.recv_multipart()
            asked = decode(request).msg_id
            assert second_beat.wait(timeout=20.0), "the client sent no second heartbeat"
            peer.send_multipart([identity, empty, *encode(Pong(role="peer", name="p"), msg_id=1, reply_to=asked)])
            assert isinstance(conn.wait(fut, "ping", timeout_seconds=10.0), Pong)
        finally:
            conn.close(timeout_seconds=0.5)



@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_merged_posts_leave_as_one_at_the_end_of_the_turn_and_keep_the_order() -> None:
    """``post_merged``: a turn's messages of one type to a peer leave as one message as the turn ends; any other
    message sent there first sends them, so the peer receives everything in the order it was sent. (A real
    server and connection on loopback, in this process.)"""
    from pwmesh.service.rpc import Connections, Server
    from pwmesh.service.tasks import TaskGroup
    from pwmesh.service.transport import Context
    from pwmesh.wire import Envelope
    from pwmesh.wire.messages import DeleteShards, Ping

    def merge(a: DeleteShards, b: DeleteShards) -> DeleteShards:
        return DeleteShards(buffers=a.buffers + b.buffers)

    got: list[tuple[str, list[str]]] = []
    arrived = asyncio.Event()

    def on(peer: bytes, env: Envelope) -> None:
        got.append((env.message.op, list(getattr(env.message, "buffers", []))))
        if isinstance(env.message, Ping):
            arrived.set()

    ctx, tasks = Context(), TaskGroup()
    server = Server(ctx, "tcp://127.0.0.1:0", {DeleteShards: on, Ping: on}, tasks=tasks, name="peer")
    server.start()
    conns = Connections(ctx, tasks=tasks, name="sender")
    try:
        conns.post_merged(server.address, DeleteShards(buffers=["s/a"]), merge)
        conns.post_merged(server.address, DeleteShards(buffers=["s/b"]), merge)
        await asyncio.sleep(0)  # the turn ends: the two leave as one
        conns.post_merged(server.address, DeleteShards(buffers=["s/c"]), merge)
        conns.post(server.address, Ping())  # sends the waiting one first
        await asyncio.wait_for(arrived.wait(), 10)
        assert got == [("exec.delete_shards", ["s/a", "s/b"]), ("exec.delete_shards", ["s/c"]), ("ping", [])]
    finally:
        await tasks.stop()
        ctx.close()
