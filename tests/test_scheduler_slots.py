"""The island order's slots counted per cell (``scheduler/slots.py``) decide exactly what counting every
device did: a seeded random workload of runs over overlapping device ranges (cells split), recurring
programs and templates (footprints reused), footprints forgotten (cells dropped), executors lost, several
parts of a run ending in one call (``parts_done``: a fan-out head's report), is driven through
``IslandOrder`` and through a slow reference that keeps a count per device, sorts every waiting client
before each release and ends parts one at a time; every action, the per-device counts and the order's
history must agree."""

from __future__ import annotations

import collections
import random

import pytest

from pwmesh.core.contract import Send
from pwmesh.scheduler.order import IslandOrder, _Pending
from pwmesh.scheduler.slots import DeviceKey, Slots
from pwmesh.wire.messages import DeviceRange, InstallTemplate, RunPart, RunTemplate, ScheduleRun

pytestmark = pytest.mark.timeout(60)

DEVICES = 8  # per executor
EXECUTORS = [f"e{i}" for i in range(4)]


class PerDevice(IslandOrder):
    """The reference: a count per (executor, device), computed from the run's own parts, and a release
    loop that sorts every waiting client after each release and checks every device of the best heads.
    It shares only the bookkeeping the policy is made of (clients, keys, sequencing's messages)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.per_device: collections.Counter[DeviceKey] = collections.Counter()
        self.held: dict[str, dict[str, list[DeviceKey]]] = {}  # run -> executor -> devices it holds

    @staticmethod
    def devices(pending: _Pending) -> set[DeviceKey]:
        parts = pending.run.parts if pending.template is None else pending.template.parts  # type: ignore[union-attr]
        return {(p.executor_id, r.first + k) for p in parts for r in p.devices for k in range(r.count)}

    def _release(self) -> list[Send]:
        actions: list[Send] = []
        while True:
            waiting = [c for c in self._clients.values() if c.queue]
            order = (sorted(waiting, key=lambda c: c.queue[0].arrival) if self.policy == "fifo" else
                     sorted(waiting, key=lambda c: (-c.priority, c.vtime, c.queue[0].arrival)))
            for client in order:
                if all(self.per_device[key] < self.window for key in self.devices(client.queue[0])):
                    actions.extend(self._sequence(client, client.queue.popleft()))
                    break
                if self.policy == "fifo":
                    return actions
            else:
                return actions

    def _sequence(self, client: object, pending: _Pending) -> list[Send]:
        held: dict[str, list[DeviceKey]] = {}
        for key in self.devices(pending):
            self.per_device[key] += 1
            held.setdefault(key[0], []).append(key)
        self.held[pending.run.run_id] = held
        return super()._sequence(client, pending)  # type: ignore[arg-type]

    def part_done(self, run_id: str, executor_id: str, device_seconds: float, stimulus: str = "") -> list[Send]:
        for key in self.held.get(run_id, {}).pop(executor_id, []):
            self.per_device[key] -= 1
        return super().part_done(run_id, executor_id, device_seconds, stimulus)

    def parts_done(self, run_id: str, executor_ids: list[str], device_seconds: float,
                   stimulus: str = "") -> list[Send]:
        actions: list[Send] = []
        for executor_id in executor_ids:  # one at a time, each with its release pass
            actions += self.part_done(run_id, executor_id, device_seconds, stimulus)
            device_seconds = 0.0
        return actions


def random_part(rng: random.Random, executor: str, nodes: list[int], refs: bool = False) -> RunPart:
    ranges = []
    for _ in range(rng.choice([1, 1, 2])):
        first = rng.randrange(DEVICES)
        ranges.append(DeviceRange(first=first, count=rng.randint(1, DEVICES - first)))
    return RunPart(executor_id=executor, control=f"tcp://{executor}:1", devices=ranges, nodes=nodes,
                   computations=bytes([len(nodes)]), refs=[0] if refs else [])


def random_parts(rng: random.Random, refs: bool = False) -> list[RunPart]:
    executors = rng.sample(EXECUTORS, rng.randint(1, 3))
    return [random_part(rng, ex, [2 * k, 2 * k + 1][:rng.randint(1, 2)], refs) for k, ex in enumerate(executors)]


@pytest.mark.parametrize("policy", ["fair", "fifo"])
@pytest.mark.parametrize("seed", range(10))
def test_cells_decide_what_a_count_per_device_decided(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    window = 1 + seed % 3
    fast = IslandOrder(0, policy=policy, window=window, scheduler="s", history=50)
    slow = PerDevice(0, policy=policy, window=window, scheduler="s", history=50)
    slow.epoch = fast.epoch
    if seed % 2:  # footprints no run uses are forgotten at once, and their cells with them
        fast.slots.idle_shapes = 0
    programs = [random_parts(rng) for _ in range(4)]  # footprints that come back
    templates = [InstallTemplate(template_id=f"t{i}", parts=random_parts(rng, refs=True)) for i in range(3)]
    for t in templates:
        fast.install(t)
        slow.install(t)
    clients = {f"c{i}": (rng.choice([1.0, 2.0, 4.0]), rng.choice([0, 0, 1])) for i in range(8)}
    in_flight: list[tuple[str, str]] = []
    for step in range(600):
        roll = rng.random()
        if roll < 0.02:  # an executor is lost: its parts never report
            executor = rng.choice(EXECUTORS)
            got, want = fast.forget_executor(executor), slow.forget_executor(executor)
            in_flight = [(r, ex) for r, ex in in_flight if ex != executor]
        elif in_flight and roll < 0.15:  # several parts of a run end together (a fan-out head's PartsDone)
            run_id = rng.choice(in_flight)[0]
            ending = [ex for r, ex in in_flight if r == run_id and rng.random() < 0.8] + rng.sample(EXECUTORS, 1)
            in_flight = [(r, ex) for r, ex in in_flight if r != run_id or ex not in ending]
            cost = rng.choice([0.0, rng.random()])
            got, want = fast.parts_done(run_id, ending, cost), slow.parts_done(run_id, ending, cost)
        elif in_flight and roll < 0.5:
            run_id, executor = in_flight.pop(rng.randrange(len(in_flight)))
            cost = rng.choice([0.0, rng.random()])
            got, want = fast.part_done(run_id, executor, cost), slow.part_done(run_id, executor, cost)
        else:
            session = rng.choice(list(clients))
            weight, priority = clients[session]
            run_id = f"{session}-{step}"
            if rng.random() < 0.25:
                t = rng.choice(templates)
                r: ScheduleRun | RunTemplate = RunTemplate(template_id=t.template_id, run_id=run_id, proxy="p",
                                                           names=[f"n{step}"], session=session, weight=weight,
                                                           priority=priority)
                got, want = fast.submit_template(r), slow.submit_template(r)  # type: ignore[arg-type]
            else:
                parts = rng.choice(programs) if rng.random() < 0.5 else random_parts(rng)
                r = ScheduleRun(run_id=run_id, proxy="p", parts=parts, session=session, weight=weight,
                                priority=priority)
                got, want = fast.submit(r), slow.submit(r)
        assert got == want, f"step {step}"
        assert dict(fast.busy) == {k: n for k, n in slow.per_device.items() if n}, f"step {step}"
        for action in got:
            in_flight.append((action.message.run_id, action.to.removeprefix("tcp://").rsplit(":", 1)[0]))
    assert list(fast.history) == list(slow.history)
    assert fast.next_seq > 150 and any(c.queue for c in fast._clients.values()), "runs waited, and ran"


def test_a_footprint_holding_part_of_a_cell_splits_it_and_both_halves_keep_its_count() -> None:
    slots = Slots()
    whole = slots.take("whole", lambda: frozenset(("a", d) for d in range(8)))
    assert len(whole.cells) == 1
    whole.cells[0].busy = 1  # a run of the whole executor in flight
    half = slots.take("half", lambda: frozenset(("a", d) for d in range(4)))
    assert len(half.cells) == 1 and len(whole.cells) == 2  # the run's footprint holds both halves
    assert [c.busy for c in whole.cells] == [1, 1] and slots.busy()[("a", 3)] == slots.busy()[("a", 7)] == 1
    assert slots.take("whole", lambda: frozenset()) is whole  # interned: not built again


def test_footprints_no_run_uses_are_forgotten_beyond_a_bound_with_their_cells() -> None:
    slots = Slots(idle_shapes=1)
    first = slots.take(1, lambda: frozenset({("a", 0)}))
    second = slots.take(2, lambda: frozenset({("b", 0)}))
    slots.drop(first)
    slots.drop(second)  # the newest unused one is kept, the older forgotten
    assert slots.take(2, lambda: frozenset()) is second
    assert slots.take(1, lambda: frozenset({("a", 0)})) is not first
    assert len(slots._cells) == 2
