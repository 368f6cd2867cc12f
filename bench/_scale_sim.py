"""Parts (d) and (e) of bench/scale.py: the controller at 16 to 1,024 hosts, on the simulator.

``pwmesh.sim`` runs the real RM, island-scheduler and proxy cores with simulated executors,
an in-memory network (every message through the real codec) and virtual time. Here every
controller daemon is charged the real CPU its core took for each message (``charge_cpu``):
a core that cannot keep up makes messages queue and the simulated run slow down, so where a
single controller saturates shows in the simulated rates. The executors' costs (their host
work per computation, a device's time per tiny op, the network's latency) are the ones
``bench/sim_check.py`` measured on this machine's real cluster (``sim_check.json``'s
``calibration``); without that file the simulator's defaults are used, and the results say so.

(d) Figure 5 of the paper: a chain of ``k`` tiny computations on a slice spanning every
    device of 16 to 1,024 hosts (8 devices each), run OpByOp (``k`` programs), Chained (one
    program of ``k`` nodes) and Fused (one node doing all ``k``). Computations per second
    (``k`` per step, median step), beside multi-controller JAX, whose every host dispatches
    its own devices: its rate is this machine's per-op rate at any size. The client waits for each step
    before it sends the next; Chained runs once more with steps in flight (``ahead``), as JAX dispatches.
(e) A GPipe forward pass over 4 islands x 256 hosts: 4 stages, stage ``s`` on all 2,048
    devices of island ``s``, ``m`` microbatches, one program per step; dispatched one step at
    a time (the ideal: ``(m + stages - 1)`` stage times a step) and with the next step
    dispatched while one runs, as a training loop does (the ideal: ``m`` stage times a step,
    steps overlapping); its step time against the ideal, and what the controller did.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from pwmesh.sim.cluster import SimCluster, SimConfig
from pwmesh.sim.cost import CostModel
from pwmesh.sim.network import LinkSpec
from pwmesh.sim.workloads import Workload, install

MODES = ("opbyop", "chained", "fused")
SATURATED = 0.9  # a controller daemon (the proxy, an island scheduler) is saturated when this busy
DEFAULT_CALIBRATION = Path(__file__).resolve().parent / "results" / "sim_check.json"


def calibration_from(path: Path = DEFAULT_CALIBRATION) -> dict[str, float]:
    """The calibrated numbers a ``sim_check`` run wrote (seconds; CostModel, LinkSpec, SimConfig and
    Workload field names), for the benchmarks that simulate this machine. Here, not in sim_check.py:
    importing that one sets up JAX for its own measurements."""
    data = json.loads(Path(path).read_text())
    if data.get("benchmark") != "sim_check":
        raise ValueError(f"{path} is not a sim_check result")
    return dict(data["calibration"])


@dataclasses.dataclass(frozen=True)
class Costs:
    """The simulated hardware, and where its numbers came from."""

    cost: CostModel
    link: LinkSpec
    daemons: dict[str, float]  # SimConfig's fields among them (the client's send time, service times)
    op_seconds: float  # one tiny op on one device (the chains' computations)
    jax_op_seconds: float | None  # plain JAX's time per op on this machine (the multi-controller baseline)
    source: str


def load_costs(path: Path | None) -> Costs:
    """The calibration ``bench/sim_check.py`` wrote (fields named as CostModel's and LinkSpec's), or defaults."""
    found = path if path is not None else DEFAULT_CALIBRATION
    calibration: dict[str, Any] = {}
    if found.exists():
        calibration = calibration_from(found)
    elif path is not None:
        raise FileNotFoundError(f"no calibration at {path} (run bench/sim_check.py first)")

    def pick(cls: type, values: dict[str, Any]) -> dict[str, Any]:
        names = {f.name for f in dataclasses.fields(cls)}
        return {k: float(v) for k, v in values.items() if k in names and v is not None}

    cost = CostModel(**pick(CostModel, calibration))
    link = LinkSpec(**pick(LinkSpec, calibration))
    daemons = {k: v for k, v in pick(SimConfig, calibration).items() if k.endswith("_seconds")}
    op = calibration.get("compute_seconds", 10e-6)  # one tiny op's device time (sim_check: a fori_loop step)
    # Plain JAX's pmapped add issued back to back, per call: what each host of a multi-controller JAX does.
    jax_op = calibration.get("launch_seconds")
    source = f"{found} (measured by bench/sim_check.py)" if calibration else \
        "the simulator's defaults (no bench/results/sim_check.json: run bench/sim_check.py to measure this machine)"
    return Costs(cost=cost, link=link, daemons=daemons, op_seconds=float(op), jax_op_seconds=None if jax_op is None else float(jax_op),
                 source=source)


def _run(config: SimConfig, workload: Workload, charge_schedulers: bool = True) -> tuple[dict[str, Any], SimCluster]:
    started = time.monotonic()
    cluster = SimCluster(config)
    if not charge_schedulers:  # what-if: the island schedulers' work costs no time (the proxy's still does)
        for scheduler in cluster.schedulers:
            scheduler.charge_cpu = False
    install(cluster, workload)
    report = cluster.run()
    report["wall_seconds"] = time.monotonic() - started
    failed = {name: c for name, c in report["clients"].items() if c["failure"] or c["errors"]}
    if failed:
        raise RuntimeError(f"the simulated {workload.name} run failed: {failed}")
    return report, cluster


def between_ends(cluster: SimCluster) -> float:
    """A step's time with steps in flight: the mean time between two steps' ends, after the first (a warm-up).
    Not a median: steps dispatched together end in pairs (short, long, short, ...), whose median misleads."""
    (client,) = cluster.clients
    ends = client.marked("step_end")
    if len(ends) < 3:
        raise ValueError("steps in flight need at least 3 steps")
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def _controller(report: dict[str, Any], per: float) -> dict[str, Any]:
    """The controller's figures over the steps (setup excluded), ``per`` unit (a computation, a step)."""
    steps = report["in_steps"]
    return {
        "proxy_messages": steps["messages"] / per,
        "proxy_bytes": steps["bytes"] / per,
        "proxy_cpu_us": 1e6 * steps["proxy_cpu_seconds"] / per,
        "scheduler_cpu_us": 1e6 * steps["scheduler_cpu_seconds"] / per,
        "proxy_busy": report["proxy"]["busy_in_steps"] or 0.0,
        "scheduler_busy": report["schedulers"]["busy_in_steps"] or 0.0,
    }


def chain_on_slice(hosts: int, devices_per_host: int, k: int, steps: int, costs: Costs) -> list[dict[str, Any]]:
    """(a) run: a chain of ``k`` nodes over every device of ``hosts`` hosts, one function per device (pmap)
    and one SPMD program over the slice (spmd: a gang across every host, its devices sent to each host once,
    in the first step), ``steps`` steps (the first a warm-up, not counted)."""
    rows = []
    for kind in ("pmap", "spmd"):
        config = SimConfig(islands=1, hosts_per_island=hosts, devices_per_host=devices_per_host, link=costs.link,
                           cost=costs.cost, charge_cpu=True, **costs.daemons)
        report, _ = _run(config, Workload(name="chained", steps=steps, k=k, devices=hosts * devices_per_host,
                                          compute_seconds=costs.op_seconds, spmd=kind == "spmd"))
        ops = report["proxy"]["messages_out_by_op"]
        rows.append({"kind": kind, "hosts": hosts, "devices": hosts * devices_per_host, "k": k,
                     "steps": report["steps"], "computations": report["computations"],
                     "step_seconds": report["warm_step_seconds_median"],
                     "register_gang_messages": ops.get("exec.register_gang", 0),
                     "first_step_proxy_bytes": report["first_step"]["bytes"],
                     "proxy_bytes_per_step": report["in_steps"]["bytes"] / (steps - 1),
                     "proxy_messages_per_step": report["in_steps"]["messages"] / (steps - 1),
                     "sim_wall_seconds": report["wall_seconds"]})
        print(f"  simulated {kind}: {k} nodes over {hosts * devices_per_host:,} devices, warm step "
              f"{1e3 * rows[-1]['step_seconds']:.2f} ms, proxy {rows[-1]['proxy_bytes_per_step']:,.0f} bytes a step "
              f"({rows[-1]['first_step_proxy_bytes']:,.0f} in the first, with {rows[-1]['register_gang_messages']:,} "
              f"RegisterGang)  ({report['wall_seconds']:.1f} s)", flush=True)
    return rows


def chain_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["node", "hosts", "devices", "nodes", "computations", "warm step ms", "proxy msgs/step",
               "proxy bytes/step", "first step's proxy bytes", "RegisterGang sent"]
    return headers, [[r["kind"], f"{r['hosts']:,}", f"{r['devices']:,}", str(r["k"]), f"{r['computations']:,}",
                      f"{1e3 * r['step_seconds']:.2f}", f"{r['proxy_messages_per_step']:,.0f}",
                      f"{r['proxy_bytes_per_step']:,.0f}", f"{r['first_step_proxy_bytes']:,.0f}",
                      f"{r['register_gang_messages']:,}"] for r in rows]


def figure5(hosts: tuple[int, ...], devices_per_host: int, k: int, steps: int, costs: Costs,
            ahead: int = 1) -> dict[str, Any]:
    """(d): computations per second by mode and host count, and the controller's share of the time, the
    client waiting for each step's result before it sends the next (one step in flight). With ``ahead`` > 1,
    Chained once more with that many steps in flight, as a JAX loop's asynchronous dispatch keeps them: what
    the controller sustains when the hops' latency overlaps. The first of ``steps`` is a warm-up (lowering,
    functions sent to the executors): not counted."""
    if steps < 2:
        raise ValueError("figure5 needs at least 2 steps: the first is a warm-up")
    rows = []
    for n in hosts:
        for mode, in_flight in [(mode, 1) for mode in MODES] + ([("chained", ahead)] if ahead > 1 else []):
            config = SimConfig(islands=1, hosts_per_island=n, devices_per_host=devices_per_host, link=costs.link,
                               cost=costs.cost, charge_cpu=True, **costs.daemons)
            # Steps in flight need more steps: the first few overlap the warm-up, the last ``in_flight - 1`` drain.
            report, cluster = _run(config, Workload(name=mode, steps=steps if in_flight == 1 else max(steps, 6 * in_flight),
                                                 k=k, devices=n * devices_per_host, compute_seconds=costs.op_seconds,
                                                 in_flight=in_flight))
            step = report["warm_step_seconds_median"] if in_flight == 1 else between_ends(cluster)
            rows.append({"hosts": n, "devices": n * devices_per_host, "mode": mode, "in_flight": in_flight,
                         "step_seconds": step, "computations_per_second": k / step,
                         "virtual_seconds": report["virtual_seconds"],
                         "sim_wall_seconds": report["wall_seconds"],
                         **_controller(report, k * (report["steps"] - 1))})
            print(f"  {n:5d} hosts {mode:8s} {in_flight} in flight {k / step:12,.0f} computations/s  proxy busy "
                  f"{rows[-1]['proxy_busy']:.0%}, scheduler {rows[-1]['scheduler_busy']:.0%}  "
                  f"({report['wall_seconds']:.1f} s)", flush=True)
    saturation = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode and r["in_flight"] == 1]
        first = next((r for r in mine if max(r["proxy_busy"], r["scheduler_busy"]) >= SATURATED), None)
        saturation[mode] = {
            "hosts": None if first is None else first["hosts"],
            "by": None if first is None else ("proxy" if first["proxy_busy"] >= first["scheduler_busy"]
                                              else "scheduler"),
            "peak_computations_per_second": max(r["computations_per_second"] for r in mine)}
    jax_rate = None if costs.jax_op_seconds is None else 1.0 / costs.jax_op_seconds
    return {"rows": rows, "k": k, "steps": steps, "devices_per_host": devices_per_host, "ahead": ahead,
            "saturated_when_busy": SATURATED, "saturation": saturation,
            "jax_multi_controller_computations_per_second": jax_rate}


def pipeline(islands: int, hosts_per_island: int, devices_per_host: int, microbatches: int, steps: int,
             stage_seconds: float, costs: Costs, in_flight: int = 1, charge_schedulers: bool = True) -> dict[str, Any]:
    """(e): a GPipe forward pass, one stage per island over all its devices (the first step: a warm-up).
    ``charge_schedulers`` False: the island schedulers' CPU is counted but costs no simulated time (how much of
    the step is theirs)."""
    if steps < 2:
        raise ValueError("pipeline needs at least 2 steps: the first is a warm-up")
    devices = hosts_per_island * devices_per_host
    config = SimConfig(islands=islands, hosts_per_island=hosts_per_island, devices_per_host=devices_per_host,
                       link=costs.link, cost=costs.cost, charge_cpu=True, keep_spans=True, **costs.daemons)
    report, cluster = _run(config, Workload(name="pipeline", steps=steps, devices=devices, stages=islands,
                                   microbatches=microbatches, compute_seconds=stage_seconds, in_flight=in_flight),
                           charge_schedulers)
    steps_seen = report["clients"]["c0"]["steps"]
    step = report["warm_step_seconds_median"] if in_flight == 1 else between_ends(cluster)
    # Each stage's computation on a device: its time and a kernel launch (the executor's host work per
    # computation can hide behind the device's: it is no part of the bound).
    stage = stage_seconds + costs.cost.launch_seconds
    # One step alone: the fill and drain too, (m + stages - 1) stage times. Steps in flight overlap (a
    # forward pass does not wait for the last one's drain): then each island's m stage times a step.
    ideal = (microbatches + (islands - 1 if in_flight == 1 else 0)) * stage
    return {"islands": islands, "hosts_per_island": hosts_per_island, "devices_per_stage": devices,
            "hosts": islands * hosts_per_island, "devices": islands * devices, "microbatches": microbatches,
            "in_flight": in_flight, "schedulers_charged": charge_schedulers,
            "steps": steps_seen, "stage_seconds": stage_seconds, "step_seconds": step,
            "ideal_step_seconds": ideal, "efficiency": ideal / step, "computations": report["computations"],
            "data_plane_bytes_per_step": report["data_plane_bytes"] / steps,
            "sim_wall_seconds": report["wall_seconds"], "timeline": _timeline(cluster, hosts_per_island),
            **_controller(report, steps - 1)}


def _timeline(cluster: SimCluster, hosts_per_island: int) -> list[dict[str, Any]]:
    """The last step's run on each island's first host: (island, start, end, node) of each computation, in
    ms from that step's start (its dispatch: the ``step`` mark when steps go one at a time, else the run's
    first computation)."""
    (client,) = cluster.clients
    first = cluster.executors[0]
    last_run = max(first.spans, key=lambda span: span[0])[2]
    spans = [(island, span) for island in range(cluster.config.islands)
             for span in cluster.executors[island * hosts_per_island].spans if span[2] == last_run]
    start = client.marked("step")[-1]
    if any(span[0] < start for _, span in spans):  # dispatched before the step began (steps in flight)
        start = min(span[0] for _, span in spans)
    seen = set()
    out = []
    for island, (t0, t1, _, node, _) in spans:
        if (island, node) not in seen:
            seen.add((island, node))
            out.append({"island": island, "start_ms": 1e3 * (t0 - start), "end_ms": 1e3 * (t1 - start), "node": node})
    return out


# ------------------------------------------------------------------ tables and plots


def figure5_table(d: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["hosts", "devices", "mode", "steps in flight", "computations/s", "proxy busy", "sched busy",
               "proxy msgs/comp", "proxy CPU us/comp", "sched CPU us/comp"]
    rows = [[f"{r['hosts']:,}", f"{r['devices']:,}", r["mode"], str(r.get("in_flight", 1)),
             f"{r['computations_per_second']:,.0f}",
             f"{r['proxy_busy']:.0%}", f"{r['scheduler_busy']:.0%}", f"{r['proxy_messages']:,.0f}",
             f"{r['proxy_cpu_us']:,.0f}", f"{r['scheduler_cpu_us']:,.0f}"] for r in d["rows"]]
    return headers, rows


def figure5_lines(d: dict[str, Any]) -> list[str]:
    lines = []
    for mode, s in d["saturation"].items():
        where = (f"from {s['hosts']:,} hosts on (the {s['by']})" if s["hosts"] is not None
                 else "at no size measured")
        lines.append(f"{mode}: a controller daemon is busy >= {d['saturated_when_busy']:.0%} of the time {where}; "
                     f"peak {s['peak_computations_per_second']:,.0f} computations/s")
    for in_flight in sorted({r.get("in_flight", 1) for r in d["rows"]}):
        chained = [r for r in d["rows"] if r["mode"] == "chained" and r.get("in_flight", 1) == in_flight]
        if len(chained) > 1:
            lo, hi = chained[0], chained[-1]
            lines.append(f"chained, {in_flight} step(s) in flight: {lo['computations_per_second']:,.0f} computations/s "
                         f"at {lo['hosts']:,} hosts, {hi['computations_per_second']:,.0f} at {hi['hosts']:,} "
                         f"({hi['computations_per_second'] / lo['computations_per_second']:.2f}x)")
    if d["jax_multi_controller_computations_per_second"]:
        lines.append(f"multi-controller JAX (this machine's per-op rate, at any size): "
                     f"{d['jax_multi_controller_computations_per_second']:,.0f} computations/s")
    return lines


def pipeline_table(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["islands x hosts", "devices", "microbatches", "steps in flight", "step ms", "ideal ms", "efficiency",
               "proxy busy", "sched busy", "proxy msgs/step", "proxy CPU ms/step", "sched CPU ms/step",
               "data plane MB/step"]
    return headers, [[f"{e['islands']} x {e['hosts_per_island']:,}", f"{e['devices']:,}", str(e["microbatches"]),
                      str(e["in_flight"]) + ("" if e.get("schedulers_charged", True) else " (schedulers free)"),
                      f"{1e3 * e['step_seconds']:.2f}", f"{1e3 * e['ideal_step_seconds']:.2f}",
                      f"{e['efficiency']:.0%}", f"{e['proxy_busy']:.0%}", f"{e['scheduler_busy']:.0%}",
                      f"{e['proxy_messages']:,.0f}", f"{e['proxy_cpu_us'] / 1e3:.2f}",
                      f"{e['scheduler_cpu_us'] / 1e3:.2f}", f"{e['data_plane_bytes_per_step'] / 1e6:,.1f}"]
                     for e in runs]


def plot_figure5(ax: Any, d: dict[str, Any]) -> None:
    for i, mode in enumerate(MODES):
        mine = [r for r in d["rows"] if r["mode"] == mode and r.get("in_flight", 1) == 1]
        ax.plot([r["hosts"] for r in mine], [r["computations_per_second"] for r in mine], "o-", color=f"C{i}",
                label=mode)
        ahead = [r for r in d["rows"] if r["mode"] == mode and r.get("in_flight", 1) > 1]
        if ahead:
            ax.plot([r["hosts"] for r in ahead], [r["computations_per_second"] for r in ahead], "s--",
                    color=f"C{i}", label=f"{mode}, {ahead[0]['in_flight']} steps in flight")
        sat = d["saturation"][mode]["hosts"]
        if sat is not None:
            ax.axvline(sat, color=f"C{i}", linestyle=":", alpha=0.6)
    if d["jax_multi_controller_computations_per_second"]:
        ax.axhline(d["jax_multi_controller_computations_per_second"], color="gray", linestyle="--",
                   label="JAX multi-controller")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("hosts (8 devices each); dotted: the proxy or scheduler busy >= 90%")
    ax.set_ylabel("computations / s (simulated)")
    ax.set_title(f"(d) Figure 5, chain of {d['k']} tiny computations", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(which="both", alpha=0.3)


def plot_pipeline(ax: Any, e: dict[str, Any]) -> None:
    """Which island computes when during one step: the pipeline's fill, steady state and drain."""
    for span in e["timeline"]:
        ax.barh(span["island"], span["end_ms"] - span["start_ms"], left=span["start_ms"], height=0.6,
                color=f"C{span['node'] // e['islands'] % 10}", edgecolor="black", linewidth=0.3)
    ax.axvline(1e3 * e["ideal_step_seconds"], color="red", linestyle="--", label="ideal step")
    ax.axvline(1e3 * e["step_seconds"], color="black", linestyle=":", label="simulated step")
    ax.set_xlim(left=0)  # the step begins at 0: the gap before the first bar is its dispatch
    ax.set_yticks(range(e["islands"]))
    ax.set_yticklabels([f"island {i}" for i in range(e["islands"])])
    ax.invert_yaxis()
    ax.set_xlabel("ms into a step (one host per island; colour: microbatch; before the first bar: dispatch)")
    ax.set_title(f"(e) pipeline: {e['islands']} islands x {e['hosts_per_island']:,} hosts, "
                 f"{e['microbatches']} microbatches, "
                 f"{'one step at a time' if e['in_flight'] == 1 else str(e['in_flight']) + ' steps in flight'}: "
                 f"{e['efficiency']:.0%} of ideal", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
