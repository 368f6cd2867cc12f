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
    Ok,
    Ping,
    RegisterExecutor,
    RegisterScheduler,
    ReleaseSlices,
    UnregisterExecutor,
    WatchCluster,
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
        self.watchers: set[bytes] = set()
        handlers: dict[type[Message], Any] = {
            cls: self._handle for cls in (RegisterExecutor, UnregisterExecutor, RegisterScheduler, Heartbeat,
                                          AllocateSlice, ReleaseSlices, GetClusterState)}
        handlers[WatchCluster] = self._watch
        handlers[Ping] = self.ping
        self.server = Server(self.ctx, self.config.listen, handlers, tasks=self.tasks, name=self.name)
        self.server.start()
        self.tasks.spawn(every(self.config.heartbeat_timeout_seconds / 4, self._expire), name="rm.expire")

    def _handle(self, peer: bytes, env: Envelope) -> Message | None:
        reply = self.state.handle(env.message, time.monotonic())
        self._notify()
        return reply

    def _watch(self, peer: bytes, env: Envelope) -> Ok:
        self.watchers.add(peer)
        return Ok()

    async def _expire(self) -> None:
        self.state.expire(time.monotonic())
        self._notify()

    def _notify(self) -> None:
        for lost in self.state.take_notifications():
            log.warning("executor %s (host %s) lost: %s", lost.executor_id, lost.host, lost.reason)
            for peer in list(self.watchers):
                self.tasks.spawn(self._tell(peer, lost), name=f"notify-{lost.executor_id}")

    async def _tell(self, peer: bytes, message: Message) -> None:
        if not await self.server.send(peer, message):
            self.watchers.discard(peer)  # that proxy is gone

    def ready_info(self) -> dict[str, Any]:
        return {**super().ready_info(), "address": self.server.address}
