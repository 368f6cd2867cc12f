"""``pw.Array``'s operators, indexing and conversions, as ``jax.Array`` has them.

An operator (``a + b``, ``a @ w``, ``a < 3``, ``-a``), an index (``a[2:4, 0]``, ``a[ids]``) or ``astype``
runs the ``jax.numpy`` operation as a computation on the array's slice: a ``pw.jit`` of it, one per
operation and slice, so each signature is traced and exported once. The result is a ``pw.Array`` future
there, laid out as XLA's propagation chooses, as ``jax.jit``'s output is. Scalar conversions
(``float(a)``, ``int(a)``, ``bool(a)``, ``operator.index(a)``, ``a.item()``) fetch the value.

While ``pw.jit`` traces a function closing over a ``pw.Array``, the array stands for its input there
(``pwmesh.client.capture``), and its operators are JAX's on that input: part of the one program.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from pwmesh.client import array, capture
from pwmesh.client.array import Array
from pwmesh.client.devices import Slice
from pwmesh.client.functions import JitFunction, jit

# A function per (slice, operation): its traces and exports serve every later call.
_jitted: weakref.WeakKeyDictionary[Slice, dict[Any, JitFunction]] = weakref.WeakKeyDictionary()

_OPERANDS = (Array, np.ndarray, np.generic, jax.Array, int, float, complex)


def _on(sl: Slice, key: Any, make: Callable[[Slice], JitFunction]) -> JitFunction:
    per_slice = _jitted.setdefault(sl, {})
    found = per_slice.get(key)
    if found is None:
        found = per_slice.setdefault(key, make(sl))
    return found


def binary(op: Callable[[Any, Any], Any], x: Array, y: Any, reflected: bool = False) -> Any:
    """``op(x, y)`` (``op(y, x)`` when ``reflected``) on ``x``'s slice; ``NotImplemented`` for an operand
    that is no array (Python then tries the other side, as it does for ``jax.Array``). A tracer's own
    operator takes a ``pw.Array`` closed over, within its trace."""
    if not isinstance(y, _OPERANDS) or isinstance(y, jax.core.Tracer):
        return NotImplemented
    if capture.active():
        a, b = x.__jax_array__(), (y.__jax_array__() if isinstance(y, Array) else y)
        return op(b, a) if reflected else op(a, b)
    f = _on(x.sharding.slice, op, lambda sl: jit(op, devices=sl))
    return f(y, x) if reflected else f(x, y)


def unary(op: Callable[[Any], Any], x: Array) -> Any:
    if capture.active():
        return op(x.__jax_array__())
    return _on(x.sharding.slice, op, lambda sl: jit(op, devices=sl))(x)


def _astype(x: Any, dtype: Any) -> Any:
    return x.astype(dtype)


def astype(x: Array, dtype: Any) -> Any:
    """``x`` converted to ``dtype`` on its devices (canonicalized as ``jax.Array.astype`` does)."""
    if capture.active():
        return x.__jax_array__().astype(dtype)
    f = _on(x.sharding.slice, _astype, lambda sl: jit(_astype, devices=sl, static_argnums=1))
    return f(x, np.dtype(dtype))


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (Array, np.ndarray, jax.Array))


def _call_method(x: Any, *arrays: Any, name: str, tree: Any, statics: tuple[Any, ...]) -> Any:
    if tree is None:  # a property (``x.T``)
        return getattr(x, name)
    given = iter(arrays)
    leaves = [next(given) if s is _ARRAY else s[1] for s in statics]
    args, kwargs = jax.tree_util.tree_unflatten(tree, leaves)
    return getattr(x, name)(*args, **kwargs)


_ARRAY = ("array",)  # where a method's argument leaf is an array: an input of the computation


def method(name: str, x: Array, args: tuple[Any, ...] | None, kwargs: dict[str, Any]) -> Any:
    """``x.name(*args, **kwargs)`` (``args`` None: the property ``x.name``) as ``jax.Array``'s does it, on
    ``x``'s slice: array arguments are inputs, any other is static (keyed with its type, as ``jax.jit``'s
    static arguments)."""
    if capture.active():
        attr = getattr(x.__jax_array__(), name)
        return attr if args is None else attr(*args, **kwargs)
    if args is None:
        f = _on(x.sharding.slice, _call_method,
                lambda sl: jit(_call_method, devices=sl, static_argnames=("name", "tree", "statics")))
        return f(x, name=name, tree=None, statics=())
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    statics = tuple(_ARRAY if _is_array(leaf) else (type(leaf), leaf) for leaf in leaves)
    arrays = [leaf for leaf in leaves if _is_array(leaf)]
    f = _on(x.sharding.slice, _call_method,
            lambda sl: jit(_call_method, devices=sl, static_argnames=("name", "tree", "statics")))
    return f(x, *arrays, name=name, tree=tree, statics=statics)


def _index_key(index: Any) -> tuple[tuple[tuple[Any, ...], ...], list[Any]]:
    """An index as a hashable description (slices, integers, ``None``, ``...``) and its array parts,
    which are the computation's inputs."""
    parts = index if isinstance(index, tuple) else (index,)
    key: list[tuple[Any, ...]] = []
    arrays: list[Any] = []
    for part in parts:
        if isinstance(part, slice):
            key.append(("slice", part.start, part.stop, part.step))
        elif part is None or part is Ellipsis or (isinstance(part, (int, np.integer)) and not isinstance(part, bool)):
            key.append(("at", part))
        else:
            key.append(("array",))
            arrays.append(part)
    return tuple(key), arrays


def _index_of(key: tuple[tuple[Any, ...], ...], arrays: tuple[Any, ...]) -> tuple[Any, ...]:
    given = iter(arrays)
    out: list[Any] = []
    for part in key:
        if part[0] == "slice":
            out.append(slice(*part[1:]))
        elif part[0] == "at":
            out.append(part[1])
        else:
            out.append(next(given))
    return tuple(out)


def _take(x: Any, *arrays: Any, index: tuple[tuple[Any, ...], ...]) -> Any:
    return x[_index_of(index, arrays)]


def getitem(x: Array, index: Any) -> Any:
    """``x[index]``, as ``jax.Array`` indexes (basic and advanced indexing; out-of-range gathers clamp)."""
    if capture.active():
        return x.__jax_array__()[index]
    key, arrays = _index_key(index)
    f = _on(x.sharding.slice, _take, lambda sl: jit(_take, devices=sl, static_argnames="index"))
    return f(x, *arrays, index=key)


def rows(x: Array) -> Any:
    """``iter(x)``: its rows, each a ``pw.Array``, as iterating a ``jax.Array`` gives."""
    if not x.shape:
        raise TypeError("iteration over a 0-d array")  # as jax.Array's
    return (getitem(x, i) for i in range(x.shape[0]))


array.use_operations(sys.modules[__name__])
