"""A runaway computation does not keep other tenants off its device (issue #26, item 4).

Bob's run loops for ever. His tenant's deadline (``max_run_seconds``) fails the run, but XLA cannot be
made to stop a computation it runs: before, the device stayed held, and alice's computation queued
behind it on the same device never ran. Now the executor, seeing the cancelled run's computation still
on its device ``--reclaim-after-seconds`` later, restarts itself: the runaway fails, alice's computation
is queued again in the new process and completes, and every buffer on the executor (bob's included)
is kept. Real daemons on one one-device host, with keys, so the deadline is bob's alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pwmesh as pw
from helpers import eventually
from pwmesh.cli.commands import fetch_status
from pwmesh.proxy import tenants
from pwmesh.service import keys as cluster_keys

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def key_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cluster = cluster_keys.init(tmp_path_factory.mktemp("reclaim-keys") / "cluster")
    tenants.save(cluster / tenants.FILE_NAME, tenants.TenantPolicy({"bob": tenants.TenantLimits(max_run_seconds=2.0)}))
    return {"cluster": cluster, "alice": cluster_keys.add_client(cluster, "alice"),
            "bob": cluster_keys.add_client(cluster, "bob"), "root": cluster_keys.add_client(cluster, "root", admin=True)}


@pytest.fixture(scope="module")
def one_device(key_dirs: dict[str, Path]) -> Iterator[pw.LocalCluster]:
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=1, devices_per_host=1, keys=str(key_dirs["cluster"]),
                               executor_args=("--reclaim-after-seconds", "1"))
    with pw.LocalCluster(spec) as running:
        yield running


def forever(x: jax.Array) -> jax.Array:
    """Never returns: its loop's condition holds for ever."""
    def body(carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        i, v = carry
        return (i + 1) % 1000, jnp.sin(v) * 0.999 + 0.001
    return jax.lax.while_loop(lambda c: c[0] >= 0, body, (jnp.zeros((), jnp.int32), x))[1]


def test_a_runaway_past_its_deadline_gives_the_device_back(one_device: pw.LocalCluster,
                                                            key_dirs: dict[str, Path]) -> None:
    address = one_device.address
    with pw.Client(address, name="bob", keys=str(key_dirs["bob"])) as bob, \
            pw.Client(address, name="alice", keys=str(key_dirs["alice"])) as alice:
        bob_slice = bob.make_virtual_device_set().add_slice(devices=1)
        alice_slice = alice.make_virtual_device_set().add_slice(devices=1)
        assert bob_slice.devices[0].executor == alice_slice.devices[0].executor  # one device: they share it
        kept = bob.put(np.arange(4.0, dtype=np.float32)[None], bob_slice)
        a = alice.put(np.ones((1, 4), np.float32), alice_slice)
        inc = pw.pmap(lambda v: v + 1.0, devices=alice_slice)
        np.testing.assert_array_equal(np.asarray(inc(a)), np.full((1, 4), 2.0))  # compiled before

        runaway = pw.pmap(forever, devices=bob_slice)(np.ones((1, 8), np.float32))
        eventually(lambda: any(st.running for st in fetch_status(address, keys=str(key_dirs["root"])).executor_stats),
                   60)
        behind = inc(a)  # queued on the device the runaway holds
        with pytest.raises(pw.DeadlineExceeded, match="max_run_seconds"):
            np.asarray(runaway)
        # The executor restarts itself a second after the cancel; alice's computation runs after it.
        np.testing.assert_array_equal(np.asarray(behind), np.full((1, 4), 2.0))
        log = one_device.child("island0-host0").log_path.read_text()
        assert "restarting to take them back" in log
        # Nothing else was lost: bob's other buffer, alice's, and the device for everyone's next runs.
        np.testing.assert_array_equal(np.asarray(kept), [[0.0, 1.0, 2.0, 3.0]])
        np.testing.assert_array_equal(np.asarray(inc(inc(a))), np.full((1, 4), 3.0))
        np.testing.assert_array_equal(np.asarray(pw.pmap(lambda v: v * 2.0, devices=bob_slice)(kept)),
                                      [[0.0, 2.0, 4.0, 6.0]])
