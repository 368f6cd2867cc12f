"""Frame layout and codec: the only code that turns messages into bytes and back.

On the wire a message is the multipart frame list ``[header, body, *buffers]``
(a ROUTER socket prepends routing ids and an empty delimiter; see
``service.transport``). ``header`` is a msgpack array
``[protocol_version, op, msg_id, reply_to, sender]``. ``body`` is the msgpack map
of the message's fields. numpy arrays never pass through msgpack: each becomes an
extension value ``[frame_index, dtype, shape]`` and its bytes ride as a later
frame, sent without a copy and received as a read-only view of the frame.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import msgpack
import numpy as np

from pwmesh.errors import ProtocolError
from pwmesh.wire.messages import Message, Record, message_types

PROTOCOL_VERSION = 1
_ARRAY_EXT = 1
_ALLOWED_DTYPE_KINDS = frozenset("biufcV")  # V: ml_dtypes (bfloat16, float8...)


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """What an inbound message may weigh; anything over is rejected unread."""

    max_header_bytes: int = 1024
    max_body_bytes: int = 64 << 20
    max_buffers: int = 4096
    max_buffer_bytes: int = 16 << 30


DEFAULT_LIMITS = Limits()


class FrameError(ProtocolError):
    """A rejected inbound frame; ``msg_id``/``sender`` are set when the header was readable. ``reason`` is
    one word for the kind of fault (the metrics count by it; ``message`` says the rest)."""

    def __init__(self, message: str, *, msg_id: int | None = None, op: str | None = None,
                 reason: str = "malformed") -> None:
        super().__init__(message)
        self.msg_id = msg_id
        self.op = op
        self.reason = reason


class Gather:
    """An array sent from pieces of other arrays, never gathered in memory: its frame is ``views()``'s
    bytes back to back (the data plane writes them with scatter-gather ``sendmsg``, or copies them
    straight into a shared-memory slot); the receiver gets one contiguous array of ``shape``, as for
    an ndarray. A subclass says where the pieces are (``pwmesh.dataflow.exchange.Gathered``)."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize

    def views(self) -> Iterator[memoryview]:
        """The frame's bytes, in order, as byte views of the pieces' memory (``nbytes`` in all)."""
        raise NotImplementedError

    def into(self, out: np.ndarray) -> np.ndarray:
        """The frame's bytes copied into ``out`` (a writable uint8 array of ``nbytes``); returns ``out``."""
        at = 0
        for view in self.views():
            out[at:at + view.nbytes] = np.frombuffer(view, np.uint8)
            at += view.nbytes
        if at != self.nbytes:
            raise ValueError(f"a gathered frame of {at} bytes, {self.nbytes} expected")
        return out


def frame_nbytes(frame: Any) -> int:
    """A frame's size: bytes, a buffer, or a ``Gather``."""
    return frame.nbytes if isinstance(frame, Gather) else memoryview(frame).nbytes


@dataclasses.dataclass(slots=True)
class Envelope:
    """A decoded message and the header fields around it."""

    message: Message
    msg_id: int
    reply_to: int | None
    sender: str  # the name the sender gives itself (a header field: for logs, never for decisions)
    # Who sent it, set by the receiving daemon from the connection's key (not on the wire): the key's
    # name and role ("daemon", "admin", "client"; "local" and "daemon" on a cluster without keys).
    user: str = ""
    role: str = ""


_DTYPE_NAMES: dict[np.dtype, str] = {}


def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, remembered: NumPy works it out in Python each time (~1.6 us; a training step's
    messages name ~30 dtypes in the proxy alone)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = dtype.name
        if len(_DTYPE_NAMES) < 256:  # a few in practice; never a table that grows with what is sent
            _DTYPE_NAMES[dtype] = name
    return name


def dtype_from_name(name: str) -> np.dtype:
    try:
        dtype = np.dtype(name)
    except TypeError:
        import ml_dtypes  # noqa: PLC0415 - optional: only needed for exotic float types

        try:
            dtype = np.dtype(getattr(ml_dtypes, name))
        except AttributeError:
            raise ProtocolError(f"unknown dtype {name!r}") from None
    if dtype.kind not in _ALLOWED_DTYPE_KINDS or dtype.hasobject or dtype.itemsize == 0:
        # Zero-byte items would let a tiny message claim arrays of any length.
        raise ProtocolError(f"dtype {name!r} is not allowed on the wire")
    return dtype


def encode(message: Message, *, msg_id: int, reply_to: int | None = None, sender: str = "") -> list[Any]:
    """Frames for ``message``: ``[header, body, *buffers]`` (buffers are not copied; a ``Gather`` stays one,
    for the data plane to write: only it sends messages that hold one)."""
    buffers: list[Any] = []

    def default(obj: Any) -> Any:
        if isinstance(obj, Gather):  # its bytes go as they are: native-endian, C order, like an ndarray's
            buffers.append(obj)
            return msgpack.ExtType(_ARRAY_EXT, msgpack.packb([len(buffers) - 1, dtype_name(obj.dtype),
                                                              list(obj.shape)]))
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise TypeError("object arrays cannot be sent")
            # ascontiguousarray makes 0-d arrays 1-d: keep the shape. The wire is native-endian.
            arr = np.ascontiguousarray(obj).reshape(obj.shape)
            if not arr.dtype.isnative:
                arr = arr.astype(arr.dtype.newbyteorder("="))
            # A uint8 view: ml_dtypes (bfloat16...) have no buffer-protocol format of their own.
            buffers.append(arr.reshape(-1).view(np.uint8).data if arr.size else b"")
            meta = msgpack.packb([len(buffers) - 1, dtype_name(arr.dtype), list(arr.shape)])
            return msgpack.ExtType(_ARRAY_EXT, meta)
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, (tuple, set, frozenset)):
            return list(obj)
        raise TypeError(f"cannot encode {type(obj).__name__}")

    header = msgpack.packb([PROTOCOL_VERSION, message.op, msg_id, reply_to, sender])
    body = msgpack.packb(message.to_wire(), default=default)
    # What the receiver would reject unread is refused here, where the sender can say so: never sent
    # to be dropped (a run waiting on it would wait for ever).
    limits = DEFAULT_LIMITS
    if len(body) > limits.max_body_bytes or len(buffers) > limits.max_buffers or any(
            frame_nbytes(b) > limits.max_buffer_bytes for b in buffers):
        raise ProtocolError(f"{message.op} would be {len(body)} bytes and {len(buffers)} buffers, over what a "
                            f"message may carry ({limits.max_body_bytes} bytes, {limits.max_buffers} buffers of "
                            f"{limits.max_buffer_bytes} bytes each): it was not sent")
    return [header, body, *buffers]


def pack_records(records: Sequence[Record]) -> bytes:
    """A list of records (no arrays inside) as msgpack bytes: what one daemon packs once and
    another forwards unread (a run's computations, through the island scheduler)."""
    return msgpack.packb([r.to_wire() for r in records])  # type: ignore[no-any-return]


def unpack_records(data: bytes, cls: type[Record], what: str) -> list[Any]:
    """``pack_records``' inverse, validated like any message body; ``ProtocolError`` on anything wrong."""
    try:
        items = _unpack(data)
    except Exception as exc:
        raise ProtocolError(f"unreadable {what}: {type(exc).__name__}: {exc}") from None
    if not isinstance(items, list):
        raise ProtocolError(f"{what}: expected a list, got {type(items).__name__}")
    return [cls.from_wire(item, f"{what}[{i}]") for i, item in enumerate(items)]


def _unpack(data: Any, **kwargs: Any) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=True, **kwargs)


def decode_header(frame: Any, limits: Limits = DEFAULT_LIMITS) -> tuple[str, int, int | None, str]:
    """``(op, msg_id, reply_to, sender)`` from a header frame, fully validated."""
    view = memoryview(frame)
    if view.nbytes > limits.max_header_bytes:
        raise FrameError(f"header of {view.nbytes} bytes exceeds {limits.max_header_bytes}", reason="oversized")
    try:
        header = _unpack(view)
    except Exception as exc:
        raise FrameError(f"unreadable header: {exc}", reason="header") from None
    if not isinstance(header, list) or len(header) != 5:
        raise FrameError("header must be [version, op, msg_id, reply_to, sender]", reason="header")
    version, op, msg_id, reply_to, sender = header
    if not isinstance(msg_id, int) or isinstance(msg_id, bool):
        raise FrameError("header msg_id must be an integer", reason="header")
    if version != PROTOCOL_VERSION:
        raise FrameError(
            f"protocol version {version!r} is not supported (this side speaks {PROTOCOL_VERSION})",
            msg_id=msg_id, reason="version",
        )
    if not isinstance(op, str):
        raise FrameError("header op must be a string", msg_id=msg_id, reason="header")
    if reply_to is not None and (not isinstance(reply_to, int) or isinstance(reply_to, bool)):
        raise FrameError("header reply_to must be an integer or nil", msg_id=msg_id, op=op, reason="header")
    if not isinstance(sender, str):
        raise FrameError("header sender must be a string", msg_id=msg_id, op=op, reason="header")
    return op, msg_id, reply_to, sender


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Envelope:
    """Validate and decode ``[header, body, *buffers]``; raise ``FrameError`` on anything wrong."""
    if not frames:
        raise FrameError("empty message", reason="header")
    op, msg_id, reply_to, sender = decode_header(frames[0], limits)
    if len(frames) < 2:  # the header was readable: the sender gets an answer, not a timeout
        raise FrameError("a message needs a header and a body frame", msg_id=msg_id, op=op, reason="body")
    cls = message_types().get(op)
    if cls is None:
        raise FrameError(f"unknown op {op!r}", msg_id=msg_id, op=op, reason="unknown_op")
    buffers = [memoryview(f) for f in frames[2:]]
    if len(buffers) > limits.max_buffers:
        raise FrameError(f"{len(buffers)} buffers exceed the limit of {limits.max_buffers}", msg_id=msg_id, op=op,
                         reason="oversized")
    if sum(b.nbytes for b in buffers) > limits.max_buffer_bytes:
        raise FrameError(f"buffers exceed {limits.max_buffer_bytes} bytes", msg_id=msg_id, op=op, reason="oversized")
    body_view = memoryview(frames[1])
    if body_view.nbytes > limits.max_body_bytes:
        raise FrameError(f"body of {body_view.nbytes} bytes exceeds {limits.max_body_bytes}", msg_id=msg_id, op=op,
                         reason="oversized")
    used: set[int] = set()

    def ext_hook(code: int, data: bytes) -> Any:
        if code != _ARRAY_EXT:
            raise ProtocolError(f"unknown extension type {code}")
        meta = _unpack(data)
        if not (isinstance(meta, list) and len(meta) == 3 and isinstance(meta[0], int) and isinstance(meta[1], str)
                and isinstance(meta[2], list) and all(isinstance(d, int) and d >= 0 for d in meta[2])):
            raise ProtocolError("malformed array reference")
        index, dtype_name, shape = meta
        if not 0 <= index < len(buffers):
            raise ProtocolError(f"array references frame {index}, but only {len(buffers)} buffers came")
        if index in used:
            raise ProtocolError(f"buffer frame {index} referenced twice")
        used.add(index)
        dtype = dtype_from_name(dtype_name)
        expected = math.prod(shape) * dtype.itemsize
        buf = buffers[index]
        if buf.nbytes != expected:
            raise ProtocolError(f"buffer {index} has {buf.nbytes} bytes, {dtype_name}{shape} needs {expected}")
        return np.frombuffer(buf, dtype=dtype).reshape(shape) if expected else np.zeros(shape, dtype)

    try:
        body = _unpack(body_view, ext_hook=ext_hook)
        message = cls.from_wire(body)
    except FrameError:
        raise
    except ProtocolError as exc:
        raise FrameError(f"bad {op} body: {exc.message}", msg_id=msg_id, op=op, reason="body") from None
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise FrameError(f"unreadable {op} body: {type(exc).__name__}: {exc}", msg_id=msg_id, op=op,
                         reason="body") from None
    if len(used) != len(buffers):
        raise FrameError(f"{len(buffers) - len(used)} buffer frame(s) not referenced by the body", msg_id=msg_id, op=op,
                         reason="body")
    return Envelope(message=message, msg_id=msg_id, reply_to=reply_to, sender=sender)
