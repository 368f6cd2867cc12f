"""The RM and the island schedulers in the simulator: the real pure cores behind thin shells.

Each shell does what its asyncio daemon does with a message — and nothing more — so
the core is what the simulation measures: ``SimResourceManager`` wraps
``rm.state.ResourceManagerState``, ``SimScheduler`` wraps ``scheduler.state.SchedulerState``
(one per island), each through its one entry, ``handle(event, now) -> actions``; the proxy's is
``sim.proxy``. Every call into a core is timed
(``Node.core``: real CPU seconds), which is where a single controller would saturate.
"""

from __future__ import annotations

from typing import Any

from pwmesh.core.contract import Received, Reply, Send
from pwmesh.errors import PwmeshError
from pwmesh.rm.state import Notify, ResourceManagerState
from pwmesh.scheduler.state import SchedulerState
from pwmesh.sim.clock import Clock
from pwmesh.sim.network import Network
from pwmesh.sim.node import Node
from pwmesh.wire import Envelope
from pwmesh.wire.messages import (
    Enqueue,
    Error,
    ExecutorLost,
    FanOut,
    FreeShards,
    InstallTemplate,
    NeedTemplate,
    NodeDone,
    PartsDone,
    RunPartDone,
    RunTemplate,
    ScheduleRun,
    WatchCluster,
)


def error_message(exc: BaseException) -> Error:
    """An exception as the wire's ``Error`` (as every daemon's shell answers one)."""
    if isinstance(exc, PwmeshError):
        return Error(code=exc.code, message=exc.message)
    return Error(code="internal", message=f"{type(exc).__name__}: {exc}")


class SimResourceManager(Node):
    """The RM's shell: every request to the core, its reply back, its notifications to the watchers."""

    def __init__(self, address: str, clock: Clock, network: Network, state: ResourceManagerState,
                 **node: Any) -> None:
        super().__init__(address, clock, network, **node)
        self.state = state
        self.watchers: list[str] = []

    def handle(self, env: Envelope) -> None:
        if isinstance(env.message, WatchCluster) and env.sender not in self.watchers:
            self.watchers.append(env.sender)
        for action in self.core(self.state.handle, Received(env.message), self.clock.now):
            if isinstance(action, Notify):
                for watcher in self.watchers:
                    self.post(watcher, action.message)
            elif action.error is not None:
                self.post(env.sender, error_message(action.error), reply_to=env.msg_id)
            elif action.message is not None:
                self.post(env.sender, action.message, reply_to=env.msg_id)


class SimScheduler(Node):
    """An island scheduler's shell: ``ScheduleRun``, ``InstallTemplate``, ``RunTemplate``, ``FreeShards``,
    ``NodeDone``, ``RunPartDone``, ``NeedTemplate`` and the RM's ``ExecutorLost`` into ``SchedulerState``;
    ``Enqueue`` (and ``InstallPart``, ``TemplateMissing``, the proxy's ``IslandDone``, the executors'
    ``DeleteShards``) out."""

    def __init__(self, address: str, clock: Clock, network: Network, state: SchedulerState, **node: Any) -> None:
        super().__init__(address, clock, network, **node)
        self.state = state
        self.order = state.order
        self.decisions = 0  # runs released into the island's order
        self.enqueues = 0

    def handle(self, env: Envelope) -> None:
        msg = env.message
        if not isinstance(msg, ScheduleRun | RunTemplate | InstallTemplate | NeedTemplate | RunPartDone | NodeDone
                          | PartsDone | FreeShards | ExecutorLost):
            return  # the RM's other news concerns the JAX group, which the simulator has none of
        actions = self.core(self.state.handle, Received(msg), self.clock.now)
        runs = set()
        for action in actions:
            if isinstance(action, Reply):
                if action.error is not None:
                    self.post(env.sender, error_message(action.error), reply_to=env.msg_id)
            elif isinstance(action, Send) and isinstance(action.message, Enqueue | FanOut):
                runs.add(action.message.run_id)
                self.enqueues += 1 if isinstance(action.message, Enqueue) else action.message.count()
                self.post(action.to, action.message)
            elif isinstance(action, Send):  # a template's part again, or a run refused for want of its template
                self.post(action.to, action.message)
        self.decisions += len(runs)
