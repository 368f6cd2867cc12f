"""A host dies mid-program: affected futures fail with DeviceLost, nothing hangs, and the
session's slices move onto surviving devices so the same program runs again."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

import pwmesh as pw
from helpers import eventually, slow_then_after
from pwmesh.cli.commands import fetch_status

HEARTBEAT_TIMEOUT_SECONDS = 2.0


@pytest.fixture
def fragile() -> Iterator[pw.LocalCluster]:
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=1,
                               heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_SECONDS)
    with pw.LocalCluster(spec) as c:
        yield c


def test_executor_killed_mid_program(fragile: pw.LocalCluster) -> None:
    with pw.Client(fragile.address) as client:
        f, on0, on1, x, y = slow_then_after(client, fragile.address)
        kept = client.put(np.arange(3.0)[None], on0)  # lives only on host0
        after = pw.pmap(lambda s: s + 1.0, devices=on1)
        fragile.child("island0-host0").popen.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        for arr in (x, y):  # y waits on host1 for data that will never come
            with pytest.raises(pw.DeviceLost, match="island0-host0"):
                np.asarray(arr)
        assert time.monotonic() - killed < 2 * HEARTBEAT_TIMEOUT_SECONDS + 1.0
        # The session's virtual slice now lives on the surviving host: the same program,
        # unchanged, runs again.
        x2, y2 = f(np.ones(1))
        np.testing.assert_allclose(np.asarray(y2), np.asarray(x2) + 1.0)
        state = fetch_status(fragile.address).cluster
        (moved,) = [sl for sl in state.slices if sl.slice_id == on0.slice_id]
        assert [d.executor_id for d in moved.devices] == ["island0-host1"] and not moved.broken
        assert [e.alive for e in state.executors if e.executor_id == "island0-host0"] == [False]
        # A buffer that lived only on the lost host says so when used.
        with pytest.raises(pw.DeviceLost, match="island0-host0"):
            np.asarray(kept)
        with pytest.raises(pw.DeviceLost, match="island0-host0"):
            np.asarray(after(kept))


def test_scheduler_killed_then_restarted(fragile: pw.LocalCluster) -> None:
    with pw.Client(fragile.address) as client:
        sl = client.make_virtual_device_set().add_slice(devices=1)
        inc = pw.pmap(lambda x: x + 1.0, devices=sl)
        np.testing.assert_array_equal(np.asarray(inc(np.zeros(1))), [1.0])
        fragile.child("scheduler-0").popen.send_signal(signal.SIGKILL)
        # Within the heartbeat timeout the RM declares it lost; work for its island fails clearly.
        def refused() -> bool:
            try:
                np.asarray(inc(np.zeros(1)))
            except pw.DeviceLost as exc:
                return "scheduler of island 0" in str(exc)
            return False

        eventually(refused, 2 * HEARTBEAT_TIMEOUT_SECONDS + 5)
        fragile.restart("scheduler-0")  # same address, a new instance: it registers again
        eventually(lambda: not refused(), 15)
        np.testing.assert_array_equal(np.asarray(inc(np.ones(1))), [2.0])
