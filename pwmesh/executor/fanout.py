"""A fan-out head's relay (no sockets): a large run's parts down a tree of executors, its completions up.

The island scheduler sends a run over many executors as one ``FanOut`` per subtree (``scheduler/tree.py``).
A warm run of an installed template comes with its parts said together (``FanOut.run``, a ``TemplateRun``:
the run's fields once, and per part its nodes and ``executor_seq``, packed): the head makes its own
``Enqueue`` of part 0 and sends each child its slice of those bytes (a leaf: a ``FanOut`` of one part; a
head: of its subtree's), so no one, the scheduler included, builds or encodes a body per executor. Any
other run's parts travel as their ``Enqueue``'s encoded bodies, which the scheduler encoded once: the head
decodes its own part only and sends each child its slice of the bodies as they came, unread, so its work
per child is a copy of bytes, not a decode and an encode. Each part's ``report`` names where its
completions go (a part said together: its ``FanOut``'s ``parent``, "" for the scheduler), so a child's
``NodeDone`` and ``RunPartDone`` come here. The relay sends its parent one
``PartsDone`` per run once its own part and every child have ended (a child head: its ``PartsDone``), the
device seconds summed; failures and early completions (``NodeDone``) go up at once, as they
came, in a ``PartsDone`` of their own (``last`` false), ahead of the end that stands for them on the
same connection. A head's own part reports to the head itself (its ``report`` is the head's own control
address; the daemon hands those reports to this relay, never to a socket): its end is one of the
subtree's, so the parent hears one ``PartsDone`` per child subtree, the head's own part in it, and the
island's scheduler one message per top-level subtree per run, not two.

What a head can and cannot do to its children's parts: no more than when it decoded and re-encoded
them. It is a daemon of the cluster (the connection's key is checked as for any ``Enqueue``) and the
bodies are not signed, so it can drop, delay or alter a child's bytes, as it could alter the decoded
part before (or a part said together: its slice of the packed parts). It cannot make a child accept what the
child would not accept from the scheduler: the child decodes and validates its body as it does any
``Enqueue`` (``enqueue_body``: the same record checks; a ``FanOut`` whose packed parts do not line up is
refused whole), admits it in its island's order (``executor_seq`` per scheduler and epoch), and its reports
are accepted only from a key that speaks for it (``speaks_for``). A body that does not decode fails
that part alone, with the codec's error: the child reports it (``NodeDone`` with the error, then its
``RunPartDone``) to its ``FanOut``'s ``parent``, where its part would have reported, and still relays
its own children's bodies; the head above, which never read it, is not affected.

When an executor below is gone, the scheduler asks its head (``SubtreeLost``): the head stops waiting for
it and sends up, at once, everything it holds of the run (``lost`` set); a head above that receives such
an answer sends everything it holds up with it, so the scheduler learns every end that was on its way
before it fails the rest, naming the executor gone: a completion is never lost nor counted twice.

The island's frees of many executors come the same way (``FanOutFrees``: ``split_frees``), with nothing
coming back.
"""

from __future__ import annotations

import collections
import dataclasses

from pwmesh.errors import ProtocolError
from pwmesh.wire.messages import (
    Enqueue,
    ErrorInfo,
    FanOut,
    FanOutFrees,
    Message,
    NodeDone,
    PartsDone,
    RunPartDone,
    SubtreeLost,
    enqueue_body,
    subtree_frees,
)

MAX_RUNS = 4096  # runs a head waits on at once (the oldest forgotten: its scheduler restarted, say)

Out = list[tuple[str, Message]]  # (where, what) to post


@dataclasses.dataclass(slots=True, eq=False)
class _Pending:
    parent: str
    waiting: collections.Counter[str]  # child -> reports still due (a head child: its own part and its subtree)
    ended: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def split_frees(msg: FanOutFrees) -> Out:
    """What a head of the island's frees sends each child subtree (it deletes ``msg.buffers`` itself)."""
    return subtree_frees(msg.buffers, msg.controls, msg.sizes, start=1)


class FanOutRelay:
    def __init__(self, name: str, capacity: int = MAX_RUNS) -> None:
        self.name = name
        self.capacity = capacity
        # Where its own parts report when it heads a subtree (its control address, as the scheduler names it;
        # "" until it first heads one): the daemon hands what is sent there to ``handle``, not to a socket.
        self.control = ""
        self._runs: collections.OrderedDict[str, _Pending] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._runs)

    def fan_out(self, msg: FanOut) -> tuple[Enqueue | None, Out]:
        """This head's own part (None: its body is unreadable, and its failure is among the sends), and each
        child's message: its slice of the parts (a leaf's: a ``FanOut`` of one). Bodies go on unread: only
        the head's own is decoded; a child's is decoded, and checked, by the child. Parts said together
        (``msg.run``) go on as their slices, and the head makes its own ``Enqueue`` of part 0."""
        run = msg.run
        n = len(msg.executors)
        if run is not None:  # its parts said together, and no bodies
            wrong = run.problem(n) or (f"{len(msg.bodies) + len(msg.parts)} bodies as well"
                                       if msg.bodies or msg.parts else "")
            what = wrong or "its parts"
        else:
            wrong = "parts" if len(msg.bodies) != n or msg.parts else ""
            what = f"{len(msg.bodies)} bodies"
        if n == 0 or wrong or len(msg.controls) != n or len(msg.sizes) != n:
            raise ProtocolError(f"FanOut of run {msg.run_id}: {what} for {n} executors, {len(msg.controls)} "
                                f"controls and {len(msg.sizes)} sizes")
        out: Out = []
        waiting: collections.Counter[str] = collections.Counter()
        me = msg.controls[0]
        if n > 1:
            self.control = me
            waiting[self.name] = 1  # its own part: it reports here, and its end goes up with the subtree's
        bodies, executors, controls, sizes = msg.bodies, msg.executors, msg.controls, msg.sizes
        run_id = msg.run_id
        ranges = []
        i = 1
        while i < n:
            j = i + min(max(1, sizes[i]), n - i)
            ranges.append((i, j))
            waiting[executors[i]] += 1  # a leaf's RunPartDone, or a head child's PartsDone (its own part in it)
            i = j
        cuts = run.cut(ranges) if run is not None else [None] * len(ranges)
        for (i, j), cut in zip(ranges, cuts, strict=True):
            out.append((controls[i], FanOut(run_id=run_id, parent=me, bodies=bodies[i:j] if cut is None else [],
                                            executors=executors[i:j], controls=controls[i:j], sizes=sizes[i:j],
                                            run=cut)))
        if waiting:
            self._runs[run_id] = _Pending(msg.parent, waiting)
            while len(self._runs) > self.capacity:
                self._runs.popitem(last=False)
        if run is not None:  # its completions come here when it heads a subtree (else: "" is the scheduler)
            return run.first(run_id, me if waiting else "" if msg.parent == run.scheduler else msg.parent), out
        try:
            own = enqueue_body(bodies[0], f"FanOut of run {run_id}: {self.name}'s part")
        except ProtocolError as exc:  # its own part fails, never the rest of its subtree
            failed = [NodeDone(run_id=run_id, nodes=[], executor_id=self.name, error=ErrorInfo.of(exc)),
                      RunPartDone(run_id=run_id, executor_id=self.name, device_seconds=0.0)]
            if not waiting:  # (a FanOut of one: no subtree here, it reports where its part would have)
                return None, [*out, *[(msg.parent, report) for report in failed]]
            return None, [*out, *self.handle(failed[0]), *self.handle(failed[1])]
        if waiting:
            own.report = me  # (whatever its body said: the relay waits for it here)
        return own, out

    def handle(self, msg: Message) -> Out:
        """A child's report, or the scheduler's word that one below is gone: what goes up."""
        if isinstance(msg, RunPartDone):
            run = self._runs.get(msg.run_id)
            if run is None or not run.waiting[msg.executor_id]:
                return []
            run.ended.append(msg.executor_id)
            run.seconds += msg.device_seconds
            return self._heard(msg.run_id, run, msg.executor_id)
        if isinstance(msg, NodeDone):
            run = self._runs.get(msg.run_id)
            if run is None or not run.waiting[msg.executor_id]:
                return []
            return [(run.parent, PartsDone(run_id=msg.run_id, head=self.name, reports=[msg], last=False))]
        if isinstance(msg, PartsDone):
            return self._child_parts(msg)
        if isinstance(msg, SubtreeLost):
            out: Out = []
            for run_id in msg.run_ids:
                run = self._runs.get(run_id)
                if run is None:  # nothing held: say so (the heads above send up what they hold)
                    continue
                run.waiting.pop(msg.executor_id, None)
                out += self._up(run_id, run, last=not run.waiting, lost=msg.executor_id)
            return out
        return []

    def _child_parts(self, msg: PartsDone) -> Out:
        run = self._runs.get(msg.run_id)
        if run is None or not run.waiting[msg.head]:
            return []
        run.ended += msg.ended
        run.seconds += msg.device_seconds
        if msg.lost:  # an answer to SubtreeLost: up at once, with everything held here
            if msg.last:
                run.waiting[msg.head] -= 1
                if run.waiting[msg.head] <= 0:
                    del run.waiting[msg.head]
            return self._up(msg.run_id, run, last=not run.waiting, lost=msg.lost, reports=msg.reports)
        if msg.reports:
            up: Out = [(run.parent, PartsDone(run_id=msg.run_id, head=self.name, reports=msg.reports, last=False))]
        else:
            up = []
        if not msg.last:
            return up
        return up + self._heard(msg.run_id, run, msg.head)

    def _heard(self, run_id: str, run: _Pending, child: str) -> Out:
        run.waiting[child] -= 1
        if run.waiting[child] > 0:
            return []
        del run.waiting[child]
        return self._up(run_id, run, last=True) if not run.waiting else []

    def _up(self, run_id: str, run: _Pending, *, last: bool, lost: str = "", reports: list[NodeDone] | None = None) -> Out:
        done = PartsDone(run_id=run_id, head=self.name, ended=run.ended, device_seconds=run.seconds,
                         reports=reports or [], last=last, lost=lost)
        run.ended, run.seconds = [], 0.0
        if last:
            self._runs.pop(run_id, None)
        return [(run.parent, done)]
