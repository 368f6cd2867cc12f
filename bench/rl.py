"""The RL example's time per step: sampler and trainer overlapped on two islands, against the same loop
run sequentially on one slice, and against plain JAX (issue #31 item 1).

``pwmesh/examples/rl.py`` trains its policy (``lm``'s Transformer) by REINFORCE, each step one
batch sampled and one update, in four ways:

- **overlap**: the sampler on 2 devices ``{"data": 2}`` of island 1, the trainer on 4 devices
  ``{"data": 2, "model": 2}`` of island 0, one ``@pw.program`` a step: the sampler makes batch
  k+1 while the trainer learns from batch k, then the weights are resharded to the sampler
  (one step off-policy);
- **overlap-calls**: the same as three calls a step (sample, train, ``pw.reshard``), each a
  program of its own;
- **sequential**: sampling and training on the trainer's slice, one after the other (one
  program a step; on-policy, no weights to move);
- **jax**: the sequential loop under plain ``jax.jit`` in a process of its own, on a 2x2 mesh of
  4 CPU devices (``rl.py --mode jax``).

The cluster has one executor of 4 devices per island (the trainer's mesh on one host: no JAX
group), started once; each mode runs ``--rounds`` times per preset, alternating the order, and
the medians of the time per step (after the warm-up, to the last reward fetched) are compared.
Presets: ``tiny`` (plain JAX ~7-8 ms a step on 2 cores) and ``small`` (~110-160 ms).

    python bench/rl.py              # ~2 minutes on 2 cores
    python bench/rl.py --smoke      # seconds: the tiny preset, a few steps

Writes ``rl.json`` and (with matplotlib) ``rl.png`` (the reward curves, and the time per step)
into ``--out`` (default: bench/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import pwmesh as pw
from pwmesh.examples import rl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_OUT, load_average, machine, pyplot, save_figure, save_results, table  # noqa: E402

MODES = ("overlap", "overlap-calls", "sequential", "jax")


@dataclasses.dataclass
class Config:
    presets: tuple[str, ...] = ("tiny", "small")
    steps: dict[str, int] = dataclasses.field(default_factory=lambda: {"tiny": 120, "small": 40})
    rounds: int = 2


def jax_run(preset: str, steps: int) -> dict[str, Any]:
    """``rl.py --mode jax`` in a process of its own: it needs 4 CPU devices, asked for before JAX starts."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "jax.json"
        env = {k: v for k, v in os.environ.items() if k != "PWMESH_ADDRESS"}
        subprocess.run([sys.executable, "-m", "pwmesh.examples.rl", "--mode", "jax", "--preset", preset,
                        "--steps", str(steps), "--log-every", str(steps), "--json", str(out)],
                       check=True, env=env, stdout=subprocess.DEVNULL, timeout=600)
        return dict(json.loads(out.read_text()))


def measure(preset: str, config: Config) -> dict[str, Any]:
    steps = config.steps[preset]
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(config.rounds):
        for mode in (MODES if r % 2 == 0 else tuple(reversed(MODES))):
            if mode == "jax":
                runs[mode].append(jax_run(preset, steps))
            else:
                runs[mode].append(dataclasses.asdict(rl.run(mode, rl.PRESETS[preset], steps)))
    ms = {m: 1000 * statistics.median(run["step_seconds"] for run in runs[m]) for m in MODES}
    point: dict[str, Any] = {
        "preset": preset,
        "config": dataclasses.asdict(rl.PRESETS[preset]),
        "steps": steps,
        "ms_per_step": ms,
        "rounds_ms": {m: [1000 * run["step_seconds"] for run in runs[m]] for m in MODES},
        "rewards": {m: runs[m][0]["rewards"] for m in MODES},
        "reward_first10": {m: float(np.mean(runs[m][0]["rewards"][:10])) for m in MODES},
        "reward_last10": {m: float(np.mean(runs[m][0]["rewards"][-10:])) for m in MODES},
        # Deterministic: every round of a mode gives the same rewards (and sequential pwmesh plain JAX's).
        "rewards_repeat": {m: all(run["rewards"] == runs[m][0]["rewards"] for run in runs[m]) for m in MODES},
        "sequential_over_overlap": ms["sequential"] / ms["overlap"],
        "jax_over_overlap": ms["jax"] / ms["overlap"],
        "load_average_1m": load_average(),
    }
    print(f"  {preset}: " + ", ".join(f"{m} {ms[m]:.1f} ms" for m in MODES)
          + f"; sequential/overlap {point['sequential_over_overlap']:.2f}x", flush=True)
    return point


def plot(path: Path, points: list[dict[str, Any]]) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (curve, bars) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    first = points[0]
    for m in MODES:
        rewards = first["rewards"][m]
        curve.plot(range(1, len(rewards) + 1), rewards, label=m, linewidth=1.2)
    curve.set_xlabel("step")
    curve.set_ylabel("mean reward per token")
    curve.set_ylim(0, 1.05)
    curve.set_title(f"REINFORCE, 'count up by one' ({first['preset']}; random policy: 1/16)\n"
                    "overlap-calls draws over overlap, jax over sequential: the same rewards", fontsize=9)
    curve.legend(fontsize=8)
    width = 0.8 / len(MODES)
    for i, m in enumerate(MODES):
        xs = [k + (i - (len(MODES) - 1) / 2) * width for k in range(len(points))]
        bars.bar(xs, [p["ms_per_step"][m] for p in points], width, label=m)
    bars.set_xticks(range(len(points)), [p["preset"] for p in points])
    bars.set_ylabel("ms a step (median)")
    bars.set_title("time per step (CPU devices; the daemons share the cores)", fontsize=9)
    bars.legend(fontsize=8)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=None, help="comma-separated, of " + ",".join(rl.PRESETS))
    parser.add_argument("--steps", type=int, default=None, help="steps per run, every preset (120, 40)")
    parser.add_argument("--rounds", type=int, default=None, help="runs per mode and preset (2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--smoke", action="store_true", help="tiny run (seconds) to check that everything works")
    args = parser.parse_args(argv)
    config = Config(presets=("tiny",), steps={"tiny": 8}, rounds=1) if args.smoke else Config()
    if args.presets:
        config.presets = tuple(p for p in args.presets.split(",") if p)
        if set(config.presets) - set(rl.PRESETS):
            parser.error(f"presets are {sorted(rl.PRESETS)}")
    if args.steps is not None:
        config.steps = {preset: args.steps for preset in config.presets}
    if args.rounds is not None:
        config.rounds = args.rounds

    started = time.monotonic()
    load_at_start = load_average()
    os.environ.pop("PWMESH_ADDRESS", None)
    with pw.LocalCluster(pw.LocalClusterSpec(islands=2, hosts_per_island=1, devices_per_host=4)) as cluster:
        pw.connect(cluster.address, name="bench-rl")
        try:
            points = [measure(preset, config) for preset in config.presets]
        finally:
            pw.disconnect()
    print()
    print(table(["preset", *[f"{m} ms" for m in MODES], "sequential/overlap", "jax/overlap", "reward end"],
                [[p["preset"], *[f"{p['ms_per_step'][m]:.1f}" for m in MODES], f"{p['sequential_over_overlap']:.2f}",
                  f"{p['jax_over_overlap']:.2f}", f"{p['reward_last10']['overlap']:.2f}"] for p in points]))
    result = {
        "benchmark": "rl",
        "smoke": args.smoke,
        "config": dataclasses.asdict(config),
        "machine": machine(load_at_start),
        "points": points,
        "wall_seconds": time.monotonic() - started,
    }
    save_results(args.out, "rl", result, lambda path: plot(path, points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
