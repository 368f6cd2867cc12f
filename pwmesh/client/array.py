"""``pw.Array``: a future for a logical, sharded buffer living in the executors' stores.

Shape and dtype are known the moment the array exists (they are static); the
value is fetched only when asked (``np.asarray``, ``pw.get``) and then cached.
Dropping the last Python reference releases the buffer on the cluster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from pwmesh.wire.messages import AwaitBuffers, BuffersState, QueryBuffers

if TYPE_CHECKING:
    from pwmesh.client.api import Client


class Array:
    __slots__ = ("__weakref__", "_client", "_id", "_value", "_deleted", "shape", "dtype", "shards")

    def __init__(self, client: Client, buffer_id: int, shape: tuple[int, ...], dtype: np.dtype, shards: int) -> None:
        self._client = client
        self._id = buffer_id
        self._value: np.ndarray | None = None
        self._deleted = False
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.shards = shards

    @property
    def buffer_id(self) -> int:
        return self._id

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def _check_alive(self) -> None:
        if self._deleted:
            raise ValueError(f"pw.Array {self._id} was deleted")

    def block_until_ready(self) -> Array:
        """Wait until the value is computed; raises the remote error if computing it failed."""
        if self._value is None:
            self._check_alive()
            self._client.conn.request(AwaitBuffers(buffers=[self._id]))
        return self

    def is_ready(self) -> bool:
        """Whether the value is computed (or has failed), without waiting."""
        if self._value is not None:
            return True
        self._check_alive()
        reply = self._client.conn.request(QueryBuffers(buffers=[self._id]))
        assert isinstance(reply, BuffersState)
        return reply.ready[0]

    def value(self) -> np.ndarray:
        if self._value is None:
            self._check_alive()
            self._value = self._client.fetch([self])[0]
        return self._value

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        value = self.value()
        if dtype is not None and np.dtype(dtype) != value.dtype:
            return value.astype(dtype)
        return value.copy() if copy else value

    def delete(self) -> None:
        """Free the buffer on the cluster now (also happens when the array is garbage-collected)."""
        if not self._deleted:
            self._deleted = True
            self._client.release(self._id)

    def __del__(self) -> None:
        try:
            self.delete()
        except Exception:  # interpreter shutdown or a closed connection: nothing left to free
            pass

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d pw.Array")
        return self.shape[0]

    def __repr__(self) -> str:
        state = "deleted" if self._deleted else ("fetched" if self._value is not None else "future")
        return f"pw.Array(shape={self.shape}, dtype={self.dtype}, shards={self.shards}, {state})"
