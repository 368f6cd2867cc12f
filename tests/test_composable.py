"""A ``pw.Array`` closed over by a ``pw.jit`` function is an input of its computation (issue #27, item 2), as a
``jax.Array`` closed over is a constant of ``jax.jit``'s: it is passed in, never fetched or baked in.
How: ``pwmesh.client.capture``."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pwmesh as pw
from pwmesh.cli.commands import fetch_status

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def grid() -> Iterator[tuple[pw.Client, pw.Slice]]:
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=1, devices_per_host=2)
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address, name="composable") as client:
        yield client, client.make_virtual_device_set().add_slice(devices=2)


def test_a_closed_over_array_is_an_input_not_a_fetched_constant(grid: tuple[pw.Client, pw.Slice]) -> None:
    client, sl = grid
    w = client.put(np.arange(8, dtype=np.float32), sl, P("x"))
    f = pw.jit(lambda x: x * 2 + w, devices=sl, in_specs=P("x"), out_specs=P("x"))
    x = np.ones(8, np.float32)
    np.testing.assert_allclose(np.asarray(f(x)), x * 2 + np.arange(8))
    assert w._value is None, "never fetched to the client: it was read on the cluster"
    (exported,) = f._exports.values()
    assert len(exported.in_specs) == 2, "exported with the array as its second input"
    np.testing.assert_allclose(np.asarray(f(x * 3)), x * 6 + np.arange(8))  # the same export, the same array


def test_the_reflected_operator_and_a_gradient_with_closed_over_weights(grid: tuple[pw.Client, pw.Slice]) -> None:
    client, sl = grid
    w = client.put(np.full((2, 4), 0.5, np.float32), sl, P("x"))
    loss = lambda x: jnp.sum((w @ x) ** 2)  # noqa: E731 - the array on the left: its __matmul__ is JAX's
    x = np.arange(4, dtype=np.float32)
    got = pw.jit(jax.grad(loss), devices=sl)(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.grad(lambda x: jnp.sum((jnp.full((2, 4), 0.5) @ x) ** 2))(x)))


def test_inside_a_program_and_in_status(grid: tuple[pw.Client, pw.Slice]) -> None:
    client, sl = grid
    bias = client.put(np.full(8, 10.0, np.float32), sl, P("x"))
    add = pw.jit(lambda x: x + bias, devices=sl, in_specs=P("x"), out_specs=P("x"))

    @pw.program
    def twice(x):
        return add(add(x))

    np.testing.assert_allclose(np.asarray(twice(np.zeros(8, np.float32))), np.full(8, 20.0))
    assert fetch_status(client.address).sessions  # the cluster still serves


def test_jax_refuses_its_own_functions_given_one_directly(grid: tuple[pw.Client, pw.Slice]) -> None:
    """As for any ``__jax_array__`` object: ``jnp.sin(w)`` is refused saying to convert it first."""
    client, sl = grid
    w = client.put(np.zeros(8, np.float32), sl, P("x"))
    with pytest.raises(ValueError, match="__jax_array__"):
        pw.jit(lambda x: x + jnp.sin(w), devices=sl)(np.zeros(8, np.float32))
    out = pw.jit(lambda x: x + jnp.sin(jnp.asarray(w)), devices=sl)(np.ones(8, np.float32))
    np.testing.assert_allclose(np.asarray(out), np.ones(8))


def test_traced_once_closing_over_arrays_of_every_kind(grid: tuple[pw.Client, pw.Slice]) -> None:
    """The body runs once per signature however many ``pw.Array``s it closes over, and each keeps its type in
    the trace: a weak one (a bfloat16 value times it stays bfloat16), a typed key, an int4 one, one read in a
    branch only, one closed over by a function inlined into another."""
    client, sl = grid
    weak = client.put(jnp.array(2.0), sl)
    key = client.put(jax.random.key(7), sl)
    small = client.put(np.array([1, -2, 3, -4], jnp.int4), sl)
    branch = client.put(np.full(4, 5.0, np.float32), sl)
    inner_w = client.put(np.full(4, 0.5, np.float32), sl)
    assert weak.weak_type
    runs = []
    inner = pw.jit(lambda x: x * inner_w, devices=sl)

    def f(x, flag):
        runs.append(None)
        noise = jax.random.normal(jnp.asarray(key), (4,), jnp.bfloat16)  # JAX's functions take it converted
        picked = jax.lax.cond(flag, lambda: branch.astype(jnp.bfloat16), lambda: jnp.zeros(4, jnp.bfloat16))
        return x * weak + noise + picked + small.astype(jnp.bfloat16), inner(x)

    g = pw.jit(f, devices=sl)
    x = jnp.ones(4, jnp.bfloat16)
    for flag in (True, False, True):
        out, scaled = g(x, flag)
    assert len(runs) == 1, "one signature, one trace (the closed-over arrays found in it, not by tracing again)"
    assert out.dtype == jnp.bfloat16, "the weak array kept bfloat16, as a weak jax.Array does"
    want = (x * 2.0 + jax.random.normal(jax.random.key(7), (4,), jnp.bfloat16) + jnp.full(4, 5.0, jnp.bfloat16)
            + jnp.array([1, -2, 3, -4], jnp.bfloat16))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32))
    np.testing.assert_allclose(np.asarray(scaled, np.float32), np.full(4, 0.5))
    g(x * 2, False)
    assert len(runs) == 1, "the same signature again: no trace"
    assert all(a._value is None for a in (weak, branch, inner_w)), "read on the cluster, never fetched"


def test_jax_functions_outside_any_trace_refuse_one_clearly(grid: tuple[pw.Client, pw.Slice]) -> None:
    """Outside any trace too, JAX's functions and ``jax.jit`` given a ``pw.Array`` refuse it naming the
    conversions (its type, ``jax.ShapeDtypeStruct.like(w)``, is known to JAX: ``jax.typeof`` gives it)."""
    client, sl = grid
    w = client.put(np.zeros(4, np.float32), sl, P("x"))
    for call in (lambda: jnp.sin(w), lambda: jax.jit(lambda v: v)(w)):
        with pytest.raises(pw.InvalidArgument, match=r"__jax_array__.*jnp.asarray\(w\)"):
            call()
    assert jax.typeof(w).shape == (4,)
    out = jax.eval_shape(lambda v: v.sum(), jax.ShapeDtypeStruct.like(w))
    assert (out.shape, out.dtype) == ((), np.float32)
    assert w._value is None
