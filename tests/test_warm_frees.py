"""A warm run's end in the proxy looks at none of its executors one by one (issue #30 item 4 (d)).

Pure, like ``test_warm_dispatch``: a cached lowering's runs share one frozen holder set per set of holders;
their frees name those holders through one list made once and shared by every free of them (still every
holder, in every free), the run's executors are merged into the session's once, and a bound input's holders
become the template's shared set. What changes one (an executor lost, a migration, the session's end) is
still seen: a free then lists the holders as they are now.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_proxy_state import CLIENT, SCHEDULER, World, chain, sent

from pwmesh.proxy import state as proxy_state
from pwmesh.proxy.state import Inbound, Notice, Tick
from pwmesh.wire.messages import (
    DeleteShards,
    ExecutorLost,
    ForgetOwner,
    FreeShards,
    Ok,
    ProgramInput,
    PutBuffer,
    RegisterProgram,
    ReleaseBuffers,
    RunProgram,
)

pytestmark = pytest.mark.timeout(60)


def run(world: World, output: int) -> tuple[list[Any], Any]:
    """One run of program "p" on buffer 1, every executor reporting: what the proxy sent, and the run."""
    actions = world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[output],
                                                      program_id="p")))
    ((_, the_run),) = world.proxy.runs.values()
    out: list[Any] = list(actions)
    for done in world.executors(actions):
        out += world.handle(Inbound(b"ex", done))
    assert not world.proxy.runs
    return out, the_run


def setup(nodes: int = 3) -> tuple[World, str]:
    world = World()
    sid, slice_id = world.open()
    fns = [world.function(CLIENT, slice_id, f"f{k}".encode()) for k in range(nodes)]
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    world.handle(Inbound(CLIENT, RegisterProgram(program_id="p", program=chain(fns, slice_id))))
    return world, sid


def test_warm_runs_free_every_holder_through_one_shared_list() -> None:
    world, sid = setup()
    frees = []
    for output in (2, 3, 4):
        actions, the_run = run(world, output)
        ((to, free),) = [(a.to, a.message) for a in sent(actions, FreeShards)]
        assert to == SCHEDULER
        (group,) = free.groups  # the run's two temporaries, held alike: one group
        temporaries = {f"{sid}/{name}" for _, _, names in the_run.named_temps for name in names}  # by name
        assert set(group.buffers) == temporaries and len(temporaries) == 2 and not the_run.temporaries
        frees.append(group)
    holders = {c for c, ex in world.controls.items() if ex in {"ex0", "ex1"}}
    for group in frees:  # every holder, once, in every free
        assert sorted(group.controls) == sorted(holders)
    assert frees[1].controls is frees[2].controls, "warm runs share their holders' list"
    assert frees[1].controls == frees[0].controls
    # The kept frees, sent again per executor if the scheduler is lost, still reach each holder.
    by_control = world.proxy.frees.lost(SCHEDULER)
    assert set(by_control) == holders
    assert all(set(names) >= set(frees[2].buffers) for names in by_control.values())


def test_a_bound_input_takes_the_templates_holders_and_the_runs_executors_merge_once() -> None:
    world, sid = setup()
    session = world.proxy.sessions[CLIENT]
    _, first = run(world, 2)
    _, second = run(world, 3)
    x = session.buffers[1]
    assert isinstance(x.holders, frozenset), "the template's set, shared: later runs look at it once"
    assert first.executors is second.executors and first.executors in session.merged
    assert first.executors <= session.hosts
    # A release of the input frees it on every holder.
    actions = world.handle(Inbound(CLIENT, ReleaseBuffers(buffers=[1])))
    freed = {c for a in sent(actions, FreeShards) for g in a.message.groups for c in g.controls
             if f"{sid}/{x.name}" in g.buffers}
    assert freed == set(first.executors)


def test_a_lost_executor_is_left_out_of_the_next_free_and_the_shared_list_is_untouched() -> None:
    world, sid = setup()
    run(world, 2)
    actions, _ = run(world, 3)
    ((_, shared),) = [(a.to, a.message) for a in sent(actions, FreeShards)]
    before = list(shared.groups[0].controls)
    gone = before[0]
    world.handle(Notice(ExecutorLost(executor_id=world.controls[gone], host="h", control=gone, reason="test")))
    # The outputs of both warm runs (the template's holders, shared) are released: freed on those left.
    actions = world.handle(Inbound(CLIENT, ReleaseBuffers(buffers=[2, 3])))
    named = {c for a in sent(actions, FreeShards) for g in a.message.groups for c in g.controls}
    named |= {a.to for a in sent(actions, DeleteShards)}
    assert named == set(before) - {gone}
    assert shared.groups[0].controls == before, "the shared list is never changed"


def test_the_sessions_end_forgets_the_owner_on_every_host_its_warm_runs_used() -> None:
    world, sid = setup()
    session = world.proxy.sessions[CLIENT]
    _, the_run = run(world, 2)
    run(world, 3)
    world.now = 100.0  # no heartbeat: the session expires
    actions = world.handle(Tick())
    assert session.ended and not session.merged and not session.hosts
    forgotten = {a.to for a in sent(actions, ForgetOwner)}
    assert set(the_run.executors) <= forgotten


def test_the_memories_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy_state, "MAX_HOLDER_LISTS", 2)
    world = World()
    lists = [world.proxy._listed(frozenset({f"tcp://e{k}:1", "tcp://x:1"})) for k in range(5)]
    assert len(world.proxy._holder_lists) <= 2
    assert all(sorted(listed) == sorted({f"tcp://e{k}:1", "tcp://x:1"}) for k, listed in enumerate(lists))
    mutable = {"tcp://a:1"}
    assert world.proxy._listed(mutable) == ["tcp://a:1"] and len(world.proxy._holder_lists) <= 2
