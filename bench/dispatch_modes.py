"""Parallel vs sequential dispatch (the paper's Figure 7): a K-stage pipeline, one stage per host.

For each K, a cluster of 1 island x K hosts x 1 device starts; the client asks for
K one-device slices (one per host) and chains ``x + 1.0`` through them in a
``@pw.program``, so the program is K nodes and K-1 cross-host transfers:

- parallel dispatch (``@pw.program``, the default): the proxy sends the whole
  program to the island scheduler at once; every executor enqueues its stage and
  posts its receives before stage 1 has run.
- sequential dispatch (``pw.program(fn, dispatch="sequential")``): the proxy
  sends each node only once its predecessors have completed, so every stage
  pays a round trip through the proxy and the scheduler.

Two measurements per mode, both in steady state (after a warm-up):

- latency: N programs back to back, each result fetched before the next call;
- pipelined: N programs with up to ``--depth`` in flight (the oldest fetched
  whenever that many are outstanding).

Many short rounds alternate the modes; the median round is reported (the best\nround and every round are in the JSON).

    python bench/dispatch_modes.py               # ~3-4 minutes on a 2-core machine
    python bench/dispatch_modes.py --smoke       # K=2 only, a few programs

Writes ``dispatch_modes.json`` and ``dispatch_modes.png`` into ``--out``
(default: bench/results).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import pwmesh as pw

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_OUT,
    executor_trace,
    load_average,
    machine,
    pyplot,
    save_figure,
    save_results,
    table,
)

MODES = ("parallel", "sequential")
KINDS = ("latency", "pipelined")


@dataclasses.dataclass
class Config:
    ks: tuple[int, ...] = (2, 4, 8)
    # Many short rounds, alternating the modes, and the median round: on a shared 2-core
    # machine a neighbour's burst then hits both modes alike instead of one whole block.
    programs: int = 60  # per mode, per round, per measurement
    warmup: int = 20
    rounds: int = 11
    depth: int = 12  # programs in flight in the pipelined measurement


def make_programs(stages: list[pw.MappedFunction]) -> tuple[dict[str, Any], str]:
    """The same chain, once per dispatch mode; modes the installed pwmesh lacks are left out."""

    def chain(x: Any) -> Any:
        for stage in stages:
            x = stage(x)
        return x

    programs: dict[str, Any] = {"parallel": pw.program(chain)}
    note = ""
    try:
        programs["sequential"] = pw.program(chain, dispatch="sequential")
    except TypeError as exc:  # pw.program has no dispatch= yet
        note = f"sequential dispatch unavailable: {exc}"
    return programs, note


def latency(prog: Callable[[Any], Any], x: Any, n: int, expected: float) -> float:
    """Seconds per program, each fetched before the next is called."""
    start = time.perf_counter()
    for _ in range(n):
        value = np.asarray(prog(x))
        if value[0] != expected:
            raise AssertionError(f"program returned {value}, expected {expected}")
    return (time.perf_counter() - start) / n


def pipelined(client: pw.Client, prog: Callable[[Any], Any], x: Any, n: int, depth: int, expected: float) -> float:
    """Seconds per program with up to ``depth`` programs in flight."""
    outstanding: collections.deque[pw.Array] = collections.deque()
    start = time.perf_counter()
    for _ in range(n):
        outstanding.append(prog(x))
        if len(outstanding) >= depth:
            client.fetch([outstanding.popleft()], timeout_seconds=120.0)
    values = client.fetch(list(outstanding), timeout_seconds=120.0)
    elapsed = time.perf_counter() - start
    if values and values[-1][0] != expected:
        raise AssertionError(f"program returned {values[-1]}, expected {expected}")
    return elapsed / n


def traced_latency(client: pw.Client, address: str, prog: Callable[[Any], Any], x: Any, n: int,
                   k: int) -> dict[str, float] | None:
    """Where one program's time goes, from the executors' traces: medians in ms (None if unavailable).

    dispatch: call -> stage 1 starts; compute: one stage runs; handoff: stage i ends -> stage i+1
    starts (parallel: the transfer; sequential: also completion -> proxy -> scheduler -> executor);
    result: the last stage ends -> the value is at the client.
    """
    since = time.time()
    calls = []
    for _ in range(n):
        called = time.time()
        np.asarray(prog(x))
        calls.append((called, time.time()))
    runs: dict[str, dict[int, Any]] = {}
    for ev in executor_trace(address, client.session_id, since):
        runs.setdefault(ev.run_id.split("#", 1)[0], {})[ev.node] = ev
    complete = sorted((r for r in runs.values() if len(r) == k), key=lambda r: r[0].start)
    if len(complete) != n:
        return None
    parts: dict[str, list[float]] = {"dispatch": [], "compute": [], "handoff": [], "result": [], "total": []}
    for (called, fetched), run in zip(calls, complete, strict=True):
        parts["dispatch"].append(run[0].start - called)
        parts["compute"].extend(run[i].end - run[i].start for i in range(k))
        parts["handoff"].extend(run[i + 1].start - run[i].end for i in range(k - 1))
        parts["result"].append(fetched - run[k - 1].end)
        parts["total"].append(fetched - called)
    return {f"{name}_ms": 1000 * statistics.median(v) for name, v in parts.items() if v}


def bench_k(k: int, config: Config) -> dict[str, Any]:
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=k, devices_per_host=1)
    t0 = time.monotonic()
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address, name=f"dispatch-k{k}") as client:
        started = time.monotonic() - t0
        devs = client.make_virtual_device_set()
        slices = [devs.add_slice(devices=1) for _ in range(k)]
        hosts = [sl.devices[0].executor for sl in slices]
        if len(set(hosts)) != k:
            raise RuntimeError(f"expected one stage per host, got placement {hosts}")
        stages = [pw.pmap(lambda v: v + 1.0, devices=sl) for sl in slices]
        programs, note = make_programs(stages)
        x = client.put(np.zeros(1, np.float32), slices[0])
        expected = float(k)
        for prog in programs.values():  # trace, compile everywhere, reach steady state
            latency(prog, x, config.warmup, expected)
            pipelined(client, prog, x, config.warmup, config.depth, expected)
        samples: dict[str, dict[str, list[float]]] = {m: {kind: [] for kind in KINDS} for m in programs}
        for r in range(config.rounds):
            order = list(programs) if r % 2 == 0 else list(reversed(programs))
            for mode in order:
                samples[mode]["latency"].append(latency(programs[mode], x, config.programs, expected))
                samples[mode]["pipelined"].append(
                    pipelined(client, programs[mode], x, config.programs, config.depth, expected))
        breakdown = {mode: traced_latency(client, cluster.address, prog, x, config.programs, k)
                     for mode, prog in programs.items()}
    result: dict[str, Any] = {"k": k, "placement": hosts, "cluster_start_seconds": started, "note": note,
                              "breakdown": breakdown}
    for kind in KINDS:
        row: dict[str, Any] = {}
        for mode in MODES:
            got = samples.get(mode, {}).get(kind)
            row[f"{mode}_ms"] = 1000 * statistics.median(got) if got else None
            row[f"{mode}_best_ms"] = 1000 * min(got) if got else None
            row[f"{mode}_rounds_ms"] = [1000 * s for s in got] if got else []
        par, seq = row["parallel_ms"], row["sequential_ms"]
        row["parallel_over_sequential"] = par / seq if par and seq else None
        result[kind] = row
    return result


def per_stage(results: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Slope of ms/program over K per measurement and mode: what each extra stage costs (needs 2+ Ks)."""
    if len(results) < 2:
        return {}
    slopes: dict[str, dict[str, float | None]] = {}
    for kind in KINDS:
        slopes[kind] = {}
        for mode in MODES:
            points = [(r["k"], r[kind][f"{mode}_ms"]) for r in results if r[kind][f"{mode}_ms"] is not None]
            ks, ms = [p[0] for p in points], [p[1] for p in points]
            slopes[kind][mode] = float(np.polyfit(ks, ms, 1)[0]) if len(points) >= 2 else None
    return slopes


def plot(path: Path, results: list[dict[str, Any]]) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ks = [r["k"] for r in results]
    titles = {"latency": "one program at a time (result fetched before the next)",
              "pipelined": "pipelined (many programs in flight)"}
    for ax, kind in zip(axes, KINDS, strict=True):
        for mode, style in (("parallel", "o-"), ("sequential", "s--")):
            ys = [r[kind][f"{mode}_ms"] for r in results]
            if all(y is not None for y in ys):
                ax.plot(ks, ys, style, label=f"{mode} dispatch")
        ax.set_xticks(ks)
        ax.set_xlabel("pipeline stages K (one host each)")
        ax.set_ylabel("ms / program")
        ax.set_ylim(bottom=0)
        ax.set_title(titles[kind], fontsize=10)
        ax.legend()
    fig.suptitle("K-stage chain of x + 1.0: parallel vs sequential dispatch")
    return save_figure(fig, path)


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default=None, help="pipeline lengths, e.g. 2,4,8")
    parser.add_argument("--programs", type=int, default=None, help="programs per mode per round")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up programs per mode")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--depth", type=int, default=None, help="programs in flight (pipelined)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--smoke", action="store_true", help="tiny run (seconds) to check that everything works")
    args = parser.parse_args(argv)

    config = Config(ks=(2,), programs=10, warmup=3, rounds=1, depth=4) if args.smoke else Config()
    if args.ks:
        config.ks = tuple(int(k) for k in args.ks.split(","))
    for field in ("programs", "warmup", "rounds", "depth"):
        if getattr(args, field) is not None:
            setattr(config, field, getattr(args, field))

    started = time.monotonic()
    load_at_start = load_average()
    results = []
    for k in config.ks:
        print(f"K={k}: 1 island x {k} hosts x 1 device ...", flush=True)
        results.append(bench_k(k, config))
        if results[-1]["note"]:
            print(f"  {results[-1]['note']}")

    slopes = per_stage(results)
    print()
    print(table(["K", "measure", "parallel ms", "sequential ms", "par/seq"],
                [[r["k"], kind, fmt(r[kind]["parallel_ms"]), fmt(r[kind]["sequential_ms"]),
                  fmt(r[kind]["parallel_over_sequential"])] for kind in KINDS for r in results]))
    traced = [(r["k"], mode, b) for r in results for mode, b in r["breakdown"].items() if b]
    if traced:
        print()
        print("where one program's time goes (latency measurement, medians from the executors' traces):")
        print(table(["K", "mode", "dispatch ms", "stage ms", "handoff ms", "result ms", "total ms"],
                    [[k, mode, fmt(b["dispatch_ms"]), fmt(b["compute_ms"]), fmt(b.get("handoff_ms")),
                      fmt(b["result_ms"]), fmt(b["total_ms"])] for k, mode, b in traced]))
    if slopes:
        print()
        print("cost of one more stage (least-squares slope of ms/program over K):")
        print(table(["measure", "parallel ms/stage", "sequential ms/stage"],
                    [[kind, fmt(slopes[kind]["parallel"]), fmt(slopes[kind]["sequential"])] for kind in KINDS]))

    result = {
        "benchmark": "dispatch_modes",
        "smoke": args.smoke,
        "config": {**dataclasses.asdict(config), "ks": list(config.ks)},
        "machine": machine(load_at_start),
        "results": results,
        "ms_per_stage": slopes,
        "wall_seconds": time.monotonic() - started,
    }
    save_results(args.out, "dispatch_modes", result, lambda path: plot(path, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
