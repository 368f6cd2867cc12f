"""``pw.get`` of many small values is one request (``FetchBuffers``), and the proxy asks each executor once for
all of their shards it holds: a training loop's losses, fetched ten at a time, cost one round trip, not ten.
Real daemons (the session's cluster: 2 islands x 2 hosts x 2 CPU devices)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import pwmesh as pw
from helpers import out_of_memory
from pwmesh.cli.commands import debug_events

pytestmark = pytest.mark.timeout(120)


def requests(address: str, daemon: str, op: str) -> int:
    """How many ``op`` requests are among ``daemon``'s latest events."""
    return sum(f"Inbound({op} from" in line for line in debug_events(address, daemon, 40).splitlines())


def test_many_small_values_over_two_executors_come_in_one_request(cluster: pw.LocalCluster,
                                                                         client: pw.Client) -> None:
    sl = client.make_virtual_device_set().add_slice(devices=4, island=0)  # 2 hosts: each value on 2 executors
    x = np.arange(4.0, dtype=np.float32)
    values = [pw.pmap(lambda v, k=k: v * k, devices=sl)(x) for k in range(12)]
    got = pw.get(values)
    for k, value in enumerate(got):
        np.testing.assert_array_equal(value, x * k)
    assert requests(cluster.address, "proxy", "proxy.fetch_buffers") == 1
    assert requests(cluster.address, "proxy", "proxy.fetch") == 0
    assert len({d.executor for d in sl.devices}) == 2
    # A pytree with a value fetched already and host leaves: the rest still come in one request.
    more = [pw.pmap(lambda v, k=k: v - k, devices=sl)(x) for k in range(3)]
    tree = {"old": values[0], "new": more, "host": 7}
    fetched = pw.get(tree)
    assert fetched["host"] == 7 and [list(v) for v in fetched["new"]] == [list(x - k) for k in range(3)]


def test_a_failed_value_among_them_fails_the_fetch_with_its_cause(client: pw.Client) -> None:
    sl = client.make_virtual_device_set().add_slice(devices=2, island=0)
    good = pw.pmap(lambda v: v + 1.0, devices=sl)(np.array([1.0, 2.0]))
    bad = pw.pmap(out_of_memory, devices=sl)(np.array([1.0, 2.0]))
    with pytest.raises(pw.RemoteError) as info:
        pw.get([good, bad])
    assert "RESOURCE_EXHAUSTED" in info.value.message and info.value.remote_traceback
    np.testing.assert_array_equal(pw.get([good, good + 0])[0], [2.0, 3.0])  # the session goes on


def test_a_fetch_goes_ahead_of_the_releases_waiting_for_the_next_message(cluster: pw.LocalCluster) -> None:
    """A garbage-collected array's release waits for the client's next message. A fetch goes ahead of it (the
    proxy sends for the value first, and frees after); any other message goes behind it (it sees them freed)."""
    with pw.Client(cluster.address, name="release-order") as client:
        client.session.conn.heartbeat_interval_seconds = 60.0  # no heartbeat carries them off meanwhile
        sl = client.make_virtual_device_set().add_slice(devices=2, island=0)
        inc = pw.pmap(lambda v: v + 1.0, devices=sl)
        a = inc(np.zeros(2, np.float32))
        b = inc(a)
        del a
        gc.collect()
        np.testing.assert_array_equal(np.asarray(b), [2.0, 2.0])
        del b
        gc.collect()
        c = inc(np.ones(2, np.float32))
        np.testing.assert_array_equal(np.asarray(c), [2.0, 2.0])
        lines = [line for line in debug_events(cluster.address, "proxy", 60).splitlines() if "Inbound(proxy." in line]
        client_ops = ("proxy.fetch", "proxy.release_buffers", "proxy.run_program")  # (not the schedulers' reports)
        ops = [op for op in (line.split("Inbound(")[1].split(" ")[0] for line in lines) if op in client_ops]
        assert ops[-5:] == ["proxy.fetch", "proxy.release_buffers", "proxy.release_buffers", "proxy.run_program",
                            "proxy.fetch"], ops  # fetch b, release a; release b, run c; fetch c
