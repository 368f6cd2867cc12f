"""Block layouts: a value of ``rows`` leading-axis rows split into ``shards`` equal blocks.

Resharding an M-way value into N ways moves, for every pair of blocks that
overlap, exactly the overlapping rows: producer shard ``i`` sends consumer shard
``j`` the rows both cover. Pure arithmetic, no arrays.
"""

from __future__ import annotations

from typing import NamedTuple

from pwmesh.errors import InvalidArgument


class Piece(NamedTuple):
    """Rows ``[lo, hi)`` of a producer shard go to consumer shard ``dest`` at row ``offset``."""

    dest: int
    lo: int
    hi: int
    offset: int


def check_split(shape: list[int] | tuple[int, ...], shards: int, what: str) -> None:
    """``InvalidArgument`` unless ``shape`` splits into ``shards`` equal blocks along its leading axis."""
    if shards < 1:
        raise InvalidArgument(f"{what}: {shards} shards; a value has at least one")
    if shards == 1:
        return
    if not shape:
        raise InvalidArgument(f"{what}: a scalar cannot be split into {shards} shards")
    if shape[0] % shards:
        raise InvalidArgument(
            f"{what}: shape {tuple(shape)} cannot be split into {shards} equal shards along its leading axis "
            f"({shape[0]} rows is not a multiple of {shards})"
        )


def block(rows: int, shards: int, index: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of shard ``index``."""
    size = rows // shards
    return index * size, (index + 1) * size


def pieces(rows: int, src_shards: int, dst_shards: int, src: int) -> list[Piece]:
    """Where producer shard ``src`` (of ``src_shards``) sends its rows under a ``dst_shards`` layout."""
    start, stop = block(rows, src_shards, src)
    size = rows // dst_shards
    if rows == 0:  # every block is empty; each consumer shard still hears from exactly one producer
        return [Piece(dest, 0, 0, 0) for dest in range(dst_shards) if dest * src_shards // dst_shards == src]
    out = []
    for dest in range(start // size, (stop - 1) // size + 1 if stop > start else start // size):
        lo, hi = max(start, dest * size), min(stop, (dest + 1) * size)
        out.append(Piece(dest, lo - start, hi - start, lo - dest * size))
    return out


def sources(rows: int, src_shards: int, dst_shards: int, dest: int) -> list[int]:
    """The producer shards that send anything to consumer shard ``dest``."""
    if rows == 0:
        return [dest * src_shards // dst_shards]
    size = rows // src_shards
    start, stop = block(rows, dst_shards, dest)
    return list(range(start // size, (stop - 1) // size + 1))
