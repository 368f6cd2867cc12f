"""``Client``: one connection to a cluster; and the module-level API built on a default client.

State lives in ``Client`` instances (tests may hold several); the module
functions (``pw.connect``, ``pw.get``, ...) use the process's default client.
"""

from __future__ import annotations

import atexit
import itertools
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from pwmesh.client.array import Array
from pwmesh.client.connection import ClientConnection
from pwmesh.client.devices import Slice, VirtualDevice, VirtualDeviceSet, slice_of
from pwmesh.client.functions import ExportedFunction, canonical
from pwmesh.dataflow.layout import check_split
from pwmesh.errors import InvalidArgument
from pwmesh.service.local_cluster import LocalCluster, LocalClusterSpec
from pwmesh.wire.messages import (
    BufferValue,
    Fetch,
    GetStatus,
    ProgramSpec,
    PutBuffer,
    RegisterProgram,
    RegisterProgramFunction,
    ReleaseBuffers,
    StatusReply,
)


class Client:
    """A session on a pwmesh cluster (an embedded local one if no address is given)."""

    def __init__(self, address: str | None = None, *, name: str = "", weight: float = 1.0, priority: int = 0,
                 cluster: LocalClusterSpec | None = None, connect_timeout_seconds: float = 10.0) -> None:
        address = address or os.environ.get("PWMESH_ADDRESS") or None
        self.cluster: LocalCluster | None = None
        if address is None:
            self.cluster = LocalCluster(cluster)
            address = self.cluster.start()
        self.address = address
        try:
            self.conn = ClientConnection(address, name=name or f"pid{os.getpid()}", weight=weight,
                                         priority=priority, connect_timeout_seconds=connect_timeout_seconds)
        except BaseException:
            if self.cluster is not None:
                self.cluster.stop()
            raise
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._functions: set[str] = set()
        self._programs: set[str] = set()
        self.device_sets: list[VirtualDeviceSet] = []
        atexit.register(self.close)

    @property
    def session_id(self) -> str:
        return self.conn.session_id

    def new_buffer_id(self) -> int:
        return next(self._ids)

    def canonical(self, value: Any) -> np.ndarray:
        return canonical(value)

    def make_virtual_device_set(self) -> VirtualDeviceSet:
        devs = VirtualDeviceSet(self)
        self.device_sets.append(devs)
        return devs

    def ensure_function(self, exported: ExportedFunction, slice_id: int) -> None:
        """Ship a compiled function to the proxy once per session."""
        with self._lock:
            if exported.fn_id in self._functions:
                return
            self._functions.add(exported.fn_id)
        self.conn.post(RegisterProgramFunction(fn_id=exported.fn_id, exported=exported.serialized,
                                               slice_id=slice_id, spmd=exported.spmd))

    def ensure_program(self, program_id: str, spec: ProgramSpec) -> None:
        """Ship a traced program to the proxy once per session; its runs then send only its id."""
        with self._lock:
            if program_id in self._programs:
                return
            self._programs.add(program_id)
        self.conn.post(RegisterProgram(program_id=program_id, program=spec))

    def release(self, buffer_id: int) -> None:
        if not self.conn.closed:
            self.conn.post(ReleaseBuffers(buffers=[buffer_id]))

    def fetch(self, arrays: Sequence[Array], timeout_seconds: float | None = None) -> list[np.ndarray]:
        """Values of ``arrays``, fetched in parallel; ``PwTimeoutError`` if one takes longer than the timeout."""
        futures = [self.conn.submit(Fetch(buffer=a.buffer_id)) for a in arrays]
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        values = []
        for arr, fut in zip(arrays, futures, strict=True):
            assert fut is not None
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            reply = self.conn.wait(fut, "fetch", remaining)
            assert isinstance(reply, BufferValue)
            if len(reply.shards) == 1 or arr.ndim == 0:
                value = np.array(reply.shards[0], copy=True)
            else:
                value = np.concatenate(reply.shards, axis=0)
            values.append(value.reshape(arr.shape))
        return values

    def put(self, value: Any, devices: Slice | Sequence[VirtualDevice]) -> Array:
        sl = slice_of(devices)
        if sl.client is not self:
            raise InvalidArgument("that slice belongs to another client")
        arr = canonical(value)
        check_split(arr.shape, len(sl.devices), f"put onto {len(sl.devices)} devices")
        buffer_id = self.new_buffer_id()
        self.conn.post(PutBuffer(buffer=buffer_id, slice_id=sl.slice_id, array=arr))
        return Array(self, buffer_id, arr.shape, arr.dtype, len(sl.devices))

    def status(self) -> StatusReply:
        reply = self.conn.request(GetStatus(), timeout_seconds=60.0)
        assert isinstance(reply, StatusReply)
        return reply

    def close(self) -> None:
        atexit.unregister(self.close)
        self.conn.close()
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


_default: Client | None = None
_default_lock = threading.Lock()


def connect(address: str | None = None, *, name: str = "", weight: float = 1.0, priority: int = 0,
            cluster: LocalClusterSpec | None = None, connect_timeout_seconds: float = 10.0) -> Client:
    """Connect to the cluster at ``address`` (else ``$PWMESH_ADDRESS``, else start an embedded one).

    The client becomes the default one used by ``pw.make_virtual_device_set``, ``pw.get`` and ``pw.put``.
    """
    global _default
    client = Client(address, name=name, weight=weight, priority=priority, cluster=cluster,
                    connect_timeout_seconds=connect_timeout_seconds)
    with _default_lock:
        old, _default = _default, client
    if old is not None:
        old.close()
    return client


def default_client() -> Client:
    """The default client, connecting (embedded cluster) on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Client()
        return _default


def disconnect() -> None:
    global _default
    with _default_lock:
        old, _default = _default, None
    if old is not None:
        old.close()


def make_virtual_device_set() -> VirtualDeviceSet:
    return default_client().make_virtual_device_set()


def get(tree: Any) -> Any:
    """Fetch every ``pw.Array`` in a pytree (in parallel); other leaves pass through."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: isinstance(x, Array))
    arrays = [leaf for leaf in leaves if isinstance(leaf, Array) and leaf._value is None]
    by_client: dict[int, list[Array]] = {}
    for arr in arrays:
        by_client.setdefault(id(arr._client), []).append(arr)
    for group in by_client.values():
        for arr, value in zip(group, group[0]._client.fetch(group), strict=True):
            arr._value = value
    return jax.tree_util.tree_unflatten(
        treedef, [leaf.value() if isinstance(leaf, Array) else leaf for leaf in leaves])


def put(value: Any, devices: Slice | Sequence[VirtualDevice]) -> Array:
    """Scatter a host array over a slice's devices (split along its leading axis)."""
    return slice_of(devices).client.put(value, devices)
