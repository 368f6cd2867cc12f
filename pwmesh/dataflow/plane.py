"""The data plane: tuples between executors over raw TCP streams, or shared memory on one machine.

Control stays on ZeroMQ (the control sockets); bulk data never shares a queue
with it. Why not ZeroMQ for the bytes too: libzmq receives every message into a
fresh ``malloc``, and for big frames that is a fresh mapping whose 4 KiB pages
fault one by one — 16k faults for 64 MiB, which alone halves the bandwidth of a
plain socket — and its frames are not 64-byte aligned, so JAX copies them again
(measured in ``bench/transfer.py``). Here the receiver reads each array with
``recv_into`` straight into a page-aligned buffer from a pool of buffers it has
already faulted in, and JAX on CPU adopts an aligned buffer without a copy. A
pooled buffer is handed out again only once nothing refers to it any more.

Between two executors on the same machine (same boot id) the sender instead
copies each big array into a slot of a shared-memory segment it owns and sends
only its place; the receiver copies it out into a pooled buffer and acknowledges,
which frees the slot: two memory copies, no kernel socket buffers.

One stream per (sender, receiver) pair, written by one thread per destination,
read by one thread per peer. A message on the stream is a length-prefixed
msgpack preamble ``[[kind, nbytes, segment, offset], ...]`` — one entry per frame
of the encoded ``TupleBatch`` (``pwmesh.wire.codec``) — followed by the bytes of
every inline frame. Each message is acknowledged once the receiver holds it, so
the sender knows what is delivered (``AwaitIdle``, drains) and which slots are free.
Everything that arrives is validated by the same codec as control messages.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import mmap
import os
import queue
import select
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np

from pwmesh.core.ratelimit import RejectedLog
from pwmesh.dataflow.secure import TAG_BYTES, Seal, SealError, new_nonce, pair_key, proof, proves
from pwmesh.service import listeners
from pwmesh.service.keys import unkeyed
from pwmesh.wire import codec
from pwmesh.wire.messages import ShardBatch, TupleBatch

log = logging.getLogger(__name__)

INLINE, SHARED = 0, 1
BIG_FRAME_BYTES = 64 << 10  # frames at least this big go through pooled buffers / shared memory
_LEN = struct.Struct("!I")
_ACK = struct.Struct("!Q")
MAX_PREAMBLE_BYTES = 1 << 20
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024  # buffers a sendmsg may take
# A batch whose stream broke before it was acknowledged is sent again on a new stream, after these waits;
# once they are spent it is lost, loudly (``DataPlane.lost``), never counted delivered.
RETRY_DELAYS_SECONDS = (0.05, 0.25, 1.0)
_WAKE: list[Any] = []  # put on a stream's queue: batches wait to be sent again
MAX_HELLO_BYTES = 4096
HANDSHAKE_TIMEOUT_SECONDS = 30.0  # a peer that connects and never says hello holds a thread no longer


class StreamError(ValueError):
    """What came in on a stream is not the data-plane protocol: the stream is closed."""


def _unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data)
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise StreamError(f"unreadable {what}: {type(exc).__name__}: {exc}") from None


def _map_segment(name: str) -> tuple[mmap.mmap, np.ndarray]:
    """A sender's shared-memory segment, read-only; ``StreamError`` if there is no such segment."""
    try:
        # Never through a link: a name the peer chose must not open some other file of ours.
        fd = os.open(f"/dev/shm/{name}", os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise StreamError(f"shared-memory segment {name!r}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise StreamError(f"shared-memory segment {name!r} is not this user's alone (uid {info.st_uid}, "
                              f"mode {info.st_mode & 0o777:o})")
        mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    except (OSError, ValueError) as exc:  # an empty file cannot be mapped
        raise StreamError(f"shared-memory segment {name!r}: {exc}") from None
    finally:
        os.close(fd)
    return mapped, np.frombuffer(mapped, dtype=np.uint8)


def _machine_of(hello: Any) -> str:
    """The ``machine`` of a handshake (``""`` for none); ``StreamError`` if it is not one."""
    if not isinstance(hello, dict) or not isinstance(hello.get("machine", ""), str):
        raise StreamError("malformed handshake")
    return hello.get("machine", "")  # type: ignore[no-any-return]


def _send_hello(sock: socket.socket, hello: dict[str, Any]) -> None:
    data = msgpack.packb(hello)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_hello(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(recv_bytes(sock, _LEN.size))
    if n > MAX_HELLO_BYTES:
        raise StreamError(f"a handshake of {n} bytes")
    hello = _unpack(recv_bytes(sock, n), "handshake")
    if not isinstance(hello, dict):
        raise StreamError("malformed handshake")
    return hello


def machine_id() -> str:
    """Executors with the same id can share memory (same kernel, same /dev/shm)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}" if boot else ""


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionError("peer closed the stream")
        view = view[got:]


def send_views(sock: socket.socket, views: Iterator[memoryview]) -> None:
    """Every byte of ``views``, in order: up to ``IOV_MAX`` of them a ``sendmsg`` (the kernel gathers them;
    no copy into one buffer here)."""
    while True:
        chunk = list(itertools.islice(views, _IOV_MAX))
        if not chunk:
            return
        total = sum(v.nbytes for v in chunk)
        sent = sock.sendmsg(chunk)
        if sent == total:
            continue
        for view in chunk:  # a short write (a signal, a timeout): the rest one view at a time
            if sent >= view.nbytes:
                sent -= view.nbytes
                continue
            sock.sendall(view[sent:])
            sent = 0


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``sock`` (``ConnectionError`` if the peer closes first)."""
    buf = bytearray(n)
    _recv_exactly(sock, memoryview(buf))
    return bytes(buf)


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to 64 (what JAX on CPU needs to adopt a buffer without a copy)."""
    return (nbytes + 63) & ~63


class BufferPool:
    """Page-aligned receive buffers, reused once nothing refers to them (JAX may adopt one as a
    device buffer; it then lives as long as that array). Sizes are rounded up to powers of two.

    Up to ``keep_bytes`` of them are kept, faulted in, for reuse once their users let go: a fresh
    buffer's page faults cost more than filling it (a weight sync lands hundreds of MiB in dozens of
    buffers every step). Past that, the buffers handed out longest ago make room (values stored for
    good, say: they are no longer kept, and their memory goes with them) for those in use now."""

    def __init__(self, keep_bytes: int = 1 << 30, keep_per_size: int = 256) -> None:
        self._lock = threading.Lock()
        self._buffers: dict[int, list[np.ndarray]] = collections.defaultdict(list)
        self._keep_bytes = keep_bytes
        self._keep = keep_per_size  # and no more of a size: ``take`` looks through them
        self.kept_bytes = 0
        self._taken: dict[int, int] = {}  # id of a kept buffer -> when it was last handed out (a count)
        self._clock = 0

    @staticmethod
    def _size(nbytes: int) -> int:
        return max(BIG_FRAME_BYTES, 1 << (nbytes - 1).bit_length())

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 view of ``nbytes`` bytes, page-aligned."""
        size = self._size(nbytes)
        with self._lock:
            self._clock += 1
            for raw in self._buffers[size]:
                # Ours: the list, getrefcount's argument and the loop variable. More: someone holds a view.
                if sys.getrefcount(raw) <= 3:
                    self._taken[id(raw)] = self._clock
                    return raw[:nbytes]
            mapped = mmap.mmap(-1, size)
            if hasattr(mmap, "MADV_HUGEPAGE"):  # 2 MiB pages: a fresh 64 MiB buffer faults 32 times, not 16k
                mapped.madvise(mmap.MADV_HUGEPAGE)
            raw = np.frombuffer(mapped, dtype=np.uint8)
            if size <= self._keep_bytes and len(self._buffers[size]) < self._keep:
                self._make_room(self.kept_bytes + size - self._keep_bytes)
                self._buffers[size].append(raw)
                self._taken[id(raw)] = self._clock
                self.kept_bytes += size
            return raw[:nbytes]

    def _make_room(self, nbytes: int) -> None:
        """Keep ``nbytes`` fewer: the buffers handed out longest ago go first."""
        if nbytes <= 0:
            return
        oldest = sorted((self._taken[id(raw)], size, i) for size, kept in self._buffers.items()
                        for i, raw in enumerate(kept))
        going: dict[int, set[int]] = collections.defaultdict(set)
        for _, size, i in oldest:
            if nbytes <= 0:
                break
            going[size].add(i)
            nbytes -= size
        for size, indices in going.items():
            kept = self._buffers[size]
            for i in indices:
                del self._taken[id(kept[i])]
            self._buffers[size] = [raw for i, raw in enumerate(kept) if i not in indices]
            self.kept_bytes -= size * len(indices)


class _Segment:
    """A shared-memory segment this process created: one slot for one frame in flight."""

    def __init__(self, size: int) -> None:
        self.name = f"pwmesh-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        path = f"/dev/shm/{self.name}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size
        self.array = np.frombuffer(self.map, dtype=np.uint8)

    def unlink(self) -> None:
        try:
            os.unlink(f"/dev/shm/{self.name}")
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unlinked and unmapped: its memory goes once the receiver's mapping does too."""
        self.unlink()
        self.array = np.empty(0, np.uint8)  # the view first: a mapping with views on it cannot close
        try:
            self.map.close()
        except BufferError:  # a frame being copied from it still: the mapping goes with its last view
            pass


class _Pending:
    """A batch on its way: its encoded frames (kept until acknowledged, to send again), the slots it
    holds, and how many streams it was lost with."""

    __slots__ = ("frames", "slots", "attempts", "tag")

    def __init__(self, frames: list[Any], tag: Any = None) -> None:
        self.frames = frames
        self.slots: list[_Segment] = []
        self.attempts = 0
        self.tag = tag  # the sender's, for ``on_lost``


class _Stream:
    """One destination: a connected socket, a queue of encoded batches, a writer and an ack reader.
    ``session``: (session id, its data key) for a stream between a client and an executor."""

    def __init__(self, plane: DataPlane, address: str, session: tuple[str, bytes] | None = None) -> None:
        self.plane = plane
        self.address = address
        self.session = session
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()  # _Pending, _WAKE or None (the end)
        self.lock = threading.Condition()
        self.unacked: collections.deque[_Pending] = collections.deque()  # sent, in order, not acknowledged
        self.retry: collections.deque[_Pending] = collections.deque()  # lost with a stream: to send again first
        self.not_before = 0.0  # monotonic: no new stream before then (the retry's wait)
        self.free: list[_Segment] = []
        self.segments: list[_Segment] = []
        self.sock: socket.socket | None = None
        self.shared = False
        self.seal: Seal | None = None  # this stream's sealing (the cluster has keys, and not plaintext)
        self.ack_seal: Seal | None = None  # how its acknowledgements are sealed (the cluster has keys)
        self.closed = False
        self.sent_bytes = [0, 0]  # by path (INLINE: the TCP stream, SHARED: shared memory); its writer's alone
        self.writer = threading.Thread(target=self._write_loop, name=f"pwmesh-data-to-{address}", daemon=True)
        self.writer.start()

    def _connect(self) -> socket.socket:
        plain, theirs = unkeyed(self.address)
        host, port = plain.removeprefix("tcp://").rsplit(":", 1)
        pair, key = self.plane.pair, self.plane.key
        if self.session is not None:  # a client's stream: keyed by its session, whatever the cluster's keys
            pair, key = None, self.session[1]
        elif pair is not None:
            theirs = theirs or self.plane.cluster_key
            if theirs is None:
                raise StreamError(f"the data plane at {self.address} has no key in its address")
            key = pair_key(pair[1], theirs, client=pair[0], server=theirs)
        sock = socket.create_connection((host, int(port)), timeout=HANDSHAKE_TIMEOUT_SECONDS)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = new_nonce() if key is not None else b""
            _send_hello(sock, {"machine": self.plane.machine if self.plane.shared_memory else "", "pid": os.getpid(),
                               "nonce": nonce, "plaintext": self.plane.plaintext,
                               **({"from": pair[0]} if pair is not None else {}),
                               **({"session": self.session[0]} if self.session is not None else {})})
            reply = _recv_hello(sock)
            machine = _machine_of(reply)
            seal = ack_seal = None
            if key is not None:
                theirs = reply.get("nonce")
                if not (isinstance(theirs, bytes) and proves(key, b"server", nonce, theirs, reply.get("proof"))):
                    raise StreamError(f"the data plane at {self.address} did not prove it holds the cluster's keys")
                _send_hello(sock, {"proof": proof(key, b"client", nonce, theirs)})
                if reply.get("encrypted") is not False:
                    seal = Seal(key, nonce, theirs)
                ack_seal = Seal(key, nonce, theirs, purpose=b"acks")  # sealed even in plaintext: they free slots
            sock.settimeout(None)  # a stream may rightly be idle for as long as we have nothing to send
        except BaseException:  # whoever answered there is no data plane: do not keep its socket
            sock.close()
            raise
        self.seal, self.ack_seal = seal, ack_seal
        self.shared = bool(self.plane.machine) and machine == self.plane.machine
        threading.Thread(target=self._ack_loop, args=(sock,), name=f"pwmesh-acks-{self.address}", daemon=True).start()
        return sock

    def _slot(self, nbytes: int) -> _Segment:
        with self.lock:
            while True:
                fits = [s for s in self.free if s.size >= nbytes]
                if fits:
                    seg = min(fits, key=lambda s: s.size)
                    self.free.remove(seg)
                    return seg
                if len(self.segments) < self.plane.max_segments:
                    seg = _Segment(BufferPool._size(nbytes))
                    self.segments.append(seg)
                    return seg
                if self.free:  # too small: replace the smallest with one that fits
                    old = min(self.free, key=lambda s: s.size)
                    self.free.remove(old)
                    self.segments.remove(old)
                    old.close()
                    continue
                if self.closed:
                    raise ConnectionError("stream closed")
                self.lock.wait(timeout=1.0)  # every slot is in flight: wait for an acknowledgement

    def _write_loop(self) -> None:
        while True:
            with self.lock:
                pending = self.retry.popleft() if self.retry else None
            if pending is None:
                queued = self.queue.get()
                if queued is None:
                    return
                if queued is _WAKE:
                    continue
                pending = queued
            pending.slots = []
            with self.lock:
                self.unacked.append(pending)  # settled by its acknowledgement, or sent again by ``_reset``
            try:
                if self.sock is None:
                    wait = self.not_before - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)  # this writer's own back-off before the next stream (a thread of its own)
                    self.sock = self._connect()
                self._write(self.sock, pending.frames, pending.slots)
            except (OSError, StreamError) as exc:
                self._reset(exc)

    def _write(self, sock: socket.socket, frames: list[Any], slots: list[_Segment]) -> None:
        preamble: list[list[Any]] = []
        inline: list[memoryview | codec.Gather] = []
        seal = self.seal
        for frame in frames:
            view = frame if isinstance(frame, codec.Gather) else memoryview(frame).cast("B")
            # A slot is freed only when its message is acknowledged: a message with more big frames than
            # there are slots would wait for itself for ever. Those beyond go inline on the stream.
            if self.shared and view.nbytes >= BIG_FRAME_BYTES and len(slots) < self.plane.max_segments:
                seg = self._slot(view.nbytes)
                if isinstance(view, codec.Gather):
                    view.into(seg.array[:view.nbytes])  # gathered straight into the slot
                else:
                    seg.array[:view.nbytes] = np.frombuffer(view, dtype=np.uint8)
                slots.append(seg)
                preamble.append([SHARED, view.nbytes, seg.name, 0])
            else:
                if isinstance(view, codec.Gather) and seal is not None:  # sealing reads one buffer
                    view = view.into(self.plane.pool.take(view.nbytes)).data
                preamble.append([INLINE, view.nbytes, "", 0])
                inline.append(view)
        head = msgpack.packb(preamble)
        if seal is not None:
            head = seal.seal(head)
        sock.sendall(_LEN.pack(len(head)) + head)
        for view in inline:
            if isinstance(view, codec.Gather):
                send_views(sock, view.views())
            elif seal is None:
                sock.sendall(view)
            elif view.nbytes >= BIG_FRAME_BYTES:
                out = self.plane.pool.take(view.nbytes + TAG_BYTES)  # warm, reused once sent
                seal.seal_into(view, out)
                sock.sendall(out.data)
            else:
                sock.sendall(seal.seal(view))
        for kind, nbytes, _, _ in preamble:
            self.sent_bytes[kind] += nbytes

    def _ack_loop(self, sock: socket.socket) -> None:
        """Acknowledgements, in order: each frees a batch's slots. Sealed under the stream's own keys
        and counter, so a forged, replayed or reordered one closes the stream (and what it would have
        settled is sent again) instead of counting a batch delivered that was not."""
        ack_seal = self.ack_seal
        size = _ACK.size + (TAG_BYTES if ack_seal is not None else 0)
        try:
            while True:
                data = recv_bytes(sock, size)
                (count,) = _ACK.unpack(ack_seal.open(data) if ack_seal is not None else data)
                delivered = []
                with self.lock:
                    if count > len(self.unacked):
                        raise StreamError(f"{count} acknowledged, {len(self.unacked)} sent")
                    for _ in range(count):
                        pending = self.unacked.popleft()
                        self.free.extend(pending.slots)
                        if isinstance(pending.tag, Notify):
                            delivered.append(pending.tag)
                    self.lock.notify_all()
                self.plane._settled(count, delivered=delivered)
        except (OSError, ConnectionError, StreamError, SealError) as exc:
            self._reset(exc, sock)

    def _reset(self, reason: BaseException | None = None, sock: socket.socket | None = None) -> None:
        """The stream is gone (``sock``: the one that ended, if it is not the current one there is nothing
        to do): what it had not acknowledged goes again on a new stream, up to len(RETRY_DELAYS_SECONDS)
        times a batch; what is left after that is lost, and said so."""
        with self.lock:
            if sock is not None and sock is not self.sock:
                return  # an earlier stream's reader, ending after its writer moved on
            failed = list(self.unacked)
            self.unacked.clear()
            self.free = list(self.segments)
            current, self.sock = self.sock, None
            again = []
            for pending in failed:
                pending.attempts += 1
                if not self.closed and pending.attempts <= len(RETRY_DELAYS_SECONDS):
                    again.append(pending)
            self.retry.extendleft(reversed(again))  # ahead of anything newer, in their order
            if again:
                self.not_before = time.monotonic() + RETRY_DELAYS_SECONDS[max(p.attempts for p in again) - 1]
            self.lock.notify_all()
        if current is not None:
            with contextlib.suppress(OSError):
                current.shutdown(socket.SHUT_RDWR)  # wakes its acknowledgement reader (a close alone does not)
            current.close()
        lost = len(failed) - len(again)
        kept = {id(p) for p in again}
        lost_tags = [p.tag for p in failed if id(p) not in kept]
        if again:
            self.plane.retried += len(again)
            log.warning("data plane: lost the stream to %s (%s); sending %d batch(es) again", self.address, reason,
                        len(again), extra={"peer": self.address, "reason": str(reason)})
            self.queue.put(_WAKE)
        if lost:
            log.error("data plane: %d batch(es) to %s were lost (%s), %s", lost, self.address, reason,
                      "the stream was closed" if self.closed else
                      f"after {len(RETRY_DELAYS_SECONDS)} more tries", extra={"peer": self.address,
                                                                           "reason": str(reason)})
            self.plane._settled(lost, lost=lost, tags=lost_tags, reason=f"the stream to {self.address} broke "
                                f"({reason}) and so did every retry")

    def close(self) -> None:
        self.closed = True
        self.queue.put(None)
        self._reset(ConnectionError("the data plane closed"))
        with self.lock:
            segments, self.segments, self.free = self.segments, [], []
        for seg in segments:
            seg.close()


class Notify:
    """A batch's tag that is told the batch's fate, on the plane's loop: ``done(None)`` once the receiver
    holds it, ``done(why)`` if it is lost."""

    __slots__ = ("done",)

    def __init__(self, done: Callable[[str | None], None]) -> None:
        self.done = done


class _Inline:
    """The loop of a plane that has none (a client's): what it is asked to call later runs at once, on the
    plane's own thread (the callbacks are thread-safe)."""

    @staticmethod
    def call_soon_threadsafe(fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)


class DataPlane:
    """An executor's data plane: a listener for its peers' streams, and a stream to each destination.

    ``on_batch`` is called on the event loop (through ``call_soon_threadsafe``) for every
    batch that arrives; ``idle`` is set whenever every batch sent so far has been acknowledged.

    Clients move their arrays over it too (a direct put or fetch, never through the proxy): a client's
    stream is keyed by its session's data key (``session_keys``, which the proxy gives both ends), carries
    only ``ShardBatch`` messages, and each is handed to ``on_shards(session, batch)``. A client's own plane
    (``loop`` None, ``sessions_only``) serves only its session's streams."""

    def __init__(self, loop: Any, on_batch: Callable[[TupleBatch], None], *, bind_host: str = "127.0.0.1",
                 port: int = 0, shared_memory: bool = True, max_segments: int = 8, max_streams: int = 4096,
                 limits: codec.Limits = codec.DEFAULT_LIMITS, key: bytes | None = None,
                 pair: tuple[bytes, bytes] | None = None, is_daemon: Callable[[bytes], bool] | None = None,
                 cluster_key: bytes | None = None, plaintext: bool = False,
                 on_lost: Callable[[list[Any], str], None] | None = None,
                 on_shards: Callable[[str, ShardBatch], None] | None = None, sessions_only: bool = False,
                 copy_shared: bool = True) -> None:
        """``pair`` (public, secret: the host's CURVE keys, z85): each stream is keyed by its two ends
        (``secure.pair_key``): the destination's public key is in its address (``keys.keyed``; none:
        ``cluster_key``, the cluster's), the sender's in its hello, which ``is_daemon`` must accept. Else ``key`` (``secure.plane_key``): one
        secret every end holds. Streams prove their key both ways and are sealed, unless both ends are
        ``plaintext`` (a fabric you trust). Neither: anyone who connects is a peer. ``on_lost(tags, why)``
        is called on the loop with the tags of batches given up on (``send``), but a ``Notify`` tag is told
        itself, delivered or lost. ``copy_shared=False`` (a plane without a loop): what arrives through
        shared memory is handed over as views of the sender's slots, and acknowledged only once the
        callback returns, which must have copied what it keeps (one copy fewer: a client's fetch)."""
        if not copy_shared and loop is not None:
            raise ValueError("views of shared memory are handed only to callbacks run by the reader itself")
        self.copy_shared = copy_shared
        self.loop = loop if loop is not None else _Inline()
        self.on_lost = on_lost
        self.on_shards = on_shards
        self.session_keys: dict[str, bytes] = {}  # session id -> its data key (set by the owner, any thread)
        self.sessions_only = sessions_only
        self.refusing = ""  # why every inbound stream is refused ("": none is; set by a test's hook)
        self.key = key
        self.pair = pair
        self.is_daemon = is_daemon
        self.cluster_key = cluster_key
        self.plaintext = plaintext
        self.on_batch = on_batch
        self.shared_memory = shared_memory
        self.machine = machine_id()
        self.max_segments = max_segments
        self.limits = limits
        self.pool = BufferPool()
        self._streams: dict[str, _Stream] = {}
        self._in_flight = 0
        self.lost = 0  # batches given up on (their streams broke, and every retry did too): never delivered
        self.retried = 0  # batches sent again on a new stream
        self._count_lock = threading.Lock()
        self.idle = asyncio.Event()  # set while nothing sent is unacknowledged (built on the owner's loop)
        self.idle.set()
        self._listener = listeners.tcp_listener(f"tcp://{bind_host}:{port}")
        self._listener.setblocking(False)  # the accept thread waits in select, with ``_wake``
        self._wake = os.pipe()
        host, port = self._listener.getsockname()[:2]
        self.address = f"tcp://{host}:{port}"
        self.max_streams = max_streams
        self._readers: set[socket.socket] = set()  # inbound streams being read (one thread each)
        self._readers_lock = threading.Lock()
        self._rejected = RejectedLog("data plane", logger=log)
        # For the metrics. Bytes received by path (INLINE, SHARED): each stream's reader thread counts its
        # own (no lock per message), folded into ``_received_bytes`` when it ends.
        self._reading: dict[socket.socket, list[int]] = {}
        self._received_bytes = [0, 0]
        self.rejected: collections.Counter[str] = collections.Counter()  # by reason (under ``_readers_lock``)
        self._closing = False
        self._accepting = threading.Thread(target=self._accept_loop, name="pwmesh-data-accept", daemon=True)
        self._accepting.start()

    # ---------------------------------------------------------------- sending

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def send(self, address: str, batch: TupleBatch | ShardBatch, tag: Any = None,
             session: tuple[str, bytes] | None = None) -> None:
        """Queue ``batch`` for the executor whose data plane listens at ``address`` (never blocks). If it
        is lost, ``on_lost`` is told with ``tag`` (not None); a ``Notify`` tag is told either way.
        ``session`` (id, data key): the stream is a client's, keyed by its session."""
        where = address if session is None else f"{address}#{session[0]}"
        stream = self._streams.get(where)
        if stream is None:
            stream = self._streams[where] = _Stream(self, address, session)
        with self._count_lock:
            self._in_flight += 1
        self.idle.clear()
        stream.queue.put(_Pending(codec.encode(batch, msg_id=0), tag))

    def forget_session(self, session: str) -> None:
        """Session ``session`` ended: close the streams to its client (what they had not delivered is lost)."""
        for where in [w for w, stream in self._streams.items()
                      if stream.session is not None and stream.session[0] == session]:
            self._streams.pop(where).close()

    def _settled(self, count: int, *, lost: int = 0, tags: list[Any] | None = None, reason: str = "",
                 delivered: list[Any] | None = None) -> None:
        """``count`` batches are no longer in flight: acknowledged (sent with ``delivered`` tags), or
        (``lost`` of them, sent with ``tags``) given up on."""
        with self._count_lock:
            self._in_flight -= count
            self.lost += lost
            idle = self._in_flight <= 0
        tagged = [t for t in tags or () if t is not None and not isinstance(t, Notify)]
        if tagged and self.on_lost is not None and not self._closing:
            self.loop.call_soon_threadsafe(self.on_lost, tagged, reason)
        for tag in tags or ():
            if isinstance(tag, Notify):
                self.loop.call_soon_threadsafe(tag.done, reason or "lost")
        for tag in delivered or ():  # the acknowledged batches' ``Notify`` tags (``_ack_loop`` picks them)
            self.loop.call_soon_threadsafe(tag.done, None)
        if idle and not self._closing:
            self.loop.call_soon_threadsafe(self._mark_idle)

    def _mark_idle(self) -> None:
        if self._in_flight <= 0:
            self.idle.set()

    # -------------------------------------------------------------- receiving

    def _accept_loop(self) -> None:
        while True:
            try:
                watched: list[socket.socket | int] = [self._listener, self._wake[0]]
                readable, _, _ = select.select(watched, [], [])
                if self._wake[0] in readable:
                    return
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):  # taken back by its peer meanwhile
                continue
            except (OSError, ValueError):
                return
            peer = addr[0] if isinstance(addr, tuple) else addr  # by host: every connection has its own port
            with self._readers_lock:
                full = len(self._readers) >= self.max_streams
                if not full:
                    self._readers.add(sock)
            if full:
                self._reject(peer, "too_many_streams",
                             f"{self.max_streams} streams are open already; connection closed")
                sock.close()
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(target=self._read_loop, args=(sock, peer), name="pwmesh-data-in",
                                 daemon=True).start()
            except (OSError, RuntimeError) as exc:  # reset already, or no thread to be had
                self._reject(peer, "stream", f"cannot serve a stream: {exc}")
                self._forget(sock)

    def _forget(self, sock: socket.socket) -> None:
        with self._readers_lock:
            self._readers.discard(sock)
            counted = self._reading.pop(sock, None)
            if counted is not None:
                self._received_bytes = [a + b for a, b in zip(self._received_bytes, counted, strict=True)]
        sock.close()

    def _reject(self, peer: Any, reason: str, message: str) -> None:
        with self._readers_lock:
            self.rejected[reason] += 1
        self._rejected.rejected(peer, message)

    def bytes_moved(self) -> dict[tuple[str, str], int]:
        """Bytes sent and received so far, by ``(direction, path)``: path ``tcp`` (the stream) or ``shm``
        (shared memory, between executors of one machine)."""
        sent = [0, 0]
        for stream in list(self._streams.values()):
            sent = [a + b for a, b in zip(sent, stream.sent_bytes, strict=True)]
        with self._readers_lock:
            received = list(self._received_bytes)
            for counted in self._reading.values():
                received = [a + b for a, b in zip(received, counted, strict=True)]
        return {("sent", "tcp"): sent[INLINE], ("sent", "shm"): sent[SHARED],
                ("received", "tcp"): received[INLINE], ("received", "shm"): received[SHARED]}

    def _read_loop(self, sock: socket.socket, peer: Any) -> None:
        segments: dict[str, tuple[mmap.mmap, np.ndarray]] = {}
        counted = [0, 0]
        with self._readers_lock:
            self._reading[sock] = counted
        try:
            shared, seal, ack_seal, session = self._handshake(sock)
            while True:
                frames = self._read_message(sock, segments, shared, seal, counted)
                ack = _ACK.pack(1)
                ack = ack if ack_seal is None else ack_seal.seal(ack)
                if self.copy_shared:
                    sock.sendall(ack)  # held here: its slots may be reused
                try:
                    message: Any = codec.decode(frames, self.limits).message
                except codec.FrameError as exc:
                    self._reject(peer, exc.reason, exc.message)
                    message = None
                del frames
                if message is not None:
                    self._dispatch(message, session, peer)
                    del message  # views of the sender's slots (``copy_shared=False``) go before the slots do
                if not self.copy_shared:
                    sock.sendall(ack)
        except (StreamError, SealError) as exc:
            self._reject(peer, "stream", f"{exc}; stream closed")
        except OSError as exc:
            if not self._closing:
                log.debug("data plane: a peer's stream ended: %s", exc)
        except Exception as exc:  # a bug; whatever it is, one peer's stream must not end the plane (or flood the log)
            self._reject(peer, "stream", f"stream failed: {type(exc).__name__}: {exc}")
        finally:
            self._forget(sock)
            mapped = [m for m, _ in segments.values()]
            segments.clear()  # the views go first: an mmap with views on it cannot close
            for m in mapped:
                try:
                    m.close()
                except BufferError:  # a view is still held somewhere: the mapping goes with it
                    pass

    def _dispatch(self, message: Any, session: str | None, peer: Any) -> None:
        """Hand what arrived to its callback: a client's shards, or (from a daemon) a tuple batch."""
        if session is not None and isinstance(message, ShardBatch) and self.on_shards is not None:
            self.loop.call_soon_threadsafe(self.on_shards, session, message)
        elif session is None and isinstance(message, TupleBatch):
            self.loop.call_soon_threadsafe(self.on_batch, message)
        elif session is not None:
            self._reject(peer, "wrong_op", f"a {message.op} on session {session}'s stream (only its shards travel "
                         "there)")
        else:
            self._reject(peer, "wrong_op", f"a {message.op} (only tuple batches travel here)")

    def _handshake(self, sock: socket.socket) -> tuple[bool, Seal | None, Seal | None, str | None]:
        """Read the peer's hello and answer it (with keys: each end proves it holds them); whether the
        stream's big frames come through shared memory, how its payload is sealed, how our
        acknowledgements are, and the session whose stream it is (None: a daemon's)."""
        sock.settimeout(HANDSHAKE_TIMEOUT_SECONDS)
        if self.refusing:
            raise StreamError(f"refusing every stream ({self.refusing})")
        hello = _recv_hello(sock)
        machine = _machine_of(hello)
        key, seal, ack_seal = self.key, None, None
        session = hello.get("session")
        if session is not None:  # a client's stream (or, at a client, an executor's): keyed by the session
            key = self.session_keys.get(session) if isinstance(session, str) else None
            if not key:
                raise StreamError(f"a stream for session {str(session)[:40]!r}, which has no data key here")
        elif self.sessions_only:
            raise StreamError("a stream for no session (this data plane serves only its session's)")
        elif self.pair is not None:
            sender = hello.get("from")
            if not (isinstance(sender, bytes) and len(sender) == 40 and self.is_daemon is not None
                    and self.is_daemon(sender)):
                raise StreamError("a hello from no daemon's key")
            key = pair_key(self.pair[1], sender, client=sender, server=self.pair[0])
        if key is None:
            _send_hello(sock, {"machine": self.machine if self._shares(machine) else ""})
        else:
            theirs, mine = hello.get("nonce"), new_nonce()
            if not (isinstance(theirs, bytes) and len(theirs) == len(mine)):
                raise StreamError("a hello without the cluster's keys")
            encrypted = not (self.plaintext and hello.get("plaintext") is True)  # plaintext if both ends ask
            _send_hello(sock, {"machine": self.machine if self._shares(machine) else "", "nonce": mine,
                               "proof": proof(key, b"server", theirs, mine), "encrypted": encrypted})
            if not proves(key, b"client", theirs, mine, _recv_hello(sock).get("proof")):
                raise StreamError("a peer that does not hold the cluster's keys")
            seal = Seal(key, theirs, mine) if encrypted else None
            ack_seal = Seal(key, theirs, mine, purpose=b"acks")
        sock.settimeout(None)  # a stream may rightly be idle for as long as its sender has nothing to send
        return self._shares(machine), seal, ack_seal, session

    def _shares(self, machine: str) -> bool:
        return bool(self.shared_memory and self.machine and machine == self.machine)

    def _read_message(self, sock: socket.socket, segments: dict[str, tuple[mmap.mmap, np.ndarray]],
                      shared: bool, seal: Seal | None, counted: list[int]) -> list[Any]:
        """One message's frames (its bytes added to ``counted``, by path, once all are read)."""
        (n,) = _LEN.unpack(recv_bytes(sock, _LEN.size))
        if n > MAX_PREAMBLE_BYTES + TAG_BYTES:
            raise StreamError(f"a preamble of {n} bytes")
        head = recv_bytes(sock, n)
        preamble = _unpack(head if seal is None else seal.open(head), "preamble")
        limits = self.limits
        if not isinstance(preamble, list) or not 2 <= len(preamble) <= limits.max_buffers + 2:
            raise StreamError("malformed preamble")
        for entry in preamble:  # every entry checked before a byte of any frame is read
            if not (isinstance(entry, list) and len(entry) == 4 and entry[0] in (INLINE, SHARED)
                    and type(entry[1]) is int and 0 <= entry[1] <= limits.max_buffer_bytes):
                raise StreamError(f"malformed preamble entry {str(entry)[:80]}")
            if entry[0] == SHARED and not (shared and isinstance(entry[2], str) and entry[2].startswith("pwmesh-")
                                           and "/" not in entry[2] and type(entry[3]) is int and entry[3] >= 0):
                raise StreamError("a shared-memory frame this stream cannot have")
        declared = sum(entry[1] for entry in preamble)
        if declared > limits.max_header_bytes + limits.max_body_bytes + limits.max_buffer_bytes:
            raise StreamError(f"a message of {declared} bytes")
        frames: list[Any] = []
        place = self._placer([entry[1] for entry in preamble if entry[1] >= BIG_FRAME_BYTES
                              and (entry[0] == INLINE or self.copy_shared)])
        for kind, nbytes, name, offset in preamble:
            if kind == SHARED:
                if name not in segments:
                    segments[name] = _map_segment(name)
                source = segments[name][1]
                if offset + nbytes > source.nbytes:
                    raise StreamError("shared-memory frame outside its segment")
                if not self.copy_shared:  # a view: acknowledged (the slot reused) once the callback is done
                    frames.append(source[offset:offset + nbytes])
                    continue
                buf = place(nbytes)
                np.copyto(buf, source[offset:offset + nbytes])
                frames.append(buf)
            elif seal is not None and nbytes >= BIG_FRAME_BYTES:
                sealed = self.pool.take(nbytes + TAG_BYTES)
                _recv_exactly(sock, sealed.data)
                buf = place(nbytes)
                seal.open_into(sealed, buf)
                frames.append(buf)
            elif seal is not None:
                frames.append(seal.open(recv_bytes(sock, nbytes + TAG_BYTES)))
            elif nbytes >= BIG_FRAME_BYTES:
                buf = place(nbytes)
                _recv_exactly(sock, buf.data)
                frames.append(buf)
            else:
                frames.append(recv_bytes(sock, nbytes))
        for kind, nbytes, _, _ in preamble:
            counted[kind] += nbytes
        return frames

    def _placer(self, sizes: list[int]) -> Callable[[int], np.ndarray]:
        """Where a message's big frames (of ``sizes``, in order) are read: back to back in one pooled buffer,
        each at a 64-byte boundary. Blocks of one value that are whole rows in row order (a row-split
        weight's pieces) then lie as in the value itself, and ``assemble`` takes them as they are."""
        if len(sizes) < 2:
            return self.pool.take
        block = self.pool.take(sum(_aligned(n) for n in sizes))
        at = 0

        def place(nbytes: int) -> np.ndarray:
            nonlocal at
            buf = block[at:at + nbytes]
            at += _aligned(nbytes)
            return buf
        return place

    def close(self, *, keep_listener: bool = False) -> None:
        """``keep_listener``: leave the listener open, for the process an exec starts next to take over
        (``pwmesh.service.listeners``); what connects meanwhile waits in its backlog."""
        self._closing = True
        os.write(self._wake[1], b"x")  # the accept thread returns
        self._accepting.join(timeout=5.0)
        for fd in self._wake:
            os.close(fd)
        if not keep_listener:
            listeners.close(self._listener)
        for stream in self._streams.values():
            stream.close()
        with self._readers_lock:
            readers = list(self._readers)
        for sock in readers:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
