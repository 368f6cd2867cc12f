"""The island's JAX group as a pure core (``pwmesh.scheduler.group``): when a forming starts, when it is
complete, when the island's work is held, and what a member lost under way does; and the resource
manager's part in a member's restart (announced, excused). No sockets, no JAX."""

from __future__ import annotations

from rm_driver import DrivenRM
from test_placement import executor

from pwmesh.core.liveness import Liveness
from pwmesh.scheduler.group import AskAgain, Form, Formed, IslandGroup, Joined, Left, Tick
from pwmesh.wire.messages import (
    ExecutorJoined,
    ExecutorLost,
    ExecutorRestarting,
    LeavingForGroup,
    Ok,
    PleaseRegister,
    RegisterExecutor,
)

SETTLE = 0.5


def formed(group: IslandGroup, members: tuple[str, ...], now: float) -> float:
    """Drive a forming of ``members`` to completion (each reports it); returns the time after."""
    actions = group.handle(Tick(), now + SETTLE)
    assert actions == [Form(group.epoch, members)]
    for m in members:
        actions = group.handle(Joined(m, group.epoch), now + SETTLE)
    assert actions == [Formed(group.epoch, members)]
    return now + SETTLE


def test_members_that_register_together_get_one_forming_once_settled() -> None:
    group = IslandGroup(settle_seconds=SETTLE)
    assert not group.holding
    assert group.handle(Joined("a", 0), 0.0) == []
    assert group.handle(Joined("b", 0), 0.2) == [], "a forming waits for the membership to settle"
    assert group.holding, "work waits while a forming is due"
    assert group.handle(Tick(), 0.6) == [], "b joined at 0.2: not settled yet"
    assert group.handle(Tick(), 0.8) == [Form(1, ("a", "b"))]
    assert group.handle(Joined("a", 1), 1.0) == []
    assert group.holding
    assert group.handle(Joined("b", 1), 1.2) == [Formed(1, ("a", "b"))]
    assert not group.holding, "the island's work is released once every member is in the forming"


def test_a_member_that_joins_later_gets_a_new_forming_of_all() -> None:
    group = IslandGroup(settle_seconds=SETTLE)
    group.handle(Joined("a", 0), 0.0)
    group.handle(Joined("b", 0), 0.0)
    now = formed(group, ("a", "b"), 0.0)
    group.handle(Joined("c", 0), now + 1)
    assert group.holding
    now = formed(group, ("a", "b", "c"), now + 1)
    assert group.epoch == 2 and not group.holding


def test_a_member_lost_or_drained_re_forms_the_rest() -> None:
    group = IslandGroup(settle_seconds=SETTLE)
    for m in "abc":
        group.handle(Joined(m, 0), 0.0)
    now = formed(group, ("a", "b", "c"), 0.0)
    group.handle(Left("b"), now + 1)
    assert group.holding
    formed(group, ("a", "c"), now + 1)


def test_a_member_lost_under_way_abandons_the_forming_for_one_without_it() -> None:
    group = IslandGroup(settle_seconds=SETTLE)
    group.handle(Joined("a", 0), 0.0)
    group.handle(Joined("b", 0), 0.0)
    assert group.handle(Tick(), 1.0) == [Form(1, ("a", "b"))]
    group.handle(Joined("a", 1), 1.5)
    assert group.handle(Left("b"), 2.0) == [], "settling first"
    assert group.handle(Tick(), 2.6) == [Form(2, ("a",))], "a waits in vain for b in forming 1"
    assert group.handle(Joined("a", 2), 3.0) == [Formed(2, ("a",))]


def test_a_member_new_under_way_waits_for_the_forming_to_complete() -> None:
    group = IslandGroup(settle_seconds=SETTLE)
    group.handle(Joined("a", 0), 0.0)
    assert group.handle(Tick(), 1.0) == [Form(1, ("a",))]
    assert group.handle(Joined("b", 0), 1.1) == []
    assert group.handle(Joined("a", 1), 1.2) == [Formed(1, ("a",))]
    assert group.holding, "b is not in it: another forming is due"
    assert group.handle(Tick(), 1.7) == [Form(2, ("a", "b"))]


def test_members_slow_to_join_are_asked_again() -> None:
    group = IslandGroup(settle_seconds=SETTLE, ask_again_seconds=5.0)
    group.handle(Joined("a", 0), 0.0)
    group.handle(Joined("b", 0), 0.0)
    assert group.handle(Tick(), 1.0) == [Form(1, ("a", "b"))]
    group.handle(Joined("a", 1), 2.0)
    assert group.handle(Tick(), 5.0) == []
    assert group.handle(Tick(), 6.0) == [AskAgain(1, ("b",))]
    assert group.handle(Tick(), 7.0) == [], "asked once per interval"


def test_the_last_member_leaving_leaves_no_group_and_holds_nothing() -> None:
    group = IslandGroup(settle_seconds=SETTLE)
    group.handle(Joined("a", 0), 0.0)
    now = formed(group, ("a",), 0.0)
    group.handle(Left("a"), now + 1)
    assert group.handle(Tick(), now + 2) == [Formed(1, ())]
    assert not group.holding


def test_a_member_restarted_by_someone_else_brings_a_new_forming() -> None:
    group = IslandGroup(settle_seconds=SETTLE)
    group.handle(Joined("a", 0), 0.0)
    group.handle(Joined("b", 0), 0.0)
    now = formed(group, ("a", "b"), 0.0)
    group.handle(Joined("b", 0), now + 1)  # its process was restarted: in no group
    assert group.holding
    formed(group, ("a", "b"), now + 1)


def test_after_a_scheduler_restart_formings_continue_past_the_members_epochs() -> None:
    group = IslandGroup(settle_seconds=SETTLE)
    group.handle(Joined("a", 7), 0.0)  # members of a forming an earlier scheduler made
    assert group.handle(Tick(), 1.0) == [Form(8, ("a",))], "a later epoch than any member is in"


# ------------------------------------------------- the resource manager's part in a restart

def test_a_member_leaving_for_a_forming_is_announced_and_excused_until_it_registers_again() -> None:
    state = DrivenRM(heartbeat_timeout_seconds=3.0)
    state.ask(RegisterExecutor(info=executor("a")), now=0.0)
    state.take_notifications()
    assert state.ask(LeavingForGroup(executor_id="a", epoch=2, grace_seconds=60.0), now=1.0) == Ok()
    assert state.take_notifications() == [ExecutorRestarting(executor_id="a", control="tcp://a:1", epoch=2)], \
        "every watcher hears of the restart (and fences)"
    state.expire(now=30.0)
    assert state.executors["a"].alive and state.take_notifications() == [], "silent while restarting: excused"
    assert state.ask(RegisterExecutor(info=executor("a")), now=31.0) == Ok()
    assert isinstance(state.take_notifications()[0], ExecutorJoined)
    state.expire(now=35.0)
    lost = state.take_notifications()
    assert [n.executor_id for n in lost if isinstance(n, ExecutorLost)] == ["a"], \
        "registered again, the excuse is over: silent for a heartbeat timeout, it is lost"
    assert state.ask(LeavingForGroup(executor_id="nobody", epoch=1, grace_seconds=60.0), now=36.0) \
        == PleaseRegister()


def test_an_excuse_is_not_shortened_by_the_beats_before_the_restart() -> None:
    alive = Liveness(timeout_seconds=3.0)
    alive.beat("a", 0.0)
    alive.excuse("a", until=60.0)
    alive.beat("a", 1.0)  # the old process beats once more on its way out
    assert alive.expired(50.0) == []
    assert alive.expired(64.0) == ["a"]
