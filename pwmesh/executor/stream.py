"""Streamed computations: handed to their devices without waiting, seen computed by a thread.

An accelerator's stream runs what it is given in order, with no host work in
between; XLA on CPU does the same for a computation whose inputs are outputs
still being computed. The runner streams slow computations
(``Runner._stream``); here a thread per device waits for them in the order they
were handed over and gives the event loop each batch found computed together.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from pwmesh.executor.functions import CompiledFunction
    from pwmesh.executor.runner import Work


class Streamed(NamedTuple):
    """A computation handed to its devices and not yet seen computed (see ``Runner._stream``)."""

    work: Work
    fn: CompiledFunction
    per_shard: list[list[Any]]
    outs: list[list[Any]]
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
            waits = not all(_ready(leaf) for leaf in last_outputs(streamed.outs))
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


def last_outputs(outs: list[list[Any]]) -> list[Any]:
    """One output per device (``outs``: per shard, the arrays one execution made there) that a later
    computation has not consumed (donated). An execution's outputs on a device are computed (or fail)
    together, so one stands for all: a step with 54 outputs on 4 devices waits on 4 arrays, not 216.
    A device whose outputs were all consumed already has none: what consumed them follows it."""
    found = []
    for leaves in outs:
        live = next((leaf for leaf in reversed(leaves) if not leaf.is_deleted()), None)
        if live is not None:
            found.append(live)
    return found


def _ready(leaf: Any) -> bool:
    try:
        return bool(leaf.is_ready())
    except RuntimeError:
        if leaf.is_deleted():  # consumed since it was looked at: what consumed it waits for it
            return True
        raise


def computed(outs: list[list[Any]]) -> float:
    """Wait until every output (per shard, a list of arrays) is computed; when that was (wall clock).
    Each is waited for directly: jax.block_until_ready's pytree walk costs more than the wait. An output
    consumed meanwhile by a computation it was donated to is not waited for (it cannot be); that one
    runs after this, on the same devices, and lands after it."""
    for leaf in last_outputs(outs):
        try:
            leaf.block_until_ready()
        except RuntimeError:
            if not leaf.is_deleted():
                raise
    return time.time()
