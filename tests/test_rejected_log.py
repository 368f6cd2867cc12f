"""Rejected frames are logged at most once per peer per interval, with a count (no disk-filling junk)."""

from __future__ import annotations

import logging

import pytest

from pwmesh.core.ratelimit import RejectedLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_from_one_peer_is_one_line_per_interval_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    rejected = RejectedLog("proxy", interval_seconds=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="pwmesh.service.rpc"):
        for i in range(6000):
            clock.now = i * 0.001  # 6,000 junk frames in 6 s
            rejected.rejected(b"junk", "not a pwmesh frame")
        clock.now = 12.0
        rejected.rejected(b"junk", "not a pwmesh frame")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0] == "proxy: rejected frame from b'junk': not a pwmesh frame"
    assert lines[1] == "proxy: rejected frame from b'junk': not a pwmesh frame (5999 more from it in the last 12 s)"


def test_each_peer_has_its_own_interval_and_the_remembered_peers_are_bounded(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    rejected = RejectedLog("rm", interval_seconds=10.0, peers=8, clock=clock)
    with caplog.at_level(logging.WARNING, logger="pwmesh.service.rpc"):
        for peer in range(100):
            rejected.rejected(peer, "bad")
            rejected.rejected(peer, "bad")
    assert len(caplog.records) == 100, "the first frame of each peer is logged, the second not"
    assert len(rejected._seen) == 8


def test_a_warning_a_peer_can_repeat_is_one_line_per_key_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    """Found by fuzzing 10^6 frames per socket: the RM's notices of junk executors made the proxy and the
    scheduler write a warning each (2.3 and 3.4 MB of log)."""
    clock = Clock()
    notices = RejectedLog("proxy", interval_seconds=10.0, clock=clock, logger=logging.getLogger("pwmesh.test"))
    with caplog.at_level(logging.WARNING, logger="pwmesh.test"):
        for i in range(1000):
            clock.now = i * 0.005
            notices.warning("rm.executor_restarting", "notice %s not applied: %s", "rm.executor_restarting", f"x{i}")
        notices.warning("rm.executor_lost", "notice %s not applied: %s", "rm.executor_lost", "y")
        clock.now = 10.0
        notices.warning("rm.executor_restarting", "notice %s not applied: %s", "rm.executor_restarting", "z")
    assert [r.getMessage() for r in caplog.records] == [
        "notice rm.executor_restarting not applied: x0",
        "notice rm.executor_lost not applied: y",
        "notice rm.executor_restarting not applied: z (999 more like it in the last 10 s)"]
