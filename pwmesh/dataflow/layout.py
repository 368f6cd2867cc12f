"""Layouts: how a value's global array is cut into per-device blocks over a slice's mesh.

A value lives on the devices of one slice, which the client sees as a logical mesh:
axis sizes, devices in row-major order (as ``jax.sharding.Mesh`` over
``devices.reshape(sizes)``). Its *spec* says, per array dimension, which mesh axes
split that dimension, major to minor (a ``PartitionSpec`` with the axis names turned
into indices); the mesh axes that split nothing replicate it. So every device holds
exactly one block, ``Layout.box(device)``, and devices whose mesh coordinates differ
only along replicating axes hold equal blocks (replicas): the blocks JAX's
``NamedSharding.devices_indices_map`` gives, and the same shard keys (one per device).

Resharding from one layout to another moves, for every destination device, each
piece of its block from exactly one source device: the source's own index when that
device holds the piece, else one replica chosen by the destination's index (so
destinations spread over replicas). ``plan`` says which source sends which piece to
which destination, and how many sources each destination hears from (its progress
markers). Blocks that do not overlap exchange nothing. Pure arithmetic, no arrays.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, NamedTuple

import numpy as np

from pwmesh.errors import InvalidArgument

Box = tuple[tuple[int, int], ...]  # per dimension, [lo, hi)


class Piece(NamedTuple):
    """Source block ``[lo, hi)`` (per dimension, in the source block's coordinates) goes to destination
    device ``dest`` at ``offset`` (per dimension, in the destination block's coordinates)."""

    dest: int
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    offset: tuple[int, ...]

    def source_index(self) -> tuple[slice, ...]:
        return tuple(slice(lo, hi) for lo, hi in zip(self.lo, self.hi, strict=True))

    def dest_index(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + hi - lo) for o, lo, hi in zip(self.offset, self.lo, self.hi, strict=True))


class Assembled(list):  # type: ignore[type-arg]
    """A value's blocks already assembled into it: ``[value]``, which ``Layout.assemble`` returns as is (a
    client's direct fetch copies each block into place as it arrives: ``pwmesh.client.direct``)."""


class Layout(NamedTuple):
    """A value of ``shape`` over a mesh of axis ``mesh`` sizes; dimension ``d`` split by axes ``spec[d]``."""

    shape: tuple[int, ...]
    mesh: tuple[int, ...]
    spec: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, shape: tuple[int, ...] | list[int], sharding: Any, devices: int) -> Layout:
        """From a wire ``Sharding`` (``.mesh``, ``.spec``); None: leading-axis blocks over ``devices``."""
        if sharding is None:
            return cls.blocks(shape, devices)
        spec = [tuple(axes) for axes in sharding.spec]
        while spec and not spec[-1]:  # P("x", None) is P("x"): one layout, one key in every cache
            spec.pop()
        return cls(tuple(shape), tuple(sharding.mesh), tuple(spec))

    @classmethod
    def blocks(cls, shape: tuple[int, ...] | list[int], devices: int) -> Layout:
        """Equal blocks along the leading axis, one per device (``pw.pmap``'s layout)."""
        split = ((0,),) if devices > 1 and len(shape) else ()
        return cls(tuple(shape), (devices,), split)

    @classmethod
    def replicated(cls, shape: tuple[int, ...] | list[int], devices: int) -> Layout:
        return cls(tuple(shape), (devices,), ())

    @property
    def devices(self) -> int:
        return math.prod(self.mesh)

    @property
    def splits(self) -> tuple[int, ...]:
        """Per dimension, how many blocks it is cut into."""
        return _tables(self).splits

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return _tables(self).shard_shape

    @property
    def replicated_fully(self) -> bool:
        return all(k == 1 for k in self.splits)

    def check(self, what: str) -> None:
        """``InvalidArgument`` unless the layout can be made: axes exist and are used once, dimensions divide."""
        if not self.mesh or any(n < 1 for n in self.mesh):
            raise InvalidArgument(f"{what}: a mesh of axis sizes {list(self.mesh)}; every axis has at least one device")
        if len(self.spec) > len(self.shape):
            raise InvalidArgument(f"{what}: a spec for {len(self.spec)} dimensions, but the value has shape "
                                  f"{self.shape} ({len(self.shape)} dimensions)")
        used = [a for axes in self.spec for a in axes]
        for a in used:
            if not 0 <= a < len(self.mesh):
                raise InvalidArgument(f"{what}: mesh axis {a} does not exist (the mesh has {len(self.mesh)} axes)")
        if len(set(used)) != len(used):
            raise InvalidArgument(f"{what}: a mesh axis splits more than one dimension (axes {used})")
        for d, (n, k) in enumerate(zip(self.shape, self.splits, strict=True)):
            if n % k:
                raise InvalidArgument(f"{what}: dimension {d} of shape {self.shape} ({n}) cannot be split into "
                                      f"{k} equal blocks ({n} is not a multiple of {k})")

    def coords(self, device: int) -> tuple[int, ...]:
        return tuple(int(c) for c in np.unravel_index(device, self.mesh))

    def block(self, device: int) -> tuple[int, ...]:
        """Per dimension, the index of the block ``device`` holds."""
        return _tables(self).blocks[device]

    def box(self, device: int) -> Box:
        return _tables(self).boxes[device]

    # Shadows tuple.index on purpose (a Layout is never searched as a tuple): mypy rightly sees an override.
    def index(self, device: int) -> tuple[slice, ...]:  # type: ignore[override]
        """``device``'s block of the global array, for numpy indexing."""
        return tuple(slice(lo, hi) for lo, hi in self.box(device))

    def replicas(self, block: tuple[int, ...]) -> tuple[int, ...]:
        """The devices holding ``block``, in order."""
        return _tables(self).holders[block]

    def distinct(self) -> list[int]:
        """One device per distinct block (the first holding it), in row-major order of the blocks."""
        return _tables(self).distinct

    def same_blocks(self, other: Layout) -> bool:
        """Whether every device holds the same block under both (a copy needs no reshard)."""
        return self == other or (self.shape == other.shape and _tables(self).boxes == _tables(other).boxes)

    def split(self, array: np.ndarray) -> list[np.ndarray]:
        """``array``'s block for every device (replicas share one view)."""
        return [array[self.index(d)] if self.shape else array for d in range(self.devices)]

    def assemble(self, blocks: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
        """The global array from one block per distinct block, in ``distinct()`` order."""
        if isinstance(blocks, Assembled):
            return np.asarray(blocks[0])
        devices = self.distinct()
        if len(devices) == 1:
            return np.asarray(blocks[0]).reshape(self.shape)
        out = np.empty(self.shape, dtype)
        for device, value in zip(devices, blocks, strict=True):
            out[self.index(device)] = value
        return out


class _Tables(NamedTuple):
    splits: tuple[int, ...]
    shard_shape: tuple[int, ...]
    blocks: list[tuple[int, ...]]  # per device, the index of its block per dimension
    boxes: list[Box]  # per device, its block's [lo, hi) per dimension
    holders: dict[tuple[int, ...], tuple[int, ...]]  # per block, the devices holding it
    distinct: list[int]  # one device per block, in row-major order of the blocks


@functools.lru_cache(maxsize=4096)
def _tables(layout: Layout) -> _Tables:
    """Everything a layout says per device, computed once per layout (lowering asks often)."""
    splits = tuple(math.prod(layout.mesh[a] for a in layout.spec[d]) if d < len(layout.spec) else 1
                   for d in range(len(layout.shape)))
    shard_shape = tuple(n // k for n, k in zip(layout.shape, splits, strict=True))
    blocks = []
    holders: dict[tuple[int, ...], list[int]] = {}
    for device in range(layout.devices):
        coords = layout.coords(device)
        block = []
        for d in range(len(layout.shape)):
            index = 0
            for a in layout.spec[d] if d < len(layout.spec) else ():
                index = index * layout.mesh[a] + coords[a]
            block.append(index)
        blocks.append(tuple(block))
        holders.setdefault(tuple(block), []).append(device)
    boxes = [tuple((i * s, (i + 1) * s) for i, s in zip(b, shard_shape, strict=True)) for b in blocks]
    return _Tables(splits, shard_shape, blocks, boxes, {b: tuple(devs) for b, devs in holders.items()},
                   [devs[0] for _, devs in sorted(holders.items())])


class Plan(NamedTuple):
    """A reshard from one layout to another: what each source sends, whom each destination hears from."""

    sends: dict[int, list[Piece]]  # source device -> its pieces, by destination
    sources: dict[int, list[int]]  # destination device -> the source devices that report to it


def _covering(length: int, src_blocks: int, dst_blocks: int, q: int) -> range:
    """The source blocks along one dimension that overlap destination block ``q``. An empty dimension
    overlaps nothing, yet each destination still hears from exactly one source."""
    if length == 0:
        start = q * src_blocks // dst_blocks
        return range(start, start + 1)
    size = length // src_blocks
    lo, hi = q * (length // dst_blocks), (q + 1) * (length // dst_blocks)
    return range(lo // size, (hi - 1) // size + 1)


@functools.lru_cache(maxsize=1024)
def plan(src: Layout, dst: Layout, groups: tuple[int, ...] | None = None) -> Plan:
    """Every piece that moves from ``src`` to ``dst`` (same global shape) and who sends it.

    A block held by several source devices (replicas) is sent by the destination's own device if it
    holds it, else by one replica, spread over the destinations; ``groups`` (per destination device, its
    executor's number; -1: none) spreads by executor instead, so every device of one executor hears the same
    replica and the sender can send each piece to that executor once (``exchange.cut``)."""
    if src.shape != dst.shape:
        raise InvalidArgument(f"a reshard keeps the shape: {src.shape} is not {dst.shape}")
    sends: dict[int, list[Piece]] = {s: [] for s in range(src.devices)}
    sources: dict[int, list[int]] = {}
    src_sizes, dst_sizes = src.shard_shape, dst.shard_shape
    # An executor's devices all prefer its first one's own replica: one sender for all of them.
    first: dict[int, int] = {}
    for j, g in enumerate(groups or ()):
        first.setdefault(g, j)
    for j in range(dst.devices):
        q = dst.block(j)
        heard = []
        grouped = groups is not None and groups[j] >= 0
        own = first[groups[j]] if groups is not None and grouped else j
        per_dim = [_covering(n, a, b, qd) for n, a, b, qd in zip(src.shape, src.splits, dst.splits, q, strict=True)]
        for block in itertools.product(*per_dim):
            holders = src.replicas(block)
            spread = groups[j] if groups is not None and grouped else j
            s = own if own in holders else holders[spread % len(holders)]
            lo, hi, offset = [], [], []
            for d, (i, qd) in enumerate(zip(block, q, strict=True)):
                start, stop = i * src_sizes[d], (i + 1) * src_sizes[d]
                want_lo, want_hi = qd * dst_sizes[d], (qd + 1) * dst_sizes[d]
                a, b = max(start, want_lo), min(stop, want_hi)
                lo.append(a - start)
                hi.append(max(a, b) - start)
                offset.append(a - want_lo)
            sends[s].append(Piece(j, tuple(lo), tuple(hi), tuple(offset)))
            heard.append(s)
        sources[j] = sorted(heard)
    return Plan(sends, sources)


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
    """The rows ``[start, stop)`` of leading-axis block ``index`` of ``shards``."""
    size = rows // shards
    return index * size, (index + 1) * size
