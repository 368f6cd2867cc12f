"""The simulator against the real cluster at small scale (issue 20, item 2): the same programs, real and simulated.

The programs are ``dispatch.py``'s ``add`` sequences (the paper's Figure 5): ``--lengths``
(8, 32, 128) scalar adds on a slice of 2 devices, each fed by the previous, as OpByOp
(one ``pw.pmap`` call each), Chained (one ``@pw.program``) and Fused (one ``fori_loop``).

1. **Real**: a LocalCluster of 1 island x 2 executors x 2 devices (the slice packed on
   one executor, as in ``dispatch.py``); seconds per sequence, first call to the last
   value at the client (checked), median of ``--rounds`` rounds that alternate the
   (mode, length) pairs. Beside them, what the calibration reads: the loopback round
   trip (a ``Ping`` to the proxy through ``ClientConnection``), and plain JAX in this
   process (one tiny pmapped add, and a ``fori_loop`` iteration from the slope of two
   loop lengths).
2. **Calibration** from a subset only: a computation's device launch
   (``CostModel.launch_seconds``) is plain JAX's pmapped add issued back to back, its
   device time (the workload's ``compute_seconds``) one loop iteration; the client's
   time per message (``SimConfig.client_send_seconds``) is OpByOp's calls issued, not
   waited for, per call. Fitted: the links' one-way latency to the shortest Fused row
   (one program's fixed cost; it starts from half the ping), then the executor's
   ``host_overhead_seconds`` to the slope of the real Chained time over the shortest and
   longest length less the simulator's own slope there. Those three rows are fits;
   every other row is a prediction.
3. **Simulated**: ``pwmesh.sim`` at the same shape (1 island, 2 hosts x 2 devices, a
   2-device slice), ``charge_cpu`` on (the real proxy, scheduler and RM cores' CPU
   counts as their daemons' time), the same workloads; the median step.

4. **Larger**: the same sequences (``--large-lengths``) on a real LocalCluster of 1 island x
   ``--large-hosts`` executors (16) x 1 CPU device each, the slice spanning all of them (one
   shard per executor), and on the simulator at that shape with the calibration above, fitted
   to nothing here: every row a prediction. The cluster's startup (to every executor ready)
   and its executors' resident memory are reported beside it; on a 2-core machine 16
   executors share two cores, which the simulator (one host's work per host) does not model.

Reported per row: real, simulated, real/sim; and the worst ratio either way (max of
r and 1/r). ``calibration_from(path)`` reads the calibrated numbers back (for
``bench/scale.py``).

    python bench/sim_check.py              # ~30 s on a 2-core machine (16 executors of ~240 MiB each)
    python bench/sim_check.py --smoke      # seconds

Writes ``sim_check.json``, ``sim_check.md`` and ``sim_check.png`` into ``--out``
(default: bench/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# dispatch sets XLA_FLAGS (2 CPU devices in this process) before jax is imported: import it first.
import jax  # noqa: E402
import numpy as np  # noqa: E402
from _common import DEFAULT_OUT, load_average, machine, pyplot, save_figure, save_results, table  # noqa: E402
from _scale_sim import calibration_from  # noqa: E402, F401  (the reader of this script's results)
from dispatch import DEVICES, MODE_NAMES, MODES, check, make_op, per_device, step  # noqa: E402

import pwmesh as pw  # noqa: E402
from pwmesh.client.connection import ClientConnection  # noqa: E402
from pwmesh.sim.cluster import SimCluster, SimConfig  # noqa: E402
from pwmesh.sim.cost import CostModel  # noqa: E402
from pwmesh.sim.network import LinkSpec  # noqa: E402
from pwmesh.sim.workloads import Workload, install  # noqa: E402
from pwmesh.wire.messages import Ping, Pong  # noqa: E402

HOSTS = 2  # executors in the island, DEVICES each


@dataclasses.dataclass
class Config:
    lengths: tuple[int, ...] = (8, 32, 128)
    rounds: int = 15
    warmup: int = 2  # sequences per (mode, length) before measuring
    pings: int = 200
    jax_calls: int = 300
    loop_lengths: tuple[int, int] = (1, 4096)  # plain JAX fori_loop lengths: the slope is one iteration
    sim_steps: int = 15
    large_hosts: int = 16  # the larger check: executors of one device each (0: none)
    large_lengths: tuple[int, ...] = (8, 32)
    large_rounds: int = 5


SMOKE = Config(lengths=(2, 8), rounds=1, warmup=1, pings=20, jax_calls=20, loop_lengths=(1, 256), sim_steps=3,
               large_hosts=3, large_lengths=(4,), large_rounds=1)


# ------------------------------------------------------------------ real


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_jax(config: Config) -> dict[str, float]:
    """Plain JAX in this process: one tiny pmapped add (to its value), and one fori_loop iteration."""
    x = jax.pmap(lambda v: v * 0.0, devices=jax.devices()[:DEVICES])(np.zeros(DEVICES, np.float32))
    one = make_op("add", 1)
    for _ in range(5):
        one(x).block_until_ready()
    call = statistics.median(timed(lambda: one(x).block_until_ready()) for _ in range(config.jax_calls))

    def loop() -> None:  # plain JAX's OpByOp: calls issued back to back, waited for at the end
        v = x
        for _ in range(config.jax_calls):
            v = one(v)
        v.block_until_ready()

    pipelined = statistics.median(timed(loop) for _ in range(5)) / config.jax_calls
    short, long = config.loop_lengths
    loops = {n: make_op("add", n) for n in (short, long)}
    medians = {}
    for n, op in loops.items():
        op(x).block_until_ready()
        medians[n] = statistics.median(timed(lambda op=op: op(x).block_until_ready())
                                       for _ in range(max(5, config.jax_calls // 10)))
    iteration = max(0.0, (medians[long] - medians[short]) / (long - short))
    return {"call_seconds": call, "pipelined_call_seconds": pipelined, "loop_iteration_seconds": iteration,
            **{f"loop_{n}_seconds": t for n, t in medians.items()}}


def warm_sequences(sl: Any, x: Any, one: Any, lengths: Iterable[int], check: Callable[[Any, float], None],
                   warmup: int) -> dict[tuple[str, int], Callable[[], None]]:
    """dispatch.py's three modes over ``sl`` for each length (``one``: the pmapped add, ``x``: its input), each
    checking its result, run ``warmup`` times already."""
    sequences: dict[tuple[str, int], Callable[[], None]] = {}
    for n in lengths:
        fused = pw.pmap(per_device("add", n), devices=sl)

        def chain(v: Any, n: int = n) -> Any:
            for _ in range(n):
                v = one(v)
            return v

        calls = {"opbyop": functools.partial(chain, x), "chained": functools.partial(pw.program(chain), x),
                 "fused": functools.partial(fused, x)}
        for mode, call in calls.items():
            sequences[mode, n] = lambda call=call, n=n: check(call(), float(n))
    for sequence in sequences.values():
        for _ in range(warmup):
            sequence()
    return sequences


def measure_real(config: Config) -> tuple[dict[tuple[str, int], dict[str, Any]], dict[str, Any]]:
    """{(mode, length): stats} on a LocalCluster as dispatch.py's pwmesh side, and the ping round trip."""
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=HOSTS, devices_per_host=DEVICES)
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address, name="bench-sim-check") as client:
        sl = client.make_virtual_device_set().add_slice(devices=DEVICES)
        placement = sorted({d.executor for d in sl.devices})
        if len(placement) != 1:
            raise RuntimeError(f"dispatch.py's shape packs the slice on one executor, got {placement}")
        x = client.put(np.zeros(DEVICES, np.float32), sl)
        one = pw.pmap(step("add"), devices=sl)
        sequences = warm_sequences(sl, x, one, config.lengths, check, config.warmup)
        pairs = list(sequences)
        samples: dict[tuple[str, int], list[float]] = {pair: [] for pair in pairs}
        for r in range(config.rounds):
            shift = r % len(pairs)  # rotate who goes first, so a neighbour's burst hits all alike
            for pair in pairs[shift:] + pairs[:shift]:
                samples[pair].append(timed(sequences[pair]))
        # The client's own time per call: OpByOp's calls issued (not waited for), over the calls.
        n = max(config.lengths)
        issue = []
        for _ in range(max(3, config.rounds)):
            start = time.perf_counter()
            v = x
            for _ in range(n):
                v = one(v)
            issue.append((time.perf_counter() - start) / n)
            check(v, float(n))
        ping = ClientConnection(cluster.address, name="bench-sim-check-ping", open_session=False)
        try:
            rtts = []
            for _ in range(config.pings):
                start = time.perf_counter()
                reply = ping.request(Ping(), timeout_seconds=30.0)
                rtts.append(time.perf_counter() - start)
                assert isinstance(reply, Pong), reply
        finally:
            ping.close()
    out = {pair: {"seconds": statistics.median(got), "best_seconds": min(got), "rounds": got}
           for pair, got in samples.items()}
    return out, {"placement": placement, "ping_rtt_seconds": statistics.median(rtts),
                 "client_call_seconds": statistics.median(issue), "client_call_length": n,
                 "ping_rtt_best_seconds": min(rtts)}


def resident_mib(pid: int) -> float:
    """A process's resident memory (MiB), from /proc; 0 where there is none."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` have used (from /proc; 0 for one that is gone)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15 of stat)
    return total


def measure_large(config: Config) -> tuple[dict[tuple[str, int], dict[str, Any]], dict[str, Any]]:
    """{(mode, length): stats} on a LocalCluster of ``large_hosts`` executors x 1 device, the slice over all of
    them; and the cluster's startup and memory."""
    hosts = config.large_hosts
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=hosts, devices_per_host=1)
    started = time.perf_counter()
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address, name="bench-sim-check-large") as client:
        startup = time.perf_counter() - started
        rss = [resident_mib(c.popen.pid) for c in cluster.children if c.role == "executor"]
        sl = client.make_virtual_device_set().add_slice(devices=hosts)
        placement = sorted({d.executor for d in sl.devices})
        if len(placement) != hosts:
            raise RuntimeError(f"the larger check spreads the slice over {hosts} executors, got {placement}")
        x = client.put(np.zeros(hosts, np.float32), sl)
        one = pw.pmap(step("add"), devices=sl)

        def check_all(value: Any, expected: float) -> None:
            got = np.asarray(value)
            if got.shape != (hosts,) or not np.all(got == expected):
                raise AssertionError(f"sequence returned {got}, expected {expected} on each of {hosts} devices")

        sequences = warm_sequences(sl, x, one, config.large_lengths, check_all, config.warmup)
        pairs = list(sequences)
        samples: dict[tuple[str, int], list[float]] = {pair: [] for pair in pairs}
        # The CPU every process of the run used (the cluster's daemons and this client) per sequence: on a
        # machine with fewer cores than executors, that over the cores bounds the time from below.
        pids = [os.getpid(), *(c.popen.pid for c in cluster.children)]
        cpu: dict[tuple[str, int], list[float]] = {pair: [] for pair in pairs}
        for r in range(config.large_rounds):
            shift = r % len(pairs)
            for pair in pairs[shift:] + pairs[:shift]:
                before = cpu_seconds(pids)
                samples[pair].append(timed(sequences[pair]))
                cpu[pair].append(cpu_seconds(pids) - before)
        rss_after = [resident_mib(c.popen.pid) for c in cluster.children if c.role == "executor"]
    out = {pair: {"seconds": statistics.median(got), "best_seconds": min(got), "rounds": got,
                  "cpu_seconds": statistics.median(cpu[pair])} for pair, got in samples.items()}
    return out, {"hosts": hosts, "cores": os.cpu_count() or 1, "devices_per_host": 1, "startup_seconds": startup,
                 "executor_rss_mib_at_start": statistics.median(rss) if rss else 0.0,
                 "executor_rss_mib_after": statistics.median(rss_after) if rss_after else 0.0,
                 "executors_rss_mib_total_after": sum(rss_after)}


# ------------------------------------------------------------------ simulated


def simulate(mode: str, length: int, calibration: dict[str, float], steps: int, hosts: int = HOSTS,
             devices_per_host: int = DEVICES, devices: int = DEVICES) -> dict[str, Any]:
    """One (mode, length) on the simulator at a real cluster's shape (default: the calibration's, 2 hosts x 2
    devices, a slice of 2); the median step and its figures."""
    sim_config = SimConfig(
        islands=1, hosts_per_island=hosts, devices_per_host=devices_per_host,
        link=LinkSpec(latency_seconds=calibration["latency_seconds"]),
        client_send_seconds=calibration["client_send_seconds"],
        cost=CostModel(launch_seconds=calibration["launch_seconds"],
                       host_overhead_seconds=calibration["host_overhead_seconds"]),
        proxy_service_seconds=calibration["proxy_service_seconds"],
        scheduler_service_seconds=calibration["scheduler_service_seconds"],
        rm_service_seconds=calibration["rm_service_seconds"], charge_cpu=True)
    cluster = SimCluster(sim_config)
    # The real values are one float32 per device: a slice of n devices holding (n, 1).
    install(cluster, Workload(name=mode, steps=steps, k=length, devices=devices, rows=1, cols=1,
                              compute_seconds=calibration["compute_seconds"]))
    report = cluster.run()
    failed = {name: c for name, c in report["clients"].items() if c["failure"] or c["errors"]}
    if failed or report["steps"] != steps:
        raise RuntimeError(f"simulated {mode} x {length} failed: {failed or report['steps']}")
    return {"seconds": report["step_seconds_median"], "proxy_core_cpu_seconds": report["proxy"]["core_cpu_seconds"],
            "proxy_messages_in": report["proxy"]["messages_in"], "real_seconds": report["real_seconds"]}


def calibrate(real: dict[tuple[str, int], dict[str, Any]], cluster: dict[str, Any], plain: dict[str, float],
              config: Config) -> tuple[dict[str, float], list[tuple[str, int]]]:
    """The simulator's numbers from a subset of the measurements; returns them and the rows they fit.

    Measured directly: the device, the client's time per call. Fitted, in this order (the second
    leaves the first alone): the links' latency to the shortest Fused row (one program's fixed cost),
    then the executor's time per computation to the Chained slope."""
    short, long = min(config.lengths), max(config.lengths)
    calibration = {
        "latency_seconds": cluster["ping_rtt_seconds"] / 2,  # LinkSpec: one way; fitted below
        "launch_seconds": plain["pipelined_call_seconds"],  # CostModel: per computation per device
        "compute_seconds": plain["loop_iteration_seconds"],  # Workload: one add's device time
        "client_send_seconds": cluster["client_call_seconds"],  # SimConfig: per message a client sends
        "proxy_service_seconds": 0.0,  # SimConfig: the cores' real CPU is charged instead (charge_cpu)
        "scheduler_service_seconds": 0.0,
        "rm_service_seconds": 0.0,
        "host_overhead_seconds": 0.0,  # CostModel: fitted below
    }

    def sim(mode: str, n: int, **changes: float) -> float:
        return simulate(mode, n, {**calibration, **changes}, config.sim_steps)["seconds"]

    # A message's way on this machine costs more than half a ping: a Ping is the one message the proxy's shell
    # answers without its core, and a sequence's hops wait for a core among 5 processes. The one-way latency
    # is fitted to the shortest Fused row (one program's fixed cost), starting from half the ping; a
    # sequence's time is linear in the latency (its hops on the critical path).
    measured = calibration["latency_seconds"]
    base = sim("fused", short)
    hops = (sim("fused", short, latency_seconds=2 * measured) - base) / measured
    if hops > 0:
        calibration["latency_seconds"] = max(0.0, measured + (real["fused", short]["seconds"] - base) / hops)
    real_slope = (real["chained", long]["seconds"] - real["chained", short]["seconds"]) / (long - short)
    sim_slope = (sim("chained", long) - sim("chained", short)) / (long - short)
    calibration["host_overhead_seconds"] = max(0.0, real_slope - sim_slope)
    return calibration, [("fused", short), ("chained", short), ("chained", long)]


# ------------------------------------------------------------------ report


def ratio_spread(ratio: float) -> float:
    return max(ratio, 1 / ratio)


def rows_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["mode", "length", "real ms", "sim ms", "real/sim", "row"]
    body = [[MODE_NAMES[r["mode"]], r["length"], f"{1e3 * r['real_seconds']:.3f}", f"{1e3 * r['sim_seconds']:.3f}",
             f"{r['ratio']:.2f}", "fit (calibration)" if r["calibration"] else "prediction"] for r in rows]
    return headers, body


def calibration_table(calibration: dict[str, float], sources: dict[str, str]) -> tuple[list[str], list[list[str]]]:
    return ["parameter", "us", "from"], [[k, f"{1e6 * v:.2f}", sources[k]] for k, v in calibration.items()]


def markdown(headers: list[str], rows: list[list[Any]]) -> str:
    align = ["---" if i < 2 else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def plot(path: Path, rows: list[dict[str, Any]]) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, mode in enumerate(MODES):
        mine = [r for r in rows if r["mode"] == mode]
        color = f"C{i}"
        ax.plot([r["length"] for r in mine], [1e3 * r["real_seconds"] for r in mine], "o-", color=color,
                label=f"{MODE_NAMES[mode]} real")
        ax.plot([r["length"] for r in mine], [1e3 * r["sim_seconds"] for r in mine], "s--", color=color,
                label=f"{MODE_NAMES[mode]} simulated")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("computations per sequence")
    ax.set_ylabel("ms per sequence (log)")
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Figure-5 sequences: real cluster vs simulator (1 island, 2 hosts x 2 devices)", fontsize=10)
    return save_figure(fig, path)


SOURCES = {
    "latency_seconds": "fit: shortest Fused row (from half the median Ping round trip)",
    "launch_seconds": "plain JAX: tiny pmapped adds issued back to back, per call",
    "compute_seconds": "plain JAX: one fori_loop iteration (slope over two loop lengths)",
    "client_send_seconds": "real OpByOp calls issued, not waited for: seconds per call",
    "proxy_service_seconds": "0: the core's real CPU is charged (charge_cpu)",
    "scheduler_service_seconds": "0: the core's real CPU is charged (charge_cpu)",
    "rm_service_seconds": "0: the core's real CPU is charged (charge_cpu)",
    "host_overhead_seconds": "fit: real Chained slope (shortest, longest) less the simulator's",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default=None, help="comma-separated sequence lengths (8,32,128)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None, help="warm-up sequences per mode and length")
    parser.add_argument("--sim-steps", type=int, default=None, help="simulated steps per row (median)")
    parser.add_argument("--large-hosts", type=int, default=None,
                        help="executors (1 device each) of the larger check (16; 0: none)")
    parser.add_argument("--large-lengths", default=None, help="comma-separated sequence lengths of the larger check")
    parser.add_argument("--large-rounds", type=int, default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--smoke", action="store_true", help="tiny run (seconds) to check that everything works")
    args = parser.parse_args(argv)

    config = dataclasses.replace(SMOKE) if args.smoke else Config()
    if args.lengths:
        config.lengths = tuple(sorted({int(n) for n in args.lengths.split(",") if n}))
    if args.large_lengths:
        config.large_lengths = tuple(sorted({int(n) for n in args.large_lengths.split(",") if n}))
    for field in ("rounds", "warmup", "sim_steps", "large_hosts", "large_rounds"):
        if getattr(args, field) is not None:
            setattr(config, field, getattr(args, field))
    if len(config.lengths) < 2:
        parser.error("the calibration needs at least two lengths")

    started = time.monotonic()
    load_at_start = load_average()
    print(f"plain JAX: {config.jax_calls} calls, loops of {config.loop_lengths} ...", flush=True)
    plain = measure_jax(config)
    print(f"real cluster: {config.rounds} rounds of lengths {config.lengths} ...", flush=True)
    real, cluster = measure_real(config)
    print("calibrating and simulating ...", flush=True)
    calibration, fitted = calibrate(real, cluster, plain, config)
    rows = []
    for mode in MODES:
        for n in config.lengths:
            sim = simulate(mode, n, calibration, config.sim_steps)
            ratio = real[mode, n]["seconds"] / sim["seconds"]
            rows.append({"mode": mode, "length": n, "real_seconds": real[mode, n]["seconds"],
                         "real_rounds": real[mode, n]["rounds"], "sim_seconds": sim["seconds"], "ratio": ratio,
                         "calibration": (mode, n) in fitted, "sim": sim})
    large_rows: list[dict[str, Any]] = []
    large: dict[str, Any] = {}
    if config.large_hosts:
        print(f"larger: a real cluster of {config.large_hosts} executors x 1 device, lengths {config.large_lengths} ...",
              flush=True)
        large_real, large = measure_large(config)
        for mode in MODES:
            for n in config.large_lengths:
                sim = simulate(mode, n, calibration, config.sim_steps, hosts=config.large_hosts, devices_per_host=1,
                               devices=config.large_hosts)
                ratio = large_real[mode, n]["seconds"] / sim["seconds"]
                large_rows.append({"mode": mode, "length": n, "real_seconds": large_real[mode, n]["seconds"],
                                   "real_cpu_seconds": large_real[mode, n]["cpu_seconds"],
                                   "real_rounds": large_real[mode, n]["rounds"], "sim_seconds": sim["seconds"],
                                   "ratio": ratio, "calibration": False, "sim": sim})
    predicted = [r for r in rows if not r["calibration"]]
    worst = max(rows, key=lambda r: ratio_spread(r["ratio"]))
    worst_predicted = max(predicted, key=lambda r: ratio_spread(r["ratio"])) if predicted else worst
    summary = (f"worst ratio {worst['ratio']:.2f} ({MODE_NAMES[worst['mode']]} x {worst['length']}); "
               f"simulated and real agree within {ratio_spread(worst['ratio']):.2f}x on every row, "
               f"{ratio_spread(worst_predicted['ratio']):.2f}x on the predictions")
    measured = (f"measured: ping round trip {1e6 * cluster['ping_rtt_seconds']:.1f} us; client per pw.pmap call "
                f"{1e6 * cluster['client_call_seconds']:.1f} us; plain JAX call {1e6 * plain['call_seconds']:.1f} us "
                f"alone, {1e6 * plain['pipelined_call_seconds']:.1f} us back to back; fori_loop iteration "
                f"{1e9 * plain['loop_iteration_seconds']:.1f} ns")
    print()
    print("seconds per sequence, real (median of rounds) vs simulated (median step):")
    print(table(*rows_table(rows)))
    print()
    print(measured)
    print("calibration:")
    print(table(*calibration_table(calibration, SOURCES)))
    print()
    print(summary)
    large_lines: list[str] = []
    if large_rows:
        worst_large = max(large_rows, key=lambda r: ratio_spread(r["ratio"]))
        large["summary"] = (f"{config.large_hosts} executors x 1 device, the slice over all of them: worst ratio "
                            f"{worst_large['ratio']:.2f} ({MODE_NAMES[worst_large['mode']]} x {worst_large['length']}); "
                            f"real and simulated agree within {ratio_spread(worst_large['ratio']):.2f}x on every row "
                            "(all predictions: the calibration is the small cluster's)")
        large["startup_line"] = (f"startup {large['startup_seconds']:.1f} s to every daemon ready; executors' resident "
                                 f"memory {large['executor_rss_mib_at_start']:.0f} MiB each at start, "
                                 f"{large['executor_rss_mib_after']:.0f} MiB after ({large['executors_rss_mib_total_after']:,.0f} "
                                 "MiB all together)")
        large["cpu_line"] = ("CPU all processes used per sequence, over this machine's "
                             f"{large['cores']} cores (a lower bound on the real time here): " + ", ".join(
                                 f"{MODE_NAMES[r['mode']]} x {r['length']} {1e3 * r['real_cpu_seconds'] / large['cores']:.1f} ms"
                                 for r in large_rows))
        large_lines = [f"larger: {config.large_hosts} executors x 1 device, real (median of rounds) vs simulated:",
                       table(*rows_table(large_rows)), large["startup_line"], large["cpu_line"], large["summary"]]
        print()
        print("\n\n".join(large_lines))

    result = {
        "benchmark": "sim_check",
        "smoke": args.smoke,
        "config": dataclasses.asdict(config),
        "machine": machine(load_at_start),
        "measured": {"plain_jax": plain, "cluster": cluster},
        "calibration": calibration,
        "calibration_sources": SOURCES,
        "calibration_rows": [{"mode": m, "length": n} for m, n in fitted],
        "rows": rows,
        "worst_ratio": worst["ratio"],
        "worst_spread": ratio_spread(worst["ratio"]),
        "worst_predicted_ratio": worst_predicted["ratio"],
        "summary": summary,
        "large": {**large, "rows": large_rows},
        "wall_seconds": time.monotonic() - started,
    }
    md = "\n\n".join([
        "seconds per sequence, real (median of rounds) vs simulated (median step):",
        markdown(*rows_table(rows)), measured, "calibration:",
        markdown(*calibration_table(calibration, SOURCES)), summary,
        *([f"larger: {config.large_hosts} executors x 1 device, real (median of rounds) vs simulated:",
           markdown(*rows_table(large_rows)), large["startup_line"], large["cpu_line"], large["summary"]]
          if large_rows else []),
    ]) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim_check.md").write_text(md)
    print(f"\nwrote {args.out / 'sim_check.md'}")
    save_results(args.out, "sim_check", result, lambda path: plot(path, rows))
    return 0 if all(math.isfinite(r["ratio"]) and r["ratio"] > 0 for r in [*rows, *large_rows]) else 1


if __name__ == "__main__":
    sys.exit(main())
