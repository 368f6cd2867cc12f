"""A program run's intake in the proxy: its inputs and outputs bound to buffers (checked
before anything is lowered or sent), then, once lowered, the run and the buffers it
makes recorded in the session, and its host arrays split into puts per executor."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from pwmesh.errors import InvalidArgument, NotFound
from pwmesh.ir.lower import Lowered, ShardLocation, value_layout
from pwmesh.proxy.session import Buffer, Run, Session
from pwmesh.wire.codec import dtype_name
from pwmesh.wire.messages import ProgramSpec, PutShards, RunProgram, ValueSpec


@dataclasses.dataclass
class Binding:
    """What a run's inputs and outputs are, before it is lowered."""

    names: list[str]  # every value's buffer name
    host_data: dict[int, np.ndarray]  # values sent with the run
    bound: dict[int, list[ShardLocation]]  # values read from existing buffers: where their shards are
    pinned: list[Buffer]  # those buffers (pinned while the run reads them)
    temporaries: list[Buffer]  # buffers freed with the run
    outputs: dict[int, int]  # output value -> the client's buffer id
    donated: dict[int, tuple[int, Buffer]]  # donated input value -> (the client's id, its buffer)

    @property
    def keep(self) -> frozenset[int]:
        """Donated values the executors must not consume: someone else may still read them."""
        return frozenset(v for v, (_, buf) in self.donated.items() if not buf.consumable)


def bind(session: Session, msg: RunProgram, program: ProgramSpec) -> Binding:
    """Check a run's inputs and outputs against its program and name every value; nothing changes."""
    if len(msg.inputs) != len(program.inputs) or len(msg.outputs) != len(program.outputs):
        raise InvalidArgument(
            f"program takes {len(program.inputs)} inputs and {len(program.outputs)} outputs; "
            f"got {len(msg.inputs)} and {len(msg.outputs)}")
    names: list[str] = [""] * len(program.values)
    host_data: dict[int, np.ndarray] = {}
    bound: dict[int, list[ShardLocation]] = {}
    pinned: list[Buffer] = []
    temporaries: list[Buffer] = []
    donated_values = {node.inputs[k] for node in program.nodes for k in node.donate}
    donated: dict[int, tuple[int, Buffer]] = {}
    donated_ids: set[int] = set()  # of their buffers (a training step donates ~100: no quadratic check)
    for v, inp in zip(program.inputs, msg.inputs, strict=True):
        spec = program.values[v]
        if inp.buffer is not None:
            buf = session.buffers.get(inp.buffer)
            if buf is None:
                if inp.buffer in session.donated:
                    raise InvalidArgument(f"buffer {inp.buffer} was donated to {session.donated[inp.buffer]} and "
                                          "can no longer be used")
                raise NotFound(f"buffer {inp.buffer} does not exist (deleted, or never made)")
            if buf.spec.shape != spec.shape or buf.spec.dtype != spec.dtype:
                raise InvalidArgument(f"input {v}: buffer is {buf.spec.dtype}{buf.spec.shape}, "
                                      f"program expects {spec.dtype}{spec.shape}")
            if (buf.spec.sharding, buf.spec.shards) != (spec.sharding, spec.shards) and (
                    buf.spec.shards != spec.shards or not value_layout(buf.spec).same_blocks(value_layout(spec))):
                raise InvalidArgument(f"input {v}: buffer {inp.buffer} is laid out as {value_layout(buf.spec)}, "
                                      f"the program expects {value_layout(spec)}")
            if buf.lost is not None:
                raise buf.lost
            if buf.error is not None:  # its computation failed: whatever reads it fails with the same cause
                raise buf.error
            names[v], bound[v] = buf.name, buf.locations
            pinned.append(buf)
            if v in donated_values:
                if id(buf) in donated_ids:
                    raise InvalidArgument(f"buffer {inp.buffer} is donated twice in one run")
                donated_ids.add(id(buf))
                donated[v] = (inp.buffer, buf)
        elif inp.array is not None:
            if list(inp.array.shape) != spec.shape or dtype_name(inp.array.dtype) != spec.dtype:
                raise InvalidArgument(f"input {v}: array is {inp.array.dtype}{list(inp.array.shape)}, "
                                      f"program expects {spec.dtype}{spec.shape}")
            names[v] = session.temp_name()
            host_data[v] = inp.array
            temporaries.append(Buffer.new(names[v], spec, client_ref=False))
        else:
            raise InvalidArgument(f"input {v} has neither an array nor a buffer")
    if len(set(msg.outputs)) != len(msg.outputs):
        raise InvalidArgument(f"output buffer ids must be distinct, got {msg.outputs}")
    outputs: dict[int, int] = {}
    for v, cid in zip(program.outputs, msg.outputs, strict=True):
        if cid in session.buffers or v in outputs or names[v]:
            raise InvalidArgument(f"output buffer {cid} (value {v}) is already taken or is an input")
        outputs[v] = cid
        names[v] = session.buffer_name(cid)
    for v, name in enumerate(names):
        if not name:
            names[v] = session.temp_name()
    if donated and len({id(b) for b in pinned}) != len(pinned):
        passed = collections.Counter(id(b) for b in pinned)
        if any(passed[id(buf)] > 1 for _, buf in donated.values()):
            raise InvalidArgument("a donated buffer is passed to the same run again: it is consumed by the one "
                                  "call it is given to")
    return Binding(names, host_data, bound, pinned, temporaries, outputs, donated)


def record_run(session: Session, run_id: str, program: ProgramSpec, lowered: Lowered, binding: Binding) -> Run:
    """Record a lowered run and the buffers it makes in the session (nothing can fail from here on)."""
    names, outputs, pinned, temporaries = binding.names, binding.outputs, binding.pinned, binding.temporaries
    # A cached lowering's reporters and executors are shared, frozen (a node's set is copied if an executor's
    # own report must shrink it: ``Run.pending``); a run lowered alone builds its own.
    pending: dict[int, set[str] | frozenset[str]] = (
        dict(lowered.pending) if lowered.pending is not None else
        {n: set(ex) for n, ex in lowered.node_executors.items()})
    executors = lowered.controls if lowered.controls is not None else frozenset(
        {c.control for comps in lowered.schedules.values() for c in comps} | lowered.landing)
    run = Run(run_id=run_id, pending=pending, outputs_of={}, pinned=pinned, temporaries=temporaries,
              executors=executors, schedulers=set(lowered.schedules), gangs=bool(lowered.gangs), frees=lowered.frees)
    for buf in pinned:
        buf.pins += 1
        buf.readers += 1
        more = lowered.holders.get(buf.name)
        if more and more is not buf.holders:  # (a cached lowering's, shared by its runs: once taken, one look)
            if buf.holders <= more:
                buf.holders = more  # shared, never changed in place (a change replaces it)
            elif not more <= buf.holders:
                buf.holders = buf.holders | more  # (a new set: the old one may be a cached lowering's, shared)
    for client_id, buf in binding.donated.values():  # the run consumes it: the client's reference ends here
        buf.client_ref = False
        session.donate(client_id, run_id)
        run.donated.append((client_id, buf))
    for name in lowered.derived:  # reshards and landings: freed with the run
        temporaries.append(Buffer.new(name, ValueSpec(shape=[], dtype="float32", shards=0), client_ref=False))
    for buf in temporaries:
        buf.holders = lowered.holders.get(buf.name, set())
    read = {v for node in program.nodes for v in node.inputs}
    named: frozenset[int] = frozenset()
    if lowered.temps is not None:  # a cached lowering's: its temporaries are names, freed by group
        groups, named = lowered.temps
        run.named_temps = [(slice_id, held, [names[v] for v in values]) for slice_id, held, values in groups]
    for index, node in enumerate(program.nodes):
        made = []
        for v in node.outputs:
            if v in named:
                continue
            buf = Buffer.new(names[v], program.values[v], client_ref=v in outputs)
            if v in read and v in outputs:  # until this run ends, its own nodes may read it: not consumable
                buf.read_by_its_run = True
                run.read_inside.append(buf)
            buf.locations = lowered.produced[v]
            buf.slice_id = node.slice_id
            buf.holders = lowered.holders.get(buf.name, set())
            made.append(buf)
            if v in outputs:
                session.buffers[outputs[v]] = buf
                buf.pins += 1  # until the run finishes: a release meanwhile must not delete under it
                run.outputs.append(buf)
            else:
                temporaries.append(buf)
        if made:
            run.outputs_of[index] = made
    session.runs[run.run_id] = run
    return run


def host_puts(lowered: Lowered, host_data: dict[int, np.ndarray]) -> dict[str, PutShards]:
    """The shards of the arrays sent with a run, one batch per executor."""
    puts: dict[str, PutShards] = {}
    blocks: dict[tuple[int, object], list[np.ndarray]] = {}
    for put in lowered.puts:
        split = blocks.get((put.value, put.layout))
        if split is None:
            split = blocks[(put.value, put.layout)] = put.layout.split(host_data[put.value])
        batch = puts.setdefault(put.location.control, PutShards(keys=[], devices=[], arrays=[]))
        batch.keys.append(put.key)
        batch.devices.append(put.location.device)
        batch.arrays.append(split[put.shard])
    return puts
