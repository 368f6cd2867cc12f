"""The island scheduler's core, with no sockets: ``SchedulerState.handle(event, now) -> actions``.

It joins the island's order (``order.py``: ``IslandOrder``, the sharing policy and the sequencing) and,
on an island of ``--collectives`` executors, its JAX group (``group.py``: ``IslandGroup``): while a
forming of the group is under way or due, the Enqueues the order releases are held, in order, and leave
right after the forming completes. The daemon (``scheduler/daemon.py``) and the simulator
(``sim/controller.py``) drive this same core.

Events:
    ``Received(message)``  ``ScheduleRun``, ``InstallTemplate``, ``RunTemplate`` and ``FreeShards`` from a proxy
                           (``templates.py``), ``NodeDone``, ``RunPartDone`` and ``NeedTemplate`` from an
                           executor, ``PartsDone`` from a fan-out head (``tree.py``), and the resource
                           manager's notices ``ExecutorJoined``, ``ExecutorLost`` and ``ExecutorRestarting``
                           (the shell does what concerns its connections itself: marking a peer alive or
                           lost, fences).
    ``Tick()``             time passed: a settled membership may start a forming of the group.

Actions (each carrying the id of the event that caused it, ``stimulus``):
    ``Send(control, Enqueue)`` an executor's part of a released run, in the island's order; a run over more
                           than ``above`` executors as ``Send(head, FanOut)``, one per subtree (``tree.py``).
    ``Send(head, SubtreeLost)`` an executor below a fan-out head is gone: what did its subtree report?
    ``Send(control, InstallPart)`` a template's part an executor asked for again.
    ``Send(proxy, TemplateMissing)`` a run of a template not held here, refused whole.
    ``Send(proxy, IslandDone)`` what the island's executors reported of a run (``completions.py``): one
                           message when every part has ended; a failure at once; an output early.
    ``Send(control, DeleteShards)`` the proxy's frees for the island (``FreeShards``), one per executor (more
                           than ``above`` executors: ``FanOutFrees`` to each subtree's head).
    ``Reply(error=...)``   a message refused (a run naming devices that cannot be): the sender is told.
    ``Form``, ``AskAgain``, ``Formed`` (``group.py``) start a forming of the JAX group (a coordinator, then
                           ``JoinGroup`` to each member at ``controls``), ask its slow members again, and
                           stop the coordinators of older formings (the held Enqueues follow ``Formed``).

Every event is kept in ``events`` (``pwmesh debug events scheduler-N``) but a ``Tick`` that caused nothing
(it changed nothing) and the payload of a large run (logged as a line); ``EventLog.timed`` hands them to a
fresh core built with the same ``epoch`` to replay.
"""

from __future__ import annotations

import dataclasses

from pwmesh.core.contract import EventLog, Received, Reply, Send
from pwmesh.errors import PwmeshError
from pwmesh.scheduler.completions import IslandCompletions
from pwmesh.scheduler.group import AskAgain, Form, Formed, IslandGroup, Joined, Left
from pwmesh.scheduler.group import Tick as GroupTick
from pwmesh.scheduler.order import IslandOrder
from pwmesh.scheduler.templates import Template
from pwmesh.scheduler.tree import Layout, RunTree, build, fanout_width, frees, layout, tree_above
from pwmesh.wire.messages import (
    DeleteShards,
    Enqueue,
    ExecutorJoined,
    ExecutorLost,
    ExecutorRestarting,
    FreeShards,
    InstallTemplate,
    IslandDone,
    NeedTemplate,
    NodeDone,
    PartsDone,
    RunPartDone,
    RunTemplate,
    ScheduleRun,
    SubtreeLost,
)

MAX_LOGGED_RUN_BYTES = 64 << 10  # a larger ScheduleRun is logged as a line, not kept (the log keeps 2,000 events)

# ------------------------------------------------------------------ events


@dataclasses.dataclass(slots=True)
class Tick:
    """Time passed (the island's JAX group waits for a membership to settle, and asks slow members again)."""


Event = Received | Tick
Action = Send | Reply | Form | AskAgain | Formed

_KINDS = {ScheduleRun: "schedule", RunTemplate: "run", InstallTemplate: "install", NeedTemplate: "need",
          RunPartDone: "part-done", PartsDone: "parts-done", NodeDone: "node-done", FreeShards: "free", ExecutorJoined: "joined",
          ExecutorLost: "lost", ExecutorRestarting: "restarting"}


class SchedulerState:
    def __init__(self, order: IslandOrder, group: IslandGroup | None = None, fanout: int | None = None,
                 above: int | None = None) -> None:
        self.order = order
        # A run over more than ``above`` executors goes out through a tree of them, ``fanout`` wide (``tree.py``).
        self.fanout = fanout_width(fanout)
        self.above = tree_above(above)
        self.trees: dict[str, RunTree] = {}  # runs in flight that went through a tree
        self._executor_of: dict[str, str] = {}  # control address -> executor (the runs' parts name both)
        self.group = group  # None: the island's executors form no JAX group
        self.controls: dict[str, str] = {}  # the group's members: executor -> control address
        self.events = EventLog()
        self._held: list[Send] = []  # the island's work while its group forms, in order
        self.completions = IslandCompletions(order.scheduler)  # what executors reported, for the proxies
        order.sequenced = []
        order.layout_for = self._layout  # a template's runs over a tree: its layout, worked out once

    @property
    def island(self) -> int:
        return self.order.island

    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply ``event``; return what must happen because of it, in order."""
        actions: list[Action] = []
        if type(event) is Tick:
            if self.group is None:
                return []
            stimulus = self.events.stimulus("tick")
            actions = self._group(self.group.handle(GroupTick(), now), stimulus)
            if actions:  # a tick that caused nothing changed nothing: not logged, so the log shows the rest
                self.events.record(now, stimulus, event, len(actions))
            return actions
        if not isinstance(event, Received):
            raise TypeError(f"not a scheduler event: {event!r}")
        message = event.message
        stimulus = self.events.stimulus(_KINDS.get(type(message), message.op))
        try:
            match message:
                case RunPartDone(run_id=run_id, executor_id=executor_id, device_seconds=seconds):
                    actions = self._told(self.completions.part_done(run_id, executor_id), stimulus)
                    actions += self._release(self.order.part_done(run_id, executor_id, seconds, stimulus))
                    if self.trees and run_id in self.trees and not self.completions.running(run_id):
                        del self.trees[run_id]
                case PartsDone():
                    actions = self._parts_done(message, stimulus)
                case NodeDone():
                    actions = self._told(self.completions.node_done(message), stimulus)
                case FreeShards(groups=groups):  # not held while the group forms: frees order nothing
                    for group in groups:  # one DeleteShards an executor, or through a tree (``tree.py``)
                        if len(group.controls) > self.above:
                            actions += frees(group.buffers, group.controls, self.fanout, stimulus,
                                             self._gone if self.completions.lost else None)
                        else:
                            actions += [Send(control, DeleteShards(buffers=group.buffers), stimulus)
                                        for control in group.controls]
                case RunTemplate():
                    actions = self._release(self.order.submit_template(message, stimulus))
                case ScheduleRun():
                    if len(message.parts) > self.above:
                        self._executor_of.update((p.control, p.executor_id) for p in message.parts)
                    actions = self._release(self.order.submit(message, stimulus))
                case InstallTemplate():
                    self.order.install(message)
                    if len(message.parts) > self.above:
                        self._executor_of.update((p.control, p.executor_id) for p in message.parts)
                case NeedTemplate():  # not held while the group forms: it orders nothing
                    control, part = self.order.templates.part_for(message)
                    if control:
                        actions = [Send(control, part, stimulus)]
                case ExecutorJoined(executor_id=executor_id, control=control, island=island, group=group,
                                    group_epoch=epoch, fresh=fresh):
                    self.completions.executor_joined(executor_id)
                    if fresh:  # a new process: it expects the island's order from its first Enqueue on
                        self.order.restart_executor(executor_id)
                    if self.group is not None and island == self.island and group:
                        self.controls[executor_id] = control
                        actions = self._group(self.group.handle(Joined(executor_id, epoch), now), stimulus)
                case ExecutorLost(executor_id=executor_id, host=host, reason=reason):
                    # Its parts not ended fail their runs (a drained one ended what it reported first).
                    why = f"executor {executor_id} on host {host} is gone ({reason})"
                    # A part that reported through a fan-out head waits for the head's word (``_tree_lost``).
                    spare = {r for r, tree in self.trees.items() if tree.parent(executor_id)} if self.trees else ()
                    actions = self._told(self.completions.executor_lost(executor_id, why, spare), stimulus)
                    actions += self._release(self.order.forget_executor(executor_id, stimulus))
                    if self.trees:
                        actions += self._tree_lost(executor_id, why, stimulus)
                    if self.group is not None:
                        actions += self._group(self.group.handle(Left(executor_id), now), stimulus)
                case ExecutorRestarting(executor_id=executor_id):
                    # Its work goes on in its next process, but not what it held as a fan-out head: the
                    # subtrees it heads fail, its own part in them, naming it (their reports reach a relay
                    # that never heard of the run).
                    if self.trees:
                        actions = self._tree_lost(executor_id, f"executor {executor_id} restarted (a JAX group "
                                                  "forming) while heading a fan-out subtree of the run", stimulus)
                case _:
                    raise TypeError(f"the scheduler's core does not handle {message.op}")
        except PwmeshError as exc:  # refused (a run naming devices that cannot be): nothing changed
            actions = [Reply(error=exc, stimulus=stimulus)]
        finally:
            self.events.record(now, stimulus, self._kept(event), len(actions))
        return actions

    def _kept(self, event: Received) -> Received | str:
        """What the log keeps of ``event``: itself, but a line for a large run (2,000 kept would hold gigabytes)."""
        run = event.message
        if isinstance(run, ScheduleRun) and sum(len(p.computations) for p in run.parts) > MAX_LOGGED_RUN_BYTES:
            return f"Received(message=ScheduleRun(run_id={run.run_id!r}, session={run.session!r}, " \
                   f"parts={len(run.parts)}), payload not kept)"
        if isinstance(run, InstallTemplate) and sum(len(p.computations) for p in run.parts) > MAX_LOGGED_RUN_BYTES:
            return f"Received(message=InstallTemplate(template_id={run.template_id!r}, " \
                   f"parts={len(run.parts)}), payload not kept)"
        return event

    # ------------------------------------------------------------ fan-out trees

    def _parts_done(self, msg: PartsDone, stimulus: str) -> list[Action]:
        """A top-level head's report of its subtree (``executor/fanout.py``): what it names of its own subtree
        counts; what the subtree of an executor gone below it (``lost``) did not report never will."""
        run_id = msg.run_id
        tree = self.trees.get(run_id)
        if tree is None:
            return []  # ended, or sequenced by an earlier instance of this scheduler
        mine = tree.reports_for
        actions: list[Action] = []
        for report in msg.reports:
            if report.run_id == run_id and mine(msg.head, report.executor_id):
                actions += self._told(self.completions.node_done(report), stimulus)
        sends: list[Send] = []
        # The parts it ended, taken together (what one at a time would do), the subtree's seconds charged once.
        ended = msg.ended
        if not tree.subtree(msg.head).issuperset(ended):
            ended = [executor_id for executor_id in ended if mine(msg.head, executor_id)]
        if ended:
            actions += self._told(self.completions.parts_done(run_id, ended), stimulus)
            sends += self.order.parts_done(run_id, ended, msg.device_seconds, stimulus, msg.head)
        if msg.lost and mine(msg.head, msg.lost):  # the head's answer to SubtreeLost: the rest never comes
            actions += self._lose_below(run_id, tree, msg.lost, f"executor {msg.lost} is gone", stimulus, sends,
                                        itself=True)
        actions += self._release(sends)
        if not self.completions.running(run_id):
            self.trees.pop(run_id, None)
        return actions

    def _lose_below(self, run_id: str, tree: RunTree, gone: str, why: str, stimulus: str,
                    sends: list[Send], itself: bool = False) -> list[Action]:
        """``gone``'s subtree of run ``run_id`` reported through it (and, ``itself``, its own part through its
        head): what of it has not ended fails, naming it."""
        below = tree.below(gone)
        if itself:
            below = [gone, *below]
        actions = self._told(self.completions.lose_parts(
            run_id, below, gone, f"{why}; the run's parts on {len(below)} executors reported through it"), stimulus)
        for executor_id in below:
            sends += self.order.part_done(run_id, executor_id, 0.0, stimulus)
        return actions

    def _tree_lost(self, executor_id: str, why: str, stimulus: str) -> list[Action]:
        """``executor_id`` is gone: in each tree it is in, what reported through it (its own part too, if it heads
        a subtree: that reported to its relay) is lost if it reported to the scheduler; else its head is asked
        what of its subtree it had (``SubtreeLost``)."""
        actions: list[Action] = []
        sends: list[Send] = []
        ask: dict[str, list[str]] = {}  # head control -> runs
        for run_id, tree in list(self.trees.items()):
            if executor_id not in tree.index:
                continue
            parent = tree.parent(executor_id)
            if parent is None:
                heads = tree.sizes[tree.index[executor_id]] > 1
                actions += self._lose_below(run_id, tree, executor_id, why, stimulus, sends, itself=heads)
            elif parent[0] not in self.completions.lost:  # (a head gone answers nothing: its own loss covers this)
                ask.setdefault(parent[1], []).append(run_id)
            if not self.completions.running(run_id):
                del self.trees[run_id]
        actions += self._release(sends)
        # (Sorted: the same sends whichever order the runs' trees were kept in.)
        actions += [Send(control, SubtreeLost(executor_id=executor_id, run_ids=sorted(runs)), stimulus)
                    for control, runs in sorted(ask.items())]
        return actions

    def _trees(self, sends: list[Send]) -> list[Send]:
        """Each run over more than ``above`` executors as a tree's sends (``tree.py``); the rest as they are."""
        out: list[Send] = []
        i, n = 0, len(sends)
        executor_of, lost = self._executor_of.__getitem__, self.completions.lost.__contains__
        while i < n:
            message = sends[i].message
            if not isinstance(message, Enqueue):
                out.append(sends[i])
                i += 1
                continue
            run_id = message.run_id
            j = i + 1
            while j < n and isinstance(m := sends[j].message, Enqueue) and m.run_id == run_id:
                j += 1
            if j - i <= self.above:
                out += sends[i:j]
            else:
                tree_sends, tree = build(run_id, sends[i:j], executor_of, self.fanout, self.order.scheduler, lost)
                if self.completions.running(run_id):
                    self.trees[run_id] = tree
                out += tree_sends
            i = j
        return out

    def _layout(self, template: Template) -> Layout | None:
        """The tree a template's runs go through (None: they go directly), while none of its heads is gone
        (then each run's tree is built anew, around the executors gone: ``build``)."""
        if len(template.parts) <= self.above:
            return None
        found = template.layout
        if not isinstance(found, Layout) or found.width != self.fanout:
            found = template.layout = layout([p.executor_id for p in template.parts],
                                             [p.control for p in template.parts], self.fanout,
                                             [p.nodes for p in template.parts])
        lost = self.completions.lost
        if lost and not found.heads.isdisjoint(lost):
            return None
        return found

    def _gone(self, control: str) -> bool:
        return self._executor_of.get(control, "") in self.completions.lost

    def _told(self, reports: list[tuple[str, IslandDone]], stimulus: str) -> list[Action]:
        return [Send(proxy, done, stimulus) for proxy, done in reports]

    def _release(self, sends: list[Send]) -> list[Action]:
        """The order's Enqueues: now, or held (in order) while the island's JAX group forms. The runs they
        sequenced are counted for their completions from now (a part sequenced for a lost executor fails)."""
        actions: list[Action] = []
        sequenced = self.order.sequenced
        stimulus = sends[0].stimulus if sends else ""
        while sequenced:
            runs = list(sequenced)
            sequenced.clear()
            for run_id, proxy, parts, nodes, tree in runs:
                actions += self._told(self.completions.start(run_id, proxy, parts, nodes), stimulus)
                if tree is not None and self.completions.running(run_id):
                    self.trees[run_id] = tree  # (its sends are the tree's already)
                lost = self.completions.lost
                if lost:  # a part for an executor already gone failed as it started: its slots are free
                    for executor_id in [e for e in parts if e in lost]:
                        sends = [*sends, *self.order.part_done(run_id, executor_id, 0.0, stimulus)]
        if len(sends) > self.above:
            sends = self._trees(sends)
        if self.group is not None and (self._held or self.group.holding):
            self._held.extend(sends)  # sent, in order, once the group has formed
            return actions
        actions.extend(sends)
        return actions

    def _group(self, group_actions: list[Form | AskAgain | Formed], stimulus: str) -> list[Action]:
        actions: list[Action] = []
        for action in group_actions:
            actions.append(dataclasses.replace(action, stimulus=stimulus))
            if isinstance(action, Formed):
                actions.extend(self._held)
                self._held = []
        return actions
