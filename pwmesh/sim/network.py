"""An in-memory network in virtual time, with the real codec on every control message.

Each ordered pair of addresses is a link: a message occupies it for ``size /
bandwidth`` seconds (so a big message delays those behind it), then arrives
``latency`` plus a seeded random jitter later, never before the message sent on the
same link before it (ZeroMQ keeps per-connection FIFO order, and so does this).
Every control message is ``encode``d into its real frames when sent and ``decode``d
from them when delivered, so its size in bytes is what the wire would carry, and a
message the codec would reject fails here too. Bulk data (the executors' data plane)
moves as byte counts over the same links (``transfer``): it never goes through msgpack
in pwmesh either.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import random
import time
from collections.abc import Callable
from typing import Any

from pwmesh.errors import InvalidArgument, NotFound
from pwmesh.sim.clock import Clock
from pwmesh.wire import Envelope, Message, decode, encode


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """One link's character: one-way latency, bandwidth, and jitter as a fraction of the latency
    (each message waits a further uniform ``[0, jitter * latency)``)."""

    latency_seconds: float = 20e-6
    bandwidth_bytes_per_second: float = 100e9 / 8
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if self.latency_seconds < 0 or self.bandwidth_bytes_per_second <= 0 or self.jitter < 0:
            raise InvalidArgument(f"a link needs latency >= 0, bandwidth > 0 and jitter >= 0, got {self}")


@dataclasses.dataclass
class Traffic:
    """Messages and bytes one address sent or received (control: real frames; data: the data plane)."""

    messages: int = 0
    bytes: int = 0
    data_transfers: int = 0
    data_bytes: int = 0
    by_op: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    tagged_messages: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    tagged_bytes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)


Deliver = Callable[[Envelope], None]


class Network:
    def __init__(self, clock: Clock, link: LinkSpec | None = None, *, seed: int = 0) -> None:
        self.clock = clock
        self.link = link or LinkSpec()
        self.links: dict[tuple[str, str], LinkSpec] = {}  # per (src, dst) overrides
        self.sent: dict[str, Traffic] = collections.defaultdict(Traffic)
        self.received: dict[str, Traffic] = collections.defaultdict(Traffic)
        self._random = random.Random(seed)
        self._nodes: dict[str, Deliver] = {}
        self._busy_until: dict[tuple[str, str], float] = {}  # the link is transmitting until then
        self._last_arrival: dict[tuple[str, str], float] = {}
        self._ids = itertools.count(1)
        self.last_bytes = 0  # the size of the last message sent (its real frames)
        self.decode_seconds = 0.0  # the real CPU the message being delivered took to decode (``sim.node``)

    def attach(self, address: str, deliver: Deliver) -> None:
        if address in self._nodes:
            raise InvalidArgument(f"address {address!r} is attached twice")
        self._nodes[address] = deliver

    def spec(self, src: str, dst: str) -> LinkSpec:
        return self.links.get((src, dst), self.link)

    def _arrival(self, src: str, dst: str, nbytes: int) -> float:
        link, pair, now = self.spec(src, dst), (src, dst), self.clock.now
        start = max(now, self._busy_until.get(pair, now))
        done = start + nbytes / link.bandwidth_bytes_per_second
        self._busy_until[pair] = done
        jitter = self._random.random() * link.jitter * link.latency_seconds if link.jitter else 0.0
        arrival = max(done + link.latency_seconds + jitter, self._last_arrival.get(pair, 0.0))
        self._last_arrival[pair] = arrival
        return arrival

    def new_id(self) -> int:
        return next(self._ids)

    def send(self, src: str, dst: str, message: Message, *, reply_to: int | None = None, msg_id: int | None = None,
             tag: str = "", frames: list[Any] | None = None) -> int:
        """Post ``message`` from ``src`` to ``dst``; returns its message id (a reply carries it as ``reply_to``).
        ``tag`` counts it in a class of its own too (the proxy's dispatch traffic)."""
        deliver = self._nodes.get(dst)
        if deliver is None:
            raise NotFound(f"no simulated daemon at {dst!r} (message {message.op} from {src})")
        if msg_id is None:
            msg_id = self.new_id()
        if frames is None:  # (given: the sender encoded it already, timing it)
            frames = encode(message, msg_id=msg_id, reply_to=reply_to, sender=src)
        nbytes = sum(memoryview(f).nbytes for f in frames)
        self.last_bytes = nbytes
        for traffic in (self.sent[src], self.received[dst]):
            traffic.messages += 1
            traffic.bytes += nbytes
            traffic.by_op[message.op] += 1
            if tag:
                traffic.tagged_messages[tag] += 1
                traffic.tagged_bytes[tag] += nbytes
        self.clock.at(self._arrival(src, dst, nbytes), lambda: self._deliver(deliver, frames))
        return msg_id

    def _deliver(self, deliver: Deliver, frames: list[Any]) -> None:
        start = time.process_time()
        env = decode(frames)
        self.decode_seconds = time.process_time() - start
        deliver(env)

    def transfer(self, src: str, dst: str, nbytes: int, arrived: Callable[[], None]) -> None:
        """Move ``nbytes`` of bulk data from ``src`` to ``dst`` (data-plane addresses); ``arrived`` runs on arrival."""
        for traffic in (self.sent[src], self.received[dst]):
            traffic.data_transfers += 1
            traffic.data_bytes += nbytes
        self.clock.at(self._arrival(src, dst, nbytes), arrived)
