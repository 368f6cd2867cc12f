"""A simulated daemon: an address on the in-memory network that handles one message at a time.

A controller daemon (RM, island scheduler, proxy) is one event loop: a message waits
while the one before it is handled. ``service_seconds`` is what handling one costs in
virtual time (fixed), and with ``charge_cpu`` the real CPU time its pure core took is
added, so a core that cannot keep up makes the messages queue and the simulated run
slow down: where one controller saturates shows in the simulated times. By default
both are zero and a run is deterministic. What a message's handling posts leaves when
its handling ends.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any, TypeVar

from pwmesh.sim.clock import Clock
from pwmesh.sim.network import Network
from pwmesh.wire import Envelope, Message, encode

T = TypeVar("T")


class Node:
    def __init__(self, address: str, clock: Clock, network: Network, *, service_seconds: float = 0.0,
                 charge_cpu: bool = False, charge_codec: bool = False) -> None:
        self.address = address
        self.clock = clock
        self.network = network
        self.service_seconds = service_seconds
        self.charge_cpu = charge_cpu
        # The real CPU of decoding each message it handles and encoding each it sends, charged too: what its
        # shell spends on the wire codec, per message (the cores' CPU does not include it).
        self.charge_codec = charge_codec
        self.codec_seconds = 0.0
        self.cpu_seconds = 0.0  # real CPU time inside this daemon's pure core (``core``)
        self.core_calls = 0
        self.handled = 0
        self.busy_seconds = 0.0  # virtual time spent handling (service + charged CPU)
        self.busy_log: list[tuple[float, float]] = []  # (start, virtual seconds) of every timed handling
        self._backlog: collections.deque[tuple[Envelope, float]] = collections.deque()
        self._busy_until = 0.0
        self._draining = False
        self._charged = 0.0  # CPU of the message being handled
        self._outbox: list[tuple[str, Message, int | None, int, str]] | None = None
        network.attach(address, self._arrive)

    # ------------------------------------------------------------ subclasses

    def handle(self, env: Envelope) -> None:
        raise NotImplementedError

    def core(self, fn: Callable[..., T], *args: Any) -> T:
        """Call the pure core: its real CPU time is counted (and charged, with ``charge_cpu``)."""
        start = time.process_time()
        try:
            return fn(*args)
        finally:
            spent = time.process_time() - start
            self.cpu_seconds += spent
            self.core_calls += 1
            self._charged += spent

    def post(self, dst: str, message: Message, *, reply_to: int | None = None, tag: str = "") -> int:
        """Send ``message`` to ``dst`` (when the message being handled is done, if handling takes time);
        returns its message id, which a reply to it names."""
        msg_id = self.network.new_id()
        if self._outbox is not None:
            self._outbox.append((dst, message, reply_to, msg_id, tag))
        else:
            self.network.send(self.address, dst, message, reply_to=reply_to, msg_id=msg_id, tag=tag)
        return msg_id

    def busy_between(self, start: float, end: float) -> float:
        """Virtual seconds spent handling messages between ``start`` and ``end`` (a busy daemon: close to
        ``end - start``)."""
        return sum(max(0.0, min(t + cost, end) - max(t, start)) for t, cost in self.busy_log
                   if t < end and t + cost > start)

    # ------------------------------------------------------------- the loop

    def _arrive(self, env: Envelope) -> None:
        decoded = self.network.decode_seconds
        if self._draining or self.clock.now < self._busy_until:
            self._backlog.append((env, decoded))
            if not self._draining:
                self._draining = True
                self.clock.at(self._busy_until, self._drain)
            return
        self._handle(env, decoded)

    def _drain(self) -> None:
        self._draining = False
        while self._backlog and self.clock.now >= self._busy_until:
            self._handle(*self._backlog.popleft())
        if self._backlog:
            self._draining = True
            self.clock.at(self._busy_until, self._drain)

    def _handle(self, env: Envelope, decoded: float = 0.0) -> None:
        self.handled += 1
        timed = self.service_seconds > 0 or self.charge_cpu or self.charge_codec
        if not timed:
            self.handle(env)
            return
        self._charged = 0.0
        self._outbox = []
        try:
            self.handle(env)
        finally:
            outbox, self._outbox = self._outbox, None
        cost = self.service_seconds + (self._charged if self.charge_cpu else 0.0)
        frames: list[list[Any] | None] = [None] * len(outbox)
        if self.charge_codec:
            start = time.process_time()
            frames = [encode(message, msg_id=msg_id, reply_to=reply_to, sender=self.address)
                      for _, message, reply_to, msg_id, _ in outbox]
            codec = decoded + time.process_time() - start
            self.codec_seconds += codec
            cost += codec
        self.busy_seconds += cost
        self.busy_log.append((self.clock.now, cost))
        self._busy_until = self.clock.now + cost

        def flush() -> None:
            for (dst, message, reply_to, msg_id, tag), encoded in zip(outbox, frames, strict=True):
                self.network.send(self.address, dst, message, reply_to=reply_to, msg_id=msg_id, tag=tag,
                                  frames=encoded)

        if outbox:
            self.clock.at(self._busy_until, flush)
