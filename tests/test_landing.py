"""What arrives by the data plane lands on an executor's devices: assembled once, in as few copies as it can.

Real JAX on this process's two CPU devices (``conftest``), real pooled buffers and the real codec; no
sockets (``test_plane`` and ``test_dataflow`` move the same bytes between processes). Issue #31 item 2:
a weight sync to a replicated sampler assembled and copied every value once per device.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pwmesh.dataflow.exchange import Landing, assemble, cut, expand, in_place, landings
from pwmesh.dataflow.plane import BufferPool
from pwmesh.dataflow.progress import Arrived, Progress
from pwmesh.executor.landing import land
from pwmesh.wire import codec
from pwmesh.wire.messages import DataTuple, Emit, Sharding, ShardRun, Site, Target, TupleBatch

SHAPE = [64, 32]


def piece(rows: tuple[int, int], array: np.ndarray, *, src: int, copies: list[list[int]] | None = None,
          cols: tuple[int, int] | None = None) -> DataTuple:
    """A block of shard 0 of a ``SHAPE`` float32 value (device 0), as ``cut`` makes it."""
    lo, hi = rows
    c0, c1 = cols or (0, SHAPE[1])
    return DataTuple(prefix="s/v", shard=0, device=0, src=src, sources=2, shape=SHAPE, dtype="float32", count=1,
                     seq=0, offset=[lo, c0], array=np.ascontiguousarray(array[lo:hi, c0:c1]), copies=copies or [])


def through_the_wire(tuples: list[DataTuple], pool: BufferPool) -> list[DataTuple]:
    """``tuples`` encoded and decoded as the data plane does, its big frames read back to back into one
    pooled buffer (``DataPlane._placer``)."""
    frames = codec.encode(TupleBatch(tuples=tuples), msg_id=0)
    sizes = [len(memoryview(f).cast("B")) for f in frames[2:]]
    block = pool.take(sum((n + 63) & ~63 for n in sizes))
    read, at = [bytes(frames[0]), bytes(frames[1])], 0
    for frame, n in zip(frames[2:], sizes, strict=True):
        buf = block[at:at + n]
        buf[:] = np.frombuffer(memoryview(frame).cast("B"), np.uint8)
        read.append(buf)
        at += (n + 63) & ~63
    message = codec.decode(read).message
    assert isinstance(message, TupleBatch)
    return message.tuples


def test_row_blocks_read_back_to_back_are_taken_as_they_are() -> None:
    """A row-split weight's pieces, read into one buffer in row order, are the value already: no copy."""
    x = np.arange(64 * 32, dtype=np.float32).reshape(SHAPE)
    pool = BufferPool()
    tuples = through_the_wire([piece((0, 32), x, src=0), piece((32, 64), x, src=1)], pool)
    got = assemble(tuples[::-1], tuples[0], take=pool.take)
    np.testing.assert_array_equal(got, x)
    assert all(np.shares_memory(got, t.array) for t in tuples)
    # Not when the value's buffer may be shared with shards outside the caller's reach (``whole=False``).
    copied = assemble(tuples, tuples[0], take=pool.take, whole=False)
    np.testing.assert_array_equal(copied, x)
    assert not any(np.shares_memory(copied, t.array) for t in tuples)


@pytest.mark.parametrize("case", ["columns", "apart", "reversed"])
def test_blocks_not_lying_as_the_value_are_assembled(case: str) -> None:
    """Column blocks, row blocks in separate buffers, or back to back in the wrong order: a copy."""
    x = np.arange(64 * 32, dtype=np.float32).reshape(SHAPE)
    pool = BufferPool()
    if case == "columns":
        sent = [piece((0, 64), x, src=0, cols=(0, 16)), piece((0, 64), x, src=1, cols=(16, 32))]
        tuples = through_the_wire(sent, pool)
    elif case == "apart":
        tuples = [piece((0, 32), x, src=0), piece((32, 64), x, src=1)]
    else:
        tuples = through_the_wire([piece((32, 64), x, src=1), piece((0, 32), x, src=0)], pool)
    assert in_place(tuples, tuple(SHAPE), np.dtype(np.float32)) is None
    got = assemble(tuples, tuples[0], take=pool.take)
    np.testing.assert_array_equal(got, x)
    assert not any(np.shares_memory(got, t.array) for t in tuples)


def test_replicas_sharing_a_tuple_land_once_and_a_donation_leaves_the_other_intact() -> None:
    """Two replicas on this executor's two CPU devices: one assembly, one host buffer that JAX adopts
    for both; a computation donating one replica writes elsewhere (JAX never writes to a host buffer
    it adopted), so the other keeps its value."""
    x = np.arange(64 * 32, dtype=np.float32).reshape(SHAPE)
    pool = BufferPool()
    sent = [piece((0, 64), x, src=0, copies=[[1, 1]], cols=(0, 16)),
            piece((0, 64), x, src=1, copies=[[1, 1]], cols=(16, 32))]
    tuples = expand(through_the_wire(sent, pool), share=True)
    assert len(tuples) == 4 and tuples[0].array is tuples[1].array  # shared, not copied
    by_shard: dict[int, list[DataTuple]] = {}
    for t in tuples:
        by_shard.setdefault(t.shard, []).append(t)
    (landing,) = landings([(f"s/v/{j}", ts[0].device, ts, ts[-1]) for j, ts in sorted(by_shard.items())])
    assert landing.shards == [("s/v/0", 0), ("s/v/1", 1)] and landing.whole
    taken: list[int] = []

    def take(nbytes: int) -> np.ndarray:
        taken.append(nbytes)
        return pool.take(nbytes)

    devices = jax.devices("cpu")[:2]
    first, second = land(landing, devices, take)
    assert taken == [x.nbytes]  # assembled once, for both devices
    assert [a.devices() for a in (first, second)] == [{devices[0]}, {devices[1]}]
    np.testing.assert_array_equal(np.asarray(first), x)
    bumped = jax.jit(lambda a: a + 1, donate_argnums=0)(first)
    np.testing.assert_array_equal(np.asarray(bumped), x + 1)
    np.testing.assert_array_equal(np.asarray(second), x)


def test_replicas_completed_apart_each_get_their_own_value() -> None:
    """Shards that share an array but complete in different landings: neither keeps the shared array."""
    x = np.arange(64 * 32, dtype=np.float32).reshape(SHAPE)
    (t0, t1) = expand([piece((0, 64), x, src=0, copies=[[1, 1]])], share=True)
    alone = Landing([("s/v/0", 0)], [t0], t0)
    assert not alone.whole
    got = assemble(alone.payloads, alone.last, whole=alone.whole)
    np.testing.assert_array_equal(got, x)
    assert not np.shares_memory(got, t1.array)
    # Without ``share``, every copy is an array of its own (the simulator's and tests' way).
    a, b = expand([piece((0, 64), x, src=0, copies=[[1, 1]])])
    assert not np.shares_memory(a.array, b.array) and b.copies == []


def test_landings_group_only_shards_with_the_very_same_arrays() -> None:
    x = np.arange(64 * 32, dtype=np.float32).reshape(SHAPE)
    shared = expand([piece((0, 64), x, src=0, copies=[[1, 1]])], share=True)
    other = piece((0, 64), x, src=0)
    out = landings([("s/v/0", 0, [shared[0]], shared[0]), ("s/v/1", 1, [shared[1]], shared[1]),
                    ("s/w/0", 0, [other], other)])
    assert [landing.shards for landing in out] == [[("s/v/0", 0), ("s/v/1", 1)], [("s/w/0", 0)]]


def test_the_pool_keeps_buffers_up_to_its_byte_budget_the_oldest_making_room() -> None:
    """Buffers come back for reuse once released, up to ``keep_bytes`` of them (faulted in already); past
    that, the ones handed out longest ago (values held for good) stop being kept, for the newest."""
    pool = BufferPool(keep_bytes=3 << 20)
    stored = [pool.take(1 << 20) for _ in range(3)]  # held for good, as a store holds its values
    assert pool.kept_bytes == 3 << 20
    churn = [pool.take(1 << 20) for _ in range(2)]  # a sync's buffers: the two oldest stop being kept
    assert pool.kept_bytes == 3 << 20
    addresses = {c.ctypes.data for c in churn}
    del churn
    again = [pool.take(1 << 20) for _ in range(2)]
    assert {a.ctypes.data for a in again} == addresses  # reused, not made afresh
    assert pool.kept_bytes == 3 << 20 and len(stored) == 3


def test_column_blocks_all_on_one_executor_are_gathered_there_and_kept_as_they_arrive() -> None:
    """A weight split by columns over a trainer's 2x2 mesh, all on one executor, to a replicated sampler on
    two devices of another: one whole block crosses (named for both replicas), with the other source's
    marker; the receiver keeps that block as it is, for both devices."""
    x = np.arange(64 * 32, dtype=np.float32).reshape(SHAPE)
    shards = {0: x[:, :16], 1: x[:, 16:], 2: x[:, :16], 3: x[:, 16:]}  # (data, model) row-major
    sampler = Site(executor_id="b", data="tcp://b:2", host="b", runs=[ShardRun(device=0, shard=0, count=2)])
    target = Target(prefix="s/v", shards=2, sites=[sampler], shape=SHAPE, dtype="float32",
                    sharding=Sharding(mesh=[2], spec=[[], []]))
    emit = Emit(mode="block", rows=64, src_shards=4, targets=[target], shape=SHAPE,
                src=Sharding(mesh=[2, 2], spec=[[], [1]]))
    pool = BufferPool()
    sent = [t for _, t in cut(emit, shards, take=pool.take)]
    data = [t for t in sent if t.array is not None]
    assert len(data) == 1 and data[0].array.shape == tuple(SHAPE) and data[0].copies == [[1, 1]]
    assert sorted((t.src, t.count) for t in sent) == [(0, 1), (1, 0)]
    arrived = expand(through_the_wire(sent, pool), share=True)
    progress, done = Progress(), []
    for t in arrived:
        key = f"s/v/{t.shard}"
        got = progress.tuple(key, t.src, t.seq, t.sources, t) if t.seq >= 0 else None
        got = progress.marker(key, t.src, t.count, t.sources) or got
        if isinstance(got, Arrived):
            done.append((key, t.device, got.payloads, t))
    (landing,) = landings(done)
    value = assemble(landing.payloads, landing.last, take=pool.take, whole=landing.whole)
    np.testing.assert_array_equal(value, x)
    assert value is landing.payloads[0].array  # kept as it arrived: no copy on this side


def test_a_block_gathered_for_several_executors_is_gathered_once() -> None:
    """Fan-out (one trainer, two sampler hosts): the sender gathers the block once, not once a receiver."""
    x = np.arange(64 * 32, dtype=np.float32).reshape(SHAPE)
    shards = {0: x[:, :16], 1: x[:, 16:]}
    sites = [Site(executor_id=ex, data=f"tcp://{ex}:2", host=ex, runs=[ShardRun(device=0, shard=k, count=1)])
             for k, ex in enumerate("ab")]
    target = Target(prefix="s/v", shards=2, sites=sites, shape=SHAPE, dtype="float32",
                    sharding=Sharding(mesh=[2], spec=[[], []]))
    emit = Emit(mode="block", rows=64, src_shards=2, targets=[target], shape=SHAPE,
                src=Sharding(mesh=[2], spec=[[], [0]]))
    taken: list[int] = []

    def take(nbytes: int) -> np.ndarray:
        taken.append(nbytes)
        return np.empty(nbytes, np.uint8)

    sent = cut(emit, shards, take=take)
    data = [(dest.executor_id, t) for dest, t in sent if t.array is not None]
    assert [ex for ex, _ in data] == ["a", "b"] and data[0][1].array is data[1][1].array
    assert taken == [x.nbytes]
    np.testing.assert_array_equal(data[0][1].array, x)
