"""Lowering: a device-agnostic program plus a placement → per-island, per-executor work.

Pure: no sockets, no JAX. Every node becomes one ``Computation`` per executor
that holds some of its shards (never one message per shard), its shards given
as runs of contiguous devices, so what the proxy sends does not grow with the
number of devices. A value lives on the devices of a slice, one shard per device,
each the block its layout gives that device (``pwmesh.dataflow.layout``: blocks of
any dimensions over a logical mesh, replicas included; without a ``sharding``,
equal blocks along the leading axis); shard ``i`` of a buffer lives under
``"<owner>/<buffer>/<i>"`` on the executor that holds it. Where a value must be
elsewhere than where it was made — on another executor, or in another layout —
its producer (or the executor that holds it) gets an ``Emit``: send your shards
onward as shard-tagged tuples, and the consumers' progress tracking says when they
are complete (``pwmesh.dataflow``). A value read in another layout than its own is
resharded into a derived buffer of its own, freed with the run's temporaries. A reshard node
whose every block moves (a weight sync) has no computation at all: the blocks land straight
under its output's name, and each destination executor reports the node done once its shards
are stored (``Target.node``).
Routed values (``ragged``) go from a route node to one expert each and come back
through a combine node (mixture-of-experts).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable

import numpy as np

from pwmesh.dataflow.layout import Layout, check_split
from pwmesh.errors import InvalidArgument
from pwmesh.ir.graph import donation_error
from pwmesh.ir.keys import blockwise_id, gang_id
from pwmesh.wire.codec import dtype_from_name
from pwmesh.wire.messages import (
    Computation,
    Emit,
    GangRange,
    NodeSpec,
    PhysicalDevice,
    ProgramSpec,
    RegisterGang,
    RunPart,
    SendShards,
    Sharding,
    ShardRun,
    Site,
    SliceInfo,
    Target,
    ValueSpec,
)


def shard_key(owner: str, buffer: str, shard: int) -> str:
    return f"{owner}/{buffer}/{shard}"


def split_key(key: str) -> tuple[str, str, int] | None:
    """``(owner, buffer, shard)`` of a ``shard_key``; None for what is not one."""
    parts = key.split("/")
    if len(parts) != 3 or not parts[2].isdigit():
        return None
    return parts[0], parts[1], int(parts[2])


@dataclasses.dataclass(frozen=True, slots=True)
class ShardLocation:
    executor_id: str
    control: str
    data: str
    device: int
    island: int
    host: str = ""
    group: str = ""  # the executor's JAX group ("" for none)
    _hash: int = dataclasses.field(default=0, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        """Kept once made: a run's lowering is looked up by its inputs' locations (``ir.cache._key``), a
        training step's ~200 of them each time, and a dataclass hashes all seven fields on every call."""
        h = self._hash
        if not h:
            h = hash((self.executor_id, self.control, self.data, self.device, self.island, self.host, self.group)) or 1
            object.__setattr__(self, "_hash", h)
        return h


def location(d: PhysicalDevice) -> ShardLocation:
    """``d``'s location, one object for equal ones: a run's lowering is looked up by its inputs' locations
    (``ir.cache._key``), and a tuple compares identical elements without calling their ``__eq__`` (a
    dataclass's builds two 7-tuples: ~0.5 us, for each of a training step's ~600 locations)."""
    fields = (d.executor_id, d.control, d.data, d.device, d.island, d.host, d.group)
    found = _LOCATIONS.get(fields)
    if found is None:
        if len(_LOCATIONS) >= MAX_INTERNED_LOCATIONS:  # a cluster's devices, over its life: a bound, not a cache
            _LOCATIONS.clear()
        found = _LOCATIONS[fields] = ShardLocation(*fields)
    return found


MAX_INTERNED_LOCATIONS = 1 << 20
_LOCATIONS: dict[tuple[str, str, str, int, int, str, str], ShardLocation] = {}


def slice_locations(sl: SliceInfo) -> list[ShardLocation]:
    return [location(d) for d in sl.devices]


@dataclasses.dataclass(frozen=True)
class Gang:
    """An SPMD node's devices when they span executors: what each of those executors is sent once
    (``RegisterGang``, by the proxy), so that the node's computations carry only its id."""

    message: RegisterGang
    controls: tuple[str, ...]  # its executors' control addresses, each sent ``message`` once


# An SPMD node over executors that share no JAX group: each runs its devices' part of the partitioned
# program alone, as a per-device function (``blockwise_id``), which works when that part needs no
# peers (no collectives; the executor refuses the function, with why, when it does).
BLOCKWISE = Gang(RegisterGang(gang_id="", devices=[]), ())


def cross_host_gang(index: int, devs: list[ShardLocation]) -> Gang | None:
    """An SPMD node's devices, in shard order, when they span several executors (their collectives then
    join across processes, through the executors' JAX group); None when they fit one; ``BLOCKWISE`` when
    they span executors in no one JAX group."""
    if len({d.executor_id for d in devs}) == 1:
        return None
    groups = {d.group for d in devs}
    if len(groups) != 1 or "" in groups:
        return BLOCKWISE
    ranges: list[GangRange] = []
    controls: dict[str, None] = {}
    for d in devs:
        last = ranges[-1] if ranges else None
        if last is not None and last.executor_id == d.executor_id and d.device == last.first + last.count:
            last.count += 1
        else:
            ranges.append(GangRange(executor_id=d.executor_id, first=d.device))
        controls.setdefault(d.control)
    return Gang(RegisterGang(gang_id=gang_id(ranges), devices=ranges), tuple(controls))


def runs_of(pairs: list[tuple[int, int]]) -> list[ShardRun]:
    """(device, shard) pairs as runs: consecutive devices holding consecutive shards share one."""
    runs: list[ShardRun] = []
    for device, shard in pairs:
        last = runs[-1] if runs else None
        if last is not None and device == last.device + last.count and shard == last.shard + last.count:
            last.count += 1
        else:
            runs.append(ShardRun(device=device, shard=shard, count=1))
    return runs


def sites_of(layout: list[ShardLocation], shards: list[int] | None = None) -> list[Site]:
    """The executors of ``layout`` (those holding ``shards``; default all) with their runs."""
    wanted = range(len(layout)) if shards is None else shards
    by_executor: dict[str, list[tuple[int, int]]] = {}
    first: dict[str, ShardLocation] = {}
    for j in wanted:
        where = layout[j]
        by_executor.setdefault(where.executor_id, []).append((where.device, j))
        first.setdefault(where.executor_id, where)
    return [Site(executor_id=ex, data=first[ex].data, host=first[ex].host, runs=runs_of(pairs))
            for ex, pairs in by_executor.items()]


@dataclasses.dataclass
class HostPut:
    """Shard ``shard`` of host input ``value``, cut as ``layout`` says, goes to ``location`` under ``key``."""

    value: int
    shard: int
    location: ShardLocation
    key: str
    layout: Layout


def value_layout(spec: ValueSpec) -> Layout:
    """How a value is cut over its ``shards`` devices."""
    return Layout.of(spec.shape, spec.sharding, spec.shards)


def wire_sharding(layout: Layout) -> Sharding:
    return Sharding(mesh=list(layout.mesh), spec=[list(axes) for axes in layout.spec])


# (slice id, the controls holding them, the values), and the values among them all.
TempGroups = tuple[list[tuple[int, frozenset[str], list[int]]], frozenset[int]]


@dataclasses.dataclass
class Lowered:
    schedules: dict[str, list[Computation]]  # scheduler address -> computations in program order
    puts: list[HostPut]
    moves: dict[str, list[SendShards]]  # holder's control address -> sends of existing buffers
    produced: dict[int, list[ShardLocation]]  # computed value -> where each shard was made
    holders: dict[str, set[str] | frozenset[str]]  # buffer name -> control addresses holding any of its shards
    node_executors: dict[int, set[str]]  # node -> executors that report its completion
    function_sites: dict[str, set[tuple[str, tuple[int, ...]]]]  # fn_id -> {(control, devices)}
    gangs: dict[str, Gang] = dataclasses.field(default_factory=dict)  # the gangs its computations name, by id
    derived: list[str] = dataclasses.field(default_factory=list)  # buffers lowering made (reshards): temporaries
    # The executors (control addresses) that report reshard nodes landed with no computation (``Target.node``):
    # the run needs them as it needs those its computations run on.
    landing: set[str] = dataclasses.field(default_factory=set)
    # A cached lowering's packed parts per scheduler (see ir.cache), installed there once
    # (``InstallTemplate``), and this run's names per scheduler (``RunTemplate``); the schedules'
    # computations then name placeholders, not this run's buffers.
    parts: dict[str, list[RunPart]] | None = None
    run_names: dict[str, list[str]] | None = None
    # The cached lowering this run was made from (``ir.cache``; None: lowered for this run alone). Its
    # identity lasts as long as the cache keeps it: the proxy remembers per template what it already did.
    template: object | None = dataclasses.field(default=None, compare=False)
    template_id: str = dataclasses.field(default="", compare=False)  # its id where it is installed
    # A cached lowering's, made once (``ir.cache``): the controls of every executor its runs take part in, the
    # ids of those that report completions, and each node's reporters, frozen: a warm run shares them rather
    # than build sets of every executor again (None: lowered for this run alone, computed from the above).
    controls: frozenset[str] | None = dataclasses.field(default=None, compare=False)
    executor_ids: frozenset[str] | None = dataclasses.field(default=None, compare=False)
    pending: dict[int, frozenset[str]] | None = dataclasses.field(default=None, compare=False)
    # A cached lowering's temporaries (values its nodes make that are not the program's outputs), made once:
    # by the slice of the node making them and the controls holding them, one group per (slice, holders).
    # A warm run records them as names (``proxy.session.Run.named_temps``), not a buffer each.
    temps: TempGroups | None = dataclasses.field(default=None, compare=False)
    # Buffers (by name) the executors delete themselves once the node reading them last ran without error
    # (``Computation.frees``): name -> (that node, the controls that delete it). When the node succeeded and
    # nobody else holds the buffer, the proxy sends no delete for it (``ProxyState._finish_run``).
    frees: dict[str, tuple[int, set[str] | frozenset[str]]] = dataclasses.field(default_factory=dict)


def validate(program: ProgramSpec) -> None:
    """Structural checks: ids in range, every value defined once before it is read."""
    n_values = len(program.values)
    defined = set()
    for v in program.inputs:
        if not 0 <= v < n_values:
            raise InvalidArgument(f"program input {v} is not a value (program has {n_values})")
        if v in defined:
            raise InvalidArgument(f"value {v} is listed twice among the program's inputs")
        defined.add(v)
    for index, node in enumerate(program.nodes):
        for v in node.inputs:
            if v not in defined:
                raise InvalidArgument(f"node {index} reads value {v} before anything defines it")
        for v in node.outputs:
            if not 0 <= v < n_values or v in defined:
                raise InvalidArgument(f"node {index} defines value {v}, which is out of range or defined already")
            defined.add(v)
    for v in program.outputs:
        if v not in defined:
            raise InvalidArgument(f"program output {v} is never defined")
        if program.values[v].ragged:
            raise InvalidArgument(f"program output {v} is routed rows; combine the experts' outputs first")
    for index, node in enumerate(program.nodes):
        _validate_node(program, index, node)
    read = {v for node in program.nodes for v in node.inputs} | set(program.outputs)
    computed = {v for node in program.nodes for v in node.outputs}  # an output nobody reads is made and freed
    for v, spec in enumerate(program.values):
        if v not in read and v not in computed and spec.shards != 1:
            raise InvalidArgument(f"value {v} is never read, so it cannot be split ({spec.shards} shards)")
        if spec.shards < 1 or any(d < 0 for d in spec.shape):
            raise InvalidArgument(f"value {v} has an invalid layout: shape {spec.shape}, {spec.shards} shards")
        if spec.sharding is None:
            if spec.shards > 1 and (not spec.shape or spec.shape[0] % spec.shards):
                raise InvalidArgument(
                    f"value {v} of shape {tuple(spec.shape)} cannot be split into {spec.shards} equal shards "
                    "along its leading axis"
                )
        else:
            layout = value_layout(spec)
            layout.check(f"value {v}")
            if layout.devices != spec.shards:
                raise InvalidArgument(f"value {v} lives on {spec.shards} devices but its mesh "
                                      f"{spec.sharding.mesh} has {layout.devices}")
    for index, node in enumerate(program.nodes):
        for k in node.donate:
            if not 0 <= k < len(node.inputs):
                raise InvalidArgument(f"node {index} donates input {k}; it has {len(node.inputs)}")
    unsafe = donation_error(program)
    if unsafe is not None:
        raise InvalidArgument(unsafe)


def _validate_node(program: ProgramSpec, index: int, node: NodeSpec) -> None:
    values = program.values
    ragged_in = [v for v in node.inputs if values[v].ragged]
    if node.kind == "call":
        if ragged_in and len(node.inputs) != 1:
            raise InvalidArgument(f"node {index} reads routed rows and {len(node.inputs) - 1} other values; "
                                  "an expert takes its routed rows alone")
        if any(values[v].ragged != bool(ragged_in) for v in node.outputs):
            raise InvalidArgument(f"node {index}: an expert's outputs are routed rows exactly when its input is")
        if ragged_in and any(values[v].shape[:1] != values[ragged_in[0]].shape[:1] for v in node.outputs):
            raise InvalidArgument(f"node {index}: an expert must return one row for each row it gets")
    elif node.kind == "route":
        if len(node.inputs) != 2 or not node.outputs or len(node.outputs) != len(node.targets):
            raise InvalidArgument(f"route node {index} takes (rows, expert ids) and names a slice per output")
        x, experts = (values[v] for v in node.inputs)
        if not x.shape or x.ragged or experts.shape != x.shape[:1] or not np.issubdtype(experts.dtype, np.integer):
            raise InvalidArgument(f"route node {index}: expert ids must be integers of shape {x.shape[:1]}, one "
                                  f"per row of the routed value {x.shape}; got {experts.dtype}{experts.shape}")
        for v in node.outputs:
            out = values[v]
            if not out.ragged or out.shards != 1 or out.shape != x.shape or out.dtype != x.dtype:
                raise InvalidArgument(f"route node {index}: output {v} must be routed rows like {x.shape} "
                                      f"{x.dtype}, on one device")
    elif node.kind == "combine":
        if len(node.outputs) != 1 or not node.inputs or len(ragged_in) != len(node.inputs):
            raise InvalidArgument(f"combine node {index} takes the experts' routed outputs and makes one value")
        out = values[node.outputs[0]]
        if out.ragged or any(values[v].shape != out.shape or values[v].dtype != out.dtype for v in node.inputs):
            raise InvalidArgument(f"combine node {index}: every expert output must be {out.dtype}{out.shape}")
    elif node.kind == "reshard":
        if len(node.inputs) != 1 or len(node.outputs) != 1:
            raise InvalidArgument(f"reshard node {index} takes one value and makes one")
        x, y = values[node.inputs[0]], values[node.outputs[0]]
        if x.ragged or y.ragged or (x.shape, x.dtype) != (y.shape, y.dtype):
            raise InvalidArgument(f"reshard node {index} turns {x.dtype}{x.shape} into {y.dtype}{y.shape}; "
                                  "a reshard keeps shape and dtype")
    else:
        raise InvalidArgument(f"node {index} has unknown kind {node.kind!r} (call, reshard, route or combine)")
    if node.kind != "call" and (node.fn_id or node.in_shardings or node.donate):
        raise InvalidArgument(f"{node.kind} node {index} runs no function (no function, input layouts or donation)")
    if node.in_shardings:
        if len(node.in_shardings) != len(node.inputs):
            raise InvalidArgument(f"node {index} gives {len(node.in_shardings)} input layouts for "
                                  f"{len(node.inputs)} inputs")
        for k, (v, sharding) in enumerate(zip(node.inputs, node.in_shardings, strict=True)):
            Layout.of(values[v].shape, sharding, 1).check(f"node {index} input {k}")
    for v in node.outputs:
        if values[v].ragged and values[v].shards != 1:
            raise InvalidArgument(f"value {v} is routed rows split {values[v].shards} ways; they live on one device")


def lower(
    program: ProgramSpec,
    *,
    owner: str,
    names: list[str],
    host_inputs: set[int],
    bound: dict[int, list[ShardLocation]],
    slices: dict[int, SliceInfo],
    spmd: dict[str, bool],
    fresh_name: Callable[[], str] | None = None,
    keep: frozenset[int] = frozenset(),
) -> Lowered:
    """Lower ``program``; ``names[v]`` is the buffer name of value ``v``; ``bound`` locates existing
    buffers; ``fresh_name`` names the buffers lowering derives (reshards, combine landings); ``keep``:
    donated values the executors must not consume after all (someone else still reads them)."""
    validate(program)
    return _Lowering(program, owner, names, host_inputs, bound, slices, spmd, fresh_name, keep).run()


class _Lowering:
    def __init__(self, program: ProgramSpec, owner: str, names: list[str], host_inputs: set[int],
                 bound: dict[int, list[ShardLocation]], slices: dict[int, SliceInfo], spmd: dict[str, bool],
                 fresh_name: Callable[[], str] | None, keep: frozenset[int]) -> None:
        self.program = program
        self.program_outputs = frozenset(program.outputs)
        self.readers = collections.Counter(v for node in program.nodes for v in node.inputs)
        self.keep = keep
        self.owner = owner
        self.names = names
        self.host_inputs = host_inputs
        self.slices = slices
        self.spmd = spmd
        counter = iter(range(1 << 62))
        self.fresh_name = fresh_name or (lambda: f"derived{next(counter)}")
        self.out = Lowered(schedules={}, puts=[], moves={}, produced={}, holders={}, node_executors={},
                           function_sites={})
        self.loc: dict[int, list[ShardLocation]] = dict(bound)  # where each shard of a value was made
        self.producer: dict[int, int] = {}  # value -> node
        self.comps: dict[tuple[int, str], Computation] = {}  # (node, executor) -> its computation
        self.placed: set[tuple[str, int, str]] = set()  # (buffer, shard, executor) present or on its way
        self.layouts: dict[tuple[int, Layout, tuple[str, ...]], str] = {}  # (value, layout, executors) -> buffer
        self.bound_emits: dict[tuple[int, str], SendShards] = {}  # (value, holder) -> its sends
        self.slice_gangs: dict[int, Gang | None] = {}  # slice -> its gang (an SPMD node's), made once
        self.landed: set[int] = set()  # values reshard nodes land with no computation (``land``)
        for v, where in bound.items():
            if len(where) != program.values[v].shards:
                raise InvalidArgument(f"input value {v} is bound to a buffer with {len(where)} shards, "
                                      f"the program expects {program.values[v].shards}")
            for i, w in enumerate(where):
                self.placed.add((names[v], i, w.executor_id))
                self.hold(names[v], w)

    def prefix(self, buffer: str) -> str:
        return f"{self.owner}/{buffer}"

    def hold(self, buffer: str, where: ShardLocation) -> None:
        held = self.out.holders.get(buffer)
        if held is None:
            self.out.holders[buffer] = {where.control}
        elif isinstance(held, set):  # (while lowering always: only a cached lowering's runs share frozen ones)
            held.add(where.control)

    def run(self) -> Lowered:
        for index, node in enumerate(self.program.nodes):
            sl = self.slices.get(node.slice_id)
            if sl is None:
                raise InvalidArgument(f"node {index} runs on slice {node.slice_id}, which this session does not own")
            devs = slice_locations(sl)
            if node.kind == "call":
                self.call(index, node, devs, sl.scheduler)
            elif node.kind == "route":
                self.route(index, node, devs, sl.scheduler)
            elif node.kind == "reshard":
                (v,) = node.inputs
                (w,) = node.outputs
                if self.program.values[w].shards != len(devs):
                    raise InvalidArgument(f"reshard node {index} runs on {len(devs)} devices but its output {w} "
                                          f"lives on {self.program.values[w].shards}")
                if self.program.values[w].sharding is None:
                    check_split(self.program.values[w].shape, len(devs), f"reshard node {index} reads value {v} "
                                f"on {len(devs)} devices")
                want = value_layout(self.program.values[w])
                if not self.land(index, v, w, devs, want):
                    inputs = [self.prefix(self.materialize(v, devs, want, f"reshard node {index}"))]
                    self.computations(index, node, devs, sl.scheduler, kind="identity", inputs=inputs,
                                      outputs=[self.prefix(self.names[w]) for w in node.outputs])
                self.made(index, node.outputs, devs)
            else:
                self.combine(index, node, devs, sl.scheduler)
        return self.out

    # ------------------------------------------------------------------ nodes

    def computations(self, index: int, node: NodeSpec, devs: list[ShardLocation], scheduler: str, *,
                     kind: str, inputs: list[str], outputs: list[str], spmd: bool = False,
                     ragged: bool = False) -> list[Computation]:
        """One computation per executor holding shards of ``node``, in program order on its scheduler."""
        by_executor: dict[str, list[tuple[int, int]]] = {}
        control: dict[str, str] = {}  # one pass: looking each executor up in ``devs`` made this O(N^2)
        for j, dev in enumerate(devs):
            by_executor.setdefault(dev.executor_id, []).append((dev.device, j))
            control.setdefault(dev.executor_id, dev.control)
        made = []
        quiet = not any(v in self.program_outputs for v in node.outputs)
        for executor_id, pairs in by_executor.items():
            comp = Computation(node=index, fn_id=node.fn_id if kind == "call" else "", executor_id=executor_id,
                               control=control[executor_id], runs=runs_of(pairs), inputs=inputs, outputs=outputs,
                               spmd=spmd, kind=kind, ragged=ragged, quiet=quiet)
            self.comps[(index, executor_id)] = comp
            self.out.schedules.setdefault(scheduler, []).append(comp)
            made.append(comp)
        self.out.node_executors[index] = set(by_executor)
        return made

    def call(self, index: int, node: NodeSpec, devs: list[ShardLocation], scheduler: str) -> None:
        if node.fn_id not in self.spmd:
            raise InvalidArgument(f"node {index} calls function {node.fn_id[:12]}, which was never registered")
        n = len(devs)
        values = self.program.values
        is_spmd = self.spmd[node.fn_id]
        gang = None
        blockwise = False
        if is_spmd:
            if node.slice_id not in self.slice_gangs:
                self.slice_gangs[node.slice_id] = cross_host_gang(index, devs)
            gang = self.slice_gangs[node.slice_id]
            if gang is BLOCKWISE:
                gang, blockwise = None, True
            elif gang is not None:
                self.out.gangs[gang.message.gang_id] = gang
        for v in node.outputs:
            if values[v].shards != n:
                raise InvalidArgument(f"node {index} runs on {n} devices but its output {v} is split "
                                      f"{values[v].shards} ways")
        inputs = []
        read = []  # the buffer each input is read from (unprefixed)
        ragged = False
        for k, v in enumerate(node.inputs):
            if values[v].ragged:
                ragged = True
                if self.loc.get(v) != devs:
                    raise InvalidArgument(f"node {index} reads routed value {v} on slice {node.slice_id}, but the "
                                          "route sends it to another slice (call each expert on its own slice)")
                read.append(self.names[v])
            else:
                sharding = node.in_shardings[k] if node.in_shardings else None
                if sharding is None:  # equal leading-axis blocks: a scalar cannot be cut so
                    check_split(values[v].shape, n, f"node {index} reads value {v} on {n} devices")
                want = Layout.of(values[v].shape, sharding, n)
                if want.devices != n:
                    raise InvalidArgument(f"node {index} reads input {k} over a mesh of {want.devices} devices; "
                                          f"it runs on {n}")
                read.append(self.materialize(v, devs, want, f"node {index}"))
        inputs = [self.prefix(name) for name in read]
        comps = self.computations(index, node, devs, scheduler, kind="call", inputs=inputs,
                                  outputs=[self.prefix(self.names[v]) for v in node.outputs],
                                  spmd=is_spmd and not blockwise, ragged=ragged)
        donate = [k for k in node.donate if node.inputs[k] not in self.keep]
        # What nothing reads after it: what it consumes, and a value sent with the run that it alone reads. Its
        # executors delete a buffer whole, so only one whose shards there are all theirs: not a value made
        # here whose shards went to executors its producer's devices did not map them to (an ancestor on the
        # producer's slice may still be reading the other shard there).
        held_elsewhere = self.held_elsewhere({read[k] for k in donate}, devs) if donate else set()
        frees = [k for k in donate if read[k] not in held_elsewhere] + [
            k for k, v in enumerate(node.inputs) if k not in donate and v in self.host_inputs and self.readers[v] == 1
            and v not in self.program_outputs]
        for k in frees:
            self.out.frees[read[k]] = (index, {comp.control for comp in comps})
        for comp in comps:
            comp.donate = donate
            comp.frees = frees
            comp.gang = gang.message.gang_id if gang is not None else ""
            if blockwise:
                comp.fn_id = blockwise_id(node.fn_id, {r.device + k: r.shard + k for r in comp.runs
                                                       for k in range(r.count)})
        for comp in comps:
            devices = tuple(r.device + k for r in comp.runs for k in range(r.count))
            sites = {(comp.control, devices)} if is_spmd and not blockwise else {(comp.control, (d,)) for d in devices}
            self.out.function_sites.setdefault(node.fn_id, set()).update(sites)
        self.made(index, node.outputs, devs)

    def held_elsewhere(self, names: set[str], devs: list[ShardLocation]) -> set[str]:
        """Those of ``names`` of which some executor holds a shard that a node on ``devs`` does not read there
        (one pass over what is placed, not one per name)."""
        read = {(j, dev.executor_id) for j, dev in enumerate(devs)}
        return {buffer for buffer, j, executor in self.placed if buffer in names and (j, executor) not in read}

    def route(self, index: int, node: NodeSpec, devs: list[ShardLocation], scheduler: str) -> None:
        """Rows of ``inputs[0]`` go to the expert ``inputs[1]`` names: output ``k`` lands on ``targets[k]``."""
        x, experts = node.inputs
        values = self.program.values
        inputs = []
        for v in (x, experts):
            check_split(values[v].shape, len(devs), f"route node {index} reads value {v} on {len(devs)} devices")
            want = Layout.blocks(values[v].shape, len(devs))
            inputs.append(self.prefix(self.materialize(v, devs, want, f"route node {index}")))
        targets = []
        for k, (v, slice_id) in enumerate(zip(node.outputs, node.targets, strict=True)):
            sl = self.slices.get(slice_id)
            if sl is None:
                raise InvalidArgument(f"route node {index} sends expert {k} to slice {slice_id}, "
                                      "which this session does not own")
            where = slice_locations(sl)
            if len(where) != 1:
                raise InvalidArgument(f"expert {k} runs on a slice of {len(where)} devices; an expert runs on one")
            spec = values[v]
            targets.append(Target(prefix=self.prefix(self.names[v]), shards=1, sites=sites_of(where),
                                  shape=list(spec.shape), dtype=spec.dtype))
            self.loc[v] = where
            self.out.produced[v] = where
            self.hold(self.names[v], where[0])
        emit = Emit(mode="route", rows=values[x].shape[0], src_shards=len(devs), targets=targets, slot=0,
                    selector=1)
        for comp in self.computations(index, node, devs, scheduler, kind="route", inputs=inputs, outputs=[]):
            comp.emits.append(emit)
        for v in node.outputs:
            self.producer[v] = index

    def combine(self, index: int, node: NodeSpec, devs: list[ShardLocation], scheduler: str) -> None:
        """The experts' rows come back to ``outputs[0]`` in row order, split over ``devs``."""
        (y,) = node.outputs
        spec = self.program.values[y]
        n = len(devs)
        check_split(spec.shape, n, f"combine node {index}'s output")
        if spec.shards != n:
            raise InvalidArgument(f"combine node {index} runs on {n} devices but its output {y} is split "
                                  f"{spec.shards} ways")
        landing = self.fresh_name()
        self.out.derived.append(landing)
        target = Target(prefix=self.prefix(landing), shards=n, sites=sites_of(devs),
                        shape=shard_shape(spec.shape, n), dtype=spec.dtype)
        for k, v in enumerate(node.inputs):
            made_by = self.producer.get(v)
            if made_by is None or self.program.nodes[made_by].kind != "call":
                raise InvalidArgument(f"combine node {index} reads value {v}, which no expert computed")
            for comp in (c for (i, _), c in self.comps.items() if i == made_by):
                slot = len(comp.inputs) + self.program.nodes[made_by].outputs.index(v)
                comp.emits.append(Emit(mode="scatter", rows=spec.shape[0], src_shards=len(node.inputs),
                                       targets=[target], slot=slot, source=k))
        for dev in devs:
            self.hold(landing, dev)
        self.computations(index, node, devs, scheduler, kind="identity", inputs=[self.prefix(landing)],
                          outputs=[self.prefix(self.names[y])])
        self.made(index, node.outputs, devs)

    def land(self, index: int, v: int, w: int, devs: list[ShardLocation], want: Layout) -> bool:
        """Reshard node ``index`` (``v`` to ``w`` on ``devs``, laid out as ``want``) with no computation, where
        every shard of ``w`` must move: ``v``'s blocks land straight under ``w``'s name, and each executor of
        ``devs`` reports the node done once its shards are stored (``Target.node``). Not for a host input (put
        where it is read), nor where the blocks are there already or copied there for another reader (a
        computation stores them under ``w``'s name)."""
        spec = self.program.values[v]
        if v in self.host_inputs or self.layouts.get(layout_key(v, want, devs)) is not None:
            return False
        want.check(f"reshard node {index} reads value {v} on {len(devs)} devices")
        same = value_layout(spec).same_blocks(want)
        name = self.names[v]
        missing = any((name, j, dev.executor_id) not in self.placed for j, dev in enumerate(devs))
        if same and (v in self.producer or not missing):
            return False
        emit = block_emit(spec, self.prefix(self.names[w]), want, sites_of(devs))
        emit.targets[0].node = index
        self.emit_from(v, emit)
        self.out.node_executors[index] = {dev.executor_id for dev in devs}
        self.out.landing.update(dev.control for dev in devs)
        self.landed.add(w)
        return True

    def made(self, index: int, outputs: list[int], devs: list[ShardLocation]) -> None:
        for v in outputs:
            self.loc[v] = devs
            self.producer[v] = index
            self.out.produced[v] = devs
            for j, dev in enumerate(devs):
                self.placed.add((self.names[v], j, dev.executor_id))
                self.hold(self.names[v], dev)

    # ------------------------------------------------------------------ edges

    def materialize(self, v: int, devs: list[ShardLocation], want: Layout, reader: str) -> str:
        """Make shard ``j`` of value ``v``, cut as ``want`` says, present on ``devs[j]``'s executor;
        returns the buffer name it is there under (``v``'s own, or a reshard of it)."""
        spec = self.program.values[v]
        want.check(f"{reader} reads value {v} on {len(devs)} devices")
        have = value_layout(spec)
        if v in self.host_inputs:
            name = self.names[v]
            if not have.same_blocks(want):
                name = self.layouts.get(layout_key(v, want, devs)) or self.layout_name(v, want, devs)
            for j, dev in enumerate(devs):
                if (name, j, dev.executor_id) not in self.placed:
                    self.placed.add((name, j, dev.executor_id))
                    self.out.puts.append(HostPut(value=v, shard=j, location=dev, key=shard_key(self.owner, name, j),
                                                 layout=want))
                    self.hold(name, dev)
            return name
        name = self.names[v]
        missing = [j for j, dev in enumerate(devs) if (name, j, dev.executor_id) not in self.placed]
        same = have.same_blocks(want)
        if same and not missing:
            return name
        # Made by this run and laid out alike: copy the missing shards under its own name. Resharded,
        # or an existing buffer read elsewhere: into a buffer of this run's own, freed with it.
        if not same or v not in self.producer:
            made = self.layouts.get(layout_key(v, want, devs))
            if made is not None:
                return made
            name = self.layout_name(v, want, devs)
            missing = list(range(len(devs)))
        for j in missing:
            self.placed.add((name, j, devs[j].executor_id))
            self.hold(name, devs[j])
        self.emit_from(v, block_emit(spec, self.prefix(name), want, sites_of(devs, missing)))
        return name

    def layout_name(self, v: int, want: Layout, devs: list[ShardLocation]) -> str:
        name = self.fresh_name()
        self.layouts[layout_key(v, want, devs)] = name
        self.out.derived.append(name)
        return name

    def emit_from(self, v: int, emit: Emit) -> None:
        """Attach ``emit`` to whatever holds ``v``'s shards: its producer's computations, or the holders."""
        made_by = self.producer.get(v)
        if made_by is not None and v not in self.landed:  # (a landed reshard's output has no computation)
            outputs = self.program.nodes[made_by].outputs
            for (i, _), comp in self.comps.items():
                if i == made_by:
                    comp.emits.append(dataclasses.replace(emit, slot=len(comp.inputs) + outputs.index(v)))
            return
        by_holder: dict[str, list[tuple[int, int]]] = {}
        holder: dict[str, ShardLocation] = {}
        for i, where in enumerate(self.loc[v]):
            by_holder.setdefault(where.executor_id, []).append((where.device, i))
            holder[where.executor_id] = where
        for executor_id, pairs in by_holder.items():
            send = self.bound_emits.get((v, executor_id))
            if send is None:
                send = SendShards(prefix=self.prefix(self.names[v]), runs=runs_of(pairs), emits=[])
                self.bound_emits[(v, executor_id)] = send
                self.out.moves.setdefault(holder[executor_id].control, []).append(send)
            send.emits.append(emit)


def move_shard(spec: ValueSpec, prefix: str, shard: int, new: PhysicalDevice) -> Emit:
    """The emit that copies shard ``shard`` of a buffer, as it is, to device ``new`` (a drained host's)."""
    site = Site(executor_id=new.executor_id, data=new.data, host=new.host,
                runs=[ShardRun(device=new.device, shard=shard)])
    return block_emit(spec, prefix, value_layout(spec), [site])


def shard_shape(shape: list[int], shards: int) -> list[int]:
    """One of ``shards`` equal leading-axis blocks of ``shape``."""
    return [shape[0] // shards, *shape[1:]] if shape else []


def block_emit(spec: ValueSpec, prefix: str, want: Layout, sites: list[Site]) -> Emit:
    """Send the value ``spec`` (as it is laid out) to ``sites`` of its layout ``want``, under ``prefix``.
    Leading-axis blocks on both sides travel in the compact form (no shape, no shardings)."""
    have = value_layout(spec)
    plain = have == Layout.blocks(have.shape, have.devices) and want == Layout.blocks(want.shape, want.devices)
    target = Target(prefix=prefix, shards=want.devices, sites=sites, shape=list(want.shard_shape), dtype=spec.dtype,
                    sharding=None if plain else wire_sharding(want))
    return Emit(mode="block", rows=spec.shape[0] if spec.shape else 1, src_shards=have.devices, targets=[target],
                shape=None if plain else list(spec.shape), src=None if plain else wire_sharding(have))


def layout_key(v: int, want: Layout, devs: list[ShardLocation]) -> tuple[int, Layout, tuple[str, ...]]:
    """Value ``v`` laid out as ``want`` over these executors: one copy serves every device of each."""
    return (v, want, tuple(d.executor_id for d in devs))


def nbytes(shape: list[int], dtype: str) -> int:
    # By the wire's name lookup: a proxy that never decoded a bfloat16 array does not know the name otherwise
    # (fetching a bfloat16 result failed with "data type 'bfloat16' not understood").
    return math.prod(shape) * dtype_from_name(dtype).itemsize
