"""Workloads for the simulator, written as client scripts of real messages (see ``sim.client``).

The Figure-5 comparison of the Pathways paper: a chain of ``k`` tiny computations
(each ``compute_seconds`` on every device of a slice) run

- ``opbyop``: as ``k`` separate programs of one node, each fed the previous one's output
  (the client does not wait between them: dispatch is asynchronous);
- ``chained``: as one program of ``k`` nodes, registered once and run by id;
- ``fused``: as one program of one node whose function does the ``k`` steps' work.

Then ``pipeline``: ``stages`` stages, stage ``s`` on a slice of island ``s % islands``,
``microbatches`` microbatches, one program per step (GPipe's forward pass); and
``clients``: many clients with weights, each keeping ``backlog`` runs of a one-node
program in flight on slices that share devices, for ``duration_seconds``.

Each step is marked ``step`` ... ``step_end`` (the client waited for its outputs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from pwmesh.errors import InvalidArgument
from pwmesh.ir.keys import function_id
from pwmesh.sim.client import Call, Mark, Op, Post, Script, SimClient
from pwmesh.sim.cluster import SimCluster
from pwmesh.sim.cost import FunctionCost
from pwmesh.wire.messages import (
    AwaitBuffers,
    CreateSlice,
    NodeSpec,
    OpenSession,
    ProgramInput,
    ProgramSpec,
    PutBuffer,
    RegisterProgram,
    RegisterProgramFunction,
    ReleaseBuffers,
    RunProgram,
    SliceCreated,
    SliceInfo,
    ValueSpec,
)

WORKLOADS = ("opbyop", "chained", "fused", "pipeline", "clients")


@dataclasses.dataclass(frozen=True)
class Workload:
    """What to run. Shapes are per device: every value is ``rows`` x ``cols`` float32 on each device."""

    name: str = "chained"
    steps: int = 10
    k: int = 16  # computations in the chain (opbyop, chained, fused)
    devices: int = 8  # devices per slice
    compute_seconds: float | None = 10e-6  # per computation per device; None: the roofline of its shapes
    rows: int = 8
    cols: int = 128
    exported_bytes: int = 4096  # a function artifact's size on the wire
    spmd: bool = False  # functions are one program over the slice (pw.jit; a gang across hosts), not per device
    stages: int = 4  # pipeline
    microbatches: int = 4
    in_flight: int = 1  # steps dispatched ahead of the one awaited (not clients: see backlog)
    clients: int = 4  # clients
    weights: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    backlog: int = 4
    duration_seconds: float = 0.05

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise InvalidArgument(f"unknown workload {self.name!r}; choose one of {', '.join(WORKLOADS)}")
        if min(self.steps, self.k, self.devices, self.rows, self.cols, self.stages, self.microbatches,
               self.clients, self.backlog, self.in_flight) < 1 or not self.weights or min(self.weights) <= 0:
            raise InvalidArgument(f"every count must be at least 1 and weights positive: {self}")


def value(w: Workload) -> ValueSpec:
    return ValueSpec(shape=[w.devices * w.rows, w.cols], dtype="float32", shards=w.devices)


def function(w: Workload, name: str, seconds: float | None) -> FunctionCost:
    shard = (w.rows, w.cols)
    return FunctionCost(name=name, in_shapes=(shard,), out_shapes=(shard,), seconds=seconds)


def register(fn: FunctionCost, slice_id: int, w: Workload) -> tuple[str, RegisterProgramFunction]:
    exported = fn.artifact(w.exported_bytes)
    fn_id = function_id(exported, w.spmd)
    return fn_id, RegisterProgramFunction(fn_id=fn_id, exported=exported, slice_id=slice_id, spmd=w.spmd)


def chain(fn_ids: list[str], slice_ids: list[int], spec: ValueSpec) -> ProgramSpec:
    """``x -> f0 -> f1 -> ...``: node ``i`` runs ``fn_ids[i]`` on ``slice_ids[i]``."""
    n = len(fn_ids)
    return ProgramSpec(values=[spec] * (n + 1), inputs=[0], outputs=[n], nodes=[
        NodeSpec(fn_id=fn_ids[i], slice_id=slice_ids[i], inputs=[i], outputs=[i + 1]) for i in range(n)])


def _session(name: str, w: Workload, weight: float = 1.0,
             island: int | None = None) -> Generator[Op, Any, SliceInfo]:
    """Open a session and make a slice; the script's value is the slice."""
    yield Call(OpenSession(name=name, weight=weight))
    created = yield Call(CreateSlice(devices=w.devices, island=island))
    assert isinstance(created, SliceCreated)
    return created.slice


def _put(buffer: int, slice_id: int, w: Workload) -> Call:
    return Call(PutBuffer(buffer=buffer, slice_id=slice_id, array=np.zeros((w.devices * w.rows, w.cols), np.float32)))


def figure5(w: Workload, name: str = "c0") -> Callable[[SimClient], Script]:
    """OpByOp, Chained or Fused (``w.name``)."""
    def script(client: SimClient) -> Script:
        sl = yield from _session(name, w)
        spec = value(w)
        if w.name == "fused":
            seconds = None if w.compute_seconds is None else w.compute_seconds * w.k
            fn = function(w, "fused", seconds)
            if seconds is None:  # the roofline of k steps' work
                fn = dataclasses.replace(fn, flops=float(w.k * w.rows * w.cols))
            fns = [fn]
        else:
            fns = [function(w, f"op{i}", w.compute_seconds) for i in range(w.k)]
        ids = []
        for fn in fns:
            fn_id, reg = register(fn, sl.slice_id, w)
            yield Call(reg)
            ids.append(fn_id)
        if w.name == "opbyop":
            for i, fn_id in enumerate(ids):
                yield Post(RegisterProgram(program_id=f"op{i}", program=chain([fn_id], [sl.slice_id], spec)))
        else:
            yield Post(RegisterProgram(program_id="step", program=chain(ids, [sl.slice_id] * len(ids), spec)))
        yield _put(0, sl.slice_id, w)
        next_id = 1

        def submit() -> Generator[Op, Any, list[int]]:
            nonlocal next_id
            if w.name == "opbyop":
                made, source = [], 0
                for i in range(w.k):
                    yield Post(RunProgram(inputs=[ProgramInput(buffer=source)], outputs=[next_id], program_id=f"op{i}"))
                    made.append(next_id)
                    source, next_id = next_id, next_id + 1
            else:
                made = [next_id]
                yield Post(RunProgram(inputs=[ProgramInput(buffer=0)], outputs=[next_id], program_id="step"))
                next_id += 1
            return made

        yield from _steps(w, submit, last_only=True)

    return script


def pipeline(w: Workload, islands: int, name: str = "c0") -> Callable[[SimClient], Script]:
    """``w.stages`` stages over the islands in turn, ``w.microbatches`` microbatches, one program per step."""
    def script(client: SimClient) -> Script:
        yield Call(OpenSession(name=name))
        slices = []
        for s in range(w.stages):
            created = yield Call(CreateSlice(devices=w.devices, island=s % islands))
            slices.append(created.slice.slice_id)
        ids = []
        for s in range(w.stages):
            fn_id, reg = register(function(w, f"stage{s}", w.compute_seconds), slices[s], w)
            yield Call(reg)
            ids.append(fn_id)
        spec, m, n = value(w), w.microbatches, w.stages
        # Values: m inputs, then stage s of microbatch b makes value m + b * n + s.
        nodes = [NodeSpec(fn_id=ids[s], slice_id=slices[s], inputs=[b if s == 0 else m + b * n + s - 1],
                          outputs=[m + b * n + s]) for b in range(m) for s in range(n)]
        program = ProgramSpec(values=[spec] * (m + m * n), inputs=list(range(m)), nodes=nodes,
                              outputs=[m + b * n + n - 1 for b in range(m)])
        yield Post(RegisterProgram(program_id="pipeline", program=program))
        for b in range(m):
            yield _put(b, slices[0], w)
        next_id = m

        def submit() -> Generator[Op, Any, list[int]]:
            nonlocal next_id
            outs = list(range(next_id, next_id + m))
            next_id += m
            yield Post(RunProgram(inputs=[ProgramInput(buffer=b) for b in range(m)], outputs=outs,
                                  program_id="pipeline"))
            return outs

        yield from _steps(w, submit, last_only=False)

    return script


def _steps(w: Workload, submit: Callable[[], Generator[Op, Any, list[int]]], last_only: bool) -> Script:
    """``w.steps`` steps, each marked ``step`` ... ``step_end``: steps are sent (``submit``: a step's messages,
    returning the values it makes) until ``w.in_flight`` are in flight, then the oldest is awaited (its last
    value only, with ``last_only``: a chain's end) and its values released. With ``in_flight`` > 1 the next
    steps are dispatched while one runs (a JAX loop's asynchronous dispatch): a step is then the time between
    two steps' ends."""
    running: list[list[int]] = []  # each step's values, oldest first
    submitted = 0
    for _ in range(w.steps):
        yield Mark("step")
        while submitted < w.steps and len(running) < w.in_flight:
            running.append((yield from submit()))
            submitted += 1
        made = running.pop(0)
        yield Call(AwaitBuffers(buffers=made[-1:] if last_only else made))
        yield Mark("step_end")
        yield Post(ReleaseBuffers(buffers=made))


def weighted(w: Workload, index: int) -> Callable[[SimClient], Script]:
    """One of many clients: keeps ``w.backlog`` runs in flight until ``w.duration_seconds``; marks ``run_done``."""
    weight = w.weights[index % len(w.weights)]

    def script(client: SimClient) -> Script:
        sl = yield from _session(f"c{index}", w, weight=weight, island=0)
        fn_id, reg = register(function(w, "op", w.compute_seconds), sl.slice_id, w)
        yield Call(reg)
        yield Post(RegisterProgram(program_id="op", program=chain([fn_id], [sl.slice_id], value(w))))
        yield _put(0, sl.slice_id, w)
        in_flight: list[int] = []
        next_id = 1
        while client.clock.now < w.duration_seconds:
            while len(in_flight) < w.backlog:
                yield Post(RunProgram(inputs=[ProgramInput(buffer=0)], outputs=[next_id], program_id="op"))
                in_flight.append(next_id)
                next_id += 1
            oldest = in_flight.pop(0)
            yield Call(AwaitBuffers(buffers=[oldest]))
            yield Mark("run_done")
            yield Post(ReleaseBuffers(buffers=[oldest]))
        if in_flight:
            yield Call(AwaitBuffers(buffers=in_flight))
            yield Post(ReleaseBuffers(buffers=in_flight))

    return script


def install(cluster: SimCluster, w: Workload) -> None:
    """Add the workload's clients to ``cluster``."""
    if w.name in ("opbyop", "chained", "fused"):
        cluster.add_client("c0", figure5(w))
    elif w.name == "pipeline":
        cluster.add_client("c0", pipeline(w, cluster.config.islands))
    else:
        for i in range(w.clients):
            cluster.add_client(f"c{i}", weighted(w, i))
