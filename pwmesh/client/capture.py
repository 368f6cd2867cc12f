"""``pw.Array``s a traced function closes over become inputs of its computation.

In ``jax.jit`` a ``jax.Array`` closed over is a constant of the computation. A ``pw.Array`` lives on
the cluster, so it cannot be baked into the exported module; it is passed in, as an argument the
function did not name. ``pw.jit`` traces a new signature with every ``pw.Array`` it touches standing
for zeros of its shape (``discover``); if it touched any, it traces it once more with them as extra
inputs (``lifted``), each standing for its own input's tracer. As with JAX's constants, what a function
closed over is fixed when it is traced: rebinding the name later is not seen by that signature's later
calls.

The hook is ``pw.Array.__jax_array__`` (``as_jax``), which JAX calls where an operator meets one
(``x + w``, ``w @ x``, ``jnp.asarray(w)``); JAX's own functions given one directly (``jnp.sin(w)``)
refuse it, as they refuse any ``__jax_array__`` object, saying to convert it first. Outside any
trace, a ``pw.Array`` converts to its value.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax.numpy as jnp

from pwmesh.errors import InvalidArgument

T = TypeVar("T")

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


def discover(trace: Callable[[], T]) -> tuple[list[Any], T]:
    """Run ``trace`` (one abstract trace of a function) with every ``pw.Array`` it touches standing for zeros of
    its shape: the arrays, in the order it first touched them, and what ``trace`` returned."""
    found: dict[int, Any] = {}

    def record(array: Any) -> Any:
        found.setdefault(id(array), array)
        return jnp.zeros(array.shape, array.dtype)

    token = _standing_for.set(record)
    try:
        result = trace()
    finally:
        _standing_for.reset(token)
    return list(found.values()), result


def lifted(fn: Callable[..., Any], captured: Sequence[Any]) -> Callable[..., Any]:
    """``fn`` taking the arrays it closes over as its last arguments."""
    ids = [id(a) for a in captured]

    def with_inputs(*flat: Any) -> Any:
        own = len(flat) - len(ids)
        values = dict(zip(ids, flat[own:], strict=True))

        def standing_for(array: Any) -> Any:
            try:
                return values[id(array)]
            except KeyError:
                raise InvalidArgument("a pw.Array the function closes over was not touched when it was first "
                                      "traced (it depends on a value): pass it as an argument") from None

        token = _standing_for.set(standing_for)
        try:
            return fn(*flat[:own])
        finally:
            _standing_for.reset(token)

    return with_inputs
