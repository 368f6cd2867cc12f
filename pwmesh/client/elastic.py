"""Elastic slices, the client's side: ``Slice.suspend``, ``Slice.resume`` and ``Slice.reshape``.

The proxy and the resource manager do the work (``pwmesh/proxy/elastic.py``): the slice keeps its
id, the resource manager grants it devices anew, and the proxy copies every live buffer of it
executor to executor onto them, binding each ``pw.Array``'s id to the copy. Here a slice waits for
its arrays to be computed first (nothing moves under a run), and, for a reshape, says how each
array lies on the new mesh and gives each array its new sharding: the same objects, so a training
loop goes on with the arrays and functions it holds.
"""

from __future__ import annotations

import math
from typing import Any

from jax.sharding import PartitionSpec

from pwmesh.client.array import Array
from pwmesh.client.devices import Slice, mesh_axes, use_elastic
from pwmesh.client.sharding import P, SliceSharding, axes_of, spec_indices
from pwmesh.errors import InvalidArgument, PwmeshError
from pwmesh.wire.messages import Sharding


def arrays_on(sl: Slice, *, donated: bool = False) -> list[Array]:
    """The live ``pw.Array``s laid out on ``sl`` (``donated``: and those donated to a call, which the cluster
    gives back if that call's run was aborted before it consumed them: they move with the slice too)."""
    return [a for a in sl.session.arrays(donated=donated) if isinstance(a, Array) and a.sharding.slice is sl]


def _settle(sl: Slice, arrays: list[Array]) -> None:
    """Wait until every array of ``sl`` is computed: a resume or reshape moves nothing that a run still makes.
    (A run holds its arrays until its last report reaches the proxy, which may come after its values: the
    proxy answers the resume once nothing holds them, ``ProxyState._when_settled``.)"""
    if arrays:
        try:
            sl.session.await_buffers([a.buffer_id for a in arrays])
        except PwmeshError:  # a failed array moves as it is, failed with its cause
            pass


def suspend(sl: Slice) -> None:
    (info,) = sl.session.suspend_slices([sl.slice_id])
    sl._adopt(info)


def resume(sl: Slice, island: int | None) -> None:
    _settle(sl, arrays_on(sl))
    (info,) = sl.session.resume_slices([sl.slice_id], island=island)
    sl._adopt(info)


def kept_spec(array: Array, axes: dict[str, int]) -> PartitionSpec:
    """``array``'s spec on a mesh of ``axes``: its own where that mesh has the axes it names and its dimensions
    divide by them, else replicated."""
    spec = array.sharding.spec
    for d, entry in enumerate(spec):
        names = axes_of(entry)
        if any(name not in axes for name in names) or array.shape[d] % math.prod(axes[n] for n in names):
            return P()
    return spec


def reshape(sl: Slice, devices: int, mesh: Any, island: int | None) -> None:
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise InvalidArgument(f"a slice has a positive number of devices, got {devices!r}")
    axes = mesh_axes(mesh, devices)
    arrays = arrays_on(sl, donated=True)  # one given back later lies as the others do
    specs = [kept_spec(a, axes) for a in arrays]
    sizes = list(axes.values())
    shardings = [Sharding(mesh=sizes, spec=spec_indices(spec, tuple(axes), f"pw.Array {a.buffer_id}"))
                 for a, spec in zip(arrays, specs, strict=True)]
    _settle(sl, [a for a in arrays if not a.donated])
    (info,) = sl.session.resume_slices([sl.slice_id], devices=devices, island=island, mesh=sizes,
                                       buffers=[a.buffer_id for a in arrays], shardings=shardings)
    sl._adopt(info, axes)
    for a, spec in zip(arrays, specs, strict=True):
        a.sharding = SliceSharding(sl, spec)


class _Elastic:
    """What ``Slice`` calls (``devices.use_elastic``)."""

    suspend = staticmethod(suspend)
    resume = staticmethod(resume)
    reshape = staticmethod(reshape)


use_elastic(_Elastic)
