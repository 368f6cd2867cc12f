"""Train a byte-level Transformer language model on pwmesh, data- and model-parallel.

The model, data and shardings are ``pwmesh.examples.lm``'s. One slice of 4 devices
is a 2x2 mesh ``{"data": 2, "model": 2}``; the training step is one ``pw.jit``
over it with ``in_specs``/``out_specs`` from the model's ``PartitionSpec``s, and
parameters and optimizer state are donated, so they stay on the devices from step
to step: one call per step, dispatched ahead while the devices compute. Losses are
fetched only to report them.

    pwmesh submit pwmesh/examples/train_lm.py --steps 300   # the mesh over 2 hosts (their JAX group)
    pwmesh submit --no-collectives --devices-per-host 4 pwmesh/examples/train_lm.py --steps 300   # one host
    python -m pwmesh.examples.train_lm --reference --steps 300   # plain jax.jit, same shardings

``--checkpoint DIR`` resumes from the newest checkpoint there and saves one at the
end (and every ``--checkpoint-every`` steps). Stopped by Ctrl-C (SIGINT) or SIGTERM, it
saves one of the last step done (in ``--checkpoint DIR``, else in a new directory) and
says where, and how to resume. ``--json PATH`` writes the losses and
the measured speed. With ``--reference`` the identical model trains with plain
``jax.jit`` and the same ``NamedSharding``s in this process (on 4 CPU devices:
the script asks for them itself when JAX has not started yet).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

import pwmesh as pw
from pwmesh.examples import lm

MESH = {"data": 2, "model": 2}
WARMUP_STEPS = 3  # compile and first runs: not part of the speed
IN_FLIGHT = 2  # steps left running while the losses before them are fetched


@dataclasses.dataclass
class Result:
    losses: list[float]
    step_seconds: float  # per step, after warm-up (wall clock, dispatch included)
    tokens_per_second: float
    first_step: int  # where this run started (a resumed run starts after its checkpoint)


@dataclasses.dataclass
class Trainer:
    """One way of running ``lm.make_train_step``: its step, and how state gets on and off the devices."""

    step: Callable[[Any, Any, Any], tuple[Any, Any, Any]]
    place: Callable[[Any, Any], Any]  # (host tree, specs) -> device tree
    fetch: Callable[[Any], Any]  # device tree -> host tree (numpy)


def pwmesh_trainer(config: lm.Config, optimizer: Any, mesh: dict[str, int] = MESH) -> Trainer:
    """``lm``'s step as one ``pw.jit`` over a slice shaped ``mesh`` (over several hosts: their JAX group)."""
    sl = pw.make_virtual_device_set().add_slice(devices=math.prod(mesh.values()), mesh=mesh)
    pspecs, ospecs = lm.param_specs(config), lm.opt_state_specs(config, optimizer)
    step = pw.jit(lm.make_train_step(config, optimizer), devices=sl, in_specs=(pspecs, ospecs, lm.batch_spec()),
                  out_specs=(pspecs, ospecs, P()), donate_argnums=(0, 1))
    return Trainer(step, lambda tree, specs: pw.put(tree, devices=sl, spec=specs), pw.get)


def jax_trainer(config: lm.Config, optimizer: Any, axes: dict[str, int] = MESH) -> Trainer:
    """The same step under plain ``jax.jit`` in this process, with the same shardings (``axes``: the mesh, over
    this process's first devices)."""
    devices = lm.local_devices(math.prod(axes.values()), "--reference")
    mesh = Mesh(np.array(devices).reshape(tuple(axes.values())), tuple(axes))

    def named(specs: Any) -> Any:
        return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))

    pspecs, ospecs = named(lm.param_specs(config)), named(lm.opt_state_specs(config, optimizer))
    step = jax.jit(lm.make_train_step(config, optimizer), in_shardings=(pspecs, ospecs, named(lm.batch_spec())),
                   out_shardings=(pspecs, ospecs, named(P())), donate_argnums=(0, 1))
    return Trainer(step, lambda tree, specs: jax.device_put(tree, named(specs)), jax.device_get)


def train(config: lm.Config, steps: int, trainer: Trainer, optimizer: Any, *, checkpoint: str | None = None,
          checkpoint_every: int = 0, progress: bool = True, log_every: int = 10,
          stop_requested: Callable[[], str] = lambda: "") -> Result:
    """Train up to step ``steps`` (from the newest checkpoint in ``checkpoint``, if any). ``stop_requested``:
    why to stop after the step under way ("": go on), as a ``KeyboardInterrupt`` would, with a checkpoint."""
    params, opt_state, start = _initial_state(config, optimizer, checkpoint)
    params = trainer.place(params, lm.param_specs(config))
    opt_state = trainer.place(opt_state, lm.opt_state_specs(config, optimizer))
    data = lm.batches(config, start=start)
    losses: list[Any] = []
    reported: list[float] = []
    began = shown = time.perf_counter()
    timed_from = None
    done = start  # steps whose new state ``params``/``opt_state`` hold
    if not progress:
        print(f"training steps {start + 1}..{steps}", flush=True)
    try:
        with _progress(progress, steps - start) as bar:
            for step in range(start, steps):
                params, opt_state, loss = trainer.step(params, opt_state, next(data))
                done = step + 1
                losses.append(loss)
                if stop_requested():  # between steps: no state is half donated
                    raise KeyboardInterrupt(stop_requested())
                timed_from, reported, shown = _report(trainer, config, step, start, steps, losses, reported, shown,
                                                      timed_from, bar, log_every)
                if checkpoint and checkpoint_every and done % checkpoint_every == 0 and done < steps:
                    lm.save_checkpoint(checkpoint, done, trainer.fetch(params), trainer.fetch(opt_state))
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (``main``): keep what was trained
        where = checkpoint or tempfile.mkdtemp(prefix="train_lm-")
        if done > start:
            saved = lm.save_checkpoint(where, done, trainer.fetch(params), trainer.fetch(opt_state))
            print(f"stopped ({stop.args[0] if stop.args else 'SIGINT'}) after step {done}: checkpoint saved in {saved}; "
                  f"resume with --checkpoint {where}", flush=True)
        else:
            print(f"stopped ({stop.args[0] if stop.args else 'SIGINT'}) before step {start + 1} was done: nothing "
                  "new to save", flush=True)
        raise
    end = time.perf_counter()
    if checkpoint and steps > start:
        lm.save_checkpoint(checkpoint, steps, trainer.fetch(params), trainer.fetch(opt_state))
    if timed_from is None or len(losses) == timed_from[1]:
        seconds = (end - began) / max(1, len(losses))
    else:
        seconds = (end - timed_from[0]) / (len(losses) - timed_from[1])
    return Result(reported, seconds, config.tokens_per_step / seconds, start)


def _report(trainer: Trainer, config: lm.Config, step: int, start: int, steps: int, losses: list[Any],
            reported: list[float], shown: float, timed_from: tuple[float, int] | None, bar: Any,
            log_every: int) -> tuple[tuple[float, int] | None, list[float], float]:
    """After step ``step``: start timing once warm, and fetch and show the losses ``IN_FLIGHT`` behind."""
    if step - start == WARMUP_STEPS - 1:
        trainer.fetch(losses[-1])  # the warm-up (compiles) is done: time from here
        timed_from = (time.perf_counter(), len(losses))
    # Losses are fetched IN_FLIGHT steps behind: the newest steps keep the devices busy meanwhile.
    last = step == steps - 1
    if len(losses) - len(reported) >= log_every + IN_FLIGHT or last:
        upto = len(losses) if last else len(losses) - IN_FLIGHT
        fresh = [float(v) for v in trainer.fetch(losses[len(reported):upto])]
        losses[len(reported):upto] = fresh  # the arrays go: a long run holds no device value a step
        now = time.perf_counter()
        bar.update(len(reported) + len(fresh), fresh[-1], config.tokens_per_step * len(fresh) / (now - shown))
        reported += fresh
        shown = now
    return timed_from, reported, shown


def _initial_state(config: lm.Config, optimizer: Any, checkpoint: str | None) -> tuple[Any, Any, int]:
    params = jax.device_get(lm.init_params(config))
    opt_state = jax.device_get(optimizer.init(params))
    if checkpoint and lm.latest_checkpoint(checkpoint) is not None:
        start, params, opt_state = lm.load_checkpoint(checkpoint, params, opt_state)
        return params, opt_state, start
    return params, opt_state, 0


class _Bar:
    def __init__(self, progress: Progress | None, task: Any) -> None:
        self.progress, self.task = progress, task

    def update(self, done: int, loss: float, tokens_per_second: float) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=done, loss=loss, speed=tokens_per_second)


class _progress:  # noqa: N801 - used as a context manager, like rich's own
    """A rich progress bar with the loss and tokens/s (or nothing, when ``enabled`` is false)."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                 TextColumn("loss {task.fields[loss]:.4f}"),
                                 TextColumn("{task.fields[speed]:,.0f} tokens/s"), TimeRemainingColumn(),
                                 transient=False) if enabled else None
        self.total = total

    def __enter__(self) -> _Bar:
        if self.progress is None:
            return _Bar(None, None)
        self.progress.start()
        return _Bar(self.progress, self.progress.add_task("train", total=self.total, loss=float("nan"), speed=0.0))

    def __exit__(self, *exc_info: object) -> None:
        if self.progress is not None:
            self.progress.stop()


def main(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(lm.PRESETS), default="small")
    parser.add_argument("--steps", type=int, default=200, help="train up to this step (default: 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", metavar="DIR", help="resume from the newest checkpoint here; save at the end")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="also save every N steps")
    parser.add_argument("--reference", action="store_true", help="plain jax.jit in this process, same shardings")
    parser.add_argument("--json", metavar="PATH", help="write the losses and the speed here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    config = dataclasses.replace(lm.PRESETS[args.preset], seed=args.seed)
    optimizer = lm.make_optimizer(config)
    trainer = jax_trainer(config, optimizer) if args.reference else pwmesh_trainer(config, optimizer)

    # Ctrl-C and SIGTERM stop it after the step under way, with a checkpoint: an interrupt in the middle of a
    # step could leave the state donated to it and not yet replaced, nothing to save. A second one stops now.
    requested: list[str] = []

    def stop(signum: int, frame: Any) -> None:
        if requested:
            raise KeyboardInterrupt(signal.Signals(signum).name)
        requested.append(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        result = train(config, args.steps, trainer, optimizer, checkpoint=args.checkpoint,
                       checkpoint_every=args.checkpoint_every, progress=not args.no_progress,
                       stop_requested=lambda: requested[0] if requested else "")
    except KeyboardInterrupt as stopped:
        sys.exit(128 + (signal.SIGTERM if stopped.args and stopped.args[0] == "SIGTERM" else signal.SIGINT))
    where = "plain JAX (one process)" if args.reference else "pwmesh"
    if result.losses:
        print(f"{where}: steps {result.first_step}..{args.steps}, loss {result.losses[0]:.4f} -> "
              f"{result.losses[-1]:.4f}, {result.tokens_per_second:,.0f} tokens/s "
              f"({result.step_seconds * 1e3:.2f} ms a step)")
    if args.json:
        Path(args.json).write_text(json.dumps({"system": "jax" if args.reference else "pwmesh",
                                               "preset": args.preset, "config": dataclasses.asdict(config),
                                               **dataclasses.asdict(result)}) + "\n")
    return result


if __name__ == "__main__":
    main()
