"""Shardings as JAX writes them: ``PartitionSpec``s over a slice's named mesh.

``SliceSharding`` is what ``pw.Array.sharding`` returns: a slice and a spec, like
``jax.sharding.NamedSharding`` with the slice's mesh. Specs are checked against
the mesh's axis names and the value's shape here, with the names in the message,
and travel as axis indices (``wire.Sharding``; the arithmetic is
``pwmesh.dataflow.layout``). ``resolve`` matches ``in_specs``/``out_specs`` (a spec,
or a pytree prefix of specs, ``None`` meaning the default) to a pytree's leaves, as
``jax.jit`` and ``jax.shard_map`` do.

Where ``out_specs`` are left out, an output takes the sharding XLA's propagation
gives it, as under ``jax.jit``: ``propagation_mesh`` is the slice's mesh over
virtual CPU devices of a client of this process's own (never JAX's default
backend), so the function can be compiled here once to ask XLA.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec
from jaxlib import xla_client

from pwmesh.client.devices import Slice
from pwmesh.dataflow.layout import Layout
from pwmesh.errors import InvalidArgument
from pwmesh.wire.messages import Sharding

P = PartitionSpec


def is_spec_leaf(x: Any) -> bool:
    """Leaves of a tree of specs: a ``PartitionSpec`` (a tuple, to ``jax.tree_util``) or ``None`` (the default)."""
    return x is None or isinstance(x, PartitionSpec)


def axes_of(entry: Any) -> tuple[Any, ...]:
    """The mesh axis names one entry of a spec names (``None``: none; a name; a tuple of names)."""
    if entry is None:
        return ()
    if isinstance(entry, tuple):
        return entry
    return (entry,)


def spec_indices(spec: PartitionSpec, names: Sequence[str], what: str) -> list[list[int]]:
    """``spec`` with its axis names as indices into ``names``; ``InvalidArgument`` naming a bad one."""
    if not isinstance(spec, PartitionSpec):
        raise InvalidArgument(f"{what}: a sharding is a jax.sharding.PartitionSpec, got {type(spec).__name__} {spec!r}")
    out = []
    for entry in spec:
        axes = []
        for name in axes_of(entry):
            if not isinstance(name, str):
                raise InvalidArgument(f"{what}: {spec} names {name!r}; a spec names mesh axes by their names")
            if name not in names:
                raise InvalidArgument(f"{what}: {spec} names mesh axis {name!r}, which the slice's mesh "
                                      f"({', '.join(names)}) does not have")
            axes.append(list(names).index(name))
        out.append(axes)
    while out and not out[-1]:
        out.pop()
    return out


class SliceSharding:
    """A slice and a ``PartitionSpec`` over its mesh: how a ``pw.Array`` is laid out on the devices (JAX's
    ``NamedSharding(mesh, spec)``, with the slice as the mesh: ``pw.NamedSharding`` is this class)."""

    __slots__ = ("slice", "spec", "_wire", "key")

    def __init__(self, sl: Slice, spec: PartitionSpec) -> None:
        self.slice = sl
        self.spec = spec
        self._wire = Sharding(mesh=list(sl.mesh_shape), spec=spec_indices(spec, sl.axis_names, repr(self)))
        # What a traced program depends on of it (``tracing.leaf_signature``), made once: every call looks it up.
        # A reshaped slice (``Slice.reshape``) is another mesh under the same object: its count is in the key.
        self.key = (id(sl), sl.reshapes, tuple(map(tuple, self._wire.spec)))

    @property
    def mesh(self) -> dict[str, int]:
        return self.slice.mesh

    @property
    def wire(self) -> Sharding:
        return self._wire

    def layout(self, shape: Sequence[int]) -> Layout:
        return Layout.of(tuple(shape), self._wire, len(self.slice.devices))

    def check(self, shape: Sequence[int], what: str) -> Layout:
        """The layout of a value of ``shape``; ``InvalidArgument`` (with axis names) if it cannot be made."""
        if len(self.spec) > len(shape):
            named = [a for entry in self.spec for a in axes_of(entry)]
            if len(set(named)) != len(named):  # as jax.jit checks: its own DuplicateSpecError, first
                NamedSharding(abstract_mesh(self.slice), self.spec)
            raise InvalidArgument(f"{what}: {self.spec} has {len(self.spec)} entries but the value has shape "
                                  f"{tuple(shape)}")
        layout = self.layout(shape)
        for d, (n, k) in enumerate(zip(layout.shape, layout.splits, strict=True)):
            if n % k:
                names = axes_of(self.spec[d])
                raise InvalidArgument(f"{what}: dimension {d} of shape {tuple(shape)} ({n}) cannot be split over "
                                      f"mesh axes {names} ({k} devices) of slice {self.slice.slice_id}: {n} is not a "
                                      f"multiple of {k}")
        return layout

    def shard_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Each shard's shape; ``InvalidArgument`` (a ``ValueError``, as ``jax.sharding`` raises) if a
        dimension does not divide, never a truncated shape."""
        return self.check(shape, "shard_shape").shard_shape

    @property
    def is_fully_replicated(self) -> bool:
        return not self._wire.spec

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, SliceSharding) and other.slice is self.slice
                and other._wire.spec == self._wire.spec)

    def __hash__(self) -> int:
        return hash((id(self.slice), tuple(map(tuple, self._wire.spec))))

    def __repr__(self) -> str:
        return f"SliceSharding(slice={self.slice.slice_id}, mesh={self.slice.mesh}, spec={self.spec})"


def default_spec(current: SliceSharding | None, sl: Slice) -> PartitionSpec:
    """The spec a value gets on ``sl`` when none is asked for: a value already on ``sl`` keeps its own; one
    on another slice keeps its spec where ``sl``'s mesh has the axes it names; anything else is replicated."""
    if current is None:
        return P()
    if current.slice is sl or all(name in sl.mesh for entry in current.spec for name in axes_of(entry)):
        return current.spec
    return P()


def resolve(specs: Any, tree: Any, what: str) -> list[PartitionSpec | None]:
    """One spec (or ``None``: the default) per leaf of ``tree``, from ``specs``: a spec, or a pytree prefix
    of ``tree`` whose leaves are specs or ``None`` (as ``in_specs`` of ``jax.shard_map``)."""
    if is_spec_leaf(specs):
        return [specs] * len(jax.tree_util.tree_leaves(tree))
    try:
        per_leaf = jax.tree_util.tree_map(lambda s, sub: _Broadcast(s, len(jax.tree_util.tree_leaves(sub))), specs,
                                          tree, is_leaf=is_spec_leaf)
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"{what} do not match the values' structure (they must be a pytree prefix of it, "
                              f"with PartitionSpecs or None as leaves): {exc}") from None
    out: list[PartitionSpec | None] = []
    for group in jax.tree_util.tree_leaves(per_leaf):
        if not is_spec_leaf(group.spec):
            raise InvalidArgument(f"{what}: {group.spec!r} is not a PartitionSpec")
        out.extend([group.spec] * group.leaves)
    return out


class _Broadcast:
    """One spec over the ``leaves`` leaves of a subtree (a pytree leaf itself, whatever the spec is)."""

    __slots__ = ("spec", "leaves")

    def __init__(self, spec: Any, leaves: int) -> None:
        self.spec = spec
        self.leaves = leaves


def abstract_mesh(sl: Slice) -> AbstractMesh:
    """The slice's mesh as functions are traced and exported under it. Its axes are Auto, as a
    ``jax.sharding.Mesh``'s are by default, which is what the executors build: a JAX whose AbstractMesh
    defaults to Explicit axes (0.11) would otherwise refuse the executors' mesh for the exported one."""
    return AbstractMesh(sl.mesh_shape, sl.axis_names, axis_types=(AxisType.Auto,) * len(sl.axis_names))


_clients: dict[int, Any] = {}
_clients_lock = threading.Lock()


def _virtual_devices(n: int) -> list[Any]:
    """``n`` CPU devices of a client of this module's own (JAX's default backend is left alone)."""
    with _clients_lock:
        client = _clients.get(n)
        if client is None:
            client = _clients[n] = xla_client.make_cpu_client(num_devices=n)
    return list(client.devices())


@functools.lru_cache(maxsize=64)
def propagation_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    """A concrete mesh of this shape over virtual CPU devices: compiling against it asks XLA's propagation."""
    return Mesh(np.array(_virtual_devices(int(np.prod(shape)))).reshape(shape), names)


def spec_from(sharding: Any, names: Sequence[str]) -> PartitionSpec:
    """The spec of an output sharding XLA chose (a ``NamedSharding`` over our mesh); replicated for one
    that is not expressible so (the value is then moved into that layout: correct, if slower)."""
    if isinstance(sharding, NamedSharding) and tuple(sharding.mesh.axis_names) == tuple(names):
        return sharding.spec
    return P()
