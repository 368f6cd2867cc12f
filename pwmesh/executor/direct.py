"""A client's arrays straight to and from this executor, over the data plane: never through the proxy.

The proxy only says where. For a direct put it checks the put (the tenant's limits, the slice, the
layout), names the shards and tells each executor to expect them (``ExpectShards``: refused at once
if they do not fit); the client then sends them on a stream keyed by its session's data key, and each
arrives as the shard the proxy announced, or not at all (the wrong session, key, device, shape or
dtype: rejected and logged). For a direct fetch the proxy asks each executor holding a block to push
it to the client's data plane (``PushShards``), once it exists — the same posted receive as a
``FetchShards`` — and answers when every executor has it delivered.

Like every value, a shard announced and not here yet is waited for by what reads it (the object
store's ``get``), so a run issued after a put sees the put's value.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from pwmesh.core.ratelimit import RejectedLog
from pwmesh.dataflow.plane import DataPlane, Notify
from pwmesh.errors import InvalidArgument, Unavailable
from pwmesh.executor.store import ObjectStore
from pwmesh.wire import Envelope
from pwmesh.wire.codec import dtype_from_name
from pwmesh.wire.messages import ExpectShards, Ok, PushShards, ShardBatch

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Expected:
    """A shard a client's direct put will send: whose, where, and what it must be."""

    session: str
    device: int
    shape: tuple[int, ...]
    dtype: np.dtype[Any]


class DirectTransfers:
    """This executor's side of the clients' direct puts and fetches (the handlers of ``ExpectShards`` and
    ``PushShards``, and of the shards that arrive on a client's stream)."""

    def __init__(self, name: str, store: ObjectStore, plane: DataPlane,
                 store_value: Callable[[str, int, np.ndarray], None],
                 on_host: Callable[[Any], Awaitable[Any]]) -> None:
        """``store_value(key, device, array)``: store what arrived on that device, as data from another
        executor is stored (a big one copied onto the device off the loop; a failure fails the key)."""
        self.name = name
        self.store = store
        self.plane = plane
        self.store_value = store_value
        self.on_host = on_host
        self.expected: dict[str, Expected] = {}
        self.received_bytes = 0
        self.pushed_bytes = 0
        self._rejected = RejectedLog("direct transfers", logger=log)

    def _session(self, session: str, data_key: bytes) -> None:
        if not data_key:
            raise InvalidArgument(f"session {session} has no data key (its proxy gives none)")
        self.plane.session_keys[session] = data_key

    def expect(self, peer: bytes, env: Envelope) -> Ok:
        msg = env.message
        assert isinstance(msg, ExpectShards)
        if not (len(msg.keys) == len(msg.devices) == len(msg.shapes)):
            raise InvalidArgument("expect_shards needs as many keys, devices and shapes")
        if any(not k.startswith(f"{msg.session}/") for k in msg.keys):
            raise InvalidArgument(f"a shard of session {msg.session} must be named under it")
        dtype = dtype_from_name(msg.dtype)
        nbytes = sum(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for shape in msg.shapes)
        self.store.refuse_put(msg.keys, nbytes, self.name)  # as a put through the proxy
        self._session(msg.session, msg.data_key)
        for key, device, shape in zip(msg.keys, msg.devices, msg.shapes, strict=True):
            self.expected[key] = Expected(msg.session, device, tuple(shape), dtype)
        return Ok()

    def arrived(self, session: str, batch: ShardBatch) -> None:
        """Shards a client sent (on the loop): each stored if it is the one announced, else rejected."""
        if len(batch.keys) != len(batch.arrays) or len(batch.devices) != len(batch.keys):
            self._rejected.rejected(session, f"session {session}: a batch of {len(batch.keys)} keys, "
                                    f"{len(batch.devices)} devices and {len(batch.arrays)} arrays")
            return
        for key, device, array in zip(batch.keys, batch.devices, batch.arrays, strict=True):
            want = self.expected.get(key)
            if want is None or want.session != session:
                self._rejected.rejected(session, f"session {session} sent shard {key!r}, which it was not told "
                                        "to send here: dropped")
                continue
            if (device, tuple(array.shape), array.dtype) != (want.device, want.shape, want.dtype):
                self._rejected.rejected(session, f"session {session} sent shard {key!r} as {array.dtype}"
                                        f"{list(array.shape)} on device {device}, not the {want.dtype}"
                                        f"{list(want.shape)} on device {want.device} announced: dropped")
                continue
            del self.expected[key]
            self.received_bytes += int(array.nbytes)
            if not self.store.deleted(key):
                self.store_value(key, device, array)

    async def push(self, peer: bytes, env: Envelope) -> Ok:
        """Send shards to a client's data plane once they exist; ``Ok`` once it holds them."""
        msg = env.message
        assert isinstance(msg, PushShards)
        if len(msg.keys) != len(msg.indices):
            raise InvalidArgument("push_shards needs as many keys and indices")
        self._session(msg.session, msg.data_key)
        futures = [self.store.get(k) for k in msg.keys]  # ``get``: a shard not made yet is waited for
        arrays = [await self.on_host(await f) for f in futures]
        delivered: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def done(why: str | None) -> None:
            if delivered.done():
                return
            if why is None:
                delivered.set_result(None)
            else:
                delivered.set_exception(Unavailable(f"executor {self.name} could not reach the client's data "
                                                    f"plane at {msg.to}: {why}"))

        self.plane.send(msg.to, ShardBatch(tag=msg.tag, keys=msg.keys, arrays=arrays, indices=msg.indices),
                        tag=Notify(done), session=(msg.session, msg.data_key))
        await delivered
        self.pushed_bytes += sum(int(a.nbytes) for a in arrays)
        return Ok()

    def forget(self, session: str) -> None:
        """Session ``session`` ended: its key, streams and what it had announced go."""
        self.plane.session_keys.pop(session, None)
        self.plane.forget_session(session)
        for key in [k for k, e in self.expected.items() if e.session == session]:
            del self.expected[key]
