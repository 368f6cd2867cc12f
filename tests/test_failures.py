"""A host dies mid-program: every affected future fails with DeviceLost, nothing hangs."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import eventually, slow

import pwmesh as pw
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
        devs = client.make_virtual_device_set()
        on0, on1 = devs.add_slice(devices=1), devs.add_slice(devices=1)
        remote_slow = pw.pmap(slow, devices=on0)
        after = pw.pmap(lambda s: s + 1.0, devices=on1)

        @pw.program
        def f(v):
            x = remote_slow(v)
            return x, after(x)

        x, y = f(np.ones(1))
        eventually(lambda: fetch_status(fragile.address).executor_stats[0].outstanding == 1, 30)
        fragile.child("island0-host0").popen.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        for arr in (x, y):  # y waits on host1 for data that will never come
            with pytest.raises(pw.DeviceLost, match="island0-host0"):
                np.asarray(arr)
        assert time.monotonic() - killed < 2 * HEARTBEAT_TIMEOUT_SECONDS + 1.0
        # host1's queue is not stuck behind the cancelled run: it runs new work.
        plus = pw.pmap(lambda v: v + 2.0, devices=on1)
        np.testing.assert_array_equal(np.asarray(plus(np.ones(1))), [3.0])
        # Work for the dead host fails at once with the reason.
        with pytest.raises(pw.DeviceLost, match="island0-host0"):
            np.asarray(pw.pmap(lambda v: v, devices=on0)(np.ones(1)))
        status = fetch_status(fragile.address)
        assert [e.alive for e in status.cluster.executors if e.executor_id == "island0-host0"] == [False]
