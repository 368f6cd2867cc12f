"""Gang-scheduling stress: several clients submit programs whose collectives (a
``psum`` over a slice that may span executors) overlap on devices in random
(seeded) patterns, all at once.

With the island schedulers' consistent order, every program completes. Run it
against a cluster whose executors order work by arrival instead
(``--test-order-by-arrival``, with ``--test-enqueue-jitter-seconds``) and two
collectives that each hold a device the other needs deadlock, inside JAX's
cross-process collectives; the executors' watchdogs then report which devices
are stuck in which collective.

    python -m pwmesh.examples.gang_stress --clients 8 --programs 200    # needs $PWMESH_ADDRESS
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import random
import threading
import time

import jax
import numpy as np

import pwmesh as pw


@dataclasses.dataclass
class ClientResult:
    programs: int
    correct: int
    seconds: float


def client_workload(address: str, client_index: int, programs: int, seed: int, slice_sizes: tuple[int, ...],
                    started: threading.Barrier | None = None, timeout_seconds: float | None = None) -> ClientResult:
    """One client: a few slices of random sizes, then ``programs`` one-gang programs on random ones."""
    rng = random.Random(seed * 1000 + client_index)
    with pw.Client(address, name=f"stress-{client_index}") as client:
        devs = client.make_virtual_device_set()
        slices = [devs.add_slice(devices=rng.choice(slice_sizes)) for _ in range(3)]
        fns = [pw.pmap(lambda x, k=k: jax.lax.psum(x, "i") + k, devices=sl, axis_name="i")
               for k, sl in enumerate(slices)]
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds

        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        warm = [f(np.zeros(len(sl))) for f, sl in zip(fns, slices, strict=True)]  # compile before the storm
        client.fetch(warm, timeout_seconds=remaining())
        if started is not None:
            started.wait(timeout=remaining())
        start = time.monotonic()
        outs = []
        for i in range(programs):
            k = rng.randrange(len(fns))
            x = np.full(len(slices[k]), float(i))
            outs.append((fns[k](x), np.full_like(x, x.sum() + k)))
        correct = 0
        for arr, expected in outs:
            value = client.fetch([arr], timeout_seconds=remaining())[0]
            correct += bool(np.array_equal(value, expected))
        return ClientResult(programs, correct, time.monotonic() - start)


def run(address: str, clients: int, programs: int, seed: int, slice_sizes: tuple[int, ...] = (3, 4),
        timeout_seconds: float | None = None) -> list[ClientResult]:
    """All clients at once (threads, each its own session); results in client order."""
    started = threading.Barrier(clients)
    pool = concurrent.futures.ThreadPoolExecutor(clients)
    try:
        futures = [pool.submit(client_workload, address, i, programs, seed, slice_sizes, started, timeout_seconds)
                   for i in range(clients)]
        concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        started.abort()  # a client that failed early must not leave the others waiting at the barrier
        if timeout_seconds is not None:  # every client ends by its deadline: report the root cause
            errors = [e for e in (f.exception() for f in futures) if e is not None]
            causes = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
            if errors:  # a client stuck at the barrier only says that another one failed (or was late)
                raise (causes or errors)[0]
        return [f.result() for f in futures]
    finally:
        started.abort()
        pool.shutdown(wait=timeout_seconds is not None, cancel_futures=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default=None, help="proxy address (default: $PWMESH_ADDRESS, else embedded)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--programs", type=int, default=200, help="programs per client")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cluster = None
    address = args.address or os.environ.get("PWMESH_ADDRESS")
    if not address:
        cluster = pw.LocalCluster(pw.LocalClusterSpec(islands=1, hosts_per_island=3, devices_per_host=2,
                                                      collectives=True))
        address = cluster.start()
    try:
        results = run(address, args.clients, args.programs, args.seed)
    finally:
        if cluster is not None:
            cluster.stop()
    total = sum(r.programs for r in results)
    correct = sum(r.correct for r in results)
    slowest = max(r.seconds for r in results)
    print(f"{args.clients} clients x {args.programs} programs: {correct}/{total} correct, "
          f"all done in {slowest:.1f} s ({total / slowest:.0f} programs/s)")


if __name__ == "__main__":
    main()
