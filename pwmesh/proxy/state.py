"""The proxy's pure core: sessions, runs, buffers and their reference counts, remaps and losses.

``ProxyState.handle(event, now) -> actions`` does no I/O and never awaits: the daemon
(``proxy/daemon.py``) turns actions into messages and holds the futures of the requests
that wait (an ``AwaitBuffers``, a ``Fetch``); the simulator (``pwmesh/sim``) runs the
same core over its in-memory network in virtual time. A buffer's readiness is state
(``Buffer.done``, ``Buffer.error``); when it changes the core says so with ``Resolve``.

Events:
    ``Inbound(peer, message)``   a message a peer sent on the proxy's own socket: a client's
                                 request or post, an island scheduler's ``IslandDone`` (what the
                                 island's executors reported of a run: ``scheduler/completions.py``), an
                                 executor's ``NodeDone`` (a part sent with no scheduler).
    ``Notice(message)``          an unsolicited message on the proxy's connection to the RM
                                 (``ExecutorLost``, ``SliceRemapped``, ``SchedulerLost``...).
    ``SliceGranted(peer, slice)`` the RM's answer to the ``Ask`` a ``CreateSlice`` produced.
    ``FetchEnded(peer, buffer)`` a fetch ``Fetching`` started is over (the buffer is unpinned).
    ``Tick()``                   end the sessions whose client stopped sending heartbeats.
    ``Inherited(slices)``        at start: the slices the resource manager holds, of the proxy before
                                 this one (their sessions may be resumed: ``proxy/resume.py``).
    ``Reclaimed(...)``           the executors' answers to a resume's ``Reclaim``.
    ``Inventoried(...)``         what an executor back from a stall holds (``Inventory``).
    ``KeptChecked(run_id, intact)`` which shards donated to an aborted run are intact (``CheckKept``).

Actions:
    ``Send(to, message, dispatch)`` post ``message`` to the daemon at address ``to`` (the RM,
                                 a scheduler, an executor's control address); ``dispatch``: it is
                                 program traffic (counted in ``StatusReply``).
    ``Reply(message, error)``    the answer to the request being handled (one of the two).
    ``Ask(to, message)``         a request whose answer comes back as an event (``SliceGranted``).
    ``Park(key)``                answer the request later, as the ``Unpark(key, ask, error)`` of a later event
                                 says (a resume waiting for runs and fetches to let go of its slice's arrays).
    ``Wait(buffers, then)``      answer once every buffer is ``done`` (``AwaitBuffers``; a ``Fetch``
                                 with ``then=Fetching``).
    ``Fetching(buffer, keys)``   fetch these shard keys (by executor control address, in
                                 ``Layout.distinct()`` order); send ``FetchEnded`` when done.
    ``FetchingAll(fetches)``     a ``FetchBuffers``: each ``Fetching`` once all are done, one request an
                                 executor; a ``FetchEnded`` for each.
    ``Resolve(buffer)``          ``buffer`` just became done (ready, or failed with ``buffer.error``).
    ``PeerLost(control, error)`` the executor at ``control`` is gone: fail what waits on it.
    ``PeerBack(control)``        it is back (restarted): send what waited for it.
    ``FencePeer(control, fence)`` it restarts: post ``fence`` and hold later posts until ``PeerBack``.
    ``Reclaim(controls, message)`` request ``message`` (``ReclaimOwner``) of each executor; for a resume,
                                 hand the core ``Reclaimed`` and answer the request with what it says.
    ``Inventory(control, executor_id)`` ask an executor back from a stall what it holds (``ListHeld``);
                                 then ``Inventoried``.
    ``CheckKept(run_id, asks)``  ask executors which of these shard keys, donated to an aborted run, they
                                 hold intact (``ListHeld(keys)``); then ``KeptChecked``.
"""

from __future__ import annotations

import collections
import gc
import itertools
import logging
import re
import secrets
import weakref
from collections.abc import Callable, Sequence
from typing import ClassVar

from pwmesh.core.contract import EventLog
from pwmesh.core.liveness import Liveness
from pwmesh.core.ratelimit import RejectedLog
from pwmesh.dataflow.layout import Layout
from pwmesh.errors import (
    DeadlineExceeded,
    DeviceLost,
    InvalidArgument,
    NoSession,
    NotFound,
    PermissionDenied,
    ProtocolError,
    PwmeshError,
    ResourceExhausted,
    Unavailable,
)
from pwmesh.ir.cache import MAX_PROGRAM_ID_CHARS
from pwmesh.ir.keys import function_id
from pwmesh.ir.lower import location, move_shard, nbytes, shard_key, slice_locations, split_key, value_layout
from pwmesh.proxy import elastic
from pwmesh.proxy.events import (  # noqa: F401 - re-exported: tests name them from here too
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
    _summary,
    settled,
    sources,
)
from pwmesh.proxy.frees import KeptFrees
from pwmesh.proxy.intake import bind, host_puts, record_run
from pwmesh.proxy.resume import Orphan, adopt, data_key, resume_token, slice_controls, token_matches
from pwmesh.proxy.session import Buffer, Run, Session
from pwmesh.proxy.tenants import TenantLimits, TenantPolicy
from pwmesh.service.keys import LOCAL, speaks_for, unkeyed
from pwmesh.wire import DEFAULT_LIMITS, Message
from pwmesh.wire.codec import dtype_from_name
from pwmesh.wire.messages import (
    AllocateSlice,
    AwaitBuffers,
    BuffersState,
    CancelRun,
    CloseSession,
    Computation,
    CreateSlice,
    DataLost,
    DeleteShards,
    Error,
    ErrorInfo,
    ExecutorJoined,
    ExecutorLost,
    ExecutorRestarting,
    ExpectShards,
    Fence,
    Fetch,
    FetchBuffers,
    ForgetOwner,
    FreeGroup,
    FreeShards,
    Heartbeat,
    InstallTemplate,
    IslandDone,
    Move,
    NodeDone,
    Ok,
    OpenSession,
    PleaseRegister,
    ProgramSpec,
    PutBuffer,
    PutDirect,
    PutShards,
    QueryBuffers,
    ReclaimOwner,
    RegisterFunction,
    RegisterProgram,
    RegisterProgramFunction,
    RegrantSlices,
    ReleaseBuffers,
    ReleaseSlices,
    ResumeSession,
    ResumeSlices,
    ResumeSuspended,
    RunPart,
    RunProgram,
    RunTemplate,
    SchedulerJoined,
    SchedulerLost,
    ScheduleRun,
    SendMoves,
    SendShards,
    SessionOpened,
    SessionResumed,
    Sharding,
    ShardPlaces,
    ShardRun,
    SliceCreated,
    SliceInfo,
    SliceRemapped,
    SlicesChanged,
    SuspendSession,
    SuspendSlices,
    TakeBack,
    TemplateMissing,
    VacateSlices,
    ValueSpec,
    WatchCluster,
)
from pwmesh.wire.parts import run_parts

__all__ = ["_summary", "Action", "Ask", "CheckFunction", "CheckKept", "Deliver", "Delivered", "Event", "FencePeer", "FetchEnded", "Fetching", "FunctionChecked", "Inbound", "Inherited", "Inventoried", "Inventory", "KeptChecked", "Lowered", "LowerOffLoop", "Notice", "Park", "PeerBack", "PeerLost", "ProxyState", "Reclaim", "Reclaimed", "Reply", "Resolve", "Send", "settled", "SliceGranted", "sources", "Tick", "Unpark", "Wait"]

log = logging.getLogger(__name__)

# What one run's computations for one island may pack into: the message limit, less room for the
# rest of the ScheduleRun (its names and header).
MAX_PART_BYTES = DEFAULT_LIMITS.max_body_bytes - (1 << 20)
MAX_TEMPLATE_RETRIES = 3  # a run sent again to a scheduler that lacked its template, at most
MAX_REFUSED_FUNCTIONS = 1024  # functions the sandbox refused, remembered (the oldest forgotten first)
MAX_FETCH_BUFFERS = 1024  # buffers one ``FetchBuffers`` may name (its answer: at most 4,096 blocks in all)
MAX_ARRIVING_PROGRAMS = 4  # per session, coming in parts at once (each held until its last part)
MAX_MERGED = 64  # per session: cached lowerings' executor sets known to be in its ``hosts`` (``Session.merged``)
MAX_HOLDER_LISTS = 256  # holder sets of cached lowerings kept listed for frees (``_listed``)
# A resume or reshape waits this long for the runs and fetches holding its slice's arrays to let go (``Park``);
# a session may have this many waiting at once (each is checked after every event while it waits).
SETTLE_WAIT_SECONDS = 30.0
MAX_PARKED_PER_SESSION = 16
SESSION_ID = re.compile(r"s\d+-[0-9a-f]{6}")  # what ``_open_session`` names sessions
UNKNOWN_VALUE = ValueSpec(shape=[], dtype="float32", shards=1)  # a failed output of a program never seen

class ProxyState:
    """Everything the proxy knows and decides; see the module docstring for events and actions."""

    def __init__(self, *, rm: str, address: str, name: str = "proxy", session_timeout_seconds: float = 30.0,
                 client_heartbeat_interval_seconds: float = 5.0, lower_off_loop_nodes: int = 0,
                 secret: bytes = b"") -> None:
        """``lower_off_loop_nodes``: a program with that many computations or more, not lowered yet, is
        lowered by the shell on a thread (``LowerOffLoop``); 0: everything is lowered here. ``secret``: what
        sessions' resume tokens are made with; one that outlives this process lets its sessions outlive it
        (``proxy/resume.py``; b"": they cannot)."""
        self.rm = rm
        self.lower_off_loop_nodes = lower_off_loop_nodes
        self.address = address  # where executors send NodeDone (carried in every ScheduleRun)
        self.name = name
        self.session_timeout_seconds = session_timeout_seconds
        self.client_heartbeat_interval_seconds = client_heartbeat_interval_seconds
        self.sessions: dict[bytes, Session] = {}
        self.sessions_opened = 0  # ever
        self.sessions_expired = 0  # ended because their client stopped sending heartbeats
        self.sessions_resumed = 0  # taken back after a restart of the proxy
        self.secret = secret
        self.data_secret = secret or secrets.token_bytes(32)  # what sessions' data keys derive from
        # Sessions of the proxy before this one, by id, until resumed or freed (``resume_until``).
        self.orphans: dict[str, Orphan] = {}
        self.resume_until = float("-inf")  # monotonic: sessions of the proxy before may resume until then
        self.resuming: set[str] = set()  # session ids being resumed (waiting for the executors)
        self.runs: dict[str, tuple[Session, Run]] = {}
        self.exported: dict[str, RegisterProgramFunction] = {}  # by function id: what executors are sent
        self.registered: set[tuple[str, str, tuple[int, ...]]] = set()  # (fn, control, devices) sent; pruned for a new process there
        self.gangs_sent: set[tuple[str, str]] = set()  # (gang id, control) sent (``RegisterGang``); pruned as it is
        # Cached lowerings whose every function site is in ``registered`` (and gang in ``gangs_sent``): their
        # later runs skip the check, one set lookup per function per device (~25 ms a run at 2,048 devices
        # and 16 functions). Valid while those only grow: whatever prunes them must clear this too.
        self.sites_registered: weakref.WeakSet[object] = weakref.WeakSet()
        # Cached lowerings whose packed parts were found to fit one message (they never change).
        self.parts_sized: weakref.WeakSet[object] = weakref.WeakSet()
        # Cached lowerings installed on islands' schedulers (``InstallTemplate``): template -> {scheduler: the
        # scheduler's generation then}. A scheduler that (re)joins starts a new generation: installed again.
        self.templates_installed: weakref.WeakKeyDictionary[object, dict[str, int]] = weakref.WeakKeyDictionary()
        self.scheduler_generation: collections.Counter[str] = collections.Counter()
        self.templates_reinstalled = 0  # runs sent again because their scheduler lacked the template
        self.liveness = Liveness(session_timeout_seconds)
        self.policy = TenantPolicy()  # tenants' limits and shares (the shell keeps it as the admin set it)
        self.lost: dict[str, DeviceLost] = {}  # executor id -> why it is gone
        self.lost_controls: set[str] = set()  # their control addresses: nothing is sent there
        self.moved_buffers = 0  # buffers moved off draining hosts, ever
        # New functions' modules are read in a child process before they are registered (``CheckFunction``):
        # set by the shell when it has one. What passed, and what was refused (the last ones), by id.
        self.check_functions = False
        self.checked_functions: set[str] = set()
        self.refused_functions: dict[str, PwmeshError] = {}
        # Bytes of each tenant's puts and fetches passing through here now (``max_bytes_in_flight``).
        self.in_flight: collections.Counter[str] = collections.Counter()
        self._orphan_slices: dict[str, list[SliceInfo]] = {}  # sessions being resumed: the slices they had
        self._reclaiming: dict[str, Reclaim] = {}  # sessions being resumed: what was asked of the executors
        self.lost_schedulers: dict[str, DeviceLost] = {}  # address -> why: runs there cannot be ordered
        self.frees = KeptFrees()  # frees sent to schedulers not known fanned out: sent again if one is lost
        self._holder_lists: dict[frozenset[str], list[str]] = {}  # a cached lowering's holder sets, listed (``_listed``)
        # Whose daemon key a public key (z85) is, by name (the shell's authorized keys; None: nobody's, or no
        # keys): an island's reports are taken only from the key its scheduler's address advertises.
        self.key_holder: Callable[[bytes], str | None] = lambda public: None
        self.programs = 0
        self.dispatch_messages = 0  # Send actions of program traffic, ever (the shell adds their bytes)
        self._session_ids = itertools.count(1)
        self._requests = itertools.count(1)  # slice requests to the RM (``AllocateSlice.request``)
        self._out: list[Action] = []
        # What a peer can make us say again and again (completions and losses it makes up): a line per
        # (kind, executor) per 10 s, at most 100 lines per 10 s in all, with counts of the rest.
        self._now = 0.0  # the time ``handle`` was given: the core's clock
        self._stimulus = ""  # the id of the event being handled (``events``)
        self._peer_log = RejectedLog(name, logger=log, clock=lambda: self._now)
        self._dispatching = False
        self._user = ""  # who sent the Inbound being handled (``Inbound.user``)
        self._handlers = {op: getattr(self, method) for op, method in self.HANDLERS.items()}
        # Aborted runs whose donated buffers the executors are asked about (``CheckKept``): run id ->
        # (session, run, error, [(client id, buffer)]).
        self._keeping: dict[str, tuple[Session, Run, PwmeshError, list[tuple[int, Buffer]]]] = {}
        # Resumes and reshapes waiting for their slices' arrays to be let go of (``_when_settled``): key ->
        # (session id, slice ids, the Ask that goes on, until when it waits).
        self._parked: dict[int, tuple[str, list[int], Ask, float]] = {}
        self._park_keys = itertools.count(1)
        # The latest events, as summary lines (a client's messages carry arrays: none is kept).
        self.events = EventLog()

    # The messages ``Inbound`` takes, and their handlers (the shell serves these ops with ``handle``).
    HANDLERS: ClassVar[dict[type[Message], str]] = {
        OpenSession: "_open_session", CloseSession: "_close_session", Heartbeat: "_heartbeat",
        ResumeSession: "_resume_session",
        CreateSlice: "_create_slice", RegisterProgramFunction: "_register_function",
        RegisterProgram: "_register_program", RunProgram: "_run_program", PutBuffer: "_put_buffer",
        ReleaseBuffers: "_release_buffers", AwaitBuffers: "_await_buffers", QueryBuffers: "_query_buffers",
        Fetch: "_fetch", FetchBuffers: "_fetch_buffers", NodeDone: "_node_done", IslandDone: "_island_done", DataLost: "_data_lost",
        TakeBack: "_take_back",
        TemplateMissing: "_template_missing",
        PutDirect: "_put_direct", SuspendSlices: "_suspend_slices", ResumeSlices: "_resume_slices",
        SuspendSession: "_suspend_session", ResumeSuspended: "_resume_suspended",
    }
    ADMIN_HANDLERS: ClassVar[tuple[type[Message], ...]] = (SuspendSession, ResumeSuspended)  # the shell lets admins only

    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply ``event``; return what must happen because of it, in order."""
        self._out = out = []
        self._now = now
        kind = event.message.op if isinstance(event, Inbound | Notice) else type(event).__name__
        self._stimulus = stimulus = self.events.stimulus(kind)
        try:
            if isinstance(event, Inbound):
                self._user = event.user
                handler = self._handlers.get(type(event.message))
                if handler is None:
                    raise ProtocolError(f"the proxy does not serve {event.message.op!r}")
                reply = handler(event.peer, event.message, now)
                if reply is not None:
                    out.append(reply)
            elif isinstance(event, Notice):
                self._notified(event.message)
            elif isinstance(event, SliceGranted):
                out.append(self._slice_granted(event.peer, event.slice))
            elif isinstance(event, SlicesPlaced):
                out.append(self._slices_placed(event))
            elif isinstance(event, FetchEnded):
                event.buffer.pins -= 1
                event.buffer.readers -= 1
                self.in_flight[event.owner] -= event.nbytes
                self._maybe_free(event.session_id, event.buffer)
            elif isinstance(event, Delivered):
                self.in_flight[event.owner] -= event.nbytes
            elif isinstance(event, FunctionChecked):
                if event.error is None:
                    self.checked_functions.add(event.fn_id)
                else:
                    self.refused_functions[event.fn_id] = event.error
                    while len(self.refused_functions) > MAX_REFUSED_FUNCTIONS:
                        del self.refused_functions[next(iter(self.refused_functions))]
            elif isinstance(event, Lowered):
                session = self.sessions.get(event.peer)
                if session is not None and session.session_id == event.session_id:  # else it ended meanwhile
                    session.lowerings.finish(event.job)
                    gc.collect(1)  # a big program's lowering, cached: frozen as its parts were (``_assemble``)
                    gc.freeze()
            elif isinstance(event, Tick):
                self._expire_sessions(now)
                self._expire_runs(now)
                self._expire_orphans(now)
            elif isinstance(event, Inherited):
                self._inherit(event.slices, now)
            elif isinstance(event, Reclaimed):
                out.append(self._reclaimed(event, now))
            elif isinstance(event, Inventoried):
                self._reconcile(event)
            elif isinstance(event, KeptChecked):
                self._kept_checked(event)
            else:
                raise TypeError(f"not a proxy event: {event!r}")
            if self._parked:  # (rare: only while a resume waits) what this event let go of may let one go on
                self._unpark(now)
        except PwmeshError as exc:
            out.append(Reply(error=exc))
        finally:
            self._out = []
            self._dispatching = False
            self.events.record(now, stimulus, _summary(event), len(out))
        return out

    def _send(self, to: str, message: Message) -> None:
        if to in self.lost_controls:  # gone: what it would hold died with it
            return
        self._out.append(Send(to, message, self._dispatching, self._stimulus))
        if self._dispatching:
            self.dispatch_messages += 1
        if self.frees.kept and type(message) in (RunTemplate, ScheduleRun):  # its report confirms earlier frees
            self.frees.run_sent(to, message.run_id)  # type: ignore[attr-defined]

    def _resolve(self, buf: Buffer, error: PwmeshError | None) -> None:
        if buf.resolve(error):
            self._out.append(Resolve(buf))

    def watch(self, role: str = "proxy") -> WatchCluster:
        """Subscription to the RM, carrying every slice our sessions hold (rebuilds a restarted RM)."""
        slices = [sl for session in self.sessions.values() for sl in session.slices.values()]
        slices += [sl for orphan in self.orphans.values() for sl in orphan.slices]
        return WatchCluster(role=role, name=self.name, slices=slices)

    # ----------------------------------------------------------------- sessions

    def _own(self, peer: bytes) -> Session | None:
        """The session of ``peer`` if the key sending now opened it. Another key's connection under the
        same routing id (ZeroMQ lets a client choose its own) is no way into it: it has none."""
        session = self.sessions.get(peer)
        return session if session is not None and session.owner == self._user else None

    def session(self, peer: bytes) -> Session:
        session = self._own(peer)
        if session is None:
            raise NoSession("this connection has no session (open one first, or it timed out)")
        return session

    def _open_session(self, peer: bytes, msg: OpenSession, now: float) -> Reply:
        if msg.weight <= 0:
            raise InvalidArgument(f"a session's weight must be positive, got {msg.weight}")
        old = self.sessions.get(peer)
        if old is not None and old.owner != self._user:
            raise PermissionDenied("this connection's routing id belongs to another key's session")
        if old is not None:
            self._end_session(old, "reopened")
        limits = self.policy.of(self._user)
        held = sum(1 for s in self.sessions.values() if s.owner == self._user)
        if limits.max_sessions and held >= limits.max_sessions:
            raise ResourceExhausted(f"tenant {self._user!r} holds {held} sessions, its limit "
                                    f"(max_sessions {limits.max_sessions})")
        weight, priority = self._shares(self._user, msg.weight, msg.priority)
        sid = f"s{next(self._session_ids)}-{secrets.token_hex(3)}"
        while sid in self.orphans or sid in self.resuming:  # one of the proxy before's
            sid = f"s{next(self._session_ids)}-{secrets.token_hex(3)}"
        self.sessions_opened += 1
        self.sessions[peer] = Session(session_id=sid, name=msg.name, peer=peer, owner=self._user,
                                      weight=weight, priority=priority)
        self.liveness.beat(sid, now)
        log.info("session %s (%s) opened", sid, msg.name)
        return Reply(SessionOpened(session_id=sid, heartbeat_interval_seconds=self._client_beats(),
                                   session_timeout_seconds=self.session_timeout_seconds,
                                   resume_token=resume_token(self.secret, sid, self._user),
                                   data_key=data_key(self.data_secret, sid)))

    # ------------------------------------------------------- sessions of the proxy before (``proxy/resume.py``)

    def _inherit(self, slices: list[SliceInfo], now: float) -> None:
        """The resource manager's slices at our start: every one is a session of the proxy before's."""
        for sl in slices:
            self.orphans.setdefault(sl.owner, Orphan()).slices.append(sl)
        self.resume_until = now + self.session_timeout_seconds
        if self.orphans:
            log.info("%d sessions of the proxy before this one hold %d slices: they are kept for %g s for their "
                     "clients to resume them", len(self.orphans), len(slices), self.session_timeout_seconds)

    def may_resume(self, session_id: str, now: float) -> bool:
        """Whether ``session_id`` may be one of the proxy before's, still to be resumed."""
        return session_id in self.orphans or (
            now <= self.resume_until and SESSION_ID.fullmatch(session_id) is not None
            and session_id not in self.resuming and self._by_id(session_id) is None)

    def _resume_session(self, peer: bytes, msg: ResumeSession, now: float) -> Reclaim:
        sid = msg.session_id
        if not token_matches(self.secret, sid, self._user, msg.token):
            raise PermissionDenied(f"this token does not resume session {sid} (a session is resumed only with the "
                                   "token it was opened with, by the key that opened it)")
        if sid in self.resuming or self._by_id(sid) is not None:
            raise InvalidArgument(f"session {sid} is being resumed already, or was never lost")
        orphan = self.orphans.pop(sid, None)
        if orphan is None and now > self.resume_until:
            raise NotFound(f"session {sid} is gone: it ended or expired (sessions of a proxy that restarted are "
                           f"kept for {self.session_timeout_seconds:g} s for their clients to resume them)")
        slices = orphan.slices if orphan is not None else []
        self.resuming.add(sid)
        self._orphan_slices[sid] = slices
        controls = self._controls_of(slices)
        message = ReclaimOwner(prefix=f"{sid}/", marker=f"r{secrets.token_hex(4)}.", why=(
            f"the proxy at {self.address} restarted while this run was in flight (its session was resumed)"))
        reclaim = Reclaim(controls, message, resume=msg, peer=peer, user=self._user)
        self._reclaiming[sid] = reclaim
        return reclaim

    def _reclaimed(self, event: Reclaimed, now: float) -> Reply:
        """The executors said what they hold of a session being resumed: rebuild it, free what nobody claims."""
        msg = event.resume
        sid = msg.session_id
        reclaim = self._reclaiming.pop(sid)
        self.resuming.discard(sid)
        slices = self._orphan_slices.pop(sid)
        weight, priority = self._shares(event.user, msg.weight, msg.priority)
        session = Session(session_id=sid, name=msg.name, peer=event.peer, owner=event.user, weight=weight,
                          priority=priority, marker=reclaim.message.marker)
        declared = set(msg.slices)
        session.slices = {sl.slice_id: sl for sl in slices if sl.slice_id in declared}
        undeclared = [sl.slice_id for sl in slices if sl.slice_id not in declared]
        if undeclared:
            self._send(self.rm, ReleaseSlices(owner=sid, slice_ids=undeclared))
        why = (f"the proxy serving session {sid} restarted or was replaced (by the one at {self.address}) while this "
               "value was being made or moved, or before it had the request that makes it (or a host holding it "
               f"did not answer then): session {sid} was resumed without it")
        # Arrays it dropped lately are kept only for what it sent before that names them, and only if they are
        # all there (their releases follow).
        gone = [b for b in msg.released if b.buffer in event.named and b.buffer not in event.coming]
        adopted = adopt(session, [b for b in msg.buffers if b.buffer not in event.coming], event.held, why, gone)
        for control, buffers in adopted.unclaimed.items():
            self._send(control, DeleteShards(buffers=sorted(buffers)))
        session.hosts |= set(event.held)
        old = self.sessions.get(event.peer)
        if old is not None:
            self._end_session(old, "its connection resumed another session")
        self.sessions[event.peer] = session
        self.liveness.beat(sid, now)
        self.sessions_resumed += 1
        log.info("session %s (%s) resumed: %d arrays kept, %d failed, %d slices", sid, msg.name,
                 len(msg.buffers) - len(adopted.failed), len(adopted.failed), len(session.slices))
        return Reply(SessionResumed(heartbeat_interval_seconds=self._client_beats(),
                                    session_timeout_seconds=self.session_timeout_seconds,
                                    failed=adopted.failed, why=why))

    def _expire_orphans(self, now: float) -> None:
        """Free the sessions of the proxy before that nobody resumed in time: their slices and buffers."""
        if not self.orphans or now <= self.resume_until:
            return
        orphans, self.orphans = self.orphans, {}
        for sid, orphan in orphans.items():
            log.info("session %s of the proxy before was not resumed within %g s: freeing its %d slices", sid,
                     self.session_timeout_seconds, len(orphan.slices))
            self._send(self.rm, ReleaseSlices(owner=sid))
            controls = self._controls_of(orphan.slices)
            if controls:
                self._out.append(Reclaim(controls, ReclaimOwner(
                    prefix=f"{sid}/", marker="", drop=True,
                    why=f"session {sid} was not resumed after its proxy restarted")))

    def _client_beats(self) -> float:
        """How often a client beats: four beats per timeout, so one late beat never ends a live session."""
        return min(self.client_heartbeat_interval_seconds, self.session_timeout_seconds / 4)

    def _by_id(self, session_id: str) -> Session | None:
        """The live session ``session_id`` (sessions are kept by connection)."""
        return next((s for s in self.sessions.values() if s.session_id == session_id), None)

    def _controls_of(self, slices: list[SliceInfo]) -> list[str]:
        """The live executors the slices' devices are on, each once."""
        return [c for c in slice_controls(slices) if c not in self.lost_controls]

    def _shares(self, user: str, weight: float, priority: int) -> tuple[float, int]:
        """A new session's weight and priority: the server's to give; a client's own count only where it is
        the cluster's one user."""
        limits = self.policy.of(user)
        own = user in ("", LOCAL.name)
        return (limits.weight if limits.weight is not None else (weight if own else 1.0),
                limits.priority if limits.priority is not None else (priority if own else 0))

    def _close_session(self, peer: bytes, msg: CloseSession, now: float) -> Reply:
        self._end_session(self.session(peer), "closed by client")
        return Reply(Ok())

    def _heartbeat(self, peer: bytes, msg: Heartbeat, now: float) -> Reply:
        self.liveness.beat(self.session(peer).session_id, now)
        return Reply(Ok())

    def _expire_runs(self, now: float) -> None:
        """Fail the runs still going past their tenant's ``max_run_seconds``."""
        for session, run in [sr for sr in self.runs.values() if now > sr[1].deadline]:
            limit = self.policy.of(session.owner).max_run_seconds
            self._abort_run(session, run, DeadlineExceeded(
                f"run {run.run_id} was still going after its tenant's limit of {limit:g} s (max_run_seconds); "
                "what it had not made fails with this"))

    def _expire_sessions(self, now: float) -> None:
        lost = set(self.liveness.expired(now))
        for session in [s for s in self.sessions.values() if s.session_id in lost]:
            self.sessions_expired += 1
            self._end_session(session, f"no heartbeat for {self.session_timeout_seconds} seconds")

    def _end_session(self, session: Session, why: str) -> None:
        """Free everything the session owned; runs in flight are cancelled and free their part."""
        log.info("session %s ended: %s", session.session_id, why)
        self.sessions.pop(session.peer, None)
        self.liveness.forget(session.session_id)
        ended = PwmeshError(f"session {session.session_id} ended: {why}")
        for run in list(session.runs.values()):
            self._abort_run(session, run, ended)
        for run_id in [r for r, keeping in self._keeping.items() if keeping[0] is session]:
            self._kept_checked(KeptChecked(run_id, []))
        for buf in [*session.buffers.values(), *session.returnable.values()]:
            buf.client_ref = False
            self._maybe_free(session.session_id, buf)
        session.buffers.clear()
        session.returnable.clear()
        session.ended = True
        session.hosts |= {d.control for sl in session.slices.values() for d in sl.devices}
        if session.slices:
            self._send(self.rm, ReleaseSlices(owner=session.session_id))
            session.slices.clear()
        self._forget_if_done(session)

    def _forget_if_done(self, session: Session) -> None:
        """Once an ended session's last run is over, executors may drop its tombstones."""
        if session.ended and not session.runs:
            for control in session.hosts:
                self._send(control, ForgetOwner(prefix=f"{session.session_id}/"))
            session.hosts.clear()
            session.merged.clear()

    # ------------------------------------------------------------------- slices

    def _create_slice(self, peer: bytes, msg: CreateSlice, now: float) -> Ask:
        session = self.session(peer)
        return Ask(self.rm, AllocateSlice(owner=session.session_id, devices=msg.devices, island=msg.island,
                                          kind=msg.kind, request=str(next(self._requests))), peer)

    def _slice_granted(self, peer: bytes, sl: SliceInfo) -> Reply:
        session = self.sessions.get(peer)
        if session is None or session.session_id != sl.owner:  # it ended while the RM allocated
            self._send(self.rm, ReleaseSlices(owner=sl.owner, slice_ids=[sl.slice_id]))
            raise NotFound("this connection's session ended before its slice was allocated")
        session.slices[sl.slice_id] = sl
        return Reply(SliceCreated(slice=sl))

    # ---------------------------------------------------- elastic slices (``proxy/elastic.py``)

    def _suspend_slices(self, peer: bytes, msg: SuspendSlices, now: float) -> Ask:
        session = self.session(peer)
        elastic.owned(session, msg.slice_ids)
        return Ask(self.rm, VacateSlices(owner=session.session_id, slice_ids=list(msg.slice_ids)), peer)

    def _resume_slices(self, peer: bytes, msg: ResumeSlices, now: float) -> Ask | Park:
        session = self.session(peer)
        elastic.check_reshape(session, msg)
        return self._when_settled(session, list(msg.slice_ids), now, Ask(
            self.rm, RegrantSlices(owner=session.session_id, slice_ids=list(msg.slice_ids), devices=msg.devices,
                                   island=msg.island), peer, reshape=msg if msg.devices else None))

    def _when_settled(self, session: Session, slice_ids: list[int], now: float, ask: Ask) -> Ask | Park:
        """``ask`` now if no run or fetch holds an array of these slices; else the request waits (``Park``) until
        none does, for at most ``SETTLE_WAIT_SECONDS``: a run holds its arrays until its last report comes,
        which may be after the client saw its values (``_unpark``)."""
        if not elastic.held(session, elastic.owned(session, slice_ids)):
            return ask
        waiting = sum(1 for parked in self._parked.values() if parked[0] == session.session_id)
        if waiting >= MAX_PARKED_PER_SESSION:
            raise ResourceExhausted(f"session {session.session_id} has {waiting} resumes waiting for their slices' "
                                    "arrays already: wait for those")
        key = next(self._park_keys)
        self._parked[key] = (session.session_id, slice_ids, ask, now + SETTLE_WAIT_SECONDS)
        return Park(key)

    def _unpark(self, now: float) -> None:
        """Let the parked requests whose slices nothing holds now go on; fail those whose session or slice went,
        or that waited ``SETTLE_WAIT_SECONDS``."""
        for key, (session_id, slice_ids, ask, deadline) in list(self._parked.items()):
            session = self._by_id(session_id)
            try:
                if session is None:
                    raise NoSession(f"session {session_id} ended while its resume waited for its arrays")
                slices = elastic.owned(session, slice_ids)
            except PwmeshError as exc:
                self._out.append(Unpark(key, error=exc))
            else:
                busy = elastic.held(session, slices)
                if busy and now < deadline:
                    continue  # (the message is made only when it is said: this runs after every event)
                if busy:
                    error = elastic.held_error(session, slices, busy)
                    self._out.append(Unpark(key, error=Unavailable(f"{error.message} "
                                                                   f"(waited {SETTLE_WAIT_SECONDS:g} s)")))
                else:
                    self._out.append(Unpark(key, ask=ask))
            del self._parked[key]

    def _tenant_session(self, session_id: str) -> Session:
        """An admin's target (the shell let only admins send this)."""
        session = self._by_id(session_id)
        if session is None:
            raise NotFound(f"no live session {session_id!r} (pwmesh status lists them)")
        if not session.slices:
            raise InvalidArgument(f"session {session_id} holds no slices")
        return session

    def _suspend_session(self, peer: bytes, msg: SuspendSession, now: float) -> Ask:
        session = self._tenant_session(msg.session_id)
        log.info("an admin (%s) suspends session %s", self._user or "local", session.session_id)
        return Ask(self.rm, VacateSlices(owner=session.session_id, slice_ids=sorted(session.slices)), peer)

    def _resume_suspended(self, peer: bytes, msg: ResumeSuspended, now: float) -> Ask | Park:
        session = self._tenant_session(msg.session_id)
        ids = sorted(sid for sid, sl in session.slices.items() if sl.suspended)
        if not ids:
            raise InvalidArgument(f"session {session.session_id} has no suspended slice")
        log.info("an admin (%s) resumes session %s", self._user or "local", session.session_id)
        return self._when_settled(session, ids, now, Ask(self.rm, RegrantSlices(owner=session.session_id,
                                                                                slice_ids=ids), peer))

    def _slices_placed(self, event: SlicesPlaced) -> Reply:
        """The RM suspended or placed anew these slices: adopt them; move the buffers of those that moved."""
        for sl in event.slices:
            session = self._by_id(sl.owner)
            old = session.slices.get(sl.slice_id) if session is not None else None
            if session is None or old is None:  # its session ended meanwhile (which released it)
                continue
            session.slices[sl.slice_id] = sl
            reshape = event.reshape if isinstance(event.reshape, ResumeSlices) else None
            if sl.suspended:  # its buffers leave its devices, now others', for host memory
                for control, spill in elastic.spill(session, sl):
                    self._send(control, spill)
                continue
            if reshape is None and old.devices == sl.devices and not old.suspended:
                continue  # placed anew on the very devices it has: its shards are there
            sends, old_buffers = elastic.move(session, sl, reshape)
            for control, send in sends:
                self._send(control, send)
            session.hosts |= {d.control for d in sl.devices}
            self.moved_buffers += len(old_buffers)
            # Deleted straight behind their SendShards, on the same connection to each holder, so each executor
            # looks up what it sends before the delete: a FreeShards through the island's scheduler reaches the
            # executor by another pipe and could be read first (the copy then failed, NotFound "was deleted").
            self._maybe_free(session.session_id, *old_buffers, direct=True)
        return Reply(SlicesChanged(slices=event.slices))

    def _register_function(self, peer: bytes, msg: RegisterProgramFunction, now: float) -> Reply | None:
        session = self.session(peer)
        if msg.slice_id not in session.slices:
            raise NotFound(f"slice {msg.slice_id} is not one of this session's slices")
        if msg.fn_id != function_id(msg.exported, msg.spmd, msg.mesh, msg.axes, msg.donate):
            raise InvalidArgument("a function's id must be the hash of its exported bytes and calling convention "
                                  "(see pwmesh.ir.keys.function_id)")
        if self.check_functions and msg.fn_id not in self.exported:  # new here: its module is read first
            refused = self.refused_functions.get(msg.fn_id)
            if refused is not None:
                session.refused_functions[msg.fn_id] = refused  # its runs fail with why
                raise refused
            if msg.fn_id not in self.checked_functions:
                self._out.append(CheckFunction(msg.fn_id, msg.exported))
                return None
        self.exported.setdefault(msg.fn_id, msg)
        session.functions[msg.fn_id] = msg.spmd
        return Reply(Ok())

    # ----------------------------------------------------------------- programs

    def _register_program(self, peer: bytes, msg: RegisterProgram, now: float) -> None:
        session = self.session(peer)
        if not msg.program_id or len(msg.program_id) > MAX_PROGRAM_ID_CHARS:
            raise InvalidArgument(f"a program id has 1 to {MAX_PROGRAM_ID_CHARS} characters")
        program = self._assemble(session, msg)
        if program is None:
            return None  # more parts to come (or refused: its runs say why)
        # Checked when it first runs (lowering validates it), where an error reaches its buffers.
        if msg.program_id not in session.programs:
            limits = self.policy.of(session.owner)
            held = sum(len(s.programs) for s in self.sessions.values() if s.owner == session.owner)
            if limits.max_programs and held >= limits.max_programs:  # its runs fail with this, not NotFound
                session.refused_programs[msg.program_id] = ResourceExhausted(
                    f"tenant {session.owner!r} holds {held} programs, its limit (max_programs "
                    f"{limits.max_programs}): close sessions it no longer needs")
                while len(session.refused_programs) > 64:
                    del session.refused_programs[next(iter(session.refused_programs))]
                return None
        session.refused_programs.pop(msg.program_id, None)
        session.programs.setdefault(msg.program_id, program)
        return None  # posted, like a RunProgram after it

    def _assemble(self, session: Session, msg: RegisterProgram) -> ProgramSpec | None:
        """The whole program once its last part is in (``RegisterProgram.parts``), else None. Parts come in
        order on one connection; the tenant's ``max_nodes`` is checked as they come, not once they all
        have (a program over it is refused: its runs fail with why, and what came is dropped)."""
        if msg.parts == 1 and msg.part == 0:
            return msg.program
        pid = msg.program_id
        if msg.part > 0 and pid in session.refused_programs and pid not in session.arriving:
            return None  # the rest of a program refused already
        expected, sofar = session.arriving.pop(pid, (0, None))
        if not 0 <= msg.part < msg.parts or msg.part != expected:
            raise InvalidArgument(f"program {pid[:16]!r}: part {msg.part} of {msg.parts} came where part {expected} "
                                  "was due (parts come in order)")
        if sofar is None:
            if len(session.arriving) >= MAX_ARRIVING_PROGRAMS:
                raise ResourceExhausted(f"{MAX_ARRIVING_PROGRAMS} programs are arriving in parts in this session "
                                        "already: send one at a time")
            sofar = ProgramSpec(values=[], nodes=[], inputs=[], outputs=[])
        sofar.values.extend(msg.program.values)
        sofar.nodes.extend(msg.program.nodes)
        # Held until the session ends, and millions of objects for a big program: out of the cyclic
        # collector's way (every full collection walked them: alice's round trips grew to 1.1 s while
        # a 10^6-node program arrived, 0.3 s with it frozen). They are still freed when dropped; the
        # young generations are collected first, so little garbage is frozen with them.
        gc.collect(1)
        gc.freeze()
        limit = self.policy.of(session.owner).max_nodes
        if limit and len(sofar.nodes) > limit:
            session.refused_programs[pid] = ResourceExhausted(
                f"the program has more than {limit} computations (over tenant {session.owner!r}'s max_nodes "
                f"{limit}, at {len(sofar.nodes)} of its part {msg.part + 1} of {msg.parts})")
            return None
        if msg.part < msg.parts - 1:
            session.arriving[pid] = (msg.part + 1, sofar)
            return None
        sofar.inputs, sofar.outputs = msg.program.inputs, msg.program.outputs
        return sofar

    def _run_program(self, peer: bytes, msg: RunProgram, now: float) -> None:
        session = self.session(peer)
        program = msg.program if msg.program is not None else session.programs.get(msg.program_id)
        try:
            if program is None:
                if msg.program_id in session.refused_programs:
                    raise session.refused_programs[msg.program_id]
                raise NotFound(f"program {msg.program_id[:16]!r} was never registered in this session"
                               if msg.program_id else "RunProgram names no program")
            self._dispatching = True  # what it sends is program traffic (until ``handle`` returns)
            if self._dispatch(session, msg, program, now):
                self.programs += 1
        except PwmeshError as exc:
            if program is not None and session.refused_functions:  # a function refused: that is the cause
                exc = next((session.refused_functions[n.fn_id] for n in program.nodes
                            if n.fn_id in session.refused_functions), exc)
            for i, cid in enumerate(msg.outputs):
                v = program.outputs[i] if program is not None and i < len(program.outputs) else -1
                spec = program.values[v] if program is not None and 0 <= v < len(program.values) else UNKNOWN_VALUE
                session.fail_buffer(cid, spec, exc)
            raise exc  # noqa: B904 - the cause itself (a refused function's), not the lowering's symptom
        return None  # posted: the client learns of success from its buffers, of failure from an Error

    def _held_bytes(self, owner: str) -> int:
        """Bytes the buffers of ``owner``'s sessions hold (each logical buffer once)."""
        return sum(nbytes(buf.spec.shape, buf.spec.dtype)
                   for s in self.sessions.values() if s.owner == owner for buf in s.buffers.values())

    def _check_in_flight(self, owner: str, nbytes: int, what: str) -> None:
        """``ResourceExhausted`` if ``nbytes`` more in flight would put ``owner`` over its limit."""
        limit = self.policy.of(owner).max_bytes_in_flight
        if limit and self.in_flight[owner] + nbytes > limit:
            raise ResourceExhausted(
                f"{what} of {nbytes} bytes would put tenant {owner!r} over its limit of bytes in flight through the "
                f"proxy (max_bytes_in_flight {limit}; {self.in_flight[owner]} in flight now): wait for earlier "
                "puts and fetches to complete, or send less at once")

    def _check_bytes(self, owner: str, limits: TenantLimits, more: Callable[[], int]) -> None:
        """``ResourceExhausted`` if ``owner`` would hold more than its ``max_bytes`` with ``more()`` bytes more."""
        if not limits.max_bytes:
            return
        total = self._held_bytes(owner) + more()
        if total > limits.max_bytes:
            raise ResourceExhausted(f"tenant {owner!r} would hold {total} bytes, over its limit "
                                    f"(max_bytes {limits.max_bytes})")

    def _dispatch(self, session: Session, msg: RunProgram, program: ProgramSpec, now: float) -> bool:
        """Lower and send one run; False if it is to be lowered off the loop first (``LowerOffLoop``)."""
        limits = self.policy.of(session.owner)
        if limits.max_nodes and len(program.nodes) > limits.max_nodes:
            raise ResourceExhausted(f"the program has {len(program.nodes)} computations, over tenant "
                                    f"{session.owner!r}'s limit (max_nodes {limits.max_nodes})")
        self._check_bytes(session.owner, limits,
                          lambda: sum(nbytes(program.values[v].shape, program.values[v].dtype) for v in program.outputs))
        elastic.refuse(session, msg, program)
        binding = bind(session, msg, program)
        if self.lower_off_loop_nodes and len(program.nodes) >= self.lower_off_loop_nodes:
            job = session.lowerings.job(msg.program_id, program, owner=session.session_id, names=binding.names,
                                        host_inputs=set(binding.host_data), bound=binding.bound,
                                        slices=dict(session.slices), spmd=dict(session.functions), keep=binding.keep)
            if job is not None:
                self._out.append(LowerOffLoop(session.session_id, job))
                return False
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
        executors = lowered.executor_ids if lowered.executor_ids is not None else (
            set().union(*lowered.node_executors.values()) if lowered.node_executors else set())
        for executor_id in (executors & self.lost.keys() if self.lost else ()):
            raise DeviceLost(f"{self.lost[executor_id].message}; the program's slices still map there "
                             "(remapping onto surviving devices is not supported yet)")

        parts = None
        if not msg.sequential:  # sequential: each node goes once its predecessors are done (below)
            # A cached lowering's parts are packed once; this run's names go with them.
            parts = lowered.parts if lowered.parts is not None else {
                scheduler: run_parts(comps) for scheduler, comps in lowered.schedules.items()}
            if lowered.parts is None or lowered.template not in self.parts_sized:  # a cached one: once
                for mine in parts.values():
                    packed = sum(len(p.computations) for p in mine)
                    if packed > MAX_PART_BYTES:  # refused here, whole: a message over the limit is never sent
                        raise ResourceExhausted(
                            f"the program's computations for one island pack into {packed} bytes, over the "
                            f"{MAX_PART_BYTES} bytes one message may carry: split it into smaller programs")
                if lowered.parts is not None and lowered.template is not None:
                    self.parts_sized.add(lowered.template)

        # Nothing can fail past this point: send everything in order, then record the run (its
        # completions come in later events; recording a 128-node run costs ~1 ms the island
        # need not wait for).
        run_id = session.next_run_id()
        if lowered.template is None or lowered.template not in self.sites_registered:
            for fn_id, sites in lowered.function_sites.items():
                for control, devices in sites:
                    if (fn_id, control, devices) not in self.registered:
                        self.registered.add((fn_id, control, devices))
                        fn = self.exported[fn_id]
                        self._send(control, RegisterFunction(fn_id=fn_id, exported=fn.exported, spmd=fn.spmd,
                                                             devices=list(devices), mesh=fn.mesh, axes=fn.axes,
                                                             donate=fn.donate))
            for gang_id, gang in lowered.gangs.items():  # once per executor and slice version, not per run
                for control in gang.controls:
                    if (gang_id, control) not in self.gangs_sent:
                        self.gangs_sent.add((gang_id, control))
                        self._send(control, gang.message)
            if lowered.template is not None:
                self.sites_registered.add(lowered.template)
        for control, batch in host_puts(lowered, binding.host_data).items():
            self._send(control, batch)
        for control, sends in lowered.moves.items():  # one message a holder, its moves together
            self._send(control, SendMoves(moves=[Move(prefix=s.prefix, runs=s.runs, emits=s.emits) for s in sends],
                                          run_id=run_id, proxy=self.address))
        templated: dict[str, tuple[InstallTemplate, RunTemplate]] = {}
        if parts is not None and lowered.run_names is not None:  # an installed template: one message an island
            installed = self.templates_installed.setdefault(lowered.template, {})
            for scheduler, mine in parts.items():
                install = InstallTemplate(template_id=lowered.template_id, parts=mine)
                templated[scheduler] = sent = (install, RunTemplate(
                    template_id=lowered.template_id, run_id=run_id, proxy=self.address,
                    names=lowered.run_names[scheduler], session=session.session_id, weight=session.weight,
                    priority=session.priority))
                generation = self.scheduler_generation[scheduler]
                if installed.get(scheduler) != generation:
                    installed[scheduler] = generation
                    self._send(scheduler, install)
                self._send(scheduler, sent[1])
        elif parts is not None:
            for scheduler, mine in parts.items():
                self._schedule(session, run_id, scheduler, mine)
        run = record_run(session, run_id, program, lowered, binding)
        run.templated, run.template = templated, lowered.template
        if limits.max_run_seconds:
            run.deadline = now + limits.max_run_seconds
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
        return True

    def _schedule(self, session: Session, run_id: str, scheduler: str, parts: list[RunPart]) -> None:
        self._send(scheduler, ScheduleRun(run_id=run_id, proxy=self.address, parts=parts,
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

    def _reported_run(self, peer: bytes, run_id: str, executor_id: str, what: str) -> tuple[Session, Run] | None:
        """The run an executor's report (``what``: "completions", "losses") is about, None if it ended;
        refused from a client session, or from a daemon host's key about another host's parts."""
        if peer in self.sessions:
            raise ProtocolError(f"{what} come from executors, not from client sessions")
        if not speaks_for(self._user, executor_id):  # a daemon host's key reports its own parts only
            raise PermissionDenied(f"the daemon key {self._user!r} cannot report {executor_id}'s {what}")
        return self.runs.get(run_id.split("#", 1)[0])

    def _node_done(self, peer: bytes, msg: NodeDone, now: float) -> None:
        found = self._reported_run(peer, msg.run_id, msg.executor_id, "completions")
        if found is None:
            if self._by_id(msg.run_id.partition(":")[0]) is None:
                # Its session closed: a report still on its way as its client, which had the values it
                # fetched (an early fetch's reply leaves the executor first), went. Nothing waits for it.
                return None
            self._peer_log.warning(("unknown run", msg.executor_id), "completion for unknown run %s from %s", msg.run_id, msg.executor_id)
            return None
        session, run = found
        self._dispatching = True  # (a context manager here cost ~2 us a completion)
        self._node_finished(session, run, msg)
        return None

    def _island_done(self, peer: bytes, msg: IslandDone, now: float) -> None:
        """An island's scheduler reports a run's computations there: the nodes listed completed on every
        executor of the island (each reported once: ``scheduler/completions.py``); with ``error``, they failed
        on ``executor_id`` (the island's message that ends them follows); ``lost``: the run cannot finish."""
        if peer in self.sessions:
            raise ProtocolError("an island's completions come from its scheduler, not from client sessions")
        self._check_scheduler_key(msg)
        self.frees.heard(msg.scheduler, msg.run_id)
        found = self.runs.get(msg.run_id.split("#", 1)[0])
        if found is None:
            return None  # ended already (aborted, say): nothing waits for it
        session, run = found
        if msg.scheduler not in run.schedulers:
            self._peer_log.warning(("unexpected", msg.scheduler), "completions of run %s from %s, which it did not "
                                   "go through", msg.run_id, msg.scheduler)
            return None
        self._dispatching = True
        if msg.error is not None or msg.lost:
            err = msg.error.exception() if msg.error is not None else DeviceLost(
                f"executor {msg.executor_id} left before it ended its part of the run")
            if msg.lost or run.gangs:
                # A run with a gang: aborted at once, its outputs failing with this cause and its pins let go.
                # The member that failed runs its collectives on zeros for its peers (``Runner._join_collectives``);
                # where it could not, a peer still in one is restarted to take its devices back when told to
                # cancel (``Executor._reclaim``) rather than wait there for good.
                self._abort_run(session, run, err)
                return None
            run.failed.update(msg.nodes)
            for node in msg.nodes:  # (the first outcome of a buffer stays: the island's end resolves no more)
                if node in run.pending:
                    for buf in run.outputs_of.get(node, []):
                        self._resolve(buf, err)
            return None
        finished = False
        for node in msg.nodes:
            if run.pending.pop(node, None) is None:
                continue  # told before (each node once: a report sent twice changes nothing)
            self._node_ended(run, node)
            finished = True
        if finished:
            self._nodes_ended(session, run)
        return None

    def _node_ended(self, run: Run, node: int) -> None:
        """``node`` of ``run`` is done everywhere (no longer pending): its outputs resolve, what waits for it
        is told."""
        for buf in run.outputs_of.get(node, []):
            self._resolve(buf, None)
        if run.held:
            for waits in run.waits_for.values():
                waits.discard(node)

    def _nodes_ended(self, session: Session, run: Run) -> None:
        """After ``_node_ended`` of some of ``run``'s nodes: release the held ones now free; the run may be over."""
        if run.held:
            self._release_nodes(session, run)
        if not run.pending:
            self._finish_run(session, run)

    def _check_scheduler_key(self, msg: IslandDone) -> None:
        """Refuse (and log, rate-limited) an island's report from any key but the one its scheduler's address
        advertises (``keys.keyed``; an address with none, or the cluster's, is the cluster's own daemons'):
        a daemon host's key must not finish, fail or abort another island's runs."""
        try:
            _, public = unkeyed(msg.scheduler)
        except InvalidArgument:
            public = None
        holder = (self.key_holder(public) or "?") if public is not None else ""
        if speaks_for(self._user, holder):
            return
        self._peer_log.warning(("forged", self._user), "refused completions of run %s as the scheduler at %s from "
                               "the daemon key %r (that scheduler's key is %r's)", msg.run_id, msg.scheduler,
                               self._user, holder or "the cluster")
        raise PermissionDenied(f"the daemon key {self._user!r} cannot report for the scheduler at {msg.scheduler}")

    def _template_missing(self, peer: bytes, msg: TemplateMissing, now: float) -> None:
        """A scheduler did not hold a run's template (it restarted, or dropped it) and ordered nothing of the
        run: install it there again and send the run again; after ``MAX_TEMPLATE_RETRIES``, fail the run."""
        if peer in self.sessions:
            raise ProtocolError("a scheduler says which templates it lacks, not a client session")
        found = self.runs.get(msg.run_id)
        sent = found[1].templated.get(msg.scheduler) if found is not None else None
        if found is None or sent is None or sent[1].template_id != msg.template_id:
            return  # ended already (aborted, say), or not a run of ours there
        session, run = found
        run.template_retries += 1
        if run.template_retries > MAX_TEMPLATE_RETRIES:
            self._abort_run(session, run, Unavailable(
                f"the scheduler at {msg.scheduler} lost the run's template {msg.template_id} "
                f"{run.template_retries} times in a row (it keeps restarting, or holds too few templates)"))
            return
        self.templates_reinstalled += 1
        log.info("scheduler %s lacks template %s of run %s: installing it again", msg.scheduler, msg.template_id,
                 msg.run_id)
        if run.template is not None:
            self.templates_installed.setdefault(run.template, {})[msg.scheduler] = \
                self.scheduler_generation[msg.scheduler]
        self._dispatching = True
        self._send(msg.scheduler, sent[0])
        self._send(msg.scheduler, sent[1])

    def _data_lost(self, peer: bytes, msg: DataLost, now: float) -> None:
        found = self._reported_run(peer, msg.run_id, msg.executor_id, "losses")
        if found is not None:  # else it ended already
            self._abort_run(*found, msg.error.exception())

    def _node_finished(self, session: Session, run: Run, msg: NodeDone) -> None:
        node_error = msg.error.exception() if msg.error is not None else None
        finished = False
        for node in msg.nodes:
            waiting = run.pending.get(node)
            if waiting is None or msg.executor_id not in waiting:
                self._peer_log.warning(("unexpected", msg.executor_id), "unexpected completion of node %s of %s from %s", node,
                                       msg.run_id, msg.executor_id)
                continue
            if isinstance(waiting, frozenset):  # a cached lowering's, shared by its runs: this run's own copy
                waiting = run.pending[node] = set(waiting)
            waiting.discard(msg.executor_id)
            if node_error is not None:
                run.failed.add(node)
                for buf in run.outputs_of.get(node, []):
                    self._resolve(buf, node_error)
            if not waiting:
                del run.pending[node]
                self._node_ended(run, node)
                finished = True
        if finished:
            self._nodes_ended(session, run)

    # ------------------------------------------------------- the RM's notices

    def _notified(self, msg: Message) -> None:
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
            # Frees it may not have fanned out (in flight when it died): to each executor now (deletes are
            # idempotent; its executors still hold those buffers otherwise, until their session ends).
            for control, buffers in self.frees.lost(msg.address).items():
                self._send(control, DeleteShards(buffers=buffers))
        elif isinstance(msg, SchedulerJoined):
            self.lost_schedulers.pop(msg.address, None)
            self.scheduler_generation[msg.address] += 1  # a new process: it holds no template
        elif isinstance(msg, ExecutorJoined):
            was_lost = self.lost.pop(msg.executor_id, None) is not None
            self.lost_controls.discard(msg.control)
            if was_lost:  # back (from a stall, say): what it still holds may make lost buffers whole again
                self._out.append(Inventory(msg.control, msg.executor_id))
            if msg.fresh:  # a new process: it has none of the functions and gangs sent to the old one
                self.registered = {r for r in self.registered if r[1] != msg.control}
                self.gangs_sent = {g for g in self.gangs_sent if g[1] != msg.control}
                self.sites_registered = weakref.WeakSet()
            self._out.append(PeerBack(msg.control))  # and sends what waited for it to restart
        elif isinstance(msg, ExecutorRestarting):
            self._out.append(FencePeer(msg.control, Fence(epoch=msg.epoch)))
        elif isinstance(msg, Error):
            log.warning("a daemon refused a message we sent without waiting: %s: %s", msg.code, msg.message)
        elif isinstance(msg, PleaseRegister):  # the resource manager restarted
            log.warning("the resource manager asked us to register again; handing it our slices")
            self._send(self.rm, self.watch())

    def _slice_remapped(self, note: SliceRemapped) -> None:
        """Adopt a slice's new devices, and move its live buffers off hosts still up (draining)."""
        session = self._by_id(note.slice.owner)
        if session is None or note.slice.slice_id not in session.slices:
            return
        session.slices[note.slice.slice_id] = note.slice
        for buf in session.buffers.values():
            if buf.slice_id != note.slice.slice_id or buf.lost is not None:
                continue
            prefix = f"{session.session_id}/{buf.name}"
            moved: set[str] = set()
            # Rewritten below as this buffer's own copies: its may be shared (a cached lowering's runs share
            # their outputs' locations and holders).
            holders: set[str] | None = None
            for move in note.moves:
                here = buf.locations[move.index]
                if here.executor_id != move.old.executor_id or move.old.executor_id in self.lost:
                    continue  # already elsewhere, or the data died with its host
                new = move.new
                self._send(here.control, SendShards(
                    prefix=prefix, runs=[ShardRun(device=here.device, shard=move.index)],
                    emits=[move_shard(buf.spec, prefix, move.index, new)]))
                if holders is None:
                    buf.locations, buf.holders = list(buf.locations), (holders := set(buf.holders))
                buf.locations[move.index] = location(new)
                holders.add(new.control)
                moved.add(here.control)
            if moved:
                self.moved_buffers += 1
            if moved and holders is not None and buf.done and buf.error is None and buf.pins == 0:
                # The copies on the draining host go now (every shard it held of this buffer moved).
                still = {loc.control for loc in buf.locations}
                for control in moved - still:
                    self._send(control, DeleteShards(buffers=[prefix]))
                    holders.discard(control)

    def _executor_lost(self, lost: ExecutorLost) -> None:
        err = DeviceLost(f"executor {lost.executor_id} on host {lost.host} is gone ({lost.reason})")
        self.lost[lost.executor_id] = err
        self.lost_controls.add(lost.control)
        self._out.append(PeerLost(lost.control, err))  # fails the fetches that were waiting on it
        failed = 0
        for session in list(self.sessions.values()):
            for buf in session.buffers.values():
                if any(loc.executor_id == lost.executor_id for loc in buf.locations):
                    buf.lost = err
                    self._resolve(buf, err)
                    failed += 1
        for session, run in list(self.runs.values()):  # ended sessions' runs too
            if self._needs(run, lost) or any(b.lost is not None for b in run.pinned):
                self._abort_run(session, run, err)
                failed += 1
        if lost.graceful and not failed:  # drained and left (a clean stop, a scale-down): nothing was lost
            log.info("%s", err.message)
        else:
            self._peer_log.warning(("lost", lost.executor_id), "%s%s", err.message,
                                   f": {failed} buffer(s) and run(s) lost with it" if failed else "")
        # In the same event as the failures above: a client that retries on hearing
        # of them finds its slices already on live hosts.
        for remap in lost.remapped:
            self._slice_remapped(remap)

    def _reconcile(self, got: Inventoried) -> None:
        """An executor back from a stall holds ``got.keys``: buffers taken for lost with it whose shards it
        still holds (every other host of theirs up) are whole again; whatever it holds that no session's
        buffer or run names any more (released, or made by runs aborted meanwhile) is deleted."""
        held = set(got.keys)
        live: dict[str, set[str]] = {}
        for session in self.sessions.values():
            live.setdefault(session.session_id, set()).update(
                b.name for b in [*session.buffers.values(), *session.returnable.values()])
        for session, run in self.runs.values():
            live.setdefault(session.session_id, set()).update(
                b.name for b in [*run.temporaries, *run.outputs, *run.pinned])
            for _, _, names in run.named_temps:
                live[session.session_id].update(names)
        whole = 0
        for session in self.sessions.values():
            for buf in session.buffers.values():
                # Failed by this loss alone (its run was under way, or its completion still on the way, when
                # the executor was taken for lost), and made only here: whole again if every shard is here.
                failed_by_loss = buf.error is not None and buf.error is buf.lost
                if buf.lost is None or (buf.error is not None and not failed_by_loss):
                    continue
                here = [i for i, loc in enumerate(buf.locations) if loc.executor_id == got.executor_id]
                if failed_by_loss and len(here) != len(buf.locations):
                    continue  # its other executors may never have made their shards (the run was aborted)
                if (here and all(loc.executor_id not in self.lost for loc in buf.locations)
                        and all(shard_key(session.session_id, buf.name, i) in held for i in here)):
                    buf.lost = None
                    buf.error = None
                    whole += 1
        doomed = set()
        for key in held:
            parts = split_key(key)
            if parts is not None and parts[1] not in live.get(parts[0], ()):
                doomed.add(f"{parts[0]}/{parts[1]}")
        if doomed:
            self._send(got.control, DeleteShards(buffers=sorted(doomed)))
        log.info("executor %s is back holding %d objects: %d buffers taken for lost are whole again, %d buffers "
                 "nobody holds any more deleted", got.executor_id, len(held), whole, len(doomed))

    def _needs(self, run: Run, lost: ExecutorLost) -> bool:
        """Whether ``run`` can no longer finish without ``lost``. A drained executor flushed
        everything it sent, so only its unfinished work matters; after a crash, data it
        sent may never have arrived, so any run it took part in is failed."""
        if not lost.graceful:
            return lost.control in run.executors
        if run.schedulers and not any(s in self.lost_schedulers for s in run.schedulers):
            # Its islands' schedulers tell (``IslandDone(lost=True)``): they heard its reports before it left,
            # and ``pending`` here is per island, not per executor.
            return False
        return any(lost.executor_id in waiting for waiting in run.pending.values())

    def _abort_run(self, session: Session, run: Run, err: PwmeshError) -> None:
        """Fail everything ``run`` has not produced, and free the survivors' queues of it.

        What was donated to it and may not have been consumed yet (complete, on live executors) is kept
        until its executors say whether they hold it intact (``CheckKept``; they were told to cancel the run
        first): those buffers are the client's again (``TakeBack``), as they would be had the call never
        been made; only then do its outputs fail, saying so."""
        info = ErrorInfo.of(err)
        for control in run.executors:
            self._send(control, CancelRun(run_id=run.run_id, error=info))
        run.pending.clear()
        run.frees = {}  # which of its nodes ran is not known here: every buffer it read is deleted
        keep = [] if session.ended else [(cid, buf) for cid, buf in run.donated if buf.done and buf.error is None
                                         and buf.lost is None and buf.locations
                                         and all(loc.executor_id not in self.lost for loc in buf.locations)]
        if keep:
            asks: dict[str, list[str]] = {}
            for _, buf in keep:
                buf.pins += 1  # not freed with the run
                for i, loc in enumerate(buf.locations):
                    asks.setdefault(loc.control, []).append(shard_key(session.session_id, buf.name, i))
            self._keeping[run.run_id] = (session, run, err, keep)
            self._out.append(CheckKept(run.run_id, asks))
        else:
            self._fail_outputs(run, err)
        self._finish_run(session, run)

    def _fail_outputs(self, run: Run, err: PwmeshError) -> None:
        for bufs in run.outputs_of.values():
            for buf in bufs:
                self._resolve(buf, err)

    def _kept_checked(self, event: KeptChecked) -> None:
        """The executors said which shards donated to an aborted run they hold intact: buffers whole there are
        the client's to take back; the rest are freed. Then the run's outputs fail."""
        keeping = self._keeping.pop(event.run_id, None)
        if keeping is None:
            return
        session, run, err, keep = keeping
        intact = set(event.intact)
        back = []
        for cid, buf in keep:
            buf.pins -= 1
            if (not session.ended and buf.lost is None
                    and all(shard_key(session.session_id, buf.name, i) in intact for i in range(len(buf.locations)))):
                session.returnable[cid] = buf
                back.append(cid)
            else:
                self._maybe_free(session.session_id, buf)
        if back:
            log.info("run %s was aborted before it consumed buffers %s donated to it: they are its client's again",
                     run.run_id, back)
            err = type(err)(f"{err.message} (it had not consumed what was donated to it: pw.Array "
                            f"{', '.join(map(str, back))} can be used again)", remote_traceback=err.remote_traceback)
        self._fail_outputs(run, err)

    def _finish_run(self, session: Session, run: Run) -> None:
        self.runs.pop(run.run_id, None)
        session.runs.pop(run.run_id, None)
        executors = run.executors
        if isinstance(executors, frozenset):  # a cached lowering's, shared by its runs: merged once, then one lookup
            if executors not in session.merged:
                session.hosts |= executors
                if len(session.merged) >= MAX_MERGED:
                    session.merged.clear()
                session.merged.add(executors)
        elif not executors <= session.hosts:
            session.hosts |= executors
        for buf in (*run.pinned, *run.outputs):
            buf.pins -= 1
        for buf in run.pinned:
            buf.readers -= 1
        for buf in run.read_inside:
            buf.read_by_its_run = False
        if run.frees:
            self._freed_by_executors(run)
        self._maybe_free(session.session_id, *run.pinned, *run.outputs, *run.temporaries, session=session,
                         named=run.named_temps)
        self._forget_if_done(session)

    @staticmethod
    def _freed_by_executors(run: Run) -> None:
        """What ``run``'s executors deleted themselves (``Computation.frees``: the node reading it last ran
        without error, on every executor holding it) is held nowhere now: no delete goes for it."""
        frees, failed = run.frees, run.failed
        for buf in (*run.pinned, *run.temporaries):
            found = frees.get(buf.name)
            if found is not None and found[0] not in failed and buf.freeable and buf.holders <= found[1]:
                buf.holders = set()

    # ------------------------------------------------------------------ buffers

    def _maybe_free(self, session_id: str, *bufs: Buffer, session: Session | None = None,
                    named: Sequence[tuple[int, frozenset[str], list[str]]] = (), direct: bool = False) -> None:
        """Delete the freeable ``bufs`` wherever they are held: one message per island (``FreeShards`` to the
        scheduler of the buffer's slice, which sends each executor its ``DeleteShards``), or per executor
        where no live scheduler is known (an ended session's buffers, a lost island). ``named``: a finished
        run's temporaries by name (``Run.named_temps``), freed with them. ``direct``: one ``DeleteShards`` per
        holder, never through a scheduler (what the proxy just sent those holders must be handled first)."""
        # scheduler ("": none) -> [(executors holding alike buffers, those buffers)]. A run's buffers are mostly
        # held by the same executors: one group, each name and control once (not a name per holder). Found
        # by comparing sets (a few groups at most), not hashing each buffer's 1,000 holders.
        by_island: dict[str, list[tuple[set[str] | frozenset[str], list[str]]]] = {}
        owner = session

        def place(slice_id: int | None, held: set[str] | frozenset[str], prefixes: list[str]) -> None:
            """Add ``prefixes``, held by ``held``, to their island's group of alike holders."""
            nonlocal owner
            if owner is None:
                owner = self._by_id(session_id) or Session(session_id, "", b"")
            sl = owner.slices.get(slice_id) if slice_id is not None else None
            island = sl.scheduler if sl is not None and sl.scheduler not in self.lost_schedulers else ""
            holders = held - self.lost_controls if self.lost_controls else held
            groups = by_island.setdefault(island, [])
            for held_by, listed in groups:
                if held_by is holders or held_by == holders:  # (a cached lowering's runs share theirs)
                    listed.extend(prefixes)
                    return
            groups.append((holders, prefixes))

        for buf in bufs:
            if not buf.freeable:
                continue
            if buf.holders:
                place(buf.slice_id, buf.holders, [f"{session_id}/{buf.name}"])
            buf.holders = set()
        for slice_id, held, names in named:
            if not self.lost_controls or held - self.lost_controls:  # held by none still up: nothing to free
                place(slice_id, held, [f"{session_id}/{name}" for name in names])
        for island, groups in by_island.items():
            if direct or not island or (len(groups) == 1 and len(groups[0][0]) == 1):
                by_holder: dict[str, list[str]] = {}
                for holders, prefixes in groups:
                    for control in holders:
                        by_holder.setdefault(control, []).extend(prefixes)
                for control, prefixes in by_holder.items():
                    self._send(control, DeleteShards(buffers=prefixes))
                continue
            free = FreeShards(groups=[FreeGroup(buffers=prefixes, controls=self._listed(holders))
                                      for holders, prefixes in groups if holders])
            self._send(island, free)
            self.frees.sent(island, free)  # until the scheduler is known to have read it

    def _listed(self, holders: set[str] | frozenset[str]) -> list[str]:
        """``holders`` as a free's list of controls. A cached lowering's buffers share one frozen set per holder
        set: its list is made once and shared by every free of them (nothing reads it but to send it, and no one
        changes it), so a warm run's frees copy and touch none of its up to 1,024 executors."""
        if not isinstance(holders, frozenset):
            return list(holders)
        listed = self._holder_lists.get(holders)
        if listed is None:
            if len(self._holder_lists) >= MAX_HOLDER_LISTS:
                self._holder_lists.clear()
            listed = self._holder_lists[holders] = list(holders)
        return listed

    def _put_buffer(self, peer: bytes, msg: PutBuffer, now: float) -> Reply:
        session = self.session(peer)
        try:
            return self._put(session, msg)
        except PwmeshError as exc:
            session.fail_buffer(msg.buffer, ValueSpec(shape=list(msg.array.shape), dtype=msg.array.dtype.name,
                                                      shards=1), exc)
            raise

    def _new_put(self, session: Session, buffer_id: int, slice_id: int, shape: list[int], dtype: str,
                 sharding: Sharding | None) -> tuple[Buffer, Layout]:
        """A put's buffer, checked (the tenant's limits, the slice, the layout), not registered yet."""
        sl = session.slices.get(slice_id)
        if sl is None:
            raise NotFound(f"slice {slice_id} is not one of this session's slices")
        if sl.suspended:
            raise elastic.suspended_error(sl, "the put was not made")
        if buffer_id in session.buffers:
            raise InvalidArgument(f"buffer {buffer_id} already exists")
        n = len(sl.devices)
        spec = ValueSpec(shape=shape, dtype=dtype, shards=n, sharding=sharding)
        layout = value_layout(spec)
        if sharding is None and n > 1 and (not shape or shape[0] % n):
            raise InvalidArgument(f"an array of shape {tuple(shape)} cannot be split evenly over {n} devices")
        layout.check(f"putting an array of shape {tuple(shape)} on slice {slice_id}")
        if layout.devices != n:
            raise InvalidArgument(f"a layout over {layout.devices} devices for slice {slice_id} of {n}")
        buf = Buffer.new(session.buffer_name(buffer_id), spec, client_ref=True)
        buf.locations = slice_locations(sl)
        buf.slice_id = sl.slice_id
        return buf, layout

    def _put(self, session: Session, msg: PutBuffer) -> Reply:
        self._check_bytes(session.owner, self.policy.of(session.owner), lambda: int(msg.array.nbytes))
        self._check_in_flight(session.owner, int(msg.array.nbytes), "a put")  # counted per executor below
        buf, layout = self._new_put(session, msg.buffer, msg.slice_id, list(msg.array.shape), msg.array.dtype.name,
                                    msg.sharding)
        puts: dict[str, PutShards] = {}
        keys = buf.keys(session.session_id)  # once: per shard it made a put of n shards cost n^2
        buf.holders = holders = set()
        for key, loc, part in zip(keys, buf.locations, layout.split(msg.array), strict=True):
            batch = puts.setdefault(loc.control, PutShards(keys=[], devices=[], arrays=[]))
            batch.keys.append(key)
            batch.devices.append(loc.device)
            batch.arrays.append(part)
            holders.add(loc.control)
        for control, batch in puts.items():
            size = sum(int(a.nbytes) for a in batch.arrays)
            self.in_flight[session.owner] += size
            self._out.append(Deliver(control, batch, session.owner, size))
        buf.resolve(None)  # new: nobody waits on it yet
        session.buffers[msg.buffer] = buf
        return Reply(Ok())

    def _put_direct(self, peer: bytes, msg: PutDirect, now: float) -> Expecting:
        """A put whose bytes go from the client to the executors (``executor/direct.py``): checked and
        named here, announced to each executor; the answer says where each shard goes."""
        session = self.session(peer)
        try:
            dtype = dtype_from_name(msg.dtype)
            self._check_bytes(session.owner, self.policy.of(session.owner), lambda: nbytes(msg.shape, msg.dtype))
            buf, layout = self._new_put(session, msg.buffer, msg.slice_id, list(msg.shape), dtype.name, msg.sharding)
        except PwmeshError as exc:
            session.fail_buffer(msg.buffer, ValueSpec(shape=list(msg.shape), dtype=str(msg.dtype), shards=1), exc)
            raise
        sid = session.session_id
        key_of_session = data_key(self.data_secret, sid)
        asks: dict[str, ExpectShards] = {}
        places = ShardPlaces(addresses=[], keys=[], devices=[])
        shape = list(layout.shard_shape)
        buf.holders = holders = set()
        for key, loc in zip(buf.keys(sid), buf.locations, strict=True):
            ask = asks.get(loc.control)
            if ask is None:
                ask = asks[loc.control] = ExpectShards(session=sid, data_key=key_of_session, keys=[], devices=[],
                                                       shapes=[], dtype=dtype.name)
            ask.keys.append(key)
            ask.devices.append(loc.device)
            ask.shapes.append(shape)
            places.addresses.append(loc.data)
            places.keys.append(key)
            places.devices.append(loc.device)
            holders.add(loc.control)
        buf.resolve(None)  # its shards are waited for where they go, as a put's through the proxy are
        session.buffers[msg.buffer] = buf
        return Expecting(dict(asks), places)

    def _release_buffers(self, peer: bytes, msg: ReleaseBuffers, now: float) -> None:
        session = self._own(peer)
        if session is None:
            return None
        released = []
        for cid in msg.buffers:
            buf = session.buffers.pop(cid, None) or session.returnable.pop(cid, None)
            if buf is not None:
                buf.client_ref = False
                released.append(buf)
        self._maybe_free(session.session_id, *released)  # one message an executor (or island), not one a buffer
        return None

    def _take_back(self, peer: bytes, msg: TakeBack, now: float) -> Reply:
        session = self.session(peer)
        buf = session.returnable.pop(msg.buffer, None)
        if buf is None:
            if msg.buffer in session.buffers:  # taken back already
                return Reply(Ok())
            what = session.donated.get(msg.buffer)
            if what is None:
                raise NotFound(f"buffer {msg.buffer} does not exist (deleted, or never made)")
            raise InvalidArgument(f"buffer {msg.buffer} was donated to {what} and can no longer be used (that run "
                                  "consumed it, or has not failed)")
        buf.client_ref = True
        session.buffers[msg.buffer] = buf
        session.donated.pop(msg.buffer, None)
        return Reply(Ok())

    def buffer(self, session: Session, cid: int) -> Buffer:
        buf = session.buffers.get(cid)
        if buf is None:
            if cid in session.donated:
                raise InvalidArgument(f"buffer {cid} was donated to {session.donated[cid]} and can no longer be used")
            raise NotFound(f"buffer {cid} does not exist (deleted, or never made)")
        return buf

    def _await_buffers(self, peer: bytes, msg: AwaitBuffers, now: float) -> Wait:
        session = self.session(peer)
        return Wait([self.buffer(session, cid) for cid in msg.buffers])

    def _query_buffers(self, peer: bytes, msg: QueryBuffers, now: float) -> Reply:
        session = self.session(peer)
        return Reply(BuffersState(ready=[self.buffer(session, cid).done for cid in msg.buffers]))

    def _fetch(self, peer: bytes, msg: Fetch, now: float) -> Fetching:
        session = self.session(peer)
        buf = self.buffer(session, msg.buffer)
        size = 0 if msg.to else self._fetched_bytes(buf)  # direct: its bytes never pass through here
        self._check_in_flight(session.owner, size, "a fetch")
        sid = session.session_id
        return self._fetching(session, buf, size, msg.to, msg.tag, data_key(self.data_secret, sid) if msg.to else b"")

    @staticmethod
    def _fetched_bytes(buf: Buffer) -> int:
        """What a fetch of ``buf`` brings through the proxy (a failed one: its cause, not its bytes)."""
        return 0 if buf.error is not None else nbytes(buf.spec.shape, buf.spec.dtype)

    def _fetching(self, session: Session, buf: Buffer, size: int, to: str = "", tag: str = "",
                  key: bytes = b"") -> Fetching:
        """A fetch of ``buf`` begun (its ``size`` bytes counted in flight; ``to``, ``tag``, ``key``: a direct
        one's, as ``Fetching`` says): ``FetchEnded`` undoes this."""
        self.in_flight[session.owner] += size
        buf.pins += 1  # a release while we fetch must not delete the shards under us
        buf.readers += 1  # nor a run it is donated to consume them
        return Fetching(session.session_id, buf, session.owner, size, to=to, tag=tag, data_key=key)

    def _fetch_buffers(self, peer: bytes, msg: FetchBuffers, now: float) -> FetchingAll:
        """``Fetch`` of several buffers at once: every one looked up (and the bytes checked) before any is pinned."""
        session = self.session(peer)
        if not msg.buffers:
            raise InvalidArgument("FetchBuffers names no buffer")
        if len(msg.buffers) > MAX_FETCH_BUFFERS:
            raise InvalidArgument(f"FetchBuffers names {len(msg.buffers)} buffers, over {MAX_FETCH_BUFFERS}: "
                                  "send several")
        bufs = [self.buffer(session, cid) for cid in msg.buffers]
        sizes = [self._fetched_bytes(buf) for buf in bufs]
        self._check_in_flight(session.owner, sum(sizes), "a fetch")
        return FetchingAll([self._fetching(session, buf, size) for buf, size in zip(bufs, sizes, strict=True)])
