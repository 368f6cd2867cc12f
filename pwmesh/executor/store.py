"""The host's object store: one future per shard key.

``get`` on a key that has not arrived yet posts a receive: it returns the future
that a later ``put`` (a local computation, or the data plane) resolves. Keys are
never reused, so a key deleted while pending is remembered (``_deleted``) and a
late arrival for it is dropped instead of leaking.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pwmesh.errors import NotFound, PwmeshError


def _retrieve(fut: asyncio.Future[Any]) -> None:
    # Failed entries nobody awaited are normal (a failed input nobody reads);
    # retrieving the exception keeps asyncio from logging it at collection.
    if not fut.cancelled():
        fut.exception()


class ObjectStore:
    def __init__(self) -> None:
        self._entries: dict[str, asyncio.Future[Any]] = {}
        self._nbytes: dict[str, int] = {}
        self._deleted: set[str] = set()

    def _entry(self, key: str) -> asyncio.Future[Any]:
        fut = self._entries.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            fut.add_done_callback(_retrieve)
            self._entries[key] = fut
        return fut

    def get(self, key: str) -> asyncio.Future[Any]:
        """The value's future, created (a posted receive) if the key has not arrived yet."""
        if key in self._deleted:
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(NotFound(f"object {key} was deleted"))
            fut.add_done_callback(_retrieve)
            return fut
        return self._entry(key)

    def lookup(self, key: str) -> asyncio.Future[Any]:
        """The value's future; ``NotFound`` if nothing produced or awaits ``key``."""
        fut = self._entries.get(key)
        if fut is None:
            raise NotFound(f"no object {key} on this executor")
        return fut

    def put(self, key: str, value: Any, nbytes: int) -> None:
        if key in self._deleted:
            return
        fut = self._entry(key)
        if fut.done():
            raise PwmeshError(f"object {key} was produced twice")
        fut.set_result(value)
        self._nbytes[key] = nbytes

    def fail(self, key: str, exc: PwmeshError) -> None:
        if key in self._deleted:
            return
        fut = self._entry(key)
        if not fut.done():
            fut.set_exception(exc)

    def delete(self, keys: list[str]) -> int:
        removed = 0
        for key in keys:
            fut = self._entries.pop(key, None)
            self._nbytes.pop(key, None)
            if fut is not None:
                removed += 1
                if not fut.done():
                    self._deleted.add(key)
                    fut.set_exception(NotFound(f"object {key} was deleted before it arrived"))
        return removed

    def forget_owner(self, prefix: str) -> None:
        """Drop the tombstones of an owner (a closed session): its keys never come again."""
        self._deleted = {k for k in self._deleted if not k.startswith(prefix)}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(self._nbytes.values())
