"""Compiled functions as portable ``jax.export`` artifacts, traced on the client.

A function is exported for its slice's mesh with its inputs' and outputs'
``PartitionSpec``s (``export_jit``), or mapped over the leading axis one block per
device (``export_pmap``). The artifact travels, never pickled Python; its id is the
hash of its bytes and of how it is called. Nothing here talks to the cluster.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export
from jax.extend import core as jax_core
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from pwmesh.client import capture, prng, subbyte
from pwmesh.client.devices import Slice
from pwmesh.client.sharding import P, SliceSharding, abstract_mesh, propagation_mesh, resolve, spec_from
from pwmesh.errors import InvalidArgument
from pwmesh.ir.keys import function_id


@dataclasses.dataclass(frozen=True)
class ExportedFunction:
    """One traced, exported function: what it takes and gives, and how it is registered."""

    fn_id: str
    serialized: bytes
    spmd: bool  # one program over the slice's devices (else one per device, each on its block)
    mesh: list[int]  # the mesh it was exported over (SPMD), and its axis names
    axes: list[str]
    donate: list[int]  # flat inputs it may consume
    in_specs: tuple[PartitionSpec, ...]  # per flat input, over the slice's mesh
    out_avals: tuple[jax.ShapeDtypeStruct, ...]  # global (whole-slice) shapes
    out_specs: tuple[PartitionSpec, ...]  # per flat output, over the slice's mesh
    out_tree: Any

    def register(self, register: Callable[..., None], slice_id: int) -> None:
        register(self.fn_id, exported=self.serialized, slice_id=slice_id, spmd=self.spmd, mesh=self.mesh,
                 axes=self.axes, donate=self.donate)


def _serialize(exp: export.Exported, spmd: bool, mesh: list[int], axes: list[str],
               donate: list[int]) -> tuple[str, bytes]:
    serialized = bytes(exp.serialize())
    return function_id(serialized, spmd, mesh, axes, donate), serialized


def _quiet_export(jitted: Any, sl: Slice, avals: Sequence[jax.ShapeDtypeStruct]) -> export.Exported:
    """``jax.export`` of ``jitted`` for the platforms of ``sl``'s devices (this process need not have them).
    Donation is the executors' (they compile with it), so JAX's warning that an export cannot use it is
    not the user's to see."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        try:
            return export.export(jitted, platforms=sl.platforms)(*avals)
        except NotImplementedError as exc:
            if "host_callbacks" not in str(exc):
                raise
            raise InvalidArgument(
                "the function makes a host callback (jax.debug.print, jax.debug.callback, jax.pure_callback, "
                "io_callback), which cannot run on the cluster: a function reaches the executors as a jax.export "
                "artifact, which holds none (and executors run no client Python); return the value and print it "
                "here") from exc


@dataclasses.dataclass(frozen=True)
class Captured:
    """Where a traced function's jaxpr takes the ``index``-th ``pw.Array`` it closes over."""

    index: int


@dataclasses.dataclass(frozen=True)
class TracedFunction:
    """A function traced once for one signature. Every later step (asking XLA for the outputs' shardings, the
    export, a call inlined into another trace) replays its jaxpr, never the Python body: the body runs once per
    signature, as under ``jax.jit``."""

    jaxpr: Any  # a ClosedJaxpr: ``hoisted``, then the arguments' leaves, to flat outputs
    in_avals: tuple[jax.ShapeDtypeStruct, ...]  # the arguments' leaves, then ``captured``
    out_avals: tuple[jax.ShapeDtypeStruct, ...]
    out_tree: Any
    captured: tuple[Any, ...]  # the pw.Arrays it closes over: its last inputs (``pwmesh.client.capture``)
    # The jaxpr's first inputs: a value of an enclosing trace it closes over, or (``Captured``) a pw.Array.
    hoisted: tuple[Any, ...] = ()

    @property
    def flat(self) -> Callable[..., list[Any]]:
        """The function again, flat inputs (the arguments' leaves, then the captured arrays) to flat outputs (an
        artifact holds no user pytree types, optax's states say, which ``jax.export`` cannot serialize: the
        caller rebuilds the structure it traced)."""
        replay = jax_core.jaxpr_as_fun(self.jaxpr)
        hoisted = self.hoisted
        own = len(self.in_avals) - len(self.captured)

        def flat(*args: Any) -> list[Any]:
            first = [args[own + h.index] if isinstance(h, Captured) else h for h in hoisted]
            return list(replay(*first, *args[:own]))

        return flat

    @property
    def out_shape(self) -> Any:
        return jax.tree_util.tree_unflatten(self.out_tree, list(self.out_avals))

    @property
    def reusable(self) -> bool:
        """Whether it may serve later calls: not when it closes over a value of the trace it was made in."""
        return (not any(not isinstance(h, Captured) for h in self.hoisted)
                and not any(isinstance(c, jax.core.Tracer) for c in self.jaxpr.consts))


def _aval(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=bool(getattr(x, "weak_type", False)))


def trace_jit(fn: Callable[..., Any], avals: Sequence[jax.ShapeDtypeStruct]) -> TracedFunction:
    """``fn(*leaves)`` traced for ``avals``, once: each ``pw.Array`` it closes over an input of its own."""
    closed, stand_ins, traced = capture.standing_in(lambda: jax.jit(fn).trace(*avals))
    where = {id(s): Captured(k) for k, s in enumerate(stand_ins)}
    hoisted = tuple(where.get(id(c), c) for c in traced._consts)  # JAX has no public name for them
    out_leaves, out_tree = jax.tree_util.tree_flatten(traced.out_info)
    return TracedFunction(traced.jaxpr, (*avals, *map(_aval, closed)), tuple(map(_aval, out_leaves)), out_tree,
                          tuple(closed), hoisted)


def export_jit(fn: Callable[..., Any] | TracedFunction, sl: Slice, avals: Sequence[jax.ShapeDtypeStruct],
               in_specs: Sequence[PartitionSpec], out_specs: Any, donate: Sequence[int], name: str) -> ExportedFunction:
    """``fn(*leaves)`` (or a function traced already) as one SPMD program over ``sl``'s mesh (a plain one on a
    single device).

    ``out_specs``: a spec or pytree prefix of specs for the outputs (``None`` leaves: what XLA's
    propagation chooses, asked by compiling here once). It is traced under the slice's mesh, as ``jax.jit``
    is under ``jax.set_mesh``: ``with_sharding_constraint(x, P(...))`` and ``shard_map`` over the slice's axis
    names work inside it."""
    with jax.sharding.use_abstract_mesh(abstract_mesh(sl)):
        traced = fn if isinstance(fn, TracedFunction) else trace_jit(fn, avals)
        return _export_jit(traced, sl, traced.in_avals, in_specs, out_specs, donate, name)


def _export_jit(traced: TracedFunction, sl: Slice, avals: Sequence[jax.ShapeDtypeStruct],
                in_specs: Sequence[PartitionSpec], out_specs: Any, donate: Sequence[int],
                name: str) -> ExportedFunction:
    n = len(sl.devices)
    out_shape = traced.out_shape
    out_leaves = traced.out_avals
    out_tree = traced.out_tree
    flat_fn = traced.flat
    wanted = resolve(out_specs, out_shape, f"{name}: out_specs")
    for i, (leaf, spec) in enumerate(zip(out_leaves, wanted, strict=True)):
        if spec is not None:
            SliceSharding(sl, spec).check(leaf.shape, f"{name}: output {i}")
    # Typed keys in or out: the module takes and returns their data (``client/prng.py``); what the client
    # sees of its outputs stays the traced (logical) avals.
    on_data = prng.physical_function(flat_fn, avals, out_leaves)
    exported_fn = on_data or flat_fn
    physical = [prng.physical_aval(a) for a in avals]
    if n == 1:
        exp = _quiet_export(jax.jit(exported_fn), sl, physical)
        specs_out = tuple(P() for _ in out_leaves)
        fn_id, serialized = _serialize(exp, False, [1], [], list(donate))
        return ExportedFunction(fn_id, serialized, False, [1], [], list(donate), tuple(P() for _ in avals),
                                _out_avals(exp, out_leaves if on_data else None), specs_out, out_tree)
    # Every output's spec: XLA's choice where none was asked for.
    full = (_propagated(flat_fn, sl, avals, in_specs, wanted) if any(spec is None for spec in wanted)
            else [spec for spec in wanted if spec is not None])
    for i, (leaf, spec) in enumerate(zip(out_leaves, full, strict=True)):
        SliceSharding(sl, spec).check(leaf.shape, f"{name}: output {i} (as XLA shards it)")
    mesh = abstract_mesh(sl)
    sharded = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s), weak_type=a.weak_type)
               for a, s in zip(physical, in_specs, strict=True)]
    exp = _quiet_export(jax.jit(exported_fn, out_shardings=[NamedSharding(mesh, s) for s in full],
                                keep_unused=True), sl, sharded)
    axes = list(sl.axis_names)
    fn_id, serialized = _serialize(exp, True, list(sl.mesh_shape), axes, list(donate))
    return ExportedFunction(fn_id, serialized, True, list(sl.mesh_shape), axes, list(donate), tuple(in_specs),
                            _out_avals(exp, out_leaves if on_data else None), tuple(full), out_tree)


def _out_avals(exp: export.Exported, logical: Sequence[jax.ShapeDtypeStruct] | None
               ) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The outputs as the client sees them: the module's, or (it has typed keys) the traced ones."""
    outs = logical if logical is not None else exp.out_avals
    return tuple(jax.ShapeDtypeStruct(o.shape, o.dtype, weak_type=o.weak_type) for o in outs)


def _propagated(flat_fn: Callable[..., Any], sl: Slice, avals: Sequence[jax.ShapeDtypeStruct],
                in_specs: Sequence[PartitionSpec], wanted: list[PartitionSpec | None]) -> list[PartitionSpec]:
    """The outputs' specs with XLA's choice where none was asked for: ``jax.jit``'s outputs, exactly."""
    mesh = propagation_mesh(sl.mesh_shape, sl.axis_names)
    with jax.set_mesh(mesh):
        compiled = jax.jit(flat_fn, in_shardings=tuple(NamedSharding(mesh, s) for s in in_specs),
                           out_shardings=[None if s is None else NamedSharding(mesh, s) for s in wanted]
                           ).lower(*avals).compile()
    return [spec if spec is not None else spec_from(chosen, sl.axis_names)
            for spec, chosen in zip(wanted, jax.tree_util.tree_leaves(compiled.output_shardings), strict=True)]


def export_pmap(fn: Callable[..., Any], sl: Slice, avals: Sequence[jax.ShapeDtypeStruct], axis_name: str | None,
                name: str) -> ExportedFunction:
    """``fn`` mapped over the leading axis, one element per device (``jax.pmap``'s semantics): each device
    runs it on its block alone, or (``axis_name``) all run it as one SPMD program so collectives work."""
    n = len(sl.devices)
    for i, a in enumerate(avals):
        if not a.shape or a.shape[0] != n:
            raise InvalidArgument(f"{name}: argument {i} has shape {a.shape}; pmap over {n} devices needs a leading "
                                  f"axis of size {n}")
    names = sl.axis_names
    blocks = P(names[0] if len(names) == 1 else names)  # the leading axis over every device, in the slice's order

    trees: list[Any] = []  # the output's structure, seen as the export traces it (inside the mapped axis)

    def per_block(*args: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(fn(*[a[0] for a in args]))
        trees.append(tree)
        return [jnp.expand_dims(o, 0) for o in leaves]

    if axis_name is None:
        block_avals = [jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype) for a in avals]
        exp = _quiet_export(jax.jit(per_block), sl, block_avals)
        out_avals = tuple(jax.ShapeDtypeStruct((n, *o.shape[1:]), o.dtype) for o in exp.out_avals)
        mesh, axes = [n], []
    else:
        abstract = AbstractMesh((n,), (axis_name,), axis_types=(AxisType.Auto,))  # as the executors' (sharding.py)
        spec = P(axis_name)
        mapped = jax.shard_map(per_block, mesh=abstract, in_specs=spec, out_specs=spec)
        sharded = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(abstract, spec)) for a in avals]
        exp = _quiet_export(jax.jit(mapped), sl, sharded)
        out_avals = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in exp.out_avals)
        mesh, axes = [n], [axis_name]
    spmd = axis_name is not None
    fn_id, serialized = _serialize(exp, spmd, mesh, axes, [])
    return ExportedFunction(fn_id, serialized, spmd, mesh, axes, [], tuple(blocks for _ in avals), out_avals,
                            tuple(blocks for _ in out_avals), trees[-1])


def _flat_outputs(fn: Callable[..., Any]) -> Callable[..., list[Any]]:
    """``fn`` returning its outputs' leaves: an artifact holds no user pytree types (optax's states, say,
    which ``jax.export`` cannot serialize); the caller rebuilds the structure it traced."""

    def flat(*args: Any) -> list[Any]:
        return jax.tree_util.tree_leaves(fn(*args))

    return flat


def canonical(value: Any) -> np.ndarray:
    """A host value as it is sent: the array JAX would make of it (``as_jax_would``), a typed key array's data
    or a sub-byte array in its container (``client/prng.py``, ``client/subbyte.py``)."""
    if prng.is_key(getattr(value, "dtype", None)):
        return prng.key_data(value)
    return subbyte.contained(as_jax_would(value))


def as_jax_would(value: Any) -> np.ndarray:
    """A host value as the array JAX would make of it (float64 -> float32 unless x64 is on). A NumPy masked
    array is refused, as JAX refuses it (its mask would be dropped in silence); so is a Python int out of
    the range of JAX's integer type (``OverflowError``, as ``jax.jit`` and ``jax.device_put`` raise)."""
    if isinstance(value, np.ma.MaskedArray):
        raise InvalidArgument("numpy masked arrays are not supported as direct inputs to JAX functions. Use "
                              "arr.filled() to convert the value to a standard numpy array.")
    if isinstance(value, int) and not isinstance(value, bool):
        return _python_int(value)
    arr = np.asarray(value)
    dtype = jax.dtypes.canonicalize_dtype(arr.dtype)
    return arr if arr.dtype == dtype else arr.astype(dtype)


def _python_int(value: int) -> np.ndarray:
    dtype = np.dtype(jax.dtypes.canonicalize_dtype(np.int64))
    info = np.iinfo(dtype)
    if not info.min <= value <= info.max:
        raise OverflowError(f"Python int {value} too large to convert to {dtype.name}")
    return np.asarray(value, dtype)


def host_aval(value: Any) -> jax.ShapeDtypeStruct:
    """The abstract value of a host leaf; weakly typed as in ``jax.jit``: a Python scalar, or a ``jax.Array``
    that is weak itself (``jnp.array(3.0)``)."""
    if prng.is_key(getattr(value, "dtype", None)):
        return jax.ShapeDtypeStruct(value.shape, value.dtype)
    python_scalar = isinstance(value, (int, float, complex)) and not isinstance(value, (bool, np.generic))
    weak = python_scalar or (isinstance(value, jax.Array) and value.weak_type)
    arr = as_jax_would(value)
    return jax.ShapeDtypeStruct(arr.shape, arr.dtype, weak_type=weak)
