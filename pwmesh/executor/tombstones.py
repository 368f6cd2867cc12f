"""The buffers an executor deleted, remembered in memory that does not grow with a session's length.

Buffer names are never reused, so the object store remembers every deleted one: data for it that
arrives late is dropped instead of leaking, and a late read fails at once instead of waiting for
ever. Kept as a set of names, that memory grew by ~90 bytes per deleted buffer: a training loop
deletes a step's 160 outputs a step, ~14 KB, and an executor grew by ~2.5 MB a second for as long as
a session ran (10 GB an hour of a tiny model's training).

Two facts bound it. A proxy names a session's buffers ``<owner>/<marker>t<n>`` or
``<owner>/<marker>b<client id>.<n>`` with ``n`` from one counter per session and proxy (the marker
tells a restarted proxy's names from its predecessor's), so the deleted ones of a stem
(``<owner>/<marker>``) are a set of integers, which consecutive deletes make ranges: one for a
training loop's every step or few (a buffer that lives on, or lives on another executor only, leaves
a gap). And a buffer whose shards here all came whole from one SPMD computation on this executor
(``complete``) has nothing left to arrive: once it falls out of the recent names it needs no
tombstone at all.

So: the newest ``RECENT`` names are kept as they are (a late read of any of them still fails at
once); older ones go to their stem's ranges (parsing a name costs ~1 us, paid once as it ages, and
only by a name that was not complete), names of any other form to a set. A stem keeps its newest
``MAX_RANGES`` ranges and the set its newest ``RECENT`` names: what is older than that (hundreds of
thousands of deletes ago, where data in flight lives seconds) is forgotten, so the memory is bounded
(a few MB) however long a session runs. Pure: no asyncio.
"""

from __future__ import annotations

import bisect
import collections
from typing import Any

RECENT = 1 << 16  # names kept as they are: the newest deletes, which late arrivals and reads race
MAX_RANGES = 50_000  # a stem's newest ranges kept (two ints each)


def parse(buffer: str) -> tuple[str, int] | None:
    """``(stem, n)`` of a proxy's name (``"s1/t7"`` -> ``("s1/", 7)``, ``"s1/b3.8"`` -> ``("s1/", 8)``,
    ``"s1/r0a1b2c3d.b5.9"`` -> ``("s1/r0a1b2c3d.", 9)``), or None for a name of another form."""
    owner, slash, name = buffer.partition("/")
    if not slash:
        return None
    marker = ""
    if name[:1] == "r" and name[9:10] == ".":  # a restarted proxy's: r<8 hex digits>.
        marker, name = name[:10], name[10:]
    kind = name[:1]
    if kind == "t":
        digits = name[1:]
    elif kind == "b":
        client, dot, digits = name[1:].partition(".")
        if not dot or not (client.isascii() and client.isdigit()):
            return None
    else:
        return None
    if not (digits.isascii() and digits.isdigit()):
        return None
    return f"{owner}/{marker}", int(digits)


class Ranges:
    """A set of integers as sorted, disjoint, non-touching half-open ranges ``[lo, hi)``."""

    __slots__ = ("_hi", "_lo")

    def __init__(self) -> None:
        self._lo: list[int] = []
        self._hi: list[int] = []

    def add(self, n: int) -> None:
        hi = self._hi
        if hi and n == hi[-1]:  # the usual case: deletes come in about the order names were given
            hi[-1] = n + 1
        else:
            self.add_range(n, n + 1)

    def add_range(self, lo: int, hi: int) -> None:
        """Add ``[lo, hi)``, merged with every range it overlaps or touches."""
        i = bisect.bisect_left(self._hi, lo)  # the first range ending at or after lo
        j = bisect.bisect_right(self._lo, hi)  # past the last range starting at or before hi
        if i < j:
            lo, hi = min(lo, self._lo[i]), max(hi, self._hi[j - 1])
        self._lo[i:j] = [lo]
        self._hi[i:j] = [hi]

    def drop_oldest(self, keep: int) -> None:
        """Keep only the ``keep`` highest ranges."""
        if len(self._lo) > keep:
            del self._lo[:-keep], self._hi[:-keep]

    def __contains__(self, n: int) -> bool:
        i = bisect.bisect_right(self._lo, n)
        return i > 0 and n < self._hi[i - 1]

    def __len__(self) -> int:
        """How many ranges (not integers)."""
        return len(self._lo)

    def export(self) -> list[int]:
        """``[lo, hi, lo, hi, ...]``."""
        return [x for pair in zip(self._lo, self._hi, strict=True) for x in pair]


class Tombstones:
    """Deleted buffers (``"<owner>/<name>"``): ``add``, ``in``, ``forget`` an owner's, ``export``/``restore``."""

    def __init__(self, recent: int = RECENT) -> None:
        self.recent = recent
        # Oldest first. OrderedDicts: a plain dict drained from the front scans the slots its deletes left
        # (~12 us a pop at this size, against ~1 for an OrderedDict's ``popitem(last=False)``).
        self._recent: collections.OrderedDict[str, bool] = collections.OrderedDict()  # name -> complete
        self._ranges: dict[str, Ranges] = {}  # stem -> its deleted numbers, once they aged
        self._other: collections.OrderedDict[str, None] = collections.OrderedDict()  # aged names of no proxy's form

    def add(self, buffer: str, complete: bool = False) -> None:
        """``buffer`` was deleted; ``complete``: nothing of it can arrive any more (see the module)."""
        recent = self._recent
        recent[buffer] = complete
        if len(recent) > self.recent:
            old, was_complete = recent.popitem(last=False)
            if not was_complete:
                self._age(old)

    def _age(self, buffer: str) -> None:
        parsed = parse(buffer)
        if parsed is None:
            self._other[buffer] = None
            if len(self._other) > self.recent:
                self._other.popitem(last=False)
            return
        stem, n = parsed
        ranges = self._ranges.get(stem)
        if ranges is None:
            ranges = self._ranges[stem] = Ranges()
        ranges.add(n)
        if len(ranges) > MAX_RANGES + 1_000:  # trimmed now and then, not at every add
            ranges.drop_oldest(MAX_RANGES)

    def __contains__(self, buffer: str) -> bool:
        if buffer in self._recent or buffer in self._other:
            return True
        if not self._ranges:
            return False
        parsed = parse(buffer)
        if parsed is None:
            return False
        ranges = self._ranges.get(parsed[0])
        return ranges is not None and parsed[1] in ranges

    def recently(self, buffer: str) -> bool:
        """Whether ``buffer`` is among the newest deletes (a dictionary lookup: no name is parsed)."""
        return buffer in self._recent

    def forget(self, prefix: str) -> None:
        """Drop the tombstones of the buffers whose names begin with ``prefix`` (an owner's)."""
        self._recent = collections.OrderedDict((k, v) for k, v in self._recent.items() if not k.startswith(prefix))
        self._other = collections.OrderedDict((k, None) for k in self._other if not k.startswith(prefix))
        self._ranges = {k: v for k, v in self._ranges.items() if not k.startswith(prefix)}

    def __len__(self) -> int:
        """Entries held (names and ranges): what the memory grows with."""
        return len(self._recent) + len(self._other) + sum(len(r) for r in self._ranges.values())

    def export(self) -> list[Any]:
        """A msgpack-able copy (``restore`` takes it): names, and ``[stem, lo, hi, lo, hi, ...]`` lists."""
        names: list[Any] = [k for k, complete in self._recent.items() if not complete]
        names += sorted(self._other)
        names += [[stem, *ranges.export()] for stem, ranges in sorted(self._ranges.items())]
        return names

    def restore(self, exported: list[Any]) -> None:
        """Add what ``export`` gave (a restarted executor's tombstones)."""
        for entry in exported:
            if isinstance(entry, str):
                self.add(entry)
                continue
            stem, *flat = entry
            ranges = self._ranges.get(stem)
            if ranges is None:
                ranges = self._ranges[stem] = Ranges()
            for lo, hi in zip(flat[::2], flat[1::2], strict=True):
                ranges.add_range(int(lo), int(hi))
