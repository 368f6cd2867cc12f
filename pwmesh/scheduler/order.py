"""The island's single order and the sharing policy that feeds it (no sockets): the ordering part of the
island scheduler's core (``scheduler/state.py``: ``SchedulerState.handle`` is the entry the daemon and the
simulator use; this is its policy, as ``rm/placement.py`` is the resource manager's).

Runs wait in one queue per client. Whenever every device a client's next run
touches has a free slot (at most ``window`` runs in flight per device; counted
once per cell of devices the runs use together, ``slots.py``), the policy may
release it; a released run is sequenced at once and whole: each of its
computations gets the next island sequence number, and each executor gets
its part as one ``Enqueue`` carrying that executor's own running count, so it
can restore the order even if messages arrive out of order. Because sequencing
is atomic per run, every device sees the same relative order of all gang
computations of all programs — which is what keeps programs whose collectives
share devices from deadlocking.

Policies pick which client's head run goes next:

- ``fifo``: runs in arrival order, whatever the client.
- ``fair``: strict priority first; within a priority, the client that has used
  the least device time per unit of weight (virtual time, charged with the
  device-seconds executors report). A client that was idle re-enters at the
  current minimum, so sitting out earns no credit.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import secrets
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from pwmesh.core.contract import Send
from pwmesh.errors import InvalidArgument
from pwmesh.scheduler.slots import Cell, DeviceKey, Shape, Slots
from pwmesh.scheduler.templates import IslandTemplates, Template
from pwmesh.scheduler.tree import Layout, RunTree
from pwmesh.wire.messages import ClientUsage, Enqueue, InstallTemplate, RunTemplate, ScheduleRun, TemplateMissing
from pwmesh.wire.records import MAX_DEVICES
from pwmesh.wire.schema import maker

_enqueue = maker(Enqueue)  # (an Enqueue is made per executor per decision: a class call costs twice this)

POLICIES = ("fifo", "fair")


class OrderEntry(NamedTuple):
    """One computation's place in the island order (a tuple: one is made per computation)."""

    seq: int
    run_id: str
    node: int
    executor_id: str
    session: str


@dataclasses.dataclass(slots=True)
class _Pending:
    run: ScheduleRun | RunTemplate
    arrival: int
    shape: Shape  # its footprint, as cells of devices counted together (``slots.py``)
    template: Template | None = None  # a run of an installed template (``RunTemplate``)

    @property
    def footprint(self) -> frozenset[DeviceKey]:
        """Every (executor, device) the run uses."""
        return self.shape.devices


@dataclasses.dataclass
class _Client:
    session: str
    weight: float
    priority: int
    queue: collections.deque[_Pending] = dataclasses.field(default_factory=collections.deque)
    vtime: float = 0.0
    device_seconds: float = 0.0
    runs: int = 0
    in_flight: int = 0
    order: int = 0  # when it joined the table: ties in policy order go to the older client (a stable sort's)
    version: int = 0  # bumped when its place in the policy order changes: older heap entries are stale


# A client waiting in the fair order: (its policy key's three parts: -priority, virtual time, its head's
# arrival; then order, version, tiebreak, client, the cell whose freed slot woke it, if one did). Flat, not
# (key, order, ...): heaps compare these all the time, and a tuple inside a tuple compares twice.
_Entry = tuple[int, float, int, int, int, int, _Client, "Cell | None"]


@dataclasses.dataclass(slots=True)
class _InFlight:
    client: _Client
    shape: Shape
    parts: dict[str, list[Cell]]  # executor -> the cells it holds (until it reports)
    # A run sent through a fan-out tree (``tree.Layout``): each top-level head's subtree below it, kept whole
    # (its parts not in ``parts``) until a part of it ends apart from the rest: the head's ``PartsDone``
    # usually ends them all at once (``parts_done``).
    below: dict[str, tuple[frozenset[str], list[str]]] | None = None
    layout: Layout | None = None


class ExecutorCounts:
    """Each executor's Enqueues sent from this scheduler instance (its next ``executor_seq``), in one array: a
    run's executors, given by their places here (``places``, worked out once per template), are counted in
    one step, not one per executor."""

    def __init__(self) -> None:
        self._index: dict[str, int] = {}
        self._values = np.zeros(64, np.int64)
        self._each = self._values.data  # the same counts one at a time, as ints (numpy's scalars: 2x)

    def places(self, executors: list[str]) -> np.ndarray:
        """Where each of ``executors`` (each named once) is counted (stable: an executor keeps its place)."""
        index = self._index
        for executor_id in executors:
            if executor_id not in index:
                index[executor_id] = len(index)
        if len(index) > len(self._values):
            grown = np.zeros(max(len(index), 2 * len(self._values)), np.int64)
            grown[:len(self._values)] = self._values
            self._values, self._each = grown, grown.data
        return np.fromiter((index[e] for e in executors), np.intp, len(executors))

    def take(self, places: np.ndarray) -> np.ndarray:
        """The next ``executor_seq`` of each executor at ``places``, each counted once more."""
        values = self._values
        taken: np.ndarray = values[places]
        values[places] = taken + 1
        return taken

    def next(self, executor_id: str) -> int:
        """``executor_id``'s next ``executor_seq``, counted."""
        i = self._index.get(executor_id)
        if i is None:
            i = int(self.places([executor_id])[0])
        each = self._each
        value: int = each[i]
        each[i] = value + 1
        return value

    def restart(self, executor_id: str) -> None:
        """A new process runs under ``executor_id``: its count starts over."""
        i = self._index.get(executor_id)
        if i is not None:
            self._values[i] = 0


class IslandOrder:
    def __init__(self, island: int, *, policy: str = "fair", window: int = 2, scheduler: str = "",
                 history: int = 10_000, epoch: str = "") -> None:
        if policy not in POLICIES:
            raise InvalidArgument(f"unknown policy {policy!r}; choose one of {POLICIES}")
        if window < 1:
            raise InvalidArgument(f"the window must be at least 1 run per device, got {window}")
        self.island = island
        self.policy = policy
        self.window = window
        self.scheduler = scheduler
        self.next_seq = 0
        # The order's newest ``history`` computations, kept a run at a time (``history`` expands them):
        # (first seq, run id, session, its parts' (executor, nodes)), runs with no computation left out.
        self._history: collections.deque[tuple[int, str, str, list[tuple[str, list[int]]]]] = \
            collections.deque(maxlen=history)
        self.max_clients = 256  # idle clients beyond this many are forgotten
        # This instance: executors restart their count with a new one (given: a replay of its events).
        self.epoch = epoch or secrets.token_hex(4)
        self.slots = Slots()  # runs in flight per device, counted per cell (``slots.py``)
        self._executor_seq = ExecutorCounts()
        self._clients: dict[str, _Client] = {}
        self._in_flight: dict[str, _InFlight] = {}
        self._arrivals = itertools.count()
        self._joined = itertools.count()  # clients' ``order``
        self._ties = itertools.count()
        # The fair order, kept between events: waiting clients not known to be blocked (empty after each
        # release pass), and per cell at its window the clients whose head it blocks, in policy order
        # (``Cell.blocked``). A completion wakes only the best of those its freed slot may let through.
        self._ready: list[_Entry] = []
        self._stimulus = ""  # the event being handled: the Sends it causes carry its id
        self.templates = IslandTemplates()  # cached lowerings installed once, run by id (``templates.py``)
        # Runs sequenced since ``SchedulerState`` last looked: (run id, proxy, executor -> its nodes, every
        # node or None, the fan-out tree its parts went through or None); it counts their completions
        # (``completions.py``). None: not kept (the order alone).
        self.sequenced: list[tuple[str, str, dict[str, list[int]], list[int] | None, RunTree | None]] | None = None
        # The fan-out tree a template's runs go through, if they do (set by ``SchedulerState``): its runs are
        # then sent as the tree's messages, made in one pass (``_tree_sends``). None: one Enqueue each.
        self.layout_for: Callable[[Template], Layout | None] | None = None

    # ---------------------------------------------------------------- events
    #
    # Each returns the Enqueues released, as ``Send`` actions carrying ``stimulus`` (the id of the event
    # ``SchedulerState`` is handling).

    def submit(self, run: ScheduleRun, stimulus: str = "") -> list[Send]:
        """Queue a run for its client, then release whatever now fits."""
        self._stimulus = stimulus
        # Runs of one program name the same ranges: the footprint is checked and built once, when first seen.
        key = tuple([(part.executor_id, r.first, r.count) for part in run.parts for r in part.devices])
        shape = self.slots.known(key)
        if shape is None:
            for part in run.parts:
                for r in part.devices:
                    if r.first < 0 or not 1 <= r.count <= MAX_DEVICES:
                        raise InvalidArgument(f"run {run.run_id}: devices [{r.first}, +{r.count}) on "
                                              f"{part.executor_id}")
            shape = self.slots.take(key, lambda: frozenset((ex, first + k) for ex, first, count in key
                                                           for k in range(count)))
        return self._queue(_Pending(run, next(self._arrivals), shape))

    def install(self, msg: InstallTemplate) -> None:
        """Keep a template its runs will name (``templates.py``)."""
        self.templates.install(msg)

    def submit_template(self, run: RunTemplate, stimulus: str = "") -> list[Send]:
        """Queue a run of an installed template; one of a template not held here is refused whole, and its
        proxy told (``TemplateMissing``: it installs the template again and sends the run again)."""
        self._stimulus = stimulus
        template = self.templates.get(run.template_id)
        if template is None:
            return [Send(run.proxy, TemplateMissing(run_id=run.run_id, template_id=run.template_id,
                                                    scheduler=self.scheduler), stimulus)]
        if len(run.names) < template.names:
            raise InvalidArgument(f"run {run.run_id} names {len(run.names)} buffers; template "
                                  f"{run.template_id} refers to {template.names}")
        footprint = template.footprint
        return self._queue(_Pending(run, next(self._arrivals), self.slots.take(footprint, lambda: footprint),
                                    template))

    def _queue(self, pending: _Pending) -> list[Send]:
        run = pending.run
        client = self._clients.get(run.session)
        if client is None:
            client = self._clients[run.session] = _Client(run.session, run.weight, run.priority,
                                                          order=next(self._joined))
        queue = client.queue
        # Its key (``_key``) changes with a new head or a new priority (its virtual time only when it has no head).
        moved = not queue or client.priority != run.priority
        client.weight, client.priority = run.weight, run.priority
        if not queue and not client.in_flight:
            # Re-entering after idling: start level with the others, with no saved-up credit.
            active = [c.vtime for c in self._clients.values() if c is not client and (c.queue or c.in_flight)]
            client.vtime = max(client.vtime, min(active, default=client.vtime))
        queue.append(pending)
        if moved and self.policy == "fair":
            self._place(client)
        return self._release()

    def part_done(self, run_id: str, executor_id: str, device_seconds: float, stimulus: str = "") -> list[Send]:
        """An executor finished its part of a run: free its slots, charge the client."""
        self._stimulus = stimulus
        flight = self._in_flight.get(run_id)
        if flight is None:
            return []
        freed = flight.parts.pop(executor_id, None)
        if freed is None:
            head = self._kept_below(flight, executor_id)
            if head is None:
                return []
            self._unfold(flight, head)
            freed = flight.parts.pop(executor_id)
        for cell in freed:
            cell.busy -= 1
        self._freed(run_id, flight, freed, device_seconds)
        return self._release()

    def parts_done(self, run_id: str, executor_ids: list[str], device_seconds: float,
                   stimulus: str = "", head: str = "") -> list[Send]:
        """Executors' parts of a run ended together (a fan-out head's ``PartsDone``, ``head`` the top-level head
        that sent it): what ``part_done`` for each in turn decides (``device_seconds`` charged with the first).
        An end that charges nothing, wakes no one and leaves the run in flight, while no one waits to be
        released (the fair order's ``_ready`` is empty; in FIFO, no run waits), changes nothing but its cells'
        counts: only those are kept. The whole subtree of ``head`` ended so, while its parts are kept
        together, is ended in one step (``_together``)."""
        self._stimulus = stimulus
        flight = self._in_flight.get(run_id)
        if flight is None:
            return []
        if flight.below:
            if head in flight.below and self._together(run_id, flight, head, executor_ids, device_seconds):
                return []
            for executor_id in executor_ids:  # (one by one from here)
                kept = self._kept_below(flight, executor_id)
                if kept is not None:
                    self._unfold(flight, kept)
        if self.policy != "fair" and any(c.queue for c in self._clients.values()):
            actions: list[Send] = []
            for executor_id in executor_ids:
                actions += self.part_done(run_id, executor_id, device_seconds, stimulus)
                device_seconds = 0.0
            return actions
        actions = []
        parts = flight.parts
        for executor_id in executor_ids:
            seconds, device_seconds = device_seconds, 0.0
            freed = parts.pop(executor_id, None)
            if freed is None:
                continue
            waiting = False
            for cell in freed:
                cell.busy -= 1
                if cell.blocked:
                    waiting = True
            if seconds or waiting or not parts or self._ready:
                self._freed(run_id, flight, freed, seconds)
                if self._ready:  # (empty: a release pass would find no one, and change nothing)
                    actions += self._release()
                if not parts:
                    break
        return actions

    def _together(self, run_id: str, flight: _InFlight, head: str, executor_ids: list[str],
                  device_seconds: float) -> bool:
        """End every part below ``head`` in one step, if ``executor_ids`` are those parts and ending them one by
        one would only lower their cells' counts (and charge the client, and perhaps end the run): no one
        waits to be released, the charge moves no waiting client, and no cell of theirs holds anyone back.
        False: nothing done (they are ended one by one)."""
        executors, below = flight.below[head]  # type: ignore[index]
        client = flight.client
        if self._ready or (device_seconds and client.queue) or set(executor_ids) != executors:
            return False
        if self.policy != "fair" and any(c.queue for c in self._clients.values()):
            return False  # (FIFO releases after each part: ``part_done``)
        cells = flight.shape.cells_of((head, executors), below)
        for cell in cells:
            if cell.blocked:
                return False
        del flight.below[head]  # type: ignore[union-attr]
        for cell in cells:
            cell.busy -= 1
        self._freed(run_id, flight, [], device_seconds)
        return True

    @staticmethod
    def _kept_below(flight: _InFlight, executor_id: str) -> str | None:
        """The top-level head whose subtree, kept whole in ``flight``, holds ``executor_id``'s part (None: none)."""
        if not flight.below or flight.layout is None:
            return None
        head = flight.layout.top_of.get(executor_id)
        return head if head is not None and head in flight.below else None

    @staticmethod
    def _unfold(flight: _InFlight, head: str) -> None:
        """The parts below ``head``, kept whole so far, one by one in ``flight.parts`` (the shape's own lists)."""
        _, below = flight.below.pop(head)  # type: ignore[union-attr]
        by = flight.shape.by_executor
        for executor_id in below:
            flight.parts[executor_id] = by[executor_id]

    def _freed(self, run_id: str, flight: _InFlight, freed: list[Cell], device_seconds: float) -> None:
        """An executor's part of ``run_id`` ended (its cells' counts already down): charge the client, wake
        whom its freed slots may let through, and end the run if it was the last part."""
        client = flight.client
        client.device_seconds += device_seconds
        client.vtime += device_seconds / client.weight
        if self.policy == "fair":
            # (Its virtual time moved, so its place in the order, if it waits: where it waits, its entry is
            # put right when it comes first: ``_wake``, ``_release``.)
            window = self.window
            for cell in freed:
                if cell.blocked and cell.busy < window:
                    self._wake(cell)
        if not flight.parts and not flight.below:
            del self._in_flight[run_id]
            self.slots.drop(flight.shape)
            client.in_flight -= 1
            if len(self._clients) > self.max_clients:
                self._forget_idle()

    def _forget_idle(self) -> None:
        """Keep the client table bounded (beyond ``max_clients``): an idle client forgotten loses nothing it would
        have kept, since a client that comes back re-enters at the others' level anyway."""
        for session, c in list(self._clients.items()):
            if not c.queue and not c.in_flight:
                del self._clients[session]

    # --------------------------------------------------------------- policy

    def _key(self, client: _Client) -> tuple[float, ...]:
        if self.policy == "fifo":
            return (client.queue[0].arrival,)
        return (-client.priority, client.vtime, client.queue[0].arrival)

    def _blocker(self, pending: _Pending) -> Cell | None:
        """A cell of ``pending``'s footprint with no free slot (None: it fits)."""
        window = self.window
        for cell in pending.shape.cells:
            if cell.busy >= window:
                return cell
        return None

    def _entry(self, client: _Client, woken_by: Cell | None = None) -> _Entry:
        """``client``'s place in the fair order (``_key``'s parts, flat)."""
        return (-client.priority, client.vtime, client.queue[0].arrival, client.order, client.version,
                next(self._ties), client, woken_by)

    def _place(self, client: _Client) -> None:
        """``client``'s key changed, or its head: it waits in the order anew (older entries go stale), on a cell
        that blocks its head if one does (slots only fill during a release pass: it would not fit later in
        it either, and what ``_release`` would do with it is wait it there)."""
        client.version += 1
        entry = self._entry(client)
        window = self.window
        for cell in client.queue[0].shape.cells:
            if cell.busy >= window:
                heapq.heappush(cell.blocked, entry)
                return
        heapq.heappush(self._ready, entry)

    def _wake(self, cell: Cell) -> None:
        """A slot of ``cell`` may be free: let the best client its window blocks be considered again (one still
        blocked by another cell waits there instead, and the next best here is considered)."""
        window = self.window
        if cell.busy >= window:
            return
        blocked = cell.blocked
        while blocked:
            entry = heapq.heappop(blocked)
            client = entry[6]
            if entry[4] != client.version or not client.queue:
                continue
            if entry[1] != client.vtime:  # charged since: it is first only if it still is at its own time
                heapq.heappush(blocked, self._entry(client))
                continue
            for other in client.queue[0].shape.cells:
                if other.busy >= window:
                    heapq.heappush(other.blocked, entry)
                    break
            else:
                heapq.heappush(self._ready, (*entry[:7], cell))
                break

    def _release(self) -> list[Send]:
        """Release head runs in policy order while any fits (work-conserving)."""
        if self.policy == "fifo":
            return self._release_fifo()
        # Fair: pop waiting clients in key order; a head that does not fit waits on a device that blocks
        # it (slots only fill during a pass, so it would not fit later in it either) until a slot there
        # frees. The first head that fits is the one a sort of every waiting client would release.
        # A client charged device time (``_freed``) keeps its entry, whose virtual time is then behind its
        # own: keys only grow so, never shrink (a new priority is placed at once: ``_queue``), so an entry
        # that comes first at its own time is first; one that does not goes back in at its own time.
        ready = self._ready
        if not ready:
            return []  # (no one to consider: every waiting client waits on a full cell)
        actions: list[Send] = []
        window = self.window
        heappop, heappush = heapq.heappop, heapq.heappush
        while ready:
            entry = heappop(ready)
            client, woken_by = entry[6], entry[7]
            if entry[4] != client.version or not client.queue:
                pass  # stale: the client was placed anew, or has nothing left to run
            elif entry[1] != client.vtime:
                heappush(ready, self._entry(client))  # (what woke it wakes the next below)
            else:
                for cell in client.queue[0].shape.cells:  # (``_blocker``, inline)
                    if cell.busy >= window:
                        heappush(cell.blocked, (*entry[:7], None))
                        break
                else:
                    actions.extend(self._sequence(client, client.queue.popleft()))
                    if client.queue:
                        self._place(client)
            if woken_by is not None and woken_by.busy < window:
                self._wake(woken_by)  # its slot may still be free: the next best there may use it
        return actions

    def _release_fifo(self) -> list[Send]:
        """Oldest head first, and nothing overtakes a head that does not fit."""
        actions: list[Send] = []
        heap = [(self._key(c), c.order, c) for c in self._clients.values() if c.queue]
        heapq.heapify(heap)
        while heap:
            _, order, client = heapq.heappop(heap)
            if self._blocker(client.queue[0]) is not None:
                break
            actions.extend(self._sequence(client, client.queue.popleft()))
            if client.queue:
                heapq.heappush(heap, (self._key(client), order, client))
        return actions

    def _sequence(self, client: _Client, pending: _Pending) -> list[Send]:
        run = pending.run
        template = pending.template
        layout = None
        if template is not None and self.layout_for is not None and template.held_by_all:
            layout = self.layout_for(template)
        if layout is None:
            actions = self._enqueues(run, template)
        else:
            assert isinstance(run, RunTemplate) and template is not None
            actions = self._tree_sends(run, template, layout)
        shape = pending.shape
        for cell in shape.cells:
            cell.busy += 1
        # The lists are the shape's own: a cell split later (``slots.py``) is held and freed with them.
        if layout is not None and len(shape.by_executor) == len(layout.tree.executors):
            by = shape.by_executor  # (through a tree: the parts below its top-level heads kept whole)
            flight = _InFlight(client, shape, {ex: by[ex] for ex in layout.lone}, dict(layout.below), layout)
        else:
            flight = _InFlight(client, shape, dict(shape.by_executor))
        self._in_flight[run.run_id] = flight
        client.in_flight += 1
        client.runs += 1
        return actions

    def _tree_sends(self, run: RunTemplate, template: Template, layout: Layout) -> list[Send]:
        """A run of a template every executor holds, over its fan-out tree: one ``FanOut`` per top-level subtree
        with its parts said together (``Layout.sends``), what ``_enqueues`` and ``tree.build`` make of it
        without a message per executor (the template's parts, places and tree worked out once)."""
        seq, run_id, proxy = self.next_seq, run.run_id, run.proxy
        if template.places is None:
            template.places = self._executor_seq.places([part.executor_id for part in template.parts])
        executor_seqs = self._executor_seq.take(template.places)
        if self.sequenced is not None:
            self.sequenced.append((run_id, proxy, template.executor_nodes, template.nodes, layout.tree))
        if template.offsets[-1]:
            self._history.append((seq, run_id, run.session, template.placed))
        self.next_seq = seq + template.offsets[-1]
        return layout.sends(run_id, proxy, run.names, self.scheduler, self.epoch, template.template_id, seq,
                            executor_seqs, self._stimulus)

    def _enqueues(self, run: ScheduleRun | RunTemplate, template: Template | None) -> list[Send]:
        """A run's Enqueues, one per executor, in the island's order."""
        if template is not None:
            assert isinstance(run, RunTemplate)
            return self._template_enqueues(run, template)
        assert isinstance(run, ScheduleRun)
        actions = []
        seq = start = self.next_seq
        run_id, proxy, scheduler, epoch, stimulus = run.run_id, run.proxy, self.scheduler, self.epoch, self._stimulus
        count = self._executor_seq.next  # (one at a time: nothing but a template says each executor has one part)
        placed: list[tuple[str, list[int]]] = []
        for part in run.parts:
            nodes = part.nodes
            end = seq + len(nodes)
            placed.append((part.executor_id, nodes))
            enqueue = _enqueue(run_id=run_id, proxy=proxy, nodes=nodes, computations=part.computations,
                               seqs=list(range(seq, end)), names=part.names, scheduler=scheduler,
                               executor_seq=count(part.executor_id), epoch=epoch)
            actions.append(Send(part.control, enqueue, stimulus))
            seq = end
        if self.sequenced is not None:
            self.sequenced.append((run_id, proxy, {p.executor_id: p.nodes for p in run.parts}, None, None))
        if seq > start:
            self._history.append((start, run_id, run.session, placed))
        self.next_seq = seq
        return actions

    def _template_enqueues(self, run: RunTemplate, template: Template) -> list[Send]:
        """A template's run as one Enqueue per executor: its parts' bytes go with the first run sent each
        executor only; every run carries the island's names."""
        actions = []
        seq = start = self.next_seq
        run_id, proxy, names, scheduler, epoch = run.run_id, run.proxy, run.names, self.scheduler, self.epoch
        placed: list[tuple[str, list[int]]] = []
        if self.sequenced is not None:
            self.sequenced.append((run_id, proxy, template.executor_nodes, template.nodes, None))
        if template.places is None:
            template.places = self._executor_seq.places([part.executor_id for part in template.parts])
        executor_seqs = self._executor_seq.take(template.places).tolist()
        for part, executor_seq in zip(template.parts, executor_seqs, strict=True):
            ex, nodes = part.executor_id, part.nodes
            end = seq + len(nodes)
            placed.append((ex, nodes))
            first = ex not in template.sent
            if first:
                template.sent.add(ex)
            enqueue = _enqueue(run_id=run_id, proxy=proxy, nodes=nodes, computations=part.computations if first else b"",
                               seqs=list(range(seq, end)), names=names, scheduler=scheduler,
                               executor_seq=executor_seq, epoch=epoch, template=template.template_id,
                               refs=part.refs if first else [])
            actions.append(Send(part.control, enqueue, self._stimulus))
            seq = end
        if seq > start:
            self._history.append((start, run_id, run.session, placed))
        self.next_seq = seq
        return actions

    def forget_executor(self, executor_id: str, stimulus: str = "") -> list[Send]:
        """An executor is gone: its parts will never report; free their slots."""
        actions: list[Send] = []
        for run_id, flight in list(self._in_flight.items()):
            if executor_id in flight.parts or self._kept_below(flight, executor_id) is not None:
                actions.extend(self.part_done(run_id, executor_id, 0.0, stimulus))
        return actions

    def restart_executor(self, executor_id: str) -> None:
        """A new process runs under ``executor_id``: its Enqueues count from 0 again (the old process's
        parts were forgotten when it was declared lost), and it holds no template's part."""
        self._executor_seq.restart(executor_id)
        self.templates.forget_executor(executor_id)

    @property
    def history(self) -> collections.deque[OrderEntry]:
        """The newest computations sequenced (at most the ``history`` given), oldest first."""
        entries: collections.deque[OrderEntry] = collections.deque(maxlen=self._history.maxlen)
        for seq, run_id, session, placed in self._history:
            for executor_id, nodes in placed:
                for node in nodes:
                    entries.append(OrderEntry(seq, run_id, node, executor_id, session))
                    seq += 1
        return entries

    @property
    def busy(self) -> Mapping[DeviceKey, int]:
        """Runs in flight per (executor, device): a read-only view (a device with none reads 0)."""
        return self.slots.busy()

    @property
    def in_flight(self) -> int:
        """Runs sequenced whose parts are not all done."""
        return len(self._in_flight)

    def usage(self) -> list[ClientUsage]:
        return [ClientUsage(session=c.session, weight=c.weight, priority=c.priority, device_seconds=c.device_seconds,
                            runs=c.runs, waiting=len(c.queue)) for c in self._clients.values()]
