"""Compiled functions: ``jax.export`` artifacts, compiled and cached per device assignment."""

from __future__ import annotations

import asyncio
import functools
import math
import threading
from typing import Any

import jax
import numpy as np
from jax import export
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from pwmesh.errors import InvalidArgument


@functools.cache
def _sharding(devices: tuple[jax.Device, ...], spmd: bool) -> Any:
    """Shardings are made once per device assignment (a mesh costs ~20 us to build, per call)."""
    if spmd:
        return NamedSharding(Mesh(np.array(devices), ("x",)), PartitionSpec("x"))
    (device,) = devices
    return SingleDeviceSharding(device)


class CompiledFunction:
    """One exported function and its executables, one per device assignment."""

    def __init__(self, fn_id: str, exported: export.Exported, spmd: bool) -> None:
        self.fn_id = fn_id
        self.exported = exported
        self.spmd = spmd
        self._lock = threading.Lock()
        self._executables: dict[tuple[int, ...], Any] = {}
        # How long a run of one shard takes (inf: never ran, so it compiles first, on a device
        # thread): a quicker run counts at once, a slower one a quarter, so one pause or busy
        # moment does not send a quick function off the fast path.
        self.seconds = float("inf")
        self.runs = 0

    def ran(self, seconds: float) -> None:
        """Record how long one shard's run took (timed where it was waited for: the loop or a device thread)."""
        self.seconds = min(seconds, 0.75 * self.seconds + 0.25 * seconds)
        self.runs += 1

    def landed(self, seconds: float | None) -> None:
        """Record a streamed run: ``seconds`` (None: its end was not seen) only ever lowers the estimate.

        Its end is taken by a landing thread once it has the interpreter back, which takes up
        to the switch interval (5 ms) while the loop is busy: timed so, a quick function would
        look slow, stay streamed and be timed so again; only inline runs tell it slower."""
        if seconds is not None:
            self.seconds = min(self.seconds, seconds)
        self.runs += 1

    @property
    def num_inputs(self) -> int:
        return len(self.exported.in_avals)

    @functools.cached_property
    def shard_output_nbytes(self) -> int:
        """Bytes one shard's outputs take on its device, known before anything runs.

        A per-shard function is exported for one block, so its output avals are one
        shard's; an SPMD one has global output avals, split evenly over its devices."""
        total = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in self.exported.out_avals)
        return total // self.exported.nr_devices if self.spmd else total

    @functools.cached_property
    def output_nbytes(self) -> list[int]:
        """Bytes of each output of one shard (see ``shard_output_nbytes``)."""
        split = self.exported.nr_devices if self.spmd else 1
        return [math.prod(a.shape) * np.dtype(a.dtype).itemsize // split for a in self.exported.out_avals]

    def sharding(self, devices: tuple[jax.Device, ...]) -> Any:
        return _sharding(devices, self.spmd)

    def compiled(self, devices: tuple[jax.Device, ...]) -> bool:
        """Whether ``executable(devices)`` returns at once (nothing to compile)."""
        return self.ready(devices) is not None

    def ready(self, devices: tuple[jax.Device, ...]) -> Any:
        """The executable for ``devices`` if it is compiled already, else None (never compiles)."""
        return self._executables.get(tuple(d.id for d in devices))

    def executable(self, devices: tuple[jax.Device, ...]) -> Any:
        """The executable for ``devices``, compiled on first use (call from a worker thread)."""
        key = tuple(d.id for d in devices)
        with self._lock:
            exe = self._executables.get(key)
        if exe is not None:
            return exe
        if self.spmd and len(devices) != self.exported.nr_devices:
            raise InvalidArgument(
                f"function {self.fn_id} was exported for {self.exported.nr_devices} devices, got {len(devices)}"
            )
        sharding = self.sharding(devices)
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in self.exported.in_avals]
        out_shardings = sharding if self.spmd else None
        exe = jax.jit(self.exported.call, out_shardings=out_shardings).lower(*specs).compile()
        with self._lock:
            self._executables.setdefault(key, exe)
            return self._executables[key]


class FunctionCache:
    """Functions by id; ``get`` waits for a registration that has not arrived yet."""

    def __init__(self) -> None:
        self._functions: dict[str, asyncio.Future[CompiledFunction]] = {}

    def _entry(self, fn_id: str) -> asyncio.Future[CompiledFunction]:
        fut = self._functions.get(fn_id)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._functions[fn_id] = fut
        return fut

    def register(self, fn_id: str, serialized: bytes, spmd: bool) -> CompiledFunction:
        fut = self._entry(fn_id)
        if fut.done():
            return fut.result()
        try:
            fn = CompiledFunction(fn_id, export.deserialize(bytearray(serialized)), spmd)
        except Exception as exc:  # e.g. exported by a JAX this executor cannot read
            err = InvalidArgument(f"function {fn_id[:12]} cannot be loaded here: {type(exc).__name__}: {exc}")
            fut.set_exception(err)  # computations waiting for it fail with the reason, not hang
            fut.exception()
            raise err from None
        fut.set_result(fn)
        return fn

    def get(self, fn_id: str) -> asyncio.Future[CompiledFunction]:
        """The function's future: resolved at registration (which may come after the work)."""
        return self._entry(fn_id)

    def __len__(self) -> int:
        return sum(1 for f in self._functions.values() if f.done())
