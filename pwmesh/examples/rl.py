"""Reinforcement learning on two meshes: a sampler and a trainer, scheduled independently, weights synced each step.

The policy is ``pwmesh.examples.lm``'s Transformer over a vocabulary of 16 tokens. The
task needs no data: given a random first token, write ``seq_len`` more, each the one
before plus 1 (mod 16); every token that follows that rule earns 1 (a random policy earns
1/16 a token). The policy learns it by REINFORCE with a baseline: each token's
log-probability is weighted by the reward still to come from it (its own and the later
ones'), less that sum's mean over the batch at the same position.

Two slices on two islands do the work (``--mode overlap``, the default):

- the **sampler**, a slice of 2 devices ``{"data": 2}`` on island 1: one ``pw.jit``
  generates a batch of sequences autoregressively and scores them, the parameters
  replicated, the batch split over ``"data"``;
- the **trainer**, a slice of 4 devices ``{"data": 2, "model": 2}`` on island 0: one
  ``pw.jit`` takes a policy-gradient step, parameters and optimizer state sharded
  Megatron-style over ``"model"`` (``lm.param_specs``) and donated.

Every step the sampler generates batch k+1 while the trainer learns from batch k (the
sampler's call is issued first, and nothing waits: pwmesh's calls return futures), so
the sampler's weights are one step behind the trainer's (one step off-policy). Then
``pw.reshard`` moves the new weights from the trainer's layout to the sampler's
executor to executor (a gather of the model-sharded blocks onto every sampler device);
the batch crosses the other way as the trainer's input. The client fetches only the
rewards, two steps behind.

    python -m pwmesh.examples.rl                     # the embedded cluster: prints the reward per step
    python -m pwmesh.examples.rl --plot rl.png       # ... and draws the curve (needs matplotlib)
    python -m pwmesh.examples.rl --mode sequential   # the same loop on one slice, on-policy, no overlap
    python -m pwmesh.examples.rl --mode jax          # the same loop in plain JAX on a 2x2 mesh, this process

``bench/rl.py`` times the three against each other.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pwmesh as pw
from pwmesh.examples import lm

TRAINER_MESH = {"data": 2, "model": 2}
SAMPLER_MESH = {"data": 2}
MODES = ("overlap", "overlap-calls", "sequential", "jax")
# Compiles and first runs: not part of the time per step. The overlapped loop's reward of step k waits for
# the trainer's step k - 2 only, so the warm-up must be long enough to have compiled every piece.
WARMUP_STEPS = 5
IN_FLIGHT = 2  # steps issued ahead of the rewards the client fetches

# The policy: lm's Transformer, small. On 2 CPU cores, plain JAX on a 2x2 mesh: tiny ~7 ms a step
# (sample and train), small ~110 ms. tiny learns the task in about 100 steps, small in about 50.
PRESETS: dict[str, lm.Config] = {
    "tiny": lm.Config(vocab=16, d_model=32, n_layers=1, n_heads=2, d_ff=64, seq_len=8, batch=64, lr=3e-3,
                      weight_decay=0.0),
    "small": lm.Config(vocab=16, d_model=64, n_layers=2, n_heads=2, d_ff=128, seq_len=16, batch=128, lr=3e-3,
                       weight_decay=0.0),
}


@dataclasses.dataclass
class Result:
    rewards: list[float]  # mean reward per token of each step's batch
    step_seconds: float  # per step after the warm-up (wall clock, dispatch included)
    mode: str


# ------------------------------------------------------------------ the task and the learning (plain JAX)


def rewards_of(tokens: jax.Array, vocab: int) -> jax.Array:
    """1 for each generated token that is the one before it plus 1 (mod ``vocab``): float32 [batch, seq_len]."""
    return (tokens[:, 1:] == (tokens[:, :-1] + 1) % vocab).astype(jnp.float32)


def make_sample(config: lm.Config) -> Callable[[Any, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]:
    """``sample(params, step) -> (tokens, rewards, mean_reward)``: ``config.batch`` sequences of a random first
    token and ``seq_len`` tokens drawn from the policy, one at a time; deterministic in ``config.seed`` and
    ``step`` (an int32 scalar), whatever the mesh."""

    def sample(params: Any, step: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        key = jax.random.fold_in(jax.random.key(config.seed), step)
        first, key = jax.random.split(key)
        tokens = jnp.zeros((config.batch, config.seq_len + 1), jnp.int32)
        tokens = tokens.at[:, 0].set(jax.random.randint(first, (config.batch,), 0, config.vocab))

        def draw(t: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            tokens, key = carry
            key, now = jax.random.split(key)
            # Causal: the logits at t see tokens 0..t only, so what is after t (zeros) does not matter.
            logits = jax.lax.dynamic_index_in_dim(lm.logits(params, tokens), t, axis=1, keepdims=False)
            return tokens.at[:, t + 1].set(jax.random.categorical(now, logits)), key

        tokens, _ = jax.lax.fori_loop(0, config.seq_len, draw, (tokens, key))
        rewards = rewards_of(tokens, config.vocab)
        return tokens, rewards, rewards.mean()

    return sample


def policy_loss(params: Any, tokens: jax.Array, rewards: jax.Array) -> jax.Array:
    """REINFORCE with a baseline: each token's log-probability times its reward to go, less the batch's mean
    reward to go at that position."""
    logp = jax.nn.log_softmax(lm.logits(params, tokens), axis=-1)
    taken = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    to_go = jnp.cumsum(rewards[:, ::-1], axis=1)[:, ::-1]
    advantage = jax.lax.stop_gradient(to_go - to_go.mean(axis=0, keepdims=True))
    return -(advantage * taken).sum(axis=1).mean()


def make_train_step(config: lm.Config, optimizer: optax.GradientTransformation) -> Any:
    """``train_step(params, opt_state, tokens, rewards) -> (params, opt_state, loss)``: pure, for the caller to jit."""
    del config  # the shapes come from the arguments

    def train_step(params: Any, opt_state: Any, tokens: jax.Array, rewards: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(policy_loss)(params, tokens, rewards)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def initial_state(config: lm.Config, optimizer: optax.GradientTransformation) -> tuple[Any, Any]:
    params = jax.device_get(lm.init_params(config))
    return params, jax.device_get(optimizer.init(params))


# ------------------------------------------------------------------ the loops


def overlapped(config: lm.Config, steps: int, trainer: pw.Slice, sampler: pw.Slice, *, calls: bool = False,
               report: Callable[[int, float], None] = lambda step, reward: None) -> Result:
    """The sampler on ``sampler`` one step behind the trainer on ``trainer``, the weights resharded to it every
    step: one ``@pw.program`` a step (one message per island), or with ``calls`` three calls a step (sample,
    train, reshard), each its own program. ``report(step, reward)`` is called as each step's reward is
    fetched (in order)."""
    optimizer = lm.make_optimizer(config)
    pspecs, ospecs = lm.param_specs(config), lm.opt_state_specs(config, optimizer)
    sample = pw.jit(make_sample(config), devices=sampler, in_specs=(P(), P()),
                    out_specs=(P("data"), P("data"), P()))
    train = pw.jit(make_train_step(config, optimizer), devices=trainer,
                   in_specs=(pspecs, ospecs, P("data"), P("data")), out_specs=(pspecs, ospecs, P()),
                   donate_argnums=(0, 1))

    def one_step(params: Any, opt_state: Any, weights: Any, batch: Any, k: Any) -> Any:
        following = sample(weights, k)  # batch k+1 with the weights of step k, first: nothing waits for it
        params, opt_state, _ = train(params, opt_state, batch[0], batch[1])  # learns from batch k meanwhile
        weights = pw.reshard(params, devices=sampler, spec=P())  # trainer -> sampler, executor to executor
        return params, opt_state, weights, following

    run_step = one_step if calls else pw.program(one_step)
    params, opt_state = initial_state(config, optimizer)
    params, opt_state = pw.put(params, devices=trainer, spec=pspecs), pw.put(opt_state, devices=trainer, spec=ospecs)
    weights = pw.reshard(params, devices=sampler, spec=P())
    batch = sample(weights, np.int32(0))

    def step(k: int) -> Any:
        nonlocal params, opt_state, weights, batch
        reward = batch[2]
        params, opt_state, weights, batch = run_step(params, opt_state, weights, batch[:2], np.int32(k + 1))
        return reward

    return _run(steps, step, "overlap-calls" if calls else "overlap", report)


def sequential(config: lm.Config, steps: int, sl: pw.Slice, *,
               report: Callable[[int, float], None] = lambda step, reward: None) -> Result:
    """The same sampler and trainer on one slice (the trainer's mesh), one after the other in one
    ``@pw.program`` a step: on-policy, no weights to move, nothing overlapped."""
    optimizer = lm.make_optimizer(config)
    pspecs, ospecs = lm.param_specs(config), lm.opt_state_specs(config, optimizer)
    sample = pw.jit(make_sample(config), devices=sl, in_specs=(pspecs, P()), out_specs=(P("data"), P("data"), P()))
    train = pw.jit(make_train_step(config, optimizer), devices=sl,
                   in_specs=(pspecs, ospecs, P("data"), P("data")), out_specs=(pspecs, ospecs, P()),
                   donate_argnums=(0, 1))

    @pw.program
    def one_step(params: Any, opt_state: Any, k: Any) -> Any:
        tokens, rewards, reward = sample(params, k)
        params, opt_state, _ = train(params, opt_state, tokens, rewards)
        return params, opt_state, reward

    params, opt_state = initial_state(config, optimizer)
    params, opt_state = pw.put(params, devices=sl, spec=pspecs), pw.put(opt_state, devices=sl, spec=ospecs)

    def step(k: int) -> Any:
        nonlocal params, opt_state
        params, opt_state, reward = one_step(params, opt_state, np.int32(k))
        return reward

    return _run(steps, step, "sequential", report)


def reference(config: lm.Config, steps: int, *,
              report: Callable[[int, float], None] = lambda step, reward: None) -> Result:
    """The sequential loop in plain JAX in this process: ``jax.jit`` on a 2x2 mesh of CPU devices (asked
    for here if JAX has not started yet), the same shardings."""
    mesh = Mesh(np.array(lm.local_devices(4, "--mode jax")).reshape(2, 2), tuple(TRAINER_MESH))

    def named(specs: Any) -> Any:
        return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))

    optimizer = lm.make_optimizer(config)
    pspecs, ospecs = named(lm.param_specs(config)), named(lm.opt_state_specs(config, optimizer))
    split, whole = named(P("data")), named(P())
    sample = jax.jit(make_sample(config), in_shardings=(pspecs, whole), out_shardings=(split, split, whole))
    train = jax.jit(make_train_step(config, optimizer), in_shardings=(pspecs, ospecs, split, split),
                    out_shardings=(pspecs, ospecs, whole), donate_argnums=(0, 1))
    params, opt_state = initial_state(config, optimizer)
    params, opt_state = jax.device_put(params, pspecs), jax.device_put(opt_state, ospecs)

    def step(k: int) -> Any:
        nonlocal params, opt_state
        tokens, rewards, reward = sample(params, np.int32(k))
        params, opt_state, _ = train(params, opt_state, tokens, rewards)
        return reward

    return _run(steps, step, "jax", report, fetch=jax.device_get)


def _run(steps: int, step: Callable[[int], Any], mode: str, report: Callable[[int, float], None],
         fetch: Callable[[Any], Any] = pw.get) -> Result:
    """Issue ``step(k)`` for every k, fetching each step's reward ``IN_FLIGHT`` steps behind (the newest steps
    keep the devices busy meanwhile); time the steps after the warm-up, to the last reward fetched."""
    pending: list[Any] = []
    rewards: list[float] = []
    timed_from = None

    def take(upto: int) -> None:
        while len(rewards) < upto:
            rewards.append(float(fetch(pending[len(rewards)])))
            report(len(rewards) - 1, rewards[-1])

    began = time.perf_counter()
    for k in range(steps):
        pending.append(step(k))
        if k == WARMUP_STEPS - 1:
            take(len(pending))  # the compiles are done: time from here
            timed_from = (time.perf_counter(), len(pending))
        take(len(pending) - IN_FLIGHT)
    take(len(pending))
    end = time.perf_counter()
    if timed_from is None or timed_from[1] == steps:
        seconds = (end - began) / max(1, steps)
    else:
        seconds = (end - timed_from[0]) / (steps - timed_from[1])
    return Result(rewards, seconds, mode)


# ------------------------------------------------------------------ the command


def plot(path: str | Path, results: list[Result]) -> bool:
    """Reward per step of each result, as a PNG at ``path``; False (nothing written) without matplotlib."""
    try:  # an optional dependency (pip install -e '.[bench]'), so found at run time
        importlib.import_module("matplotlib").use("Agg")
    except ImportError:
        return False
    plt = importlib.import_module("matplotlib.pyplot")

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for r in results:
        ax.plot(range(1, len(r.rewards) + 1), r.rewards, label=f"{r.mode} ({r.step_seconds * 1e3:.1f} ms a step)")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward per token")
    ax.set_ylim(0, 1.05)
    ax.set_title("REINFORCE on 'count up by one' (a random policy earns 1/16)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def slices() -> tuple[pw.Slice, pw.Slice]:
    """The trainer's slice (a 2x2 mesh, island 0) and the sampler's (2 devices, data-parallel, island 1)."""
    devs = pw.make_virtual_device_set()
    trainer = devs.add_slice(devices=4, island=0, mesh=TRAINER_MESH)
    sampler = devs.add_slice(devices=2, island=1, mesh=SAMPLER_MESH)
    return trainer, sampler


def run(mode: str, config: lm.Config, steps: int, *,
        report: Callable[[int, float], None] = lambda step, reward: None) -> Result:
    """One mode of the loop on the default client's cluster (``jax``: in this process)."""
    if mode == "jax":
        return reference(config, steps, report=report)
    trainer, sampler = slices()
    if mode in ("overlap", "overlap-calls"):
        return overlapped(config, steps, trainer, sampler, calls=mode == "overlap-calls", report=report)
    return sequential(config, steps, trainer, report=report)


def main(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, default="overlap",
                        help="overlap: sampler and trainer on two islands, one program a step (default); "
                             "overlap-calls: the same as three calls a step; sequential: both on one slice, one "
                             "after the other; jax: sequential in plain JAX, this process")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=1, metavar="N", help="print every Nth step's reward")
    parser.add_argument("--plot", metavar="PNG", help="draw the reward curve here (needs matplotlib)")
    parser.add_argument("--json", metavar="PATH", help="write the rewards and the time per step here")
    args = parser.parse_args(argv)
    config = dataclasses.replace(PRESETS[args.preset], seed=args.seed)

    def report(step: int, reward: float) -> None:
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            print(f"step {step + 1:4d}  reward {reward:.3f}", flush=True)

    result = run(args.mode, config, args.steps, report=report)
    first, last = result.rewards[:10], result.rewards[-10:]
    print(f"{args.mode}: reward {np.mean(first):.3f} (first {len(first)} steps) -> {np.mean(last):.3f} "
          f"(last {len(last)}), {result.step_seconds * 1e3:.2f} ms a step")
    if args.plot:
        print(f"wrote {args.plot}" if plot(args.plot, [result]) else "matplotlib is not installed: no plot")
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "config": dataclasses.asdict(config),
                                               **dataclasses.asdict(result)}) + "\n")
    return result


if __name__ == "__main__":
    main()
