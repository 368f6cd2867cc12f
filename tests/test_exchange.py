"""Block arithmetic, cutting values into shard-tagged tuples and assembling them (pure numpy: no sockets, no JAX).

Every test plays both sides of a transfer: producers ``cut`` their local shards as an
``Emit`` says, every tuple goes through a ``Progress`` on its destination's executor
(as the executor's data plane does), and completed destinations are ``assemble``d.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import pytest

from pwmesh.dataflow.exchange import Destination, Ragged, assemble, cut, cut_error, destinations, expand
from pwmesh.dataflow.layout import Layout, block, check_split, plan
from pwmesh.dataflow.progress import Arrived, Progress
from pwmesh.errors import DeviceLost, InvalidArgument
from pwmesh.wire.messages import DataTuple, Emit, ErrorInfo, Sharding, ShardRun, Site, Target

SPLITS = [1, 2, 3, 4, 8]
ROWS = 24
PREFIX = "sess1/v1"


def site(executor: str, runs: list[tuple[int, int, int]]) -> Site:
    return Site(executor_id=executor, data=f"tcp://{executor}:2", host=executor,
                runs=[ShardRun(device=d, shard=s, count=c) for d, s, c in runs])


def spread(shards: int, only: list[int] | None = None) -> list[Site]:
    """Shards alternate between executors a and b (shard j on device j // 2), or only ``only`` of them."""
    wanted = range(shards) if only is None else only
    by: dict[str, list[tuple[int, int, int]]] = {}
    for j in wanted:
        by.setdefault("ab"[j % 2], []).append((j // 2, j, 1))
    return [site(ex, runs) for ex, runs in by.items()]


def block_target(shape: list[int], shards: int, sites: list[Site] | None = None, dtype: str = "float32") -> Target:
    shard_shape = [shape[0] // shards, *shape[1:]] if shape else []
    return Target(prefix=PREFIX, shards=shards, sites=sites if sites is not None else spread(shards),
                  shape=shard_shape, dtype=dtype)


class DataPlane:
    """The receiving side of every executor: one Progress each, completed destinations assembled."""

    def __init__(self) -> None:
        self.progress: dict[str, Progress] = {}
        self.received: dict[str, list[DataTuple]] = {}  # key -> every tuple and marker, in arrival order
        self.arrived: dict[str, list[DataTuple]] = {}  # key -> the payloads Progress released
        self.where: dict[str, Destination] = {}

    def deliver(self, tuples: list[tuple[Destination, DataTuple]]) -> None:
        # As an executor receives them: a tuple's copies (replicas on the same executor) are its own.
        tuples = [(dataclasses.replace(dest, device=each.device), each) for dest, sent in tuples
                  for each in expand([sent])]
        for dest, t in tuples:
            key = f"{t.prefix}/{t.shard}"
            assert t.device == dest.device
            assert self.where.setdefault(key, dest) == dest, f"{key} reached two places"
            self.received.setdefault(key, []).append(t)
            progress = self.progress.setdefault(dest.executor_id, Progress())
            done = None
            if t.seq >= 0:
                done = progress.tuple(key, t.src, t.seq, t.sources, t)
            if t.count >= 0:
                done = progress.marker(key, t.src, t.count, t.sources) or done
            if done is not None:
                assert isinstance(done, Arrived)
                assert key not in self.arrived
                self.arrived[key] = (done.payloads, t)

    def value(self, key: str) -> np.ndarray | Ragged:
        payloads, last = self.arrived[key]
        return assemble(payloads, last)

    def waiting(self) -> int:
        return sum(len(p) for p in self.progress.values())


def shuffled(tuples: list[Any], seed: int) -> list[Any]:
    order = np.random.default_rng(seed).permutation(len(tuples))
    return [tuples[i] for i in order]


def reshard(array: np.ndarray, m: int, target: Target, seed: int = 0) -> DataPlane:
    """Cut ``array``, split ``m`` ways, with a block emit to ``target``; deliver in a shuffled order."""
    emit = Emit(mode="block", rows=array.shape[0] if array.ndim else 1, src_shards=m, targets=[target])
    producer_shards = np.split(array, m) if array.ndim else [array]
    tuples = []
    for src, part in enumerate(producer_shards):  # each producer cuts on its own executor
        tuples.extend(cut(emit, {src: part}))
    plane = DataPlane()
    plane.deliver(shuffled(tuples, seed))
    return plane


# --------------------------------------------------------------- layout arithmetic


@pytest.mark.parametrize("shape, shards, match", [
    ([24, 3], 0, "0 shards; a value has at least one"),
    ([24, 3], -1, "-1 shards"),
    ([], 2, "a scalar cannot be split into 2 shards"),
    ([24, 3], 5, r"shape \(24, 3\) cannot be split into 5 equal shards .*24 rows is not a multiple of 5"),
    ([3], 4, r"shape \(3,\) .*\(3 rows is not a multiple of 4\)"),
])
def test_check_split_errors(shape: list[int], shards: int, match: str) -> None:
    with pytest.raises(InvalidArgument, match=f"^value 7: {match}"):
        check_split(shape, shards, "value 7")


@pytest.mark.parametrize("shape, shards", [([], 1), ([5], 1), ([0, 3], 4), ([24, 3], 8), ((24,), 3)])
def test_check_split_accepts(shape: list[int], shards: int) -> None:
    check_split(shape, shards, "value 7")


def test_destinations_from_runs() -> None:
    target = block_target([8, 3], 4, [site("a", [(2, 0, 2)]), site("b", [(0, 3, 1)])])
    assert destinations(target) == {
        0: Destination("a", "tcp://a:2", "a", 2),
        1: Destination("a", "tcp://a:2", "a", 3),
        3: Destination("b", "tcp://b:2", "b", 0),
    }


# --------------------------------------------------------------- block: copies and reshards


@pytest.mark.parametrize("m, n", list(itertools.product(SPLITS, SPLITS)))
def test_block_reshard_every_consumer_shard_is_its_slice(m: int, n: int) -> None:
    x = np.arange(ROWS * 3, dtype=np.float32).reshape(ROWS, 3)
    plane = reshard(x, m, block_target([ROWS, 3], n), seed=m * 10 + n)
    assert plane.waiting() == 0
    assert sorted(plane.arrived) == sorted(f"{PREFIX}/{j}" for j in range(n))
    for j, (start, stop) in enumerate(block(ROWS, n, j) for j in range(n)):
        key = f"{PREFIX}/{j}"
        np.testing.assert_array_equal(plane.value(key), x[start:stop])
        assert plane.where[key].executor_id == "ab"[j % 2] and plane.where[key].device == j // 2
        # One marker from each producer whose block overlaps, each saying how many producers report.
        ts = plane.received[key]
        heard = plan(Layout.blocks((ROWS, 3), m), Layout.blocks((ROWS, 3), n)).sources[j]
        assert sorted(t.src for t in ts if t.count >= 0) == heard
        assert {t.sources for t in ts} == {len(heard)}


@pytest.mark.parametrize("m, n", list(itertools.product(SPLITS, SPLITS)))
def test_block_reshard_of_zero_rows(m: int, n: int) -> None:
    x = np.zeros((0, 3), np.int32)
    plane = reshard(x, m, block_target([0, 3], n, dtype="int32"))
    assert plane.waiting() == 0
    for j in range(n):
        value = plane.value(f"{PREFIX}/{j}")
        assert value.shape == (0, 3) and value.dtype == np.int32
        assert len({t.src for t in plane.received[f"{PREFIX}/{j}"]}) == 1


def test_copy_covers_only_the_shards_in_the_target() -> None:
    """A copy (M == N) to the consumer shards that are missing: the others send nothing."""
    x = np.arange(8 * 2, dtype=np.float32).reshape(8, 2)
    plane = reshard(x, 4, block_target([8, 2], 4, spread(4, only=[1, 2])))
    assert sorted(plane.arrived) == [f"{PREFIX}/1", f"{PREFIX}/2"]
    np.testing.assert_array_equal(plane.value(f"{PREFIX}/1"), x[2:4])
    np.testing.assert_array_equal(plane.value(f"{PREFIX}/2"), x[4:6])
    assert plane.waiting() == 0


def test_copy_of_a_whole_shard_is_one_tuple_with_its_marker() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    emit = Emit(mode="block", rows=4, src_shards=2, targets=[block_target([4, 3], 2)])
    ((dest, t),) = cut(emit, {1: x})
    assert (dest.executor_id, t.shard, t.src, t.sources, t.count, t.seq, t.offset) == ("b", 1, 1, 1, 1, 0, [0, 0])
    assert assemble([t], t) is t.array


def test_scalar_copy() -> None:
    x = np.array(3.5, np.float32)
    plane = reshard(x, 1, block_target([], 1, [site("b", [(1, 0, 1)])]))
    value = plane.value(f"{PREFIX}/0")
    assert value.shape == () and value == 3.5


def test_block_error_tuples_reach_exactly_the_destinations_of_the_failed_shards() -> None:
    emit = Emit(mode="block", rows=ROWS, src_shards=2, targets=[block_target([ROWS, 3], 4)])
    error = ErrorInfo.of(DeviceLost("gone"))
    out = cut_error(emit, [1], error)
    assert [(d.executor_id, t.shard) for d, t in out] == [("a", 2), ("b", 3)]
    assert all(t.error == error for _, t in out)


# --------------------------------------------------------------- route and scatter (mixture of experts)


def expert_targets(experts: int, rows: int, cols: int) -> list[Target]:
    """Expert k's rows land on executor e<k>, device 0 (capacity: every row)."""
    return [Target(prefix=f"sess1/x{k}", shards=1, sites=[site(f"e{k}", [(0, 0, 1)])], shape=[rows, cols],
                   dtype="float32") for k in range(experts)]


def route(x: np.ndarray, ids: np.ndarray, m: int, experts: int, seed: int = 0) -> DataPlane:
    emit = Emit(mode="route", rows=x.shape[0], src_shards=m, targets=expert_targets(experts, *x.shape),
                slot=0, selector=1)
    tuples = []
    for src, (part, part_ids) in enumerate(zip(np.split(x, m), np.split(ids, m), strict=True)):
        tuples.extend(cut(emit, {src: part}, {src: part_ids}))
    plane = DataPlane()
    plane.deliver(shuffled(tuples, seed))
    return plane


def scatter(outputs: dict[int, Ragged], rows: int, n: int, cols: int, seed: int = 0) -> DataPlane:
    target = block_target([rows, cols], n)
    tuples = []
    for k, value in outputs.items():
        emit = Emit(mode="scatter", rows=rows, src_shards=len(outputs), targets=[target], slot=1, source=k)
        tuples.extend(cut(emit, {0: value}))
    plane = DataPlane()
    plane.deliver(shuffled(tuples, seed))
    return plane


@pytest.mark.parametrize("m, experts, seed", [(1, 1, 0), (1, 3, 1), (2, 3, 2), (4, 5, 3), (8, 2, 4), (3, 8, 5)])
def test_route_sends_every_expert_exactly_its_rows(m: int, experts: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ROWS, 4)).astype(np.float32)
    ids = rng.integers(0, experts, ROWS).astype(np.int32)
    if experts > 1:
        ids[ids == experts - 1] = 0  # the last expert gets nothing: it still hears from every producer
    plane = route(x, ids, m, experts, seed)
    assert plane.waiting() == 0
    for k in range(experts):
        key = f"sess1/x{k}/0"
        markers = [t for t in plane.received[key] if t.count >= 0]
        assert sorted(t.src for t in markers) == list(range(m)), "one marker from every producer"
        assert {t.sources for t in plane.received[key]} == {m}
        (rows,) = np.nonzero(ids == k)
        if not len(rows):
            assert plane.arrived[key][0] == [] and all(t.count == 0 for t in markers)
            continue
        got = plane.value(key)
        assert isinstance(got, Ragged)
        np.testing.assert_array_equal(got.index, rows)
        np.testing.assert_array_equal(got.array, x[rows])


@pytest.mark.parametrize("bad", [3, -1, 100])
def test_route_expert_id_out_of_range(bad: int) -> None:
    emit = Emit(mode="route", rows=4, src_shards=1, targets=expert_targets(3, 4, 2), slot=0, selector=1)
    with pytest.raises(InvalidArgument, match=f"expert id {bad} is out of range: there are 3 experts"):
        cut(emit, {0: np.zeros((4, 2), np.float32)}, {0: np.array([0, bad, 1, 2])})


def test_unknown_emit_mode() -> None:
    with pytest.raises(InvalidArgument, match="unknown emit mode 'gather'"):
        cut(Emit(mode="gather", rows=1, src_shards=1, targets=[]), {})


@pytest.mark.parametrize("n", SPLITS)
def test_scatter_puts_rows_back_in_order(n: int) -> None:
    rng = np.random.default_rng(n)
    x = rng.standard_normal((ROWS, 2)).astype(np.float32)
    order = rng.permutation(ROWS)
    # Three experts' outputs, each with its rows in some order and from all over the value.
    outputs = {k: Ragged(x[part], part.astype(np.int32)) for k, part in enumerate(np.array_split(order, 3))}
    plane = scatter(outputs, ROWS, n, 2, seed=n)
    assert plane.waiting() == 0
    for j in range(n):
        key = f"{PREFIX}/{j}"
        assert sorted(t.src for t in plane.received[key] if t.count >= 0) == [0, 1, 2]
        start, stop = block(ROWS, n, j)
        np.testing.assert_array_equal(plane.value(key), x[start:stop])


@pytest.mark.parametrize("m, n, experts, seed", [(1, 1, 2, 0), (2, 4, 3, 1), (4, 2, 4, 2), (8, 3, 2, 3),
                                                 (3, 8, 5, 4)])
def test_route_identity_scatter_round_trip(m: int, n: int, experts: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ROWS, 3)).astype(np.float32)
    ids = rng.permutation(np.arange(ROWS) % experts).astype(np.int64)  # every expert gets rows
    routed = route(x, ids, m, experts, seed)
    outputs = {k: routed.value(f"sess1/x{k}/0") for k in range(experts)}
    combined = scatter(outputs, ROWS, n, 3, seed)
    np.testing.assert_array_equal(np.concatenate([combined.value(f"{PREFIX}/{j}") for j in range(n)]), x)


def test_expert_with_no_rows_gets_an_empty_value() -> None:
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    plane = route(x, np.zeros(4, np.int32), 2, 2)
    assert plane.arrived["sess1/x1/0"][0] == []
    got = plane.value("sess1/x1/0")
    assert isinstance(got, Ragged)
    assert got.array.shape == (0, 2) and got.array.dtype == np.float32 and got.index.shape == (0,)


def test_round_trip_with_an_expert_that_gets_no_rows() -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((ROWS, 3)).astype(np.float32)
    ids = np.zeros(ROWS, np.int32)
    ids[::2] = 2  # expert 1 gets nothing
    routed = route(x, ids, 2, 3)
    outputs = {k: routed.value(f"sess1/x{k}/0") for k in range(3)}
    combined = scatter(outputs, ROWS, 4, 3)
    np.testing.assert_array_equal(np.concatenate([combined.value(f"{PREFIX}/{j}") for j in range(4)]), x)


def test_scatter_of_zero_rows() -> None:
    empty = Ragged(np.zeros((0, 2), np.float32), np.zeros((0,), np.int32))
    plane = scatter({0: empty, 1: empty}, 0, 2, 2)
    assert plane.waiting() == 0
    for j in range(2):
        assert plane.value(f"{PREFIX}/{j}").shape == (0, 2)


def test_replicas_on_one_executor_travel_once_and_each_gets_its_own_copy() -> None:
    """A value replicated over two devices of each executor (a sampler's weights): each piece is sent to an
    executor once, naming the other replica in ``copies``, not once a device (issue #31: weight sync sent
    twice the bytes); the receiver gives every replica its own array, never one buffer for two devices."""
    x = np.arange(8 * 2, dtype=np.float32).reshape(8, 2)
    sites = [site("a", [(0, 0, 1), (1, 1, 1)]), site("b", [(0, 2, 1), (1, 3, 1)])]
    target = Target(prefix=PREFIX, shards=4, sites=sites, shape=[8, 2], dtype="float32",
                    sharding=Sharding(mesh=[2, 2], spec=[]))
    emit = Emit(mode="block", rows=8, src_shards=2, targets=[target], shape=[8, 2],
                src=Sharding(mesh=[2], spec=[[0]]))
    tuples = [t for src, part in enumerate(np.split(x, 2)) for t in cut(emit, {src: part})]
    assert sorted((d.executor_id, t.shard, t.copies) for d, t in tuples) == [
        ("a", 0, [[1, 1]]), ("a", 0, [[1, 1]]), ("b", 2, [[3, 1]]), ("b", 2, [[3, 1]])]
    plane = reshard_tuples(tuples)
    values = [plane.value(f"{PREFIX}/{j}") for j in range(4)]
    for value in values:
        np.testing.assert_array_equal(value, x)
    assert not np.shares_memory(values[0], values[1]) and not np.shares_memory(values[2], values[3])


def reshard_tuples(tuples: list[Any]) -> DataPlane:
    plane = DataPlane()
    plane.deliver(shuffled(tuples, 0))
    assert plane.waiting() == 0
    return plane
