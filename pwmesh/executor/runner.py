"""The execution of computations: the shell around the device queues (``queues.DeviceQueues``).

Each device has one non-preemptive FIFO queue and one worker thread, as a TPU
core has one stream. The executor puts a computation's shards on their devices'
queues in island order (the pure core decides when each starts, and when a run's
part is done); this module waits for its inputs, function and memory, makes the
JAX calls (``calls``) and stores, emits and reports what they made. A computation
starts here once each of its local devices has reached it at the head of its
queue, and its inputs are here: no host waits for another. Shards on other executors that do not communicate never
wait for each other; an SPMD computation spanning executors (``Computation.gang``)
joins its peers in its collectives, through the executors' JAX group, and its
devices wait there, holding their queues. That is why every executor of an
island must see the same order (the island scheduler's): with two orders, two
such computations can each hold a device the other needs, forever.

Inputs are futures in the object store, posted before their producers run, so
a computation whose local devices have all arrived starts the moment its inputs
resolve.

How a computation runs once it starts: a quick one whose function is compiled
and *bounded* (nothing in it loops or waits on data: ``functions.bounded``) runs
right on the event loop (no thread hop); a slower bounded one is *streamed* —
handed to XLA without waiting, as to an accelerator's stream, so the loop goes on
to the next one (reading outputs still being computed) while the devices compute, at most
RUN_AHEAD ahead per device; a device thread sees each computed and it lands
(stored, emitted, reported) then. The rest (a first run, which compiles; routed
rows; a gang, whose hand-over to XLA may wait for its peers; anything not bounded,
which XLA may run to its end inside the call that hands it over) runs on its
devices' threads, once what is streamed ahead of it has landed. So the loop,
which serves heartbeats, status, cancels and signals, is never held by a
computation for longer than an inline one's bound, whatever it measured before.
A warm part (a chain of such inline computations, as a program run again) runs
as one chain when it arrives (``_run_chain``): no queue entry, no ``Work`` and
no report each, one report for them all. (A part's inline computations run back
to back, as they did one by one: a part of thousands holds the loop that long.)

Memory back-pressure: a computation's output bytes are known statically. One
whose outputs could never fit the executor's memory limit fails at once
(``ResourceExhausted``); once its inputs are there, one that does not fit *now*
waits at the head of its queues, blocking them, until deletions free enough
(see ``store.MemoryBudget``). The bytes are reserved as it starts, and become
stored bytes when its outputs land.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from pwmesh.errors import DeviceLost, NotFound, PwmeshError, RemoteError, ResourceExhausted
from pwmesh.executor.calls import (
    Whole,
    call_ragged,
    call_single,
    call_spmd,
    call_together,
    compiled,
    dispatch_plain,
    dispatch_spmd,
    dispatch_spmd_or_none,
    dispatch_together,
    pieces,
    wait_plain,
)
from pwmesh.executor.functions import CompiledFunction, FunctionCache
from pwmesh.executor.gangs import Gangs
from pwmesh.executor.group import peer_gone
from pwmesh.executor.queues import DeviceQueues, PartDone, Start
from pwmesh.executor.state import How, how_to_run, runs_inline
from pwmesh.executor.store import ObjectStore, format_bytes
from pwmesh.executor.stream import Landed, Streamed, Streams
from pwmesh.executor.work import Span, Work
from pwmesh.wire.messages import Computation, Emit

log = logging.getLogger(__name__)

RUN_AHEAD = 4  # computations handed to a device and not yet finished there, at most (see ``Runner._stream``)


def as_error(exc: BaseException, context: str) -> PwmeshError:
    """The error a failed shard stores: remote errors keep their original traceback."""
    if isinstance(exc, PwmeshError):
        return exc
    return RemoteError(f"{context}: {type(exc).__name__}: {exc}", remote_traceback="".join(traceback.format_exception(exc)))


def with_wholes(values: list[Any], wholes: list[Any | None]) -> list[Any]:
    """One shard's inputs: ``values`` in the places of the inputs that go in whole, None in theirs."""
    rest = iter(values)
    return [next(rest) if whole is None else None for whole in wholes]


def piece_inputs(inputs: list[str], wholes: list[Any | None] | None) -> list[str]:
    """The input buffers whose pieces a computation reads: all but those that go in whole."""
    return inputs if wholes is None else [p for p, w in zip(inputs, wholes, strict=True) if w is None]


class Runner:
    def __init__(
        self,
        devices: list[jax.Device],
        store: ObjectStore,
        functions: FunctionCache,
        *,
        emit: Callable[[Work, Emit, dict[int, Any], dict[int, Any], PwmeshError | None], None],
        done: Callable[[Work], None],
        part_done: Callable[[str, str, float], None] = lambda run_id, scheduler, seconds: None,
        done_together: Callable[[str, str, str, list[tuple[int, bool]]], None] | None = None,
        free: Callable[[list[str]], object] | None = None,
        memory_limit_bytes: int = 0,
        memory_wait_seconds: float = 300.0,
        host: str = "",
        trace_spans: int = 100_000,
    ) -> None:
        self.devices = devices
        # An accelerator's devices compute while the loop goes on: nothing runs inline there (``runs_inline``).
        self.asynchronous = any(d.platform != "cpu" for d in devices)
        self.store = store
        store.pieces = pieces  # SPMD outputs are stored whole (``ObjectStore.put_whole``): how to cut one
        self.functions = functions
        functions.devices = devices  # a function run by blocks names devices by their index here
        self.host = host
        self.memory = store.memory  # stored bytes are counted by the store, reservations here
        self.memory.limit_bytes = memory_limit_bytes
        self.memory_wait_seconds = memory_wait_seconds
        self._emit = emit
        self._done = done
        # (run, proxy, scheduler, [(node, quiet)]): computations of one run that completed together
        # (``_run_chain``); without it, ``done`` is called for each, with a ``Work`` made for it.
        self._done_together = done_together
        self._part_done = part_done
        # Delete buffers here (a computation's ``frees``, once it ran): the executor's own delete, as the proxy's.
        self._free = free or store.delete
        self.core = DeviceQueues(len(devices))  # the queues and the runs' accounting; this class acts on it
        self._starts: set[asyncio.Task[None]] = set()  # started computations, until they release their devices
        self.pools = [
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pwmesh-dev{i}")
            for i in range(len(devices))
        ]
        self.spans: collections.deque[Span] = collections.deque(maxlen=trace_spans)  # newest; for ``pwmesh trace``
        self._collectives: dict[Work, float] = {}  # gang computations running, since when (the watchdog)
        self._running: dict[Work, float] = {}  # on device threads or handed to devices: since when (wall clock)
        # What waits on work, kept here so that ``Work`` stays a plain record: a queued computation's
        # cancellation (set when its run is cancelled), and a streamed one's landing (its outputs computed).
        self._cancels: dict[Work, asyncio.Future[None]] = {}
        # (fn_id, spmd, devices, donated inputs) -> what the fast path runs, once compiled (functions never change)
        # (function, SPMD, a gang's id (its mesh's hash) or the local device ids, donated inputs) -> found
        self._ready: dict[tuple[str, bool, str | tuple[int, ...], tuple[int, ...]],
                          tuple[CompiledFunction, list[jax.Device], list[Any]]] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self.streams = Streams(len(devices), self._landed)  # handed to devices, not yet landed (``_stream``)
        # Every device of this executor's JAX group by (executor, device index): a gang's mesh (set by the
        # executor once it has joined the group).
        self.group_devices: dict[tuple[str, int], jax.Device] = {}
        self.gangs = Gangs()  # the gangs it was sent (``RegisterGang``), which computations name by id

    @property
    def outstanding(self) -> int:
        return self.core.outstanding

    @property
    def executed(self) -> int:
        return self.core.executed

    async def wait_idle(self) -> None:
        """Return once every enqueued computation has completed (used to drain)."""
        await self._idle.wait()

    def enqueue_all(self, run_id: str, proxy: str, comps: list[Computation],
                    scheduler: str = "") -> list[tuple[Computation, PwmeshError]]:
        """Enqueue one run's computations on this executor, in order; returns those refused, and why.

        The run's part is done (``part_done``) once all of them have completed, not before:
        a computation that runs at once (see ``enqueue``) must not end the part alone."""
        refused = []
        self.core.admitting(run_id)
        try:
            ran = self._run_chain(run_id, proxy, comps, scheduler)
            for comp in comps[ran:]:
                try:
                    self.enqueue(run_id, proxy, comp, scheduler)
                except PwmeshError as exc:
                    refused.append((comp, exc))
                except Exception as exc:  # a bug: this computation fails, the rest of the run goes on
                    log.exception("enqueueing computation %s of run %s failed", comp.node, run_id)
                    refused.append((comp, as_error(exc, f"enqueueing computation {comp.node}")))
        finally:
            self._act(self.core.admitted(run_id, scheduler))
        return refused

    def _valid(self, devices: list[int] | tuple[int, ...]) -> bool:
        """Whether ``devices`` names each of this host's devices at most once, and at least one."""
        return (bool(devices) and min(devices) >= 0 and max(devices) < len(self.devices)
                and len(set(devices)) == len(devices))

    def enqueue(self, run_id: str, proxy: str, comp: Computation, scheduler: str = "") -> None:
        """Put ``comp``'s shards on their devices' queues (synchronously, in call order).

        The fast path: a small computation whose devices are free, whose inputs and
        function are here and whose outputs fit runs right now, on the event loop,
        without a queue or a thread hop (in the island's order all the same: nothing
        is ahead of it on its devices)."""
        shards = comp.shards()
        devices = [device for device, _ in shards]
        if not self._valid(devices):
            raise PwmeshError(f"computation {comp.node} names devices {devices}; this host has {len(self.devices)}")
        work = Work(run_id, proxy, scheduler, comp, devices, [shard for _, shard in shards])
        self.core.add(work)
        self._idle.clear()
        try:
            if self._run_now(work):
                return
        except Exception:  # a bug on the fast path must lose neither the computation nor the run
            log.exception("%s failed on the fast path", work.label)
            if work.finished:  # it ran and was reported; only its tail went wrong
                return
        work.queued = True
        # Only work that goes through the queues waits, so only it has this: it fails when its run is
        # cancelled, so that whatever it waits for (inputs, its function) stops holding it.
        cancel = self._cancels[work] = asyncio.get_running_loop().create_future()
        cancel.add_done_callback(_retrieve)
        self._act(self.core.queue(work))

    def _act(self, actions: list[Start] | list[PartDone]) -> None:
        pending: collections.deque[Start | PartDone] = collections.deque(actions)
        while pending:
            action = pending.popleft()
            if isinstance(action, Start):
                # A quick computation that reached the head of its queues with everything it needs here runs
                # now, as on the fast path (``_run_now``): no task, no await, and so on down a chain (a queue
                # drained a computation a task cost ~25 us more). In a loop, not recursion: chains are long.
                if self._run_started(action.work):
                    pending.extend(self.core.release(action.work))
                    continue
                task = asyncio.get_running_loop().create_task(self._start(action.work), name=action.work.label)
                self._starts.add(task)
                task.add_done_callback(self._starts.discard)
            else:
                self._part_done(action.run_id, action.scheduler, action.device_seconds)

    async def _start(self, work: Work) -> None:
        """Run ``work``: every local device has reached it. Its devices are held until this returns."""
        try:
            if not work.finished:  # not given up already (``abandon``)
                await self._run(work)
        except Exception:  # a bug in one computation must not take its devices down with it
            log.exception("computation %s failed outside its own error handling", work.label)
        finally:
            self._act(self.core.release(work))

    def cancel_run(self, run_id: str, error: PwmeshError) -> None:
        """Fail what ``run_id``'s computations still wait for (inputs, memory), so none blocks a queue.

        Nodes dispatched one by one (sequential dispatch) run as ``run_id#node``: those too."""
        for work in self.core.of_run(run_id):
            work.cancelled = error
            self.memory.cancel(work, error)
            # Only this work stops waiting: the keys it waits for may serve other runs.
            cancel = self._cancels.get(work)
            if cancel is not None and not cancel.done():
                cancel.set_exception(error)

    def abandon(self, error: PwmeshError, only: list[Work] | None = None) -> int:
        """Give up on every computation not completed (the executor is stopping and will not wait
        for them), or on ``only`` those: each fails now with ``error``, reported as any failure is, so
        nobody waits for its outputs; one still running on a device thread keeps running there, unheard
        of. Returns how many were given up."""
        works = self.core.incomplete() if only is None else only
        now = time.time()
        for work in works:
            work.cancelled = error
            self.memory.cancel(work, error)
            cancel = self._cancels.get(work)
            if cancel is not None and not cancel.done():
                cancel.set_exception(error)
            started = self._running.pop(work, 0.0)
            self._finish(work, started or now, started, [], None, error, 0)
        return len(works)

    def donating(self) -> set[str]:
        """The keys that computations running now (on device threads, or handed to devices) were given to
        consume: they may be gone any moment."""
        return {f"{work.comp.inputs[k]}/{shard}" for work in self._running for k in work.comp.donate
                for shard in work.shards}

    def running_of(self, run_id: str) -> list[Work]:
        """``run_id``'s computations running on device threads or handed to devices now (and those of the
        nodes it dispatched one by one)."""
        return [w for w in self._running if w.run_id == run_id or w.run_id.startswith(f"{run_id}#")]

    def silence(self) -> None:
        """Report nothing from now on (the executor is restarting: what it had not completed goes on in the
        next process, which reports it then)."""
        self._emit = lambda work, emit, outs, shards, err: None
        self._done = lambda work: None
        self._part_done = lambda run_id, scheduler, seconds: None

    def running(self, now: float) -> list[str]:
        """What runs on device threads or was handed to its devices, oldest first: one line each, with its
        devices and for how long (a long computation is busy, not dead: ``pwmesh status`` shows it)."""
        return [f"devices [{','.join(map(str, work.devices))}] running {work.label} ({work.comp.fn_id[:12]}) "
                f"for {now - since:.1f} s" for work, since in sorted(self._running.items(), key=lambda i: i[1])]

    @property
    def running_count(self) -> int:
        return len(self._running)

    @property
    def longest_running_seconds(self) -> float:
        return time.time() - min(self._running.values()) if self._running else 0.0

    def trace(self, since: float = 0.0, limit: int = 0) -> list[Span]:
        """The newest ``limit`` (0: all) recorded spans that ended at or after ``since``."""
        spans = [s for s in self.spans if s.end >= since]
        return spans[-limit:] if limit > 0 else spans

    def queued(self) -> list[int]:
        return self.core.queued()

    def gang_waits(self, older_than_seconds: float = 0.0) -> list[str]:
        """The gang computations that devices here run (the first handed to each device; those behind wait
        for it) for longer than ``older_than_seconds``: each waits for peers on other executors that have
        not reached it (a deadlock, if those wait for one here)."""
        now = time.monotonic()
        waits: list[str] = []
        seen: set[int] = set()
        for work, since in list(self._collectives.items()):  # in the order they were handed over
            if seen.isdisjoint(work.devices) and now - since >= older_than_seconds:
                waits.append(f"devices [{','.join(map(str, work.devices))}] have been in {work.label}, a collective "
                             f"over {self._gang_label(work.comp)}, for {now - since:.1f} s")
            seen.update(work.devices)
        return waits

    # --------------------------------------------------------------- running

    def _check_fits(self, work: Work, fn: CompiledFunction) -> None:
        """Fail at once if the computation's outputs on this host could never fit its memory."""
        needed = fn.shard_output_nbytes * len(work.devices)
        self.memory.check(needed, f"computation {work.comp.node} ({work.comp.fn_id[:12]}) on host {self.host}")

    async def _reserve(self, work: Work, nbytes: int) -> int:
        """Wait until ``nbytes`` fit, then hold them for ``work``'s outputs; returns what it holds."""
        if work.cancelled is not None and not self.memory.fits(nbytes):
            raise work.cancelled
        if self.memory.try_reserve(nbytes):  # it fits, nobody waits ahead: no timer, no task (~5% of a chain)
            return nbytes
        try:
            await asyncio.wait_for(self.memory.reserve(nbytes, owner=work), self.memory_wait_seconds)
        except TimeoutError:
            memory = self.memory
            raise ResourceExhausted(
                f"computation {work.comp.node} ({work.comp.fn_id[:12]}) on host {self.host} waited "
                f"{self.memory_wait_seconds:g} s for {format_bytes(nbytes)} of memory for its outputs: "
                f"{format_bytes(memory.in_use)} of the executor's {format_bytes(memory.limit_bytes)} limit stay held "
                f"({len(self.store)} objects; the sessions holding them must free some, or the executor needs "
                "more memory; --memory-wait-seconds)") from None
        return nbytes

    async def _run(self, work: Work) -> None:
        """All local devices are here: meet the peers, then run every local shard."""
        comp = work.comp
        reserved = 0
        per_shard: list[list[Any]] = []
        outs: list[list[Any]] | Whole | None = None
        err: PwmeshError | None = None
        await self.streams.room(work, RUN_AHEAD)
        # Wall clock, so the spans of processes on one machine line up. ``start`` stays 0
        # if it fails before it: it then shows as a zero-length span at the failure.
        arrived = time.time()
        start = 0.0
        try:
            fn = None
            streamed = None  # what to hand over without waiting for it (see _stream), if that is how it runs
            if comp.kind == "call":
                fn = await self._unless_cancelled(self.functions.get(comp.fn_id), work)
                if comp.gang and self.gangs.known(comp.gang) is None:  # its devices may come after it
                    await self._unless_cancelled(self.gangs.get(comp.gang), work)
                self._check_fits(work, fn)
                found = None if comp.ragged or comp.gang else self._runnable(comp, tuple(work.devices))
                how = how_to_run(comp, found[0] if found else None, len(found[1]) if found else len(work.devices),
                                 self.asynchronous)
                # Inline: it runs right on the loop (_call), on computed inputs only; threads: _call too.
                streamed = found if how is How.STREAM else None
            per_shard, wholes = await self._inputs(work, fn, streamed is not None)
            if fn is not None:
                reserved = await self._reserve(work, fn.shard_output_nbytes * len(work.devices))
            if streamed is None or self.streams.mixed(work):
                # A device runs one thing at a time, and what is streamed to it lands in order
                # (one landing thread a device set): let what is streamed ahead land first.
                # Its devices reached it only then: that is when its trace's wait begins.
                await self.streams.room(work, 1)
                arrived = max(arrived, self.streams.free_since(work))
            if work.cancelled is not None:  # meanwhile: it must not start (nor consume what it was donated)
                raise work.cancelled
            start = time.time()
            if fn is None:  # route: nothing runs, it only emits; identity: its inputs are its outputs
                outs = per_shard if comp.kind == "identity" else [[] for _ in work.shards]
            elif streamed is not None:
                self._stream(work, fn, streamed[1], streamed[2], per_shard, wholes, (arrived, start), reserved)
                return
            else:
                outs = await self._call(work, fn, per_shard, wholes)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                self.memory.release(reserved)
                raise
            err = as_error(exc, f"computation {comp.node} ({comp.fn_id[:12] or comp.kind})")
            if comp.gang and peer_gone(exc):
                err = DeviceLost(f"computation {comp.node} ({comp.fn_id[:12]}) lost a peer in its collectives over "
                                 f"{self._gang_label(comp)}: {exc}")
            elif comp.gang and fn is not None and not start and work.cancelled is None:
                await self._join_collectives(work, fn, err)
        # Each output's bytes as its function says (as a streamed one's): asking each array costs ~3 us.
        nbytes = fn.output_nbytes if fn is not None and not comp.ragged else None
        self._finish(work, arrived, start, per_shard, outs, err, reserved, nbytes)

    async def _join_collectives(self, work: Work, fn: CompiledFunction, err: PwmeshError) -> None:
        """A gang computation that failed here before it ran (an input lost, say) still runs, on zeros, what
        its collectives need, and its outputs are dropped (it fails with ``err``). Its peers may be in those
        collectives already, and collectives pair by their order on each device, not by run: a member that
        skipped one would leave its peers waiting for good, or pair their next run's with this one's."""
        try:
            devices = self._mesh(work.comp, tuple(work.devices))
            in_shardings, _ = fn.shardings(tuple(devices))
            zeros = [[jax.device_put(np.zeros(sharding.shard_shape(aval.shape), aval.dtype), self.devices[d])
                      for aval, sharding in zip(fn.exported.in_avals, in_shardings, strict=True)]
                     for d in work.devices]
        except Exception as exc:  # noqa: BLE001 - it failed already; this is the peers' best effort
            log.warning("computation %d of run %s failed here (%s) and cannot join its collectives over %s: %s",
                        work.comp.node, work.run_id, err.message, self._gang_label(work.comp), exc)
            return
        # Nothing donated (what it was given stays for the proxy to delete); watched, and reclaimed if cancelled
        # while its peers never come, as the computation itself would be.
        self._running[work], self._collectives[work] = time.time(), time.monotonic()
        try:
            outs, _ = await asyncio.get_running_loop().run_in_executor(
                self.pools[work.devices[-1]], call_spmd, fn, tuple(devices), self._local(work), zeros, None, ())
        except Exception as exc:  # noqa: BLE001 - as above
            log.warning("computation %d of run %s failed here (%s), and on zeros in its collectives over %s: %s",
                        work.comp.node, work.run_id, err.message, self._gang_label(work.comp), exc)
            return
        finally:
            self._running.pop(work, None)
            self._collectives.pop(work, None)
        for leaf in outs.leaves:
            leaf.delete()
        log.warning("computation %d of run %s failed here (%s): it joined its collectives over %s on zeros, for "
                    "its peers, and fails", work.comp.node, work.run_id, err.message, self._gang_label(work.comp))

    async def _inputs(self, work: Work, fn: CompiledFunction | None,
                      streamed: bool) -> tuple[list[list[Any]], list[Any | None] | None]:
        """Every local shard's inputs, and (an SPMD call) those that go in whole (``_whole_inputs``: None in
        their places in the shards'). Looked up at once where all are stored (no future each), else
        waited for one by one (a streamed computation takes outputs still being computed, donated ones
        too: the proxy lets a run consume a buffer only when nothing else reads it, so its producer
        has no emits of it, and stores nothing once it lands consumed)."""
        wholes = self._whole_inputs(work, fn, streamed)
        per_shard = self._stored(work, wholes)
        if per_shard is not None:
            return per_shard, wholes
        if fn is not None and work.comp.spmd and not work.comp.emits:  # it may take them whole: wait so
            for buffer in piece_inputs(work.comp.inputs, wholes):
                await self._unless_cancelled(self.store.arrival(buffer), work)
            wholes = self._whole_inputs(work, fn, streamed)
            per_shard = self._stored(work, wholes)
            if per_shard is not None:
                return per_shard, wholes
        inputs = piece_inputs(work.comp.inputs, wholes)
        per_shard = []
        for shard in work.shards:
            values = [await self._input(f"{p}/{shard}", work, streamed) for p in inputs]
            per_shard.append(values if wholes is None else with_wholes(values, wholes))
        return per_shard, wholes

    def _stored(self, work: Work, wholes: list[Any | None] | None) -> list[list[Any]] | None:
        """Every local shard's inputs (but those going in whole) if all are stored here, else None."""
        inputs = piece_inputs(work.comp.inputs, wholes)
        per_shard = []
        for shard in work.shards:
            values = self.store.values([f"{p}/{shard}" for p in inputs])
            if values is None:
                return None
            per_shard.append(values if wholes is None else with_wholes(values, wholes))
        return per_shard

    def _whole_inputs(self, work: Work, fn: CompiledFunction | None, streamed: bool) -> list[Any | None] | None:
        """An SPMD call's inputs that an SPMD output here is, whole (a global array) over the same devices
        and layout: they go in as they are, with no piece looked up or assembled (that costs ~0.1-0.3 ms a
        call). A streamed call takes outputs still being computed too. None: none does (or it is no SPMD
        call, or one whose values are emitted: emits send pieces)."""
        comp = work.comp
        if fn is None or not comp.spmd or comp.emits:
            return None
        found = self._runnable(comp, tuple(work.devices))
        devices = found[1] if found is not None else self._mesh(comp, tuple(work.devices))
        return self._wholes(comp, fn, devices, tuple(work.shards), streamed)

    def _wholes(self, comp: Computation, fn: CompiledFunction, devices: list[jax.Device], shards: tuple[int, ...],
                streamed: bool = False) -> list[Any | None] | None:
        """``_whole_inputs`` over ``devices`` (the warm path calls it directly: it has no ``Work``)."""
        shardings = fn.shardings(tuple(devices))[0]
        if len(shardings) != len(comp.inputs):  # a malformed computation: it fails as it is called
            return None
        wholes = []
        for buffer, sharding in zip(comp.inputs, shardings, strict=True):
            array = self.store.whole(buffer, sharding, shards)
            if array is None and streamed:
                array = self.streams.whole(buffer, sharding, shards)
            wholes.append(array)
        return wholes if any(w is not None for w in wholes) else None

    async def _input(self, key: str, work: Work, pending: bool) -> Any:
        """An input: the stored value, or (``pending``: for a computation that is streamed too, so
        nothing here waits for it) a streamed computation's output as soon as it is handed out."""
        value = self.streams.piece(key) if pending else None
        if value is not None:
            return value
        return await self._unless_cancelled(self.store.get(key), work)

    async def _unless_cancelled(self, fut: asyncio.Future[Any], work: Work) -> Any:
        """``await fut``, unless ``work``'s run is cancelled first (then raise the reason)."""
        if not fut.done():
            await asyncio.wait((fut, self._cancels[work]), return_when=asyncio.FIRST_COMPLETED)
        if not fut.done():
            raise work.cancelled or PwmeshError(f"{work.label} was cancelled")
        return fut.result()

    def _stream(self, work: Work, fn: CompiledFunction, devices: list[jax.Device], exes: list[Any],
                per_shard: list[list[Any]], wholes: list[Any | None] | None, times: tuple[float, float],
                reserved: int) -> None:
        """Hand a compiled computation to its devices and return without waiting for it.

        As on an accelerator's stream, XLA queues it behind what its devices run now, and
        its inputs may be outputs still being computed: the devices go from one computation
        to the next with no Python in between, while this loop meets the next gang's peers
        and hands that one over too (at most RUN_AHEAD ahead). Its outputs are given to the
        computations here that read them at once (``_input``); they land in the store, are
        emitted and reported when a device thread has seen them computed (``_landed``)."""
        comp = work.comp
        outs: list[list[Any]] | Whole
        try:
            if comp.spmd:
                outs = self._outputs(work, dispatch_spmd(fn, tuple(devices), self._local(work), per_shard, wholes,
                                                         tuple(comp.donate)))
            else:
                outs = dispatch_together(exes, devices, per_shard)
            self._consume(work, per_shard, wholes)
        except Exception as exc:
            err = as_error(exc, f"computation {comp.node} ({comp.fn_id[:12]})")
            self._finish(work, times[0], times[1], per_shard, None, err, reserved)
            return
        work.streamed = True
        self._running.setdefault(work, times[1])
        self.streams.hand_over(Streamed(work, fn, per_shard, outs, times, reserved))

    def _landed(self, batch: list[Landed]) -> None:
        """Streamed computations are computed (or failed; ``end`` is when): they finish like any other."""
        for landed in batch:
            try:
                self._land(landed)
            except Exception:  # a bug in one must not lose the others
                log.exception("%s failed as it landed", landed.streamed.work.label)

    def _land(self, landed: Landed) -> None:
        streamed, end, exc = landed.streamed, landed.end, landed.error
        work, fn, comp = streamed.work, streamed.fn, streamed.work.comp
        self._running.pop(work, None)
        arrived, begin = self.streams.land(streamed, end)
        err = None if exc is None else as_error(exc, f"computation {comp.node} ({comp.fn_id[:12]})")
        if err is None:
            fn.landed((end - begin) / len(work.devices) if landed.timed else None)
            work.device_seconds = (end - begin) * len(work.devices)
        self._finish(work, arrived, begin, streamed.per_shard, None if err else streamed.outs, err,
                     streamed.reserved, fn.output_nbytes, end=end)

    def _run_now(self, work: Work) -> bool:
        """Run ``work`` here and now if it can start at once and is quick; False leaves it to the queues."""
        if not self.core.free(work) or not self._run_inline(work):
            return False
        self.core.started += 1  # it never reaches the queues' own start
        return True

    def _run_started(self, work: Work) -> bool:
        """Run ``work``, which its queues just started, here and now if it is quick and needs no wait; True if it
        ran (and is finished: its devices are the caller's to release)."""
        if work.finished or work.cancelled is not None:  # the task path fails (or drops) it as it should
            return False
        try:
            return self._run_inline(work)
        except Exception:  # a bug on the fast path must lose neither the computation nor the run
            log.exception("%s failed on the fast path", work.label)
            return work.finished

    def _run_inline(self, work: Work) -> bool:
        """Run ``work`` on this thread if it is quick and its inputs, function, memory and devices (nothing
        streamed to them unfinished) are all here now; True if it ran and finished."""
        comp = work.comp
        if comp.gang or comp.kind != "call" or comp.ragged:
            return False
        found = self._runnable(comp, tuple(work.devices))
        if found is None:
            return False
        fn, devices, exes = found
        # how_to_run's INLINE, its gang and routed-rows cases ruled out above (this runs per computation).
        if not runs_inline(fn, fn.seconds * len(devices), self.asynchronous):
            return False
        wholes = self._whole_inputs(work, fn, streamed=False)
        per_shard = self._stored(work, wholes)
        if per_shard is None:  # not here yet, or failed: the queues wait for it (or report it)
            return False
        if self.streams.busy(work.devices):  # what is streamed ahead lands first (as in ``_run``)
            return False
        nbytes = fn.shard_output_nbytes * len(devices)
        if not self.memory.try_reserve(nbytes):
            return False
        arrived = time.time()
        if not (comp.spmd or comp.emits or comp.donate) and self._run_plain(work, fn, devices, exes, per_shard,
                                                                             arrived, nbytes):
            return True
        outs = None
        err = None
        try:
            outs = self._call_inline(work, fn, devices, exes, per_shard, wholes)
        except Exception as exc:
            err = as_error(exc, f"computation {comp.node} ({comp.fn_id[:12]})")
        self._finish(work, arrived, arrived, per_shard, outs, err, nbytes, fn.output_nbytes)
        return True

    def _run_chain(self, run_id: str, proxy: str, comps: list[Computation], scheduler: str) -> int:
        """The warm path of a part (a chain of small computations: a training loop's step, Figure 5's Chained):
        its first computations that could each run inline as ``_run_plain`` does (a function per device, or an SPMD
        one over this executor's devices alone, its outputs kept whole; no emits, nothing donated, quick, compiled,
        inputs stored, devices idle with nothing streamed to them) run
        here one after the other, dispatched, waited for and stored with nothing else per computation: no
        ``Work``, no queue, no report each, but one for them all. Returns how many ran (and completed). The
        rest, from the first that cannot run so (or fails as it is dispatched: the ordinary path runs that one
        again, and fails it as it should), take the ordinary path. Nothing else runs meanwhile (this holds
        the loop, as inline computations do), so devices found idle stay idle and inputs stay stored."""
        if self.asynchronous:
            return 0
        done: list[tuple[int, bool]] = []
        failed: list[tuple[Work, list[list[Any]], float, BaseException]] = []
        try:
            self._chain(run_id, proxy, comps, scheduler, done, failed)
        except Exception:  # a bug here must lose nothing: what did not run takes the ordinary path
            log.exception("run %s: the warm path failed after %d computations; the rest take the ordinary path",
                          run_id, len(done))
        finally:
            if done and self._done_together is not None:
                self._done_together(run_id, proxy, scheduler, done)
        for work, per_shard, arrived, exc in failed:  # it ran and failed: that is its outcome, after those before it
            self.core.add(work)
            self._finish(work, arrived, arrived, per_shard, None,
                         as_error(exc, f"computation {work.comp.node} ({work.comp.fn_id[:12]})"), 0)
        return len(done) + len(failed)

    def _chain(self, run_id: str, proxy: str, comps: list[Computation], scheduler: str,
               done: list[tuple[int, bool]], failed: list[tuple[Work, list[list[Any]], float, BaseException]]) -> None:
        """``_run_chain``'s loop: what ran goes in ``done``, the one that ran and failed (last) in ``failed``."""
        store, memory, spans, core = self.store, self.memory, self.spans, self.core
        load = core.load
        idle: dict[tuple[int, ...], bool] = {}
        for comp in comps:
            if comp.gang or comp.emits or comp.donate or comp.ragged or comp.kind != "call":
                break
            shards = comp.shards()
            device_ids = tuple([d for d, _ in shards])
            shard_ids = [s for _, s in shards]
            free = idle.get(device_ids)
            if free is None:  # once per set of devices: nothing here can queue work on them or stream to them
                free = idle[device_ids] = (self._valid(device_ids) and not any([load[d] for d in device_ids])
                                           and not self.streams.busy(list(device_ids)))
            if not free:
                break
            found = self._runnable(comp, device_ids)
            if found is None:
                break
            fn, devices, exes = found
            if not runs_inline(fn, fn.seconds * len(devices)):
                break
            # An SPMD computation over this executor's devices alone (a pmap with a collective): the inputs an
            # SPMD output here is go in whole (``_whole_inputs``), the rest as pieces.
            wholes = self._wholes(comp, fn, devices, tuple(shard_ids)) if comp.spmd else None
            inputs = piece_inputs(comp.inputs, wholes)
            per_shard = []
            for shard in shard_ids:
                values = store.values([f"{p}/{shard}" for p in inputs])
                if values is None:
                    break
                per_shard.append(values if wholes is None else with_wholes(values, wholes))
            if len(per_shard) != len(shards):  # an input is not here (yet): the queues wait for it
                break
            nbytes = fn.shard_output_nbytes * len(devices)
            if not memory.try_reserve(nbytes):
                break
            try:
                arrived = time.time()
                start = time.perf_counter()
                outs: list[list[Any]] | Whole | None
                if comp.spmd:
                    outs = dispatch_spmd_or_none(fn, tuple(devices), per_shard, wholes, len(comp.outputs))
                else:
                    outs = dispatch_plain(exes, devices, per_shard, len(comp.outputs))
                if outs is None:  # it fails as it is dispatched, or makes the wrong outputs: the ordinary path says so
                    break
                try:
                    wait_plain([outs.leaves] if isinstance(outs, Whole) else outs)  # (a Whole's: computed together)
                except Exception as exc:
                    failed.append((Work(run_id, proxy, scheduler, comp, list(device_ids), shard_ids),
                                   per_shard, arrived, exc))
                    return
                wall = time.perf_counter() - start
                fn.ran(wall / len(devices))
                spans.append(Span(arrived, arrived, time.time(), run_id, comp.node, comp.seq, comp.fn_id, device_ids,
                                  ""))
                if isinstance(outs, Whole):
                    for buffer, leaf, sharding, shard_nbytes in zip(comp.outputs, outs.leaves, outs.shardings,
                                                                   outs.nbytes, strict=True):
                        store.put_whole(buffer, leaf, sharding, tuple(shard_ids), outs.local, shard_nbytes)
                    wall *= len(devices)  # every device was busy all along (as ``_call_inline`` counts it)
                else:
                    self._store_plain(comp, fn, shard_ids, outs)
            finally:
                memory.release(nbytes)  # the outputs are stored bytes now (or nothing was made)
            core.ran(run_id, device_ids, wall)
            if comp.frees:
                self._free_inputs(comp)
            done.append((comp.node, comp.quiet))
            if self._done_together is None:  # (a runner without one: each reported as the ordinary path does)
                self._done(Work(run_id, proxy, scheduler, comp, list(device_ids), shard_ids,
                                finished=True, device_seconds=wall))

    def _run_plain(self, work: Work, fn: CompiledFunction, devices: list[jax.Device], exes: list[Any],
                   per_shard: list[list[Any]], arrived: float, reserved: int) -> bool:
        """The warm path of ``_run_inline``, for the commonest computation (a function per device: no SPMD, no
        emits, nothing donated) that runs and makes what it should: dispatch, wait, store, report, with no
        per-node Python beyond that (a chain's node cost the runner ~40 us, ~11 of them its XLA calls; ~32 so). False,
        having stored and reported nothing, if it fails as it is dispatched or makes the wrong number of
        outputs (a malformed computation): the general path then runs it again, and fails it as it should."""
        comp = work.comp
        start = time.perf_counter()
        outs = dispatch_plain(exes, devices, per_shard, len(comp.outputs))
        if outs is None:
            return False
        try:
            wait_plain(outs)
        except Exception as exc:  # it ran and failed: that is its outcome
            self._finish(work, arrived, arrived, per_shard, None,
                         as_error(exc, f"computation {comp.node} ({comp.fn_id[:12]})"), reserved)
            return True
        wall = time.perf_counter() - start
        work.device_seconds = wall
        fn.ran(wall / len(devices))
        end = time.time()
        self.spans.append(Span(arrived, arrived, end, work.run_id, comp.node, comp.seq, comp.fn_id,
                               tuple(work.devices), ""))
        try:
            self._store_plain(comp, fn, work.shards, outs)
        finally:
            self.memory.release(reserved)  # the outputs are stored bytes now
            self._complete(work)
        return True

    def _store_plain(self, comp: Computation, fn: CompiledFunction, shards: list[int], outs: list[list[Any]]) -> None:
        """Store what a warm computation made (``dispatch_plain``): output ``i`` of shard ``shards[k]`` is
        ``outs[k][i]``."""
        put = self.store.put
        for i, (buffer, shard_nbytes) in enumerate(zip(comp.outputs, fn.output_nbytes, strict=False)):
            for shard, out in zip(shards, outs, strict=True):
                put(f"{buffer}/{shard}", out[i], shard_nbytes, computed=True)

    def _runnable(self, comp: Computation, device_ids: tuple[int, ...]
                  ) -> tuple[CompiledFunction, list[jax.Device], list[Any]] | None:
        """The function, devices (a gang's: its whole mesh) and executables of a computation, if it is
        registered and compiled for its devices; found once per (function, devices), then remembered."""
        # A gang's id stands for its mesh (the hash of its devices).
        key = (comp.fn_id, comp.spmd, comp.gang or device_ids, tuple(comp.donate))
        found = self._ready.get(key)
        if found is None:
            entry = self.functions.get(comp.fn_id)
            if not entry.done() or entry.exception() is not None:
                return None
            fn = entry.result()
            devices = self._mesh(comp, device_ids)
            exes = compiled(fn, comp.spmd, devices, tuple(comp.donate))
            if exes is None:
                return None
            found = self._ready[key] = (fn, devices, exes)
        return found

    def _mesh(self, comp: Computation, device_ids: tuple[int, ...]) -> list[jax.Device]:
        """The devices a computation runs over: its local ones, or a gang's every device."""
        if not comp.gang:
            return [self.devices[d] for d in device_ids]
        gang = self.gangs.known(comp.gang)
        if gang is None:  # (``_run`` waited for it: forgotten since, among more than the registry keeps)
            raise NotFound(f"computation {comp.node} runs in gang {comp.gang}, which this executor does not know")
        missing = [f"{ex}:{d}" for ex, d in gang.mesh if (ex, d) not in self.group_devices]
        if missing:
            raise DeviceLost(f"computation {comp.node} spans devices {', '.join(missing)}, which are not in this "
                             f"executor's JAX group now")
        return [self.group_devices[member] for member in gang.mesh]

    def _gang_label(self, comp: Computation) -> str:
        gang = self.gangs.known(comp.gang)
        return gang.label if gang is not None else f"gang {comp.gang}"

    def _local(self, work: Work) -> tuple[jax.Device, ...]:
        return tuple(self.devices[d] for d in work.devices)

    def _finish(self, work: Work, arrived: float, start: float, per_shard: list[list[Any]],
                outs: list[list[Any]] | Whole | None, err: PwmeshError | None, reserved: int,
                nbytes: list[int] | None = None, end: float = 0.0) -> None:
        """Store (or fail) its outputs, give back its reservation, send its emits, report it done."""
        if work.finished:  # given up already (``abandon``): what it made now has nobody to go to
            self.memory.release(reserved)
            return
        comp = work.comp
        end = end or time.time()
        self.spans.append(Span(arrived, start or end, end, work.run_id, comp.node, comp.seq, comp.fn_id,
                               tuple(work.devices), "" if err is None else err.message))
        try:
            if isinstance(outs, Whole) and err is None:
                err = self._finish_whole(work, outs)
            else:
                for i, shard in enumerate(work.shards):
                    out = None if outs is None or isinstance(outs, Whole) else outs[i]
                    err = self._finish_outputs(work, shard, out, err, nbytes)
        finally:
            self.memory.release(reserved)  # the outputs are stored bytes now, or failed
        try:
            self._emit_all(work, per_shard, outs, err)
        finally:
            self._complete(work)

    def _emit_all(self, work: Work, per_shard: list[list[Any]], outs: list[list[Any]] | Whole | None,
                  err: PwmeshError | None) -> None:
        """Send the values the computation's emits name (or, if it failed, its failure)."""
        if not work.comp.emits:  # most computations: their consumers run on this executor
            return
        assert not isinstance(outs, Whole), "a computation with emits has its outputs in pieces (_outputs)"
        if err is not None or outs is None:
            for emit in work.comp.emits:
                self._emit(work, emit, {}, {}, err or PwmeshError(f"{work.label} produced nothing"))
            return
        values = [[*ins, *out] for ins, out in zip(per_shard, outs, strict=True)]
        for emit in work.comp.emits:
            local = {shard: values[i][emit.slot] for i, shard in enumerate(work.shards)}
            selectors = {shard: values[i][emit.selector] for i, shard in enumerate(work.shards)
                         if emit.selector >= 0}
            self._emit(work, emit, local, selectors, None)

    async def _call(self, work: Work, fn: CompiledFunction, per_shard: list[list[Any]],
                    wholes: list[Any | None] | None) -> list[list[Any]] | Whole:
        comp = work.comp
        found = self._runnable(comp, tuple(work.devices))
        devices = found[1] if found is not None else self._mesh(comp, tuple(work.devices))
        # A quick computation runs right here, on the loop: the hop to a device thread and back
        # (~0.1-0.5 ms on a busy host) would dominate it. Never a gang: it waits for its peers;
        # nor routed rows: they are padded and cut on the host.
        if found is not None and how_to_run(comp, fn, len(devices), self.asynchronous) is How.INLINE:
            return self._call_inline(work, fn, devices, found[2], per_shard, wholes)
        self._running[work] = time.time()
        try:
            return await self._call_on_threads(work, fn, devices, per_shard, wholes)
        finally:
            self._running.pop(work, None)

    async def _call_on_threads(self, work: Work, fn: CompiledFunction, devices: list[jax.Device],
                               per_shard: list[list[Any]], wholes: list[Any | None] | None) -> list[list[Any]] | Whole:
        comp = work.comp
        loop = asyncio.get_running_loop()
        donate = tuple(comp.donate)
        if comp.spmd:
            if comp.gang:
                self._collectives[work] = time.monotonic()
            try:
                whole, seconds = await loop.run_in_executor(
                    self.pools[work.devices[-1]], call_spmd, fn, tuple(devices), self._local(work), per_shard,
                    wholes, donate)
            finally:
                self._collectives.pop(work, None)
                self._consume(work, per_shard, wholes)
            fn.ran(seconds / len(devices))
            work.device_seconds = seconds * len(devices)
            return self._outputs(work, whole)
        call = call_ragged if comp.ragged else functools.partial(call_single, donate=donate)
        try:
            results = await asyncio.gather(*(
                loop.run_in_executor(self.pools[d], call, fn, self.devices[d], args)
                for d, args in zip(work.devices, per_shard, strict=True)))
        finally:
            self._consume(work, per_shard)
        fn.ran(max(r[1] for r in results))
        work.device_seconds = sum(r[1] for r in results)
        return [r[0] for r in results]

    def _call_inline(self, work: Work, fn: CompiledFunction, devices: list[jax.Device], exes: list[Any],
                     per_shard: list[list[Any]], wholes: list[Any | None] | None) -> list[list[Any]] | Whole:
        """Run a compiled computation's shards on this thread, all dispatched before any is waited for."""
        outs: list[list[Any]] | Whole
        try:
            if work.comp.spmd:
                whole, wall = call_spmd(fn, tuple(devices), self._local(work), per_shard, wholes,
                                        tuple(work.comp.donate))
                outs = self._outputs(work, whole)
                work.device_seconds = wall * len(devices)  # every device was busy all along
            else:
                outs, wall = call_together(exes, devices, per_shard)
                work.device_seconds = wall
        finally:
            self._consume(work, per_shard, wholes)
        fn.ran(wall / len(devices))  # ``fn.seconds`` is per shard: how_to_run multiplies it back
        return outs

    def _outputs(self, work: Work, whole: Whole) -> list[list[Any]] | Whole:
        """An SPMD computation's outputs as they are stored: whole, unless it emits any (emits send pieces):
        then in pieces, each output kept whole beside them for the SPMD computations here that read it."""
        if not work.comp.emits:
            return whole
        shards = tuple(work.shards)
        for prefix, leaf, sharding in zip(work.comp.outputs, whole.leaves, whole.shardings, strict=False):
            self.store.keep_whole(prefix, leaf, sharding, shards, whole.local)
        return whole.split()

    def _finish_whole(self, work: Work, whole: Whole) -> PwmeshError | None:
        """Store an SPMD computation's outputs whole (``ObjectStore.put_whole``): no piece is made."""
        comp = work.comp
        if len(whole.leaves) != len(comp.outputs):
            err = PwmeshError(f"computation {comp.node} produced {len(whole.leaves)} outputs, "
                              f"expected {len(comp.outputs)}")
            for shard in work.shards:
                self._finish_outputs(work, shard, None, err)
            return err
        shards = tuple(work.shards)
        for prefix, leaf, sharding, nbytes in zip(comp.outputs, whole.leaves, whole.shardings, whole.nbytes,
                                                  strict=True):
            if not leaf.is_deleted():  # else a computation it was donated to consumed it before it landed
                self.store.put_whole(prefix, leaf, sharding, shards, whole.local, nbytes)
        return None

    def _consume(self, work: Work, per_shard: list[list[Any]], wholes: list[Any | None] | None = None) -> None:
        """The donated inputs XLA took over (reused for outputs, or freed) leave the store now: their
        bytes are the outputs' now. One it could not take (placed on another device first, say) stays
        until the proxy deletes it."""
        spmd, inputs, consume = work.comp.spmd, work.comp.inputs, self.store.consume
        for k in work.comp.donate:
            whole = wholes[k] if wholes is not None and k < len(wholes) else None
            if whole is not None:  # it went in whole: taken over as one global array, or not at all
                if whole.is_deleted():
                    self.store.consume_whole(inputs[k], work.shards)
                continue
            consumed = None  # one SPMD call took all of an input's pieces or none (one global array)
            buffer = inputs[k]
            for shard, args in zip(work.shards, per_shard, strict=True):
                value = args[k] if k < len(args) else None
                if consumed is None or not spmd:
                    consumed = isinstance(value, jax.Array) and value.is_deleted()
                if consumed:
                    consume(f"{buffer}/{shard}", buffer)

    def _finish_outputs(self, work: Work, shard: int, outs: list[Any] | None, err: PwmeshError | None,
                        nbytes: list[int] | None = None) -> PwmeshError | None:
        """Store one shard's outputs (``nbytes`` each, when known: asking an array costs ~3 us), or fail them."""
        keys = [f"{p}/{shard}" for p in work.comp.outputs]
        if err is None and outs is not None and len(outs) != len(keys):
            err = PwmeshError(f"computation {work.comp.node} produced {len(outs)} outputs, expected {len(keys)}")
        for i, key in enumerate(keys):
            if err is None:
                assert outs is not None
                value = outs[i]
                if isinstance(value, jax.Array) and value.is_deleted():
                    # A computation it was donated to consumed it before it landed: nothing to keep, nor to come.
                    self.store.made_here(key)
                    continue
                self.store.put(key, value, value.nbytes if nbytes is None else nbytes[i], computed=True)
            else:
                self.store.fail(key, err)
        if err is not None and work.error is None:
            work.error = err
        return err

    def _free_inputs(self, comp: Computation) -> None:
        """``comp`` ran without error: delete the inputs it read last (``Computation.frees``)."""
        self._free(comp.freed())

    def _complete(self, work: Work) -> None:
        if work.comp.frees and work.error is None and work.cancelled is None:
            self._free_inputs(work.comp)
        self._cancels.pop(work, None)
        actions = self.core.complete(work)
        if self.core.outstanding == 0:
            self._idle.set()
        self._done(work)  # before its part ends: the executor reports the two together
        self._act(actions)

    async def aclose(self) -> None:
        """Stop what runs (the started computations' tasks), then ``close``."""
        for task in self._starts:
            task.cancel()
        await asyncio.gather(*self._starts, return_exceptions=True)
        self.close()

    def close(self) -> None:
        for task in self._starts:
            task.cancel()
        for pool in self.pools:
            pool.shutdown(wait=False, cancel_futures=True)
        self.streams.close()


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


