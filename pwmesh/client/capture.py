"""``pw.Array``s a traced function closes over become inputs of its computation.

In ``jax.jit`` a ``jax.Array`` closed over is a constant of the computation. A ``pw.Array`` lives on
the cluster, so it cannot be baked into the exported module; it is passed in, as an argument the
function did not name. ``pw.jit`` traces a new signature once, with every ``pw.Array`` it touches standing
for a value of an enclosing trace (``standing_in``), which the function's jaxpr then takes as an input, as
it takes any enclosing trace's value it closes over. As with JAX's constants, what a function closed over
is fixed when it is traced: rebinding the name later is not seen by that signature's later calls.

The hook is ``pw.Array.__jax_array__`` (``as_jax``), which JAX calls where an operator meets one
(``x + w``, ``w @ x``, ``jnp.asarray(w)``); JAX's own functions given one directly (``jnp.sin(w)``)
refuse it, as they refuse any ``__jax_array__`` object, saying to convert it first. Outside any
trace, a ``pw.Array`` converts to its value.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core
from jax._src.lax import lax as lax_internal

from pwmesh.client.array import Array, use_capture

T = TypeVar("T")


def _aval(array: Array) -> jax_core.ShapedArray:
    return jax_core.ShapedArray(array.shape, array.dtype, weak_type=array.weak_type)


# What JAX's abstractification (``jax.typeof``, ``jax.ShapeDtypeStruct.like``) makes of a pw.Array: its shape,
# dtype and weak type, as of a jax.Array (JAX has no public registry for array types). Where JAX goes on to read
# its sharding (``jax.jit(f)(w)``, ``jax.eval_shape(f, w)``), ``pw.Array.format`` refuses it first.
jax_core.pytype_aval_mappings[Array] = _aval

# What a pw.Array becomes in the trace under way: None outside one (its value).
_standing_for: contextvars.ContextVar[Callable[[Any], Any] | None] = contextvars.ContextVar(
    "pwmesh_capture", default=None)


def active() -> bool:
    """Whether ``pw.jit`` is tracing a function here (a ``pw.Array`` then stands for an input of it)."""
    return _standing_for.get() is not None


def as_jax(array: Any) -> Any:
    """``array`` (a ``pw.Array``) as JAX meets it: an input's tracer while ``pw.jit`` traces, else its value."""
    standing_for = _standing_for.get()
    if standing_for is None:
        return jnp.asarray(array.value())
    return standing_for(array)


def standing_in(trace: Callable[[], T]) -> tuple[list[Any], list[Any], T]:
    """Run ``trace`` (one abstract trace of a function, ``jax.jit(fn).trace``) with every ``pw.Array`` it touches
    standing for a value of an enclosing trace: the trace closes over that value as it closes over any
    enclosing trace's (its jaxpr takes each as an input: ``Traced._consts``), so it runs once and the arrays
    become inputs, without a second trace. The arrays, in the order it first touched them, what stood for
    each (the same order), and what ``trace`` returned."""
    found: dict[int, tuple[Any, Any]] = {}
    result: list[T] = []

    def enclosing() -> list[Any]:
        outer = jax_core.trace_ctx.trace  # JAX names the trace under way only privately

        def stand_in(array: Any) -> Any:
            if id(array) not in found:
                with jax_core.set_current_trace(outer):  # a value of the enclosing trace, made in no other
                    found[id(array)] = (array, placeholder(array.shape, array.dtype, array.weak_type))
            return found[id(array)][1]

        token = _standing_for.set(stand_in)
        try:
            result.append(trace())
        finally:
            _standing_for.reset(token)
        return []

    jax.make_jaxpr(enclosing)()
    return [a for a, _ in found.values()], [s for _, s in found.values()], result[0]


def placeholder(shape: tuple[int, ...], dtype: Any, weak: bool = False) -> Any:
    """Zeros of ``shape`` and ``dtype`` (a typed key's too): inside a trace, a value of it."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(jnp.zeros((*shape, *dtype._impl.key_shape), jnp.uint32),
                                        impl=dtype._impl.name)
    zeros = jnp.zeros(shape, dtype)
    # Weakly typed as the array is (a bfloat16 value times it stays bfloat16): JAX has no public way to say so.
    return lax_internal._convert_element_type(zeros, np.dtype(dtype), weak_type=True) if weak else zeros


use_capture(as_jax)
