"""The training example's model, data, shardings and checkpoints (plain JAX in this process, no cluster)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pwmesh.examples import lm

TINY = lm.PRESETS["tiny"]


def _is_spec(x: object) -> bool:
    return isinstance(x, P)


@pytest.mark.parametrize("name", sorted(lm.PRESETS))
def test_specs_have_the_structure_of_params_and_state_and_divide(name: str) -> None:
    config = lm.PRESETS[name]
    params = jax.eval_shape(lambda: lm.init_params(config))
    state = jax.eval_shape(lm.make_optimizer(config).init, params)
    for tree, specs in ((params, lm.param_specs(config)), (state, lm.opt_state_specs(config))):
        assert jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(specs, is_leaf=_is_spec)
        for leaf, spec in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(specs, is_leaf=_is_spec),
                              strict=True):
            for dim, axis in zip(leaf.shape, spec, strict=False):
                assert axis is None or dim % 2 == 0, (leaf.shape, spec)
    assert config.batch % 2 == 0 and config.n_heads % 2 == 0 and config.d_ff % 2 == 0


def test_the_moments_follow_their_parameters() -> None:
    specs = lm.opt_state_specs(TINY)
    adam = specs[1][0]  # chain(clip, adamw): adamw's first state is scale_by_adam's
    assert adam.mu == lm.param_specs(TINY) == adam.nu
    assert adam.count == P()


def test_an_untrained_model_knows_nothing() -> None:
    tokens = next(lm.batches(TINY))
    loss = float(lm.loss_fn(lm.init_params(TINY), tokens))
    assert abs(loss - math.log(256)) < 0.5


def test_training_lowers_the_loss_and_specs_do_not_change_the_math() -> None:
    """A (1, 2) mesh of this process's two devices against one device: the same losses."""
    optimizer = lm.make_optimizer(TINY)
    step = lm.make_train_step(TINY, optimizer)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))

    def named(specs: object) -> object:
        return jax.tree_util.tree_map(lambda s: jax.sharding.NamedSharding(mesh, s), specs, is_leaf=_is_spec)

    sharded = jax.jit(step, in_shardings=(named(lm.param_specs(TINY)), named(lm.opt_state_specs(TINY, optimizer)),
                                          named(lm.batch_spec())))
    plain = jax.jit(step)
    losses = {}
    for name, fn in (("sharded", sharded), ("plain", plain)):
        params = lm.init_params(TINY)
        state = optimizer.init(params)
        out = []
        for tokens, _ in zip(lm.batches(TINY), range(30), strict=False):
            params, state, loss = fn(params, state, tokens)
            out.append(float(loss))
        losses[name] = np.array(out)
    np.testing.assert_allclose(losses["sharded"], losses["plain"], rtol=1e-5)
    assert losses["plain"][-5:].mean() < losses["plain"][:5].mean() - 0.5


def test_batches_are_deterministic_and_resume_exactly() -> None:
    assert lm.corpus().size > 1 << 20 and lm.corpus().dtype == np.uint8
    first = lm.batches(TINY)
    fifth = [next(first) for _ in range(5)][-1]
    np.testing.assert_array_equal(next(lm.batches(TINY, start=4)), fifth)
    assert fifth.shape == (TINY.batch, TINY.seq_len + 1) and fifth.dtype == np.int32
    other = next(lm.batches(dataclasses.replace(TINY, seed=1)))
    assert not np.array_equal(other, next(lm.batches(TINY)))


def test_checkpoints_round_trip_and_refuse_what_does_not_fit(tmp_path: Path) -> None:
    params = jax.device_get(lm.init_params(TINY))
    state = jax.device_get(lm.make_optimizer(TINY).init(params))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        lm.load_checkpoint(tmp_path, params, state)
    lm.save_checkpoint(tmp_path, 3, params, state)
    path = lm.save_checkpoint(tmp_path, 12, params, state)
    assert path.name == "ckpt_12.npz" and lm.latest_checkpoint(tmp_path) == path
    assert not list(tmp_path.glob(".ckpt-*")), "no temporary file left behind"
    step, got_params, got_state = lm.load_checkpoint(tmp_path, params, state)
    assert step == 12
    for a, b in zip(jax.tree_util.tree_leaves((got_params, got_state)), jax.tree_util.tree_leaves((params, state)),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    bigger = jax.device_get(lm.init_params(dataclasses.replace(TINY, d_model=64)))
    with pytest.raises(ValueError, match=r"params\['embed'\] has shape \(256, 32\), expected \(256, 64\)"):
        lm.load_checkpoint(tmp_path, bigger, state)
    with pytest.raises(ValueError, match=r"no params\['extra'\]"):
        lm.load_checkpoint(tmp_path, {**params, "extra": np.zeros(1)}, state)
