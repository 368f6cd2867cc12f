"""Weak types carried on ``pw.Array`` and through programs (issue #27, item 4), as JAX's type promotion
has them (the rules ``tests/dtypes_test.py`` checks upstream): a value made of a Python scalar is weakly
typed, and a weak value does not widen a narrower one, so a bfloat16 model stays bfloat16. Each
expectation is plain ``jax.jit``'s on the same values, on both layouts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pwmesh as pw

pytestmark = pytest.mark.timeout(180)

X = np.ones(4, dtype=jnp.bfloat16)
mul = jax.jit(lambda a, b: a * b)


def test_a_weak_output_passed_on_keeps_bfloat16(mesh_2x1: pw.Slice) -> None:
    scale = pw.jit(lambda s: s * 2, devices=mesh_2x1)(1.0)  # weak f32, as jax.jit's
    assert scale.weak_type and scale.dtype == np.float32
    assert scale.weak_type == jax.jit(lambda s: s * 2)(1.0).weak_type
    out = pw.jit(lambda a, b: a * b, devices=mesh_2x1)(X, scale)
    assert out.dtype == mul(X, jax.jit(lambda s: s * 2)(1.0)).dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out).astype(np.float32), np.full(4, 2.0))


def test_a_put_python_scalar_or_weak_array_is_weak(mesh_2x1: pw.Slice) -> None:
    for value in (3.0, jnp.array(3.0)):
        put = pw.put(value, mesh_2x1)
        assert put.weak_type
        assert pw.jit(lambda a, b: a * b, devices=mesh_2x1)(X, put).dtype == mul(X, value).dtype == jnp.bfloat16
    strong = pw.put(np.float32(3.0), mesh_2x1)
    assert not strong.weak_type
    assert pw.jit(lambda a, b: a * b, devices=mesh_2x1)(X, strong).dtype == mul(X, np.float32(3.0)).dtype


def test_weak_through_a_program_and_a_reshard(mesh_2x1: pw.Slice) -> None:
    double = pw.jit(lambda s: s * 2, devices=mesh_2x1)

    @pw.program
    def made(s):
        return pw.reshard(double(s), devices=mesh_2x1, spec=P())

    out = made(1.5)
    assert out.weak_type
    assert pw.jit(lambda a, b: a * b, devices=mesh_2x1)(X, out).dtype == jnp.bfloat16
