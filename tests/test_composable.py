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
