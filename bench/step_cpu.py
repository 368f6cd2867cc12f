"""Where a training step's CPU goes: each pwmesh process's CPU time per step, against plain JAX's.

Issue #29 asks that a step cost what JAX's costs, and that the note say where each remaining
microsecond goes. Wall time on a shared machine moves with whatever else runs; the CPU time each
process takes per step (from ``/proc``) moves much less, and says which part of the controller
costs what. ``train_lm``'s model trains ``--steps`` steps of ``--preset`` (after a warm-up):

- pwmesh: the step as one ``pw.jit`` over a 2x2 mesh of one executor's 4 CPU devices, driven from
  this process (the client); CPU per step of the client, the proxy, the island scheduler, the
  executor, and of the executor's main thread alone (its interpreter: receiving, admitting,
  dispatching, storing, reporting), the rest being XLA's compute threads and the data plane's;
- plain JAX: the same step under ``jax.jit`` with the same shardings in a process of its own with 4
  CPU devices (``--reference``): its CPU per step is the computation plus JAX's own dispatch.

    python bench/step_cpu.py                 # about a minute: tiny, 1,500 steps
    python bench/step_cpu.py --preset small --steps 300
    python bench/step_cpu.py --smoke         # seconds
    python bench/step_cpu.py --platform cuda # one GPU (a 1x1 mesh): the executor and plain JAX on it

Then (on CPU) plain JAX once more, beside a load that takes what pwmesh's controller took: a process
burning the client's, the proxy's and the island scheduler's CPU per step, plus what the executor
took beyond plain JAX's step, in nine bursts per pwmesh step (a step's messages). If that alone slows
plain JAX to pwmesh's speed, the gap is the CPU the controller shares with the devices' compute, not
its latency (``--no-load``: skip it).

Writes ``step_cpu.json`` into ``--out`` (default: bench/results). Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_OUT, load_average, machine, share_accelerator, table, write_json  # noqa: E402

WARMUP = 50
DEVICES = 4  # on CPU: a 2x2 mesh (train_lm's); on an accelerator one device, a 1x1 mesh


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User and system CPU time of a process (or one of its threads)."""
    stat = Path(f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mesh_of(platform: str) -> dict[str, int]:
    return {"data": 2, "model": 2} if platform == "cpu" else {"data": 1, "model": 1}


def reference(preset: str, steps: int, warmup: int, platform: str) -> dict[str, float]:
    """Plain JAX, in this process (on CPU started with 4 devices): wall and CPU per step."""
    import jax

    jax.config.update("jax_platforms", platform)
    from pwmesh.examples import lm, train_lm

    config = lm.PRESETS[preset]
    optimizer = lm.make_optimizer(config)
    trainer = train_lm.jax_trainer(config, optimizer, mesh_of(platform))
    train_lm.train(config, warmup, trainer, optimizer, progress=False)
    cpu, wall = time.process_time(), time.perf_counter()
    train_lm.train(config, steps, trainer, optimizer, progress=False)
    return {"wall_ms": (time.perf_counter() - wall) / steps * 1e3, "cpu_ms": (time.process_time() - cpu) / steps * 1e3}


def burn(cpu_ms: float, period_ms: float, bursts: int) -> None:
    """Take ``cpu_ms`` of CPU every ``period_ms`` of wall time, in ``bursts`` equal bursts, until stopped or
    the process that started it is gone (the load beside plain JAX's second run)."""
    burst, gap = cpu_ms / bursts / 1e3, max(0.0, (period_ms - cpu_ms) / bursts / 1e3)
    parent = os.getppid()
    while os.getppid() == parent:
        for _ in range(bursts):
            end = time.thread_time() + burst
            while time.thread_time() < end:
                pass
            time.sleep(gap)


def plain_jax(args: argparse.Namespace, env: dict[str, str], what: str) -> dict[str, float]:
    """Plain JAX's step (``reference``) in a process of its own; ``what``: the run, for its error."""
    done = subprocess.run([sys.executable, __file__, "--reference", "--preset", args.preset, "--steps", str(args.steps),
                           "--platform", args.platform] + (["--smoke"] if args.smoke else []),
                          env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def beside_load(args: argparse.Namespace, env: dict[str, str], cpu_ms: float, period_ms: float) -> dict[str, float]:
    """Plain JAX's step again, with ``burn`` in a process of its own beside it."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import step_cpu; "
            f"step_cpu.burn({cpu_ms!r}, {period_ms!r}, 9)")
    load = subprocess.Popen([sys.executable, "-c", code])
    try:
        return plain_jax(args, env, "plain JAX's run beside the load")
    finally:
        load.terminate()
        load.wait(timeout=30)


def pwmesh_step(preset: str, steps: int, warmup: int, platform: str) -> dict[str, float]:
    """pwmesh on a local cluster of one executor (4 CPU devices, or one of ``platform``'s): wall and each
    process's CPU per step."""
    import jax

    jax.config.update("jax_platforms", "cpu")  # this process only traces: the devices are the executor's
    import pwmesh as pw
    from pwmesh.examples import lm, train_lm

    mesh = mesh_of(platform)
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=1, devices_per_host=math.prod(mesh.values()),
                               platform=platform)
    with pw.LocalCluster(spec) as cluster:
        pids = {child.role: child.popen.pid for child in cluster.children if child.role != "rm"}
        pids["client"] = os.getpid()
        pw.connect(cluster.address, name="step-cpu")
        try:
            config = lm.PRESETS[preset]
            optimizer = lm.make_optimizer(config)
            trainer = train_lm.pwmesh_trainer(config, optimizer, mesh)
            train_lm.train(config, warmup, trainer, optimizer, progress=False)
            executor = pids["executor"]
            before = {role: cpu_seconds(pid) for role, pid in pids.items()}
            main_before, wall = cpu_seconds(executor, executor), time.perf_counter()
            train_lm.train(config, steps, trainer, optimizer, progress=False)
            wall = time.perf_counter() - wall
            after = {role: cpu_seconds(pid) for role, pid in pids.items()}
            main = cpu_seconds(executor, executor) - main_before
        finally:
            pw.disconnect()
    out = {"wall_ms": wall / steps * 1e3}
    out.update({f"{role}_cpu_ms": (after[role] - before[role]) / steps * 1e3 for role in pids})
    out["executor_main_thread_cpu_ms"] = main / steps * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--platform", default="cpu", help="the executor's and plain JAX's devices (cuda: one GPU)")
    parser.add_argument("--smoke", action="store_true", help="a few steps: checks the paths, measures nothing")
    parser.add_argument("--no-load", action="store_true", help="skip plain JAX beside the controller's CPU as a load")
    parser.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)  # plain JAX's own process
    args = parser.parse_args()
    steps, warmup = (20, 5) if args.smoke else (args.steps, WARMUP)
    if args.reference:
        print(json.dumps(reference(args.preset, steps, warmup, args.platform)))
        return
    load = load_average()
    share_accelerator(args.platform)
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}", JAX_PLATFORMS=args.platform)
    jax_step = plain_jax(args, env, "plain JAX's run")
    mine = pwmesh_step(args.preset, steps, warmup, args.platform)
    controller = sum(mine[f"{role}_cpu_ms"] for role in ("client", "proxy", "scheduler"))
    rows = [["plain JAX (one process)", f"{jax_step['wall_ms']:.2f}", f"{jax_step['cpu_ms']:.2f}"],
            ["pwmesh, all processes", f"{mine['wall_ms']:.2f}", f"{controller + mine['executor_cpu_ms']:.2f}"]]
    loaded: dict[str, float] | None = None
    load_ms = controller + max(0.0, mine["executor_cpu_ms"] - jax_step["cpu_ms"])
    if args.platform == "cpu" and not args.no_load:
        loaded = beside_load(args, env, load_ms, mine["wall_ms"])
        rows.insert(1, [f"  beside {load_ms:.2f} ms of load a step", f"{loaded['wall_ms']:.2f}",
                        f"{loaded['cpu_ms']:.2f}"])
    rows += [[f"  {role}", "", f"{mine[f'{role}_cpu_ms']:.2f}"] for role in ("client", "proxy", "scheduler", "executor")]
    rows.append(["    executor's main thread", "", f"{mine['executor_main_thread_cpu_ms']:.2f}"])
    print(f"\n{args.preset} on {args.platform}: {steps} steps after {warmup} of warm-up, ms per step\n")
    print(table(["", "wall", "CPU"], rows))
    print(f"\npwmesh/JAX {jax_step['wall_ms'] / mine['wall_ms']:.3f}"
          + (f"; JAX beside the load / JAX {jax_step['wall_ms'] / loaded['wall_ms']:.3f}" if loaded else ""))
    result: dict[str, Any] = {
        "benchmark": "step_cpu", "smoke": args.smoke, "preset": args.preset, "steps": steps,
        "machine": machine(load, args.platform), "jax": jax_step, "pwmesh": mine,
        "ratio": jax_step["wall_ms"] / mine["wall_ms"],
        "controller_cpu_ms": controller,
        "executor_own_cpu_ms": mine["executor_cpu_ms"] - jax_step["cpu_ms"],
        "load_cpu_ms": load_ms, "jax_beside_load": loaded,
        "ratio_beside_load": jax_step["wall_ms"] / loaded["wall_ms"] if loaded else None,
    }
    write_json(args.out / "step_cpu.json", result)
    print(f"\nwrote {args.out / 'step_cpu.json'}")


if __name__ == "__main__":
    main()
