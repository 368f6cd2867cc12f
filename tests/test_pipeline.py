"""Pipeline-parallel training (``pwmesh.pipeline``) against the same model trained unpipelined in plain JAX.

The schedules are checked as data first (every stage's order, the merged program
order). Then the example Transformer, cut into S stages on slices that alternate
between the two islands of the 8-device cluster, trains a few steps with M
microbatches; its losses and parameters equal plain ``jax.jit`` of the whole model
on the whole batch, in this process (1e-4 relative), for S in {2, 4} and M in
{1, 4, 8}, with 1F1B, and with stages that are themselves data- and model-parallel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import pwmesh as pw
from helpers import eventually
from pwmesh import pipeline
from pwmesh.examples import lm
from pwmesh.pipeline import Op, Pipeline, Stage, global_order, stage_order, unpipelined

CONFIG = dataclasses.replace(lm.PRESETS["tiny"], n_layers=4, batch=8)
STEPS = 3
FETCH_TIMEOUT_SECONDS = 120.0


def optimizer() -> optax.GradientTransformation:
    return optax.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1)


# ------------------------------------------------------------------ schedules, as data


@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 7, 8])
def test_every_schedule_runs_each_call_once_in_a_dataflow_order(schedule: str, stages: int,
                                                                microbatches: int) -> None:
    order = global_order(schedule, stages, microbatches)
    expected = {Op("F", s, i) for s in range(stages - 1) for i in range(microbatches)}
    expected |= {Op("B", s, i) for s in range(stages) for i in range(microbatches)} | {Op("U", s) for s in
                                                                                       range(stages)}
    assert sorted(order, key=repr) == sorted(expected, key=repr) and len(order) == len(expected)
    at = {op: k for k, op in enumerate(order)}
    for op in order:
        s, i = op.stage, op.microbatch
        if op.kind == "F" and s > 0:
            assert at[Op("F", s - 1, i)] < at[op], "a forward follows the one before it"
        if op.kind == "B" and s < stages - 1:
            assert at[Op("B", s + 1, i)] < at[op] and at[Op("F", s, i)] < at[op], "a backward follows its gradient"
        if op.kind == "U":
            assert all(at[Op("B", s, j)] < at[op] for j in range(microbatches)), "the update comes last"
    for s in range(stages):
        assert [op for op in order if op.stage == s] == stage_order(schedule, stages, microbatches, s)


def test_gpipe_runs_all_forwards_then_all_backwards_and_1f1b_alternates() -> None:
    def kinds(schedule: str, stage: int) -> str:
        return "".join(op.kind for op in stage_order(schedule, 4, 6, stage))

    assert kinds("gpipe", 0) == "FFFFFF" "BBBBBB" "U"
    assert kinds("1f1b", 0) == "FFF" "FBFBFB" "BBB" "U", "warm-up of S-1-s forwards, then one of each"
    assert kinds("1f1b", 2) == "F" "FBFBFBFBFB" "B" "U"
    assert kinds("gpipe", 3) == kinds("1f1b", 3) == "BBBBBB" "U", "the last stage's forward is in its backward"


# ------------------------------------------------------------------ against plain JAX


@pytest.fixture(scope="module")
def devs(wide_cluster: pw.LocalCluster) -> Iterator[pw.VirtualDeviceSet]:
    client = pw.connect(wide_cluster.address, name="pipeline")
    yield client.make_virtual_device_set()
    pw.disconnect()


def lm_stages(n: int, specs: bool = False) -> list[Stage]:
    param_specs = lm.split_params(CONFIG, lm.param_specs(CONFIG), n) if specs else [None] * n
    return [Stage(lm.stage_init(CONFIG, s, n), lm.stage_apply(CONFIG, s, n), param_specs[s], name=f"s{s}")
            for s in range(n)]


def train_both(pipe: Pipeline, stages: list[Stage], steps: int = STEPS) -> tuple[list[float], list[float], Any, Any]:
    """``steps`` steps on the pipeline and unpipelined in plain JAX, from the same parameters and data."""
    keys = jax.random.split(jax.random.key(0), len(stages))
    host = [jax.device_get(stage.init(k)) for stage, k in zip(stages, keys, strict=True)]
    state = pipe.place(host)
    opt = pipe.optimizer
    step = jax.jit(unpipelined(stages, opt))
    params, opt_state = host, opt.init(host)
    data = lm.batches(CONFIG)
    losses, reference = [], []
    for _ in range(steps):
        batch = next(data)
        state, loss = pipe.step(state, batch)
        losses.append(loss)
        params, opt_state, ref_loss = step(params, opt_state, batch)
        reference.append(float(ref_loss))
    got = [float(v) for v in pw.get(losses)]
    return got, reference, pw.get(state.params), jax.device_get(params)


def assert_same_training(got: list[float], reference: list[float], params: Any, ref_params: Any) -> None:
    """Each step's loss within 1e-4 relative; each parameter array within 1e-4 relative in norm.

    Not element by element: summing microbatch gradients rounds differently from one whole-batch
    gradient (~1e-7), and where an element's gradient is itself near the rounding (cancellation),
    Adam's m / sqrt(v) turns that into a relative difference of up to ~2e-4 in that one element
    (3e-6 absolute in 0.017, seen with 4 stages and 4 microbatches)."""
    np.testing.assert_allclose(got, reference, rtol=1e-4)
    assert got[-1] < got[0], "it learns"
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(ref_params)
    worst = ("", 0.0)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree_util.tree_leaves(ref_params),
                            strict=True):
        b = np.asarray(b)
        error = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))
        worst = max(worst, (jax.tree_util.keystr(path), error), key=lambda w: w[1])
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-4, err_msg=jax.tree_util.keystr(path))
    assert worst[1] <= 1e-4, f"parameter {worst[0]} differs by {worst[1]:.2e} (relative, in norm)"


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("microbatches", "stages"), [
    (4, 4), (8, 2),  # the suite's: several microbatches over both depths (~7 s each)
    *(pytest.param(m, s, marks=pytest.mark.long) for m, s in [(1, 2), (1, 4), (4, 2), (8, 4)])])
def test_a_pipeline_trains_exactly_as_the_unpipelined_model(devs: pw.VirtualDeviceSet, stages: int,
                                                            microbatches: int) -> None:
    slices = [devs.add_slice(devices=1, island=s % 2) for s in range(stages)]  # every hop crosses islands
    model = lm_stages(stages)
    pipe = Pipeline(model, slices, optimizer(), microbatches=microbatches)
    assert_same_training(*train_both(pipe, model))


@pytest.mark.timeout(240)
def test_1f1b_trains_exactly_as_the_unpipelined_model(devs: pw.VirtualDeviceSet) -> None:
    slices = [devs.add_slice(devices=1, island=s // 2) for s in range(4)]  # two stages per island
    model = lm_stages(4)
    pipe = Pipeline(model, slices, optimizer(), microbatches=8, schedule="1f1b")
    assert_same_training(*train_both(pipe, model))


@pytest.mark.timeout(240)
def test_stages_that_are_data_and_model_parallel_on_their_slices(devs: pw.VirtualDeviceSet) -> None:
    """Each stage on a 2x2 mesh of its island: batch over "data", Megatron specs over "model"."""
    mesh = {"data": 2, "model": 2}
    slices = [devs.add_slice(devices=4, island=s, mesh=mesh) for s in range(2)]
    model = lm_stages(2, specs=True)
    pipe = Pipeline(model, slices, optimizer(), microbatches=2, batch_spec=P("data"))
    got, reference, params, ref_params = train_both(pipe, model)
    assert_same_training(got, reference, params, ref_params)


@pytest.mark.timeout(240)
def test_state_stays_on_the_stages_and_memory_stays_flat(devs: pw.VirtualDeviceSet) -> None:
    slices = [devs.add_slice(devices=1, island=s) for s in range(2)]
    model = lm_stages(2)
    pipe = Pipeline(model, slices, optimizer(), microbatches=4)
    state = pipe.init(jax.random.key(1))
    for s, sl in enumerate(slices):
        for leaf in jax.tree_util.tree_leaves((state.params[s], state.opt_state[s], state.accumulators[s])):
            assert leaf.sharding.slice is sl
    client = pw.default_client()

    def stored() -> int:
        return sum(e.bytes for e in client.status().executor_stats)

    def settled() -> int:
        """What the executors hold once no run is in flight at the proxy. A run's temporaries are freed after
        its completion, which may come after its last output: a snapshot taken as that lands can count them."""
        eventually(lambda: all(s.programs == 0 for s in client.status().sessions), 10)
        return stored()

    data = lm.batches(CONFIG)
    first = 0
    for step in range(24):
        old = state
        state, loss = pipe.step(state, next(data))
        if step % 8 == 7:  # once the whole step is done (its loss comes before stage 0's update)
            for leaf in jax.tree_util.tree_leaves(state):
                leaf.block_until_ready()
            if not first:
                first = settled()
            else:  # no more than after the first steps, once what is still being freed has gone
                try:
                    eventually(lambda limit=first: stored() <= limit, 10)
                except TimeoutError:
                    raise AssertionError(f"stored bytes grew over the steps: {first} -> {stored()}") from None
    with pytest.raises(pw.InvalidArgument, match="was donated to s0.update"):
        pw.get(old.params[0]["embed"])


def test_bad_pipelines_and_batches_say_what_is_wrong(devs: pw.VirtualDeviceSet) -> None:
    one = devs.add_slice(devices=1, island=0)
    model = lm_stages(2)
    with pytest.raises(pw.InvalidArgument, match="2 stages need 2 slices, got 1"):
        Pipeline(model, [one], optimizer())
    with pytest.raises(pw.InvalidArgument, match="schedule must be one of"):
        Pipeline(model, [one, one], optimizer(), schedule="interleaved")
    with pytest.raises(pw.InvalidArgument, match="microbatches must be a positive integer"):
        Pipeline(model, [one, one], optimizer(), microbatches=0)
    pipe = Pipeline(model, [one, one], optimizer(), microbatches=3)
    with pytest.raises(pw.InvalidArgument, match="place the pipeline's state first"):
        pipe.step(None, next(lm.batches(CONFIG)))
    state = pipe.init(jax.random.key(0))
    with pytest.raises(pw.InvalidArgument, match="a batch of 8 does not split into 3 equal microbatches"):
        pipe.step(state, next(lm.batches(CONFIG)))
