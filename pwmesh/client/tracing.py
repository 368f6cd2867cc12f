"""Tracing programs into dataflow graphs.

A traced program has one node per call of a compiled function (never one per
shard) and one value per logical buffer. Inside ``@pw.program`` array arguments
are ``Symbol``s: shape, dtype and sharding, no data. Calling a compiled function
outside any program traces a one-node program, so both paths share one dispatch
(``pwmesh.client.dispatch``). Nothing here talks to the cluster: a program that
must run part-way while it is traced (a host function) is handed a ``run``
callback by the layer above.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from pwmesh.client import prng
from pwmesh.client.array import Array
from pwmesh.client.devices import Slice
from pwmesh.client.export import ExportedFunction, canonical, host_aval
from pwmesh.client.sharding import SliceSharding
from pwmesh.dataflow.layout import check_split
from pwmesh.errors import InvalidArgument
from pwmesh.ir.graph import donation_error
from pwmesh.wire.codec import dtype_name, pack_records
from pwmesh.wire.messages import NodeSpec, ProgramSpec, ValueSpec

if TYPE_CHECKING:
    from pwmesh.client.session import Session

_building: contextvars.ContextVar[ProgramBuilder | None] = contextvars.ContextVar("pwmesh_builder", default=None)


def current_builder() -> ProgramBuilder | None:
    """The program being traced in this context, if any."""
    return _building.get()


class Symbol:
    """A value inside a program being traced: shape, dtype and sharding, no data."""

    __slots__ = ("builder", "value", "shape", "dtype", "sharding", "weak_type")

    def __init__(self, builder: ProgramBuilder, value: int, shape: tuple[int, ...], dtype: np.dtype,
                 sharding: SliceSharding | None, weak_type: bool = False) -> None:
        self.builder = builder
        self.value = value
        self.shape = shape
        self.dtype = dtype
        self.sharding = sharding  # None: host data, laid out as its first reader asks
        self.weak_type = weak_type

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def aval(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, self.dtype, weak_type=self.weak_type)

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise InvalidArgument("this value is symbolic inside @pw.program; return it from the program to fetch it")

    def __repr__(self) -> str:
        return f"pw.Symbol(shape={self.shape}, dtype={self.dtype}, sharding={self.sharding})"


@dataclasses.dataclass
class Call:
    """One call of a compiled function, bound: what ``ProgramBuilder.call`` turns into a node."""

    name: str
    exported: ExportedFunction
    slice: Slice
    leaves: list[Any]  # the dynamic arguments' leaves, in order
    in_shardings: list[SliceSharding]  # the layout each is read in
    donate: list[int]  # leaves it consumes
    captured: int = 0  # the last leaves are pw.Arrays the function closes over (``pwmesh.client.capture``)


class NeedsStaging(Exception):  # noqa: N818 - a signal to the caller, not an error
    """Raised while tracing symbolically when a host function needs concrete values."""


def split_static(fn_name: str, args: Sequence[Any], kwargs: dict[str, Any], static_argnums: Iterable[int],
                 static_argnames: Iterable[str]) -> tuple[tuple[Any, ...], dict[str, Any], tuple[Any, ...]]:
    """``(dynamic args, dynamic kwargs, static key)``; static arguments must be hashable (as in ``jax.jit``)."""
    nums = {i if i >= 0 else len(args) + i for i in static_argnums}
    names = set(static_argnames)
    # Keyed with its type too, as ``jax.jit`` keys them: 1, 1.0 and True are equal, and hash alike, but
    # trace to different programs.
    static = tuple((i, type(args[i]), args[i]) for i in sorted(nums) if i < len(args)) + tuple(
        sorted(((k, type(v), v) for k, v in kwargs.items() if k in names), key=lambda e: e[0]))
    for where, _, value in static:
        try:
            hash(value)
        except TypeError:
            raise InvalidArgument(f"{fn_name}: static argument {where!r} is a {type(value).__name__}, which is not "
                                  "hashable (static arguments key the compiled function)") from None
        try:
            value == value  # noqa: B015 - what a cache hit would ask: asked now, so it fails at once or never
        except Exception as exc:
            raise InvalidArgument(f"{fn_name}: static argument {where!r}: static arguments should be comparable "
                                  f"using __eq__ ({type(exc).__name__}: {exc})") from exc
    dyn_args = tuple(a for i, a in enumerate(args) if i not in nums)
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in names}
    return dyn_args, dyn_kwargs, static


def with_static(args: Sequence[Any], kwargs: dict[str, Any], static: tuple[Any, ...]) -> tuple[list[Any],
                                                                                                 dict[str, Any]]:
    """The call's arguments again, static ones put back where they were."""
    full = list(args)
    kw = dict(kwargs)
    for where, _, value in static:
        if isinstance(where, int):
            full.insert(where, value)
        else:
            kw[where] = value
    return full, kw


class ProgramBuilder:
    def __init__(self, concrete: list[Any] | None = None, run: Callable[..., list[Any]] | None = None) -> None:
        self.values: list[ValueSpec] = []
        self.nodes: list[NodeSpec] = []
        self.node_names: list[str] = []  # what each node calls (for errors)
        self.inputs: list[int] = []
        self.functions: dict[str, tuple[ExportedFunction, int]] = {}
        self.session: Session | None = None
        self.shardings: dict[int, SliceSharding] = {}  # value -> its sharding, client side
        self.constants: dict[int, np.ndarray] = {}  # inputs captured while tracing (not arguments)
        self.captured: dict[int, Array] = {}  # pw.Arrays functions close over: inputs after the constants
        self.weak: set[int] = set()  # values weakly typed (as JAX's: a Python scalar's, and what they make)
        self.keys: dict[int, Any] = {}  # values other on the wire (typed keys, int4): their dtypes (``prng.py``)
        self.donated: dict[int, str] = {}  # value -> the function it was donated to
        self._unfixed: set[int] = set()  # host inputs whose layout their first reader sets
        # Staged tracing (a program with host functions): the call's real arguments, the
        # callback that runs what was traced so far, and once a host function ran, every
        # value so far as an Array or host array.
        self.concrete = concrete
        self.run = run
        self.flushed: dict[int, Any] | None = None
        self.sequential = False

    # ------------------------------------------------------------ host functions

    def host_call(self, fn: Callable[..., Any], args: Sequence[Any], fetch: Callable[[list[Any]], list[Any]]) -> Any:
        """A data-dependent step: dispatch what was traced so far, fetch the inputs, run ``fn``.
        Everything after it is dispatched node by node, once its inputs exist (sequential)."""
        if self.concrete is None:
            raise NeedsStaging()
        if self.flushed is None:
            self._flush()
        leaves, tree = jax.tree_util.tree_flatten(list(args))
        return fn(*jax.tree_util.tree_unflatten(tree, fetch([self.concrete_of(leaf) for leaf in leaves])))

    def concrete_of(self, leaf: Any) -> Any:
        if isinstance(leaf, Symbol):
            assert self.flushed is not None and leaf.builder is self
            return self.flushed[leaf.value]
        return leaf

    def _flush(self) -> None:
        """Dispatch the program traced so far (in parallel), its every computed value an output."""
        assert self.concrete is not None and self.run is not None
        self.flushed = dict(zip(self.inputs, self.concrete, strict=False))
        self.flushed.update(self.constants)
        self.flushed.update(self.captured)
        computed = [v for node in self.nodes for v in node.outputs if v not in self.donated]
        if not computed:
            return
        traced = self.finish(computed, jax.tree_util.tree_structure(computed))
        outs = self.run(traced, self.concrete, sequential=self.sequential)
        self.flushed.update(zip(computed, outs, strict=True))

    # ------------------------------------------------------------ values

    def _value(self, shape: tuple[int, ...], dtype: np.dtype, sharding: SliceSharding | None, *,
               shards: int = 1, ragged: bool = False) -> int:
        wire = sharding.wire if sharding is not None else None
        devices = len(sharding.slice.devices) if sharding is not None else shards
        if prng.repacked(dtype):  # on the wire, a typed key array is its data, an int4 one int8 (``prng.py``)
            self.keys[len(self.values)] = dtype
        on_wire, wire_dtype = prng.physical(shape, dtype)
        self.values.append(ValueSpec(shape=list(on_wire), dtype=dtype_name(wire_dtype), shards=devices, ragged=ragged,
                                     sharding=wire))
        v = len(self.values) - 1
        if sharding is not None:
            self.shardings[v] = sharding
        return v

    def input(self, aval: jax.ShapeDtypeStruct, sharding: SliceSharding | None) -> Symbol:
        v = self._value(tuple(aval.shape), aval.dtype, sharding)
        if sharding is None:
            self._unfixed.add(v)
        if aval.weak_type:
            self.weak.add(v)
        self.inputs.append(v)
        return Symbol(self, v, tuple(aval.shape), prng.dtype_of(aval.dtype), sharding, bool(aval.weak_type))

    def _symbol(self, what: str, i: int, leaf: Any, closed_over: bool = False) -> Symbol:
        """A call's argument as a value of this program: a symbol of it, or a constant it captures (a pw.Array
        its function closes over: ``closed_over``)."""
        if isinstance(leaf, Symbol):
            if leaf.builder is not self:
                raise InvalidArgument(f"{what}: argument {i} belongs to another program being traced")
            return leaf
        if isinstance(leaf, Array) and closed_over:
            found = next((v for v, a in self.captured.items() if a is leaf), None)
            if found is not None:
                return Symbol(self, found, leaf.shape, leaf.dtype, leaf.sharding)
            sym = self.input(leaf_aval(leaf), leaf.sharding)
            self.inputs.pop()  # not an argument: bound to the same array at every run
            self.captured[sym.value] = leaf
            return sym
        if isinstance(leaf, Array):
            raise InvalidArgument(f"{what}: argument {i} is a pw.Array; inside @pw.program, pass every pw.Array "
                                  "in as an argument of the program")
        value = canonical(leaf)
        sym = self.input(host_aval(leaf), None)
        self.inputs.pop()  # not an argument: sent with every run as it was captured
        self.constants[sym.value] = value
        return sym

    def _owned_by(self, what: str, session: Session) -> None:
        if self.session is None:
            self.session = session
        elif session is not self.session:
            raise InvalidArgument(f"{what} belongs to another client than the rest of this program")

    def _fix(self, sym: Symbol, sharding: SliceSharding) -> None:
        """A host input takes the layout of its first reader (it is put there directly)."""
        if sym.value in self._unfixed:
            self._unfixed.discard(sym.value)
            spec = self.values[sym.value]
            spec.sharding = sharding.wire
            spec.shards = len(sharding.slice.devices)
            self.shardings[sym.value] = sharding

    # ------------------------------------------------------------ nodes

    def concrete_tree(self, tree: Any) -> Any:
        """``tree`` with its symbols' values (past a host function, where each call runs as it comes)."""
        return jax.tree_util.tree_map(self.concrete_of, tree, is_leaf=lambda x: isinstance(x, Symbol))

    def call(self, call: Call) -> Any:
        assert self.flushed is None, "past a host function, calls run eagerly (see concrete_tree)"
        self._owned_by(call.name, call.slice.session)
        first_closed = len(call.leaves) - call.captured
        syms = [self._symbol(call.name, i, leaf, i >= first_closed) for i, leaf in enumerate(call.leaves)]
        n = len(call.slice.devices)
        ragged = any(self.values[s.value].ragged for s in syms)
        if ragged and n != 1:
            raise InvalidArgument(f"{call.name} gets routed rows but runs on {n} devices; an expert runs on one")
        for sym, sharding in zip(syms, call.in_shardings, strict=True):
            self._fix(sym, sharding)
        for i in call.donate:
            v = syms[i].value
            if v in self.donated:
                raise InvalidArgument(f"{call.name}: argument {i} was donated already (to {self.donated[v]})")
            self.donated[v] = call.name
        exported = call.exported
        outs = []
        for aval, spec in zip(exported.out_avals, exported.out_specs, strict=True):
            sharding = SliceSharding(call.slice, spec)
            v = self._value(tuple(aval.shape), prng.dtype_of(aval.dtype), sharding, ragged=ragged)
            outs.append(Symbol(self, v, tuple(aval.shape), prng.dtype_of(aval.dtype), sharding, bool(aval.weak_type)))
            if aval.weak_type:
                self.weak.add(v)
        self.node_names.append(call.name)
        self.nodes.append(NodeSpec(fn_id=exported.fn_id, slice_id=call.slice.slice_id, inputs=[s.value for s in syms],
                                   outputs=[s.value for s in outs], in_shardings=[s.wire for s in call.in_shardings],
                                   donate=list(call.donate)))
        self.functions[exported.fn_id] = (exported, call.slice.slice_id)
        return jax.tree_util.tree_unflatten(exported.out_tree, outs)

    def reshard(self, x: Any, sharding: SliceSharding) -> Symbol:
        """``x`` laid out as ``sharding`` says (a move, a gather, a scatter or a re-cut)."""
        sl = sharding.slice
        self._owned_by("pw.reshard", sl.session)
        sym = self._symbol("pw.reshard", 0, x)
        sharding.check(sym.shape, "pw.reshard")
        self._fix(sym, sharding)
        v = self._value(sym.shape, sym.dtype, sharding)
        self.node_names.append("pw.reshard")
        self.nodes.append(NodeSpec(fn_id="", slice_id=sl.slice_id, inputs=[sym.value], outputs=[v], kind="reshard"))
        if sym.weak_type:
            self.weak.add(v)
        return Symbol(self, v, sym.shape, sym.dtype, sharding, sym.weak_type)

    def route(self, x: Any, expert_ids: Any, experts: Sequence[Any], home: Slice, blocks: SliceSharding) -> Symbol:
        """Rows of ``x`` to ``experts[expert_ids[row]]``, and their results back in row order on ``home``."""
        self._owned_by("pw.Router", home.session)
        sym, ids = (self._symbol("pw.Router", i, leaf) for i, leaf in enumerate((x, expert_ids)))
        n = len(home.devices)
        for s in (sym, ids):
            self._fix(s, blocks)
        parts = [self._value(sym.shape, sym.dtype, None, ragged=True) for _ in experts]
        self.node_names.append("pw.Router")
        self.nodes.append(NodeSpec(fn_id="", slice_id=home.slice_id, inputs=[sym.value, ids.value], outputs=parts,
                                   kind="route", targets=[e.slice.slice_id for e in experts]))
        results = []
        for expert, part in zip(experts, parts, strict=True):
            out = expert(Symbol(self, part, sym.shape, sym.dtype, None))
            if not isinstance(out, Symbol):
                raise InvalidArgument(f"expert {expert.__name__} must return one array, one row per row it gets")
            results.append(out)
        first = results[0]
        for expert, out in zip(experts, results, strict=True):
            if (out.shape, out.dtype) != (first.shape, first.dtype):
                raise InvalidArgument(f"experts return different shapes: {expert.__name__} gives "
                                      f"{out.dtype}{out.shape}, {experts[0].__name__} {first.dtype}{first.shape}")
        check_split(first.shape, n, f"pw.Router combining the experts' output onto {n} devices")
        y = self._value(first.shape, first.dtype, blocks)
        self.values[y].sharding = None  # the combine lands leading-axis blocks (the default layout)
        self.node_names.append("pw.Router (combine)")
        self.nodes.append(NodeSpec(fn_id="", slice_id=home.slice_id, inputs=[r.value for r in results], outputs=[y],
                                   kind="combine"))
        return Symbol(self, y, first.shape, first.dtype, blocks)

    # ------------------------------------------------------------ the program

    def finish(self, outputs: list[int], out_tree: Any, *, check_outputs: bool = True) -> TracedProgram:
        if self.session is None:
            raise InvalidArgument("a program must call at least one compiled function (pw.jit, pw.pmap)")
        for v in self._unfixed:  # read by nothing that sets a layout: one copy on the first device it goes to
            self.values[v].shards = 1
        spec = ProgramSpec(values=self.values, nodes=self.nodes,
                           inputs=self.inputs + list(self.constants) + list(self.captured), outputs=outputs)
        unsafe = donation_error(spec, self.node_names)
        if unsafe is not None:
            raise InvalidArgument(unsafe)
        return TracedProgram(spec, list(self.functions.values()), out_tree, self.session,
                             [self.shardings[v] for v in outputs],
                             [i for i, v in enumerate(self.inputs) if v in self.donated],
                             {i: self.donated[v] for i, v in enumerate(self.inputs) if v in self.donated},
                             list(self.constants.values()), captured=list(self.captured.values()),
                             out_weak=[v in self.weak for v in outputs],
                             out_keys={i: self.keys[v] for i, v in enumerate(outputs) if v in self.keys},
                             meshes=tuple({id(sh.slice): (sh.slice, sh.slice.reshapes)
                                           for sh in self.shardings.values()}.values()))


@dataclasses.dataclass
class TracedProgram:
    spec: ProgramSpec
    functions: list[tuple[ExportedFunction, int]]
    out_tree: Any
    session: Session
    out_shardings: list[SliceSharding]
    donated: list[int]  # argument leaves the program consumes
    donated_to: dict[int, str]  # ... and the function each goes to
    constants: list[np.ndarray]  # inputs after the arguments: values captured while tracing
    program_id: str = ""  # a traced program kept for reuse is registered with the proxy under its digest
    captured: list[Any] = dataclasses.field(default_factory=list)  # inputs after the constants: closed-over pw.Arrays
    out_weak: list[bool] = dataclasses.field(default_factory=list)  # which outputs are weakly typed
    out_keys: dict[int, Any] = dataclasses.field(default_factory=dict)  # outputs other on the wire: their dtypes
    # The slices it runs on, each with its ``reshapes`` when it was traced: a reshape since makes it stale.
    meshes: tuple[tuple[Any, int], ...] = ()

    @property
    def stale(self) -> bool:
        """Whether a slice it runs on was reshaped since it was traced (its exports are for the old mesh)."""
        return any(sl.reshapes != reshapes for sl, reshapes in self.meshes)


class NotAValue(TypeError):
    """A call's argument is no value (a ``jax.ShapeDtypeStruct``: only ``.lower`` takes one); its caller says
    which argument, as ``jax.jit`` does."""

    def __init__(self, leaf: Any) -> None:
        super().__init__(f"{type(leaf)} is not a valid JAX type")
        self.leaf = leaf


def leaf_signature(leaf: Any) -> tuple[Any, ...]:
    """What of an argument leaf a traced program depends on (its cache key)."""
    if isinstance(leaf, Array):
        return ("buffer", leaf.shape, leaf.dtype, leaf.weak_type, leaf.sharding.key)
    if isinstance(leaf, jax.ShapeDtypeStruct):
        raise NotAValue(leaf)
    aval = host_aval(leaf)
    return ("host", aval.shape, str(aval.dtype) if prng.is_key(aval.dtype) else np.dtype(aval.dtype).name,
            aval.weak_type)


def leaf_aval(leaf: Any) -> jax.ShapeDtypeStruct:
    if isinstance(leaf, (Array, Symbol)):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, weak_type=leaf.weak_type)
    if isinstance(leaf, (jax.ShapeDtypeStruct, jax.core.ShapedArray)):  # ahead of time (``.lower``): types stand for values
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, weak_type=leaf.weak_type)
    return host_aval(leaf)


def trace(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
          builder: ProgramBuilder | None = None) -> tuple[ProgramBuilder, Any]:
    """Call ``fn(*args, **kwargs)`` with a program input ``Symbol`` for every array leaf."""
    builder = builder or ProgramBuilder()
    leaves, in_tree = jax.tree_util.tree_flatten((tuple(args), kwargs))
    symbols = [builder.input(leaf_aval(leaf), leaf.sharding if isinstance(leaf, Array) else None) for leaf in leaves]
    sym_args, sym_kwargs = jax.tree_util.tree_unflatten(in_tree, symbols)
    token = _building.set(builder)
    try:
        return builder, fn(*sym_args, **sym_kwargs)
    finally:
        _building.reset(token)


def trace_program(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> TracedProgram:
    """The program ``fn`` makes of these arguments; its outputs must be values its calls computed."""
    builder, result = trace(fn, args, kwargs)
    out_leaves, out_tree = jax.tree_util.tree_flatten(result)
    for i, leaf in enumerate(out_leaves):
        if not isinstance(leaf, Symbol) or leaf.builder is not builder:
            raise InvalidArgument(f"program output {i} is a {type(leaf).__name__}; a program returns values "
                                  "computed by its compiled functions")
        if leaf.value in builder.inputs or leaf.value in builder.constants:
            raise InvalidArgument(f"program output {i} is one of its inputs; return only computed values")
    return builder.finish([s.value for s in out_leaves], out_tree)


class ProgramCache:
    """Traced programs by the signature of their arguments (pytree structure, static values, shapes, dtypes,
    shardings)."""

    def __init__(self, fn: Callable[[Sequence[Any], dict[str, Any], tuple[Any, ...]], Any]) -> None:
        self.fn = fn  # called with (dynamic args, dynamic kwargs, static key)
        self._lock = threading.Lock()
        self._traced: dict[tuple[Any, ...], TracedProgram] = {}

    def get(self, args: Sequence[Any], kwargs: dict[str, Any], static: tuple[Any, ...] = ()) -> TracedProgram:
        leaves, in_tree = jax.tree_util.tree_flatten((tuple(args), kwargs))
        key = (in_tree, static, tuple(leaf_signature(leaf) for leaf in leaves))
        with self._lock:
            traced = self._traced.get(key)
        # Arrays' signatures name their slices' reshapes; host data's do not, so a trace is checked for them.
        if traced is None or traced.stale:
            traced = trace_program(lambda *a, **k: self.fn(a, k, static), args, kwargs)
            traced.program_id = hashlib.sha256(pack_records([traced.spec])).hexdigest()
            with self._lock:
                self._traced[key] = traced
        return traced
