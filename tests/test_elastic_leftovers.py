"""Elastic slices (issue #31, item 3), the leftovers: what a run aborted before it consumed them gives back
(donated arrays, ``Session.returnable`` in the proxy) leaves the devices with its slice and moves with it
when it is resumed or reshaped; a ``@pw.program`` of host data alone is traced again for a reshaped slice.
Real daemons; the run is aborted as ``tests/test_failures.py`` aborts one (its island's scheduler
restarted while the run waits behind seconds of work)."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pwmesh as pw
from helpers import eventually, slow
from pwmesh.cli.commands import fetch_status

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def three_hosts() -> Iterator[pw.LocalCluster]:
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=3, devices_per_host=2, heartbeat_timeout_seconds=2.0)
    with pw.LocalCluster(spec) as c:
        yield c


def _held(address: str) -> dict[str, tuple[int, int]]:
    """(bytes on the devices, objects) per executor."""
    return {s.executor_id: (s.bytes, s.objects) for s in fetch_status(address).executor_stats}


def _given_back(cluster: pw.LocalCluster, client: pw.Client, sl: pw.Slice, spec: P) -> tuple[pw.Array, object]:
    """``state`` (arange(8) laid out as ``spec``) donated to a step on ``sl`` that is aborted before it ran: the
    step waits behind seconds of work when the island's scheduler is restarted. ``state`` is not used after
    (not taken back yet): the proxy keeps it for its client. Returns it and the step."""
    busy = pw.pmap(slow, devices=sl)(np.ones(len(sl.devices)))
    executors = sl.executors
    eventually(lambda: any(s.running for s in fetch_status(cluster.address).executor_stats
                           if s.executor_id in executors), 30)
    step = pw.jit(lambda s: s * 2.0, devices=sl, in_specs=spec, out_specs=spec, donate_argnums=0)
    state = client.put(np.arange(8.0, dtype=np.float32), sl, spec)
    state.block_until_ready()
    new = step(state)
    scheduler = cluster.child("scheduler-0")
    scheduler.popen.send_signal(signal.SIGKILL)
    scheduler.popen.wait()
    cluster.restart("scheduler-0")
    with pytest.raises(pw.DeviceLost, match=rf"pw.Array {state.buffer_id} can be used again"):
        np.asarray(new)
    with pytest.raises(pw.DeviceLost):
        np.asarray(busy)
    return state, step


def test_a_donated_array_given_back_leaves_the_devices_with_its_slice_and_moves_when_it_is_resumed(
        three_hosts: pw.LocalCluster) -> None:
    with pw.Client(three_hosts.address, name="low") as low:
        sl = low.make_virtual_device_set().add_slice(devices=2, mesh={"x": 2})
        (first,) = sl.executors
        state, step = _given_back(three_hosts, low, sl, P("x"))
        assert _held(three_hosts.address)[first][0] > 0
        sl.suspend()
        # Every buffer of the slice leaves its devices, the one the client may take back too.
        eventually(lambda: _held(three_hosts.address)[first][0] == 0, 20)
        with pw.Client(three_hosts.address, name="high", priority=10) as high:
            taken = high.make_virtual_device_set().add_slice(devices=4)
            assert first in taken.executors
            sl.resume()
            (now,) = sl.executors
            assert now != first
            # Moved with the slice: nothing of it stays on the devices given to the other tenant.
            eventually(lambda: _held(three_hosts.address)[first][1] == 0, 20)
            np.testing.assert_array_equal(np.asarray(state), np.arange(8.0))  # taken back here: whole
            assert not state.is_deleted() and state.sharding.slice is sl
            np.testing.assert_array_equal(np.asarray(step(state)), np.arange(8.0) * 2)


def test_a_donated_array_given_back_is_resharded_when_its_slice_is_reshaped(three_hosts: pw.LocalCluster) -> None:
    with pw.Client(three_hosts.address) as client:
        sl = client.make_virtual_device_set().add_slice(devices=2, mesh={"x": 2})
        state, _ = _given_back(three_hosts, client, sl, P("x"))
        sl.reshape(4, mesh={"x": 4})
        assert len(sl.devices) == 4
        np.testing.assert_array_equal(np.asarray(state), np.arange(8.0))  # taken back after the reshape
        assert state.sharding.slice is sl and state.sharding.spec == P("x") and state.sharding.mesh == {"x": 4}
        double = pw.jit(lambda s: s * 2.0, devices=sl, in_specs=P("x"), out_specs=P("x"), donate_argnums=0)
        np.testing.assert_array_equal(np.asarray(double(state)), np.arange(8.0) * 2)


def test_a_program_of_host_data_is_traced_again_for_a_reshaped_slice(three_hosts: pw.LocalCluster) -> None:
    with pw.Client(three_hosts.address) as client:
        sl = client.make_virtual_device_set().add_slice(devices=2, mesh={"x": 2})
        double = pw.jit(lambda v: v * 2.0, devices=sl, in_specs=P("x"), out_specs=P("x"))
        traces = []

        @pw.program
        def twice(v):
            traces.append(1)
            return double(double(v))

        x = np.arange(12.0, dtype=np.float32)
        first = twice(x)
        np.testing.assert_array_equal(np.asarray(first), x * 4)
        assert first.sharding.mesh == {"x": 2}
        np.asarray(twice(x))
        assert len(traces) == 1  # traced once for the slice as it is
        sl.reshape(3, mesh={"x": 3})
        after = twice(x)
        np.testing.assert_array_equal(np.asarray(after), x * 4)
        assert after.sharding.mesh == {"x": 3} and len(after.sharding.slice.devices) == 3
        assert len(traces) == 2  # traced again for the new mesh, once
        np.asarray(twice(x))
        assert len(traces) == 2
