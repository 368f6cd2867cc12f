"""Virtual devices: what a client names; the resource manager maps them to physical ones."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pwmesh.errors import InvalidArgument
from pwmesh.wire.messages import CreateSlice, SliceCreated, SliceInfo

if TYPE_CHECKING:
    from pwmesh.client.api import Client


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


class Slice:
    """A set of virtual devices inside one island, with a logical mesh."""

    def __init__(self, client: Client, info: SliceInfo, mesh: dict[str, int]) -> None:
        self.client = client
        self.slice_id = info.slice_id
        self.island = info.island
        self.mesh = mesh
        self.devices = tuple(
            VirtualDevice(info.slice_id, i, d.island, d.host, d.executor_id, d.device, self)
            for i, d in enumerate(info.devices)
        )

    def __len__(self) -> int:
        return len(self.devices)

    def __repr__(self) -> str:
        return f"Slice(id={self.slice_id}, island={self.island}, devices={len(self.devices)}, mesh={self.mesh})"


class VirtualDeviceSet:
    def __init__(self, client: Client) -> None:
        self.client = client
        self.slices: list[Slice] = []

    def add_slice(self, devices: int, *, island: int | None = None, mesh: dict[str, int] | None = None) -> Slice:
        """Ask for ``devices`` devices in one island; raises ``ResourceExhausted`` if none can hold them."""
        mesh = dict(mesh) if mesh else {"x": devices}
        size = 1
        for n in mesh.values():
            size *= n
        if size != devices:
            raise InvalidArgument(f"mesh {mesh} has {size} devices, the slice asks for {devices}")
        reply = self.client.conn.request(CreateSlice(devices=devices, island=island))
        assert isinstance(reply, SliceCreated)
        sl = Slice(self.client, reply.slice, mesh)
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
