"""Moving values between slices: ``pw.reshard`` and mixture-of-experts routing (``pw.Router``).

Both add nodes to the program being traced (inside ``@pw.program``) or run as a
program of their own (outside). Neither sends data through the controller:
executors send each other shard-tagged tuples, and progress markers tell each
destination when it has everything (see ``pwmesh.dataflow``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from pwmesh.client.devices import Slice, VirtualDevice, slice_of
from pwmesh.client.functions import MappedFunction
from pwmesh.client.tracing import ProgramCache, _building, execute
from pwmesh.errors import InvalidArgument

_reshards: weakref.WeakKeyDictionary[Slice, ProgramCache] = weakref.WeakKeyDictionary()


def reshard(x: Any, *, devices: Slice | Sequence[VirtualDevice]) -> Any:
    """``x`` (a ``pw.Array``, a host array, or a value inside ``@pw.program``) split in equal blocks
    along its leading axis over ``devices``: a copy to other executors or islands, a scatter, a
    gather or a re-slice, whatever the two layouts need. Only the overlapping rows move."""
    sl = slice_of(devices)
    builder = _building.get()
    if builder is not None:
        return builder.reshard(x, sl)
    cache = _reshards.get(sl)
    if cache is None:
        cache = _reshards[sl] = ProgramCache(lambda value: reshard(value, devices=sl))
    return execute(cache.get([x]), [x])


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

    def __init__(self, experts: Sequence[MappedFunction], *,
                 devices: Slice | Sequence[VirtualDevice] | None = None) -> None:
        self.experts = list(experts)
        if not self.experts:
            raise InvalidArgument("a router needs at least one expert")
        for e in self.experts:
            if not isinstance(e, MappedFunction):
                raise InvalidArgument(f"experts are pw.jit functions, got {type(e).__name__}")
            if len(e.slice.devices) != 1:
                raise InvalidArgument(f"expert {e.__name__} runs on {len(e.slice.devices)} devices; "
                                      "an expert runs on a slice of one device")
        self.home = slice_of(devices) if devices is not None else self.experts[0].slice
        if any(e.slice.client is not self.home.client for e in self.experts):
            raise InvalidArgument("a router's experts and devices must belong to one client")
        self._eager = ProgramCache(self)

    def __call__(self, x: Any, expert_ids: Any) -> Any:
        builder = _building.get()
        if builder is not None:
            return builder.route(x, expert_ids, self.experts, self.home)
        return execute(self._eager.get([x, expert_ids]), [x, expert_ids])

    def __repr__(self) -> str:
        return f"pw.Router({len(self.experts)} experts, slice={self.home.slice_id})"
