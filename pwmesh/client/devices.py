"""Virtual devices: what a client names; the resource manager maps them to physical ones.

A slice is a set of virtual devices inside one island, seen as a logical mesh: named
axes whose sizes multiply to the number of devices, devices in row-major order (as
``jax.sharding.Mesh(np.array(devices).reshape(sizes), names)``). Without ``mesh=`` a
slice is one axis ``"x"`` over all its devices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pwmesh.client.session import Session
from pwmesh.errors import InvalidArgument
from pwmesh.wire.messages import SliceInfo

DEFAULT_AXIS = "x"

# ``pwmesh.client.elastic`` moves a slice's arrays when it is resumed or reshaped: it sits above this module (it
# needs pw.Array and shardings), so it registers itself here when imported (``pwmesh.client.api`` imports it).
_elastic: list[Any] = []


def use_elastic(impl: Any) -> None:
    """Suspend, resume and reshape slices with ``impl`` (``pwmesh.client.elastic``)."""
    _elastic[:] = [impl]


def _impl() -> Any:
    if not _elastic:
        raise InvalidArgument("elastic slices come with the client library: import pwmesh.client.api")
    return _elastic[0]


@dataclasses.dataclass(frozen=True)
class VirtualDevice:
    """Device ``index`` of slice ``slice_id``; ``host``/``device`` say where it is backed now."""

    slice_id: int
    index: int
    island: int
    host: str
    executor: str
    device: int
    slice: Slice = dataclasses.field(compare=False, repr=False)

    def __repr__(self) -> str:
        return f"VirtualDevice(slice={self.slice_id}, index={self.index} -> {self.executor}:{self.device})"


def mesh_axes(mesh: Any, devices: int) -> dict[str, int]:
    """``mesh=`` as axis names to sizes, checked against the number of devices."""
    if mesh is None:
        return {DEFAULT_AXIS: devices}
    if isinstance(mesh, Mapping):
        pairs = list(mesh.items())
    elif isinstance(mesh, Sequence) and all(isinstance(p, Sequence) and len(p) == 2 for p in mesh):
        pairs = [tuple(p) for p in mesh]
    else:
        raise InvalidArgument(f"mesh= takes axis names and sizes, e.g. {{'data': 2, 'model': 2}}; got {mesh!r}")
    for name, size in pairs:
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"mesh axis names are non-empty strings, got {name!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InvalidArgument(f"mesh axis {name!r} has size {size!r}; sizes are positive integers")
    axes = dict(pairs)
    if len(axes) != len(pairs):
        raise InvalidArgument(f"mesh {mesh!r} names an axis twice")
    if math.prod(axes.values()) != devices:
        raise InvalidArgument(f"mesh {axes} has {math.prod(axes.values())} devices, the slice asks for {devices}")
    return axes


class Slice:
    """A set of virtual devices inside one island, with a logical mesh (``slice.mesh``: names to sizes)."""

    def __init__(self, session: Session, info: SliceInfo, mesh: dict[str, int]) -> None:
        self.session = session
        self.slice_id = info.slice_id
        self.mesh = dict(mesh)
        # How often its mesh changed (``reshape``): what was traced or exported for it before is stale.
        self.reshapes = 0
        self._adopt(info)

    def _adopt(self, info: SliceInfo, mesh: dict[str, int] | None = None) -> None:
        """Where the resource manager put it now (made, resumed, reshaped to ``mesh``)."""
        if mesh is not None:
            self.mesh = dict(mesh)
            self.reshapes += 1
        self.island = info.island
        self.suspended = info.suspended
        self.devices = tuple(
            VirtualDevice(info.slice_id, i, d.island, d.host, d.executor_id, d.device, self)
            for i, d in enumerate(info.devices)
        )
        # What its functions are exported for (cpu, cuda, rocm, tpu): its devices', which a remap keeps.
        self.platforms = sorted({d.platform for d in info.devices})

    def suspend(self) -> None:
        """Give its devices back to the cluster for others; its arrays stay where they are and readable
        (``pw.get``), but running on it (or putting to it) raises ``pw.SliceSuspended`` until ``resume``."""
        _impl().suspend(self)

    def resume(self, *, island: int | None = None) -> None:
        """Take devices again, wherever the resource manager grants them (other hosts, or ``island``), with
        every live array of it moved there: the same ``pw.Array`` objects, and the same functions, work on."""
        _impl().resume(self, island)

    def reshape(self, devices: int, *, mesh: Any = None, island: int | None = None) -> None:
        """Move it, running or suspended, onto ``devices`` devices seen as ``mesh`` (as ``add_slice`` takes it):
        each live array resharded there (its spec kept where the new mesh has its axes and its dimensions
        divide, else replicated), the same objects; its ``pw.jit`` functions are exported again for the mesh."""
        _impl().reshape(self, devices, mesh, island)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.mesh)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.values())

    @property
    def executors(self) -> set[str]:
        return {d.executor for d in self.devices}

    def __len__(self) -> int:
        return len(self.devices)

    def __repr__(self) -> str:
        state = ", suspended" if self.suspended else ""
        return (f"Slice(id={self.slice_id}, island={self.island}, devices={len(self.devices)}, mesh={self.mesh}"
                f"{state})")


class VirtualDeviceSet:
    def __init__(self, session: Session) -> None:
        self.session = session
        self.slices: list[Slice] = []

    def add_slice(self, devices: int, *, island: int | None = None, mesh: Any = None, kind: str = "") -> Slice:
        """Ask for ``devices`` devices in one island, seen as ``mesh`` (axis names to sizes, row-major;
        default one axis ``"x"``), all of ``kind`` if given: a platform (``"cpu"``, ``"gpu"``, ``"cuda"``,
        ``"rocm"``, ``"tpu"``) or part of a device kind (``"H100"``). Raises ``ResourceExhausted`` if no
        island can hold them."""
        if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
            raise InvalidArgument(f"a slice has a positive number of devices, got {devices!r}")
        axes = mesh_axes(mesh, devices)
        sl = Slice(self.session, self.session.create_slice(devices, island, kind), axes)
        self.slices.append(sl)
        return sl


def slice_of(devices: Slice | Sequence[VirtualDevice]) -> Slice:
    """The slice that ``devices`` (a slice, or all of its devices in order) names."""
    if isinstance(devices, Slice):
        return devices
    devices = list(devices)
    if not devices or not all(isinstance(d, VirtualDevice) for d in devices):
        raise InvalidArgument("devices= takes a Slice or the VirtualDevices of one (slice.devices)")
    sl = devices[0].slice
    if list(sl.devices) != devices:
        raise InvalidArgument("devices= must be all of one slice's devices, in order (subsets are not supported yet)")
    return sl
