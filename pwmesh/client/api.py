"""The public facade: ``Client`` (a session, and an embedded cluster when no address is given),
and the module-level API built on a default client (``pw.connect``, ``pw.get``, ``pw.put``, ...).

State lives in ``Client`` instances (tests may hold several); the module functions
use the process's default client.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from pwmesh.client import (
    array_ops,  # noqa: F401 - registers pw.Array's operators (``array.use_operations``)
    elastic,  # noqa: F401 - registers Slice.suspend/resume/reshape (``devices.use_elastic``)
)
from pwmesh.client.array import Array
from pwmesh.client.devices import Slice, VirtualDevice, VirtualDeviceSet, slice_of
from pwmesh.client.dispatch import fetch_all
from pwmesh.client.export import canonical, host_aval
from pwmesh.client.routing import reshard
from pwmesh.client.session import Session
from pwmesh.client.sharding import P, SliceSharding, resolve
from pwmesh.errors import InvalidArgument, SliceSuspended
from pwmesh.service.local_cluster import LocalCluster, LocalClusterSpec
from pwmesh.wire.messages import StatusReply


class Client:
    """A session on a pwmesh cluster (an embedded local one if no address is given)."""

    def __init__(self, address: str | None = None, *, name: str = "", weight: float = 1.0, priority: int = 0,
                 cluster: LocalClusterSpec | None = None, connect_timeout_seconds: float = 10.0,
                 keys: str | None = None) -> None:
        """``keys``: the keys directory this client was given (else ``$PWMESH_KEYS``; an embedded cluster
        started with ``LocalClusterSpec(keys=...)`` lends its own)."""
        address = address or os.environ.get("PWMESH_ADDRESS") or None
        self.cluster: LocalCluster | None = None
        if address is None:
            # Embedded: each island's executors form a JAX group, so SPMD slices may span hosts as they
            # do under `pwmesh up`; private, so no other local user can reach it (a spec given says for itself).
            self.cluster = LocalCluster(cluster or LocalClusterSpec(collectives=True, private=True))
            address = self.cluster.start_visibly()
            keys = keys or self.cluster.spec.keys or None
        self.address = address
        try:
            self.session = Session(address, name=name, weight=weight, priority=priority,
                                   connect_timeout_seconds=connect_timeout_seconds, keys=keys)
        except BaseException:
            if self.cluster is not None:
                self.cluster.stop()
            raise
        self.device_sets: list[VirtualDeviceSet] = []
        atexit.register(self.close)

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def conn(self) -> Any:
        """The connection to the proxy (for tools and tests that speak the wire directly)."""
        return self.session.conn

    def new_buffer_id(self) -> int:
        return self.session.new_buffer_id()

    def make_virtual_device_set(self) -> VirtualDeviceSet:
        devs = VirtualDeviceSet(self.session)
        self.device_sets.append(devs)
        return devs

    def fetch(self, arrays: Sequence[Array], timeout_seconds: float | None = None) -> list[np.ndarray]:
        """Values of ``arrays``, fetched in parallel; ``PwTimeoutError`` if one takes longer than the timeout."""
        for arr in arrays:
            arr._check_alive()
        blocks = self.session.fetch([a.buffer_id for a in arrays], timeout_seconds, [a.layout() for a in arrays])
        return [a.assemble(b) for a, b in zip(arrays, blocks, strict=True)]

    def put(self, value: Any, devices: Slice | Sequence[VirtualDevice], spec: Any = None) -> Any:
        """``pw.put`` on this client's slice."""
        if slice_of(devices).session is not self.session:
            raise InvalidArgument("that slice belongs to another client")
        return put(value, devices, spec)

    def status(self) -> StatusReply:
        return self.session.status()

    def close(self) -> None:
        atexit.unregister(self.close)
        self.session.close()
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
            cluster: LocalClusterSpec | None = None, connect_timeout_seconds: float = 10.0,
            keys: str | None = None) -> Client:
    """Connect to the cluster at ``address`` (else ``$PWMESH_ADDRESS``, else start an embedded one).

    The client becomes the default one used by ``pw.make_virtual_device_set``, ``pw.get`` and ``pw.put``
    (a previous default client is closed). While the default client runs an embedded cluster, another
    ``pw.connect()`` raises ``InvalidArgument``: stopping that cluster would break its arrays. Call
    ``pw.disconnect()`` first, or use ``pw.Client(address)`` for a second session on it.
    """
    global _default
    with _default_lock:
        running = _default.cluster if _default is not None else None
    if running is not None:
        raise InvalidArgument(
            f"pw.connect(): the default client already runs an embedded cluster (at {running.address}), whose "
            "arrays would break if it stopped. Call pw.disconnect() first to stop it, or open another session "
            f"on it with pw.Client({running.address!r})")
    client = Client(address, name=name, weight=weight, priority=priority, cluster=cluster,
                    connect_timeout_seconds=connect_timeout_seconds, keys=keys)
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


NamedSharding = SliceSharding  # JAX's name for it: ``pw.NamedSharding(slice, P(...))``


def device_put(value: Any, sharding: SliceSharding) -> Any:
    """``jax.device_put(value, sharding)`` on the cluster: ``pw.put(value, sharding)``, for a sharding made
    as JAX's is (``pw.NamedSharding(slice, P(...))``)."""
    return put(value, sharding)


def make_virtual_device_set() -> VirtualDeviceSet:
    return default_client().make_virtual_device_set()


def get(tree: Any) -> Any:
    """The pytree with every ``pw.Array`` fetched (in parallel) into a numpy array; other leaves as they are."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: isinstance(x, Array))
    fetch_all(leaves)
    return jax.tree_util.tree_unflatten(treedef, [leaf.value() if isinstance(leaf, Array) else leaf
                                                  for leaf in leaves])


def put(value: Any, devices: Slice | Sequence[VirtualDevice] | SliceSharding, spec: Any = None) -> Any:
    """``value`` (a pytree of host arrays or ``pw.Array``s) on ``devices``, each leaf laid out as ``spec`` says
    (a ``PartitionSpec`` or a pytree prefix of them; ``None``: replicated, as ``pw.jit`` takes host values), or
    as ``devices`` says when it is a sharding (``jax.device_put(x, NamedSharding(mesh, spec))``'s form). A
    ``pw.Array`` laid out so already is returned as it is; one laid out otherwise is resharded there."""
    if isinstance(devices, SliceSharding):
        if spec is not None:
            raise InvalidArgument("pw.put: give a sharding, or devices and a spec, not both")
        sl, spec = devices.slice, devices.spec
    else:
        sl = slice_of(devices)
    if sl.suspended:  # (the proxy refuses it too: a slice an admin suspended fails the array on its first read)
        raise SliceSuspended(f"pw.put: the put was not made: slice {sl.slice_id} is suspended; resume it "
                             "(slice.resume()) first")
    session = sl.session
    leaves, treedef = jax.tree_util.tree_flatten(value)
    specs = resolve(spec, value, "pw.put: spec")
    arrays = []
    for i, (leaf, leaf_spec) in enumerate(zip(leaves, specs, strict=True)):
        if isinstance(leaf, Array):
            wanted = SliceSharding(sl, leaf_spec if leaf_spec is not None else P())
            arrays.append(leaf if leaf.sharding == wanted else reshard(leaf, devices=sl, spec=wanted.spec))
            continue
        arr = canonical(leaf)  # a typed key array's: its data (``client/prng.py``)
        aval = host_aval(leaf)
        weak = bool(aval.weak_type or getattr(leaf, "weak_type", False))  # a Python scalar, or a weak jax.Array
        sharding = SliceSharding(sl, leaf_spec if leaf_spec is not None else P())
        sharding.check(aval.shape, f"pw.put: leaf {i}")
        buffer_id = session.new_buffer_id()
        session.put(buffer_id, sl.slice_id, arr, sharding.wire)
        arrays.append(Array(session, buffer_id, aval.shape, aval.dtype, sharding, weak))
    return jax.tree_util.tree_unflatten(treedef, arrays)
