"""The island scheduler's core takes a large run in work per subtree, not per executor, and decides exactly
what it decided one executor at a time (issue 30, item 4 d): a template's runs over a fan-out tree are sent
from a layout worked out once (``tree.Layout``), a head's ``PartsDone`` ends its subtree's parts in one step
(``IslandOrder.parts_done``, ``IslandCompletions.parts_done``), and frees skip the sort when no executor is
gone. A seeded random workload (templates and whole runs, wide and narrow, heads reporting all or part of
their subtree, with early completions, in one or two messages, executors lost and joining again, frees) is
driven through a core with these paths and through one without them (``layout_for`` off, and a subclass
that ends a head's parts one ``part_done`` at a time, as before): every action must be the same."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pwmesh.core.contract import Received, Send
from pwmesh.executor.fanout import FanOutRelay
from pwmesh.scheduler.completions import IslandCompletions
from pwmesh.scheduler.order import IslandOrder
from pwmesh.scheduler.state import SchedulerState
from pwmesh.scheduler.tree import build, layout
from pwmesh.wire import decode, encode
from pwmesh.wire.messages import (
    DeviceRange,
    Enqueue,
    ExecutorJoined,
    ExecutorLost,
    FanOut,
    FreeGroup,
    FreeShards,
    InstallTemplate,
    IslandDone,
    Message,
    NodeDone,
    PartsDone,
    RunPart,
    RunPartDone,
    RunTemplate,
    ScheduleRun,
)

pytestmark = pytest.mark.timeout(120)

EXECUTORS = [f"e{i}" for i in range(14)]
WIDTH = 3


def control(executor: str) -> str:
    return f"tcp://{executor}:1"


class OneAtATime(IslandOrder):
    """The reference order: a head's parts end one ``part_done`` at a time, each followed by its release pass."""

    def parts_done(self, run_id: str, executor_ids: list[str], device_seconds: float,
                   stimulus: str = "", head: str = "") -> list[Send]:
        actions: list[Send] = []
        for executor_id in executor_ids:
            actions += self.part_done(run_id, executor_id, device_seconds, stimulus)
            device_seconds = 0.0
        return actions


class OneAtATimeCompletions(IslandCompletions):
    def parts_done(self, run_id: str, executor_ids: list[str]) -> list[tuple[str, IslandDone]]:
        out: list[tuple[str, IslandDone]] = []
        for executor_id in executor_ids:
            out += self.part_done(run_id, executor_id)
        return out


def cores(policy: str) -> tuple[SchedulerState, SchedulerState]:
    fast = SchedulerState(IslandOrder(0, policy=policy, window=2, scheduler="tcp://s"), fanout=WIDTH, above=WIDTH)
    slow = SchedulerState(OneAtATime(0, policy=policy, window=2, scheduler="tcp://s", epoch=fast.order.epoch),
                          fanout=WIDTH, above=WIDTH)
    slow.order.layout_for = None  # every run's Enqueues one at a time, then ``tree.build``
    slow.completions = OneAtATimeCompletions("tcp://s")
    return fast, slow


def received(actions: list[object]) -> list[object]:
    """``actions`` with each send of a run's parts replaced by what every executor gets of it: through the
    codec, down the tree through real relays, each executor's ``Enqueue`` where it arrives (a template's parts
    said together and its parts as bodies must come out the same)."""
    out: list[object] = []
    for action in actions:
        if not (isinstance(action, Send) and isinstance(action.message, Enqueue | FanOut)):
            out.append(action)
            continue
        hops: list[tuple[str, Message]] = [(action.to, action.message)]
        while hops:
            to, message = hops.pop(0)
            message = decode(encode(message, msg_id=1)).message
            if isinstance(message, FanOut):
                own, more = FanOutRelay(to.removeprefix("tcp://").removesuffix(":1")).fan_out(message)
                out.append(("received", to, own, action.stimulus))
                hops += more
            else:
                out.append(("received", to, message, action.stimulus))
    return out


def parts(rng: random.Random, executors: list[str], refs: bool) -> list[RunPart]:
    return [RunPart(executor_id=ex, control=control(ex), devices=[DeviceRange(first=0, count=rng.choice([1, 2]))],
                    nodes=list(range(rng.randint(0, 3))), computations=b"c", refs=[0] if refs else [])
            for ex in executors]


def reports_for(rng: random.Random, send: Send) -> list[Message]:
    """What the executors of one send report, as heads would (some of it; early completions; in pieces)."""
    message = send.message
    if isinstance(message, Enqueue):
        ex = send.to.removeprefix("tcp://").removesuffix(":1")
        return [RunPartDone(run_id=message.run_id, executor_id=ex, device_seconds=rng.choice([0.0, 0.5]))]
    assert isinstance(message, FanOut)
    head = message.executors[0]
    if len(message.executors) == 1:  # a subtree of one: no relay, it reports to the scheduler itself
        return [RunPartDone(run_id=message.run_id, executor_id=head, device_seconds=0.25)]
    nodes = message.run.unpacked()[0] if message.run is not None else [p.nodes for p in message.parts]
    out: list[Message] = []
    ended = list(message.executors)  # the head's own part among them (it reports to its own relay)
    rng.shuffle(ended)
    early = [NodeDone(run_id=message.run_id, nodes=mine[:1], executor_id=ex)
             for ex, mine in zip(message.executors, nodes, strict=True) if mine and rng.random() < 0.2]
    if rng.random() < 0.1:
        ended.append(rng.choice(EXECUTORS))  # perhaps one not of its subtree: not its to report
    if rng.random() < 0.3 and len(ended) > 1:  # in two messages, the first not its last word
        cut = rng.randrange(1, len(ended))
        out.append(PartsDone(run_id=message.run_id, head=head, ended=ended[:cut], device_seconds=0.1,
                             reports=early, last=False))
        out.append(PartsDone(run_id=message.run_id, head=head, ended=ended[cut:], device_seconds=0.2))
    else:
        out.append(PartsDone(run_id=message.run_id, head=head, ended=ended, device_seconds=rng.choice([0.0, 0.3]),
                             reports=early))
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("sessions", ["abc", "a"])  # one client: fewer runs held back, more ended in one step
@pytest.mark.parametrize("policy", ["fair", "fifo"])
@pytest.mark.parametrize("seed", range(8))
def test_batched_paths_decide_and_send_what_one_executor_at_a_time_did(policy: str, seed: int, sessions: str) -> None:
    rng = random.Random(seed)
    fast, slow = cores(policy)
    templates = []
    for i in range(4):
        executors = rng.sample(EXECUTORS, rng.choice([2, 5, 9, len(EXECUTORS)]))
        templates.append(InstallTemplate(template_id=f"t{i}", parts=parts(rng, executors, refs=True)))
    pending: list[Message] = []
    tree_runs = 0
    laid_out = fast.order.layout_for
    assert laid_out is not None
    fast.order.layout_for = lambda t: (layouts.append(found) or found) if (found := laid_out(t)) else None
    layouts: list[object] = []
    ended_together: list[bool] = []  # a head's whole subtree ended in one step (``IslandOrder._together``)
    together = fast.order._together
    fast.order._together = lambda *a: ended_together.append(together(*a)) or ended_together[-1]  # type: ignore[method-assign]

    def handle(message: Message) -> list[object]:
        nonlocal tree_runs
        got, want = fast.handle(Received(message), 0.0), slow.handle(Received(message), 0.0)
        assert received(got) == received(want), f"step {step}: {message!r}"
        for action in got:
            if isinstance(action, Send) and isinstance(action.message, Enqueue | FanOut):
                pending.extend(reports_for(rng, action))
                tree_runs += isinstance(action.message, FanOut)
        return got

    for t in templates:
        handle(t)
    for step in range(800):
        roll = rng.random()
        if roll < 0.01:
            ex = rng.choice(EXECUTORS)
            handle(ExecutorLost(executor_id=ex, host=ex, control=control(ex), reason="gone"))
        elif roll < 0.05:  # one gone joins again (or one that was not gone)
            ex = rng.choice(list(fast.completions.lost) or EXECUTORS)
            handle(ExecutorJoined(executor_id=ex, control=control(ex), island=0))
        elif roll < 0.1:
            handle(FreeShards(groups=[FreeGroup(buffers=[f"b{step}"], controls=[control(ex) for ex in
                                                                               rng.sample(EXECUTORS, rng.randint(1, 14))])]))
        elif pending and roll < 0.6:
            handle(pending.pop(rng.randrange(len(pending))))
        else:
            session = rng.choice(sessions)
            if rng.random() < 0.7:
                t = rng.choice(templates)
                handle(RunTemplate(template_id=t.template_id, run_id=f"r{step}", proxy="p", names=["x"],
                                   session=session, weight=rng.choice([1.0, 2.0])))
            else:
                executors = rng.sample(EXECUTORS, rng.randint(1, 14))
                handle(ScheduleRun(run_id=f"r{step}", proxy="p", parts=parts(rng, executors, refs=False),
                                   session=session))
        assert dict(fast.order.busy) == dict(slow.order.busy)
    while pending:
        handle(pending.pop(0))
    assert list(fast.order.history) == list(slow.order.history)
    assert fast.order.usage() == slow.order.usage()
    assert len(layouts) > 10 and tree_runs > 30 and fast.order.next_seq > 200, "runs went through trees"
    if policy == "fair" and sessions == "a":
        assert sum(ended_together) > 10, "heads' subtrees ended in one step"


def test_a_layout_is_the_tree_build_makes_of_the_same_parts() -> None:
    for n in (4, 16, 17, 100, 1024):
        executors = [f"e{i}" for i in range(n)]
        nodes = [[0, 1] if i % 3 else [1] for i in range(n)]
        firsts = [sum(len(m) for m in nodes[:i]) for i in range(n)]
        sends = [Send(control(ex), Enqueue(run_id="r", proxy="p", nodes=nodes[i], computations=b"",
                                           seqs=[7 + firsts[i] + k for k in range(len(nodes[i]))], names=["x"],
                                           scheduler="tcp://s", executor_seq=i, epoch="ep", template="t"), "s")
                 for i, ex in enumerate(executors)]
        want, tree = build("r", sends, lambda c: c.removeprefix("tcp://").removesuffix(":1"), 16, "tcp://s")
        plan = layout(executors, [control(ex) for ex in executors], 16, nodes)
        got = plan.sends("r", "p", ["x"], "tcp://s", "ep", "t", 7, np.arange(n), "s")
        assert len(got) == len(want) <= 16
        assert received(list(got)) == received(list(want))
        assert (plan.tree.executors, plan.tree.sizes, plan.tree.parents) == (tree.executors, tree.sizes, tree.parents)
        assert plan.heads == set(tree.heads())
