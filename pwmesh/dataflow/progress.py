"""Progress tracking: when has a consumer shard received everything it will get?

Every tuple travels tagged with its destination — a key naming one shard of one
edge of one step (``"<owner>/<buffer>/<shard>"``: buffer names are never reused,
so a key is one edge in one run) — and with the producer shard that sent it.
Every producer shard that could send to a destination sends it one *marker*
saying how many tuples it sent there in all, zero included, and every tuple and
marker says how many producers will report. A destination is complete when all
of them have reported and every announced tuple is in: that is how an edge can
be sparse (most destinations of a routed edge get no data, only markers) and how
a consumer that receives nothing still knows it is done.

Pure: no sockets, no arrays' contents, no clocks. Malformed progress — a second
marker from one producer, a tuple sent twice, more tuples than announced, a
disagreement on the number of producers, anything for a destination already
complete — raises ``ProgressError``; the destination's state is left unchanged.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from pwmesh.errors import ProtocolError, PwmeshError


class ProgressError(ProtocolError):
    """A tuple or marker that contradicts what the destination has already seen."""


@dataclasses.dataclass(frozen=True, slots=True)
class Arrived:
    """Everything for ``key`` is here: the tuples' payloads in (producer, sequence) order."""

    key: str
    payloads: list[Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
    """A producer of ``key`` failed: the destination fails with its error."""

    key: str
    error: PwmeshError


@dataclasses.dataclass
class _Inbox:
    sources: int  # producers that will report
    markers: dict[int, int] = dataclasses.field(default_factory=dict)  # producer -> tuples it sent
    tuples: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)  # (producer, seq) -> payload
    per_source: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)

    def complete(self) -> bool:
        return len(self.markers) == self.sources and all(
            self.per_source[src] == count for src, count in self.markers.items())


class Progress:
    """The destinations of one executor: tuples and markers in, completions out."""

    def __init__(self, remember: int = 100_000) -> None:
        self._inboxes: dict[str, _Inbox] = {}
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()  # complete, failed, forgotten
        self._remember = remember

    def __len__(self) -> int:
        """Destinations waiting for more."""
        return len(self._inboxes)

    def pending(self) -> dict[str, tuple[int, int]]:
        """Waiting destinations: key -> (producers reported, producers expected)."""
        return {key: (len(box.markers), box.sources) for key, box in self._inboxes.items()}

    def tuple(self, key: str, src: int, seq: int, sources: int, payload: Any) -> Arrived | None:
        """Tuple number ``seq`` from producer ``src`` arrived for ``key``."""
        if seq < 0:
            raise ProgressError(f"{key}: tuple sequence numbers start at 0, got {seq}")
        box = self._inbox(key, src, sources)
        if (src, seq) in box.tuples:
            raise ProgressError(f"{key}: tuple {seq} from producer {src} arrived twice")
        announced = box.markers.get(src)
        if announced is not None and not 0 <= seq < announced:
            raise ProgressError(f"{key}: tuple {seq} from producer {src}, which announced only {announced}")
        box.tuples[(src, seq)] = payload
        box.per_source[src] += 1
        return self._maybe_done(key, box)

    def marker(self, key: str, src: int, count: int, sources: int) -> Arrived | None:
        """Producer ``src`` has sent ``count`` tuples to ``key`` in all (possibly none)."""
        if count < 0:
            raise ProgressError(f"{key}: producer {src} announced a negative number of tuples ({count})")
        box = self._inbox(key, src, sources)
        if src in box.markers:
            raise ProgressError(f"{key}: a second completion marker from producer {src}")
        if count < box.per_source[src]:
            raise ProgressError(f"{key}: producer {src} announced {count} tuples but {box.per_source[src]} "
                                "arrived already")
        if any(seq >= count for s, seq in box.tuples if s == src):
            raise ProgressError(f"{key}: producer {src} announced {count} tuples but sent a later one")
        box.markers[src] = count
        return self._maybe_done(key, box)

    def fail(self, key: str, error: PwmeshError) -> Failed | None:
        """A producer of ``key`` failed: the destination ends now (later tuples for it are dropped)."""
        if key in self._ended:
            return None
        self._inboxes.pop(key, None)
        self._end(key)
        return Failed(key, error)

    def forget(self, prefix: str) -> int:
        """Drop the destinations under ``prefix`` (a deleted buffer, a cancelled run); returns how many."""
        gone = [k for k in self._inboxes if k.startswith(prefix)]
        for key in gone:
            del self._inboxes[key]
            self._end(key)
        return len(gone)

    def ended(self, key: str) -> bool:
        return key in self._ended

    def _inbox(self, key: str, src: int, sources: int) -> _Inbox:
        if key in self._ended:
            raise ProgressError(f"{key}: progress from producer {src} after the destination completed")
        if sources < 1:
            raise ProgressError(f"{key}: {sources} producers; a destination has at least one")
        box = self._inboxes.get(key)
        if box is None:
            box = self._inboxes[key] = _Inbox(sources)
        elif box.sources != sources:
            raise ProgressError(f"{key}: producer {src} says {sources} producers report, others said {box.sources}")
        return box

    def _maybe_done(self, key: str, box: _Inbox) -> Arrived | None:
        if not box.complete():
            return None
        del self._inboxes[key]
        self._end(key)
        return Arrived(key, [box.tuples[k] for k in sorted(box.tuples)])

    def _end(self, key: str) -> None:
        self._ended[key] = None
        while len(self._ended) > self._remember:
            self._ended.popitem(last=False)
