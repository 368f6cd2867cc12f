"""Error paths: each failure reaches the caller as a clear exception, and daemons keep serving."""

from __future__ import annotations

import socket
import struct
import time

import msgpack
import numpy as np
import pytest
import zmq
from jax.sharding import PartitionSpec as P

import pwmesh as pw
from helpers import fails_across_islands, out_of_memory
from pwmesh.wire import PROTOCOL_VERSION, decode, encode
from pwmesh.wire.messages import Error, Ping, Pong, PutBuffer


def test_connecting_to_a_dead_address_fails_fast() -> None:
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as probe:
        port = probe.bind_to_random_port("tcp://127.0.0.1")
    # Nothing listens on the port any more.
    start = time.monotonic()
    with pytest.raises(pw.ConnectionFailed, match=f"127.0.0.1:{port}"):
        pw.Client(f"tcp://127.0.0.1:{port}", connect_timeout_seconds=1.0)
    assert time.monotonic() - start < 5.0


def test_remote_failure_reaches_client_with_traceback(client: pw.Client) -> None:
    s0, y = fails_across_islands(client)
    with pytest.raises(pw.RemoteError):
        y.block_until_ready()
    # The session and the executors keep serving.
    ok = pw.pmap(lambda v: v + 1.0, devices=s0)
    np.testing.assert_array_equal(np.asarray(ok(np.array([1.0, 2.0]))), [2.0, 3.0])


def test_too_many_devices_is_resource_exhausted(client: pw.Client) -> None:
    devs = client.make_virtual_device_set()
    with pytest.raises(pw.ResourceExhausted, match="at most 4"):
        devs.add_slice(devices=100)
    with pytest.raises(pw.ResourceExhausted, match="island 7"):
        devs.add_slice(devices=1, island=7)
    assert devs.add_slice(devices=4).devices  # the failures changed nothing


def _daemon_addresses(cluster: pw.LocalCluster) -> dict[str, str]:
    addresses = {}
    for child in cluster.children:
        addresses[child.name] = child.info["address"]
    return addresses


def _data_planes(cluster: pw.LocalCluster) -> list[tuple[str, int]]:
    found = []
    for child in cluster.children:
        if child.role == "executor":
            host, port = child.info["data"].removeprefix("tcp://").rsplit(":", 1)
            found.append((host, int(port)))
    return found


def _garbage() -> list[tuple[list[bytes], bool]]:
    """(frames after the delimiter, whether an Error reply is expected)."""
    header = msgpack.packb([PROTOCOL_VERSION, "ping", 77, None, "fuzz"])
    return [
        ([b"\xc1\xff garbage"], False),  # one unreadable frame: dropped and logged
        ([b"\x93\x01", b""], False),  # truncated header
        ([msgpack.packb([99, "ping", 77, None, "fuzz"]), msgpack.packb({})], True),  # other version
        ([msgpack.packb([PROTOCOL_VERSION, "no.such.op", 77, None, "fuzz"]), msgpack.packb({})], True),
        ([header, b"\xc1\xc1"], True),  # unreadable body
        ([msgpack.packb([PROTOCOL_VERSION, "exec.put_shards", 77, None, "f"]), msgpack.packb({"keys": 3})], True),
        ([header, msgpack.packb({}), b"extra frame"], True),  # a buffer nothing references
    ]


def test_daemons_survive_garbage(cluster: pw.LocalCluster, client: pw.Client) -> None:
    ctx = zmq.Context()
    try:
        for name, address in _daemon_addresses(cluster).items():
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 10_000)
            sock.connect(address)
            sock.send(b"no delimiter at all")
            for frames, answered in _garbage():
                sock.send_multipart([b"", *frames])
                if answered:
                    reply = decode(sock.recv_multipart()[1:])
                    assert isinstance(reply.message, Error), (name, frames)
                    assert reply.message.code == "protocol" and reply.reply_to == 77, (name, reply)
            # Still serving: a well-formed request right behind the garbage is answered.
            sock.send_multipart([b"", *encode(Ping(), msg_id=5)])
            reply = decode(sock.recv_multipart()[1:])
            assert isinstance(reply.message, Pong), (name, reply.message)
            sock.close()
    finally:
        ctx.term()
    sl = client.make_virtual_device_set().add_slice(devices=2)
    np.testing.assert_array_equal(np.asarray(pw.pmap(lambda x: -x, devices=sl)(np.ones(2))), [-1.0, -1.0])


def test_data_planes_survive_garbage(cluster: pw.LocalCluster, client: pw.Client) -> None:
    """Raw TCP streams: a bad hello, a bad preamble, a lying length, a peer that hangs up mid-frame."""
    hello = msgpack.packb({"machine": "", "pid": 1})
    bad_preamble = msgpack.packb([[0, 5, "", 0]])  # one frame: no header + body pair
    lying = msgpack.packb([[0, 4, "", 0], [0, 1 << 40, "", 0]])  # a frame over the limit
    shared = msgpack.packb([[1, 4, "../../etc/passwd", 0], [0, 1, "", 0]])  # shared memory it did not offer
    streams = [
        b"\xff" * 64,
        struct.pack("!I", len(hello)) + hello + struct.pack("!I", len(bad_preamble)) + bad_preamble,
        struct.pack("!I", len(hello)) + hello + struct.pack("!I", len(lying)) + lying,
        struct.pack("!I", len(hello)) + hello + struct.pack("!I", len(shared)) + shared,
        struct.pack("!I", len(hello)) + hello + struct.pack("!I", 1 << 30),  # a preamble too big to read
        struct.pack("!I", len(hello)) + hello + struct.pack("!I", 100) + b"short",  # hangs up mid-preamble
    ]
    for host, port in _data_planes(cluster):
        for garbage in streams:
            with socket.create_connection((host, port), timeout=10) as sock:
                sock.sendall(garbage)
    # Every executor still moves data: a value made on one island, resharded onto the other.
    devs = client.make_virtual_device_set()
    a, b = devs.add_slice(devices=2, island=0), devs.add_slice(devices=1, island=1)
    x = np.arange(8.0, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(pw.reshard(client.put(x, a), devices=b)), x)


def test_a_failed_put_keeps_its_cause(client: pw.Client) -> None:
    sl = client.make_virtual_device_set().add_slice(devices=2)
    with pytest.raises(pw.InvalidArgument, match=r"\(3\) cannot be split over mesh axes \('x',\) \(2 devices\)"):
        client.put(np.arange(3.0), sl, spec=P("x"))  # the client refuses what it can check at once
    # A put the proxy refuses (sent around the client's check) fails its buffer with the cause.
    buffer_id = client.new_buffer_id()
    client.conn.post(PutBuffer(buffer=buffer_id, slice_id=sl.slice_id, array=np.arange(3.0, dtype=np.float32)))
    bad = pw.Array(client.session, buffer_id, (3,), np.dtype(np.float32), pw.SliceSharding(sl, P("x")))
    with pytest.raises(pw.InvalidArgument, match="cannot be split evenly over 2 devices"):
        np.asarray(bad)


def _same_cause(expected: pw.PwmeshError, got: pw.PwmeshError, what: str = "") -> None:
    assert type(got) is type(expected), what
    assert got.message == expected.message, what
    assert getattr(got, "remote_traceback", "") == getattr(expected, "remote_traceback", ""), what


def test_a_failed_value_fails_whatever_reads_it_with_its_cause(client: pw.Client) -> None:
    """Issue #27 item 7: every path that reads a value whose computation failed (a new program that
    binds it, a reshard, a donation, a fetch) fails with that computation's error: its type, message
    and remote traceback, never a message about the value's missing shards."""
    devs = client.make_virtual_device_set()
    s0, s1 = devs.add_slice(devices=2, island=0), devs.add_slice(devices=2, island=1)
    x = pw.pmap(out_of_memory, devices=s0)(np.array([1.0, 2.0]))
    with pytest.raises(pw.RemoteError) as info:
        np.asarray(x)  # fetch
    cause = info.value
    assert "RESOURCE_EXHAUSTED" in cause.message and cause.remote_traceback
    paths = {
        "a program that binds it": lambda: pw.pmap(lambda v: v * 2.0, devices=s0)(x),
        "one on another island": lambda: pw.pmap(lambda v: v * 2.0, devices=s1)(x),
        "a reshard": lambda: pw.reshard(x, devices=s1),
        "a donation": lambda: pw.jit(lambda v: v + 1.0, devices=s0, donate_argnums=0)(x),
    }
    for what, path in paths.items():
        with pytest.raises(pw.PwmeshError) as info:
            np.asarray(path())
        _same_cause(cause, info.value, what)


def test_a_value_refused_at_dispatch_keeps_the_refusal_as_its_cause(client: pw.Client) -> None:
    """The default cluster has no JAX groups: an SPMD computation with collectives over a slice that
    spans executors is refused as it is dispatched; what reads its value later says why, as it did."""
    sl = client.make_virtual_device_set().add_slice(devices=4, island=0)
    assert len({d.executor for d in sl.devices}) == 2
    centred = pw.jit(lambda v: v - v.sum(), devices=sl, in_specs=P("x"), out_specs=P("x"))
    y = centred(np.arange(4.0, dtype=np.float32))
    with pytest.raises(pw.InvalidArgument, match="JAX group") as info:
        np.asarray(y)
    cause = info.value
    for use in (lambda: pw.jit(lambda v: v * 2.0, devices=sl, in_specs=P("x"), out_specs=P("x"))(y),
                lambda: pw.reshard(y, devices=client.make_virtual_device_set().add_slice(devices=1, island=1))):
        with pytest.raises(pw.InvalidArgument) as info:
            np.asarray(use())
        _same_cause(cause, info.value)
