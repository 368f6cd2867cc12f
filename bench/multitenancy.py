"""Multi-tenancy: device-time shares of weighted clients on one island, and throughput vs clients.

Part 1 (shares): four clients with weights 1:2:4:8 (``pw.Client(address, weight=w)``)
saturate one island with a small compiled computation on a slice spanning every
device of the island, so every run of every client competes for the same
devices. Each client keeps ``--depth`` runs outstanding (it fetches the oldest
quarter whenever that many are in flight), so its queue at the island scheduler
never runs dry. After a warm-up, the island scheduler's own accounting
(``GetSchedulerStats``: device-seconds per session, as the executors report them)
is read twice, ``--duration`` seconds apart; each client's share of the
device-seconds in between is compared with its share of the total weight.

Part 2 (throughput): 1, 4, 8 and 16 equal-weight clients run the same loop;
aggregate throughput is the number of computations the scheduler released in the
measurement window divided by its length.

    python bench/multitenancy.py                 # ~2 minutes on a 2-core machine
    python bench/multitenancy.py --smoke         # a few seconds: checks that it all runs

Writes ``multitenancy.json`` and ``multitenancy.png`` (matplotlib, if installed)
into ``--out`` (default: bench/results).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

import pwmesh as pw

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_OUT,
    SchedulerProbe,
    load_average,
    machine,
    pyplot,
    save_figure,
    save_results,
    table,
)

WEIGHTS = (1.0, 2.0, 4.0, 8.0)


@dataclasses.dataclass
class Config:
    hosts: int = 2
    devices_per_host: int = 2
    size: int = 256  # each device multiplies a size x size block by itself
    depth: int = 64  # runs each client keeps outstanding (>> the scheduler's window of 8 per device)
    warmup: float = 5.0
    duration: float = 30.0  # measurement window of the shares part
    throughput_duration: float = 10.0  # measurement window per client count
    client_counts: tuple[int, ...] = (1, 4, 8, 16)
    target_error: float = 0.05  # |share - target| / target
    sample_interval: float = 0.25  # seconds between scheduler samples inside the window

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host


_T0 = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _T0:5.1f} s] {message}", flush=True)


def work(x: Any) -> Any:
    """A small computation with a measurable device time: one matmul, a nonlinearity, a reduction."""
    return jnp.tanh(x @ x).sum()


class ClientThread(threading.Thread):
    """One tenant: its own session, one slice over the whole island, runs kept in flight until ``stop``."""

    def __init__(self, address: str, name: str, weight: float, depth: int, config: Config,
                 ready: threading.Barrier, stop: threading.Event) -> None:
        super().__init__(name=name, daemon=True)
        self.address = address
        self.weight = weight
        self.depth = depth
        self.config = config
        self.ready = ready
        self.stop = stop
        self.session = ""
        self.placement: list[str] = []
        self.completed = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the main thread
            self.error = exc
            self.ready.abort()

    def _run(self) -> None:
        cfg = self.config
        with pw.Client(self.address, name=self.name, weight=self.weight) as client:
            self.session = client.session_id
            sl = client.make_virtual_device_set().add_slice(devices=cfg.devices)
            self.placement = [f"{d.executor}:{d.device}" for d in sl.devices]
            fn = pw.pmap(work, devices=sl)
            rng = np.random.default_rng(len(self.name))
            x = client.put(rng.standard_normal((cfg.devices, cfg.size, cfg.size), np.float32) / cfg.size, sl)
            client.fetch([fn(x)], timeout_seconds=120.0)  # compile everywhere before the clock starts
            self.ready.wait(timeout=300.0)
            outstanding: collections.deque[pw.Array] = collections.deque()
            batch = max(1, self.depth // 4)  # fetch the oldest quarter; the rest stays queued
            while not self.stop.is_set():
                outstanding.append(fn(x))
                if len(outstanding) >= self.depth:
                    client.fetch([outstanding.popleft() for _ in range(batch)], timeout_seconds=120.0)
                    self.completed += batch
            if outstanding:  # drain: leave nothing queued behind
                client.fetch(list(outstanding), timeout_seconds=120.0)
                self.completed += len(outstanding)


def measure(address: str, probe: SchedulerProbe, weights: list[float], config: Config, duration: float,
            depth: int) -> dict[str, Any]:
    """Run one client per weight; the scheduler's device-seconds and runs per client over the window."""
    ready = threading.Barrier(len(weights) + 1)
    stop = threading.Event()
    threads = [ClientThread(address, f"tenant{i}-w{w:g}", w, depth, config, ready, stop) for i, w in enumerate(weights)]
    begun = time.monotonic()
    for t in threads:
        t.start()
    try:
        try:
            ready.wait(timeout=300.0)
        except threading.BrokenBarrierError:
            pass
        setup = time.monotonic() - begun
        failed = [t for t in threads if t.error is not None]
        if failed:
            raise RuntimeError(f"{failed[0].name} failed") from failed[0].error
        time.sleep(config.warmup)
        t0, s0 = probe.snapshot()
        samples = []  # is each client backlogged (runs waiting at the scheduler) during the window?
        while time.monotonic() < t0 + duration:
            time.sleep(min(config.sample_interval, max(0.0, t0 + duration - time.monotonic())))
            samples.append(probe.snapshot())
        t1, s1 = samples[-1]
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300.0)
    failed = [t for t in threads if t.error is not None or t.is_alive()]
    log(f"{len(weights)} clients: setup {setup:.1f} s, drain {time.monotonic() - t1:.1f} s")
    if failed:
        raise RuntimeError(f"{failed[0].name} failed or hung") from failed[0].error
    elapsed = t1 - t0
    clients = []
    for t in threads:
        ds0, runs0, _ = s0.get(t.session, (0.0, 0, 0))
        ds1, runs1, _ = s1.get(t.session, (0.0, 0, 0))
        waiting = [snap.get(t.session, (0.0, 0, 0))[2] for _, snap in samples]
        clients.append({"name": t.name, "session": t.session, "weight": t.weight, "placement": t.placement,
                        "device_seconds": ds1 - ds0, "runs": runs1 - runs0, "completed_total": t.completed,
                        # fraction of samples in which the client had runs waiting at the scheduler: the
                        # policy can only enforce its share while it is backlogged (close to 1.0)
                        "backlogged": sum(w > 0 for w in waiting) / len(waiting) if waiting else 0.0,
                        "mean_waiting": sum(waiting) / len(waiting) if waiting else 0.0})
    return {"seconds": elapsed, "clients": clients}


def shares_part(address: str, probe: SchedulerProbe, config: Config) -> dict[str, Any]:
    window = measure(address, probe, list(WEIGHTS), config, config.duration, config.depth)
    total_ds = sum(c["device_seconds"] for c in window["clients"])
    total_w = sum(WEIGHTS)
    rows = []
    for c in window["clients"]:
        target = c["weight"] / total_w
        share = c["device_seconds"] / total_ds if total_ds > 0 else 0.0
        rows.append({**c, "target_share": target, "share": share, "error": share - target,
                     "relative_error": (share - target) / target})
    return {
        "seconds": window["seconds"],
        "device_seconds_total": total_ds,
        "device_utilisation": total_ds / (window["seconds"] * config.devices),
        "runs_total": sum(c["runs"] for c in rows),
        "max_relative_error": max(abs(r["relative_error"]) for r in rows),
        "max_error_points": max(abs(100 * r["error"]) for r in rows),
        # The target: every share within +/-5% of its weight share, relative (the strict reading);
        # within_target_points is the loose one (+/-5 percentage points of the island).
        "within_target": all(abs(r["relative_error"]) <= config.target_error for r in rows),
        "within_target_points": all(abs(r["error"]) <= config.target_error for r in rows),
        "clients": rows,
    }


def throughput_part(address: str, probe: SchedulerProbe, config: Config) -> list[dict[str, Any]]:
    results = []
    for n in config.client_counts:
        # Fewer runs per client as clients grow (at least 16 each, 256 in all): the island stays
        # saturated and the drain after the window stays short.
        depth = max(16, min(config.depth, 256 // n))
        window = measure(address, probe, [1.0] * n, config, config.throughput_duration, depth)
        runs = [c["runs"] for c in window["clients"]]
        ds = [c["device_seconds"] for c in window["clients"]]
        results.append({
            "clients": n,
            "depth_per_client": depth,
            "seconds": window["seconds"],
            "computations": sum(runs),
            "computations_per_second": sum(runs) / window["seconds"],
            "device_utilisation": sum(ds) / (window["seconds"] * config.devices),
            "per_client_computations": runs,
            # Jain's index over device-seconds: 1.0 = perfectly even between equal weights.
            "fairness": (sum(ds) ** 2 / (n * sum(d * d for d in ds))) if any(ds) else 0.0,
        })
        log(f"{n:2d} clients: {results[-1]['computations_per_second']:.0f} computations/s")
    return results


def plot(path: Path, shares: dict[str, Any], throughput: list[dict[str, Any]]) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = [f"w={c['weight']:g}" for c in shares["clients"]]
    xs = np.arange(len(names))
    ax1.bar(xs - 0.2, [100 * c["target_share"] for c in shares["clients"]], 0.4, label="target (weight share)",
            color="#bbbbbb")
    ax1.bar(xs + 0.2, [100 * c["share"] for c in shares["clients"]], 0.4, label="measured (device-seconds)",
            color="#1f77b4")
    ax1.set_xticks(xs, names)
    ax1.set_ylabel("share of island device time (%)")
    ax1.set_title("4 clients, weights 1:2:4:8, fair policy")
    ax1.legend()
    ns = [r["clients"] for r in throughput]
    ax2.plot(ns, [r["computations_per_second"] for r in throughput], "o-")
    ax2.set_xticks(ns)
    ax2.set_xlabel("equal-weight clients")
    ax2.set_ylabel("computations / s (all clients)")
    ax2.set_ylim(bottom=0)
    ax2.set_title("aggregate throughput")
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=None, help="measurement window of the shares part (s)")
    parser.add_argument("--throughput-duration", type=float, default=None, help="window per client count (s)")
    parser.add_argument("--warmup", type=float, default=None, help="seconds of load before each window")
    parser.add_argument("--clients", default=None, help="client counts for throughput, e.g. 1,4,8,16")
    parser.add_argument("--hosts", type=int, default=None, help="hosts in the island")
    parser.add_argument("--devices-per-host", type=int, default=None)
    parser.add_argument("--size", type=int, default=None, help="matrix size per device")
    parser.add_argument("--depth", type=int, default=None, help="runs each client keeps in flight")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--smoke", action="store_true", help="tiny run (seconds) to check that everything works")
    args = parser.parse_args(argv)

    config = Config()
    if args.smoke:
        # Smaller island and windows: checks every code path in a few seconds, measures nothing.
        config = Config(hosts=1, devices_per_host=2, size=128, depth=16, warmup=0.25, duration=1.0,
                        throughput_duration=0.5, client_counts=(1, 2))
    for field, value in (("duration", args.duration), ("throughput_duration", args.throughput_duration),
                         ("warmup", args.warmup), ("hosts", args.hosts), ("devices_per_host", args.devices_per_host),
                         ("size", args.size), ("depth", args.depth)):
        if value is not None:
            setattr(config, field, value)
    if args.clients:
        config.client_counts = tuple(int(n) for n in args.clients.split(","))

    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=config.hosts, devices_per_host=config.devices_per_host,
                               policy="fair")
    started = time.monotonic()
    load_at_start = load_average()
    log(f"multitenancy: 1 island x {config.hosts} hosts x {config.devices_per_host} devices, fair policy, "
          f"{config.size}x{config.size} matmul per device")
    with pw.LocalCluster(spec) as cluster, SchedulerProbe(cluster.address) as probe:
        log(f"shares: weights {':'.join(f'{w:g}' for w in WEIGHTS)}, {config.warmup:g} s warm-up, "
              f"{config.duration:g} s window")
        shares = shares_part(cluster.address, probe, config)
        log("throughput:")
        throughput = throughput_part(cluster.address, probe, config)

    print()
    print(table(["client", "weight", "target %", "measured %", "error (pp)", "rel. error %", "computations",
                 "backlogged %"],
                [[c["name"], f"{c['weight']:g}", f"{100 * c['target_share']:.1f}", f"{100 * c['share']:.1f}",
                  f"{100 * c['error']:+.1f}", f"{100 * c['relative_error']:+.1f}", c["runs"],
                  f"{100 * c['backlogged']:.0f}"]
                 for c in shares["clients"]]))
    verdict = "within" if shares["within_target"] else "NOT within"
    print(f"max error {shares['max_error_points']:.1f} percentage points, {100 * shares['max_relative_error']:.1f}% "
          f"relative ({verdict} the +/-{100 * config.target_error:.0f}% relative target); "
          f"island device utilisation {100 * shares['device_utilisation']:.0f}%")
    print()
    print(table(["clients", "computations/s", "device util. %", "fairness (Jain)"],
                [[r["clients"], f"{r['computations_per_second']:.0f}", f"{100 * r['device_utilisation']:.0f}",
                  f"{r['fairness']:.3f}"] for r in throughput]))

    result = {
        "benchmark": "multitenancy",
        "smoke": args.smoke,
        "config": {**dataclasses.asdict(config), "client_counts": list(config.client_counts),
                   "cluster": {"islands": 1, "hosts_per_island": config.hosts,
                               "devices_per_host": config.devices_per_host, "policy": "fair"}},
        "machine": machine(load_at_start),
        "shares": shares,
        "throughput": throughput,
        "wall_seconds": time.monotonic() - started,
    }
    save_results(args.out, "multitenancy", result, lambda path: plot(path, shares, throughput))
    return 0


if __name__ == "__main__":
    sys.exit(main())
