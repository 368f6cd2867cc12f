"""Helpers shared by the tests that start their own clusters, and the leak checks every
test of a cluster gets (conftest.py applies them)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zmq
from jax.sharding import PartitionSpec as P

import pwmesh as pw
from pwmesh.cli.commands import debug_events, fetch_status
from pwmesh.client.connection import ClientConnection
from pwmesh.wire import Message, decode, encode
from pwmesh.wire.messages import Ping, Pong
from pwmesh.wire.records import ExecutorInfo


def slow(x):
    # Some tenths of a second of real work on one CPU core (0.4 s here), more on a busy one.
    m = jnp.full((192, 192), 0.01, jnp.float32)
    v = jnp.full((192, 192), 0.5, jnp.float32) * x
    return jax.lax.fori_loop(0, 3000, lambda i, a: jnp.tanh(a @ m), v).sum()


def last_event(address: str, daemon: str, starts: str) -> float:
    """When ``daemon``'s core last handled an event whose line starts with ``starts`` (its event log, ``pwmesh
    debug events``), on the host's monotonic clock: the same in every process here, so daemons' and the test's
    times compare. Read afterwards, an order is asserted without sampling a transient state."""
    times = [float(line.split(" ", 2)[0]) for line in debug_events(address, daemon, 0).splitlines()[1:]
             if line.split(" ", 2)[2].startswith(starts)]
    assert times, f"{daemon} logged no {starts}"
    return times[-1]


def frees_settled(client: pw.Client) -> list[pw.Array]:
    """Once this returns, every free issued so far has reached every live executor: the releases of arrays
    dropped earlier (batched in ``client``) and the frees of sessions ended earlier go to the executors
    through their island's scheduler, and a run over every device of each island, fetched, is behind all of
    them on every scheduler-to-executor link. For a baseline of what the executors hold (a status reads them
    directly, so it may overtake a free). Keep the arrays returned until the last reading: the runs' inputs
    and outputs (they make no temporaries: nothing of theirs is freed later)."""
    gc.collect()
    islands: dict[int, list[ExecutorInfo]] = {}
    for e in client.status().cluster.executors:
        if e.alive and not e.draining:
            islands.setdefault(e.island, []).append(e)
    devs = client.make_virtual_device_set()
    held = []
    for island, executors in sorted(islands.items()):
        n = sum(len(e.devices) for e in executors)
        sl = devs.add_slice(devices=n, island=island)
        assert {d.executor for d in sl.devices} == {e.executor_id for e in executors}, "a run on each executor"
        # Split over every device (so fetching y reads a piece from every executor) and laid out as the call takes
        # it: a reshard would make temporaries, freed at the run's end, which may come after its value.
        split = P(next(iter(sl.mesh)))
        x = client.put(np.zeros(n, np.float32), sl, split)
        y = pw.jit(lambda v: v + 1.0, devices=sl, in_specs=split, out_specs=split)(x)
        np.testing.assert_array_equal(np.asarray(y), np.ones(n, np.float32))
        held += [x, y]
    return held


def eventually(condition: Callable[[], bool], timeout_seconds: float) -> None:
    """Re-check ``condition`` until it holds. Only for states a daemon reports on request
    and pushes to nobody (an executor's outstanding work, its lifecycle status)."""
    deadline = time.monotonic() + timeout_seconds
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_seconds} seconds")
        time.sleep(0.02)


def admitted(address: str, keys: Path) -> bool:
    """Whether a connection with ``keys`` gets through to the daemon at ``address`` now (a key added counts
    from the daemons' next read of ``authorized/``)."""
    try:
        ClientConnection(address, name="probe", open_session=False, probe=True, keys=str(keys),
                         connect_timeout_seconds=1.5).close()
    except pw.ConnectionFailed:
        return False
    return True


def refused(conn: ClientConnection, message: Message) -> bool:
    """Whether ``conn``'s ``message`` is now refused with ``PermissionDenied`` (its key was removed)."""
    try:
        conn.request(message, timeout_seconds=5.0)
    except pw.PermissionDenied:
        return True
    return False


def reap(proc: subprocess.Popen[Any]) -> None:
    """Kill ``proc`` if a failed assertion left it running; close its pipes."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def ping_status(address: str) -> str:
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(address)
        sock.send_multipart([b"", *encode(Ping(), msg_id=1)])
        reply = decode(sock.recv_multipart()[1:]).message
    assert isinstance(reply, Pong)
    return reply.status


def out_of_memory(x):
    """Materialises 4 TiB on the executor: XLA fails at run time (RESOURCE_EXHAUSTED), on the remote host."""
    return x + jnp.sort(jnp.arange(2**40, dtype=jnp.float32))[:1]


def fails_across_islands(client: pw.Client) -> tuple[pw.Slice, pw.Array]:
    """A program whose node on island 0 runs out of memory (``out_of_memory`` on both of its devices) and whose
    node on island 1 reads that: both outputs fail with the cause and its remote traceback (asserted here).
    Returns island 0's slice and the downstream output."""
    devs = client.make_virtual_device_set()
    s0, s1 = devs.add_slice(devices=2, island=0), devs.add_slice(devices=2, island=1)
    bad = pw.pmap(out_of_memory, devices=s0)
    after = pw.pmap(lambda x: x * 2.0, devices=s1)

    @pw.program
    def f(v):
        x = bad(v)
        return x, after(x)

    x, y = f(np.array([1.0, 2.0]))
    for arr in (x, y):  # the downstream node on the other island fails too, with the cause
        with pytest.raises(pw.RemoteError) as info:
            np.asarray(arr)
        assert "RESOURCE_EXHAUSTED" in str(info.value)
        assert "Remote traceback" in str(info.value) and info.value.remote_traceback
    return s0, y


def slow_then_after(client: pw.Client, address: str) -> tuple[Any, pw.Slice, pw.Slice, pw.Array, pw.Array]:
    """``x = slow(v)`` on host0 feeds ``after(x)`` on host1 in one program; returns
    ``(program, on0, on1, x, y)`` once host0 reports it is computing."""
    devs = client.make_virtual_device_set()
    on0, on1 = devs.add_slice(devices=1), devs.add_slice(devices=1)
    assert (on0.devices[0].executor, on1.devices[0].executor) == ("island0-host0", "island0-host1")
    remote_slow = pw.pmap(slow, devices=on0)
    after = pw.pmap(lambda s: s + 1.0, devices=on1)

    @pw.program
    def f(v):
        x = remote_slow(v)
        return x, after(x)

    x, y = f(np.ones(1))
    eventually(lambda: fetch_status(address).executor_stats[0].outstanding == 1, 30)
    return f, on0, on1, x, y


# ------------------------------------------------------------------ leak checks
#
# In the manner of dask's ``gen_cluster`` (``check_thread_leak``, ``check_process_leak``,
# ``check_instances``): what a test or a cluster fixture took must be given back once it is
# done, after a bounded grace period spent waiting on the resources themselves.

# A cluster's daemons drain before they exit and a client's I/O thread finishes its last
# poll: on a busy 2-core machine that can take seconds. Only a real leak waits this long.
# The ``fragile`` cluster's (conftest): a lost host is written off within a test's patience.
HEARTBEAT_TIMEOUT_SECONDS = 2.0
LEAK_GRACE_SECONDS = 15.0
# How often file descriptors and contexts (which signal nothing when released) are looked at again.
LEAK_RECHECK_SECONDS = 0.05

_contexts: weakref.WeakKeyDictionary[zmq.Context[Any], str] = weakref.WeakKeyDictionary()
_contexts_lock = threading.Lock()
_context_serial = itertools.count(1)


def track_zmq_contexts() -> None:
    """Record every ZeroMQ context made from now on, and where (pyzmq keeps no list of them).

    Called once, before any test runs; shadow contexts own nothing and are left out."""
    original = zmq.Context.__init__
    if getattr(original, "tracked_by_pwmesh_tests", False):
        return

    @functools.wraps(original)
    def init(self: zmq.Context[Any], *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not self._shadow:
            label = f"context #{next(_context_serial)} made at {_call_site()}"
            with _contexts_lock:
                _contexts[self] = label

    init.tracked_by_pwmesh_tests = True  # type: ignore[attr-defined]
    zmq.Context.__init__ = init  # type: ignore[method-assign]


def start_zmq_garbage_collector() -> None:
    """Start pyzmq's garbage collector now, with one zero-copy send.

    It frees zero-copy frames once ZeroMQ is done with them, with a thread, a context and
    sockets of its own that it starts at the first such send and keeps for the life of the
    process: started before any test, it is in every check's "before" rather than charged as
    a leak to whichever test first sent a big frame."""
    big = b"\0" * (4 * zmq.COPY_THRESHOLD)  # copy=False copies frames below the threshold
    with zmq.Context() as ctx, ctx.socket(zmq.PAIR) as out, ctx.socket(zmq.PAIR) as into:
        out.bind("inproc://warm-the-zmq-gc")
        into.connect("inproc://warm-the-zmq-gc")
        out.send(big, copy=False)
        into.recv()
    assert zmq.utils.garbage.gc.is_alive()


def _call_site() -> str:
    """The innermost frames outside pyzmq, pytest, threading and this file: who made the context."""
    skip = (f"{os.sep}zmq{os.sep}", f"{os.sep}_pytest{os.sep}", f"{os.sep}pluggy{os.sep}", threading.__file__, __file__)
    frames = [f for f in traceback.extract_stack(sys._getframe(2), limit=16)
              if not any(part in f.filename for part in skip)]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} ({f.name})" for f in reversed(frames[-3:]))


@dataclasses.dataclass(frozen=True)
class Resources:
    """What this process holds that a test or a cluster could leave behind."""

    threads: frozenset[threading.Thread] = frozenset()
    children: frozenset[tuple[int, str]] = frozenset()  # (pid, command line) of live child processes
    fds: frozenset[tuple[int, str]] = frozenset()  # (descriptor, what it refers to)
    contexts: frozenset[str] = frozenset()  # open ZeroMQ contexts, by label (serial and maker)

    def _combine(self, other: Resources, op: Callable[[frozenset[Any], frozenset[Any]], frozenset[Any]]) -> Resources:
        return Resources(*(op(getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self)))

    def __sub__(self, other: Resources) -> Resources:
        return self._combine(other, frozenset.__sub__)

    def __or__(self, other: Resources) -> Resources:
        return self._combine(other, frozenset.__or__)

    def __and__(self, other: Resources) -> Resources:
        return self._combine(other, frozenset.__and__)

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) for f in dataclasses.fields(self))

    def describe(self) -> str:
        stacks = sys._current_frames()
        parts = []
        for thread in sorted(self.threads, key=lambda t: t.name):
            stack = stacks.get(thread.ident or -1)
            # Where it is in its own code (threading's waits say nothing), else what it runs.
            frames = [f for f in traceback.extract_stack(stack) if f.filename != threading.__file__] if stack else []
            where = "".join(traceback.format_list(frames[-4:])) or f"    running {getattr(thread, '_target', None)!r}\n"
            parts.append(f"thread {thread.name!r} ({'daemon' if thread.daemon else 'not daemon'}), at:\n"
                         + where.rstrip("\n"))
        parts += [f"child process {pid}: {_cmdlines.get(pid, '?')}" for pid, _ in sorted(self.children)]
        parts += [f"file descriptor {fd} -> {target}" for fd, target in sorted(self.fds)]
        parts += [f"ZeroMQ {label}" for label in sorted(self.contexts)]
        return "\n".join(f"  - {part}" for part in parts)


def held() -> Resources:
    """The threads, child processes, file descriptors and open ZeroMQ contexts held now."""
    with _contexts_lock:
        contexts = frozenset(label for ctx, label in list(_contexts.items()) if not ctx.closed)
    return Resources(frozenset(t for t in threading.enumerate() if t is not threading.current_thread()),
                     _children(), _fds(), contexts)


def _fds() -> frozenset[tuple[int, str]]:
    if not sys.platform.startswith("linux"):
        return frozenset()
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            found.append((int(name), os.readlink(f"/proc/self/fd/{name}")))
        except FileNotFoundError:  # the descriptor listdir read the directory with, closed since
            pass
    return frozenset(found)


def _children() -> frozenset[tuple[int, str]]:
    """Live (not yet exited) direct children; every thread's children are the process's."""
    if not sys.platform.startswith("linux"):
        return frozenset()
    pids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            pids.update(int(p) for p in Path(f"/proc/self/task/{tid}/children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    # The kernel's own words: a task's ``children`` list is reliable only while the tasks are stopped.
    # A fresh-clone CI run saw it miss a leaked child, so every process whose parent we are counts too.
    me = str(os.getpid())
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in pids:
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
            if stat[stat.rindex(")") + 2:].split(" ", 2)[1] == me:
                pids.add(int(entry))
    found = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):  # reaped meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] not in "ZX":  # exited, not yet reaped by its Popen: released
            # Known by pid and start time, not command line: an executor that restarts itself (exec)
            # is the same child under new arguments.
            found.append((pid, fields[19]))
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                _cmdlines[pid] = cmdline.decode(errors="replace").strip()
            except (FileNotFoundError, ProcessLookupError):
                pass
    return frozenset(found)


_cmdlines: dict[int, str] = {}  # each child's command line as last seen (what a leak report names)


_reported = Resources()  # leaks already reported once: a later check does not report them again


def check_released(taken: Resources, *, what: str, timeout_seconds: float | None = None) -> None:
    """Fail (naming each) if anything in ``taken`` is still held once ``timeout_seconds`` have passed.

    The wait is on the resources themselves: leaked threads are joined and leaked child
    processes waited on (a pidfd, which reaps nothing: their ``Popen`` still will); descriptors
    and contexts, which signal nothing, are looked at again every ``LEAK_RECHECK_SECONDS``."""
    global _reported
    timeout_seconds = LEAK_GRACE_SECONDS if timeout_seconds is None else timeout_seconds
    deadline = time.monotonic() + timeout_seconds
    collected = False
    while leaked := (taken & held()) - _reported:
        if not collected:  # something unreachable may hold it until the collector runs
            gc.collect()
            collected = True
            continue
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        _wait_for_release(leaked, min(remaining, LEAK_RECHECK_SECONDS))
    else:
        return
    _reported |= leaked
    for pid, _ in leaked.children:  # they would run on through every later test
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    pytest.fail(f"{what} leaked (still held {timeout_seconds:g} seconds later):\n{leaked.describe()}", pytrace=False)


def check_no_leaks(before: Resources, *, what: str, allowed: Resources = Resources(),
                   timeout_seconds: float | None = None) -> None:
    """Fail (naming each) if anything taken since ``before`` (other than ``allowed``) is still held."""
    check_released(held() - before - allowed, what=what, timeout_seconds=timeout_seconds)


def _wait_for_release(leaked: Resources, timeout_seconds: float) -> None:
    """Block until something in ``leaked`` may have been released, or ``timeout_seconds`` pass."""
    deadline = time.monotonic() + timeout_seconds
    joined = False
    for thread in leaked.threads:
        if not isinstance(thread, threading._DummyThread):  # a thread Python did not start cannot be joined
            thread.join(max(0.0, deadline - time.monotonic()))
            joined = True
    pidfds = []
    try:
        for pid, _ in leaked.children:
            with contextlib.suppress(OSError):  # gone already, or a kernel without pidfds: look again
                pidfds.append(os.pidfd_open(pid))
        if pidfds:
            select.select(pidfds, [], [], max(0.0, deadline - time.monotonic()))  # readable once it exits
        elif not joined:
            time.sleep(max(0.0, deadline - time.monotonic()))  # descriptors and contexts signal nothing
    finally:
        for fd in pidfds:
            os.close(fd)
