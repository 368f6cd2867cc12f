"""A run's computations per executor, packed once by the proxy and unpacked by that executor.

The island scheduler orders runs by the devices they use; it never needs the
computations themselves, so it forwards each executor's part as the bytes the
proxy packed (decoding and re-encoding a 128-node program cost it ~7 ms).

A program run again and again has the same parts but for its buffer names. So
the parts of a cached lowering name their buffers ``"@<k>"``, the k-th of the
part's ``names``: the proxy packs them once and sends each run the same bytes
with that run's names; an executor unpacks each such part once (``PartTemplates``)
and fills in the names per run.

Better still, such a part is *installed*: the island scheduler holds a cached lowering's parts
(``InstallTemplate``) and sends each executor its part once, with the first run (``Enqueue.template``
and ``refs``); later runs carry only the template's id and the run's names, the island's whole list,
of which the part's ``"@<k>"`` is ``names[refs[k]]``. ``PartTemplates`` keeps those by id too.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

from pwmesh.errors import NotFound, ProtocolError
from pwmesh.wire.codec import pack_records, unpack_records
from pwmesh.wire.messages import Computation, DeviceRange, Emit, Enqueue, RunPart, Target
from pwmesh.wire.records import check_runs

_Plan = tuple[list[int | str], list[int | str]]  # a template computation's inputs and outputs: name indices


def run_parts(comps: Iterable[Computation]) -> list[RunPart]:
    """One part per executor, its computations in the order given."""
    by_executor: dict[str, list[Computation]] = {}
    for comp in comps:
        by_executor.setdefault(comp.executor_id, []).append(comp)
    return [RunPart(executor_id=executor_id, control=mine[0].control, devices=device_ranges(mine),
                    nodes=[c.node for c in mine], computations=pack_records(mine))
            for executor_id, mine in by_executor.items()]


def with_names(parts: list[RunPart], names: list[str]) -> list[RunPart]:
    """An installed template's parts (``refs``) with a run's names (``RunTemplate.names``), each part its own:
    the run as a ``ScheduleRun`` would carry it."""
    return [RunPart(executor_id=p.executor_id, control=p.control, devices=p.devices, nodes=p.nodes,
                    computations=p.computations, names=[names[r] for r in p.refs]) for p in parts]


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
    return with_buffers(comp, [name(p) for p in comp.inputs], [name(p) for p in comp.outputs], name)


def with_buffers(comp: Computation, inputs: list[str], outputs: list[str], name: Callable[[str], str]) -> Computation:
    """A copy of ``comp`` reading ``inputs`` and making ``outputs``, its emit targets mapped through ``name``."""
    emits = [renamed_emit(e, name) for e in comp.emits] if comp.emits else []
    return Computation(node=comp.node, fn_id=comp.fn_id, executor_id=comp.executor_id, control=comp.control,
                       runs=comp.runs, inputs=inputs, outputs=outputs, emits=emits, spmd=comp.spmd, kind=comp.kind,
                       ragged=comp.ragged, seq=comp.seq, gang=comp.gang, donate=comp.donate, frees=comp.frees,
                       quiet=comp.quiet)


def renamed_emit(emit: Emit, name: Callable[[str], str]) -> Emit:
    """A copy of ``emit`` with its targets' buffers mapped through ``name``."""
    return Emit(mode=emit.mode, rows=emit.rows, src_shards=emit.src_shards, slot=emit.slot, selector=emit.selector,
                source=emit.source, shape=emit.shape, src=emit.src,
                targets=[Target(prefix=name(t.prefix), shards=t.shards, sites=t.sites, shape=t.shape, dtype=t.dtype,
                                sharding=t.sharding, node=t.node) for t in emit.targets])


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
    """An executor's parts of cached lowerings, unpacked once each: by their bytes (the newest ``capacity``),
    and those installed by id (``install``; the newest ``installed_capacity``)."""

    def __init__(self, capacity: int = 64, installed_capacity: int = 1024) -> None:
        self.capacity = capacity
        self.installed_capacity = installed_capacity
        self._parts: collections.OrderedDict[bytes, list[Computation]] = collections.OrderedDict()
        # template id -> its computations (naming "@<k>"), what each k stands for in a run's names, each
        # computation's inputs and outputs as indices into a run's names (or the name itself), worked out once,
        # and how many names a run must carry for them (None: a reference no run's names can stand for)
        self._installed: collections.OrderedDict[str, tuple[list[Computation], list[int], list[_Plan], int | None]] = \
            collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._parts) + len(self._installed)

    def holds(self, template_id: str) -> bool:
        return template_id in self._installed

    def install(self, template_id: str, nodes: list[int], computations: bytes, refs: list[int]) -> None:
        """Keep a template's part: its computations unpacked and checked once."""
        where = f"template {template_id}'s part"
        comps = unpack_records(computations, Computation, where)
        for comp in comps:
            check_runs(comp.runs, f"{where}, computation {comp.node}")
        if [c.node for c in comps] != nodes:
            raise ProtocolError(f"{where}: its computations are nodes {[c.node for c in comps]}, it names {nodes}")
        if any(r < 0 for r in refs):
            raise ProtocolError(f"{where} refers to a negative name")

        def plan(ref: str) -> int | str:
            if ref[:1] != "@":
                return ref
            k = int(ref[1:]) if ref[1:].isdigit() else -1
            return refs[k] if 0 <= k < len(refs) else -1  # -1: no name (refused at the run, as it names it)

        plans = [([plan(p) for p in c.inputs], [plan(p) for p in c.outputs]) for c in comps]
        indices = [x for ins, outs in plans for x in (*ins, *outs) if type(x) is int]
        need = None if -1 in indices else max(indices, default=-1) + 1
        self._installed[template_id] = (comps, list(refs), plans, need)
        self._installed.move_to_end(template_id)
        while len(self._installed) > self.installed_capacity:
            self._installed.popitem(last=False)

    def instantiated(self, msg: Enqueue) -> list[Computation]:
        """A run of an installed template (``msg.template``): its computations with the run's names."""
        found = self._installed.get(msg.template)
        if found is None:
            raise NotFound(f"Enqueue of run {msg.run_id} names template {msg.template}, which this executor "
                           "does not hold")
        self._installed.move_to_end(msg.template)
        template, refs, plans, need = found
        names = msg.names

        def name(ref: str) -> str:
            if ref[:1] != "@":
                return ref
            k = int(ref[1:]) if ref[1:].isdigit() else -1
            i = refs[k] if 0 <= k < len(refs) else -1
            if not 0 <= i < len(names):
                raise ProtocolError(f"Enqueue of run {msg.run_id} refers to buffer {ref!r}; it names {len(names)}")
            return names[i]

        if need is None or need > len(names):  # a reference the run names nothing for: refused, naming it
            return [renamed(c, name) for c in template]
        # (a training step's ~220 names: indexing, not parsing "@<k>" a name a run)
        return [with_buffers(c, [x if isinstance(x, str) else names[x] for x in ins],
                             [x if isinstance(x, str) else names[x] for x in outs], name)
                for c, (ins, outs) in zip(template, plans, strict=True)]

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
    if msg.template:
        templates = templates if templates is not None else PartTemplates(0, 1)
        if msg.computations:  # the first run of it sent here: its part comes with it
            templates.install(msg.template, msg.nodes, msg.computations, msg.refs)
        comps = templates.instantiated(msg)
    elif msg.names:
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
