"""A long computation never makes its executor look dead (issue #32).

What a user tried: a function whose run time depends on its input, called 30 times
quickly, then once for many heartbeat timeouts. The executor had learnt the function was
quick and ran the long call on its event loop, so it stopped beating, the resource manager
wrote the host off with every buffer on it, and SIGTERM went unheard. Here the same
sequence runs on one executor, on two, and on two in a JAX group (an SPMD gang): the
call completes and is delivered, the host stays alive and shows as busy with what it runs,
and the loop is never held for long. Also: a long first compile, a large host put, and
SIGTERM in the middle of a long computation (it stops within its grace, and the caller
is told the stop was why).

Durations are calibrated on this machine (plain JAX, same process) so that each long
call lasts several heartbeat timeouts; the assertions are on events and states, not times,
except the loop's bound, which is the point.
"""

from __future__ import annotations

import functools
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pwmesh as pw
from helpers import eventually
from pwmesh.cli.commands import fetch_status, format_status
from pwmesh.executor.functions import CompiledFunction, bounded
from pwmesh.executor.state import runs_inline

HEARTBEAT = 2.0  # seconds: a host silent for this long is declared lost
LONG = 3 * HEARTBEAT  # the long call: this many seconds at least (three heartbeat timeouts)
# Loop wake-ups later than this fail the test. The computations here would hold it for LONG; the
# bound is loose for a loaded 2-core machine (the executors' own stalls are measured in bench/).
LOOP_BOUND = 1.0
LANES = 8

pytestmark = pytest.mark.timeout(240)


def spin(x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``n`` dependent steps over ``x``: its run time is its input's, not its shape's. Returns the
    steps taken (so the caller can check the whole loop ran) and the values."""
    def body(carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        i, v = carry
        return i + 1, jnp.sin(v) * 0.999 + 0.001
    return jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.zeros((), jnp.int32), x))


@functools.cache
def steps_per_second() -> float:
    """How many ``spin`` steps this machine takes a second (plain JAX, one device)."""
    fn = jax.jit(spin)
    x = jnp.ones(LANES, jnp.float32)
    jax.block_until_ready(fn(x, jnp.int32(10)))
    n = 200_000
    while True:
        start = time.perf_counter()
        jax.block_until_ready(fn(x, jnp.int32(n)))
        seconds = time.perf_counter() - start
        if seconds > 0.2:
            return n / seconds
        n *= 4


def long_steps(seconds: float) -> int:
    return min(int(steps_per_second() * seconds), 2**31 - 1)


def stalls_since(address: str, since: float) -> list[list[float]]:
    """Every executor's loop stalls (wall clock, seconds held) since ``since``, at least LOOP_BOUND long."""
    return [stall for st in fetch_status(address).executor_stats for stall in st.loop_stalls
            if stall[0] >= since and stall[1] >= LOOP_BOUND]


def wait_busy(address: str, timeout_seconds: float) -> str:
    """Wait until an executor reports running something; the cluster status as text then."""
    eventually(lambda: any(st.running for st in fetch_status(address).executor_stats), timeout_seconds)
    return format_status(fetch_status(address))


def in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


def quick_then_long(address: str, call: Any, lanes: int) -> None:
    """The issue's sequence: 30 quick calls, then one lasting LONG, watched while it runs."""
    x = np.ones((lanes, LANES), np.float32) if lanes > 1 else np.ones(LANES, np.float32)
    expected_quick = np.asarray(jax.jit(spin)(jnp.ones(LANES, jnp.float32), jnp.int32(1))[1])
    for _ in range(30):
        steps, values = call(x, 1)
        assert np.all(np.asarray(steps) == 1)
        np.testing.assert_allclose(np.asarray(values).reshape(-1, LANES)[0], expected_quick, rtol=1e-6)
    since = time.time()
    n = long_steps(LONG)
    thread, result = in_thread(lambda: [np.asarray(v) for v in call(x, n)])
    status = wait_busy(address, 30)
    assert "busy" in status and "running" in status, status
    # Busy, not dead: while it runs, for longer than the heartbeat timeout, the host stays up.
    deadline = time.monotonic() + 3 * HEARTBEAT
    while time.monotonic() < deadline and thread.is_alive():
        assert all(e.alive for e in fetch_status(address).cluster.executors), "a busy host was taken for dead"
        thread.join(timeout=0.5)
    thread.join(timeout=180)
    assert not thread.is_alive(), "the long call never returned"
    assert "error" not in result, result.get("error")
    steps, values = result["value"]
    assert np.all(steps == n), "the whole loop ran and its result was delivered"
    assert np.all(np.isfinite(values))
    assert all(e.alive for e in fetch_status(address).cluster.executors)
    assert stalls_since(address, since) == [], "an executor's loop was held while it computed"
    # And the executor serves the next call as before.
    steps, _ = call(x, 1)
    assert np.all(np.asarray(steps) == 1)


# ------------------------------------------------------------------ the inline decision


def test_a_function_that_loops_on_its_data_never_runs_on_the_loop() -> None:
    """Whatever it measured before: XLA:CPU runs a small while loop to its end inside the call that
    hands it over, so only functions whose run time their shapes bound may run inline."""
    exported = jax.export.export(jax.jit(spin))(jax.ShapeDtypeStruct((LANES,), jnp.float32),
                                                jax.ShapeDtypeStruct((), jnp.int32))
    fn = CompiledFunction("spin", exported, spmd=False)
    assert not runs_inline(fn, 0.0), "not known yet: not inline"
    fn.executable((jax.devices("cpu")[0],))
    assert fn.bounded is False
    for _ in range(64):
        fn.ran(1e-6)  # quick, every time
    assert not any(runs_inline(fn, s) for s in (0.0, 1e-6, fn.seconds))


def test_what_is_bounded() -> None:
    def hlo(f: Any, *args: Any) -> str:
        return jax.jit(f).lower(*args).compile().as_text()

    v = jnp.ones((4, 4), jnp.float32)
    assert bounded(hlo(lambda a: a @ a + 1.0, v))
    assert bounded(hlo(lambda a: jax.lax.fori_loop(0, 8, lambda i, b: b @ a, a), v)), "a static trip count"
    assert bounded(hlo(lambda a: jax.lax.scan(lambda c, r: (c + r, c), a[0], a)[0], v)), "scan: static"
    assert not bounded(hlo(lambda a, n: jax.lax.fori_loop(0, n, lambda i, b: b @ a, a), v, jnp.int32(2)))
    assert not bounded(hlo(spin, jnp.ones(LANES), jnp.int32(2)))
    callback = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    assert not bounded(hlo(lambda a: jax.pure_callback(lambda b: b, callback, a), v)), "a host callback waits"


# ------------------------------------------------------------------------- clusters


def spec(**kwargs: Any) -> pw.LocalClusterSpec:
    return pw.LocalClusterSpec(islands=1, heartbeat_timeout_seconds=HEARTBEAT, **kwargs)


@pytest.fixture(scope="module")
def one() -> Iterator[pw.LocalCluster]:
    with pw.LocalCluster(spec(hosts_per_island=1, devices_per_host=2)) as running:
        yield running


def test_one_executor_quick_calls_then_a_long_one(one: pw.LocalCluster) -> None:
    with pw.Client(one.address, name="liveness") as client:
        sl = client.make_virtual_device_set().add_slice(devices=2)
        fn = pw.pmap(spin, devices=sl)
        quick_then_long(one.address, lambda x, n: fn(x, np.full(2, n, np.int32)), lanes=2)


@pytest.mark.long  # ~24 s: the tests beside it run the same sequence at a 2 s heartbeat, on one and two executors
def test_two_executors_without_a_group_at_the_issues_timings() -> None:
    """As reported: default heartbeats (10 s), a call of about 18 s, on two executors."""
    global HEARTBEAT, LONG
    with pw.LocalCluster(pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=1)) as cluster, \
            pw.Client(cluster.address, name="liveness") as client:
        saved = HEARTBEAT, LONG
        HEARTBEAT, LONG = 10.0, 18.0
        try:
            sl = client.make_virtual_device_set().add_slice(devices=2)
            assert len({d.executor for d in sl.devices}) == 2
            fn = pw.pmap(spin, devices=sl)
            quick_then_long(cluster.address, lambda x, n: fn(x, np.full(2, n, np.int32)), lanes=2)
        finally:
            HEARTBEAT, LONG = saved


@pytest.mark.long  # ~11 s: the same sequence runs on one executor in CI; this is it as a gang over two
def test_two_executors_in_a_jax_group_an_spmd_call() -> None:
    """A gang: one SPMD program over both executors' devices, each running its part on a device thread."""
    with pw.LocalCluster(spec(hosts_per_island=2, devices_per_host=1, collectives=True)) as cluster, \
            pw.Client(cluster.address, name="liveness") as client:
        sl = client.make_virtual_device_set().add_slice(devices=2)
        assert len({d.executor for d in sl.devices}) == 2
        fn = pw.jit(spin, devices=sl, in_specs=(P("x"), P()), out_specs=(P(), P("x")))
        quick_then_long(cluster.address, lambda x, n: fn(x, np.int32(n)), lanes=1)


def test_a_long_first_compile_leaves_the_host_alive(one: pw.LocalCluster) -> None:
    def deep(x: jax.Array) -> jax.Array:  # hundreds of sorts and matmuls: XLA takes seconds to compile it
        m = jnp.eye(16, dtype=jnp.float32) * 0.5
        for k in range(200):
            x = jnp.sort(jnp.tanh(x @ m + k * 1e-6), axis=-1)
        return x

    with pw.Client(one.address, name="liveness") as client:
        sl = client.make_virtual_device_set().add_slice(devices=1)
        x = np.linspace(0, 1, 16 * 16, dtype=np.float32).reshape(1, 16, 16)
        since = time.time()
        out = pw.pmap(deep, devices=sl)(x)
        expected = np.asarray(jax.jit(deep)(x[0]))
        np.testing.assert_allclose(np.asarray(out)[0], expected, rtol=1e-5, atol=1e-6)
        assert all(e.alive for e in fetch_status(one.address).cluster.executors)
        assert stalls_since(one.address, since) == []


def test_a_large_put_is_copied_off_the_loop(one: pw.LocalCluster) -> None:
    """A put this large is copied onto its device on a host-copy thread, never on the loop. (On CPU,
    JAX often takes a received buffer without copying it, so this guards the path more than it times
    it; a GPU's host-to-device copy of 512 MiB takes a good part of a second.)"""
    put_bound = 0.25
    with pw.Client(one.address, name="liveness") as client:
        sl = client.make_virtual_device_set().add_slice(devices=1)
        big = np.arange(128 << 20, dtype=np.float32).reshape(1, -1)
        since = time.time()
        value = client.put(big, sl)
        total = pw.jit(lambda a: a[0, -1], devices=sl)(value)
        assert float(np.asarray(total)) == float(big[0, -1])
        held = [s for st in fetch_status(one.address).executor_stats for s in st.loop_stalls
                if s[0] >= since and s[1] >= put_bound]
        assert held == [], f"the loop was held during the put: {held}"


def test_sigterm_during_a_long_computation_stops_the_executor_within_its_grace() -> None:
    with pw.LocalCluster(spec(hosts_per_island=1, devices_per_host=1)) as cluster, \
            pw.Client(cluster.address, name="liveness") as client:
        sl = client.make_virtual_device_set().add_slice(devices=1)
        fn = pw.pmap(spin, devices=sl)
        x = np.ones((1, LANES), np.float32)
        fn(x, np.ones(1, np.int32))[0].block_until_ready()
        steps, _ = fn(x, np.full(1, long_steps(120.0), np.int32))  # minutes, if nobody stops it
        wait_busy(cluster.address, 30)
        (executor,) = [c for c in cluster.children if c.role == "executor"]
        grace = 15.0  # what the launcher waits before SIGKILL
        start = time.monotonic()
        executor.popen.send_signal(signal.SIGTERM)
        try:
            code = executor.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the executor was still running {grace} s after SIGTERM")
        assert code == 0, f"exit code {code}"
        assert time.monotonic() - start < grace
        with pytest.raises(pw.PwmeshError, match="SIGTERM") as info:
            np.asarray(steps)
        assert "stopped" in str(info.value), info.value
