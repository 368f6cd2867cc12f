"""Fuzz every daemon's socket and every executor's data plane, then run a real program.

Frames come from the message registry (``pwmesh.wire.messages.message_types``), so a
new message type is fuzzed as soon as it exists. Each frame is one of:

- **valid**: a message of a random type, every field a valid value of its annotation
  (records nested, arrays as out-of-band buffers), ids out of range: integers are
  negative or huge (never a small id a live daemon uses), strings come from a small
  pool of names nobody has (so what a valid message registers stays bounded);
- **swapped**, **wrong_type**, **missing**, **extra**: a valid body with two fields'
  values swapped, one field of another type, one field dropped, one field too many;
- **huge**: declared sizes far beyond what came: arrays of 2^40 elements, buffer
  references out of range, msgpack strings, lists and maps declaring 4 GiB or 4
  billion items, nesting deeper than any decoder's stack, odd dtypes;
- **truncated**: a valid message's header, body or buffer cut short, frames dropped
  or added;
- **version**, **header**: wrong protocol versions, headers of the wrong shape and types;
- **random**: frames of random bytes; **envelope**: no routing delimiter at all.

Every control socket (the resource manager, each island scheduler, each executor's
control socket, the proxy) gets ``--frames`` frames from a few peers in turn (a new
connection every ``--frames-per-peer``), with a ``Ping`` every ``--ping-every``
frames that must be answered within ``--hang-seconds`` (a hang otherwise). Each
executor's data-plane port gets ``--frames`` messages of junk too: random bytes,
broken handshakes, preambles of the wrong shape or declaring huge or shared-memory
frames that do not exist, and the same mutated messages as above, framed correctly.

Afterwards every daemon must still run, its RSS and log file must have grown by less
than ``--max-rss-growth-mib`` and ``--max-log-growth-kib``, and a real program (a
``pw.pmap`` chain over two slices of island 0, its values checked) must succeed.

Each daemon runs under an address-space limit (``--address-space-gib``), so one that runs away
fails alone rather than through the machine's OOM killer.

    python bench/fuzz.py                    # 10^4 frames per socket: under a minute on 2 cores
    python bench/fuzz.py --frames 150000    # 10^6 frames in all (6 minutes here; bench/README.md)
    python bench/fuzz.py --frames 1000000   # 10^6 per socket (~40 minutes at 3,000 frames/s)
    python bench/fuzz.py --smoke            # seconds

Writes ``fuzz[-LABEL].json`` into ``--out`` (default: bench/results).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import math
import os
import random
import resource
import socket
import struct
import sys
import time
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_OUT, load_average, machine, table, write_json  # noqa: E402

import pwmesh as pw  # noqa: E402
from pwmesh.dataflow.plane import INLINE, SHARED, machine_id, recv_bytes  # noqa: E402
from pwmesh.wire import PROTOCOL_VERSION, Record, decode, encode, message_types  # noqa: E402
from pwmesh.wire.messages import Ping, Pong, ShardRun  # noqa: E402

# Integers a daemon never uses as an id, a count or an index of something real.
INTS = [-1, -7, -(2**31), 2**31 - 1, 2**32 + 5, 2**53 + 1, 2**62, 2**63 - 1, -(2**63), 2**64 - 1, 10**6, 10**9 + 7]
FLOATS = [0.0, -1.0, 1e-300, 1e308, -1e308, math.inf, -math.inf, math.nan, 2.5]
STRINGS = ["", "fuzz", *(f"fuzz-{i}" for i in range(6)), "tcp://127.0.0.1:1", "\x00\uffff", "\u00e9\u2603",
           "@0", "@4095", "fuzz/0/0", "fuzz-1:7", "../../etc/passwd", "x" * 3000]
DTYPES = [np.float32, np.int8, np.bool_, np.float64, np.complex64, np.uint64, np.int32]
ODD_DTYPES = ["object", "V0", "V8", "void64", "<U4", "S3", "M8", "float128", "int32,int32", "(2,)i4", ">f4",
              "(100000000,)f8", "nonsense", "bfloat16", "float8_e4m3fn", "int4", ""]
_MEGABYTE = random.Random(1).randbytes(1 << 20)
KINDS = ["valid", "swapped", "wrong_type", "missing", "extra", "huge", "truncated", "version", "header",
         "random", "envelope"]


@functools.cache
def _fields(cls: type) -> list[tuple[str, Any, bool]]:
    """``(name, annotation, optional)`` of each field of record ``cls``."""
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name],
             f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
            for f in dataclasses.fields(cls)]


class _Body:
    """Stands in for a ``Message`` so ``wire.encode`` frames a mutated body as it frames a real one."""

    def __init__(self, op: Any, body: Any) -> None:
        self.op = op
        self._body = body

    def to_wire(self) -> Any:
        return self._body


class FrameMaker:
    """Random, truncated and mutated frames built from the message registry."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.ops = sorted(message_types())
        self.records = sorted({tp for cls in message_types().values() for tp in self._records_in(cls)},
                              key=lambda c: c.__name__)
        self._ids = 1 << 20

    def _records_in(self, cls: type) -> Iterator[type]:
        yield cls
        for _, tp, _ in _fields(cls):
            for arg in (tp, *typing.get_args(tp), *(a for t in typing.get_args(tp) for a in typing.get_args(t))):
                if isinstance(arg, type) and issubclass(arg, Record) and arg is not cls:
                    yield arg

    def msg_id(self) -> int:
        self._ids += 1
        return self._ids

    # ------------------------------------------------------------- values

    def value(self, tp: Any, depth: int = 0) -> Any:
        """A valid value of annotation ``tp``: right type, out-of-range ids."""
        rng = self.rng
        if tp is Any:
            return self.junk(depth)
        origin = typing.get_origin(tp)
        if origin in (types.UnionType, typing.Union):
            args = typing.get_args(tp)
            if type(None) in args and rng.random() < 0.3:
                return None
            return self.value(rng.choice([a for a in args if a is not type(None)]), depth)
        if origin is list:
            (item,) = typing.get_args(tp)
            n = 0 if depth > 3 else rng.choice([0, 1, 1, 2, 3])
            return [self.value(item, depth + 1) for _ in range(n)]
        if origin is dict:
            _, val = typing.get_args(tp)
            return {rng.choice(STRINGS): self.value(val, depth + 1) for _ in range(rng.choice([0, 1, 2]))}
        if isinstance(tp, type) and issubclass(tp, Record):
            return self.record(tp, depth + 1)
        if tp is bool:
            return rng.random() < 0.5
        if tp is int:
            return rng.choice(INTS)
        if tp is float:
            return rng.choice(FLOATS)
        if tp is str:
            return rng.choice(STRINGS)
        if tp is bytes:
            return self.blob(depth)
        if tp is np.ndarray:
            return self.array()
        raise TypeError(f"no generator for {tp!r}")

    def record(self, cls: type, depth: int = 0) -> dict[str, Any]:
        """A record's wire form; optional fields are sometimes left out."""
        out = {}
        for name, tp, optional in _fields(cls):
            if optional and self.rng.random() < 0.3:
                continue
            if cls is ShardRun and name == "count" and self.rng.random() < 0.5:
                out[name] = self.rng.choice([1, 3])  # half the time a count that gets past the check
                continue
            out[name] = self.value(tp, depth)
        return out

    def array(self) -> np.ndarray:
        shape = [self.rng.choice([0, 1, 2, 3]) for _ in range(self.rng.choice([0, 1, 2]))]
        return np.zeros(shape, self.rng.choice(DTYPES))

    def blob(self, depth: int) -> bytes:
        """Bytes fields: random, or packed records (what ``Enqueue.computations`` carries), or msgpack junk."""
        roll = self.rng.random()
        if roll < 0.4 and depth < 3:
            cls = self.rng.choice(self.records)
            return msgpack.packb([self.record(cls, depth + 1) for _ in range(self.rng.choice([1, 2]))],
                                 default=_no_arrays)
        if roll < 0.6:
            return msgpack.packb(self.junk(depth + 1), default=_no_arrays)
        return self.rng.randbytes(self.rng.choice([0, 1, 7, 64]))

    def junk(self, depth: int = 0) -> Any:
        """Any msgpack value, of any type."""
        rng = self.rng
        choices: list[Callable[[], Any]] = [
            lambda: None, lambda: rng.random() < 0.5, lambda: rng.choice(INTS), lambda: rng.choice(FLOATS),
            lambda: rng.choice(STRINGS), lambda: rng.randbytes(rng.choice([0, 3, 40])),
            lambda: [] if depth > 2 else [self.junk(depth + 1) for _ in range(rng.choice([1, 2]))],
            lambda: {} if depth > 2 else {rng.choice(STRINGS): self.junk(depth + 1)},
            lambda: {rng.choice(INTS): 1},  # a non-string key
            lambda: msgpack.ExtType(rng.choice([0, 2, 7, 127]), rng.randbytes(4)),
            lambda: msgpack.ExtType(1, msgpack.packb([rng.choice(INTS), "float32", [1]])),
            lambda: msgpack.ExtType(1, rng.randbytes(5)),
        ]
        return rng.choice(choices)()

    # ------------------------------------------------------------- frames

    def frames(self, kind: str | None = None) -> tuple[str, list[bytes], bool]:
        """``(kind, frames, with_delimiter)`` for one message."""
        rng = self.rng
        kind = kind or rng.choice(KINDS)
        op = rng.choice(self.ops)
        cls = message_types()[op]
        body = self.record(cls)
        if kind == "valid":
            return kind, self._encode(op, body), True
        if kind in ("swapped", "wrong_type", "missing", "extra"):
            keys = list(body)
            if kind == "swapped" and len(keys) >= 2:
                a, b = rng.sample(keys, 2)
                body[a], body[b] = body[b], body[a]
            elif kind == "missing" and keys:
                del body[rng.choice(keys)]
            elif kind == "wrong_type" and keys:
                body[rng.choice(keys)] = self.junk()
            else:
                body[rng.choice(["fuzz_extra", *(k.upper() for k in keys)])] = self.junk()
            return kind, self._encode(op, body), True
        if kind == "huge":
            return kind, self._huge(op, body), True
        if kind == "truncated":
            frames = self._encode(op, body)
            roll = rng.random()
            if roll < 0.5:
                i = rng.randrange(len(frames))
                frames[i] = frames[i][:rng.randrange(len(frames[i]))] if frames[i] else b"\x00"
            elif roll < 0.8:
                frames = frames[:rng.randrange(len(frames))] or [b""]
            else:
                frames = [*frames, *(rng.randbytes(rng.choice([0, 8])) for _ in range(rng.choice([1, 2])))]
            return kind, frames, True
        if kind == "version":
            version = rng.choice([0, 2, -1, 2**64 - 1, "1", None, 1.0, [1]])
            header = msgpack.packb([version, op, self.msg_id(), None, "fuzz"])
            return kind, [header, *self._encode(op, body)[1:]], True
        if kind == "header":
            return kind, [self._bad_header(op), *self._encode(op, body)[1:]], True
        if kind == "random":
            return kind, [rng.randbytes(rng.choice([0, 1, 5, 30, 300])) for _ in range(rng.choice([1, 2, 3, 4]))], True
        frames = self._encode(op, body)  # envelope: a message without the routing delimiter
        return kind, frames, False

    def _encode(self, op: Any, body: Any) -> list[bytes]:
        try:
            frames = encode(_Body(op, body), msg_id=self.msg_id(), sender="fuzz")  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):  # junk msgpack itself refuses: send other junk
            frames = encode(_Body(op, {}), msg_id=self.msg_id(), sender="fuzz")  # type: ignore[arg-type]
        return [bytes(f) for f in frames]

    def _bad_header(self, op: str) -> bytes:
        rng = self.rng
        good: list[Any] = [PROTOCOL_VERSION, op, self.msg_id(), None, "fuzz"]
        roll = rng.randrange(6)
        if roll == 0:
            good[2] = rng.choice([*INTS, "1", None, 1.5, True, []])
        elif roll == 1:
            good[1] = rng.choice([None, 3, b"op", "fuzz.unknown", "", op.upper(), "x" * 900])
        elif roll == 2:
            good[3] = rng.choice([*INTS, "2", 1.5, True, {}])
        elif roll == 3:
            good[4] = rng.choice([None, 7, b"fuzz", ["fuzz"], "s" * 2000])
        elif roll == 4:
            good = good[:rng.randrange(5)] + ([None] * rng.randrange(3) if rng.random() < 0.5 else [])
        else:
            return msgpack.packb(self.junk(), default=_no_arrays)
        return msgpack.packb(good)

    def _huge(self, op: str, body: dict[str, Any]) -> list[bytes]:
        rng = self.rng
        header = msgpack.packb([PROTOCOL_VERSION, op, self.msg_id(), None, "fuzz"])
        roll = rng.randrange(8)
        key = rng.choice(list(body)) if body else "fuzz"
        if roll == 0:  # an array declaring far more elements than its buffer holds
            shape = rng.choice([[2**40], [2**31, 2**31], [2**63 - 1], [0, 2**62], [1] * 40, [3, -1]])
            meta = msgpack.packb([0, "float32", shape])
            body[key] = msgpack.ExtType(1, meta)
            return [header, _pack(body), b"\x00" * 16]
        if roll == 1:  # a buffer reference out of range, twice, or an odd dtype
            ref = rng.choice([[2**63 - 1, "float32", [1]], [-1, "float32", [1]], [0, rng.choice(ODD_DTYPES), [2]],
                              [0, "float32"], [0, "float32", [1], 9]])
            body[key] = [msgpack.ExtType(1, msgpack.packb(ref)), msgpack.ExtType(1, msgpack.packb(ref))]
            return [header, _pack(body), b"\x00" * 8]
        if roll == 2:  # a msgpack str / bin declaring 4 GiB, with a few bytes behind
            return [header, b"\x81\xa2op" + rng.choice([b"\xdb", b"\xc6"]) + b"\xff\xff\xff\xff" + b"x" * 10]
        if roll == 3:  # a list / map declaring 4 billion items
            return [header, b"\x81\xa2op" + rng.choice([b"\xdd", b"\xdf"]) + b"\xff\xff\xff\xff" + b"\xc0" * 10]
        if roll == 4:  # nesting deeper than any decoder's stack
            depth = rng.choice([600, 5000, 100_000])
            return [header, b"\x81\xa2op" + b"\x91" * depth + b"\xc0"]
        if roll == 5:  # a header over the limit
            return [msgpack.packb([PROTOCOL_VERSION, op, 1, None, "s" * 5000]), _pack(body)]
        if roll == 6:  # more buffer frames than a message may have (rare: 4,100 frames)
            return [header, _pack(body), *([b""] * 4100)] if rng.random() < 0.05 else [header, b"\xc1"]
        return [header, _pack(body), _MEGABYTE]  # a megabyte nobody refers to


def _pack(value: Any) -> bytes:
    """msgpack of a body with arrays as plain bytes (the ext form is what the codec makes)."""
    return msgpack.packb(value, default=_no_arrays)  # type: ignore[no-any-return]


def _no_arrays(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tobytes()
    raise TypeError(f"cannot pack {type(obj).__name__}")


# ------------------------------------------------------------------ control sockets


@dataclasses.dataclass
class TargetResult:
    name: str
    role: str
    plane: str  # "control" or "data"
    address: str
    frames: int = 0
    replies: int = 0
    pings: int = 0
    hangs: int = 0
    peers: int = 0
    seconds: float = 0.0
    kinds: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def frames_per_second(self) -> float:
        return self.frames / self.seconds if self.seconds else 0.0


def fuzz_control(maker: FrameMaker, name: str, role: str, address: str, frames: int, *, ping_every: int = 200,
                 frames_per_peer: int = 2500, hang_seconds: float = 20.0,
                 checkpoint: Callable[[int], None] | None = None) -> TargetResult:
    """Send ``frames`` fuzz frames to a daemon's ROUTER socket; a ``Ping`` every ``ping_every`` must come back."""
    result = TargetResult(name, role, "control", address)
    kinds: collections.Counter[str] = collections.Counter()
    ctx = zmq.Context()
    sock: zmq.Socket[bytes] | None = None
    started = time.monotonic()
    try:
        for i in range(frames):
            if i % frames_per_peer == 0:
                if sock is not None:
                    sock.close(linger=0)
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.RCVHWM, 0)
                sock.connect(address)
                result.peers += 1
            assert sock is not None
            kind, parts, delimited = maker.frames()
            kinds[kind] += 1
            sock.send_multipart([b"", *parts] if delimited else parts)
            result.replies += _drain(sock)
            if (i + 1) % ping_every == 0 or i == frames - 1:
                got, answered = _ping(sock, maker, hang_seconds)
                result.replies += got
                result.pings += 1
                if not answered:
                    result.hangs += 1
                    break
            if checkpoint is not None and (i + 1) % max(1, frames // 10) == 0:
                checkpoint(i + 1)
        result.frames = sum(kinds.values())
    finally:
        if sock is not None:
            sock.close(linger=0)
        ctx.term()
    result.seconds = time.monotonic() - started
    result.kinds = dict(kinds)
    return result


def _drain(sock: zmq.Socket[bytes]) -> int:
    got = 0
    while True:
        try:
            sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return got
        got += 1


def _ping(sock: zmq.Socket[bytes], maker: FrameMaker, timeout_seconds: float) -> tuple[int, bool]:
    """Send a ``Ping`` behind everything sent; (replies read, whether its ``Pong`` came in time)."""
    msg_id = maker.msg_id()
    sock.send_multipart([b"", *encode(Ping(), msg_id=msg_id, sender="fuzz")])
    deadline = time.monotonic() + timeout_seconds
    got = 0
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(left * 1000):
            break
        frames = sock.recv_multipart()
        got += 1
        if frames and frames[0] == b"":
            env = decode(frames[1:])
            if env.reply_to == msg_id and isinstance(env.message, Pong):
                return got, True
    return got, False


# ------------------------------------------------------------------ data plane

_LEN = struct.Struct("!I")


def fuzz_data(maker: FrameMaker, name: str, address: str, frames: int, *, hang_seconds: float = 20.0,
              checkpoint: Callable[[int], None] | None = None) -> TargetResult:
    """Send ``frames`` junk messages to an executor's data-plane port, over many connections. A stream
    whose handshake is not answered within ``hang_seconds`` is a hang (the port stopped serving)."""
    result = TargetResult(name, "executor", "data", address)
    kinds: collections.Counter[str] = collections.Counter()
    started = time.monotonic()
    sent = 0
    next_checkpoint = max(1, frames // 10)
    while sent < frames:
        result.peers += 1
        try:
            sent += _data_stream(maker, address, frames - sent, kinds, hang_seconds)
        except (TimeoutError, ConnectionRefusedError) as exc:
            result.hangs += 1
            print(f"{name}: the data plane stopped answering: {type(exc).__name__}: {exc}", flush=True)
            break
        if checkpoint is not None and sent >= next_checkpoint:
            checkpoint(sent)
            next_checkpoint += max(1, frames // 10)
    result.frames = sent
    result.seconds = time.monotonic() - started
    result.kinds = dict(kinds)
    return result


def _connect(address: str, timeout_seconds: float) -> socket.socket:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout_seconds)


def _data_stream(maker: FrameMaker, address: str, budget: int, kinds: collections.Counter[str],
                 timeout_seconds: float) -> int:
    """One connection's worth of junk (at most ``budget`` messages); how many were sent. Raises
    ``TimeoutError`` if a correct handshake is not answered: the only reply a data plane owes."""
    rng = maker.rng
    with _connect(address, timeout_seconds) as sock:
        roll = rng.random()
        if roll < 0.1:  # no handshake at all: bytes
            kinds["random"] += 1
            sock.sendall(rng.randbytes(rng.choice([1, 4, 100, 5000])))
            return 1
        if roll < 0.2:  # a handshake of the wrong shape or size
            kinds["handshake"] += 1
            hello = msgpack.packb(rng.choice([[], 7, "x", {"machine": 3}, {"machine": []}, None, {1: 2}]))
            sock.sendall(_LEN.pack(rng.choice([len(hello), 0, 2**32 - 1, 5000])) + hello)
            return 1
        shared = rng.random() < 0.5
        hello = msgpack.packb({"machine": machine_id() if shared else "", "pid": 1})
        sock.sendall(_LEN.pack(len(hello)) + hello)
        (n,) = _LEN.unpack(recv_bytes(sock, _LEN.size))
        recv_bytes(sock, n)
        # Up to 200 messages on this stream, sent back to back: mutated messages framed right, then maybe one
        # that is not (the stream ends there). Then the stream's end, and every acknowledgement until the
        # receiver closes it too: a receiver that stops reading shows as a timeout (a hang).
        sent, chunks = 0, []
        for _ in range(min(200, budget)):
            sent += 1
            if rng.random() < 0.15:
                kinds["preamble"] += 1
                chunks.append(_bad_preamble(rng))
                break
            kind, parts, _ = maker.frames()
            kinds[kind] += 1
            head = msgpack.packb([[INLINE, len(p), "", 0] for p in parts])
            chunks.append(_LEN.pack(len(head)) + head + b"".join(parts))
        try:
            sock.sendall(b"".join(chunks))
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass
        except TimeoutError:
            raise
        except OSError:  # it closed the stream before reading it all (a message it could not frame)
            pass
        return sent


def _bad_preamble(rng: random.Random) -> bytes:
    entries: Any = rng.choice([
        [[INLINE, 2**34, "", 0], [INLINE, 1, "", 0]],  # 16 GiB declared, nothing sent
        [[SHARED, 8, "pwmesh-fuzz-nosuch", 0], [INLINE, 1, "", 0]],
        [[SHARED, 8, "../../etc/passwd", 0], [INLINE, 1, "", 0]],
        [[SHARED, 8, "pwmesh-x", "zero"], [INLINE, 1, "", 0]],
        [[INLINE, -1, "", 0], [INLINE, 1, "", 0]],
        [[INLINE, "8", "", 0], [INLINE, 1, "", 0]],
        [[INLINE, 1], [INLINE, 1, "", 0]],
        [7, 8], [[]], "preamble", {"a": 1}, [[9, 1, "", 0], [INLINE, 1, "", 0]],
        [[INLINE, 0, "", 0]] * 5000,
    ])
    head = msgpack.packb(entries)
    length = rng.choice([len(head)] * 4 + [2**32 - 1, (1 << 20) + 1, 0])
    return _LEN.pack(length) + head


# ------------------------------------------------------------------ the cluster


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclasses.dataclass
class DaemonSample:
    name: str
    role: str
    pid: int
    alive: bool
    rss_bytes: int
    log_bytes: int


def sample(cluster: pw.LocalCluster) -> dict[str, DaemonSample]:
    out = {}
    for c in cluster.children:
        alive = c.popen.poll() is None
        out[c.name] = DaemonSample(c.name, c.role, c.popen.pid, alive, rss_bytes(c.popen.pid) if alive else 0,
                                   c.log_path.stat().st_size if c.log_path.exists() else 0)
    return out


def logged_since(path: Path, offset: int, top: int = 12) -> list[tuple[str, int]]:
    """What a daemon logged from ``offset`` on: its most frequent lines (timestamps dropped, cut at 160
    characters, tracebacks' lines counted like any other), with their counts."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    lines = (line.split(" level=", 1)[-1][:160] for line in text.splitlines() if line.strip())
    return collections.Counter(lines).most_common(top)


def targets(cluster: pw.LocalCluster) -> list[tuple[str, str, str, str]]:
    """``(name, role, plane, address)`` of every socket to fuzz: each daemon's control socket, each data plane."""
    out = []
    for c in cluster.children:
        out.append((c.name, c.role, "control", c.info["address"]))
        if c.role == "executor":
            out.append((c.name, c.role, "data", c.info["data"]))
    return out


def real_program(address: str) -> dict[str, Any]:
    """A two-slice ``pw.pmap`` chain on island 0 (data crosses executors when the slices do), values checked."""
    started = time.monotonic()
    with pw.Client(address, name="fuzz-check") as client:
        devs = client.make_virtual_device_set()
        s1, s2 = devs.add_slice(devices=1, island=0), devs.add_slice(devices=1, island=0)
        a = pw.pmap(lambda x: x * 2.0, devices=s1)
        b = pw.pmap(lambda x: x + 1.0, devices=s2)

        @pw.program
        def chain(v: Any) -> Any:
            return b(a(v))

        x = np.arange(4.0, dtype=np.float32).reshape(1, 4)
        got = np.asarray(chain(x))
        np.testing.assert_array_equal(got, x * 2.0 + 1.0)
        executors = sorted({d.executor for sl in (s1, s2) for d in sl.devices})
    return {"ok": True, "seconds": time.monotonic() - started, "executors": executors}


def run(cluster: pw.LocalCluster, frames: int, *, seed: int = 0,
        ping_every: int = 200,
        frames_per_peer: int = 2500, hang_seconds: float = 20.0, data_frames: int | None = None,
        only: Callable[[str, str, str], bool] = lambda name, role, plane: True,
        progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Fuzz every socket of a running ``cluster``; what happened, what grew, and the real program after."""
    maker = FrameMaker(seed)
    before = sample(cluster)
    curve: list[dict[str, Any]] = []  # RSS of every daemon as the run goes on

    def checkpoint(name: str) -> Callable[[int], None]:
        def at(done: int) -> None:
            now = sample(cluster)
            curve.append({"target": name, "frames": done, "rss_mib": {n: s.rss_bytes / 2**20 for n, s in now.items()}})
        return at

    results = []
    for name, role, plane, address in targets(cluster):
        if not only(name, role, plane):
            continue
        progress(f"{plane:7} {name:20} {address}")
        if plane == "control":
            r = fuzz_control(maker, name, role, address, frames, ping_every=ping_every,
                             frames_per_peer=frames_per_peer, hang_seconds=hang_seconds,
                             checkpoint=checkpoint(f"{name}/{plane}"))
        else:
            r = fuzz_data(maker, name, address, frames if data_frames is None else data_frames,
                          hang_seconds=hang_seconds, checkpoint=checkpoint(f"{name}/{plane}"))
        results.append(r)
        progress(f"        {r.frames} frames in {r.seconds:.1f} s ({r.frames_per_second:.0f}/s), "
                 f"{r.replies} replies, {r.hangs} hangs")
    after = sample(cluster)
    daemons = []
    for name, b in before.items():
        a = after[name]
        daemons.append({"name": name, "role": b.role, "pid": b.pid, "alive": a.alive,
                        "logged": logged_since(cluster.child(name).log_path, b.log_bytes),
                        "rss_before_mib": b.rss_bytes / 2**20, "rss_after_mib": a.rss_bytes / 2**20,
                        "rss_growth_mib": (a.rss_bytes - b.rss_bytes) / 2**20,
                        "log_before_bytes": b.log_bytes, "log_after_bytes": a.log_bytes,
                        "log_growth_bytes": a.log_bytes - b.log_bytes})
    program: dict[str, Any]
    try:
        program = real_program(cluster.address)
    except Exception as exc:  # reported, and counted against the run
        program = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    total_frames = sum(r.frames for r in results)
    total_seconds = sum(r.seconds for r in results)
    return {
        "targets": [{**dataclasses.asdict(r), "frames_per_second": r.frames_per_second} for r in results],
        "daemons": daemons,
        "rss_curve": curve,
        "program": program,
        "totals": {"frames": total_frames, "seconds": total_seconds,
                   "frames_per_second": total_frames / total_seconds if total_seconds else 0.0,
                   "crashes": sum(not d["alive"] for d in daemons), "hangs": sum(r.hangs for r in results),
                   "max_rss_growth_mib": max(d["rss_growth_mib"] for d in daemons),
                   "max_log_growth_bytes": max(d["log_growth_bytes"] for d in daemons)},
    }


def failures(result: dict[str, Any], max_rss_growth_mib: float, max_log_growth_kib: float) -> list[str]:
    """What the run's checks found wrong, in words (empty: it passed)."""
    out = []
    for d in result["daemons"]:
        if not d["alive"]:
            out.append(f"{d['name']} died")
        if d["rss_growth_mib"] > max_rss_growth_mib:
            out.append(f"{d['name']}'s RSS grew by {d['rss_growth_mib']:.1f} MiB (bound {max_rss_growth_mib})")
        if d["log_growth_bytes"] > max_log_growth_kib * 1024:
            out.append(f"{d['name']}'s log grew by {d['log_growth_bytes'] / 1024:.1f} KiB (bound {max_log_growth_kib})")
    for t in result["targets"]:
        if t["hangs"]:
            out.append(f"{t['name']} ({t['plane']}) stopped answering")
    if not result["program"]["ok"]:
        out.append(f"the real program failed: {result['program']['error']}")
    return out


def _selector(only: str) -> Callable[[str, str, str], bool]:
    wanted = {w.strip() for w in only.split(",") if w.strip()}
    return lambda name, role, plane: not wanted or bool({name, role, plane, f"{name}/{plane}"} & wanted)


def limit_address_space(cluster: pw.LocalCluster, gib: float) -> None:
    """Give each of ``cluster``'s daemons an address-space limit of ``gib`` GiB (``RLIMIT_AS``): one that
    runs away fails with ``MemoryError`` on its own instead of the kernel's OOM killer picking a victim
    on a shared machine (a daemon uses ~0.3-1.5 GiB of address space)."""
    limit = int(gib * 2**30)
    for child in cluster.children:
        _, hard = resource.prlimit(child.popen.pid, resource.RLIMIT_AS)
        resource.prlimit(child.popen.pid, resource.RLIMIT_AS,
                         (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


# Every kind of daemon, the fewest processes: one island, two executors (data crosses between them).
# Short timeouts: what the fuzz registered (executors, schedulers, sessions) is gone within seconds.
# A fuzzed executor's drain waits for shards a junk SendShards named and nobody will send (see
# bench/README.md), up to its drain timeout: the stop does not wait for that.
SPEC = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=1, heartbeat_timeout_seconds=5.0,
                           session_timeout_seconds=10.0, stop_timeout_seconds=3.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=10_000, help="frames per socket (and per data-plane port)")
    parser.add_argument("--data-frames", type=int, default=None, help="messages per data-plane port (default: --frames)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ping-every", type=int, default=200)
    parser.add_argument("--frames-per-peer", type=int, default=2500, help="a new connection after this many frames")
    parser.add_argument("--hang-seconds", type=float, default=20.0)
    parser.add_argument("--max-rss-growth-mib", type=float, default=64.0)
    parser.add_argument("--max-log-growth-kib", type=float, default=64.0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--smoke", action="store_true", help="tiny run (seconds) to check that everything works")
    parser.add_argument("--label", default="", help="suffix of the results file")
    parser.add_argument("--address-space-gib", type=float, default=8.0,
                        help="each daemon's address-space limit (a runaway daemon fails alone, not the machine)")
    parser.add_argument("--only", default="", help="fuzz only these targets: names, roles or planes, comma-separated")
    parser.add_argument("--log-dir", default=None, help="keep the daemons' logs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    frames = 300 if args.smoke else args.frames
    load_at_start = load_average()
    started = time.monotonic()
    os.environ.pop("PWMESH_ADDRESS", None)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    print(f"fuzz: a local cluster of {SPEC.islands} island x {SPEC.hosts_per_island} hosts x "
          f"{SPEC.devices_per_host} device; {frames} frames per socket ...", flush=True)
    cluster = pw.LocalCluster(SPEC, log_dir=args.log_dir)
    try:
        cluster.start()
        limit_address_space(cluster, args.address_space_gib)
        result = run(cluster, frames, seed=args.seed, ping_every=args.ping_every,
                     frames_per_peer=args.frames_per_peer, hang_seconds=args.hang_seconds,
                     data_frames=args.data_frames, only=_selector(args.only),
                     progress=lambda line: print(line, flush=True))
    finally:
        cluster.stop()
    found = failures(result, args.max_rss_growth_mib, args.max_log_growth_kib)
    result = {"benchmark": "fuzz", "smoke": args.smoke, "label": args.label,
              "config": {"frames_per_socket": frames, "data_frames": args.data_frames, "seed": args.seed,
                         "ping_every": args.ping_every, "frames_per_peer": args.frames_per_peer,
                         "hang_seconds": args.hang_seconds, "max_rss_growth_mib": args.max_rss_growth_mib,
                         "max_log_growth_kib": args.max_log_growth_kib, "cluster": dataclasses.asdict(SPEC),
                         "kinds": KINDS},
              **result, "failures": found, "machine": machine(load_at_start),
              "wall_seconds": time.monotonic() - started}
    print()
    print(table(["socket", "plane", "frames", "frames/s", "replies", "peers", "hangs"],
                [[t["name"], t["plane"], t["frames"], f"{t['frames_per_second']:.0f}", t["replies"], t["peers"],
                  t["hangs"]] for t in result["targets"]]))
    print()
    print(table(["daemon", "alive", "RSS MiB", "RSS growth MiB", "log growth KiB"],
                [[d["name"], "yes" if d["alive"] else "NO", f"{d['rss_after_mib']:.0f}",
                  f"{d['rss_growth_mib']:+.1f}", f"{d['log_growth_bytes'] / 1024:.1f}"] for d in result["daemons"]]))
    totals = result["totals"]
    print(f"\n{totals['frames']} frames in {totals['seconds']:.0f} s ({totals['frames_per_second']:.0f}/s); "
          f"crashes {totals['crashes']}, hangs {totals['hangs']}; real program: "
          f"{'ok' if result['program']['ok'] else result['program']['error']}")
    for d in result["daemons"]:
        if d["logged"]:
            print(f"\n{d['name']} logged, most often:")
            for line, count in d["logged"]:
                print(f"  {count:7d}  {line}")
    for line in found:
        print(f"FAILED: {line}")
    name = f"fuzz-{args.label}" if args.label else ("fuzz-smoke" if args.smoke else "fuzz")
    out_json = args.out / f"{name}.json"
    write_json(out_json, json.loads(json.dumps(result, default=str)))
    print(f"\nwrote {out_json}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
