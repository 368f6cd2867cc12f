"""Sub-byte dtypes (``int4``, ``uint4``, ``int2``, ``uint2``, ``float4_e2m1fn``) on the cluster: a value travels
and is stored in a byte-wide container dtype, each element exact in it.

NumPy holds a sub-byte element in a byte, and so does ``jax.device_put``; an executable compiled ahead of time
for a sharded input (the executors' path) asks for the packed layout instead, and refuses the array put
("compiled for input layouts that disagree"). So, as a typed key array is its data (``client/prng.py``),
everything below the client sees a sub-byte value as its container: the exported module converts on its way in
and out, and a value fetched is converted back.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from ml_dtypes import float8_e4m3fn


def container(dtype: Any) -> np.dtype[Any] | None:
    """The byte-wide dtype a sub-byte ``dtype`` is held in (None: ``dtype`` is a byte or wider)."""
    try:
        dt = np.dtype(dtype)
    except TypeError:  # an extended dtype (a typed key's)
        return None
    if dt.itemsize != 1 or jax.dtypes.itemsize_bits(dt) >= 8:
        return None
    if jnp.issubdtype(dt, jnp.signedinteger):
        return np.dtype(np.int8)
    if jnp.issubdtype(dt, jnp.unsignedinteger):
        return np.dtype(np.uint8)
    return np.dtype(float8_e4m3fn)  # float4_e2m1fn: its every value is one of float8_e4m3fn's


def contained(value: np.ndarray) -> np.ndarray:
    """A host value of a sub-byte dtype in its container (any other as it is)."""
    holder = container(value.dtype)
    return value if holder is None else value.astype(holder)


def released(value: np.ndarray, dtype: Any) -> np.ndarray:
    """A value fetched in its container as ``dtype`` again (``contained``'s inverse)."""
    return value if value.dtype == dtype else value.astype(dtype)
