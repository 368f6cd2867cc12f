"""Training throughput of a real model on pwmesh against plain JAX (the paper's Figure 6, asked of a Transformer).

``pwmesh/examples/train_lm.py``'s model trains, data- and model-parallel on a 2x2
mesh of 4 CPU devices, for each of its presets (per-step compute from about 3 ms
to about 200 ms here):

- plain JAX: ``train_lm --reference`` in a process of its own with 4 CPU devices
  (one ``jax.jit`` step with ``NamedSharding``s, parameters and state donated);
- pwmesh: the same step as one ``pw.jit`` over a slice of a local cluster of one
  executor with 4 CPU devices, from this process.

Each system trains ``--rounds`` times per preset, alternating which goes first;
tokens/s are taken after the warm-up steps (compiles), and the medians compared.
The answer: the ratio per preset, and the smallest step time at which pwmesh
reaches ``--threshold`` (95 %) of plain JAX, interpolated (log time) between
presets, with the fixed per-step overhead fitted over all of them.

    python bench/train.py              # a few minutes
    python bench/train.py --smoke      # seconds: the tiny preset, a few steps
    python bench/train.py --platform cuda --mesh 1x1 --presets small,large   # one GPU (bench/gpu.sh)

``--platform`` puts the executors and plain JAX on that platform's devices (the
benchmark's own process stays on CPU: it only traces); ``--mesh DATAxMODEL``
(default 2x2) sizes the mesh, plain JAX then running this file's copy of
``train_lm --reference`` over it.

Writes ``train.json`` and ``train.png`` into ``--out`` (default: bench/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
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
from pwmesh.examples import lm, train_lm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_OUT,
    PLATFORMS,
    fixed_overhead,
    load_average,
    machine,
    pyplot,
    save_figure,
    save_results,
    share_accelerator,
    table,
    threshold_crossing,
)


@dataclasses.dataclass
class Config:
    presets: tuple[str, ...] = ("tiny", "small", "large")
    steps: dict[str, int] = dataclasses.field(default_factory=lambda: {"tiny": 300, "small": 80, "large": 14})
    rounds: int = 2
    threshold: float = 0.95
    platform: str = "cpu"  # the executors' devices, and plain JAX's
    mesh: dict[str, int] = dataclasses.field(default_factory=lambda: dict(train_lm.MESH))


def parse_mesh(text: str) -> dict[str, int]:
    """``DATAxMODEL`` (``2x2``) as a mesh of ``train_lm``'s axes."""
    data, model = (int(n) for n in text.lower().split("x"))
    return {"data": data, "model": model}


def jax_run(preset: str, steps: int, config: Config) -> dict[str, Any]:
    """``train_lm --reference`` in a process of its own (its devices are its own); on another mesh than
    train_lm's, this file's copy of it (``reference``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PWMESH_ADDRESS")}
    if config.platform != "cpu":
        env["JAX_PLATFORMS"] = config.platform
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "jax.json"
        if config.mesh == train_lm.MESH:
            command = ["-m", "pwmesh.examples.train_lm", "--reference", "--no-progress"]
        else:
            command = [__file__, "--reference-json", "--mesh", "{data}x{model}".format(**config.mesh)]
        proc = subprocess.run([sys.executable, *command, "--preset", preset, "--steps", str(steps), "--json", str(out)],
                              env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"train_lm --reference failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def reference(preset: str, steps: int, mesh: dict[str, int], out: str) -> None:
    """``train_lm --reference`` (``jax_trainer``) over ``mesh`` of this process's first devices."""
    config = lm.PRESETS[preset]
    optimizer = lm.make_optimizer(config)
    trainer = train_lm.jax_trainer(config, optimizer, mesh)
    result = train_lm.train(config, steps, trainer, optimizer, progress=False)
    Path(out).write_text(json.dumps(dataclasses.asdict(result)) + "\n")


def pwmesh_run(preset: str, steps: int, mesh: dict[str, int]) -> dict[str, Any]:
    config = lm.PRESETS[preset]
    optimizer = lm.make_optimizer(config)
    trainer = train_lm.pwmesh_trainer(config, optimizer, mesh)
    result = train_lm.train(config, steps, trainer, optimizer, progress=False)
    return dataclasses.asdict(result)


def measure(preset: str, config: Config) -> dict[str, Any]:
    steps = config.steps[preset]
    runs: dict[str, list[dict[str, Any]]] = {"jax": [], "pwmesh": []}
    for r in range(config.rounds):
        for name in (("jax", "pwmesh") if r % 2 == 0 else ("pwmesh", "jax")):
            runs[name].append(jax_run(preset, steps, config) if name == "jax" else
                              pwmesh_run(preset, steps, config.mesh))
    jax_s = statistics.median(run["step_seconds"] for run in runs["jax"])
    pw_s = statistics.median(run["step_seconds"] for run in runs["pwmesh"])
    tokens = lm.PRESETS[preset].tokens_per_step
    same = all(a["losses"] == runs["jax"][0]["losses"] for a in runs["jax"] + runs["pwmesh"])
    point = {
        "preset": preset,
        "config": dataclasses.asdict(lm.PRESETS[preset]),
        "steps": steps,
        "compute_ms_per_step": 1000 * jax_s,
        "pwmesh_ms_per_step": 1000 * pw_s,
        "jax_tokens_per_second": tokens / jax_s,
        "pwmesh_tokens_per_second": tokens / pw_s,
        "ratio": jax_s / pw_s,
        "jax_rounds_ms": [1000 * run["step_seconds"] for run in runs["jax"]],
        "pwmesh_rounds_ms": [1000 * run["step_seconds"] for run in runs["pwmesh"]],
        "losses_identical": same,
        # Across runs (JAX's among themselves too): on a GPU, XLA's autotuning and reductions may differ per process.
        "max_loss_difference": max(abs(a - b) for run in runs["jax"] + runs["pwmesh"]
                                   for a, b in zip(run["losses"], runs["jax"][0]["losses"], strict=True)),
        "jax_final_loss": runs["jax"][0]["losses"][-1],
        "final_loss": runs["pwmesh"][0]["losses"][-1],
        "load_average_1m": load_average(),
    }
    print(f"  {preset}: JAX {point['compute_ms_per_step']:.2f} ms/step, pwmesh {point['pwmesh_ms_per_step']:.2f} "
          f"ms/step, pwmesh/JAX {point['ratio']:.3f}, losses identical: {same}", flush=True)
    return point


def plot(path: Path, points: list[dict[str, Any]], threshold: float, config: Config) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.plot([p["compute_ms_per_step"] for p in points], [p["ratio"] for p in points], "o-",
            label="pwmesh / plain JAX tokens/s")
    for p in points:
        ax.annotate(p["preset"], (p["compute_ms_per_step"], p["ratio"]), textcoords="offset points",
                    xytext=(4, -12), fontsize=8)
    ax.axhline(threshold, color="grey", linestyle=":", label=f"{threshold:.0%} of plain JAX")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    devices = math.prod(config.mesh.values())
    ax.set_xlabel("training step time (ms, plain JAX, {data}x{model} mesh of ".format(**config.mesh)
                  + f"{devices} {config.platform.upper()} device{'s' if devices > 1 else ''})")
    ax.set_ylabel("pwmesh / plain-JAX throughput")
    ax.set_ylim(0, max(1.1, 1.05 * max(p["ratio"] for p in points)))
    ax.set_title("Transformer LM training: how big a step must be to hide pwmesh's dispatch", fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=None, help="comma-separated, of " + ",".join(lm.PRESETS))
    parser.add_argument("--rounds", type=int, default=None, help="runs per system and preset (2)")
    parser.add_argument("--threshold", type=float, default=None, help="pwmesh/JAX ratio to reach (0.95)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run, every preset (300, 80, 14)")
    parser.add_argument("--platform", choices=PLATFORMS, default="cpu",
                        help="the executors' devices and plain JAX's (cpu)")
    parser.add_argument("--mesh", type=parse_mesh, default=None, help="DATAxMODEL devices (2x2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--smoke", action="store_true", help="tiny run (seconds) to check that everything works")
    parser.add_argument("--preset", help=argparse.SUPPRESS)  # with --reference-json: jax_run's subprocess
    parser.add_argument("--reference-json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reference_json:
        reference(args.preset, args.steps, args.mesh, args.json)
        return 0
    config = Config(presets=("tiny",), steps={"tiny": 8}, rounds=1) if args.smoke else Config()
    if args.presets:
        config.presets = tuple(p for p in args.presets.split(",") if p)
        if set(config.presets) - set(lm.PRESETS):
            parser.error(f"presets are {sorted(lm.PRESETS)}")
    for field in ("rounds", "threshold", "mesh"):
        if getattr(args, field) is not None:
            setattr(config, field, getattr(args, field))
    if args.steps is not None:
        config.steps = {preset: args.steps for preset in config.presets}
    config.platform = args.platform
    if config.platform != "cpu":
        share_accelerator(config.platform)
        jax.config.update("jax_platforms", "cpu")  # this process only traces: the devices are the executors'

    started = time.monotonic()
    load_at_start = load_average()
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=1, devices_per_host=math.prod(config.mesh.values()),
                               platform=config.platform)
    with pw.LocalCluster(spec) as cluster:
        pw.connect(cluster.address, name="bench-train")
        try:
            points = [measure(preset, config) for preset in config.presets]
        finally:
            pw.disconnect()
    points.sort(key=lambda p: p["compute_ms_per_step"])
    crossed = threshold_crossing(points, config.threshold)
    fitted = fixed_overhead(points, config.threshold)

    print()
    print(table(["preset", "JAX ms/step", "pwmesh ms/step", "JAX tokens/s", "pwmesh tokens/s", "pwmesh/JAX"],
                [[p["preset"], f"{p['compute_ms_per_step']:.2f}", f"{p['pwmesh_ms_per_step']:.2f}",
                  f"{p['jax_tokens_per_second']:,.0f}", f"{p['pwmesh_tokens_per_second']:,.0f}", f"{p['ratio']:.3f}"]
                 for p in points]))
    print()
    if crossed["point"] is None:
        print(f"pwmesh reached {config.threshold:.0%} of plain JAX at none of the step times measured "
              f"(up to {points[-1]['compute_ms_per_step']:.1f} ms)")
    else:
        print(f"smallest step time at which pwmesh reaches {config.threshold:.0%} of plain JAX: "
              f"{crossed['min_ms']:.1f} ms measured ({crossed['point']['preset']}), "
              f"{crossed['min_ms_interpolated']:.1f} ms interpolated")
    print(f"fitted fixed overhead: {fitted['overhead_ms']:.2f} ms a step, so {config.threshold:.0%} needs steps "
          f"of at least {fitted['predicted_min_ms']:.1f} ms")

    result = {
        "benchmark": "train",
        "smoke": args.smoke,
        "config": dataclasses.asdict(config),
        "machine": machine(load_at_start, config.platform),
        "threshold": config.threshold,
        "points": points,
        "min_step_ms": crossed["min_ms"],
        "min_step_ms_interpolated": crossed["min_ms_interpolated"],
        "overhead_ms_per_step": fitted["overhead_ms"],
        "predicted_min_step_ms": fitted["predicted_min_ms"],
        "wall_seconds": time.monotonic() - started,
    }
    save_results(args.out, "train", result, lambda path: plot(path, points, config.threshold, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
