"""The island scheduler (IslandOrder), driven directly with messages: its single order,
its window, and its sharing policies — no sockets, no clocks (durations are given). The
policies' long-run shares come from the simulator's closed loop (``pwmesh.sim.island``)."""

from __future__ import annotations

import collections
import random

import pytest

from pwmesh.core.contract import Send
from pwmesh.errors import InvalidArgument
from pwmesh.scheduler.order import IslandOrder
from pwmesh.sim.island import saturate
from pwmesh.sim.island import schedule_run as run
from pwmesh.wire.messages import Enqueue, ScheduleRun
from pwmesh.wire.parts import enqueued


def enqueues(actions: list[Send]) -> dict[str, Enqueue]:
    by_control = {a.to: a.message for a in actions if isinstance(a.message, Enqueue)}
    assert len(by_control) == len(actions), "one Enqueue per executor per run"
    return by_control


def released(actions: list[Send]) -> list[str]:
    return list(dict.fromkeys(a.message.run_id for a in actions if isinstance(a.message, Enqueue)))


# ------------------------------------------------------------------ the order


def test_sequence_numbers_are_consecutive_and_global_across_runs() -> None:
    order = IslandOrder(island=0, scheduler="tcp://sched")
    first = enqueues(order.submit(run("r1", [(0, "a"), (1, "b"), (2, "a")])))
    second = enqueues(order.submit(run("r2", [(0, "b"), (1, "a")])))
    # A run's places are consecutive, executor part by executor part (the scheduler never
    # unpacks a part: it forwards the proxy's bytes with their places beside them).
    assert [(c.node, c.seq) for c in enqueued(first["tcp://a:1"])] == [(0, 0), (2, 1)]
    assert [(c.node, c.seq) for c in enqueued(first["tcp://b:1"])] == [(1, 2)]
    assert [(c.node, c.seq) for c in enqueued(second["tcp://b:1"])] == [(0, 3)]
    assert [(c.node, c.seq) for c in enqueued(second["tcp://a:1"])] == [(1, 4)]
    assert order.next_seq == 5
    assert first["tcp://a:1"].scheduler == "tcp://sched"
    assert [e.seq for e in order.history] == [0, 1, 2, 3, 4]


def test_each_executor_counts_its_enqueues_so_it_can_restore_order() -> None:
    order = IslandOrder(island=0, window=100)
    seqs = collections.defaultdict(list)
    for i in range(5):
        for control, enq in enqueues(order.submit(run(f"r{i}", [(0, "a")] if i % 2 else [(0, "a"), (1, "b")]))).items():
            seqs[control].append(enq.executor_seq)
    assert seqs["tcp://a:1"] == [0, 1, 2, 3, 4]
    assert seqs["tcp://b:1"] == [0, 1, 2]


def test_every_device_sees_the_same_relative_order_of_gangs() -> None:
    """Random overlapping gangs from several clients: any two gangs sharing devices are
    ordered the same way on every device they share (what prevents deadlock)."""
    rng = random.Random(7)
    executors = ["a", "b", "c", "d"]
    order = IslandOrder(island=0, window=3)
    per_device: dict[tuple[str, int], list[int]] = collections.defaultdict(list)
    in_flight: list[tuple[str, str]] = []

    def record(actions: list[Send]) -> None:
        for action in actions:
            enqueue = action.message
            assert isinstance(enqueue, Enqueue)
            for comp in enqueued(enqueue):
                for device, _ in comp.shards():
                    per_device[(comp.executor_id, device)].append(comp.seq)
                in_flight.append((enqueue.run_id, comp.executor_id))

    for i in range(200):
        gang = rng.sample(executors, rng.randint(2, 4))
        record(order.submit(run(f"r{i}", [(0, ex) for ex in gang], session=f"client{i % 4}")))
        while in_flight and rng.random() < 0.6:
            run_id, ex = in_flight.pop(rng.randrange(len(in_flight)))
            record(order.part_done(run_id, ex, rng.random()))
    while in_flight:
        run_id, ex = in_flight.pop(0)
        record(order.part_done(run_id, ex, 0.1))
    assert order.next_seq == sum(len(v) for v in per_device.values()) > 0
    for seqs in per_device.values():
        assert seqs == sorted(seqs), "each device's queue follows the one island order"


# ---------------------------------------------------------------- the window


def test_window_holds_runs_back_until_a_part_completes() -> None:
    order = IslandOrder(island=0, window=2)
    assert released(order.submit(run("r1", [(0, "a")]))) == ["r1"]
    assert released(order.submit(run("r2", [(0, "a")]))) == ["r2"]
    assert order.submit(run("r3", [(0, "a")])) == []
    assert order.submit(run("r4", [(0, "b")])) == []  # one client's runs keep their order
    assert released(order.submit(run("o1", [(0, "b")], "other"))) == ["o1"]  # other clients are not held up
    assert order.part_done("r1", "b", 1.0) == []  # not one of r1's executors: ignored
    assert released(order.part_done("r1", "a", 1.0)) == ["r3", "r4"]  # r4 was only waiting behind r3


def test_a_run_needs_a_slot_on_every_device_it_touches() -> None:
    order = IslandOrder(island=0, window=1)
    order.submit(run("r1", [(0, "a")]))
    assert order.submit(run("r2", [(0, "a"), (1, "b")])) == []
    assert released(order.part_done("r1", "a", 0.5)) == ["r2"]
    assert order.part_done("r2", "a", 0.5) == []
    assert order.submit(run("r3", [(0, "b")])) == []  # r2 still holds b
    assert released(order.part_done("r2", "b", 0.5)) == ["r3"]


def test_forgetting_a_lost_executor_frees_its_slots() -> None:
    order = IslandOrder(island=0, window=1)
    order.submit(run("r1", [(0, "a"), (1, "b")]))
    assert order.submit(run("r2", [(0, "b")])) == []
    order.part_done("r1", "a", 0.1)
    assert released(order.forget_executor("b")) == ["r2"]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        IslandOrder(island=0, policy="lottery")
    with pytest.raises(InvalidArgument):
        IslandOrder(island=0, window=0)


# ---------------------------------------------------------------- policies


def test_fair_shares_follow_weights_over_a_long_run() -> None:
    weights = {"w1": 1.0, "w2": 2.0, "w4": 4.0, "w8": 8.0}
    shares = saturate(IslandOrder(island=0, window=2), {s: (w, 0) for s, w in weights.items()}, steps=3000)
    for session, weight in weights.items():
        expected = weight / sum(weights.values())
        assert shares[session] == pytest.approx(expected, rel=0.05), (session, shares)


def test_fifo_ignores_weights() -> None:
    shares = saturate(IslandOrder(island=0, policy="fifo", window=2), {"w1": (1.0, 0), "w8": (8.0, 0)}, steps=1000)
    assert shares["w1"] == pytest.approx(0.5, abs=0.02)


def test_fair_shares_follow_weights_for_gangs_over_two_executors_too() -> None:
    def gang(run_id: str, session: str, weight: float, priority: int) -> ScheduleRun:
        return run(run_id, [(0, "a"), (1, "b")], session, weight, priority)

    shares = saturate(IslandOrder(island=0, window=2), {"w1": (1.0, 0), "w3": (3.0, 0)}, steps=2000, make_run=gang)
    assert shares["w1"] == pytest.approx(0.25, rel=0.05), shares


def test_saturate_refuses_a_loop_with_nothing_to_run() -> None:
    with pytest.raises(InvalidArgument, match="saturate"):
        saturate(IslandOrder(island=0), {}, steps=10)
    with pytest.raises(InvalidArgument, match="saturate"):
        saturate(IslandOrder(island=0), {"c": (1.0, 0)}, steps=10, backlog=0)


def test_priority_preempts_at_run_boundaries() -> None:
    order = IslandOrder(island=0, window=1)
    order.submit(run("low-1", [(0, "a")], "low"))
    order.submit(run("low-2", [(0, "a")], "low"))
    order.submit(run("high-1", [(0, "a")], "high", priority=5))
    # low-1 already runs (non-preemptive); the next slot goes to the higher priority.
    assert released(order.part_done("low-1", "a", 1.0)) == ["high-1"]
    order.submit(run("high-2", [(0, "a")], "high", priority=5))
    assert released(order.part_done("high-1", "a", 100.0)) == ["high-2"]  # usage does not matter across priorities
    assert released(order.part_done("high-2", "a", 1.0)) == ["low-2"]


def test_a_client_charged_while_it_waits_goes_at_its_new_virtual_time() -> None:
    """A charge leaves a waiting client's entry where it is (``order.py``: keys only grow); it still counts."""
    order = IslandOrder(island=0, window=1)
    assert released(order.submit(run("a1", [(0, "e0")], "A"))) == ["a1"]
    assert released(order.submit(run("b1", [(0, "e1")], "B"))) == ["b1"]
    assert released(order.submit(run("a2", [(0, "e1")], "A"))) == []  # A waits first, on e1
    assert released(order.submit(run("b2", [(0, "e1")], "B"))) == []
    assert released(order.part_done("a1", "e0", 10.0)) == []  # A is charged 10 while it waits
    assert released(order.part_done("b1", "e1", 1.0)) == ["b2"]  # B, at 1, goes before A, at 10


def test_an_idle_client_earns_no_credit() -> None:
    order = IslandOrder(island=0, window=1)
    # "busy" uses the device alone for a long time...
    order.submit(run("busy-0", [(0, "a")], "busy"))
    for i in range(1, 50):
        order.submit(run(f"busy-{i}", [(0, "a")], "busy"))
        order.part_done(f"busy-{i - 1}", "a", 1.0)
    # ...then "late" arrives: it gets its fair half, not 49 turns of saved-up credit.
    for i in range(20):
        order.submit(run(f"late-{i}", [(0, "a")], "late"))
        order.submit(run(f"busy-{50 + i}", [(0, "a")], "busy"))
    turns = []
    current = "busy-49"
    for _ in range(20):
        (current,) = released(order.part_done(current, "a", 1.0))
        turns.append(current.split("-")[0])
    assert 9 <= turns.count("late") <= 11, turns


def test_usage_is_reported_per_client() -> None:
    order = IslandOrder(island=0)
    order.submit(run("r1", [(0, "a")], "alice", weight=2.0))
    order.part_done("r1", "a", 1.5)
    (alice,) = order.usage()
    assert (alice.session, alice.weight, alice.device_seconds, alice.runs, alice.waiting) == ("alice", 2.0, 1.5, 1, 0)


def test_idle_clients_are_forgotten_beyond_a_bound() -> None:
    order = IslandOrder(island=0)
    order.max_clients = 3
    for i in range(10):
        order.submit(run(f"r{i}", [(0, "a")], session=f"c{i}"))
        order.part_done(f"r{i}", "a", 1.0)
    assert len(order.usage()) <= 3
    busy = run("busy", [(0, "a")], session="busy")
    order.submit(busy)
    assert "busy" in {u.session for u in order.usage()}  # one with work in flight is never forgotten


def test_a_run_naming_absurd_devices_is_refused_and_changes_nothing() -> None:
    order = IslandOrder(island=0)
    bad = run("r1", [(0, "a")])
    bad.parts[0].devices[0].count = 1 << 40
    with pytest.raises(InvalidArgument, match="devices"):
        order.submit(bad)
    assert order.next_seq == 0 and not order.busy
    assert released(order.submit(run("r2", [(0, "a")]))) == ["r2"]


class SortEveryRelease(IslandOrder):
    """The release loop as it was (sort every waiting client after each release, check every head):
    the reference the kept order (heaps, clients waiting on the device that blocks them) must agree
    with, action for action."""

    def _release(self) -> list[Send]:
        actions: list[Send] = []
        released = True
        while released:
            released = False
            waiting = [c for c in self._clients.values() if c.queue]
            order = (sorted(waiting, key=lambda c: c.queue[0].arrival) if self.policy == "fifo" else
                     sorted(waiting, key=lambda c: (-c.priority, c.vtime, c.queue[0].arrival)))
            for client in order:
                if all(self.busy[key] < self.window for key in client.queue[0].footprint):
                    actions.extend(self._sequence(client, client.queue.popleft()))
                    released = True
                    break
                if self.policy == "fifo":
                    break
        return actions


@pytest.mark.parametrize("policy", ["fair", "fifo"])
@pytest.mark.parametrize(("seed", "window"), [(seed, 1 + seed % 3) for seed in range(12)])
def test_the_kept_order_releases_exactly_what_sorting_every_time_released(policy: str, seed: int,
                                                                         window: int) -> None:
    rng = random.Random(seed)
    fast = IslandOrder(0, policy=policy, window=window, scheduler="s")
    slow = SortEveryRelease(0, policy=policy, window=window, scheduler="s")
    slow.epoch = fast.epoch
    if seed % 2:  # idle clients forgotten and coming back: they rejoin the table (and its ties) at the end
        fast.max_clients = slow.max_clients = 4
    clients = {f"c{i}": [rng.choice([1.0, 2.0, 4.0]), rng.choice([0, 0, 0, 1])] for i in range(12)}
    executors = [f"e{i}" for i in range(4)]
    in_flight: list[tuple[str, str]] = []
    for step in range(800):
        if in_flight and rng.random() < 0.5:
            run_id, executor = in_flight.pop(rng.randrange(len(in_flight)))
            cost = rng.choice([0.0, rng.random()])  # a part that took no time moves no virtual time
            got, want = fast.part_done(run_id, executor, cost), slow.part_done(run_id, executor, cost)
        else:
            session = rng.choice(list(clients))
            if rng.random() < 0.05:  # a client's priority or weight changes while its runs wait
                clients[session] = [rng.choice([1.0, 2.0, 4.0]), rng.choice([0, 1])]
            weight, priority = clients[session]
            placements = [(0, e) for e in rng.sample(executors, rng.randint(1, 3))]
            r = run(f"{session}-{step}", placements, session=session, weight=weight, priority=priority)
            got, want = fast.submit(r), slow.submit(r)
        assert got == want, f"step {step}"
        for action in got:  # each part completes later, in random order
            in_flight.append((action.message.run_id, action.to.removeprefix("tcp://").rsplit(":", 1)[0]))
    assert fast.next_seq > 200 and any(c.queue for c in fast._clients.values()), "runs waited, and ran"
