"""A ``pw.jit`` function called inside another being traced is inlined, as a nested ``jax.jit`` is
(issue #27, item 2): one program, no eager call. Ported from JAX's ``tests/pjit_test.py``, each case
naming its upstream test; values checked against plain JAX, on both layouts of ``test_sharding_constraint``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pwmesh as pw

pytestmark = pytest.mark.timeout(180)


# pjit_test.py: PJitTest.testNested (a constant captured by the nested function, too)
def test_nested(mesh_2x1: pw.Slice) -> None:
    h = jnp.arange(4.0)
    f = pw.jit(lambda x: x.sum() + h.sum(), devices=mesh_2x1, in_specs=P("x", "y"), out_specs=None)
    g = pw.jit(lambda x: f(jnp.sin(x)), devices=mesh_2x1, in_specs=P("x", None), out_specs=None)
    x = np.arange(16.0, dtype=np.float32).reshape(4, 4)
    np.testing.assert_allclose(np.asarray(g(x)), np.sin(x).sum() + np.asarray(h).sum(), rtol=1e-6)
    assert not f._exports, "one program: the inner function was traced into the outer one, never exported alone"


# pjit_test.py: PJitTest.testAutodiff (the gradient through a nested function, taken inside pw.jit)
def test_autodiff_through_a_nested_function(mesh_2x1: pw.Slice) -> None:
    h = jnp.arange(4.0)
    f = pw.jit(lambda x: x.sum(1) * h.sum(), devices=mesh_2x1, in_specs=P("x", "y"), out_specs=P(("x", "y")))
    loss = lambda x: f(jnp.sin(x * 4 + 2)).sum()  # noqa: E731 - as upstream's g, reduced to a scalar
    x = np.arange(16.0, dtype=np.float32).reshape(4, 4) / 100
    want = jax.grad(lambda x: (jnp.sin(x * 4 + 2).sum(1) * h.sum()).sum())(x)
    np.testing.assert_allclose(np.asarray(pw.jit(jax.grad(loss), devices=mesh_2x1)(x)), np.asarray(want), rtol=1e-5)


# Not a port: the inner function's static arguments kept when it is inlined
def test_nested_static_args(mesh_2x1: pw.Slice) -> None:
    inner = pw.jit(lambda x, n: x * n, devices=mesh_2x1, static_argnums=1)
    outer = pw.jit(lambda x: inner(x, 3) + inner(x, 2.5), devices=mesh_2x1)
    x = np.arange(4, dtype=np.int32)
    out = np.asarray(outer(x))
    np.testing.assert_allclose(out, x * 3 + x * 2.5)
    assert out.dtype == np.float32, "3 keeps int32, 2.5 makes float32: as jax.jit"


def test_pmap_inside_a_traced_function_is_refused_clearly(mesh_2x1: pw.Slice) -> None:
    mapped = pw.pmap(lambda v: v + 1, devices=mesh_2x1)
    with pytest.raises(pw.InvalidArgument, match="called while another function is being traced"):
        pw.jit(lambda x: mapped(x), devices=mesh_2x1)(np.ones((2, 3), np.float32))
