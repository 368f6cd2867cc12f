"""What an island's executors reported of its runs, told to each run's proxy once per island (no sockets).

A run's executors report to the island's scheduler that sent them their parts, not to the proxy; the
scheduler's core (``scheduler/state.py``) hands the reports here, and sends the proxy what this returns:

- ``RunPartDone`` ends an executor's part (it stands for every computation of the part not reported
  before). Once every executor with a part of the run here has ended it, the proxy is sent **one**
  ``IslandDone`` naming the run's nodes here not reported before: with N executors, one message to the
  proxy instead of N.
- ``NodeDone`` without an error: computations someone outside the run may wait for (a program's output:
  a fetch, a consumer in a later run or another island). A node is reported early (its own
  ``IslandDone``) once every executor of the island with that node completed it (reported it, or ended its
  part), unless the run ends at the same event (then the run's message carries it).
- ``NodeDone`` with an error goes to the proxy at once, its ``executor_id`` and ``ErrorInfo`` unchanged (the
  cause stays: issue #27 item 7): the proxy fails the node's outputs, and the island's final message still
  lists the node (it ends it; a buffer's first outcome stays).
- An executor that left (``ExecutorLost``) before ending its part of a run here: the proxy is told at once
  (``IslandDone(lost=True)``: the run cannot finish) and the part counts as ended, so the island's message
  still goes. A graceful drain delivers the executor's reports before it leaves (a barrier), so a part it
  ended is never taken for lost; a part not sequenced yet for a lost executor fails as it is sequenced.

Each (run, executor, node) counts once: a report of a run not in flight here (ended, or ordered by an
earlier instance of this scheduler: a restart loses the runs in flight, and the proxy fails them on
``SchedulerLost``) or of an executor whose part has ended is dropped, so a report sent twice (a restarted
executor's process, a retry) never doubles a completion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Mapping

from pwmesh.errors import DeviceLost
from pwmesh.wire.messages import ErrorInfo, IslandDone, NodeDone

MAX_LOST = 4096  # executors remembered as lost (a part sequenced for one fails at once)


@dataclasses.dataclass(slots=True, eq=False)
class _Run:
    proxy: str
    nodes: list[int]  # every node of the run on this island, in order
    parts: Mapping[str, list[int]]  # executor -> its nodes (shared with the template: never changed)
    left: set[str]  # executors whose part has not ended
    told: set[int] = dataclasses.field(default_factory=set)  # nodes the proxy was told completed (early)
    # Nodes reported early by some executor: node -> executors that have not completed it yet.
    early: dict[int, set[str]] = dataclasses.field(default_factory=dict)


class IslandCompletions:
    """The runs in flight on one island and what their executors reported; each method returns the
    ``IslandDone`` messages for the proxy, as (proxy address, message)."""

    def __init__(self, scheduler: str = "") -> None:
        self.scheduler = scheduler  # this scheduler's address, as the proxy knows it
        self._runs: dict[str, _Run] = {}
        self.lost: dict[str, str] = {}  # executor -> why it is gone (until it joins again)

    def __len__(self) -> int:
        return len(self._runs)

    def start(self, run_id: str, proxy: str, parts: Mapping[str, list[int]],
              nodes: list[int] | None = None) -> list[tuple[str, IslandDone]]:
        """Run ``run_id`` was sequenced: ``parts`` are executor -> its nodes (not changed after: a template's
        are shared by its runs), ``nodes`` all of them in order (None: worked out here)."""
        if nodes is None:
            nodes = sorted({n for mine in parts.values() for n in mine})
        run = self._runs[run_id] = _Run(proxy, nodes, parts, set(parts))
        out: list[tuple[str, IslandDone]] = []
        if not self.lost:
            return out
        for executor_id in [e for e in parts if e in self.lost]:
            out += self._lose(run_id, run, executor_id, self.lost[executor_id])
        return out

    def node_done(self, msg: NodeDone) -> list[tuple[str, IslandDone]]:
        run = self._runs.get(msg.run_id)
        if run is None or msg.executor_id not in run.left:
            return []  # ended, ordered by an earlier instance of this scheduler, or its part ended: counted
        mine = run.parts[msg.executor_id]
        nodes = [n for n in msg.nodes if n in mine]
        if msg.error is not None:  # at once, as the executor sent it (the island's end still lists the nodes)
            if not msg.nodes:  # its whole part failed (a fan-out head that could not read its own part)
                nodes = list(mine)
            return [(run.proxy, IslandDone(run_id=msg.run_id, scheduler=self.scheduler, nodes=nodes,
                                           executor_id=msg.executor_id, error=msg.error))]
        ready = []
        for node in nodes:
            waiting = run.early.get(node)
            if waiting is None:
                if node in run.told:
                    continue
                waiting = run.early[node] = {e for e in run.left if node in run.parts[e]}
            waiting.discard(msg.executor_id)
            if not waiting and node not in run.told:
                ready.append(node)
        return self._early(msg.run_id, run, ready)

    def part_done(self, run_id: str, executor_id: str) -> list[tuple[str, IslandDone]]:
        run = self._runs.get(run_id)
        if run is None or executor_id not in run.left:
            return []
        run.left.discard(executor_id)
        if not run.left:
            del self._runs[run_id]
            nodes = [n for n in run.nodes if n not in run.told] if run.told else run.nodes
            return [(run.proxy, IslandDone(run_id=run_id, scheduler=self.scheduler, nodes=nodes))]
        if not run.early:
            return []
        ready = []
        for node in run.parts[executor_id]:  # its early nodes are complete there too
            waiting = run.early.get(node)
            if waiting is not None:
                waiting.discard(executor_id)
                if not waiting and node not in run.told:
                    ready.append(node)
        return self._early(run_id, run, ready)

    def parts_done(self, run_id: str, executor_ids: list[str]) -> list[tuple[str, IslandDone]]:
        """Several executors' parts ended together (a fan-out head's ``PartsDone``): what ``part_done`` for each
        in turn says, in one step where no node was reported early (the island's one message, or nothing)."""
        run = self._runs.get(run_id)
        if run is None:
            return []
        if run.early:
            out: list[tuple[str, IslandDone]] = []
            for executor_id in executor_ids:
                out += self.part_done(run_id, executor_id)
            return out
        run.left.difference_update(executor_ids)
        if run.left:
            return []
        del self._runs[run_id]
        nodes = [n for n in run.nodes if n not in run.told] if run.told else run.nodes
        return [(run.proxy, IslandDone(run_id=run_id, scheduler=self.scheduler, nodes=nodes))]

    def executor_lost(self, executor_id: str, why: str, spare: Container[str] = ()) -> list[tuple[str, IslandDone]]:
        """``executor_id`` left: every part of it not ended fails its run (and counts as ended), but in the runs
        ``spare`` names (it reported through a fan-out head, which is asked what it had: ``lose_parts``)."""
        self.lost[executor_id] = why
        while len(self.lost) > MAX_LOST:
            del self.lost[next(iter(self.lost))]
        out: list[tuple[str, IslandDone]] = []
        for run_id, run in list(self._runs.items()):
            if executor_id in run.left and run_id not in spare:
                out += self._lose(run_id, run, executor_id, why)
        return out

    def running(self, run_id: str) -> bool:
        return run_id in self._runs

    def lose_parts(self, run_id: str, executors: list[str], named: str, why: str) -> list[tuple[str, IslandDone]]:
        """The parts of ``executors`` not ended will never report (their reports came through ``named``, a
        fan-out head that is gone): the proxy is told once, naming it, and they count as ended."""
        run = self._runs.get(run_id)
        if run is None:
            return []
        gone = [e for e in executors if e in run.left]
        if not gone:
            return []
        nodes = sorted({n for e in gone for n in run.parts[e] if n not in run.told})
        out = [(run.proxy, IslandDone(run_id=run_id, scheduler=self.scheduler, nodes=nodes, executor_id=named,
                                      error=ErrorInfo.of(DeviceLost(why)), lost=True))]
        for e in gone:
            out += self.part_done(run_id, e)
        return out

    def executor_joined(self, executor_id: str) -> None:
        self.lost.pop(executor_id, None)

    def _lose(self, run_id: str, run: _Run, executor_id: str, why: str) -> list[tuple[str, IslandDone]]:
        mine = [n for n in run.parts[executor_id] if n not in run.told]
        lost = (run.proxy, IslandDone(run_id=run_id, scheduler=self.scheduler, nodes=mine, executor_id=executor_id,
                                      error=ErrorInfo.of(DeviceLost(why)), lost=True))
        return [lost, *self.part_done(run_id, executor_id)]

    def _early(self, run_id: str, run: _Run, ready: list[int]) -> list[tuple[str, IslandDone]]:
        if not ready:
            return []
        run.told.update(ready)
        return [(run.proxy, IslandDone(run_id=run_id, scheduler=self.scheduler, nodes=ready))]
