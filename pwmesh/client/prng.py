"""Typed PRNG keys (``jax.random.key``) on the cluster: a key array travels and is stored as its key data.

A key array's dtype is one of JAX's extended dtypes (``key<fry>``), which neither NumPy nor the wire knows.
So the client keeps two views of a value: the *logical* one the user and JAX see (shape ``(4,)``, dtype
``key<fry>``: a ``pw.Array``, the avals functions are traced with) and the *physical* one everything below
sees (shape ``(4, 2)``, ``uint32``: the program's values, the proxy, the executors' stores). The exported
module takes and returns key data and wraps and unwraps it inside (``physical_function``), so the executors
run it unchanged; a key ``pw.Array`` fetched is wrapped again (``pw.get`` gives a key ``jax.Array``, and
``np.asarray`` refuses it, as JAX's does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy
import numpy as np


def is_key(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key's (``jax.random.key``)."""
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


def dtype_of(dtype: Any) -> Any:
    """``dtype`` as a value's dtype: a key dtype as it is, any other as a NumPy dtype."""
    return dtype if is_key(dtype) else np.dtype(dtype)


def _impl(dtype: Any) -> Any:
    return dtype._impl  # JAX names a key dtype's implementation only privately (its PRNGImpl)


def physical(shape: Sequence[int], dtype: Any) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """The shape and dtype a value has on the wire: a key array's are its key data's."""
    if is_key(dtype):
        return (*shape, *_impl(dtype).key_shape), np.dtype(np.uint32)
    return tuple(shape), np.dtype(dtype)


def logical_shape(shape: Sequence[int], dtype: Any) -> tuple[int, ...]:
    """A key array's shape from its data's (``physical``'s inverse): without the key's own dimensions."""
    return tuple(shape[:len(shape) - len(_impl(dtype).key_shape)])


def physical_aval(aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    if not is_key(aval.dtype):
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
    """``flat_fn`` taking and returning key data where it takes and returns keys (None: it has no key)."""
    keyed_in = [is_key(a.dtype) for a in in_avals]
    keyed_out = [is_key(a.dtype) for a in out_avals]
    if not (any(keyed_in) or any(keyed_out)):
        return None

    def on_data(*args: Any) -> list[Any]:
        keys = [jax.random.wrap_key_data(x, impl=_impl(a.dtype).name) if k else x
                for x, a, k in zip(args, in_avals, keyed_in, strict=True)]
        outs = flat_fn(*keys)
        return [jax.random.key_data(o) if k else o for o, k in zip(outs, keyed_out, strict=True)]

    return on_data


def not_numpy(dtype: Any) -> TypeError:
    return TypeError(f"JAX array with PRNGKey dtype {dtype} cannot be converted to a NumPy array. Use "
                     "jax.random.key_data(arr) if you wish to extract the underlying integer array.")
