"""Liveness: who beat when, and who has missed their ``timeout_seconds``. Pure: the time is given."""

from __future__ import annotations


class Liveness:
    def __init__(self, timeout_seconds: float) -> None:
        self.timeout_seconds = timeout_seconds
        self._last: dict[str, float] = {}
        self._excused: dict[str, float] = {}  # peer -> silent until then without being lost

    def beat(self, peer: str, now: float) -> None:
        until = self._excused.get(peer, now)
        self._last[peer] = max(now, until)  # a beat does not shorten an excuse

    def excuse(self, peer: str, until: float) -> None:
        """Count ``peer`` as beating until ``until`` (it announced a restart); ``forget`` ends that."""
        self._excused[peer] = until
        self._last[peer] = max(until, self._last.get(peer, until))

    def forget(self, peer: str) -> None:
        self._last.pop(peer, None)
        self._excused.pop(peer, None)

    def expired(self, now: float) -> list[str]:
        """Peers silent for longer than the timeout; they are forgotten once reported."""
        lost = [p for p, t in self._last.items() if now - t > self.timeout_seconds]
        for peer in lost:
            del self._last[peer]
            self._excused.pop(peer, None)
        return lost
