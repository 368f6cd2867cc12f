"""Log lines a peer can cause, rate-limited: whatever a peer sends, the log grows by at most a few
lines per interval (a peer repeating one rejected frame, thousands of peers sending one each, a
handler that fails the same way again and again)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class RejectedLog:
    """Rejected frames, logged at most once per peer per ``interval_seconds`` with a count of the rest:
    junk cannot fill a disk with warnings (a WARNING of ~200 bytes per frame, before). At most
    ``peers`` peers are remembered (the oldest forgotten), so many junk peers cannot fill memory, and at
    most ``lines`` lines are written per interval whatever the number of peers (every new connection is
    a new peer): past that, frames are counted and the count is logged with the next line of a later
    interval. Safe to call from several threads (the data plane's stream readers)."""

    def __init__(self, name: str, interval_seconds: float = 10.0, peers: int = 1024, lines: int = 100,
                 clock: Callable[[], float] | None = None, logger: logging.Logger = log) -> None:
        self.name = name
        self.log = logger
        self.interval_seconds = interval_seconds
        self.peers = peers
        self.lines = lines
        self._clock = clock or time.monotonic
        self._seen: dict[Any, tuple[float, int]] = {}  # peer -> (when last logged, rejected since)
        self._lock = threading.Lock()
        self._window = -math.inf  # when the current interval's line budget started
        self._written = 0  # lines written in it
        self._unlogged = 0  # frames from peers over the budget, not yet told
        self._unlogged_since = 0.0

    def rejected(self, peer: Any, reason: str) -> None:
        more = self.allow(peer)
        if more is not None:
            self.log.warning("%s: rejected frame from %r: %s%s", self.name, peer, reason, more,
                             extra={"peer": peer, "reason": reason})

    def warning(self, key: Any, message: str, *args: Any) -> None:
        """``log.warning(message, *args)``, at most once per ``key`` per interval (it ends with the count left out)."""
        more = self.allow(key, "like it")
        if more is not None:
            self.log.warning(message + "%s", *args, more)

    def allow(self, key: Any, alike: str = "from it") -> str | None:
        """Whether a line about ``key`` may be written now: ``None`` if not (it is counted), else the
        suffix that line ends with, telling what was left out since (``""`` if nothing)."""
        with self._lock:
            now = self._clock()
            last = self._seen.pop(key, None)
            if last is not None and now - last[0] < self.interval_seconds:
                self._seen[key] = (last[0], last[1] + 1)
                return None
            if now - self._window >= self.interval_seconds:
                self._window, self._written = now, 0
            if self._written >= self.lines:  # this interval's lines are spent: count, tell later
                if not self._unlogged:
                    self._unlogged_since = now
                self._unlogged += 1
                if last is not None:
                    self._seen[key] = last
                return None
            self._written += 1
            more = f" ({last[1]} more {alike} in the last {now - last[0]:.0f} s)" if last is not None and last[1] else ""
            if self._unlogged:
                more += (f" ({self._unlogged} more from others in the last {now - self._unlogged_since:.0f} s, "
                         f"over the limit of {self.lines} lines per {self.interval_seconds:.0f} s)")
                self._unlogged = 0
            self._seen[key] = (now, 0)
            while len(self._seen) > self.peers:
                self._seen.pop(next(iter(self._seen)))
            return more
