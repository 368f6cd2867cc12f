"""Pipeline-parallel training across islands: the paper's Table 2, on this machine.

The Transformer of ``pwmesh/examples/lm.py``, cut into 4 stages, trains with
``pwmesh.pipeline`` (GPipe, M microbatches, one program per step) on the same 4
devices in every arrangement, each stage one device of an executor of its own:

- (a) 1 island of 4 executors, all 4 stages;
- (b) 2 islands x 2 executors, 2 stages each;
- (c) 4 islands x 1 executor, 1 stage each.

Each arrangement is a local cluster of its own (4 executors x 1 device, the rest
the same); the arrangements run ``--rounds`` times in alternating order and the
median tokens/s is taken (after the warm-up steps, which compile). The paper's
question: does spreading the stages over islands cost throughput? Its answer was
97.2 % for 2 islands; the target here is (b)/(a) and (c)/(a) >= 0.97.

Baselines in the same run: plain JAX, the whole model unpipelined on the whole
batch (no pipeline bubble, no re-materialisation, no dispatch), in this process
on one device and in a process of its own data-parallel over 4 CPU devices;
and, when Ray is installed, the same GPipe pipeline with one Ray actor
per stage passing ObjectRefs (``bench/_ray_pipeline.py``).

The trace of one step of (b) is drawn from the executors' traces (what
``pwmesh trace`` writes), one row per stage, forwards and backwards by microbatch.

    python bench/pipeline.py             # a few minutes
    python bench/pipeline.py --smoke     # seconds: a tiny model, a few steps

Writes ``pipeline.json``, ``pipeline.png`` and ``pipeline_trace.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

import pwmesh as pw
from pwmesh import pipeline
from pwmesh.cli import commands
from pwmesh.examples import lm, pipeline_lm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_OUT, load_average, machine, pyplot, save_figure, save_results, table  # noqa: E402

STAGES = 4
ARRANGEMENTS = {"a": 1, "b": 2, "c": 4}  # name -> islands (4 executors of 1 device in all)
LABELS = {"a": "(a) 1 island x 4 stages", "b": "(b) 2 islands x 2 stages", "c": "(c) 4 islands x 1 stage"}



@dataclasses.dataclass
class Config:
    # The "large" preset (d 256, 4 layers) with 32 sequences a step: per microbatch and stage a few
    # milliseconds of compute, large against pwmesh's per-call cost; a step well under a second.
    preset: str = "large"
    batch: int = 32
    microbatches: int = 8
    steps: int = 12  # timed after pipeline_lm.WARMUP_STEPS of warm-up
    rounds: int = 3
    target: float = 0.97
    ray: bool = True

    @property
    def model(self) -> lm.Config:  # what pipeline_lm --preset P --batch B trains
        base = lm.PRESETS[self.preset]
        return dataclasses.replace(base, n_layers=max(base.n_layers, STAGES), batch=self.batch)


def pwmesh_run(config: Config, islands: int, trace_to: Path | None = None) -> dict[str, Any]:
    """Train ``config.steps`` steps on a fresh cluster of ``islands`` islands x 4 / islands executors."""
    spec = pw.LocalClusterSpec(islands=islands, hosts_per_island=STAGES // islands, devices_per_host=1)
    with pw.LocalCluster(spec) as cluster:
        pw.connect(cluster.address, name="bench-pipeline")
        try:
            slices = pipeline_lm.place_stages(STAGES, islands)
            executors = [sl.devices[0].executor for sl in slices]
            if len(set(executors)) != STAGES:
                raise RuntimeError(f"the stages share executors: {executors}")
            stages = pipeline_lm.model(config.model, STAGES)
            pipe = pipeline.Pipeline(stages, slices, pipeline_lm.make_optimizer(config.model),
                                     microbatches=config.microbatches)
            result = pipeline_lm.train_pipelined(config.model, config.steps + pipeline_lm.WARMUP_STEPS, pipe, stages,
                                                 progress=False)
            out = {"islands": islands, "executors": executors, **dataclasses.asdict(result)}
            if trace_to is not None:
                out["trace"] = one_step_trace(cluster.address, pipe, config, trace_to)
            return out
        finally:
            pw.disconnect()


def one_step_trace(address: str, pipe: pipeline.Pipeline, config: Config, path: Path) -> list[dict[str, Any]]:
    """One more step, alone, and what each stage's device ran in it (from the executors' traces)."""
    state = pipe.init(jax.random.key(1))
    data = lm.batches(config.model)
    for _ in range(2):  # compiled already; one step to settle the new state's first run
        state, loss = pipe.step(state, next(data))
        pw.get(loss)
        for leaf in jax.tree_util.tree_leaves(state):
            leaf.block_until_ready()
    began = time.monotonic()
    state, loss = pipe.step(state, next(data))
    for leaf in jax.tree_util.tree_leaves(state):
        leaf.block_until_ready()
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "trace.json"
        commands.trace(address, str(file), last_seconds=time.monotonic() - began + 0.01, limit=100_000)
        events = json.loads(file.read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") == "computation"]
    last_start: dict[str, float] = {}
    for e in spans:
        last_start[e["args"]["run_id"]] = max(last_start.get(e["args"]["run_id"], 0.0), e["ts"])
    if last_start:  # the newest run is the traced step
        newest = max(last_start, key=last_start.__getitem__)
        spans = [e for e in spans if e["args"]["run_id"] == newest]
    out = []
    for e in spans:
        node = e["args"].get("node")
        op = pipe.order[node] if node is not None and node < len(pipe.order) else None
        out.append({"executor": procs.get(e["pid"], str(e["pid"])), "start_ms": e["ts"] / 1000,
                    "ms": e["dur"] / 1000, "kind": op.kind if op else "?", "stage": op.stage if op else -1,
                    "microbatch": op.microbatch if op else -1})
    start = min((s["start_ms"] for s in out), default=0.0)
    for s in out:
        s["start_ms"] -= start
    draw_trace(path, out, config)
    return out


def draw_trace(path: Path, spans: list[dict[str, Any]], config: Config) -> bool:
    plt = pyplot()
    if plt is None or not spans:
        return False
    colours = {"F": "#4C72B0", "B": "#DD8452", "U": "#8C8C8C", "?": "#CCCCCC"}
    rows = sorted({(s["stage"], s["executor"]) for s in spans})
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(rows) + 1.6))
    for y, row in enumerate(rows):
        for s in (s for s in spans if (s["stage"], s["executor"]) == row):
            ax.broken_barh([(s["start_ms"], max(s["ms"], 0.05))], (y - 0.4, 0.8), facecolors=colours[s["kind"]],
                           edgecolors="white", linewidth=0.5)
            if s["kind"] in "FB" and s["ms"] > 0.012 * max(x["start_ms"] + x["ms"] for x in spans):
                ax.text(s["start_ms"] + s["ms"] / 2, y, str(s["microbatch"]), ha="center", va="center", fontsize=7,
                        color="white")
    ax.set_yticks(range(len(rows)), [f"stage {st}\n{ex.split(' (')[0]}" for st, ex in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"pwmesh trace of one GPipe step: {STAGES} stages on 2 islands, {config.microbatches} microbatches\n"
                 "blue: forward; orange: backward (with its recomputed forward); grey: optimizer; numbers: microbatch",
                 fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def jax_run(config: Config) -> dict[str, Any]:
    stages = pipeline_lm.model(config.model, STAGES)
    result = pipeline_lm.train_reference(config.model, config.steps + pipeline_lm.WARMUP_STEPS, stages,
                                         progress=False)
    return dataclasses.asdict(result)


def jax_devices_run(config: Config, devices: int) -> dict[str, Any]:
    """Plain JAX data-parallel over ``devices`` CPU devices of a process of its own (this one has 1)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PWMESH_ADDRESS")}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "jax.json"
        proc = subprocess.run([sys.executable, "-m", "pwmesh.examples.pipeline_lm", "--reference", "--devices",
                               str(devices), "--preset", config.preset, "--batch", str(config.batch),
                               "--steps", str(config.steps + pipeline_lm.WARMUP_STEPS), "--json", str(out),
                               "--no-progress"], env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"pipeline_lm --reference --devices {devices} failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def ray_run(config: Config) -> dict[str, Any] | None:
    if not config.ray or importlib.util.find_spec("ray") is None:
        return None
    from _ray_pipeline import ray_pipeline_tokens_per_second  # noqa: PLC0415 - Ray is optional

    return ray_pipeline_tokens_per_second(config.model, STAGES, config.microbatches, config.steps,
                                          warmup=pipeline_lm.WARMUP_STEPS,
                                          optimizer_factory=lambda: pipeline_lm.make_optimizer(config.model))


def plot(path: Path, rows: list[tuple[str, float]], target_line: float | None) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.2))
    names = [r[0] for r in rows]
    values = [r[1] for r in rows]
    bars = ax.barh(range(len(rows)), values, color=["#4C72B0"] * len(ARRANGEMENTS) + ["#999999"] * (len(rows) - 3))
    for bar, v in zip(bars, values, strict=True):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {v:,.0f}", va="center", fontsize=8)
    if target_line is not None:
        ax.axvline(target_line, color="grey", linestyle=":", label="97 % of (a)")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_yticks(range(len(rows)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (median of rounds)")
    ax.set_title("Pipelined Transformer training, same 4 CPU devices: spread over islands or not", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=None, help="runs per arrangement (3)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (12)")
    parser.add_argument("--microbatches", type=int, default=None, help="microbatches per step (8)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray baseline")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--smoke", action="store_true", help="tiny run (seconds) to check that everything works")
    args = parser.parse_args(argv)
    config = Config(preset="tiny", batch=8, microbatches=4, steps=2, rounds=1, ray=False) if args.smoke else Config()
    for field in ("rounds", "steps", "microbatches"):
        if getattr(args, field) is not None:
            setattr(config, field, getattr(args, field))
    config.ray = config.ray and not args.no_ray

    started = time.monotonic()
    load_at_start = load_average()
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ARRANGEMENTS}
    trace: list[dict[str, Any]] = []
    for r in range(config.rounds):
        order = list(ARRANGEMENTS) if r % 2 == 0 else list(reversed(ARRANGEMENTS))
        for name in order:
            last = r == config.rounds - 1 and name == "b"
            run = pwmesh_run(config, ARRANGEMENTS[name], args.out / "pipeline_trace.png" if last else None)
            trace = run.pop("trace", trace)
            runs[name].append(run)
            print(f"  round {r + 1} {LABELS[name]}: {run['tokens_per_second']:,.0f} tokens/s "
                  f"({run['step_seconds'] * 1e3:.1f} ms a step)", flush=True)
    jax_result = jax_run(config)
    print(f"  plain JAX, unpipelined, 1 device: {jax_result['tokens_per_second']:,.0f} tokens/s", flush=True)
    jax4 = jax_devices_run(config, STAGES)
    print(f"  plain JAX, unpipelined, {STAGES} devices data-parallel: {jax4['tokens_per_second']:,.0f} tokens/s",
          flush=True)
    ray_result = ray_run(config)
    if ray_result is not None:
        print(f"  Ray, one actor per stage: {ray_result['tokens_per_second']:,.0f} tokens/s", flush=True)

    median = {name: statistics.median(run["tokens_per_second"] for run in rs) for name, rs in runs.items()}
    ratios = {f"{name}/a": median[name] / median["a"] for name in ("b", "c")}
    losses_same = all(run["losses"] == runs["a"][0]["losses"] for rs in runs.values() for run in rs)
    rows = [(LABELS[name], median[name]) for name in ARRANGEMENTS]
    rows.append(("plain JAX, 1 process, unpipelined", jax_result["tokens_per_second"]))
    rows.append((f"plain JAX, 1 process, {STAGES} devices data-parallel", jax4["tokens_per_second"]))
    if ray_result is not None:
        rows.append((f"Ray, {STAGES} actors, GPipe", ray_result["tokens_per_second"]))

    print()
    print(table(["system", "tokens/s", "vs (a)"], [[n, f"{v:,.0f}", f"{v / median['a']:.3f}"] for n, v in rows]))
    print()
    for key, value in ratios.items():
        print(f"{key}: {value:.3f} (target >= {config.target})")
    print(f"losses identical in every arrangement and round: {losses_same}")

    result = {
        "benchmark": "pipeline",
        "smoke": args.smoke,
        "config": dataclasses.asdict(config),
        "machine": machine(load_at_start),
        "tokens_per_step": config.model.tokens_per_step,
        "arrangements": {name: {"label": LABELS[name], "islands": ARRANGEMENTS[name],
                                "tokens_per_second": median[name],
                                "rounds_tokens_per_second": [run["tokens_per_second"] for run in runs[name]],
                                "executors": runs[name][0]["executors"]} for name in ARRANGEMENTS},
        "ratios": ratios,
        "target": config.target,
        "within_target": all(v >= config.target for v in ratios.values()),
        "losses_identical": losses_same,
        "final_loss": runs["a"][0]["losses"][-1],
        "jax": {"tokens_per_second": jax_result["tokens_per_second"], "final_loss": jax_result["losses"][-1]},
        "jax_data_parallel": {"devices": STAGES, "tokens_per_second": jax4["tokens_per_second"],
                              "final_loss": jax4["losses"][-1]},
        "ray": None if ray_result is None else {k: ray_result[k] for k in ("tokens_per_second", "step_seconds")},
        "trace": trace,
        "wall_seconds": time.monotonic() - started,
    }
    save_results(args.out, "pipeline", result, lambda path: plot(path, rows, 0.97 * median["a"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
