"""Moving one large float32 array between two processes: the baselines for pwmesh's data plane.

Two spawned worker processes, a sender and a receiver, move a 4 MiB and a 64 MiB
float32 array, several times each, by:

- **tcp**: a plain TCP socket on 127.0.0.1; the sender ``sendall(memoryview(array))``,
  the receiver ``recv_into`` a reused, pre-faulted buffer (the best case for a socket);
- **zmq**: plain pyzmq, DEALER (sender) to ROUTER (receiver) over tcp://127.0.0.1,
  ``send(array, copy=False)`` and ``recv_multipart(copy=False)``: what a naive zmq data
  plane does (the array ends up in the zmq frame, zero-copy from there on);
- **shm**: one segment in /dev/shm, created once per measurement and reused; the
  writer ``np.copyto``'s the array in, signals the reader with one byte on a Unix
  socket, the reader copies it out into its own pre-allocated array and acknowledges;
- **pwmesh-sealed**, **pwmesh-authed**: the same with the cluster's keys: streams authenticated
  and sealed with AES-256-GCM (the default), or authenticated only (``--data-plane-plaintext``);
- **pwmesh**: the executor-to-executor data plane. Not measured yet: ``measure_pwmesh``
  is the hook (it returns None, and the row reads "not measured").

Every transfer is timed by the sender, from the first byte it sends (or copies) to the
receiver's one-byte acknowledgement that the whole array is in its destination: the
full handoff, one small round trip included. Bandwidth is bytes / seconds, in GB/s
(1e9). Rounds alternate the methods so that a neighbour's burst on a shared machine
hits them alike; each row reports the median and the best transfer over all rounds,
and the receiver's minor page faults and CPU seconds per transfer (getrusage and
process_time, so every thread of the process, zmq's I/O thread included).

Where the time goes: at the largest size the same three methods run again with one
knob changed at a time (``VARIANTS``: fresh vs reused receive memory, recv chunk sizes,
SO_RCVBUF/SO_SNDBUF, zmq copy=True, zmq frames of 1 or 4 MiB, the glibc allocator,
JAX as the final destination), and an in-process ``local`` section times memcpy,
fresh-memory page faults and JAX's host-to-device handoff (``jax.device_put``,
``jnp.asarray``, ``np.asarray``: aliasing or copy).

    python bench/transfer.py                 # 2-3 minutes on a 2-core machine
    python bench/transfer.py --smoke         # seconds: tiny sizes, checks that everything runs
    python bench/transfer.py --sizes 4,64 --repeats 15 --rounds 3 --no-variants

Writes ``transfer.json``, ``transfer.md`` and (with matplotlib) ``transfer.png`` into
``--out`` (default: bench/results).

Findings, 64 MiB, on a 2-core VM shared with other jobs (load average 3.7-8 over four runs,
so wall times moved by up to 2x; the receiver's CPU time and page faults per transfer did not):

- tcp 1.75-2.34 GB/s median (best 2.2-2.8); zmq 0.62-1.01 (best 1.05-1.23), 0.34-0.58x tcp;
  shm 2.3-2.4 (two memcpy of ~13 ms each; memcpy runs at ~5 GB/s here).
- zmq loses its time to page faults in the receiver, nothing else. libzmq receives every
  message into a fresh malloc; above glibc's mmap threshold (dynamic, at most 32 MiB) that is
  a new mapping of 4 KiB pages: 16,385 minor faults per message, 47-66 ms of receiver CPU
  against raw TCP's 17-23 ms (~2-4 us a fault on this VM). With glibc told not to mmap
  (one arena, M_MMAP_MAX=0): 0 faults and 18 ms, as TCP. Frames of 1 MiB: 257 faults,
  19.5 ms; 4 MiB frames: ~10,000 faults, 35-41 ms; 16 MiB: all of them. zmq.SNDBUF/RCVBUF
  of 4 MiB change nothing. The sender with copy=False costs what sendall costs (15-17 ms);
  copy=True adds a fresh buffer and a memcpy (64-75 ms), recv copy=True a second fresh
  buffer (32,770 faults, 97-129 ms).
- Raw TCP: receiving into fresh memory costs +8-12 ms CPU with np.empty (numpy madvises
  huge pages: 34-544 faults) and +43-68 ms with malloc-like 4 KiB-page memory (16,384
  faults). The recv_into size does not matter (64 KiB: 1,025 calls, 19 ms; unbounded: the
  kernel hands over ~3 MiB a call, 22 calls, 18-23 ms). SO_RCVBUF/SO_SNDBUF of 4 MiB gain
  nothing over autotuning; a fixed SO_RCVBUF of 256 KiB costs 1-3 ms.
- JAX 0.10.2 on CPU: jax.device_put of a 64-byte aligned numpy array aliases it (0.1 ms, no
  copy), even with may_alias=False, and holds a reference to the array's base until the JAX
  array dies. numpy's own 16-byte aligned arrays and zmq frames (malloc + 8..56) are copied
  into fresh memory: 43-78 ms for 64 MiB. jnp.asarray always copies (36-87 ms).
  np.asarray(jax CPU array) is a zero-copy, read-only view.
- shm with the reader aliasing the segment (one copy, device_put of the mapped view):
  4.5-4.9 GB/s, ~2x the two-copy handoff; pipelining the two copies in 1-4 MiB chunks gave
  0.9-1.2x, within the noise, on a machine with no core to spare.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import mmap
import multiprocessing
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_OUT, load_average, machine, pyplot, save_figure, save_results, table  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
METHODS = ("tcp", "zmq", "shm", "pwmesh", "pwmesh-shm", "pwmesh-sealed", "pwmesh-authed")
# pwmesh-sealed / pwmesh-authed: the data plane's TCP path with the cluster's keys, sealed (AES-256-GCM,
# the default with keys) or authenticated only (--data-plane-plaintext); plain "pwmesh" has no keys.
ACK = b"a"
PAGE = 4096
JAX_ALIGNMENT = 64  # jax.device_put aliases host memory on CPU only from 64-byte aligned arrays
START_TIMEOUT_SECONDS = 60.0  # a spawned worker imports numpy, zmq and jax
GLIBC_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
GLIBC_M_MMAP_MAX = -4
GLIBC_M_ARENA_MAX = -8


@dataclasses.dataclass
class Config:
    sizes: tuple[int, ...] = (4 * MiB, 64 * MiB)  # bytes
    repeats: int = 15  # timed transfers per measurement
    warmup: int = 2  # untimed transfers first: connections up, buffers faulted in
    rounds: int = 3  # the methods alternate round by round; samples pool over rounds
    variants: bool = True  # the one-knob-at-a-time runs at the largest size
    local_repeats: int = 7  # in-process timings (memcpy, page faults, JAX)


# ---------------------------------------------------------------------------------------------------------------
# Memory: where the bytes land.


def aligned_empty(nbytes: int, align: int = PAGE) -> np.ndarray:
    """An uninitialised float32 array whose data starts on an ``align`` boundary.

    numpy's own allocations are 16-byte aligned, and jax.device_put copies those; a page-aligned
    buffer is aliased instead. The view keeps its base alive (``arr.base``).
    """
    base = np.empty(nbytes + align, np.uint8)
    offset = (-base.ctypes.data) % align
    return base[offset:offset + nbytes].view(np.float32)


def prefaulted(nbytes: int) -> np.ndarray:
    arr = aligned_empty(nbytes)
    arr.fill(1.0)
    return arr


def stamp(arr: np.ndarray, transfer: int) -> None:
    """Mark the array's ends with the transfer number, so the receiver can tell a stale buffer."""
    arr[0] = arr[-1] = transfer


def check(first: float, last: float, transfer: int) -> None:
    if first != transfer or last != transfer:
        raise AssertionError(f"transfer {transfer}: received ends {first}, {last}")


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Fresh:
    """Receive memory allocated anew for every transfer, the way an allocator hands it out.

    ``numpy``: np.empty (numpy madvises large allocations for transparent huge pages);
    ``mmap``: an anonymous mapping without that advice (4 KiB pages), as glibc malloc
    serves any allocation over its mmap threshold, and so as libzmq's message buffers.
    """

    def __init__(self, kind: str, nbytes: int) -> None:
        self.kind, self.nbytes = kind, nbytes
        self.mapping: mmap.mmap | None = None

    def new(self) -> np.ndarray:
        self.release()
        if self.kind == "numpy":
            return aligned_empty(self.nbytes)
        self.mapping = mmap.mmap(-1, self.nbytes)
        return np.frombuffer(self.mapping, np.float32)

    def release(self) -> None:
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:  # a view still exports it: the garbage collector unmaps it later
                pass
            self.mapping = None


def to_jax(arr: np.ndarray) -> bool:
    """Hand the received array to JAX (CPU) as the final destination; True if JAX aliased it (no copy)."""
    x = jax.device_put(arr, may_alias=True)
    x.block_until_ready()
    aliased = x.unsafe_buffer_pointer() == arr.ctypes.data
    del x
    return aliased


def heap_without_mmap() -> None:
    """glibc malloc: one arena, never mmap, never trim, so a freed big buffer is reused, not unmapped.

    By default a block over the mmap threshold (dynamic, at most 32 MiB) is a fresh mapping,
    faulted in page by page on first touch and unmapped on free: every 64 MiB zmq message.
    zmq's I/O thread allocates from an arena of its own, whose heaps cannot hold 64 MiB and
    fall back to mmap whatever M_MMAP_MAX says, hence one arena. The arena limit only holds
    if set before any second thread allocates: a fresh process. Process-wide, for life.
    """
    libc = ctypes.CDLL(None)
    for param, value in ((GLIBC_M_ARENA_MAX, 1), (GLIBC_M_MMAP_MAX, 0), (GLIBC_M_TRIM_THRESHOLD, 1 << 30)):
        if libc.mallopt(param, value) != 1:
            raise OSError(f"mallopt({param}, {value}) failed")


# ---------------------------------------------------------------------------------------------------------------
# Worker processes. Each job is one measurement: set up, ``warmup + repeats`` transfers, tear down.
# The receiver sends ("ready", address) once it listens; both end with ("done", stats).


def tcp_receive(ctl: Connection, p: dict[str, Any]) -> dict[str, Any]:
    nbytes, chunk = p["nbytes"], p.get("recv_chunk")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if p.get("rcvbuf"):  # before listen(): the window scale is agreed in the handshake
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, p["rcvbuf"])
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(START_TIMEOUT_SECONDS)
        ctl.send(("ready", listener.getsockname()))
        sock, _ = listener.accept()
    finally:
        listener.close()
    fresh = Fresh(p["dst"], nbytes) if p.get("dst") else None
    records = []
    with sock:
        sock.setblocking(True)  # a timeout would add a poll() before every recv
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rcvbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        dst = prefaulted(nbytes)
        for transfer in range(p["transfers"]):
            faults, cpu = minor_faults(), time.process_time()
            if fresh:
                dst = fresh.new()
            view = memoryview(dst).cast("B")
            got = calls = 0
            while got < nbytes:
                n = sock.recv_into(view[got:got + chunk] if chunk else view[got:])
                if n == 0:
                    raise ConnectionError("sender closed mid-transfer")
                got += n
                calls += 1
            check(dst[0], dst[-1], transfer)
            aliased = to_jax(dst) if p.get("to_jax") else None
            del view
            sock.sendall(ACK)
            records.append({"faults": minor_faults() - faults, "cpu": time.process_time() - cpu,
                            "recv_calls": calls, "jax_aliased": aliased})
    if fresh:
        fresh.release()
    return {"records": records, "so_rcvbuf": rcvbuf}


def tcp_send(ctl: Connection, p: dict[str, Any]) -> dict[str, Any]:
    src = prefaulted(p["nbytes"])
    records = []
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if p.get("sndbuf"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, p["sndbuf"])
        sock.connect(tuple(p["address"]))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sndbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        data = memoryview(src)
        for transfer in range(p["transfers"]):
            stamp(src, transfer)
            cpu, start = time.process_time(), time.perf_counter()
            sock.sendall(data)
            if sock.recv(1) != ACK:
                raise ConnectionError("no acknowledgement")
            records.append({"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu})
    return {"records": records, "so_sndbuf": sndbuf}


def zmq_receive(ctl: Connection, p: dict[str, Any]) -> dict[str, Any]:
    if p.get("heap_without_mmap"):
        heap_without_mmap()
    nbytes, assemble = p["nbytes"], p.get("assemble", False)
    ctx = zmq.Context(1)
    records = []
    try:
        sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        if p.get("rcvbuf"):
            sock.setsockopt(zmq.RCVBUF, p["rcvbuf"])
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        ctl.send(("ready", f"tcp://127.0.0.1:{port}"))
        dst = prefaulted(nbytes) if assemble else None
        for transfer in range(p["transfers"]):
            faults, cpu = minor_faults(), time.process_time()
            ident, *frames = sock.recv_multipart(copy=bool(p.get("copy_recv")))
            buffers = [memoryview(f) if isinstance(f, bytes) else f.buffer for f in frames]
            address = np.frombuffer(buffers[0], np.uint8).ctypes.data
            if assemble:  # one contiguous array out of the frames
                flat = dst.view(np.uint8)
                offset = 0
                for buf in buffers:
                    flat[offset:offset + len(buf)] = np.frombuffer(buf, np.uint8)
                    offset += len(buf)
                arr = dst
            else:
                arr = np.frombuffer(buffers[0], np.float32) if len(buffers) == 1 else None
            first = np.frombuffer(buffers[0], np.float32, count=1)[0]
            last = np.frombuffer(buffers[-1], np.float32)[-1]
            check(first, last, transfer)
            aliased = to_jax(arr) if p.get("to_jax") and arr is not None else None
            del buffers, frames, arr
            sock.send_multipart([ident, ACK])
            records.append({"faults": minor_faults() - faults, "cpu": time.process_time() - cpu,
                            "jax_aliased": aliased, "frame_address_mod_64": address % 64})
        sock.close(linger=0)
    finally:
        ctx.term()
    return {"records": records}


def zmq_send(ctl: Connection, p: dict[str, Any]) -> dict[str, Any]:
    nbytes, chunk, copy = p["nbytes"], p.get("frame_bytes"), p.get("copy_send", False)
    src = prefaulted(nbytes)
    ctx = zmq.Context(1)
    records = []
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        if p.get("sndbuf"):
            sock.setsockopt(zmq.SNDBUF, p["sndbuf"])
        sock.connect(p["address"])
        data = memoryview(src).cast("B")
        frames = [data[i:i + chunk] for i in range(0, nbytes, chunk)] if chunk else [data]
        for transfer in range(p["transfers"]):
            stamp(src, transfer)
            cpu, start = time.process_time(), time.perf_counter()
            if len(frames) == 1:
                sock.send(frames[0], copy=copy)
            else:
                sock.send_multipart(frames, copy=copy)
            if sock.recv() != ACK:
                raise ConnectionError("no acknowledgement")
            records.append({"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu})
        sock.close(linger=0)
    finally:
        ctx.term()
    return {"records": records}


@contextmanager
def mapped(path: str, nbytes: int) -> Iterator[np.ndarray]:
    """The shared segment as a float32 array (page-aligned, so JAX can alias it)."""
    fd = os.open(path, os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    try:
        yield np.frombuffer(mapping, np.float32)
    finally:
        try:
            mapping.close()
        except BufferError:  # the caller still holds a view: unmapped when that is collected
            pass


def chunks(nbytes: int, chunk: int | None) -> list[slice]:
    """float32 element ranges of ``chunk`` bytes each (one range: the whole array)."""
    step = (chunk or nbytes) // 4
    return [slice(i, min(i + step, nbytes // 4)) for i in range(0, nbytes // 4, step)]


def shm_receive(ctl: Connection, p: dict[str, Any]) -> dict[str, Any]:
    nbytes, mode = p["nbytes"], p.get("dst", "reused")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(f"\0pwmesh-transfer-{os.getpid()}-{uuid.uuid4().hex[:8]}")  # abstract: no file to clean up
        listener.listen(1)
        listener.settimeout(START_TIMEOUT_SECONDS)
        ctl.send(("ready", listener.getsockname()))
        sig, _ = listener.accept()
    finally:
        listener.close()
    fresh = Fresh("numpy", nbytes) if mode == "fresh" else None
    records = []
    with sig, mapped(p["path"], nbytes) as segment:
        sig.setblocking(True)
        dst = prefaulted(nbytes)
        for transfer in range(p["transfers"]):
            for i, part in enumerate(chunks(nbytes, p.get("chunk"))):
                if sig.recv(1) != b"w":
                    raise ConnectionError("no signal")
                if i == 0:
                    faults, cpu, start = minor_faults(), time.process_time(), time.perf_counter()
                    if fresh:
                        dst = fresh.new()
                if mode != "segment":  # "segment": no copy out, the reader uses (and JAX aliases) the segment
                    np.copyto(dst[part], segment[part])
            arr = segment if mode == "segment" else dst
            copy_out = time.perf_counter() - start
            check(arr[0], arr[-1], transfer)
            aliased = to_jax(arr) if p.get("to_jax") else None
            del arr
            sig.sendall(ACK)
            records.append({"faults": minor_faults() - faults, "cpu": time.process_time() - cpu,
                            "copy_out_seconds": copy_out, "jax_aliased": aliased})
        del dst, segment
    return {"records": records}


def shm_send(ctl: Connection, p: dict[str, Any]) -> dict[str, Any]:
    src = prefaulted(p["nbytes"])
    records = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sig, mapped(p["path"], p["nbytes"]) as segment:
        sig.connect(p["address"])
        parts = chunks(p["nbytes"], p.get("chunk"))
        for transfer in range(p["transfers"]):
            stamp(src, transfer)
            cpu, start = time.process_time(), time.perf_counter()
            for part in parts:  # one signal per chunk: the reader copies chunk i out while we copy i + 1 in
                np.copyto(segment[part], src[part])
                sig.sendall(b"w")
            copied = time.perf_counter()
            if sig.recv(1) != ACK:
                raise ConnectionError("no acknowledgement")
            end = time.perf_counter()
            records.append({"seconds": end - start, "cpu": time.process_time() - cpu,
                            "copy_in_seconds": copied - start})
        del segment
    return {"records": records}


JOBS: dict[tuple[str, str], Callable[[Connection, dict[str, Any]], dict[str, Any]]] = {
    ("tcp", "receiver"): tcp_receive, ("tcp", "sender"): tcp_send,
    ("zmq", "receiver"): zmq_receive, ("zmq", "sender"): zmq_send,
    ("shm", "receiver"): shm_receive, ("shm", "sender"): shm_send,
}


def worker_main(role: str, ctl: Connection) -> None:
    """A worker's loop: run jobs until told to stop (None) or the parent goes away."""
    while True:
        try:
            job = ctl.recv()
        except EOFError:
            return
        if job is None:
            return
        method, params = job
        try:
            ctl.send(("done", JOBS[(method, role)](ctl, params)))
        except Exception:
            ctl.send(("error", f"{role}, {method}: {traceback.format_exc()}"))


class Peers:
    """The sender and the receiver worker, spawned once and reused by every measurement.

    ``close()`` always stops both (ask, then SIGTERM, then SIGKILL), so a hung transfer
    never outlives the benchmark.
    """

    ROLES = ("sender", "receiver")

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: dict[str, BaseProcess] = {}
        self.conns: dict[str, Connection] = {}
        self.tainted: set[str] = set()  # workers whose process-wide state a job changed: restarted before the next

    def start(self) -> Peers:
        for role in self.ROLES:
            self.start_one(role)
        return self

    def start_one(self, role: str) -> None:
        ours, theirs = self.ctx.Pipe()
        proc = self.ctx.Process(target=worker_main, args=(role, theirs), name=f"transfer-{role}", daemon=True)
        proc.start()
        theirs.close()
        self.procs[role], self.conns[role] = proc, ours

    def taint(self, role: str) -> None:
        self.tainted.add(role)

    def expect(self, roles: list[str], kind: str, timeout_seconds: float) -> dict[str, Any]:
        """Each role's next message, which must be ``kind``; the first error, death or timeout raises at once."""
        pending = {self.conns[role]: role for role in roles}
        got: dict[str, Any] = {}
        deadline = time.monotonic() + timeout_seconds
        while pending:
            ready = wait(list(pending), max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"{', '.join(pending.values())}: no {kind!r} within {timeout_seconds:.0f} s")
            for conn in ready:
                role = pending.pop(conn)  # type: ignore[call-overload]
                try:
                    message, payload = conn.recv()  # type: ignore[union-attr]
                except EOFError:
                    raise RuntimeError(f"the {role} worker died") from None
                if message == "error":
                    raise RuntimeError(payload)
                if message != kind:
                    raise RuntimeError(f"{role}: expected {kind!r}, got {message!r}")
                got[role] = payload
        return got

    def run(self, method: str, params: dict[str, Any], timeout_seconds: float) -> tuple[dict[str, Any], dict[str, Any]]:
        """One job on both workers: the receiver listens, the sender connects and times. (sender, receiver) stats."""
        for role in sorted(self.tainted):
            self.stop_one(role)
            self.start_one(role)
        self.tainted.clear()
        self.conns["receiver"].send((method, params))
        address = self.expect(["receiver"], "ready", START_TIMEOUT_SECONDS)["receiver"]
        self.conns["sender"].send((method, {**params, "address": address}))
        done = self.expect(["sender", "receiver"], "done", START_TIMEOUT_SECONDS + timeout_seconds)
        return done["sender"], done["receiver"]

    def stop_one(self, role: str) -> None:
        proc, conn = self.procs.pop(role, None), self.conns.pop(role, None)
        if conn is not None:
            try:
                conn.send(None)
            except OSError:
                pass
            conn.close()
        if proc is None:
            return
        proc.join(5.0)
        if proc.is_alive():
            proc.terminate()
            proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join()

    def close(self) -> None:
        for role in self.ROLES:
            self.stop_one(role)

    def __enter__(self) -> Peers:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@contextmanager
def peers_for(peers: Peers | None) -> Iterator[Peers]:
    """The caller's workers, or a pair of our own for this one measurement."""
    if peers is not None:
        yield peers
        return
    with Peers() as own:
        yield own


# ---------------------------------------------------------------------------------------------------------------
# Measurements: one function per method, each -> a result row (dict), or None when not measured.


def job_timeout_seconds(nbytes: int, transfers: int) -> float:
    return 30.0 + transfers * nbytes / 20e6  # 20 MB/s: far below anything a working path does


def summarize(method: str, nbytes: int, options: dict[str, Any], sent: list[dict[str, Any]],
              received: list[dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any]:
    seconds = [r["seconds"] for r in sent]
    median, best = statistics.median(seconds), min(seconds)

    def med(records: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in records if r.get(key) is not None]
        return statistics.median(values) if values else None

    row: dict[str, Any] = {
        "method": method, "bytes": nbytes, "measured": True, "options": options,
        "seconds_median": median, "seconds_best": best,
        "gbytes_per_second": nbytes / median / 1e9, "gbytes_per_second_best": nbytes / best / 1e9,
        "transfers": len(seconds),
        "send_cpu_seconds_median": med(sent, "cpu"),
        "recv_cpu_seconds_median": med(received, "cpu"),
        "recv_minor_faults_median": med(received, "faults"),
        "samples_seconds": seconds,
    }
    for key in ("recv_calls", "copy_out_seconds"):
        if med(received, key) is not None:
            row[f"{key}_median"] = med(received, key)
    if med(received, "frame_address_mod_64") is not None:
        row["frame_address_mod_64"] = med(received, "frame_address_mod_64")
    if med(sent, "copy_in_seconds") is not None:
        row["copy_in_seconds_median"] = med(sent, "copy_in_seconds")
    aliased = {r["jax_aliased"] for r in received if r.get("jax_aliased") is not None}
    if aliased:
        row["jax_aliased"] = aliased == {True}
    row.update(extra)
    return row


def measure(method: str, nbytes: int, repeats: int, peers: Peers | None, options: dict[str, Any],
            warmup: int = 2, params: dict[str, Any] | None = None) -> dict[str, Any]:
    transfers = warmup + repeats
    job = {"nbytes": nbytes, "transfers": transfers, **options, **(params or {})}
    with peers_for(peers) as workers:
        if options.get("heap_without_mmap"):  # mallopt needs a fresh process, and taints it for life
            workers.taint("receiver")
        sent, received = workers.run(method, job, job_timeout_seconds(nbytes, transfers))
        if options.get("heap_without_mmap"):
            workers.taint("receiver")
    extra = {k: v for k, v in {**sent, **received}.items() if k != "records"}
    return summarize(method, nbytes, options, sent["records"][warmup:], received["records"][warmup:], extra)


def measure_tcp(nbytes: int, repeats: int, *, peers: Peers | None = None, warmup: int = 2,
                **options: Any) -> dict[str, Any]:
    """Raw TCP on 127.0.0.1. Options: dst ("numpy"/"mmap": fresh memory per transfer instead of the
    reused buffer), recv_chunk (bytes per recv_into), rcvbuf/sndbuf (SO_RCVBUF/SO_SNDBUF), to_jax."""
    return measure("tcp", nbytes, repeats, peers, options, warmup)


def measure_zmq(nbytes: int, repeats: int, *, peers: Peers | None = None, warmup: int = 2,
                **options: Any) -> dict[str, Any]:
    """pyzmq DEALER -> ROUTER on tcp://127.0.0.1, copy=False both ends. Options: copy_send, copy_recv,
    frame_bytes (a multipart message of frames this size), assemble (copy the frames into one reused
    array), rcvbuf/sndbuf (zmq.RCVBUF/SNDBUF), heap_without_mmap (glibc mallopt in the receiver), to_jax."""
    return measure("zmq", nbytes, repeats, peers, options, warmup)


def measure_shm(nbytes: int, repeats: int, *, peers: Peers | None = None, warmup: int = 2,
                **options: Any) -> dict[str, Any]:
    """A /dev/shm segment created once, reused by every transfer: copy in, signal, copy out, ack.
    Options: dst ("reused", "fresh": np.empty per transfer, "segment": no copy out), chunk (copy and
    signal in chunks of this many bytes, so the reader's copy out overlaps the writer's copy in), to_jax."""
    path = f"/dev/shm/pwmesh-transfer-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        os.close(fd)
        return measure("shm", nbytes, repeats, peers, options, warmup, {"path": path})
    finally:
        os.unlink(path)


# ---- pwmesh: HOOK for the executor-to-executor data plane -----------------------------------------------------
class _PwmeshSetup:
    """One embedded cluster per data path, started on first use and kept for every round: two
    islands of one executor with one device each; the array moves from island 0 to island 1."""

    def __init__(self, shared_memory: bool, security: str = "") -> None:
        import pwmesh as pw  # noqa: PLC0415 - the baselines run without it
        from pwmesh.service import keys  # noqa: PLC0415

        args = () if shared_memory else ("--no-shared-memory",)
        args += ("--data-plane-plaintext",) if security == "authed" else ()
        self.keys_dir = tempfile.mkdtemp(prefix="pwmesh-bench-keys-") if security else ""
        if self.keys_dir:
            keys.init(self.keys_dir)  # the client shows the cluster's own pair
        self.pw = pw
        self.cluster = pw.LocalCluster(pw.LocalClusterSpec(islands=2, hosts_per_island=1, devices_per_host=1,
                                                           executor_args=args, keys=self.keys_dir))
        self.cluster.start()
        self.client = pw.Client(self.cluster.address, name="bench-transfer", keys=self.keys_dir or None)
        devs = self.client.make_virtual_device_set()
        self.source, self.dest = devs.add_slice(devices=1, island=0), devs.add_slice(devices=1, island=1)
        self.arrays: dict[int, Any] = {}

    def array(self, nbytes: int) -> Any:
        if nbytes not in self.arrays:
            x = self.client.put(np.arange(nbytes // 4, dtype=np.float32), self.source)
            x.block_until_ready()
            self.arrays[nbytes] = x
        return self.arrays[nbytes]

    def close(self) -> None:
        self.client.close()
        self.cluster.stop()
        if self.keys_dir:
            shutil.rmtree(self.keys_dir, ignore_errors=True)


_PWMESH: dict[tuple[bool, str], _PwmeshSetup] = {}


def close_pwmesh() -> None:
    while _PWMESH:
        _PWMESH.popitem()[1].close()


def measure_pwmesh(nbytes: int, repeats: int, *, peers: Peers | None = None, warmup: int = 2,
                   shared_memory: bool = False, security: str = "", **options: Any) -> dict[str, Any]:
    """pwmesh, executor to executor across islands: ``pw.reshard`` of a buffer on island 0's executor
    onto island 1's, timed from the call to the destination buffer being ready (one program: the
    proxy's dispatch, the data plane, the completion coming back). ``shared_memory=False`` (the
    executors run with --no-shared-memory) is the path between hosts: a raw TCP stream into pooled,
    pre-faulted, page-aligned buffers that JAX adopts without a copy; ``True`` is one machine's path
    through /dev/shm. ``security``: "" (no keys), "sealed" or "authed" (see ``METHODS``)."""
    setup = _PWMESH.get((shared_memory, security))
    if setup is None:
        setup = _PWMESH[(shared_memory, security)] = _PwmeshSetup(shared_memory, security)
    x = setup.array(nbytes)
    records = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        y = setup.pw.reshard(x, devices=setup.dest)
        y.block_until_ready()
        seconds = time.perf_counter() - start
        y.delete()
        if i >= warmup:
            records.append({"seconds": seconds})
    # Back to back: ``repeats`` moves dispatched at once, so one's fixed cost (dispatch, completion)
    # overlaps the others' bytes: the bandwidth the data plane sustains.
    start = time.perf_counter()
    moved = [setup.pw.reshard(x, devices=setup.dest) for _ in range(repeats)]
    for y in moved:
        y.block_until_ready()
    pipelined = time.perf_counter() - start
    for y in moved:
        y.delete()
    method = "pwmesh-shm" if shared_memory else {"": "pwmesh", "sealed": "pwmesh-sealed",
                                                  "authed": "pwmesh-authed"}[security]
    return summarize(method, nbytes, options, records, [], {
        "pipelined_transfers": repeats, "pipelined_gbytes_per_second": repeats * nbytes / pipelined / 1e9})


def control_under_bulk(nbytes: int, transfers: int, pings: int) -> dict[str, Any]:
    """Ping round trips to the receiving executor's control socket, idle and while ``transfers`` bulk
    moves of ``nbytes`` stream into it over TCP: control must not queue behind bulk data."""
    from pwmesh.cli.commands import fetch_status  # noqa: PLC0415
    from pwmesh.client.connection import ClientConnection  # noqa: PLC0415
    from pwmesh.wire.messages import Ping  # noqa: PLC0415

    setup = _PWMESH.get((False, "")) or _PWMESH.setdefault((False, ""), _PwmeshSetup(False))
    x = setup.array(nbytes)
    dest = next(e for e in fetch_status(setup.cluster.address).cluster.executors if e.island == 1)
    conn = ClientConnection(dest.control, name="bench-ping", open_session=False)

    def rtt() -> float:
        start = time.perf_counter()
        conn.request(Ping(), timeout_seconds=30.0)
        return time.perf_counter() - start

    try:
        idle = [rtt() for _ in range(pings)]
        busy: list[float] = []
        moved = [setup.pw.reshard(x, devices=setup.dest) for _ in range(transfers)]  # dispatched at once
        start = time.perf_counter()
        while not all(y.is_ready() for y in moved) and len(busy) < 10 * pings:
            busy.append(rtt())
        for y in moved:
            y.block_until_ready()
        seconds = time.perf_counter() - start
        for y in moved:
            y.delete()
    finally:
        conn.close()
    return {"bytes": nbytes, "transfers": transfers, "bulk_seconds": seconds,
            "bulk_gbytes_per_second": transfers * nbytes / seconds / 1e9,
            "idle_ping_ms_median": 1000 * statistics.median(idle), "busy_pings": len(busy),
            "busy_ping_ms_median": 1000 * statistics.median(busy) if busy else None,
            "busy_ping_ms_max": 1000 * max(busy) if busy else None}


def measure_pwmesh_shm(nbytes: int, repeats: int, *, peers: Peers | None = None, warmup: int = 2,
                       **options: Any) -> dict[str, Any]:
    return measure_pwmesh(nbytes, repeats, peers=peers, warmup=warmup, shared_memory=True, **options)


def measure_pwmesh_sealed(nbytes: int, repeats: int, *, peers: Peers | None = None, warmup: int = 2,
                          **options: Any) -> dict[str, Any]:
    return measure_pwmesh(nbytes, repeats, peers=peers, warmup=warmup, security="sealed", **options)


def measure_pwmesh_authed(nbytes: int, repeats: int, *, peers: Peers | None = None, warmup: int = 2,
                          **options: Any) -> dict[str, Any]:
    return measure_pwmesh(nbytes, repeats, peers=peers, warmup=warmup, security="authed", **options)


# ---------------------------------------------------------------------------------------------------------------


MEASURES: dict[str, Callable[..., dict[str, Any] | None]] = {
    "tcp": measure_tcp, "zmq": measure_zmq, "shm": measure_shm, "pwmesh": measure_pwmesh,
    "pwmesh-shm": measure_pwmesh_shm, "pwmesh-sealed": measure_pwmesh_sealed, "pwmesh-authed": measure_pwmesh_authed}

# One knob at a time, at the largest size: (method, label, options). The first of each method is its baseline.
VARIANTS: list[tuple[str, str, dict[str, Any]]] = [
    ("tcp", "baseline: recv_into reused buffer, unbounded recv", {}),
    ("tcp", "fresh np.empty per transfer (THP-madvised)", {"dst": "numpy"}),
    ("tcp", "fresh anonymous mmap per transfer (4 KiB pages, like malloc)", {"dst": "mmap"}),
    ("tcp", "recv_into 64 KiB at a time", {"recv_chunk": 64 * KiB}),
    ("tcp", "recv_into 256 KiB at a time", {"recv_chunk": 256 * KiB}),
    ("tcp", "recv_into 1 MiB at a time", {"recv_chunk": MiB}),
    ("tcp", "recv_into 4 MiB at a time", {"recv_chunk": 4 * MiB}),
    ("tcp", "SO_RCVBUF 256 KiB (no autotuning)", {"rcvbuf": 256 * KiB}),
    ("tcp", "SO_RCVBUF 4 MiB (no autotuning)", {"rcvbuf": 4 * MiB}),
    ("tcp", "SO_SNDBUF 4 MiB", {"sndbuf": 4 * MiB}),
    ("tcp", "SO_RCVBUF + SO_SNDBUF 4 MiB", {"rcvbuf": 4 * MiB, "sndbuf": 4 * MiB}),
    ("tcp", "-> JAX: reused page-aligned buffer, device_put aliases", {"to_jax": True}),
    ("tcp", "-> JAX: fresh np.empty (page-aligned), device_put aliases", {"dst": "numpy", "to_jax": True}),
    ("zmq", "baseline: one frame, copy=False both ends", {}),
    ("zmq", "send copy=True", {"copy_send": True}),
    ("zmq", "recv copy=True (bytes)", {"copy_recv": True}),
    ("zmq", "zmq.SNDBUF + RCVBUF 4 MiB", {"sndbuf": 4 * MiB, "rcvbuf": 4 * MiB}),
    ("zmq", "1 MiB frames (multipart), left as frames", {"frame_bytes": MiB}),
    ("zmq", "4 MiB frames (multipart), left as frames", {"frame_bytes": 4 * MiB}),
    ("zmq", "16 MiB frames (multipart), left as frames", {"frame_bytes": 16 * MiB}),
    ("zmq", "one frame, copied into a reused array", {"assemble": True}),
    ("zmq", "1 MiB frames, copied into a reused array", {"frame_bytes": MiB, "assemble": True}),
    ("zmq", "4 MiB frames, copied into a reused array", {"frame_bytes": 4 * MiB, "assemble": True}),
    ("zmq", "one frame, glibc malloc without mmap (buffers reused)", {"heap_without_mmap": True}),
    ("zmq", "-> JAX: 1 MiB frames into a reused aligned array + device_put",
     {"frame_bytes": MiB, "assemble": True, "to_jax": True}),
    ("zmq", "-> JAX: np.frombuffer(frame) + device_put", {"to_jax": True}),
    ("zmq", "-> JAX: 4 MiB frames into a reused aligned array + device_put",
     {"frame_bytes": 4 * MiB, "assemble": True, "to_jax": True}),
    ("shm", "baseline: copy in, copy out into reused array", {}),
    ("shm", "copy out into fresh np.empty", {"dst": "fresh"}),
    ("shm", "pipelined: 4 MiB chunks, copy out overlaps copy in", {"chunk": 4 * MiB}),
    ("shm", "pipelined: 1 MiB chunks", {"chunk": MiB}),
    ("shm", "-> JAX: copy out into reused aligned array + device_put", {"to_jax": True}),
    ("shm", "-> JAX: 4 MiB chunks pipelined into reused aligned array + device_put",
     {"chunk": 4 * MiB, "to_jax": True}),
    ("shm", "-> JAX: no copy out, device_put aliases the segment (1 copy)", {"dst": "segment", "to_jax": True}),
]


# --smoke runs one variant per code path, but not the mallopt one: it needs a fresh receiver process (~2 s).
SMOKE_VARIANTS = (
    "fresh np.empty per transfer (THP-madvised)",
    "fresh anonymous mmap per transfer (4 KiB pages, like malloc)",
    "recv_into 64 KiB at a time",
    "SO_RCVBUF + SO_SNDBUF 4 MiB",
    "-> JAX: reused page-aligned buffer, device_put aliases",
    "send copy=True",
    "recv copy=True (bytes)",
    "zmq.SNDBUF + RCVBUF 4 MiB",
    "-> JAX: np.frombuffer(frame) + device_put",
    "-> JAX: 1 MiB frames into a reused aligned array + device_put",
    "copy out into fresh np.empty",
    "-> JAX: 4 MiB chunks pipelined into reused aligned array + device_put",
    "-> JAX: no copy out, device_put aliases the segment (1 copy)",
)


def not_measured(method: str, nbytes: int) -> dict[str, Any]:
    return {"method": method, "bytes": nbytes, "measured": False, "seconds_median": None, "seconds_best": None,
            "gbytes_per_second": None, "gbytes_per_second_best": None, "note": "not measured"}


def pool(rows: list[dict[str, Any] | None], method: str, nbytes: int) -> dict[str, Any]:
    """One row out of the same measurement's rounds: samples pooled, medians of the per-round medians."""
    got = [r for r in rows if r is not None]
    if not got:
        return not_measured(method, nbytes)
    if len(got) == 1:
        return {**got[0], "rounds": 1}
    samples = [s for r in got for s in r["samples_seconds"]]
    median, best = statistics.median(samples), min(samples)
    row = dict(got[0])
    for key, value in got[0].items():
        if key.endswith("_median") and key != "seconds_median" and value is not None:
            row[key] = statistics.median(r[key] for r in got)
    if got[0].get("pipelined_gbytes_per_second") is not None:
        row["pipelined_gbytes_per_second"] = statistics.median(r["pipelined_gbytes_per_second"] for r in got)
    row.update({"seconds_median": median, "seconds_best": best, "gbytes_per_second": nbytes / median / 1e9,
                "gbytes_per_second_best": nbytes / best / 1e9, "transfers": len(samples),
                "samples_seconds": samples, "rounds": len(got),
                "load_average_1m": [r.get("load_average_1m") for r in got]})
    return row


def run_rounds(jobs: list[tuple[str, int, str, dict[str, Any]]], config: Config,
               peers: Peers) -> list[dict[str, Any]]:
    """Every job once per round, rounds alternating the order; one pooled row per job."""
    got: list[list[dict[str, Any] | None]] = [[] for _ in jobs]
    for r in range(config.rounds):
        order = list(range(len(jobs))) if r % 2 == 0 else list(reversed(range(len(jobs))))
        for i in order:
            method, nbytes, label, options = jobs[i]
            load = load_average()
            row = MEASURES[method](nbytes, config.repeats, peers=peers, warmup=config.warmup, **options)
            if row is not None:
                row["load_average_1m"] = load
            got[i].append(row)
    rows = []
    for (method, nbytes, label, _), results in zip(jobs, got, strict=True):
        rows.append({**pool(results, method, nbytes), "label": label})
    return rows


def ratios(rows: list[dict[str, Any]], sizes: tuple[int, ...],
           key: str = "gbytes_per_second") -> dict[str, dict[str, float | None]]:
    """Per size: each method's bandwidth (``key``: median or best) over raw TCP's (and pwmesh's over shm's)."""
    pairs = (("zmq", "tcp"), ("shm", "tcp"), ("pwmesh", "tcp"), ("pwmesh-shm", "shm"), ("pwmesh-sealed", "pwmesh"),
             ("pwmesh-authed", "pwmesh"))
    out: dict[str, dict[str, float | None]] = {}
    for nbytes in sizes:
        bw = {r["method"]: r[key] for r in rows if r["bytes"] == nbytes}
        out[size_label(nbytes)] = {f"{a}/{b}": (bw[a] / bw[b] if bw.get(a) and bw.get(b) else None)
                                   for a, b in pairs}
    return out


# ---------------------------------------------------------------------------------------------------------------
# In-process: memcpy, page faults, and JAX as the destination.


def best_seconds(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def local_costs(nbytes: int, repeats: int) -> list[dict[str, Any]]:
    """What one process pays per ``nbytes``: copying, faulting fresh memory in, handing it to JAX."""
    src = prefaulted(nbytes)
    dst = prefaulted(nbytes)
    unaligned_base = prefaulted(nbytes + 2 * JAX_ALIGNMENT)
    unaligned = unaligned_base.view(np.uint8)[16:16 + nbytes].view(np.float32)
    default_numpy = np.ones(nbytes // 4, np.float32)
    rows: list[dict[str, Any]] = []

    def add(name: str, fn: Callable[[], Any], note: str = "", **extra: Any) -> None:
        best, median = best_seconds(fn, repeats)
        rows.append({"operation": name, "bytes": nbytes, "seconds_best": best, "seconds_median": median,
                     "gbytes_per_second_best": nbytes / best / 1e9, "note": note, **extra})

    def fresh_mmap_copy() -> None:
        mapping = mmap.mmap(-1, nbytes)
        view = np.frombuffer(mapping, np.float32)
        np.copyto(view, src)
        del view
        mapping.close()

    def fresh_mmap_faults() -> None:
        mapping = mmap.mmap(-1, nbytes)
        view = np.frombuffer(mapping, np.uint8)
        view[::PAGE] = 1  # one write per page: the faults alone
        del view
        mapping.close()

    def put_block(arr: np.ndarray) -> Callable[[], None]:
        return lambda: jax.device_put(arr, may_alias=True).block_until_ready()

    def aliases(x: jax.Array, arr: np.ndarray) -> bool:
        return x.unsafe_buffer_pointer() == arr.ctypes.data

    add("np.copyto into a reused array (memcpy)", lambda: np.copyto(dst, src))
    add("np.empty + np.copyto (fresh, THP-madvised by numpy)", lambda: np.copyto(np.empty_like(src), src))
    add("anonymous mmap + np.copyto (fresh, 4 KiB pages)", fresh_mmap_copy)
    add("anonymous mmap + one write per 4 KiB page (faults only)", fresh_mmap_faults)
    add("np.empty + one write per 4 KiB page (faults only, THP)",
        lambda: np.empty(nbytes, np.uint8)[::PAGE].fill(1))
    add("jax.device_put(page-aligned numpy, may_alias=True)", put_block(src),
        aliased=aliases(jax.device_put(src, may_alias=True), src))
    add("jax.device_put(page-aligned numpy)  [default may_alias]",
        lambda: jax.device_put(src).block_until_ready(), aliased=aliases(jax.device_put(src), src))
    x = jax.device_put(src, may_alias=False)
    add("jax.device_put(page-aligned numpy, may_alias=False)",
        lambda: jax.device_put(src, may_alias=False).block_until_ready(), aliased=aliases(x, src),
        note="may_alias=False still aliases a numpy array here")
    add("jax.device_put(np.ones: numpy's 16-byte alignment)", put_block(default_numpy),
        aliased=aliases(jax.device_put(default_numpy, may_alias=True), default_numpy),
        address_mod_64=default_numpy.ctypes.data % 64)
    add("jax.device_put(16 bytes past a 64-byte boundary)", put_block(unaligned),
        aliased=aliases(jax.device_put(unaligned, may_alias=True), unaligned))
    add("jnp.asarray(page-aligned numpy)", lambda: jnp.asarray(src).block_until_ready(),
        aliased=aliases(jnp.asarray(src), src))
    held = jax.device_put(dst, may_alias=True)
    held.block_until_ready()
    src_view = np.asarray(held)
    add("np.asarray(JAX CPU array)", lambda: np.asarray(held), aliased=src_view.ctypes.data == held.unsafe_buffer_pointer(),
        note=f"writeable={src_view.flags.writeable}")
    dst[0] = -1.0  # aliasing means later writes to the numpy array show through the JAX array
    rows[-1]["jax_sees_later_numpy_writes"] = bool(held[0] == -1.0)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Output.


def size_label(nbytes: int) -> str:
    if nbytes % MiB == 0:
        return f"{nbytes // MiB} MiB"
    if nbytes % KiB == 0:
        return f"{nbytes // KiB} KiB"
    return f"{nbytes} B"


def parse_size(text: str) -> int:
    """'64' or '64M' -> 64 MiB; '256K' -> 256 KiB."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": KiB, "M": MiB, "G": 1 << 30}.get(text[-1:], None)
    return int(float(text[:-1]) * scale) if scale else int(float(text) * MiB)


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def highest_load(row: dict[str, Any]) -> float | None:
    """The highest 1-minute load average seen at the start of the row's rounds."""
    load = row.get("load_average_1m")
    if isinstance(load, list):
        return max((v for v in load if v is not None), default=None)
    return load


def main_table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        if not r["measured"]:
            lines.append([r["method"], size_label(r["bytes"]), "not measured", "", "", "", "", ""])
            continue
        lines.append([r["method"], size_label(r["bytes"]), fmt(r["gbytes_per_second"]),
                      fmt(r["gbytes_per_second_best"]), fmt(1000 * r["seconds_median"], ".1f"),
                      fmt(r["recv_minor_faults_median"], ".0f"), fmt(None if r["recv_cpu_seconds_median"] is None else 1000 * r["recv_cpu_seconds_median"], ".1f"),
                      fmt(highest_load(r))])
    return table(["method", "size", "GB/s median", "GB/s best", "ms median", "recv faults", "recv cpu ms",
                  "load 1m"], lines)


def ratio_table(ratio: dict[str, dict[str, float | None]]) -> str:
    keys = list(next(iter(ratio.values())).keys()) if ratio else []
    return table(["size", *keys], [[size, *[fmt(v) for v in r.values()]] for size, r in ratio.items()])


def variant_table(rows: list[dict[str, Any]]) -> str:
    base = {r["method"]: r["gbytes_per_second"] for r in reversed(rows) if r["label"].startswith("baseline")}
    lines = []
    for r in rows:
        extra = []
        if r.get("recv_calls_median") is not None:
            extra.append(f"{r['recv_calls_median']:.0f} recv")
        if r.get("copy_out_seconds_median") is not None:
            extra.append(f"in {1000 * r['copy_in_seconds_median']:.1f} / out {1000 * r['copy_out_seconds_median']:.1f} ms")
        if r.get("jax_aliased") is not None:
            extra.append("JAX aliased" if r["jax_aliased"] else "JAX copied")
        if r.get("frame_address_mod_64") is not None:
            extra.append(f"frame at 64k+{r['frame_address_mod_64']:.0f}")
        lines.append([r["method"], r["label"], fmt(r["gbytes_per_second"]), fmt(r["gbytes_per_second_best"]),
                      fmt(r["gbytes_per_second"] / base[r["method"]] if r["method"] in base else None),
                      fmt(1000 * r["seconds_median"], ".1f"),
                      fmt(r["recv_minor_faults_median"], ".0f"), fmt(None if r["recv_cpu_seconds_median"] is None else 1000 * r["recv_cpu_seconds_median"], ".1f"),
                      fmt(1000 * r["send_cpu_seconds_median"], ".1f"), ", ".join(extra)])
    return table(["method", "variant", "GB/s", "best", "x base", "ms", "recv faults", "recv cpu ms",
                  "send cpu ms", "notes"], lines)


def local_table(rows: list[dict[str, Any]]) -> str:
    return table(["operation", "ms best", "ms median", "GB/s best", "aliased", "note"],
                 [[r["operation"], fmt(1000 * r["seconds_best"], ".2f"), fmt(1000 * r["seconds_median"], ".2f"),
                   fmt(r["gbytes_per_second_best"]), {True: "yes", False: "no"}.get(r.get("aliased"), ""),
                   r.get("note", "")] for r in rows])


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    parts = [
        "# transfer: one float32 array between two processes",
        "",
        f"`python bench/transfer.py{' --smoke' if result['smoke'] else ''}` on {m['platform']}, {m['cpus']} CPUs, "
        f"load average (1 min) {m['load_average_1m_at_start']} at start, {m['load_average_1m_at_end']} at end. "
        f"Medians over {result['config']['rounds']} rounds x {result['config']['repeats']} transfers; "
        "GB/s = bytes / seconds / 1e9, timed by the sender from its first byte to the receiver's acknowledgement.",
        "",
        "## Bandwidth", "", "```", main_table(result["results"]), "```", "",
        "## Ratios (median GB/s; best GB/s below)", "", "```", ratio_table(result["ratios"]), "",
        ratio_table(result["ratios_best"]), "```",
    ]
    if result["variants"]:
        parts += ["", f"## Where the time goes ({size_label(result['variants'][0]['bytes'])}, one knob at a time)",
                  "", "```", variant_table(result["variants"]), "```"]
    if pipelined_line(result["results"]):
        parts += ["", pipelined_line(result["results"])]
    c = result.get("control_under_bulk")
    if c:
        parts += ["", "## Control under bulk (pwmesh)", "", control_line(c)]
    if result["local"]:
        parts += ["", f"## In one process ({size_label(result['local'][0]['bytes'])})", "", "```",
                  local_table(result["local"]), "```"]
    return "\n".join(parts) + "\n"


def pipelined_line(rows: list[dict[str, Any]]) -> str:
    parts = [f"{r['method']} {size_label(r['bytes'])} {fmt(r['pipelined_gbytes_per_second'])} GB/s"
             for r in rows if r.get("pipelined_gbytes_per_second") is not None]
    return "pwmesh moves dispatched back to back (fixed costs overlap): " + ", ".join(parts) if parts else ""


def control_line(c: dict[str, Any]) -> str:
    return (f"ping to the receiving executor's control socket: {fmt(c['idle_ping_ms_median'], '.2f')} ms idle, "
            f"{fmt(c['busy_ping_ms_median'], '.2f')} ms median / {fmt(c['busy_ping_ms_max'], '.2f')} ms max during "
            f"{c['transfers']} x {size_label(c['bytes'])} streaming into it ({c['busy_pings']} pings; bulk at "
            f"{fmt(c['bulk_gbytes_per_second'], '.2f')} GB/s)")


def plot(path: Path, result: dict[str, Any]) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    panels = 2 if result["variants"] else 1
    fig, axes = plt.subplots(1, panels, figsize=(7 + 7 * (panels - 1), 4.8 if panels == 1 else 7.5),
                             squeeze=False)
    ax = axes[0][0]
    sizes = result["config"]["sizes"]
    width = 0.8 / len(METHODS)
    for i, method in enumerate(METHODS):
        bws = [next((r["gbytes_per_second"] for r in result["results"]
                     if r["method"] == method and r["bytes"] == n), None) for n in sizes]
        xs = [j + (i - (len(METHODS) - 1) / 2) * width for j in range(len(sizes))]
        ax.bar(xs, [b or 0.0 for b in bws], width, label=method if any(bws) else f"{method} (not measured)")
    ax.set_xticks(range(len(sizes)), [size_label(n) for n in sizes])
    ax.set_ylabel("GB/s (median)")
    ax.set_title("one array between two processes", fontsize=10)
    ax.legend()
    if panels == 2:
        ax = axes[0][1]
        rows = result["variants"]
        colors = {"tcp": "C0", "zmq": "C1", "shm": "C2"}
        bars = ax.barh(range(len(rows)), [r["gbytes_per_second"] for r in rows],
                       color=[colors.get(r["method"], "C3") for r in rows])
        for bar, r in zip(bars, rows, strict=True):  # CPU time and faults hold up under a neighbour's load
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                    f" {1000 * r['recv_cpu_seconds_median']:.0f} ms cpu, {r['recv_minor_faults_median']:.0f} faults",
                    va="center", fontsize=6)
        ax.set_yticks(range(len(rows)), [f"{r['method']}: {r['label']}" for r in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("GB/s (median); receiver CPU ms and page faults per transfer")
        ax.set_xlim(right=ax.get_xlim()[1] * 1.3)
        ax.set_title(f"one knob at a time, {size_label(rows[0]['bytes'])}", fontsize=10)
    return save_figure(fig, path)


def host_settings() -> dict[str, str]:
    """Kernel knobs that bound these numbers."""
    files = {"thp_enabled": "/sys/kernel/mm/transparent_hugepage/enabled",
             "thp_defrag": "/sys/kernel/mm/transparent_hugepage/defrag",
             "tcp_rmem": "/proc/sys/net/ipv4/tcp_rmem", "tcp_wmem": "/proc/sys/net/ipv4/tcp_wmem",
             "rmem_max": "/proc/sys/net/core/rmem_max", "wmem_max": "/proc/sys/net/core/wmem_max"}
    out = {}
    for key, name in files.items():
        try:
            out[key] = Path(name).read_text().strip().replace("\t", " ")
        except OSError:
            out[key] = "?"
    return out


def run(config: Config, smoke: bool) -> dict[str, Any]:
    started = time.monotonic()
    load_at_start = load_average()
    jobs = [(method, n, "", {}) for n in config.sizes for method in METHODS]
    with Peers() as peers:
        print(f"{len(config.sizes)} sizes x {len(METHODS)} methods x {config.rounds} rounds "
              f"x {config.repeats} transfers ...", flush=True)
        rows = run_rounds(jobs, config, peers)
        variants: list[dict[str, Any]] = []
        if config.variants:
            largest = max(config.sizes)
            chosen = ([next(v for v in VARIANTS if v[1] == label) for label in SMOKE_VARIANTS] if smoke
                      else VARIANTS)
            print(f"{len(chosen)} variants at {size_label(largest)} ...", flush=True)
            variants = run_rounds([(m, largest, label, opts) for m, label, opts in chosen], config, peers)
    print("in-process costs ...", flush=True)
    local = local_costs(max(config.sizes), config.local_repeats)
    print("control pings under bulk transfers ...", flush=True)
    control = control_under_bulk(max(config.sizes), 2 if smoke else 8, 5 if smoke else 30)
    return {
        "benchmark": "transfer",
        "smoke": smoke,
        "config": {**dataclasses.asdict(config), "sizes": list(config.sizes)},
        "machine": {**machine(load_at_start), "host": host_settings()},
        "results": rows,
        "ratios": ratios(rows, config.sizes),
        "ratios_best": ratios(rows, config.sizes, "gbytes_per_second_best"),
        "variants": variants,
        "local": local,
        "control_under_bulk": control,
        "wall_seconds": time.monotonic() - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=None, help="array sizes, MiB unless suffixed K/M: e.g. 4,64 or 256K,1M")
    parser.add_argument("--repeats", type=int, default=None, help="timed transfers per method, size and round")
    parser.add_argument("--rounds", type=int, default=None, help="rounds alternating the methods")
    parser.add_argument("--warmup", type=int, default=None, help="untimed transfers before each measurement")
    parser.add_argument("--variants", action=argparse.BooleanOptionalAction, default=None,
                        help="the one-knob-at-a-time runs at the largest size (default: on)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds) to check that everything works")
    args = parser.parse_args(argv)

    config = (Config(sizes=(64 * KiB, MiB), repeats=3, warmup=1, rounds=1, local_repeats=2)
              if args.smoke else Config())
    if args.sizes:
        config.sizes = tuple(parse_size(s) for s in args.sizes.split(","))
    for field in ("repeats", "rounds", "warmup", "variants"):
        if getattr(args, field) is not None:
            setattr(config, field, getattr(args, field))

    try:
        result = run(config, args.smoke)
    finally:
        close_pwmesh()
    print()
    print(main_table(result["results"]))
    print()
    print(ratio_table(result["ratios"]))
    print("best:")
    print(ratio_table(result["ratios_best"]))
    if result["variants"]:
        print(f"\nwhere the time goes ({size_label(max(config.sizes))}, one knob at a time):")
        print(variant_table(result["variants"]))
    if pipelined_line(result["results"]):
        print("\n" + pipelined_line(result["results"]))
    if result.get("control_under_bulk"):
        print("\n" + control_line(result["control_under_bulk"]))
    print(f"\nin one process ({size_label(max(config.sizes))}):")
    print(local_table(result["local"]))
    md = args.out / "transfer.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(markdown(result))
    print(f"\nwrote {md}")
    save_results(args.out, "transfer", result, lambda path: plot(path, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
