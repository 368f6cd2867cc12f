"""``pwmesh-rm``: the resource manager's asyncio shell around ``ResourceManagerState``: each request, and
every tick of its heartbeat check, is an event for the core; its ``Notify`` actions go to every watcher and
its ``Reply`` back to the requester."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from pwmesh.core.contract import Received, Reply
from pwmesh.errors import InvalidArgument, PermissionDenied
from pwmesh.rm.state import Action, Notify, ResourceManagerState, Tick
from pwmesh.service.heartbeat import every
from pwmesh.service.keys import Security, speaks_for, unkeyed
from pwmesh.service.lifecycle import Service
from pwmesh.service.metrics import Metric, counter, gauge, listen_host, wire_metrics
from pwmesh.service.rpc import Access, Server
from pwmesh.wire import Envelope, Message
from pwmesh.wire.messages import (
    AllocateSlice,
    ClaimProxy,
    DrainExecutor,
    ExecutorLost,
    GetClusterState,
    GetEvents,
    Heartbeat,
    LeavingForGroup,
    Ok,
    Ping,
    ProxyLost,
    RegisterExecutor,
    RegisterScheduler,
    RegrantSlices,
    ReleaseSlices,
    SliceRemapped,
    UnregisterExecutor,
    VacateSlices,
    WatchCluster,
    Watchers,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ResourceManagerConfig:
    listen: str = "tcp://127.0.0.1:0"
    name: str = "rm"
    heartbeat_timeout_seconds: float = 10.0
    security: Security = dataclasses.field(default_factory=Security)  # --keys, --insecure
    metrics_port: int | None = None  # Prometheus metrics over HTTP (0: a free port; None: none)


class ResourceManager(Service):
    role = "rm"

    def __init__(self, config: ResourceManagerConfig) -> None:
        super().__init__(config.name, config.security, metrics_port=config.metrics_port, metrics_host=listen_host(config.listen))
        self.config = config
        # Slice ids start from the clock, so a restarted RM never hands out an id that
        # a proxy still holds from before (they are restored as proxies re-register).
        self.state = ResourceManagerState(heartbeat_timeout_seconds=config.heartbeat_timeout_seconds,
                                          first_slice_id=int(time.time() * 1000) % (1 << 40))

    async def setup(self) -> None:
        self.watchers: set[bytes] = set()
        handlers: dict[type[Message], Any] = {
            cls: self._handle for cls in (RegisterExecutor, UnregisterExecutor, RegisterScheduler, Heartbeat,
                                          AllocateSlice, ReleaseSlices, DrainExecutor, GetClusterState, ClaimProxy,
                                          VacateSlices, RegrantSlices)}
        handlers[WatchCluster] = self._watch
        handlers[LeavingForGroup] = self._leaving
        handlers[Ping] = self.ping
        handlers[GetEvents] = self.events
        self.event_log = self.state.events
        # Everything here is the daemons' (register, watch, allocate...); an admin may read the map.
        self.server = Server(self.ctx, self.config.listen, handlers, tasks=self.tasks, name=self.name,
                             on_unreachable=self.watchers.discard, access=Access.of(admin=[GetClusterState, GetEvents]))
        self.server.start()
        self.tasks.spawn(every(self.config.heartbeat_timeout_seconds / 4, self._expire), name="rm.expire")

    def _handle(self, peer: bytes, env: Envelope) -> Message | None:
        self._check_claim(env)
        return self._act(self.state.handle(Received(env.message), time.monotonic()))

    def _check_claim(self, env: Envelope) -> None:
        """A daemon host's own key acts only as itself (``keys.speaks_for``): it registers, beats for,
        watches as and unregisters only the daemon it names; slices are allocated, released and hosts
        drained only by a proxy's key. The cluster's own key, and a keyless cluster's peers, may do all."""
        msg = env.message
        match msg:
            case RegisterExecutor(info=info):
                claims = [info.executor_id]
                self._check_keys(env, [info.control, info.data])
            case RegisterScheduler(info=info):
                claims = [info.name]
                self._check_keys(env, [info.address])
                held = self.state.schedulers.get(info.island)
                if held is not None and not speaks_for(env.user, held.name):  # a lost one is forgotten
                    raise PermissionDenied(f"island {info.island} has a live scheduler ({held.name!r}): "
                                           f"the key {env.user!r} cannot take it over")
            case UnregisterExecutor(executor_id=name) | LeavingForGroup(executor_id=name):
                claims = [name]
            case Heartbeat(name=name) | WatchCluster(name=name) | ClaimProxy(name=name):
                claims = [name]
            case AllocateSlice() | ReleaseSlices() | DrainExecutor() | VacateSlices() | RegrantSlices():
                proxies = [name for role, name in self.state.known if role == "proxy"]
                if speaks_for(env.user, "") or any(speaks_for(env.user, p) for p in proxies):
                    return
                raise PermissionDenied(f"{msg.op} is a proxy's: the key {env.user!r} is no proxy's")
            case _:
                return
        for name in claims:
            if not speaks_for(env.user, name):
                raise PermissionDenied(f"the daemon key {env.user!r} may act only as {env.user!r} "
                                       f"(or {env.user}:...), not as {name!r} ({msg.op})")

    def _check_keys(self, env: Envelope, addresses: list[str]) -> None:
        """The keys a daemon advertises in its addresses (``keys.keyed``) are its own or the cluster's:
        peers will hold it to them, so a host cannot send them to another's."""
        if self.ctx.keys is None:
            return
        for address in addresses:
            try:
                _, key = unkeyed(address)
            except InvalidArgument as exc:
                raise PermissionDenied(str(exc)) from None
            if key is None or key == self.ctx.keys.server_public:
                continue
            holder = self.ctx.whose(key)
            if holder is None or holder.name != env.user:
                raise PermissionDenied(f"the daemon key {env.user!r} cannot advertise {address!r}: that key is "
                                       f"{'nobody' if holder is None else repr(holder.name)}'s")

    def _watch(self, peer: bytes, env: Envelope) -> Message | None:
        self.watchers.add(peer)
        return self._handle(peer, env)

    def _leaving(self, peer: bytes, env: Envelope) -> Message | None:
        reply = self._handle(peer, env)  # every watcher is told before the executor hears back
        return Watchers(count=len(self.watchers)) if isinstance(reply, Ok) else reply

    async def _expire(self) -> None:
        self._act(self.state.handle(Tick(), time.monotonic()))

    def _act(self, actions: list[Action]) -> Message | None:
        """Carry out the core's actions: notices to every watcher, then the answer (returned, or raised)."""
        reply: Message | None = None
        for action in actions:
            if isinstance(action, Notify):
                self._notify(action.message)
            elif isinstance(action, Reply):
                if action.error is not None:
                    raise action.error
                reply = action.message
        return reply

    def _notify(self, note: Message) -> None:
        """Post a notice to every watcher, before the current reply."""
        # An executor that left (it drained and unregistered: a clean stop) is news, not trouble.
        level = logging.INFO if isinstance(note, ExecutorLost) and note.graceful else logging.WARNING
        if isinstance(note, ExecutorLost):
            log.log(level, "executor %s (host %s) %s: %s", note.executor_id, note.host,
                    "left" if note.graceful else "lost", note.reason)
        if isinstance(note, ProxyLost):
            log.warning("the active proxy %s at %s is lost (%s): a standby may take over", note.name,
                        note.address, note.reason)
        for remap in note.remapped if isinstance(note, ExecutorLost) else [note]:
            if isinstance(remap, SliceRemapped):
                log.log(level, "slice %s remapped (%s)%s", remap.slice.slice_id, remap.reason,
                        f": broken, {remap.slice.broken}" if remap.slice.broken else "")
        for peer in self.watchers:
            self.server.post(peer, note)

    def collect(self) -> list[Metric]:
        state = self.state
        executors = list(state.executors.values())
        return [
            *wire_metrics(self.role, self.name, self.server.received, self.server.sent, self.server.rejected),
            gauge("pwmesh_rm_executors", "Executors known, by state.", labels={"state": ""}, values=[
                (("alive",), sum(e.alive and not e.draining for e in executors)),
                (("draining",), sum(e.alive and e.draining for e in executors)),
                (("lost",), sum(not e.alive for e in executors))]),
            counter("pwmesh_rm_heartbeat_misses", "Daemons declared lost for missing their heartbeats, by role.",
                    labels={"role": ""}, values=sorted(state.heartbeat_misses.items())),
            counter("pwmesh_rm_executors_lost", "Executors lost (missed heartbeats, or died) or left (drained).",
                    labels={"how": ""}, values=[(("lost",), state.executors_lost), (("left",), state.executors_left)]),
            gauge("pwmesh_rm_schedulers", "Island schedulers registered.", len(state.schedulers)),
            gauge("pwmesh_rm_slices", "Virtual slices allocated.", len(state.slices)),
            gauge("pwmesh_rm_map_version", "Version of the virtual-to-physical device map.", state.map_version),
        ]

    def ready_info(self) -> dict[str, Any]:
        return {**super().ready_info(), "address": self.server.address}
