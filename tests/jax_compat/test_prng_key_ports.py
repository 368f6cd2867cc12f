"""Typed PRNG keys (``jax.random.key``) in and out of ``pw.jit``, stored, fetched and passed on (issue #27,
item 4): cases ported from JAX's ``tests/random_test.py``, class ``KeyArrayTest`` (each upstream test named
above its port), with ``jax.jit`` -> ``pw.jit`` and ``jax.device_put`` -> ``pw.put``. Each expectation is
plain JAX's on the same keys, on both layouts (``conftest.py``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import pwmesh as pw

pytestmark = pytest.mark.timeout(180)


def make_keys(*shape: int, seed: int = 28) -> Any:
    seeds = seed + jnp.arange(math.prod(shape), dtype=jnp.uint32)
    return jax.vmap(jax.random.key)(seeds).reshape(shape)


def assert_keys_equal(got: Any, want: Any) -> None:
    got = pw.get(got) if isinstance(got, pw.Array) else got
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(got)), np.asarray(jax.random.key_data(want)))


# upstream: KeyArrayTest.test_dtype_property
def test_dtype_property(mesh_2x1: pw.Slice) -> None:
    k1 = make_keys()
    seen = []

    def f(k: Any) -> Any:
        seen.append(k.dtype)
        return jax.random.split(k)

    out = pw.jit(f, devices=mesh_2x1)(k1)
    assert seen[0] == k1.dtype and out.dtype == k1.dtype and out.shape == (2,)


# upstream: KeyArrayTest.test_isinstance
def test_a_key_result_is_a_key_array(mesh_2x1: pw.Slice) -> None:
    out = pw.jit(lambda k: k, devices=mesh_2x1)(make_keys())
    assert jax.dtypes.issubdtype(out.dtype, jax.dtypes.prng_key)
    assert isinstance(pw.get(out), jax.Array) and jax.dtypes.issubdtype(pw.get(out).dtype, jax.dtypes.prng_key)


# upstream: KeyArrayTest.test_cpp_dispatch_split (keys in and out, called twice)
def test_split_twice(mesh_2x1: pw.Slice) -> None:
    f = pw.jit(jax.random.split, devices=mesh_2x1)
    key = make_keys()
    assert_keys_equal(f(key), jax.jit(jax.random.split)(key))
    assert_keys_equal(f(key), jax.random.split(key))


# upstream: KeyArrayTest.test_cpp_dispatch_normal, and a key output passed on to another call
def test_a_key_output_passed_on(mesh_2x1: pw.Slice) -> None:
    def step(key: Any) -> Any:
        key, sub = jax.random.split(key)
        return key, jax.random.normal(sub, (4,))

    f, g = pw.jit(step, devices=mesh_2x1), jax.jit(step)
    key, x = f(make_keys())
    key, y = f(key)
    want_key, want_x = g(make_keys())
    want_key, want_y = g(want_key)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(want_x))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want_y))
    assert_keys_equal(key, want_key)


# upstream: KeyArrayTest.test_scan_lowering
def test_scan_lowering(mesh_2x1: pw.Slice) -> None:
    ks = make_keys(3, 4)
    _, out = pw.jit(lambda ks: lax.scan(lambda _, k: (None, k.T), None, ks), devices=mesh_2x1)(ks)
    assert out.shape == (3, 4)
    assert_keys_equal(out, ks)


# upstream: KeyArrayTest.test_slice, test_transpose, test_gather
@pytest.mark.parametrize("fn, shape", [(lambda x: lax.slice_in_dim(x, 1, 3), (2, 4)), (lambda x: x.T, (4, 3)),
                                       (lambda x: x[1], (4,))], ids=["slice", "transpose", "gather"])
def test_key_array_operations(mesh_2x1: pw.Slice, fn: Any, shape: tuple[int, ...]) -> None:
    ks = make_keys(3, 4)
    ys = pw.jit(fn, devices=mesh_2x1)(ks)
    assert ys.shape == shape
    assert_keys_equal(ys, jax.jit(fn)(ks))


# upstream: KeyArrayTest.test_select
def test_select(mesh_2x1: pw.Slice) -> None:
    ks = make_keys(3, 2)
    cs = jnp.array([True, False, False, True, False, True]).reshape(3, 2)
    ys = pw.jit(lax.select, devices=mesh_2x1)(cs, ks, ks)
    assert ys.shape == (3, 2)
    assert_keys_equal(ys, ks)


# upstream: KeyArrayTest.test_device_put
def test_device_put(mesh_2x1: pw.Slice) -> None:
    keys = make_keys(4)
    put = pw.put(keys, mesh_2x1)
    assert put.dtype == keys.dtype and put.shape == (4,)
    assert_keys_equal(put, keys)


# upstream: KeyArrayTest.test_device_put_sharded (a key array split over the mesh, then used there)
def test_device_put_sharded(mesh_2x2: pw.Slice) -> None:
    keys = make_keys(4)
    put = pw.put(keys, mesh_2x2, P(("x", "y")))
    assert_keys_equal(put, keys)
    draws = pw.jit(jax.vmap(lambda k: jax.random.uniform(k)), devices=mesh_2x2, in_specs=P(("x", "y")))(put)
    np.testing.assert_array_equal(np.asarray(draws), np.asarray(jax.vmap(lambda k: jax.random.uniform(k))(keys)))


# upstream: random_test's typed keys are not NumPy arrays: np.asarray refuses them, naming key_data
def test_a_key_array_is_not_a_numpy_array(mesh_2x1: pw.Slice) -> None:
    out = pw.jit(lambda k: k, devices=mesh_2x1)(make_keys())
    with pytest.raises(TypeError, match="key_data"):
        np.asarray(out)


# pwmesh's own: a dropped key array is declared to a restarted proxy as it lives on the wire, its data
def test_a_dropped_key_array_is_declared_as_its_data(mesh_2x1: pw.Slice) -> None:
    put = pw.put(make_keys(4), mesh_2x1, P("x"))
    buffer_id = put.buffer_id
    del put
    declared = mesh_2x1.session._declare()  # what a resume would send (``ClientConnection.declare``)
    (gone,) = [r for r in declared.released if r.buffer == buffer_id]
    assert (gone.spec.shape, gone.spec.dtype) == ([4, 2], "uint32")
