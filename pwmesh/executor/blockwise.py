"""An SPMD function run by blocks: each executor runs its own devices' part, with no JAX group.

A ``pw.jit`` function is one program over its slice's mesh. Over devices of several executors
it normally runs in their JAX group (XLA's collectives join across processes). Without a group,
a function whose partitioned program needs no collectives still runs: XLA's SPMD partitioner
makes the program each device runs on its block; when that program neither communicates nor
asks which partition it is (``partition-id``, ``replica-id``), it is the same on every device,
and each executor runs it on its own blocks as a per-device function.

The partitioner needs a device assignment of the mesh's size, which an executor with fewer
devices cannot give; it only reads the assignment's size, so the mesh here is this host's one
device repeated. The partitioned module (optimized HLO) is converted back to StableHLO and
wrapped as a ``jax.export.Exported`` over one device and the blocks' shapes: from there it is
compiled, cached and called as any per-device function (``functions.CompiledFunction``).
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

import jax
import numpy as np
from jax import export
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from pwmesh.errors import InvalidArgument

# Ops by which one device's program depends on the others (or on where it runs): such a program
# runs only with its peers, in one JAX group.
_COMMUNICATES = re.compile(r"\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter|collective-broadcast|"
                           r"ragged-all-to-all|partition-id|replica-id|send|recv)(-start|-done)?\(")
# What the partitioner leaves on the module and its arguments: meaningless for one device, and they
# would make XLA fall back to its older sharding propagation.
_MODULE_ATTRIBUTES = re.compile(r"^module @[\w.$-]+ attributes \{[^\n]*\} \{", re.MULTILINE)
_SHARDING_ATTRIBUTE = re.compile(r'(\{|, )mhlo\.sharding = "[^"]*"(, |\})')


def communication(hlo: str) -> list[str]:
    """The ops of a partitioned module (optimized HLO text) by which its devices depend on each other."""
    return sorted({m.group(1) for m in _COMMUNICATES.finditer(hlo)})


def _without_sharding(match: re.Match[str]) -> str:
    """An attribute dictionary's ``mhlo.sharding`` entry removed, whatever its place in it."""
    before, after = match.group(1), match.group(2)
    if before == "{":
        return "{}" if after == "}" else "{"
    return "}" if after == "}" else ", "


def per_device(exported: export.Exported, mesh: tuple[int, ...], axes: tuple[str, ...], fn_id: str) -> export.Exported:
    """``exported`` (an SPMD function over a mesh of ``mesh`` sizes named ``axes``) as the function one device
    runs on its blocks; ``InvalidArgument`` if its devices would communicate. Compiles the whole module once
    (call from a worker thread)."""
    devices = int(np.prod(mesh))
    device = jax.local_devices()[0]
    concrete = Mesh(np.array([device] * devices, dtype=object).reshape(mesh), axes)
    abstract = AbstractMesh(mesh, axes, axis_types=(AxisType.Auto,) * len(axes))
    blocks = PartitionSpec(axes[0] if len(axes) == 1 else axes)  # unspecified: the leading axis

    def specs(found: Any, on: Any) -> list[Any]:
        return [NamedSharding(on, blocks if s is None else s.spec) for s in found]

    ins = specs(exported.in_shardings_jax(concrete), concrete)
    outs = specs(exported.out_shardings_jax(concrete), concrete)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(exported.in_avals, ins, strict=True)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = jax.jit(exported.call, out_shardings=jax.tree_util.tree_unflatten(exported.out_tree, outs)
                           ).lower(*args).compile()
    hlo = compiled.as_text() or ""
    found = communication(hlo)
    if found:
        raise InvalidArgument(
            f"function {fn_id[:12]} runs over devices of several executors that are in no JAX group, and its "
            f"devices communicate ({', '.join(found)}): such a program runs only in one JAX group. Start the "
            "island with JAX groups (the default; not --no-collectives), or ask for a slice on one host")
    try:
        from jax._src.interpreters import mlir
        from jax._src.lib import xla_client
        from jax._src.lib.mlir import ir

        executable = compiled.runtime_executable()
        assert executable is not None, "a compiled module has its executable"
        (module,) = executable.hlo_modules()
        text = str(ir.Module.parse(xla_client._xla.mlir.hlo_to_stablehlo(module.as_serialized_hlo_module_proto()),
                                   context=mlir.make_ir_context()))
        text = _MODULE_ATTRIBUTES.sub("module @blocks attributes {mhlo.num_partitions = 1 : i32, "
                                      "mhlo.num_replicas = 1 : i32} {", text, count=1)
        text = _SHARDING_ATTRIBUTE.sub(_without_sharding, text)
        with mlir.make_ir_context():
            serialized = mlir.module_to_bytecode(ir.Module.parse(text))
    except Exception as exc:  # internal APIs of this JAX: say what cannot be done, and why
        raise InvalidArgument(f"function {fn_id[:12]} spans executors in no JAX group, and this JAX cannot run "
                              f"its devices' part alone ({type(exc).__name__}: {exc}); start the island with JAX "
                              "groups (the default)") from exc
    abstract_ins = specs(exported.in_shardings_jax(abstract), abstract)
    abstract_outs = specs(exported.out_shardings_jax(abstract), abstract)
    return dataclasses.replace(
        exported, mlir_module_serialized=serialized, nr_devices=1,
        in_avals=tuple(a.update(shape=s.shard_shape(a.shape)) for a, s in zip(exported.in_avals, abstract_ins,
                                                                              strict=True)),
        out_avals=tuple(a.update(shape=s.shard_shape(a.shape)) for a, s in zip(exported.out_avals, abstract_outs,
                                                                               strict=True)),
        in_shardings_hlo=(None,) * len(exported.in_avals), out_shardings_hlo=(None,) * len(exported.out_avals))
