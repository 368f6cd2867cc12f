"""``pw.pmap``: a JAX function mapped over a slice, shipped as a ``jax.export`` artifact.

Values are sharded in blocks along their leading axis, one block per device, so
a pmap shard is a block of one element. Without ``axis_name`` each device runs
the function on its block independently (any slice). With ``axis_name`` the
function is exported once as an SPMD ``shard_map`` over an abstract mesh of the
slice's size, so collectives like ``jax.lax.psum(x, axis_name)`` work; that
needs the slice's devices on one executor until cross-host collectives land.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from pwmesh.client.devices import Slice, VirtualDevice, slice_of
from pwmesh.client.tracing import ProgramCache, call_mapped
from pwmesh.errors import InvalidArgument
from pwmesh.ir.keys import function_id


@dataclasses.dataclass(frozen=True)
class ExportedFunction:
    fn_id: str
    serialized: bytes
    spmd: bool
    out_avals: tuple[jax.ShapeDtypeStruct, ...]  # global (whole-slice) shapes
    out_tree: Any


class MappedFunction:
    """What ``pw.pmap`` returns: callable eagerly, or inside a ``@pw.program``."""

    def __init__(self, fn: Callable[..., Any], devices: Slice | Sequence[VirtualDevice], axis_name: str | None) -> None:
        self.fn = fn
        self.slice = slice_of(devices)
        self.axis_name = axis_name
        self.__name__ = getattr(fn, "__name__", "mapped")
        self._lock = threading.Lock()
        self._exports: dict[tuple[Any, ...], ExportedFunction] = {}
        self.eager = ProgramCache(self)  # called outside @pw.program: a one-node program

    @property
    def num_devices(self) -> int:
        return len(self.slice.devices)

    def export_for(self, avals: Sequence[jax.ShapeDtypeStruct]) -> ExportedFunction:
        """The exported artifact for these global input shapes (cached)."""
        key = tuple((a.shape, str(a.dtype)) for a in avals)
        with self._lock:
            found = self._exports.get(key)
        if found is None:
            found = self._export(avals)
            with self._lock:
                found = self._exports.setdefault(key, found)
        return found

    def _export(self, avals: Sequence[jax.ShapeDtypeStruct]) -> ExportedFunction:
        n = self.num_devices
        for i, a in enumerate(avals):
            if not a.shape or a.shape[0] != n:
                raise InvalidArgument(
                    f"{self.__name__}: argument {i} has shape {a.shape}; pmap over {n} devices needs a leading "
                    f"axis of size {n}"
                )
        fn = self.fn

        def per_block(*blocks: Any) -> Any:
            out = fn(*[b[0] for b in blocks])
            return jax.tree_util.tree_map(lambda o: jnp.expand_dims(o, 0), out)

        if self.axis_name is None:
            block_avals = [jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype) for a in avals]
            exp = export.export(jax.jit(per_block), platforms=["cpu"])(*block_avals)
            out_avals = tuple(jax.ShapeDtypeStruct((n, *o.shape[1:]), o.dtype) for o in exp.out_avals)
        else:
            mesh = AbstractMesh((n,), (self.axis_name,))
            spec = PartitionSpec(self.axis_name)
            mapped = jax.shard_map(per_block, mesh=mesh, in_specs=spec, out_specs=spec)
            sharded = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec)) for a in avals]
            exp = export.export(jax.jit(mapped), platforms=["cpu"])(*sharded)
            out_avals = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in exp.out_avals)
        serialized = bytes(exp.serialize())
        fn_id = function_id(serialized, self.axis_name is not None)
        return ExportedFunction(fn_id, serialized, self.axis_name is not None, out_avals, exp.out_tree)

    def __call__(self, *args: Any) -> Any:
        return call_mapped(self, args)

    def __repr__(self) -> str:
        return f"pw.pmap({self.__name__}, slice={self.slice.slice_id}, axis_name={self.axis_name!r})"


class JitFunction(MappedFunction):
    """What ``pw.jit`` returns: ``fn`` with a global view of its arguments, which are split in
    blocks along their leading axis over the slice's devices (one block per device)."""

    def _export(self, avals: Sequence[jax.ShapeDtypeStruct]) -> ExportedFunction:
        n = self.num_devices
        for i, a in enumerate(avals):
            if n > 1 and (not a.shape or a.shape[0] % n):
                raise InvalidArgument(f"{self.__name__}: argument {i} of shape {a.shape} cannot be split into {n} "
                                      "equal blocks along its leading axis")
        if n == 1:
            exp = export.export(jax.jit(self.fn), platforms=["cpu"])(*avals)
        else:
            blocks = NamedSharding(AbstractMesh((n,), ("x",)), PartitionSpec("x"))
            sharded = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=blocks) for a in avals]
            out_shape = jax.eval_shape(self.fn, *avals)
            for o in jax.tree_util.tree_leaves(out_shape):
                if not o.shape or o.shape[0] % n:
                    raise InvalidArgument(f"{self.__name__}: an output of shape {o.shape} cannot be split into "
                                          f"{n} equal blocks along its leading axis")
            exp = export.export(jax.jit(self.fn, out_shardings=blocks), platforms=["cpu"])(*sharded)
        serialized = bytes(exp.serialize())
        fn_id = function_id(serialized, n > 1)
        out_avals = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in exp.out_avals)
        return ExportedFunction(fn_id, serialized, n > 1, out_avals, exp.out_tree)

    def __repr__(self) -> str:
        return f"pw.jit({self.__name__}, slice={self.slice.slice_id})"


def jit(fn: Callable[..., Any], *, devices: Slice | Sequence[VirtualDevice]) -> JitFunction:
    """``fn`` compiled for ``devices`` with a global view (like ``jax.jit``); arguments and results
    are split in equal blocks along their leading axis over the devices. Values made by one
    function and read by another on a slice of another size are resharded on the way."""
    return JitFunction(fn, devices, axis_name=None)


def pmap(fn: Callable[..., Any], *, devices: Slice | Sequence[VirtualDevice],
         axis_name: str | None = None) -> MappedFunction:
    """Map ``fn`` over the leading axis of its arguments, one element per device of ``devices``."""
    return MappedFunction(fn, devices, axis_name)


def canonical(array: Any) -> np.ndarray:
    """A host array in the dtype JAX would use for it (float64 → float32 unless x64 is on)."""
    arr = np.asarray(array)
    dtype = jax.dtypes.canonicalize_dtype(arr.dtype)
    return arr if arr.dtype == dtype else arr.astype(dtype)
