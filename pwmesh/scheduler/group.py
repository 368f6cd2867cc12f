"""An island's JAX group, formed and re-formed as its membership changes: a pure core.

The executors of an island started with ``--collectives`` form one JAX multi-process
group, so SPMD computations span them. JAX fixes a group when its processes start
their backends, so a change of membership (an executor joins, is drained or is lost)
means a new *forming* (an epoch): a new coordinator, and every member restarting its
JAX runtime into it (``JoinGroup``; the executor keeps its buffers across that in host
memory). While a forming is under way the island's work is held, so no computation
reaches an executor that is restarting or pairs members of two formings.

``IslandGroup.handle(event, now) -> actions`` decides; the scheduler carries the actions
out (spawn and stop coordinators, send ``JoinGroup``, release held work).
"""

from __future__ import annotations

import dataclasses

# ------------------------------------------------------------------ events


@dataclasses.dataclass(frozen=True)
class Joined:
    """An executor of the island registered, in forming ``epoch`` of the group (0: in none yet)."""

    executor_id: str
    epoch: int


@dataclasses.dataclass(frozen=True)
class Left:
    """An executor of the island is gone (lost, drained)."""

    executor_id: str


@dataclasses.dataclass(frozen=True)
class Tick:
    """Time passed: a settled membership may now start a forming; a slow one is asked again."""


Event = Joined | Left | Tick

# ----------------------------------------------------------------- actions


@dataclasses.dataclass(frozen=True)
class Form:
    """Start forming ``epoch``: a coordinator for ``len(members) + 1`` processes, then ``JoinGroup`` to
    each member (process ``i + 1`` is ``members[i]``)."""

    epoch: int
    members: tuple[str, ...]
    stimulus: str = ""  # the event that caused it (``SchedulerState`` fills it in)


@dataclasses.dataclass(frozen=True)
class AskAgain:
    """Send ``JoinGroup`` for forming ``epoch`` again to ``members`` that have not joined it yet (a
    message to an executor that was restarting may have been lost)."""

    epoch: int
    members: tuple[str, ...]
    stimulus: str = ""  # the event that caused it (``SchedulerState`` fills it in)


@dataclasses.dataclass(frozen=True)
class Formed:
    """Forming ``epoch`` is complete (every member registered in it): stop the coordinators of older
    formings and release the held work. Epoch 0 with no members: the island has no group now."""

    epoch: int
    members: tuple[str, ...]
    stimulus: str = ""  # the event that caused it (``SchedulerState`` fills it in)


Action = Form | AskAgain | Formed


@dataclasses.dataclass
class IslandGroup:
    # A membership change waits this long for the next before a forming starts (executors of a
    # starting cluster register one by one: one forming for all of them, not one each).
    settle_seconds: float = 0.5
    ask_again_seconds: float = 5.0

    def __post_init__(self) -> None:
        self.live: dict[str, int] = {}  # member -> the forming it reports being in
        self.formed: tuple[str, ...] = ()
        self.formed_epoch = 0  # the newest complete forming (0: none)
        self.epoch = 0  # of the newest forming, complete or under way
        self.forming: tuple[str, ...] | None = None  # its members while under way
        self._changed = 0.0  # when membership last changed
        self._asked = 0.0  # when the forming under way last asked its members

    @property
    def holding(self) -> bool:
        """Whether the island's work must wait: a forming is under way or due."""
        return self.forming is not None or self._due()

    def _due(self) -> bool:
        return tuple(sorted(self.live)) != self.formed or any(e != self.formed_epoch for e in self.live.values())

    def handle(self, event: Event, now: float) -> list[Action]:
        match event:
            case Joined(executor_id=member, epoch=epoch):
                self.epoch = max(self.epoch, epoch)  # after a restart of ours, members may be in later ones
                if self.live.get(member) != epoch:
                    if member not in self.live or epoch == 0:  # new, or restarted by someone else
                        self._changed = now
                    self.live[member] = epoch
            case Left(executor_id=member):
                if self.live.pop(member, None) is not None:
                    self._changed = now
            case Tick():
                pass
        return self._step(now)

    def _step(self, now: float) -> list[Action]:
        members = tuple(sorted(self.live))
        if self.forming is not None:
            # A member gone under way: the others wait for it in vain; form again without it. (A member
            # new under way waits for the next forming: this one completes first.)
            if any(m not in self.live for m in self.forming):
                if now - self._changed < self.settle_seconds:
                    return []
                return self._form(members, now) if members else self._none()
            waiting = tuple(m for m in self.forming if self.live[m] != self.epoch)
            if not waiting:
                self.formed, self.forming, self.formed_epoch = self.forming, None, self.epoch
                return [Formed(self.epoch, self.formed)]
            if now - self._asked >= self.ask_again_seconds:
                self._asked = now
                return [AskAgain(self.epoch, waiting)]
            return []
        if not self._due() or now - self._changed < self.settle_seconds:
            return []
        if not members:  # the last member left: nothing to form
            return self._none()
        return self._form(members, now)

    def _none(self) -> list[Action]:
        self.formed, self.forming, self.formed_epoch = (), None, self.epoch
        return [Formed(self.epoch, ())]

    def _form(self, members: tuple[str, ...], now: float) -> list[Action]:
        self.epoch += 1
        self.forming = members
        self._asked = now
        return [Form(self.epoch, members)]
