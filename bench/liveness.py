"""How long an executor's event loop is held while its devices work (issue #32).

The loop answers heartbeats, status requests, cancels and signals; a computation that held
it for a heartbeat timeout made the resource manager write the host off. This runs, on a
one-executor cluster with the default heartbeats (10 s): 30 quick calls of a function whose
run time is its input's, then one call of ``--long-seconds``, then a large put, and reports
the executor's loop stalls (wake-ups 50 ms or more late) and the longest, per phase.

The baseline, in the same run: the same loop-lag probe in a plain asyncio process while
plain JAX computes the same long call on a thread (what this machine's scheduling alone
costs a loop when its cores are busy).

Writes ``liveness.json`` into ``--out`` (default: bench/results).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import DEFAULT_OUT, load_average, machine, table, write_json  # noqa: E402

import pwmesh as pw  # noqa: E402
from pwmesh.cli.commands import fetch_status  # noqa: E402
from pwmesh.service.heartbeat import LoopLag  # noqa: E402

LANES = 8  # values each step works on (more: slower steps, for calls of minutes within int32 steps)


def spin(x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
    def body(carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        i, v = carry
        return i + 1, jnp.sin(v) * 0.999 + 0.001
    return jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.zeros((), jnp.int32), x))


def steps_for(seconds: float, lanes: int) -> int:
    fn = jax.jit(spin)
    x = jnp.ones(lanes, jnp.float32)  # calibrated on the same shape the cluster runs
    jax.block_until_ready(fn(x, jnp.int32(10)))
    n = 200_000
    while True:
        start = time.perf_counter()
        jax.block_until_ready(fn(x, jnp.int32(n)))
        took = time.perf_counter() - start
        if took > 0.2:
            return min(int(n / took * seconds), 2**31 - 1)
        n *= 4


def baseline(n: int, lanes: int) -> dict[str, Any]:
    """The loop-lag probe in this process while plain JAX runs the long call on a thread."""
    async def main() -> dict[str, Any]:
        lag = LoopLag()
        probe = asyncio.get_running_loop().create_task(lag.run())
        fn = jax.jit(spin)
        start = time.perf_counter()
        await asyncio.to_thread(lambda: jax.block_until_ready(fn(jnp.ones(lanes, jnp.float32), jnp.int32(n))))
        seconds = time.perf_counter() - start
        probe.cancel()
        return {"seconds": round(seconds, 2), "max_lag_ms": round(lag.max_seconds * 1e3, 1), "stalls": lag.stalls}
    return asyncio.run(main())


def stalls(address: str, since: float, until: float) -> list[list[float]]:
    return [s for st in fetch_status(address).executor_stats for s in st.loop_stalls if since <= s[0] <= until]


def phase(name: str, address: str, since: float, until: float, beats_ok: bool) -> dict[str, Any]:
    found = stalls(address, since, until)
    return {"phase": name, "seconds": round(until - since, 2), "stalls_50ms": len(found),
            "max_stall_ms": round(max((s[1] for s in found), default=0.0) * 1e3, 1), "host_stayed_up": beats_ok}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long-seconds", type=float, default=18.0)
    parser.add_argument("--put-mib", type=int, default=512)
    parser.add_argument("--lanes", type=int, default=LANES, help="values per step (64: calls of minutes)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--smoke", action="store_true", help="a short run that checks everything works")
    args = parser.parse_args(argv)
    if args.smoke:
        args.long_seconds, args.put_mib = 1.0, 16
    load_at_start = load_average()
    n = steps_for(args.long_seconds, args.lanes)
    phases = []
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=1, devices_per_host=1)
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address, name="bench-liveness") as client:
        sl = client.make_virtual_device_set().add_slice(devices=1)
        fn = pw.pmap(spin, devices=sl)
        x = np.ones((1, args.lanes), np.float32)
        start = time.time()
        for _ in range(30):
            np.asarray(fn(x, np.ones(1, np.int32))[0])
        phases.append(phase("30 quick calls", cluster.address, start, time.time(), True))
        start = time.time()
        steps, _ = fn(x, np.full(1, n, np.int32))
        up = True
        done = threading.Event()
        threading.Thread(target=lambda: (steps.block_until_ready(), done.set()), daemon=True).start()
        while not done.wait(0.5):
            up = up and all(e.alive for e in fetch_status(cluster.address).cluster.executors)
        assert int(np.asarray(steps)[0]) == n
        phases.append(phase(f"one call of {args.long_seconds:g} s", cluster.address, start, time.time(), up))
        start = time.time()
        big = np.ones((1, args.put_mib << 18), np.float32)
        value = client.put(big, sl)
        value.block_until_ready()
        np.asarray(pw.jit(lambda a: a[0, 0], devices=sl)(value))
        phases.append(phase(f"a {args.put_mib} MiB put", cluster.address, start, time.time(), True))
        lag_max = fetch_status(cluster.address).executor_stats[0].loop_lag_max_seconds
    base = baseline(n, args.lanes)
    print(table(["phase", "seconds", "stalls >= 50 ms", "longest stall ms", "host stayed up"],
                [[p["phase"], p["seconds"], p["stalls_50ms"], p["max_stall_ms"], p["host_stayed_up"]]
                 for p in phases]))
    print(f"\nexecutor's longest loop lag since it started: {lag_max * 1e3:.1f} ms")
    print(f"baseline (plain asyncio, plain JAX computing {base['seconds']} s on a thread): "
          f"longest lag {base['max_lag_ms']} ms, {base['stalls']} stalls")
    write_json(args.out / "liveness.json", {"benchmark": "liveness", "smoke": args.smoke, "phases": phases, "loop_lag_max_ms": round(lag_max * 1e3, 1),
                                             "baseline": base, "machine": machine(load_at_start)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
