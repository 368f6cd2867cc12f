"""A client's big arrays go straight to and from the executors over the data plane (``client/direct.py``,
``executor/direct.py``): the proxy only says where. Real daemons; the plane-level tests use real planes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pwmesh as pw
from helpers import eventually
from pwmesh.cli.commands import fetch_status
from pwmesh.client.direct import DIRECT_MIN_BYTES
from pwmesh.dataflow.plane import DataPlane, Notify
from pwmesh.executor.direct import DirectTransfers
from pwmesh.executor.store import ObjectStore
from pwmesh.wire import Envelope
from pwmesh.wire.messages import ExpectShards, ShardBatch

MiB = 1 << 20
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster() -> Iterator[pw.LocalCluster]:
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=2, memory_limit_bytes=256 * MiB,
                               collectives=True)
    with pw.LocalCluster(spec) as c:
        yield c


def direct_bytes(address: str) -> tuple[int, int]:
    stats = fetch_status(address).executor_stats
    return sum(s.direct_received_bytes for s in stats), sum(s.direct_pushed_bytes for s in stats)


def test_a_big_put_and_fetch_go_between_the_client_and_the_executors(cluster: pw.LocalCluster) -> None:
    with pw.Client(cluster.address) as client:
        sl = client.make_virtual_device_set().add_slice(devices=4)
        x = np.arange(2 * DIRECT_MIN_BYTES, dtype=np.float32).reshape(512, -1)  # 8 MiB, 2 MiB a device
        received, pushed = direct_bytes(cluster.address)
        a = pw.put(x, sl, P("x"))
        # Each shard once, to its executor (counted there once stored: the client hears sooner).
        eventually(lambda: direct_bytes(cluster.address)[0] - received == x.nbytes, timeout_seconds=10)
        np.testing.assert_array_equal(np.asarray(a), x)
        doubled = pw.jit(lambda v: v * 2, devices=sl, in_specs=P("x"), out_specs=P("x"))(a)
        np.testing.assert_array_equal(np.asarray(doubled), x * 2)
        assert direct_bytes(cluster.address)[1] - pushed == 2 * x.nbytes  # both values pushed, each block once


def test_a_big_host_argument_of_pw_jit_goes_direct_and_is_freed_after_the_run(cluster: pw.LocalCluster) -> None:
    with pw.Client(cluster.address) as client:
        sl = client.make_virtual_device_set().add_slice(devices=4)
        batch = np.arange(2 * DIRECT_MIN_BYTES // 4, dtype=np.float32).reshape(256, -1)  # 2 MiB
        step = pw.jit(lambda v: (v * 2).sum(), devices=sl, in_specs=P("x"))
        def objects() -> int:
            return sum(s.objects for s in fetch_status(cluster.address).executor_stats)

        eventually(lambda: objects() == 0, timeout_seconds=10)  # the earlier tests' sessions' values freed
        received = direct_bytes(cluster.address)[0]
        out = step(batch)
        assert float(np.asarray(out)) == float((batch.astype(np.float64) * 2).sum())
        eventually(lambda: direct_bytes(cluster.address)[0] - received == batch.nbytes, timeout_seconds=10)
        # The batch's shards were freed once the run had read them: only the result's 4 are left.
        eventually(lambda: objects() == 4, timeout_seconds=10)


def test_small_values_still_travel_in_control_messages(cluster: pw.LocalCluster) -> None:
    with pw.Client(cluster.address) as client:
        sl = client.make_virtual_device_set().add_slice(devices=2)
        before = direct_bytes(cluster.address)
        a = pw.put(np.arange(8, dtype=np.float32), sl, P("x"))
        np.testing.assert_array_equal(np.asarray(a), np.arange(8, dtype=np.float32))
        assert direct_bytes(cluster.address) == before


def test_a_fetch_issued_right_after_runs_sees_their_result(cluster: pw.LocalCluster) -> None:
    with pw.Client(cluster.address) as client:
        sl = client.make_virtual_device_set().add_slice(devices=4)
        x = np.ones((256, 4096), np.float32)  # 4 MiB
        step = pw.jit(lambda v: v + 1, devices=sl, in_specs=P("x"), out_specs=P("x"), donate_argnums=0)
        a = pw.put(x, sl, P("x"))
        for _ in range(5):
            a = step(a)
        np.testing.assert_array_equal(np.asarray(a), x + 5)  # fetched before the runs were done


def test_a_failed_value_fetched_direct_raises_its_cause(cluster: pw.LocalCluster) -> None:
    with pw.Client(cluster.address) as client:
        sl = client.make_virtual_device_set().add_slice(devices=1)
        too_big = pw.pmap(lambda s: np.zeros((300 * MiB // 4,), np.float32) + s, devices=sl)
        out = too_big(np.ones(1, np.float32))
        with pytest.raises(pw.ResourceExhausted, match="island0-host"):
            np.asarray(out)


def test_a_direct_put_that_does_not_fit_is_refused_at_once_and_others_go_on(cluster: pw.LocalCluster) -> None:
    with pw.Client(cluster.address) as client:
        sl = client.make_virtual_device_set().add_slice(devices=1)
        with pytest.raises(pw.ResourceExhausted, match="does not fit on executor island0-host"):
            pw.put(np.zeros((300 * MiB // 4,), np.float32), sl)
        y = np.full((MiB,), 3.0, np.float32)
        np.testing.assert_array_equal(np.asarray(pw.put(y, sl)), y)


# ---------------------------------------------------------------- the data plane's side, real planes


class Received:
    def __init__(self) -> None:
        self.batches: list[tuple[str, ShardBatch]] = []
        self.event = threading.Event()

    def __call__(self, session: str, batch: ShardBatch) -> None:
        self.batches.append((session, batch))
        self.event.set()


def told() -> tuple[Notify, list[str | None], threading.Event]:
    outcome: list[str | None] = []
    done = threading.Event()

    def on_done(why: str | None) -> None:
        outcome.append(why)
        done.set()

    return Notify(on_done), outcome, done


def test_a_stream_keyed_by_its_session_is_taken_and_another_key_is_refused() -> None:
    got = Received()
    executor = DataPlane(None, lambda b: None, on_shards=got)
    client = DataPlane(None, lambda b: None, sessions_only=True)
    intruder = DataPlane(None, lambda b: None, sessions_only=True)
    try:
        executor.session_keys["s1"] = b"k" * 32
        batch = ShardBatch(tag="put", keys=["s1/b1/0"], arrays=[np.arange(4.0)], devices=[0])
        tag, outcome, done = told()
        client.send(executor.address, batch, tag=tag, session=("s1", b"k" * 32))
        assert done.wait(10) and outcome == [None]
        assert got.event.wait(10) and got.batches[0][0] == "s1"
        np.testing.assert_array_equal(got.batches[0][1].arrays[0], np.arange(4.0))

        tag, outcome, done = told()  # the same session's name, another key: refused, never delivered
        intruder.send(executor.address, batch, tag=tag, session=("s1", b"x" * 32))
        assert done.wait(30) and outcome[0] is not None
        tag, outcome, done = told()  # a session this executor was never told of
        intruder.send(executor.address, batch, tag=tag, session=("s2", b"k" * 32))
        assert done.wait(30) and outcome[0] is not None
        assert len(got.batches) == 1
        eventually(lambda: executor.rejected["stream"] >= 2, timeout_seconds=10)
    finally:
        intruder.close()
        client.close()
        executor.close()


def test_a_clients_plane_takes_no_stream_without_its_session() -> None:
    client = DataPlane(None, lambda b: None, sessions_only=True, on_shards=Received())
    client.session_keys["s1"] = b"k" * 32
    stranger = DataPlane(None, lambda b: None)  # no keys at all: a daemon's stream, anyone's
    try:
        tag, outcome, done = told()
        stranger.send(client.address, ShardBatch(tag="f1", keys=["s1/b1/0"], arrays=[np.zeros(2)]), tag=tag)
        assert done.wait(30) and outcome[0] is not None
        eventually(lambda: client.rejected["stream"] >= 1, timeout_seconds=10)
    finally:
        stranger.close()
        client.close()


@pytest.mark.asyncio
async def test_only_the_shards_announced_are_stored() -> None:
    store = ObjectStore()
    plane = DataPlane(asyncio.get_running_loop(), lambda b: None)
    stored: list[tuple[str, int, np.ndarray]] = []

    def store_value(key: str, device: int, array: np.ndarray) -> None:
        stored.append((key, device, array))
        store.put(key, array, array.nbytes)

    async def on_host(value: object) -> object:
        return value

    direct = DirectTransfers("host0", store, plane, store_value, on_host)
    try:
        expect = ExpectShards(session="s1", data_key=b"k" * 32, keys=["s1/b1/0", "s1/b1/1"], devices=[0, 1],
                              shapes=[[4], [4]], dtype="float32")
        direct.expect(b"", Envelope(message=expect, msg_id=1, reply_to=None, sender="proxy"))
        f32 = np.arange(4, dtype=np.float32)
        direct.arrived("s2", ShardBatch(tag="put", keys=["s1/b1/0"], arrays=[f32], devices=[0]))  # not its session
        direct.arrived("s1", ShardBatch(tag="put", keys=["s1/b9/0"], arrays=[f32], devices=[0]))  # not announced
        direct.arrived("s1", ShardBatch(tag="put", keys=["s1/b1/0"], arrays=[f32.astype(np.float64)],
                                        devices=[0]))  # not the dtype announced
        direct.arrived("s1", ShardBatch(tag="put", keys=["s1/b1/1"], arrays=[f32], devices=[0]))  # not the device
        direct.arrived("s1", ShardBatch(tag="put", keys=["s1/b1/0"], arrays=[f32], devices=[0]))
        assert [(k, d) for k, d, _ in stored] == [("s1/b1/0", 0)]
        assert list(direct.expected) == ["s1/b1/1"]  # still awaited, as announced
        direct.forget("s1")
        assert not direct.expected and "s1" not in plane.session_keys
    finally:
        plane.close()
