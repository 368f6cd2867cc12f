"""The RL example (issue #31): a sampler and a trainer on meshes of their own, on two islands, and the
M-to-N weight transfer between them (``pw.reshard`` of a pytree), on real daemons.

The wide cluster (one executor of 8 devices per island) holds the trainer's 2x2 mesh on one host,
so no JAX group is needed; the sampler's slice is on the other island, another executor.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pwmesh as pw
from pwmesh.examples import lm, rl

FETCH_TIMEOUT_SECONDS = 60.0


@pytest.fixture
def wide_default(wide_cluster: pw.LocalCluster) -> Iterator[pw.Client]:
    """The module-level API (the example's ``pw.jit``, ``pw.put``...) bound to the wide cluster."""
    client = pw.connect(wide_cluster.address, name="test-rl")
    yield client
    pw.disconnect()


@pytest.mark.timeout(60)
def test_a_pytree_moves_between_meshes_of_different_sizes_and_specs(wide_default: pw.Client) -> None:
    trainer, sampler = rl.slices()
    assert trainer.mesh == {"data": 2, "model": 2} and sampler.mesh == {"data": 2}
    assert {d.executor for d in trainer.devices}.isdisjoint({d.executor for d in sampler.devices})
    rng = np.random.default_rng(0)
    tree = {"w": rng.random((8, 12), dtype=np.float32), "b": rng.random((12,), dtype=np.float32),
            "heads": [rng.random((4, 6, 2), dtype=np.float32), np.arange(24, dtype=np.int32).reshape(6, 4)],
            "step": np.float32(3.0)}
    trainer_specs = {"w": P("data", "model"), "b": P("model"), "heads": [P(None, "model", "data"), P("model")],
                     "step": P()}
    on_trainer = pw.put(tree, devices=trainer, spec=trainer_specs)
    # 2x2 -> 2: replicated (a data-parallel sampler's weights), and split other ways over the sampler's axis.
    replicated = pw.reshard(on_trainer, devices=sampler, spec=P())
    split = pw.reshard(on_trainer, devices=sampler,
                       spec={"w": P(None, "data"), "b": P("data"), "heads": [P("data"), P(None, "data")],
                             "step": P()})
    # And 2 -> 2x2, every array's rows over "model" (replicated over "data").
    back = pw.reshard(split, devices=trainer, spec={"w": P("model"), "b": P("model"),
                                                    "heads": [P("model"), P("model")], "step": P()})
    for moved, where in ((replicated, sampler), (split, sampler), (back, trainer)):
        leaves = jax.tree_util.tree_leaves(moved)
        assert all(isinstance(a, pw.Array) and a.sharding.slice is where for a in leaves)
        assert jax.tree_util.tree_structure(moved) == jax.tree_util.tree_structure(tree)
        got = wide_default.fetch(leaves, timeout_seconds=FETCH_TIMEOUT_SECONDS)
        for value, want in zip(got, jax.tree_util.tree_leaves(tree), strict=True):
            assert value.dtype == np.asarray(want).dtype
            np.testing.assert_array_equal(value, want)
    assert replicated["w"].sharding.spec == P() and split["w"].sharding.spec == P(None, "data")


@pytest.mark.timeout(60)
def test_the_model_weights_reach_the_sampler_in_its_layout(wide_default: pw.Client) -> None:
    """What the example syncs every step: lm's Megatron-sharded parameters, onto the sampler replicated."""
    trainer, sampler = rl.slices()
    config = rl.PRESETS["tiny"]
    params = jax.device_get(lm.init_params(config))
    on_trainer = pw.put(params, devices=trainer, spec=lm.param_specs(config))
    weights = pw.reshard(on_trainer, devices=sampler, spec=P())
    for got, want in zip(jax.tree_util.tree_leaves(pw.get(weights)), jax.tree_util.tree_leaves(params), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.timeout(90)
def test_the_overlapped_loop_learns(wide_default: pw.Client) -> None:
    """Sampler one step behind the trainer, weights resharded each step: the reward rises from a random
    policy's (1/16 a token) to most tokens right. Seeds are fixed, so the run is the same every time
    (measured: 0.08 over the first 10 steps, 0.91 over the last 10 of 80); the margin is wide."""
    trainer, sampler = rl.slices()
    result = rl.overlapped(rl.PRESETS["tiny"], 80, trainer, sampler)
    assert len(result.rewards) == 80 and result.step_seconds > 0
    first, last = np.mean(result.rewards[:10]), np.mean(result.rewards[-10:])
    assert first < 0.2, result.rewards
    assert last > first + 0.4, result.rewards
