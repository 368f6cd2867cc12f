"""Sharding constraints inside ``pw.jit``, ported from JAX's ``tests/pjit_test.py`` (issue #27, item 3).

Each case names the upstream test it follows. Upstream runs them under ``jtu.with_mesh``; here the
mesh is a slice's, and ``pw.jit`` traces under it as ``jax.jit`` traces under ``jax.set_mesh``, so a
bare ``PartitionSpec`` in ``with_sharding_constraint`` (or ``shard_map``) names the slice's axes. The
upstream checks of HLO text and of ``addressable_shards`` are left out (the values live on the
cluster); the values are checked against plain JAX. Both layouts: one executor with two devices, and
two executors of one device each in one JAX group.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.lax import with_sharding_constraint
from jax.sharding import PartitionSpec as P

import pwmesh as pw

pytestmark = pytest.mark.timeout(180)


# pjit_test.py: PJitTest.testShardingConstraintStablehlo
def test_sharding_constraint_stablehlo(mesh_2x1: pw.Slice) -> None:
    def f(x):
        y = x + 1
        y = with_sharding_constraint(y, P("x", "y"))
        return y * 2

    x = np.arange(math.prod((8, 8)), dtype=np.float32).reshape(8, 8)
    np.testing.assert_allclose(np.asarray(pw.jit(f, devices=mesh_2x1, in_specs=P(), out_specs=P())(x)), (x + 1) * 2)


# pjit_test.py: PJitTest.testShardingConstraint (the constraint's spec, not the output's, shards the middle)
def test_sharding_constraint(mesh_2x1: pw.Slice) -> None:
    def f(x):
        y = x + 1
        y = with_sharding_constraint(y, P("x", "y"))
        return y * 2

    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    out = pw.jit(f, devices=mesh_2x1, in_specs=P(), out_specs=P("x"))(x)
    np.testing.assert_allclose(np.asarray(out), (x + 1) * 2)


# pjit_test.py: PJitTest.testShardingConstraintPyTreeWithArray (a list of arrays, one spec for all)
def test_sharding_constraint_pytree(mesh_2x1: pw.Slice) -> None:
    def f(x):
        return with_sharding_constraint(x, P("x", "y"))

    v = np.arange(64, dtype=np.float32).reshape(8, 8)
    out = pw.jit(f, devices=mesh_2x1)([v, v * 2])
    np.testing.assert_array_equal(np.asarray(out[0]), v)
    np.testing.assert_array_equal(np.asarray(out[1]), v * 2)


# pjit_test.py: PJitTest.testShardingConstraintPyTreeVmapWithUnconstrainedDims (values)
def test_sharding_constraint_pytree_vmap_unconstrained_dims(mesh_2x1: pw.Slice) -> None:
    def f(x):
        x = jax.vmap(lambda x: with_sharding_constraint(x, [P(P.UNCONSTRAINED, "y"), P("x", P.UNCONSTRAINED)]))(x)
        x = x.copy()
        x[0]["a"] *= 2
        return x

    v = np.arange(2 * 8 * 8, dtype=np.float32).reshape(2, 8, 8)
    x = [{"a": v, "b": v * 2}, v * 3]
    out = pw.jit(f, devices=mesh_2x1)(x)
    np.testing.assert_allclose(np.asarray(out[0]["a"]), v * 2)
    np.testing.assert_allclose(np.asarray(out[0]["b"]), v * 2)
    np.testing.assert_allclose(np.asarray(out[1]), v * 3)


# pjit_test.py: PJitTest.testGradOfConstraint
def test_grad_of_constraint(mesh_2x1: pw.Slice) -> None:
    h = lambda x: jnp.sin(with_sharding_constraint(x, P("x"))).sum()  # noqa: E731 - as upstream
    x = np.arange(8, dtype=np.float32)
    out = pw.jit(lambda x: jax.grad(h)(x), devices=mesh_2x1)(x)
    np.testing.assert_allclose(np.asarray(out), np.cos(x), rtol=1e-6)


# pjit_test.py: PJitTest.testNoopPartitionSpecs
def test_noop_partition_specs(mesh_2x1: pw.Slice) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 2, 2)
    for spec in [P(), P(None), P(()), P((), None), P(None, None, ())]:
        y = pw.jit(lambda x: x * 2, devices=mesh_2x1, in_specs=spec, out_specs=spec)(x)
        np.testing.assert_allclose(np.asarray(y), x * 2)


# pjit_test.py: PJitTest.testVMapShardingConstraint (values: the constraint inside a vmapped pjit)
def test_vmap_sharding_constraint(mesh_2x1: pw.Slice) -> None:
    x = np.arange(5 * 4, dtype=np.float32).reshape(5, 4)
    out = pw.jit(jax.vmap(lambda r: with_sharding_constraint(r, P("x"))), devices=mesh_2x1)(x)
    np.testing.assert_array_equal(np.asarray(out), x)


# Not a port: shard_map over the slice's axis names, its mesh taken from the context
def test_shard_map_over_the_slices_axes(mesh_2x1: pw.Slice) -> None:
    def f(a):
        return jax.shard_map(lambda b: b * 10 + jax.lax.axis_index("x"), in_specs=P("x"), out_specs=P("x"))(a)

    x = np.arange(8, dtype=np.float32)
    out = pw.jit(f, devices=mesh_2x1, in_specs=P("x"), out_specs=P("x"))(x)
    np.testing.assert_allclose(np.asarray(out), x * 10 + np.repeat([0.0, 1.0], 4))
