"""``pwmesh-proxy``: client sessions, program lowering, parallel asynchronous dispatch.

``RunProgram`` is handled synchronously from validation to the last posted
message: the output buffers exist before the handler returns, so a ``Fetch``
sent right behind it always finds them, and a run's messages leave in order.
The client does not wait for the run: dispatch is asynchronous, completion
arrives as ``NodeDone`` from the executors and resolves the buffers' futures.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import secrets
import time
from collections.abc import Iterator
from typing import Any

from pwmesh.errors import (
    DeviceLost,
    InvalidArgument,
    NotFound,
    ProtocolError,
    PwmeshError,
    ResourceExhausted,
    Unavailable,
)
from pwmesh.ir.cache import MAX_PROGRAM_ID_CHARS
from pwmesh.ir.keys import function_id
from pwmesh.ir.lower import location, move_shard, slice_locations, value_layout
from pwmesh.proxy.intake import bind, host_puts, record_run
from pwmesh.proxy.session import Buffer, Run, Session
from pwmesh.service.heartbeat import Liveness, every
from pwmesh.service.keys import Security
from pwmesh.service.lifecycle import Service
from pwmesh.service.metrics import Metric, counter, gauge, listen_host, merged, wire_metrics
from pwmesh.service.rpc import Connections, Server, wait_for_peer
from pwmesh.wire import Envelope, Message
from pwmesh.wire.messages import (
    AllocateSlice,
    AwaitBuffers,
    AwaitIdle,
    BuffersState,
    BufferValue,
    CancelRun,
    CloseSession,
    ClusterStateReply,
    ClusterTrace,
    Computation,
    CreateSlice,
    DeleteShards,
    DrainExecutor,
    DrainHost,
    DrainStarted,
    Error,
    ErrorInfo,
    ExecutorJoined,
    ExecutorLost,
    ExecutorRestarting,
    ExecutorStats,
    Fence,
    Fetch,
    FetchShards,
    ForgetOwner,
    GetClusterState,
    GetClusterTrace,
    GetExecutorStats,
    GetStatus,
    GetTrace,
    Heartbeat,
    HostDrained,
    NodeDone,
    Ok,
    OpenSession,
    Ping,
    PleaseRegister,
    ProgramSpec,
    PutBuffer,
    PutShards,
    QueryBuffers,
    RegisterFunction,
    RegisterProgram,
    RegisterProgramFunction,
    ReleaseBuffers,
    ReleaseSlices,
    RunPart,
    RunProgram,
    SchedulerJoined,
    SchedulerLost,
    ScheduleRun,
    SendShards,
    SessionInfo,
    SessionOpened,
    ShardRun,
    ShardValues,
    SliceAllocated,
    SliceCreated,
    SliceRemapped,
    StatusReply,
    TraceEvents,
    ValueSpec,
    WatchCluster,
)
from pwmesh.wire.parts import run_parts

log = logging.getLogger(__name__)

UNKNOWN_VALUE = ValueSpec(shape=[], dtype="float32", shards=1)  # a failed output of a program never seen
EARLY_FETCH_TIMEOUT_SECONDS = 7 * 24 * 3600.0  # a fetch sent before its value exists waits as long as it computes


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
    trace_timeout_seconds: float = 10.0  # per executor, for GetClusterTrace
    trace_events_per_reply: int = 200_000  # over all executors: ~32 MiB, half the message size limit
    security: Security = dataclasses.field(default_factory=Security)  # --keys, --insecure
    metrics_port: int | None = None  # Prometheus metrics over HTTP (0: a free port; None: none)


class Proxy(Service):
    role = "proxy"

    def __init__(self, config: ProxyConfig) -> None:
        super().__init__(config.name, config.security, metrics_port=config.metrics_port, metrics_host=listen_host(config.listen))
        self.config = config
        self.sessions: dict[bytes, Session] = {}
        self.sessions_opened = 0  # ever
        self.sessions_expired = 0  # ended because their client stopped sending heartbeats
        self.runs: dict[str, tuple[Session, Run]] = {}
        self.exported: dict[str, RegisterProgramFunction] = {}  # by function id: what executors are sent
        self.registered: set[tuple[str, str, tuple[int, ...]]] = set()
        self.liveness = Liveness(config.session_timeout_seconds)
        self.lost: dict[str, DeviceLost] = {}  # executor id -> why it is gone
        self.moved_buffers = 0  # buffers moved off draining hosts, ever
        self.lost_schedulers: dict[str, DeviceLost] = {}  # address -> why: runs there cannot be ordered
        self._session_ids = itertools.count(1)
        self.programs = 0
        self.dispatch_messages = 0  # sent while dispatching and finishing programs (see ``_counted``)
        self.dispatch_bytes = 0

    async def setup(self) -> None:
        handlers: dict[type[Message], Any] = {
            OpenSession: self._open_session,
            CloseSession: self._close_session,
            Heartbeat: self._heartbeat,
            CreateSlice: self._create_slice,
            RegisterProgramFunction: self._register_function,
            RegisterProgram: self._register_program,
            RunProgram: self._run_program,
            PutBuffer: self._put_buffer,
            AwaitBuffers: self._await_buffers,
            Fetch: self._fetch,
            QueryBuffers: self._query_buffers,
            ReleaseBuffers: self._release_buffers,
            GetStatus: self._status,
            GetClusterTrace: self._trace,
            DrainHost: self._drain_host,
            NodeDone: self._node_done,
            Ping: self.ping,
        }
        self.server = Server(self.ctx, self.config.listen, handlers, tasks=self.tasks, name=self.name)
        self.server.start()
        self.peers = Connections(self.ctx, tasks=self.tasks, name=self.name, on_message=self._notified)
        await wait_for_peer(self.peers.get(self.config.rm), self._watch(),
                            timeout_seconds=self.config.rm_timeout_seconds)
        self.tasks.spawn(every(self.config.session_timeout_seconds / 4, self._expire_sessions), name="expire")
        self.tasks.spawn(every(self.config.rm_heartbeat_interval_seconds, self._heartbeat_rm), name="heartbeat")

    def _watch(self) -> WatchCluster:
        """Subscription to the RM, carrying every slice our sessions hold (rebuilds a restarted RM)."""
        slices = [sl for session in self.sessions.values() for sl in session.slices.values()]
        return WatchCluster(role=self.role, name=self.name, slices=slices)

    async def _heartbeat_rm(self) -> None:
        self.peers.post(self.config.rm, Heartbeat(role=self.role, name=self.name))

    def ready_info(self) -> dict[str, Any]:
        return {**super().ready_info(), "address": self.server.address}

    def collect(self) -> list[Metric]:
        received, rejected = self.peers.counts()
        return [
            *wire_metrics(self.role, self.name, merged(self.server.received, received),
                          merged(self.server.sent, self.peers.sent), merged(self.server.rejected, rejected)),
            gauge("pwmesh_proxy_sessions", "Client sessions open now.", len(self.sessions)),
            counter("pwmesh_proxy_sessions_opened", "Client sessions opened.", self.sessions_opened),
            counter("pwmesh_proxy_sessions_expired", "Sessions ended because their client missed its heartbeats.",
                    self.sessions_expired),
            gauge("pwmesh_proxy_buffers", "Logical buffers the sessions hold.",
                  sum(len(s.buffers) for s in self.sessions.values())),
            gauge("pwmesh_proxy_runs", "Program runs dispatched and not yet finished.", len(self.runs)),
            counter("pwmesh_proxy_programs", "Program runs dispatched.", self.programs),
            counter("pwmesh_proxy_dispatch_messages", "Messages sent to dispatch and finish programs.",
                    self.dispatch_messages),
            counter("pwmesh_proxy_dispatch_bytes", "Bytes of those messages.", self.dispatch_bytes),
            gauge("pwmesh_proxy_executors_lost", "Executors this proxy knows are gone.", len(self.lost)),
        ]

    async def drain(self) -> None:
        await self.peers.barrier(timeout_seconds=2.0)

    # ----------------------------------------------------------------- sessions

    def _session(self, peer: bytes) -> Session:
        session = self.sessions.get(peer)
        if session is None:
            raise NotFound("this connection has no session (open one first, or it timed out)")
        return session

    def _open_session(self, peer: bytes, env: Envelope) -> SessionOpened:
        msg = env.message
        assert isinstance(msg, OpenSession)
        if msg.weight <= 0:
            raise InvalidArgument(f"a session's weight must be positive, got {msg.weight}")
        old = self.sessions.get(peer)
        if old is not None:
            self._end_session(old, "reopened")
        sid = f"s{next(self._session_ids)}-{secrets.token_hex(3)}"
        self.sessions_opened += 1
        self.sessions[peer] = Session(session_id=sid, name=msg.name, peer=peer, weight=msg.weight,
                                      priority=msg.priority)
        self.liveness.beat(sid, time.monotonic())
        log.info("session %s (%s) opened", sid, msg.name)
        # Four beats per timeout, so one late beat never ends a live session.
        interval = min(self.config.client_heartbeat_interval_seconds, self.config.session_timeout_seconds / 4)
        return SessionOpened(session_id=sid, heartbeat_interval_seconds=interval,
                             session_timeout_seconds=self.config.session_timeout_seconds)

    def _close_session(self, peer: bytes, env: Envelope) -> Ok:
        self._end_session(self._session(peer), "closed by client")
        return Ok()

    def _heartbeat(self, peer: bytes, env: Envelope) -> Ok:
        session = self._session(peer)
        self.liveness.beat(session.session_id, time.monotonic())
        return Ok()

    async def _expire_sessions(self) -> None:
        lost = set(self.liveness.expired(time.monotonic()))
        for session in [s for s in self.sessions.values() if s.session_id in lost]:
            self.sessions_expired += 1
            self._end_session(session, f"no heartbeat for {self.config.session_timeout_seconds} seconds")

    def _end_session(self, session: Session, why: str) -> None:
        """Free everything the session owned; runs in flight are cancelled and free their part."""
        log.info("session %s ended: %s", session.session_id, why)
        self.sessions.pop(session.peer, None)
        self.liveness.forget(session.session_id)
        ended = PwmeshError(f"session {session.session_id} ended: {why}")
        for run in list(session.runs.values()):
            self._abort_run(session, run, ended)
        for buf in list(session.buffers.values()):
            buf.client_ref = False
            self._maybe_free(session, buf)
        session.buffers.clear()
        session.ended = True
        session.hosts |= {d.control for sl in session.slices.values() for d in sl.devices}
        if session.slices:
            self.peers.post(self.config.rm, ReleaseSlices(owner=session.session_id))
            session.slices.clear()
        self._forget_if_done(session)

    def _forget_if_done(self, session: Session) -> None:
        """Once an ended session's last run is over, executors may drop its tombstones."""
        if session.ended and not session.runs:
            for control in session.hosts - self.peers.lost:
                self.peers.post(control, ForgetOwner(prefix=f"{session.session_id}/"))
            session.hosts.clear()

    # ------------------------------------------------------------------- slices

    async def _create_slice(self, peer: bytes, env: Envelope) -> SliceCreated:
        msg = env.message
        assert isinstance(msg, CreateSlice)
        session = self._session(peer)
        reply = await self.peers.request(
            self.config.rm, AllocateSlice(owner=session.session_id, devices=msg.devices, island=msg.island,
                                         kind=msg.kind),
            timeout_seconds=self.config.rm_timeout_seconds)
        assert isinstance(reply, SliceAllocated)
        session.slices[reply.slice.slice_id] = reply.slice
        return SliceCreated(slice=reply.slice)

    def _register_function(self, peer: bytes, env: Envelope) -> Ok:
        msg = env.message
        assert isinstance(msg, RegisterProgramFunction)
        session = self._session(peer)
        if msg.slice_id not in session.slices:
            raise NotFound(f"slice {msg.slice_id} is not one of this session's slices")
        if msg.fn_id != function_id(msg.exported, msg.spmd, msg.mesh, msg.axes, msg.donate):
            raise InvalidArgument("a function's id must be the hash of its exported bytes and calling convention "
                                  "(see pwmesh.ir.keys.function_id)")
        self.exported.setdefault(msg.fn_id, msg)
        session.functions[msg.fn_id] = msg.spmd
        return Ok()

    # ----------------------------------------------------------------- programs

    def _register_program(self, peer: bytes, env: Envelope) -> None:
        msg = env.message
        assert isinstance(msg, RegisterProgram)
        session = self._session(peer)
        if not msg.program_id or len(msg.program_id) > MAX_PROGRAM_ID_CHARS:
            raise InvalidArgument(f"a program id has 1 to {MAX_PROGRAM_ID_CHARS} characters")
        # Checked when it first runs (lowering validates it), where an error reaches its buffers.
        session.programs.setdefault(msg.program_id, msg.program)
        return None  # posted, like a RunProgram after it

    def _run_program(self, peer: bytes, env: Envelope) -> None:
        msg = env.message
        assert isinstance(msg, RunProgram)
        session = self._session(peer)
        program = msg.program if msg.program is not None else session.programs.get(msg.program_id)
        try:
            if program is None:
                raise NotFound(f"program {msg.program_id[:16]!r} was never registered in this session"
                               if msg.program_id else "RunProgram names no program")
            with self._counted():
                self._dispatch(session, msg, program)
            self.programs += 1
        except PwmeshError as exc:
            for i, cid in enumerate(msg.outputs):
                v = program.outputs[i] if program is not None and i < len(program.outputs) else -1
                spec = program.values[v] if program is not None and 0 <= v < len(program.values) else UNKNOWN_VALUE
                session.fail_buffer(cid, spec, exc)
            raise
        return None  # posted: the client learns of success from its buffers, of failure from an Error

    def _dispatch(self, session: Session, msg: RunProgram, program: ProgramSpec) -> None:
        binding = bind(session, msg, program)
        program, lowered = session.lowerings.lower(
            msg.program_id, program, owner=session.session_id, names=binding.names,
            host_inputs=set(binding.host_data), bound=binding.bound, slices=session.slices, spmd=session.functions,
            fresh_name=session.temp_name, packed=not msg.sequential, keep=binding.keep)
        for node in program.nodes:
            broken = session.slices[node.slice_id].broken
            if broken:
                raise ResourceExhausted(f"slice {node.slice_id} cannot run: {broken}")
        for scheduler in lowered.schedules:
            if scheduler in self.lost_schedulers:
                raise self.lost_schedulers[scheduler]
        executors = set().union(*lowered.node_executors.values()) if lowered.node_executors else set()
        for executor_id in executors:
            if executor_id in self.lost:
                raise DeviceLost(f"{self.lost[executor_id].message}; the program's slices still map there "
                                 "(remapping onto surviving devices is not supported yet)")

        # Nothing can fail past this point: post everything in order, then record the run (its
        # completions come in later callbacks; recording a 128-node run costs ~1 ms the island
        # need not wait for).
        run_id = session.next_run_id()
        for fn_id, sites in lowered.function_sites.items():
            for control, devices in sites:
                if (fn_id, control, devices) not in self.registered:
                    self.registered.add((fn_id, control, devices))
                    fn = self.exported[fn_id]
                    self.peers.post(control, RegisterFunction(fn_id=fn_id, exported=fn.exported, spmd=fn.spmd,
                                                              devices=list(devices), mesh=fn.mesh, axes=fn.axes,
                                                              donate=fn.donate))
        for control, batch in host_puts(lowered, binding.host_data).items():
            self.peers.post(control, batch)
        for control, sends in lowered.moves.items():
            for send in sends:
                self.peers.post(control, send)
        if not msg.sequential:  # sequential: each node goes once its predecessors are done (below)
            # A cached lowering's parts are packed once; this run's names go with them.
            parts = lowered.parts if lowered.parts is not None else {
                scheduler: run_parts(comps) for scheduler, comps in lowered.schedules.items()}
            for scheduler, mine in parts.items():
                self._schedule(session, run_id, scheduler, mine)
        run = record_run(session, run_id, program, lowered, binding)
        self.runs[run_id] = (session, run)
        if msg.sequential:
            produced_by = {v: i for i, node in enumerate(program.nodes) for v in node.outputs}
            for i, node in enumerate(program.nodes):
                run.waits_for[i] = {produced_by[v] for v in node.inputs if v in produced_by}
                run.held[i] = []
            for scheduler, comps in lowered.schedules.items():
                for comp in comps:
                    run.held[comp.node].append((scheduler, comp))
            self._release_nodes(session, run)
        if not run.pending:
            self._finish_run(session, run)

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        """Count what the proxy sends in the block toward its program traffic (``StatusReply``)."""
        messages, nbytes = self.peers.sent_messages, self.peers.sent_bytes
        try:
            yield
        finally:
            self.dispatch_messages += self.peers.sent_messages - messages
            self.dispatch_bytes += self.peers.sent_bytes - nbytes

    def _schedule(self, session: Session, run_id: str, scheduler: str, parts: list[RunPart]) -> None:
        self.peers.post(scheduler, ScheduleRun(run_id=run_id, proxy=self.server.address, parts=parts,
                                               session=session.session_id, weight=session.weight,
                                               priority=session.priority))

    def _release_nodes(self, session: Session, run: Run) -> None:
        """Sequential dispatch: send every held node whose predecessors have all completed."""
        for node in [n for n, waits in run.waits_for.items() if not waits and n in run.held]:
            by_scheduler: dict[str, list[Computation]] = {}
            for scheduler, comp in run.held.pop(node):
                by_scheduler.setdefault(scheduler, []).append(comp)
            for scheduler, comps in by_scheduler.items():
                # Its own scheduler run id: the island's window counts each node separately.
                self._schedule(session, f"{run.run_id}#{node}", scheduler, run_parts(comps))

    def _node_done(self, peer: bytes, env: Envelope) -> None:
        msg = env.message
        assert isinstance(msg, NodeDone)
        if peer in self.sessions:
            raise ProtocolError("completions come from executors, not from client sessions")
        found = self.runs.get(msg.run_id.split("#", 1)[0])
        if found is None:
            log.warning("completion for unknown run %s from %s", msg.run_id, msg.executor_id)
            return None
        session, run = found
        with self._counted():
            self._node_finished(session, run, msg)
        return None

    def _node_finished(self, session: Session, run: Run, msg: NodeDone) -> None:
        node_error = msg.error.exception() if msg.error is not None else None
        finished = False
        for node in msg.nodes:
            waiting = run.pending.get(node)
            if waiting is None or msg.executor_id not in waiting:
                log.warning("unexpected completion of node %s of %s from %s", node, msg.run_id, msg.executor_id)
                continue
            waiting.discard(msg.executor_id)
            if node_error is not None:
                for buf in run.outputs_of.get(node, []):
                    buf.resolve(node_error)
            if not waiting:
                del run.pending[node]
                for buf in run.outputs_of.get(node, []):
                    buf.resolve(None)
                if run.held:
                    for waits in run.waits_for.values():
                        waits.discard(node)
                finished = True
        if finished:
            if run.held:
                self._release_nodes(session, run)
            if not run.pending:
                self._finish_run(session, run)

    # ------------------------------------------------------------ lost executors

    def _notified(self, env: Envelope) -> None:
        """Unsolicited messages on our outgoing connections (the RM's notifications)."""
        msg = env.message
        if isinstance(msg, ExecutorLost):
            self._executor_lost(msg)
        elif isinstance(msg, SliceRemapped):
            self._slice_remapped(msg)
        elif isinstance(msg, SchedulerLost):
            err = DeviceLost(f"the scheduler of island {msg.island} is gone ({msg.reason})")
            log.warning("%s", err.message)
            self.lost_schedulers[msg.address] = err
            for session, run in list(self.runs.values()):
                if msg.address in run.schedulers:
                    self._abort_run(session, run, err)
        elif isinstance(msg, SchedulerJoined):
            self.lost_schedulers.pop(msg.address, None)
        elif isinstance(msg, ExecutorJoined):
            self.lost.pop(msg.executor_id, None)  # what it held stays lost: it was declared gone
            self.peers.mark_alive(msg.control)  # and sends what waited for it to restart
        elif isinstance(msg, ExecutorRestarting):
            self.peers.fence(msg.control, Fence(epoch=msg.epoch))
        elif isinstance(msg, Error):
            log.warning("a daemon refused a message we sent without waiting: %s: %s", msg.code, msg.message)
        elif isinstance(msg, PleaseRegister):  # the resource manager restarted
            log.warning("the resource manager asked us to register again; handing it our slices")
            self.peers.post(self.config.rm, self._watch())

    def _slice_remapped(self, note: SliceRemapped) -> None:
        """Adopt a slice's new devices, and move its live buffers off hosts still up (draining)."""
        session = next((s for s in self.sessions.values() if s.session_id == note.slice.owner), None)
        if session is None or note.slice.slice_id not in session.slices:
            return
        session.slices[note.slice.slice_id] = note.slice
        for buf in session.buffers.values():
            if buf.slice_id != note.slice.slice_id or buf.lost is not None:
                continue
            prefix = f"{session.session_id}/{buf.name}"
            moved: set[str] = set()
            for move in note.moves:
                here = buf.locations[move.index]
                if here.executor_id != move.old.executor_id or move.old.executor_id in self.lost:
                    continue  # already elsewhere, or the data died with its host
                new = move.new
                self.peers.post(here.control, SendShards(
                    prefix=prefix, runs=[ShardRun(device=here.device, shard=move.index)],
                    emits=[move_shard(buf.spec, prefix, move.index, new)]))
                buf.locations[move.index] = location(new)
                buf.holders.add(new.control)
                moved.add(here.control)
            if moved:
                self.moved_buffers += 1
            if moved and buf.ready.done() and buf.ready.exception() is None and buf.pins == 0:
                # The copies on the draining host go now (every shard it held of this buffer moved).
                still = {loc.control for loc in buf.locations}
                for control in moved - still:
                    self.peers.post(control, DeleteShards(buffers=[prefix]))
                    buf.holders.discard(control)

    async def _drain_host(self, peer: bytes, env: Envelope) -> HostDrained:
        msg = env.message
        assert isinstance(msg, DrainHost)
        before = self.moved_buffers
        # The RM posts every SliceRemapped before this reply: by the time it arrives,
        # our slices point elsewhere and every buffer's move is on its way.
        started = await self.peers.request(self.config.rm, DrainExecutor(executor=msg.executor),
                                           timeout_seconds=self.config.rm_timeout_seconds)
        assert isinstance(started, DrainStarted)
        moved = self.moved_buffers - before
        await self.peers.request(started.control, AwaitIdle(), timeout_seconds=self.config.drain_timeout_seconds)
        log.info("host %s drained: %s slices and %s buffers moved", started.executor_id, started.remapped, moved)
        return HostDrained(executor_id=started.executor_id, slices=started.remapped, buffers=moved)

    def _executor_lost(self, lost: ExecutorLost) -> None:
        err = DeviceLost(f"executor {lost.executor_id} on host {lost.host} is gone ({lost.reason})")
        log.warning("%s", err.message)
        self.lost[lost.executor_id] = err
        self.peers.mark_lost(lost.control, err)  # fails the fetches that were waiting on it
        for session in list(self.sessions.values()):
            for buf in session.buffers.values():
                if any(loc.executor_id == lost.executor_id for loc in buf.locations):
                    buf.lost = err
                    buf.resolve(err)
        for session, run in list(self.runs.values()):  # ended sessions' runs too
            if self._needs(run, lost) or any(b.lost is not None for b in run.pinned):
                self._abort_run(session, run, err)
        # In the same callback as the failures above: a client that retries on hearing
        # of them finds its slices already on live hosts.
        for remap in lost.remapped:
            self._slice_remapped(remap)

    @staticmethod
    def _needs(run: Run, lost: ExecutorLost) -> bool:
        """Whether ``run`` can no longer finish without ``lost``. A drained executor flushed
        everything it sent, so only its unfinished work matters; after a crash, data it
        sent may never have arrived, so any run it took part in is failed."""
        if not lost.graceful:
            return lost.control in run.executors
        return any(lost.executor_id in waiting for waiting in run.pending.values())

    def _abort_run(self, session: Session, run: Run, err: PwmeshError) -> None:
        """Fail everything ``run`` has not produced, and free the survivors' queues of it."""
        for bufs in run.outputs_of.values():
            for buf in bufs:
                buf.resolve(err)
        info = ErrorInfo.of(err)
        for control in run.executors - self.peers.lost:
            self.peers.post(control, CancelRun(run_id=run.run_id, error=info))
        run.pending.clear()
        self._finish_run(session, run)

    def _finish_run(self, session: Session, run: Run) -> None:
        self.runs.pop(run.run_id, None)
        session.runs.pop(run.run_id, None)
        session.hosts |= run.executors
        for buf in (*run.pinned, *run.outputs):
            buf.pins -= 1
        for buf in run.pinned:
            buf.readers -= 1
        for buf in run.read_inside:
            buf.read_by_its_run = False
        self._maybe_free(session, *run.pinned, *run.outputs, *run.temporaries)
        self._forget_if_done(session)

    # ------------------------------------------------------------------ buffers

    def _maybe_free(self, session: Session, *bufs: Buffer) -> None:
        """Delete the freeable ``bufs`` wherever they are held: one message per executor."""
        by_holder: dict[str, list[str]] = {}
        for buf in bufs:
            if not buf.freeable:
                continue
            for control in buf.holders - self.peers.lost:
                by_holder.setdefault(control, []).append(f"{session.session_id}/{buf.name}")
            buf.holders = set()
        for control, prefixes in by_holder.items():
            self.peers.post(control, DeleteShards(buffers=prefixes))

    def _put_buffer(self, peer: bytes, env: Envelope) -> Ok:
        msg = env.message
        assert isinstance(msg, PutBuffer)
        session = self._session(peer)
        try:
            return self._put(session, msg)
        except PwmeshError as exc:
            session.fail_buffer(msg.buffer, ValueSpec(shape=list(msg.array.shape), dtype=msg.array.dtype.name,
                                                      shards=1), exc)
            raise

    def _put(self, session: Session, msg: PutBuffer) -> Ok:
        sl = session.slices.get(msg.slice_id)
        if sl is None:
            raise NotFound(f"slice {msg.slice_id} is not one of this session's slices")
        if msg.buffer in session.buffers:
            raise InvalidArgument(f"buffer {msg.buffer} already exists")
        n = len(sl.devices)
        spec = ValueSpec(shape=list(msg.array.shape), dtype=msg.array.dtype.name, shards=n, sharding=msg.sharding)
        layout = value_layout(spec)
        if msg.sharding is None and n > 1 and (msg.array.ndim == 0 or msg.array.shape[0] % n):
            raise InvalidArgument(f"an array of shape {msg.array.shape} cannot be split evenly over {n} devices")
        layout.check(f"putting an array of shape {msg.array.shape} on slice {msg.slice_id}")
        if layout.devices != n:
            raise InvalidArgument(f"a layout over {layout.devices} devices for slice {msg.slice_id} of {n}")
        buf = Buffer.new(session.buffer_name(msg.buffer), spec, client_ref=True)
        buf.locations = slice_locations(sl)
        buf.slice_id = sl.slice_id
        puts: dict[str, PutShards] = {}
        for i, (loc, part) in enumerate(zip(buf.locations, layout.split(msg.array), strict=True)):
            batch = puts.setdefault(loc.control, PutShards(keys=[], devices=[], arrays=[]))
            batch.keys.append(buf.keys(session.session_id)[i])
            batch.devices.append(loc.device)
            batch.arrays.append(part)
            buf.holders.add(loc.control)
        for control, batch in puts.items():
            self.peers.post(control, batch)
        buf.resolve(None)
        session.buffers[msg.buffer] = buf
        return Ok()

    def _release_buffers(self, peer: bytes, env: Envelope) -> None:
        msg = env.message
        assert isinstance(msg, ReleaseBuffers)
        session = self.sessions.get(peer)
        if session is None:
            return None
        for cid in msg.buffers:
            buf = session.buffers.pop(cid, None)
            if buf is not None:
                buf.client_ref = False
                self._maybe_free(session, buf)
        return None

    def _buffer(self, session: Session, cid: int) -> Buffer:
        buf = session.buffers.get(cid)
        if buf is None:
            if cid in session.donated:
                raise InvalidArgument(f"buffer {cid} was donated to {session.donated[cid]} and can no longer be used")
            raise NotFound(f"buffer {cid} does not exist (deleted, or never made)")
        return buf

    async def _await_buffers(self, peer: bytes, env: Envelope) -> Ok:
        msg = env.message
        assert isinstance(msg, AwaitBuffers)
        session = self._session(peer)
        for buf in [self._buffer(session, cid) for cid in msg.buffers]:
            await buf.ready
            if buf.lost is not None:
                raise buf.lost
        return Ok()

    def _query_buffers(self, peer: bytes, env: Envelope) -> BuffersState:
        msg = env.message
        assert isinstance(msg, QueryBuffers)
        session = self._session(peer)
        return BuffersState(ready=[self._buffer(session, cid).ready.done() for cid in msg.buffers])

    async def _fetch(self, peer: bytes, env: Envelope) -> BufferValue:
        msg = env.message
        assert isinstance(msg, Fetch)
        session = self._session(peer)
        buf = self._buffer(session, msg.buffer)
        buf.pins += 1  # a release while we fetch must not delete the shards under us
        buf.readers += 1  # nor a run it is donated to consume them
        try:
            shards = None if buf.ready.done() else await self._fetch_early(session, buf)
            if shards is None:
                await buf.ready  # raises its failure, if it failed
                if buf.lost is not None:
                    raise buf.lost
                shards = await self._fetch_shards(session, buf, self.config.fetch_timeout_seconds)
        finally:
            buf.pins -= 1
            buf.readers -= 1
            self._maybe_free(session, buf)
        return BufferValue(shards=shards)

    async def _fetch_early(self, session: Session, buf: Buffer) -> list[Any] | None:
        """Fetch a buffer still being computed: ask its executors now, not once it is done.

        ``FetchShards`` waits there for a shard not made yet (a posted receive), so the value
        comes back as soon as it exists: two hops sooner than waiting for the completion
        first (executor -> proxy, then proxy -> executor). No timeout while it computes (a
        lost executor, a cancelled run or a failed node ends the wait). None once the buffer
        is complete without the values: the caller reports its failure, or (it was moved
        meanwhile, say) fetches it the ordinary way."""
        fetching = asyncio.ensure_future(self._fetch_shards(session, buf, EARLY_FETCH_TIMEOUT_SECONDS))
        try:
            await asyncio.wait((buf.ready, fetching), return_when=asyncio.FIRST_COMPLETED)
            if fetching.done() and fetching.exception() is None:
                return fetching.result()
            await asyncio.wait((buf.ready,))  # complete, successfully or not (the caller reports which)
            if buf.ready.exception() is None and buf.lost is None:
                with contextlib.suppress(PwmeshError):
                    return await fetching
            return None
        finally:
            if not fetching.done():
                fetching.cancel()
            elif not fetching.cancelled():
                fetching.exception()  # retrieved: a failure here was reported another way

    async def _fetch_shards(self, session: Session, buf: Buffer, timeout_seconds: float) -> list[Any]:
        """One shard of each distinct block (``Layout.distinct()`` order): replicas are not fetched twice."""
        keys = buf.keys(session.session_id)
        wanted = value_layout(buf.spec).distinct()
        by_executor: dict[str, list[int]] = {}
        for k, i in enumerate(wanted):
            by_executor.setdefault(buf.locations[i].control, []).append(k)
        shards: list[Any] = [None] * len(wanted)

        async def fetch_from(control: str, indices: list[int]) -> None:
            deadline = time.monotonic() + timeout_seconds
            while True:
                try:
                    reply = await self.peers.request(control, FetchShards(keys=[keys[wanted[k]] for k in indices]),
                                                     timeout_seconds=max(0.0, deadline - time.monotonic()))
                    break
                except Unavailable:  # it restarted (into its JAX group's next forming) and holds the shards again
                    if time.monotonic() >= deadline:
                        raise
            assert isinstance(reply, ShardValues)
            for k, arr in zip(indices, reply.arrays, strict=True):
                shards[k] = arr

        await asyncio.gather(*(fetch_from(c, idx) for c, idx in by_executor.items()))
        return shards

    # ------------------------------------------------------------------- status

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
            for s in self.sessions.values()
        ]
        return StatusReply(cluster=reply.state, sessions=sessions, executor_stats=[s for s in found if s],
                           programs=self.programs, dispatch_messages=self.dispatch_messages,
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
        return ClusterTrace(executors=[t for t in found if t], limit=limit,
                            missing=[e.executor_id for e, t in zip(live, found, strict=True) if t is None])

