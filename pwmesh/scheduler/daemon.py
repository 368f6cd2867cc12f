"""``pwmesh-scheduler --island N``: the asyncio shell around ``IslandOrder``."""

from __future__ import annotations

import dataclasses
from typing import Any

from pwmesh.errors import DeviceLost
from pwmesh.scheduler.order import IslandOrder, SendEnqueue
from pwmesh.service.heartbeat import every
from pwmesh.service.lifecycle import Service
from pwmesh.service.rpc import Connections, Server, wait_for_peer
from pwmesh.wire import Envelope
from pwmesh.wire.messages import (
    ExecutorJoined,
    ExecutorLost,
    GetSchedulerStats,
    Heartbeat,
    Ping,
    PleaseRegister,
    RegisterScheduler,
    RunPartDone,
    SchedulerInfo,
    SchedulerStats,
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
    policy: str = "fair"
    window: int = 8  # runs in flight per device


class Scheduler(Service):
    role = "scheduler"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config.name or f"scheduler-{config.island}")
        self.config = config

    async def setup(self) -> None:
        handlers = {
            ScheduleRun: self._schedule,
            RunPartDone: self._part_done,
            GetSchedulerStats: self._stats,
            Ping: self.ping,
        }
        self.server = Server(self.ctx, self.config.listen, handlers, tasks=self.tasks, name=self.name)
        self.order = IslandOrder(self.config.island, policy=self.config.policy, window=self.config.window,
                                 scheduler=self.server.address)
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
        elif isinstance(env.message, ExecutorJoined):
            self.peers.mark_alive(env.message.control)
        elif isinstance(env.message, ExecutorLost):
            lost = env.message
            self.peers.mark_lost(lost.control, DeviceLost(f"executor {lost.executor_id} is gone ({lost.reason})"))
            self._post(self.order.forget_executor(lost.executor_id))

    async def _heartbeat(self) -> None:
        self.peers.post(self.config.rm, Heartbeat(role=self.role, name=self.name))

    def _post(self, actions: list[SendEnqueue]) -> None:
        # Synchronous from sequencing to posting: each executor receives its parts in
        # island order (and can restore it from ``executor_seq`` regardless).
        for action in actions:
            self.peers.post(action.control, action.enqueue)

    def _schedule(self, peer: bytes, env: Envelope) -> None:
        run = env.message
        assert isinstance(run, ScheduleRun)
        self._post(self.order.submit(run))

    def _part_done(self, peer: bytes, env: Envelope) -> None:
        msg = env.message
        assert isinstance(msg, RunPartDone)
        self._post(self.order.part_done(msg.run_id, msg.executor_id, msg.device_seconds))

    def _stats(self, peer: bytes, env: Envelope) -> SchedulerStats:
        return SchedulerStats(island=self.config.island, policy=self.order.policy, next_seq=self.order.next_seq,
                              clients=self.order.usage())

    async def drain(self) -> None:
        await self.peers.barrier(timeout_seconds=2.0)

    def ready_info(self) -> dict[str, Any]:
        return {**super().ready_info(), "address": self.server.address, "island": self.config.island}
