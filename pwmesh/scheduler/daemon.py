"""``pwmesh-scheduler --island N``: the asyncio shell around ``IslandOrder``."""

from __future__ import annotations

import dataclasses
from typing import Any

from pwmesh.errors import DeviceLost
from pwmesh.scheduler.order import IslandOrder
from pwmesh.service.heartbeat import every
from pwmesh.service.lifecycle import Service
from pwmesh.service.rpc import Connections, Server, wait_for_peer
from pwmesh.wire import Envelope
from pwmesh.wire.messages import (
    ExecutorLost,
    Heartbeat,
    Ping,
    PleaseRegister,
    RegisterScheduler,
    Scheduled,
    SchedulerInfo,
    ScheduleRun,
    WatchCluster,
)


@dataclasses.dataclass
class SchedulerConfig:
    island: int
    rm: str
    listen: str = "tcp://127.0.0.1:0"
    name: str = ""
    rm_timeout_seconds: float = 30.0
    heartbeat_interval_seconds: float = 2.0


class Scheduler(Service):
    role = "scheduler"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config.name or f"scheduler-{config.island}")
        self.config = config
        self.order = IslandOrder(config.island)

    async def setup(self) -> None:
        handlers = {
            ScheduleRun: self._schedule,
            Ping: self.ping,
        }
        self.server = Server(self.ctx, self.config.listen, handlers, tasks=self.tasks, name=self.name)
        self.server.start()
        self.peers = Connections(self.ctx, tasks=self.tasks, name=self.name, on_message=self._notified)
        rm = self.peers.get(self.config.rm)
        await wait_for_peer(rm, self._registration(), timeout_seconds=self.config.rm_timeout_seconds)
        await rm.request(WatchCluster(role=self.role, name=self.name), timeout_seconds=self.config.rm_timeout_seconds)
        self.tasks.spawn(every(self.config.heartbeat_interval_seconds, self._heartbeat), name="heartbeat")

    def _registration(self) -> RegisterScheduler:
        return RegisterScheduler(info=SchedulerInfo(island=self.config.island, address=self.server.address,
                                                    name=self.name))

    def _notified(self, env: Envelope) -> None:
        if isinstance(env.message, PleaseRegister):  # the resource manager restarted
            self.peers.post(self.config.rm, self._registration())
            self.peers.post(self.config.rm, WatchCluster(role=self.role, name=self.name))
        elif isinstance(env.message, ExecutorLost):
            lost = env.message
            self.peers.mark_lost(lost.control, DeviceLost(f"executor {lost.executor_id} is gone ({lost.reason})"))

    async def _heartbeat(self) -> None:
        self.peers.post(self.config.rm, Heartbeat(role=self.role, name=self.name))

    def _schedule(self, peer: bytes, env: Envelope) -> Scheduled:
        run = env.message
        assert isinstance(run, ScheduleRun)
        first = self.order.next_seq
        # Synchronous from sequencing to posting: each executor receives its
        # computations in island order, never two runs interleaved.
        for action in self.order.handle(run):
            self.peers.post(action.control, action.enqueue)
        return Scheduled(first_seq=first, count=len(run.computations))

    async def drain(self) -> None:
        await self.peers.barrier(timeout_seconds=2.0)

    def ready_info(self) -> dict[str, Any]:
        return {**super().ready_info(), "address": self.server.address, "island": self.config.island}
