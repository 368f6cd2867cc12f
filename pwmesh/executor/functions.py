"""Compiled functions: ``jax.export`` artifacts, compiled and cached per device assignment."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import math
import re
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import export
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from pwmesh.errors import InvalidArgument
from pwmesh.executor.artifacts import read
from pwmesh.executor.blockwise import per_device
from pwmesh.executor.sandbox import Sandbox
from pwmesh.ir.keys import BLOCKWISE, parse_blockwise

# What makes a computation's run time unbounded by its shapes, in its optimized HLO: a loop whose trip
# count XLA could not work out (a static ``fori_loop`` or ``scan`` has one: ``known_trip_count``), a host
# callback, a receive or an infeed. XLA:CPU runs a computation over small buffers synchronously inside the
# call that hands it over (a scalar while loop of 3e7 steps held its caller for all its 66 ms), so a
# function with any of these never runs on, or is handed over from, an executor's event loop.
_WHILE = re.compile(r"\bwhile\(")
_WAITS = ("callback", " infeed(", " outfeed(", " recv(", " send(", " recv-done(")


def bounded(hlo: str) -> bool:
    """Whether a compiled module (``hlo``: its optimized HLO text) runs for a time its shapes bound."""
    for line in hlo.splitlines():
        if _WHILE.search(line) and "known_trip_count" not in line:
            return False
        if any(op in line for op in _WAITS):
            return False
    return True


@functools.cache
def _named(devices: tuple[jax.Device, ...], mesh: tuple[int, ...], axes: tuple[str, ...],
           spec: PartitionSpec) -> NamedSharding:
    """One sharding object per (devices, mesh, spec), shared by every function: a mesh costs ~20 us to
    build, and an SPMD output goes on whole into the next SPMD call only under the very same object."""
    return NamedSharding(Mesh(np.array(devices).reshape(mesh), axes), spec)


class CompiledFunction:
    """One exported function and its executables, one per device assignment (and donation).

    An SPMD function was exported over a mesh of ``mesh`` sizes and ``axes`` names: it runs
    over the same mesh of this host's devices, its inputs and outputs laid out as it was
    exported (``in_shardings``/``out_shardings``). A per-device one runs on one block."""

    def __init__(self, fn_id: str, exported: export.Exported, spmd: bool, mesh: list[int] | None = None,
                 axes: list[str] | None = None, donate: list[int] | None = None) -> None:
        self.fn_id = fn_id
        self.exported = exported
        self.spmd = spmd
        self.mesh = tuple(mesh) if mesh and axes else (exported.nr_devices,)
        self.axes = tuple(axes) if mesh and axes else ("x",)
        self.donate = tuple(donate or ())
        if spmd and math.prod(self.mesh) != exported.nr_devices:
            raise InvalidArgument(f"function {fn_id[:12]} was exported for {exported.nr_devices} devices, "
                                  f"its mesh {list(self.mesh)} has {math.prod(self.mesh)}")
        self._lock = threading.Lock()
        self._executables: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}
        self._shardings: dict[tuple[int, ...], tuple[tuple[Any, ...], tuple[Any, ...]]] = {}
        # How long a run of one shard takes (inf: never ran, so it compiles first, on a device
        # thread): a quicker run counts at once, a slower one a quarter, so one pause or busy
        # moment does not send a quick function off the fast path.
        self.seconds = float("inf")
        self.runs = 0
        # Whether nothing in it loops or waits on data (``bounded``): None until it is known, found on a
        # device thread as it is first compiled (reading the compiled module costs ms for a large one).
        self.bounded: bool | None = None
        # An SPMD function's part run by blocks that asks which partition it is (``by_blocks``): what each
        # device (its JAX id) runs, its partition's number in it.
        self.partitions: dict[int, export.Exported] = {}

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

    def shardings(self, devices: tuple[jax.Device, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Its inputs' and outputs' shardings over ``devices`` (an SPMD function's mesh of them)."""
        found = self._shardings.get(tuple(d.id for d in devices))
        if found is None:
            found = self._shardings[tuple(d.id for d in devices)] = self._make_shardings(devices)
        return found

    def _make_shardings(self, devices: tuple[jax.Device, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        if not self.spmd:
            (device,) = devices
            single = SingleDeviceSharding(device)
            return (single,) * self.num_inputs, (single,) * len(self.exported.out_avals)
        if len(devices) != math.prod(self.mesh):
            raise InvalidArgument(f"function {self.fn_id[:12]} runs over a mesh of {list(self.mesh)} devices, "
                                  f"got {len(devices)}")
        mesh = Mesh(np.array(devices).reshape(self.mesh), self.axes)
        blocks = PartitionSpec(self.axes[0] if len(self.axes) == 1 else self.axes)  # unspecified: leading axis

        def interned(found: Sequence[Any]) -> tuple[Any, ...]:  # NamedShardings, or None: the leading axis
            return tuple(_named(tuple(devices), self.mesh, self.axes, blocks if s is None else s.spec) for s in found)

        return interned(self.exported.in_shardings_jax(mesh)), interned(self.exported.out_shardings_jax(mesh))

    @functools.cached_property
    def output_nbytes(self) -> list[int]:
        """Bytes each output of one shard takes on its device, known before anything runs (a per-device
        function is exported for one block; an SPMD one has global outputs, each device its block)."""
        avals = self.exported.out_avals
        if not self.spmd:
            return [math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in avals]
        # Over the abstract mesh: a mesh spanning executors has devices this host cannot address.
        mesh = AbstractMesh(self.mesh, self.axes, axis_types=(AxisType.Auto,) * len(self.axes))
        blocks = PartitionSpec(self.axes[0] if len(self.axes) == 1 else self.axes)
        found: Sequence[Any] = self.exported.out_shardings_jax(mesh)  # NamedShardings, or None
        outs = [NamedSharding(mesh, blocks if s is None else s.spec) for s in found]
        return [math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize for a, s in zip(avals, outs, strict=True)]

    @property
    def shard_output_nbytes(self) -> int:
        return sum(self.output_nbytes)

    def compiled(self, devices: tuple[jax.Device, ...], donate: tuple[int, ...] = ()) -> bool:
        """Whether ``executable(devices)`` returns at once (nothing to compile)."""
        return self.ready(devices, donate) is not None

    def ready(self, devices: tuple[jax.Device, ...], donate: tuple[int, ...] = ()) -> Any:
        """The executable for ``devices`` if it is compiled already, else None (never compiles)."""
        return self._executables.get((tuple(d.id for d in devices), donate))

    def executable(self, devices: tuple[jax.Device, ...], donate: tuple[int, ...] = ()) -> Any:
        """The executable for ``devices`` (consuming the ``donate`` inputs), compiled on first use (call from
        a worker thread)."""
        key = (tuple(d.id for d in devices), donate)
        with self._lock:
            exe = self._executables.get(key)
        if exe is not None:
            return exe
        if self.spmd and len(devices) != self.exported.nr_devices:
            raise InvalidArgument(
                f"function {self.fn_id} was exported for {self.exported.nr_devices} devices, got {len(devices)}"
            )
        ins, outs = self.shardings(devices)
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(self.exported.in_avals, ins,
                                                                                     strict=True)]
        out_shardings = jax.tree_util.tree_unflatten(self.exported.out_tree, list(outs)) if self.spmd else None
        exported = self.partitions.get(devices[0].id, self.exported) if self.partitions else self.exported
        with warnings.catch_warnings():
            # Donation is a hint: XLA reuses what it can (on CPU too) and says so for the rest.
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            exe = jax.jit(exported.call, out_shardings=out_shardings,
                          donate_argnums=donate).lower(*specs).compile()
        if self.bounded is None:  # known before the executable is: nothing runs inline while it is not
            text = exe.as_text()
            try:
                self.bounded = text is not None and bounded(text)
            except Exception:  # unreadable text: never inline
                self.bounded = False
        with self._lock:
            self._executables.setdefault(key, exe)
            return self._executables[key]


def load(fn_id: str, serialized: bytes, spmd: bool, mesh: list[int] | None = None, axes: list[str] | None = None,
         donate: list[int] | None = None, sandbox: Sandbox | None = None) -> CompiledFunction:
    """A registered function, read (``read``) here once ``sandbox``, if any, has read it without dying."""
    if sandbox is not None:
        sandbox.check(fn_id, serialized)
    return CompiledFunction(fn_id, read(fn_id, serialized), spmd, mesh, axes, donate)


def by_blocks(fn: CompiledFunction, fn_id: str, partitions: dict[int, int]) -> CompiledFunction:
    """SPMD function ``fn`` as the per-device function each device runs on its blocks alone
    (``blockwise.per_device``: ``InvalidArgument`` if its devices would communicate), device ``d`` (its
    JAX id) running partition ``partitions[d]``. Call from a worker thread."""
    blocks = per_device(fn.exported, fn.mesh, fn.axes, fn.fn_id)
    found = CompiledFunction(fn_id, blocks.exported, spmd=False, donate=list(fn.donate))
    if blocks.per_partition:
        found.partitions = {d: blocks.for_partition(p) for d, p in partitions.items()}
    return found


class FunctionCache:
    """Functions by id; ``get`` waits for a registration that has not arrived yet. An id with
    ``BLOCKWISE`` in it (``blockwise_id``) names a registered SPMD function run by blocks (``by_blocks``), derived here on first use."""

    def __init__(self, sandbox: Sandbox | None = None) -> None:
        self.sandbox = sandbox  # reads each new function first, in a child process (``pwmesh.executor.sandbox``)
        self.executor: concurrent.futures.Executor | None = None  # where functions are derived (None: the loop's)
        self.devices: list[jax.Device] = []  # this executor's, by index (set by the runner): ids' devices
        self._functions: dict[str, asyncio.Future[CompiledFunction]] = {}
        self._loading: set[str] = set()  # being deserialized off the loop (``load``)
        self._deriving: set[asyncio.Task[None]] = set()

    def _entry(self, fn_id: str) -> asyncio.Future[CompiledFunction]:
        fut = self._functions.get(fn_id)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._functions[fn_id] = fut
        return fut

    def _settle(self, fut: asyncio.Future[CompiledFunction], found: CompiledFunction | InvalidArgument) -> None:
        if fut.done():
            return
        if isinstance(found, InvalidArgument):
            fut.set_exception(found)  # computations waiting for it fail with the reason, not hang
            fut.exception()
        else:
            fut.set_result(found)

    def register(self, fn_id: str, serialized: bytes, spmd: bool, mesh: list[int] | None = None,
                 axes: list[str] | None = None, donate: list[int] | None = None) -> CompiledFunction:
        """Deserialize and register ``fn_id`` on this thread (``load`` keeps the event loop free)."""
        fut = self._entry(fn_id)
        if not fut.done():
            try:
                self._settle(fut, load(fn_id, serialized, spmd, mesh, axes, donate, self.sandbox))
            except InvalidArgument as exc:
                self._settle(fut, exc)
        return fut.result()

    async def load(self, fn_id: str, serialized: bytes, spmd: bool, mesh: list[int] | None = None,
                   axes: list[str] | None = None, donate: list[int] | None = None, *,
                   executor: concurrent.futures.Executor | None = None) -> CompiledFunction:
        """``register`` with the deserializing on ``executor``'s threads: a large model's module takes
        long enough to read that the loop would miss its heartbeats."""
        fut = self._entry(fn_id)
        if not fut.done() and fn_id not in self._loading:
            self._loading.add(fn_id)
            try:
                found: CompiledFunction | InvalidArgument = await asyncio.get_running_loop().run_in_executor(
                    executor, load, fn_id, serialized, spmd, mesh, axes, donate, self.sandbox)
            except InvalidArgument as exc:
                found = exc
            finally:
                self._loading.discard(fn_id)
            self._settle(fut, found)
        return await asyncio.shield(fut)

    def get(self, fn_id: str) -> asyncio.Future[CompiledFunction]:
        """The function's future: resolved at registration (which may come after the work)."""
        if fn_id not in self._functions and BLOCKWISE in fn_id:
            task = asyncio.get_running_loop().create_task(self._derive(fn_id, self._entry(fn_id)))
            self._deriving.add(task)
            task.add_done_callback(self._deriving.discard)
        return self._entry(fn_id)

    async def _derive(self, fn_id: str, fut: asyncio.Future[CompiledFunction]) -> None:
        """Resolve ``fut`` with its SPMD function run by blocks, once that function is registered."""
        try:
            parsed = parse_blockwise(fn_id)
            if parsed is None or any(not 0 <= d < len(self.devices) for d in parsed[1]):
                raise InvalidArgument(f"function id {fn_id[:80]!r} names no function run by blocks on this "
                                      "executor's devices")
            base_id, partitions = parsed
            base = await asyncio.shield(self._entry(base_id))
            by_id = {self.devices[d].id: p for d, p in partitions.items()}
            found: CompiledFunction | InvalidArgument = await asyncio.get_running_loop().run_in_executor(
                self.executor, by_blocks, base, fn_id, by_id)
        except InvalidArgument as exc:
            found = exc
        except Exception as exc:  # a registration that failed otherwise, or a bug: the run fails with it
            found = InvalidArgument(f"function {fn_id[:12]} could not be run by blocks: {type(exc).__name__}: {exc}")
        self._settle(fut, found)

    def __len__(self) -> int:
        return sum(1 for f in self._functions.values() if f.done())
