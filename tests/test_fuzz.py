"""Hostile input: what the fuzzer (``bench/fuzz.py``) found, one regression test each, and the fuzzer itself
against a real cluster (10^4 frames per socket)."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading

import msgpack
import pytest

from pwmesh.dataflow import plane as plane_module
from pwmesh.dataflow.plane import INLINE, SHARED, DataPlane, machine_id
from pwmesh.errors import InvalidArgument, PwmeshError
from pwmesh.service.rpc import Connection, RejectedLog, Server
from pwmesh.service.tasks import TaskGroup
from pwmesh.service.transport import Context
from pwmesh.wire import Envelope, encode
from pwmesh.wire.messages import GetClusterState, GetSchedulerStats, Ping, Pong, SchedulerJoined, TupleBatch

_LEN = struct.Struct("!I")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------ RejectedLog


def test_new_peers_cannot_write_more_than_the_line_budget_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    """Every new connection is a new peer: a flood of one frame per connection is still a few lines."""
    clock = Clock()
    rejected = RejectedLog("proxy", interval_seconds=10.0, lines=5, clock=clock)
    with caplog.at_level(logging.WARNING, logger="pwmesh.service.rpc"):
        for peer in range(1000):
            clock.now = peer * 0.001
            rejected.rejected(peer, "junk")
        clock.now = 11.0
        rejected.rejected("late", "junk")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 6, lines
    assert lines[-1] == ("proxy: rejected frame from 'late': junk (995 more from others in the last 11 s, "
                         "over the limit of 5 lines per 10 s)")


def test_rejected_log_counts_every_frame_from_many_threads() -> None:
    rejected = RejectedLog("data plane", interval_seconds=1e9)
    rejected.rejected("peer", "first")

    def flood() -> None:
        for _ in range(2000):
            rejected.rejected("peer", "junk")

    threads = [threading.Thread(target=flood) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rejected._seen["peer"][1] == 8000


# ------------------------------------------------------------------ the data plane


def _connect(plane: DataPlane) -> socket.socket:
    host, port = plane.address.removeprefix("tcp://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10.0)


def _hello(sock: socket.socket, machine: str = "") -> None:
    hello = msgpack.packb({"machine": machine, "pid": 1})
    sock.sendall(_LEN.pack(len(hello)) + hello)
    (n,) = _LEN.unpack(_recv(sock, _LEN.size))
    _recv(sock, n)


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the plane closed this stream (it reads nothing more from it)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _preamble(entries: object, length: int | None = None) -> bytes:
    head = msgpack.packb(entries)
    return _LEN.pack(len(head) if length is None else length) + head


# Each ends its stream; before, the first four killed their reader thread with a traceback on stderr
# (the daemon's log), and every one of them could be sent once per connection, forever.
BROKEN_STREAMS = {
    "handshake not a map": _LEN.pack(3) + msgpack.packb([1, 2]),
    "handshake of None": _LEN.pack(1) + msgpack.packb(None),
    "preamble entry not a list": None,  # after a good handshake: see below
    "preamble entry of wrong types": None,
    "handshake of 4 GiB": _LEN.pack(2**32 - 1) + b"\x80",
    "unreadable handshake": _LEN.pack(4) + b"\xc1\xc1\xc1\xc1",
}
AFTER_HELLO = {
    "preamble entry not a list": _preamble([7, 8]),
    "preamble entry of wrong types": _preamble([[INLINE, 1, "", "zero"], [SHARED, "8", 3, None]]),
    "unknown frame kind": _preamble([[9, 1, "", 0], [INLINE, 1, "", 0]]),
    "16 GiB frames": _preamble([[INLINE, 2**34, "", 0]] * 3),
    "a shared-memory segment that does not exist": _preamble([[SHARED, 8, "pwmesh-nosuch", 0], [INLINE, 1, "", 0]]),
    "preamble of 4 GiB": _preamble([], length=2**32 - 1),
    "unreadable preamble": _LEN.pack(3) + b"\xc1\xc1\xc1",
}


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_junk_on_the_data_plane_closes_its_stream_logs_little_and_leaves_the_plane_serving(
        caplog: pytest.LogCaptureFixture) -> None:
    arrived = asyncio.Event()
    plane = DataPlane(asyncio.get_running_loop(), lambda batch: arrived.set())
    sender = DataPlane(asyncio.get_running_loop(), lambda batch: None)

    def junk() -> None:
        for _ in range(20):  # each broken stream 20 times, each on a connection of its own
            for name, data in BROKEN_STREAMS.items():
                with _connect(plane) as sock:
                    if data is None:
                        _hello(sock)
                        data = AFTER_HELLO[name]
                    sock.sendall(data)
                    assert _closed_by_peer(sock), name
            for name, data in AFTER_HELLO.items():
                with _connect(plane) as sock:
                    _hello(sock, machine_id())  # shared memory allowed: its frames are checked all the same
                    sock.sendall(data)
                    assert _closed_by_peer(sock), name
        with _connect(plane) as sock:  # messages framed right but not batches: dropped, the stream goes on
            _hello(sock)
            for frames in ([b"\xc1", b""], encode(Ping(), msg_id=1), [b"x"] * 5):
                sock.sendall(_preamble([[INLINE, len(f), "", 0] for f in frames]) + b"".join(map(bytes, frames)))
                assert _recv(sock, 8) == struct.pack("!Q", 1)

    try:
        with caplog.at_level(logging.DEBUG, logger="pwmesh"):
            await asyncio.to_thread(junk)
            sender.send(plane.address, TupleBatch(tuples=[]))  # a real batch still arrives
            await asyncio.wait_for(arrived.wait(), 10.0)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert 1 <= len(warnings) <= 2, warnings  # every connection came from 127.0.0.1: one line per 10 s
        assert warnings[0].startswith("data plane: rejected frame from '127.0.0.1': ")
        assert len(plane._readers) == 1, "the junk streams' sockets are let go: the sender's stream is left"
    finally:
        sender.close()
        plane.close()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_peer_that_never_says_hello_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plane_module, "HANDSHAKE_TIMEOUT_SECONDS", 0.2)
    plane = DataPlane(asyncio.get_running_loop(), lambda batch: None)

    def silent() -> None:
        with _connect(plane) as talker, _connect(plane) as mute:
            _hello(talker)  # a stream that said hello may stay idle as long as it likes
            assert _closed_by_peer(mute)
            talker.settimeout(0.5)
            with pytest.raises(TimeoutError):
                talker.recv(1)

    try:
        await asyncio.to_thread(silent)
    finally:
        plane.close()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_inbound_streams_are_capped() -> None:
    plane = DataPlane(asyncio.get_running_loop(), lambda batch: None, max_streams=2)

    def many() -> None:
        with _connect(plane) as a, _connect(plane) as b, _connect(plane) as c:
            assert _closed_by_peer(c)  # over the cap: closed at once
            a.settimeout(0.3)
            b.settimeout(0.3)
            for sock in (a, b):
                with pytest.raises(TimeoutError):
                    sock.recv(1)

    try:
        await asyncio.to_thread(many)
    finally:
        plane.close()


# ------------------------------------------------------------------ addresses from peers


@pytest.mark.timeout(10)
@pytest.mark.parametrize("address", ["xxxx", "tcp://", "tcp://host:port", "", "x" * 3000])
def test_connecting_to_an_address_that_is_none_is_a_refusal_and_leaks_no_socket(address: str) -> None:
    """Executors, schedulers and the proxy connect to addresses other daemons (or anyone) sent them;
    before, a bad one raised ZMQError from deep inside a handler and left its socket open (the
    context then never terminated: every daemon's stop hung on it)."""
    ctx = Context()
    with pytest.raises(InvalidArgument, match="cannot connect to"):
        ctx.dealer(address)
    ctx.close()  # returns: no socket is left open


# ------------------------------------------------------------------ the daemons' socket pump


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_what_a_peer_can_make_fail_again_and_again_is_answered_every_time_and_logged_rarely(
        caplog: pytest.LogCaptureFixture) -> None:
    """Found by fuzzing the resource manager: a WatchCluster restoring a slice whose map version is
    2^64 - 1 (msgpack's largest integer) made it store 2^64, which no reply holding it could encode
    again: the exception escaped the socket's reader (a traceback per request) and the requester
    waited for its timeout. Handlers failing, and replies to peers that left, were a line each."""
    ctx, tasks = Context(), TaskGroup()
    peers: list[bytes] = []

    def unencodable(peer: bytes, env: Envelope) -> SchedulerJoined:
        peers.append(peer)
        server.post(peer, SchedulerJoined(island=2**64, address="x"))  # a notification: dropped, logged
        return SchedulerJoined(island=2**64, address="x")

    def buggy(peer: bytes, env: Envelope) -> None:
        raise KeyError("a handler's bug")

    server = Server(ctx, "tcp://127.0.0.1:0", {GetClusterState: unencodable, GetSchedulerStats: buggy,
                                               Ping: lambda peer, env: Pong(role="test", name="test")},
                    tasks=tasks, name="srv")
    server.start()
    conn = Connection(ctx, server.address, tasks=tasks, name="client")
    try:
        with caplog.at_level(logging.INFO, logger="pwmesh"):
            for _ in range(100):
                with pytest.raises(PwmeshError, match="srv could not encode its rm.scheduler_joined reply"):
                    await conn.request(GetClusterState(), timeout_seconds=5.0)
                with pytest.raises(PwmeshError, match="a handler's bug"):
                    await conn.request(GetSchedulerStats(), timeout_seconds=5.0)
            for _ in range(100):
                server.post(b"gone", Pong(role="test", name="test"))
            assert isinstance(await conn.request(Ping(), timeout_seconds=5.0), Pong)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 3, lines
        assert sum("cannot encode rm.scheduler_joined" in line for line in lines) == 1
        assert sum("handler for sched.get_stats failed" in line for line in lines) == 1
        assert sum("cannot send pong to peer b'gone'" in line for line in lines) == 1
    finally:
        await tasks.stop()
        ctx.close()


@pytest.mark.asyncio
async def test_tasks_failing_alike_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    """Found by fuzzing the executors: every SendShards with a junk emit mode was accepted, then its
    task failed with a traceback in the log: one per message."""
    tasks = TaskGroup()

    async def fail() -> None:
        raise InvalidArgument("unknown emit mode 'fuzz'")

    with caplog.at_level(logging.ERROR, logger="pwmesh.service.tasks"):
        spawned = [tasks.spawn(fail(), name=f"send-fuzz-{i}") for i in range(100)]
        spawned.append(tasks.spawn(fail(), name="other"))
        await asyncio.gather(*spawned, return_exceptions=True)  # the group's own callbacks ran first
    assert [r.getMessage() for r in caplog.records] == ["task send-fuzz-0 failed", "task other failed"]
    await tasks.stop()
