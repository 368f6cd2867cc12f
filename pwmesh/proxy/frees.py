"""The frees the proxy sent to islands' schedulers that may not have reached their executors yet (no sockets).

A ``FreeShards`` goes to an island's scheduler, which sends each executor its ``DeleteShards``. A
scheduler that dies with one in flight (queued to it, or read but not fanned out) loses it, and those
buffers would stay on the executors until their session ends. Posts get no answer, so the proxy keeps
each ``FreeShards`` it sent a scheduler until it knows the scheduler handled it: the proxy's messages to
a scheduler arrive in the order sent, so once the scheduler reports on a run (``IslandDone``) sent to it
after a free, it read that free first and fanned it out then. When the scheduler is lost
(``SchedulerLost``) what is still kept goes again, as one ``DeleteShards`` per executor: deletes are
idempotent (a name is never reused; a deleted one is a tombstone), so a free sent twice costs nothing.
"""

from __future__ import annotations

import collections

from pwmesh.wire.messages import FreeShards

MAX_KEPT = 4096  # frees kept per scheduler; past this the oldest are taken as delivered (runs confirm them)
MAX_MARKS = 4096  # runs per scheduler that would confirm frees (an aborted run never reports: forgotten)


class KeptFrees:
    """Per scheduler address: the ``FreeShards`` not known to be fanned out, numbered in the order sent,
    and the runs sent after them (run id -> the number of the last free sent before it)."""

    def __init__(self) -> None:
        self.kept: dict[str, collections.deque[tuple[int, FreeShards]]] = {}
        self._marks: dict[str, dict[str, int]] = {}
        self._count = 0
        self.dropped = 0  # frees taken as delivered unconfirmed (more than ``MAX_KEPT`` kept), ever
        self.resent = 0  # frees sent again per executor because their scheduler was lost, ever

    def __len__(self) -> int:
        return sum(len(kept) for kept in self.kept.values())

    def sent(self, scheduler: str, free: FreeShards) -> None:
        self._count += 1
        kept = self.kept.setdefault(scheduler, collections.deque())
        kept.append((self._count, free))
        if len(kept) > MAX_KEPT:
            kept.popleft()
            self.dropped += 1

    def run_sent(self, scheduler: str, run_id: str) -> None:
        """A run (``ScheduleRun``, ``RunTemplate``) went to ``scheduler``: its report confirms the frees before it."""
        kept = self.kept.get(scheduler)
        if not kept:
            return
        marks = self._marks.setdefault(scheduler, {})
        marks[run_id] = kept[-1][0]
        if len(marks) > MAX_MARKS:
            del marks[next(iter(marks))]

    def heard(self, scheduler: str, run_id: str) -> None:
        """``scheduler`` reported on ``run_id``: it read every free sent it before that run."""
        marks = self._marks.get(scheduler)
        if not marks:
            return
        last = marks.pop(run_id, None)
        if last is None:
            return
        kept = self.kept[scheduler]
        while kept and kept[0][0] <= last:
            kept.popleft()
        if not kept:  # every run marked now confirms nothing more
            del self.kept[scheduler], self._marks[scheduler]

    def lost(self, scheduler: str) -> dict[str, list[str]]:
        """``scheduler`` is gone: what it may not have fanned out, by executor control address -> buffers."""
        self._marks.pop(scheduler, None)
        by_control: dict[str, list[str]] = {}
        for _, free in self.kept.pop(scheduler, ()):
            self.resent += 1
            for group in free.groups:
                for control in group.controls:
                    by_control.setdefault(control, []).extend(group.buffers)
        return by_control
