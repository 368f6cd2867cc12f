"""Play a lowered program's dataflow with real values, in one process (no sockets, no JAX).

What the executors do with a ``Lowered``, step by step: host puts and bound buffers
land, the holders' moves are sent, computations run in program order with plain
functions, and every emit is ``cut`` into tuples that go through a ``Progress`` on
the destination's executor and are ``assemble``d there. The outputs come back
gathered, so a lowering can be checked against the program's meaning. A transfer
that is missing shows up as a computation reading a shard that never arrived, and a
short one as a destination left waiting (``PlayError``); one sent twice as progress
for a destination already complete (the destination's ``ProgressError``), or, where
the shard was already there by a put or a computation, as a shard arriving twice
(``PlayError``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from pwmesh.dataflow.exchange import Destination, Ragged, assemble, cut, expand
from pwmesh.dataflow.progress import Progress
from pwmesh.errors import PwmeshError
from pwmesh.ir.lower import Lowered, ShardLocation, shard_key, value_layout
from pwmesh.wire.messages import DataTuple, ProgramSpec, SendShards

Function = Callable[[np.ndarray], np.ndarray]  # row-wise: routed rows go through it as a plain array


class PlayError(PwmeshError):
    """The lowered program does not play through: a shard is missing, sent twice or never completed."""


class _Executors:
    """Every executor's buffers and progress: what the executors hold between messages."""

    def __init__(self) -> None:
        self.store: dict[str, dict[str, Any]] = collections.defaultdict(dict)  # executor -> key -> value
        self.progress: dict[str, Progress] = collections.defaultdict(Progress)

    def read(self, executor: str, key: str, reader: str) -> Any:
        try:
            return self.store[executor][key]
        except KeyError:
            raise PlayError(f"{reader} reads {key} on {executor}, which never arrived there") from None

    def deliver(self, tuples: list[tuple[Destination, DataTuple]]) -> None:
        """Each tuple through its destination's ``Progress``; a completed shard is assembled and stored."""
        for dest, t in [(dest, each) for dest, sent in tuples for each in expand([sent])]:
            key = f"{t.prefix}/{t.shard}"
            progress = self.progress[dest.executor_id]
            done = None
            if t.seq >= 0:
                done = progress.tuple(key, t.src, t.seq, t.sources, t)
            if t.count >= 0:
                done = progress.marker(key, t.src, t.count, t.sources) or done
            if done is not None:
                if key in self.store[dest.executor_id]:
                    raise PlayError(f"{key} arrived twice on {dest.executor_id}")
                self.store[dest.executor_id][key] = assemble(done.payloads, t)


def play(program: ProgramSpec, lowered: Lowered, functions: Mapping[str, Function], *, owner: str,
         names: Sequence[str], host: Mapping[int, np.ndarray] | None = None,
         bound: Mapping[int, np.ndarray] | None = None,
         bound_at: Mapping[int, list[ShardLocation]] | None = None) -> dict[int, np.ndarray]:
    """Play ``lowered`` (``program`` lowered for ``owner`` with buffer ``names``, as ``lower`` was
    called); returns the program's outputs, gathered.

    ``host``: the host inputs' values. ``bound``: the bound inputs' values, whose shards already
    sit where ``bound_at`` (``lower``'s ``bound``) says. ``functions``: ``fn_id`` -> what a call
    node computes, applied to each shard (calls here are row-wise: a shard's rows are its own).
    """
    host, bound, bound_at = host or {}, bound or {}, bound_at or {}
    executors = _Executors()
    holders: dict[str, str] = {}  # control address -> executor, for the moves' senders
    for v, where in bound_at.items():
        if v not in bound:
            raise PlayError(f"value {v} is bound at {len(where)} shards but has no value to play")
        parts = value_layout(program.values[v]).split(bound[v])
        for i, (w, part) in enumerate(zip(where, parts, strict=True)):
            executors.store[w.executor_id][shard_key(owner, names[v], i)] = part
            holders[w.control] = w.executor_id
    for put in lowered.puts:
        if put.value not in host:
            raise PlayError(f"host input {put.value} is put on {put.location.executor_id} but has no value to play")
        executors.store[put.location.executor_id][put.key] = put.layout.split(host[put.value])[put.shard]
    for where in lowered.produced.values():  # a reshard node's output lands with no computation; its holder
        for w in where:  # sends it on
            holders.setdefault(w.control, w.executor_id)
    moves: list[tuple[str, SendShards]] = []
    for address, sends in lowered.moves.items():
        if address not in holders:
            raise PlayError(f"moves are sent from {address}, which holds no bound shard")
        moves.extend((holders[address], send) for send in sends)

    def move() -> None:
        """Every move whose shards are there (an executor waits for what it is asked to send)."""
        while True:
            ready = [(ex, send) for ex, send in moves if all(
                f"{send.prefix}/{s}" in executors.store[ex] for r in send.runs for s in range(r.shard, r.shard + r.count))]
            if not ready:
                return
            for ex, send in ready:
                moves.remove((ex, send))
                local = {s: executors.read(ex, f"{send.prefix}/{s}", f"a move from {ex}")
                         for r in send.runs for s in range(r.shard, r.shard + r.count)}
                for emit in send.emits:
                    executors.deliver(cut(emit, local))

    computations = sorted((c for comps in lowered.schedules.values() for c in comps), key=lambda c: c.node)
    move()
    for c in computations:  # program order: a node's inputs were all made (and sent) before it
        move()
        ex = c.executor_id
        reader = f"node {c.node}"
        shards = [s for _, s in c.shards()]
        ins = [{s: executors.read(ex, f"{p}/{s}", reader) for s in shards} for p in c.inputs]
        if c.kind == "call":
            if c.fn_id not in functions:
                raise PlayError(f"{reader} calls {c.fn_id!r}, which is not among the functions given")
            fn = functions[c.fn_id]
            (arg,) = ins
            out = {s: Ragged(fn(x.array), x.index) if isinstance(x, Ragged) else fn(x) for s, x in arg.items()}
            outs = [out for _ in c.outputs]
        elif c.kind == "identity":
            outs = ins
        elif c.kind == "route" and not c.outputs:  # a route only emits, each row to its expert
            outs = []
        else:
            raise PlayError(f"{reader} is a {c.kind!r} computation with {len(c.outputs)} outputs: "
                            "not something this player knows")
        for p, out in zip(c.outputs, outs, strict=True):
            for s, x in out.items():
                executors.store[ex][f"{p}/{s}"] = x
        slots = ins + outs
        for emit in c.emits:
            executors.deliver(cut(emit, slots[emit.slot], slots[emit.selector] if emit.selector >= 0 else None))
    move()
    if moves:
        raise PlayError(f"moves never sent, their shards never there: {[send.prefix for _, send in moves]}")
    waiting = {ex: p.pending() for ex, p in executors.progress.items() if len(p)}
    if waiting:
        raise PlayError(f"destinations left waiting for more: {waiting}")
    gathered = {}
    for v in program.outputs:
        layout = value_layout(program.values[v])
        where = lowered.produced[v]
        blocks = [executors.read(where[i].executor_id, shard_key(owner, names[v], i), f"output {v}")
                  for i in layout.distinct()]
        gathered[v] = layout.assemble(blocks, np.dtype(program.values[v].dtype))
    return gathered
