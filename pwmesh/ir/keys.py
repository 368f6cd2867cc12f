"""Names shared by the client, the proxy and the executors."""

from __future__ import annotations

import hashlib


def function_id(serialized: bytes, spmd: bool) -> str:
    """A compiled function's id: the hash of its ``jax.export`` bytes (and calling convention)."""
    return hashlib.sha256(serialized + (b"spmd" if spmd else b"")).hexdigest()[:32]
