"""The Progress tracker: when a destination shard has everything it will get (pure: no sockets, no arrays)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pwmesh.dataflow.progress import Arrived, Failed, Progress, ProgressError
from pwmesh.errors import DeviceLost

PROPERTY = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=60,
    report_multiple_bugs=False,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow],
)

KEY = "sess1/v1/0"


def snapshot(progress: Progress) -> tuple[int, dict[str, tuple[int, int]], bool]:
    return len(progress), progress.pending(), progress.ended(KEY)


# --------------------------------------------------------------- completion


def test_tuples_then_markers() -> None:
    p = Progress()
    assert p.tuple(KEY, src=0, seq=0, sources=2, payload="a0") is None
    assert p.tuple(KEY, src=1, seq=0, sources=2, payload="b0") is None
    assert p.tuple(KEY, src=0, seq=1, sources=2, payload="a1") is None
    assert p.marker(KEY, src=0, count=2, sources=2) is None
    assert p.pending() == {KEY: (1, 2)}
    assert p.marker(KEY, src=1, count=1, sources=2) == Arrived(KEY, ["a0", "a1", "b0"])
    assert len(p) == 0 and p.pending() == {} and p.ended(KEY)


def test_markers_before_tuples() -> None:
    p = Progress()
    assert p.marker(KEY, src=1, count=1, sources=2) is None
    assert p.marker(KEY, src=0, count=2, sources=2) is None
    assert p.pending() == {KEY: (2, 2)}, "every producer reported, but tuples are still on their way"
    assert p.tuple(KEY, src=0, seq=1, sources=2, payload="a1") is None
    assert p.tuple(KEY, src=1, seq=0, sources=2, payload="b0") is None
    assert p.tuple(KEY, src=0, seq=0, sources=2, payload="a0") == Arrived(KEY, ["a0", "a1", "b0"])
    assert len(p) == 0


def test_payloads_come_in_producer_then_sequence_order_whatever_the_arrival() -> None:
    p = Progress()
    done = None
    for src, seq in [(7, 2), (3, 0), (7, 0), (3, 1), (7, 1)]:
        assert done is None
        done = p.tuple(KEY, src, seq, sources=2, payload=(src, seq))
    assert done is None
    p.marker(KEY, src=7, count=3, sources=2)
    done = p.marker(KEY, src=3, count=2, sources=2)
    assert done == Arrived(KEY, [(3, 0), (3, 1), (7, 0), (7, 1), (7, 2)])


def test_zero_tuple_destination_completes_on_markers_alone() -> None:
    p = Progress()
    assert p.marker(KEY, src=0, count=0, sources=3) is None
    assert p.marker(KEY, src=2, count=0, sources=3) is None
    assert p.marker(KEY, src=1, count=0, sources=3) == Arrived(KEY, [])
    assert p.ended(KEY) and len(p) == 0


def test_single_producer_single_tuple() -> None:
    p = Progress()
    assert p.tuple(KEY, src=0, seq=0, sources=1, payload="x") is None
    assert p.marker(KEY, src=0, count=1, sources=1) == Arrived(KEY, ["x"])


def test_destinations_are_independent() -> None:
    p = Progress()
    other = "sess1/v1/1"
    p.marker(KEY, src=0, count=1, sources=1)
    assert p.marker(other, src=0, count=0, sources=1) == Arrived(other, [])
    assert p.pending() == {KEY: (1, 1)}
    assert p.tuple(KEY, src=0, seq=0, sources=1, payload="x") == Arrived(KEY, ["x"])


# --------------------------------------------------------------- malformed progress: rejected, state unchanged


def rejected(p: Progress, call: str, *args: object, match: str | None) -> None:
    before = snapshot(p)
    with pytest.raises(ProgressError, match=match):
        getattr(p, call)(*args)
    assert snapshot(p) == before


def test_duplicate_tuple_is_rejected_without_changing_state() -> None:
    p = Progress()
    p.tuple(KEY, 0, 0, 1, "first")
    rejected(p, "tuple", KEY, 0, 0, 1, "second", match="arrived twice")
    # The original payload is the one delivered.
    assert p.marker(KEY, 0, 1, 1) == Arrived(KEY, ["first"])


def test_duplicate_marker_is_rejected_without_changing_state() -> None:
    p = Progress()
    p.marker(KEY, 0, 2, 2)
    rejected(p, "marker", KEY, 0, 2, 2, match="second completion marker")
    rejected(p, "marker", KEY, 0, 5, 2, match="second completion marker")  # even with another count
    p.tuple(KEY, 0, 0, 2, "a")
    p.tuple(KEY, 0, 1, 2, "b")
    assert p.marker(KEY, 1, 0, 2) == Arrived(KEY, ["a", "b"])


def test_tuple_beyond_the_announced_count_is_rejected() -> None:
    p = Progress()
    p.marker(KEY, 0, 2, 2)
    rejected(p, "tuple", KEY, 0, 2, 2, "late", match="announced only 2")
    rejected(p, "tuple", KEY, 0, 9, 2, "late", match="announced only 2")


def test_marker_announcing_fewer_tuples_than_arrived_is_rejected() -> None:
    p = Progress()
    p.tuple(KEY, 0, 0, 1, "a")
    p.tuple(KEY, 0, 1, 1, "b")
    rejected(p, "marker", KEY, 0, 1, 1, match="announced 1 tuples")
    assert p.marker(KEY, 0, 2, 1) == Arrived(KEY, ["a", "b"])


def test_marker_below_a_tuple_already_here_is_rejected() -> None:
    """Producer 0 sent tuple 3 but says it sent 2 in all: one of the two is wrong."""
    p = Progress()
    p.tuple(KEY, 0, 3, 1, "d")
    rejected(p, "marker", KEY, 0, 2, 1, match="sent a later one")


def test_sources_disagreement_is_rejected() -> None:
    p = Progress()
    p.tuple(KEY, 0, 0, 2, "a")
    rejected(p, "tuple", KEY, 1, 0, 3, "b", match="3 producers report, others said 2")
    rejected(p, "marker", KEY, 1, 0, 1, match="1 producers report, others said 2")
    p.marker(KEY, 0, 1, 2)
    assert p.marker(KEY, 1, 0, 2) == Arrived(KEY, ["a"])


def test_no_producers_is_rejected() -> None:
    p = Progress()
    rejected(p, "marker", KEY, 0, 0, 0, match="at least one")
    rejected(p, "tuple", KEY, 0, 0, -1, "x", match="at least one")


@pytest.mark.parametrize("call, args", [("tuple", (KEY, 0, -1, 1, "x")), ("marker", (KEY, 0, -1, 1))],
                         ids=["negative-seq", "negative-count"])
def test_malformed_first_progress_leaves_no_destination_behind(call: str, args: tuple[object, ...]) -> None:
    p = Progress()
    rejected(p, call, *args, match=None)


def test_negative_seq_and_count_are_rejected() -> None:
    p = Progress()
    p.marker(KEY, 1, 0, 2)  # the destination exists already: nothing is created by the bad calls
    rejected(p, "tuple", KEY, 0, -1, 2, "x", match="start at 0")
    rejected(p, "marker", KEY, 0, -1, 2, match="negative number of tuples")


# --------------------------------------------------------------- after the end


def test_late_tuples_and_markers_after_completion_are_rejected() -> None:
    p = Progress()
    p.tuple(KEY, 0, 0, 1, "a")
    assert p.marker(KEY, 0, 1, 1) == Arrived(KEY, ["a"])
    rejected(p, "tuple", KEY, 0, 0, 1, "a", match="after the destination completed")
    rejected(p, "tuple", KEY, 0, 1, 1, "b", match="after the destination completed")
    rejected(p, "marker", KEY, 0, 1, 1, match="after the destination completed")
    rejected(p, "marker", KEY, 1, 0, 1, match="after the destination completed")


def test_fail_ends_the_destination_once() -> None:
    p = Progress()
    p.tuple(KEY, 0, 0, 2, "a")
    err = DeviceLost("host b went away")
    assert p.fail(KEY, err) == Failed(KEY, err)
    assert len(p) == 0 and p.ended(KEY)
    assert p.fail(KEY, DeviceLost("again")) is None, "a destination fails once"
    rejected(p, "tuple", KEY, 1, 0, 2, "b", match="after the destination completed")
    rejected(p, "marker", KEY, 1, 0, 2, match="after the destination completed")


def test_fail_before_anything_arrived_and_after_completion() -> None:
    p = Progress()
    err = DeviceLost("lost")
    assert p.fail(KEY, err) == Failed(KEY, err)
    rejected(p, "marker", KEY, 0, 0, 1, match="after the destination completed")
    done = "sess1/v2/0"
    p.marker(done, 0, 0, 1)
    assert p.fail(done, err) is None, "a complete destination cannot fail any more"


def test_forget_drops_waiting_destinations_under_a_prefix() -> None:
    p = Progress()
    for key in ("sess1/v1/0", "sess1/v1/1", "sess1/v10/0", "sess2/v1/0"):
        p.tuple(key, 0, 0, 1, key)
    p.marker("sess1/v1/2", 0, 0, 2)
    assert p.forget("sess1/v1/") == 3
    assert sorted(p.pending()) == ["sess1/v10/0", "sess2/v1/0"]
    assert p.ended("sess1/v1/0") and not p.ended("sess1/v10/0")
    with pytest.raises(ProgressError, match="after the destination completed"):
        p.marker("sess1/v1/0", 0, 1, 1)
    assert p.forget("sess1/v1/") == 0
    assert p.forget("nobody/") == 0
    assert p.marker("sess1/v10/0", 0, 1, 1) == Arrived("sess1/v10/0", ["sess1/v10/0"])


def test_ended_destinations_are_remembered_up_to_a_bound() -> None:
    p = Progress(remember=2)
    for i in range(3):
        p.marker(f"k/{i}", 0, 0, 1)
    assert [p.ended(f"k/{i}") for i in range(3)] == [False, True, True]
    # The oldest one is forgotten: a (very) late marker for it starts a new destination.
    assert p.marker("k/0", 0, 0, 1) == Arrived("k/0", [])


# --------------------------------------------------------------- property


@st.composite
def fan_outs(draw: st.DrawFn) -> dict[str, dict[int, int]]:
    """Destinations -> {producer id: tuples it sends there} (producer ids need not be 0..n-1)."""
    n_dest = draw(st.integers(1, 4))
    out = {}
    for d in range(n_dest):
        producers = draw(st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True))
        out[f"o/b/{d}"] = {src: draw(st.integers(0, 3)) for src in producers}
    return out


@PROPERTY
@given(plan=fan_outs(), data=st.data())
def test_every_destination_completes_once_with_its_payloads_in_order(
        plan: dict[str, dict[int, int]], data: st.DataObject) -> None:
    events: list[tuple[str, str, int, int, int]] = []  # (what, key, src, seq or count, sources)
    for key, counts in plan.items():
        for src, count in counts.items():
            events.append(("marker", key, src, count, len(counts)))
            events.extend(("tuple", key, src, seq, len(counts)) for seq in range(count))
    events = data.draw(st.permutations(events))
    p = Progress()
    arrived: dict[str, list[object]] = {}
    for what, key, src, n, sources in events:
        assert key not in arrived, f"{key}: progress after completion was not refused"
        done = (p.tuple(key, src, n, sources, (key, src, n)) if what == "tuple"
                else p.marker(key, src, n, sources))
        if done is not None:
            assert isinstance(done, Arrived) and done.key == key
            arrived[key] = done.payloads
    assert len(p) == 0 and p.pending() == {}
    for key, counts in plan.items():
        assert arrived[key] == [(key, src, seq) for src in sorted(counts) for seq in range(counts[src])]
        assert p.ended(key)
        # A replay of any of its events is refused.
        src = next(iter(counts))
        with pytest.raises(ProgressError):
            p.marker(key, src, counts[src], len(counts))
