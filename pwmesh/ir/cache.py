"""Lowered programs, cached per program and map version (ARCHITECTURE §3, step 2).

A client calls the same traced program again and again; lowering it is the same
work each time except for the names of its buffers, which are new every run.
So a program is lowered once with placeholder names (``@<value>`` and, for the
buffers lowering derives, ``@d<k>``) and each run *instantiates* that template:
the same computations, emits, puts and moves with the run's names filled in —
a copy of records instead of placement, layout and transfer planning.

The entry is found by the program's id (a digest of its spec, computed once by
the client when it traces) and the run's bindings: where each bound input's
shards are and which inputs come from the host. It is used only while every
slice the program runs on is still the object it was lowered against: the
proxy replaces a slice's ``SliceInfo`` whenever the resource manager changes
its map, so a remap (a host lost, a slice migrated) lowers the program again.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import secrets
from collections.abc import Callable

from pwmesh.errors import InvalidArgument, PwmeshError
from pwmesh.ir.lower import HostPut, Lowered, ShardLocation, TempGroups, lower
from pwmesh.ir.placement import Placements
from pwmesh.wire.messages import ProgramSpec, RunPart, SendShards, SliceInfo
from pwmesh.wire.parts import referenced_parts, renamed, renamed_emit

MAX_PROGRAM_ID_CHARS = 128


@dataclasses.dataclass(eq=False)
class _Template:
    program: ProgramSpec
    slices: dict[int, SliceInfo]  # the slices it was lowered against (identity: a remap replaces them)
    lowered: Lowered  # with placeholder names
    placeholders: list[str]  # "<owner>/<placeholder>" of value v, then of each derived buffer
    # (buffer, as an index into placeholders) -> who holds its shards: one frozen set for equal ones, shared by
    # every run's buffers (``proxy.session.Buffer.holders``), so freeing a run's temporaries compares by identity.
    holders: list[tuple[int, frozenset[str]]]
    # Per scheduler, its parts packed once (installed there once: ``InstallTemplate``), each part's "@<k>"
    # standing for the island's names[part.refs[k]]; and those names, as indices into placeholders.
    parts: dict[str, list[RunPart]]
    island_names: dict[str, list[int]]
    template_id: str = dataclasses.field(default_factory=lambda: secrets.token_hex(8))  # unique across proxies
    # What every run of it takes part in, made once (``Lowered.controls``, ``executor_ids``, ``pending``).
    controls: frozenset[str] = frozenset()
    executor_ids: frozenset[str] = frozenset()
    pending: dict[int, frozenset[str]] = dataclasses.field(default_factory=dict)
    temps: TempGroups | None = None  # ``Lowered.temps``
    frees: list[tuple[int, int, frozenset[str]]] = dataclasses.field(default_factory=list)  # (buffer, node, controls)

    def current(self, slices: dict[int, SliceInfo]) -> bool:
        """Whether every slice it was lowered against is still the one the session holds (no remap since)."""
        return all(slices.get(sid) is sl for sid, sl in self.slices.items())


class LoweringCache:
    """One session's lowered programs, the least recently used dropped past ``capacity``."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._templates: collections.OrderedDict[tuple[object, ...], _Template] = collections.OrderedDict()
        self._failed: dict[tuple[object, ...], PwmeshError] = {}  # jobs that failed, until their run raises it
        self._placements = Placements()  # the bound inputs' locations, hashed once per list (``_key``)

    def __len__(self) -> int:
        return len(self._templates)

    def lower(self, program_id: str, program: ProgramSpec, *, owner: str, names: list[str], host_inputs: set[int],
              bound: dict[int, list[ShardLocation]], slices: dict[int, SliceInfo], spmd: dict[str, bool],
              fresh_name: Callable[[], str], packed: bool = False,
              keep: frozenset[int] = frozenset()) -> tuple[ProgramSpec, Lowered]:
        """``lower(...)``'s result for this run, from the cache when it can be; with the spec it is of.

        An empty ``program_id`` is never cached. Under a known id the cached spec is the one that
        runs (the client's id names it), after a check that the one sent has its shape. ``packed``:
        a cached run comes as packed parts (``Lowered.parts``; see ``_instantiate``)."""
        if len(program_id) > MAX_PROGRAM_ID_CHARS:
            raise InvalidArgument(f"a program id has at most {MAX_PROGRAM_ID_CHARS} characters")
        if not _templated(program_id, names, bound):
            return program, lower(program, owner=owner, names=names, host_inputs=host_inputs, bound=bound,
                                  slices=slices, spmd=spmd, fresh_name=fresh_name, keep=keep)
        key = _key(program_id, bound, host_inputs, keep, self._placements)
        failed = self._failed.pop(key, None)
        if failed is not None:  # lowered off the loop (``job``), and that failed: this run fails the same way
            raise failed
        template = self._templates.get(key)
        if template is not None and template.current(slices):
            _check_same_shape(program_id, template.program, program)
            self._templates.move_to_end(key)
            self.hits += 1
            return template.program, _instantiate(template, owner, names, fresh_name, packed)
        self.misses += 1
        template = _build(program, owner=owner, host_inputs=host_inputs, bound=bound, slices=slices, spmd=spmd,
                          keep=keep)
        self._store(key, template)
        return program, _instantiate(template, owner, names, fresh_name, packed)

    def job(self, program_id: str, program: ProgramSpec, *, owner: str, names: list[str], host_inputs: set[int],
            bound: dict[int, list[ShardLocation]], slices: dict[int, SliceInfo], spmd: dict[str, bool],
            keep: frozenset[int] = frozenset()) -> LoweringJob | None:
        """The work ``lower`` would do for this run before it could instantiate, as a job to run on another
        thread (then ``finish``), so a huge program does not hold the caller's loop; None if ``lower``
        would find a template, or never makes one. ``slices`` and ``spmd`` are the job's own copies."""
        if len(program_id) > MAX_PROGRAM_ID_CHARS or not _templated(program_id, names, bound):
            return None
        key = _key(program_id, bound, host_inputs, keep, self._placements)
        template = self._templates.get(key)
        if key in self._failed or (template is not None and template.current(slices)):
            return None
        return LoweringJob(key, functools.partial(_build, program, owner=owner, host_inputs=host_inputs,
                                                  bound=bound, slices=slices, spmd=spmd, keep=keep))

    def finish(self, job: LoweringJob) -> None:
        """Keep what ``job`` made: its template, or its failure for the next ``lower`` of its run to raise."""
        if job.error is not None:
            self._failed[job.key] = job.error
        elif job.template is not None:
            self.misses += 1
            self._store(job.key, job.template)

    def _store(self, key: tuple[object, ...], template: _Template) -> None:
        self._templates[key] = template
        self._templates.move_to_end(key)
        while len(self._templates) > self.capacity:
            self._templates.popitem(last=False)


@dataclasses.dataclass(eq=False)
class LoweringJob:
    """A template to build away from the event loop: ``run`` it on a thread, then ``LoweringCache.finish``."""

    key: tuple[object, ...]
    build: Callable[[], _Template]
    template: _Template | None = None
    error: PwmeshError | None = None

    def run(self) -> None:
        """Build the template (pure: it reads only what the job was given). A lowering error is kept."""
        try:
            self.template = self.build()
        except PwmeshError as exc:
            self.error = exc
        except Exception as exc:  # a bug in lowering: this run fails with it, and nothing waits for ever
            self.error = PwmeshError(f"lowering the program failed: {type(exc).__name__}: {exc}")


def _templated(program_id: str, names: list[str], bound: dict[int, list[ShardLocation]]) -> bool:
    """Whether a run is lowered through a template: it has a program id, and no two of its inputs are bound
    to one buffer (those share their transfers: placeholders would not)."""
    bound_names = [names[v] for v in bound]
    return bool(program_id) and len(set(bound_names)) == len(bound_names)


def _key(program_id: str, bound: dict[int, list[ShardLocation]], host_inputs: set[int],
         keep: frozenset[int], placements: Placements) -> tuple[object, ...]:
    return (program_id, tuple((v, placements.of(where)) for v, where in sorted(bound.items())),
            tuple(sorted(host_inputs)), keep)


def _build(program: ProgramSpec, *, owner: str, host_inputs: set[int], bound: dict[int, list[ShardLocation]],
           slices: dict[int, SliceInfo], spmd: dict[str, bool], keep: frozenset[int]) -> _Template:
    """Lower ``program`` with placeholder names, and pack its parts once: a template for every run of it."""
    placeholders = [f"@{v}" for v in range(len(program.values))]
    derived = (f"@d{k}" for k in itertools.count())
    lowered = lower(program, owner=owner, names=placeholders, host_inputs=host_inputs, bound=bound,
                    slices=slices, spmd=spmd, fresh_name=lambda: next(derived), keep=keep)
    used = {node.slice_id for node in program.nodes}
    bare = placeholders + lowered.derived
    prefixed = [f"{owner}/{p}" for p in bare]
    index = {p: i for i, p in enumerate(prefixed)}
    parts: dict[str, list[RunPart]] = {}
    island_names: dict[str, list[int]] = {}
    for scheduler, comps in lowered.schedules.items():
        island: dict[int, int] = {}  # placeholder -> its place in the island's names (first use first)
        parts[scheduler] = [dataclasses.replace(part, refs=[island.setdefault(index[name], len(island))
                                                           for name in names])
                            for part, names in referenced_parts(comps)]
        island_names[scheduler] = list(island)
    at = {b: i for i, b in enumerate(bare)}
    frozen: dict[frozenset[str], frozenset[str]] = {}
    holders = [(at[b], frozen.setdefault(frozenset(controls), frozenset(controls)))
               for b, controls in lowered.holders.items()]
    return _Template(program, {sid: slices[sid] for sid in used}, lowered, prefixed, holders, parts, island_names,
                     controls=frozenset(c.control for comps in lowered.schedules.values() for c in comps)
                     | frozenset(lowered.landing),
                     executor_ids=frozenset().union(*lowered.node_executors.values()),
                     pending={n: frozenset(ex) for n, ex in lowered.node_executors.items()},
                     temps=_temp_groups(program, dict(holders)),
                     frees=[(at[b], node, frozenset(controls)) for b, (node, controls) in lowered.frees.items()])


def _temp_groups(program: ProgramSpec, holders: dict[int, frozenset[str]]) -> TempGroups:
    """``Lowered.temps`` of ``program``: what its nodes make that it does not return, by slice and holders
    (``holders``: by value; the holder sets are the template's shared ones, so equal groups are one)."""
    outputs = set(program.outputs)
    groups: dict[tuple[int, int], tuple[int, frozenset[str], list[int]]] = {}
    values: set[int] = set()
    for node in program.nodes:
        for v in node.outputs:
            if v in outputs:
                continue
            values.add(v)
            held = holders.get(v)
            if held:  # held nowhere: nothing to free
                groups.setdefault((node.slice_id, id(held)), (node.slice_id, held, []))[2].append(v)
    return list(groups.values()), frozenset(values)


def _check_same_shape(program_id: str, cached: ProgramSpec, sent: ProgramSpec) -> None:
    if (len(cached.nodes), len(cached.values), cached.inputs, cached.outputs) != (
            len(sent.nodes), len(sent.values), sent.inputs, sent.outputs):
        raise InvalidArgument(f"program id {program_id[:16]} names another program in this session "
                              "(ids must be digests of the program's spec)")


def _instantiate(template: _Template, owner: str, names: list[str], fresh_name: Callable[[], str],
                 packed: bool) -> Lowered:
    """The template with this run's names: fresh records and containers, nothing shared that a run mutates.

    ``packed``: the run is sent as a run of the template installed on its islands (``Lowered.parts``, the
    same for every run, and ``run_names``, this run's names per island), so its computations are not
    copied (``schedules`` keeps the template's, for their nodes and executors)."""
    src = template.lowered
    derived = [fresh_name() for _ in src.derived]
    bare = names + derived
    real = [f"{owner}/{name}" for name in bare]
    by_prefix = dict(zip(template.placeholders, real, strict=True))

    def put(p: HostPut) -> HostPut:
        buffer, _, shard = p.key.rpartition("/")
        return HostPut(value=p.value, shard=p.shard, location=p.location, key=f"{by_prefix[buffer]}/{shard}",
                       layout=p.layout)

    parts: dict[str, list[RunPart]] | None = None
    run_names: dict[str, list[str]] | None = None
    if packed:
        schedules = src.schedules
        parts = template.parts
        run_names = {scheduler: [real[i] for i in island] for scheduler, island in template.island_names.items()}
    else:
        name = by_prefix.__getitem__
        schedules = {s: [renamed(c, name) for c in comps] for s, comps in src.schedules.items()}
    return Lowered(
        schedules=schedules,
        puts=[put(p) for p in src.puts],
        moves={control: [SendShards(prefix=by_prefix[m.prefix], runs=m.runs,
                                    emits=[renamed_emit(e, by_prefix.__getitem__) for e in m.emits])
                         for m in sends] for control, sends in src.moves.items()},
        # Shared with the template, not copied: a buffer's locations and holders are replaced when they change
        # (a migration), never rewritten in place (``proxy.session.Buffer``).
        produced=dict(src.produced),
        holders={bare[i]: controls for i, controls in template.holders},
        node_executors=src.node_executors,
        function_sites=src.function_sites,
        gangs=src.gangs,
        derived=derived,
        landing=src.landing,
        parts=parts,
        run_names=run_names,
        template=template,
        template_id=template.template_id,
        controls=template.controls,
        executor_ids=template.executor_ids,
        pending=template.pending,
        temps=template.temps,
        frees={bare[i]: (node, controls) for i, node, controls in template.frees},
    )
