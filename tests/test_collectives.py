"""SPMD across hosts: collectives over slices that span executors of one island.

Each island's executors form one JAX multi-process group (``LocalClusterSpec(collectives=True)``:
a coordinator process per island, the executors its members, gloo on CPU). A ``pw.pmap`` with
``psum`` or a ``pw.jit`` over a mesh spanning executors is one SPMD program whose shards run on
their own executors and meet in their collectives; no executor waits for another before it starts.
Results equal one-process JAX; a collective whose peer dies fails with ``DeviceLost`` and the
survivors go on serving.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_train import reference, train

import pwmesh as pw
from helpers import eventually
from pwmesh.cli.commands import fetch_status

SPEC = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=2, collectives=True)


@pytest.fixture(scope="module")
def grouped() -> Iterator[pw.LocalCluster]:
    with pw.LocalCluster(SPEC) as running:
        yield running


@pytest.fixture
def client(grouped: pw.LocalCluster) -> Iterator[pw.Client]:
    with pw.Client(grouped.address, name="collectives") as c:
        yield c


def spanning(client: pw.Client, devices: int = 4, **kwargs: object) -> pw.Slice:
    sl = client.make_virtual_device_set().add_slice(devices=devices, **kwargs)  # type: ignore[arg-type]
    assert len({d.executor for d in sl.devices}) == 2, "the slice spans both executors"
    return sl


def test_the_island_executors_report_one_jax_group(grouped: pw.LocalCluster) -> None:
    executors = fetch_status(grouped.address).cluster.executors
    assert len(executors) == 2 and len({e.group for e in executors}) == 1 and executors[0].group
    ids = [d.global_id for e in executors for d in e.devices]
    assert len(set(ids)) == 4 and min(ids) >= 0, "every device has its own JAX id in the group"


def test_pmap_psum_over_executors_equals_one_process_jax(client: pw.Client) -> None:
    sl = spanning(client)
    total = pw.pmap(lambda x: jax.lax.psum(x, "i") * 2.0, devices=sl, axis_name="i")
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    for _ in range(3):  # the first run compiles; the rest run as compiled
        np.testing.assert_array_equal(np.asarray(total(x)), np.broadcast_to(x.sum(0) * 2.0, (4, 2)))


def test_jit_over_a_mesh_spanning_executors_equals_one_process_jax(client: pw.Client) -> None:
    sl = spanning(client, mesh={"data": 2, "model": 2})

    def layer(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.tanh(x @ w).sum(axis=1, keepdims=True) * x

    step = pw.jit(layer, devices=sl, in_specs=(P("data", None), P(None, "model")), out_specs=P("data", None))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 6)).astype(np.float32)
    w = rng.standard_normal((6, 4)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(step(x, w)), np.asarray(jax.jit(layer)(x, w)), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_training_on_a_mesh_over_two_hosts_equals_plain_jax(grouped: pw.LocalCluster, tmp_path: Path) -> None:
    pw.connect(grouped.address, name="train-over-hosts")
    try:
        ours = train("tiny", 10).losses
    finally:
        pw.disconnect()
    theirs = reference("tiny", 10, tmp_path / "jax.json")
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)


HEARTBEAT_TIMEOUT_SECONDS = 3.0


def quick_to_notice_loss() -> Iterator[pw.LocalCluster]:
    """A cluster of its own (the test changes its membership) that declares a silent host lost in 3 s."""
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=2, collectives=True,
                               heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_SECONDS, stop_timeout_seconds=5.0)
    with pw.LocalCluster(spec) as running:
        yield running


fragile = pytest.fixture(quick_to_notice_loss, name="fragile")
elastic = pytest.fixture(quick_to_notice_loss, name="elastic")


@pytest.mark.timeout(180)
@pytest.mark.timeout(120)
def test_a_gang_member_whose_input_is_gone_still_runs_its_collectives_so_the_next_run_pairs_right(
        grouped: pw.LocalCluster, client: pw.Client) -> None:
    """One member of a gang fails before it runs (here its piece of the input was deleted under it, as a
    resume's old copies once were, a0775f3): it still runs the computation's collectives, on zeros, and
    drops what it made. Collectives pair by their order on each device, not by run: before, its peer waited
    in this run's all-reduce for good, and the next run's all-reduce on the failed member paired with it,
    so the next run hung too (and could have computed from the wrong run's data)."""
    import asyncio

    from pwmesh.service.rpc import Connection
    from pwmesh.service.tasks import TaskGroup
    from pwmesh.service.transport import Context
    from pwmesh.wire.messages import DeleteShards, GetEvents

    sl = spanning(client, mesh={"d": 4})
    step = pw.jit(lambda x: x + jnp.sum(x), devices=sl, in_specs=(P("d"),))
    x = pw.put(np.arange(8, dtype=np.float32), sl, P("d"))
    np.testing.assert_array_equal(np.asarray(step(x)), np.arange(8, dtype=np.float32) + 28.0)

    async def delete_on(control: str, prefixes: list[str]) -> None:  # as a daemon would (no keys here)
        ctx, tasks = Context(), TaskGroup()
        try:
            conn = Connection(ctx, control, tasks=tasks, name="deleter")
            conn.post(DeleteShards(buffers=prefixes))
            await conn.request(GetEvents(limit=1), timeout_seconds=10.0)  # behind it on the connection: handled
        finally:
            await tasks.stop()
            ctx.close()

    # The proxy's name for x is b<id>.<n>, n a session counter: every likely one (a name not held is a no-op).
    host = fetch_status(grouped.address).cluster.executors[1]
    asyncio.run(delete_on(host.control, [f"{client.session_id}/b{x._id}.{n}" for n in range(64)]))
    with pytest.raises(pw.NotFound, match="was deleted"):
        np.asarray(step(x))
    y = pw.put(np.ones(8, dtype=np.float32), sl, P("d"))
    np.testing.assert_array_equal(np.asarray(step(y)), np.full(8, 9.0, np.float32))  # and not a hang
    warned = (grouped.log_dir / f"{host.executor_id}.log").read_text()
    assert "joined its collectives over 4 devices" in warned and "on zeros" in warned


def test_a_collective_whose_peer_dies_fails_with_device_lost_and_the_survivor_serves_on(
        fragile: pw.LocalCluster) -> None:
    with pw.Client(fragile.address, name="victim") as client:
        sl = spanning(client)
        busy = client.make_virtual_device_set().add_slice(devices=1)  # one device of the executor that dies
        victim = busy.devices[0].executor
        total = pw.pmap(lambda x: jax.lax.psum(x, "i"), devices=sl, axis_name="i")
        slow = pw.pmap(lambda x: jax.lax.fori_loop(0, 2_000_000_000, lambda i, v: v * 1.0000001, x), devices=busy)
        assert np.asarray(total(np.ones(4, np.float32))).tolist() == [4.0] * 4
        slow(np.ones(1, np.float32))  # holds one of the victim's devices (for minutes), so ...
        stuck = total(np.ones(4, np.float32))  # ... the survivor's shards wait in the psum for the victim's
        next(c for c in fragile.children if c.name == victim).popen.kill()
        start = time.monotonic()
        with pytest.raises(pw.DeviceLost):
            np.asarray(stuck)
        assert time.monotonic() - start < 2 * HEARTBEAT_TIMEOUT_SECONDS
        # The survivor's devices are free again: they run new work (once the victim is known to be
        # lost, a new slice can land only there).
        eventually(lambda: not any(e.alive for e in fetch_status(fragile.address).cluster.executors
                                   if e.executor_id == victim), 3 * HEARTBEAT_TIMEOUT_SECONDS)
        after = client.make_virtual_device_set().add_slice(devices=2)
        assert victim not in after.executors
        double = pw.pmap(lambda x: x * 2.0, devices=after)
        assert np.asarray(double(np.ones(2, np.float32))).tolist() == [2.0, 2.0]


def _formings(cluster: pw.LocalCluster) -> dict[str, int]:
    """Live executor -> the forming of the island's JAX group it is in."""
    return {e.executor_id: e.group_epoch for e in fetch_status(cluster.address).cluster.executors if e.alive}


@pytest.mark.timeout(300)
def test_the_group_re_forms_as_executors_join_and_leave_and_buffers_stay(elastic: pw.LocalCluster) -> None:
    with pw.Client(elastic.address, name="elastic") as client:
        sl = spanning(client)
        total = pw.pmap(lambda x: jax.lax.psum(x, "i") * 2.0, devices=sl, axis_name="i")
        x = np.arange(8, dtype=np.float32).reshape(4, 2)
        expected = np.broadcast_to(x.sum(0) * 2.0, (4, 2))
        kept = total(x)  # stays on both executors (never fetched) while they restart into new formings
        np.asarray(total(x))
        first = _formings(elastic)
        assert len(set(first.values())) == 1 and min(first.values()) >= 1, first

        # A host joins: every member restarts into a forming of three, and keeps what it held.
        elastic.add_executor(0, "island0-host2")
        eventually(lambda: len(set(_formings(elastic).values())) == 1 and len(_formings(elastic)) == 3, 60)
        joined = _formings(elastic)
        assert min(joined.values()) > max(first.values()), (first, joined)
        np.testing.assert_array_equal(np.asarray(kept), expected)
        np.testing.assert_array_equal(np.asarray(total(x)), expected)  # functions registered before
        wide = client.make_virtual_device_set().add_slice(devices=6)
        assert len(wide.executors) == 3
        wider = pw.pmap(lambda v: jax.lax.psum(v, "i"), devices=wide, axis_name="i")
        np.testing.assert_array_equal(np.asarray(wider(np.ones(6, np.float32))), [6.0] * 6)

        # A host leaves (stopped, as after a drain): the other two form a group without it.
        leaving = next(c for c in elastic.children if c.name == "island0-host2")
        leaving.popen.terminate()
        assert leaving.popen.wait(timeout=30) == 0
        # Work submitted as the others restart (its function and inputs sent to executors on their
        # way out: their proxy fences, then holds them) completes once they are back.
        during = pw.pmap(lambda v: v + 1.0, devices=client.make_virtual_device_set().add_slice(devices=2))
        np.testing.assert_array_equal(np.asarray(during(np.zeros(2, np.float32))), [1.0, 1.0])
        eventually(lambda: set(_formings(elastic)) == set(first)
                   and len(set(_formings(elastic).values())) == 1
                   and min(_formings(elastic).values()) > max(joined.values()), 60)
        np.testing.assert_array_equal(np.asarray(kept), expected)
        np.testing.assert_array_equal(np.asarray(total(x)), expected)
