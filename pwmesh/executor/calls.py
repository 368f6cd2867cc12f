"""The JAX calls an executor makes: run compiled computations on its devices, dispatched or waited for.

Every function here takes a computation's shards (per shard, its input arrays) and the
devices they run on; none knows of queues, runs or the event loop (``runner.Runner``).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import jax
import numpy as np

from pwmesh.dataflow.exchange import Ragged
from pwmesh.executor.functions import CompiledFunction

try:  # the call ``jax.make_array_from_callback`` ends in (``copied_to``)
    from jax._src.core import ShapedArray as _ShapedArray
    from jax._src.interpreters.pxla import batched_device_put as _batched_device_put
except ImportError:  # a JAX without them: the public way
    _batched_device_put = None  # type: ignore[assignment]
try:  # the concrete type of a JAX array: checked by identity on the warm path (``dispatch_together``)
    from jax._src.array import ArrayImpl as _ArrayImpl
except ImportError:  # a JAX without it: every value goes through ``placed``
    _ArrayImpl = None  # type: ignore[assignment,misc]


def compiled(fn: CompiledFunction, spmd: bool, devices: list[jax.Device], donate: tuple[int, ...]) -> list[Any] | None:
    """The executables to run on ``devices`` if all are compiled (none for an SPMD function: one call
    compiles and runs for all), else None."""
    if spmd:
        return [] if fn.compiled(tuple(devices), donate) else None
    exes = [fn.ready((d,), donate) for d in devices]
    return None if None in exes else exes


def placed(value: Any, device: jax.Device) -> Any:
    """``value`` on ``device``: as it is if it is there already (``device_put`` would cost ~60 us to do nothing)."""
    if isinstance(value, jax.Array) and getattr(value.sharding, "_device", None) is device:
        return value
    return jax.device_put(value, device)


def to_host(value: Any) -> Any:
    """A copy of a stored value in host memory (``ObjectStore.to_host``); routed rows are there already."""
    return np.array(value) if isinstance(value, jax.Array) else value


def dispatch_together(exes: list[Any], devices: list[jax.Device], per_shard: list[list[Any]]) -> list[list[Any]]:
    """Dispatch per-device shards (without waiting for them); each device's outputs.

    A chain's node runs this once: arrays already on their device (the usual case) and a single output are
    seen by their type, not through ``placed`` and ``tree_leaves`` (~3 us of a node's ~12 us of calls)."""
    array = _ArrayImpl
    outs = []
    for exe, device, args in zip(exes, devices, per_shard, strict=True):
        for a in args:
            if type(a) is not array or getattr(a.sharding, "_device", None) is not device:
                args = [placed(x, device) for x in args]
                break
        out = exe(*args)
        outs.append([out] if type(out) is array else jax.tree_util.tree_leaves(out))
    return outs


def dispatch_plain(exes: list[Any], devices: list[jax.Device], per_shard: list[list[Any]],
                   outputs: int) -> list[list[Any]] | None:
    """``dispatch_together`` for a warm computation that must make ``outputs`` outputs a device: None if it
    fails as it is dispatched or makes another number (a malformed computation: the general path runs it
    again and says how)."""
    try:
        outs = dispatch_together(exes, devices, per_shard)
    except Exception:
        return None
    for out in outs:
        if len(out) != outputs:
            return None
    return outs


def wait_plain(outs: list[list[Any]]) -> None:
    """Wait for what ``dispatch_plain`` dispatched: a device's outputs are computed together, so one stands for
    all (``computed``, whose check for outputs a later computation consumed cannot apply: none ran since)."""
    for out in outs:
        if out:
            out[-1].block_until_ready()


def call_together(exes: list[Any], devices: list[jax.Device],
                   per_shard: list[list[Any]]) -> tuple[list[list[Any]], float]:
    """Per-device shards on the calling thread, each dispatched before any is waited for;
    their outputs and the seconds they took together."""
    start = time.perf_counter()
    outs = dispatch_together(exes, devices, per_shard)
    computed(outs)
    return outs, time.perf_counter() - start


def call_single(fn: CompiledFunction, device: jax.Device, args: list[Any],
                 donate: tuple[int, ...] = ()) -> tuple[list[Any], float]:
    exe = fn.executable((device,), donate)  # compiles on first use: not part of its time
    start = time.perf_counter()
    on_device = [placed(a, device) for a in args]
    out = exe(*on_device)
    leaves = jax.tree_util.tree_leaves(out)
    jax.block_until_ready(leaves)
    return leaves, time.perf_counter() - start


def call_ragged(fn: CompiledFunction, device: jax.Device, args: list[Any]) -> tuple[list[Any], float]:
    """An expert on its routed rows: padded to the capacity it was compiled for, its outputs cut back.
    An expert that got no rows does not run: its outputs are empty."""
    (rows,) = args
    assert isinstance(rows, Ragged)
    n = len(rows.index)
    if n == 0:
        return [Ragged(np.zeros((0, *a.shape[1:]), a.dtype), rows.index) for a in fn.exported.out_avals], 0.0
    (aval,) = fn.exported.in_avals
    padded = np.zeros(aval.shape, aval.dtype)
    padded[:n] = rows.array
    outs, seconds = call_single(fn, device, [padded])
    return [Ragged(np.asarray(out)[:n], rows.index) for out in outs], seconds


class Whole(NamedTuple):
    """An SPMD computation's outputs as it made them: global arrays over its devices, not cut into
    per-device pieces (the store keeps them so: ``ObjectStore.put_whole``); ``split`` cuts them."""

    leaves: list[Any]
    exe: Any  # the executable that made them
    local: tuple[jax.Device, ...]  # this executor's devices among theirs, in its shards' order
    shardings: tuple[Any, ...]  # each output's, as its function has it (interned: what its readers' inputs are)
    nbytes: list[int]  # each output's bytes per shard

    def split(self) -> list[list[Any]]:
        """Each local device's outputs, as a per-device computation's would be."""
        return split(self.leaves, self.local, self.exe)


def dispatch_spmd(fn: CompiledFunction, devices: tuple[jax.Device, ...], local: tuple[jax.Device, ...],
                   per_shard: list[list[Any]], wholes: list[Any | None] | None = None,
                   donate: tuple[int, ...] = ()) -> Whole:
    """Dispatch an SPMD computation over ``devices`` (without waiting for it), given the shards of its
    ``local`` ones (all of them, unless it spans executors): its outputs whole (global arrays). An input
    with a whole in ``wholes`` goes in as it is (and needs no pieces in ``per_shard``)."""
    exe = fn.executable(devices, donate)
    shardings, out_shardings = fn.shardings(devices)
    globals_ = []
    for i, (aval, sharding) in enumerate(zip(fn.exported.in_avals, shardings, strict=True)):
        whole = wholes[i] if wholes else None
        if whole is None:
            pieces = [placed(args[i], d) for args, d in zip(per_shard, local, strict=True)]
            whole = jax.make_array_from_single_device_arrays(aval.shape, sharding, pieces)
        globals_.append(whole)
    return Whole(jax.tree_util.tree_leaves(exe(*globals_)), exe, local, out_shardings, fn.output_nbytes)


def dispatch_spmd_or_none(fn: CompiledFunction, devices: tuple[jax.Device, ...], per_shard: list[list[Any]],
                          wholes: list[Any | None] | None, outputs: int) -> Whole | None:
    """``dispatch_plain`` for a warm SPMD computation over this executor's devices alone (``dispatch_spmd``):
    None if it fails as it is dispatched or makes another number of outputs."""
    try:
        whole = dispatch_spmd(fn, devices, devices, per_shard, wholes)
    except Exception:
        return None
    return whole if len(whole.leaves) == outputs else None


# Per output sharding (an executable returns the same objects call after call) and local devices: where each
# of an output's per-device arrays goes.
_PLACES: dict[tuple[Any, tuple[jax.Device, ...]], list[int]] = {}
# Per executable and local devices: each output's sharding and places, as its last call had them. A step's
# outputs are split every call; looking each leaf's sharding up (hashing a NamedSharding and the devices)
# was most of the ~40 us a 54-output step spent here: now one lookup a call, and an identity check a leaf.
_PLANS: dict[tuple[int, tuple[jax.Device, ...]], tuple[Any, list[tuple[Any, list[int]]]]] = {}


def _places(leaf: Any, local: tuple[jax.Device, ...]) -> list[int]:
    sharding = leaf.sharding
    places = _PLACES.get((sharding, local))
    if places is None:
        order = {d.id: i for i, d in enumerate(local)}
        try:
            places = [order[d.id] for d in sharding._addressable_device_assignment]
        except AttributeError:  # a JAX without it: the public way
            places = [order[s.device.id] for s in leaf.addressable_shards]
        if len(_PLACES) > 4096:
            _PLACES.clear()
        _PLACES[(sharding, local)] = places
    return places


def split(leaves: list[Any], local: tuple[jax.Device, ...], exe: Any = None) -> list[list[Any]]:
    """Each local device's pieces of global arrays ``leaves`` (the outputs of executable ``exe``, if given),
    in ``local`` order.

    ``addressable_shards`` makes a Shard, and a sharding, per piece: a 54-output step on 4 devices took
    ~41 us of the loop for that alone (~22 us this way; the pieces are the very same arrays)."""
    result: list[list[Any]] = [[] for _ in local]
    key = (id(exe), local)
    kept = _PLANS.get(key) if exe is not None else None
    plan = kept[1] if kept is not None and kept[0] is exe and len(kept[1]) == len(leaves) else None
    if plan is None:
        plan = [(leaf.sharding, _places(leaf, local)) for leaf in leaves]
        if exe is not None:
            if len(_PLANS) > 1024:
                _PLANS.clear()
            _PLANS[key] = (exe, plan)
    for leaf, (sharding, places) in zip(leaves, plan, strict=True):
        if leaf.sharding is not sharding:  # not as the last call had it: looked up again
            places = _places(leaf, local)
        try:
            arrays = leaf._arrays
        except AttributeError:
            arrays = [s.data for s in leaf.addressable_shards]
        for place, array in zip(places, arrays, strict=True):
            result[place].append(array)
    return result


def pieces(array: Any, local: tuple[jax.Device, ...]) -> list[Any]:
    """One global array's pieces on ``local`` devices, in their order (``ObjectStore``'s ``Pieces``): as JAX
    holds them when that is their order (most often), without looking its sharding up (hashing it is most
    of ``split``'s cost for one array)."""
    try:
        if tuple(array.sharding._addressable_device_assignment) == local:
            return list(array._arrays)
    except AttributeError:  # a JAX without them: the public way
        pass
    return [out for (out,) in split([array], local)]


def call_spmd(fn: CompiledFunction, devices: tuple[jax.Device, ...], local: tuple[jax.Device, ...],
               per_shard: list[list[Any]], wholes: list[Any | None] | None = None,
               donate: tuple[int, ...] = ()) -> tuple[Whole, float]:
    """``dispatch_spmd``, waited for: also the seconds it took."""
    fn.executable(devices, donate)  # compiles on first use: not part of its time
    start = time.perf_counter()
    result = dispatch_spmd(fn, devices, local, per_shard, wholes, donate)
    computed(result)
    return result, time.perf_counter() - start


def last_outputs(outs: list[list[Any]] | Whole) -> list[Any]:
    """One output per device (``outs``: per shard, the arrays one execution made there) that a later
    computation has not consumed (donated). An execution's outputs on a device are computed (or fail)
    together, so one stands for all: a step with 54 outputs on 4 devices waits on 4 arrays, not 216.
    A device whose outputs were all consumed already has none: what consumed them follows it. Outputs
    kept whole: one global array (over every device) stands for all."""
    found = []
    for leaves in ([outs.leaves] if isinstance(outs, Whole) else outs):
        live = next((leaf for leaf in reversed(leaves) if not leaf.is_deleted()), None)
        if live is not None:
            found.append(live)
    return found


def is_computed(leaf: Any) -> bool:
    try:
        return bool(leaf.is_ready())
    except RuntimeError:
        if leaf.is_deleted():  # consumed since it was looked at: what consumed it waits for it
            return True
        raise


def computed(outs: list[list[Any]] | Whole) -> float:
    """Wait until every output (per shard, a list of arrays) is computed; when that was (wall clock).
    Each is waited for directly: jax.block_until_ready's pytree walk costs more than the wait. An output
    consumed meanwhile by a computation it was donated to is not waited for (it cannot be); that one
    runs after this, on the same devices, and lands after it."""
    for leaf in last_outputs(outs):
        try:
            leaf.block_until_ready()
        except RuntimeError:
            if not leaf.is_deleted():
                raise
    return time.time()


def copied_to(array: np.ndarray, sharding: jax.sharding.SingleDeviceSharding) -> jax.Array:
    """A small array, in JAX's canonical dtype, copied onto one device: through the call
    ``jax.make_array_from_callback`` ends in, which takes about a sixth of ``device_put``'s time here
    (~17 us against ~100 us; a training step's batch arrives as one array a device)."""
    if _batched_device_put is None:  # a JAX without it: the public way, half device_put's time
        return jax.make_array_from_callback(array.shape, sharding, _Constant(array))
    return _batched_device_put(_ShapedArray(array.shape, array.dtype), sharding, [array],  # type: ignore[no-any-return]
                               [sharding._device])


class _Constant:
    """``make_array_from_callback``'s callback for a single device: the whole array, whatever index."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __call__(self, index: Any) -> np.ndarray:
        return self.array
