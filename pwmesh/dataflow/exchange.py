"""Cutting a computation's values into shard-tagged tuples, and assembling what arrives.

``cut`` is the producer's side of an ``Emit``: given the local shards of a value
(host arrays), it returns the tuples for every destination shard, grouped by the
executor they go to (one batch each: small tuples to the same host travel
together), each destination that could hear from this producer getting a
progress marker whether or not any rows go there. ``assemble`` is the consumer's
side: the payloads ``Progress`` released for one destination shard become one
array (a block, a reshard, rows combined in order) or routed rows (``Ragged``).
Pure numpy: no sockets, no JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from pwmesh.dataflow.layout import Layout, Plan, block, plan
from pwmesh.errors import InvalidArgument
from pwmesh.wire.messages import DataTuple, Emit, ErrorInfo, Target


class Ragged(NamedTuple):
    """Routed rows: ``array``'s rows are rows ``index`` of the value they were routed from."""

    array: np.ndarray
    index: np.ndarray  # type: ignore[assignment]  # shadows tuple.index on purpose (never searched as a tuple)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes + self.index.nbytes)


@dataclasses.dataclass(frozen=True, slots=True)
class Destination:
    executor_id: str
    data: str
    host: str
    device: int


def destinations(target: Target) -> dict[int, Destination]:
    """Destination shard -> where it lives, from the target's runs."""
    found = {}
    for site in target.sites:
        for run in site.runs:
            for k in range(run.count):
                found[run.shard + k] = Destination(site.executor_id, site.data, site.host, run.device + k)
    return found


def block_plan(emit: Emit, target: Target) -> Plan:
    """A block emit's moves, replicas spread by destination executor (every one of its devices hears the
    same source, so each piece goes to an executor once): the same plan on every executor."""
    src, dst = emit_layouts(emit, target)
    groups = [-1] * dst.devices
    for i, site in enumerate(target.sites):
        for run in site.runs:
            for k in range(run.count):
                if 0 <= run.shard + k < dst.devices:
                    groups[run.shard + k] = i
    return plan(src, dst, tuple(groups))


def emit_layouts(emit: Emit, target: Target) -> tuple[Layout, Layout]:
    """A block emit's source and destination layouts (the fields left out mean leading-axis blocks)."""
    if emit.shape is not None:
        shape = list(emit.shape)
    else:
        shape = [emit.rows, *target.shape[1:]] if target.shape else []
    return (Layout.of(shape, emit.src, emit.src_shards), Layout.of(shape, target.sharding, target.shards))


def _tuple(target: Target, shard: int, dest: Destination, src: int, n_sources: int, **fields: Any) -> DataTuple:
    return DataTuple(prefix=target.prefix, shard=shard, device=dest.device, src=src, sources=n_sources,
                     shape=list(target.shape), dtype=target.dtype, **fields)


def cut(emit: Emit, local: dict[int, Any],
        selectors: dict[int, np.ndarray] | None = None) -> list[tuple[Destination, DataTuple]]:
    """The tuples (each with its destination) for ``local`` — this executor's shards of the emitted
    value, ``{shard: host array or Ragged}`` — and, for ``route``, each shard's expert ids."""
    out: list[tuple[Destination, DataTuple]] = []
    if emit.mode == "block":
        (target,) = emit.targets
        dests = destinations(target)
        moves = block_plan(emit, target)
        for src, value in local.items():
            # The same piece for several destination shards of one executor (replicas): one tuple, the
            # others named in its ``copies``.
            sent: dict[tuple[Any, ...], DataTuple] = {}
            for piece in moves.sends.get(src, ()):
                dest = dests.get(piece.dest)
                if dest is None:  # that shard is already where it is needed
                    continue
                n = len(moves.sources[piece.dest])
                same = (dest.executor_id, piece.lo, piece.hi, piece.offset, n)
                first = sent.get(same)
                if first is not None:
                    first.copies.append([piece.dest, dest.device])
                    continue
                part = value[piece.source_index()] if np.ndim(value) else value
                t = _tuple(target, piece.dest, dest, src, n, count=1, seq=0, offset=list(piece.offset),
                           array=np.asarray(part))
                sent[same] = t
                out.append((dest, t))
    elif emit.mode == "route":
        assert selectors is not None
        experts = len(emit.targets)
        for src, value in local.items():
            ids = np.asarray(selectors[src])
            if ids.size and (ids.min() < 0 or ids.max() >= experts):
                bad = ids[(ids < 0) | (ids >= experts)][0]
                raise InvalidArgument(f"expert id {bad} is out of range: there are {experts} experts")
            start, _ = block(emit.rows, emit.src_shards, src)
            rows = np.arange(start, start + len(ids), dtype=np.int32)
            for k, target in enumerate(emit.targets):
                dest = destinations(target)[0]
                mask = ids == k
                if mask.any():
                    out.append((dest, _tuple(target, 0, dest, src, emit.src_shards, count=1, seq=0, ragged=True,
                                             array=np.asarray(value)[mask], index=rows[mask])))
                else:
                    out.append((dest, _tuple(target, 0, dest, src, emit.src_shards, count=0, ragged=True)))
    elif emit.mode == "scatter":
        (target,) = emit.targets
        dests = destinations(target)
        per_shard = max(1, emit.rows // target.shards)
        for value in local.values():
            assert isinstance(value, Ragged)
            owner = value.index // per_shard
            for j, dest in sorted(dests.items()):
                mask = owner == j
                if mask.any():
                    out.append((dest, _tuple(target, j, dest, emit.source, emit.src_shards, count=1, seq=0,
                                             array=value.array[mask], index=value.index[mask])))
                else:
                    out.append((dest, _tuple(target, j, dest, emit.source, emit.src_shards, count=0)))
    else:
        raise InvalidArgument(f"unknown emit mode {emit.mode!r}")
    return out


def cut_error(emit: Emit, local_shards: list[int], error: ErrorInfo) -> list[tuple[Destination, DataTuple]]:
    """Error tuples to every destination ``local_shards`` would have sent to: they fail, not wait."""
    out = []
    for target in emit.targets:
        dests = destinations(target)
        if emit.mode == "block":
            sends = block_plan(emit, target).sends
            wanted = {p.dest for src in local_shards for p in sends.get(src, ())}
        else:
            wanted = set(dests)
        for j in sorted(wanted & set(dests)):
            src = emit.source if emit.source >= 0 else (local_shards[0] if local_shards else 0)
            out.append((dests[j], _tuple(target, j, dests[j], src, 1, error=error)))
    return out


def expand(tuples: list[DataTuple]) -> list[DataTuple]:
    """``tuples`` with each one's ``copies`` as tuples of their own, each with its own copy of the array
    (never two shards over one buffer: a computation that consumes one must not change the other)."""
    if not any(t.copies for t in tuples):
        return tuples
    out: list[DataTuple] = []
    for t in tuples:
        out.append(t)
        for shard, device in t.copies:
            out.append(dataclasses.replace(t, shard=shard, device=device, copies=[],
                                           array=None if t.array is None else t.array.copy()))
    return out


def assemble(tuples: list[DataTuple], last: DataTuple) -> np.ndarray | Ragged:
    """One destination shard's value from its tuples (``Progress`` order: by producer, then sequence);
    ``last`` is whatever completed it (a tuple or a marker: it may have had no tuples at all)."""
    first = last
    shape, dtype = tuple(first.shape), np.dtype(first.dtype)
    data = [t for t in tuples if t.array is not None]
    if first.ragged:
        if not data:
            return Ragged(np.zeros((0, *shape[1:]), dtype), np.zeros((0,), np.int32))
        return Ragged(np.concatenate([t.array for t in data]), np.concatenate([t.index for t in data]))
    if (len(data) == 1 and data[0].index is None and not any(data[0].offset)
            and (whole := data[0].array) is not None and whole.shape == shape):
        return whole  # a whole shard moved as it is
    out = np.zeros(shape, dtype)
    base = first.shard * shape[0] if shape else 0
    for t in data:
        assert t.array is not None
        if t.index is not None:  # combined rows: back to their row numbers
            out[t.index - base] = t.array
        else:  # a block, at its offset
            offset = t.offset or [0] * len(shape)
            out[tuple(slice(o, o + n) for o, n in zip(offset, t.array.shape, strict=True))] = t.array
    return out
