"""Messages over sockets: a ``Server`` that validates and dispatches, and a
``Connection`` that matches replies to requests by id.

Both receive through their socket's reader callback, for as long as one owned
task in the service's task group lives (stopping the group stops receiving);
sending never waits. A handler returns a reply ``Message`` (or ``None`` for no
reply), synchronously or as a coroutine; a coroutine handler runs as its own
owned task so one slow request never stalls the socket. Exceptions become
``Error`` replies carrying the code and the remote traceback. A message a
``Connection`` posted (a negative id: nobody waits for its answer) gets none.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import itertools
import logging
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import zmq

from pwmesh.core.ratelimit import RejectedLog
from pwmesh.errors import ConnectionFailed, ProtocolError, PwmeshError, PwTimeoutError, error_class
from pwmesh.service.keys import ADMIN, DAEMON, Identity
from pwmesh.service.tasks import TaskGroup
from pwmesh.service.transport import Context, DealerSocket, RouterSocket
from pwmesh.wire import DEFAULT_LIMITS, Envelope, Limits, Message, decode, encode
from pwmesh.wire.codec import FrameError
from pwmesh.wire.messages import Error, Ok, Ping

log = logging.getLogger(__name__)

Reply = Message | None
Handler = Callable[[bytes, Envelope], Reply | Awaitable[Reply]]

_ids = itertools.count(1)
REVOKED_CHECK_SECONDS = 0.5  # how often connections of removed keys are looked for (keys re-read once a second)


@dataclasses.dataclass(frozen=True)
class Access:
    """Which ops each role may send to one daemon's socket (the sender's role: its key's, see
    ``service.keys``). Daemons may send anything; a client what ``client`` lists; an admin that and
    what ``admin`` lists. Everything else is the daemons' own traffic. Without keys every peer is a
    daemon (one user on loopback)."""

    client: frozenset[str] = frozenset({Ping.op})
    admin: frozenset[str] = frozenset()

    @classmethod
    def of(cls, client: Iterable[type[Message]] = (), admin: Iterable[type[Message]] = ()) -> Access:
        return cls(frozenset({Ping.op, *(m.op for m in client)}), frozenset(m.op for m in admin))

    def allows(self, identity: Identity | None, op: str) -> bool:
        if identity is None:  # a key removed from ``authorized/`` since it connected
            return False
        if identity.role == DAEMON or op in self.client:
            return True
        return identity.role == ADMIN and op in self.admin


def event_fields(message: Message) -> dict[str, Any]:
    """What a log line about ``message`` names as fields (``extra=``): its op, and its run and session
    where it has them."""
    out: dict[str, Any] = {"op": message.op}
    run = getattr(message, "run_id", "")
    if run and isinstance(run, str):
        out["run"] = run
    session = getattr(message, "session", "")
    if session and isinstance(session, str):
        out["session"] = session
    return out


def next_id() -> int:
    return next(_ids)


def error_reply(exc: BaseException) -> Error:
    if isinstance(exc, PwmeshError):
        return Error(code=exc.code, message=exc.message, traceback=exc.remote_traceback)
    return Error(
        code="internal",
        message=f"{type(exc).__name__}: {exc}",
        traceback="".join(traceback.format_exception(exc)),
    )


def raise_error(err: Error) -> None:
    raise error_class(err.code)(err.message, remote_traceback=err.traceback)


class Server:
    """A bound ROUTER socket whose every inbound message is validated, then handled.

    Messages are handled from the socket's reader callback, in arrival order, with
    no task per message (a coroutine handler alone gets its own owned task).
    Everything it sends — replies and pushed notifications — goes to the socket at
    once, in the order posted, so what a handler posts always precedes the
    handler's reply.
    """

    def __init__(self, ctx: Context, bind: str, handlers: dict[type[Message], Handler], *,
                 tasks: TaskGroup, name: str, limits: Limits = DEFAULT_LIMITS,
                 on_unreachable: Callable[[bytes], None] | None = None, access: Access | None = None,
                 passable: bool = False) -> None:
        """``passable``: its listener can outlive an exec (``Context.router``)."""
        self._ctx = ctx
        self._access = access or Access()
        self._sock: RouterSocket = ctx.router(bind, passable=passable)
        self._sock.on_send_error = self._send_failed
        self._handlers = {cls.op: h for cls, h in handlers.items()}
        self._tasks = tasks
        self._name = name
        self._limits = limits
        self._on_unreachable = on_unreachable
        self.address = self._sock.address
        # For the metrics: one integer increment per message, nothing more on this path (a defaultdict:
        # ~50 ns an increment, a Counter ~120 ns).
        self.received: collections.defaultdict[str, int] = collections.defaultdict(int)  # by op
        self.sent: collections.defaultdict[str, int] = collections.defaultdict(int)  # by op
        # Frames dropped or answered with ProtocolError, by ``FrameError.reason``.
        self.rejected: collections.defaultdict[str, int] = collections.defaultdict(int)
        self._rejected_log = RejectedLog(name, logger=log)
        # Failed handlers and sends, each kind logged at most once per interval: what a peer can make
        # fail again and again (a refused request, replies to a peer that left) cannot flood the log.
        self._failure_log = RejectedLog(name, logger=log)
        self._unreachable_log = RejectedLog(name, logger=log)

    def start(self) -> None:
        self._tasks.spawn(_receive_until_cancelled(self._sock, self._received), name=f"{self._name}.recv")
        if self._ctx.keys is not None:
            self._tasks.spawn(self._close_revoked(), name=f"{self._name}.revoked")

    async def _close_revoked(self) -> None:
        """A removed key's connections are closed within a second (``Context.close_revoked``)."""
        while True:
            await asyncio.sleep(REVOKED_CHECK_SECONDS)
            self._ctx.close_revoked()

    @property
    def backlog(self) -> int:
        """Messages posted but not yet taken by ZeroMQ (their peers are at the high-water mark)."""
        return self._sock.backlog

    def post(self, peer: bytes, message: Message, *, reply_to: int | None = None) -> None:
        """Send ``message`` to ``peer`` without waiting; messages leave in the order posted.

        A message that cannot be encoded (a value msgpack cannot hold, such as an integer past 64
        bits that the daemon's state reached from a peer's) is logged and, if it was a reply, replaced
        by an ``Error`` saying so: the requester learns why, and the socket's reader never sees the
        exception."""
        try:
            frames = encode(message, msg_id=next_id(), reply_to=reply_to, sender=self._name)
        except (TypeError, ValueError, OverflowError, ProtocolError) as exc:
            more = self._failure_log.allow(("encode", message.op, type(exc).__name__), alike="like it")
            if more is not None:
                log.error("%s: cannot encode %s for peer %r: %s: %s%s", self._name, message.op, peer,
                          type(exc).__name__, exc, more,
                          extra={**event_fields(message), "peer": peer, "reason": f"{type(exc).__name__}: {exc}"})
            if reply_to is None or isinstance(message, Error):
                return
            error = Error(code="internal", message=f"{self._name} could not encode its {message.op} reply: "
                                                   f"{type(exc).__name__}: {exc}")
            frames = encode(error, msg_id=next_id(), reply_to=reply_to, sender=self._name)
        self.sent[message.op] += 1
        try:
            self._sock.send_nowait(peer, frames)
        except zmq.ZMQError as exc:  # the peer is gone (ROUTER_MANDATORY): tell, never crash
            self._send_failed(peer, exc, 1, message.op)

    def _send_failed(self, peer: bytes, exc: zmq.ZMQError, dropped: int, op: str = "") -> None:
        what = op or f"{dropped} queued message(s)"
        more = self._unreachable_log.allow(peer, alike="to it")
        if more is not None:
            fields = {"op": op, "peer": peer, "reason": str(exc)} if op else {"peer": peer, "reason": str(exc)}
            log.warning("%s: cannot send %s to peer %r: %s%s", self._name, what, peer, exc, more, extra=fields)
        if self._on_unreachable is not None:
            # Later, not inside post(): the caller may be iterating what the hook changes.
            asyncio.get_running_loop().call_soon(self._on_unreachable, peer)

    def _received(self, peer: bytes, payload: list[Any]) -> None:
        try:
            env = decode(payload, self._limits)
        except FrameError as exc:
            self.rejected[exc.reason] += 1
            self._rejected_log.rejected(peer, exc.message)
            if exc.msg_id is not None:
                self.post(peer, Error(code="protocol", message=exc.message), reply_to=exc.msg_id)
            return
        self.received[env.message.op] += 1
        handler = self._handlers.get(env.message.op)
        if handler is None:
            self.rejected["unserved_op"] += 1
            self.post(peer, Error(code="protocol", message=f"{self._name} does not serve op {env.message.op!r}"),
                      reply_to=env.msg_id)
            return
        identity = self._ctx.identify(payload[0])
        if not self._access.allows(identity, env.message.op):
            self.rejected["permission"] += 1
            who = f"{identity.name} ({identity.role} key)" if identity is not None else "a key no longer authorized"
            self._rejected_log.rejected(peer, f"{env.message.op} from {who} refused")
            self.post(peer, Error(code="permission_denied", message=f"{self._name} refuses {env.message.op} from "
                                                                      f"{who}: not an operation of that role"),
                      reply_to=env.msg_id)
            return
        assert identity is not None
        env.user, env.role = identity.name, identity.role
        try:
            result = handler(peer, env)
        except Exception as exc:  # a handler bug must not kill the socket
            self._log_failure(peer, env, exc)
            if env.msg_id >= 0:
                self.post(peer, error_reply(exc), reply_to=env.msg_id)
            return
        if result is None:
            return
        if isinstance(result, Message):
            if env.msg_id >= 0:  # a post's answer would be read by nobody (~60 us a step on each side)
                self.post(peer, result, reply_to=env.msg_id)
        elif inspect.isawaitable(result):
            self._tasks.spawn(self._finish(peer, env, result), name=f"{self._name}.{env.message.op}")

    def _log_failure(self, peer: bytes, env: Envelope, exc: Exception) -> None:
        """Log a failed handler: once per op and exception type per interval (the caller gets every one)."""
        more = self._failure_log.allow((env.message.op, type(exc).__name__), alike="like it")
        if more is None:
            return
        if isinstance(exc, PwmeshError):  # an expected refusal: the caller gets it as an error
            log.info("%s: %s refused: %s%s", self._name, env.message.op, exc.message, more,
                     extra={**event_fields(env.message), "peer": peer, "reason": exc.message})
        else:
            log.error("%s: handler for %s failed%s", self._name, env.message.op, more, exc_info=exc,
                      extra={**event_fields(env.message), "peer": peer, "reason": f"{type(exc).__name__}: {exc}"})

    async def _finish(self, peer: bytes, env: Envelope, pending: Awaitable[Reply]) -> None:
        try:
            reply = await pending
        except asyncio.CancelledError:  # the daemon is stopping: the requester must not wait for ever
            self.post(peer, Error(code="unavailable", message=f"{self._name} stopped before it answered "
                                                              f"{env.message.op}"), reply_to=env.msg_id)
            raise
        except Exception as exc:
            self._log_failure(peer, env, exc)
            reply = error_reply(exc)
        if reply is not None and env.msg_id >= 0:
            self.post(peer, reply, reply_to=env.msg_id)


async def _receive_until_cancelled(sock: RouterSocket | DealerSocket, callback: Callable[..., None]) -> None:
    """Feed ``callback`` from ``sock`` for as long as this (owned) task lives."""
    sock.start_receiving(callback)
    try:
        await asyncio.get_running_loop().create_future()  # resolved by nothing: ends when cancelled
    finally:
        sock.stop_receiving()


class Connection:
    """A DEALER connection to one peer; ``request`` awaits the reply with a timeout."""

    def __init__(self, ctx: Context, address: str, *, tasks: TaskGroup, name: str,
                 on_message: Callable[[Envelope], None] | None = None,
                 limits: Limits = DEFAULT_LIMITS, sent: collections.defaultdict[str, int] | None = None) -> None:
        self._sock: DealerSocket = ctx.dealer(address)
        self.address = address
        # For the metrics, by op: sent (shared by a ``Connections``), received (replies and notifications);
        # unreadable frames by reason.
        self.sent: collections.defaultdict[str, int] = collections.defaultdict(int) if sent is None else sent
        self.received: collections.defaultdict[str, int] = collections.defaultdict(int)
        self.rejected: collections.defaultdict[str, int] = collections.defaultdict(int)
        self._name = name
        self._rejected_log = RejectedLog(name, logger=log)
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self._on_message = on_message
        self._limits = limits
        # Messages posted, and how many of them a reply has proven delivered: a reply
        # to a request proves everything posted before it arrived (one ordered pipe).
        self._posted = 0
        self._delivered = 0
        self._held: list[list[Any]] | None = None  # while held (see ``hold``): what waits to be sent
        self._deferred: Message | None = None  # ``post_merged``'s, until this turn of the loop ends
        tasks.spawn(_receive_until_cancelled(self._sock, self._received), name=f"{name}->{address}.recv")

    def post_merged(self, message: Message, merge: Callable[[Any, Any], Message]) -> None:
        """Post ``message`` as this turn of the event loop ends, merged (``merge(earlier, later)``) with the
        others of its type posted so meanwhile: a proxy's frees of one turn (a run's end, a fetch's, a
        client's releases) leave as one ``DeleteShards``, not one each. Whatever else is sent here first
        sends it, so what this peer receives keeps the order it was sent in."""
        deferred = self._deferred
        if deferred is not None:
            if type(deferred) is type(message):
                self._deferred = merge(deferred, message)
                return
            self._send_deferred()
        self._deferred = message
        asyncio.get_running_loop().call_soon(self._send_deferred)

    def _send_deferred(self) -> None:
        message, self._deferred = self._deferred, None
        if message is not None:
            self.post(message)

    def post(self, message: Message) -> int:
        """Send ``message`` without waiting; posted messages leave in the order posted. Returns its bytes."""
        if self._deferred is not None:
            self._send_deferred()
        self._posted += 1
        frames = encode(message, msg_id=-next_id(), sender=self._name)  # negative: no answer wanted
        self.sent[message.op] += 1
        self._send(frames)
        return sum(memoryview(f).nbytes for f in frames)

    def _send(self, frames: list[Any]) -> None:
        if self._held is not None:
            self._held.append(frames)
        else:
            self._sock.send_nowait(frames)

    def hold(self) -> None:
        """Keep what is posted or requested here until ``release`` (the peer is restarting)."""
        if self._held is None:
            self._held = []

    def release(self, *, drop: bool = False) -> None:
        """Send, in order, what ``hold`` kept (or, with ``drop``, forget it: the peer is gone)."""
        held, self._held = self._held, None
        if drop:
            self._deferred = None
        for frames in held or ():
            if not drop:
                self._sock.send_nowait(frames)

    @property
    def unconfirmed(self) -> bool:
        """Whether something posted here is not yet proven delivered."""
        return self._delivered < self._posted

    async def flush(self) -> None:
        """Wait until everything posted so far has been handed to the socket."""
        if self._deferred is not None:
            self._send_deferred()
        await self._sock.wait_sent()

    async def request(self, message: Message, *, timeout_seconds: float) -> Message:
        msg_id = next_id()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Message] = loop.create_future()
        self._pending[msg_id] = fut
        timer = loop.call_later(timeout_seconds, self._expire, fut, message.op, timeout_seconds)
        try:
            # The same ordered pipe as post(): a request never overtakes what was posted before it.
            if self._deferred is not None:
                self._send_deferred()
            self._posted += 1
            upto = self._posted
            self._send(encode(message, msg_id=msg_id, sender=self._name))
            self.sent[message.op] += 1
            reply = await fut
            self._delivered = max(self._delivered, upto)
        finally:
            timer.cancel()
            self._pending.pop(msg_id, None)
        if isinstance(reply, Error):
            raise_error(reply)
        return reply

    def _expire(self, fut: asyncio.Future[Message], op: str, timeout_seconds: float) -> None:
        if not fut.done():
            fut.set_exception(PwTimeoutError(f"{self.address} did not answer {op} within {timeout_seconds} seconds"))

    def _received(self, payload: list[Any]) -> None:
        try:
            env = decode(payload, self._limits)
        except FrameError as exc:
            # An unreadable reply cannot be matched to its request, which then times out.
            self.rejected[exc.reason] += 1
            self._rejected_log.rejected(self.address, exc.message)
            return
        self.received[env.message.op] += 1
        if env.reply_to is not None:
            # The answer to a request: to its caller, or to nobody if the caller stopped waiting (timed out).
            # Never a notice: a late PleaseRegister(written_off) to a heartbeat that had timed out, handled as
            # one, made an executor back from a partition start over twice, and the resource manager took
            # its second registration for a new process and wrote off what it held.
            fut = self._pending.get(env.reply_to)
            if fut is not None and not fut.done():
                fut.set_result(env.message)
        elif self._on_message is not None:
            self._on_message(env)

    def fail_pending(self, exc: PwmeshError) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)


class Beats:
    """Heartbeats to one peer (the resource manager) sent as requests, so whether it answers is known: an
    outage is one log line once it has lasted two beats, and one with its length when it ends (a 50 s RM
    outage once went unlogged everywhere). An answer other than ``Ok`` (``PleaseRegister``) goes to
    ``on_reply`` as a notice would."""

    def __init__(self, peers: Connections, address: str, what: str, interval_seconds: float,
                 on_reply: Callable[[Envelope], None]) -> None:
        self.peers = peers
        self.address = address
        self.what = what
        self.interval_seconds = interval_seconds
        self.on_reply = on_reply
        self.silent_since: float | None = None
        self._logged = False

    async def beat(self, message: Message) -> None:
        try:
            reply: Message | None = await self.peers.request(self.address, message,
                                                             timeout_seconds=self.interval_seconds)
        except (PwTimeoutError, ConnectionFailed) as exc:
            now = time.monotonic()
            if self.silent_since is None:
                self.silent_since = now - self.interval_seconds
            if not self._logged and now - self.silent_since >= 2 * self.interval_seconds:
                log.warning("%s: the %s at %s has not answered for %.0f s (%s); what needs it waits",
                            self.peers.name, self.what, self.address, now - self.silent_since, exc.message)
                self._logged = True
            return
        except PwmeshError:  # a refusal is an answer
            reply = None
        if self.silent_since is not None:
            if self._logged:
                log.warning("%s: the %s at %s answers again, after %.1f s", self.peers.name, self.what,
                            self.address, time.monotonic() - self.silent_since)
            self.silent_since, self._logged = None, False
        if reply is not None and not isinstance(reply, Ok):
            self.on_reply(Envelope(message=reply, msg_id=0, reply_to=None, sender=self.what))


class Connections:
    """One ``Connection`` per peer address, made on first use."""

    def __init__(self, ctx: Context, *, tasks: TaskGroup, name: str,
                 on_message: Callable[[Envelope], None] | None = None) -> None:
        self._ctx = ctx
        self._tasks = tasks
        self._name = name
        self._on_message = on_message
        self._by_address: dict[str, Connection] = {}
        self.lost: set[str] = set()  # peers known gone: posts to them are dropped
        self.sent_messages = 0  # posted, ever (the proxy reports its program traffic from these)
        self.sent_bytes = 0
        self.sent: collections.defaultdict[str, int] = collections.defaultdict(int)  # by op, every connection's
        self._silent_log = RejectedLog(name, logger=log)  # peers that did not answer a barrier

    @property
    def name(self) -> str:
        """Whose connections these are (the daemon's name, for logs)."""
        return self._name

    def get(self, address: str) -> Connection:
        conn = self._by_address.get(address)
        if conn is None:
            conn = Connection(self._ctx, address, tasks=self._tasks, name=self._name, on_message=self._on_message,
                              sent=self.sent)
            self._by_address[address] = conn
        return conn

    async def request(self, address: str, message: Message, *, timeout_seconds: float) -> Message:
        return await self.get(address).request(message, timeout_seconds=timeout_seconds)

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Messages received over every connection by op, and frames rejected by reason (the metrics)."""
        received: dict[str, int] = {}
        rejected: dict[str, int] = {}
        for conn in self._by_address.values():
            for total, counts in ((received, conn.received), (rejected, conn.rejected)):
                for key, n in counts.items():
                    total[key] = total.get(key, 0) + n
        return received, rejected

    def post(self, address: str, message: Message) -> None:
        if address in self.lost:
            log.debug("%s: dropped %s for %s, which is gone", self._name, message.op, address)
            return
        self.sent_bytes += self.get(address).post(message)
        self.sent_messages += 1

    def post_merged(self, address: str, message: Message, merge: Callable[[Any, Any], Message]) -> None:
        """``Connection.post_merged`` to ``address`` (dropped if it is gone)."""
        if address in self.lost:
            log.debug("%s: dropped %s for %s, which is gone", self._name, message.op, address)
            return
        self.get(address).post_merged(message, merge)
        self.sent_messages += 1

    def fence(self, address: str, message: Message) -> None:
        """Post ``message`` (the last thing ``address`` gets before it restarts), then hold what
        follows for it until it is back (``mark_alive``) or gone (``mark_lost``)."""
        self.post(address, message)
        self.get(address).hold()

    def mark_alive(self, address: str) -> None:
        self.lost.discard(address)
        conn = self._by_address.get(address)
        if conn is not None:
            conn.release()

    def mark_lost(self, address: str, exc: PwmeshError) -> None:
        """``address`` is gone: fail what waits on it, drop what would be sent to it."""
        self.lost.add(address)
        conn = self._by_address.get(address)
        if conn is not None:
            conn.release(drop=True)
            conn.fail_pending(exc)

    async def flush(self) -> None:
        for conn in list(self._by_address.values()):
            await conn.flush()

    async def barrier(self, *, timeout_seconds: float) -> None:
        """Return once every peer has processed all we sent it (a Ping answered behind it on each
        ordered connection with unconfirmed messages). Flushing alone only hands frames to
        ZeroMQ, which drops them at close; this proves delivery."""

        async def ping(conn: Connection) -> None:
            try:
                await conn.request(Ping(), timeout_seconds=timeout_seconds)
            except PwmeshError as exc:  # once per peer per interval: a peer's junk may name an address often
                more = self._silent_log.allow(conn.address, alike="from it")
                if more is not None:
                    log.warning("%s: no barrier reply from %s: %s%s", self._name, conn.address, exc, more,
                                extra={"peer": conn.address, "reason": exc.message})

        await asyncio.gather(*(ping(c) for a, c in list(self._by_address.items())
                               if c.unconfirmed and a not in self.lost))


async def wait_for_peer(conn: Connection, message: Message, *, timeout_seconds: float) -> Message:
    """``request`` that reports an absent peer as ``ConnectionFailed``."""
    try:
        return await conn.request(message, timeout_seconds=timeout_seconds)
    except PwTimeoutError:
        raise ConnectionFailed(f"nothing answered at {conn.address} within {timeout_seconds} seconds") from None


