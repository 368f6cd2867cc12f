"""Per-device FIFO run queues and the execution of computations.

Each device has one non-preemptive FIFO queue and one worker thread, as a TPU
core has one stream. The executor puts a computation's shards on their devices'
queues in island order (the order ``Enqueue`` messages arrive in). A shard
starts when it reaches its queue's head *and* its inputs have resolved: inputs
are futures in the object store, posted before their producers run. An SPMD
(gang) computation occupies every one of its devices' queues and runs once all
of them have reached it.

Memory back-pressure: a computation's output bytes are known statically. When
it reaches its queue's head, one whose outputs could never fit the executor's
memory limit fails at once (``ResourceExhausted``); once its inputs are there,
one that does not fit *now* waits at the head of its queue, blocking it, until
deletions free enough (see ``store.MemoryBudget``). The bytes are reserved as the
shard starts, and become stored bytes when its outputs land.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import traceback
from collections.abc import Callable
from typing import Any

import jax

from pwmesh.errors import PwmeshError, RemoteError
from pwmesh.executor.functions import CompiledFunction, FunctionCache
from pwmesh.executor.store import ObjectStore
from pwmesh.wire.messages import Computation, ErrorInfo, SendTask, ShardTask

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Work:
    """One computation of one run on this executor, possibly several shards."""

    run_id: str
    proxy: str
    comp: Computation
    remaining: int
    error: PwmeshError | None = None
    cancelled: PwmeshError | None = None  # its run was cancelled: it never waits for memory
    gang_arrived: int = 0
    gang_done: asyncio.Future[None] | None = None


def as_error(exc: BaseException, context: str) -> PwmeshError:
    """The error a failed shard stores: remote errors keep their original traceback."""
    if isinstance(exc, PwmeshError):
        return exc
    return RemoteError(f"{context}: {type(exc).__name__}: {exc}", remote_traceback="".join(traceback.format_exception(exc)))


def error_info(exc: PwmeshError) -> ErrorInfo:
    return ErrorInfo(code=exc.code, message=exc.message, traceback=exc.remote_traceback)


class Runner:
    def __init__(
        self,
        devices: list[jax.Device],
        store: ObjectStore,
        functions: FunctionCache,
        *,
        send: Callable[[SendTask, Any, PwmeshError | None], None],
        done: Callable[[Work], None],
        memory_limit_bytes: int = 0,
        host: str = "",
    ) -> None:
        self.devices = devices
        self.store = store
        self.functions = functions
        self.host = host
        self.memory = store.memory  # stored bytes are counted by the store, reservations here
        self.memory.limit_bytes = memory_limit_bytes
        self._send = send
        self._done = done
        self.queues: list[asyncio.Queue[tuple[Work, ShardTask | None]]] = [asyncio.Queue() for _ in devices]
        self.pools = [
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pwmesh-dev{i}")
            for i in range(len(devices))
        ]
        self.executed = 0
        self._runs: dict[str, list[Work]] = {}  # incomplete work by run, for cancellation
        self._outstanding = 0  # computations enqueued and not yet complete
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def outstanding(self) -> int:
        return self._outstanding

    async def wait_idle(self) -> None:
        """Return once every enqueued computation has completed (used to drain)."""
        await self._idle.wait()

    def enqueue(self, run_id: str, proxy: str, comp: Computation) -> None:
        """Put ``comp``'s shards on their devices' queues (synchronously, in call order)."""
        for shard in comp.shards:
            if not 0 <= shard.device < len(self.devices):
                raise PwmeshError(f"computation {comp.node} names device {shard.device}; this host has {len(self.devices)}")
        self._outstanding += 1
        self._idle.clear()
        if comp.spmd:
            work = Work(run_id, proxy, comp, remaining=1, gang_done=asyncio.get_running_loop().create_future())
            for shard in comp.shards:
                self.queues[shard.device].put_nowait((work, None))
        else:
            work = Work(run_id, proxy, comp, remaining=len(comp.shards))
            for shard in comp.shards:
                self.queues[shard.device].put_nowait((work, shard))
        self._runs.setdefault(run_id, []).append(work)

    def cancel_run(self, run_id: str, error: PwmeshError) -> None:
        """Fail the inputs and the memory ``run_id``'s computations still wait for, so none blocks its queue."""
        for work in self._runs.get(run_id, []):
            work.cancelled = error
            self.memory.cancel(work, error)
            for shard in work.comp.shards:
                for key in shard.inputs:
                    if not self.store.get(key).done():
                        self.store.fail(key, error)

    def queued(self) -> list[int]:
        return [q.qsize() for q in self.queues]

    async def device_loop(self, index: int) -> None:
        queue = self.queues[index]
        while True:
            work, shard = await queue.get()
            if shard is None:
                await self._gang(work)
            else:
                await self._run_shard(work, shard, index)

    async def _inputs(self, keys: list[str]) -> list[Any]:
        return [await self.store.get(k) for k in keys]

    def _check_fits(self, work: Work, fn: CompiledFunction) -> None:
        """Fail at once if the computation's outputs on this host could never fit its memory."""
        needed = fn.shard_output_nbytes * len(work.comp.shards)
        self.memory.check(needed, f"computation {work.comp.node} ({work.comp.fn_id[:12]}) on host {self.host}")

    async def _reserve(self, work: Work, nbytes: int) -> int:
        """Wait until ``nbytes`` fit, then hold them for ``work``'s outputs; returns what it holds."""
        if work.cancelled is not None and not self.memory.fits(nbytes):
            raise work.cancelled
        await self.memory.reserve(nbytes, owner=work)
        return nbytes

    async def _run_shard(self, work: Work, shard: ShardTask, device: int) -> None:
        reserved = 0
        outs: list[Any] | None = None
        err: PwmeshError | None = None
        try:
            fn = await self.functions.get(work.comp.fn_id)
            self._check_fits(work, fn)
            args = await self._inputs(shard.inputs)
            reserved = await self._reserve(work, fn.shard_output_nbytes)
            loop = asyncio.get_running_loop()
            outs = await loop.run_in_executor(self.pools[device], _call_single, fn, self.devices[device], args)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                self.memory.release(reserved)
                raise
            err = as_error(exc, f"computation {work.comp.node} ({work.comp.fn_id[:12]}) shard on device {device}")
        try:
            self._finish_shard(work, shard.outputs, outs, err)
        finally:
            self.memory.release(reserved)  # the outputs are stored bytes now, or failed

    async def _gang(self, work: Work) -> None:
        assert work.gang_done is not None
        work.gang_arrived += 1
        if work.gang_arrived == len(work.comp.shards):
            # The last device to reach the gang computation runs it for all.
            reserved = 0
            outs: list[list[Any]] | None = None
            err: PwmeshError | None = None
            try:
                fn = await self.functions.get(work.comp.fn_id)
                self._check_fits(work, fn)
                per_shard = [await self._inputs(s.inputs) for s in work.comp.shards]
                reserved = await self._reserve(work, fn.shard_output_nbytes * len(work.comp.shards))
                devices = tuple(self.devices[s.device] for s in work.comp.shards)
                loop = asyncio.get_running_loop()
                pool = self.pools[work.comp.shards[-1].device]
                outs = await loop.run_in_executor(pool, _call_spmd, fn, devices, per_shard)
            except BaseException as exc:
                if isinstance(exc, asyncio.CancelledError):
                    self.memory.release(reserved)
                    raise
                err = as_error(exc, f"computation {work.comp.node} ({work.comp.fn_id[:12]})")
            try:
                for i, s in enumerate(work.comp.shards):
                    self._finish_outputs(work, s.outputs, None if outs is None else outs[i], err)
            finally:
                self.memory.release(reserved)  # the outputs are stored bytes now, or failed
            self._complete(work)
            work.gang_done.set_result(None)
        else:
            await asyncio.shield(work.gang_done)

    def _finish_shard(self, work: Work, keys: list[str], outs: list[Any] | None, err: PwmeshError | None) -> None:
        self._finish_outputs(work, keys, outs, err)
        work.remaining -= 1
        if work.remaining == 0:
            self._complete(work)

    def _finish_outputs(self, work: Work, keys: list[str], outs: list[Any] | None, err: PwmeshError | None) -> None:
        if err is None and outs is not None and len(outs) != len(keys):
            err = PwmeshError(f"computation {work.comp.node} produced {len(outs)} outputs, expected {len(keys)}")
        values: dict[str, Any] = {}
        for i, key in enumerate(keys):
            if err is None:
                assert outs is not None
                values[key] = outs[i]
                self.store.put(key, outs[i], outs[i].nbytes)
            else:
                self.store.fail(key, err)
        if err is not None and work.error is None:
            work.error = err
        for task in work.comp.sends:
            if task.key in keys:
                self._send(task, values.get(task.key), err)

    def _complete(self, work: Work) -> None:
        self.executed += 1
        self._outstanding -= 1
        if self._outstanding == 0:
            self._idle.set()
        works = self._runs.get(work.run_id)
        if works is not None:
            works.remove(work)
            if not works:
                del self._runs[work.run_id]
        self._done(work)

    def close(self) -> None:
        for pool in self.pools:
            pool.shutdown(wait=False, cancel_futures=True)


def _call_single(fn: CompiledFunction, device: jax.Device, args: list[Any]) -> list[Any]:
    exe = fn.executable((device,))
    placed = [jax.device_put(a, device) for a in args]
    out = exe(*placed)
    leaves = jax.tree_util.tree_leaves(out)
    jax.block_until_ready(leaves)
    return leaves


def _call_spmd(fn: CompiledFunction, devices: tuple[jax.Device, ...], per_shard: list[list[Any]]) -> list[list[Any]]:
    exe = fn.executable(devices)
    sharding = fn.sharding(devices)
    globals_ = []
    for i, aval in enumerate(fn.exported.in_avals):
        pieces = [jax.device_put(args[i], d) for args, d in zip(per_shard, devices, strict=True)]
        globals_.append(jax.make_array_from_single_device_arrays(aval.shape, sharding, pieces))
    out = exe(*globals_)
    leaves = jax.tree_util.tree_leaves(out)
    jax.block_until_ready(leaves)
    order = {d.id: i for i, d in enumerate(devices)}
    result: list[list[Any]] = [[] for _ in devices]
    for leaf in leaves:
        for s in leaf.addressable_shards:
            result[order[s.device.id]].append(s.data)
    return result
