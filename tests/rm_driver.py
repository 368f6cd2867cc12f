"""The resource manager's core driven as its shells drive it (``rm/daemon.py``, ``sim/controller.py``), for
tests written as requests and replies: ``ask`` hands the core a request (``Received``) and returns its
answer, raising the error it failed with; the ``Notify`` actions wait in ``notices`` until
``take_notifications``; ``expire`` is a ``Tick`` and returns the executors it found lost."""

from __future__ import annotations

import dataclasses

from pwmesh.core.contract import Received, Reply
from pwmesh.rm.state import Action, Notify, ResourceManagerState, Tick
from pwmesh.wire import Message
from pwmesh.wire.messages import ExecutorLost


@dataclasses.dataclass
class DrivenRM(ResourceManagerState):
    def __post_init__(self) -> None:
        super().__post_init__()
        self.notices: list[Message] = []

    def _carry_out(self, actions: list[Action]) -> Message | None:
        reply: Message | None = None
        for action in actions:
            if isinstance(action, Notify):
                self.notices.append(action.message)
            else:
                assert isinstance(action, Reply) and action is actions[-1], "the answer comes last, once"
                if action.error is not None:
                    raise action.error
                reply = action.message
        return reply

    def ask(self, message: Message, now: float) -> Message | None:
        return self._carry_out(self.handle(Received(message), now))

    def take_notifications(self) -> list[Message]:
        out, self.notices = self.notices, []
        return out

    def expire(self, now: float) -> list[str]:
        before = len(self.notices)
        self._carry_out(self.handle(Tick(), now))
        return [n.executor_id for n in self.notices[before:] if isinstance(n, ExecutorLost)]
