"""Dispatch overhead (the paper's Figure 5): computations per second, pwmesh vs plain JAX vs Ray.

The computation is a scalar add on each of a slice's 2 devices, (a) alone
(``add``: ``v + 1``) and (b) after an all-reduce across the slice (``add_psum``:
``psum(v) / 2 + 1``). Each system runs a sequence of ``--length`` (128) of them,
each fed by the previous result, in up to three modes:

- OpByOp: one call per computation. pwmesh: the ``pw.pmap``'d function called
  128 times, each call its own program; plain JAX: a Python loop of 128 calls
  to the ``jax.pmap``'d op (the multi-controller baseline); Ray: 128 tiny
  remote tasks, each fed the previous one's ObjectRef.
- Chained: one call for all 128. pwmesh: one ``@pw.program`` of 128 nodes;
  Ray: 128 chained method calls on one actor, passing ObjectRefs. Plain JAX has
  no such mode (one jitted call is Fused).
- Fused: one computation running all 128 inside one compiled function (a
  ``fori_loop`` in the pmapped function): one pwmesh node, one JAX call, one
  Ray actor call.

pwmesh runs on a local cluster of 1 island x 2 executors x 2 devices, its slice
packed on one executor (as plain JAX's devices are in one process). Plain
JAX runs in this process on 2 CPU devices; Ray's workers run the same
``jax.pmap``'d op on 2 CPU devices each. A sequence's time runs from the first
call to the last value at the client (checked). Rounds alternate the
(computation, mode) pairs; pwmesh's and plain JAX's are measured in the same
rounds, so a shared machine's load falls on both alike (Ray's after, on its
own); the median round is reported.

    python bench/dispatch.py              # ~2 minutes on a 2-core machine
    python bench/dispatch.py --smoke      # seconds: short sequences, one round
    python bench/dispatch.py --platform cuda --devices 1 --systems pwmesh,jax   # one GPU (bench/gpu.sh)

``--platform`` puts the executors and plain JAX on that platform's devices,
``--devices`` the slice's and plain JAX's number of them (2).

Ray comes from the ``bench`` extra (``pip install -e '.[bench]'``); without it
the Ray rows are skipped and recorded as null. Writes ``dispatch.json``,
``dispatch.md`` and ``dispatch.png`` into ``--out`` (default: bench/results).
"""

from __future__ import annotations

import os

# Plain JAX, and Ray's workers (which inherit this environment), get as many CPU devices as the
# pwmesh slice; this must happen before jax is imported. pwmesh's executors set their own.
DEVICES = 2  # the slice's and plain JAX's devices: --devices (at most 2 on CPU) sets it before anything runs
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Ray resolves 127.0.0.1 to the host's external address and then listens on every interface;
# in its single-machine mode it stays on loopback. Read when ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import pwmesh as pw  # noqa: E402

try:
    import ray
except ImportError:  # optional: pip install -e '.[bench]'
    ray = None

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_OUT,
    PLATFORMS,
    executor_trace,
    load_average,
    machine,
    pyplot,
    save_figure,
    save_results,
    share_accelerator,
    table,
)

COMPUTATIONS = ("add", "add_psum")
MODES = ("opbyop", "chained", "fused")
SYSTEMS = ("pwmesh", "jax", "ray")
MODE_NAMES = {"opbyop": "OpByOp", "chained": "Chained", "fused": "Fused"}
# (mode, other system, other mode, minimum pwmesh/other): the targets
TARGETS = (("chained", "ray", "chained", 30.0), ("chained", "jax", "opbyop", 1.0), ("opbyop", "ray", "opbyop", 5.0))


@dataclasses.dataclass
class Config:
    length: int = 128  # computations per sequence
    rounds: int = 11
    warmup: int = 3  # sequences per (computation, mode) before measuring
    min_round_seconds: float = 0.25  # a round repeats sequences until this long (fast systems)
    trace_samples: int = 5  # pwmesh sequences traced per (computation, mode) for the breakdown
    systems: tuple[str, ...] = SYSTEMS
    platform: str = "cpu"  # the executors' devices, and plain JAX's
    devices: int = DEVICES


# ------------------------------------------------------------------ the computation


def step(computation: str) -> Callable[[Any], Any]:
    """One computation on one device's block: the same function in every system."""
    if computation == "add":
        return lambda v: v + 1.0
    return lambda v: jax.lax.psum(v, "i") / DEVICES + 1.0  # equal inputs: also v + 1


def per_device(computation: str, length: int) -> Callable[[Any], Any]:
    """``length`` computations in one compiled function (Fused), or one (``length`` 1)."""
    one = step(computation)
    if length == 1:
        return one
    if computation == "add_psum":  # psum's result is the same on every device; the loop carry must stay per-device
        return lambda v: jax.lax.fori_loop(0, length, lambda _, a: jax.lax.pcast(one(a), "i", to="varying"), v)
    return lambda v: jax.lax.fori_loop(0, length, lambda _, a: one(a), v)


def axis_name(computation: str) -> str | None:
    return "i" if computation == "add_psum" else None


def make_op(computation: str, length: int) -> Any:
    """The ``jax.pmap``'d op on this process's first 2 CPU devices (compiled on first call)."""
    return jax.pmap(per_device(computation, length), axis_name=axis_name(computation),
                    devices=jax.devices()[:DEVICES])


def check(value: Any, expected: float) -> None:
    got = np.asarray(value)
    if got.shape != (DEVICES,) or not np.all(got == expected):
        raise AssertionError(f"sequence returned {got}, expected {expected} on each of {DEVICES} devices")


# ------------------------------------------------------------------ measuring


def rate(sequence: Callable[[], None], length: int, min_seconds: float) -> float:
    """Computations per second over back-to-back sequences (at least one, at least ``min_seconds``)."""
    done = 0
    start = time.perf_counter()
    while True:
        sequence()
        done += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return done * length / elapsed


def measure(sequences: dict[tuple[str, str], Callable[[], None]], config: Config) -> dict[str, dict[str, Any]]:
    """{computation: {mode: stats}} for one system: warm-up, then rounds alternating the pairs."""
    return measure_systems({("", c, m): seq for (c, m), seq in sequences.items()}, config)[""]


def measure_systems(sequences: dict[tuple[str, str, str], Callable[[], None]],
                    config: Config) -> dict[str, dict[str, dict[str, Any]]]:
    """{system: {computation: {mode: stats}}}: warm-up, then rounds alternating every (system, computation,
    mode): systems measured in the same rounds see the same machine, so their ratio holds on a shared one
    (measured one system after the other, a neighbour's burst during one moved the ratio by 1.6x)."""
    for sequence in sequences.values():
        for _ in range(config.warmup):
            sequence()
    keys = list(sequences)
    samples: dict[tuple[str, str, str], list[float]] = {key: [] for key in keys}
    for r in range(config.rounds):
        shift = r % len(keys)  # rotate who goes first, so a neighbour's burst hits all alike
        for key in keys[shift:] + keys[:shift]:
            samples[key].append(rate(sequences[key], config.length, config.min_round_seconds))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (system, computation, mode), got in samples.items():
        per = out.setdefault(system, {c: {m: None for m in MODES} for c in COMPUTATIONS})
        median = statistics.median(got)
        per[computation][mode] = {"computations_per_second": median, "us_per_computation": 1e6 / median,
                                  "best_computations_per_second": max(got), "rounds": got}
    return out


# ------------------------------------------------------------------ pwmesh




def traced(client: pw.Client, address: str, sequence: Callable[[], Any], length: int,
           samples: int) -> dict[str, float] | None:
    """Where a sequence's time goes, medians over ``samples`` sequences (None if the traces miss some):
    the client's calls, until the first computation starts, running, between computations, and from
    the last one's end to the value at the client."""
    parts: dict[str, list[float]] = {}
    for _ in range(samples):
        since = called = time.time()
        result = sequence()
        issued = time.time()
        np.asarray(result)
        fetched = time.time()
        events = executor_trace(address, client.session_id, since)
        if len(events) != length:
            return None
        gaps = [b.start - a.end for a, b in zip(events, events[1:], strict=False)] or [0.0]
        sample = {
            "issue_ms": 1000 * (issued - called),
            "to_first_start_ms": 1000 * (events[0].start - called),
            "compute_median_us": 1e6 * statistics.median(ev.end - ev.start for ev in events),
            "compute_sum_ms": 1000 * sum(ev.end - ev.start for ev in events),
            "gap_median_us": 1e6 * statistics.median(gaps),
            "gap_sum_ms": 1000 * sum(gaps),
            "result_ms": 1000 * (fetched - events[-1].end),
            "total_ms": 1000 * (fetched - called),
        }
        for key, value in sample.items():
            parts.setdefault(key, []).append(value)
    return {key: statistics.median(values) for key, values in parts.items()}


def bench_pwmesh(config: Config, beside: dict[tuple[str, str], Callable[[], None]] | None = None,
                 ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """pwmesh's rates and breakdown; with ``beside`` (plain JAX's sequences), theirs too, measured in the same
    rounds (``measure_systems``)."""
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=DEVICES, platform=config.platform)
    n = config.length
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address, name="bench-dispatch") as client:
        sl = client.make_virtual_device_set().add_slice(devices=DEVICES)
        placement = sorted({d.executor for d in sl.devices})
        if len(placement) != 1:
            raise RuntimeError(f"psum needs the slice on one executor, got {placement}")
        # Made as plain JAX's is (below): by the pmapped op, so each call reads it in the layout it wants.
        # (A put's blocks are (1,) a device and pmap's are (): reading one, each run reshaped it first.)
        x = pw.pmap(lambda v: v * 0.0, devices=sl)(np.zeros(DEVICES, np.float32))
        calls: dict[tuple[str, str], Callable[[], Any]] = {}
        for computation in COMPUTATIONS:
            one = pw.pmap(step(computation), devices=sl, axis_name=axis_name(computation))
            fused = pw.pmap(per_device(computation, n), devices=sl, axis_name=axis_name(computation))

            def opbyop(one: pw.MappedFunction = one) -> Any:
                v = x
                for _ in range(n):
                    v = one(v)  # each call is its own one-node program
                return v

            def chain(v: Any, one: pw.MappedFunction = one) -> Any:
                for _ in range(n):
                    v = one(v)
                return v

            calls[computation, "opbyop"] = opbyop
            calls[computation, "chained"] = functools.partial(pw.program(chain), x)
            calls[computation, "fused"] = functools.partial(fused, x)
        sequences = {pair: (lambda call=call: check(call(), float(n))) for pair, call in calls.items()}
        together = {("pwmesh", c, m): seq for (c, m), seq in sequences.items()}
        together.update({("jax", c, m): seq for (c, m), seq in (beside or {}).items()})
        measured = measure_systems(together, config)
        breakdown = {f"{c}/{m}": traced(client, cluster.address, calls[c, m], 1 if m == "fused" else n,
                                        config.trace_samples) for c, m in calls}
    return measured["pwmesh"], {"placement": placement, "breakdown": breakdown}, measured.get("jax")


# ------------------------------------------------------------------ plain JAX


def bench_jax(config: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    sequences, info = jax_sequences(config)
    return measure(sequences, config), info


def jax_sequences(config: Config) -> tuple[dict[tuple[str, str], Callable[[], None]], dict[str, Any]]:
    n = config.length
    if config.platform != "cpu" and jax.devices()[0].platform == "cpu":
        raise RuntimeError(f"plain JAX found no {config.platform} devices here")
    x = jax.pmap(lambda v: v * 0.0, devices=jax.devices()[:DEVICES])(np.zeros(DEVICES, np.float32))
    sequences: dict[tuple[str, str], Callable[[], None]] = {}
    for computation in COMPUTATIONS:
        one, fused = make_op(computation, 1), make_op(computation, n)
        # XLA's CPU client deadlocks (an all-reduce rendezvous that never completes) when two psum
        # executions are in flight on 2 CPU devices here, so that loop waits for each call.
        wait_each = computation == "add_psum" and config.platform == "cpu"

        def opbyop(one: Any = one, wait_each: bool = wait_each) -> None:
            v = x
            for _ in range(n):
                v = one(v)
                if wait_each:
                    v.block_until_ready()
            check(v, float(n))

        sequences[computation, "opbyop"] = opbyop
        sequences[computation, "fused"] = lambda fused=fused: check(fused(x), float(n))
    info = {"devices": [str(d) for d in jax.devices()[:DEVICES]],
            "note": "add_psum OpByOp waits for each call: XLA's CPU collectives deadlock with two in flight"
            if config.platform == "cpu" else ""}
    return sequences, info


# ------------------------------------------------------------------ Ray


# Ray ships ray_task by value, with this (empty) dict; each worker then keeps its compiled ops in it.
_RAY_WORKER_OPS: dict[tuple[str, int], Any] = {}


def ray_task(computation: str, length: int, v: Any) -> np.ndarray:
    """The Ray task: the plain-JAX op on this worker's 2 CPU devices."""
    key = (computation, length)
    if key not in _RAY_WORKER_OPS:
        _RAY_WORKER_OPS[key] = make_op(computation, length)
    return np.asarray(_RAY_WORKER_OPS[key](v))


class RayStage:
    """The Ray actor: a worker holding its compiled ops, like an executor holding a slice."""

    def __init__(self) -> None:
        self.ops: dict[tuple[str, int], Any] = {}

    def devices(self) -> int:
        return jax.device_count()

    def compute(self, computation: str, length: int, v: Any) -> np.ndarray:
        key = (computation, length)
        if key not in self.ops:
            self.ops[key] = make_op(computation, length)
        return np.asarray(self.ops[key](v))


def bench_ray(config: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    assert ray is not None
    n = config.length
    with warnings.catch_warnings():
        # JAX warns on any fork; Ray forks only to exec its daemons at once, which is safe.
        warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 object_store_memory=100 * 1024 * 1024)
    try:
        task = ray.remote(ray_task)
        actor = ray.remote(RayStage).remote()
        worker_devices = ray.get(actor.devices.remote())
        if worker_devices < DEVICES:
            raise RuntimeError(f"Ray's worker sees {worker_devices} JAX devices, expected {DEVICES}")
        x = np.zeros(DEVICES, np.float32)
        sequences: dict[tuple[str, str], Callable[[], None]] = {}
        for computation in COMPUTATIONS:

            def opbyop(computation: str = computation) -> None:
                ref = x
                for _ in range(n):
                    ref = task.remote(computation, 1, ref)  # a tiny task fed the previous ObjectRef
                check(ray.get(ref), float(n))

            def chained(computation: str = computation) -> None:
                ref = x
                for _ in range(n):
                    ref = actor.compute.remote(computation, 1, ref)
                check(ray.get(ref), float(n))

            def fused(computation: str = computation) -> None:
                check(ray.get(actor.compute.remote(computation, n, x)), float(n))

            sequences[computation, "opbyop"] = opbyop
            sequences[computation, "chained"] = chained
            sequences[computation, "fused"] = fused
        results = measure(sequences, config)
    finally:
        ray.shutdown()
    return results, {"version": ray.__version__, "worker_devices": worker_devices}


# ------------------------------------------------------------------ report


def cps(results: dict[str, Any], system: str, computation: str, mode: str) -> float | None:
    entry = (results.get(system) or {}).get(computation, {}).get(mode)
    return entry["computations_per_second"] if entry else None


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """pwmesh over each other system, mode for mode, per computation."""
    out: dict[str, Any] = {}
    for computation in COMPUTATIONS:
        out[computation] = {}
        for other in ("ray", "jax"):
            row = {}
            for mode in MODES:
                ours, theirs = cps(results, "pwmesh", computation, mode), cps(results, other, computation, mode)
                row[mode] = ours / theirs if ours and theirs else None
            out[computation][f"pwmesh_over_{other}"] = row
    return out


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for computation in COMPUTATIONS:
        for mode, other, other_mode, minimum in TARGETS:
            ours, theirs = cps(results, "pwmesh", computation, mode), cps(results, other, computation, other_mode)
            measured = ours / theirs if ours and theirs else None
            out.append({"computation": computation, "pwmesh_mode": mode, "versus": f"{other} {other_mode}",
                        "target": minimum, "measured": measured,
                        "met": None if measured is None else measured >= minimum})
    return out


def fmt(v: float | None, spec: str = ",.0f") -> str:
    return "n/a" if v is None else format(v, spec)


def results_table(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["system", "mode", *(f"{c} computations/s" for c in COMPUTATIONS)]
    rows = []
    for system in SYSTEMS:
        for mode in MODES:
            values = [cps(results, system, c, mode) for c in COMPUTATIONS]
            if results.get(system) is None:
                rows.append([system, MODE_NAMES[mode], *(["skipped"] * len(COMPUTATIONS))])
            elif any(v is not None for v in values):
                rows.append([system, MODE_NAMES[mode], *(fmt(v) for v in values)])
    return headers, rows


def targets_table(found: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["computation", "pwmesh", "versus", "target", "measured", "met"]
    rows = [[t["computation"], MODE_NAMES[t["pwmesh_mode"]], t["versus"], f">= {t['target']:g}x",
             "n/a" if t["measured"] is None else f"{t['measured']:.3g}x",
             {True: "yes", False: "no", None: "n/a"}[t["met"]]] for t in found]
    return headers, rows


def markdown(headers: list[str], rows: list[list[str]]) -> str:
    align = ["---" if i < 2 else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def plot(path: Path, results: dict[str, Any]) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(COMPUTATIONS), figsize=(11, 4.2), sharey=True)
    width = 0.8 / len(SYSTEMS)
    for ax, computation in zip(axes, COMPUTATIONS, strict=True):
        for i, system in enumerate(SYSTEMS):
            xs, ys = [], []
            for j, mode in enumerate(MODES):
                v = cps(results, system, computation, mode)
                if v is not None:
                    xs.append(j + (i - (len(SYSTEMS) - 1) / 2) * width)
                    ys.append(v)
            label = system if results.get(system) is not None else f"{system} (not installed)"
            ax.bar(xs, ys, width, label=label)
        ax.set_yscale("log")
        ax.set_xticks(range(len(MODES)), [MODE_NAMES[m] for m in MODES])
        ax.set_title({"add": "scalar add", "add_psum": f"scalar add + psum over {DEVICES} devices"}[computation],
                     fontsize=10)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0].set_ylabel("computations / s (log)")
    axes[0].legend()
    fig.suptitle("Dispatch overhead: 128 computations each fed by the previous (higher is better)")
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    global DEVICES  # --devices
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=None, help="computations per sequence (128)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None, help="warm-up sequences per computation and mode")
    parser.add_argument("--min-round-seconds", type=float, default=None)
    parser.add_argument("--systems", default=None, help="comma-separated subset of " + ",".join(SYSTEMS))
    parser.add_argument("--platform", choices=PLATFORMS, default="cpu",
                        help="the executors' devices and plain JAX's (cpu)")
    parser.add_argument("--devices", type=int, choices=(1, 2), default=DEVICES,
                        help=f"the slice's and plain JAX's devices ({DEVICES})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--smoke", action="store_true", help="tiny run (seconds) to check that everything works")
    args = parser.parse_args(argv)

    config = Config(length=8, rounds=1, warmup=1, min_round_seconds=0.0, trace_samples=1) if args.smoke else Config()
    for field in ("length", "rounds", "warmup", "min_round_seconds"):
        if getattr(args, field) is not None:
            setattr(config, field, getattr(args, field))
    if args.systems:
        config.systems = tuple(s for s in args.systems.split(",") if s)
        unknown = set(config.systems) - set(SYSTEMS)
        if unknown:
            parser.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    DEVICES = config.devices = args.devices
    config.platform = args.platform
    if config.platform != "cpu":
        share_accelerator(config.platform)
        jax.config.update("jax_platforms", config.platform)  # plain JAX on the executors' kind of device

    started = time.monotonic()
    load_at_start = load_average()
    results: dict[str, Any] = {s: None for s in SYSTEMS}
    info: dict[str, Any] = {s: None for s in SYSTEMS}
    notes = []
    runners = {"pwmesh": lambda c: bench_pwmesh(c)[:2], "jax": bench_jax, "ray": bench_ray}
    if "pwmesh" in config.systems and "jax" in config.systems:  # in the same rounds: their ratio is the issue's
        print(f"pwmesh and jax, alternating: {config.rounds} rounds of sequences of {config.length} ...", flush=True)
        t0 = time.monotonic()
        jax_seqs, info["jax"] = jax_sequences(config)
        results["pwmesh"], info["pwmesh"], results["jax"] = bench_pwmesh(config, jax_seqs)
        for system in ("pwmesh", "jax"):
            info[system].update(seconds=time.monotonic() - t0, load_average_1m_after=load_average(),
                                measured_with="pwmesh and jax alternating in the same rounds")
    for system in config.systems:
        if results[system] is not None:
            continue
        if system == "ray" and ray is None:
            note = "ray is not installed (pip install -e '.[bench]'): Ray rows skipped, recorded as null"
            print(note, flush=True)
            notes.append(note)
            continue
        print(f"{system}: {config.rounds} rounds of sequences of {config.length} ...", flush=True)
        t0 = time.monotonic()
        results[system], info[system] = runners[system](config)
        info[system]["seconds"] = time.monotonic() - t0
        info[system]["load_average_1m_after"] = load_average()

    found = targets(results)
    print()
    print(f"computations per second (median of {config.rounds} rounds; sequences of {config.length}):")
    print(table(*results_table(results)))
    print()
    print("targets (pwmesh over the other system):")
    print(table(*targets_table(found)))
    breakdown = (info.get("pwmesh") or {}).get("breakdown") or {}
    if any(breakdown.values()):
        print()
        print("where one pwmesh sequence's time goes (ms; from the executors' traces):")
        print(table(["sequence", "client calls", "to 1st start", "compute sum", "gaps sum", "result", "total",
                     "compute med us", "gap med us"],
                    [[name, *(fmt(b[k], ".1f") for k in ("issue_ms", "to_first_start_ms", "compute_sum_ms",
                                                          "gap_sum_ms", "result_ms", "total_ms",
                                                          "compute_median_us", "gap_median_us"))]
                     for name, b in breakdown.items() if b]))

    result = {
        "benchmark": "dispatch",
        "smoke": args.smoke,
        "config": {**dataclasses.asdict(config), "systems": list(config.systems)},
        "machine": machine(load_at_start, config.platform),
        "results": results,
        "ratios": ratios(results),
        "targets": found,
        "systems": info,
        "notes": notes,
        "wall_seconds": time.monotonic() - started,
    }
    md = "\n\n".join([
        f"computations per second (median of {config.rounds} rounds; sequences of {config.length}):",
        markdown(*results_table(results)),
        "targets (pwmesh over the other system):",
        markdown(*targets_table(found)),
    ]) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dispatch.md").write_text(md)
    print(f"\nwrote {args.out / 'dispatch.md'}")
    save_results(args.out, "dispatch", result, lambda path: plot(path, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
