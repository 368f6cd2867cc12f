"""How long a computation takes on a fake device: declared, or from its shapes.

A simulated function travels as a real ``RegisterProgramFunction`` / ``RegisterFunction``
would: its ``exported`` bytes are a small msgpack header (``FunctionCost``: a declared
time, or flops, and the per-shard input and output shapes) padded to the size a
``jax.export`` artifact would have. The executor that is sent the function reads its
cost from those bytes, as a real one reads shapes from the artifact: nothing else
tells it.

Time on one device: the declared ``seconds``, else the roofline
``max(flops / device flops, bytes moved / device memory bandwidth)`` where bytes moved
are the shard's inputs and outputs; plus a fixed ``launch_seconds``. A computation's
shards run in parallel, one per device; the host adds ``host_overhead_seconds`` per
computation before it starts (its dispatch: finding inputs, handing it to the devices).
"""

from __future__ import annotations

import dataclasses
import math

import msgpack
import numpy as np

from pwmesh.errors import InvalidArgument, ProtocolError

MAGIC = b"pwmesh-sim-fn\x00"


@dataclasses.dataclass(frozen=True)
class FunctionCost:
    """A simulated function: per-shard shapes (for output sizes and the roofline) and its cost."""

    name: str
    in_shapes: tuple[tuple[int, ...], ...] = ()
    out_shapes: tuple[tuple[int, ...], ...] = ()
    dtype: str = "float32"
    seconds: float | None = None  # declared time per shard; None: from flops and bytes
    flops: float | None = None  # per shard; None: one per output element

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def in_bytes(self) -> int:
        return sum(math.prod(s) for s in self.in_shapes) * self.itemsize

    @property
    def out_bytes(self) -> int:
        return sum(math.prod(s) for s in self.out_shapes) * self.itemsize

    def artifact(self, pad_to: int = 0) -> bytes:
        """The function's stand-in for ``jax.export`` bytes (the cost rides inside; ``pad_to``: a realistic size)."""
        header = MAGIC + msgpack.packb({"name": self.name, "in": [list(s) for s in self.in_shapes],
                                        "out": [list(s) for s in self.out_shapes], "dtype": self.dtype,
                                        "seconds": self.seconds, "flops": self.flops})
        return header + bytes(max(0, pad_to - len(header)))

    @classmethod
    def from_artifact(cls, exported: bytes) -> FunctionCost:
        if not exported.startswith(MAGIC):
            raise ProtocolError("not a simulated function: its exported bytes lack the simulator's header")
        try:
            unpacker = msgpack.Unpacker(raw=False)
            unpacker.feed(exported[len(MAGIC):])
            head = next(unpacker)
            return cls(name=head["name"], in_shapes=tuple(tuple(s) for s in head["in"]),
                       out_shapes=tuple(tuple(s) for s in head["out"]), dtype=head["dtype"],
                       seconds=head["seconds"], flops=head["flops"])
        except (StopIteration, KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
            raise ProtocolError(f"unreadable simulated function header: {exc}") from None


@dataclasses.dataclass(frozen=True)
class CostModel:
    """The fake hardware: one device's speed, and the host's fixed cost per computation."""

    device_flops_per_second: float = 100e12
    device_memory_bytes_per_second: float = 1e12
    launch_seconds: float = 5e-6  # per computation per device: the kernel launch
    host_overhead_seconds: float = 20e-6  # per computation on an executor, before its devices start
    # What a fan-out head (``executor/fanout.py``) spends on its loop: ``relay_seconds`` per message it handles
    # whole (the ``FanOut`` it receives, its own part decoded with it; each message it sends on; each report
    # it takes in or sends up) and ``relay_body_seconds`` per part it carries in or out as an opaque body
    # (its children's, never decoded there). Measured with the real codec (``python -m pwmesh.sim.relay_cost``,
    # this 2-core machine): 1-minute load 4.5, 6-8 us a message and 0.2-0.3 us a body (a 64-part FanOut in and
    # its 16 sends on: 140-154 us; decoding and re-encoding every part, as before: 870-965 us, the 8 us a part
    # charged before); load 1.8, 3.8 us and 0.09 us (76 us; before: 429 us). Charged as loaded, as before.
    relay_seconds: float = 7e-6
    relay_body_seconds: float = 0.25e-6
    # A ``FanOut`` whose parts are said together (a warm template run: ``TemplateRun``, packed) costs a head more
    # per message than one of bodies (its nested record decoded, its parts' counts read, each child's cut
    # built and encoded), the same per part: measured 2026-11-27, load ~1, 6.2 us a message and 0.09 us a part
    # against 4.4 us and 0.13 us for bodies (1.4x a message). Charged on top of ``relay_seconds`` for each
    # such FanOut taken in or sent on: the 7 us above, 1.4x, as loaded.
    relay_together_seconds: float = 3e-6

    def __post_init__(self) -> None:
        if min(self.device_flops_per_second, self.device_memory_bytes_per_second) <= 0:
            raise InvalidArgument("device speeds must be positive")
        if min(self.launch_seconds, self.host_overhead_seconds, self.relay_seconds, self.relay_body_seconds,
               self.relay_together_seconds) < 0:
            raise InvalidArgument("overheads cannot be negative")

    def shard_seconds(self, fn: FunctionCost) -> float:
        """One shard's time on one device."""
        if fn.seconds is not None:
            return fn.seconds + self.launch_seconds
        flops = fn.flops if fn.flops is not None else sum(math.prod(s) for s in fn.out_shapes)
        moved = fn.in_bytes + fn.out_bytes
        return max(flops / self.device_flops_per_second, moved / self.device_memory_bytes_per_second) \
            + self.launch_seconds
