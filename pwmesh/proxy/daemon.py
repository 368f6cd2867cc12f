"""``pwmesh-proxy``: the shell around the proxy's pure core (``proxy/state.py``).

Everything the proxy decides is in ``ProxyState``; this daemon only does its I/O: it feeds
the core what arrives (client requests, executors' completions, the RM's notices, a tick),
sends what the core says to, and holds the futures of the requests that wait (an
``AwaitBuffers``, a ``Fetch``, a ``CreateSlice`` waiting on the RM).

``RunProgram`` is handled synchronously from validation to the last posted message: the
output buffers exist before the handler returns, so a ``Fetch`` sent right behind it always
finds them, and a run's messages leave in order. The client does not wait for the run:
dispatch is asynchronous; completion arrives as ``IslandDone`` from the islands' schedulers (one per run
per island: the executors report to their scheduler).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import hashlib
import inspect
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pwmesh.core.ratelimit import RejectedLog
from pwmesh.errors import STANDBY, InvalidArgument, NoSession, PwmeshError, PwTimeoutError, Unavailable
from pwmesh.executor.sandbox import Sandbox
from pwmesh.proxy import tenants
from pwmesh.proxy.events import (
    Action,
    Ask,
    CheckFunction,
    CheckKept,
    Deliver,
    Delivered,
    Event,
    Expecting,
    FencePeer,
    FetchEnded,
    Fetching,
    FetchingAll,
    FunctionChecked,
    Inbound,
    Inherited,
    Inventoried,
    Inventory,
    KeptChecked,
    Lowered,
    LowerOffLoop,
    Notice,
    Park,
    PeerBack,
    PeerLost,
    Reclaim,
    Reclaimed,
    Reply,
    Resolve,
    Send,
    SliceGranted,
    SlicesPlaced,
    Tick,
    Unpark,
    Wait,
    settled,
    sources,
)
from pwmesh.proxy.session import Buffer
from pwmesh.proxy.state import ProxyState
from pwmesh.service.heartbeat import every
from pwmesh.service.keys import ADMIN, DAEMON, Keys, Security
from pwmesh.service.lifecycle import Service
from pwmesh.service.metrics import Metric, counter, gauge, listen_host, merged, wire_metrics
from pwmesh.service.rpc import Access, Beats, Connections, Server, wait_for_peer
from pwmesh.wire import Envelope, Message
from pwmesh.wire.messages import (
    AllocateSlice,
    AwaitIdle,
    BufferValue,
    BufferValues,
    ClaimProxy,
    ClusterStateReply,
    ClusterTrace,
    DataLost,
    DeleteShards,
    DrainExecutor,
    DrainHost,
    DrainStarted,
    Error,
    ExecutorStats,
    FetchShards,
    GetClusterState,
    GetClusterTrace,
    GetEvents,
    GetExecutorStats,
    GetStatus,
    GetTrace,
    Heartbeat,
    HostDrained,
    IslandDone,
    ListHeld,
    NodeDone,
    Ok,
    OpenSession,
    OwnedShards,
    Ping,
    ProxyLease,
    ProxyLost,
    PushShards,
    PutBuffer,
    ReleaseBuffers,
    ReleaseSlices,
    ResumeSession,
    RunProgram,
    SessionInfo,
    SessionResumed,
    ShardValues,
    SliceAllocated,
    SlicesUpdated,
    StatusReply,
    TemplateMissing,
    TraceEvents,
)

log = logging.getLogger(__name__)

DELIVER_TIMEOUT_SECONDS = 600.0  # a put's bytes count in flight at most this long (an executor never answering)
EARLY_FETCH_TIMEOUT_SECONDS = 7 * 24 * 3600.0  # a fetch sent before its value exists waits as long as it computes
# Messages held per connection for a session not resumed yet (``Proxy._hold``): past this, "no session".
MAX_HELD_MESSAGES = 10_000


def merged_deletes(earlier: DeleteShards, later: DeleteShards) -> DeleteShards:
    """Two frees for one executor as one (``Connection.post_merged``)."""
    return DeleteShards(buffers=earlier.buffers + later.buffers)


def _ignored() -> asyncio.Future[Any]:
    """A turn nobody waits for (a resumed session's registration): its failure is logged, not raised."""
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def done(f: asyncio.Future[Any]) -> None:
        if not f.cancelled() and f.exception() is not None:
            log.info("a resumed session's registration was refused: %s", f.exception())

    fut.add_done_callback(done)
    return fut


def sees_all(env: Envelope) -> bool:
    """Whether the sender may see every tenant's sessions and runs (an admin, or a daemon), not only its own."""
    return env.role in (ADMIN, DAEMON)


@dataclasses.dataclass
class ProxyConfig:
    rm: str
    listen: str = "tcp://127.0.0.1:0"
    name: str = "proxy"
    rm_timeout_seconds: float = 30.0
    fetch_timeout_seconds: float = 120.0
    session_timeout_seconds: float = 30.0
    client_heartbeat_interval_seconds: float = 5.0
    rm_heartbeat_interval_seconds: float = 2.0
    drain_timeout_seconds: float = 300.0
    # The tenants' policy (``pwmesh.proxy.tenants``): "" for the keys directory's tenants.json (none without keys).
    tenants_file: str = ""
    # A program of this many computations or more, not lowered before, is lowered on a thread while the
    # loop serves everyone else (~0.2 s of lowering here); its session's later requests wait their turn.
    lower_off_loop_nodes: int = 2_000
    trace_timeout_seconds: float = 10.0  # per executor, for GetClusterTrace
    trace_events_per_reply: int = 200_000  # over all executors: ~32 MiB, half the message size limit
    security: Security = dataclasses.field(default_factory=Security)  # --keys, --insecure
    metrics_port: int | None = None  # Prometheus metrics over HTTP (0: a free port; None: none)
    # Read each new function's module in a child process before registering it (``pwmesh.executor.sandbox``,
    # as executors do); None: with keys (tenants).
    sandbox_functions: bool | None = None
    # What sessions' resume tokens are made with, kept in this file (made, mode 0600, if missing) so that they
    # outlive a restart of this proxy; "": derived from the proxy's key with --keys, else none (a restart
    # then ends every session).
    session_secret_file: str = ""
    reclaim_timeout_seconds: float = 10.0  # per executor, for what it holds of a session being resumed
    # Serve nothing until the active proxy is lost, then take over its sessions (their clients resume them
    # here); without it a proxy claims the lease at start, and is a standby only if another one holds it.
    standby: bool = False


def session_secret(config: ProxyConfig, keys: Keys | None) -> bytes:
    """The secret resume tokens are made with (``proxy/resume.py``): one that outlives the process, or b""."""
    if config.session_secret_file:
        path = Path(config.session_secret_file)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            secret = path.read_bytes()
            if len(secret) < 16:
                raise InvalidArgument(f"{path} holds {len(secret)} bytes: a session secret needs 16 or more") from None
            return secret
        secret = os.urandom(32)
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
        return secret
    if keys is not None:  # the cluster's secret (a front host's directory holds it): every proxy's, standbys too
        return hashlib.sha256(b"pwmesh session resume\0" + keys.secret).digest()
    return b""


class Proxy(Service):
    role = "proxy"

    def __init__(self, config: ProxyConfig) -> None:
        super().__init__(config.name, config.security, metrics_port=config.metrics_port, metrics_host=listen_host(config.listen))
        self.config = config
        self._notice_log = RejectedLog(self.name, logger=log)  # notices a peer made unappliable: rate-limited
        self._deliver_log = RejectedLog(self.name, logger=log)  # puts an executor refused (each logged there too)
        self.waiting: dict[Buffer, list[asyncio.Future[None]]] = {}  # buffers not done -> requests waiting
        self._parked: dict[int, asyncio.Future[Unpark]] = {}  # requests the core parked (``Park``), by key
        self.dispatch_bytes = 0  # bytes of the core's program traffic (``Send.dispatch``)
        # Clients with a program being lowered off the loop (``LowerOffLoop``), and what each sent since, in
        # order: handled once it is (a client's requests keep their order; other clients' never wait).
        self._behind: dict[bytes, collections.deque[tuple[Envelope, asyncio.Future[Any]]]] = {}
        self._lowering: set[bytes] = set()
        self.lowered_off_loop = 0  # programs lowered on a thread, ever
        self._drains = itertools.count(1)  # drain requests to the RM (``DrainExecutor.request``)
        # What connections sent, after this proxy started, for a session of the proxy before that they have
        # not resumed yet (their header names it): held, then handled after the resume, in order
        # (``_hold``); answered "no session" if no resume comes within the session timeout.
        self._held: dict[bytes, collections.deque[tuple[Envelope, asyncio.Future[Any], float]]] = {}
        # Whether this proxy holds the cluster's lease (``ClaimProxy``): a standby serves no session.
        self.active = False
        self.lease = ProxyLease(active=False, holder="", address="")
        self._claiming = False

    async def setup(self) -> None:
        handlers: dict[type[Message], Any] = {
            **dict.fromkeys(ProxyState.HANDLERS, self._serve),
            GetStatus: self._status,
            GetClusterTrace: self._trace,
            DrainHost: self._drain_host,
            GetEvents: self.events,
            Ping: self.ping,
        }
        # Clients open sessions and act on their own; completions come from daemons only; an admin drains.
        # An admin also suspends and resumes other tenants' sessions (``pwmesh suspend``).
        access = Access.of(client=[*(op for op in ProxyState.HANDLERS
                                     if op not in (NodeDone, IslandDone, DataLost, TemplateMissing,
                                                   *ProxyState.ADMIN_HANDLERS)),
                                   GetStatus, GetClusterTrace],
                           admin=[DrainHost, GetEvents, *ProxyState.ADMIN_HANDLERS])
        self.server = Server(self.ctx, self.config.listen, handlers, tasks=self.tasks, name=self.name, access=access)
        self.state = ProxyState(rm=self.config.rm, address=self.server.address, name=self.name,
                                session_timeout_seconds=self.config.session_timeout_seconds,
                                client_heartbeat_interval_seconds=self.config.client_heartbeat_interval_seconds,
                                lower_off_loop_nodes=self.config.lower_off_loop_nodes,
                                secret=session_secret(self.config, self.ctx.keys))
        self.event_log = self.state.events
        self.state.key_holder = lambda public: getattr(self.ctx.whose(public), "name", None)
        if not self.state.secret:
            log.info("no session secret (--session-secret-file, or --keys): sessions end if this proxy restarts")
        sandboxed = self.config.sandbox_functions
        self.sandbox = Sandbox() if (sandboxed if sandboxed is not None else self.ctx.keys is not None) else None
        self.state.check_functions = self.sandbox is not None
        # The policy applies from the first request on (read at each tick after this).
        keys = self.ctx.keys
        where = self.config.tenants_file or (str(keys.directory / tenants.FILE_NAME) if keys is not None else "")
        self.tenants = tenants.PolicyFile(where) if where else None
        if self.tenants is not None:
            self.state.policy = self.tenants.current()
            if self.tenants.error:
                log.error("the tenants policy %s was not applied: %s", self.tenants.path, self.tenants.error)
        self.server.start()
        self.peers = Connections(self.ctx, tasks=self.tasks, name=self.name, on_message=self._notified)
        await wait_for_peer(self.peers.get(self.config.rm), self.state.watch(self.role),
                            timeout_seconds=self.config.rm_timeout_seconds)
        if not self.config.standby:
            await self._claim()
        if not self.active:
            log.warning("serving as a standby: the active proxy is %s at %s", self.lease.holder or "none",
                        self.lease.address or "-")
        # Every second at least: runs past their tenant's deadline fail within a second of it.
        self.tasks.spawn(every(min(1.0, self.config.session_timeout_seconds / 4), self._tick), name="expire")
        self.rm_beats = Beats(self.peers, self.config.rm, "resource manager", self.config.rm_heartbeat_interval_seconds,
                              self._notified)
        self.tasks.spawn(every(self.config.rm_heartbeat_interval_seconds, self._heartbeat_rm), name="heartbeat")

    async def _claim(self) -> None:
        """Ask for the lease; once it is ours, take over what the proxy before left."""
        if self._claiming or self.active:
            return
        self._claiming = True
        try:
            self.lease = await self._ask_lease()
            if self.lease.active:
                await self._activate()
        finally:
            self._claiming = False

    async def _ask_lease(self) -> ProxyLease:
        lease = await self.peers.request(self.config.rm, ClaimProxy(name=self.name, address=self.server.address),
                                         timeout_seconds=self.config.rm_timeout_seconds)
        assert isinstance(lease, ProxyLease)
        return lease

    async def _activate(self) -> None:
        """This proxy is the active one now: the slices the resource manager holds are sessions of the proxy
        before (restarted, or lost), kept for their clients to resume them here."""
        held = await self.peers.request(self.config.rm, GetClusterState(), timeout_seconds=self.config.rm_timeout_seconds)
        assert isinstance(held, ClusterStateReply)
        mine = {s.session_id for s in self.state.sessions.values()}
        self._perform(self.state.handle(Inherited([sl for sl in held.state.slices if sl.owner not in mine]),
                                        time.monotonic()))
        self.active = True
        if self.config.standby:
            log.warning("took over as the active proxy (the one before was %s)", self.lease.holder or "none")

    def _on_lease(self, msg: ProxyLease | ProxyLost) -> None:
        """What the resource manager says of the lease: a standby claims a free one; an active proxy that lost
        it (the RM declared it lost, and another took over) stops, as two active proxies would free each
        other's sessions."""
        if isinstance(msg, ProxyLost) or not msg.holder:
            if not self.active:
                self.tasks.spawn(self._claim(), name="claim")
            elif isinstance(msg, ProxyLease):  # the RM restarted and forgot the lease: ours again
                self.tasks.spawn(self._reclaim_lease(), name="claim")
            return
        self.lease = msg
        if self.active and not msg.active:
            log.error("another proxy (%s at %s) took over: stopping (restarted, this one is a standby)",
                      msg.holder, msg.address)
            self.stop_reason = "another proxy took over"
            self.tasks.spawn(self.close(), name="close-taken-over")

    async def _reclaim_lease(self) -> None:
        self._on_lease(await self._ask_lease())

    async def _heartbeat_rm(self) -> None:
        await self.rm_beats.beat(Heartbeat(role=self.role, name=self.name))

    def ready_info(self) -> dict[str, Any]:
        return {**super().ready_info(), "address": self.server.address}

    def collect(self) -> list[Metric]:
        received, rejected = self.peers.counts()
        state = self.state
        return [
            *wire_metrics(self.role, self.name, merged(self.server.received, received),
                          merged(self.server.sent, self.peers.sent), merged(self.server.rejected, rejected)),
            gauge("pwmesh_proxy_sessions", "Client sessions open now.", len(state.sessions)),
            counter("pwmesh_proxy_sessions_opened", "Client sessions opened.", state.sessions_opened),
            counter("pwmesh_proxy_sessions_expired", "Sessions ended because their client missed its heartbeats.",
                    state.sessions_expired),
            counter("pwmesh_proxy_sessions_resumed", "Sessions taken back by their clients after a restart of the proxy.",
                    state.sessions_resumed),
            gauge("pwmesh_proxy_buffers", "Logical buffers the sessions hold.",
                  sum(len(s.buffers) for s in state.sessions.values())),
            gauge("pwmesh_proxy_runs", "Program runs dispatched and not yet finished.", len(state.runs)),
            counter("pwmesh_proxy_programs", "Program runs dispatched.", state.programs),
            counter("pwmesh_proxy_dispatch_messages", "Messages sent to dispatch and finish programs.",
                    state.dispatch_messages),
            counter("pwmesh_proxy_dispatch_bytes", "Bytes of those messages.", self.dispatch_bytes),
            gauge("pwmesh_proxy_lowering_off_loop", "Programs being lowered, or new functions read, on a thread now.",
                  len(self._lowering)),
            counter("pwmesh_proxy_lowered_off_loop", "Programs lowered on a thread.", self.lowered_off_loop),
            gauge("pwmesh_proxy_executors_lost", "Executors this proxy knows are gone.", len(state.lost)),
        ]

    async def drain(self) -> None:
        await self.peers.barrier(timeout_seconds=2.0)

    async def close(self) -> None:
        await super().close()
        sandbox: Sandbox | None = getattr(self, "sandbox", None)  # absent if the start failed before it
        if sandbox is not None:
            sandbox.close()

    # ------------------------------------------------------------ the core's I/O

    def _serve(self, peer: bytes, env: Envelope) -> Message | Awaitable[Message] | None:
        """Every request and post the core handles: its answer, or what will answer it."""
        if not self.active:
            raise Unavailable(f"{STANDBY}: the active proxy is {self.lease.holder or 'none'} at "
                              f"{self.lease.address or '-'}")
        held = self._hold(peer, env)
        if held is not None:
            return held
        behind = self._behind.get(peer)
        if behind is not None and not isinstance(env.message, Heartbeat):  # after its program being lowered
            turn: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            behind.append((env, turn))
            return turn
        return self._handle(peer, env)

    def _hold(self, peer: bytes, env: Envelope) -> asyncio.Future[Any] | None:
        """Hold what a connection sends for a session of the proxy before until it resumes it: its client
        learns of the restart only from a heartbeat's answer, and what it sent meanwhile (a registration, a
        run) must neither be refused nor overtake the resume. The header's session id decides only this:
        whoever names a session they cannot resume waits for the session timeout, then hears "no session"."""
        if (peer in self.state.sessions or not env.sender
                or isinstance(env.message, (Heartbeat, ResumeSession, OpenSession, NodeDone, IslandDone, DataLost,
                                            TemplateMissing))
                or not self.state.may_resume(env.sender, time.monotonic())):
            return None
        held = self._held.get(peer)
        if held is None:
            # Tell its client now (not at its next heartbeat) that it must resume: "no session" in answer to
            # this message, which it keeps waiting for (it is answered after the resume).
            held = self._held[peer] = collections.deque()
            self.server.post(peer, Error(code=NoSession.code, message="this connection has no session: resume it "
                                         "(the proxy restarted)"), reply_to=env.msg_id)
        if len(held) >= MAX_HELD_MESSAGES:
            return None
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        held.append((env, fut, time.monotonic()))
        return fut

    def _expire_held(self) -> None:
        """Held messages whose session was not resumed within the session timeout: "no session"."""
        limit = time.monotonic() - self.config.session_timeout_seconds
        for peer, held in list(self._held.items()):
            while held and held[0][2] < limit:
                _, fut, _ = held.popleft()
                if not fut.done():
                    fut.set_exception(NoSession("this connection has no session (its session was not resumed)"))
            if not held:
                del self._held[peer]

    def _handle(self, peer: bytes, env: Envelope) -> Any:
        inbound = Inbound(peer, env.message, env.user)
        return self._perform(self.state.handle(inbound, time.monotonic()), inbound)

    async def _off_loop(self, inbound: Inbound, work: Callable[[], Event]) -> Any:
        """Do ``work`` on a thread (the loop goes on serving everyone else; what ``inbound``'s client sends
        meanwhile waits behind it), hand the core the event it returns, then handle ``inbound`` again and
        what waited. The thread shares the GIL, so the loop still runs every few milliseconds."""
        peer = inbound.peer
        try:
            event = await asyncio.to_thread(work)
            self._perform(self.state.handle(event, time.monotonic()))
        finally:
            self._lowering.discard(peer)
        try:
            answer = self._perform(self.state.handle(inbound, time.monotonic()), inbound)
        finally:
            self._take_turns(peer)
        return await answer if inspect.isawaitable(answer) else answer

    async def _inventory(self, inventory: Inventory) -> None:
        """What an executor back from a stall holds, for the core to reconcile."""
        try:
            got = await self.peers.request(inventory.control, ListHeld(),
                                           timeout_seconds=self.config.reclaim_timeout_seconds)
        except PwmeshError as exc:
            log.warning("executor %s, back, did not say what it holds (%s): its objects stay until its next return",
                        inventory.executor_id, exc)
            return
        if isinstance(got, OwnedShards):
            self._perform(self.state.handle(Inventoried(inventory.control, inventory.executor_id, got.keys),
                                            time.monotonic()))

    async def _check_kept(self, check: CheckKept) -> None:
        """Which shards donated to an aborted run its executors hold intact, for the core to give back."""
        async def ask(control: str, keys: list[str]) -> list[str]:
            try:
                got = await self.peers.request(control, ListHeld(keys=keys),
                                               timeout_seconds=self.config.reclaim_timeout_seconds)
            except PwmeshError as exc:
                log.info("executor at %s did not say whether it holds what was donated to aborted run %s (%s): it "
                         "is freed", control, check.run_id, exc)
                return []
            return got.keys if isinstance(got, OwnedShards) else []

        found = await asyncio.gather(*(ask(control, keys) for control, keys in check.asks.items()))
        self._perform(self.state.handle(KeptChecked(check.run_id, [k for keys in found for k in keys]),
                                        time.monotonic()))

    @staticmethod
    def _resuming_env(reclaim: Reclaim) -> Envelope:
        """The envelope a resumed session's registrations are handled in, as if its client sent them again."""
        assert reclaim.resume is not None
        return Envelope(message=reclaim.resume, msg_id=0, reply_to=None, sender=reclaim.resume.session_id,
                        user=reclaim.user, role="client")

    async def _reclaim(self, reclaim: Reclaim) -> dict[str, OwnedShards | None]:
        """Ask each executor for what it holds of an owner (``ReclaimOwner``); None where one does not answer."""
        async def ask(control: str) -> OwnedShards | None:
            try:
                got = await self.peers.request(control, reclaim.message,
                                               timeout_seconds=self.config.reclaim_timeout_seconds)
            except PwmeshError as exc:
                log.warning("%s did not say what it holds of %s: %s", control, reclaim.message.prefix, exc)
                return None
            return got if isinstance(got, OwnedShards) else None

        found = await asyncio.gather(*(ask(c) for c in reclaim.controls))
        return dict(zip(reclaim.controls, found, strict=True))

    async def _resume(self, reclaim: Reclaim, waiting: list[Envelope]) -> Any:
        """A session resumed: what its executors hold, then the core rebuilds it; then what its client sent
        before (``waiting``: held, and handled then) and meanwhile, in order."""
        assert reclaim.resume is not None
        coming = frozenset(b for env in waiting for b in (
            env.message.outputs if isinstance(env.message, RunProgram) else
            [env.message.buffer] if isinstance(env.message, PutBuffer) else []))
        named = frozenset(b for env in waiting for b in (
            [i.buffer for i in env.message.inputs if i.buffer is not None] if isinstance(env.message, RunProgram) else
            env.message.buffers if isinstance(env.message, ReleaseBuffers) else []))
        try:
            held = await self._reclaim(reclaim)
            event = Reclaimed(reclaim.peer, reclaim.user, reclaim.resume, held, coming, named)
            answer = self._perform(self.state.handle(event, time.monotonic()))
            if isinstance(answer, SessionResumed):
                return dataclasses.replace(answer, held=[env.msg_id for env in waiting])
            return answer
        finally:
            self._lowering.discard(reclaim.peer)
            self._take_turns(reclaim.peer)

    def _lower(self, lower: LowerOffLoop, peer: bytes) -> Event:
        """A big program's lowering (it finds the template when handled again)."""
        lower.job.run()
        self.lowered_off_loop += 1
        return Lowered(peer, lower.session_id, lower.job)

    def _check(self, check: CheckFunction) -> Event:
        """A new function read in the sandbox: a module the proxy never parses itself (it imports no JAX)."""
        assert self.sandbox is not None
        try:
            self.sandbox.check(check.fn_id, check.exported)
        except InvalidArgument as exc:
            return FunctionChecked(check.fn_id, InvalidArgument(f"the proxy refused function {check.fn_id[:12]}: "
                                                                f"{exc.message}"))
        return FunctionChecked(check.fn_id, None)

    def _take_turns(self, peer: bytes) -> None:
        """Handle what ``peer`` sent while its program was lowered, in order, until another needs lowering."""
        behind = self._behind.get(peer)
        while behind and peer not in self._lowering:
            env, turn = behind.popleft()
            try:
                answer = self._handle(peer, env)
            except Exception as exc:  # noqa: BLE001 - the request's own error: its turn fails with it
                if not turn.done():
                    turn.set_exception(exc)
                continue
            if inspect.isawaitable(answer):
                self.tasks.spawn(self._settle(turn, answer), name=f"{self.name}.turn")
            elif not turn.done():
                turn.set_result(answer)
        if not behind and peer not in self._lowering:
            self._behind.pop(peer, None)

    @staticmethod
    async def _settle(turn: asyncio.Future[Any], answer: Awaitable[Any]) -> None:
        try:
            result = await answer
        except Exception as exc:  # noqa: BLE001 - handed to whoever waits on the turn
            if not turn.done():
                turn.set_exception(exc)
            return
        if not turn.done():
            turn.set_result(result)

    def _perform(self, actions: list[Action], inbound: Inbound | None = None) -> Any:
        """Do what the core said, in order; return the answer (or a coroutine making it), or raise its error.
        ``inbound``: the request the actions answer (a ``LowerOffLoop`` handles it again)."""
        answer: Any = None
        error: PwmeshError | None = None
        for action in actions:
            if isinstance(action, Send):
                if isinstance(action.message, DeleteShards):  # a turn's frees: one message an executor
                    self.peers.post_merged(action.to, action.message, merged_deletes)
                    continue
                before = self.peers.sent_bytes
                self.peers.post(action.to, action.message)
                if action.dispatch:
                    self.dispatch_bytes += self.peers.sent_bytes - before
            elif isinstance(action, Resolve):
                for fut in self.waiting.pop(action.buffer, ()):
                    if not fut.done():
                        fut.set_result(None)
            elif isinstance(action, Reply):
                answer, error = action.message, action.error
            elif isinstance(action, Wait):
                answer = self._await_buffers(action.buffers)
            elif isinstance(action, Fetching):
                answer = self._fetch(action)
            elif isinstance(action, FetchingAll):
                answer = self._fetch_all(action)
            elif isinstance(action, Expecting):
                answer = self._expect(action)
            elif isinstance(action, Ask):
                answer = self._ask(action)
            elif isinstance(action, Park):  # its future now, not when the coroutine first runs: an Unpark may come first
                parked = self._parked[action.key] = asyncio.get_running_loop().create_future()
                answer = self._parked_answer(action.key, parked)
            elif isinstance(action, Unpark):
                waiter = self._parked.pop(action.key, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(action)
            elif isinstance(action, Deliver):
                self.tasks.spawn(self._deliver(action), name="deliver")
            elif isinstance(action, PeerLost):
                self.peers.mark_lost(action.control, action.error)  # fails the fetches waiting on it
            elif isinstance(action, PeerBack):
                self.peers.mark_alive(action.control)
            elif isinstance(action, FencePeer):
                self.peers.fence(action.control, action.fence)
            elif isinstance(action, Inventory):
                self.tasks.spawn(self._inventory(action), name="inventory")
            elif isinstance(action, CheckKept):
                self.tasks.spawn(self._check_kept(action), name=f"check-kept-{action.run_id}")
            elif isinstance(action, Reclaim):
                if action.resume is None:
                    self.tasks.spawn(self._reclaim(action), name="reclaim")
                else:  # what the session sent before and after waits behind its resume, as behind a lowering
                    self._lowering.add(action.peer)
                    held = [(env, fut) for env, fut, _ in self._held.pop(action.peer, ())]
                    # Its registrations first (what it sent before may use them), as if it had sent them again.
                    resuming = self._resuming_env(action)
                    again = [(dataclasses.replace(resuming, message=m), _ignored())
                             for m in [*action.resume.functions, *action.resume.programs]]
                    self._behind[action.peer] = collections.deque([*again, *held,
                                                                   *self._behind.get(action.peer, ())])
                    answer = self._resume(action, [env for env, _ in held])
            elif isinstance(action, LowerOffLoop | CheckFunction):
                assert inbound is not None  # only a request's handling goes off the loop
                # Now, not when the coroutine first runs: what its client sent next must already wait.
                self._lowering.add(inbound.peer)
                self._behind.setdefault(inbound.peer, collections.deque())
                answer = self._off_loop(inbound, functools.partial(self._lower, action, inbound.peer)
                                        if isinstance(action, LowerOffLoop) else functools.partial(self._check, action))
            else:
                raise TypeError(f"not a proxy action: {action!r}")
        if error is not None:
            raise error
        return answer

    def _notified(self, env: Envelope) -> None:
        """Unsolicited messages on our outgoing connections (the RM's notifications)."""
        if isinstance(env.message, ProxyLease | ProxyLost):
            self._on_lease(env.message)
            return
        try:
            self._perform(self.state.handle(Notice(env.message), time.monotonic()))
        except PwmeshError as exc:
            self._notice_log.warning(env.message.op, "notice %s not applied: %s", env.message.op, exc)

    async def _tick(self) -> None:
        if self.tenants is not None:
            error = self.tenants.error
            self.state.policy = self.tenants.current()
            if self.tenants.error and self.tenants.error != error:
                log.error("the tenants policy %s was not applied (the last good one stays): %s", self.tenants.path,
                          self.tenants.error)
        self._perform(self.state.handle(Tick(), time.monotonic()))
        self._expire_held()

    async def _until_done(self, buf: Buffer) -> None:
        if not buf.done:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.waiting.setdefault(buf, []).append(fut)
            await fut

    async def _parked_answer(self, key: int, parked: asyncio.Future[Unpark]) -> Message:
        """A parked request's answer (``Park``): its ``Unpark``'s error, or its Ask's answer."""
        try:
            unpark = await parked
        finally:
            self._parked.pop(key, None)
        if unpark.error is not None:
            raise unpark.error
        assert unpark.ask is not None
        return await self._ask(unpark.ask)

    async def _ask(self, ask: Ask) -> Message:
        msg = ask.message
        try:
            reply = await self.peers.request(ask.to, msg, timeout_seconds=self.config.rm_timeout_seconds)
        except PwTimeoutError:
            if isinstance(msg, AllocateSlice) and msg.request:
                # Given up: if the request still arrives (the RM was away), what it makes is released at
                # once, behind it on the same connection; nothing is left that no session holds.
                self.peers.post(ask.to, ReleaseSlices(owner=msg.owner, requests=[msg.request]))
            raise
        if isinstance(reply, SlicesUpdated):
            return self._perform(self.state.handle(SlicesPlaced(ask.peer, reply.slices, ask.reshape), time.monotonic()))
        assert isinstance(reply, SliceAllocated)
        return self._perform(self.state.handle(SliceGranted(ask.peer, reply.slice), time.monotonic()))

    async def _deliver(self, deliver: Deliver) -> None:
        """A client's put, as a request: its bytes count as in flight until the executor answers (or fails,
        or is lost). Its failure is the executor's to record (the keys fail there), not ours to report."""
        try:
            if deliver.to not in self.peers.lost:  # (as a post to it would be, it is dropped)
                await self.peers.request(deliver.to, deliver.message, timeout_seconds=DELIVER_TIMEOUT_SECONDS)
        except PwmeshError as exc:
            self._deliver_log.warning(deliver.to, "a put to %s failed: %s", deliver.to, exc)
        finally:
            self._perform(self.state.handle(Delivered(deliver.owner, deliver.nbytes), time.monotonic()))

    async def _await_buffers(self, buffers: list[Buffer]) -> Ok:
        for buf in buffers:  # the first failure, in order, as soon as it is known
            await self._until_done(buf)
            failed = settled([buf])
            if failed is not None:
                raise failed
        return Ok()

    async def _expect(self, expecting: Expecting) -> Message:
        """A direct put: every executor told what to expect (the first refusal is the answer), then where."""
        await asyncio.gather(*(self.peers.request(control, ask, timeout_seconds=DELIVER_TIMEOUT_SECONDS)
                               for control, ask in expecting.asks.items()))
        return expecting.reply

    async def _fetch(self, fetching: Fetching) -> BufferValue:
        sid, buf = fetching.session_id, fetching.buffer
        try:
            (shards,) = await self._fetch_values([fetching])
        finally:
            self._perform(self.state.handle(FetchEnded(sid, buf, fetching.owner, fetching.nbytes), time.monotonic()))
        if fetching.to:  # pushed to the client's data plane: the answer says how many blocks
            return BufferValue(shards=[], pushed=len(shards))
        return BufferValue(shards=shards)

    async def _fetch_all(self, many: FetchingAll) -> BufferValues:
        """A ``FetchBuffers``: as ``Fetch``, every buffer at once, each executor asked once for all of their
        shards it holds."""
        try:
            shards = await self._fetch_values(many.fetches)
        finally:
            now = time.monotonic()
            for f in many.fetches:
                self._perform(self.state.handle(FetchEnded(f.session_id, f.buffer, f.owner, f.nbytes), now))
        return BufferValues(shards=shards)

    async def _fetch_values(self, fetches: list[Fetching]) -> list[list[Any]]:
        """Each buffer's shards: asked for at once if one is still being computed (``_fetch_early``), else
        once every one is done; the first failure among them, in order, is raised."""
        buffers = [f.buffer for f in fetches]
        shards = None if all(b.done for b in buffers) else await self._fetch_early(fetches)
        if shards is None:
            await self._until_all_done(buffers)
            failed = settled(buffers)
            if failed is not None:
                raise failed
            shards = await self._fetch_shards(fetches, self.config.fetch_timeout_seconds)
        return shards

    async def _until_all_done(self, buffers: list[Buffer]) -> None:
        for buf in buffers:
            await self._until_done(buf)

    async def _fetch_early(self, fetches: list[Fetching]) -> list[list[Any]] | None:
        """Fetch buffers still being computed: ask their executors now, not once they are done.

        ``FetchShards`` waits there for a shard not made yet (a posted receive), so the values
        come back as soon as they exist: two hops sooner than waiting for the completion
        first (executor -> proxy, then proxy -> executor). No timeout while they compute (a
        lost executor, a cancelled run or a failed node ends the wait). None once the buffers
        are complete without the values: the caller reports a failure, or (one was moved
        meanwhile, say) fetches them the ordinary way."""
        buffers = [f.buffer for f in fetches]
        early = asyncio.ensure_future(self._fetch_shards(fetches, EARLY_FETCH_TIMEOUT_SECONDS))
        done = asyncio.ensure_future(self._until_all_done(buffers))
        try:
            await asyncio.wait((done, early), return_when=asyncio.FIRST_COMPLETED)
            if early.done() and early.exception() is None:
                return early.result()
            await done  # complete, successfully or not (the caller reports which)
            if settled(buffers) is None:
                with contextlib.suppress(PwmeshError):
                    return await early
            return None
        finally:
            done.cancel()
            if not early.done():
                early.cancel()
            elif not early.cancelled():
                early.exception()  # retrieved: a failure here was reported another way

    async def _fetch_shards(self, fetches: list[Fetching], timeout_seconds: float) -> list[list[Any]]:
        """Each buffer's one shard of each distinct block (``sources``): replicas are not fetched twice; each
        executor is asked once for all of its shards. A direct fetch (one buffer, ``fetching.to``): each
        executor pushes its blocks to the client instead (``PushShards``)."""
        fetching = fetches[0]
        assert not fetching.to or len(fetches) == 1
        wanted = [(b, control, key) for b, f in enumerate(fetches) for control, key in sources(f.session_id, f.buffer)]
        by_executor: dict[str, list[int]] = {}
        for k, (_, control, _) in enumerate(wanted):
            by_executor.setdefault(control, []).append(k)
        shards: list[Any] = [None] * len(wanted)

        async def fetch_from(control: str, indices: list[int]) -> None:
            deadline = time.monotonic() + timeout_seconds
            keys = [wanted[k][2] for k in indices]
            request: Message = FetchShards(keys=keys) if not fetching.to else PushShards(
                session=fetching.session_id, data_key=fetching.data_key, to=fetching.to, tag=fetching.tag,
                keys=keys, indices=indices)
            while True:
                try:
                    reply = await self.peers.request(control, request,
                                                     timeout_seconds=max(0.0, deadline - time.monotonic()))
                    break
                except Unavailable:  # it restarted (into its JAX group's next forming) and holds the shards again
                    if time.monotonic() >= deadline:
                        raise
            if fetching.to:
                return
            assert isinstance(reply, ShardValues)
            for k, arr in zip(indices, reply.arrays, strict=True):
                shards[k] = arr

        await asyncio.gather(*(fetch_from(c, idx) for c, idx in by_executor.items()))
        per_buffer: list[list[Any]] = [[] for _ in fetches]
        for (b, _, _), shard in zip(wanted, shards, strict=True):
            per_buffer[b].append(shard)
        return per_buffer

    # ------------------------------------------------------------ requests of the shell alone

    async def _drain_host(self, peer: bytes, env: Envelope) -> HostDrained:
        msg = env.message
        assert isinstance(msg, DrainHost)
        before = self.state.moved_buffers
        # The RM posts every SliceRemapped before this reply: by the time it arrives,
        # our slices point elsewhere and every buffer's move is on its way.
        request = DrainExecutor(executor=msg.executor, request=str(next(self._drains)))
        try:
            started = await self.peers.request(self.config.rm, request, timeout_seconds=self.config.rm_timeout_seconds)
        except PwTimeoutError:  # given up: if it still arrives, it is undone behind it (the caller hears failure)
            self.peers.post(self.config.rm, dataclasses.replace(request, cancel=True))
            raise
        assert isinstance(started, DrainStarted)
        moved = self.state.moved_buffers - before
        await self.peers.request(started.control, AwaitIdle(), timeout_seconds=self.config.drain_timeout_seconds)
        log.info("host %s drained: %s slices and %s buffers moved", started.executor_id, started.remapped, moved)
        return HostDrained(executor_id=started.executor_id, slices=started.remapped, buffers=moved)

    async def _status(self, peer: bytes, env: Envelope) -> StatusReply:
        reply = await self.peers.request(self.config.rm, GetClusterState(), timeout_seconds=self.config.rm_timeout_seconds)
        assert isinstance(reply, ClusterStateReply)

        async def stats(control: str) -> ExecutorStats | None:
            try:
                got = await self.peers.request(control, GetExecutorStats(), timeout_seconds=2.0)
            except PwmeshError:
                return None
            return got if isinstance(got, ExecutorStats) else None

        found = await asyncio.gather(*(stats(e.control) for e in reply.state.executors if e.alive))
        sessions = [
            SessionInfo(session_id=s.session_id, name=s.name, buffers=len(s.buffers), programs=len(s.runs),
                        weight=s.weight, priority=s.priority, registered=len(s.programs),
                        lowered=s.lowerings.misses, reused=s.lowerings.hits)
            for s in self.state.sessions.values() if sees_all(env) or s.owner == env.user
        ]
        return StatusReply(cluster=reply.state, sessions=sessions, rm=self.config.rm, executor_stats=[s for s in found if s],
                           programs=self.state.programs, dispatch_messages=self.state.dispatch_messages,
                           dispatch_bytes=self.dispatch_bytes)

    async def _trace(self, peer: bytes, env: Envelope) -> ClusterTrace:
        """Every live executor's recorded computations, for ``pwmesh trace``."""
        msg = env.message
        assert isinstance(msg, GetClusterTrace)
        reply = await self.peers.request(self.config.rm, GetClusterState(), timeout_seconds=self.config.rm_timeout_seconds)
        assert isinstance(reply, ClusterStateReply)
        live = [e for e in reply.state.executors if e.alive]
        # About 160 bytes an event on the wire: keep the whole reply well inside one message.
        limit = self.config.trace_events_per_reply // max(1, len(live))
        limit = min(limit, msg.limit) if msg.limit > 0 else limit

        async def events(control: str) -> TraceEvents | None:
            try:
                got = await self.peers.request(control, GetTrace(since=msg.since, limit=limit),
                                               timeout_seconds=self.config.trace_timeout_seconds)
            except PwmeshError:
                return None
            return got if isinstance(got, TraceEvents) else None

        found = await asyncio.gather(*(events(e.control) for e in live))
        if not sees_all(env):  # a client sees its own sessions' runs (run ids begin with their session's)
            mine = tuple(f"{s.session_id}:" for s in self.state.sessions.values() if s.owner == env.user)
            for trace in found:
                if trace is not None:
                    trace.events = [e for e in trace.events if e.run_id.startswith(mine)]
        return ClusterTrace(executors=[t for t in found if t], limit=limit,
                            missing=[e.executor_id for e, t in zip(live, found, strict=True) if t is None])

