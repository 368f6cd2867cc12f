"""A randomised run of faults under two clients (issue #28, item 7): ``pytest -m long tests/faults``.

Real daemons; two clients, each looping over its own slice (a put now and then, a program
every step, its value checked against plain NumPy). Meanwhile, faults drawn from a seeded
generator, one after another: the proxy, an executor or the island's scheduler killed
(SIGKILL) and started again on its address, under its name, at once or after a delay; an
executor paused (SIGSTOP) past the heartbeat timeout and resumed. The invariants, checked
throughout and at the end:

- no hang: every call returns or raises within ``BOUND`` seconds;
- errors name their cause: only ``DeviceLost``, ``Unavailable``, ``ResourceExhausted`` (a slice
  briefly without backing) or ``PwTimeoutError`` (an RM request during an outage) are raised,
  and never for a value already fetched once;
- the next program works: after each fault, each client completes a step within ``BOUND``;
- nothing leaks: once the clients close, within the session timeout, no slice and no object
  is left on any executor.

Outside CI (``long``); ``PWMESH_FAULTS`` (default 12) and ``PWMESH_FAULT_SEED`` choose the run. It
prints a line per fault (what, how long until each client's next good step) and the totals.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

import pwmesh as pw
from helpers import eventually
from pwmesh.cli.commands import fetch_status

HEARTBEAT = 2.0
SESSION_TIMEOUT = 8.0
BOUND = 4 * SESSION_TIMEOUT  # no call may take longer than this, whatever the fault
EXPECTED = (pw.DeviceLost, pw.Unavailable, pw.ResourceExhausted, pw.PwTimeoutError)

pytestmark = [pytest.mark.long, pytest.mark.timeout(3600)]


class Worker(threading.Thread):
    """One client's loop: a value on its slice, a step on it, checked."""

    def __init__(self, address: str, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.client = pw.Client(address, name=name)
        self.stop = threading.Event()
        self.steps = 0
        self.errors: dict[str, int] = {}
        self.unexpected: list[BaseException] = []
        self.slowest = 0.0
        self.last_good = 0.0  # monotonic: its last step that completed and checked

    def run(self) -> None:
        try:
            host = np.arange(6, dtype=np.float32).reshape(2, 3)
            x = step = None
            while not self.stop.is_set():
                start = time.monotonic()
                try:
                    if step is None:  # a slice asked for while the proxy restarts may have to be asked again
                        sl = self.client.make_virtual_device_set().add_slice(devices=2)
                        step = pw.pmap(lambda v: v * 0.5 + 1.0, devices=sl)
                    if x is None or self.steps % 7 == 0:
                        host = np.arange(6, dtype=np.float32).reshape(2, 3) + self.steps
                        x = self.client.put(host, sl)
                    y = step(x)
                    np.testing.assert_allclose(np.asarray(y), host * 0.5 + 1.0)
                    self.steps += 1
                    self.last_good = time.monotonic()
                except EXPECTED as exc:
                    self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1
                    x = None  # what it held may be gone: put it again
                except BaseException as exc:  # noqa: BLE001 - an invariant broken: reported by the test
                    self.unexpected.append(exc)
                    x = None
                self.slowest = max(self.slowest, time.monotonic() - start)
        finally:
            self.client.close()


def good_step_after(workers: list[Worker], since: float) -> float:
    """Wait until every worker completed a step after ``since``; how long that took."""
    eventually(lambda: all(w.last_good > since for w in workers), BOUND)
    return time.monotonic() - since


def fault(cluster: pw.LocalCluster, rng: random.Random) -> str:
    """Inflict one fault; what it was."""
    kind = rng.choice(["proxy", "executor", "executor-pause", "scheduler"])
    delay = rng.choice([0.0, 0.5 * SESSION_TIMEOUT])
    if kind == "executor-pause":
        name = rng.choice([c.name for c in cluster.children if c.role == "executor"])
        pid = cluster.child(name).popen.pid
        os.kill(pid, signal.SIGSTOP)
        time.sleep(2.5 * HEARTBEAT)  # the fault's length: past the heartbeat timeout
        os.kill(pid, signal.SIGCONT)
        return f"{name} paused {2.5 * HEARTBEAT:g} s"
    name = {"proxy": "proxy", "scheduler": "scheduler-0"}.get(kind) or rng.choice(
        [c.name for c in cluster.children if c.role == "executor"])
    child = cluster.child(name)
    child.popen.send_signal(signal.SIGKILL)
    child.popen.wait()
    time.sleep(delay)  # the outage's length
    cluster.restart(name)
    return f"{name} killed, restarted after {delay:g} s"


def test_random_faults_under_two_clients() -> None:
    faults = int(os.environ.get("PWMESH_FAULTS", "12"))
    seed = int(os.environ.get("PWMESH_FAULT_SEED", str(random.randrange(1 << 30))))
    rng = random.Random(seed)
    print(f"\nseed {seed}, {faults} faults")
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=3, devices_per_host=2,
                               session_timeout_seconds=SESSION_TIMEOUT, heartbeat_timeout_seconds=HEARTBEAT)
    with pw.LocalCluster(spec) as cluster:
        workers = [Worker(cluster.address, f"client{i}") for i in range(2)]
        for w in workers:
            w.start()
        good_step_after(workers, 0.0)  # each has its slice and has stepped once
        table: list[tuple[str, float]] = []
        for _ in range(faults):
            start = time.monotonic()
            what = fault(cluster, rng)
            recovered = good_step_after(workers, time.monotonic())
            table.append((what, time.monotonic() - start))
            print(f"  {what:45s} both clients stepping again {recovered:5.1f} s after it ended")
        for w in workers:
            w.stop.set()
        for w in workers:
            w.join(timeout=BOUND)
            assert not w.is_alive(), f"{w.name} hangs"
        report: dict[str, Any] = {w.name: (w.steps, w.errors, round(w.slowest, 1)) for w in workers}
        print(f"  steps, errors, slowest call (s) per client: {report}")
        assert all(not w.unexpected for w in workers), [w.unexpected for w in workers]
        assert all(w.slowest < BOUND for w in workers), report
        # Nothing leaks: the sessions closed, their slices and objects go.
        eventually(lambda: not fetch_status(cluster.address).cluster.slices
                   and sum(s.objects for s in fetch_status(cluster.address).executor_stats) == 0, 2 * SESSION_TIMEOUT)
        print("  invariants held: no hang, causes named, next step works, nothing leaked")
