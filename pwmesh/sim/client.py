"""A simulated client: a script of real client messages, sent to the proxy over the network.

A script is a generator that yields what the client does next — ``Call`` (a request:
the generator resumes with the reply; an ``Error`` reply is thrown into it as the
exception it stands for), ``Post`` (no reply waited for, as ``RunProgram``),
``Sleep`` and ``Mark`` (a labelled instant, for the figures) — so a workload reads
like the client program it stands for. ``send_seconds`` is the client library's own time
per message it sends (binding a call, encoding, the socket): messages leave one after
another, each that much after the one before, and a ``Mark`` waits for them. Once its session is open the client sends
``Heartbeat``s at the interval the proxy asked for, until its script ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from typing import Any

from pwmesh.errors import PwmeshError, error_class
from pwmesh.sim.clock import Clock
from pwmesh.sim.network import Network
from pwmesh.sim.node import Node
from pwmesh.wire import Envelope, Message
from pwmesh.wire.messages import Error, Heartbeat, SessionOpened


@dataclasses.dataclass(frozen=True)
class Call:
    message: Message


@dataclasses.dataclass(frozen=True)
class Post:
    message: Message


@dataclasses.dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclasses.dataclass(frozen=True)
class Mark:
    label: str


Op = Call | Post | Sleep | Mark
Script = Generator[Op, Any, None]


class SimClient(Node):
    def __init__(self, name: str, address: str, proxy: str, clock: Clock, network: Network,
                 script: Callable[[SimClient], Script], *, send_seconds: float = 0.0,
                 on_mark: Callable[[str, float], None] | None = None) -> None:
        super().__init__(address, clock, network)
        self.send_seconds = send_seconds
        self._send_free = 0.0  # the client is busy sending until then
        self.name = name
        self.on_mark = on_mark  # told of every Mark (the cluster snapshots its counters at the first step)
        self.proxy = proxy
        self.marks: list[tuple[str, float]] = []
        self.errors: list[Error] = []  # refusals of posts (nobody waited for them)
        self.failure: PwmeshError | None = None  # what ended the script early
        self.done = False
        self.finished_at: float | None = None  # virtual time its script ended
        self._script = script(self)
        self._waiting: int | None = None
        self._heartbeat_seconds: float | None = None

    def start(self, at: float = 0.0) -> None:
        self.clock.at(at, lambda: self._step(None))

    def marked(self, label: str) -> list[float]:
        return [t for name, t in self.marks if name == label]

    def _step(self, value: Any, error: PwmeshError | None = None) -> None:
        try:
            op = self._script.throw(error) if error is not None else self._script.send(value)
            while True:
                if isinstance(op, Call):
                    self._waiting = self._send(op.message)
                    return
                if isinstance(op, Sleep):
                    self.clock.after(op.seconds, lambda: self._step(None))
                    return
                if isinstance(op, Post):
                    self._send(op.message)
                elif isinstance(op, Mark):
                    at = max(self.clock.now, self._send_free)
                    self.marks.append((op.label, at))
                    if self.on_mark is not None:
                        self.on_mark(op.label, at)
                else:
                    raise TypeError(f"a client script yielded {op!r}")
                op = self._script.send(None)
        except StopIteration:
            self._end(None)
        except PwmeshError as exc:
            self._end(exc)

    def _send(self, message: Message) -> int:
        """Post ``message`` to the proxy once the client has spent ``send_seconds`` on it; its message id."""
        if self.send_seconds <= 0:
            return self.post(self.proxy, message)
        self._send_free = max(self.clock.now, self._send_free) + self.send_seconds
        msg_id = self.network.new_id()
        self.clock.at(self._send_free, lambda: self.network.send(self.address, self.proxy, message, msg_id=msg_id))
        return msg_id

    def _end(self, failure: PwmeshError | None) -> None:
        self.failure = failure
        self.done = True
        self.finished_at = max(self.clock.now, self._send_free)

    def handle(self, env: Envelope) -> None:
        msg = env.message
        if env.reply_to is not None and env.reply_to == self._waiting:
            self._waiting = None
            if isinstance(msg, SessionOpened) and self._heartbeat_seconds is None:
                self._heartbeat_seconds = msg.heartbeat_interval_seconds
                self.clock.after(self._heartbeat_seconds, self._heartbeat)
            if isinstance(msg, Error):
                self._step(None, error_class(msg.code)(msg.message))
            else:
                self._step(msg)
        elif isinstance(msg, Error):
            self.errors.append(msg)

    def _heartbeat(self) -> None:
        if self.done or self._heartbeat_seconds is None:
            return
        self.post(self.proxy, Heartbeat(role="client", name=self.name))
        self.clock.after(self._heartbeat_seconds, self._heartbeat)
