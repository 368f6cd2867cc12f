"""An SPMD function run by blocks: each executor runs its own devices' part, with no JAX group.

A ``pw.jit`` function is one program over its slice's mesh. Over devices of several executors
it normally runs in their JAX group (XLA's collectives join across processes). Without a group,
a function whose partitioned program needs no collectives still runs: XLA's SPMD partitioner
makes the program each device runs on its block; when that program does not communicate, each
executor runs it on its own blocks as a per-device function. Where it asks which partition it
is (``partition-id``: a replicated input cut into blocks, say), each device's part has its own
partition's number as a constant; it runs on one replica (``replica-id`` is 0).

The partitioner needs a device assignment of the mesh's size, which an executor with fewer
devices cannot give; it only reads the assignment's size, so the mesh here is this host's one
device repeated. The partitioned module (as XLA dumps it right after partitioning, before its
CPU passes) is converted back to StableHLO and
wrapped as a ``jax.export.Exported`` over one device and the blocks' shapes: from there it is
compiled, cached and called as any per-device function (``functions.CompiledFunction``).
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax import export
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from pwmesh.errors import InvalidArgument

# Ops by which one device's program depends on the others: such a program runs only with its peers,
# in one JAX group.
_COMMUNICATES = re.compile(r"\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter|collective-broadcast|"
                           r"ragged-all-to-all|send|recv)(-start|-done)?\(")
# Which partition (or replica) runs it: a constant once each device's part is made for it.
_PARTITION_ID = re.compile(r"(%[\w#.]+) = stablehlo\.partition_id : tensor<ui32>")
_REPLICA_ID = re.compile(r"(%[\w#.]+) = stablehlo\.replica_id : tensor<ui32>")
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


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The part of an SPMD function each device runs on its blocks: one ``Exported`` over one device, the
    same for every partition unless it asks which partition it is (``per_partition``)."""

    exported: export.Exported  # for partition 0 (shapes and calling convention are every partition's)
    text: str  # the part's StableHLO
    per_partition: bool

    def for_partition(self, partition: int) -> export.Exported:
        """The part partition ``partition`` runs (its ``partition-id`` that constant)."""
        if not self.per_partition:
            return self.exported
        text = _PARTITION_ID.sub(rf"\1 = stablehlo.constant dense<{partition}> : tensor<ui32>", self.text)
        return dataclasses.replace(self.exported, mlir_module_serialized=_serialized(text))


def _hlo_module(dumped: bytes) -> bytes:
    """The ``HloModuleProto`` in an ``HloProto`` as XLA dumps one (its field 1), by the protobuf wire format."""
    at = 0
    while at < len(dumped):
        key, at = _varint(dumped, at)
        field, kind = key >> 3, key & 7
        if kind == 2:
            size, at = _varint(dumped, at)
            if field == 1:
                return dumped[at:at + size]
            at += size
        elif kind == 0:
            _, at = _varint(dumped, at)
        elif kind in (1, 5):
            at += 8 if kind == 1 else 4
        else:
            break
    raise ValueError("no HLO module in XLA's dump")


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _serialized(text: str) -> bytes:
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context():
        return bytes(mlir.module_to_bytecode(ir.Module.parse(text)))


def per_device(exported: export.Exported, mesh: tuple[int, ...], axes: tuple[str, ...], fn_id: str) -> Blocks:
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
    with tempfile.TemporaryDirectory(prefix="pwmesh-blocks-") as dump, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # The module as the partitioner leaves it, before XLA's CPU passes (fusions, layouts), which do not
        # take their own output as input again.
        jax.jit(exported.call, out_shardings=jax.tree_util.tree_unflatten(exported.out_tree, outs)).lower(
            *args).compile(compiler_options={"xla_dump_to": dump, "xla_dump_hlo_pass_re": "spmd-partitioning",
                                             "xla_dump_hlo_as_proto": True, "xla_dump_hlo_as_text": True})
        found_files = sorted(Path(dump).glob("*after_spmd-partitioning*"))
        hlo = next((f.read_text() for f in found_files if f.suffix == ".txt"), "")
        proto = next((f.read_bytes() for f in found_files if f.suffix == ".pb"), b"")
    if not proto:
        raise InvalidArgument(f"function {fn_id[:12]} spans executors in no JAX group, and XLA did not show how it "
                              "partitions it here; start the island with JAX groups (the default)")
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

        text = str(ir.Module.parse(xla_client._xla.mlir.hlo_to_stablehlo(_hlo_module(proto)), context=mlir.make_ir_context()))
        text = _MODULE_ATTRIBUTES.sub("module @blocks attributes {mhlo.num_partitions = 1 : i32, "
                                      "mhlo.num_replicas = 1 : i32} {", text, count=1)
        text = _SHARDING_ATTRIBUTE.sub(_without_sharding, text)
        text = _REPLICA_ID.sub(r"\1 = stablehlo.constant dense<0> : tensor<ui32>", text)  # one replica
        serialized = _serialized(_PARTITION_ID.sub(r"\1 = stablehlo.constant dense<0> : tensor<ui32>", text))
    except Exception as exc:  # internal APIs of this JAX: say what cannot be done, and why
        raise InvalidArgument(f"function {fn_id[:12]} spans executors in no JAX group, and this JAX cannot run "
                              f"its devices' part alone ({type(exc).__name__}: {exc}); start the island with JAX "
                              "groups (the default)") from exc
    abstract_ins = specs(exported.in_shardings_jax(abstract), abstract)
    abstract_outs = specs(exported.out_shardings_jax(abstract), abstract)
    part = dataclasses.replace(
        exported, mlir_module_serialized=serialized, nr_devices=1,
        in_avals=tuple(a.update(shape=s.shard_shape(a.shape)) for a, s in zip(exported.in_avals, abstract_ins,
                                                                              strict=True)),
        out_avals=tuple(a.update(shape=s.shard_shape(a.shape)) for a, s in zip(exported.out_avals, abstract_outs,
                                                                               strict=True)),
        in_shardings_hlo=(None,) * len(exported.in_avals), out_shardings_hlo=(None,) * len(exported.out_avals))
    return Blocks(part, text, per_partition=bool(_PARTITION_ID.search(text)))
