"""The wire codec: every registered message round-trips, and every bad frame is a FrameError.

Strategies are derived from each Record's type hints, so a new message type is
covered by the round-trip and negative tests as soon as it is registered.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import threading
import types
import typing
from typing import Any

import ml_dtypes
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pwmesh.errors import ProtocolError
from pwmesh.wire import PROTOCOL_VERSION, Envelope, Limits, Message, Record, decode, encode, message_types, schema
from pwmesh.wire.codec import FrameError
from pwmesh.wire.messages import (
    Computation,
    DataTuple,
    Enqueue,
    FanOut,
    Ok,
    Ping,
    PutBuffer,
    PutShards,
    ShardRun,
    ShardValues,
    TupleBatch,
    enqueue_body,
)
from pwmesh.wire.schema import record

PROPERTY = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=5,
    # One shrunk counterexample per test is enough and keeps a failing run fast; the
    # explicit dtype × shape test lists every broken combination at once.
    report_multiple_bugs=False,
    # No explain phase: it traces every line and makes a falsified example cost minutes.
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FUZZ = settings(PROPERTY, max_examples=40)

OPS = sorted(message_types())
ARRAY_DTYPES = [np.dtype(np.float32), np.dtype(np.int32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.bool_)]

# --------------------------------------------------------------- strategies


def _float32_array(shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(np.float32, shape, elements=st.floats(width=32))


def _array_of(dtype: np.dtype, shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    if dtype == np.dtype(ml_dtypes.bfloat16):
        # hypothesis cannot draw ml_dtypes directly: round float32 values instead.
        return _float32_array(shape).map(lambda a: a.astype(ml_dtypes.bfloat16))
    return hnp.arrays(dtype, shape)


def _layout(arr: np.ndarray, how: str) -> np.ndarray:
    """Optionally a non-contiguous view, which encode must make contiguous."""
    if how == "reversed" and arr.ndim >= 1:
        return arr[::-1]
    if how == "transposed" and arr.ndim >= 2:
        return arr.T
    return arr


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = draw(st.sampled_from(ARRAY_DTYPES))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    arr = draw(_array_of(dtype, shape))
    return _layout(arr, draw(st.sampled_from(["contiguous", "reversed", "transposed"])))


_ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=5,
)

_SCALARS: dict[Any, st.SearchStrategy[Any]] = {
    int: st.integers(min_value=-(2**63), max_value=2**64 - 1),
    float: st.floats(allow_nan=True, allow_infinity=True),
    str: st.text(max_size=12),
    bool: st.booleans(),
    bytes: st.binary(max_size=24),
    np.ndarray: arrays(),
}


def strategy_for(tp: Any) -> st.SearchStrategy[Any]:
    """A strategy for any annotation the schema supports; fails loudly on a new one."""
    if tp is Any:
        return _ANY
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return st.one_of(*[st.none() if arg is type(None) else strategy_for(arg) for arg in typing.get_args(tp)])
    if origin is list:
        (item,) = typing.get_args(tp)
        return st.lists(strategy_for(item), max_size=3)
    if origin is dict:
        key, value = typing.get_args(tp)
        assert key is str, f"dict keys on the wire are strings, not {key}"
        return st.dictionaries(st.text(max_size=6), strategy_for(value), max_size=3)
    if isinstance(tp, type) and issubclass(tp, Record):
        return record_strategy(tp)
    if tp in _SCALARS:
        return _SCALARS[tp]
    raise AssertionError(f"no strategy for annotation {tp!r}: extend strategy_for")


@functools.cache
def field_hints(cls: type) -> dict[str, Any]:
    """The fields that travel (not those a sender alone fills in, ``metadata={"wire": False}``: ``FanOut.parts``)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.metadata.get("wire", True)}


def record_strategy(cls: type) -> st.SearchStrategy[Any]:
    fields = {name: strategy_for(tp) for name, tp in field_hints(cls).items()}
    return st.fixed_dictionaries(fields).map(lambda kw: cls(**kw))


MESSAGE_STRATEGIES = {op: record_strategy(cls) for op, cls in message_types().items()}


def headers() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({
        "msg_id": st.integers(min_value=0, max_value=2**63 - 1),
        "reply_to": st.none() | st.integers(min_value=0, max_value=2**63 - 1),
        "sender": st.text(max_size=20),
    })


# --------------------------------------------------------------- helpers


def on_the_wire(frames: list[Any]) -> list[bytes]:
    """What a socket delivers: each frame copied into its own bytes object."""
    return [bytes(f) for f in frames]


def assert_same(expected: Any, actual: Any, path: str = "message") -> None:
    if isinstance(expected, Record):
        assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
        for name in field_hints(type(expected)):
            assert_same(getattr(expected, name), getattr(actual, name), f"{path}.{name}")
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), f"{path}: got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        if expected.dtype.kind == "V":
            # ml_dtypes NaNs compare unequal under np.testing: compare the exact bits.
            bits = np.dtype(f"u{expected.dtype.itemsize}")
            np.testing.assert_array_equal(actual.view(bits), expected.view(bits), err_msg=path)
        else:
            np.testing.assert_array_equal(actual, expected, err_msg=path)
    elif isinstance(expected, float):
        assert type(actual) is float, f"{path}: got {type(actual).__name__}"
        if math.isnan(expected):
            assert math.isnan(actual), path
        else:
            assert actual == expected and math.copysign(1, actual) == math.copysign(1, expected), path
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, list) and len(actual) == len(expected), f"{path}: {actual!r}"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same(e, a, f"{path}[{i}]")
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), f"{path}: {actual!r}"
        for k in expected:
            assert_same(expected[k], actual[k], f"{path}[{k!r}]")
    else:
        assert type(actual) is type(expected) and actual == expected, f"{path}: {actual!r} != {expected!r}"


def rebuild(frames: list[bytes], *, header: list[Any] | None = None, body: Any = None) -> list[bytes]:
    """``frames`` with the header or body replaced (given as unpacked values), buffers kept."""
    new_header = msgpack.packb(header) if header is not None else frames[0]
    new_body = msgpack.packb(body) if body is not None else frames[1]
    return [new_header, new_body, *frames[2:]]


def unpack_body(frames: list[bytes]) -> dict[str, Any]:
    """The body as a map, array references left as msgpack ``ExtType`` values."""
    return msgpack.unpackb(frames[1], raw=False)


def header_of(op: str, msg_id: int = 41) -> list[Any]:
    return [PROTOCOL_VERSION, op, msg_id, None, "tester"]


def array_frames(array: np.ndarray, msg_id: int = 41) -> list[bytes]:
    return on_the_wire(encode(PutBuffer(buffer=3, slice_id=1, array=array), msg_id=msg_id))


def with_array_ref(frames: list[bytes], **changes: Any) -> list[bytes]:
    """Rewrite the PutBuffer array reference ``[frame_index, dtype, shape]`` in place."""
    body = unpack_body(frames)
    ext = body["array"]
    index, dtype, shape = msgpack.unpackb(ext.data)
    meta = {"index": index, "dtype": dtype, "shape": shape, **changes}
    body["array"] = msgpack.ExtType(ext.code, msgpack.packb([meta["index"], meta["dtype"], meta["shape"]]))
    return rebuild(frames, body=body)


def expect_frame_error(frames: list[Any], limits: Limits | None = None, *, msg_id: int | None = 41,
                       case: object = "") -> FrameError:
    """Decoding must fail with FrameError (nothing else), carrying ``msg_id`` when the header was readable."""
    try:
        decode(frames) if limits is None else decode(frames, limits)
    except FrameError as exc:
        err = exc
    except Exception as exc:  # noqa: BLE001 - the point: anything but FrameError is a failure
        pytest.fail(f"{case}: raised {type(exc).__name__} instead of FrameError: {exc}")
    else:
        pytest.fail(f"{case}: decoded without an error")
    assert isinstance(err, ProtocolError)
    assert err.msg_id == msg_id, f"{case}: msg_id {err.msg_id} != {msg_id}: {err}"
    return err


def decode_or_frame_error(frames: list[bytes]) -> Envelope | None:
    try:
        return decode(frames)
    except FrameError:
        return None


def sample(tp: Any) -> Any:
    """A deterministic, fully populated value for an annotation (first arm of a union)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return [1, "any"]
    if origin in (types.UnionType, typing.Union):
        return sample(next(arg for arg in typing.get_args(tp) if arg is not type(None)))
    if origin is list:
        (item,) = typing.get_args(tp)
        return [sample(item)]
    if origin is dict:
        return {"k": sample(typing.get_args(tp)[1])}
    if isinstance(tp, type) and issubclass(tp, Record):
        return tp(**{name: sample(t) for name, t in field_hints(tp).items()})
    if tp is np.ndarray:
        return np.arange(6, dtype=np.int32).reshape(2, 3)
    return {int: 1234567, float: -2.5, str: "héllo", bool: True, bytes: b"\x00\xc1\xff"}[tp]


def required_fields(op: str) -> list[str]:
    return [f.name for f in dataclasses.fields(message_types()[op])
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def sample_frames(op: str) -> list[bytes]:
    return on_the_wire(encode(sample(message_types()[op]), msg_id=41, sender="sampler"))


def wrong_value(tp: Any) -> Any:
    """A value that ``tp`` rejects: strings only pass ``str`` (and ``Any``), so use an int there."""
    arms = typing.get_args(tp) if typing.get_origin(tp) in (types.UnionType, typing.Union) else (tp,)
    assert Any not in arms, "an Any field accepts every value"
    return 7 if str in arms else "not-the-right-type"


# --------------------------------------------------------------- registry


def test_registry_holds_every_message_as_the_final_slotted_dataclass() -> None:
    types_ = message_types()
    assert {"error", "ok", "ping", "sched.schedule_run", "exec.enqueue", "proxy.run_program"} <= set(types_)
    for op, cls in types_.items():
        assert cls.op == op
        assert issubclass(cls, Message)
        assert dataclasses.is_dataclass(cls)
        assert "__slots__" in cls.__dict__, f"{op}: registry kept the pre-dataclass class"


def test_every_annotation_has_a_strategy() -> None:
    for cls in message_types().values():
        for name, tp in field_hints(cls).items():
            assert strategy_for(tp) is not None, f"{cls.__name__}.{name}"


@pytest.mark.parametrize("op", OPS)
@PROPERTY
@given(data=st.data())
def test_a_records_maker_makes_what_its_class_makes(op: str, data: st.DataObject) -> None:
    message = data.draw(MESSAGE_STRATEGIES[op], label="message")
    fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    made = schema.maker(type(message))(**fields)
    assert type(made) is type(message) and made == message


def test_a_makers_defaults_are_the_classs_and_each_record_gets_its_own_lists() -> None:
    make = schema.maker(Enqueue)
    required = {"run_id": "r", "proxy": "p", "nodes": [0], "computations": b""}
    one, two = make(**required), make(**required)
    assert one == Enqueue(**required) and one.seqs == [] and one.seqs is not two.seqs
    with pytest.raises(TypeError):
        make(**required, nonsense=1)
    with pytest.raises(TypeError):
        make(run_id="r")  # a required field left out

    @record
    class Checked(Record):
        n: int

        def __post_init__(self) -> None:
            self.n += 1

    assert schema.maker(Checked) is Checked  # its __init__ does more than store: the class itself


# --------------------------------------------------------------- round trips


@pytest.mark.parametrize("op", OPS)
@PROPERTY
@given(data=st.data(), header=headers())
def test_every_message_type_round_trips(op: str, data: st.DataObject, header: dict[str, Any]) -> None:
    message = data.draw(MESSAGE_STRATEGIES[op], label="message")
    frames = encode(message, **header)
    env = decode(on_the_wire(frames))
    assert type(env.message) is type(message)
    assert (env.msg_id, env.reply_to, env.sender) == (header["msg_id"], header["reply_to"], header["sender"])
    assert_same(message, env.message)


def test_array_dtypes_and_shapes_round_trip() -> None:
    """Every dtype × shape, 0-d and 0-size included; all failing cases are reported together."""
    problems = []
    for dtype, shape in itertools.product(ARRAY_DTYPES, [(), (0,), (3, 0), (0, 0, 2), (1,), (2, 3), (2, 1, 3)]):
        array = (np.arange(math.prod(shape)) % 3).astype(dtype).reshape(shape)
        try:
            got = decode(array_frames(array)).message.array
            assert got.dtype == dtype, f"dtype {got.dtype}"
            assert got.shape == shape, f"shape {got.shape}"
            np.testing.assert_array_equal(got.astype(np.float32), array.astype(np.float32))
            assert not got.size or not got.flags.writeable, "received arrays are read-only views of their frame"
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            problems.append(f"{dtype}{list(shape)}: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("byteorder", [">", "<"])
def test_arrays_of_either_byte_order_round_trip_by_value(byteorder: str) -> None:
    array = np.arange(4, dtype=f"{byteorder}i4")
    got = decode(array_frames(array)).message.array
    np.testing.assert_array_equal(got, array)


def test_buffers_go_out_of_band_without_a_copy() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    frames = encode(ShardValues(arrays=[array, array[1:]]), msg_id=5)
    assert len(frames) == 4
    assert np.shares_memory(np.asarray(frames[2]), array)
    assert array.tobytes() not in bytes(frames[1]), "array bytes must not ride in the msgpack body"
    got = decode(on_the_wire(frames)).message.arrays
    np.testing.assert_array_equal(got[1], array[1:])


def test_optional_array_and_error_fields_round_trip_as_none() -> None:
    message = TupleBatch(tuples=[DataTuple(prefix="s/b", shard=0, device=1, src=0, sources=1, shape=[2],
                                           dtype="float32", count=0)])
    env = decode(on_the_wire(encode(message, msg_id=9, reply_to=3, sender="x")))
    assert env.message == message
    assert env.message.tuples[0].array is None and env.message.tuples[0].error is None
    assert (env.msg_id, env.reply_to, env.sender) == (9, 3, "x")
    assert len(encode(message, msg_id=9)) == 2


def test_object_arrays_cannot_be_encoded() -> None:
    with pytest.raises(TypeError):
        encode(PutBuffer(buffer=1, slice_id=1, array=np.array([object()])), msg_id=1)


# --------------------------------------------------------------- negative: structure


def test_fewer_than_two_frames() -> None:
    expect_frame_error([], msg_id=None)
    expect_frame_error([b"\x95"], msg_id=None)


def test_header_without_body_still_names_its_msg_id() -> None:
    """A lone but readable header: the error must carry msg_id so the peer gets a reply."""
    header = on_the_wire(encode(Ping(), msg_id=41))[0]
    expect_frame_error([header], msg_id=41)


def test_bad_headers() -> None:
    """msg_id is reported exactly when the header parsed and held an integer id."""
    cases = {
        "unreadable": (b"\xc1", None),
        "map-not-array": (msgpack.packb({"op": "ping"}), None),
        "four-fields": (msgpack.packb([PROTOCOL_VERSION, "ping", 41, None]), None),
        "msg_id-str": (msgpack.packb([PROTOCOL_VERSION, "ping", "41", None, ""]), None),
        "msg_id-bool": (msgpack.packb([PROTOCOL_VERSION, "ping", True, None, ""]), None),
        "newer-version": (msgpack.packb([PROTOCOL_VERSION + 1, "ping", 41, None, ""]), 41),
        "older-version": (msgpack.packb([0, "ping", 41, None, ""]), 41),
        "op-int": (msgpack.packb([PROTOCOL_VERSION, 7, 41, None, ""]), 41),
        "reply_to-str": (msgpack.packb([PROTOCOL_VERSION, "ping", 41, "3", ""]), 41),
        "reply_to-bool": (msgpack.packb([PROTOCOL_VERSION, "ping", 41, False, ""]), 41),
        "sender-int": (msgpack.packb([PROTOCOL_VERSION, "ping", 41, None, 5]), 41),
    }
    for case, (header, msg_id) in cases.items():
        expect_frame_error([header, msgpack.packb({})], msg_id=msg_id, case=case)


def test_wrong_protocol_version_says_so() -> None:
    frames = on_the_wire(encode(Ping(), msg_id=41))
    err = expect_frame_error(rebuild(frames, header=[PROTOCOL_VERSION + 1, "ping", 41, None, ""]))
    assert "version" in str(err)


def test_unknown_op() -> None:
    err = expect_frame_error([msgpack.packb(header_of("no.such_op")), msgpack.packb({})])
    assert err.op == "no.such_op"


def test_oversized_frames_are_rejected() -> None:
    message = ShardValues(arrays=[np.zeros(20, np.float32), np.zeros(20, np.float32)])
    frames = on_the_wire(encode(message, msg_id=41, sender="a-sender-name"))
    decode(frames)  # fine under the default limits
    expect_frame_error(frames, Limits(max_header_bytes=8), msg_id=None, case="header")
    expect_frame_error(frames, Limits(max_body_bytes=16), case="body")
    expect_frame_error(frames, Limits(max_buffers=1), case="buffer count")
    expect_frame_error(frames, Limits(max_buffer_bytes=100), case="buffer bytes")


def test_limits_are_inclusive() -> None:
    frames = on_the_wire(encode(ShardValues(arrays=[np.zeros(25, np.float32)]), msg_id=41))
    exact = Limits(max_header_bytes=len(frames[0]), max_body_bytes=len(frames[1]), max_buffers=1,
                   max_buffer_bytes=100)
    decode(frames, exact)


def test_body_that_is_not_a_map() -> None:
    for body in ([], "x", 5, None, msgpack.ExtType(9, b"")):
        expect_frame_error([msgpack.packb(header_of("ping")), msgpack.packb(body)], case=repr(body))


def test_non_string_map_keys() -> None:
    body = msgpack.packb({1: "executor"})
    expect_frame_error([msgpack.packb(header_of("pong")), body])


# --------------------------------------------------------------- negative: every message type


def test_unknown_field_in_any_message() -> None:
    for op in OPS:
        frames = sample_frames(op)
        body = unpack_body(frames)
        body["no_such_field"] = 1
        err = expect_frame_error(rebuild(frames, body=body), case=op)
        assert err.op == op
        assert "no_such_field" in str(err)


def test_sample_messages_round_trip() -> None:
    """The fully populated base that the per-field negative tests damage is itself valid."""
    for op in OPS:
        message = sample(message_types()[op])
        env = decode(sample_frames(op))
        assert (env.msg_id, env.reply_to, env.sender) == (41, None, "sampler")
        assert_same(message, env.message)


def test_a_fanouts_parts_travel_as_opaque_bodies_encoded_once_each() -> None:
    """``FanOut.parts`` (the sender's Enqueues) go out as encoded bodies after any ``bodies`` given; the
    receiver gets bytes alone, each the Enqueue's own body, decoded only on demand (``enqueue_body``)."""
    parts = [sample(Enqueue), Enqueue(run_id="r", proxy="p", nodes=[3], computations=b"", executor_seq=7)]
    given = msgpack.packb(parts[0].to_wire())
    sent = FanOut(run_id="r", parent="tcp://s", bodies=[given], parts=parts, executors=["a", "b", "c"],
                  controls=["ca", "cb", "cc"], sizes=[3, 1, 1])
    assert sent.count() == 3
    got = decode(on_the_wire(encode(sent, msg_id=1))).message
    assert isinstance(got, FanOut) and got.parts == [] and all(type(b) is bytes for b in got.bodies)
    assert got.bodies[0] == given == got.bodies[1]
    for body, part in zip(got.bodies, [parts[0], *parts], strict=True):
        assert_same(part, enqueue_body(body))
    with pytest.raises(ProtocolError, match="unreadable the part: ExtraData"):
        enqueue_body(got.bodies[2] + b"\x00", "the part")
    with pytest.raises(ProtocolError, match="executor_seq"):
        enqueue_body(msgpack.packb({**parts[1].to_wire(), "executor_seq": "seven"}), "the part")


def test_missing_required_fields() -> None:
    for op in OPS:
        frames = sample_frames(op)
        for field in required_fields(op):
            body = unpack_body(frames)
            del body[field]
            err = expect_frame_error(rebuild(frames, body=body), case=f"{op} without {field}")
            assert err.op == op
            assert repr(field) in str(err), f"{op}: error does not name missing {field!r}: {err}"


def test_optional_fields_may_be_left_out() -> None:
    for op in OPS:
        cls = message_types()[op]
        required = required_fields(op)
        message = cls(**{name: sample(tp) for name, tp in field_hints(cls).items() if name in required})
        frames = on_the_wire(encode(message, msg_id=41))
        body = {name: value for name, value in unpack_body(frames).items() if name in required}
        assert_same(message, decode(rebuild(frames, body=body)).message)


def test_wrong_field_types() -> None:
    for op in OPS:
        frames = sample_frames(op)
        for field, tp in field_hints(message_types()[op]).items():
            body = unpack_body(frames)
            body[field] = wrong_value(tp)
            err = expect_frame_error(rebuild(frames, body=body), case=f"{op}.{field}={body[field]!r}")
            assert f".{field}" in str(err), f"{op}: error does not name {field!r}: {err}"


def test_scalar_types_are_strict() -> None:
    """msgpack keeps bool, int and float apart, and so must the schema."""
    for field, value in [("first_seq", True), ("first_seq", 1.0), ("first_seq", "1"), ("count", None),
                         ("count", [1])]:
        body = {"first_seq": 0, "count": 1, field: value}
        expect_frame_error([msgpack.packb(header_of("sched.scheduled")), msgpack.packb(body)],
                           case=f"{field}={value!r}")


def test_nested_record_errors_name_their_path() -> None:
    body = {"slice": {"slice_id": 1, "owner": "s", "island": 0, "map_version": 1, "scheduler": "tcp://x",
                      "devices": [{"executor_id": "e", "island": 0, "host": "h", "device": "zero",
                                   "control": "c", "data": "d"}]}}
    err = expect_frame_error([msgpack.packb(header_of("proxy.slice_created")), msgpack.packb(body)])
    assert "devices[0].device" in str(err)


# --------------------------------------------------------------- negative: array references


def test_array_reference_to_a_missing_frame() -> None:
    frames = array_frames(np.arange(4, dtype=np.int32))
    expect_frame_error(with_array_ref(frames, index=1))
    expect_frame_error(with_array_ref(frames, index=-1))
    expect_frame_error(frames[:2])


def test_array_frame_of_the_wrong_size() -> None:
    frames = array_frames(np.arange(4, dtype=np.int32))
    for delta in (-16, -4, -1, 1, 4):
        buffer = frames[2][:16 + delta] if delta < 0 else frames[2] + b"\0" * delta
        expect_frame_error([*frames[:2], buffer], case=f"{delta:+d} bytes")


def test_array_shape_that_disagrees_with_the_frame() -> None:
    frames = array_frames(np.arange(4, dtype=np.int32))
    expect_frame_error(with_array_ref(frames, shape=[5]))
    expect_frame_error(with_array_ref(frames, dtype="float64"))


def test_unreferenced_extra_frame() -> None:
    frames = array_frames(np.arange(4, dtype=np.int32))
    expect_frame_error([*frames, b"\0" * 16])
    expect_frame_error([*on_the_wire(encode(Ok(), msg_id=41)), b""])


def test_same_frame_referenced_twice() -> None:
    frames = on_the_wire(encode(ShardValues(arrays=[np.zeros(2, np.int32), np.ones(2, np.int32)]), msg_id=41))
    body = unpack_body(frames)
    body["arrays"] = [body["arrays"][0], body["arrays"][0]]
    expect_frame_error(rebuild(frames, body=body))


def test_object_disallowed_or_unknown_dtypes() -> None:
    frames = array_frames(np.arange(4, dtype=np.int32))
    for dtype in ["object", "O", "|O", "i4,O", "str", "U3", "datetime64[ns]", "nonsense", "__version__", ""]:
        expect_frame_error(with_array_ref(frames, dtype=dtype), case=dtype)


def test_malformed_array_reference() -> None:
    frames = array_frames(np.arange(4, dtype=np.int32))
    for meta in ([0, "int32"], [0, "int32", [-4]], ["0", "int32", [4]], [0, 4, [4]], [0, "int32", 4],
                 {"index": 0}, [True, "int32", [4]], [0, "int32", [2**64 - 1, 0]], b"\xc1"):
        body = unpack_body(frames)
        data = meta if isinstance(meta, bytes) else msgpack.packb(meta)
        body["array"] = msgpack.ExtType(body["array"].code, data)
        expect_frame_error(rebuild(frames, body=body), case=repr(meta))


def test_empty_array_with_an_absurd_shape() -> None:
    frames = array_frames(np.zeros((0, 3), dtype=np.int32))
    expect_frame_error(with_array_ref(frames, shape=[2**64 - 1, 2**63, 0]))


def test_unknown_extension_type() -> None:
    frames = array_frames(np.arange(4, dtype=np.int32))
    body = unpack_body(frames)
    body["array"] = msgpack.ExtType(body["array"].code + 1, body["array"].data)
    expect_frame_error(rebuild(frames, body=body))


def test_array_where_a_scalar_belongs() -> None:
    frames = on_the_wire(encode(PutShards(keys=["k"], devices=[0], arrays=[np.zeros(2, np.int32)]), msg_id=41))
    body = unpack_body(frames)
    body["keys"], body["arrays"] = body["arrays"], []
    expect_frame_error(rebuild(frames, body=body))


# --------------------------------------------------------------- fuzzing


@FUZZ
@given(frames=st.lists(st.binary(max_size=40), max_size=5))
def test_arbitrary_frames_raise_only_frame_errors(frames: list[bytes]) -> None:
    decode_or_frame_error(frames)


@FUZZ
@given(op=st.sampled_from(OPS), msg_id=st.integers(0, 2**32), body=st.binary(max_size=60),
       buffers=st.lists(st.binary(max_size=16), max_size=3))
def test_random_bodies_behind_a_valid_header(op: str, msg_id: int, body: bytes, buffers: list[bytes]) -> None:
    try:
        decode([msgpack.packb(header_of(op, msg_id)), body, *buffers])
    except FrameError as exc:
        assert exc.msg_id == msg_id
        assert exc.op == op


def test_every_truncation_of_a_body_is_rejected() -> None:
    for op in OPS:
        frames = sample_frames(op)
        for cut in range(len(frames[1])):
            expect_frame_error([frames[0], frames[1][:cut], *frames[2:]], case=f"{op} body[:{cut}]")


def test_every_truncation_of_a_header_is_rejected() -> None:
    for op in OPS:
        frames = sample_frames(op)
        for cut in range(len(frames[0])):
            expect_frame_error([frames[0][:cut], *frames[1:]], msg_id=None, case=f"{op} header[:{cut}]")


def test_every_truncation_of_a_buffer_is_rejected() -> None:
    for op in OPS:
        frames = sample_frames(op)
        for i in range(2, len(frames)):
            for cut in (0, 1, len(frames[i]) // 2, len(frames[i]) - 1):
                expect_frame_error([*frames[:i], frames[i][:cut], *frames[i + 1:]], case=f"{op} frame {i}[:{cut}]")


def test_single_byte_corruption_decodes_or_raises_frame_error() -> None:
    for op in OPS:
        frames = sample_frames(op)
        for which in (0, 1):
            for at in range(len(frames[which])):
                # 0xC1 is never valid msgpack; flipping the top bit turns types and lengths into others.
                for new in (0xC1, frames[which][at] ^ 0x80):
                    frame = bytearray(frames[which])
                    frame[at] = new
                    decode_or_frame_error([*frames[:which], bytes(frame), *frames[which + 1:]])


# --------------------------------------------------------------- compiled schema vs reference
#
# ``Record.from_wire``/``to_wire`` run code compiled from the type hints; the schema keeps
# the hint-interpreting reference implementation, which also produces every error message.
# Both must accept exactly the same values, convert them alike and fail alike.

_WIRE_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=4)
    | st.binary(max_size=4) | st.just(np.zeros(2, np.int32)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


def _positions(value: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) inside a wire value, outermost first."""
    found: list[tuple[Any, Any]] = []
    keys = value.keys() if isinstance(value, dict) else range(len(value)) if isinstance(value, list) else ()
    for key in list(keys):
        found.append((value, key))
        found.extend(_positions(value[key]))
    return found


def reference_from_wire(cls: type[Record], body: Any) -> tuple[str, Any]:
    try:
        return "ok", schema._slow_from_wire(cls, body, "")
    except ProtocolError as exc:
        return "error", str(exc)


def compiled_from_wire(cls: type[Record], body: Any) -> tuple[str, Any]:
    try:
        return "ok", cls.from_wire(body)
    except ProtocolError as exc:
        return "error", str(exc)


def assert_decoded_alike(cls: type[Record], body: Any) -> None:
    expected, actual = reference_from_wire(cls, body), compiled_from_wire(cls, body)
    assert actual[0] == expected[0], f"reference: {expected}, compiled: {actual}"
    if expected[0] == "error":
        assert actual[1] == expected[1]
    else:
        assert_same(expected[1], actual[1])


def reference_to_wire(message: Record) -> dict[str, Any]:
    return {name: schema._to_wire(getattr(message, name)) for name in field_hints(type(message))}


def assert_same_wire(expected: Any, actual: Any, path: str = "body") -> None:
    """The same plain values, container types included (arrays pass through as themselves)."""
    assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, dict):
        assert list(actual) == list(expected), path
        for key in expected:
            assert_same_wire(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), path
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same_wire(e, a, f"{path}[{i}]")
    else:
        assert actual is expected or actual == expected, f"{path}: {actual!r} != {expected!r}"


@pytest.mark.parametrize("op", OPS)
@PROPERTY
@given(data=st.data())
def test_compiled_codec_matches_the_reference(op: str, data: st.DataObject) -> None:
    message = data.draw(MESSAGE_STRATEGIES[op], label="message")
    body = message.to_wire()
    assert_same_wire(reference_to_wire(message), body)
    assert_decoded_alike(type(message), body)


@pytest.mark.parametrize("op", OPS)
@settings(PROPERTY, max_examples=25)
@given(data=st.data())
def test_compiled_decoder_fails_exactly_where_the_reference_does(op: str, data: st.DataObject) -> None:
    """Damage a valid body anywhere (replace, delete or add a value): same result, same error text."""
    cls = message_types()[op]
    body = sample(cls).to_wire()
    positions = _positions(body)
    action = data.draw(st.sampled_from(["replace", "delete", "add"]), label="action")
    if positions and action != "add":
        container, key = data.draw(st.sampled_from(positions), label="where")
        if action == "delete":
            del container[key]
        else:
            container[key] = data.draw(_WIRE_VALUES, label="value")
    else:
        body[data.draw(st.text(max_size=6), label="key")] = data.draw(_WIRE_VALUES, label="value")
    assert_decoded_alike(cls, body)


@record
class _Tree(Record):
    label: str
    children: list[_Tree] = dataclasses.field(default_factory=list)
    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    either: int | str = 0
    maybe: list[float] | None = None
    nested: list[list[int]] = dataclasses.field(default_factory=list)
    anything: Any = None


@record
class _Base(Record):
    x: int


@record
class _Derived(_Base):
    y: str = "y"


@record
class _HandWritten(Record):
    x: int

    def to_wire(self) -> dict[str, Any]:
        return {"x": self.x * 2}


@record
class _HandWrittenChild(_HandWritten):
    y: int = 0


def test_annotations_no_message_uses_yet_compile_alike() -> None:
    """Recursive records, dicts, many-armed unions, nested lists, Any: compiled and reference agree."""
    good = {"label": "root", "children": [{"label": "leaf", "weights": {"a": 1, "b": 2.5}, "either": "s"}],
            "either": 3, "maybe": [1, 2.0], "nested": [[1], []], "anything": [_Base(x=1), {"k": [1, 2]}]}
    assert_decoded_alike(_Tree, good)
    tree = _Tree.from_wire(good)
    assert type(tree.children[0].weights["a"]) is float and type(tree.maybe[0]) is float
    assert_same_wire(reference_to_wire(tree), tree.to_wire())
    for damage in ({"either": 1.5}, {"either": True}, {"either": None}, {"weights": {"a": "1"}},
                   {"weights": {1: 1.0}}, {"weights": []}, {"maybe": [True]}, {"nested": [[1], [False]]},
                   {"nested": [1]}, {"children": [{"label": 1}]}, {"children": [{"children": [{}]}]},
                   {"children": ({"label": "t"},)}, {"maybe": None}):
        assert_decoded_alike(_Tree, {**good, **damage})


def test_scalar_conversions_of_the_compiled_decoder() -> None:
    body = {"run_id": "r", "executor_id": "e", "device_seconds": 2}
    message = message_types()["sched.run_part_done"].from_wire(body)
    assert type(message.device_seconds) is float and message.device_seconds == 2.0
    for bad in (True, "2", None, [2.0]):
        with pytest.raises(ProtocolError, match=r"RunPartDone\.device_seconds: expected float"):
            message_types()["sched.run_part_done"].from_wire({**body, "device_seconds": bad})
    for bad in (True, False, 1.0):
        with pytest.raises(ProtocolError, match=r"ShardRun\.count: expected int, got (bool|float)"):
            ShardRun.from_wire({"device": 0, "shard": 0, "count": bad})
    with pytest.raises(ProtocolError, match=r"^Outer\.runs\[1\]\.shard: expected int, got str$"):
        ShardRun.from_wire({"device": 0, "shard": "x"}, "Outer.runs[1]")


def test_defaults_are_fresh_for_every_decoded_message() -> None:
    first = Computation.from_wire(Computation(node=0, fn_id="f", executor_id="e", control="c", runs=[],
                                              inputs=[], outputs=[]).to_wire() | {"emits": []})
    body = {"node": 0, "fn_id": "f", "executor_id": "e", "control": "c", "runs": [], "inputs": [], "outputs": []}
    a, b = Computation.from_wire(body), Computation.from_wire(body)
    assert a.emits == [] and a.emits is not b.emits and a.donate is not b.donate
    assert (a.kind, a.seq, a.spmd) == ("call", -1, False) and first.emits == []


def test_lists_are_copied_and_tuples_become_lists() -> None:
    inputs = ["a", "b"]
    body = {"node": 0, "fn_id": "f", "executor_id": "e", "control": "c", "runs": (), "inputs": inputs,
            "outputs": ("x",)}
    comp = Computation.from_wire(body)
    assert comp.inputs == inputs and comp.inputs is not inputs
    assert comp.runs == [] and comp.outputs == ["x"]
    wire = comp.to_wire()
    assert wire["inputs"] is not comp.inputs


def test_each_subclass_encodes_its_own_fields() -> None:
    assert _Base(x=1).to_wire() == {"x": 1}  # compiled for _Base first: _Derived must not inherit it
    assert _Derived(x=1, y="z").to_wire() == {"x": 1, "y": "z"}
    assert _Base(x=2).to_wire() == {"x": 2}
    assert _HandWritten(x=2).to_wire() == {"x": 4}
    assert _HandWrittenChild(x=3, y=1).to_wire() == {"x": 6}  # inherits the hand-written one


def test_threads_decoding_a_record_for_the_first_time_all_get_it() -> None:
    """Compilation happens at first use; threads racing to it wait for one finished decoder."""

    @record
    class Fresh(Record):
        x: int
        bases: list[_Base]

    barrier = threading.Barrier(8)
    results: list[Any] = []

    def decode_once() -> None:
        barrier.wait()
        results.append(Fresh.from_wire({"x": 1, "bases": [{"x": 2}]}))

    threads = [threading.Thread(target=decode_once) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [Fresh(x=1, bases=[_Base(x=2)])] * 8
