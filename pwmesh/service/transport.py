"""The socket layer, behind one small interface.

Daemon logic sees ``RouterSocket`` (bound, many peers) and ``DealerSocket``
(connected to one peer) sending and receiving lists of frames.

Both are plain ``zmq.Socket``s driven by the event loop's reader callback on the
socket's ``FD``, not ``zmq.asyncio`` (whose futures cost ~10x the message
itself). Receiving: ``start_receiving(callback)`` hands every message to the
callback, in order, from the loop's reader callback (``recv()`` remains for
callers that want to await one message at a time). Sending never blocks and
never awaits: ``send_nowait`` hands the frames to ZeroMQ at once; what the
socket refuses (its high-water mark reached) waits in a small per-peer backlog,
in order, flushed when the socket can take more.

ZeroMQ's ``FD`` is edge-triggered: it signals that the socket's state *may* have
changed, and any call on the socket (a send included) can consume that signal.
So the reader callback always drains fully (or re-schedules itself), and every
send is followed, once per loop iteration, by a fresh look at ``EVENTS``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import zmq
from zmq.auth.thread import ThreadAuthenticator

from pwmesh.core.ratelimit import RejectedLog
from pwmesh.errors import InvalidArgument
from pwmesh.service import listeners
from pwmesh.service.keys import DAEMON, LOCAL, AuthorizedKeys, Identity, Keys, start_authenticator, unkeyed
from pwmesh.wire.codec import DEFAULT_LIMITS

log = logging.getLogger(__name__)

# Frames at least this big are sent without a copy; below it, copying is cheaper
# than the bookkeeping zero-copy needs (pyzmq's own guidance is ~64 KiB).
ZERO_COPY_THRESHOLD_BYTES = 64 << 10
# Messages handled per reader callback before other callbacks get a turn.
RECV_BATCH = 256
# ... or this long: then the loop serves other sockets first (a client's 100 parts of a big program, at
# ~0.1 s each, once held every reply on the proxy's other connections behind them for 5.5 s).
RECV_BATCH_SECONDS = 0.01
# While messages wait in a backlog, the socket is looked at again at least this often.
BACKLOG_RETRY_SECONDS = 0.05

# Plain ints: pyzmq's flag enums cost more than the calls they are passed to.
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS = zmq.EVENTS  # pyzmq types every option's value as int | bytes: FD and EVENTS are ints
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)


def is_loopback(address: str) -> bool:
    return address.startswith(("ipc://", "inproc://")) or any(
        host in address for host in ("://127.", "://localhost", "://[::1]")
    )


class Context:
    """One ZeroMQ context per process; owns every socket made from it."""

    def __init__(self, *, high_water_mark: int = 100_000, keys: Keys | None = None,
                 allow_insecure: bool = False) -> None:
        """``keys``: every socket speaks CURVE (see ``pwmesh.service.keys``). Without them, binding
        anything but loopback is refused unless ``allow_insecure`` (a network you trust)."""
        self._ctx = zmq.Context()
        self.keys = keys
        self.allow_insecure = allow_insecure
        self._auth: ThreadAuthenticator | None = None
        self._authorized: AuthorizedKeys | None = None  # who the keys that may connect are (with keys)
        # Connections messages came in on (with keys): file descriptor -> (the key's User-Id, the peer's
        # address), so a key removed from ``authorized/`` has its connections closed (``close_revoked``).
        self._connections: dict[int, tuple[Any, Any]] = {}
        self._sockets: list[_Pump] = []
        self.high_water_mark = high_water_mark  # messages queued per peer and direction
        # How long ``close`` lets what is queued leave (0: drop it; a restarting daemon's last replies matter).
        self.linger_on_close_ms = 0
        self.keep_listeners = False  # ``close`` leaves passable listeners open (an exec follows)

    def _socket(self, kind: int, identity: bytes | None = None) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        # Never block forever on a peer that is gone; what it cannot take waits in the backlog.
        sock.setsockopt(zmq.SNDHWM, self.high_water_mark)
        sock.setsockopt(zmq.RCVHWM, self.high_water_mark)
        # With copy=False, pyzmq still copies each frame below this: big frames alone go zero-copy.
        sock.copy_threshold = ZERO_COPY_THRESHOLD_BYTES
        # No frame bigger than any message may hold is even read in (ZeroMQ drops its sender instead).
        sock.setsockopt(zmq.MAXMSGSIZE, DEFAULT_LIMITS.max_buffer_bytes)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        return sock

    def identify(self, frame: Any) -> Identity | None:
        """Who sent the message ``frame`` (received on one of this context's bound sockets) belongs to:
        the key its connection authenticated with, as ``authorized/`` says now (None: not, or no longer,
        authorized). Without keys, every peer is ``LOCAL``."""
        if self._authorized is None:
            return LOCAL if self.keys is None else None
        try:
            user = frame.get("User-Id")
            fd = frame.get(zmq.SRCFD)
        except (AttributeError, zmq.ZMQError):  # not a received frame, or one with no credentials
            return None
        known = self._connections.get(fd)
        if known is None or known[0] != user:  # a new connection on this descriptor: whose, and to where
            self._connections[fd] = (user, _peer_of(fd))
        return self._authorized.identify(user.encode() if isinstance(user, str) else user)

    def close_revoked(self) -> int:
        """Close every connection a message came in on whose key is no longer authorized (``pwmesh keys
        remove``): ZeroMQ has no call for it, so the socket under it is shut down, which ZeroMQ sees as
        the peer leaving; reconnecting, it fails the handshake. A descriptor reused since for another
        connection (another peer address) is left alone. Returns how many were closed."""
        if self._authorized is None:
            return 0
        closed = 0
        for fd, (user, peer) in list(self._connections.items()):
            if self._authorized.identify(user.encode() if isinstance(user, str) else user) is not None:
                continue
            del self._connections[fd]
            if peer is not None and _peer_of(fd) == peer:
                try:
                    with socket.socket(fileno=os.dup(fd)) as sock:
                        sock.shutdown(socket.SHUT_RDWR)
                    closed += 1
                except OSError:
                    pass
        if closed:
            log.info("closed %d connection(s) of keys no longer authorized", closed)
        return closed

    def guard_bind(self, address: str, what: str = "") -> None:
        """Refuse to listen at ``address`` off loopback without keys, unless ``allow_insecure`` (then say
        so loudly). ``what`` names the listener for the message ("the data plane at "); every listener a
        daemon opens, ZeroMQ's or its own, passes here."""
        if self.keys is not None or is_loopback(address):
            return
        if not self.allow_insecure:
            raise InvalidArgument(f"refusing to bind {what}{address} without keys: anyone who reaches it could "
                                  "run code on the cluster. Give --keys DIR (`pwmesh keys init DIR`), or "
                                  "--insecure on a network you trust")
        log.warning("INSECURE: binding %s%s without keys (--insecure): every peer that reaches it is trusted "
                    "and traffic is plaintext", what, address)

    def router(self, bind: str, *, passable: bool = False) -> RouterSocket:
        """A socket bound at ``bind``. ``passable`` (TCP only): it listens through a descriptor of our own,
        which ``close`` leaves open while ``keep_listeners`` for the process an exec starts next to take over
        (``pwmesh.service.listeners``)."""
        self.guard_bind(bind)
        sock = self._socket(zmq.ROUTER)
        if self.keys is not None:
            if self._auth is None:
                self._auth, self._authorized = start_authenticator(self._ctx, self.keys)
            self.keys.serve(sock)
        # An unknown routing id is an error we want to hear about, not a silent drop.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        listener = None
        if passable and bind.startswith("tcp://"):
            listener = listeners.tcp_listener(bind, backlog=100)
            listener.setblocking(False)  # as ZeroMQ's own (the descriptor below shares it)
            sock.setsockopt(zmq.USE_FD, os.dup(listener.fileno()))  # ZeroMQ closes its copy with the socket
            address = f"{bind.rpartition(':')[0]}:{listener.getsockname()[1]}"
            sock.bind(address)
        elif bind.endswith(":0"):
            port = sock.bind_to_random_port(bind[: -len(":0")])
            address = f"{bind[: -len(':0')]}:{port}"
        else:
            sock.bind(bind)
            address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        router = RouterSocket(sock, address)
        router.listener = listener
        self._sockets.append(router)
        return router

    def dealer(self, connect: str, identity: bytes | None = None) -> DealerSocket:
        """A socket connected to ``connect``; ``InvalidArgument`` if that is no address ZeroMQ can connect to
        (addresses come from peers: a bad one is a refused request, not a leaked socket). An address with
        a key (``keys.keyed``) must be served with that key."""
        try:
            plain, server = unkeyed(connect)
        except InvalidArgument as exc:
            raise InvalidArgument(f"cannot connect to {connect[:200]!r}: {exc}") from None
        sock = self._socket(zmq.DEALER, identity)
        if self.keys is not None:
            self.keys.connect(sock, server)
        try:
            sock.connect(plain)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise InvalidArgument(f"cannot connect to {connect[:200]!r}: {exc.strerror}") from None
        dealer = DealerSocket(sock, connect)
        self._sockets.append(dealer)
        return dealer

    def advertise(self, address: str) -> str:
        """``address``, which this process serves, as peers are to be told it (``Keys.advertise``)."""
        return address if self.keys is None else self.keys.advertise(address)

    def whose(self, public: bytes) -> Identity | None:
        """Whose key ``public`` (z85) is, as ``authorized/`` says now (None: nobody's, or no keys)."""
        return self._authorized.identify(public) if self._authorized is not None else None

    def daemon_key(self, public: bytes) -> bool:
        """Is ``public`` (z85) a daemon's key now: the cluster's, or a daemon host's in ``authorized/``?"""
        identity = self.whose(public)
        return identity is not None and identity.role == DAEMON

    def close(self) -> None:
        for sock in self._sockets:
            sock.close(linger_ms=self.linger_on_close_ms)
            if sock.listener is not None and not self.keep_listeners:
                listeners.close(sock.listener)
        self._sockets.clear()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.term()


class _Pump:
    """One socket on the running loop: its reader callback, its backlog, its receiver.

    The backlog is keyed by destination (a ROUTER's peer; ``b""`` for a DEALER):
    a peer at its high-water mark holds up only its own messages.
    """

    def __init__(self, sock: zmq.Socket[bytes], address: str) -> None:
        self._sock = sock
        self.address = address
        self.listener: socket.socket | None = None  # our own descriptor under a passable router's
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = 0
        self._on_frames: Callable[[list[Any]], None] | None = None
        self._waiters: collections.deque[asyncio.Future[list[Any]]] = collections.deque()  # recv() callers
        self._backlog: dict[bytes, collections.deque[list[Any]]] = {}
        self._backlogged = 0  # messages in the backlog
        self._drained: asyncio.Future[None] | None = None  # resolved when the backlog empties
        self._check_scheduled = False
        self._busy = False  # inside _on_events
        self._retry: asyncio.TimerHandle | None = None  # looks at the backlog again
        self._closed = False
        self._failures = RejectedLog(address, logger=log)  # the callback's failures, a line per kind per 10 s
        # Sends the backlog could not make later (e.g. the peer is gone): told, never raised.
        self.on_send_error: Callable[[bytes, zmq.ZMQError, int], None] | None = None

    # ------------------------------------------------------------ the loop side

    def _attach(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
            self._fd = cast(int, self._sock.getsockopt(zmq.FD))
            loop.add_reader(self._fd, self._on_events)
        return loop

    def _schedule_check(self) -> None:
        """Look at the socket again soon, from the loop."""
        if not self._check_scheduled and not self._closed:
            self._check_scheduled = True
            self._attach().call_soon(self._on_events)

    def _on_events(self) -> None:
        self._check_scheduled = False
        if self._closed:
            return
        self._busy = True
        try:
            while True:
                sent = self._flush() if self._backlogged else 0
                # Read after every send: the state is current, and the FD's signal is reset.
                events = cast(int, self._sock.getsockopt(_EVENTS))
                if events & _POLLIN:
                    events = self._drain(events)
                    if events < 0:
                        break
                if sent and self._backlogged and events & _POLLOUT:
                    continue
                break
        except zmq.ZMQError as exc:
            if not self._closed:  # closed under us: nothing to do
                log.error("%s: socket error: %s", self.address, exc)
        finally:
            self._busy = False
        if self._backlogged and self._retry is None and not self._closed:
            # Whether a full peer's room comes back as a signal we see is not promised: look again.
            self._retry = self._attach().call_later(BACKLOG_RETRY_SECONDS, self._retry_backlog)

    def _retry_backlog(self) -> None:
        self._retry = None
        self._on_events()

    def _after_send(self) -> None:
        """A send may have consumed the FD's signal: if that hid work, do it from the loop."""
        if self._busy:  # inside _on_events, which reads EVENTS again before it returns
            return
        events = cast(int, self._sock.getsockopt(_EVENTS))
        if (events & _POLLIN and (self._on_frames is not None or self._waiters)) or (
                events & _POLLOUT and self._backlogged):
            self._schedule_check()

    def _recv(self) -> list[Any]:
        """One whole message (raises ``zmq.Again`` if none waits); big frames stay zero-copy views."""
        recv = self._sock.recv
        frame = recv(_NOBLOCK, copy=False)
        frames = [frame]
        while frame.more:  # the rest of a multipart message is already here, never Again
            frame = recv(_NOBLOCK, copy=False)
            frames.append(frame)
        return frames

    def _drain(self, events: int) -> int:
        """Receive while ``EVENTS`` says a message waits (asking is cheaper than a failed
        receive); the last ``EVENTS`` read, or -1 if the rest is left for later (nobody
        receives, or the batch is done and the rest rescheduled)."""
        getsockopt = cast("Callable[[int], int]", self._sock.getsockopt)
        callback = self._on_frames
        if callback is None:
            while events & _POLLIN:  # one message per waiting recv(); the rest stays in ZeroMQ
                if not self._waiters:
                    return -1
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_result(self._recv())
                    events = getsockopt(_EVENTS)
            return events
        until = time.monotonic() + RECV_BATCH_SECONDS
        for _ in range(RECV_BATCH):
            try:
                frames = self._recv()
            except zmq.Again:  # not expected while EVENTS said POLLIN: look again
                frames = None
            if frames is not None:
                try:
                    callback(frames)
                except Exception as exc:  # the callback's own bug: log it (rate-limited), keep serving everyone else
                    more = self._failures.allow(type(exc).__name__, "like it")
                    if more is not None:
                        log.exception("%s: message callback failed%s", self.address, more)
                if self._on_frames is not callback or self._closed:
                    return -1
            events = getsockopt(_EVENTS)
            if not events & _POLLIN:
                return events
            if time.monotonic() > until:
                break
        self._schedule_check()  # more is waiting: let other callbacks run first
        return -1

    def start_receiving(self, callback: Callable[[list[Any]], None]) -> None:
        """Hand every inbound message (its raw frames) to ``callback``, in arrival order."""
        self._on_frames = callback
        self._schedule_check()  # what arrived before is waiting, with no signal left to say so

    def stop_receiving(self) -> None:
        self._on_frames = None

    async def _recv_frames(self) -> list[Any]:
        if self._on_frames is not None:
            raise RuntimeError(f"{self.address}: recv() while a callback receives")
        loop = self._attach()
        if not self._waiters:
            try:
                frames = self._recv()
            except zmq.Again:
                pass
            else:
                self._after_send()  # the receive, like a send, may have consumed the FD's signal
                return frames
        waiter: asyncio.Future[list[Any]] = loop.create_future()
        self._waiters.append(waiter)
        self._schedule_check()
        return await waiter

    # ------------------------------------------------------------------ sending

    def _send_frames(self, key: bytes, frames: Sequence[Any]) -> None:
        """Send now, or queue behind ``key``'s backlog; raise what ZeroMQ refuses for good."""
        if self._closed:  # shutting down: ZeroMQ would drop it at close anyway (linger 0)
            log.debug("%s: socket closed, dropped a message for %r", self.address, key)
            return
        if key in self._backlog:  # never overtake what already waits
            self._backlog[key].append(list(frames))
            self._backlogged += 1
            return
        try:
            self._send_now(frames)
        except zmq.Again:
            self._backlog[key] = collections.deque([list(frames)])
            self._backlogged += 1
            self._schedule_check()  # arms the retry; the reader callback flushes it once the peer can take more
            return
        except zmq.ZMQError:
            # Refused (no such peer): the call still processed the socket's commands, so it may have
            # consumed the FD's signal for messages that arrived meanwhile. Without a fresh look they
            # would wait for the next unrelated event (found by fuzzing: 20 s stalls after a peer left).
            # The look comes next turn: what the caller does about the refusal comes first.
            self._attach().call_soon(self._after_send)
            raise
        self._after_send()

    def _send_now(self, frames: Sequence[Any]) -> None:
        send = self._sock.send
        last = len(frames) - 1
        # A refusal (full, or no such peer) comes at the first frame, before anything is queued.
        for i, frame in enumerate(frames):
            send(frame, _MORE if i < last else _NOBLOCK, copy=False)

    def _flush(self) -> int:
        """Send what the backlog holds, in order, while the socket takes it; how many went."""
        sent = 0
        for key in list(self._backlog):
            queue = self._backlog[key]
            while queue:
                try:
                    self._send_now(queue[0])
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:  # the peer is gone: drop what waits for it, and tell
                    dropped = len(queue)
                    self._backlogged -= dropped
                    del self._backlog[key]
                    self._report(key, exc, dropped)
                    break
                queue.popleft()
                self._backlogged -= 1
                sent += 1
            else:
                del self._backlog[key]
        if not self._backlogged and self._drained is not None:
            if not self._drained.done():
                self._drained.set_result(None)
            self._drained = None
        return sent

    def _report(self, key: bytes, exc: zmq.ZMQError, dropped: int) -> None:
        if self.on_send_error is not None:
            self.on_send_error(key, exc, dropped)
        else:
            log.warning("%s: dropped %d message(s) for %r: %s", self.address, dropped, key, exc)

    @property
    def backlog(self) -> int:
        """Messages the socket has not taken yet (their peer is at its high-water mark)."""
        return self._backlogged

    async def wait_sent(self) -> None:
        """Return once everything sent so far has been handed to ZeroMQ."""
        if not self._backlogged:
            return
        if self._drained is None:
            self._drained = self._attach().create_future()
        await asyncio.shield(self._drained)

    def close(self, linger_ms: int = 0) -> None:
        if self._closed:
            return
        self._closed = True
        self._on_frames = None
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._fd)
        for waiter in self._waiters:
            waiter.cancel()
        self._waiters.clear()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)  # nothing more will leave: do not keep anyone waiting
        self._backlog.clear()
        self._backlogged = 0
        self._sock.close(linger=linger_ms)


class RouterSocket(_Pump):
    """A bound socket serving many peers; frames are ``[peer, b"", *payload]``."""

    def start_receiving(self, callback: Callable[[bytes, list[Any]], None]) -> None:  # type: ignore[override]
        """``callback(peer, payload)`` per message; one without the routing envelope gets ``payload == []``."""

        def unwrap(frames: list[Any]) -> None:
            peer = frames[0].bytes
            if len(frames) < 2 or len(frames[1]) != 0:
                callback(peer, [])
            else:
                callback(peer, frames[2:])

        super().start_receiving(unwrap)

    async def recv(self) -> tuple[bytes, list[Any]]:
        """``(peer, payload)``; a message without the routing envelope gets ``payload == []``."""
        frames = await self._recv_frames()
        peer = frames[0].bytes
        if len(frames) < 2 or len(frames[1]) != 0:
            return peer, []
        return peer, frames[2:]

    def send_nowait(self, peer: bytes, payload: Sequence[Any]) -> None:
        """Hand ``payload`` to ZeroMQ for ``peer`` (or queue it behind that peer's backlog).

        Raises ``zmq.ZMQError`` (``EHOSTUNREACH``) when no such peer is connected."""
        self._send_frames(peer, [peer, b"", *payload])

    async def send(self, peer: bytes, payload: Sequence[Any]) -> None:
        self.send_nowait(peer, payload)


class DealerSocket(_Pump):
    """A socket connected to one peer's ROUTER."""

    def start_receiving(self, callback: Callable[[list[Any]], None]) -> None:
        """``callback(payload)`` per message; one without the empty delimiter gets ``payload == []``."""

        def unwrap(frames: list[Any]) -> None:
            callback(frames[1:] if frames and len(frames[0]) == 0 else [])

        super().start_receiving(unwrap)

    async def recv(self) -> list[Any]:
        frames = await self._recv_frames()
        if not frames or len(frames[0]) != 0:
            return []
        return frames[1:]

    def send_nowait(self, payload: Sequence[Any]) -> None:
        """Hand ``payload`` to ZeroMQ (or queue it behind the backlog, in order)."""
        self._send_frames(b"", [b"", *payload])

    async def send(self, payload: Sequence[Any]) -> None:
        self.send_nowait(payload)


def _peer_of(fd: int) -> Any:
    """The address of the peer at the other end of socket ``fd`` (None: not a connected socket now)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            return sock.getpeername()
    except OSError:
        return None
