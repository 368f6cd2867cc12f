"""The RM and the island schedulers in the simulator: the real pure cores behind thin shells.

Each shell does what its asyncio daemon does with a message — and nothing more — so
the core is what the simulation measures: ``SimResourceManager`` wraps
``rm.state.ResourceManagerState``, ``SimScheduler`` wraps ``scheduler.order.IslandOrder``
(one per island); the proxy's is ``sim.proxy``. Every call into a core is timed
(``Node.core``: real CPU seconds), which is where a single controller would saturate.
"""

from __future__ import annotations

from typing import Any

from pwmesh.errors import PwmeshError
from pwmesh.rm.state import ResourceManagerState
from pwmesh.scheduler.order import IslandOrder, SendEnqueue
from pwmesh.sim.clock import Clock
from pwmesh.sim.network import Network
from pwmesh.sim.node import Node
from pwmesh.wire import Envelope
from pwmesh.wire.messages import (
    Error,
    ExecutorLost,
    RunPartDone,
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
        try:
            reply = self.core(self.state.handle, env.message, self.clock.now)
        except PwmeshError as exc:
            reply = error_message(exc)
        self.notify()
        if reply is not None:
            self.post(env.sender, reply, reply_to=env.msg_id)

    def notify(self) -> None:
        for note in self.core(self.state.take_notifications):
            for watcher in self.watchers:
                self.post(watcher, note)


class SimScheduler(Node):
    """An island scheduler's shell: ``ScheduleRun`` and ``RunPartDone`` into ``IslandOrder``, ``Enqueue`` out."""

    def __init__(self, address: str, clock: Clock, network: Network, order: IslandOrder, **node: Any) -> None:
        super().__init__(address, clock, network, **node)
        self.order = order
        self.decisions = 0  # runs released into the island's order
        self.enqueues = 0

    def handle(self, env: Envelope) -> None:
        msg = env.message
        try:
            if isinstance(msg, ScheduleRun):
                actions = self.core(self.order.submit, msg)
            elif isinstance(msg, RunPartDone):
                actions = self.core(self.order.part_done, msg.run_id, msg.executor_id, msg.device_seconds)
            elif isinstance(msg, ExecutorLost):
                actions = self.core(self.order.forget_executor, msg.executor_id)
            else:
                return  # the RM's other news concerns the JAX group, which the simulator has none of
        except PwmeshError as exc:
            self.post(env.sender, error_message(exc), reply_to=env.msg_id)
            return
        self._post(actions)

    def _post(self, actions: list[SendEnqueue]) -> None:
        self.decisions += len({a.enqueue.run_id for a in actions})
        self.enqueues += len(actions)
        for action in actions:
            self.post(action.control, action.enqueue)
