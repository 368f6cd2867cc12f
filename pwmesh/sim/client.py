"""A simulated client: a script of real client messages, sent to the proxy over the network.

A script is a generator that yields what the client does next — ``Call`` (a request:
the generator resumes with the reply; an ``Error`` reply is thrown into it as the
exception it stands for), ``Post`` (no reply waited for, as ``RunProgram``),
``Sleep`` and ``Mark`` (a labelled instant, for the figures) — so a workload reads
like the client program it stands for. Once its session is open the client sends
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
                 script: Callable[[SimClient], Script],
                 on_mark: Callable[[str, float], None] | None = None) -> None:
        super().__init__(address, clock, network)
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
                    self._waiting = self.post(self.proxy, op.message)
                    return
                if isinstance(op, Sleep):
                    self.clock.after(op.seconds, lambda: self._step(None))
                    return
                if isinstance(op, Post):
                    self.post(self.proxy, op.message)
                elif isinstance(op, Mark):
                    self.marks.append((op.label, self.clock.now))
                    if self.on_mark is not None:
                        self.on_mark(op.label, self.clock.now)
                else:
                    raise TypeError(f"a client script yielded {op!r}")
                op = self._script.send(None)
        except StopIteration:
            self._end(None)
        except PwmeshError as exc:
            self._end(exc)

    def _end(self, failure: PwmeshError | None) -> None:
        self.failure = failure
        self.done = True
        self.finished_at = self.clock.now

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
