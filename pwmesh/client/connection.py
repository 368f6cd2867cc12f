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
waiting call with ``ConnectionFailed`` instead of hanging it, and so does one that answers
without the session (it restarted, or the session expired): nothing waited for would come.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import secrets
import select
import threading
import time
from typing import Any

import zmq

from pwmesh.errors import ConnectionFailed, NotFound, PwmeshError, PwTimeoutError
from pwmesh.service.keys import Keys, unkeyed
from pwmesh.service.rpc import next_id, raise_error
from pwmesh.service.transport import ZERO_COPY_THRESHOLD_BYTES
from pwmesh.wire import Message, decode, encode
from pwmesh.wire.codec import FrameError
from pwmesh.wire.messages import CloseSession, Error, Heartbeat, OpenSession, Ping, SessionOpened

log = logging.getLogger(__name__)

_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
# While messages wait in the backlog, the I/O thread retries at least this often.
BACKLOG_RETRY_SECONDS = 0.05


class ClientConnection:
    def __init__(self, address: str, *, name: str, weight: float = 1.0, priority: int = 0,
                 connect_timeout_seconds: float = 10.0, open_session: bool = True, probe: bool = False,
                 keys: str | None = None) -> None:
        """``open_session``: open a session (what a client is). Without one (tools, the CLI), ``probe``
        first proves something answers there with a ``Ping``; either way nothing answering within
        ``connect_timeout_seconds`` is ``ConnectionFailed``. ``keys``: the keys directory this client was
        given (else ``$PWMESH_KEYS``): the connection speaks CURVE (``pwmesh.service.keys``)."""
        curve = Keys.from_option(keys)
        self.address = address
        self.session_id = ""
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
            plain, server = unkeyed(address)  # a daemon's address may carry its own key (``keys.keyed``)
            if curve is not None:
                curve.connect(self._sock, server)
            self._sock.connect(plain)
        except BaseException:  # an address ZeroMQ refuses: nothing may outlive the refusal
            self._ctx.destroy(linger=0)
            raise
        self._fd = self._sock.getsockopt(zmq.FD)  # what the I/O thread waits on: the socket is the callers'
        # Messages not yet handed to the socket, in order: refused (high-water mark), or posted
        # from ``__del__`` while this thread was inside a socket call. Guarded by ``_lock``.
        self._backlog: collections.deque[list[Any]] = collections.deque()
        self._in_socket = False  # this lock holder is inside a (multipart) socket call
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._pending: dict[int, concurrent.futures.Future[Message]] = {}
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
        first: Message = OpenSession(name=name, weight=weight, priority=priority) if open_session else Ping()
        try:
            opened = self.request(first, timeout_seconds=connect_timeout_seconds)
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
            self.heartbeat_interval_seconds = opened.heartbeat_interval_seconds
            self.liveness_timeout_seconds = opened.session_timeout_seconds

    @property
    def closed(self) -> bool:
        return self._closing.is_set()

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
                self._pending[msg_id] = fut
            if self._in_socket or self._backlog:  # re-entered mid-call, or behind earlier messages
                self._backlog.append(frames)
                self._wake()
            elif not self._send_now(frames):  # refused: the I/O thread sends it when it can
                self._backlog.append(frames)
                self._wake()
            elif self._sock.getsockopt(zmq.EVENTS) & _POLLIN:
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
                    next_beat = now + self.heartbeat_interval_seconds
                    # A session beats (and stays alive); a sessionless connection (CLI) pings.
                    # Either way the reply proves the proxy still answers.
                    probe = Heartbeat(role="client", name=self.session_id) if self.session_id else Ping()
                    beat_id = next_id()
                    if len(self._beats) > 64:  # unanswered ones: the proxy is away (the timeout below says so)
                        self._beats.clear()
                    self._beats.add(beat_id)
                    with self._lock:  # ``_service`` sends it and then looks at the socket, as every send must
                        self._backlog.append([b"", *encode(probe, msg_id=beat_id, sender=self.session_id)])
                if self._service():
                    last_reply = time.monotonic()
                if beat:
                    with self._lock:
                        waiting = bool(self._pending)
                    now = time.monotonic()
                    if waiting and now - last_reply > self.liveness_timeout_seconds:
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
                events = self._sock.getsockopt(zmq.EVENTS)
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
        messages = []
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
                if not self._sock.getsockopt(zmq.EVENTS) & _POLLIN:
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
        if env.reply_to in self._beats:
            self._beats.discard(env.reply_to)
            if isinstance(env.message, Error) and env.message.code == NotFound.code and self.session_id:
                # The proxy answers but has no such session: it restarted (its state went with it), or
                # the session expired. Nothing this session waits for will ever come: say so now.
                lost = ConnectionFailed(
                    f"the proxy at {self.address} no longer has session {self.session_id} (it restarted, or the "
                    "session expired): its arrays, slices and programs are gone there; connect again")
                with self._lock:
                    self._lost = lost
                self._fail_all(lost)
            return
        with self._lock:
            fut = self._pending.pop(env.reply_to, None)
        if fut is not None and not fut.done():
            fut.set_result(env.message)

    def _fail_all(self, exc: PwmeshError) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
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
