"""The one lifecycle every daemon shares: in-process semantics, then real signals."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

import pwmesh as pw
from helpers import eventually, ping_status, slow_then_after
from pwmesh.service.lifecycle import Service, Status


class Recording(Service):
    role = "test"

    def __init__(self, setup_delay: asyncio.Event | None = None) -> None:
        super().__init__("recording")
        self.setups = 0
        self.drains = 0
        self.block_setup = setup_delay
        self.background_cancelled = asyncio.Event()

    async def setup(self) -> None:
        self.setups += 1
        if self.block_setup is not None:
            await self.block_setup.wait()
        self.tasks.spawn(self._background(), name="background")

    async def _background(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            self.background_cancelled.set()

    async def drain(self) -> None:
        self.drains += 1


@pytest.mark.asyncio
async def test_start_is_idempotent_and_close_cancels_owned_tasks() -> None:
    svc = Recording()
    await asyncio.gather(svc.start(), svc.start())
    await svc.start()
    assert svc.setups == 1 and svc.status is Status.RUNNING
    assert len(svc.tasks) == 1
    await asyncio.gather(svc.close(), svc.close())
    assert svc.status is Status.CLOSED and svc.drains == 1
    assert svc.background_cancelled.is_set() and len(svc.tasks) == 0
    await asyncio.wait_for(svc.wait_closed(), 1)


@pytest.mark.asyncio
async def test_startup_timeout_closes_the_half_started_service() -> None:
    svc = Recording(setup_delay=asyncio.Event())  # never set: setup hangs
    svc.startup_timeout_seconds = 0.2
    with pytest.raises(TimeoutError):
        await svc.start()
    assert svc.status is Status.CLOSED and svc.drains == 0


@pytest.mark.asyncio
async def test_async_with() -> None:
    async with Recording() as svc:
        assert svc.status is Status.RUNNING
    assert svc.status is Status.CLOSED


# ------------------------------------------------------------ real processes


@pytest.fixture
def two_hosts() -> Iterator[pw.LocalCluster]:
    """A cluster of its own (these tests stop one of its executors): one island, two hosts."""
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=1)
    with pw.LocalCluster(spec) as c:
        yield c


def _start_slow_then_fast(cluster: pw.LocalCluster) -> tuple[pw.Client, pw.Array, pw.Array]:
    client = pw.Client(cluster.address)
    _, _, _, x, y = slow_then_after(client, cluster.address)
    return client, x, y


def test_first_sigterm_drains_in_flight_work(two_hosts: pw.LocalCluster) -> None:
    client, x, y = _start_slow_then_fast(two_hosts)
    host0 = two_hosts.child("island0-host0").popen
    try:
        host0.send_signal(signal.SIGTERM)
        # The in-flight computation finished and its result left the host before it exited.
        assert np.isfinite(np.asarray(y)).all()
        assert host0.wait(timeout=30) == 0
        # What lived only on the drained host is gone, and says so at once.
        with pytest.raises(pw.DeviceLost, match="island0-host0"):
            np.asarray(x)
    finally:
        client.close()


def test_second_signal_forces_exit(two_hosts: pw.LocalCluster) -> None:
    client, x, y = _start_slow_then_fast(two_hosts)
    host0 = two_hosts.child("island0-host0")
    try:
        host0.popen.send_signal(signal.SIGTERM)
        # Signals of one kind coalesce: wait until the first was heard before sending the second.
        eventually(lambda: ping_status(host0.info["address"]) == "draining", 15)
        start = time.monotonic()
        host0.popen.send_signal(signal.SIGTERM)
        assert host0.popen.wait(timeout=30) == 1
        assert time.monotonic() - start < 5.0
    finally:
        client.close()


@pytest.mark.parametrize("role", ["rm", "proxy"])
def test_idle_daemons_stop_cleanly_on_sigint(two_hosts: pw.LocalCluster, role: str) -> None:
    daemon = two_hosts.child(role).popen
    daemon.send_signal(signal.SIGINT)
    assert daemon.wait(timeout=15) == 0


def test_daemon_cli_rejects_missing_options() -> None:
    done = subprocess.run([sys.executable, "-m", "pwmesh.cli.daemons", "executor", "--devices", "1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--island" in done.stderr or "--rm" in done.stderr
