"""Lowering: a device-agnostic program plus a placement → per-island, per-executor work.

Pure: no sockets, no JAX. Every node becomes one ``Computation`` per executor
that holds some of its shards (never one message per shard across the cluster);
every edge whose producer and consumer shard sit on different executors gets a
``SendTask`` on the producer, straight to the consumer's data plane. Values are
sharded in blocks along their leading axis; shard ``i`` of a value lives under
the object-store key ``"<owner>/<buffer>/<i>"`` on every executor that holds it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pwmesh.errors import InvalidArgument
from pwmesh.wire.messages import Computation, ProgramSpec, SendTask, ShardTask, SliceInfo


def shard_key(owner: str, buffer: str, shard: int) -> str:
    return f"{owner}/{buffer}/{shard}"


@dataclasses.dataclass(frozen=True, slots=True)
class ShardLocation:
    executor_id: str
    control: str
    data: str
    device: int
    island: int


def slice_locations(sl: SliceInfo) -> list[ShardLocation]:
    return [ShardLocation(d.executor_id, d.control, d.data, d.device, d.island) for d in sl.devices]


@dataclasses.dataclass
class HostPut:
    """Shard ``shard`` of host input ``value`` goes to ``location`` under ``key``."""

    value: int
    shard: int
    location: ShardLocation
    key: str


@dataclasses.dataclass
class Lowered:
    schedules: dict[str, list[Computation]]  # scheduler address -> computations in program order
    puts: list[HostPut]
    moves: dict[str, list[SendTask]]  # holder's control address -> copies of existing buffers
    produced: dict[int, list[ShardLocation]]  # computed value -> where each shard was made
    holders: dict[str, set[str]]  # buffer name -> control addresses holding any of its shards
    node_executors: dict[int, set[str]]  # node -> executors that report its completion
    function_sites: dict[str, set[tuple[str, tuple[int, ...]]]]  # fn_id -> {(control, devices)}


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
    read = {v for node in program.nodes for v in node.inputs} | set(program.outputs)
    for v, spec in enumerate(program.values):
        if v not in read and spec.shards != 1:
            raise InvalidArgument(f"value {v} is never read, so it cannot be split ({spec.shards} shards)")
        if spec.shards < 1 or any(d < 0 for d in spec.shape):
            raise InvalidArgument(f"value {v} has an invalid layout: shape {spec.shape}, {spec.shards} shards")
        if spec.shards > 1 and (not spec.shape or spec.shape[0] % spec.shards):
            raise InvalidArgument(
                f"value {v} of shape {tuple(spec.shape)} cannot be split into {spec.shards} equal shards "
                "along its leading axis"
            )


def shard_slices(shape: list[int], shards: int) -> list[slice]:
    """The leading-axis block of each shard."""
    if shards == 1 and not shape:
        return [slice(None)]
    step = shape[0] // shards
    return [slice(i * step, (i + 1) * step) for i in range(shards)]


def split_host_array(array: np.ndarray, shards: int) -> list[np.ndarray]:
    if shards == 1:
        return [array]
    return [array[s] for s in shard_slices(list(array.shape), shards)]


def lower(
    program: ProgramSpec,
    *,
    owner: str,
    names: list[str],
    host_inputs: set[int],
    bound: dict[int, list[ShardLocation]],
    slices: dict[int, SliceInfo],
    spmd: dict[str, bool],
) -> Lowered:
    """Lower ``program``; ``names[v]`` is the buffer name of value ``v``; ``bound`` locates existing buffers."""
    validate(program)
    loc: dict[int, list[ShardLocation]] = dict(bound)
    producer: dict[int, int] = {}
    comps: dict[tuple[int, str], Computation] = {}
    out = Lowered(schedules={}, puts=[], moves={}, produced={}, holders={}, node_executors={}, function_sites={})
    placed: set[tuple[int, int, str]] = set()  # (value, shard, executor) already present or on its way

    def hold(v: int, where: ShardLocation) -> None:
        out.holders.setdefault(names[v], set()).add(where.control)

    for v, where in bound.items():
        if len(where) != program.values[v].shards:
            raise InvalidArgument(f"input value {v} is bound to a buffer with {len(where)} shards, "
                                  f"the program expects {program.values[v].shards}")
        for i, w in enumerate(where):
            placed.add((v, i, w.executor_id))
            hold(v, w)

    for index, node in enumerate(program.nodes):
        sl = slices.get(node.slice_id)
        if sl is None:
            raise InvalidArgument(f"node {index} runs on slice {node.slice_id}, which this session does not own")
        if node.fn_id not in spmd:
            raise InvalidArgument(f"node {index} calls function {node.fn_id[:12]}, which was never registered")
        devs = slice_locations(sl)
        n = len(devs)
        for v in (*node.inputs, *node.outputs):
            if program.values[v].shards != n:
                raise InvalidArgument(
                    f"node {index} runs on {n} devices but value {v} has {program.values[v].shards} shards; "
                    "resharding between different shard counts is not supported yet"
                )
        is_spmd = spmd[node.fn_id]
        if is_spmd and len({d.executor_id for d in devs}) > 1:
            raise InvalidArgument(
                f"node {index} uses collectives over a slice that spans several executors; "
                "cross-host collectives are not supported yet (ask for a slice that fits one host)"
            )
        out.node_executors[index] = {d.executor_id for d in devs}
        site_devices: dict[str, list[int]] = {}
        for i, dev in enumerate(devs):
            comp = comps.get((index, dev.executor_id))
            if comp is None:
                comp = Computation(node=index, fn_id=node.fn_id, executor_id=dev.executor_id, control=dev.control,
                                   shards=[], sends=[], spmd=is_spmd)
                comps[(index, dev.executor_id)] = comp
                out.schedules.setdefault(sl.scheduler, []).append(comp)
            site_devices.setdefault(dev.control, []).append(dev.device)
            for v in node.inputs:
                _route_input(v, i, dev, owner, names, host_inputs, loc, producer, comps, placed, out)
                hold(v, dev)
            comp.shards.append(ShardTask(
                device=dev.device,
                inputs=[shard_key(owner, names[v], i) for v in node.inputs],
                outputs=[shard_key(owner, names[v], i) for v in node.outputs],
            ))
            for v in node.outputs:
                hold(v, dev)
        # A node on several executors is one gang: each part waits for the others.
        if len(site_devices) > 1:
            for dev in devs:
                comp = comps[(index, dev.executor_id)]
                comp.peers = sorted(c for c in site_devices if c != comp.control)
        for control, devices in site_devices.items():
            if is_spmd:
                out.function_sites.setdefault(node.fn_id, set()).add((control, tuple(devices)))
            else:
                for d in devices:
                    out.function_sites.setdefault(node.fn_id, set()).add((control, (d,)))
        for v in node.outputs:
            loc[v] = devs
            producer[v] = index
            out.produced[v] = devs
            for i, dev in enumerate(devs):
                placed.add((v, i, dev.executor_id))
    return out


def _route_input(v: int, i: int, dev: ShardLocation, owner: str, names: list[str], host_inputs: set[int],
                 loc: dict[int, list[ShardLocation]], producer: dict[int, int],
                 comps: dict[tuple[int, str], Computation], placed: set[tuple[int, int, str]], out: Lowered) -> None:
    """Make shard ``i`` of value ``v`` present on ``dev``'s executor."""
    if (v, i, dev.executor_id) in placed:
        return
    placed.add((v, i, dev.executor_id))
    key = shard_key(owner, names[v], i)
    if v in host_inputs:
        out.puts.append(HostPut(value=v, shard=i, location=dev, key=key))
        return
    src = loc[v][i]
    task = SendTask(key=key, dest_executor=dev.executor_id, dest_data=dev.data, dest_device=dev.device)
    if v in producer:
        comps[(producer[v], src.executor_id)].sends.append(task)
    else:
        out.moves.setdefault(src.control, []).append(task)


def nbytes(shape: list[int], dtype: str) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize
