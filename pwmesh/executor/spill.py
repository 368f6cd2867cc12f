"""An executor's state across a restart of its JAX runtime, when its island's JAX group re-forms.

JAX fixes a process's group when its backend starts, so joining a new forming means
a new process (the executor ``exec``s itself, keeping its pid, name and addresses).
What must survive is written to a private directory in host memory (``/dev/shm``
where there is one): every buffer's bytes (moved off the devices and back onto the
same device index), failures and tombstones (so late tuples and deletes behave as
before), the registered functions and gangs, and the island order's place per scheduler.
In-flight work does not survive a restart into a forming: the executor restarts only once it is
idle. A restart to take devices back from a runaway computation (``Executor._reclaim``) cannot wait for
that: the computations it had not completed, but for the runaway's, are saved (``requeue``) and queued
again, in the same order, once it is back.

Format: ``state.msgpack`` (the index) and ``data.bin`` (the bytes, at offsets the
index gives). Nothing is pickled; a dtype travels by name (bfloat16 included).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import msgpack
import numpy as np

from pwmesh.dataflow.exchange import Ragged
from pwmesh.errors import PwmeshError
from pwmesh.wire.messages import Computation, ErrorInfo, RegisterFunction, RegisterGang


@dataclasses.dataclass
class Saved:
    values: list[tuple[str, int, np.ndarray | Ragged, int]]  # key, device index, value on the host, bytes counted
    failures: dict[str, PwmeshError]
    tombstones: list[Any]  # ObjectStore.tombstones()
    functions: list[RegisterFunction]
    expected_seq: dict[str, int]  # per scheduler source: the next Enqueue to admit
    # Computations to queue again, in order: (run id, proxy, scheduler, computation)
    requeue: list[tuple[str, str, str, Computation]] = dataclasses.field(default_factory=list)
    gangs: list[RegisterGang] = dataclasses.field(default_factory=list)  # the gangs its computations name


def spill_directory(name: str) -> Path:
    """A new private directory in host memory for ``name``'s state."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=f"pwmesh-restart-{name}-", dir=base))  # mode 0700


def _array_entry(array: np.ndarray, data: Any) -> list[Any]:
    array = np.asarray(array, order="C")  # not ascontiguousarray: it makes a 0-d array 1-d
    offset = data.tell()
    data.write(array.tobytes())
    return [str(array.dtype), list(array.shape), offset, array.nbytes]


def _array(entry: list[Any], data: memoryview) -> np.ndarray:
    dtype, shape, offset, nbytes = entry
    return np.frombuffer(data[offset:offset + nbytes], dtype=jnp.dtype(dtype)).reshape(shape).copy()


def save(saved: Saved, directory: Path) -> None:
    values = []
    with open(directory / "data.bin", "wb") as data:
        for key, device, value, nbytes in saved.values:
            if isinstance(value, Ragged):
                values.append([key, device, nbytes, "ragged", _array_entry(value.array, data),
                               _array_entry(value.index, data)])
            else:
                values.append([key, device, nbytes, "array", _array_entry(value, data)])
    index = {
        "values": values,
        "failures": [[k, ErrorInfo.of(e).to_wire()] for k, e in saved.failures.items()],
        "tombstones": saved.tombstones,
        "functions": [f.to_wire() for f in saved.functions],
        "gangs": [g.to_wire() for g in saved.gangs],
        "expected_seq": saved.expected_seq,
        "requeue": [[run_id, proxy, scheduler, comp.to_wire()] for run_id, proxy, scheduler, comp in saved.requeue],
    }
    (directory / "state.msgpack").write_bytes(msgpack.packb(index, use_bin_type=True))


def load(directory: Path) -> Saved:
    index = msgpack.unpackb((directory / "state.msgpack").read_bytes(), raw=False, strict_map_key=False)
    data = memoryview((directory / "data.bin").read_bytes())
    values: list[tuple[str, int, np.ndarray | Ragged, int]] = []
    for key, device, nbytes, kind, *arrays in index["values"]:
        if kind == "ragged":
            values.append((key, device, Ragged(_array(arrays[0], data), _array(arrays[1], data)), nbytes))
        else:
            values.append((key, device, _array(arrays[0], data), nbytes))
    return Saved(
        values=values,
        failures={k: ErrorInfo.from_wire(e).exception() for k, e in index["failures"]},
        tombstones=list(index["tombstones"]),
        functions=[RegisterFunction.from_wire(f) for f in index["functions"]],
        gangs=[RegisterGang.from_wire(g) for g in index.get("gangs", [])],
        expected_seq=dict(index["expected_seq"]),
        requeue=[(run_id, proxy, scheduler, Computation.from_wire(comp))
                 for run_id, proxy, scheduler, comp in index.get("requeue", [])],
    )


def remove(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
