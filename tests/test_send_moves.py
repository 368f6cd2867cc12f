"""A run's moves from one executor travel as one message (issue #31 item 2): the proxy sends each holder
executor one ``SendMoves`` per run, all of that run's moves for it, not a ``SendShards`` per array; the
executor sends them in one pass, the tuples for each destination batched across arrays; the receiver
lands a batch's arrays in one hop to its host-copy thread (``land_all``).

Real daemons (two islands of two executors each, real sockets, real JAX on CPU devices); what the
executors received is read from their metrics (``pwmesh_messages_received_total`` by op).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from prometheus_client.parser import text_string_to_metric_families

import pwmesh as pw
from pwmesh.dataflow.exchange import Landing
from pwmesh.dataflow.plane import BufferPool
from pwmesh.executor.daemon import MOVE_BATCH_BYTES
from pwmesh.executor.landing import land_all
from pwmesh.wire.messages import DataTuple

pytestmark = pytest.mark.timeout(120)

TRAINER = {"data": 2, "model": 2}


def received(cluster: pw.LocalCluster, op: str) -> dict[str, float]:
    """Each executor's count of control messages ``op`` received so far."""
    executors = {c.name for c in cluster.children if c.role == "executor"}
    out: dict[str, float] = {}
    for name, address in cluster.metrics_addresses().items():
        if name not in executors:
            continue
        with urllib.request.urlopen(address, timeout=10) as reply:
            families = text_string_to_metric_families(reply.read().decode())
            out[name] = sum(s.value for f in families for s in f.samples
                            if s.name == "pwmesh_messages_received_total" and s.labels.get("op") == op)
    return out


def tree_of(rng: np.random.Generator) -> tuple[dict[str, np.ndarray], dict[str, P]]:
    """Megatron-like leaves: column- and row-split weights of 8-16 MiB (over twice ``MOVE_BATCH_BYTES``
    together: each of two holders' messages goes in more than one batch), small replicated ones."""
    tree = {"w1": rng.random((2048, 2048), dtype=np.float32), "w2": rng.random((2048, 2048), dtype=np.float32),
            "w0": rng.random((2048, 1024), dtype=np.float32),
            "wq": rng.random((256, 8, 32), dtype=np.float32), "b1": rng.random((2048,), dtype=np.float32),
            "ln": rng.random((1024,), dtype=np.float32), "w3": rng.random((64, 2048), dtype=np.float32)}
    specs = {"w1": P(None, "model"), "w2": P("model", None), "wq": P(None, "model", None), "b1": P("model"),
             "ln": P(), "w3": P("data", "model"),
             "w0": P("data", "model")}
    assert sum(leaf.nbytes for leaf in tree.values()) > 2 * MOVE_BATCH_BYTES
    return tree, specs


@pytest.fixture(scope="module")
def cluster() -> Iterator[pw.LocalCluster]:
    spec = pw.LocalClusterSpec(islands=2, hosts_per_island=2, devices_per_host=2,
                               executor_args=("--no-shared-memory",), metrics=True)
    with pw.LocalCluster(spec) as cluster:
        yield cluster


def test_each_holder_gets_one_send_moves_per_sync_and_every_leaf_lands(cluster: pw.LocalCluster) -> None:
    """A trainer over two executors to a sampler over the two of the other island: per sync, each holder
    hears one ``SendMoves`` (none a ``SendShards``), whatever the number of arrays, and every leaf
    arrives whole on every sampler device (each holder's tuples reach two destinations)."""
    with pw.Client(cluster.address, name="test-send-moves") as client:
        devs = client.make_virtual_device_set()
        trainer = devs.add_slice(devices=4, island=0, mesh=TRAINER)
        sampler = devs.add_slice(devices=4, island=1, mesh={"data": 4})
        tree, specs = tree_of(np.random.default_rng(0))
        on_trainer = client.put(tree, trainer, spec=specs)
        client.session.await_buffers([a.buffer_id for a in jax.tree_util.tree_leaves(on_trainer)])
        holders = trainer.executors
        assert len(holders) == 2
        for _ in range(3):  # the first sync lowers, the next ones reuse the cached lowering: one message each
            moves, shards = received(cluster, "exec.send_moves"), received(cluster, "exec.send_shards")
            synced = pw.reshard(on_trainer, devices=sampler, spec=P())
            leaves = jax.tree_util.tree_leaves(synced)
            got = client.fetch(leaves, timeout_seconds=60)
            for value, want in zip(got, jax.tree_util.tree_leaves(tree), strict=True):
                np.testing.assert_array_equal(value, want)
            after = received(cluster, "exec.send_moves")
            assert {name: after[name] - moves[name] for name in after} == {
                name: 1.0 if name in holders else 0.0 for name in after}
            assert received(cluster, "exec.send_shards") == shards
            for a in leaves:
                a.delete()


def test_moves_of_buffers_still_arriving_wait_for_them_and_land(cluster: pw.LocalCluster) -> None:
    """Resharded right after the put, not awaited: a move whose shards are not yet there waits for them
    (what was cut before it leaves first); every leaf lands, twice over (a reshard of the reshard)."""
    with pw.Client(cluster.address, name="test-send-moves-early") as client:
        devs = client.make_virtual_device_set()
        trainer = devs.add_slice(devices=4, island=0, mesh=TRAINER)
        sampler = devs.add_slice(devices=4, island=1, mesh={"data": 2, "model": 2})
        tree, specs = tree_of(np.random.default_rng(1))
        on_trainer = client.put(tree, trainer, spec=specs)
        there = pw.reshard(on_trainer, devices=sampler, spec=P())
        back = pw.reshard(there, devices=trainer, spec=specs)
        got = client.fetch(jax.tree_util.tree_leaves(back), timeout_seconds=60)
        for value, want in zip(got, jax.tree_util.tree_leaves(tree), strict=True):
            np.testing.assert_array_equal(value, want)


def test_a_leaf_that_cannot_land_fails_alone_among_the_moves_of_its_message() -> None:
    """One message carries every array; the one the destination's memory limit refuses fails with the
    cause, and the others of the same message land."""
    spec = pw.LocalClusterSpec(islands=2, hosts_per_island=1, devices_per_host=4, memory_limit_bytes=4 << 20,
                               executor_args=("--no-shared-memory",), metrics=True)
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address, name="test-send-moves-refused") as client:
        devs = client.make_virtual_device_set()
        trainer = devs.add_slice(devices=4, island=0, mesh=TRAINER)
        sampler = devs.add_slice(devices=2, island=1, mesh={"data": 2})
        rng = np.random.default_rng(2)
        small = {"a": rng.random((64, 256), dtype=np.float32), "b": rng.random((256,), dtype=np.float32)}
        big = np.arange(768 * 1024, dtype=np.float32).reshape(768, 1024)  # 3 MiB: 6 MiB as 2 replicas
        on_trainer = client.put({"big": big, **small}, trainer,
                                spec={"big": P("data", "model"), "a": P(None, "model"), "b": P("model")})
        client.session.await_buffers([a.buffer_id for a in jax.tree_util.tree_leaves(on_trainer)])
        before = received(cluster, "exec.send_moves")
        synced = pw.reshard(on_trainer, devices=sampler, spec=P())
        with pytest.raises(pw.ResourceExhausted, match="does not fit"):
            client.fetch([synced["big"]], timeout_seconds=60)
        got = client.fetch([synced["a"], synced["b"]], timeout_seconds=60)
        np.testing.assert_array_equal(got[0], small["a"])
        np.testing.assert_array_equal(got[1], small["b"])
        after = received(cluster, "exec.send_moves")
        assert sum(after.values()) - sum(before.values()) == 1


def test_one_hop_lands_each_value_of_a_batch_or_returns_its_own_failure() -> None:
    """``land_all``, as the receiver's host-copy thread runs it for a batch's arrays (real JAX, CPU
    devices): a value that cannot be assembled is returned as its error, and the others of the batch
    land on their devices all the same."""
    def whole(prefix: str, array: np.ndarray, shape: list[int]) -> Landing:
        t = DataTuple(prefix=prefix, shard=0, device=0, src=0, sources=1, shape=shape, dtype="float32",
                      count=1, seq=0, array=array)
        return Landing([(f"{prefix}/0", 0)], [t], t)

    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    y = np.ones((8, 4), np.float32)
    devices = jax.devices("cpu")[:1]
    landed = land_all([(whole("s/x", x, [4, 4]), devices), (whole("s/bad", np.ones((5, 5), np.float32), [4, 4]),
                                                            devices), (whole("s/y", y, [8, 4]), devices)],
                      BufferPool().take)
    assert isinstance(landed[1], ValueError) and "broadcast" in str(landed[1])
    assert not isinstance(landed[0], Exception) and not isinstance(landed[2], Exception)
    (first,), (third,) = landed[0], landed[2]
    assert first.devices() == {devices[0]} and third.devices() == {devices[0]}
    np.testing.assert_array_equal(np.asarray(first), x)
    np.testing.assert_array_equal(np.asarray(third), y)
