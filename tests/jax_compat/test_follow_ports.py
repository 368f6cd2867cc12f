"""``pw.jit`` without ``devices=`` runs where its arguments are, as ``jax.jit`` follows its committed
arguments; ``pw.device_put(x, pw.NamedSharding(slice, spec))`` is ``jax.device_put(x, NamedSharding(mesh,
spec))`` (issue #27, item 8: JAX code then needs only its names changed). Cases from JAX's
``tests/api_test.py``, each named above its port, on both layouts (``conftest.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pwmesh as pw

pytestmark = pytest.mark.timeout(180)


# upstream: APITest.test_jit_on_all_devices / computation follows data: a committed argument decides where
def test_a_jit_without_devices_runs_where_its_arguments_are(mesh_2x1: pw.Slice) -> None:
    x = pw.device_put(np.arange(4, dtype=np.float32), pw.NamedSharding(mesh_2x1, P("x")))
    f = pw.jit(lambda v: v * 2 + 1)
    y = f(x)
    assert y.sharding.slice is mesh_2x1
    np.testing.assert_array_equal(np.asarray(y), np.arange(4) * 2 + 1)
    np.testing.assert_array_equal(np.asarray(f(y)), (np.arange(4) * 2 + 1) * 2 + 1)  # compiled once for the slice


# upstream: APITest.test_jit_with_incompatible_devices ("Received incompatible devices for jitted computation")
def test_arguments_on_two_slices_are_refused(layout_2x1: tuple[pw.Client, pw.Slice]) -> None:
    client, sl = layout_2x1
    other = client.make_virtual_device_set().add_slice(devices=1)
    a = pw.put(np.ones(2, np.float32), sl, P("x"))
    b = pw.put(np.ones(2, np.float32), other)
    with pytest.raises(ValueError, match="on 2 slices"):
        pw.jit(jnp.add)(a, b)


# pwmesh's own: with no pw.Array argument there is no slice to follow (jax.jit would use its default device)
def test_host_arguments_alone_ask_for_devices(mesh_2x1: pw.Slice) -> None:
    with pytest.raises(ValueError, match="give devices="):
        pw.jit(lambda v: v + 1)(np.ones(2, np.float32))


# upstream: APITest.test_device_put_sharding (a sharding as the second argument), and the tree form
def test_device_put_with_a_named_sharding(mesh_2x1: pw.Slice) -> None:
    s = pw.NamedSharding(mesh_2x1, P("x"))
    tree = {"a": np.arange(4, dtype=np.float32), "b": np.ones((2, 2), np.float32)}
    out = pw.device_put(tree, s)
    assert out["a"].sharding == s and out["b"].sharding == s
    np.testing.assert_array_equal(np.asarray(out["a"]), tree["a"])
    assert pw.device_put(out["a"], s) is out["a"]  # laid out so already: itself
    moved = pw.device_put(out["b"], pw.NamedSharding(mesh_2x1, P(None, "x")))  # laid out otherwise: resharded
    assert moved.sharding == pw.NamedSharding(mesh_2x1, P(None, "x"))
    np.testing.assert_array_equal(np.asarray(moved), tree["b"])


# upstream: APITest.test_jit_decorator_factory... as a decorator, without devices=
def test_a_decorated_jit_without_devices(mesh_2x1: pw.Slice) -> None:
    @pw.jit(static_argnums=1)
    def f(v: jax.Array, k: int) -> jax.Array:
        return v * k

    x = pw.put(np.arange(2, dtype=np.float32), mesh_2x1, P("x"))
    np.testing.assert_array_equal(np.asarray(f(x, 3)), [0.0, 3.0])
