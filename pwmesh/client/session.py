"""A client's session on the proxy: the bottom of the client library.

Everything the upper layers ask of the cluster goes through here, as wire messages
over the one ``ClientConnection``: buffer ids, registering functions and programs,
running programs, putting, fetching, awaiting and releasing buffers, slices and
status. Nothing here knows about arrays, tracing or meshes beyond what travels.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from pwmesh.client import prng
from pwmesh.client.connection import ClientConnection, Declared
from pwmesh.client.direct import DirectData, direct_min_bytes
from pwmesh.dataflow.layout import Layout
from pwmesh.wire.codec import dtype_name
from pwmesh.wire.messages import (
    AwaitBuffers,
    BuffersState,
    BufferValue,
    BufferValues,
    CreateSlice,
    Fetch,
    FetchBuffers,
    GetStatus,
    Message,
    ProgramSpec,
    PutBuffer,
    PutDirect,
    QueryBuffers,
    RegisterProgram,
    RegisterProgramFunction,
    ReleaseBuffers,
    ResumedBuffer,
    ResumeSlices,
    SessionResumed,
    Sharding,
    ShardPlaces,
    SliceCreated,
    SliceInfo,
    SlicesChanged,
    StatusReply,
    SuspendSlices,
    TakeBack,
    ValueSpec,
)

# Values and nodes a program's registration carries per message (``register_program``): ~0.8 MB, decoded
# by the proxy in ~40 ms between other clients' messages (10,000 a part let their round trips reach 0.67 s).
PROGRAM_PART_ITEMS = 4_000
# Small values fetched together (``FetchBuffers``): at most this many a request, blocks in all, and bytes.
FETCH_TOGETHER_BUFFERS = 256
FETCH_TOGETHER_BLOCKS = 2_048  # (a message carries at most 4,096 arrays)
FETCH_TOGETHER_BYTES = 16 << 20
MAX_GONE = 4_096  # arrays dropped lately, declared to a restarted proxy (``Session.gone``)
# Donated arrays dropped, released together (``Session.drop_donated``): a run aborted before it consumed one
# leaves it to its client, whose dropping it frees it; most were consumed, so one message per this many.
DONATED_RELEASE_BATCH = 256


def wire_spec(shape: tuple[int, ...], dtype: Any, sharding: Any) -> ValueSpec:
    """A ``pw.Array``'s value as the wire has it, from its shape, dtype and ``SliceSharding`` (a typed key
    array's is its data: ``client/prng.py``)."""
    shape, dtype = prng.physical(shape, dtype)
    return ValueSpec(shape=list(shape), dtype=dtype_name(dtype), shards=len(sharding.slice.devices), sharding=sharding.wire)


class Session:
    """One session: ids, registrations (each once) and the requests behind ``pw.Array``."""

    def __init__(self, address: str, *, name: str = "", weight: float = 1.0, priority: int = 0,
                 connect_timeout_seconds: float = 10.0, keys: str | None = None) -> None:
        self.address = address
        self.conn = ClientConnection(address, name=name or f"pid{os.getpid()}", weight=weight, priority=priority,
                                     connect_timeout_seconds=connect_timeout_seconds, keys=keys)
        self._ids = itertools.count(1)
        # Re-entrant: ``gone`` runs from ``pw.Array.__del__``, which the collector may call inside ``_declare``.
        self._lock = threading.RLock()
        self._functions: set[str] = set()
        self._programs: set[str] = set()
        # The registrations sent, as sent (references: their bytes are the caches' own), for a resume.
        self._registrations: dict[str, list[Message]] = {}
        # What a restarted proxy is told this session still holds (``ClientConnection.declare``): the arrays
        # alive here (``pw.Array`` registers itself) and the slices made.
        self._arrays: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._slices: list[int] = []
        # Arrays dropped or donated lately (the last ``MAX_GONE``): what was sent before a resume may name them.
        # (id, the array's ``spec``): appended without a lock (a deque is safe for that; ``_declare`` copies it).
        self._gone: collections.deque[tuple[int, Any, Any, Any]] = collections.deque(maxlen=MAX_GONE)
        self._dropped_donated: list[int] = []
        self._direct: DirectData | None = None  # made on the first direct transfer
        self.direct_min_bytes = direct_min_bytes()
        self.conn.declare = self._declare
        self.conn.on_resumed = self._resumed

    @property
    def session_id(self) -> str:
        return self.conn.session_id

    @property
    def closed(self) -> bool:
        return self.conn.closed

    def new_buffer_id(self) -> int:
        return next(self._ids)

    def track(self, array: Any) -> None:
        """``array`` (a ``pw.Array`` of this session) is alive: declared if the session is resumed."""
        with self._lock:  # not while ``_declare`` (the I/O thread) walks them
            self._arrays[array.buffer_id] = array

    def arrays(self, *, donated: bool = False) -> list[Any]:
        """The ``pw.Array``s of this session alive now (``donated``: and those donated to a call, which the
        cluster gives back if that call's run is aborted before it consumes them)."""
        with self._lock:
            return [a for a in list(self._arrays.values()) if not a.is_deleted() or (donated and a.donated)]

    def gone(self, array: Any) -> None:
        """``array`` was dropped or donated: declared as such (``ResumeSession.released``) for a while.

        It runs for every array dropped or donated (a training step's every state leaf): an append, no lock.
        What is kept is what its spec is made of, never the array: a bound method kept the last 4,096 dropped
        arrays alive, with any value they had fetched."""
        self._gone.append((array.buffer_id, array.shape, array.dtype, array.sharding))

    def _declare(self) -> Declared:
        with self._lock:
            arrays = [a for a in list(self._arrays.values()) if not a.is_deleted()]
            registrations = [m for sent in self._registrations.values() for m in sent]
            alive = {a.buffer_id for a in arrays}  # a donated array taken back (``Array._take_back``) is alive
            gone = [ResumedBuffer(buffer=b, spec=wire_spec(shape, dtype, sharding))
                    for b, shape, dtype, sharding in list(self._gone) if b not in alive]
        return Declared(buffers=[ResumedBuffer(buffer=a.buffer_id, spec=a.spec()) for a in arrays],
                        slices=list(self._slices), released=gone,
                        functions=[m for m in registrations if isinstance(m, RegisterProgramFunction)],
                        programs=[m for m in registrations if isinstance(m, RegisterProgram)])

    def _resumed(self, reply: SessionResumed) -> None:
        """The session was taken back from a restarted proxy. Its registrations went with the resume; if they
        did not fit, each is sent again with its next use (forgetting them here costs that once)."""
        with self._lock:
            self._functions.clear()
            self._programs.clear()
            self._registrations.clear()

    def _first_time(self, seen: set[str], key: str) -> bool:
        with self._lock:
            if key in seen:
                return False
            seen.add(key)
            return True

    def register_function(self, fn_id: str, *, exported: bytes, slice_id: int, spmd: bool, mesh: list[int],
                          axes: list[str], donate: list[int]) -> None:
        """Ship a compiled function to the proxy, once per session."""
        if self._first_time(self._functions, fn_id):
            message = RegisterProgramFunction(fn_id=fn_id, exported=exported, slice_id=slice_id, spmd=spmd, mesh=mesh,
                                              axes=axes, donate=donate)
            self._registrations[fn_id] = [message]
            self.conn.post(message)

    def register_program(self, program_id: str, spec: ProgramSpec) -> None:
        """Ship a traced program once per session; its runs then send only its id. A big one goes in
        parts of ``PROGRAM_PART_ITEMS`` values and nodes (``RegisterProgram.parts``)."""
        if not self._first_time(self._programs, program_id):
            return
        parts = max(1, -(-max(len(spec.values), len(spec.nodes)) // PROGRAM_PART_ITEMS))
        for k in range(parts):
            last = k == parts - 1
            vs, ns = (slice(len(items) * k // parts, len(items) * (k + 1) // parts)
                      for items in (spec.values, spec.nodes))
            part = spec if parts == 1 else ProgramSpec(values=spec.values[vs], nodes=spec.nodes[ns],
                                                       inputs=spec.inputs if last else [],
                                                       outputs=spec.outputs if last else [])
            message = RegisterProgram(program_id=program_id, program=part, part=k, parts=parts)
            self._registrations.setdefault(program_id, []).append(message)
            self.conn.post(message)

    def post(self, message: Message) -> None:
        self.conn.post(message)

    def create_slice(self, devices: int, island: int | None, kind: str = "") -> SliceInfo:
        reply = self.conn.request(CreateSlice(devices=devices, island=island, kind=kind))
        assert isinstance(reply, SliceCreated)
        self._slices.append(reply.slice.slice_id)
        return reply.slice

    def suspend_slices(self, slice_ids: list[int]) -> list[SliceInfo]:
        reply = self.conn.request(SuspendSlices(slice_ids=slice_ids))
        assert isinstance(reply, SlicesChanged)
        return reply.slices

    def resume_slices(self, slice_ids: list[int], *, devices: int = 0, island: int | None = None,
                      mesh: Sequence[int] = (), buffers: Sequence[int] = (),
                      shardings: Sequence[Sharding] = ()) -> list[SliceInfo]:
        reply = self.conn.request(ResumeSlices(slice_ids=slice_ids, devices=devices, island=island, mesh=list(mesh),
                                               buffers=list(buffers), shardings=list(shardings)))
        assert isinstance(reply, SlicesChanged)
        return reply.slices

    def _goes_direct(self, nbytes: int) -> DirectData | None:
        """The data plane to move ``nbytes`` over, if a value that big goes direct (``client/direct.py``)."""
        if not (0 <= self.direct_min_bytes <= nbytes and self.conn.data_key):
            return None
        with self._lock:
            if self._direct is None:
                self._direct = DirectData(self.session_id, self.conn.data_key, self.address)
            return self._direct

    def put(self, buffer_id: int, slice_id: int, array: np.ndarray, sharding: Sharding) -> None:
        """Put ``array`` as buffer ``buffer_id``: through the proxy (a post: it returns at once), or, if it is
        big, straight to the executors (it returns once they hold it; a failure is raised here)."""
        direct = self._goes_direct(int(array.nbytes))
        if direct is None:
            self.conn.post(PutBuffer(buffer=buffer_id, slice_id=slice_id, array=array, sharding=sharding))
            return
        try:
            places = self.conn.request(PutDirect(buffer=buffer_id, slice_id=slice_id, shape=list(array.shape),
                                                 dtype=dtype_name(array.dtype), sharding=sharding))
            assert isinstance(places, ShardPlaces)
            direct.send(array, places, sharding)
        except BaseException:
            self.release(buffer_id)  # no pw.Array holds it: its record (or what reached an executor) is freed
            raise

    def fetch(self, buffer_ids: Sequence[int], timeout_seconds: float | None = None,
              layouts: Sequence[tuple[Layout, np.dtype[Any]]] = ()) -> list[list[np.ndarray]]:
        """Each buffer's distinct blocks (fetched in parallel); ``PwTimeoutError`` past the timeout. A buffer
        laid out as ``layouts`` says, if it is big, is pushed to this session's data plane by the executors
        (direct), and comes back assembled (``Assembled``); small ones go together, up to
        ``FETCH_TOGETHER_BUFFERS`` (or ``FETCH_TOGETHER_BYTES``) a request (``FetchBuffers``)."""
        sizes = [math.prod(layout.shape) * dtype.itemsize for layout, dtype in layouts] or [0] * len(buffer_ids)
        direct = self._goes_direct(max(sizes, default=-1))
        tags = [direct.expect(*layouts[i]) if direct is not None and size >= self.direct_min_bytes else ""
                for i, size in enumerate(sizes)]
        try:
            # Each request: the buffers (indices) it fetches. Small values of known layout go together.
            requests: list[tuple[list[int], Any]] = []
            together: list[int] = []
            blocks_together = bytes_together = 0

            def flush() -> None:
                nonlocal together, blocks_together, bytes_together
                if len(together) == 1:
                    requests.append((together, self.conn.submit(Fetch(buffer=buffer_ids[together[0]]))))
                elif together:
                    requests.append((together, self.conn.submit(
                        FetchBuffers(buffers=[buffer_ids[i] for i in together]))))
                together, blocks_together, bytes_together = [], 0, 0

            for i, (b, tag) in enumerate(zip(buffer_ids, tags, strict=True)):
                if tag or not layouts:
                    requests.append(([i], self.conn.submit(Fetch(buffer=b, to=direct.address if tag and direct
                                                                   else "", tag=tag))))
                    continue
                n = len(layouts[i][0].distinct())
                if together and (len(together) >= FETCH_TOGETHER_BUFFERS or blocks_together + n > FETCH_TOGETHER_BLOCKS
                                 or bytes_together + sizes[i] > FETCH_TOGETHER_BYTES):
                    flush()
                together.append(i)
                blocks_together += n
                bytes_together += sizes[i]
            flush()
            deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
            blocks: list[Any] = [None] * len(buffer_ids)
            for indices, fut in requests:
                assert fut is not None
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                reply = self.conn.wait(fut, "fetch", remaining)
                if isinstance(reply, BufferValues):
                    for i, shards in zip(indices, reply.shards, strict=True):
                        blocks[i] = shards
                    continue
                assert isinstance(reply, BufferValue)
                tag = tags[indices[0]]
                if reply.pushed and direct is not None:
                    blocks[indices[0]] = direct.blocks(tag, reply.pushed, deadline)
                else:
                    blocks[indices[0]] = reply.shards
            return blocks
        finally:
            if direct is not None:
                for tag in tags:
                    if tag:
                        direct.forget(tag)

    def await_buffers(self, buffer_ids: list[int]) -> None:
        self.conn.request(AwaitBuffers(buffers=buffer_ids))

    def ready(self, buffer_ids: list[int], timeout_seconds: float | None = None) -> list[bool]:
        reply = self.conn.request(QueryBuffers(buffers=buffer_ids), timeout_seconds=timeout_seconds)
        assert isinstance(reply, BuffersState)
        return reply.ready

    def release(self, buffer_id: int, now: bool = True) -> None:
        """Free buffer ``buffer_id`` on the cluster: at once, or (``now`` false: it was garbage-collected) together
        with other drops, ahead of this session's next message or heartbeat (``ClientConnection.release``)."""
        if self.conn.closed:
            return
        if now:
            self.conn.post(ReleaseBuffers(buffers=[buffer_id]))
        else:
            self.conn.release([buffer_id])

    def take_back(self, buffer_id: int) -> None:
        """Take back buffer ``buffer_id``, donated to a run that was aborted before it consumed it; raises
        ``InvalidArgument`` saying so if it was consumed (or its run has not failed)."""
        self.conn.request(TakeBack(buffer=buffer_id))

    def drop_donated(self, buffer_id: int) -> None:
        """A donated array was dropped: if its run was aborted without consuming it, the proxy keeps it for
        us (``take_back``) until told, in a batch (most were consumed, and the proxy ignores those)."""
        with self._lock:
            self._dropped_donated.append(buffer_id)
            if len(self._dropped_donated) < DONATED_RELEASE_BATCH:
                return
            dropped, self._dropped_donated = self._dropped_donated, []
        if not self.conn.closed:
            self.conn.post(ReleaseBuffers(buffers=dropped))

    def status(self) -> StatusReply:
        reply = self.conn.request(GetStatus(), timeout_seconds=60.0)
        assert isinstance(reply, StatusReply)
        return reply

    def close(self) -> None:
        self.conn.close()
        if self._direct is not None:
            self._direct.close()
