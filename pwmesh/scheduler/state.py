"""The island scheduler's core, with no sockets: ``SchedulerState.handle(event, now) -> actions``.

It joins the island's order (``order.py``: ``IslandOrder``, the sharing policy and the sequencing) and,
on an island of ``--collectives`` executors, its JAX group (``group.py``: ``IslandGroup``): while a
forming of the group is under way or due, the Enqueues the order releases are held, in order, and leave
right after the forming completes. The daemon (``scheduler/daemon.py``) and the simulator
(``sim/controller.py``) drive this same core.

Events:
    ``Received(message)``  ``ScheduleRun``, ``InstallTemplate``, ``RunTemplate`` and ``FreeShards`` from a proxy
                           (``templates.py``), ``NodeDone``, ``RunPartDone`` and ``NeedTemplate`` from an
                           executor, and the resource manager's notices ``ExecutorJoined`` and ``ExecutorLost``
                           (the shell does what concerns its connections itself: marking a peer alive or
                           lost, fences).
    ``Tick()``             time passed: a settled membership may start a forming of the group.

Actions (each carrying the id of the event that caused it, ``stimulus``):
    ``Send(control, Enqueue)`` an executor's part of a released run, in the island's order.
    ``Send(control, InstallPart)`` a template's part an executor asked for again.
    ``Send(proxy, TemplateMissing)`` a run of a template not held here, refused whole.
    ``Send(proxy, IslandDone)`` what the island's executors reported of a run (``completions.py``): one
                           message when every part has ended; a failure at once; an output early.
    ``Send(control, DeleteShards)`` the proxy's frees for the island (``FreeShards``), one per executor.
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
from pwmesh.wire.messages import (
    DeleteShards,
    ExecutorJoined,
    ExecutorLost,
    FreeShards,
    InstallTemplate,
    IslandDone,
    NeedTemplate,
    NodeDone,
    RunPartDone,
    RunTemplate,
    ScheduleRun,
)

MAX_LOGGED_RUN_BYTES = 64 << 10  # a larger ScheduleRun is logged as a line, not kept (the log keeps 2,000 events)

# ------------------------------------------------------------------ events


@dataclasses.dataclass(slots=True)
class Tick:
    """Time passed (the island's JAX group waits for a membership to settle, and asks slow members again)."""


Event = Received | Tick
Action = Send | Reply | Form | AskAgain | Formed

_KINDS = {ScheduleRun: "schedule", RunTemplate: "run", InstallTemplate: "install", NeedTemplate: "need",
          RunPartDone: "part-done", NodeDone: "node-done", FreeShards: "free", ExecutorJoined: "joined",
          ExecutorLost: "lost"}


class SchedulerState:
    def __init__(self, order: IslandOrder, group: IslandGroup | None = None) -> None:
        self.order = order
        self.group = group  # None: the island's executors form no JAX group
        self.controls: dict[str, str] = {}  # the group's members: executor -> control address
        self.events = EventLog()
        self._held: list[Send] = []  # the island's work while its group forms, in order
        self.completions = IslandCompletions(order.scheduler)  # what executors reported, for the proxies
        order.sequenced = []

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
                case NodeDone():
                    actions = self._told(self.completions.node_done(message), stimulus)
                case FreeShards(groups=groups):  # not held while the group forms: frees order nothing
                    actions = [Send(control, DeleteShards(buffers=group.buffers), stimulus)
                               for group in groups for control in group.controls]
                case RunTemplate():
                    actions = self._release(self.order.submit_template(message, stimulus))
                case ScheduleRun():
                    actions = self._release(self.order.submit(message, stimulus))
                case InstallTemplate():
                    self.order.install(message)
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
                    actions = self._told(self.completions.executor_lost(
                        executor_id, f"executor {executor_id} on host {host} is gone ({reason})"), stimulus)
                    actions += self._release(self.order.forget_executor(executor_id, stimulus))
                    if self.group is not None:
                        actions += self._group(self.group.handle(Left(executor_id), now), stimulus)
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

    def _told(self, reports: list[tuple[str, IslandDone]], stimulus: str) -> list[Action]:
        return [Send(proxy, done, stimulus) for proxy, done in reports]

    def _release(self, sends: list[Send]) -> list[Action]:
        """The order's Enqueues: now, or held (in order) while the island's JAX group forms. The runs they
        sequenced are counted for their completions from now (a part sequenced for a lost executor fails)."""
        actions: list[Action] = []
        sequenced = self.order.sequenced
        if sequenced:
            stimulus = sends[0].stimulus if sends else ""
            for run_id, proxy, parts, nodes in sequenced:
                actions += self._told(self.completions.start(run_id, proxy, parts, nodes), stimulus)
            sequenced.clear()
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
