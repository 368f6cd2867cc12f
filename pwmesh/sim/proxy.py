"""The proxy in the simulator: ``proxy.state.ProxyState`` behind a thin shell.

The shell turns what arrives into the core's events (a client's request or post, an
island scheduler's ``IslandDone``: ``Inbound``; the RM's news: ``Notice``; the RM's answer to an
``Ask``: ``SliceGranted``) and the core's actions into messages on the network. It
keeps what the daemon keeps outside the core: the requests that wait (``Wait``,
``Fetching``, an ``Ask``) and the posts held for a restarting executor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pwmesh.errors import PwmeshError
from pwmesh.proxy.events import (
    Ask,
    CheckKept,
    Deliver,
    Delivered,
    FencePeer,
    FetchEnded,
    Fetching,
    Inbound,
    KeptChecked,
    Notice,
    Park,
    PeerBack,
    PeerLost,
    Reply,
    Resolve,
    Send,
    SliceGranted,
    Tick,
    Unpark,
    Wait,
    settled,
    sources,
)
from pwmesh.proxy.state import ProxyState
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
    left: int


@dataclasses.dataclass
class _Fetch:
    request: _Request
    session_id: str
    buffer: Any
    shards: dict[str, Any]  # key -> its array, once here
    order: list[str]  # every key, in the order the reply lists them
    left: int
    charge: tuple[str, int] = ("", 0)  # whose bytes in flight it is, and how many (``Fetching``)


class SimProxy(Node):
    """The proxy's shell: events into ``ProxyState``, its actions onto the network."""

    def __init__(self, address: str, clock: Clock, network: Network, state: ProxyState, rm: str,
                 **node: Any) -> None:
        super().__init__(address, clock, network, **node)
        self.state = state
        self.rm = rm
        self.errors: list[Error] = []  # Error replies the proxy got for posts (nobody waits for them)
        self._asks: dict[int, _Request] = {}  # our request id -> the client request it answers
        self._parked: dict[int, _Request] = {}  # requests the core parked (``Park``), by key
        self._waits: dict[int, list[_Waiting]] = {}  # id(buffer) -> who waits for it
        self._fetches: dict[int, tuple[_Fetch, list[str], str]] = {}  # FetchShards id -> (fetch, keys, executor)
        self._lost: set[str] = set()
        self._fenced: dict[str, list[tuple[Message, str]]] = {}
        self._abandoned: set[int] = set()  # FetchShards whose answers nobody waits for any more
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
        if env.reply_to is not None and env.reply_to in self._abandoned:
            self._abandoned.discard(env.reply_to)
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
            elif isinstance(action, Deliver):  # bytes in flight are not simulated: given back at once
                self._send(action.to, action.message, "")
                self._run(Delivered(action.owner, action.nbytes), None)
            elif isinstance(action, Reply):
                self._reply(request, action)
            elif isinstance(action, Ask):
                if request is None:
                    raise RuntimeError(f"the proxy core asked {action.to} outside any request")
                self._asks[self.post(action.to, action.message)] = request
            elif isinstance(action, Park):  # answered at its Unpark
                if request is not None:
                    self._parked[action.key] = request
            elif isinstance(action, Unpark):
                parked = self._parked.pop(action.key, None)
                if parked is not None and action.ask is not None:
                    self._do([action.ask], parked)
                else:
                    self._reply(parked, Reply(error=action.error))
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
            elif isinstance(action, CheckKept):  # simulated executors hold no values: nothing is given back
                self._run(KeptChecked(action.run_id, []), None)
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
        waiting = _Waiting(request, list(action.buffers), len(pending))
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
        failed = settled([buffer])
        if failed is not None:  # an early fetch of it ends with its failure (its shards never come)
            for msg_id, (fetch, _, _) in list(self._fetches.items()):
                if fetch.buffer is buffer:
                    self._abandon(msg_id, failed)

    def _waited(self, waiting: _Waiting) -> None:
        failed = settled(waiting.buffers)
        reply = error_message(failed) if failed is not None else Ok()
        self.post(waiting.request.peer, reply, reply_to=waiting.request.msg_id)

    def _fetch(self, request: _Request | None, action: Fetching) -> None:
        """Ask the executors at once, as the daemon does: they answer when the shards exist."""
        if request is None:
            return
        failed = settled([action.buffer]) if action.buffer.done else None
        wanted = sources(action.session_id, action.buffer)
        by_control: dict[str, list[str]] = {}
        for control, key in wanted:
            by_control.setdefault(control, []).append(key)
        fetch = _Fetch(request, action.session_id, action.buffer, {}, [key for _, key in wanted], len(by_control),
                       (action.owner, action.nbytes))
        lost = next((c for c in by_control if c in self._lost), None)
        if failed is not None or lost is not None:
            self.post(request.peer, error_message(failed) if failed is not None else
                      Error(code="device_lost", message=f"{lost} is gone"), reply_to=request.msg_id)
            self._run(FetchEnded(action.session_id, action.buffer, action.owner, action.nbytes), None)
            return
        if not by_control:
            self._fetch_done(fetch)
        for control, mine in by_control.items():
            self._fetches[self.post(control, FetchShards(keys=mine))] = (fetch, mine, control)

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
        self._run(FetchEnded(fetch.session_id, fetch.buffer, *fetch.charge), None)

    def _abandon(self, msg_id: int, error: Any) -> None:
        """Answer a fetch under way with ``error``; its executors' late answers are dropped."""
        fetch, _, _ = self._fetches.pop(msg_id)
        for other, (f, _, _) in list(self._fetches.items()):
            if f is fetch:
                del self._fetches[other]
                self._abandoned.add(other)
        self._abandoned.add(msg_id)
        self.post(fetch.request.peer, error_message(error), reply_to=fetch.request.msg_id)
        self._run(FetchEnded(fetch.session_id, fetch.buffer, *fetch.charge), None)

    def _peer_lost(self, control: str, error: Any) -> None:
        """The executor at ``control`` is gone: fetches waiting on it fail (the core fails the rest)."""
        self._lost.add(control)
        self._fenced.pop(control, None)
        for msg_id, (_, _, where) in list(self._fetches.items()):
            if where == control and msg_id in self._fetches:
                self._abandon(msg_id, error)
