"""The host's object store: one future per shard key.

``get`` on a key that has not arrived yet posts a receive: it returns the future
that a later ``put`` (a local computation, or the data plane) resolves. Keys are
never reused, so every deleted buffer is remembered (``_deleted``, ``Tombstones``, in
memory that does not grow with the session; dropped per owner when its session ends):
a late arrival for it is dropped instead of leaking, and a late ``get`` fails at once
instead of waiting for a value that never comes.

The store also keeps the host's memory account (``MemoryBudget``): what it holds,
what running computations have reserved for their outputs, and who waits for room.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from pwmesh.errors import NotFound, PwmeshError, ResourceExhausted
from pwmesh.executor.tombstones import Tombstones


def format_bytes(nbytes: int) -> str:
    """``512 B``, ``12.0 MiB``: binary units, one decimal."""
    if nbytes < 1024:
        return f"{nbytes} B"
    size = nbytes / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


@dataclasses.dataclass(eq=False)
class _Waiter:
    nbytes: int
    owner: object
    granted: asyncio.Future[None]


log = logging.getLogger(__name__)


class MemoryBudget:
    """The bytes held on one executor's devices (all of them together) against its limit.

    In use = stored objects (client puts, data-plane arrivals, computed outputs)
    plus the reservations of computations running now. A computation reserves its
    outputs' bytes (known statically) when it starts; if they do not fit, it waits,
    and its device queue with it (non-preemptive FIFO: head of line), until a
    deletion or the end of a reservation frees enough: those wake waiters directly,
    nothing polls. A client's put that does not fit now is refused (``Executor._put``);
    data arriving from other executors waits for room as outputs do (its sender's run
    needs it, and a free may be on its way), up to ``--memory-wait-seconds``.

    Waiters (at most one per device queue) are granted in arrival order, first
    fit: a big request that does not fit yet does not hold back a smaller one on
    another device. Strict FIFO across devices would deadlock a client that needs
    the small result before it frees anything.
    """

    def __init__(self, limit_bytes: int = 0) -> None:
        self.limit_bytes = limit_bytes  # 0: no limit
        self.stored = 0
        self.reserved = 0
        self._waiters: list[_Waiter] = []  # in arrival order

    @property
    def in_use(self) -> int:
        return self.stored + self.reserved

    @property
    def waiting(self) -> int:
        """How many owners (computations) wait for room."""
        return len({id(w.owner) for w in self._waiters})

    def fits(self, nbytes: int) -> bool:
        return not self.limit_bytes or self.in_use + nbytes <= self.limit_bytes

    def check(self, nbytes: int, what: str) -> None:
        """``ResourceExhausted`` if ``nbytes`` could never fit, even with everything else freed."""
        if self.limit_bytes and nbytes > self.limit_bytes:
            raise ResourceExhausted(f"{what} needs {format_bytes(nbytes)} for its outputs, more than the "
                                    f"executor's memory limit of {format_bytes(self.limit_bytes)} "
                                    f"({nbytes} > {self.limit_bytes} bytes)")

    def allocated(self, nbytes: int) -> None:
        self.stored += nbytes

    def freed(self, nbytes: int) -> None:
        self.stored -= nbytes
        self._grant()

    def request(self, nbytes: int, owner: object) -> asyncio.Future[None]:
        """Ask to hold ``nbytes`` for ``owner``: the future is done once they are held,
        at once if they fit now. ``ResourceExhausted`` if they never could."""
        self.check(nbytes, "a computation")
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.fits(nbytes):
            self.reserved += nbytes
            granted.set_result(None)
        else:
            self._waiters.append(_Waiter(nbytes, owner, granted))
        return granted

    def try_reserve(self, nbytes: int) -> bool:
        """Hold ``nbytes`` now if they fit and nobody waits ahead; ``release`` them afterwards."""
        if self._waiters or not self.fits(nbytes):
            return False
        self.reserved += nbytes
        return True

    async def reserve(self, nbytes: int, owner: object) -> None:
        """Wait until ``nbytes`` are held for ``owner``; ``release`` them afterwards.
        Raises what ``cancel(owner, ...)`` passes."""
        granted = self.request(nbytes, owner)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled() and granted.exception() is None:
                self.release(nbytes)  # granted just as our task was cancelled: give it back
            else:
                granted.cancel()
                self._waiters = [w for w in self._waiters if w.granted is not granted]
            raise

    def release(self, nbytes: int) -> None:
        """End a reservation (its outputs are stored now, counted as stored, or failed)."""
        self.reserved -= nbytes
        self._grant()

    def cancel(self, owner: object, exc: PwmeshError) -> None:
        """Fail ``owner``'s waits with ``exc``, so no queue stays blocked for it."""
        for waiter in [w for w in self._waiters if w.owner is owner]:
            self._waiters.remove(waiter)
            if not waiter.granted.done():
                waiter.granted.set_exception(exc)

    def _grant(self) -> None:
        for waiter in list(self._waiters):
            if waiter.granted.done():  # cancelled by its task; ``reserve`` removes it
                continue
            if self.fits(waiter.nbytes):
                self._waiters.remove(waiter)
                self.reserved += waiter.nbytes
                waiter.granted.set_result(None)


@dataclasses.dataclass(eq=False, slots=True)
class _Whole:
    """An SPMD output as its computation made it: one global array over its devices (``put_whole``).

    Kept whole, its shards' keys have no value of their own and the whole holds their bytes; once a
    piece is asked for (a fetch, a transfer, a per-device computation), every piece is made and stored
    under its key (``split``), holding the bytes, and the whole stays beside them for SPMD readers."""

    array: Any
    sharding: Any  # the very object its readers' input sharding must be (they are interned)
    shards: tuple[int, ...]  # its shards here, in ``local``'s order
    local: tuple[Any, ...]  # this executor's devices it spans
    shard_nbytes: int
    split: bool

    @property
    def nbytes(self) -> int:
        """The bytes it holds itself: all its shards' while whole, none once split."""
        return 0 if self.split else self.shard_nbytes * len(self.shards)


# How a global array is cut into its pieces on ``local`` devices, in their order (``calls.pieces``):
# given by the executor, so the store needs no JAX.
Pieces = Callable[[Any, tuple[Any, ...]], list[Any]]


def _retrieve(fut: asyncio.Future[Any]) -> None:
    # Failed entries nobody awaited are normal (a failed input nobody reads);
    # retrieving the exception keeps asyncio from logging it at collection.
    if not fut.cancelled():
        fut.exception()


def renamed(name: str, marker: str) -> bool:
    """Whether ``name`` was given by the proxy whose names begin with ``marker`` ("": no proxy's)."""
    return bool(marker) and name.startswith(marker)


def buffer_of(key: str) -> str:
    """``"<owner>/<buffer>"`` of a shard key ``"<owner>/<buffer>/<shard>"``."""
    return key.rpartition("/")[0]


class ObjectStore:
    """Shard keys ``"<owner>/<buffer>/<shard>"``; deletes and tombstones are per buffer.

    A value that arrived is kept as it is (``_values``); a future exists only for a key
    somebody waits for before it arrives (a posted receive) or that failed: most values
    are produced and consumed on the fast path without one."""

    def __init__(self, pieces: Pieces | None = None) -> None:
        self.pieces = pieces  # set by whoever puts wholes (the runner)
        self._values: dict[str, Any] = {}
        self._futures: dict[str, asyncio.Future[Any]] = {}  # waited for and not there yet, or failed
        self._nbytes: dict[str, int] = {}
        self._by_buffer: dict[str, list[str]] = {}
        self._deleted = Tombstones()  # buffers
        # Buffers whose every shard here came from one computation here (whole from an SPMD one, or a piece a
        # device from another): once deleted, nothing of them can arrive any more, so their tombstones need
        # not outlive the recent ones (``Tombstones``): a training step's ~100 deletes parse no name.
        self._complete: set[str] = set()
        # Owners a restarted proxy took back (``fence``): owner -> (the marker of the names it gives, the buffers
        # held when it did). Any other buffer of theirs is dead: it belongs to a run of the proxy before.
        self._fences: dict[str, tuple[str, frozenset[str]]] = {}
        self._whole: dict[str, _Whole] = {}  # buffers an SPMD computation here produced, whole (``put_whole``)
        self._arrivals: dict[str, asyncio.Future[None]] = {}  # buffers an SPMD reader waits for (``arrival``)
        self.memory = MemoryBudget()  # its limit is the executor's to set

    def _future(self, key: str) -> asyncio.Future[Any]:
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_retrieve)
        self._futures[key] = fut
        self._by_buffer.setdefault(buffer_of(key), []).append(key)
        return fut

    def deleted(self, key: str) -> bool:
        return self._dead(buffer_of(key))

    def _dead(self, buffer: str, recently: bool = False) -> bool:
        """Whether ``buffer`` was deleted (or fenced off). ``recently``: among the newest deletes only, which is
        a dictionary lookup (an older one may cost parsing its name): enough for a computation's outputs here,
        which are deleted before they land only by a cancelled run's delete, sent as the run was cancelled."""
        if self._deleted.recently(buffer) if recently else buffer in self._deleted:
            return True
        if not self._fences:
            return False
        owner, _, name = buffer.partition("/")
        fence = self._fences.get(owner)
        return fence is not None and not renamed(name, fence[0]) and buffer not in fence[1]

    def fence(self, owner: str, marker: str) -> list[str]:
        """A restarted proxy takes ``owner``'s objects back: from now on only the buffers held now and those
        whose names begin with ``marker`` (the new proxy's; "": none) are kept; returns the keys held now.
        Pending receives of other buffers of the owner fail."""
        prefix = f"{owner}/"
        self._split_all(prefix)
        held = [k for k in self._values if k.startswith(prefix)]
        self._fences[owner] = (marker, frozenset(buffer_of(k) for k in held))
        for key, fut in list(self._futures.items()):
            if key.startswith(prefix) and not fut.done() and self._dead(buffer_of(key)):
                fut.set_exception(NotFound(f"object {key} belonged to a run of a proxy that restarted"))
        return held

    def get(self, key: str) -> asyncio.Future[Any]:
        """The value's future, created (a posted receive) if the key has not arrived yet."""
        fut = self._futures.get(key)
        if fut is not None:
            return fut
        if key not in self._values:
            self._split_for(key)
        if key in self._values:
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(self._values[key])
            return fut
        if self.deleted(key):
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(NotFound(f"object {key} was deleted"))
            fut.add_done_callback(_retrieve)
            return fut
        return self._future(key)

    def values(self, keys: list[str]) -> list[Any] | None:
        """The values of ``keys`` if every one is here (not failed, not pending), else None."""
        values = self._values
        try:
            return [values[k] for k in keys]
        except KeyError:
            if not any([self._split_for(k) for k in keys if k not in values]):
                return None
        try:
            return [values[k] for k in keys]
        except KeyError:
            return None

    def put(self, key: str, value: Any, nbytes: int, computed: bool = False) -> None:
        """Store ``key``'s value (``nbytes`` of device memory). ``computed``: a computation here made it, and
        made every shard of its buffer this executor holds (see ``_complete``)."""
        if key in self._values:  # a confused or hostile peer; the first value stands
            log.warning("object %s was produced twice; keeping the first", key)
            return
        fut = self._futures.pop(key, None)
        if fut is None:
            buffer = buffer_of(key)  # once: checked against the tombstones, then indexed
            keys = self._by_buffer.get(buffer)
            # A later piece of a buffer is checked only against fences: deleting a buffer drops its pieces. A
            # computed one against the newest deletes only (``_dead``): a new name parsed a put was ~2 %.
            if (keys is None or self._fences) and self._dead(buffer, recently=computed):
                return
            if keys is None:
                keys = self._by_buffer[buffer] = []
                if computed:
                    self._complete.add(buffer)
            keys.append(key)
        elif fut.done():  # it failed (or a receive of a deleted key); the failure stands
            self._futures[key] = fut
            log.warning("object %s arrived after it failed; keeping the failure", key)
            return
        else:
            fut.set_result(value)  # a reader here waited for it (a computation streamed behind its maker)
            if computed:
                self._complete.add(buffer_of(key))
        self._values[key] = value
        self._nbytes[key] = nbytes
        self.memory.allocated(nbytes)
        if self._arrivals:
            self._arrived(buffer_of(key))

    def made_here(self, key: str) -> None:
        """``key``'s buffer was made by a computation here (which made every shard of it here), though none of it
        is stored (consumed as it landed): once deleted, nothing of it can arrive (``_complete``)."""
        buffer = buffer_of(key)
        if buffer not in self._whole:
            self._complete.add(buffer)

    def arrival(self, buffer: str) -> asyncio.Future[None]:
        """Done once anything of ``buffer`` is here (an SPMD output whole, a piece, a failure) or it is deleted.
        An SPMD computation waits so for an input it may take whole: a receive posted for a piece would have
        the whole cut into pieces as it lands, and the pieces assembled again to go in."""
        found = self._arrivals.get(buffer)
        if found is not None:
            return found
        fut = asyncio.get_running_loop().create_future()
        if buffer in self._whole or buffer in self._by_buffer or self._dead(buffer):
            fut.set_result(None)
        else:
            self._arrivals[buffer] = fut
        return fut

    def _arrived(self, buffer: str) -> None:
        fut = self._arrivals.pop(buffer, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def put_whole(self, buffer: str, array: Any, sharding: Any, shards: tuple[int, ...], local: tuple[Any, ...],
                  shard_nbytes: int) -> None:
        """Store an SPMD output as its computation made it: one global array over ``sharding``'s devices,
        whose pieces here are ``buffer``'s ``shards`` on ``local`` devices (in that order), ``shard_nbytes``
        each. No piece is made until one is asked for (``get``, ``values``, ``held``): an SPMD reader
        takes it whole (``whole``), and cutting a step's outputs into pieces it never needs was the
        executor's largest per-step cost (~2.5 us a piece). A receive already posted for a piece gets it now."""
        if self._dead(buffer, recently=True):
            return
        if buffer in self._whole:  # a confused or hostile peer; the first value stands
            log.warning("object %s was produced twice; keeping the first", buffer)
            return
        waited = buffer in self._by_buffer  # a piece was asked for (or failed) before it came
        self._by_buffer.setdefault(buffer, [])
        self._whole[buffer] = _Whole(array, sharding, shards, local, shard_nbytes, split=False)
        if not waited:
            self._complete.add(buffer)
        self.memory.allocated(shard_nbytes * len(shards))
        self._arrived(buffer)
        if waited:
            self._split(buffer)

    def keep_whole(self, buffer: str, array: Any, sharding: Any, shards: tuple[int, ...],
                   local: tuple[Any, ...]) -> None:
        """Keep an SPMD output whole beside its pieces, stored already under their keys, for SPMD readers,
        until the buffer is deleted or a piece consumed. It holds no memory of its own: it is the pieces'."""
        if not self._dead(buffer, recently=True) and buffer not in self._whole:
            self._whole[buffer] = _Whole(array, sharding, shards, local, 0, split=True)

    def whole(self, buffer: str, sharding: Any, shards: tuple[int, ...]) -> Any | None:
        """``buffer`` as one global array, if it is kept whole over exactly ``sharding`` (the same object)
        with exactly ``shards`` here, in that order; else None."""
        whole = self._whole.get(buffer)
        if whole is None or whole.sharding is not sharding or whole.shards != shards:
            return None
        return whole.array

    def _split(self, buffer: str) -> None:
        """Make a whole's pieces and store each under its key, holding the bytes the whole held."""
        whole = self._whole[buffer]
        if whole.split:
            return
        assert self.pieces is not None, "a store given wholes is given how to cut them"
        pieces = self.pieces(whole.array, whole.local)
        whole.split = True
        keys = self._by_buffer.setdefault(buffer, [])
        for shard, piece in zip(whole.shards, pieces, strict=True):
            key = f"{buffer}/{shard}"
            fut = self._futures.pop(key, None)
            if fut is not None:
                if fut.done():  # it failed before it came: the failure stands
                    self._futures[key] = fut
                    self.memory.freed(whole.shard_nbytes)
                    continue
                fut.set_result(piece)
            else:
                keys.append(key)
            self._values[key] = piece
            self._nbytes[key] = whole.shard_nbytes

    def _split_for(self, key: str) -> bool:
        """Make the pieces of ``key``'s buffer if it is kept whole only; whether that made ``key``'s."""
        buffer = buffer_of(key)
        whole = self._whole.get(buffer)
        if whole is None or whole.split:
            return False
        self._split(buffer)
        return key in self._values

    def _split_all(self, prefix: str = "") -> None:
        for buffer in [b for b, w in self._whole.items() if not w.split and b.startswith(prefix)]:
            self._split(buffer)

    def consume(self, key: str, buffer: str = "") -> None:
        """A computation took this value over (donated: its memory reused or freed): it is gone from here,
        and its bytes with it. The key stays known until the proxy deletes the buffer. ``buffer``: the key's,
        if the caller knows it."""
        whole = self._whole.pop(buffer or buffer_of(key), None) if self._whole else None
        if whole is not None and not whole.split:  # one global array: all its pieces went together
            self.memory.freed(whole.nbytes)
            return
        value = self._values.pop(key, None)
        if value is None:
            return
        self.memory.freed(self._nbytes.pop(key, 0))

    def to_host(self, buffers: list[str], copy: Callable[[Any], Any]) -> int:
        """Hold every shard here of ``buffers`` as ``copy`` makes it (in host memory) instead of on its device:
        their bytes leave the device memory account (the device buffers go as nothing else holds them: a
        computation running now keeps its inputs). Returns the bytes moved."""
        moved = 0
        for buffer in buffers:
            whole = self._whole.get(buffer)
            if whole is not None:
                if not whole.split:
                    self._split(buffer)
                del self._whole[buffer]  # it is device buffers: its readers take the host pieces now
            for key in self._by_buffer.get(buffer, ()):
                value = self._values.get(key)
                nbytes = self._nbytes.get(key, 0)
                if value is None or not nbytes:  # not here, or in host memory already
                    continue
                self._values[key] = copy(value)
                self._nbytes[key] = 0  # out of the device memory account
                moved += nbytes
        self.memory.freed(moved)
        return moved

    def consume_whole(self, buffer: str, shards: list[int]) -> None:
        """An SPMD computation took over a buffer it read whole (donated): every piece here is gone."""
        whole = self._whole.pop(buffer, None)
        if whole is not None and not whole.split:
            self.memory.freed(whole.nbytes)
            return
        if not self._by_buffer.get(buffer):  # nothing of it here yet (its computation is still streamed)
            return
        for shard in shards:
            self.consume(f"{buffer}/{shard}")

    def refuse_put(self, keys: list[str], nbytes: int, executor: str) -> None:
        """A put of ``nbytes`` under ``keys`` into this store, if it fits; else ``ResourceExhausted``. A put
        does not wait: refused whole, each key failed with why (so nothing waits for it), and what it would
        have crowded out (another tenant's next computation) runs."""
        memory = self.memory
        if memory.fits(nbytes):
            return
        exc = ResourceExhausted(
            f"a put of {format_bytes(nbytes)} does not fit on executor {executor}: it holds "
            f"{format_bytes(memory.in_use)} of its {format_bytes(memory.limit_bytes)} memory limit; free "
            "buffers (del, .delete()) or use more devices")
        for key in keys:
            self.fail(key, exc)
        raise exc

    def fail(self, key: str, exc: PwmeshError) -> None:
        if self.deleted(key) or key in self._values or buffer_of(key) in self._whole:
            return
        fut = self._futures.get(key) or self._future(key)
        if not fut.done():
            fut.set_exception(exc)
        if self._arrivals:
            self._arrived(buffer_of(key))

    def delete(self, buffers: list[str]) -> int:
        """Delete every shard of ``buffers`` held here; returns how many shards went."""
        removed = 0
        freed = 0
        complete = self._complete
        for buffer in buffers:
            if buffer in complete:
                complete.discard(buffer)
                self._deleted.add(buffer, True)
            else:
                self._deleted.add(buffer)
            self._arrived(buffer)
            whole = self._whole.pop(buffer, None)
            if whole is not None and not whole.split:
                removed += len(whole.shards)
                freed += whole.nbytes
            for key in self._by_buffer.pop(buffer, ()):
                removed += 1
                if self._values.pop(key, None) is not None:
                    freed += self._nbytes.pop(key, 0)
                fut = self._futures.pop(key, None)
                if fut is not None and not fut.done():
                    fut.set_exception(NotFound(f"object {key} was deleted before it arrived"))
        if freed:
            self.memory.freed(freed)  # wakes computations waiting for room
        return removed

    def drop_pending(self) -> int:
        """Delete the buffers some shard of which was still awaited (their runs were cancelled): what arrives
        for them later is dropped. What is complete stays. Returns how many buffers went."""
        waiting = sorted({buffer_of(k) for k, fut in self._futures.items() if not fut.done()} | set(self._arrivals))
        self.delete(waiting)
        return len(waiting)

    def write_off(self) -> int:
        """Delete everything here (everyone wrote it off: this executor was declared lost); returns how many
        shards went. Their tombstones stay: tuples for them still on their way are dropped."""
        return self.delete(list(self._by_buffer))

    def forget_owner(self, prefix: str) -> None:
        """Drop the tombstones of an owner (a closed session): its buffers never come again."""
        self._deleted.forget(prefix)
        self._complete = {k for k in self._complete if not k.startswith(prefix)}
        self._fences.pop(prefix.rstrip("/"), None)

    def held(self) -> list[tuple[str, Any, int]]:
        """(key, value, bytes) of every value here (wholes are split: each piece is one)."""
        self._split_all()
        return [(k, v, self._nbytes.get(k, 0)) for k, v in self._values.items()]

    def failures(self) -> dict[str, PwmeshError]:
        """The keys that failed, with their failures."""
        out: dict[str, PwmeshError] = {}
        for key, fut in self._futures.items():
            if fut.done() and not fut.cancelled():
                exc = fut.exception()
                if isinstance(exc, PwmeshError):
                    out[key] = exc
        return out

    def tombstones(self) -> list[Any]:
        """The tombstones, to keep across a restart of this executor (``bury`` takes them)."""
        return self._deleted.export()

    def bury(self, tombstones: list[Any]) -> None:
        """Mark deleted what ``tombstones`` names (a list of buffers, or what ``tombstones`` gave)."""
        self._deleted.restore(tombstones)

    def tombstone_count(self) -> int:
        """Entries the tombstones hold (names and ranges): what their memory grows with."""
        return len(self._deleted)

    def __len__(self) -> int:
        # A key is in one of them at most, or the piece of a whole not split yet.
        return len(self._values) + len(self._futures) + sum(len(w.shards) for w in self._whole.values() if not w.split)

    @property
    def nbytes(self) -> int:
        return self.memory.stored
