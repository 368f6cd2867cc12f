"""Names shared by the client, the proxy and the executors."""

from __future__ import annotations

import hashlib

from pwmesh.wire.records import GangRange


def function_id(serialized: bytes, spmd: bool, mesh: list[int] | None = None, axes: list[str] | None = None,
                donate: list[int] | None = None) -> str:
    """A compiled function's id: the hash of its ``jax.export`` bytes and of how it is called (one program
    over a mesh of these axes, or one per device; which inputs it may consume)."""
    how = f"{'spmd' if spmd else ''}|{mesh or []}|{axes or []}|{donate or []}".encode()
    return hashlib.sha256(serialized + how).hexdigest()[:32]


BLOCKWISE = "#blocks@"  # in a function's id: its devices' part alone (``executor/blockwise.py``)


def blockwise_id(fn_id: str, partitions: dict[int, int]) -> str:
    """The id under which an executor runs SPMD function ``fn_id`` by blocks: each device its own part of the
    partitioned program, with no JAX group (derived there from ``fn_id``'s registration). ``partitions``:
    each of the executor's devices (its index there) -> the partition (shard) it runs."""
    return fn_id + BLOCKWISE + ",".join(f"{d}:{p}" for d, p in sorted(partitions.items()))


def parse_blockwise(fn_id: str) -> tuple[str, dict[int, int]] | None:
    """``(fn_id, partitions)`` of a ``blockwise_id``; None for any other id (or a malformed one)."""
    base, found, pairs = fn_id.partition(BLOCKWISE)
    if not found:
        return None
    try:
        return base, {int(d): int(p) for d, _, p in (pair.partition(":") for pair in pairs.split(","))}
    except ValueError:
        return None


def gang_id(devices: list[GangRange]) -> str:
    """A gang's id: the hash of its devices in mesh order, so a slice at one version (the same devices)
    always names the same gang and a remapped one another, with no registry shared by proxies."""
    text = ";".join(f"{r.executor_id}:{r.first}:{r.count}" for r in devices)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
