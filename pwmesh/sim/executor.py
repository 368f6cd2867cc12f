"""A simulated host executor: fake devices with the real device-queue core, in virtual time.

It does what ``pwmesh/executor`` does with each message, without JAX or arrays, around the
executor's real core (``executor.state.ExecutorState``: ``Enqueue``s admitted in the island's
order, cancelled runs, completions batched per run per instant) and put on the real
``executor.queues.DeviceQueues`` (one FIFO per device, a computation starts at the
head of all its devices' queues). A started computation waits for its inputs and its
function, then takes the host's overhead and its devices' time from the cost model
(``sim.cost``); its outputs are stored as shapes (no data), its ``Emit``s move bytes
over the network's data plane to the executors that hold the destination shards
(per destination, the sources it will hear from are counted, as progress tracking
does), and completions go back as the core says (``NodeDone`` and ``RunPartDone`` to the island's
scheduler, which tells the proxy once per run: ``IslandDone``). ``PutShards``, ``SendShards``,
``FetchShards`` (answered with zeros of the stored shape: real bytes on the wire),
``DeleteShards``, ``ForgetOwner``, ``CancelRun``, ``RegisterGang`` (a gang computation waits
for its gang as for its function) and ``InstallPart`` (a template's part asked for again) behave
as the real executor's.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Callable

import numpy as np

from pwmesh.core.contract import Send, Timer
from pwmesh.dataflow.exchange import block_plan, destinations
from pwmesh.errors import NotFound, PwmeshError
from pwmesh.executor.fanout import FanOutRelay, split_frees
from pwmesh.executor.queues import DeviceQueues, PartDone, Start
from pwmesh.executor.state import (
    Admit,
    Cancelled,
    CancelWork,
    Completed,
    Event,
    ExecutorState,
    Installed,
    PartEnded,
    Received,
)
from pwmesh.executor.work import Work
from pwmesh.sim.clock import Clock
from pwmesh.sim.cost import CostModel, FunctionCost
from pwmesh.sim.network import Network
from pwmesh.sim.node import Node
from pwmesh.wire import Envelope, Message
from pwmesh.wire.messages import (
    CancelRun,
    Computation,
    DeleteShards,
    Emit,
    Enqueue,
    FanOut,
    FanOutFrees,
    FetchShards,
    ForgetOwner,
    InstallPart,
    Move,
    NodeDone,
    Ok,
    PartsDone,
    PutShards,
    RegisterFunction,
    RegisterGang,
    RunPartDone,
    SendMoves,
    SendShards,
    ShardValues,
    SubtreeLost,
    Target,
)

Meta = tuple[tuple[int, ...], str]  # a stored shard: its shape and dtype (the simulator keeps no data)


class SimExecutor(Node):
    def __init__(self, *, executor_id: str, island: int, host: str, control: str, data: str, devices: int,
                 clock: Clock, network: Network, cost: CostModel, peers: dict[str, SimExecutor],
                 keep_spans: bool = False) -> None:
        super().__init__(control, clock, network)
        self.executor_id = executor_id
        self.island = island
        self.host = host
        self.data = data
        self.devices = devices
        self.cost = cost
        self.peers = peers  # every executor, by data-plane address (the data plane's routes)
        self.queues = DeviceQueues(devices)
        self.relay = FanOutRelay(executor_id)  # the large runs' subtrees it heads (``executor/fanout.py``)
        self.state = ExecutorState(executor_id, log_events=False)
        self.state.control = control  # named in a NeedTemplate
        self.functions: dict[str, FunctionCost] = {}
        self.gangs: set[str] = set()  # the gangs it was sent (``RegisterGang``), by id
        self.stored: dict[str, Meta] = {}
        self._by_prefix: collections.defaultdict[str, set[str]] = collections.defaultdict(set)  # buffer -> its keys here
        self.failed: dict[str, PwmeshError] = {}
        self.tombstones: set[str] = set()  # deleted buffers ("owner/buffer"): late data for them is dropped
        self.spans: list[tuple[float, float, str, int, tuple[int, ...]]] = []  # (start, end, run, node, devices)
        self.keep_spans = keep_spans
        self.host_free = 0.0  # the host dispatches one computation at a time
        self._waiters: dict[str, list[Callable[[], None]]] = collections.defaultdict(list)
        self._reporting: set[tuple[str, int, str]] = set()  # (run, node, prefix): reshards landed with no computation
        self._fn_waiters: dict[str, list[Callable[[], None]]] = collections.defaultdict(list)  # by function or gang
        self._inbox: dict[str, int] = {}  # destination key -> pieces still expected
        self.data_bytes_out = 0

    # ------------------------------------------------------------ messages

    def handle(self, env: Envelope) -> None:
        msg = env.message
        if isinstance(msg, Enqueue):
            self._core(Received(msg))
        elif isinstance(msg, FanOut):  # the head of a large run's subtree: its children's parts on, then its own
            own, sends = self.relay.fan_out(msg)
            self._relay(sends, msg)  # its own body decoded, the rest on unread
            if own is not None:
                self._core(Received(own))
        elif isinstance(msg, FanOutFrees):  # the island's frees for a subtree it heads: on, then its own
            self._relay(split_frees(msg))
            self._delete(msg.buffers)
        elif isinstance(msg, RunPartDone | NodeDone | PartsDone | SubtreeLost):
            self._relay(self.relay.handle(msg))
        elif isinstance(msg, InstallPart):
            self._core(Installed(msg))
        elif isinstance(msg, RegisterFunction):
            fn = FunctionCost.from_artifact(msg.exported)
            self.functions[msg.fn_id] = fn
            for wake in self._fn_waiters.pop(msg.fn_id, []):
                wake()
        elif isinstance(msg, RegisterGang):
            self.gangs.add(msg.gang_id)
            for wake in self._fn_waiters.pop(msg.gang_id, []):
                wake()
        elif isinstance(msg, PutShards):
            for key, array in zip(msg.keys, msg.arrays, strict=True):
                self._store(key, (tuple(array.shape), array.dtype.name))
        elif isinstance(msg, SendShards):
            self._send(Move(prefix=msg.prefix, runs=msg.runs, emits=msg.emits), (msg.proxy, msg.run_id))
        elif isinstance(msg, SendMoves):  # each move as it is ready (the daemon batches their bytes; none here)
            for move in msg.moves:
                self._send(move, (msg.proxy, msg.run_id))
        elif isinstance(msg, FetchShards):
            self._when_ready(msg.keys, lambda: self.post(env.sender, ShardValues(arrays=[
                np.zeros(*self.stored[k]) if k in self.stored else np.zeros((0,), np.float32) for k in msg.keys]),
                reply_to=env.msg_id))
        elif isinstance(msg, DeleteShards):
            self._delete(msg.buffers)
        elif isinstance(msg, ForgetOwner):
            self.tombstones = {t for t in self.tombstones if not t.startswith(msg.prefix)}
        elif isinstance(msg, CancelRun):
            self._core(Cancelled(msg.run_id, msg.error.exception()))
        else:
            self.post(env.sender, Ok(), reply_to=env.msg_id)  # what a fake host need not do (stats, traces)

    def _core(self, event: Event) -> None:
        """Hand the executor's core ``event`` and do what it says."""
        own = self.relay.control  # (a subtree's head: its own parts report to its relay, not to the network)
        for action in self.state.handle(event, self.clock.now):
            if isinstance(action, Send):
                if action.to == own and own:
                    self._relay(self.relay.handle(action.message))
                else:
                    self.post(action.to, action.message)
            elif isinstance(action, Admit):
                self._admit(action.message, action.computations)
            elif isinstance(action, CancelWork):
                self._cancel(action.run_id, action.error)
            elif isinstance(action, Timer):  # what completes in one instant leaves together (or a wait's end)
                self.clock.after(max(0.0, action.at - self.clock.now), functools.partial(self._core, action.event))
            else:
                raise TypeError(f"not an executor action: {action!r}")

    def _admit(self, msg: Enqueue, comps: list[Computation]) -> None:
        self.queues.admitting(msg.run_id)
        starts: list[Start] = []
        to = msg.report or msg.scheduler  # where its completions go: a fan-out head's, or the scheduler
        for comp in comps:
            shards = comp.shards()
            work = Work(run_id=msg.run_id, proxy=msg.proxy, scheduler=to, comp=comp,
                        devices=[d for d, _ in shards], shards=[s for _, s in shards])
            work.queued = True
            self.queues.add(work)
            starts += self.queues.queue(work)
        self._act(starts)
        self._act(self.queues.admitted(msg.run_id, to))

    def _delete(self, buffers: list[str]) -> None:
        for prefix in buffers:
            self.tombstones.add(prefix)
            for key in self._by_prefix.pop(prefix, ()):
                self.stored.pop(key, None)
                self.failed.pop(key, None)

    def _relay(self, sends: list[tuple[str, Message]], taken: FanOut | None = None) -> None:
        """A fan-out head's messages, posted in order as the host's loop gets to them: ``relay_seconds`` per
        message it handles whole (``taken``, a ``FanOut`` with its own part's decode, or a report; each
        message it sends), ``relay_body_seconds`` per part one carries (``executor/fanout.py``), and
        ``relay_together_seconds`` more for a ``FanOut`` whose parts are said together."""
        cost, body, together = self.cost.relay_seconds, self.cost.relay_body_seconds, self.cost.relay_together_seconds

        def handled(message: Message | None) -> float:  # beyond ``cost``: its parts, said together or as bodies
            if not isinstance(message, FanOut):
                return 0.0
            return body * message.count() + (together if message.run is not None else 0.0)

        at = max(self.clock.now, self.host_free) + cost + handled(taken)
        for to, message in sends:
            at += cost + handled(message)
            self.clock.at(at, functools.partial(self.post, to, message))
        self.host_free = at

    # ------------------------------------------------------------ computations

    def _act(self, actions: list[Start] | list[PartDone]) -> None:
        for action in actions:
            if isinstance(action, Start):
                self._start(action.work)
            else:
                self._part_done(action)

    def _start(self, work: Work) -> None:
        """Every local device reached it: wait for its function and inputs, then run it."""
        comp = work.comp
        cancelled = self.state.cancelled.get(work.run_id.split("#", 1)[0])
        if cancelled is not None:
            self._fail(work, cancelled)
            return
        if comp.kind == "call" and comp.fn_id not in self.functions:
            self._fn_waiters[comp.fn_id].append(lambda: self._start(work))
            return
        if comp.gang and comp.gang not in self.gangs:  # its devices come apart from the run, as a function does
            self._fn_waiters[comp.gang].append(lambda: self._start(work))
            return
        keys = [f"{p}/{s}" for p in comp.inputs for s in work.shards]
        self._when_ready(keys, lambda: self._begin(work))

    def _begin(self, work: Work) -> None:
        if work.finished or work.cancelled is not None:
            return
        bad = next((self.failed[k] for p in work.comp.inputs for s in work.shards
                    if (k := f"{p}/{s}") in self.failed), None)
        if bad is not None:
            self._fail(work, bad)
            return
        comp = work.comp
        fn = self.functions.get(comp.fn_id) if comp.kind == "call" else None
        seconds = self.cost.shard_seconds(fn) if fn is not None else 0.0
        start = max(self.clock.now, self.host_free) + self.cost.host_overhead_seconds
        self.host_free = start
        work.device_seconds = seconds * len(work.devices)
        self.clock.at(start + seconds, lambda: self._finish(work, fn, start))

    def _finish(self, work: Work, fn: FunctionCost | None, start: float) -> None:
        if work.finished:
            return
        comp = work.comp
        if self.keep_spans:
            self.spans.append((start, self.clock.now, work.run_id, comp.node, tuple(work.devices)))
        starts = self.queues.release(work)
        if work.cancelled is None:
            for i, prefix in enumerate(comp.outputs):
                for s in work.shards:
                    self._store(f"{prefix}/{s}", self._output_meta(fn, comp, i, s))
            for emit in comp.emits:
                slot = emit.slot
                names = [*comp.inputs, *comp.outputs]
                prefix = names[slot] if 0 <= slot < len(names) else ""
                self._emit(emit, work.shards, {s: self.stored.get(f"{prefix}/{s}") for s in work.shards},
                           (work.proxy, work.run_id))
            if comp.frees:  # it read them last: they go here, as the daemon's do (no delete comes for them)
                self._delete(comp.freed())
            self._completed_node(work)
        self._act(starts)
        self._act(self.queues.complete(work))

    def _output_meta(self, fn: FunctionCost | None, comp: Computation, i: int, shard: int) -> Meta:
        if fn is not None and i < len(fn.out_shapes):
            return fn.out_shapes[i], fn.dtype
        if i < len(comp.inputs):  # identity: its inputs, stored as its outputs
            found = self.stored.get(f"{comp.inputs[i]}/{shard}")
            if found is not None:
                return found
        return (), "float32"

    def _fail(self, work: Work, error: PwmeshError) -> None:
        """A computation that cannot run: its outputs fail, its destinations hear so, its node reports it."""
        work.cancelled = work.cancelled or error
        work.error = error
        for prefix in work.comp.outputs:
            for s in work.shards:
                self._store_failed(f"{prefix}/{s}", error)
        for emit in work.comp.emits:
            for target in emit.targets:
                for j, dest in destinations(target).items():
                    peer = self.peers.get(dest.data)
                    if peer is not None:
                        key = f"{target.prefix}/{j}"
                        self.network.transfer(self.data, dest.data, 64, functools.partial(peer._store_failed, key, error))
        self._core(Completed(work.run_id, work.proxy, work.comp.node, error=error, scheduler=work.scheduler))
        if not work.finished:
            starts = self.queues.release(work)
            self._act(starts)
            self._act(self.queues.complete(work))

    def _cancel(self, run_id: str, error: PwmeshError) -> None:
        for work in self.queues.of_run(run_id):
            if not work.finished and work.cancelled is None:
                work.cancelled = error
                if work.device_seconds == 0.0:  # not running yet: it fails now, freeing its devices
                    self._fail(work, error)

    # ------------------------------------------------------------ completions

    def _completed_node(self, work: Work) -> None:
        self._core(Completed(work.run_id, work.proxy, work.comp.node, work.comp.quiet, scheduler=work.scheduler))

    def _part_done(self, done: PartDone) -> None:
        self._core(PartEnded(done.run_id, done.scheduler, done.device_seconds))

    # ------------------------------------------------------------ the store and the data plane

    def _send(self, move: Move, run: tuple[str, str]) -> None:
        """Send ``move``'s shards, as its emits say, once they are all here."""
        shards = [r.shard + k for r in move.runs for k in range(r.count)]

        def send() -> None:
            for e in move.emits:
                self._emit(e, shards, {s: self.stored.get(f"{move.prefix}/{s}") for s in shards}, run)

        self._when_ready([f"{move.prefix}/{s}" for s in shards], send)

    def _when_ready(self, keys: list[str], then: Callable[[], object]) -> None:
        """Run ``then`` once every key is stored or failed (a posted receive)."""
        missing = [k for k in keys if k not in self.stored and k not in self.failed]
        if not missing:
            then()
            return
        left = [len(missing)]

        def one() -> None:
            left[0] -= 1
            if left[0] == 0:
                then()

        for key in missing:
            self._waiters[key].append(one)

    def _store(self, key: str, meta: Meta) -> None:
        if key.rsplit("/", 1)[0] in self.tombstones:
            return
        self.stored[key] = meta
        self._by_prefix[key.rsplit("/", 1)[0]].add(key)
        for wake in self._waiters.pop(key, []):
            wake()

    def _store_failed(self, key: str, error: PwmeshError) -> None:
        if key in self.stored or key in self.failed:
            return
        self.failed[key] = error
        self._by_prefix[key.rsplit("/", 1)[0]].add(key)
        self._inbox.pop(key, None)
        for wake in self._waiters.pop(key, []):
            wake()

    def _piece(self, key: str, sources: int, meta: Meta) -> None:
        """One producer's piece (or marker) for a destination shard; the last one stores it."""
        if key in self.stored or key in self.failed or key.rsplit("/", 1)[0] in self.tombstones:
            return
        left = self._inbox.get(key, sources) - 1
        if left > 0:
            self._inbox[key] = left
            return
        self._inbox.pop(key, None)
        self._store(key, meta)

    def _report_when_landed(self, target: Target, run: tuple[str, str]) -> None:
        """A reshard node's output lands here with no computation: report the node once its shards are here
        (as the executor does: ``Target.node``)."""
        seen = (run[1], target.node, target.prefix)
        if seen in self._reporting:
            return
        self._reporting.add(seen)
        keys = [f"{target.prefix}/{r.shard + k}" for site in target.sites if site.executor_id == self.executor_id
                for r in site.runs for k in range(r.count)]

        def report() -> None:
            error = next((self.failed[k] for k in keys if k in self.failed), None)
            self._core(Completed(run[1], run[0], target.node, False, error))

        self._when_ready(keys, report)

    def _emit(self, emit: Emit, shards: list[int], local: dict[int, Meta | None],
              run: tuple[str, str] | None = None) -> None:
        """Send a value's local shards as ``emit`` says: per destination executor, one transfer of the bytes."""
        for target in emit.targets:
            if target.node >= 0 and run is not None:
                for site in target.sites:
                    peer = self.peers.get(site.data)
                    if peer is not None:
                        peer._report_when_landed(target, run)
        batches: dict[str, list[tuple[str, int, Meta]]] = {}
        nbytes: collections.Counter[str] = collections.Counter()
        for target in emit.targets:
            dests = destinations(target)
            meta: Meta = (tuple(target.shape), target.dtype)
            itemsize = np.dtype(target.dtype).itemsize if target.dtype else 4
            if emit.mode == "block":
                moves = block_plan(emit, target)
                for src in shards:
                    for piece in moves.sends.get(src, ()):
                        dest = dests.get(piece.dest)
                        if dest is None:
                            continue
                        size = math.prod(h - lo for lo, h in zip(piece.lo, piece.hi, strict=True)) * itemsize
                        batches.setdefault(dest.data, []).append(
                            (f"{target.prefix}/{piece.dest}", len(moves.sources[piece.dest]), meta))
                        nbytes[dest.data] += size
            else:  # route / scatter: every producer reports to every destination shard; rows split evenly
                for src in shards:
                    have = local.get(src)
                    value = math.prod(have[0]) * np.dtype(have[1]).itemsize if have else 0
                    for j, dest in dests.items():
                        batches.setdefault(dest.data, []).append((f"{target.prefix}/{j}", emit.src_shards, meta))
                        nbytes[dest.data] += value // max(1, len(dests) * len(emit.targets))
        for data, pieces in batches.items():
            peer = self.peers.get(data)
            if peer is None:
                raise NotFound(f"{self.executor_id}: no executor has data-plane address {data!r}")
            if peer is self:
                for key, sources, meta in pieces:
                    self._piece(key, sources, meta)
                continue
            self.data_bytes_out += nbytes[data]

            def arrived(peer: SimExecutor = peer, pieces: list[tuple[str, int, Meta]] = pieces) -> None:
                for key, sources, meta in pieces:
                    peer._piece(key, sources, meta)

            self.network.transfer(self.data, data, nbytes[data], arrived)
