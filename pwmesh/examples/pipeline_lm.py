"""Train the byte-level Transformer of ``train_lm`` as a pipeline: 4 stages over 2 islands.

The model is ``pwmesh.examples.lm``'s, cut into stages by ``lm.stage_init`` and
``lm.stage_apply`` (the first embeds, the last computes the loss). Each stage is one
device of its own slice, stages 0-1 on island 0 and 2-3 on island 1 (by default);
``pwmesh.pipeline`` runs each step as one program: every microbatch's forwards and
backwards in GPipe order (``--schedule 1f1b`` for the other), gradients accumulated
and AdamW applied on each stage's own device, activations crossing stages and
islands executor to executor.

    pwmesh submit pwmesh/examples/pipeline_lm.py --steps 100
    python -m pwmesh.examples.pipeline_lm --reference --steps 100   # plain JAX, unpipelined
    python -m pwmesh.examples.pipeline_lm --reference --devices 4   # ... data-parallel on 4 CPU devices

With ``--reference`` the same model (the same stages' parameters, composed) trains
unpipelined with plain ``jax.jit`` in this process on the whole batch: the losses are
the pipeline's, to float rounding. The optimizer is AdamW without global-norm clipping
(which would couple the stages; see ``pwmesh.pipeline``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pwmesh as pw
from pwmesh import pipeline
from pwmesh.examples import lm
from pwmesh.examples.train_lm import WARMUP_STEPS, _progress

IN_FLIGHT = 2  # steps left running while the losses before them are fetched


@dataclasses.dataclass
class Result:
    losses: list[float]
    step_seconds: float  # per step after the warm-up (wall clock, dispatch included)
    tokens_per_second: float


def model(config: lm.Config, stages: int) -> list[pipeline.Stage]:
    return [pipeline.Stage(lm.stage_init(config, s, stages), lm.stage_apply(config, s, stages), name=f"stage{s}")
            for s in range(stages)]


def make_optimizer(config: lm.Config) -> optax.GradientTransformation:
    return optax.adamw(config.lr, b1=0.9, b2=0.95, weight_decay=config.weight_decay)


def initial_params(config: lm.Config, stages: list[pipeline.Stage]) -> list[Any]:
    keys = jax.random.split(jax.random.key(config.seed), len(stages))
    return [jax.device_get(stage.init(k)) for stage, k in zip(stages, keys, strict=True)]


def place_stages(n: int, islands: int) -> list[pw.Slice]:
    """One device per stage, the stages dealt to the islands in order (stage s on island s * islands // n)."""
    devs = pw.make_virtual_device_set()
    return [devs.add_slice(devices=1, island=s * islands // n) for s in range(n)]


def train_pipelined(config: lm.Config, steps: int, pipe: pipeline.Pipeline, stages: list[pipeline.Stage], *,
                    progress: bool = True, log_every: int = 10) -> Result:
    state = pipe.place(initial_params(config, stages))
    return _loop(config, steps, lambda s, b: pipe.step(s, b), state, pw.get, progress, log_every)


def train_reference(config: lm.Config, steps: int, stages: list[pipeline.Stage], *, devices: int = 1,
                    progress: bool = True, log_every: int = 10) -> Result:
    """Plain ``jax.jit`` of the whole model, unpipelined; on ``devices`` > 1 CPU devices of this process,
    data-parallel (the batch split over them, parameters replicated: XLA all-reduces the gradients)."""
    # The devices first: on CPU they can be asked for only before anything starts JAX's backends.
    mesh = Mesh(np.array(lm.local_devices(devices, f"--devices {devices}")), ("data",)) if devices > 1 else None
    optimizer = make_optimizer(config)
    params = initial_params(config, stages)
    state = (params, optimizer.init(params))
    if mesh is None:
        step = jax.jit(pipeline.unpipelined(stages, optimizer), donate_argnums=(0, 1))
    else:
        whole, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        state = jax.device_put(state, whole)
        step = jax.jit(pipeline.unpipelined(stages, optimizer), in_shardings=(whole, whole, split),
                       out_shardings=whole, donate_argnums=(0, 1))

    def one(state: Any, batch: Any) -> Any:
        params, opt_state, loss = step(*state, batch)
        return (params, opt_state), loss

    return _loop(config, steps, one, state, jax.device_get, progress, log_every)


def _loop(config: lm.Config, steps: int, step: Any, state: Any, fetch: Any, progress: bool,
          log_every: int) -> Result:
    data = lm.batches(config)
    losses: list[Any] = []
    reported: list[float] = []
    timed_from = None
    shown = began = time.perf_counter()
    with _progress(progress, steps) as bar:
        for i in range(steps):
            state, loss = step(state, next(data))
            losses.append(loss)
            if i == WARMUP_STEPS - 1:
                fetch(loss)
                timed_from = (time.perf_counter(), len(losses))
            last = i == steps - 1
            if len(losses) - len(reported) >= log_every + IN_FLIGHT or last:
                upto = len(losses) if last else len(losses) - IN_FLIGHT
                fresh = [float(v) for v in fetch(losses[len(reported):upto])]
                now = time.perf_counter()
                bar.update(len(reported) + len(fresh), fresh[-1], config.tokens_per_step * len(fresh) / (now - shown))
                reported += fresh
                shown = now
    end = time.perf_counter()
    if timed_from is None or len(losses) == timed_from[1]:
        seconds = (end - began) / max(1, len(losses))
    else:
        seconds = (end - timed_from[0]) / (len(losses) - timed_from[1])
    return Result(reported, seconds, config.tokens_per_step / seconds)


def main(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(lm.PRESETS), default="small")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--islands", type=int, default=2, help="islands the stages are dealt to (default: 2)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", choices=pipeline.SCHEDULES, default="gpipe")
    parser.add_argument("--batch", type=int, help="sequences a step (default: the preset's, rounded to microbatches)")
    parser.add_argument("--devices", type=int, default=1, help="with --reference: data-parallel over this many "
                        "CPU devices of the process (default: 1)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", action="store_true", help="plain jax.jit in this process, unpipelined")
    parser.add_argument("--json", metavar="PATH", help="write the losses and the speed here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    base = lm.PRESETS[args.preset]
    # Every stage runs at least one layer; the batch splits into equal microbatches.
    batch = args.batch or max(base.batch, args.microbatches) // args.microbatches * args.microbatches
    config = dataclasses.replace(base, seed=args.seed, n_layers=max(base.n_layers, args.stages), batch=batch)
    stages = model(config, args.stages)
    if args.reference:
        result = train_reference(config, args.steps, stages, devices=args.devices, progress=not args.no_progress)
        where = f"plain JAX (one process, unpipelined, {args.devices} device{'s' if args.devices > 1 else ''})"
    else:
        slices = place_stages(args.stages, args.islands)
        pipe = pipeline.Pipeline(stages, slices, make_optimizer(config), microbatches=args.microbatches,
                                 schedule=args.schedule)
        result = train_pipelined(config, args.steps, pipe, stages, progress=not args.no_progress)
        islands = sorted({d.island for sl in slices for d in sl.devices})
        where = f"pwmesh, {args.stages} stages on islands {islands}, {args.microbatches} microbatches, {args.schedule}"
    if result.losses:
        print(f"{where}: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}, "
              f"{result.tokens_per_second:,.0f} tokens/s ({result.step_seconds * 1e3:.1f} ms a step)")
    if args.json:
        Path(args.json).write_text(json.dumps({"system": "jax" if args.reference else "pwmesh", **vars(args),
                                               "config": dataclasses.asdict(config),
                                               **dataclasses.asdict(result)}) + "\n")
    return result


if __name__ == "__main__":
    main()
