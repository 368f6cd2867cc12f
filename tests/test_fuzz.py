"""Hostile input: what the fuzzer (``bench/fuzz.py``) found, one regression test each, and the fuzzer itself
against a real cluster (10^4 frames per socket)."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import msgpack
import pytest
import zmq

import pwmesh as pw
from helpers import eventually
from pwmesh.dataflow import plane as plane_module
from pwmesh.dataflow.plane import INLINE, RETRY_DELAYS_SECONDS, SHARED, DataPlane, machine_id, recv_bytes
from pwmesh.errors import InvalidArgument, PwmeshError
from pwmesh.service.rpc import Connection, Connections, RejectedLog, Server
from pwmesh.service.tasks import TaskGroup
from pwmesh.service.transport import Context
from pwmesh.wire import Envelope, decode, encode
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
    (n,) = _LEN.unpack(recv_bytes(sock, _LEN.size))
    recv_bytes(sock, n)


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
                assert recv_bytes(sock, 8) == struct.pack("!Q", 1)

    try:
        with caplog.at_level(logging.DEBUG, logger="pwmesh"):
            await asyncio.to_thread(junk)
            sender.send(plane.address, TupleBatch(tuples=[]))  # a real batch still arrives
            await asyncio.wait_for(arrived.wait(), 10.0)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert 1 <= len(warnings) <= 2, warnings  # every connection came from 127.0.0.1: one line per 10 s
        assert warnings[0].startswith("data plane: rejected frame from '127.0.0.1': ")
        # the last junk stream's reader sees its end on a thread of its own: wait for it, not for a lucky order
        await asyncio.to_thread(eventually, lambda: len(plane._readers) == 1, 10.0)  # the sender's stream is left
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


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_data_plane_address_where_something_else_answers_loses_the_batch_not_the_writer(
        caplog: pytest.LogCaptureFixture) -> None:
    """Addresses come from peers: the sender's side of the handshake is checked like the receiver's.
    Before, a reply that was not a map killed the stream's writer thread, and every batch queued for that
    address waited forever (the plane never became idle again). Now each batch is tried on new streams
    as long as the retries last, then lost, loudly and counted, and the writer goes on to the next."""
    listener = socket.create_server(("127.0.0.1", 0))
    host, port = listener.getsockname()[:2]

    def impostor() -> None:
        for reply in itertools.cycle((msgpack.packb([1, 2]), msgpack.packb({"machine": 3}))):
            try:
                conn, _ = listener.accept()
            except OSError:  # shut down: the test is over
                return
            with conn:
                conn.recv(4096)
                conn.sendall(_LEN.pack(len(reply)) + reply)

    plane = DataPlane(asyncio.get_running_loop(), lambda batch: None)
    serving = asyncio.create_task(asyncio.to_thread(impostor))
    try:
        with caplog.at_level(logging.WARNING, logger="pwmesh.dataflow.plane"):
            for sent in (1, 2):
                plane.send(f"tcp://{host}:{port}", TupleBatch(tuples=[]))
                await asyncio.wait_for(plane.idle.wait(), 10.0)  # given up on, and counted lost
                assert plane.lost == sent
        messages = [r.getMessage() for r in caplog.records]
        assert "malformed handshake" in messages[0]
        assert sum("were lost" in m for m in messages) == 2, messages
        assert plane.retried == 2 * len(RETRY_DELAYS_SECONDS)
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        await serving
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
@pytest.mark.timeout(30)
async def test_a_message_callback_that_fails_again_and_again_is_logged_rarely(
        caplog: pytest.LogCaptureFixture) -> None:
    """Found by fuzzing 10^6 frames per socket: each notice the scheduler's callback failed on was an
    ERROR with its traceback (1,847 of them, 3.4 MB). The socket serves on and logs a line per 10 s."""
    ctx, tasks = Context(), TaskGroup()
    peers: list[bytes] = []

    def ping(peer: bytes, env: Envelope) -> Pong:
        peers.append(peer)
        return Pong(role="test", name="test")

    def buggy(env: Envelope) -> None:
        raise KeyError("a callback's bug")

    server = Server(ctx, "tcp://127.0.0.1:0", {Ping: ping}, tasks=tasks, name="srv")
    server.start()
    conn = Connection(ctx, server.address, tasks=tasks, name="client", on_message=buggy)
    try:
        with caplog.at_level(logging.INFO, logger="pwmesh"):
            assert isinstance(await conn.request(Ping(), timeout_seconds=5.0), Pong)
            for _ in range(100):
                server.post(peers[0], Pong(role="test", name="notice"))  # unsolicited: the callback's
            assert isinstance(await conn.request(Ping(), timeout_seconds=5.0), Pong), "it serves on"
        lines = [r.getMessage() for r in caplog.records]
        assert sum("message callback failed" in line for line in lines) == 1, lines
    finally:
        await tasks.stop()
        ctx.close()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_send_refused_for_a_peer_that_left_does_not_stall_the_socket() -> None:
    """Found by fuzzing (the proxy, an executor): a reply to a peer that had left (ROUTER_MANDATORY:
    EHOSTUNREACH), sent from outside the socket's reader callback, processed the socket's pending
    commands and so consumed the FD's edge-triggered signal for a message that had just arrived from
    another peer: nothing looked at the socket again until an unrelated event, 20 s later."""
    ctx, tasks = Context(), TaskGroup()
    peers: list[bytes] = []

    def ping(peer: bytes, env: Envelope) -> Pong:
        peers.append(peer)
        return Pong(role="test", name="srv")

    server = Server(ctx, "tcp://127.0.0.1:0", {Ping: ping}, tasks=tasks, name="srv")
    server.start()
    zctx = zmq.Context()
    gone, new = zctx.socket(zmq.DEALER), zctx.socket(zmq.DEALER)
    try:
        gone.connect(server.address)
        gone.send_multipart([b"", *encode(Ping(), msg_id=1)])
        assert await asyncio.to_thread(gone.poll, 5000)
        assert isinstance(decode(gone.recv_multipart()[1:]).message, Pong)
        gone.close(linger=0)
        new.connect(server.address)
        new.send_multipart([b"", *encode(Ping(), msg_id=2)])
        time.sleep(0.3)  # the loop is busy (not a wait): the departure and the new ping land meanwhile
        server.post(peers[0], Pong(role="test", name="late"))  # to the peer that left: refused
        assert await asyncio.to_thread(new.poll, 5000), "the new peer's ping was never answered"
    finally:
        gone.close(linger=0)
        new.close(linger=0)
        zctx.term()
        await tasks.stop()
        ctx.close()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_peer_that_never_answers_a_barrier_is_logged_once_per_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    """Found by the 10^6-frame run: an Enqueue naming a junk proxy address makes the executor post to it,
    and every AwaitIdle after that waits a barrier on it and logged that it did not answer."""
    ctx, tasks = Context(), TaskGroup()
    peers = Connections(ctx, tasks=tasks, name="executor")
    try:
        with caplog.at_level(logging.WARNING, logger="pwmesh.service.rpc"):
            for _ in range(5):
                peers.post("tcp://127.0.0.1:1", Ping())  # nothing listens there
                await peers.barrier(timeout_seconds=0.05)
        assert [r.getMessage() for r in caplog.records] == [
            "executor: no barrier reply from tcp://127.0.0.1:1: tcp://127.0.0.1:1 did not answer ping within "
            "0.05 seconds"]
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


# ------------------------------------------------------------------ the fuzzer against a real cluster

FRAMES_PER_SOCKET = 10_000
MAX_RSS_GROWTH_MIB = 64.0  # per daemon, over the whole run (measured: under 10)
MAX_LOG_GROWTH_KIB = 64.0  # per daemon (measured: under 25; a line per rejected frame was ~1.5 MiB)


def load_fuzzer() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "bench" / "fuzz.py"
    spec = importlib.util.spec_from_file_location("pwmesh_bench_fuzz", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.cluster
@pytest.mark.timeout(150)
def test_fuzzing_every_socket_crashes_nothing_bounds_memory_and_logs_and_a_program_runs_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """10^4 random, truncated and mutated frames to every daemon's socket (the resource manager, the
    island scheduler, each executor, the proxy) and as many junk messages to each executor's data
    plane; then every daemon still runs, grew little, and a real program computes the right values."""
    fuzz = load_fuzzer()
    monkeypatch.delenv("PWMESH_ADDRESS", raising=False)
    cluster = pw.LocalCluster(fuzz.SPEC, log_dir=str(tmp_path))
    try:
        cluster.start()
        fuzz.limit_address_space(cluster, 8.0)
        result = fuzz.run(cluster, FRAMES_PER_SOCKET, seed=19)
    finally:
        cluster.stop()
    planes = sorted((t["name"], t["plane"]) for t in result["targets"])
    assert planes == sorted([("rm", "control"), ("scheduler-0", "control"), ("proxy", "control"),
                             *((f"island0-host{i}", plane) for i in (0, 1) for plane in ("control", "data"))])
    assert all(t["frames"] == FRAMES_PER_SOCKET for t in result["targets"]), result["targets"]
    assert set(result["targets"][0]["kinds"]) == set(fuzz.KINDS)  # every kind of mutation was sent
    assert fuzz.failures(result, MAX_RSS_GROWTH_MIB, MAX_LOG_GROWTH_KIB) == [], result["daemons"]
    assert result["totals"]["crashes"] == 0 and result["program"]["ok"]
    assert os.listdir(tmp_path)  # the daemons' logs, measured above, are there to read


@pytest.mark.cluster
@pytest.mark.timeout(110)
def test_the_fuzz_benchmark_runs_and_writes_its_results(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PWMESH_ADDRESS"}
    bench = Path(__file__).resolve().parent.parent / "bench" / "fuzz.py"
    proc = subprocess.run([sys.executable, str(bench), "--smoke", "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    data = json.loads((tmp_path / "fuzz-smoke.json").read_text())
    assert data["benchmark"] == "fuzz" and data["smoke"] is True and data["failures"] == []
    assert {"config", "machine", "targets", "daemons", "rss_curve", "program", "totals"} <= data.keys()
    assert data["totals"]["crashes"] == 0 and data["totals"]["frames"] == 7 * data["config"]["frames_per_socket"]
    assert "frames/s" in proc.stdout
