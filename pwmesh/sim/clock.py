"""Virtual time: an event heap that jumps from one event to the next (nothing sleeps).

Events at the same instant run in the order they were scheduled (a sequence number
breaks ties), so a run is a pure function of its inputs and its seeds.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from pwmesh.errors import InvalidArgument


class Clock:
    """``now`` in virtual seconds; ``at``/``after`` schedule callbacks; ``run`` executes them in time order."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events_run = 0
        self._heap: list[tuple[float, int, Callable[[], object]]] = []  # what a callback returns is dropped
        self._seq = itertools.count()

    def at(self, when: float, callback: Callable[[], object]) -> None:
        """Run ``callback`` at virtual time ``when`` (never in the past: the past is ``now``)."""
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), callback))

    def after(self, delay_seconds: float, callback: Callable[[], object]) -> None:
        if delay_seconds < 0:
            raise InvalidArgument(f"a delay cannot be negative, got {delay_seconds}")
        self.at(self.now + delay_seconds, callback)

    @property
    def pending(self) -> int:
        return len(self._heap)

    def run(self, until: float | None = None, max_events: int | None = None) -> int:
        """Run events in time order until none is left, the next is after ``until`` (then ``now`` is
        ``until``), or ``max_events`` ran. Returns how many ran."""
        ran = 0
        heap = self._heap
        while heap:
            when = heap[0][0]
            if until is not None and when > until:
                self.now = until
                break
            if max_events is not None and ran >= max_events:
                break
            _, _, callback = heapq.heappop(heap)
            self.now = when
            callback()
            ran += 1
        self.events_run += ran
        return ran
