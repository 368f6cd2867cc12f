"""The executor's pure core: which runs it admits, in what order, and what it reports of them.

``ExecutorState.handle(event, now) -> actions`` has no threads, JAX or sockets. The daemon
(``executor/daemon.py``, with ``Runner`` running the computations) and the simulated executor
(``sim/executor.py``) drive this same core; a test drives it with events alone.

Events:
    ``Received(enqueue)``         an ``Enqueue`` from an island's scheduler, in whatever order the network
                                  gave it: admitted in the island's order (``executor_seq`` per scheduler
                                  instance), the ones that overtook an earlier one held until it comes.
    ``Installed(part)``           a template's part the executor asked its scheduler for (``InstallPart``),
                                  or word that the scheduler no longer has it.
    ``TemplateTimeout(template)`` the wait for that answer is over: what still waits for it fails.
    ``Cancelled(run_id, error)``  the proxy cancelled a run (``CancelRun``): what of it is queued fails, and
                                  what of it arrives later fails at once.
    ``Reclaimed(owner, marker, error)`` a restarted proxy took session ``owner`` back (``ReclaimOwner``): runs
                                  the proxy before sent (names without ``marker``) are cancelled, now and later.
    ``Forgotten(owner)``          the session ended for good (``ForgetOwner``).
    ``Completed(run_id, proxy, node, quiet, error, scheduler)`` a computation of a run completed (or
                                  failed, or was refused as it was admitted); ``scheduler``: the one that
                                  sent its part (its completions are reported there).
    ``PartEnded(run_id, scheduler, device_seconds)`` every computation of a run admitted here completed.
    ``Flush()``                   the wake-ups of this instant ran: batched completions leave.
    ``StartedOver()``             the executor was declared lost and starts over as a new one: the island's
                                  order and what waited for a part's end start over too.
    ``Leaving()``                 the process restarts (its work goes on in the next): every completion
                                  held here leaves now, quiet ones too.

Actions:
    ``Send(to, message)``         post a message (``NodeDone`` and ``RunPartDone`` to a scheduler; ``NodeDone``
                                  to the proxy for a part that came with no scheduler).
    ``Send(scheduler, NeedTemplate)`` a run named a template this executor does not hold: that run, and
                                  every later one from the same scheduler (the island's order), wait for it.
    ``Admit(enqueue, computations)`` run these (the runner's device queues take them in this order); those
                                  it refuses come back as ``Completed`` with their error.
    ``CancelWork(run_id, error)`` fail what of ``run_id`` is queued or waiting here.
    ``Timer(now, Flush())``       hand the core ``Flush`` once this instant's wake-ups have run.

Completions go to the island's scheduler that sent the part (``scheduler/completions.py`` tells the
proxy once per run per island): a computation that fails is reported at once (``NodeDone`` with its
error); one someone outside its run may wait for (not *quiet*: a program's output) leaves with the others
of its run after the loop's wake-ups; and the part's ``RunPartDone`` stands for every completion of the
part not reported before, so a *quiet* one is never sent on its own, nor an output that completed in the
same turn as its part's end (a chained run: one message per executor). What is reported before it leaves
first, on the same connection, so the scheduler counts each once and in order. A part that came with no
scheduler (a test's) reports to its proxy as before: quiet completions with its end.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
from typing import Protocol

from pwmesh.core.contract import EventLog, Send, Timer, describe
from pwmesh.errors import NotFound, PwmeshError
from pwmesh.executor.store import renamed
from pwmesh.wire.messages import Computation, Enqueue, ErrorInfo, InstallPart, NeedTemplate, NodeDone, RunPartDone
from pwmesh.wire.parts import PartTemplates, enqueued

MAX_CANCELLED = 10_000  # cancelled runs remembered (runs are cancelled rarely; the recent ones matter)
MAX_LOGGED_PART_BYTES = 64 << 10  # a larger Enqueue is logged as a line, not kept (the log keeps 2,000 events)
TEMPLATE_WAIT_SECONDS = 30.0  # a run waits this long for its template's part from its scheduler, then fails
INLINE_SECONDS = 1e-3  # computations quicker than this (all shards, recently) run on the event loop, not a device thread

# ------------------------------------------------------------------ how a computation runs


class Timing(Protocol):
    """What the executor measured of a compiled function (``CompiledFunction``): data, so tests inject it."""

    bounded: bool | None  # nothing in it loops without a trip count, calls the host or waits on data
    seconds: float  # how long one shard's run takes, recently (inf: never ran)
    runs: int


class How(enum.Enum):
    INLINE = "inline"  # right on the event loop: quicker than the hop to a device thread and back
    STREAM = "stream"  # handed to its devices without waiting (as on an accelerator's stream)
    THREAD = "thread"  # on its devices' threads, waited for there


def runs_inline(timing: Timing, seconds: float, asynchronous: bool = False) -> bool:
    """Whether a computation expected to take ``seconds`` (all its shards) is quick enough to run
    right on the loop (held at most INLINE_SECONDS), rather than hop to device threads and back.

    Only a bounded function ever does: one that loops may take any time on its next inputs, whatever
    it took before. Timed on threads, a function looks slower than it is (they contend for the
    interpreter), so one that might be quick enough goes inline every 16th run, to be timed there.
    Never on devices that compute ``asynchronous``ly (an accelerator): the loop would wait out the
    device's time doing nothing, when it could take the next computations meanwhile (streamed: handed
    to the device, landed by a thread). On a GPU a tiny training step held the loop ~0.7 ms a step."""
    if asynchronous or timing.bounded is not True:
        return False
    return seconds < INLINE_SECONDS or (seconds < 2 * INLINE_SECONDS and timing.runs % 16 == 0)


def how_to_run(comp: Computation, timing: Timing | None, shards: int, asynchronous: bool = False) -> How:
    """How a computation of a registered function runs, over ``shards`` device pieces (a gang's whole mesh),
    given what was measured of it (``timing``; None: not compiled for these devices yet), on devices that
    compute ``asynchronous``ly or not (``runs_inline``).

    A gang runs on its device thread: handing it to XLA may wait there for its peers, and the loop must
    go on serving the other devices. So do routed rows (padded and cut on the host), what is not
    compiled yet (it compiles there), and what is not bounded (XLA may run it to its end in the call
    that hands it over). The rest is streamed, or runs inline if it is quick."""
    if comp.gang or comp.ragged or timing is None or timing.bounded is not True:
        return How.THREAD
    if runs_inline(timing, timing.seconds * shards, asynchronous):
        return How.INLINE
    return How.STREAM

# ------------------------------------------------------------------ events
#
# Events and actions are not changed once made, but not frozen either: a frozen dataclass's __init__ costs
# four times a plain one's (0.55 against 0.14 us for a completion), and one is made per computation.


@dataclasses.dataclass(slots=True)
class Received:
    message: Enqueue


@dataclasses.dataclass(slots=True)
class Installed:
    message: InstallPart


@dataclasses.dataclass(slots=True)
class TemplateTimeout:
    template_id: str


@dataclasses.dataclass(slots=True)
class Cancelled:
    run_id: str
    error: PwmeshError


@dataclasses.dataclass(slots=True)
class Reclaimed:
    owner: str
    marker: str
    error: PwmeshError


@dataclasses.dataclass(slots=True)
class Forgotten:
    owner: str


@dataclasses.dataclass(slots=True)
class Completed:
    run_id: str
    proxy: str
    node: int
    quiet: bool = False
    error: PwmeshError | None = None
    scheduler: str = ""  # where the part came from: its completions go there ("": to ``proxy``)


@dataclasses.dataclass(slots=True)
class PartEnded:
    run_id: str
    scheduler: str
    device_seconds: float


@dataclasses.dataclass(slots=True)
class Flush:
    pass


@dataclasses.dataclass(slots=True)
class StartedOver:
    pass


@dataclasses.dataclass(slots=True)
class Leaving:
    pass


@dataclasses.dataclass(slots=True)
class Completions:
    """Successive successful completions of one run, as (node, quiet) pairs: the runner's report of a part's
    computations that ran together (``Runner._run_chain``), and in the event log, successive ``Completed``."""

    run_id: str
    proxy: str
    done: list[tuple[int, bool]]
    scheduler: str = ""

    def expand(self) -> list[Completed]:
        return [Completed(self.run_id, self.proxy, node, quiet, scheduler=self.scheduler) for node, quiet in self.done]


Event = (Received | Installed | TemplateTimeout | Cancelled | Reclaimed | Forgotten | Completed | Completions | PartEnded
         | Flush | StartedOver | Leaving)

# ------------------------------------------------------------------ actions


@dataclasses.dataclass(slots=True)
class Admit:
    message: Enqueue
    computations: list[Computation]
    stimulus: str = ""


@dataclasses.dataclass(slots=True)
class CancelWork:
    run_id: str
    error: PwmeshError
    stimulus: str = ""


Action = Send | Admit | CancelWork | Timer

_KINDS = {Received: "enqueue", Installed: "install", TemplateTimeout: "template-timeout", Cancelled: "cancel", Reclaimed: "reclaim", Forgotten: "forget",
          Completed: "done", Completions: "done", PartEnded: "part-done", Flush: "flush", StartedOver: "start-over", Leaving: "leave"}


class ExecutorState:
    def __init__(self, name: str, *, ordered: bool = True, log_events: bool = True) -> None:
        self.name = name
        self.ordered = ordered  # False (a test's option): admit in arrival order
        self.templates = PartTemplates()
        self.control = ""  # where this executor is reached (``NeedTemplate`` names it; set by its shell)
        self.template_wait_seconds = TEMPLATE_WAIT_SECONDS
        # Runs of templates asked for (``NeedTemplate``): template -> (source, Enqueue) in arrival order; and
        # per source the Enqueue that waits, with every later one held behind it (the island's order).
        self._awaiting: dict[str, list[tuple[str | None, Enqueue]]] = {}
        self._stalled: dict[str, Enqueue] = {}
        self.events = EventLog() if log_events else None
        self.cancelled: collections.OrderedDict[str, PwmeshError] = collections.OrderedDict()
        # Sessions a restarted proxy took back: owner -> (the new proxy's name marker, what old runs fail with).
        self.reclaimed: dict[str, tuple[str, PwmeshError]] = {}
        self._held: dict[str, dict[int, Enqueue]] = {}  # per source: Enqueues that overtook an earlier one
        self._expected: dict[str, int] = {}  # per source: the next executor_seq to admit
        self._completed: dict[tuple[str, str], list[int]] = {}  # (scheduler or proxy, run) -> nodes, leaving at Flush
        self._parts_done: list[tuple[str, RunPartDone]] = []  # (scheduler, message), leaving after those
        # run -> (proxy, quiet nodes done): at its part's end (a part with no scheduler only)
        self._quiet: dict[str, tuple[str, list[int]]] = {}
        self._flushing = False  # a Flush is asked for
        self._out: list[Action] = []
        self._kind, self._n = "", 0  # the event being handled: its stimulus id is "<kind>-<n>" (``_stimulus``)
        self._ids = itertools.count(1)

    # ---------------------------------------------------------------- the contract

    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply ``event``; return what must happen because of it, in order."""
        self._out = out = list[Action]()
        self._kind, self._n = kind, n = _KINDS[type(event)], next(self._ids)  # made a string only when needed
        # By type, at once: a completion per computation is the hot path (a match tried each case in turn).
        if type(event) is Completed:
            self._completed_one(event)
        elif type(event) is Completions:
            self._completed_together(event)
        elif isinstance(event, Received):
            self._arrive(event.message, now)
        elif isinstance(event, PartEnded):
            self._part_ended(event.run_id, event.scheduler, event.device_seconds)
        elif isinstance(event, Installed):
            self._installed(event.message, now)
        elif isinstance(event, TemplateTimeout):
            self._fail_waiting(event.template_id, NotFound(
                f"template {event.template_id}'s part did not come from the island's scheduler within "
                f"{self.template_wait_seconds:g} s of this executor asking for it (NeedTemplate)"), now)
        elif isinstance(event, Flush):
            self._flush()
        elif isinstance(event, Cancelled):
            self._cancel(event.run_id, event.error)
        elif isinstance(event, Reclaimed):
            self.reclaimed[event.owner] = (event.marker, event.error)
        elif isinstance(event, Forgotten):
            self.reclaimed.pop(event.owner, None)
        elif isinstance(event, StartedOver):
            self._held.clear()
            self._expected.clear()
            self._quiet.clear()
            self._awaiting.clear()
            self._stalled.clear()
        elif isinstance(event, Leaving):
            for run_id, (proxy, nodes) in self._quiet.items():  # completed here: they go now
                self._report_later(proxy, run_id, nodes)
            self._quiet.clear()
            self._flush()
        else:
            raise TypeError(f"not an executor event: {event!r}")
        if self.events is not None:
            entries = self.events.entries
            if (type(event) is Completed and event.error is None) or type(event) is Completions:
                # One per computation: a run's successive ones are kept as one entry (appending an object per
                # computation cost ~2.5 us of ~60 in bench/dispatch.py's Chained), expanded again to replay.
                done = event.done if isinstance(event, Completions) else [(event.node, event.quiet)]
                last = entries[-1][2] if entries else None
                if (type(last) is Completions and last.run_id == event.run_id and last.proxy == event.proxy
                        and last.scheduler == event.scheduler):
                    last.done.extend(done)
                else:
                    entries.append((now, (kind, n), Completions(event.run_id, event.proxy, list(done),
                                                                event.scheduler), len(out)))
            else:
                # Kept as it is, to be replayed; not a large program's part: 2,000 of those would hold gigabytes.
                kept = (describe(event) if isinstance(event, Received | Installed)
                        and len(event.message.computations) > MAX_LOGGED_PART_BYTES else event)
                entries.append((now, (kind, n), kept, len(out)))  # the id formatted when read
        self._out = []
        return out

    def _stimulus(self) -> str:
        return f"{self._kind}-{self._n}"

    def _send(self, to: str, message: NodeDone | RunPartDone | NeedTemplate) -> None:
        self._out.append(Send(to, message, self._stimulus()))

    # ---------------------------------------------------------------- admission

    def old_run(self, run_id: str) -> PwmeshError | None:
        """What a run of a session a restarted proxy took back fails with, if the proxy before sent it."""
        if not self.reclaimed:
            return None
        owner, _, rest = run_id.partition(":")
        reclaimed = self.reclaimed.get(owner)
        if reclaimed is None or renamed(rest, reclaimed[0]):
            return None
        return reclaimed[1]

    def expected_seq(self) -> dict[str, int]:
        """Per source (scheduler instance): the next ``executor_seq`` to admit (saved across a restart)."""
        return dict(self._expected)

    def expect(self, expected: dict[str, int]) -> None:
        """Go on from ``expected`` (``expected_seq`` of the process before)."""
        self._expected.update(expected)

    def _arrive(self, msg: Enqueue, now: float) -> None:
        """Admit Enqueues in the island's order: hold any that overtook an earlier one."""
        if not self.ordered or msg.executor_seq < 0:
            self._admit(msg, None, now)
            return
        source = f"{msg.scheduler}|{msg.epoch}"  # a restarted scheduler is a new source
        self._held.setdefault(source, {})[msg.executor_seq] = msg
        self._drain(source, now)

    def _drain(self, source: str, now: float) -> None:
        """Admit what of ``source`` is next in order, until one must wait for its template."""
        held = self._held.setdefault(source, {})
        expected = self._expected.get(source, 0)
        while expected in held and source not in self._stalled:
            self._admit(held.pop(expected), source, now)
            expected += 1
        self._expected[source] = expected

    def _admit(self, msg: Enqueue, source: str | None, now: float) -> None:
        failed = self.cancelled.get(msg.run_id.split("#", 1)[0]) or self.old_run(msg.run_id)
        if failed is None and msg.template and not msg.computations and not self.templates.holds(msg.template):
            if msg.scheduler:  # restarted, or dropped it: ask the scheduler for it again, and wait
                self._await_template(msg, source, now)
                return
            failed = NotFound(f"Enqueue of run {msg.run_id} names template {msg.template}, which this executor "
                              "does not hold, and no scheduler to ask for it")
        if failed is None:
            try:
                comps = enqueued(msg, self.templates)
            except PwmeshError as exc:
                failed = exc
            else:
                self._out.append(Admit(msg, comps, self._stimulus()))
                if msg.template and msg.computations and msg.template in self._awaiting:  # (a new scheduler's)
                    self._go_on(msg.template, now)
                return
        # The cancellation overtook this Enqueue (they travel different paths), or it was unreadable:
        # fail it at once, and give the scheduler its window slot back.
        self._fail(msg, failed)

    def _fail(self, msg: Enqueue, error: PwmeshError) -> None:
        to = msg.report or msg.scheduler  # (a fan-out head's, if it came through one)
        self._send(to or msg.proxy, NodeDone(run_id=msg.run_id, nodes=msg.nodes, executor_id=self.name,
                                             error=ErrorInfo.of(error)))
        self._part_ended(msg.run_id, to, 0.0)

    # ---------------------------------------------------------------- templates asked for again

    def _await_template(self, msg: Enqueue, source: str | None, now: float) -> None:
        waiting = self._awaiting.get(msg.template)
        if waiting is None:
            waiting = self._awaiting[msg.template] = []
            self._send(msg.scheduler, NeedTemplate(template_id=msg.template, executor_id=self.name,
                                                   control=self.control))
            self._out.append(Timer(now + self.template_wait_seconds, TemplateTimeout(msg.template),
                                   self._stimulus()))
        waiting.append((source, msg))
        if source is not None:
            self._stalled[source] = msg

    def _installed(self, part: InstallPart, now: float) -> None:
        """A template's part came again (or word it cannot): what waited for it goes on, in order."""
        if part.template_id not in self._awaiting:
            return  # not asked for (or given up on): nothing waits for it
        if part.missing:
            self._fail_waiting(part.template_id, NotFound(part.missing), now)
            return
        try:
            self.templates.install(part.template_id, part.nodes, part.computations, part.refs)
        except PwmeshError as exc:
            self._fail_waiting(part.template_id, exc, now)
            return
        self._go_on(part.template_id, now)

    def _go_on(self, template_id: str, now: float) -> None:
        """The template is here: what waited for it is admitted, in order."""
        for source, msg in self._awaiting.pop(template_id, []):
            self._resume(source, msg, None, now)

    def _fail_waiting(self, template_id: str, error: PwmeshError, now: float) -> None:
        for source, msg in self._awaiting.pop(template_id, []):
            self._resume(source, msg, error, now)

    def _resume(self, source: str | None, msg: Enqueue, error: PwmeshError | None, now: float) -> None:
        """``msg`` waited for its template: admit it (or fail it with ``error``), then what its source held."""
        if source is not None:
            self._stalled.pop(source, None)
        if error is not None:
            self._fail(msg, error)
        else:
            self._admit(msg, source, now)
        if source is not None:
            self._drain(source, now)

    def _cancel(self, run_id: str, error: PwmeshError) -> None:
        self.cancelled[run_id] = error
        while len(self.cancelled) > MAX_CANCELLED:
            self.cancelled.popitem(last=False)
        self._out.append(CancelWork(run_id, error, self._stimulus()))

    # ---------------------------------------------------------------- reporting

    def _completed_one(self, done: Completed) -> None:
        to = done.scheduler or done.proxy
        if done.error is not None:  # at once, its cause as it is (the scheduler forwards it unchanged)
            self._send(to, NodeDone(run_id=done.run_id, nodes=[done.node], executor_id=self.name,
                                    error=ErrorInfo.of(done.error)))
            return
        if done.quiet:  # nobody outside the run waits for it: the part's end stands for it
            if not done.scheduler:  # (reported to the proxy with the part's end)
                self._quiet.setdefault(done.run_id, (done.proxy, []))[1].append(done.node)
            return
        self._report_later(to, done.run_id, [done.node])

    def _completed_together(self, done: Completions) -> None:
        """``_completed_one`` for each of ``done``'s, in order."""
        loud = [node for node, quiet in done.done if not quiet]
        if not done.scheduler and len(loud) < len(done.done):
            self._quiet.setdefault(done.run_id, (done.proxy, []))[1].extend(
                [node for node, quiet in done.done if quiet])
        if loud:
            self._report_later(done.scheduler or done.proxy, done.run_id, loud)

    def _report_later(self, proxy: str, run_id: str, nodes: list[int]) -> None:
        """Add ``nodes`` to the completions that leave together after this instant's wake-ups."""
        self._flush_soon()
        self._completed.setdefault((proxy, run_id), []).extend(nodes)

    def _flush_soon(self) -> None:
        if not self._flushing:
            self._flushing = True
            self._out.append(Timer(0.0, Flush(), self._stimulus()))

    def _part_ended(self, run_id: str, scheduler: str, device_seconds: float) -> None:
        quiet = self._quiet.pop(run_id, None)
        if quiet is not None:  # the part's quiet completions leave with its end (a part with no scheduler)
            self._report_later(quiet[0], run_id, quiet[1])
        if not scheduler:
            return
        # Its outputs that completed this turn need no message of their own: the part's end stands for them.
        self._completed.pop((scheduler, run_id), None)
        # It leaves with this instant's completions (one I/O-thread wake-up for all), after the replies its
        # outputs woke: an early fetch of a chain's result reaches the proxy first, and the proxy forwards it
        # before it takes the run's completion, one hop behind (~1 ms of a 128-node chain's 9 when it did not).
        self._parts_done.append((scheduler, RunPartDone(run_id=run_id, executor_id=self.name,
                                                        device_seconds=device_seconds)))
        self._flush_soon()

    def _flush(self) -> None:
        self._flushing = False
        completed, self._completed = self._completed, {}
        parts, self._parts_done = self._parts_done, []
        for (proxy, run_id), nodes in completed.items():
            self._send(proxy, NodeDone(run_id=run_id, nodes=nodes, executor_id=self.name))
        for scheduler, done in parts:
            self._send(scheduler, done)

