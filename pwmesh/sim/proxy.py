"""The proxy in the simulator: ``proxy.state.ProxyState`` behind a thin shell.

The shell turns what arrives into the core's events (a client's request or post, an
executor's ``NodeDone``: ``Inbound``; the RM's news: ``Notice``; the RM's answer to an
``Ask``: ``SliceGranted``) and the core's actions into messages on the network. It
keeps what the daemon keeps outside the core: the requests that wait (``Wait``,
``Fetching``, an ``Ask``) and the posts held for a restarting executor.
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
from pwmesh.sim.clock import Clock
from pwmesh.sim.controller import error_message
from pwmesh.sim.network import Network
from pwmesh.sim.node import Node
from pwmesh.wire import Envelope, Message
from pwmesh.wire.messages import (
    BufferValue,
    Error,
    FetchShards,
    Ok,
    ShardValues,
    SliceAllocated,
    WatchCluster,
)


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
    """The proxy's shell: events into ``ProxyState``, its actions onto the network."""

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
