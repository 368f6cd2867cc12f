"""Streamed computations: handed to their devices without waiting, seen computed by a thread.

An accelerator's stream runs what it is given in order, with no host work in
between; XLA on CPU does the same for a computation whose inputs are outputs
still being computed. The runner streams slow computations
(``Runner._stream``); here a thread per device waits for them in the order they
were handed over and gives the event loop each batch found computed together.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from pwmesh.executor.calls import Whole, computed, is_computed, last_outputs, pieces
from pwmesh.executor.store import buffer_of

if TYPE_CHECKING:
    from pwmesh.executor.functions import CompiledFunction
    from pwmesh.executor.work import Work


class Streamed(NamedTuple):
    """A computation handed to its devices and not yet seen computed (see ``Runner._stream``)."""

    work: Work
    fn: CompiledFunction
    per_shard: list[list[Any]]
    outs: list[list[Any]] | Whole  # per shard, or kept whole (an SPMD computation's)
    times: tuple[float, float]  # arrived, start
    reserved: int


class Landed(NamedTuple):
    """A streamed computation seen computed (or failed) by its landing thread."""

    streamed: Streamed
    end: float  # when it was seen computed (wall clock)
    error: BaseException | None
    timed: bool  # ``end`` is about when it was computed (once the thread had the interpreter back)


class Landings:
    """One thread per device that waits for its streamed computations in the order they were
    handed over, and gives the loop each batch it found computed together (one wake-up)."""

    def __init__(self, device: int, landed: Callable[[list[Landed]], None]) -> None:
        self._queue: queue.SimpleQueue[Streamed | None] = queue.SimpleQueue()
        self._loop = asyncio.get_running_loop()
        self._landed = landed
        self._thread = threading.Thread(target=self._wait, name=f"pwmesh-landings{device}", daemon=True)
        self._thread.start()

    def put(self, streamed: Streamed) -> None:
        self._queue.put(streamed)

    def close(self) -> None:
        self._queue.put(None)

    def _wait(self) -> None:
        batch: list[Landed] = []
        while True:
            try:
                streamed = self._queue.get(block=not batch)
            except queue.Empty:  # nothing more is computed yet: hand over what is
                self._hand_over(batch)
                batch = []
                continue
            if streamed is None:
                self._hand_over(batch)
                return
            waits = not all(is_computed(leaf) for leaf in last_outputs(streamed.outs))
            if batch and waits:
                self._hand_over(batch)  # do not hold those back while this one computes
                batch = []
            try:
                # Timed if this thread waited for it, or found it computed as it took it: not if
                # it was computed while this thread waited for the ones ahead (it ended then, unseen).
                batch.append(Landed(streamed, computed(streamed.outs), None, waits or not batch))
            except Exception as exc:  # it fails its computation, not this thread
                batch.append(Landed(streamed, time.time(), exc, False))

    def _hand_over(self, batch: list[Landed]) -> None:
        if batch:
            try:
                self._loop.call_soon_threadsafe(self._landed, batch)
            except RuntimeError:  # the loop is closed: the executor is leaving
                pass




class PendingWhole(NamedTuple):
    """A streamed SPMD computation's output, handed out whole before it is computed."""

    array: Any
    sharding: Any
    shards: tuple[int, ...]
    local: tuple[Any, ...]


class Streams:
    """What is handed to each device and has not landed yet (``Runner._stream``): per device, the
    computations in the order they were handed over and when the last one that landed ended; their
    outputs, handed out to the computations here that follow them (pieces by key, an SPMD
    computation's whole by buffer); and the thread per device that sees them computed (``Landings``)."""

    def __init__(self, devices: int, landed: Callable[[list[Landed]], None]) -> None:
        self._landed = landed
        self._pieces: dict[str, Any] = {}  # key -> output not yet computed
        self._wholes: dict[str, PendingWhole] = {}  # buffer -> an SPMD output (whole) not yet computed
        self._streaming: list[collections.deque[Work]] = [collections.deque() for _ in range(devices)]
        self._device_free: list[float] = [0.0] * devices  # when its last streamed computation ended
        self._landings: list[Landings | None] = [None] * devices  # started with a device's first stream
        self._landing: dict[Work, asyncio.Future[None]] = {}

    def hand_over(self, streamed: Streamed) -> None:
        """``streamed`` was handed to its devices: its outputs are handed out; its devices' thread waits for it."""
        work, outs = streamed.work, streamed.outs
        comp = work.comp
        if isinstance(outs, Whole):
            shards = tuple(work.shards)
            for prefix, leaf, sharding in zip(comp.outputs, outs.leaves, outs.shardings, strict=False):
                self._wholes[prefix] = PendingWhole(leaf, sharding, shards, outs.local)
        else:
            for shard, out in zip(work.shards, outs, strict=True):
                for prefix, value in zip(comp.outputs, out, strict=False):  # a count mismatch fails as it lands
                    self._pieces[f"{prefix}/{shard}"] = value
        self._landing[work] = asyncio.get_running_loop().create_future()
        for device in work.devices:
            self._streaming[device].append(work)
        device = work.devices[-1]
        landings = self._landings[device]
        if landings is None:
            landings = self._landings[device] = Landings(device, self._landed)
        landings.put(streamed)

    def land(self, streamed: Streamed, end: float) -> tuple[float, float]:
        """``streamed`` was seen computed at ``end``: nothing of it is handed out any more. When it arrived and
        began: handed over while its devices were busy with the computations ahead of it, they began it (and
        waited for anything, as its trace shows) only once those ended."""
        work, comp = streamed.work, streamed.work.comp
        for device in work.devices:
            self._streaming[device].remove(work)
        if isinstance(streamed.outs, Whole):
            for prefix in comp.outputs:
                self._wholes.pop(prefix, None)
        if self._pieces:  # pieces handed out (an SPMD output's only if one was asked for)
            for shard in work.shards:
                for prefix in comp.outputs:
                    self._pieces.pop(f"{prefix}/{shard}", None)
        self._landing.pop(work).set_result(None)
        free = self.free_since(work)
        for device in work.devices:
            self._device_free[device] = end
        arrived, start = streamed.times
        return max(arrived, free), max(start, free)

    def piece(self, key: str) -> Any | None:
        """An output not yet computed, if one is handed out under ``key`` (an SPMD output's pieces are made)."""
        value = self._pieces.get(key)
        if value is None and self._wholes:
            buffer = buffer_of(key)
            pending = self._wholes.get(buffer)
            if pending is not None:
                for shard, piece in zip(pending.shards, pieces(pending.array, pending.local), strict=True):
                    self._pieces[f"{buffer}/{shard}"] = piece
                value = self._pieces.get(key)
        return value

    def whole(self, buffer: str, sharding: Any, shards: tuple[int, ...]) -> Any | None:
        """An SPMD output not yet computed, whole, if it is ``buffer`` over exactly ``sharding`` and ``shards``."""
        pending = self._wholes.get(buffer)
        if pending is None or pending.sharding is not sharding or pending.shards != shards:
            return None
        return pending.array

    def streaming(self, device: int) -> int:
        """How many computations are handed to ``device`` and have not landed."""
        return len(self._streaming[device])

    def busy(self, devices: list[int]) -> bool:
        """Whether any of ``devices`` has a computation handed to it that has not landed."""
        streaming = self._streaming
        for device in devices:
            if streaming[device]:
                return True
        return False

    @property
    def idle(self) -> bool:
        """Nothing is handed out or streamed (every computation handed over has landed)."""
        return not self._pieces and not self._wholes and not any(self._streaming)

    def mixed(self, work: Work) -> bool:
        """Whether computations on other device sets are streamed to any of its devices."""
        for device in work.devices:
            streaming = self._streaming[device]
            if streaming and streaming[-1].devices != work.devices:
                return True
        return False

    async def room(self, work: Work, limit: int) -> None:
        """Wait until each of its devices has fewer than ``limit`` streamed computations unfinished."""
        for device in work.devices:
            streaming = self._streaming[device]
            while len(streaming) >= limit:
                await asyncio.shield(self._landing[streaming[0]])

    def free_since(self, work: Work) -> float:
        """When the last computation streamed to its devices ended (0.0: none has)."""
        return max(self._device_free[d] for d in work.devices)

    def close(self) -> None:
        for landings in self._landings:
            if landings is not None:
                landings.close()
