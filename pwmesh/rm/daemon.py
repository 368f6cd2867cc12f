"""``pwmesh-rm``: the resource manager's asyncio shell around ``ResourceManagerState``."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from pwmesh.rm.state import ResourceManagerState
from pwmesh.service.heartbeat import every
from pwmesh.service.lifecycle import Service
from pwmesh.service.rpc import Server
from pwmesh.wire import Envelope, Message
from pwmesh.wire.messages import (
    AllocateSlice,
    GetClusterState,
    Heartbeat,
    Ping,
    Pong,
    RegisterExecutor,
    RegisterScheduler,
    ReleaseSlices,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ResourceManagerConfig:
    listen: str = "tcp://127.0.0.1:0"
    name: str = "rm"
    heartbeat_timeout_seconds: float = 10.0


class ResourceManager(Service):
    role = "rm"

    def __init__(self, config: ResourceManagerConfig) -> None:
        super().__init__(config.name)
        self.config = config
        self.state = ResourceManagerState(heartbeat_timeout_seconds=config.heartbeat_timeout_seconds)

    async def setup(self) -> None:
        handlers = {cls: self._handle for cls in (RegisterExecutor, RegisterScheduler, Heartbeat,
                                                   AllocateSlice, ReleaseSlices, GetClusterState)}
        handlers[Ping] = lambda peer, env: Pong(role=self.role, name=self.name)
        self.server = Server(self.ctx, self.config.listen, handlers, tasks=self.tasks, name=self.name)
        self.server.start()
        self.tasks.spawn(every(self.config.heartbeat_timeout_seconds / 4, self._expire), name="rm.expire")

    def _handle(self, peer: bytes, env: Envelope) -> Message | None:
        return self.state.handle(env.message, time.monotonic())

    async def _expire(self) -> None:
        for executor_id in self.state.expire(time.monotonic()):
            log.warning("executor %s missed its heartbeats; marked lost", executor_id)

    def ready_info(self) -> dict[str, Any]:
        return {**super().ready_info(), "address": self.server.address}
