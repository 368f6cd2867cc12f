"""The executor's device queues (``pwmesh.executor.queues``): a pure state machine, tested with no
threads, no JAX and no event loop. Its shell (``Runner``) is tested in test_fast_path.py,
test_streaming.py and test_backpressure.py."""

from __future__ import annotations

from pwmesh.executor.queues import DeviceQueues, PartDone, Start
from pwmesh.executor.work import Work
from pwmesh.wire.messages import Computation, ShardRun


def work(run: str, node: int, devices: list[int], scheduler: str = "s", seconds: float = 0.0) -> Work:
    comp = Computation(node=node, fn_id="f", executor_id="e", control="c", inputs=[], outputs=[],
                       runs=[ShardRun(device=d, shard=i) for i, d in enumerate(devices)])
    w = Work(run, "p", scheduler, comp, devices, list(range(len(devices))))
    w.queued, w.device_seconds = True, seconds
    return w


def enqueue(q: DeviceQueues, *works: Work) -> list[Start]:
    starts = []
    for w in works:
        q.add(w)
        starts += q.queue(w)
    return starts


def started(actions: list[Start] | list[PartDone]) -> list[Work]:
    return [a.work for a in actions if isinstance(a, Start)]


def test_a_device_runs_one_computation_at_a_time_in_queue_order() -> None:
    q = DeviceQueues(2)
    a, b = work("r", 0, [0]), work("r", 1, [0])
    assert started(enqueue(q, a, b)) == [a]
    assert q.queued() == [1, 0], "b waits behind a"
    assert started(q.release(a)) == [b]
    assert started(q.release(b)) == []


def test_a_computation_starts_once_it_heads_every_one_of_its_devices_and_nothing_overtakes_it() -> None:
    q = DeviceQueues(2)
    busy = work("r", 0, [1])
    gang = work("r", 1, [0, 1])
    behind = work("r", 2, [0])
    assert started(enqueue(q, busy, gang, behind)) == [busy]
    # Device 0 is free, but holds the gang (at its head) until device 1 gets there too: ``behind`` waits.
    assert started(q.release(busy)) == [gang]
    assert started(q.release(gang)) == [behind]


def test_computations_on_disjoint_devices_start_independently() -> None:
    q = DeviceQueues(3)
    a, b, c = work("r", 0, [0]), work("r", 1, [1, 2]), work("s", 0, [2])
    assert started(enqueue(q, a, b, c)) == [a, b]
    assert started(q.release(a)) == []
    assert started(q.release(b)) == [c]


def test_a_part_ends_once_every_computation_completed_and_none_is_still_being_enqueued() -> None:
    q = DeviceQueues(1)
    q.admitting("r")
    a, b = work("r", 0, [0], seconds=0.25), work("r", 1, [0], seconds=0.5)
    enqueue(q, a, b)
    q.release(a)
    assert q.complete(a) == [], "b is still to come"
    q.release(b)
    assert q.complete(b) == [], "the run is still being enqueued"
    assert q.admitted("r", "s") == [PartDone("r", "s", 0.75)]
    assert q.outstanding == 0 and q.executed == 2 and a.finished and b.finished


def test_a_streamed_computation_frees_its_devices_before_it_completes() -> None:
    q = DeviceQueues(1)
    q.admitting("r")
    a, b = work("r", 0, [0]), work("r", 1, [0])
    enqueue(q, a, b)
    assert q.admitted("r", "s") == []
    assert started(q.release(a)) == [b], "handed to its device's stream: the next one goes on"
    q.release(b)
    assert q.complete(a) == []
    assert q.complete(b) == [PartDone("r", "s", 0.0)]


def test_a_run_enqueued_with_nothing_queued_ends_its_part_when_admitted() -> None:
    q = DeviceQueues(1)
    q.admitting("r")
    quick = work("r", 0, [0])
    quick.queued = False  # it ran at once (the fast path): never queued
    q.add(quick)
    assert q.free(quick)
    assert q.complete(quick) == []
    assert q.admitted("r", "s") == [PartDone("r", "s", 0.0)]


def test_only_a_computation_alone_on_its_devices_is_free_to_run_at_once() -> None:
    q = DeviceQueues(2)
    a = work("r", 0, [0])
    enqueue(q, a)
    b, c = work("r", 1, [0, 1]), work("r", 2, [1])
    q.add(b)
    q.add(c)
    assert not q.free(b) and not q.free(c), "device 0 has a; device 1 has b and c"


def test_cancelling_a_run_names_its_waiting_work_and_its_one_by_one_nodes_only() -> None:
    q = DeviceQueues(1)
    mine, one_by_one, other = work("r1", 0, [0]), work("r1#3", 3, [0]), work("r10", 0, [0])
    enqueue(q, mine, one_by_one, other)
    assert q.of_run("r1") == [mine, one_by_one]
    q.release(mine)
    q.complete(mine)
    assert q.of_run("r1") == [one_by_one], "what completed waits for nothing"
