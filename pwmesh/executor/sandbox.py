"""Registered functions read first in a child process: a crafted artifact crashes that, not the executor.

A function reaches an executor as a ``jax.export`` artifact, which is a tenant's bytes. Reading it
(``export.deserialize``, then the MLIR module for the custom-call check) runs jaxlib's flatbuffer and
MLIR bytecode parsers over them, inside the process that holds every tenant's buffers. With a sandbox
(``pwmesh-executor --sandbox-functions``, the default on a cluster with keys) a child process reads each
new function first, with the same checks (``artifacts.read``); only an artifact it read without dying
and without a refusal is read again by the executor. If the child dies (a parser's segfault, an abort)
the function is refused, naming the signal, and a new child reads the next one.

Where the boundary is: parsing and checking the bytes. Compiling a module that passed (XLA) and running
it stay in the executor: a compiler or runtime bug that a module free of host callbacks and of custom
calls outside ``jax.export``'s stable list can still reach takes the executor down (its buffers are lost
as with any executor lost; the cluster goes on). Compiling in the child too would double every compile.

Protocol: on the child's stdin, per function, a msgpack ``[fn_id, bytes]`` after a 4-byte length; on its
stdout ``[True, ""]`` or ``[False, why]`` likewise. ``python -m pwmesh.executor.sandbox`` is the child.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
from typing import IO, Any

import msgpack

from pwmesh.errors import InvalidArgument

_LEN = struct.Struct("!I")
# Test-only fault injection: the child aborts reading a function whose id starts with this (a parser that
# crashes cannot be had on demand).
TEST_CRASH_ENV = "PWMESH_TEST_SANDBOX_CRASH_ON"


def _write(out: IO[bytes], value: Any) -> None:
    data = msgpack.packb(value, use_bin_type=True)
    out.write(_LEN.pack(len(data)) + data)
    out.flush()


def _read(src: IO[bytes]) -> Any:
    head = src.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError
    (size,) = _LEN.unpack(head)
    data = src.read(size)
    if len(data) < size:
        raise EOFError
    return msgpack.unpackb(data, raw=False)


class Sandbox:
    """The child that reads functions before the executor does (started at its first use; thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self.checked = 0
        self.crashes = 0

    def check(self, fn_id: str, serialized: bytes) -> None:
        """Read ``serialized`` in the child: ``InvalidArgument`` if it refuses it or dies reading it."""
        with self._lock:
            if self._child is None or self._child.poll() is not None:
                # Reading needs no device: the child never takes an accelerator from the executor.
                env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
                self._child = subprocess.Popen([sys.executable, "-m", "pwmesh.executor.sandbox"],
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            child = self._child
            assert child.stdin is not None and child.stdout is not None
            try:
                _write(child.stdin, [fn_id, bytes(serialized)])
                ok, why = _read(child.stdout)
            except (EOFError, BrokenPipeError, OSError):
                code = child.wait()
                _close_pipes(child)
                self._child = None
                self.crashes += 1
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                raise InvalidArgument(f"function {fn_id[:12]} crashed the process that reads functions before "
                                      f"this executor does ({how}): refused") from None
            self.checked += 1
        if not ok:
            raise InvalidArgument(why)

    def close(self) -> None:
        with self._lock:
            child, self._child = self._child, None
        if child is not None and child.poll() is None:
            assert child.stdin is not None
            child.stdin.close()  # it leaves at the end of its input
            try:
                child.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if child is not None:
            _close_pipes(child)


def _close_pipes(child: subprocess.Popen[bytes]) -> None:
    for pipe in (child.stdin, child.stdout):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:  # a write the dead child left unflushed
                pass


def main() -> None:
    """The child: read each function as the executor would, and say whether it may."""
    from pwmesh.executor.artifacts import read  # noqa: PLC0415 - JAX, in the child only

    crash_on = os.environ.get(TEST_CRASH_ENV, "")
    src, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            fn_id, serialized = _read(src)
        except EOFError:
            return
        if crash_on and fn_id.startswith(crash_on):
            os.abort()
        try:
            read(fn_id, serialized)
        except InvalidArgument as exc:
            _write(out, [False, exc.message])
        else:
            _write(out, [True, ""])


if __name__ == "__main__":
    main()
