"""The controller's daemons in the simulator: the real pure cores behind thin simulated shells.

Each shell does what its asyncio daemon does with a message — and nothing more — so
the core is what the simulation measures: ``SimResourceManager`` wraps
``rm.state.ResourceManagerState``, ``SimScheduler`` wraps ``scheduler.order.IslandOrder``
(one per island), ``SimProxy`` wraps ``proxy.state.ProxyState``. Every call into a
core is timed (``Node.core``: real CPU seconds), which is where a single controller
would saturate.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pwmesh.errors import PwmeshError
from pwmesh.ir.lower import value_layout
from pwmesh.proxy.state import (
    Ask,
    FencePeer,
    FetchEnded,
    Fetching,
    Inbound,
    Notice,
    PeerBack,
    PeerLost,
    ProxyState,
    Reply,
    Resolve,
    Send,
    SliceGranted,
    Tick,
    Wait,
)
from pwmesh.rm.state import ResourceManagerState
from pwmesh.scheduler.order import IslandOrder, SendEnqueue
from pwmesh.sim.clock import Clock
from pwmesh.sim.network import Network
from pwmesh.sim.node import Node
from pwmesh.wire import Envelope, Message
from pwmesh.wire.messages import (
    BufferValue,
    Error,
    ExecutorLost,
    FetchShards,
    Ok,
    RunPartDone,
    ScheduleRun,
    ShardValues,
    SliceAllocated,
    WatchCluster,
)


def error_message(exc: BaseException) -> Error:
    """An exception as the wire's ``Error`` (as every daemon's shell answers one)."""
    if isinstance(exc, PwmeshError):
        return Error(code=exc.code, message=exc.message)
    return Error(code="internal", message=f"{type(exc).__name__}: {exc}")


class SimResourceManager(Node):
    """The RM's shell: every request to the core, its reply back, its notifications to the watchers."""

    def __init__(self, address: str, clock: Clock, network: Network, state: ResourceManagerState,
                 **node: Any) -> None:
        super().__init__(address, clock, network, **node)
        self.state = state
        self.watchers: list[str] = []

    def handle(self, env: Envelope) -> None:
        if isinstance(env.message, WatchCluster) and env.sender not in self.watchers:
            self.watchers.append(env.sender)
        try:
            reply = self.core(self.state.handle, env.message, self.clock.now)
        except PwmeshError as exc:
            reply = error_message(exc)
        self.notify()
        if reply is not None:
            self.post(env.sender, reply, reply_to=env.msg_id)

    def notify(self) -> None:
        for note in self.core(self.state.take_notifications):
            for watcher in self.watchers:
                self.post(watcher, note)


class SimScheduler(Node):
    """An island scheduler's shell: ``ScheduleRun`` and ``RunPartDone`` into ``IslandOrder``, ``Enqueue`` out."""

    def __init__(self, address: str, clock: Clock, network: Network, order: IslandOrder, **node: Any) -> None:
        super().__init__(address, clock, network, **node)
        self.order = order
        self.decisions = 0  # runs released into the island's order
        self.enqueues = 0

    def handle(self, env: Envelope) -> None:
        msg = env.message
        try:
            if isinstance(msg, ScheduleRun):
                actions = self.core(self.order.submit, msg)
            elif isinstance(msg, RunPartDone):
                actions = self.core(self.order.part_done, msg.run_id, msg.executor_id, msg.device_seconds)
            elif isinstance(msg, ExecutorLost):
                actions = self.core(self.order.forget_executor, msg.executor_id)
            else:
                return  # the RM's other news concerns the JAX group, which the simulator has none of
        except PwmeshError as exc:
            self.post(env.sender, error_message(exc), reply_to=env.msg_id)
            return
        self._post(actions)

    def _post(self, actions: list[SendEnqueue]) -> None:
        self.decisions += len({a.enqueue.run_id for a in actions})
        self.enqueues += len(actions)
        for action in actions:
            self.post(action.control, action.enqueue)


@dataclasses.dataclass
class _Request:
    """A client's request being answered: where the answer goes."""

    peer: str
    msg_id: int


@dataclasses.dataclass
class _Waiting:
    request: _Request
    buffers: list[Any]
    then: Any
    left: int


@dataclasses.dataclass
class _Fetch:
    request: _Request
    buffer: Any
    shards: dict[str, list[Any]]  # key -> its array, once here
    order: list[str]  # every key, in the order the reply lists them
    left: int


class SimProxy(Node):
    """The proxy's shell: events into ``ProxyState``, its actions onto the network.

    It keeps what the daemon keeps outside the core: the requests that wait (``Wait``,
    ``Fetching``, an ``Ask`` to the RM), and the posts held for a restarting executor."""

    def __init__(self, address: str, clock: Clock, network: Network, state: ProxyState, rm: str,
                 **node: Any) -> None:
        super().__init__(address, clock, network, **node)
        self.state = state
        self.rm = rm
        self.errors: list[Error] = []  # Error replies the proxy got for posts (nobody waits for them)
        self._asks: dict[int, _Request] = {}  # our request id -> the client request it answers
        self._waits: dict[int, list[_Waiting]] = {}  # id(buffer) -> who waits for it
        self._fetches: dict[int, tuple[_Fetch, list[str], str]] = {}  # FetchShards id -> (fetch, keys, executor)
        self._lost: set[str] = set()
        self._fenced: dict[str, list[tuple[Message, str]]] = {}
        self._ticking = False

    def start(self) -> None:
        """Subscribe to the RM's news, as the daemon does when it starts."""
        self.post(self.rm, WatchCluster(role="proxy", name=self.address))

    def tick_every(self, seconds: float, while_: Any) -> None:
        """End expired sessions every ``seconds`` (virtual) while ``while_()`` holds."""
        def tick() -> None:
            if not while_():
                self._ticking = False
                return
            self._run(Tick(), None)
            self.clock.after(seconds, tick)

        if not self._ticking:
            self._ticking = True
            self.clock.after(seconds, tick)

    # ------------------------------------------------------------ inbound

    def handle(self, env: Envelope) -> None:
        msg, sender = env.message, env.sender
        if env.reply_to is not None and env.reply_to in self._asks:
            request = self._asks.pop(env.reply_to)
            if isinstance(msg, SliceAllocated):
                self._run(SliceGranted(request.peer.encode(), msg.slice), request)
            else:
                self.post(request.peer, msg if isinstance(msg, Error) else error_message(
                    RuntimeError(f"the RM answered {msg.op}")), reply_to=request.msg_id)
            return
        if env.reply_to is not None and env.reply_to in self._fetches:
            self._fetched(self._fetches.pop(env.reply_to), msg)
            return
        if sender == self.rm:
            if isinstance(msg, Error):
                self.errors.append(msg)
            elif not isinstance(msg, Ok):
                self._run(Notice(msg), None)
            return
        if isinstance(msg, (Error, Ok)):
            if isinstance(msg, Error):
                self.errors.append(msg)
            return
        self._run(Inbound(sender.encode(), msg), _Request(sender, env.msg_id))

    def _run(self, event: Any, request: _Request | None) -> None:
        try:
            actions = self.core(self.state.handle, event, self.clock.now)
        except PwmeshError as exc:
            if request is not None:
                self.post(request.peer, error_message(exc), reply_to=request.msg_id)
            return
        self._do(actions, request)

    # ------------------------------------------------------------ actions

    def _do(self, actions: list[Any], request: _Request | None) -> None:
        for action in actions:
            if isinstance(action, Send):
                self._send(action.to, action.message, "dispatch" if action.dispatch else "")
            elif isinstance(action, Reply):
                self._reply(request, action)
            elif isinstance(action, Ask):
                if request is None:
                    raise RuntimeError(f"the proxy core asked {action.to} outside any request")
                self._asks[self.post(action.to, action.message)] = request
            elif isinstance(action, Wait):
                self._wait(request, action)
            elif isinstance(action, Fetching):
                self._fetch(request, action)
            elif isinstance(action, Resolve):
                self._resolved(action.buffer)
            elif isinstance(action, PeerLost):
                self._peer_lost(action.control, action.error)
            elif isinstance(action, PeerBack):
                self._lost.discard(action.control)
                for message, tag in self._fenced.pop(action.control, []):
                    self._send(action.control, message, tag)
            elif isinstance(action, FencePeer):
                self._send(action.control, action.fence, "")
                self._fenced.setdefault(action.control, [])
            else:
                raise TypeError(f"the simulator does not know the proxy action {type(action).__name__}")

    def _send(self, to: str, message: Message, tag: str) -> None:
        if to in self._fenced:
            self._fenced[to].append((message, tag))
        elif to not in self._lost:
            self.post(to, message, tag=tag)

    def _reply(self, request: _Request | None, action: Reply) -> None:
        if request is None:
            return
        if action.error is not None:
            message: Message = action.error if isinstance(action.error, Message) else error_message(action.error)
        else:
            message = action.message if action.message is not None else Ok()
        self.post(request.peer, message, reply_to=request.msg_id)

    def _wait(self, request: _Request | None, action: Wait) -> None:
        if request is None:
            return
        pending = [b for b in action.buffers if not b.done]
        waiting = _Waiting(request, list(action.buffers), action.then, len(pending))
        if not pending:
            self._waited(waiting)
            return
        for buf in pending:
            self._waits.setdefault(id(buf), []).append(waiting)

    def _resolved(self, buffer: Any) -> None:
        for waiting in self._waits.pop(id(buffer), []):
            waiting.left -= 1
            if waiting.left == 0:
                self._waited(waiting)

    def _waited(self, waiting: _Waiting) -> None:
        failed = next((b.error for b in waiting.buffers if b.error is not None), None)
        if failed is not None:
            self.post(waiting.request.peer, error_message(failed), reply_to=waiting.request.msg_id)
        elif waiting.then is None:
            self.post(waiting.request.peer, Ok(), reply_to=waiting.request.msg_id)
        else:
            self._do([waiting.then], waiting.request)

    def _fetch(self, request: _Request | None, action: Fetching) -> None:
        if request is None:
            return
        # The reply lists one shard per distinct block, in ``Layout.distinct()`` order.
        rank = {shard: i for i, shard in enumerate(value_layout(action.buffer.spec).distinct())}
        keys = sorted((k for ks in action.by_control.values() for k in ks),
                      key=lambda k: rank.get(int(k.rsplit("/", 1)[1]), len(rank)))
        fetch = _Fetch(request, action.buffer, {}, keys, len(action.by_control))
        if not action.by_control:
            self._fetch_done(fetch)
        for control, mine in action.by_control.items():
            if control in self._lost:
                self.post(request.peer, Error(code="device_lost", message=f"{control} is gone"),
                          reply_to=request.msg_id)
                return
            self._fetches[self.post(control, FetchShards(keys=list(mine)))] = (fetch, list(mine), control)

    def _fetched(self, found: tuple[_Fetch, list[str], str], msg: Message) -> None:
        fetch, keys, _ = found
        if isinstance(msg, ShardValues):
            for key, array in zip(keys, msg.arrays, strict=True):
                fetch.shards[key] = array
        fetch.left -= 1
        if fetch.left == 0:
            self._fetch_done(fetch)

    def _fetch_done(self, fetch: _Fetch) -> None:
        request = fetch.request
        if len(fetch.shards) == len(fetch.order):
            self.post(request.peer, BufferValue(shards=[fetch.shards[k] for k in fetch.order]),
                      reply_to=request.msg_id)
        else:
            self.post(request.peer, Error(code="unavailable", message="a shard could not be fetched"),
                      reply_to=request.msg_id)
        self._run(FetchEnded(request.peer.encode(), fetch.buffer), None)

    def _peer_lost(self, control: str, error: Any) -> None:
        """The executor at ``control`` is gone: fetches waiting on it fail (the core fails the rest)."""
        self._lost.add(control)
        self._fenced.pop(control, None)
        for msg_id, (fetch, _, where) in list(self._fetches.items()):
            if where == control:
                del self._fetches[msg_id]
                self.post(fetch.request.peer, error_message(error), reply_to=fetch.request.msg_id)
                self._run(FetchEnded(fetch.request.peer.encode(), fetch.buffer), None)
