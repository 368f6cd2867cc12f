"""The client's one connection to a proxy.

The public API is synchronous (it is called from scripts, notebooks that
already run an event loop, and ``__del__``), so the client keeps no event loop.
The calling thread sends its message itself, at once, under one lock that guards
every use of the DEALER socket; one I/O thread waits on the socket's file
descriptor (never on the socket, which the callers use meanwhile) together with
a wake-up pipe, receives replies and resolves the ``concurrent.futures.Future``
matched by message id. Only what cannot be sent at once (the socket at its
high-water mark, or a send re-entered from ``__del__`` in the middle of another
socket call) goes through a backlog that the I/O thread flushes in order.
Heartbeats keep the session alive; a proxy that stops answering fails every
waiting call with ``ConnectionFailed`` instead of hanging it.

A proxy that answers without the session restarted (or the session expired). The
connection then resumes the session (``ResumeSession``, ``pwmesh.proxy.resume``): it
declares what the layer above still holds (``declare``), and once the proxy has taken the
session back it sends again the requests the proxy before never answered that only read
(await, query, fetch, status), and fails the others with ``Unavailable`` naming the
restart: whether they took effect is unknown. A session the proxy cannot resume fails
every call with ``ConnectionFailed`` saying why.

Given several addresses (``"tcp://a:7000,tcp://b:7000"``: an active proxy and its standbys,
``pwmesh-proxy --standby``), the connection moves to the next one when the one it uses
stops answering or says it is a standby, and resumes its session wherever it finds the
active proxy.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import secrets
import select
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import zmq

from pwmesh.errors import STANDBY, ConnectionFailed, NoSession, PwmeshError, PwTimeoutError, Unavailable
from pwmesh.service.keys import Keys, unkeyed
from pwmesh.service.rpc import next_id, raise_error
from pwmesh.service.transport import ZERO_COPY_THRESHOLD_BYTES
from pwmesh.wire import Message, decode, encode
from pwmesh.wire.codec import FrameError
from pwmesh.wire.messages import (
    AwaitBuffers,
    CloseSession,
    Error,
    Fetch,
    FetchBuffers,
    GetStatus,
    Heartbeat,
    OpenSession,
    Ping,
    QueryBuffers,
    RegisterProgram,
    RegisterProgramFunction,
    ReleaseBuffers,
    ResumedBuffer,
    ResumeSession,
    SessionOpened,
    SessionResumed,
)

log = logging.getLogger(__name__)

RELEASE_BATCH = 64  # dropped buffers said together (``ClientConnection.release``)


@dataclasses.dataclass
class Declared:
    """What a session still holds, told to a restarted proxy to resume it (``ResumeSession``)."""

    buffers: list[ResumedBuffer]
    slices: list[int]
    released: list[ResumedBuffer]
    functions: list[RegisterProgramFunction]
    programs: list[RegisterProgram]

_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
# While messages wait in the backlog, the I/O thread retries at least this often.
BACKLOG_RETRY_SECONDS = 0.05
# Requests that only read: sent again to a proxy that restarted before answering them (the rest fail).
REPLAYABLE = (AwaitBuffers, QueryBuffers, Fetch, FetchBuffers, GetStatus, Ping)


class ClientConnection:
    def __init__(self, address: str, *, name: str, weight: float = 1.0, priority: int = 0,
                 connect_timeout_seconds: float = 10.0, open_session: bool = True, probe: bool = False,
                 keys: str | None = None) -> None:
        """``open_session``: open a session (what a client is). Without one (tools, the CLI), ``probe``
        first proves something answers there with a ``Ping``; either way nothing answering within
        ``connect_timeout_seconds`` is ``ConnectionFailed``. ``keys``: the keys directory this client was
        given (else ``$PWMESH_KEYS``): the connection speaks CURVE (``pwmesh.service.keys``)."""
        curve = Keys.from_option(keys)
        self.addresses = [a.strip() for a in address.split(",") if a.strip()] or [address]
        self.address = self.addresses[0]
        self._curve = curve
        self.session_id = ""
        self.resume_token = ""
        self.data_key = b""  # what this session's direct transfers are keyed with (``client/direct.py``)
        self._opening = OpenSession(name=name, weight=weight, priority=priority)
        # Set by the layer above: what it still holds (live arrays, slices), declared to a restarted proxy
        # to take the session back; and what to do once it has (register functions and programs again).
        self.declare: Callable[[], Declared] | None = None
        self.on_resumed: Callable[[SessionResumed], None] | None = None
        self.resumed = 0  # times the session was taken back from a restarted proxy
        self.heartbeat_interval_seconds = 1.0
        self.liveness_timeout_seconds = max(connect_timeout_seconds, 10.0)
        self._ctx = zmq.Context()
        try:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            # A fixed routing id: after a TCP blip ZeroMQ reconnects as the same peer,
            # so the proxy still knows which session this is.
            self._sock.setsockopt(zmq.ROUTING_ID, b"client-" + secrets.token_bytes(12))
            self._sock.copy_threshold = ZERO_COPY_THRESHOLD_BYTES  # copy=False sends copy small frames anyway
            self._connect(self.address)
        except BaseException:  # an address ZeroMQ refuses: nothing may outlive the refusal
            self._ctx.destroy(linger=0)
            raise
        self._fd = cast(int, self._sock.getsockopt(zmq.FD))  # what the I/O thread waits on: the socket is the callers'
        # Messages not yet handed to the socket, in order: refused (high-water mark), or posted
        # from ``__del__`` while this thread was inside a socket call. Guarded by ``_lock``.
        self._backlog: collections.deque[list[Any]] = collections.deque()
        # Buffers dropped (``release``) and not yet said so: they leave in one ``ReleaseBuffers`` ahead of the
        # next message, at the next heartbeat, or once ``RELEASE_BATCH`` wait. Guarded by ``_lock``.
        self._released: list[int] = []
        self._in_socket = False  # this lock holder is inside a (multipart) socket call
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._pending: dict[int, concurrent.futures.Future[Message]] = {}
        self._requests: dict[int, Message] = {}  # the pending requests themselves (sent again after a resume)
        self._resume_id: int | None = None  # the ResumeSession in flight
        self._resume_deadline = 0.0
        self._stale: set[int] = set()  # requests sent before it: the proxy before may never answer them
        self._waiting_since = 0.0  # when a request was sent with none pending (silence before it is no failure)
        self._moved = False  # moved to another address: the requests sent before wait for the session there
        # With several addresses: move on once a heartbeat went unanswered this long (at least two beats; a
        # standby takes over only once the resource manager declares the active proxy lost: moving back and
        # forth finds it then).
        self.failover_seconds = 4.0
        self._beat_sent = 0.0  # when the oldest heartbeat not answered yet went out (0: none)
        self._silent: set[str] = set()  # addresses that stopped answering (not gone back to from a standby)
        # Guards the socket, the backlog and the pending table. Re-entrant: ``post`` runs from
        # ``__del__``, which may fire inside ``submit`` or the I/O thread's socket calls.
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self._close_started = False
        self._lost: PwmeshError | None = None
        self._beats: set[int] = set()  # heartbeats sent and not answered (the I/O thread's own)
        self._thread = threading.Thread(target=self._io_loop, name="pwmesh-client-io", daemon=True)
        self._thread.start()
        # The first request proves something answers there: a session's opening, or a probe's ping.
        if not open_session and not probe:
            return
        first: Message = self._opening if open_session else Ping()
        try:
            opened = self._first(first, connect_timeout_seconds)
        except PwTimeoutError:
            self.close()
            why = ("is a pwmesh cluster running there, and do these keys belong to it?" if curve is not None else
                   "is a pwmesh cluster running there? One that requires keys answers only clients with keys")
            raise ConnectionFailed(f"nothing answered at {address} within {connect_timeout_seconds:g} seconds "
                                   f"({why})") from None
        except BaseException:
            self.close()
            raise
        if open_session:
            assert isinstance(opened, SessionOpened)
            self.session_id = opened.session_id
            self.resume_token = opened.resume_token
            self.data_key = opened.data_key
            self.heartbeat_interval_seconds = opened.heartbeat_interval_seconds
            self.liveness_timeout_seconds = opened.session_timeout_seconds

    @property
    def closed(self) -> bool:
        return self._closing.is_set()

    def _connect(self, address: str) -> None:
        plain, server = unkeyed(address)  # a daemon's address may carry its own key (``keys.keyed``)
        if self._curve is not None:
            self._curve.connect(self._sock, server)
        self._sock.connect(plain)

    def _first(self, first: Message, timeout_seconds: float) -> Message:
        """The first request, at each address in turn until one answers it (a standby refuses a session)."""
        for i in range(len(self.addresses)):
            last = i == len(self.addresses) - 1
            try:
                return self.request(first, timeout_seconds=timeout_seconds / len(self.addresses) if not last else
                                    timeout_seconds)
            except (PwTimeoutError, Unavailable) as exc:
                if last:
                    raise
                log.info("%s: %s; trying %s", self.address, exc.message, self.addresses[i + 1])
                self._switch()
        raise AssertionError("unreachable")

    def _switch(self, *, past_silent: bool = False) -> bool:
        """Move to the next address (``past_silent``: the next not found silent; none: stay); what waits for an
        answer from the one before waits for the session at the next (sent again or failed once it is known
        there: ``_fail_stale``). Whether it moved."""
        with self._lock:
            here = self.addresses.index(self.address)
            following = [self.addresses[(here + k) % len(self.addresses)] for k in range(1, len(self.addresses))]
            if past_silent:
                following = [a for a in following if a not in self._silent]
            if not following:
                return False
            plain, _ = unkeyed(self.address)
            try:
                self._sock.disconnect(plain)
            except zmq.ZMQError:
                pass
            self.address = following[0]
            self._connect(self.address)
            self._stale |= set(self._pending)
            self._moved = True
            self._beats.clear()
            self._beat_sent = 0.0
        return True

    def release(self, buffer_ids: list[int]) -> None:
        """Say that the client dropped these buffers, together with others: a message each (~40-80 us here,
        and as much in the proxy) was a training loop's largest client cost after the step itself. They go
        ahead of the next message sent (so it sees them freed), or at the next heartbeat, or once
        ``RELEASE_BATCH`` wait."""
        with self._lock:
            self._released.extend(buffer_ids)
            if len(self._released) < RELEASE_BATCH:
                return
            # To the I/O thread: this may run in ``__del__``, inside a socket call of this thread's.
            frames = self._take_released()
            if frames is not None and not self._closing.is_set() and self._lost is None:
                self._backlog.append(frames)
                self._wake()

    def _take_released(self) -> list[Any] | None:
        """The frames of a ``ReleaseBuffers`` of what waits, if anything does (lock held)."""
        if not self._released:
            return None
        released, self._released = self._released, []
        return [b"", *encode(ReleaseBuffers(buffers=released), msg_id=next_id(), sender=self.session_id)]

    def submit(self, message: Message, *, expect_reply: bool = True) -> concurrent.futures.Future[Message] | None:
        """Send ``message`` (from this thread, now); the reply's future if one is expected."""
        msg_id = next_id()
        frames = [b"", *encode(message, msg_id=msg_id, sender=self.session_id)]
        fut: concurrent.futures.Future[Message] | None = None
        # One lock over the closed check, the registration and the send: close() cannot
        # fail the waiters or close the socket in between.
        with self._lock:
            if self._lost is not None:
                raise self._lost
            if self._closing.is_set():
                raise ConnectionFailed(f"the connection to {self.address} is closed")
            if expect_reply:
                fut = concurrent.futures.Future()
                if not self._pending:
                    self._waiting_since = time.monotonic()
                self._pending[msg_id] = fut
                self._requests[msg_id] = message
            released = self._take_released()
            # Ahead of this message, in the same order; behind a fetch, which no release can change: the proxy
            # sends for the value first (a fetch right after a run then reaches the executor before the run
            # does more often, and the value leaves as the run ends), and frees after.
            later = released if released is not None and isinstance(message, (Fetch, FetchBuffers)) else None
            if released is not None and later is None:
                if self._in_socket or self._backlog or not self._send_now(released):
                    self._backlog.append(released)
            for each in (frames, later):
                if each is None:
                    continue
                if self._in_socket or self._backlog:  # re-entered mid-call, or behind earlier messages
                    self._backlog.append(each)
                    self._wake()
                elif not self._send_now(each):  # refused: the I/O thread sends it when it can
                    self._backlog.append(each)
                    self._wake()
                elif cast(int, self._sock.getsockopt(zmq.EVENTS)) & _POLLIN:
                    self._wake()  # our send consumed the signal of a reply: tell the I/O thread
        return fut

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full: the I/O thread is awake already
            pass

    def _send_now(self, frames: list[Any]) -> bool:
        """Hand ``frames`` to the socket (lock held); False if it refuses them (nothing was queued)."""
        send = self._sock.send
        last = len(frames) - 1
        self._in_socket = True
        try:
            # A refusal (the proxy is slow or gone) comes at the first frame, before anything is queued.
            for i, frame in enumerate(frames):
                send(frame, _MORE if i < last else _NOBLOCK, copy=False)
        except zmq.Again:
            return False
        finally:
            self._in_socket = False
        return True

    def post(self, message: Message) -> None:
        self.submit(message, expect_reply=False)

    def request(self, message: Message, *, timeout_seconds: float | None = None) -> Message:
        fut = self.submit(message)
        assert fut is not None
        return self.wait(fut, message.op, timeout_seconds)

    def wait(self, fut: concurrent.futures.Future[Message], op: str, timeout_seconds: float | None = None) -> Message:
        try:
            reply = fut.result(timeout=timeout_seconds)
        except concurrent.futures.TimeoutError:
            raise PwTimeoutError(f"{self.address} did not answer {op} within {timeout_seconds} seconds") from None
        if isinstance(reply, Error):
            raise_error(reply)
        return reply

    # -------------------------------------------------------------- I/O thread

    def _io_loop(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        last_reply = time.monotonic()
        next_beat = last_reply + self.heartbeat_interval_seconds
        try:
            while not self._closing.is_set():
                timeout_ms = max(0.0, next_beat - time.monotonic()) * 1000
                if self._backlog:  # no signal is promised when the socket can take more: look again soon
                    timeout_ms = min(timeout_ms, BACKLOG_RETRY_SECONDS * 1000)
                for fd, _ in poller.poll(timeout_ms):
                    if fd == self._wake_r:
                        self._drain_pipe()
                now = time.monotonic()
                beat = now >= next_beat
                if beat:
                    # Quickly while looking for the active proxy (a standby answers "standby" until it takes over).
                    next_beat = now + (min(0.5, self.heartbeat_interval_seconds) if self._moved else
                                       self.heartbeat_interval_seconds)
                    # A session beats (and stays alive); a sessionless connection (CLI) pings.
                    # Either way the reply proves the proxy still answers.
                    probe = Heartbeat(role="client", name=self.session_id) if self.session_id else Ping()
                    beat_id = next_id()
                    if len(self._beats) > 64:  # unanswered ones: the proxy is away (the timeout below says so)
                        self._beats.clear()
                    self._beats.add(beat_id)
                    self._beat_sent = self._beat_sent or now
                    with self._lock:  # ``_service`` sends it and then looks at the socket, as every send must
                        released = self._take_released()
                        if released is not None:
                            self._backlog.append(released)
                        self._backlog.append([b"", *encode(probe, msg_id=beat_id, sender=self.session_id)])
                if self._service():
                    last_reply = time.monotonic()
                elif (len(self.addresses) > 1 and self.session_id and self._lost is None and self._beat_sent
                      and time.monotonic() - self._beat_sent > max(self.failover_seconds,
                                                                    2 * self.heartbeat_interval_seconds)):
                    silent = self.address
                    self._silent.add(silent)
                    self._switch()
                    log.warning("the proxy at %s does not answer: trying %s", silent, self.address)
                    last_reply = time.monotonic()
                    next_beat = last_reply  # ask the next one at once
                if beat:
                    with self._lock:
                        waiting = bool(self._pending)
                    now = time.monotonic()
                    if self._resume_id is not None and now > self._resume_deadline:
                        self._resume_id = None  # a later "no session" tries again
                        self._fail_stale(ConnectionFailed(
                            f"the proxy at {self.address} restarted and did not answer the resume of session "
                            f"{self.session_id} within {self.liveness_timeout_seconds:g} seconds"))
                    # Silent for the timeout while a call waited: a proxy back from a long outage is not failed
                    # for the silence before the call (it answers the call's heartbeat, or resumes the session).
                    if waiting and now - max(last_reply, self._waiting_since) > self.liveness_timeout_seconds:
                        self._fail_all(ConnectionFailed(
                            f"the proxy at {self.address} stopped answering "
                            f"(nothing for {self.liveness_timeout_seconds} seconds)"))
                        last_reply = now
        except Exception as exc:  # never die silently: every waiter learns why
            log.exception("pwmesh client I/O thread failed")
            self._lost = ConnectionFailed(f"client I/O failed: {type(exc).__name__}: {exc}")
            self._fail_all(self._lost)
        finally:
            with self._lock:
                self._sock.close(linger=0)

    def _drain_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _service(self) -> bool:
        """Flush the backlog, then take every reply waiting; whether any came.

        The socket's FD only says that its state may have changed, and any call on it
        may consume that signal: so this looks at ``EVENTS`` after every send and
        receives until nothing is left."""
        got = False
        while True:
            with self._lock:
                if self._closing.is_set():
                    return got
                sent = 0
                while self._backlog and self._send_now(self._backlog[0]):
                    self._backlog.popleft()
                    sent += 1
                events = cast(int, self._sock.getsockopt(zmq.EVENTS))
                if not events & _POLLIN:
                    if sent and self._backlog and events & _POLLOUT:
                        continue
                    return got
                received = self._receive_all()
            got = got or bool(received)
            for frames in received:
                self._deliver(frames)

    def _receive_all(self) -> list[list[Any]]:
        """Every message waiting on the socket (lock held; ``EVENTS`` said one waits)."""
        recv = self._sock.recv
        messages: list[list[Any]] = []
        self._in_socket = True
        try:
            while True:
                try:
                    frame = recv(_NOBLOCK, copy=False)
                except zmq.Again:  # not expected after POLLIN, and harmless
                    return messages
                frames = [frame]
                while frame.more:  # the rest of a multipart message is already here
                    frame = recv(_NOBLOCK, copy=False)
                    frames.append(frame)
                messages.append(frames)
                # Asking is cheaper than a receive that fails.
                if not cast(int, self._sock.getsockopt(zmq.EVENTS)) & _POLLIN:
                    return messages
        finally:
            self._in_socket = False

    def _deliver(self, frames: list[Any]) -> None:
        if not frames or len(frames[0]) != 0:
            return
        try:
            env = decode(frames[1:])
        except FrameError as exc:
            log.warning("dropped a frame from the proxy: %s", exc.message)
            return
        if env.reply_to is None:
            return
        no_session = isinstance(env.message, Error) and env.message.code == NoSession.code and bool(self.session_id)
        standby = (isinstance(env.message, Error) and env.message.code == Unavailable.code
                   and env.message.message.startswith(STANDBY) and len(self.addresses) > 1)
        if not standby:
            self._silent.discard(self.address)
        if env.reply_to in self._beats:
            self._beats.discard(env.reply_to)
            self._beat_sent = 0.0
            if no_session:
                self._session_gone()
            elif standby:  # to another that may be active; not back to one that stopped answering
                self._switch(past_silent=True)
            elif self._moved and not isinstance(env.message, Error):  # back where the session is
                self._moved = False
                self._fail_stale(Unavailable, replay=True)
            return
        if env.reply_to == self._resume_id:
            if standby:  # not the active proxy (yet): try the next (or here again, soon)
                self._resume_id = None
                self._switch(past_silent=True)
                return
            self._resumed(env.message)
            return
        if standby and self.session_id:  # sent again once the session is found at another address
            with self._lock:
                self._stale.add(env.reply_to)
            return
        if no_session and self._lost is None:
            # To the proxy after a restart, before the session was resumed: it is sent again or failed then;
            # with no resume token, the session is gone, and this call fails with every other as
            # ``ConnectionFailed`` (a request that met the new proxy before a heartbeat did got the bare
            # ``NoSession`` once).
            self._session_gone()
            return
        with self._lock:
            fut = self._pending.pop(env.reply_to, None)
            self._requests.pop(env.reply_to, None)
        if fut is not None and not fut.done():
            fut.set_result(env.message)

    # ------------------------------------------------------------ resuming the session (I/O thread)

    def _session_gone(self) -> None:
        """The proxy answers but has no session for us: resume it, or (no token) fail everything now."""
        if self._resume_id is not None or self._lost is not None:
            return
        if not self.resume_token or self.declare is None:
            self._lose(ConnectionFailed(
                f"the proxy at {self.address} no longer has session {self.session_id} (it restarted, or the "
                "session expired): its arrays, slices and programs are gone there; connect again"))
            return
        declared = self.declare()
        opening = self._opening
        resume = ResumeSession(session_id=self.session_id, token=self.resume_token, name=opening.name,
                               weight=opening.weight, priority=opening.priority, buffers=declared.buffers,
                               slices=declared.slices, released=declared.released, functions=declared.functions,
                               programs=declared.programs)
        msg_id = next_id()
        try:
            frames = encode(resume, msg_id=msg_id, sender=self.session_id)
        except (FrameError, ValueError):  # the registrations make it too big: they go again with their next use
            frames = encode(dataclasses.replace(resume, functions=[], programs=[]), msg_id=msg_id,
                            sender=self.session_id)
        log.warning("the proxy at %s no longer has session %s (it restarted?): resuming it with %d arrays",
                    self.address, self.session_id, len(declared.buffers))
        with self._lock:
            self._stale = set(self._pending)
            self._resume_id = msg_id
            self._resume_deadline = time.monotonic() + self.liveness_timeout_seconds
            self._backlog.append([b"", *frames])

    def _resumed(self, reply: Message) -> None:
        self._resume_id = None
        if not isinstance(reply, SessionResumed):
            why = reply.message if isinstance(reply, Error) else f"it answered {reply.op}"
            self._lose(ConnectionFailed(f"the proxy at {self.address} restarted and could not resume session "
                                        f"{self.session_id}: {why}; connect again"))
            return
        self.resumed += 1
        self._moved = False
        self.heartbeat_interval_seconds = reply.heartbeat_interval_seconds
        self.liveness_timeout_seconds = reply.session_timeout_seconds
        log.warning("session %s resumed at %s: %d arrays failed (%s)", self.session_id, self.address,
                    len(reply.failed), reply.why if reply.failed else "none")
        if self.on_resumed is not None:
            self.on_resumed(reply)
        with self._lock:
            self._stale -= set(reply.held)  # the new proxy held them: it answers them itself
        self._fail_stale(Unavailable, replay=True)

    def _fail_stale(self, error: PwmeshError | type[Unavailable], *, replay: bool = False) -> None:
        """The requests the proxy before never answered: sent again if they only read (``replay``), else
        failed (with ``error``, or an ``Unavailable`` naming the request)."""
        with self._lock:
            stale, self._stale = self._stale, set()
            failed = []
            for msg_id in sorted(stale):
                fut, request = self._pending.get(msg_id), self._requests.get(msg_id)
                if fut is None or request is None:
                    continue
                if replay and isinstance(request, REPLAYABLE):
                    self._backlog.append([b"", *encode(request, msg_id=msg_id, sender=self.session_id)])
                    continue
                del self._pending[msg_id], self._requests[msg_id]
                failed.append((fut, error if isinstance(error, PwmeshError) else error(
                    f"the proxy at {self.address} restarted before it answered {request.op}: whether it took "
                    f"effect is unknown (session {self.session_id} was resumed; try again)")))
        for fut, exc in failed:
            if not fut.done():
                fut.set_exception(exc)

    def _lose(self, lost: ConnectionFailed) -> None:
        with self._lock:
            self._lost = lost
        self._fail_all(lost)

    def _fail_all(self, exc: PwmeshError) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            self._requests.clear()
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)

    def close(self, timeout_seconds: float = 2.0) -> None:
        with self._lock:
            if self._close_started:
                return
            self._close_started = True
        if self.session_id and self._lost is None:
            try:
                self.request(CloseSession(), timeout_seconds=timeout_seconds)
            except PwmeshError:
                pass
        with self._lock:
            self._closing.set()
            self._wake()
        self._thread.join(timeout=timeout_seconds)
        self._fail_all(ConnectionFailed(f"the connection to {self.address} was closed"))
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._ctx.term()
