"""Moving values between layouts and slices: ``pw.reshard`` and mixture-of-experts routing (``pw.Router``).

Both add nodes to the program being traced (inside ``@pw.program``) or run as a
program of their own (outside). Neither sends data through the controller:
executors send each other shard-tagged tuples, and progress markers tell each
destination when it has everything (see ``pwmesh.dataflow``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from pwmesh.client.array import Array
from pwmesh.client.devices import Slice, VirtualDevice, slice_of
from pwmesh.client.dispatch import execute
from pwmesh.client.functions import JitFunction, MappedFunction
from pwmesh.client.sharding import P, SliceSharding, default_spec, is_spec_leaf, resolve
from pwmesh.client.tracing import ProgramCache, Symbol, current_builder
from pwmesh.errors import InvalidArgument

_reshards: weakref.WeakKeyDictionary[Slice, tuple[int, ProgramCache]] = weakref.WeakKeyDictionary()


def _reshard_one(x: Any, sl: Slice, spec: PartitionSpec | None) -> Any:
    builder = current_builder()
    assert builder is not None
    now = x.sharding if isinstance(x, (Array, Symbol)) else None
    return builder.reshard(x, SliceSharding(sl, spec if spec is not None else default_spec(now, sl)))


def reshard(x: Any, *, devices: Slice | Sequence[VirtualDevice], spec: Any = None) -> Any:
    """``x`` (a pytree of ``pw.Array``s, host arrays, or values inside ``@pw.program``) laid out on
    ``devices`` as ``spec`` says (a ``PartitionSpec`` or a pytree prefix of them; left out, as for
    ``pw.jit``'s arguments): a copy to other executors or islands, a gather, a scatter or a re-cut,
    whatever the two layouts need. Only the blocks each destination lacks move."""
    sl = slice_of(devices)
    if current_builder() is not None:
        return _map_with_specs(lambda leaf, s: _reshard_one(leaf, sl, s), x, spec)
    reshapes, cache = _reshards.get(sl, (-1, None))
    if cache is None or reshapes != sl.reshapes:  # made for the mesh it had before a ``Slice.reshape``
        cache = ProgramCache(lambda args, kwargs, static: reshard(args[0], devices=sl, spec=_spec_tree(static[0][1])))
        _reshards[sl] = (sl.reshapes, cache)
    traced = cache.get((x,), {}, ((0, _spec_key(spec)),))
    return execute(traced, jax.tree_util.tree_leaves(x))


def _map_with_specs(f: Any, tree: Any, spec: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    specs = resolve(spec, tree, "pw.reshard: spec")
    return jax.tree_util.tree_unflatten(treedef, [f(leaf, s) for leaf, s in zip(leaves, specs, strict=True)])


def _spec_key(spec: Any) -> tuple[Any, tuple[Any, ...]]:
    """A tree of specs as a hashable key (specs are hashable, their containers need not be)."""
    leaves, treedef = jax.tree_util.tree_flatten(spec, is_leaf=is_spec_leaf)
    return treedef, tuple(leaves)


def _spec_tree(key: tuple[Any, tuple[Any, ...]]) -> Any:
    treedef, leaves = key
    return jax.tree_util.tree_unflatten(treedef, list(leaves))


class Router:
    """Mixture-of-experts routing: ``Router(experts)(x, expert_ids)``.

    Row ``r`` of ``x`` goes to ``experts[expert_ids[r]]`` — only there: each expert's
    executor receives its own rows and nothing else — and the experts' results come
    back in row order, split over ``devices`` (default: the first expert's slice), which
    is also where the rows are routed from. Each expert is a ``pw.jit`` function on a
    slice of one device, written for all the rows (``x.shape``): it gets its rows padded
    to that capacity, must treat rows independently, and returns one row per row. An
    expert that gets no rows does not run, and still completes.
    """

    def __init__(self, experts: Sequence[JitFunction | MappedFunction], *,
                 devices: Slice | Sequence[VirtualDevice] | None = None) -> None:
        self.experts = list(experts)
        if not self.experts:
            raise InvalidArgument("a router needs at least one expert")
        for e in self.experts:
            if not isinstance(e, (JitFunction, MappedFunction)):
                raise InvalidArgument(f"experts are pw.jit functions, got {type(e).__name__}")
            if len(e.slice.devices) != 1:
                raise InvalidArgument(f"expert {e.__name__} runs on {len(e.slice.devices)} devices; "
                                      "an expert runs on a slice of one device")
        self.home = slice_of(devices) if devices is not None else self.experts[0].slice
        if any(e.slice.session is not self.home.session for e in self.experts):
            raise InvalidArgument("a router's experts and devices must belong to one client")
        names = self.home.axis_names
        self.blocks = SliceSharding(self.home, P(names[0] if len(names) == 1 else names))
        self._eager = ProgramCache(lambda args, kwargs, static: self(*args))

    def __call__(self, x: Any, expert_ids: Any) -> Any:
        builder = current_builder()
        if builder is not None:
            return builder.route(x, expert_ids, self.experts, self.home, self.blocks)
        return execute(self._eager.get((x, expert_ids), {}), [x, expert_ids])

    def __repr__(self) -> str:
        return f"pw.Router({len(self.experts)} experts, slice={self.home.slice_id})"
