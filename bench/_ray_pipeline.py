"""The Ray baseline for pipeline-parallel training: tokens/s of ``pwmesh.examples.lm`` as a GPipe pipeline in Ray.

What a Ray user would write for ``pwmesh.pipeline.Pipeline``: one actor per stage (each its own
process, JAX on one CPU device), holding that stage's parameters, optimizer state and gradient
accumulator and its jitted functions, the same ones ``pwmesh.pipeline`` compiles: the forward, the
backward (a ``vjp`` that recomputes the forward from the stage's input: re-materialisation), the
last stage's forward and backward in one call (loss scaled by 1/microbatches), and the optax update.
The driver submits each step in the GPipe order (``pwmesh.pipeline.global_order("gpipe", ...)``:
every stage's calls in its ``stage_order``), feeding each actor method the ObjectRefs the previous
one returned, so nothing waits for the driver; it ``ray.put``s the microbatches and fetches only the
losses, once, at the end. Plain (sequential) actors run their calls in submission order.

Ray moves small objects (under ``max_direct_call_object_size``, 100 KiB) through their owner, the
driver's core worker, inlined in task replies and task specs: as Ray does it by default.

    python bench/_ray_pipeline.py    # checks the losses against plain JAX, then times the small preset
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

# Ray resolves 127.0.0.1 to the host's external address and then listens on every interface; in its
# single-machine mode it stays on loopback. Read when ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import ray  # noqa: E402

from pwmesh.examples import lm
from pwmesh.pipeline import global_order


class StageActor:
    """Stage ``s`` of ``stages``: its parameters, optimizer state, gradient accumulator and compiled calls."""

    def __init__(self, config: lm.Config, s: int, stages: int, microbatches: int,
                 optimizer_factory: Callable[[], optax.GradientTransformation] | None) -> None:
        apply = lm.stage_apply(config, s, stages)
        first, last, scale = s == 0, s == stages - 1, 1.0 / microbatches
        self.optimizer = optimizer_factory() if optimizer_factory else optax.adamw(1e-3)
        self.params = lm.stage_init(config, s, stages)(jax.random.split(jax.random.key(0), stages)[s])
        self.opt_state = self.optimizer.init(self.params)
        self.acc = self._zeros(self.params)

        def accumulate(acc: Any, gp: Any, loss: Any) -> Any:
            return {"grads": jax.tree_util.tree_map(jnp.add, acc["grads"], gp), "loss": acc["loss"] + loss}

        def backward(p: Any, x: Any, gy: Any, acc: Any) -> tuple[Any, Any]:
            if first:  # the input is the microbatch: no gradient to send back
                _, pull = jax.vjp(lambda p: apply(p, x), p)
                return accumulate(acc, pull(gy)[0], 0.0), None
            _, pull = jax.vjp(apply, p, x)  # recomputes the forward from the stage's input
            gp, gx = pull(gy)
            return accumulate(acc, gp, 0.0), gx

        def last_backward(p: Any, x: Any, batch: Any, acc: Any) -> tuple[Any, Any]:
            if first:  # a single stage
                loss, gp = jax.value_and_grad(lambda p: apply(p, x, batch) * scale)(p)
                return accumulate(acc, gp, loss), None
            loss, (gp, gx) = jax.value_and_grad(lambda p, x: apply(p, x, batch) * scale, argnums=(0, 1))(p, x)
            return accumulate(acc, gp, loss), gx

        def update(p: Any, opt: Any, acc: Any) -> tuple[Any, Any, Any, Any]:
            updates, opt = self.optimizer.update(acc["grads"], opt, p)
            return optax.apply_updates(p, updates), opt, self._zeros(p), acc["loss"]

        self._forward = jax.jit(apply)
        self._backward = jax.jit(last_backward if last else backward, donate_argnums=3)
        self._update = jax.jit(update, donate_argnums=(0, 1, 2))

    @staticmethod
    def _zeros(params: Any) -> Any:
        return {"grads": jax.tree_util.tree_map(jnp.zeros_like, params), "loss": jnp.zeros((), jnp.float32)}

    def devices(self) -> int:
        return jax.device_count()

    def forward(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self._forward(self.params, x))

    def backward(self, x: np.ndarray, gy_or_batch: np.ndarray) -> np.ndarray | None:
        """A middle or first stage: ``gy`` is its output's gradient; the last stage: the microbatch (targets)."""
        self.acc, gx = self._backward(self.params, x, gy_or_batch, self.acc)
        return None if gx is None else np.asarray(gx)

    def update(self) -> float:
        """The optimizer step; the step's mean loss (0 except on the last stage)."""
        self.params, self.opt_state, self.acc, loss = self._update(self.params, self.opt_state, self.acc)
        return float(loss)


def ray_pipeline_tokens_per_second(config: lm.Config, stages: int, microbatches: int, steps: int, warmup: int = 3,
                                   optimizer_factory: Callable[[], optax.GradientTransformation] | None = None,
                                   ) -> dict[str, Any]:
    """Train ``warmup`` then ``steps`` GPipe steps on ``stages`` Ray actors; time the latter (wall clock).
    ``losses``: every step's loss, the warm-up's included, in order."""
    if config.batch % microbatches:
        raise ValueError(f"a batch of {config.batch} does not split into {microbatches} microbatches")
    if __name__ != "__main__":  # imported: ship this module to the workers by value, as a script would be
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with warnings.catch_warnings():  # JAX warns on any fork; Ray forks only to exec its daemons at once
        warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
        ray.init(num_cpus=stages + 1, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 ignore_reinit_error=True)
    try:
        env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # one CPU device per actor, whatever the driver has
        actor_cls = ray.remote(StageActor).options(runtime_env={"env_vars": env})
        actors = [actor_cls.remote(config, s, stages, microbatches, optimizer_factory) for s in range(stages)]
        if any(n != 1 for n in ray.get([a.devices.remote() for a in actors])):
            raise RuntimeError("a stage actor sees more than one JAX device")
        order, last, k = global_order("gpipe", stages, microbatches), stages - 1, config.batch // microbatches
        data = lm.batches(config)

        def step() -> ray.ObjectRef:
            batch = next(data)
            mbs = [ray.put(batch[i * k:(i + 1) * k]) for i in range(microbatches)]
            inputs: dict[tuple[int, int], Any] = {}  # (stage, microbatch) -> what the stage reads
            grads: dict[tuple[int, int], Any] = {}  # (stage, microbatch) -> the gradient of its output
            loss = None
            for op in order:
                s, i = op.stage, op.microbatch
                x = mbs[i] if s == 0 else inputs.get((s, i))
                if op.kind == "F":
                    inputs[(s + 1, i)] = actors[s].forward.remote(x)
                elif op.kind == "B":
                    grads[(s - 1, i)] = actors[s].backward.remote(x, mbs[i] if s == last else grads.pop((s, i)))
                else:
                    ref = actors[s].update.remote()
                    loss = ref if s == last else loss
            assert loss is not None
            return loss

        losses = [step() for _ in range(warmup)]
        if losses:
            ray.get(losses[-1])
        start = time.perf_counter()
        losses += [step() for _ in range(steps)]
        ray.get(losses[-1])
        seconds = (time.perf_counter() - start) / steps
        return {"system": "ray", "stages": stages, "microbatches": microbatches, "steps": steps,
                "step_seconds": seconds, "tokens_per_second": config.batch * config.seq_len / seconds,
                "losses": [float(v) for v in ray.get(losses)]}
    finally:
        ray.shutdown()


def _unpipelined_losses(config: lm.Config, stages: int, steps: int) -> list[float]:
    """Plain JAX, one process, the whole batch: ``pwmesh.pipeline.unpipelined``'s losses."""
    from pwmesh.pipeline import Stage, unpipelined

    parts = [Stage(lm.stage_init(config, s, stages), lm.stage_apply(config, s, stages)) for s in range(stages)]
    keys = jax.random.split(jax.random.key(0), stages)
    params = [stage.init(key) for stage, key in zip(parts, keys, strict=True)]
    optimizer = optax.adamw(1e-3)
    opt_state, train, data = optimizer.init(params), jax.jit(unpipelined(parts, optimizer)), lm.batches(config)
    losses: list[float] = []
    for _ in range(steps):
        params, opt_state, loss = train(params, opt_state, next(data))
        losses.append(float(loss))
    return losses


if __name__ == "__main__":
    small = lm.PRESETS["small"]
    got = ray_pipeline_tokens_per_second(small, stages=2, microbatches=2, steps=2, warmup=1)["losses"]
    want = _unpipelined_losses(small, 2, 3)
    print(f"ray pipeline losses (S=2, M=2): {got}\nplain JAX losses:               {want}")
    np.testing.assert_allclose(got, want, rtol=1e-4)
    result = ray_pipeline_tokens_per_second(dataclasses.replace(small, n_layers=4), stages=4, microbatches=8, steps=10)
    print(f"ray, small preset with 4 layers, S=4, M=8: {result['step_seconds'] * 1e3:.1f} ms/step, "
          f"{result['tokens_per_second']:.0f} tokens/s")
