"""``pwmesh-scheduler --island N``: the asyncio shell around ``SchedulerState`` (``IslandOrder`` and, with
``--collectives``, ``IslandGroup``: it serves the island's JAX group, each forming's coordinator a child
process of its own). Messages and ticks become events for the core; its actions become messages, and
coordinators started and stopped. Executors report their parts' completions here (``NodeDone``,
``RunPartDone``: each checked against the sender's key) and the core tells the proxy once per run
(``IslandDone``); the proxy's frees for the island come as one ``FreeShards``, sent on per executor."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

from pwmesh.core.contract import Received, Reply, Send
from pwmesh.core.ratelimit import RejectedLog
from pwmesh.errors import DeviceLost, PermissionDenied, PwmeshError
from pwmesh.scheduler.group import AskAgain, Form, Formed, IslandGroup
from pwmesh.scheduler.order import IslandOrder
from pwmesh.scheduler.state import Event, SchedulerState, Tick
from pwmesh.service.heartbeat import every
from pwmesh.service.keys import Security, speaks_for
from pwmesh.service.lifecycle import Service
from pwmesh.service.metrics import Metric, counter, gauge, listen_host, merged, wire_metrics
from pwmesh.service.rpc import Access, Beats, Connections, Handler, Server, wait_for_peer
from pwmesh.wire import Envelope, Message
from pwmesh.wire.messages import (
    ClusterStateReply,
    ExecutorJoined,
    ExecutorLost,
    ExecutorRestarting,
    Fence,
    FreeShards,
    GetClusterState,
    GetEvents,
    GetSchedulerStats,
    Heartbeat,
    InstallTemplate,
    JoinGroup,
    NeedTemplate,
    NodeDone,
    PartsDone,
    Ping,
    PleaseRegister,
    RegisterScheduler,
    RunPartDone,
    RunTemplate,
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
    collectives: bool = False  # form the island's JAX group of its --collectives executors
    security: Security = dataclasses.field(default_factory=Security)  # --keys, --insecure
    metrics_port: int | None = None  # Prometheus metrics over HTTP (0: a free port; None: none)
    # A run over more than ``fanout_above`` executors (None: $PWMESH_FANOUT_ABOVE or 256) goes out through a tree of
    # them, ``fanout`` wide (None: $PWMESH_FANOUT or 16): ``tree.py``.
    fanout: int | None = None
    fanout_above: int | None = None


log = logging.getLogger(__name__)


class Scheduler(Service):
    role = "scheduler"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config.security.named(config.name, f"scheduler-{config.island}"), config.security,
                         metrics_port=config.metrics_port,
                         metrics_host=listen_host(config.listen))
        self.config = config
        self._notice_log = RejectedLog(self.name, logger=log)  # notices a peer made unappliable: rate-limited

    async def setup(self) -> None:
        handlers: dict[type[Message], Handler] = {
            ScheduleRun: self._schedule,
            InstallTemplate: self._schedule,
            RunTemplate: self._schedule,
            NeedTemplate: self._need_template,
            RunPartDone: self._part_done,
            NodeDone: self._part_done,
            PartsDone: self._parts_done,
            FreeShards: self._schedule,
            GetSchedulerStats: self._stats,
            GetEvents: self.events,
            Ping: self.ping,
        }
        self.server = Server(self.ctx, self.config.listen, handlers, tasks=self.tasks, name=self.name,
                             access=Access.of(admin=[GetSchedulerStats, GetEvents]))
        self.order = IslandOrder(self.config.island, policy=self.config.policy, window=self.config.window,
                                 scheduler=self.ctx.advertise(self.server.address))
        self.group = IslandGroup() if self.config.collectives else None
        self.state = SchedulerState(self.order, self.group, self.config.fanout, self.config.fanout_above)
        self.event_log = self.state.events
        self._coordinators: dict[int, asyncio.subprocess.Process] = {}  # forming -> its coordinator
        self._addresses: dict[int, str] = {}  # forming -> its coordinator's address
        self.server.start()
        self.peers = Connections(self.ctx, tasks=self.tasks, name=self.name, on_message=self._notified)
        rm = self.peers.get(self.config.rm)
        await wait_for_peer(rm, self._registration(), timeout_seconds=self.config.rm_timeout_seconds)
        await rm.request(WatchCluster(role=self.role, name=self.name), timeout_seconds=self.config.rm_timeout_seconds)
        self.rm_beats = Beats(self.peers, self.config.rm, "resource manager", self.config.heartbeat_interval_seconds,
                              self._notified)
        self.tasks.spawn(every(self.config.heartbeat_interval_seconds, self._heartbeat), name="heartbeat")
        if self.group is not None:
            # Executors that registered before we watched: the notifications after this add to them.
            reply = await rm.request(GetClusterState(), timeout_seconds=self.config.rm_timeout_seconds)
            assert isinstance(reply, ClusterStateReply)
            for info in reply.state.executors:
                if info.alive and info.island == self.config.island and info.group:
                    self._handle(Received(ExecutorJoined(executor_id=info.executor_id, control=info.control,
                                                         island=info.island, group=info.group,
                                                         group_epoch=info.group_epoch)))
            self.tasks.spawn(every(0.25, self._tick), name="group-tick")

    def _registration(self) -> RegisterScheduler:
        return RegisterScheduler(info=SchedulerInfo(island=self.config.island, address=self.ctx.advertise(self.server.address),
                                                    name=self.name, epoch=self.order.epoch))

    def _notified(self, env: Envelope) -> None:
        if isinstance(env.message, PleaseRegister):  # the resource manager restarted
            self.peers.post(self.config.rm, self._registration())
            self.peers.post(self.config.rm, WatchCluster(role=self.role, name=self.name))
        elif isinstance(env.message, ExecutorJoined):
            self.peers.mark_alive(env.message.control)
            self._handle(Received(env.message))
        elif isinstance(env.message, ExecutorRestarting):
            try:
                self.peers.fence(env.message.control, Fence(epoch=env.message.epoch))
            except PwmeshError as exc:  # an address nothing can connect to: nothing to fence
                self._notice_log.warning(env.message.op, "notice %s not applied: %s", env.message.op, exc)
            self._handle(Received(env.message))  # the fan-out subtrees it heads (``tree.py``)
        elif isinstance(env.message, ExecutorLost):
            lost = env.message
            self.peers.mark_lost(lost.control, DeviceLost(f"executor {lost.executor_id} is gone ({lost.reason})"))
            self._handle(Received(lost))

    async def _heartbeat(self) -> None:
        await self.rm_beats.beat(Heartbeat(role=self.role, name=self.name))

    def _handle(self, event: Event) -> None:
        """Hand the core ``event`` and carry out its actions, in order: synchronous from sequencing to
        posting, so each executor receives its parts in island order (and can restore it from
        ``executor_seq`` regardless)."""
        for action in self.state.handle(event, time.monotonic()):
            match action:
                case Send(to=to, message=message):
                    self.peers.post(to, message)
                case Reply(error=error) if error is not None:
                    raise error
                case Form(epoch=epoch, members=members):
                    self._form(epoch, members)
                case AskAgain(epoch=epoch, members=members):
                    assert self.group is not None
                    log.warning("island %d: %s not in forming %d of the JAX group yet; asking again",
                                self.config.island, ", ".join(members), epoch)
                    self._ask(epoch, members, self.group.forming or members)
                case Formed(epoch=epoch, members=members):
                    log.info("island %d: JAX group forming %d complete: %s", self.config.island, epoch,
                             ", ".join(members) or "no members")
                    for old in [e for e in self._coordinators if e < epoch]:
                        self.tasks.spawn(self._stop_coordinator(old), name=f"stop-coordinator-{old}")

    # ------------------------------------------------------------ the JAX group

    async def _tick(self) -> None:
        self._handle(Tick())

    def _form(self, epoch: int, members: tuple[str, ...]) -> None:
        # Formings abandoned under way (a member left) stop now: their members fail to join and start over.
        assert self.group is not None
        for old in [e for e in self._coordinators if e > self.group.formed_epoch]:
            self.tasks.spawn(self._stop_coordinator(old), name=f"stop-coordinator-{old}")
        host = listen_host(self.server.address)  # a Unix socket (a private local cluster): loopback
        if host in ("*", "0.0.0.0", ""):  # noqa: S104 - a wildcard bind: the group listens where we are reached
            host = socket.gethostname()
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        address = f"{host}:{port}"
        log.info("island %d: forming %d of the JAX group at %s: %s", self.config.island, epoch, address,
                 ", ".join(members))
        self.tasks.spawn(self._coordinate(epoch, address, len(members) + 1), name=f"coordinator-{epoch}")
        self._ask(epoch, members, members, address)

    def _ask(self, epoch: int, ask: tuple[str, ...], members: tuple[str, ...], address: str = "") -> None:
        address = address or self._addresses.get(epoch, "")
        self._addresses[epoch] = address
        for member in ask:
            self.peers.post(self.state.controls[member], JoinGroup(epoch=epoch, coordinator=address, members=list(members)))

    async def _coordinate(self, epoch: int, address: str, processes: int) -> None:
        """Serve forming ``epoch``: its coordinator is a child process until a later forming completes."""
        env = {**os.environ, "PWMESH_PARENT_PID": str(os.getpid()), "JAX_PLATFORMS": "cpu"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pwmesh.cli.daemons", "jax-coordinator", "--address", address,
            "--processes", str(processes), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            env=env)
        self._coordinators[epoch] = proc
        code = await proc.wait()
        if self._coordinators.get(epoch) is proc and code != 0:
            log.warning("island %d: the coordinator of forming %d exited with %d", self.config.island, epoch, code)

    async def _stop_coordinator(self, epoch: int) -> None:
        """SIGTERM, then SIGKILL after 5 s: a stuck coordinator never outlives its forming."""
        proc = self._coordinators.pop(epoch, None)
        self._addresses.pop(epoch, None)
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout=5.0)
        except TimeoutError:
            proc.kill()
            await proc.wait()

    def _schedule(self, peer: bytes, env: Envelope) -> None:
        assert isinstance(env.message, ScheduleRun | InstallTemplate | RunTemplate | FreeShards)
        self._handle(Received(env.message))

    def _need_template(self, peer: bytes, env: Envelope) -> None:
        msg = env.message
        assert isinstance(msg, NeedTemplate)
        if not speaks_for(env.user, msg.executor_id):
            raise PermissionDenied(f"the daemon key {env.user!r} cannot ask for {msg.executor_id}'s parts")
        self._handle(Received(msg))

    def _part_done(self, peer: bytes, env: Envelope) -> None:
        msg = env.message
        assert isinstance(msg, RunPartDone | NodeDone)
        if not speaks_for(env.user, msg.executor_id):
            raise PermissionDenied(f"the daemon key {env.user!r} cannot report {msg.executor_id}'s parts done")
        self._handle(Received(msg))

    def _parts_done(self, peer: bytes, env: Envelope) -> None:
        msg = env.message
        assert isinstance(msg, PartsDone)
        if not speaks_for(env.user, msg.head):  # and the core takes from a head only what its subtree reported
            raise PermissionDenied(f"the daemon key {env.user!r} cannot report for fan-out head {msg.head}")
        self._handle(Received(msg))

    def _stats(self, peer: bytes, env: Envelope) -> SchedulerStats:
        return SchedulerStats(island=self.config.island, policy=self.order.policy, next_seq=self.order.next_seq,
                              clients=self.order.usage())

    async def drain(self) -> None:
        await self.peers.barrier(timeout_seconds=2.0)

    async def close(self) -> None:
        await super().close()
        for epoch in list(getattr(self, "_coordinators", {})):
            try:
                await self._stop_coordinator(epoch)
            except (PwmeshError, ProcessLookupError):
                pass

    def collect(self) -> list[Metric]:
        received, rejected = self.peers.counts()
        usage = self.order.usage()
        return [
            *wire_metrics(self.role, self.name, merged(self.server.received, received),
                          merged(self.server.sent, self.peers.sent), merged(self.server.rejected, rejected)),
            counter("pwmesh_scheduler_sequenced", "Computations placed in the island's order.", self.order.next_seq),
            gauge("pwmesh_scheduler_runs_in_flight", "Runs sequenced and not yet done on every executor.",
                  self.order.in_flight),
            gauge("pwmesh_scheduler_runs_waiting", "Runs waiting for their devices' window.",
                  sum(u.waiting for u in usage)),
            gauge("pwmesh_scheduler_clients", "Client sessions the policy tracks.", len(usage)),
        ]

    def ready_info(self) -> dict[str, Any]:
        return {**super().ready_info(), "address": self.server.address, "island": self.config.island}
