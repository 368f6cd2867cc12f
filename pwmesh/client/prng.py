"""Typed PRNG keys (``jax.random.key``) on the cluster: a key array travels and is stored as its key data.

A key array's dtype is one of JAX's extended dtypes (``key<fry>``), which neither NumPy nor the wire knows.
So the client keeps two views of a value: the *logical* one the user and JAX see (shape ``(4,)``, dtype
``key<fry>``: a ``pw.Array``, the avals functions are traced with) and the *physical* one everything below
sees (shape ``(4, 2)``, ``uint32``: the program's values, the proxy, the executors' stores). The exported
module takes and returns key data and wraps and unwraps it inside (``physical_function``), so the executors
run it unchanged; a key ``pw.Array`` fetched is wrapped again (``pw.get`` gives a key ``jax.Array``, and
``np.asarray`` refuses it, as JAX's does). A sub-byte value (``int4``) has two views too: its physical one is
its byte-wide container's (``client/subbyte.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy
import numpy as np

from pwmesh.client import subbyte


def is_key(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key's (``jax.random.key``)."""
    if isinstance(dtype, np.dtype):  # a NumPy dtype (ml_dtypes' too) never is: ~1 us a leaf, every call
        return False
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


def dtype_of(dtype: Any) -> Any:
    """``dtype`` as a value's dtype: a key dtype as it is, any other as a NumPy dtype."""
    return dtype if is_key(dtype) else np.dtype(dtype)


def _impl(dtype: Any) -> Any:
    return dtype._impl  # JAX names a key dtype's implementation only privately (its PRNGImpl)


def repacked(dtype: Any) -> bool:
    """Whether a value of ``dtype`` is another on the wire: a typed key array (its data), a sub-byte one (its
    container)."""
    return is_key(dtype) or subbyte.container(dtype) is not None


def physical(shape: Sequence[int], dtype: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """The shape and dtype a value has on the wire: a key array's are its key data's, a sub-byte value's its
    container's."""
    if is_key(dtype):
        return (*shape, *_impl(dtype).key_shape), np.dtype(np.uint32)
    return tuple(shape), subbyte.container(dtype) or np.dtype(dtype)


def logical_shape(shape: Sequence[int], dtype: Any) -> tuple[int, ...]:
    """A value's shape from its physical one (``physical``'s inverse): a key array's without the key's own
    dimensions."""
    if not is_key(dtype):
        return tuple(shape)
    return tuple(shape[:len(shape) - len(_impl(dtype).key_shape)])


def physical_aval(aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    if not repacked(aval.dtype):
        return aval
    shape, dtype = physical(aval.shape, aval.dtype)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=aval.sharding)


def key_data(value: Any) -> np.ndarray:
    """A host key array's data."""
    return np.asarray(jax.random.key_data(value))


def wrap(data: np.ndarray, dtype: Any) -> jax.Array:
    """The key array of ``dtype`` whose data is ``data`` (on the client's default device)."""
    return jax.random.wrap_key_data(jax.numpy.asarray(data), impl=_impl(dtype).name)


def physical_function(flat_fn: Callable[..., list[Any]], in_avals: Sequence[jax.ShapeDtypeStruct],
                      out_avals: Sequence[jax.ShapeDtypeStruct]) -> Callable[..., list[Any]] | None:
    """``flat_fn`` taking and returning physical values (``physical``) where it takes and returns others: key
    data for keys, containers for sub-byte values (None: it has neither)."""
    if not any(repacked(a.dtype) for a in (*in_avals, *out_avals)):
        return None

    def logical(x: Any, aval: jax.ShapeDtypeStruct) -> Any:
        if is_key(aval.dtype):
            return jax.random.wrap_key_data(x, impl=_impl(aval.dtype).name)
        return x.astype(aval.dtype) if subbyte.container(aval.dtype) is not None else x

    def on_wire(x: Any, aval: jax.ShapeDtypeStruct) -> Any:
        if is_key(aval.dtype):
            return jax.random.key_data(x)
        holder = subbyte.container(aval.dtype)
        return x if holder is None else x.astype(holder)

    def on_data(*args: Any) -> list[Any]:
        outs = flat_fn(*[logical(x, a) for x, a in zip(args, in_avals, strict=True)])
        return [on_wire(o, a) for o, a in zip(outs, out_avals, strict=True)]

    return on_data


def not_numpy(dtype: Any) -> TypeError:
    return TypeError(f"JAX array with PRNGKey dtype {dtype} cannot be converted to a NumPy array. Use "
                     "jax.random.key_data(arr) if you wish to extract the underlying integer array.")
