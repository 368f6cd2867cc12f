"""A client's arrays to and from the executors over the data plane, never through the proxy.

The proxy only says where (``PutDirect`` -> ``ShardPlaces``; ``Fetch(to=...)`` -> the executors push
the blocks here, and the answer says how many). The bytes go on streams keyed by the session's data
key, which the proxy gave this client when the session opened and gives the executors with each
transfer; on one machine their big frames go through shared memory (``pwmesh.dataflow.plane``).

Values smaller than ``DIRECT_MIN_BYTES`` still travel in the control messages: for them the extra
round trip (asking where) costs more than the copy through the proxy saves.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import socket
import threading
import time
from typing import Any

import numpy as np

from pwmesh.dataflow.layout import Assembled, Layout
from pwmesh.dataflow.plane import DataPlane, Notify
from pwmesh.errors import PwTimeoutError, Unavailable
from pwmesh.service.keys import unkeyed
from pwmesh.wire.messages import ShardBatch, Sharding, ShardPlaces

DIRECT_MIN_BYTES_ENV = "PWMESH_DIRECT_MIN_BYTES"
DIRECT_MIN_BYTES = 1 << 20  # values at least this big go direct (negative, in the environment: none does)
DELIVERY_TIMEOUT_SECONDS = 300.0  # a direct put's bytes delivered to every executor, or it fails


def direct_min_bytes() -> int:
    """The smallest value sent direct (``$PWMESH_DIRECT_MIN_BYTES``, else ``DIRECT_MIN_BYTES``); -1: none."""
    raw = os.environ.get(DIRECT_MIN_BYTES_ENV, "")
    return int(raw) if raw.strip() else DIRECT_MIN_BYTES


def local_host(proxy_address: str) -> str:
    """The address of this machine that the cluster reaches it by: the one it reaches the proxy from."""
    plain, _ = unkeyed(proxy_address)
    if not plain.startswith("tcp://"):
        return "127.0.0.1"
    host = plain.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    try:
        if ipaddress.ip_address(host).is_loopback:
            return "127.0.0.1"
    except ValueError:  # a name: resolved below
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


class _Fetch:
    """A direct fetch under way: the value it fills, block by block."""

    def __init__(self, layout: Layout, dtype: np.dtype[Any]) -> None:
        self.layout = layout
        self.out = np.empty(layout.shape, dtype)
        self.devices = layout.distinct()
        self.arrived: set[int] = set()

    def place(self, index: int, array: np.ndarray) -> None:
        if not 0 <= index < len(self.devices):
            return  # not a block of this value: the executor that sent it is not ours to trust that far
        where = self.layout.index(self.devices[index]) if self.layout.shape else ()
        self.out[where] = np.asarray(array).reshape(self.out[where].shape)


class DirectData:
    """This session's data plane: a listener the executors push fetched blocks to, and streams to theirs."""

    def __init__(self, session_id: str, data_key: bytes, proxy_address: str) -> None:
        self.session = (session_id, data_key)
        self.plane = DataPlane(None, self._not_ours, bind_host=local_host(proxy_address), sessions_only=True,
                               on_shards=self._arrived, copy_shared=False)
        self.plane.session_keys[session_id] = data_key
        self.address = self.plane.address
        self._tags = itertools.count(1)
        self._lock = threading.Condition()
        self._arrivals: dict[str, _Fetch] = {}  # by tag

    @staticmethod
    def _not_ours(batch: Any) -> None:  # a session's plane takes only its shards (``sessions_only``)
        return None

    # ------------------------------------------------------------------ fetch

    def expect(self, layout: Layout, dtype: np.dtype[Any]) -> str:
        """A tag for a fetch of a value laid out as ``layout`` whose blocks will be pushed here."""
        tag = f"f{next(self._tags)}"
        with self._lock:
            self._arrivals[tag] = _Fetch(layout, dtype)
        return tag

    def _arrived(self, session: str, batch: ShardBatch) -> None:
        """Blocks pushed here (on the stream's reader thread; the arrays may be views of the sender's shared
        memory, valid until this returns): each copied into its place in the value."""
        with self._lock:
            fetch = self._arrivals.get(batch.tag)
        if fetch is None:  # a fetch given up on (failed, timed out): late blocks are dropped
            return
        for index, array in zip(batch.indices, batch.arrays, strict=False):
            fetch.place(index, array)  # outside the lock: the executors' streams copy in parallel
        with self._lock:
            fetch.arrived.update(batch.indices)
            self._lock.notify_all()

    def blocks(self, tag: str, count: int, deadline: float | None) -> list[np.ndarray]:
        """The value whose ``count`` blocks were pushed for ``tag`` (the executors said they were delivered),
        assembled (``Assembled``)."""
        deadline = deadline if deadline is not None else time.monotonic() + DELIVERY_TIMEOUT_SECONDS
        with self._lock:
            try:
                fetch = self._arrivals[tag]
                while len(fetch.arrived) < count:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise PwTimeoutError(f"a direct fetch: {len(fetch.arrived)} of {count} blocks arrived")
                    self._lock.wait(left)
                return Assembled([fetch.out])
            finally:
                self._arrivals.pop(tag, None)

    def forget(self, tag: str) -> None:
        with self._lock:
            self._arrivals.pop(tag, None)

    # ------------------------------------------------------------------ put

    def send(self, array: np.ndarray, places: ShardPlaces, sharding: Sharding | None) -> None:
        """Send ``array``'s shards where ``places`` says; return once every executor holds them."""
        layout = Layout.of(array.shape, sharding, len(places.keys))
        batches: dict[str, ShardBatch] = {}
        for address, key, device, part in zip(places.addresses, places.keys, places.devices, layout.split(array),
                                              strict=True):
            batch = batches.setdefault(address, ShardBatch(tag="put", keys=[], arrays=[], devices=[]))
            batch.keys.append(key)
            batch.devices.append(device)
            batch.arrays.append(part)  # (the codec sends a block that is not contiguous as a contiguous copy)
        done = threading.Condition()
        outcomes: list[str | None] = []

        def told(why: str | None) -> None:
            with done:
                outcomes.append(why)
                done.notify_all()

        with self._lock:  # streams are made on first use: one sender at a time
            for address, batch in batches.items():
                self.plane.send(address, batch, tag=Notify(told), session=self.session)
        deadline = time.monotonic() + DELIVERY_TIMEOUT_SECONDS
        with done:
            while len(outcomes) < len(batches):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PwTimeoutError(f"a direct put: {len(outcomes)} of {len(batches)} executors took their "
                                         f"shards within {DELIVERY_TIMEOUT_SECONDS:g} s")
                done.wait(left)
        failed = [why for why in outcomes if why is not None]
        if failed:
            raise Unavailable(f"a direct put did not reach every executor: {failed[0]}")

    def close(self) -> None:
        self.plane.close()
