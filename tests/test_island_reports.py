"""Completions per island with real daemons (issue 30, item 2): executors report to their island's
scheduler, which tells the proxy once per run per island; failures keep their cause; frees go through the
island's scheduler to every executor; a scheduler restart mid-run neither loses nor doubles a completion.
(The pure-core cases, each race driven event by event: ``tests/test_island_completions.py``.)"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pwmesh as pw
from helpers import eventually, fails_across_islands, slow_then_after
from pwmesh.cli.commands import debug_events, fetch_status
from pwmesh.client.connection import ClientConnection
from pwmesh.wire.messages import DrainHost, HostDrained

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def two_islands() -> Iterator[pw.LocalCluster]:
    """Two islands of two one-device hosts: a 2-device slice spans both executors of its island."""
    spec = pw.LocalClusterSpec(islands=2, hosts_per_island=2, devices_per_host=1)
    with pw.LocalCluster(spec) as c:
        yield c


def event_count(address: str, daemon: str, what: str) -> int:
    return debug_events(address, daemon, 0).count(what)


def objects(address: str) -> Callable[[], dict[str, int]]:
    return lambda: {s.executor_id: s.objects for s in fetch_status(address).executor_stats}


def test_a_program_across_two_islands_completes_and_the_proxy_hears_of_it_per_island(
        two_islands: pw.LocalCluster) -> None:
    address = two_islands.address
    with pw.Client(address, name="islands") as client:
        devs = client.make_virtual_device_set()
        s0, s1 = devs.add_slice(devices=2, island=0), devs.add_slice(devices=2, island=1)
        assert len({d.executor for d in s0.devices}) == 2 and len({d.executor for d in s1.devices}) == 2
        a = pw.pmap(lambda x: x * 3.0, devices=s0)
        b = pw.pmap(lambda x: x - 1.0, devices=s1)

        @pw.program
        def f(v):
            return b(a(v)), a(v)

        np.testing.assert_array_equal(np.asarray(f(np.array([1.0, 2.0]))[0]), [2.0, 5.0])  # warm: registered
        island_done = event_count(address, "proxy", "proxy.island_done")
        before = [event_count(address, f"scheduler-{i}", "part-done-") for i in (0, 1)]
        runs = 4
        outs = [f(np.array([1.0, 2.0]) + k) for k in range(runs)]
        for k, (y, x) in enumerate(outs):
            np.testing.assert_array_equal(np.asarray(y), np.array([2.0, 5.0]) + 3 * k)
            np.testing.assert_array_equal(np.asarray(x), np.array([3.0, 6.0]) + 3 * k)
        # Each island's scheduler heard every executor's part end (two executors an island, one part each);
        # the proxy heard nothing from an executor, only from the islands.
        after = [event_count(address, f"scheduler-{i}", "part-done-") for i in (0, 1)]
        assert [n - m for n, m in zip(after, before, strict=True)] == [2 * runs, 2 * runs]
        assert event_count(address, "proxy", "exec.node_done") == 0
        # One message per run per island when its parts end (and an output told early, at most, if an
        # executor reported it in a turn before its part's end): not one per executor.
        told = event_count(address, "proxy", "proxy.island_done") - island_done
        assert 2 * runs <= told <= 2 * runs * 2


def test_a_failed_computation_reaches_the_caller_with_its_cause_through_the_islands_scheduler(
        two_islands: pw.LocalCluster) -> None:
    address = two_islands.address
    with pw.Client(address, name="failing") as client:
        s0, _ = fails_across_islands(client)  # fails on both executors of island 0, and downstream on island 1
        assert event_count(address, "proxy", "exec.node_done") == 0  # it came through the scheduler
        ok = pw.pmap(lambda v: v + 1.0, devices=s0)  # the island goes on serving
        np.testing.assert_array_equal(np.asarray(ok(np.array([1.0, 2.0]))), [2.0, 3.0])


def test_frees_reach_every_executor_through_the_islands_scheduler(two_islands: pw.LocalCluster) -> None:
    address = two_islands.address
    count = objects(address)
    eventually(lambda: sum(count().values()) == 0, 30)  # the earlier tests' sessions' values freed
    frees = [event_count(address, f"scheduler-{i}", " free-") for i in (0, 1)]
    with pw.Client(address, name="frees") as client:
        devs = client.make_virtual_device_set()
        s0, s1 = devs.add_slice(devices=2, island=0), devs.add_slice(devices=2, island=1)
        a = pw.pmap(lambda x: x * 3.0, devices=s0)
        b = pw.pmap(lambda x: x - 1.0, devices=s1)

        @pw.program
        def f(v):
            x = a(v)
            return b(a(x)), x  # a temporary on island 0 (a(x)), moved to island 1 for b

        outs = [f(np.array([1.0, 2.0])) for _ in range(3)]
        for out, x in outs:
            np.testing.assert_array_equal(np.asarray(out), [8.0, 17.0])
            np.testing.assert_array_equal(np.asarray(x), [3.0, 6.0])
        held = count()
        assert all(held[e] > 0 for e in held), f"every executor holds an output shard: {held}"
        del outs, out, x
        # The runs' temporaries and then the released outputs are deleted on all four executors.
        eventually(lambda: sum(count().values()) == 0, 30)
        after = [event_count(address, f"scheduler-{i}", " free-") for i in (0, 1)]
        assert all(n > m for n, m in zip(after, frees, strict=True)), "each island's frees came as FreeShards"




def test_a_scheduler_restart_mid_run_neither_loses_nor_doubles_a_completion(fragile: pw.LocalCluster) -> None:
    """The island's scheduler is killed and started again while runs are in flight: some of their executors
    had reported to it (it died holding their completions), some report to the new instance (which never
    ordered them). Every output still settles, exactly once: with its value, or with ``DeviceLost`` naming
    the scheduler's restart; none waits for ever. An input every run read is still whole (a run finished
    twice would have freed it under the next), and runs after the restart complete as usual."""
    address = fragile.address
    with pw.Client(address, name="restart") as client:
        f, on0, on1, x, y = slow_then_after(client, address)  # host0 computes for seconds
        kept = client.put(np.array([5.0]), on1)
        inc = pw.pmap(lambda s: s + 1.0, devices=on1)
        quick = [inc(kept) for _ in range(8)]  # on host1: done before, around and after the restart
        queued = f(np.ones(1))[1]  # behind the slow one on host0
        scheduler = fragile.child("scheduler-0")
        scheduler.popen.send_signal(signal.SIGKILL)
        scheduler.popen.wait()
        fragile.restart("scheduler-0")
        settled = {"value": 0, "lost": 0}
        for arr, want in [*[(q, 6.0) for q in quick], (x, None), (y, None), (queued, None)]:
            try:
                got = np.asarray(arr)
            except pw.DeviceLost as exc:
                assert "scheduler of island 0" in str(exc)
                settled["lost"] += 1
            else:
                if want is not None:
                    np.testing.assert_array_equal(got, [want])
                settled["value"] += 1
        assert sum(settled.values()) == 11 and settled["lost"] >= 1  # the queued run at least was in flight
        np.testing.assert_array_equal(np.asarray(kept), [5.0])  # never freed under a run
        for _ in range(3):  # the island orders and reports again
            np.testing.assert_array_equal(np.asarray(inc(kept)), [6.0])
        x2, y2 = f(np.ones(1))
        np.testing.assert_allclose(np.asarray(y2), np.asarray(x2) + 1.0)
        # The last run's values come early (its output reported at once); its end follows: wait for that event.

        def runs_left() -> int:
            (session,) = [s for s in fetch_status(address).sessions if s.name == "restart"]
            return session.programs

        eventually(lambda: runs_left() == 0, 30)  # no run is left waiting for a completion


def _spin(x):
    # ``x`` loops of real work (a loop of ~0.3 ms each on one CPU core): each device its own count.
    m = jnp.full((192, 192), 0.01, jnp.float32)
    v = jnp.full((192, 192), 0.5, jnp.float32)
    return x + 0.0 * jax.lax.fori_loop(0, x.astype(jnp.int32)[0], lambda i, a: jnp.tanh(a @ m), v).sum()


def test_a_host_drained_while_its_reports_are_on_their_way_fails_no_run() -> None:
    """A host is drained and stopped while runs over it and another host are under way: it ends its parts
    quickly and reports each to the island's scheduler as it goes, and leaves (after a barrier proving those
    reports arrived) while the other host still works on the same runs. The scheduler, told of the leaving after
    the reports, fails no run whose part there had ended (the proxy, which hears per island now, no longer
    judges that itself): every run completes with its value, once, and the slice goes on where it moved."""
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=3, devices_per_host=1)
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address, name="drain") as client:
        sl = client.make_virtual_device_set().add_slice(devices=2)
        slow_host, quick_host = (d.executor for d in sl.devices)
        assert slow_host != quick_host
        step = pw.pmap(_spin, devices=sl)
        np.testing.assert_array_equal(np.asarray(step(np.array([[1.0], [1.0]]))), [[1.0], [1.0]])  # compiled
        work = np.array([[3000.0], [1.0]])  # a second on the slow host a run, nothing on the quick one
        outs = [step(work + k) for k in range(5)]
        conn = ClientConnection(cluster.address, name="operator", open_session=False)
        try:  # its slices move off it (the runs' outputs too); then it is stopped, and leaves gracefully
            drained = conn.request(DrainHost(executor=quick_host), timeout_seconds=120.0)
        finally:
            conn.close()
        assert isinstance(drained, HostDrained) and drained.executor_id == quick_host
        leaving = cluster.child(quick_host).popen
        leaving.send_signal(signal.SIGTERM)
        assert leaving.wait(timeout=60) == 0
        gone = fetch_status(cluster.address)
        assert [e.alive for e in gone.cluster.executors if e.executor_id == quick_host] == [False]
        assert any(s.executor_id == slow_host and s.outstanding for s in gone.executor_stats), "the test's premise"
        for k, out in enumerate(outs):
            np.testing.assert_array_equal(np.asarray(out), work + k)
        np.testing.assert_array_equal(np.asarray(step(np.array([[1.0], [2.0]]))), [[1.0], [2.0]])
        # Its value can reach the client before the proxy took the run's completion (the executor sends an early
        # fetch's reply first): the run is over once the proxy has, soon after.
        eventually(lambda: [s.programs for s in fetch_status(cluster.address).sessions if s.name == "drain"] == [0], 30)
