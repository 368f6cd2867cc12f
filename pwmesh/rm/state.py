"""The resource manager's state machine, with no sockets: ``handle(message, now) -> reply``."""

from __future__ import annotations

import dataclasses
import itertools

from pwmesh.errors import InvalidArgument, NotFound
from pwmesh.rm.placement import DeviceRef, place
from pwmesh.service.heartbeat import Liveness
from pwmesh.wire.messages import (
    AllocateSlice,
    ClusterState,
    ClusterStateReply,
    ExecutorInfo,
    ExecutorLost,
    GetClusterState,
    Heartbeat,
    Message,
    Ok,
    PhysicalDevice,
    RegisterExecutor,
    RegisterScheduler,
    ReleaseSlices,
    SchedulerInfo,
    SliceAllocated,
    SliceInfo,
    UnregisterExecutor,
)


@dataclasses.dataclass
class ResourceManagerState:
    heartbeat_timeout_seconds: float = 10.0
    map_version: int = 0
    executors: dict[str, ExecutorInfo] = dataclasses.field(default_factory=dict)
    schedulers: dict[int, SchedulerInfo] = dataclasses.field(default_factory=dict)
    slices: dict[int, SliceInfo] = dataclasses.field(default_factory=dict)
    _slice_ids: itertools.count = dataclasses.field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        self.liveness = Liveness(self.heartbeat_timeout_seconds)
        self.notifications: list[ExecutorLost] = []

    def handle(self, message: Message, now: float) -> Message | None:
        match message:
            case RegisterExecutor(info=info):
                return self._register_executor(info, now)
            case UnregisterExecutor(executor_id=executor_id, reason=reason):
                if executor_id in self.executors:
                    self._lose(executor_id, reason, graceful=True)
                return Ok()
            case RegisterScheduler(info=info):
                self.schedulers[info.island] = info
                return Ok()
            case Heartbeat(role="executor", name=name):
                if name in self.executors:
                    self.liveness.beat(name, now)
                return None
            case Heartbeat():
                return None
            case AllocateSlice(owner=owner, devices=n, island=island):
                return SliceAllocated(slice=self._allocate(owner, n, island))
            case ReleaseSlices(owner=owner, slice_ids=ids):
                self._release(owner, ids)
                return Ok()
            case GetClusterState():
                return ClusterStateReply(state=self.snapshot())
        raise InvalidArgument(f"the resource manager does not handle {message.op}")

    def _register_executor(self, info: ExecutorInfo, now: float) -> Ok:
        info.alive = True
        self.executors[info.executor_id] = info
        self.liveness.beat(info.executor_id, now)
        self.map_version += 1
        return Ok()

    def load(self) -> dict[DeviceRef, int]:
        counts: dict[DeviceRef, int] = {}
        for sl in self.slices.values():
            for d in sl.devices:
                ref = (d.executor_id, d.device)
                counts[ref] = counts.get(ref, 0) + 1
        return counts

    def _allocate(self, owner: str, n: int, island: int | None) -> SliceInfo:
        isl, refs = place(self.executors.values(), self.load(), n, island)
        if isl not in self.schedulers:
            raise NotFound(f"island {isl} has devices but no scheduler has registered for it yet")
        self.map_version += 1
        devices = []
        for executor_id, device in refs:
            ex = self.executors[executor_id]
            devices.append(PhysicalDevice(executor_id=executor_id, island=ex.island, host=ex.host,
                                          device=device, control=ex.control, data=ex.data))
        sl = SliceInfo(slice_id=next(self._slice_ids), owner=owner, island=isl, devices=devices,
                       map_version=self.map_version, scheduler=self.schedulers[isl].address)
        self.slices[sl.slice_id] = sl
        return sl

    def _release(self, owner: str, ids: list[int] | None) -> None:
        doomed = [sid for sid, sl in self.slices.items() if sl.owner == owner and (ids is None or sid in ids)]
        for sid in doomed:
            del self.slices[sid]
        if doomed:
            self.map_version += 1

    def expire(self, now: float) -> list[str]:
        """Mark executors that missed their heartbeats as lost; returns their ids."""
        lost = [e for e in self.liveness.expired(now) if self.executors[e].alive]
        for executor_id in lost:
            self._lose(executor_id, f"missed heartbeats for {self.heartbeat_timeout_seconds} seconds")
        return lost

    def _lose(self, executor_id: str, reason: str, graceful: bool = False) -> None:
        info = self.executors[executor_id]
        if not info.alive:
            return
        info.alive = False
        self.liveness.forget(executor_id)
        self.map_version += 1
        self.notifications.append(ExecutorLost(executor_id=executor_id, host=info.host, control=info.control,
                                               reason=reason, graceful=graceful))

    def take_notifications(self) -> list[ExecutorLost]:
        """What watchers (proxies) must be told since the last call."""
        out, self.notifications = self.notifications, []
        return out

    def snapshot(self) -> ClusterState:
        return ClusterState(
            map_version=self.map_version,
            executors=list(self.executors.values()),
            schedulers=sorted(self.schedulers.values(), key=lambda s: s.island),
            slices=list(self.slices.values()),
        )
