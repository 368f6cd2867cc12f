"""The island scheduler's single order (IslandOrder), driven directly with ScheduleRun messages."""

from __future__ import annotations

from pwmesh.scheduler.order import IslandOrder, OrderEntry, SendEnqueue
from pwmesh.wire.messages import Computation, Enqueue, ScheduleRun, ShardTask


def computation(node: int, executor: str, devices: int = 1) -> Computation:
    return Computation(node=node, fn_id=f"fn{node}", executor_id=executor, control=f"tcp://{executor}:1",
                       shards=[ShardTask(device=d, inputs=[], outputs=[]) for d in range(devices)], sends=[])


def schedule_run(run_id: str, placements: list[tuple[int, str]], proxy: str = "tcp://proxy") -> ScheduleRun:
    return ScheduleRun(run_id=run_id, proxy=proxy, computations=[computation(n, ex) for n, ex in placements])


def enqueues(actions: list[SendEnqueue]) -> dict[str, Enqueue]:
    by_control = {a.control: a.enqueue for a in actions}
    assert len(by_control) == len(actions), "one SendEnqueue per executor per run"
    return by_control


def test_sequence_numbers_are_consecutive_from_zero() -> None:
    order = IslandOrder(island=0)
    run = schedule_run("r1", [(0, "a"), (0, "b"), (1, "a"), (1, "b")])
    order.handle(run)
    assert [c.seq for c in run.computations] == [0, 1, 2, 3]
    assert order.next_seq == 4


def test_sequence_numbers_are_global_across_runs() -> None:
    order = IslandOrder(island=0)
    runs = [schedule_run("r1", [(0, "a"), (1, "b")]), schedule_run("r2", [(0, "b")]),
            schedule_run("r3", [(0, "a"), (1, "a"), (2, "c")])]
    seqs = []
    for run in runs:
        order.handle(run)
        seqs.extend(c.seq for c in run.computations)
    assert seqs == list(range(6))
    assert order.next_seq == 6


def test_each_executor_gets_its_computations_in_island_order() -> None:
    order = IslandOrder(island=0)
    run = schedule_run("r1", [(0, "a"), (0, "b"), (1, "b"), (2, "a"), (2, "b"), (3, "c")])
    by_control = enqueues(order.handle(run))
    assert set(by_control) == {"tcp://a:1", "tcp://b:1", "tcp://c:1"}
    assert [(c.node, c.seq) for c in by_control["tcp://a:1"].computations] == [(0, 0), (2, 3)]
    assert [(c.node, c.seq) for c in by_control["tcp://b:1"].computations] == [(0, 1), (1, 2), (2, 4)]
    assert [(c.node, c.seq) for c in by_control["tcp://c:1"].computations] == [(3, 5)]
    for control, enqueue in by_control.items():
        assert all(c.control == control for c in enqueue.computations)


def test_one_enqueue_per_executor_per_run_carrying_the_run() -> None:
    order = IslandOrder(island=0)
    first = order.handle(schedule_run("r1", [(0, "a"), (1, "a"), (2, "a")], proxy="tcp://p1"))
    second = order.handle(schedule_run("r2", [(0, "a"), (0, "b")], proxy="tcp://p2"))
    assert len(first) == 1
    assert (first[0].enqueue.run_id, first[0].enqueue.proxy) == ("r1", "tcp://p1")
    assert [c.seq for c in first[0].enqueue.computations] == [0, 1, 2]
    by_control = enqueues(second)
    assert set(by_control) == {"tcp://a:1", "tcp://b:1"}
    assert all((e.run_id, e.proxy) == ("r2", "tcp://p2") for e in by_control.values())
    assert [c.seq for c in by_control["tcp://a:1"].computations] == [3]
    assert [c.seq for c in by_control["tcp://b:1"].computations] == [4]


def test_computations_keep_their_shards() -> None:
    order = IslandOrder(island=0)
    run = ScheduleRun(run_id="r1", proxy="p", computations=[computation(0, "a", devices=4)])
    (action,) = order.handle(run)
    assert [s.device for s in action.enqueue.computations[0].shards] == [0, 1, 2, 3]


def test_an_empty_run_sends_nothing() -> None:
    order = IslandOrder(island=0)
    order.handle(schedule_run("r1", [(0, "a")]))
    assert order.handle(schedule_run("r2", [])) == []
    assert order.next_seq == 1
    assert [c.seq for c in order.handle(schedule_run("r3", [(0, "a")]))[0].enqueue.computations] == [1]


def test_history_records_every_entry_in_order() -> None:
    order = IslandOrder(island=3)
    order.handle(schedule_run("r1", [(0, "a"), (1, "b")]))
    order.handle(schedule_run("r2", [(0, "b")]))
    assert list(order.history) == [
        OrderEntry(seq=0, run_id="r1", node=0, executor_id="a"),
        OrderEntry(seq=1, run_id="r1", node=1, executor_id="b"),
        OrderEntry(seq=2, run_id="r2", node=0, executor_id="b"),
    ]


def test_history_is_bounded_but_sequence_numbers_are_not() -> None:
    order = IslandOrder(island=0, history=3)
    for i in range(4):
        order.handle(schedule_run(f"r{i}", [(0, "a"), (1, "b")]))
    assert [e.seq for e in order.history] == [5, 6, 7]
    assert [e.run_id for e in order.history] == ["r2", "r3", "r3"]
    assert order.next_seq == 8


def test_islands_keep_separate_orders() -> None:
    first, second = IslandOrder(island=0), IslandOrder(island=1)
    first.handle(schedule_run("r1", [(0, "a"), (1, "a")]))
    run = schedule_run("r1", [(2, "b")])
    second.handle(run)
    assert run.computations[0].seq == 0
    assert first.next_seq == 2 and second.next_seq == 1
