"""Runs named by id (issue 30, item 1): a cached lowering installed once per island, then one message a run.

The proxy's, the island scheduler's and the executor's real cores, driven with events (no sockets): the
proxy sends a template once (``InstallTemplate``) and each run as one ``RunTemplate`` per island; the
scheduler gives each executor its part with the first run only; an executor without the part asks for it
(``NeedTemplate``) and holds the island's order meanwhile; a scheduler without the template (restarted)
refuses the run whole (``TemplateMissing``) and the proxy installs it again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from test_proxy_state import CLIENT, SCHEDULER, World, chain, sent

from pwmesh.core.contract import Send, Timer
from pwmesh.executor.state import Admit, ExecutorState, Flush, Installed, PartEnded, Received, TemplateTimeout
from pwmesh.proxy.state import Inbound, Notice
from pwmesh.proxy.state import Send as ProxySend
from pwmesh.scheduler.order import IslandOrder
from pwmesh.wire import encode
from pwmesh.wire.messages import (
    AwaitBuffers,
    Enqueue,
    InstallTemplate,
    NeedTemplate,
    NodeDone,
    Ok,
    ProgramInput,
    PutBuffer,
    RegisterProgram,
    RunPartDone,
    RunProgram,
    RunTemplate,
    SchedulerJoined,
    ScheduleRun,
    TemplateMissing,
)

pytestmark = pytest.mark.timeout(60)


def started(world: World) -> None:
    """A session with a 2-node chain over 4 devices (of 3 executors' 6) registered, its input put."""
    _, slice_id = world.open()
    fns = [world.function(CLIENT, slice_id, name) for name in (b"f", b"g")]
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    assert world.handle(Inbound(CLIENT, RegisterProgram(program_id="p", program=chain(fns, slice_id)))) == []


def run(world: World, output: int) -> list[Any]:
    return world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[output],
                                                   program_id="p")))


def to_scheduler(actions: list[Any]) -> list[Any]:
    return [a.message for a in actions if isinstance(a, ProxySend) and a.to == SCHEDULER]


def done(world: World, output: int) -> bool:
    return world.ask(CLIENT, AwaitBuffers(buffers=[output])).buffers[0].done


def test_a_warm_run_is_one_small_message_per_island_and_executors_expand_it() -> None:
    world = World()
    started(world)
    executors: dict[str, ExecutorState] = {}  # by control address: each executor's real core
    comps_by_run: list[dict[str, list[Any]]] = []
    for output in (2, 3, 4):
        actions = run(world, output)
        messages = to_scheduler(actions)
        if output == 2:  # the first run installs the template, then runs it
            assert [type(m) for m in messages] == [InstallTemplate, RunTemplate]
        else:
            assert [type(m) for m in messages] == [RunTemplate], "a warm run: one message for the island"
            assert sum(len(f) for f in encode(messages[0], msg_id=1)) < 400, "names only, not computations"
        install = [m for m in messages if isinstance(m, InstallTemplate)]
        if install:
            world.order.install(install[0])
        (run_msg,) = [m for m in messages if isinstance(m, RunTemplate)]
        enqueues = world.order.submit_template(run_msg)
        assert len(enqueues) == 2, "the slice's 4 devices are on 2 executors: one Enqueue each"
        assert all(bool(e.message.computations) == (output == 2) for e in enqueues), "the part goes once"
        comps: dict[str, list[Any]] = {}
        for send in enqueues:
            core = executors.setdefault(send.to, ExecutorState(world.controls[send.to], log_events=False))
            (admit,) = [a for a in core.handle(Received(send.message), 0.0) if isinstance(a, Admit)]
            comps[send.to] = admit.computations
            world.handle(Inbound(b"ex", NodeDone(run_id=run_msg.run_id, nodes=send.message.nodes,
                                                 executor_id=world.controls[send.to])))
            world.order.part_done(run_msg.run_id, world.controls[send.to], 0.0)
        comps_by_run.append(comps)
        assert done(world, output)
        buffer = world.proxy.sessions[CLIENT].buffers[output].name
        assert all(any(buffer in c.outputs[0] for c in cs) for cs in comps.values()), "the run's own names"
    # The same computations each run, but for their buffers' names.
    first, last = comps_by_run[0], comps_by_run[-1]
    assert {k: [(c.node, c.fn_id, c.runs) for c in v] for k, v in first.items()} == \
           {k: [(c.node, c.fn_id, c.runs) for c in v] for k, v in last.items()}
    assert first != last


def test_an_executor_without_its_template_asks_and_keeps_the_islands_order() -> None:
    order = IslandOrder(island=0, scheduler="tcp://sched:1")
    world = World()
    started(world)
    (install,) = [m for m in to_scheduler(run(world, 2)) if isinstance(m, InstallTemplate)]
    order.install(install)
    part = install.parts[0]
    later = [to_scheduler(run(world, out))[0] for out in (3, 4)]
    # The scheduler sent this executor its part with an earlier run; it restarted since (a new core).
    for msg in later:
        assert isinstance(msg, RunTemplate)
    sends = [s for msg in later for s in order.submit_template(msg) if s.to == part.control]
    assert len(sends) == 2 and sends[1].message.computations == b""
    core = ExecutorState(part.executor_id, log_events=False)  # the restarted executor's core
    core.control = part.control
    warm = sends[1].message  # names only
    enq_a = dataclasses.replace(warm, executor_seq=0, run_id="ra")
    enq_b = dataclasses.replace(warm, executor_seq=1, run_id="rb")
    plain = Enqueue(run_id="other:1", proxy="tcp://proxy:5555", nodes=[], computations=b"\x90",
                    scheduler=warm.scheduler, executor_seq=2, epoch=warm.epoch)
    actions = core.handle(Received(enq_b), 0.0)  # out of order: held
    assert actions == []
    actions = core.handle(Received(enq_a), 0.0)
    asks = [a for a in actions if isinstance(a, Send)]
    assert [(a.to, type(a.message)) for a in asks] == [(enq_a.scheduler, NeedTemplate)]
    assert asks[0].message.control == part.control and asks[0].message.template_id == install.template_id
    assert any(isinstance(a, Timer) for a in actions), "the wait is bounded"
    assert not any(isinstance(a, Admit) for a in actions)
    assert not any(isinstance(a, Admit) for a in core.handle(Received(plain), 0.0)), "held behind it"
    # The scheduler answers with the part; both runs and the later Enqueue go on, in order.
    control, answer = order.templates.part_for(asks[0].message)
    assert control == part.control and answer.computations == part.computations
    admitted = [a.message.run_id for a in core.handle(Installed(answer), 0.1) if isinstance(a, Admit)]
    assert admitted == ["ra", "rb", "other:1"]


def test_an_executor_whose_template_is_gone_everywhere_fails_the_run_clearly() -> None:
    order = IslandOrder(island=0, scheduler="tcp://sched:1")
    world = World()
    started(world)
    (install,) = [m for m in to_scheduler(run(world, 2)) if isinstance(m, InstallTemplate)]
    order.install(install)
    (msg,) = to_scheduler(run(world, 3))
    send = order.submit_template(msg)[0]
    enq = dataclasses.replace(send.message, computations=b"", refs=[], executor_seq=0)
    for answer in ("missing", "timeout"):
        core = ExecutorState("ex0", log_events=False)
        assert any(isinstance(a.message, NeedTemplate) for a in core.handle(Received(enq), 0.0)
                   if isinstance(a, Send))
        if answer == "missing":  # the scheduler restarted: it holds no such template
            fresh = IslandOrder(island=0, scheduler="tcp://sched:1")
            _, reply = fresh.templates.part_for(NeedTemplate(template_id=enq.template, executor_id="ex0",
                                                             control="tcp://ex0:7000"))
            assert reply.missing
            actions = core.handle(Installed(reply), 1.0)
        else:
            actions = core.handle(TemplateTimeout(enq.template), 31.0)
        actions += core.handle(Flush(), 31.0)  # the part's end leaves after this instant's replies
        failed = [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, NodeDone)]
        assert len(failed) == 1 and failed[0].error is not None and enq.template in failed[0].error.message
        assert [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, RunPartDone)], \
            "its window slots go back"
        core.handle(PartEnded(enq.run_id, "", 0.0), 1.0)


def test_a_restarted_scheduler_is_sent_the_template_again() -> None:
    world = World()
    started(world)
    messages = to_scheduler(run(world, 2))
    world.order.install(messages[0])
    for send in world.order.submit_template(messages[1]):
        world.handle(Inbound(b"ex", NodeDone(run_id=messages[1].run_id, nodes=send.message.nodes,
                                             executor_id=world.controls[send.to])))
    assert done(world, 2)

    # The scheduler restarts (a new process: no templates), before the proxy hears of it.
    world.order = IslandOrder(island=0, scheduler=SCHEDULER)
    (msg,) = to_scheduler(run(world, 3))
    (refused,) = world.order.submit_template(msg)
    assert refused.to == "tcp://proxy:5555" and isinstance(refused.message, TemplateMissing)
    assert world.order.in_flight == 0, "nothing of it was ordered"
    again = to_scheduler(world.handle(Inbound(b"sched", refused.message)))
    assert [type(m) for m in again] == [InstallTemplate, RunTemplate] and again[1] == msg
    assert world.proxy.templates_reinstalled == 1
    for done_msg in world.executors([ProxySend(SCHEDULER, m) for m in again]):
        world.handle(Inbound(b"ex", done_msg))
    assert done(world, 3)
    assert to_scheduler(run(world, 4))[0].template_id == msg.template_id
    assert [type(m) for m in to_scheduler(run(world, 5))] == [RunTemplate], "installed: runs only"

    # Heard of: a scheduler that joins anew is sent the template with the next run, without a round trip.
    world.handle(Notice(SchedulerJoined(island=0, address=SCHEDULER)))
    assert [type(m) for m in to_scheduler(run(world, 6))] == [InstallTemplate, RunTemplate]


def test_a_run_whose_template_keeps_going_missing_fails_clearly() -> None:
    world = World()
    started(world)
    messages = to_scheduler(run(world, 2))
    missing = TemplateMissing(run_id=messages[1].run_id, template_id=messages[1].template_id, scheduler=SCHEDULER)
    for _ in range(3):
        assert [type(m) for m in to_scheduler(world.handle(Inbound(b"sched", missing)))] == [InstallTemplate,
                                                                                             RunTemplate]
    world.handle(Inbound(b"sched", missing))
    wait = world.ask(CLIENT, AwaitBuffers(buffers=[2]))
    assert wait.buffers[0].done and "lost the run's template" in wait.buffers[0].error.message
    assert not world.proxy.runs


def test_cold_runs_are_still_sent_whole() -> None:
    """A run with no program id (never cached) goes as a ScheduleRun, as before."""
    world = World()
    _, slice_id = world.open()
    fns = [world.function(CLIENT, slice_id, name) for name in (b"f", b"g")]
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    actions = world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[2],
                                                      program=chain(fns, slice_id))))
    assert len(sent(actions, ScheduleRun)) == 1 and not sent(actions, RunTemplate)
    for done_msg in world.executors(actions):
        world.handle(Inbound(b"ex", done_msg))
    assert done(world, 2)
