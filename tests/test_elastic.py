"""The cluster changes under running clients: hosts join and drain, the RM restarts,
clients vanish. Real processes, real signals; waits are on events or bounded."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import pwmesh as pw
from helpers import eventually, reap, slow
from pwmesh.cli.commands import fetch_status
from pwmesh.cli.main import main


@pytest.fixture
def one_island() -> Iterator[pw.LocalCluster]:
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=1, heartbeat_timeout_seconds=2.0,
                               session_timeout_seconds=2.0)
    with pw.LocalCluster(spec) as c:
        yield c


def _objects(cluster: pw.LocalCluster) -> dict[str, int]:
    return {s.executor_id: s.objects for s in fetch_status(cluster.address).executor_stats}


def test_drain_moves_devices_and_buffers_then_the_host_can_stop(one_island: pw.LocalCluster) -> None:
    with pw.Client(one_island.address) as client:
        sl = client.make_virtual_device_set().add_slice(devices=1)
        assert sl.devices[0].executor == "island0-host0"
        kept = client.put(np.array([[1.0, 2.0]]), sl)
        double = pw.pmap(lambda x: x * 2.0, devices=sl)
        done = double(kept)
        np.testing.assert_array_equal(np.asarray(done), [[2.0, 4.0]])
        in_flight = pw.pmap(slow, devices=sl)(np.ones(1))  # still running when the drain starts

        result = CliRunner().invoke(main, ["drain", "island0-host0", "--address", one_island.address])
        assert result.exit_code == 0, result.output
        assert "island0-host0 drained: 1 slice(s) and 3 buffer(s) moved" in result.output

        state = fetch_status(one_island.address).cluster
        host0 = next(e for e in state.executors if e.executor_id == "island0-host0")
        assert host0.alive and host0.draining
        (moved,) = [s for s in state.slices if s.slice_id == sl.slice_id]
        assert [d.executor_id for d in moved.devices] == ["island0-host1"]
        status = CliRunner().invoke(main, ["status", "--address", one_island.address])
        assert "draining" in status.output

        # The drained host holds nothing any more: stopping it loses no data.
        host0_process = one_island.child("island0-host0").popen
        host0_process.send_signal(signal.SIGTERM)
        assert host0_process.wait(timeout=30) == 0
        np.testing.assert_array_equal(np.asarray(kept), [[1.0, 2.0]])
        np.testing.assert_array_equal(np.asarray(done), [[2.0, 4.0]])
        assert np.isfinite(np.asarray(in_flight)).all()
        # Client code is unchanged: the same compiled function now runs on host1.
        np.testing.assert_array_equal(np.asarray(double(kept)), [[2.0, 4.0]])


def test_a_host_joins_a_running_cluster(one_island: pw.LocalCluster) -> None:
    with pw.Client(one_island.address) as client:
        devs = client.make_virtual_device_set()
        with pytest.raises(pw.ResourceExhausted):
            devs.add_slice(devices=3)
        one_island.add_executor(0, "island0-late", devices=2)
        sl = devs.add_slice(devices=3)
        assert "island0-late" in {d.executor for d in sl.devices}
        f = pw.pmap(lambda x: x + 1.0, devices=sl)
        np.testing.assert_array_equal(np.asarray(f(np.zeros(3))), [1.0, 1.0, 1.0])


def test_resource_manager_restart_rebuilds_its_state(one_island: pw.LocalCluster) -> None:
    with pw.Client(one_island.address) as client:
        devs = client.make_virtual_device_set()
        sl = devs.add_slice(devices=1)
        inc = pw.pmap(lambda x: x + 1.0, devices=sl)
        np.testing.assert_array_equal(np.asarray(inc(np.zeros(1))), [1.0])

        one_island.restart("rm")
        # Programs on existing slices need no RM: they keep running at once.
        np.testing.assert_array_equal(np.asarray(inc(np.ones(1))), [2.0])
        # Executors, schedulers and the proxy re-register within a heartbeat or two.
        def rebuilt() -> bool:
            state = fetch_status(one_island.address).cluster
            return (len([e for e in state.executors if e.alive]) == 2 and len(state.schedulers) == 1
                    and sl.slice_id in {s.slice_id for s in state.slices})

        eventually(rebuilt, 20)
        other = devs.add_slice(devices=1)
        assert other.slice_id != sl.slice_id
        assert other.devices[0].executor == "island0-host1"  # the restored slice still counts as load
        np.testing.assert_array_equal(np.asarray(pw.pmap(lambda x: -x, devices=other)(np.ones(1))), [-1.0])


def test_a_killed_client_frees_everything_it_owned(one_island: pw.LocalCluster, tmp_path: Path) -> None:
    bystander = pw.Client(one_island.address, name="bystander")
    mine = bystander.make_virtual_device_set().add_slice(devices=1)
    kept = bystander.put(np.arange(4.0)[None], mine)
    kept.block_until_ready()
    baseline = _objects(one_island)  # the bystander's buffer is part of it
    script = tmp_path / "victim.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        import numpy as np
        import pwmesh as pw
        c = pw.Client({one_island.address!r})
        devs = c.make_virtual_device_set()
        a, b = devs.add_slice(devices=1), devs.add_slice(devices=1)
        held = [c.put(np.ones((1, 1000)), a) for _ in range(3)]
        moved = pw.pmap(lambda x: x * 2, devices=b)(held[0])
        moved.block_until_ready()
        print("ready", flush=True)
        sys.stdin.read()  # wait to be killed
    """))
    victim = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout is not None
        assert victim.stdout.readline().strip() == "ready"
        assert sum(_objects(one_island).values()) > sum(baseline.values())
        assert len(fetch_status(one_island.address).sessions) == 2
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        # Nothing tells the proxy a client died; it notices the silence (session timeout 2 s).
        eventually(lambda: _objects(one_island) == baseline, 15)
        status = fetch_status(one_island.address)
        assert [s.name for s in status.sessions] == ["bystander"]
        assert [sl.slice_id for sl in status.cluster.slices] == [mine.slice_id]
        # The other client never noticed.
        np.testing.assert_array_equal(np.asarray(kept), [[0.0, 1.0, 2.0, 3.0]])
        np.testing.assert_array_equal(np.asarray(pw.pmap(lambda x: x + 1, devices=mine)(kept)), [[1.0, 2.0, 3.0, 4.0]])
    finally:
        bystander.close()
        reap(victim)
