"""Tracing programs into dataflow graphs, and running them.

A traced program has one node per call of a compiled function (never one per
shard) and one value per logical buffer. Inside ``@pw.program`` arguments are
``Symbol``s: shape and dtype only, no data. Calling a compiled function outside
any program traces a one-node program, so both paths share one dispatch.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from pwmesh.client.array import Array
from pwmesh.dataflow.layout import check_split
from pwmesh.errors import InvalidArgument
from pwmesh.wire.codec import pack_records
from pwmesh.wire.messages import NodeSpec, ProgramInput, ProgramSpec, RunProgram, ValueSpec

if TYPE_CHECKING:
    from pwmesh.client.api import Client
    from pwmesh.client.devices import Slice
    from pwmesh.client.functions import ExportedFunction, MappedFunction

_building: contextvars.ContextVar[ProgramBuilder | None] = contextvars.ContextVar("pwmesh_builder", default=None)


class Symbol:
    """A value inside a program being traced: shape and dtype, no data."""

    __slots__ = ("builder", "value", "shape", "dtype")

    def __init__(self, builder: ProgramBuilder, value: int, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.builder = builder
        self.value = value
        self.shape = shape
        self.dtype = dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise InvalidArgument("this value is symbolic inside @pw.program; return it from the program to fetch it")

    def __repr__(self) -> str:
        return f"pw.Symbol(shape={self.shape}, dtype={self.dtype})"


class NeedsStaging(Exception):
    """Raised while tracing symbolically when a host function needs concrete values."""


class ProgramBuilder:
    def __init__(self, concrete: list[Any] | None = None) -> None:
        self.values: list[ValueSpec] = []
        self.nodes: list[NodeSpec] = []
        self.inputs: list[int] = []
        self.functions: dict[str, tuple[ExportedFunction, int]] = {}
        self.client: Client | None = None
        self._shards_fixed: set[int] = set()
        # Staged tracing (a program with host functions): the call's real arguments,
        # and once a host function ran, every value so far as an Array or host array.
        self.concrete = concrete
        self.flushed: dict[int, Any] | None = None
        self.sequential = False

    def host_call(self, hf: HostFunction, args: Sequence[Any]) -> Any:
        """A data-dependent step: dispatch what was traced so far, wait for the inputs, run ``hf``.
        Everything after it is dispatched node by node, once its inputs exist (sequential)."""
        if self.concrete is None:
            raise NeedsStaging()
        if self.flushed is None:
            self._flush()
        leaves, tree = jax.tree_util.tree_flatten(list(args))
        values = _host_values([self._concrete(leaf) for leaf in leaves])
        return hf.fn(*jax.tree_util.tree_unflatten(tree, values))

    def _concrete(self, leaf: Any) -> Any:
        if isinstance(leaf, Symbol):
            assert self.flushed is not None and leaf.builder is self
            return self.flushed[leaf.value]
        return leaf

    def _flush(self) -> None:
        """Dispatch the program traced so far (in parallel), its every computed value an output."""
        assert self.concrete is not None
        self.flushed = dict(zip(self.inputs, self.concrete, strict=True))
        computed = [v for node in self.nodes for v in node.outputs]
        if not computed:
            return
        assert self.client is not None
        spec = ProgramSpec(values=self.values, nodes=self.nodes, inputs=self.inputs, outputs=computed)
        traced = TracedProgram(spec, list(self.functions.values()), jax.tree_util.tree_structure(computed),
                               self.client)
        outs = execute(traced, self.concrete, sequential=self.sequential)
        self.flushed.update(zip(computed, outs, strict=True))

    def _value(self, shape: tuple[int, ...], dtype: np.dtype, shards: int, *, ragged: bool = False) -> int:
        self.values.append(ValueSpec(shape=list(shape), dtype=np.dtype(dtype).name, shards=shards, ragged=ragged))
        self._shards_fixed.add(len(self.values) - 1)
        return len(self.values) - 1

    def _fix_shards(self, sym: Symbol, n: int) -> None:
        """A program input takes the layout of its first reader."""
        if sym.value not in self._shards_fixed:
            self.values[sym.value].shards = n
            self._shards_fixed.add(sym.value)

    def _symbols(self, what: str, args: Sequence[Any], client: Client) -> list[Symbol]:
        for i, leaf in enumerate(args):
            if not isinstance(leaf, Symbol) or leaf.builder is not self:
                raise InvalidArgument(
                    f"{what}: argument {i} is a {type(leaf).__name__}; inside @pw.program, pass every "
                    "array in as an argument of the program"
                )
        if self.client is None:
            self.client = client
        elif client is not self.client:
            raise InvalidArgument(f"{what} belongs to another client than the rest of this program")
        return list(args)

    def reshard(self, x: Any, sl: Slice) -> Symbol:
        """``x`` split ``len(sl)`` ways over ``sl``'s devices (a move, a gather or a scatter)."""
        (sym,) = self._symbols("pw.reshard", [x], sl.client)
        n = len(sl.devices)
        check_split(sym.shape, n, f"pw.reshard onto {n} devices")
        v = self._value(sym.shape, sym.dtype, n)
        self.nodes.append(NodeSpec(fn_id="", slice_id=sl.slice_id, inputs=[sym.value], outputs=[v], kind="reshard"))
        return Symbol(self, v, sym.shape, sym.dtype)

    def route(self, x: Any, expert_ids: Any, experts: Sequence[MappedFunction], home: Slice) -> Symbol:
        """Rows of ``x`` to ``experts[expert_ids[row]]``, and their results back in row order on ``home``."""
        sym, ids = self._symbols("pw.Router", [x, expert_ids], home.client)
        n = len(home.devices)
        for s in (sym, ids):
            self._fix_shards(s, n)
        parts = [self._value(sym.shape, sym.dtype, 1, ragged=True) for _ in experts]
        self.nodes.append(NodeSpec(fn_id="", slice_id=home.slice_id, inputs=[sym.value, ids.value], outputs=parts,
                                   kind="route", targets=[e.slice.slice_id for e in experts]))
        results = []
        for expert, part in zip(experts, parts, strict=True):
            out = expert(Symbol(self, part, sym.shape, sym.dtype))
            if not isinstance(out, Symbol):
                raise InvalidArgument(f"expert {expert.__name__} must return one array, one row per row it gets")
            results.append(out)
        first = results[0]
        for expert, out in zip(experts, results, strict=True):
            if (out.shape, out.dtype) != (first.shape, first.dtype):
                raise InvalidArgument(f"experts return different shapes: {expert.__name__} gives "
                                      f"{out.dtype}{out.shape}, {experts[0].__name__} {first.dtype}{first.shape}")
        check_split(first.shape, n, f"pw.Router combining the experts' output onto {n} devices")
        y = self._value(first.shape, first.dtype, n)
        self.nodes.append(NodeSpec(fn_id="", slice_id=home.slice_id, inputs=[r.value for r in results], outputs=[y],
                                   kind="combine"))
        return Symbol(self, y, first.shape, first.dtype)

    def input(self, shape: tuple[int, ...], dtype: np.dtype, shards: int | None) -> Symbol:
        v = self._value(shape, dtype, shards or 1)
        if shards is None:  # host data: split the way its first reader needs
            self._shards_fixed.discard(v)
        self.inputs.append(v)
        return Symbol(self, v, tuple(shape), np.dtype(dtype))

    def call(self, mf: MappedFunction, args: Sequence[Any]) -> Any:
        if self.flushed is not None:  # past a host function: each call is its own program
            concrete = [self._concrete(a) for a in jax.tree_util.tree_leaves(list(args))]
            concrete_args = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(list(args)), concrete)
            return execute(mf.eager.get(concrete_args), concrete_args)
        leaves = self._symbols(mf.__name__, jax.tree_util.tree_leaves(list(args)), mf.slice.client)
        exported = mf.export_for([jax.ShapeDtypeStruct(s.shape, s.dtype) for s in leaves])
        n = mf.num_devices
        ragged = any(self.values[sym.value].ragged for sym in leaves)
        if ragged and n != 1:
            raise InvalidArgument(f"{mf.__name__} gets routed rows but runs on {n} devices; an expert runs on one")
        for sym in leaves:
            self._fix_shards(sym, n)  # a value split another way is resharded on its way in
        outs = []
        for aval in exported.out_avals:
            v = self._value(tuple(aval.shape), np.dtype(aval.dtype), n, ragged=ragged)
            outs.append(Symbol(self, v, tuple(aval.shape), np.dtype(aval.dtype)))
        self.nodes.append(NodeSpec(fn_id=exported.fn_id, slice_id=mf.slice.slice_id,
                                   inputs=[s.value for s in leaves], outputs=[s.value for s in outs]))
        self.functions[exported.fn_id] = (exported, mf.slice.slice_id)
        return jax.tree_util.tree_unflatten(exported.out_tree, outs)


@dataclasses.dataclass
class TracedProgram:
    spec: ProgramSpec
    functions: list[tuple[ExportedFunction, int]]
    out_tree: Any
    client: Client
    program_id: str = ""  # a traced program kept for reuse is registered with the proxy under its digest


def _leaf_signature(leaf: Any) -> tuple[Any, ...]:
    if isinstance(leaf, Array):
        return ("buffer", leaf.shape, leaf.dtype.name, leaf.shards)
    arr = np.asarray(leaf)
    return ("host", arr.shape, jax.dtypes.canonicalize_dtype(arr.dtype).name)


def _call_symbolically(builder: ProgramBuilder, fn: Any, args: Sequence[Any]) -> Any:
    """``fn`` called with a program input ``Symbol`` for every array leaf of ``args``."""
    leaves, in_tree = jax.tree_util.tree_flatten(list(args))
    symbols = []
    for leaf in leaves:
        kind, shape, dtype, *shards = _leaf_signature(leaf)
        symbols.append(builder.input(tuple(shape), np.dtype(dtype), shards[0] if shards else None))
    token = _building.set(builder)
    try:
        return fn(*jax.tree_util.tree_unflatten(in_tree, symbols))
    finally:
        _building.reset(token)


def _host_values(leaves: list[Any]) -> list[Any]:
    """``leaves`` with every ``pw.Array`` fetched (in parallel) into a host array."""
    arrays = [leaf for leaf in leaves if isinstance(leaf, Array)]
    if not arrays:
        return leaves
    fetched = dict(zip(map(id, arrays), arrays[0]._client.fetch(arrays), strict=True))
    return [fetched.get(id(leaf), leaf) for leaf in leaves]


def trace(fn: Any, args: Sequence[Any]) -> TracedProgram:
    """Trace ``fn(*args)`` where array leaves of ``args`` become program inputs."""
    builder = ProgramBuilder()
    result = _call_symbolically(builder, fn, args)
    out_leaves, out_tree = jax.tree_util.tree_flatten(result)
    for i, leaf in enumerate(out_leaves):
        if not isinstance(leaf, Symbol) or leaf.builder is not builder:
            raise InvalidArgument(f"program output {i} is a {type(leaf).__name__}; a program returns values "
                                  "computed by its compiled functions")
        if leaf.value in builder.inputs:
            raise InvalidArgument(f"program output {i} is one of its inputs; return only computed values")
    if builder.client is None:
        raise InvalidArgument("a program must call at least one compiled function (pw.pmap)")
    spec = ProgramSpec(values=builder.values, nodes=builder.nodes, inputs=builder.inputs,
                       outputs=[s.value for s in out_leaves])
    return TracedProgram(spec, list(builder.functions.values()), out_tree, builder.client)


class ProgramCache:
    """Traced programs by the signature of their arguments (pytree shape, shapes, dtypes, layouts)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self._lock = threading.Lock()
        self._traced: dict[tuple[Any, ...], TracedProgram] = {}

    def get(self, args: Sequence[Any]) -> TracedProgram:
        leaves, in_tree = jax.tree_util.tree_flatten(list(args))
        key = (in_tree, tuple(_leaf_signature(leaf) for leaf in leaves))
        with self._lock:
            traced = self._traced.get(key)
        if traced is None:
            traced = trace(self.fn, args)
            traced.program_id = hashlib.sha256(pack_records([traced.spec])).hexdigest()
            with self._lock:
                self._traced[key] = traced
        return traced


def execute(traced: TracedProgram, args: Sequence[Any], *, sequential: bool = False) -> Any:
    """Dispatch a traced program without waiting for it; returns its outputs as ``pw.Array`` futures."""
    client = traced.client
    leaves = jax.tree_util.tree_leaves(list(args))
    inputs = []
    for leaf in leaves:
        if isinstance(leaf, Array):
            leaf._check_alive()
            if leaf._client is not client:
                raise InvalidArgument("a pw.Array can only be used with the client that made it")
            inputs.append(ProgramInput(buffer=leaf.buffer_id))
        else:
            inputs.append(ProgramInput(array=client.canonical(leaf)))
    for exported, slice_id in traced.functions:
        client.ensure_function(exported, slice_id)
    ids = [client.new_buffer_id() for _ in traced.spec.outputs]
    if traced.program_id:  # registered once; each run names it (the proxy caches its lowering)
        client.ensure_program(traced.program_id, traced.spec)
        run = RunProgram(program_id=traced.program_id, inputs=inputs, outputs=ids, sequential=sequential)
    else:  # traced for this run only (a staged program)
        run = RunProgram(program=traced.spec, inputs=inputs, outputs=ids, sequential=sequential)
    client.conn.post(run)
    outs = []
    for buffer_id, v in zip(ids, traced.spec.outputs, strict=True):
        spec = traced.spec.values[v]
        outs.append(Array(client, buffer_id, tuple(spec.shape), np.dtype(spec.dtype), spec.shards))
    return jax.tree_util.tree_unflatten(traced.out_tree, outs)


def call_mapped(mf: MappedFunction, args: Sequence[Any]) -> Any:
    """A compiled function called inside a program adds a node; called outside, it runs as its own program."""
    builder = _building.get()
    if builder is not None:
        return builder.call(mf, args)
    return execute(mf.eager.get(args), args)


class HostFunction:
    """``pw.host(fn)``: a host-side step on concrete values (numpy in, numpy out), whose
    output shape may depend on the data. Inside ``@pw.program`` what comes before it is
    dispatched as one parallel program; what follows waits for its result (sequential)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "host")

    def __call__(self, *args: Any) -> Any:
        builder = _building.get()
        if builder is not None:
            return builder.host_call(self, args)
        leaves, tree = jax.tree_util.tree_flatten(list(args))
        return self.fn(*jax.tree_util.tree_unflatten(tree, _host_values(leaves)))


def host(fn: Any) -> HostFunction:
    """Mark ``fn`` as a host-side, data-dependent step (see ``HostFunction``)."""
    return HostFunction(fn)


def run_staged(fn: Any, args: Sequence[Any], *, sequential: bool) -> Any:
    """Run a program that contains host functions: trace with its real arguments at hand."""
    leaves = jax.tree_util.tree_leaves(list(args))
    builder = ProgramBuilder(concrete=[leaf if isinstance(leaf, Array) else np.asarray(leaf) for leaf in leaves])
    builder.sequential = sequential
    result = _call_symbolically(builder, fn, args)
    if builder.flushed is None:  # this time no host function ran: one ordinary program
        builder._flush()
    assert builder.flushed is not None
    return jax.tree_util.tree_map(lambda leaf: builder._concrete(leaf), result,
                                  is_leaf=lambda x: isinstance(x, (Symbol, Array)))
