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
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from pwmesh.dataflow.layout import Layout, Piece, Plan, block, plan
from pwmesh.errors import InvalidArgument
from pwmesh.wire.codec import Gather
from pwmesh.wire.messages import DataTuple, Emit, ErrorInfo, LandingReport, Target


class Ragged(NamedTuple):
    """Routed rows: ``array``'s rows are rows ``index`` of the value they were routed from."""

    array: np.ndarray
    index: np.ndarray  # type: ignore[assignment]  # shadows tuple.index on purpose (never searched as a tuple)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes + self.index.nbytes)

# A block gathered for other executors alone is sent from its pieces from this size on (``Gathered``);
# a smaller one is copied (its rows would be many tiny writes).
SEND_GATHERED_BYTES = 64 << 10


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


def cut(emit: Emit, local: dict[int, Any], selectors: dict[int, np.ndarray] | None = None, *,
        take: Callable[[int], np.ndarray] | None = None, here: str | None = None,
        run: tuple[str, str] | None = None) -> list[tuple[Destination, DataTuple]]:
    """The tuples (each with its destination) for ``local`` — this executor's shards of the emitted
    value, ``{shard: host array or Ragged}`` — and, for ``route``, each shard's expert ids.
    ``take(nbytes)``: where blocks gathered here are made (a writable uint8 buffer; default fresh memory).
    ``here``: the cutting executor's id; a block gathered only for other executors is then never made in
    memory but sent from its pieces (``Gathered``: the data plane's writes gather it), where it can be.
    ``run`` (its proxy, its id): the run that sends them; a reshard node's output (``Target.node``) asks
    each destination executor to report that node of it done (``LandingReport``)."""
    return _stamp(_cut(emit, local, selectors, take, here), emit.targets, run)


def _stamp(out: list[tuple[Destination, DataTuple]], targets: list[Target],
           run: tuple[str, str] | None) -> list[tuple[Destination, DataTuple]]:
    """Each tuple for a reshard node's output says whom its executor reports the node to, and when: once
    every shard of it there is stored."""
    reporting = {target.prefix: target for target in targets if target.node >= 0}
    if not reporting or run is None:
        return out
    made: dict[tuple[str, str], LandingReport] = {}
    for dest, t in out:
        target = reporting.get(t.prefix)
        if target is None:
            continue
        report = made.get((t.prefix, dest.executor_id))
        if report is None:
            shards = [r.shard + k for site in target.sites if site.executor_id == dest.executor_id
                      for r in site.runs for k in range(r.count)]
            report = made[t.prefix, dest.executor_id] = LandingReport(proxy=run[0], run_id=run[1],
                                                                      node=target.node, shards=shards)
        t.report = report
    return out


def _cut(emit: Emit, local: dict[int, Any], selectors: dict[int, np.ndarray] | None,
         take: Callable[[int], np.ndarray] | None, here: str | None) -> list[tuple[Destination, DataTuple]]:
    out: list[tuple[Destination, DataTuple]] = []
    if emit.mode == "block":
        (target,) = emit.targets
        dests = destinations(target)
        moves = block_plan(emit, target)
        gathered = _gather(target, dests, moves, local, take, here)
        out.extend(gathered)
        whole = {t.shard for _, t in gathered} | {shard for _, t in gathered for shard, _ in t.copies}
        for src, value in local.items():
            # The same piece for several destination shards of one executor (replicas): one tuple, the
            # others named in its ``copies``.
            sent: dict[tuple[Any, ...], DataTuple] = {}
            for piece in moves.sends.get(src, ()):
                dest = dests.get(piece.dest)
                if dest is None or piece.dest in whole:  # already where it is needed, or gathered here
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
        # In each destination's order, by place: a shard's row blocks then travel in row order, and arrive
        # back to back as in the value itself (``in_place``).
        out.sort(key=lambda sent: (sent[1].shard, sent[1].offset))
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


def _gather(target: Target, dests: dict[int, Destination], moves: Plan, local: dict[int, Any],
            take: Callable[[int], np.ndarray] | None, here: str | None) -> list[tuple[Destination, DataTuple]]:
    """Destination shards whose every piece this executor sends, in pieces that are not whole rows (a
    column-split weight going to a replicated one): gathered here into one block each and sent whole,
    which the receiver keeps as it is, the other sources sending their markers alone. As many copies
    as the receiver would make, made here instead, and one tuple instead of several. Where only other
    executors want the block (``here``) and its pieces are rows of their sources' rows, no copy is made
    at all: the socket's writes gather it (``Gathered``)."""
    shape = tuple(target.shape)
    if not shape:
        return []
    by_dest: dict[int, list[tuple[int, Piece]]] = {}
    for src in local:
        for piece in moves.sends.get(src, ()):
            by_dest.setdefault(piece.dest, []).append((src, piece))
    out: list[tuple[Destination, DataTuple]] = []
    made: dict[tuple[Any, ...], list[DataTuple]] = {}  # (executor, pieces) -> its tuples (replicas: copies)
    blocks: dict[tuple[Any, ...], Any] = {}  # pieces -> their block (an array or ``Gathered``), made once for all
    dtype = np.dtype(target.dtype)
    wanted: dict[tuple[Any, ...], set[str]] = {}  # pieces -> the executors that want their block
    chosen: list[tuple[int, Destination, list[tuple[int, Piece]], tuple[Any, ...]]] = []
    for j, pieces in sorted(by_dest.items()):
        dest = dests.get(j)
        if (dest is None or len(pieces) < 2 or len(pieces) != len(moves.sources[j])
                or all(p.hi[d] - p.lo[d] == shape[d] for _, p in pieces for d in range(1, len(shape)))):
            continue  # not all here, one piece already, or whole rows (the receiver takes them in place)
        which = tuple((src, p.lo, p.hi, p.offset) for src, p in pieces)
        wanted.setdefault(which, set()).add(dest.executor_id)
        chosen.append((j, dest, pieces, which))
    nbytes = math.prod(shape) * dtype.itemsize
    for j, dest, pieces, which in chosen:
        if (dest.executor_id, which) in made:
            for t in made[dest.executor_id, which]:
                t.copies.append([j, dest.device])
            continue
        value: Any = blocks.get(which)
        if value is None and here is not None and here not in wanted[which] and nbytes >= SEND_GATHERED_BYTES:
            value = Gathered.of(shape, dtype, [(local[src], p) for src, p in pieces])
        if value is None:  # read, never written, by every executor's tuple (and adopted as immutable here)
            value = np.empty(shape, dtype) if take is None else take(nbytes).view(
                dtype).reshape(shape)
            for src, p in pieces:
                value[p.dest_index()] = local[src][p.source_index()]
        blocks[which] = value
        n = len(pieces)
        (first, _), *others = sorted(pieces)
        tuples = [_tuple(target, j, dest, first, n, count=1, seq=0, array=value),
                  *(_tuple(target, j, dest, src, n, count=0) for src, _ in others)]
        made[dest.executor_id, which] = tuples
        out.extend((dest, t) for t in tuples)
    return out


class Gathered(Gather):
    """A destination block whose pieces are runs of their sources' rows (a column-split weight's blocks):
    sent as its rows' pieces in the block's order, never copied into one buffer (``Gather``)."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype,
                 bands: list[tuple[int, int, list[tuple[memoryview, int, int, int]]]]) -> None:
        super().__init__(shape, dtype)
        # Per band of the block's rows [lo, hi): each piece there, in column order, as (its source's
        # bytes, where its first row's run starts, the source's row stride, the run's length).
        self.bands = bands

    @classmethod
    def of(cls, shape: tuple[int, ...], dtype: np.dtype, pieces: list[tuple[Any, Piece]]) -> Gathered | None:
        """The block of ``shape`` that ``pieces`` (each with its source block) tile, if each piece is a run of
        whole rows' parts: every piece spans the block beyond its second dimension, and its source is a
        C-contiguous array of ``dtype`` (else None: it is gathered by a copy)."""
        if len(shape) < 2:
            return None
        runs: list[tuple[int, int, int, tuple[memoryview, int, int, int]]] = []
        for source, p in pieces:
            if (not isinstance(source, np.ndarray) or source.dtype != dtype or source.ndim != len(shape)
                    or not source.flags.c_contiguous
                    or any(p.lo[d] != 0 or p.hi[d] != shape[d] or source.shape[d] != shape[d] or p.offset[d]
                           for d in range(2, len(shape)))):
                return None
            stride = source.strides[0] if source.shape[0] > 1 else source.nbytes
            inner = math.prod(shape[2:]) * dtype.itemsize  # bytes per column
            rows = source.reshape(-1).view(np.uint8).data if source.size else memoryview(b"")
            runs.append((p.offset[0], p.offset[0] + p.hi[0] - p.lo[0], p.offset[1],
                         (rows, p.lo[0] * stride + p.lo[1] * inner, stride, (p.hi[1] - p.lo[1]) * inner)))
        edges = sorted({lo for lo, _, _, _ in runs} | {hi for _, hi, _, _ in runs})
        bands = []
        for lo, hi in itertools.pairwise(edges):
            here = sorted((col, (mv, start + (lo - top) * stride, stride, n))
                          for top, bottom, col, (mv, start, stride, n) in runs if top <= lo < bottom)
            bands.append((lo, hi, [run for _, run in here]))
        return cls(shape, dtype, bands)

    def into(self, out: np.ndarray) -> np.ndarray:
        """One strided copy per piece and band of rows (not one per row: a shared-memory slot, a sealed
        stream)."""
        row = math.prod(self.shape[1:]) * self.dtype.itemsize
        for lo, hi, runs in self.bands:
            at = lo * row
            for mv, start, stride, n in runs:
                source = np.ndarray((hi - lo, n), np.uint8, buffer=mv, offset=start, strides=(stride, 1))
                np.copyto(np.ndarray((hi - lo, n), np.uint8, buffer=out, offset=at, strides=(row, 1)), source)
                at += n
        return out

    def views(self) -> Iterator[memoryview]:
        for lo, hi, runs in self.bands:
            for r in range(hi - lo):
                for mv, start, stride, n in runs:
                    at = start + r * stride
                    yield mv[at:at + n]


def cut_error(emit: Emit, local_shards: list[int], error: ErrorInfo,
              run: tuple[str, str] | None = None) -> list[tuple[Destination, DataTuple]]:
    """Error tuples to every destination ``local_shards`` would have sent to: they fail, not wait (a reshard
    node's output reports its node failed: ``run`` as for ``cut``)."""
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
    return _stamp(out, emit.targets, run)


def expand(tuples: list[DataTuple], *, share: bool = False) -> list[DataTuple]:
    """``tuples`` with each one's ``copies`` as tuples of their own, each with its own copy of the array
    (never two shards over one buffer: a computation that consumes one must not change the other).

    ``share``: the copies share the array instead (no copy here), and each of them, the original too,
    names in ``copies`` every shard that shares it; ``landings`` then assembles each value once and
    ``Landing.whole`` says whether the array may be kept as it is."""
    if not any(t.copies for t in tuples):
        return tuples
    out: list[DataTuple] = []
    for t in tuples:
        if not t.copies:
            out.append(t)
            continue
        if share:
            sharers = [[t.shard, t.device], *t.copies]
            out.append(dataclasses.replace(t, copies=sharers))
            out.extend(dataclasses.replace(t, shard=shard, device=device, copies=sharers) for shard, device in t.copies)
            continue
        out.append(t)
        for shard, device in t.copies:
            out.append(dataclasses.replace(t, shard=shard, device=device, copies=[],
                                           array=None if t.array is None else t.array.copy()))
    return out


@dataclasses.dataclass(slots=True)
class Landing:
    """One value that arrived for one or more destination shards of an executor: ``shards`` is each one's
    (key, device); all of them get the same value, assembled once from ``payloads`` (replicas of one
    block, ``expand(share=True)``), each device its own buffer."""

    shards: list[tuple[str, int]]
    payloads: list[DataTuple]
    last: DataTuple

    @property
    def nbytes(self) -> int:
        """One copy's bytes (of a block; routed rows count what arrived)."""
        if self.last.ragged:
            return sum(t.array.nbytes + (0 if t.index is None else t.index.nbytes)
                       for t in self.payloads if t.array is not None)
        return math.prod(self.last.shape) * np.dtype(self.last.dtype).itemsize

    @property
    def whole(self) -> bool:
        """May a payload that is the whole value be kept as it is: no destination shard outside this
        landing shares its array."""
        return all(not t.copies or len(t.copies) <= len(self.shards) for t in self.payloads)


def landings(arrived: list[tuple[str, int, list[DataTuple], DataTuple]]) -> list[Landing]:
    """Destination shards completed together — each ``(key, device, payloads, last)`` — as landings:
    shards whose payloads are the very same arrays (replicas) share one."""
    out: list[Landing] = []
    by_arrays: dict[tuple[Any, ...], Landing] = {}
    for key, device, payloads, last in arrived:
        if last.ragged or not any(t.copies for t in payloads):
            out.append(Landing([(key, device)], payloads, last))
            continue
        same = (tuple(id(t.array) for t in payloads), tuple(last.shape), last.dtype)
        landing = by_arrays.get(same)
        if landing is None:
            landing = by_arrays[same] = Landing([(key, device)], payloads, last)
            out.append(landing)
        else:
            landing.shards.append((key, device))
    return out


def assemble(tuples: list[DataTuple], last: DataTuple, *, take: Callable[[int], np.ndarray] | None = None,
             whole: bool = True) -> np.ndarray | Ragged:
    """One destination shard's value from its tuples (``Progress`` order: by producer, then sequence);
    ``last`` is whatever completed it (a tuple or a marker: it may have had no tuples at all).

    ``take(nbytes)``: where a block's value is assembled (a writable uint8 buffer, e.g. a pooled one,
    already faulted in and aligned: JAX on CPU adopts it as it is); by default fresh memory. ``whole``:
    a payload that is the whole value may be returned as it is (not when another shard shares it)."""
    first = last
    shape, dtype = tuple(first.shape), np.dtype(first.dtype)
    data = [t for t in tuples if t.array is not None]
    if first.ragged:
        if not data:
            return Ragged(np.zeros((0, *shape[1:]), dtype), np.zeros((0,), np.int32))
        return Ragged(np.concatenate([t.array for t in data]), np.concatenate([t.index for t in data]))
    if (whole and len(data) == 1 and data[0].index is None and not any(data[0].offset)
            and (array := data[0].array) is not None and array.shape == shape):
        return array  # a whole shard moved as it is
    if whole and (rows := in_place(data, shape, dtype)) is not None:
        return rows
    size = math.prod(shape)
    if take is None:
        out = np.zeros(shape, dtype)
    else:
        out = take(size * dtype.itemsize).view(dtype).reshape(shape)
        # Blocks that tile the shard (a plan's pieces never overlap) write every element; rows may not.
        if any(t.index is not None for t in data) or sum(t.array.size for t in data if t.array is not None) != size:
            out.fill(0)
    base = first.shard * shape[0] if shape else 0
    for t in data:
        assert t.array is not None
        if t.index is not None:  # combined rows: back to their row numbers
            out[t.index - base] = t.array
        else:  # a block, at its offset
            offset = t.offset or [0] * len(shape)
            out[tuple(slice(o, o + n) for o, n in zip(offset, t.array.shape, strict=True))] = t.array
    return out


def in_place(data: list[DataTuple], shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
    """The value, if ``data``'s blocks are whole rows that already lie back to back, in row order, in one
    buffer (one message's frames, as the data plane reads them): a view of that buffer, no copy."""
    if len(data) < 2 or not shape:
        return None
    blocks = sorted(data, key=lambda t: t.offset[0] if t.offset else 0)
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    first = blocks[0].array
    assert first is not None
    root = _root(first)
    if root is None:
        return None
    start = first.__array_interface__["data"][0]
    rows = 0
    for t in blocks:
        a = t.array
        assert a is not None
        if (t.index is not None or a.dtype != dtype or tuple(a.shape[1:]) != shape[1:] or any(t.offset[1:])
                or (t.offset[0] if t.offset else 0) != rows or not a.flags.c_contiguous
                or a.__array_interface__["data"][0] != start + rows * row_bytes or _root(a) is not root):
            return None
        rows += a.shape[0]
    if rows != shape[0]:
        return None
    offset = start - root.__array_interface__["data"][0]
    return np.ndarray(shape, dtype, buffer=root, offset=offset)


def _root(a: np.ndarray) -> np.ndarray | None:
    """The ndarray at the bottom of ``a``'s views (the one that holds the memory's owner), if any."""
    while True:
        base = a.base.obj if isinstance(a.base, memoryview) else a.base  # the codec reads frames by memoryview
        if not isinstance(base, np.ndarray):
            return a if base is not None else None
        a = base
