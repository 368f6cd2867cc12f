"""A small byte-level decoder-only Transformer language model, in plain JAX and optax.

The pieces ``train_lm.py`` trains on pwmesh (and, with ``--reference``, in one
process with plain ``jax.jit``): the model (``init_params``, ``loss_fn``), its
Megatron-style shardings over a ``("data", "model")`` mesh (``param_specs``,
``opt_state_specs``, ``batch_spec``), the optimizer and the training step, real
text every machine has (the bytes of the Python standard library's ``.py`` files),
and checkpoints. Nothing here imports pwmesh: the same functions run under any
``jit``, on any mesh or none.

Tensor parallelism (Megatron): attention heads are split over ``"model"`` (the
q/k/v projections column-parallel, the output projection row-parallel), so is the
MLP's hidden dimension (first matrix and bias column-parallel, second matrix
row-parallel), and the unembedding over the vocabulary; the residual stream's
layer norms and biases, the embeddings and positions are replicated. The batch is
split over ``"data"``. XLA's SPMD partitioner inserts the collectives.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256  # bytes
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 512
    seq_len: int = 128
    batch: int = 16  # sequences per step, over the whole mesh
    lr: float = 3e-3
    weight_decay: float = 0.1
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len


# One training step under plain jax.jit on a 2x2 mesh of 4 CPU devices (jax 0.10.2, a 2-core
# machine), steady state over 22 steps: tiny ~3 ms (about the floor there: a step of 4 devices'
# collectives), small ~20 ms, large ~190 ms.
PRESETS: dict[str, Config] = {
    "tiny": Config(d_model=32, n_layers=1, n_heads=2, d_ff=64, seq_len=16, batch=4),
    "small": Config(d_model=128, n_layers=2, n_heads=4, d_ff=512, seq_len=64, batch=8),
    "large": Config(d_model=256, n_layers=4, n_heads=8, d_ff=1024, seq_len=64, batch=10),
}


# ------------------------------------------------------------------ the model


def init_params(config: Config, key: jax.Array | None = None) -> dict[str, Any]:
    """Parameters, deterministic from ``key`` (else ``config.seed``): a nested dict of float32 arrays."""
    d, h, k, f, v = config.d_model, config.n_heads, config.head_dim, config.d_ff, config.vocab
    key = jax.random.key(config.seed) if key is None else key
    keys = iter(jax.random.split(key, 4 + 6 * config.n_layers))
    residual = 0.02 / math.sqrt(2 * config.n_layers)  # GPT-2: the residual branches' outputs start small

    def normal(shape: tuple[int, ...], scale: float = 0.02) -> jax.Array:
        return scale * jax.random.normal(next(keys), shape, jnp.float32)

    def norm() -> dict[str, jax.Array]:
        return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}

    layers = [{
        "ln1": norm(),
        "wq": normal((d, h, k)), "wk": normal((d, h, k)), "wv": normal((d, h, k)),
        "wo": normal((h, k, d), residual),
        "ln2": norm(),
        "w1": normal((d, f)), "b1": jnp.zeros((f,), jnp.float32),
        "w2": normal((f, d), residual), "b2": jnp.zeros((d,), jnp.float32),
    } for _ in range(config.n_layers)]
    return {"embed": normal((v, d)), "pos": normal((config.seq_len, d), 0.01), "layers": layers,
            "ln_f": norm(), "unembed": normal((d, v))}


def param_specs(config: Config) -> dict[str, Any]:
    """``init_params``'s structure with a ``PartitionSpec`` per parameter (see the module docstring)."""
    norm = {"scale": P(), "bias": P()}
    heads = P(None, "model", None)
    layer = {"ln1": norm, "wq": heads, "wk": heads, "wv": heads, "wo": P("model", None, None), "ln2": norm,
             "w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
    return {"embed": P(), "pos": P(), "layers": [layer] * config.n_layers, "ln_f": norm,
            "unembed": P(None, "model")}


def batch_spec() -> P:
    """The token batch, [batch, seq_len + 1], split over ``"data"``."""
    return P("data")


def _layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _block(h: jax.Array, layer: dict[str, Any], mask: jax.Array) -> jax.Array:
    a = _layer_norm(h, layer["ln1"])
    q, k, v = (jnp.einsum("btd,dhk->bthk", a, layer[w]) for w in ("wq", "wk", "wv"))
    scores = jnp.einsum("bthk,bshk->bhts", q, k) / math.sqrt(q.shape[-1])
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    attended = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(scores, axis=-1), v)
    h = h + jnp.einsum("bthk,hkd->btd", attended, layer["wo"])
    m = _layer_norm(h, layer["ln2"])
    return h + jax.nn.gelu(m @ layer["w1"] + layer["b1"]) @ layer["w2"] + layer["b2"]


def _embed(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    inputs = tokens[:, :-1]
    return params["embed"][inputs] + params["pos"][:inputs.shape[1]]


def _blocks(h: jax.Array, layers: list[dict[str, Any]]) -> jax.Array:
    t = h.shape[1]
    mask = jnp.tril(jnp.ones((t, t), bool))
    for layer in layers:
        h = _block(h, layer, mask)
    return h


def _head_logits(params: dict[str, Any], h: jax.Array) -> jax.Array:
    return (_layer_norm(h, params["ln_f"]) @ params["unembed"]).astype(jnp.float32)


def _head_loss(params: dict[str, Any], h: jax.Array, tokens: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(_head_logits(params, h), axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


def loss_fn(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy of ``tokens`` (int32 [batch, seq_len + 1]), in float32."""
    return _head_loss(params, _blocks(_embed(params, tokens), params["layers"]), tokens)


def logits(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    """The next token's logits after each of ``tokens[:, :-1]`` (float32 [batch, seq_len, vocab]): what a
    sampler or a policy-gradient loss needs (``examples/rl.py``). Causal: position t sees tokens 0..t only."""
    return _head_logits(params, _blocks(_embed(params, tokens), params["layers"]))


# ------------------------------------------------------------------ the model as pipeline stages
#
# Stage 0 embeds and runs the first layers, the last stage runs the last layers and the loss, the
# ones between run layers only; the layers are dealt out as evenly as they go. What crosses from
# stage to stage is the residual stream, float32 [batch, seq_len, d_model].


def stage_layers(config: Config, stages: int) -> list[range]:
    """Which layers each of ``stages`` stages runs."""
    if not 1 <= stages <= config.n_layers:
        raise ValueError(f"{config.n_layers} layers cannot fill {stages} stages (each runs at least one)")
    bounds = np.linspace(0, config.n_layers, stages + 1).round().astype(int)
    return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def split_params(config: Config, tree: dict[str, Any], stages: int) -> list[dict[str, Any]]:
    """``init_params``'s tree (or ``param_specs``', or any tree shaped so) cut into the stages' own trees."""
    out = []
    for s, layers in enumerate(stage_layers(config, stages)):
        part: dict[str, Any] = {}
        if s == 0:
            part.update(embed=tree["embed"], pos=tree["pos"])
        part["layers"] = [tree["layers"][i] for i in layers]
        if s == stages - 1:
            part.update(ln_f=tree["ln_f"], unembed=tree["unembed"])
        out.append(part)
    return out


def stage_apply(config: Config, stage: int, stages: int) -> Any:
    """Stage ``stage``'s function, as ``pwmesh.pipeline.Stage.apply`` takes it: the first maps tokens to
    the residual stream, the middle ones the stream to the stream, the last the stream (and the tokens,
    for the targets) to the mean loss. A single stage maps ``(params, tokens, tokens)`` to the loss."""
    del config  # the shapes come from the parameters
    first, last = stage == 0, stage == stages - 1
    if first and last:
        return lambda p, tokens, _: loss_fn(p, tokens)
    if first:
        return lambda p, tokens: _blocks(_embed(p, tokens), p["layers"])
    if last:
        return lambda p, h, tokens: _head_loss(p, _blocks(h, p["layers"]), tokens)
    return lambda p, h: _blocks(h, p["layers"])


def stage_init(config: Config, stage: int, stages: int) -> Any:
    """Stage ``stage``'s ``init(key)``: its part of a whole model drawn from ``key``."""
    return lambda key: split_params(config, init_params(config, key), stages)[stage]


# ------------------------------------------------------------------ training


def make_optimizer(config: Config) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(config.lr, b1=0.9, b2=0.95, weight_decay=config.weight_decay))


def opt_state_specs(config: Config, optimizer: optax.GradientTransformation | None = None) -> Any:
    """``optimizer.init(params)``'s structure with a spec per leaf: a parameter's moments get that
    parameter's spec, everything else (step counts, empty states) is replicated."""
    optimizer = optimizer or make_optimizer(config)
    state = jax.eval_shape(optimizer.init, jax.eval_shape(functools.partial(init_params, config)))
    specs = param_specs(config)
    return optax.tree_map_params(optimizer, lambda _, spec: spec, state, specs,
                                 transform_non_params=lambda _: P(),
                                 is_leaf=lambda x: isinstance(x, P))


def make_train_step(config: Config, optimizer: optax.GradientTransformation | None = None) -> Any:
    """``train_step(params, opt_state, tokens) -> (params, opt_state, loss)``: pure, for the caller to jit."""
    optimizer = optimizer or make_optimizer(config)

    def train_step(params: Any, opt_state: Any, tokens: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def local_devices(n: int, what: str) -> list[Any]:
    """``n`` JAX devices of this process for ``what`` (a flag, for the message). On CPU they are asked for
    if JAX has not started its backends yet; otherwise the process must have been started with them."""
    # jax's Config declares no flag attributes (they are dynamic): read() refuses jax_platforms, so attributes.
    platforms = jax.config.jax_platforms  # type: ignore[attr-defined]
    if platforms in (None, "", "cpu") and jax.config.jax_num_cpu_devices < n:  # type: ignore[attr-defined]
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:  # JAX has started its backends already
            pass
    if len(jax.devices()) < n:
        raise SystemExit(f"{what} needs {n} JAX devices, this process has {len(jax.devices())} (set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts)")
    return jax.devices()[:n]


# ------------------------------------------------------------------ data


@functools.cache
def corpus(max_bytes: int = 8 << 20) -> np.ndarray:
    """The bytes of the standard library's ``.py`` files, in sorted path order (no download)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "__pycache__" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:  # an unreadable file: skip it, the rest is plenty
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    text = np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)
    if text.size < 1 << 16:
        raise RuntimeError(f"found only {text.size} bytes of Python source under {root}")
    return text


def batches(config: Config, *, seed: int | None = None, start: int = 0) -> Iterator[np.ndarray]:
    """Endless int32 [batch, seq_len + 1] windows at random offsets; ``start=k`` skips exactly the first k
    batches (a resumed run sees what an uninterrupted one would)."""
    text = corpus()
    rng = np.random.default_rng(config.seed if seed is None else seed)
    width = config.seq_len + 1
    for _ in range(start):
        rng.integers(0, text.size - width, size=config.batch)
    while True:
        offsets = rng.integers(0, text.size - width, size=config.batch)
        yield np.stack([text[o:o + width] for o in offsets]).astype(np.int32)


# ------------------------------------------------------------------ checkpoints
#
# One .npz per checkpoint (ckpt_<step>.npz): the leaves of params and optimizer state by their key
# paths, and the step. NumPy reads and writes it with no further dependency, it is one file, and it
# is written whole or not at all (a temporary name, then os.replace). Orbax would add a large
# dependency tree and asynchronous machinery that a model of this size does not need.


def _flat(prefix: str, tree: Any) -> dict[str, np.ndarray]:
    return {prefix + jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def save_checkpoint(directory: str | os.PathLike[str], step: int, params: Any, opt_state: Any) -> Path:
    """Write ``ckpt_<step>.npz`` into ``directory`` (made if missing); returns its path."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    # Any: numpy's savez(**kwds) would have a key "allow_pickle" be a bool.
    arrays: dict[str, Any] = {**_flat("params", params), **_flat("opt_state", opt_state), "step": np.asarray(step)}
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".ckpt-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        path = out / f"ckpt_{step}.npz"
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    found = sorted(Path(directory).glob("ckpt_*.npz"), key=lambda p: int(p.stem.removeprefix("ckpt_")))
    return found[-1] if found else None


def load_checkpoint(directory: str | os.PathLike[str], params_like: Any, opt_state_like: Any) -> tuple[int, Any, Any]:
    """The newest checkpoint in ``directory`` as ``(step, params, opt_state)`` shaped like the ``*_like`` trees."""
    path = latest_checkpoint(directory)
    if path is None:
        raise FileNotFoundError(f"no checkpoint (ckpt_<step>.npz) in {directory}")
    with np.load(path) as saved:
        def restore(prefix: str, like: Any) -> Any:
            leaves = []
            for key_path, leaf in jax.tree_util.tree_flatten_with_path(like)[0]:
                key = prefix + jax.tree_util.keystr(key_path)
                if key not in saved:
                    raise ValueError(f"{path}: no {key} in the checkpoint")
                value = saved[key]
                if value.shape != np.shape(leaf):
                    raise ValueError(f"{path}: {key} has shape {value.shape}, expected {np.shape(leaf)}")
                leaves.append(value)
            return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)

        return int(saved["step"]), restore("params", params_like), restore("opt_state", opt_state_like)
