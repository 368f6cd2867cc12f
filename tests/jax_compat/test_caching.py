"""Caching as ``jax.jit`` caches (issue #27, item 5, in part), ported from JAX's ``tests/pjit_test.py``: a
new ``pw.jit`` wrapper of the same function, on a slice of the same mesh with the same specs, finds the
function already exported (``jax.jit(f)(x)`` in a loop costs a lookup, not an export), on both layouts.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pwmesh as pw

pytestmark = pytest.mark.timeout(180)


# pjit_test.py: PJitTest.testCaching (the body is not traced again by a new wrapper)
def test_caching(mesh_2x1: pw.Slice) -> None:
    should_be_tracing = True

    def f(x):
        assert should_be_tracing
        return jnp.sin(x) * 2

    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    first = pw.jit(f, devices=mesh_2x1, in_specs=P(("x", "y")), out_specs=None)(x)
    should_be_tracing = False
    again = pw.jit(f, devices=mesh_2x1, in_specs=P(("x", "y")), out_specs=None)(x)
    np.testing.assert_allclose(np.asarray(again), np.asarray(first))
    np.testing.assert_allclose(np.asarray(first), np.sin(x) * 2, rtol=1e-6)


def test_another_convention_or_function_exports_anew(mesh_2x1: pw.Slice) -> None:
    def f(x):
        return x * 3

    a = pw.jit(f, devices=mesh_2x1, in_specs=P("x"))
    b = pw.jit(f, devices=mesh_2x1, in_specs=P())  # another convention: its own exports
    c = pw.jit(lambda x: x * 3, devices=mesh_2x1, in_specs=P("x"))  # another function object
    x = np.arange(4, dtype=np.float32)
    for w in (a, b, c):
        np.testing.assert_allclose(np.asarray(w(x)), x * 3)
    assert a._exports is pw.jit(f, devices=mesh_2x1, in_specs=P("x"))._exports
    assert a._exports is not b._exports and a._exports is not c._exports


# Not a port (item 5): the Python body runs once per signature, counted by its side effect, on a mesh where the
# outputs' shardings are XLA's choice (asked by compiling once more) and for a function closing over a pw.Array
def test_body_runs_once_per_signature(mesh_2x2: pw.Slice) -> None:
    side = []
    w = pw.put(np.arange(8, dtype=np.float32).reshape(4, 2), mesh_2x2, P("x"))

    def f(x):
        side.append(None)
        return {"y": x @ w, "z": jnp.sin(x)}

    x = np.ones((3, 4), np.float32)
    for _ in range(3):
        out = pw.jit(f, devices=mesh_2x2)(x)
    np.testing.assert_allclose(np.asarray(out["y"]), x @ np.asarray(w))
    assert len(side) == 1  # closing over a pw.Array: traced once all the same, with it as an input (capture.py)
    pw.jit(lambda x: f(x), devices=mesh_2x2)(np.ones((5, 4), np.float32))  # noqa: PLW0108
    assert len(side) == 2
    g = pw.jit(lambda x: side.append(None) or x * 2, devices=mesh_2x2)
    g(x)
    g(x + 1)
    g(np.ones(8, np.float32))
    assert len(side) == 4
