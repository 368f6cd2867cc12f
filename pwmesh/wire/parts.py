"""A run's computations per executor, packed once by the proxy and unpacked by that executor.

The island scheduler orders runs by the devices they use; it never needs the
computations themselves, so it forwards each executor's part as the bytes the
proxy packed (decoding and re-encoding a 128-node program cost it ~7 ms).

A program run again and again has the same parts but for its buffer names. So
the parts of a cached lowering name their buffers ``"@<k>"``, the k-th of the
part's ``names``: the proxy packs them once and sends each run the same bytes
with that run's names; an executor unpacks each such part once (``PartTemplates``)
and fills in the names per run.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

from pwmesh.errors import ProtocolError
from pwmesh.wire.codec import pack_records, unpack_records
from pwmesh.wire.messages import Computation, DeviceRange, Emit, Enqueue, RunPart, Target
from pwmesh.wire.records import check_runs


def run_parts(comps: Iterable[Computation]) -> list[RunPart]:
    """One part per executor, its computations in the order given."""
    by_executor: dict[str, list[Computation]] = {}
    for comp in comps:
        by_executor.setdefault(comp.executor_id, []).append(comp)
    return [RunPart(executor_id=executor_id, control=mine[0].control, devices=device_ranges(mine),
                    nodes=[c.node for c in mine], computations=pack_records(mine))
            for executor_id, mine in by_executor.items()]


def device_ranges(comps: Iterable[Computation]) -> list[DeviceRange]:
    """The devices ``comps`` use, as few ranges as cover them (a 64-device node: one)."""
    ranges: list[DeviceRange] = []
    for device in sorted({device for c in comps for device, _ in c.shards()}):
        if ranges and ranges[-1].first + ranges[-1].count == device:
            ranges[-1].count += 1
        else:
            ranges.append(DeviceRange(first=device))
    return ranges


def renamed(comp: Computation, name: Callable[[str], str]) -> Computation:
    """A copy of ``comp`` with every buffer it names (inputs, outputs, emit targets) mapped through ``name``."""
    emits = [renamed_emit(e, name) for e in comp.emits] if comp.emits else []
    return Computation(node=comp.node, fn_id=comp.fn_id, executor_id=comp.executor_id, control=comp.control,
                       runs=comp.runs, inputs=[name(p) for p in comp.inputs], outputs=[name(p) for p in comp.outputs],
                       emits=emits, spmd=comp.spmd, kind=comp.kind, ragged=comp.ragged, seq=comp.seq, gang=comp.gang,
                       donate=comp.donate, quiet=comp.quiet)


def renamed_emit(emit: Emit, name: Callable[[str], str]) -> Emit:
    """A copy of ``emit`` with its targets' buffers mapped through ``name``."""
    return Emit(mode=emit.mode, rows=emit.rows, src_shards=emit.src_shards, slot=emit.slot, selector=emit.selector,
                source=emit.source, shape=emit.shape, src=emit.src,
                targets=[Target(prefix=name(t.prefix), shards=t.shards, sites=t.sites, shape=t.shape, dtype=t.dtype,
                                sharding=t.sharding) for t in emit.targets])


def referenced_parts(comps: Iterable[Computation]) -> list[tuple[RunPart, list[str]]]:
    """``run_parts``, each part naming its buffers ``"@<k>"``: the k-th of the list that comes with it."""
    by_executor: dict[str, list[Computation]] = {}
    for comp in comps:
        by_executor.setdefault(comp.executor_id, []).append(comp)
    parts = []
    for mine in by_executor.values():
        used: dict[str, str] = {}  # name -> its reference, in first-use order

        def ref(name: str, used: dict[str, str] = used) -> str:
            return used.setdefault(name, f"@{len(used)}")

        (part,) = run_parts([renamed(c, ref) for c in mine])
        parts.append((part, list(used)))
    return parts


def checked(comps: list[Computation], msg: Enqueue) -> list[Computation]:
    """Unpacked computations whose shard runs an executor could hold (checked once per template, not per run)."""
    for comp in comps:
        check_runs(comp.runs, f"Enqueue of run {msg.run_id}, computation {comp.node}")
    return comps


class PartTemplates:
    """An executor's parts of cached lowerings, unpacked once each (by their bytes; the newest ``capacity``)."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._parts: collections.OrderedDict[bytes, list[Computation]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._parts)

    def computations(self, msg: Enqueue) -> list[Computation]:
        """``msg``'s computations with the run's names in place of their references."""
        template = self._parts.get(msg.computations)
        if template is None:
            template = checked(unpack_records(msg.computations, Computation, "Enqueue.computations"), msg)
            self._parts[msg.computations] = template
            while len(self._parts) > self.capacity:
                self._parts.popitem(last=False)
        else:
            self._parts.move_to_end(msg.computations)
        names = msg.names

        def name(ref: str) -> str:
            if ref[:1] != "@":
                return ref
            k = int(ref[1:]) if ref[1:].isdigit() else -1
            if not 0 <= k < len(names):
                raise ProtocolError(f"Enqueue of run {msg.run_id} refers to buffer {ref!r}; it names {len(names)}")
            return names[k]

        return [renamed(c, name) for c in template]


def enqueued(msg: Enqueue, templates: PartTemplates | None = None) -> list[Computation]:
    """An Enqueue's computations, checked against the nodes it names, with their places in the island order."""
    if msg.names:
        comps = (templates if templates is not None else PartTemplates(0)).computations(msg)
    else:
        comps = checked(unpack_records(msg.computations, Computation, "Enqueue.computations"), msg)
        for c in comps:  # a reference with no names would wait forever for a buffer nobody makes
            if any(p[:1] == "@" for p in (*c.inputs, *c.outputs, *(t.prefix for e in c.emits for t in e.targets))):
                raise ProtocolError(f"Enqueue of run {msg.run_id}: computation {c.node} refers to buffers "
                                    "by number but the Enqueue names none")
    if [c.node for c in comps] != msg.nodes or (msg.seqs and len(msg.seqs) != len(comps)):
        raise ProtocolError(f"Enqueue of run {msg.run_id}: its computations are nodes {[c.node for c in comps]}, "
                            f"it names {msg.nodes} with {len(msg.seqs)} places")
    for comp, seq in zip(comps, msg.seqs, strict=False):
        comp.seq = seq
    return comps
