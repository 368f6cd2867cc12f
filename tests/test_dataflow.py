"""End to end for the sharded dataflow (issue #3): values made on M devices and read on N,
``pw.reshard``, splits that cannot be, and mixture-of-experts routing with ``pw.Router``.

Every value moves executor to executor as shard-tagged tuples; these tests only look at
what a user sees (values, errors, trace spans), on real daemons with real JAX on CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pwmesh as pw
from helpers import frees_settled
from pwmesh.cli.commands import fetch_trace
from pwmesh.examples import moe
from pwmesh.wire.messages import TraceEvent

SIZES = (1, 2, 3, 4, 8)
PAIRS = [(m, n) for m in SIZES for n in SIZES]
ROWS = 24  # splits evenly over every size in SIZES
FETCH_TIMEOUT_SECONDS = 60.0
# Per-test timeouts include the fixtures' setup: the first test on a cluster also starts it.



def produce(x: jax.Array) -> jax.Array:
    return x * 2.0 + 1.0


def consume(y: jax.Array) -> jax.Array:
    return y * 3.0 - 1.0


@dataclasses.dataclass
class Wide:
    """One client on the wide cluster, its slices by (island, size) and a producer and a
    consumer compiled once for each: the tests reuse them instead of compiling anew."""

    client: pw.Client
    slices: dict[tuple[int, int], pw.Slice]
    produce: dict[tuple[int, int], pw.JitFunction]
    consume: dict[tuple[int, int], pw.JitFunction]

    def fetch(self, *arrays: pw.Array) -> list[np.ndarray]:
        return self.client.fetch(list(arrays), timeout_seconds=FETCH_TIMEOUT_SECONDS)


@pytest.fixture(scope="module")
def wide(wide_cluster: pw.LocalCluster) -> Iterator[Wide]:
    with pw.Client(wide_cluster.address, name="dataflow") as c:
        devs = c.make_virtual_device_set()
        slices = {(island, n): devs.add_slice(devices=n, island=island) for island in (0, 1) for n in SIZES}
        for (island, n), sl in slices.items():
            assert len(sl.devices) == n and {d.executor for d in sl.devices} == {f"island{island}-host0"}
        yield Wide(
            c, slices,
            # Rows split over the slice (P("x")): every pair of sizes is a real M -> N reshard.
            produce={key: pw.jit(produce, devices=sl, in_specs=P("x"), out_specs=P("x")) for key, sl in slices.items()},
            consume={key: pw.jit(consume, devices=sl, in_specs=P("x"), out_specs=P("x")) for key, sl in slices.items()},
        )


def rows(n: int = ROWS) -> np.ndarray:
    # Every element distinct: a row landing on the wrong shard, or out of order, shows.
    return np.arange(n * 3, dtype=np.float32).reshape(n, 3)


# ------------------------------------------------------------------ M -> N resharding


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("m", "n"), PAIRS)
def test_value_made_on_m_devices_is_read_on_n_on_another_island(wide: Wide, m: int, n: int) -> None:
    f, g = wide.produce[(0, m)], wide.consume[(1, n)]

    @pw.program
    def pipeline(v):
        y = f(v)
        return y, g(y)

    x = rows()
    spec = pipeline.trace(x).spec
    # (The input's own layout is test_e2e's business.)
    assert [v.shards for v in spec.values[1:]] == [m, n], "the value keeps its producer's split; the reader its own"
    y, z = pipeline(x)
    assert (y.shards, z.shards) == (m, n)
    got_y, got_z = wide.fetch(y, z)
    np.testing.assert_array_equal(got_y, produce(x))
    np.testing.assert_array_equal(got_z, consume(produce(x)))


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("m", "n"), [(1, 8), (8, 1), (2, 3), (3, 4), (4, 2), (8, 3)])
def test_value_resharded_between_slices_of_one_executor(wide: Wide, m: int, n: int) -> None:
    f, g = wide.produce[(0, m)], wide.consume[(0, n)]
    assert {d.executor for d in f.slice.devices} == {d.executor for d in g.slice.devices}

    @pw.program
    def pipeline(v):
        return g(f(v))

    x = rows()
    (got,) = wide.fetch(pipeline(x))
    np.testing.assert_array_equal(got, consume(produce(x)))


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("m", "n"), PAIRS)
def test_eager_reshard(wide: Wide, m: int, n: int) -> None:
    x = rows()
    put = wide.client.put(x, wide.slices[(1, m)], spec=P("x"))
    made = wide.produce[(1, m)](x)
    moved = [pw.reshard(a, devices=wide.slices[(0, n)]) for a in (put, made)]  # to the other island, keeping P("x")
    same_executor = pw.reshard(put, devices=wide.slices[(1, n)])  # m == n: onto the slice it is on
    from_host = pw.reshard(x, devices=wide.slices[(1, n)], spec=P("x"))
    outs = [*moved, same_executor, from_host]
    assert all(isinstance(a, pw.Array) and a.shards == n and a.shape == x.shape for a in outs)
    got = wide.fetch(put, made, *outs)
    for value, want in zip(got, [x, produce(x), x, produce(x), x, x], strict=True):
        np.testing.assert_array_equal(value, want)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("m", "n"), [(1, 8), (8, 1), (8, 3), (3, 2), (4, 1), (2, 4)])
def test_reshard_there_and_back(wide: Wide, m: int, n: int) -> None:
    home, away = wide.slices[(0, m)], wide.slices[(1, n)]
    f, g = wide.produce[(0, m)], wide.consume[(0, m)]

    @pw.program
    def round_trip(v):
        there = pw.reshard(f(v), devices=away)
        back = pw.reshard(there, devices=home)
        return there, g(back)

    x = rows()
    there, back = round_trip(x)
    assert (there.shards, back.shards) == (n, m)
    # The same eagerly: M -> N -> M on pw.Arrays.
    eager_there = pw.reshard(wide.client.put(x, home, spec=P("x")), devices=away)
    eager_back = pw.reshard(eager_there, devices=home)
    got = wide.fetch(there, back, eager_there, eager_back)
    np.testing.assert_array_equal(got[0], produce(x))
    np.testing.assert_array_equal(got[1], consume(produce(x)))
    np.testing.assert_array_equal(got[2], x)
    np.testing.assert_array_equal(got[3], x)


# ------------------------------------------------------------- splits that cannot be


def _work_done(client: pw.Client) -> dict[str, tuple[int, int]]:
    """Objects held and computations run, per executor."""
    return {s.executor_id: (s.objects, s.executed) for s in client.status().executor_stats}


@pytest.mark.timeout(90)
def test_split_that_cannot_be_is_refused_at_call_time(wide: Wide) -> None:
    four = wide.slices[(0, 4)]
    six = rows(6)
    refuse_four = pytest.raises(pw.InvalidArgument, match=r"shape \(6, 3\) \(6\) cannot be split over mesh axes "
                                r"\('x',\) \(4 devices\)")
    with refuse_four:
        pw.reshard(six, devices=four, spec=P("x"))
    held = wide.client.put(six, wide.slices[(1, 2)], spec=P("x"))
    np.testing.assert_array_equal(wide.fetch(held)[0], six)
    # (settled first: under two workers a bare baseline saw earlier frees land during the test)
    settled = frees_settled(wide.client)
    before = _work_done(wide.client)
    with refuse_four:
        pw.reshard(held, devices=four)

    @pw.program
    def inside(v):
        return pw.reshard(wide.produce[(1, 3)](v), devices=four)

    with refuse_four:
        inside(six)

    with pytest.raises(pw.InvalidArgument, match=r"shape \(12, 3\) \(12\) cannot be split over mesh axes"):
        wide.consume[(1, 8)](rows(12))

    @pw.program
    def three_then_eight(v):
        return wide.consume[(1, 8)](wide.produce[(0, 3)](v))

    with pytest.raises(pw.InvalidArgument, match=r"shape \(6, 3\) \(6\) cannot be split over mesh axes"):
        three_then_eight(six)

    assert _work_done(wide.client) == before, "a refused call sends nothing to the executors"
    del settled
    # The cluster keeps serving: the same functions and slices, shapes that split.
    ok = pw.reshard(held, devices=wide.slices[(0, 3)])
    (got_ok, got_eight, got_program) = wide.fetch(ok, wide.consume[(1, 8)](rows()), three_then_eight(rows()))
    np.testing.assert_array_equal(got_ok, six)
    np.testing.assert_array_equal(got_eight, consume(rows()))
    np.testing.assert_array_equal(got_program, consume(produce(rows())))


@pytest.mark.timeout(90)
def test_put_that_cannot_be_split_is_refused_at_call_time(wide: Wide) -> None:
    with pytest.raises(pw.InvalidArgument, match=r"\(6, 3\)"):
        wide.client.put(rows(6), wide.slices[(0, 4)], spec=P("x"))


# ------------------------------------------------------------------ mixture of experts


def _spans(address: str, session_id: str) -> list[TraceEvent]:
    return [ev for t in fetch_trace(address).executors for ev in t.events
            if ev.run_id.startswith(f"{session_id}:")]


def _fn_id(expert: pw.JitFunction, x: np.ndarray) -> str:
    # An expert is compiled for all the rows (the router pads what it gets to that capacity).
    return expert.bind((x,), {}).exported.fn_id


@pytest.mark.timeout(110)
def test_moe_example_equals_plain_jax(default_client: pw.Client) -> None:
    y = moe.main()  # checks itself against moe.reference too
    x = np.random.default_rng(1).standard_normal((moe.TOKENS, moe.DIM)).astype(np.float32)  # main's seed + 1
    np.testing.assert_allclose(y, moe.reference(x, *moe.weights(0)), rtol=1e-5, atol=1e-5)
    slices = default_client.device_sets[-1].slices
    assert len(slices) == 1 + moe.EXPERTS
    assert len({sl.island for sl in slices}) == 2, "experts spread over both islands"


@pytest.fixture
def experts(client: pw.Client) -> tuple[pw.Slice, list[pw.JitFunction], np.ndarray]:
    """The example's four experts on slices of one device, and a home slice of two."""
    devs = client.make_virtual_device_set()
    home = devs.add_slice(devices=2)
    _, w_experts = moe.weights(0)
    fns = [pw.jit(moe.expert(w), devices=devs.add_slice(devices=1)) for w in w_experts]
    return home, fns, w_experts


def _tokens() -> np.ndarray:
    return np.random.default_rng(7).standard_normal((moe.TOKENS, moe.DIM)).astype(np.float32)


def _expected(x: np.ndarray, ids: np.ndarray, w_experts: np.ndarray) -> np.ndarray:
    outs = np.stack([np.asarray(moe.expert(w)(x)) for w in w_experts])
    return outs[ids, np.arange(len(x))]


@pytest.mark.timeout(110)
def test_experts_with_no_rows_complete_and_bad_ids_fail_one_call(
        cluster: pw.LocalCluster, client: pw.Client,
        experts: tuple[pw.Slice, list[pw.JitFunction], np.ndarray]) -> None:
    home, fns, w_experts = experts
    layer = pw.Router(fns, devices=home)
    x = _tokens()
    all_first = np.zeros(len(x), np.int32)
    y = layer(x, all_first)
    assert (y.shape, y.shards) == (x.shape, 2)
    (got,) = client.fetch([y], timeout_seconds=FETCH_TIMEOUT_SECONDS)
    np.testing.assert_allclose(got, _expected(x, all_first, w_experts), rtol=1e-5, atol=1e-5)
    # Every expert completed, the three with no rows included (as an empty computation).
    ran = {ev.fn_id for ev in _spans(cluster.address, client.session_id) if not ev.error}
    assert {_fn_id(f, x) for f in fns} <= ran

    # The same inside a program, fed by a function on the home slice.
    ident = pw.jit(lambda v: v, devices=home)

    @pw.program
    def routed(v, ids):
        return layer(ident(v), ids)

    (got,) = client.fetch([routed(x, all_first)], timeout_seconds=FETCH_TIMEOUT_SECONDS)
    np.testing.assert_allclose(got, _expected(x, all_first, w_experts), rtol=1e-5, atol=1e-5)

    bad = np.arange(len(x), dtype=np.int32) % moe.EXPERTS
    bad[5] = 7
    failed = layer(x, bad)  # dispatched: the routing node finds the bad id, on its executor
    with pytest.raises(pw.InvalidArgument, match="expert id 7"):
        client.fetch([failed], timeout_seconds=FETCH_TIMEOUT_SECONDS)

    good = np.arange(len(x), dtype=np.int32) % moe.EXPERTS
    (got,) = client.fetch([layer(x, good)], timeout_seconds=FETCH_TIMEOUT_SECONDS)
    np.testing.assert_allclose(got, _expected(x, good, w_experts), rtol=1e-5, atol=1e-5)


SLOW_ITERATIONS = 8000  # about a second of matmuls on one CPU core


def heavy_expert(h: jax.Array) -> jax.Array:
    """``2 h``, after a second of row-wise work whose result is added times zero (it is
    finite, so the output is exact; XLA does not fold a float times zero)."""
    a = jnp.tile(h, (1, 16)) * 0.5
    m = jnp.full((a.shape[1], a.shape[1]), 0.01, jnp.float32)
    a = jax.lax.fori_loop(0, SLOW_ITERATIONS, lambda i, a: jnp.tanh(a @ m), a)
    return h * 2.0 + 0.0 * a[:, : h.shape[1]]


@pytest.mark.timeout(110)
def test_slow_expert_finishes_last_and_the_result_is_still_right(cluster: pw.LocalCluster,
                                                                  client: pw.Client) -> None:
    devs = client.make_virtual_device_set()
    home = devs.add_slice(devices=2, island=0)
    _, w_experts = moe.weights(0)
    slow_index = 2
    # The slow expert alone on island 1: its executor is not the fast experts' one.
    slices = [devs.add_slice(devices=1, island=1 if k == slow_index else 0) for k in range(moe.EXPERTS)]
    fns = [pw.jit(heavy_expert if k == slow_index else moe.expert(w), devices=s)
           for k, (w, s) in enumerate(zip(w_experts, slices, strict=True))]
    slow_executor = slices[slow_index].devices[0].executor
    assert all(s.devices[0].executor != slow_executor for k, s in enumerate(slices) if k != slow_index)
    layer = pw.Router(fns, devices=home)

    x = _tokens()
    ids = np.arange(len(x), dtype=np.int32) % moe.EXPERTS  # every expert gets rows
    want = _expected(x, ids, w_experts)
    want[ids == slow_index] = 2.0 * x[ids == slow_index]
    # The first call also loads and compiles every expert; the second shows only their running times.
    for _ in range(2):
        runs_before = {ev.run_id for ev in _spans(cluster.address, client.session_id)}
        (got,) = client.fetch([layer(x, ids)], timeout_seconds=FETCH_TIMEOUT_SECONDS)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    last_run = [ev for ev in _spans(cluster.address, client.session_id) if ev.run_id not in runs_before]
    spans = {ev.fn_id: ev for ev in last_run}
    slow = spans[_fn_id(fns[slow_index], x)]
    fast = [spans[_fn_id(f, x)] for k, f in enumerate(fns) if k != slow_index]
    assert all(not ev.error for ev in (slow, *fast))
    for ev in fast:
        assert ev.end < slow.end, f"a fast expert ended at {ev.end}, after the slow one ({slow.end})"
        assert ev.end - ev.start < slow.end - slow.start
    # The combine (the run's last node) waited for the slow expert's rows.
    combine = max(last_run, key=lambda ev: ev.node)
    assert combine.fn_id == "" and combine.start >= slow.end
