"""Shared fixtures: one real local cluster per test session, a fresh client per test.

The cluster is real: a resource manager, one scheduler per island and several
executors, each its own process on 127.0.0.1, with real JAX on CPU devices.
Tests that need a cluster of another shape start their own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import jax
import pytest

import pwmesh as pw
from pwmesh.cli.commands import fetch_status

# In this process too (tests that drive an executor's parts directly): two CPU devices.
# The daemons set their own device count (LocalCluster drops XLA_FLAGS for them).
jax.config.update("jax_num_cpu_devices", 2)

# Two islands x two hosts x two devices: enough for three slices on three
# executors across both islands (Figure 2) and for same-host collectives.
SPEC = pw.LocalClusterSpec(islands=2, hosts_per_island=2, devices_per_host=2, session_timeout_seconds=30.0)

# One executor of eight devices per island: every slice of up to 8 devices fits on one host
# of either island (SPMD over a 2x2 mesh included), and island 0 -> island 1 is always
# another executor. Slices may share devices (placement balances load).
WIDE = pw.LocalClusterSpec(islands=2, hosts_per_island=1, devices_per_host=8)


@pytest.fixture(scope="session")
def cluster() -> Iterator[pw.LocalCluster]:
    os.environ.pop("PWMESH_ADDRESS", None)
    with pw.LocalCluster(SPEC) as running:
        yield running


@pytest.fixture(scope="session")
def wide_cluster() -> Iterator[pw.LocalCluster]:
    os.environ.pop("PWMESH_ADDRESS", None)
    with pw.LocalCluster(WIDE) as running:
        yield running


@pytest.fixture
def client(cluster: pw.LocalCluster) -> Iterator[pw.Client]:
    """A session of its own; closing it frees its slices and buffers."""
    with pw.Client(cluster.address, name="test") as c:
        yield c


@pytest.fixture
def default_client(cluster: pw.LocalCluster) -> Iterator[pw.Client]:
    """The module-level API (pw.get, pw.make_virtual_device_set...) bound to the test cluster."""
    c = pw.connect(cluster.address, name="test-default")
    yield c
    pw.disconnect()


@pytest.fixture
def objects(cluster: pw.LocalCluster) -> Callable[[], dict[str, int]]:
    """Live objects per executor. A status request leaves the proxy behind every delete
    posted before it on the same executor connections, so it observes them: no waiting."""
    return lambda: {s.executor_id: s.objects for s in fetch_status(cluster.address).executor_stats}
