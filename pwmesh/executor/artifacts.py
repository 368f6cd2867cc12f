"""A registered function's artifact: read and checked before anything compiles it (issue #26 item 3).

Executors read each new function here, and with a sandbox (``executor.sandbox``) a child process reads
it here first: this module imports JAX and nothing of pwmesh's but its errors.
"""

from __future__ import annotations

import re

from jax import export
from jax._src.export import _export  # the custom calls JAX guarantees stable (no public name)

from pwmesh.errors import InvalidArgument

# The custom calls a registered function may make: those ``jax.export`` guarantees stable (LAPACK,
# cuSOLVER and the like, sharding markers), and never a host callback. JAX checks this when it exports,
# not when it deserializes: an artifact edited to call ``xla_ffi_python_cpu_callback`` crashed an
# executor, losing every tenant's buffers on it.
ALLOWED_CUSTOM_CALLS = frozenset(
    t for t in getattr(_export, "_CUSTOM_CALL_TARGETS_GUARANTEED_STABLE", ()) if "callback" not in t)
_CUSTOM_CALL = re.compile(r'custom_call\s*@([\w.$-]+)|call_target_name\s*=\s*"([^"]*)"')


def custom_calls(exported: export.Exported) -> set[str]:
    """Every custom-call target ``exported``'s module names."""
    return {a or b for a, b in _CUSTOM_CALL.findall(exported.mlir_module())}


def read(fn_id: str, serialized: bytes) -> export.Exported:
    """A registered function's artifact, deserialized and checked (``InvalidArgument`` if it cannot be
    read here, or calls what executors do not run)."""
    try:
        exported = export.deserialize(bytearray(serialized))
    except Exception as exc:  # e.g. exported by a JAX this executor cannot read
        raise InvalidArgument(f"function {fn_id[:12]} cannot be loaded here: {type(exc).__name__}: {exc}") from None
    refused = sorted(custom_calls(exported) - ALLOWED_CUSTOM_CALLS)
    if refused:
        raise InvalidArgument(f"function {fn_id[:12]} makes custom calls executors do not run: {', '.join(refused)} "
                              "(only those jax.export guarantees stable; never a host callback)")
    return exported
