"""What arrives by the data plane onto an executor's devices: a ``Landing`` assembled once, then put on
each of its destination devices.

Called on a host-copy thread (big values) or the loop (small ones). The value is assembled straight
into a pooled buffer, already faulted in and aligned (``BufferPool``: a fresh buffer's page faults
cost more than filling it), or is the received array itself when it came whole. On CPU, JAX adopts
such a buffer as the device buffer without a copy, and adopts it as immutable: a computation that
donates it gets a copy to write to, never this memory (``tests/test_landing.py`` checks it). So the
replicas of one value on the CPU devices of one executor share one host buffer: no copy per device.
Elsewhere ``device_put`` copies to each device from the one host value.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from pwmesh.dataflow.exchange import Landing, Ragged, assemble


def put_on(array: np.ndarray, device: jax.Device) -> jax.Array:
    """``array`` copied (or, on CPU, adopted) onto ``device``, finished."""
    value = jax.device_put(array, device)
    value.block_until_ready()
    return value


def land(landing: Landing, devices: list[jax.Device], take: Callable[[int], np.ndarray]) -> list[jax.Array]:
    """``landing``'s value on each of ``devices`` (its shards' devices, in order), assembled in a buffer
    from ``take(nbytes)`` (a writable, aligned uint8 buffer) unless it arrived whole."""
    value = assemble(landing.payloads, landing.last, take=take, whole=landing.whole)
    assert not isinstance(value, Ragged), "routed rows land on the host, one shard each"
    return [put_on(value, device) for device in devices]


def land_all(work: list[tuple[Landing, list[jax.Device]]],
             take: Callable[[int], np.ndarray]) -> list[list[jax.Array] | Exception]:
    """Each landing's values on its devices (``land``), in order, or what failed it: the arrays of one
    batch landed in one hop to a host-copy thread."""
    out: list[list[jax.Array] | Exception] = []
    for landing, devices in work:
        try:
            out.append(land(landing, devices, take))
        except Exception as exc:
            out.append(exc)
    return out
