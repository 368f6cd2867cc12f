"""The client's one connection to a proxy.

The public API is synchronous (it is called from scripts, notebooks that
already run an event loop, and ``__del__``), so the client keeps no event loop:
one I/O thread owns the DEALER socket and polls it together with a wake-up
pipe. Callers hand it encoded frames through a ``SimpleQueue`` (safe even from
``__del__``) and wait on a ``concurrent.futures.Future`` matched by message id.
Heartbeats keep the session alive; a proxy that stops answering fails every
waiting call with ``ConnectionFailed`` instead of hanging it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import queue
import secrets
import threading
import time
from typing import Any

import zmq

from pwmesh.errors import ConnectionFailed, PwmeshError, PwTimeoutError
from pwmesh.service.rpc import next_id, raise_error
from pwmesh.service.transport import ZERO_COPY_THRESHOLD_BYTES
from pwmesh.wire import Message, decode, encode
from pwmesh.wire.codec import FrameError
from pwmesh.wire.messages import CloseSession, Error, Heartbeat, OpenSession, Ping, SessionOpened

log = logging.getLogger(__name__)


class ClientConnection:
    def __init__(self, address: str, *, name: str, weight: float = 1.0, priority: int = 0,
                 connect_timeout_seconds: float = 10.0, open_session: bool = True) -> None:
        self.address = address
        self.session_id = ""
        self.heartbeat_interval_seconds = 1.0
        self.liveness_timeout_seconds = max(connect_timeout_seconds, 10.0)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A fixed routing id: after a TCP blip ZeroMQ reconnects as the same peer,
        # so the proxy still knows which session this is.
        self._sock.setsockopt(zmq.ROUTING_ID, b"client-" + secrets.token_bytes(12))
        self._sock.connect(address)
        self._backlog: collections.deque[list[Any]] = collections.deque()  # sends the socket refused
        self._outbox: queue.SimpleQueue[list[Any]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._pending: dict[int, concurrent.futures.Future[Message]] = {}
        # Re-entrant: ``post`` runs from ``__del__``, which may fire inside ``submit`` itself.
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self._close_started = False
        self._lost: PwmeshError | None = None
        self._thread = threading.Thread(target=self._io_loop, name="pwmesh-client-io", daemon=True)
        self._thread.start()
        if open_session:
            try:
                opened = self.request(OpenSession(name=name, weight=weight, priority=priority),
                                      timeout_seconds=connect_timeout_seconds)
            except PwTimeoutError:
                self.close()
                raise ConnectionFailed(
                    f"no pwmesh proxy answered at {address} within {connect_timeout_seconds} seconds"
                ) from None
            except BaseException:
                self.close()
                raise
            assert isinstance(opened, SessionOpened)
            self.session_id = opened.session_id
            self.heartbeat_interval_seconds = opened.heartbeat_interval_seconds
            self.liveness_timeout_seconds = opened.session_timeout_seconds

    @property
    def closed(self) -> bool:
        return self._closing.is_set()

    def submit(self, message: Message, *, expect_reply: bool = True) -> concurrent.futures.Future[Message] | None:
        """Queue ``message`` for the I/O thread; the reply's future if one is expected."""
        msg_id = next_id()
        frames = encode(message, msg_id=msg_id, sender=self.session_id)
        fut: concurrent.futures.Future[Message] | None = None
        # One lock over the closed check, the registration and the wake-up: close()
        # cannot fail the waiters or close the pipe in between.
        with self._lock:
            if self._lost is not None:
                raise self._lost
            if self._closing.is_set():
                raise ConnectionFailed(f"the connection to {self.address} is closed")
            if expect_reply:
                fut = concurrent.futures.Future()
                self._pending[msg_id] = fut
            self._outbox.put(frames)
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:  # the pipe is full: the I/O thread is awake already
                pass
        return fut

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
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        last_reply = time.monotonic()
        next_beat = last_reply + self.heartbeat_interval_seconds
        try:
            while not self._closing.is_set():
                timeout_ms = max(0.0, next_beat - time.monotonic()) * 1000
                poller.modify(self._sock, zmq.POLLIN | (zmq.POLLOUT if self._backlog else 0))
                events = dict(poller.poll(timeout_ms))
                if self._wake_r in events:
                    self._drain_pipe()
                self._flush_outbox()
                if self._sock in events and self._receive():
                    last_reply = time.monotonic()
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.heartbeat_interval_seconds
                    # A session beats (and stays alive); a sessionless connection (CLI) pings.
                    # Either way the reply proves the proxy still answers.
                    probe = Heartbeat(role="client", name=self.session_id) if self.session_id else Ping()
                    self._send(encode(probe, msg_id=next_id(), sender=self.session_id))
                    with self._lock:
                        waiting = bool(self._pending)
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
            self._sock.close(linger=0)

    def _drain_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _send(self, frames: list[Any]) -> None:
        """Send without ever blocking the I/O thread: what the socket refuses waits in the backlog."""
        self._backlog.append(frames)
        self._send_backlog()

    def _send_backlog(self) -> None:
        while self._backlog:
            frames = self._backlog[0]
            copy = all(memoryview(f).nbytes < ZERO_COPY_THRESHOLD_BYTES for f in frames)
            try:
                self._sock.send_multipart([b"", *frames], flags=zmq.NOBLOCK, copy=copy)
            except zmq.Again:  # the proxy is slow or gone: heartbeats and timeouts keep running
                return
            self._backlog.popleft()

    def _flush_outbox(self) -> None:
        self._send_backlog()
        while True:
            try:
                frames = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._send(frames)

    def _receive(self) -> bool:
        got = False
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return got
            got = True
            if not frames or frames[0].bytes != b"":
                continue
            try:
                env = decode(frames[1:])
            except FrameError as exc:
                log.warning("dropped a frame from the proxy: %s", exc.message)
                continue
            if env.reply_to is None:
                continue
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
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass
        self._thread.join(timeout=timeout_seconds)
        self._fail_all(ConnectionFailed(f"the connection to {self.address} was closed"))
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._ctx.term()
