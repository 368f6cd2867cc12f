"""Program validation and lowering on hand-built programs and slices (pure: no sockets, no JAX).

Besides the structure of what lowering makes, ``simulate`` plays a lowered program
through with numpy functions (``pwmesh.sim.play``: puts and moves land, computations
run in program order, every emit goes through the destinations' ``Progress``, exactly
as the executors do), so a missing or doubled transfer fails the test.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from pwmesh.dataflow.layout import Layout
from pwmesh.errors import InvalidArgument
from pwmesh.ir.keys import blockwise_id, gang_id
from pwmesh.ir.lower import (
    HostPut,
    Lowered,
    ShardLocation,
    lower,
    runs_of,
    shard_key,
    sites_of,
    slice_locations,
    validate,
)
from pwmesh.sim.play import play
from pwmesh.wire.codec import encode
from pwmesh.wire.messages import (
    Computation,
    Emit,
    NodeSpec,
    PhysicalDevice,
    ProgramSpec,
    ScheduleRun,
    SendShards,
    ShardRun,
    Site,
    SliceInfo,
    Target,
    ValueSpec,
)
from pwmesh.wire.parts import run_parts

OWNER = "sess1"


def control(executor: str) -> str:
    return f"tcp://{executor}:1"


def data(executor: str) -> str:
    return f"tcp://{executor}:2"


def make_slice(slice_id: int, devices: list[tuple[str, int]], island: int = 0) -> SliceInfo:
    return SliceInfo(
        slice_id=slice_id, owner=OWNER, island=island, map_version=1, scheduler=f"tcp://sched{island}",
        devices=[PhysicalDevice(executor_id=ex, island=island, host=ex, device=d, control=control(ex), data=data(ex))
                 for ex, d in devices],
    )


def loc(executor: str, device: int, island: int = 0) -> ShardLocation:
    return ShardLocation(executor, control(executor), data(executor), device, island, host=executor)


def sr(device: int, shard: int, count: int = 1) -> ShardRun:
    return ShardRun(device=device, shard=shard, count=count)


def site(executor: str, *runs: tuple[int, int, int]) -> Site:
    """``runs``: (device, shard, count)."""
    return Site(executor_id=executor, data=data(executor), host=executor,
                runs=[ShardRun(device=d, shard=s, count=c) for d, s, c in runs])


def value(shards: int, rows: int | None = None, dtype: str = "float32") -> ValueSpec:
    return ValueSpec(shape=[rows if rows is not None else 2 * shards, 3], dtype=dtype, shards=shards)


def chain(shards: int, first: int = 1, second: int = 2, rows: int | None = None) -> ProgramSpec:
    """v0 -f-> v1 -g-> v2, f on slice ``first`` and g on slice ``second``."""
    return ProgramSpec(
        values=[value(shards, rows) for _ in range(3)],
        nodes=[NodeSpec(fn_id="f", slice_id=first, inputs=[0], outputs=[1]),
               NodeSpec(fn_id="g", slice_id=second, inputs=[1], outputs=[2])],
        inputs=[0],
        outputs=[2],
    )


def counter_names() -> Callable[[], str]:
    count = itertools.count()
    return lambda: f"d{next(count)}"


def run(program: ProgramSpec, slices: list[SliceInfo], *, host_inputs: set[int] | None = None,
        bound: dict[int, list[ShardLocation]] | None = None, spmd: dict[str, bool] | None = None,
        fresh_name: Callable[[], str] | None = None) -> Lowered:
    fns = {n.fn_id for n in program.nodes if n.kind == "call"}
    return lower(
        program,
        owner=OWNER,
        names=[f"v{i}" for i in range(len(program.values))],
        host_inputs={0} if host_inputs is None and bound is None else (host_inputs or set()),
        bound=bound or {},
        slices={sl.slice_id: sl for sl in slices},
        spmd={fn: False for fn in fns} | (spmd or {}),
        fresh_name=fresh_name or counter_names(),
    )


def computations(lowered: Lowered) -> list[Computation]:
    return [c for comps in lowered.schedules.values() for c in comps]


def comp(lowered: Lowered, node: int, executor: str) -> Computation:
    (found,) = [c for c in computations(lowered) if c.node == node and c.executor_id == executor]
    return found


def key(v: int, shard: int) -> str:
    return shard_key(OWNER, f"v{v}", shard)


def prefix(buffer: str | int) -> str:
    return f"{OWNER}/v{buffer}" if isinstance(buffer, int) else f"{OWNER}/{buffer}"


def emitted_shards(emits: list[Emit]) -> set[tuple[str, int, str, int]]:
    """(prefix, destination shard, executor, device) of everything ``emits`` send."""
    return {(t.prefix, r.shard + k, s.executor_id, r.device + k)
            for e in emits for t in e.targets for s in t.sites for r in s.runs for k in range(r.count)}


# --------------------------------------------------------------- simulate: the lowered program, played through

FUNCTIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "f": lambda x: x * 2 + 1,
    "g": lambda x: x - 3,
    "h": lambda x: x * x,
    "e0": lambda x: x * 10,
    "e1": lambda x: x + 100,
    "e2": lambda x: -x,
}


def simulate(program: ProgramSpec, lowered: Lowered, host: dict[int, np.ndarray],
             bound: dict[int, np.ndarray] | None = None,
             bound_at: dict[int, list[ShardLocation]] | None = None) -> dict[int, np.ndarray]:
    """``lowered`` played with this file's functions and names (see ``pwmesh.sim.play``)."""
    return play(program, lowered, FUNCTIONS, owner=OWNER, names=[f"v{i}" for i in range(len(program.values))],
                host=host, bound=bound, bound_at=bound_at)


# --------------------------------------------------------------- validate()


def test_validate_accepts_a_chain() -> None:
    validate(chain(2))


def test_validate_accepts_scalars_and_empty_leading_axes() -> None:
    validate(ProgramSpec(values=[ValueSpec(shape=[], dtype="float32", shards=1),
                                 ValueSpec(shape=[0, 4], dtype="int32", shards=4)],
                         nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1])], inputs=[0], outputs=[1]))


def program(nodes: list[tuple[list[int], list[int]]], inputs: list[int], outputs: list[int],
            n_values: int = 4) -> ProgramSpec:
    return ProgramSpec(values=[value(1) for _ in range(n_values)],
                       nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=i, outputs=o) for i, o in nodes],
                       inputs=inputs, outputs=outputs)


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(program([([0], [1])], inputs=[4], outputs=[1]), id="input-out-of-range"),
        pytest.param(program([([0], [1])], inputs=[-1], outputs=[1]), id="input-negative"),
        pytest.param(program([([2], [1])], inputs=[0], outputs=[1]), id="reads-undefined"),
        pytest.param(program([([9], [1])], inputs=[0], outputs=[1]), id="reads-out-of-range"),
        pytest.param(program([([1], [2]), ([0], [1])], inputs=[0], outputs=[2]), id="reads-before-definition"),
        pytest.param(program([([0, 1], [1])], inputs=[0], outputs=[1]), id="reads-own-output"),
        pytest.param(program([([0], [1]), ([0], [1])], inputs=[0], outputs=[1]), id="defined-by-two-nodes"),
        pytest.param(program([([0], [0])], inputs=[0], outputs=[0]), id="node-redefines-an-input"),
        pytest.param(program([([0], [1, 1])], inputs=[0], outputs=[1]), id="output-listed-twice"),
        pytest.param(program([([0], [4])], inputs=[0], outputs=[4]), id="defines-out-of-range"),
        pytest.param(program([([0], [-1])], inputs=[0], outputs=[1]), id="defines-negative"),
        pytest.param(program([([0], [1])], inputs=[0], outputs=[2]), id="output-never-defined"),
        pytest.param(program([([0], [1])], inputs=[0, 0], outputs=[1]), id="input-listed-twice"),
    ],
)
def test_validate_rejects_bad_dataflow(spec: ProgramSpec) -> None:
    with pytest.raises(InvalidArgument):
        validate(spec)


def test_validate_rejects_bad_shard_splits() -> None:
    bad_layouts = {
        "uneven split": ([5, 3], 2),
        "fewer rows than shards": ([3], 4),
        "split scalar": ([], 2),
        "zero shards": ([4], 0),
        "negative shards": ([4], -2),
        "negative dimension": ([-2, 3], 1),
        "negative inner dimension": ([4, -1], 2),
    }
    for case, (shape, shards) in bad_layouts.items():
        spec = chain(2)
        spec.values[1] = ValueSpec(shape=shape, dtype="float32", shards=shards)
        with pytest.raises(InvalidArgument, match="value 1"):
            validate(spec)
            pytest.fail(f"{case}: accepted")


def test_validate_rejects_splitting_a_value_nobody_reads() -> None:
    spec = program([([0], [1])], inputs=[0, 2], outputs=[1])
    spec.values[2] = value(2)
    with pytest.raises(InvalidArgument, match="value 2 is never read, so it cannot be split"):
        validate(spec)


def _donating(nodes: list[tuple[list[int], list[int]]], donate: dict[int, list[int]], outputs: list[int]) -> ProgramSpec:
    spec = program(nodes, inputs=[0], outputs=outputs, n_values=6)
    for index, ks in donate.items():
        spec.nodes[index].donate = ks
    return spec


def test_a_value_may_be_donated_to_a_call_after_all_its_other_readers() -> None:
    # v0 is read by nodes 0 and 1 (making v1, v2); node 2 reads v1, v2 and consumes v0: both came before it.
    validate(_donating([([0], [1]), ([0, 1], [2]), ([0, 1, 2], [3])], {2: [0]}, outputs=[3]))


@pytest.mark.parametrize(("nodes", "donate", "outputs", "message"), [
    pytest.param([([0], [1]), ([0], [2])], {0: [0]}, [1, 2], "node 1 also reads and may not have read yet",
                  id="a-later-reader"),
    pytest.param([([0], [1]), ([0], [2]), ([1, 2], [3])], {1: [0]}, [3], "node 0 also reads and may not have",
                  id="a-reader-beside-it"),
    pytest.param([([0], [1]), ([1], [2])], {1: [0]}, [2, 1], "returns", id="returned"),
    pytest.param([([0], [1]), ([1], [2]), ([1, 2], [3])], {1: [0], 2: [0]}, [3], "node 2 also reads", id="twice"),
    pytest.param([([0, 0], [1])], {0: [0]}, [1], "also reads as another argument", id="same-call"),
])
def test_validate_rejects_a_donation_another_reader_may_still_need(nodes, donate, outputs, message) -> None:
    spec = _donating(nodes, donate, outputs)  # donate: node -> the positions of its inputs it consumes
    with pytest.raises(InvalidArgument, match=message):
        validate(spec)


def test_validate_rejects_an_unknown_node_kind() -> None:
    spec = chain(1)
    spec.nodes[1].kind = "reduce"
    with pytest.raises(InvalidArgument, match="node 1 has unknown kind 'reduce'"):
        validate(spec)


def test_lower_validates_first() -> None:
    spec = chain(2)
    spec.outputs = [7]
    with pytest.raises(InvalidArgument):
        run(spec, [make_slice(1, [("a", 0), ("a", 1)]), make_slice(2, [("a", 0), ("a", 1)])])


def test_node_on_a_slice_the_session_does_not_own() -> None:
    with pytest.raises(InvalidArgument, match="slice 2"):
        run(chain(2), [make_slice(1, [("a", 0), ("a", 1)])])


def test_node_calling_an_unregistered_function() -> None:
    spec = chain(1, first=1, second=1)
    with pytest.raises(InvalidArgument, match="never registered"):
        lower(spec, owner=OWNER, names=["v0", "v1", "v2"], host_inputs={0}, bound={},
              slices={1: make_slice(1, [("a", 0)])}, spmd={"f": False})


# --------------------------------------------------------------- computations


def test_one_computation_per_node_and_executor_whatever_the_shards() -> None:
    sl = make_slice(1, [("a", 0), ("a", 1), ("b", 0), ("b", 1)])
    lowered = run(chain(4, 1, 1), [sl])
    comps = lowered.schedules["tcp://sched0"]
    assert [(c.node, c.executor_id) for c in comps] == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    for c in comps:
        assert c.fn_id == ("f" if c.node == 0 else "g")
        assert c.control == control(c.executor_id)
        assert c.kind == "call" and c.spmd is False and c.ragged is False
        assert c.seq == -1, "sequence numbers belong to the island scheduler"
        first = 0 if c.executor_id == "a" else 2
        assert c.runs == [ShardRun(device=0, shard=first, count=2)]
        assert c.shards() == [(0, first), (1, first + 1)]
        assert c.inputs == [prefix(c.node)] and c.outputs == [prefix(c.node + 1)]
        assert c.emits == [], "every shard is read where it was made"
        assert c.gang == "", "shards that do not communicate wait for nobody: no gang to join"
    assert lowered.node_executors == {0: {"a", "b"}, 1: {"a", "b"}}


def test_only_nodes_making_program_outputs_report_at_once() -> None:
    """A node none of whose outputs is the program's is quiet: its executors report it with their part's end."""
    sl = make_slice(1, [("a", 0), ("b", 0)])
    comps = run(chain(2, 1, 1), [sl]).schedules["tcp://sched0"]
    assert {(c.node, c.quiet) for c in comps} == {(0, True), (1, False)}
    both = ProgramSpec(values=chain(2).values, nodes=chain(2, 1, 1).nodes, inputs=[0], outputs=[1, 2])
    assert not any(c.quiet for c in run(both, [sl]).schedules["tcp://sched0"])


def test_runs_follow_contiguous_devices_and_shards() -> None:
    assert runs_of([(0, 0), (1, 1), (2, 2)]) == [sr(0, 0, 3)]
    assert runs_of([(1, 0), (0, 1)]) == [sr(1, 0), sr(0, 1)]
    assert runs_of([(0, 0), (2, 1), (3, 2), (5, 4)]) == [sr(0, 0), sr(2, 1, 2), sr(5, 4)]
    assert runs_of([]) == []
    lowered = run(chain(4, 1, 1), [make_slice(1, [("a", 0), ("a", 2), ("a", 3), ("a", 1)])])
    assert comp(lowered, 0, "a").runs == [sr(0, 0), sr(2, 1, 2), sr(1, 3)]
    assert sites_of(slice_locations(make_slice(1, [("a", 0), ("b", 0), ("a", 1)])), [0, 1, 2]) == [
        site("a", (0, 0, 1), (1, 2, 1)), site("b", (0, 1, 1))]


def test_multi_input_multi_output_prefixes() -> None:
    spec = ProgramSpec(values=[value(2) for _ in range(4)],
                       nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0, 1], outputs=[2, 3])],
                       inputs=[0, 1], outputs=[2, 3])
    lowered = run(spec, [make_slice(1, [("a", 0), ("a", 1)])], host_inputs={0, 1})
    (c,) = computations(lowered)
    assert (c.inputs, c.outputs) == ([prefix(0), prefix(1)], [prefix(2), prefix(3)])
    assert c.runs == [sr(0, 0, 2)]


def test_emit_slots_index_inputs_then_outputs() -> None:
    """The second output of a two-input node is slot 3."""
    spec = ProgramSpec(values=[value(1) for _ in range(5)],
                       nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0, 1], outputs=[2, 3]),
                              NodeSpec(fn_id="g", slice_id=2, inputs=[3], outputs=[4])],
                       inputs=[0, 1], outputs=[2, 4])
    lowered = run(spec, [make_slice(1, [("a", 0)]), make_slice(2, [("b", 0)])], host_inputs={0, 1})
    (emit,) = comp(lowered, 0, "a").emits
    assert emit.slot == 3 and emit.targets[0].prefix == prefix(3)


def encoded_bytes(comps: list[Computation]) -> int:
    frames = encode(ScheduleRun(run_id=f"{OWNER}:1", proxy="tcp://proxy:1", parts=run_parts(comps)), msg_id=1)
    return sum(memoryview(f).nbytes for f in frames)


def test_chain_on_one_executor_is_flat_in_the_number_of_shards() -> None:
    """arg -> A -> B -> result over N devices of one executor: two computations, the same bytes for any N."""
    sizes: dict[int, list[int]] = {}
    for n in range(2, 65):
        sl = make_slice(1, [("a", d) for d in range(n)])
        lowered = run(chain(n, 1, 1), [sl])
        comps = computations(lowered)
        assert [(c.node, c.executor_id) for c in comps] == [(0, "a"), (1, "a")], n
        assert all(c.runs == [sr(0, 0, n)] and c.emits == [] for c in comps), n
        assert len(lowered.puts) == n, "one put per shard: the data itself is per shard"
        sizes[n] = [encoded_bytes([c]) for c in comps] + [encoded_bytes(comps)]
    for n, size in sizes.items():
        assert all(s <= base + 16 for s, base in zip(size, sizes[2], strict=True)), (n, size, sizes[2])


def test_chain_across_two_executors_is_flat_in_the_number_of_shards() -> None:
    """A on executor a, B on executor b: the copy of every shard is one emit with one run, whatever N."""
    sizes: dict[int, list[int]] = {}
    for n in range(2, 65):
        lowered = run(chain(n), [make_slice(1, [("a", d) for d in range(n)]),
                                 make_slice(2, [("b", d) for d in range(n)])])
        a, b = comp(lowered, 0, "a"), comp(lowered, 1, "b")
        (emit,) = a.emits
        assert emit.targets[0].sites == [site("b", (0, 0, n))], n
        assert b.emits == []
        sizes[n] = [encoded_bytes([a]), encoded_bytes([b]), encoded_bytes([a, b])]
    for n, size in sizes.items():
        assert all(s <= base + 16 for s, base in zip(size, sizes[2], strict=True)), (n, size, sizes[2])


def test_chain_stays_two_computations_per_executor_as_shards_grow() -> None:
    for shards in (2, 4, 8, 16, 32, 64):
        half = shards // 2
        devices = [("a", d) for d in range(half)] + [("b", d) for d in range(half)]
        swapped = devices[half:] + devices[:half]
        lowered = run(chain(shards), [make_slice(1, devices), make_slice(2, swapped)])
        per_executor = collections.Counter(c.executor_id for c in computations(lowered))
        assert per_executor == {"a": 2, "b": 2}, shards
        assert all(len(c.runs) == 1 for c in computations(lowered)), shards
        # Every shard of v1 crosses executors, yet rides as one emit inside each producer computation.
        for ex in "ab":
            (emit,) = comp(lowered, 0, ex).emits
            assert emit.targets[0].sites == [site("b", (0, 0, half)), site("a", (0, half, half))], shards
            assert comp(lowered, 1, ex).emits == []


def test_produced_locations() -> None:
    x, y = make_slice(1, [("a", 0), ("b", 1)]), make_slice(2, [("c", 0), ("c", 1)])
    lowered = run(chain(2), [x, y])
    assert lowered.produced == {1: slice_locations(x), 2: slice_locations(y)}


# --------------------------------------------------------------- copies between executors


def test_copy_is_a_block_emit_on_the_producer() -> None:
    lowered = run(chain(2), [make_slice(1, [("a", 0), ("a", 1)]), make_slice(2, [("b", 1), ("b", 0)])])
    assert comp(lowered, 0, "a").emits == [
        Emit(mode="block", rows=4, src_shards=2, slot=1,
             targets=[Target(prefix=prefix(1), shards=2, sites=[site("b", (1, 0, 1), (0, 1, 1))], shape=[2, 3],
                             dtype="float32")]),
    ]
    assert comp(lowered, 1, "b").emits == []
    assert comp(lowered, 1, "b").inputs == [prefix(1)], "a copy keeps the buffer's name"
    assert lowered.moves == {} and lowered.derived == []


def test_no_emits_on_the_same_executor_even_across_devices() -> None:
    lowered = run(chain(2), [make_slice(1, [("a", 0), ("a", 1)]), make_slice(2, [("a", 1), ("a", 0)])])
    assert all(c.emits == [] for c in computations(lowered))
    assert lowered.moves == {}


def test_copy_covers_only_the_missing_shards() -> None:
    lowered = run(chain(4, rows=8), [make_slice(1, [("a", 0), ("a", 1), ("b", 0), ("b", 1)]),
                                     make_slice(2, [("a", 2), ("c", 0), ("b", 2), ("c", 1)])])
    for ex in "ab":
        (emit,) = comp(lowered, 0, ex).emits
        assert emit.targets[0].sites == [site("c", (0, 1, 1), (1, 3, 1))]


def assignments(shards: int, executors: str) -> list[list[tuple[str, int]]]:
    """Every way to put ``shards`` shards on ``executors``, each shard on a fresh device of its executor."""
    result = []
    for owners in itertools.product(executors, repeat=shards):
        used: collections.Counter[str] = collections.Counter()
        devices = []
        for ex in owners:
            devices.append((ex, used[ex]))
            used[ex] += 1
        result.append(devices)
    return result


def test_emits_exactly_where_shards_cross_executors() -> None:
    shards = 3
    x = np.arange(6 * 3, dtype=np.float32).reshape(6, 3)
    for producer_devices, consumer_devices in itertools.product(assignments(shards, "ab"), repeat=2):
        spec = chain(shards)
        lowered = run(spec, [make_slice(1, producer_devices), make_slice(2, consumer_devices)])
        expected = {
            (prefix(1), i, dst, dst_dev)
            for i, ((src, _), (dst, dst_dev)) in enumerate(zip(producer_devices, consumer_devices, strict=True))
            if src != dst
        }
        for c in computations(lowered):
            if c.node == 0 and expected:
                (emit,) = c.emits  # the same emit on every producer: each sends what it holds
                assert emitted_shards([emit]) == expected, (producer_devices, consumer_devices)
                assert (emit.mode, emit.rows, emit.src_shards, emit.slot) == ("block", 6, 3, 1)
                assert all(s.data == data(s.executor_id) for s in emit.targets[0].sites)
            else:
                assert c.emits == [], "nothing crosses, or g's outputs are read by no one"
        out = simulate(spec, lowered, {0: x})
        np.testing.assert_array_equal(out[2], FUNCTIONS["g"](FUNCTIONS["f"](x)))


def test_one_copy_per_shard_and_destination_executor() -> None:
    """Two consumers on the same executor share one copy; a third executor gets its own."""
    spec = ProgramSpec(
        values=[value(2) for _ in range(5)],
        nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1]),
               NodeSpec(fn_id="g", slice_id=2, inputs=[1], outputs=[2]),
               NodeSpec(fn_id="g", slice_id=3, inputs=[1], outputs=[3]),
               NodeSpec(fn_id="g", slice_id=4, inputs=[1], outputs=[4])],
        inputs=[0], outputs=[2, 3, 4])
    lowered = run(spec, [make_slice(1, [("a", 0), ("a", 1)]), make_slice(2, [("b", 0), ("b", 1)]),
                         make_slice(3, [("b", 1), ("b", 0)]), make_slice(4, [("c", 0), ("c", 1)])])
    emits = comp(lowered, 0, "a").emits
    assert [e.targets[0].sites for e in emits] == [[site("b", (0, 0, 2))], [site("c", (0, 0, 2))]]
    assert lowered.derived == []


# --------------------------------------------------------------- reshards


@pytest.mark.parametrize("m, n", [(m, n) for m in (1, 2, 3, 4, 8) for n in (1, 2, 3, 4, 8)])
def test_reshard_m_to_n(m: int, n: int) -> None:
    """f makes v1 split m ways, g reads it split n ways: m != n gives a derived buffer and one emit to all
    n shards (even those on the producer's executor)."""
    spec = ProgramSpec(values=[value(m, 24), value(m, 24), value(n, 24)],
                       nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1]),
                              NodeSpec(fn_id="g", slice_id=2, inputs=[1], outputs=[2])],
                       inputs=[0], outputs=[2])
    producer = make_slice(1, [("a", d) for d in range(m)])
    consumer = make_slice(2, [("ab"[j % 2], j // 2) for j in range(n)])  # half of it on the producer's executor
    lowered = run(spec, [producer, consumer])
    g = [c for c in computations(lowered) if c.node == 1]
    (f,) = [c for c in computations(lowered) if c.node == 0]
    if m == n:
        assert lowered.derived == []
        assert {c.inputs[0] for c in g} == {prefix(1)}
        expected = {(prefix(1), j, "b", j // 2) for j in range(1, n, 2)}  # only b's shards move
        assert emitted_shards(f.emits) == expected
    else:
        assert lowered.derived == ["d0"]
        assert {c.inputs[0] for c in g} == {prefix("d0")}
        (emit,) = f.emits
        assert (emit.mode, emit.rows, emit.src_shards, emit.slot) == ("block", 24, m, 1)
        (target,) = emit.targets
        assert (target.prefix, target.shards, target.shape, target.dtype) == (prefix("d0"), n, [24 // n, 3],
                                                                               "float32")
        assert emitted_shards(f.emits) == {(prefix("d0"), j, "ab"[j % 2], j // 2) for j in range(n)}
        assert lowered.holders["d0"] == ({control("a"), control("b")} if n > 1 else {control("a")})
    assert lowered.moves == {}
    x = np.arange(24 * 3, dtype=np.float32).reshape(24, 3)
    np.testing.assert_array_equal(simulate(spec, lowered, {0: x})[2], FUNCTIONS["g"](FUNCTIONS["f"](x)))


def test_one_derived_buffer_per_value_and_layout() -> None:
    """Two readers at the same 4-way layout share one reshard; a 2-way reader gets its own."""
    spec = ProgramSpec(values=[value(8, 24), value(8, 24), value(4, 24), value(4, 24), value(2, 24)],
                       nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1]),
                              NodeSpec(fn_id="g", slice_id=2, inputs=[1], outputs=[2]),
                              NodeSpec(fn_id="h", slice_id=2, inputs=[1], outputs=[3]),
                              NodeSpec(fn_id="g", slice_id=3, inputs=[1], outputs=[4])],
                       inputs=[0], outputs=[2, 3, 4])
    lowered = run(spec, [make_slice(1, [("a", d) for d in range(8)]), make_slice(2, [("b", d) for d in range(4)]),
                         make_slice(3, [("b", 0), ("b", 1)])])
    assert lowered.derived == ["d0", "d1"]
    assert [c.inputs for c in computations(lowered) if c.node > 0] == [[prefix("d0")], [prefix("d0")],
                                                                         [prefix("d1")]]
    f = comp(lowered, 0, "a")
    assert [(e.targets[0].prefix, e.targets[0].shards) for e in f.emits] == [(prefix("d0"), 4), (prefix("d1"), 2)]
    x = np.arange(24 * 3, dtype=np.float32).reshape(24, 3)
    out = simulate(spec, lowered, {0: x})
    np.testing.assert_array_equal(out[2], FUNCTIONS["g"](FUNCTIONS["f"](x)))
    np.testing.assert_array_equal(out[3], FUNCTIONS["h"](FUNCTIONS["f"](x)))
    np.testing.assert_array_equal(out[4], FUNCTIONS["g"](FUNCTIONS["f"](x)))


def test_bound_buffer_resharded_by_its_holders() -> None:
    bound = {0: [loc("a", 0), loc("b", 0)]}
    spec = ProgramSpec(values=[value(2, 8), value(4, 8)],
                       nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1])], inputs=[0], outputs=[1])
    lowered = run(spec, [make_slice(1, [("a", 0), ("a", 1), ("a", 2), ("a", 3)])], bound=bound)
    assert lowered.derived == ["d0"] and lowered.puts == []
    emit = Emit(mode="block", rows=8, src_shards=2, targets=[
        Target(prefix=prefix("d0"), shards=4, sites=[site("a", (0, 0, 4))], shape=[2, 3], dtype="float32")])
    assert lowered.moves == {
        control("a"): [SendShards(prefix=prefix(0), runs=[sr(0, 0)], emits=[emit])],
        control("b"): [SendShards(prefix=prefix(0), runs=[sr(0, 1)], emits=[emit])],
    }
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    np.testing.assert_array_equal(simulate(spec, lowered, {}, {0: x}, bound)[1], FUNCTIONS["f"](x))


def test_zero_row_values_reshard() -> None:
    spec = ProgramSpec(values=[value(2, 0), value(2, 0), value(4, 0)],
                       nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1]),
                              NodeSpec(fn_id="g", slice_id=2, inputs=[1], outputs=[2])],
                       inputs=[0], outputs=[2])
    lowered = run(spec, [make_slice(1, [("a", 0), ("a", 1)]), make_slice(2, [("b", d) for d in range(4)])])
    (emit,) = comp(lowered, 0, "a").emits
    assert emit.rows == 0 and emit.targets[0].shape == [0, 3]
    assert simulate(spec, lowered, {0: np.zeros((0, 3), np.float32)})[2].shape == (0, 3)


def test_scalar_copied_between_executors() -> None:
    spec = ProgramSpec(values=[ValueSpec(shape=[], dtype="float32", shards=1)] * 3,
                       nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1]),
                              NodeSpec(fn_id="g", slice_id=2, inputs=[1], outputs=[2])],
                       inputs=[0], outputs=[2])
    lowered = run(spec, [make_slice(1, [("a", 0)]), make_slice(2, [("b", 0)])])
    (emit,) = comp(lowered, 0, "a").emits
    assert emit.rows == 1 and emit.targets[0].shape == []
    assert simulate(spec, lowered, {0: np.array(2.0, np.float32)})[2] == 2.0


def no_names() -> str:
    raise AssertionError("lowering derived a buffer for a layout it then rejected")


@pytest.mark.parametrize("spec, slices, match", [
    pytest.param(chain(8, rows=24), [make_slice(1, [("a", d) for d in range(8)]),
                                     make_slice(2, [("a", d) for d in range(5)])],
                 r"node 1 runs on 5 devices but its output 2 is split 8 ways", id="output-split-differs"),
    pytest.param(ProgramSpec(values=[value(8, 24), value(8, 24), value(5, 25)],
                             nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1]),
                                    NodeSpec(fn_id="g", slice_id=2, inputs=[1], outputs=[2])],
                             inputs=[0], outputs=[2]),
                 [make_slice(1, [("a", d) for d in range(8)]), make_slice(2, [("b", d) for d in range(5)])],
                 r"node 1 reads value 1 on 5 devices.*shape \(24, 3\) cannot be split into 5 equal shards",
                 id="computed-value"),
    pytest.param(ProgramSpec(values=[value(2, 6), value(4, 8)],
                             nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1])],
                             inputs=[0], outputs=[1]),
                 [make_slice(1, [("a", d) for d in range(4)])],
                 r"node 0 reads value 0 on 4 devices.*shape \(6, 3\) cannot be split into 4 equal shards "
                 r"along its leading axis \(6 rows is not a multiple of 4\)", id="host-input"),
    pytest.param(ProgramSpec(values=[ValueSpec(shape=[], dtype="float32", shards=1), value(2)],
                             nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1])],
                             inputs=[0], outputs=[1]),
                 [make_slice(1, [("a", 0), ("a", 1)])], "node 0 reads value 0 on 2 devices.*a scalar cannot be split",
                 id="scalar"),
])
def test_a_layout_that_cannot_be_split_is_rejected_before_anything_is_emitted(
        spec: ProgramSpec, slices: list[SliceInfo], match: str) -> None:
    validate(spec)  # the program itself is fine: only where it runs makes the split impossible
    with pytest.raises(InvalidArgument, match=match):
        run(spec, slices, fresh_name=no_names)


# --------------------------------------------------------------- host inputs and bound buffers


def test_host_inputs_become_puts_deduplicated_per_value_shard_and_executor() -> None:
    spec = ProgramSpec(
        values=[value(2) for _ in range(4)],
        nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1]),
               NodeSpec(fn_id="f", slice_id=2, inputs=[0], outputs=[2]),
               NodeSpec(fn_id="f", slice_id=3, inputs=[0, 1], outputs=[3])],
        inputs=[0], outputs=[2, 3])
    lowered = run(spec, [
        make_slice(1, [("a", 0), ("b", 0)]),
        make_slice(2, [("a", 1), ("b", 1)]),  # same executors, other devices: nothing new to put
        make_slice(3, [("b", 0), ("a", 0)]),  # shards swap executors: each shard goes to the other one too
    ])
    assert lowered.puts == [
        HostPut(value=0, shard=0, location=loc("a", 0), key=key(0, 0), layout=Layout.blocks([4, 3], 2)),
        HostPut(value=0, shard=1, location=loc("b", 0), key=key(0, 1), layout=Layout.blocks([4, 3], 2)),
        HostPut(value=0, shard=0, location=loc("b", 0), key=key(0, 0), layout=Layout.blocks([4, 3], 2)),
        HostPut(value=0, shard=1, location=loc("a", 0), key=key(0, 1), layout=Layout.blocks([4, 3], 2)),
    ]
    assert lowered.moves == {}
    assert {t.prefix for c in computations(lowered) for e in c.emits for t in e.targets} == {prefix(1)}, \
        "host inputs are put where they are read, never emitted"


def test_host_input_read_at_two_layouts_is_put_at_both() -> None:
    spec = ProgramSpec(values=[value(2, 8), value(2, 8), value(4, 8)],
                       nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1]),
                              NodeSpec(fn_id="g", slice_id=2, inputs=[0], outputs=[2])],
                       inputs=[0], outputs=[1, 2])
    lowered = run(spec, [make_slice(1, [("a", 0), ("a", 1)]), make_slice(2, [("a", 0), ("a", 1), ("b", 0),
                                                                                 ("b", 1)])])
    assert lowered.derived == ["d0"]
    assert lowered.puts == [
        HostPut(value=0, shard=0, location=loc("a", 0), key=key(0, 0), layout=Layout.blocks([8, 3], 2)),
        HostPut(value=0, shard=1, location=loc("a", 1), key=key(0, 1), layout=Layout.blocks([8, 3], 2)),
        HostPut(value=0, shard=0, location=loc("a", 0), key=shard_key(OWNER, "d0", 0), layout=Layout.blocks([8, 3], 4)),
        HostPut(value=0, shard=1, location=loc("a", 1), key=shard_key(OWNER, "d0", 1), layout=Layout.blocks([8, 3], 4)),
        HostPut(value=0, shard=2, location=loc("b", 0), key=shard_key(OWNER, "d0", 2), layout=Layout.blocks([8, 3], 4)),
        HostPut(value=0, shard=3, location=loc("b", 1), key=shard_key(OWNER, "d0", 3), layout=Layout.blocks([8, 3], 4)),
    ]
    assert [c.inputs for c in computations(lowered)] == [[prefix(0)], [prefix("d0")], [prefix("d0")]]
    assert lowered.holders["d0"] == {control("a"), control("b")}
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    out = simulate(spec, lowered, {0: x})
    np.testing.assert_array_equal(out[1], FUNCTIONS["f"](x))
    np.testing.assert_array_equal(out[2], FUNCTIONS["g"](x))


def test_host_input_read_twice_at_another_layout_is_put_once() -> None:
    spec = ProgramSpec(values=[value(2, 8), value(4, 8), value(4, 8)],
                       nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1]),
                              NodeSpec(fn_id="g", slice_id=1, inputs=[0], outputs=[2])],
                       inputs=[0], outputs=[1, 2])
    lowered = run(spec, [make_slice(1, [("a", d) for d in range(4)])])
    assert lowered.derived == ["d0"]
    assert [p.key for p in lowered.puts] == [shard_key(OWNER, "d0", j) for j in range(4)]


def test_unread_host_input_is_not_put() -> None:
    spec = ProgramSpec(values=[value(1), value(1), value(1)],
                       nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[1], outputs=[2])],
                       inputs=[0, 1], outputs=[2])
    lowered = run(spec, [make_slice(1, [("a", 0)])], host_inputs={0, 1})
    assert [p.value for p in lowered.puts] == [1]


def test_bound_buffers_on_another_executor_become_moves() -> None:
    """An existing buffer read elsewhere lands in a buffer of the run's own (freed with it), whole."""
    bound = {0: [loc("a", 0), loc("a", 1)]}
    lowered = run(chain(2, 1, 1), [make_slice(1, [("a", 1), ("b", 0)])], bound=bound)
    assert lowered.puts == []
    (landing,) = lowered.derived
    assert lowered.moves == {
        control("a"): [SendShards(prefix=prefix(0), runs=[sr(0, 0, 2)], emits=[
            Emit(mode="block", rows=4, src_shards=2, targets=[
                Target(prefix=f"{OWNER}/{landing}", shards=2, sites=[site("a", (1, 0, 1)), site("b", (0, 1, 1))],
                       shape=[2, 3], dtype="float32")])])],
    }
    assert lowered.holders["v0"] == {control("a")}
    assert lowered.holders[landing] == {control("a"), control("b")}
    x = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)
    out = simulate(chain(2, 1, 1), lowered, {}, {0: x}, bound)
    np.testing.assert_array_equal(out[2], FUNCTIONS["g"](FUNCTIONS["f"](x)))


def test_bound_buffers_already_in_place_need_no_move() -> None:
    lowered = run(chain(2, 1, 1), [make_slice(1, [("a", 1), ("a", 0)])], bound={0: [loc("a", 0), loc("a", 1)]})
    assert lowered.moves == {}
    assert lowered.puts == []
    assert lowered.derived == []


def test_bound_buffer_moves_are_sent_once_per_executor() -> None:
    spec = ProgramSpec(values=[value(1), value(1), value(1)],
                       nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1]),
                              NodeSpec(fn_id="f", slice_id=2, inputs=[0], outputs=[2])],
                       inputs=[0], outputs=[1, 2])
    lowered = run(spec, [make_slice(1, [("b", 0)]), make_slice(2, [("b", 1)])], bound={0: [loc("a", 0)]})
    ((send,),) = lowered.moves.values()
    (landing,) = lowered.derived  # one copy per executor, whichever of its devices reads it
    assert emitted_shards(send.emits) == {(f"{OWNER}/{landing}", 0, "b", 0)}


def test_bound_buffer_copied_to_two_executors_is_one_send_with_two_emits() -> None:
    spec = ProgramSpec(values=[value(1), value(1), value(1)],
                       nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1]),
                              NodeSpec(fn_id="f", slice_id=2, inputs=[0], outputs=[2])],
                       inputs=[0], outputs=[1, 2])
    lowered = run(spec, [make_slice(1, [("b", 0)]), make_slice(2, [("c", 0)])], bound={0: [loc("a", 0)]})
    assert list(lowered.moves) == [control("a")]
    ((send,),) = lowered.moves.values()
    first, second = lowered.derived
    assert [emitted_shards([e]) for e in send.emits] == [{(f"{OWNER}/{first}", 0, "b", 0)},
                                                         {(f"{OWNER}/{second}", 0, "c", 0)}]


def test_bound_buffer_with_the_wrong_shard_count() -> None:
    with pytest.raises(InvalidArgument, match="shards"):
        run(chain(2, 1, 1), [make_slice(1, [("a", 0), ("a", 1)])], bound={0: [loc("a", 0)]})


# --------------------------------------------------------------- bookkeeping


def test_node_executors_and_holders() -> None:
    lowered = run(chain(2), [make_slice(1, [("a", 0), ("a", 1)]), make_slice(2, [("a", 0), ("b", 0)])])
    assert lowered.node_executors == {0: {"a"}, 1: {"a", "b"}}
    assert lowered.holders == {
        "v0": {control("a")},
        "v1": {control("a"), control("b")},  # made on a, copied to b for g's second shard
        "v2": {control("a"), control("b")},
    }


def test_function_sites() -> None:
    spec = chain(2, 1, 2)
    lowered = run(spec, [make_slice(1, [("a", 0), ("a", 1)]), make_slice(2, [("b", 0), ("b", 1)])],
                  spmd={"g": True})
    assert lowered.function_sites == {
        "f": {(control("a"), (0,)), (control("a"), (1,))},  # one single-device executable per device
        "g": {(control("b"), (0, 1))},  # one gang executable over the executor's devices
    }
    assert comp(lowered, 1, "b").spmd is True
    assert comp(lowered, 0, "a").spmd is False


# --------------------------------------------------------------- islands


def test_nodes_on_two_islands_give_two_schedules() -> None:
    x = make_slice(1, [("a", 0), ("a", 1)], island=0)
    y = make_slice(2, [("b", 0), ("b", 1)], island=1)
    lowered = run(chain(2), [x, y])
    assert set(lowered.schedules) == {x.scheduler, y.scheduler} == {"tcp://sched0", "tcp://sched1"}
    assert [(c.node, c.executor_id) for c in lowered.schedules[x.scheduler]] == [(0, "a")]
    assert [(c.node, c.executor_id) for c in lowered.schedules[y.scheduler]] == [(1, "b")]
    (emit,) = lowered.schedules[x.scheduler][0].emits
    assert emit.targets[0].sites == [site("b", (0, 0, 2))]


def test_one_island_gives_one_schedule_in_program_order() -> None:
    sl = make_slice(1, [("a", 0), ("b", 0)])
    lowered = run(chain(2, 1, 1), [sl])
    assert list(lowered.schedules) == [sl.scheduler]
    assert [c.node for c in lowered.schedules[sl.scheduler]] == [0, 0, 1, 1]


# --------------------------------------------------------------- refusals


def test_spmd_node_over_executors_outside_one_jax_group_runs_by_blocks() -> None:
    """No group joins their devices: each executor runs its devices' part of the partitioned program alone,
    as a per-device function derived from the registered SPMD one (``blockwise_id``); no gang."""
    grouped = make_slice(1, [("a", 0), ("b", 0)])
    grouped.devices[0].group, grouped.devices[1].group = "tcp://g1", "tcp://g2"
    for sl in (make_slice(1, [("a", 0), ("b", 0)]), grouped):
        lowered = run(chain(2, 1, 1), [sl], spmd={"f": True, "g": True})
        comps = lowered.schedules[sl.scheduler]
        assert [(c.fn_id, c.spmd, c.gang) for c in comps] == [  # a's device 0 runs shard 0, b's shard 1
            (blockwise_id(f, {0: shard}), False, "") for f in "fg" for shard in (0, 1)]
        assert not lowered.gangs
        assert lowered.function_sites["f"] == {(control("a"), (0,)), (control("b"), (0,))}


def test_spmd_node_over_executors_of_one_jax_group_names_every_device_of_its_gang() -> None:
    sl = make_slice(1, [("a", 0), ("b", 0), ("a", 1), ("b", 1)])
    for d in sl.devices:
        d.group = "island-1"
    lowered = run(chain(4, 1, 1), [sl], spmd={"f": True})
    comps = [c for c in computations(lowered) if c.fn_id == "f"]
    assert {c.executor_id for c in comps} == {"a", "b"}
    (gang,) = lowered.gangs.values()
    mesh = [(r.executor_id, r.first + k) for r in gang.message.devices for k in range(r.count)]
    assert mesh == [("a", 0), ("b", 0), ("a", 1), ("b", 1)], "the whole mesh, in shard order, by executor"
    assert gang.controls == (control("a"), control("b")), "each of its executors is sent it"
    assert gang.message.gang_id == gang_id(gang.message.devices)
    assert all(c.gang == gang.message.gang_id for c in comps), "every part names the gang by id, not its devices"
    assert sorted(c.shards() for c in comps) == [[(0, 0), (1, 2)], [(0, 1), (1, 3)]]


def test_a_gang_is_named_by_its_devices_so_a_part_does_not_grow_with_them() -> None:
    """Two programs on one slice name one gang; the same slice remapped names another; and a part's
    computations are as many bytes at 64 executors as at 2 (the gang goes once, in ``RegisterGang``)."""
    def lowered_over(executors: int, order: list[str] | None = None) -> Lowered:
        names = order or [f"e{k:03d}" for k in range(executors)]
        sl = make_slice(1, [(ex, d) for ex in names for d in range(2)])
        for d in sl.devices:
            d.group = "island-1"
        return run(chain(2 * executors, 1, 1), [sl], spmd={"f": True, "g": True})

    small, big = lowered_over(2), lowered_over(64)
    assert len(small.gangs) == len(big.gangs) == 1, "one gang per slice, however many nodes use it"
    assert lowered_over(2).gangs.keys() == small.gangs.keys(), "the same devices: the same id"
    assert lowered_over(2, ["e001", "e000"]).gangs.keys() != small.gangs.keys(), "other devices: another id"
    (gang,) = big.gangs.values()
    assert [(r.executor_id, r.first, r.count) for r in gang.message.devices[:2]] == [("e000", 0, 2), ("e001", 0, 2)]

    def part_bytes(lowered: Lowered) -> int:
        return max(len(p.computations) for comps in lowered.schedules.values() for p in run_parts(comps))

    assert part_bytes(big) == part_bytes(small)


def test_spmd_node_on_one_executor_is_fine() -> None:
    lowered = run(chain(2, 1, 1), [make_slice(1, [("a", 0), ("a", 1)])], spmd={"f": True, "g": True})
    assert [c.runs for c in computations(lowered)] == [[sr(0, 0, 2)]] * 2
    assert all(c.spmd and c.gang == "" for c in computations(lowered))
    assert lowered.gangs == {}, "no gang to send"


@pytest.mark.parametrize("devices", [1, 4])
def test_output_split_that_differs_from_the_slice(devices: int) -> None:
    with pytest.raises(InvalidArgument, match="node 0 runs on .* devices but its output 1 is split 2 ways"):
        run(chain(2, 1, 1), [make_slice(1, [("a", d) for d in range(devices)])])


# --------------------------------------------------------------- route and combine (mixture of experts)

ROWS = 8


def moe(experts: int = 2, x_shards: int = 1, y_shards: int = 2) -> ProgramSpec:
    """x (v0) and expert ids (v1) -route-> v2.. (one per expert) -e<k>-> expert outputs -combine-> y.

    Route on slice 1, expert k on slice 2 + k, combine on slice 9."""
    x = ValueSpec(shape=[ROWS, 4], dtype="float32", shards=x_shards)
    ids = ValueSpec(shape=[ROWS], dtype="int32", shards=x_shards)
    routed = ValueSpec(shape=[ROWS, 4], dtype="float32", shards=1, ragged=True)
    routed_in = list(range(2, 2 + experts))
    routed_out = list(range(2 + experts, 2 + 2 * experts))
    y = 2 + 2 * experts
    return ProgramSpec(
        values=[x, ids] + [routed] * (2 * experts) + [ValueSpec(shape=[ROWS, 4], dtype="float32", shards=y_shards)],
        nodes=[NodeSpec(fn_id="", slice_id=1, inputs=[0, 1], outputs=routed_in, kind="route",
                        targets=[2 + k for k in range(experts)])]
        + [NodeSpec(fn_id=f"e{k}", slice_id=2 + k, inputs=[routed_in[k]], outputs=[routed_out[k]])
           for k in range(experts)]
        + [NodeSpec(fn_id="", slice_id=9, inputs=routed_out, outputs=[y], kind="combine")],
        inputs=[0, 1],
        outputs=[y],
    )


def moe_slices(experts: int = 2, route_devices: int = 1, combine: list[tuple[str, int]] | None = None, *,
               route: list[tuple[str, int]] | None = None, expert_at: list[tuple[str, int]] | None = None
               ) -> list[SliceInfo]:
    """Route on ``route`` (default: a's first devices), expert k on ``expert_at[k]`` (default: e<k>'s device 0)."""
    return ([make_slice(1, route or [("a", d) for d in range(route_devices)])]
            + [make_slice(2 + k, [expert_at[k] if expert_at else (f"e{k}", 0)]) for k in range(experts)]
            + [make_slice(9, combine or [("a", 0), ("a", 1)])])


def test_route_and_combine_lowering() -> None:
    spec = moe()
    lowered = run(spec, moe_slices(), host_inputs={0, 1})
    (r,) = [c for c in computations(lowered) if c.node == 0]
    assert (r.kind, r.fn_id, r.inputs, r.outputs) == ("route", "", [prefix(0), prefix(1)], [])
    assert r.emits == [Emit(mode="route", rows=ROWS, src_shards=1, slot=0, selector=1, targets=[
        Target(prefix=prefix(2 + k), shards=1, sites=[site(f"e{k}", (0, 0, 1))], shape=[ROWS, 4], dtype="float32")
        for k in range(2)])]
    landing = Target(prefix=prefix("d0"), shards=2, sites=[site("a", (0, 0, 2))], shape=[ROWS // 2, 4],
                     dtype="float32")
    for k in range(2):
        e = comp(lowered, 1 + k, f"e{k}")
        assert (e.kind, e.fn_id, e.ragged, e.inputs, e.outputs) == ("call", f"e{k}", True, [prefix(2 + k)],
                                                                    [prefix(4 + k)])
        assert e.emits == [Emit(mode="scatter", rows=ROWS, src_shards=2, targets=[landing], slot=1, source=k)]
    c = comp(lowered, 3, "a")
    assert (c.kind, c.fn_id, c.inputs, c.outputs, c.emits) == ("identity", "", [prefix("d0")], [prefix(6)], [])
    assert c.runs == [sr(0, 0, 2)]
    assert lowered.derived == ["d0"]
    assert lowered.holders["d0"] == {control("a")}
    assert lowered.holders["v2"] == {control("e0")} and lowered.holders["v3"] == {control("e1")}
    assert lowered.produced[2] == [loc("e0", 0)] and lowered.produced[6] == [loc("a", 0), loc("a", 1)]
    assert lowered.node_executors == {0: {"a"}, 1: {"e0"}, 2: {"e1"}, 3: {"a"}}
    assert lowered.function_sites == {"e0": {(control("e0"), (0,))}, "e1": {(control("e1"), (0,))}}
    assert [p.value for p in lowered.puts] == [0, 1], "route inputs are put on the route's slice"


@pytest.mark.parametrize("experts, x_shards, y_shards, slices", [
    pytest.param(2, 1, 2, moe_slices(2), id="one-way"),
    pytest.param(3, 2, 4, moe_slices(3, 2, [("b", 0), ("a", 1), ("b", 1), ("c", 0)]), id="combine-on-three"),
    pytest.param(1, 4, 1, moe_slices(1, 4, [("e0", 0)]), id="one-expert"),
    pytest.param(2, 2, 8, moe_slices(2, 2, [("b", d) for d in range(8)]), id="combine-on-eight"),
    pytest.param(3, 2, 2, moe_slices(3, 2, route=[("a", 0), ("b", 0)], expert_at=[("b", 1), ("a", 1), ("a", 2)]),
                 id="route-on-two-executors"),
    pytest.param(2, 1, 2, moe_slices(2, expert_at=[("a", 0), ("a", 0)]), id="all-on-one-device"),
])
def test_route_experts_combine_end_to_end(experts: int, x_shards: int, y_shards: int,
                                          slices: list[SliceInfo]) -> None:
    spec = moe(experts, x_shards, y_shards)
    lowered = run(spec, slices, host_inputs={0, 1})
    route_comps = [c for c in computations(lowered) if c.node == 0]
    assert sum(len(c.shards()) for c in route_comps) == x_shards
    assert all(c.emits == route_comps[0].emits and c.emits[0].src_shards == x_shards for c in route_comps)
    rng = np.random.default_rng(experts)
    x = rng.standard_normal((ROWS, 4)).astype(np.float32)
    ids = rng.permutation(np.arange(ROWS) % experts).astype(np.int32)  # every expert gets rows
    (y,) = simulate(spec, lowered, {0: x, 1: ids}).values()
    want = np.empty_like(x)
    for k in range(experts):
        want[ids == k] = FUNCTIONS[f"e{k}"](x[ids == k])
    np.testing.assert_array_equal(y, want)


def test_route_reads_inputs_resharded_to_its_slice() -> None:
    spec = moe(x_shards=4)
    lowered = run(spec, moe_slices(route_devices=2), host_inputs={0, 1})
    (r,) = [c for c in computations(lowered) if c.node == 0]
    assert r.inputs == [prefix("d0"), prefix("d1")] and r.emits[0].src_shards == 2
    assert lowered.derived == ["d0", "d1", "d2"]  # x and ids at 2 ways, then the combine's landing


def moe_with(change: Callable[[ProgramSpec], None], experts: int = 2) -> ProgramSpec:
    spec = moe(experts)
    change(spec)
    return spec


def _set_value(v: int, **fields: Any) -> Callable[[ProgramSpec], None]:
    def change(spec: ProgramSpec) -> None:
        old = spec.values[v]
        spec.values[v] = ValueSpec(**{"shape": old.shape, "dtype": old.dtype, "shards": old.shards,
                                      "ragged": old.ragged} | fields)
    return change


def _set_node(i: int, **fields: Any) -> Callable[[ProgramSpec], None]:
    def change(spec: ProgramSpec) -> None:
        for name, new in fields.items():
            setattr(spec.nodes[i], name, new)
    return change


def _two_outputs(spec: ProgramSpec) -> None:
    spec.values.append(spec.values[6])
    spec.nodes[3].outputs = [6, 7]


@pytest.mark.parametrize("change, match", [
    pytest.param(_set_node(0, inputs=[0]), "route node 0 takes", id="route-one-input"),
    pytest.param(_set_node(0, targets=[2]), "route node 0 takes", id="route-targets-count"),
    pytest.param(_set_value(1, shape=[ROWS, 1]), "route node 0: expert ids must be integers of shape",
                 id="ids-shape"),
    pytest.param(_set_value(1, dtype="float32"), "route node 0: expert ids must be integers", id="ids-dtype"),
    pytest.param(_set_value(0, shape=[]), "route node 0: expert ids", id="route-scalar"),
    pytest.param(_set_value(2, ragged=False), "route node 0: output 2 must be routed rows", id="route-out-plain"),
    pytest.param(_set_value(2, shape=[ROWS, 5]), "route node 0: output 2 must be routed rows",
                 id="route-out-shape"),
    pytest.param(_set_value(3, dtype="int32"), "route node 0: output 3 must be routed rows", id="route-out-dtype"),
    pytest.param(_set_value(2, shards=2, shape=[ROWS, 4]), "output 2 must be routed rows .* on one device",
                 id="route-out-split"),
    pytest.param(_set_node(0, fn_id="f"), "route node 0 runs no function", id="route-with-fn"),
    pytest.param(_set_node(3, fn_id="f"), "combine node 3 runs no function", id="combine-with-fn"),
    pytest.param(_two_outputs, "combine node 3 takes", id="combine-two-outputs"),
    pytest.param(_set_node(3, inputs=[]), "combine node 3 takes", id="combine-no-inputs"),
    pytest.param(_set_value(6, shape=[ROWS, 5]), "combine node 3: every expert output must be", id="combine-shape"),
    pytest.param(_set_value(6, dtype="int32"), "combine node 3: every expert output must be", id="combine-dtype"),
    pytest.param(_set_value(6, ragged=True, shards=1), "program output 6 is routed rows", id="output-ragged"),
    pytest.param(_set_node(1, inputs=[2, 0]), "node 1 reads routed rows and 1 other values", id="expert-two-in"),
    pytest.param(_set_value(4, ragged=False), "node 1: an expert's outputs are routed rows exactly when",
                 id="expert-out-plain"),
    pytest.param(_set_value(4, shape=[ROWS + 1, 4]), "node 1: an expert must return one row for each row",
                 id="expert-out-rows"),
    pytest.param(_set_value(4, shards=2), "value 4 is routed rows split 2 ways", id="expert-out-split"),
    pytest.param(_set_node(0, kind="scatter"), "node 0 has unknown kind 'scatter'", id="unknown-kind"),
])
def test_malformed_route_and_combine(change: Callable[[ProgramSpec], None], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        validate(moe_with(change, experts=2))


def test_plain_input_to_combine() -> None:
    spec = moe()
    spec.nodes[3].inputs = [4, 1]  # the expert ids are not routed rows
    with pytest.raises(InvalidArgument, match="combine node 3 takes the experts' routed outputs"):
        validate(spec)


def test_call_turning_plain_rows_into_routed_rows() -> None:
    spec = moe()
    spec.values.append(ValueSpec(shape=[ROWS, 4], dtype="float32", shards=1, ragged=True))
    spec.nodes.insert(1, NodeSpec(fn_id="f", slice_id=2, inputs=[0], outputs=[7]))
    with pytest.raises(InvalidArgument, match="node 1: an expert's outputs are routed rows exactly when"):
        validate(spec)


@pytest.mark.parametrize("change, slices, match", [
    pytest.param(None, moe_slices()[:-1], "node 3 runs on slice 9", id="combine-slice-not-owned"),
    pytest.param(None, [s for s in moe_slices() if s.slice_id != 3],
                 "route node 0 sends expert 1 to slice 3, which this session does not own", id="expert-slice"),
    pytest.param(None, [make_slice(2, [("e0", 0), ("e0", 1)]) if s.slice_id == 2 else s for s in moe_slices()],
                 "expert 0 runs on a slice of 2 devices; an expert runs on one", id="expert-on-two-devices"),
    pytest.param(_set_node(2, slice_id=2), None, "node 2 reads routed value 3 on slice 2, but the route sends it",
                 id="expert-on-another-slice"),
])
def test_route_lowering_refusals(change: Callable[[ProgramSpec], None] | None, slices: list[SliceInfo] | None,
                                 match: str) -> None:
    spec = moe_with(change) if change else moe()
    with pytest.raises(InvalidArgument, match=match):
        run(spec, slices or moe_slices(), host_inputs={0, 1})


def test_combine_of_a_value_no_expert_computed() -> None:
    spec = moe()
    spec.nodes[3].inputs = [2, 5]  # expert 0's *input*: made by the route, not by an expert
    spec.nodes[3].outputs = [6]
    with pytest.raises(InvalidArgument, match="combine node 3 reads value 2, which no expert computed"):
        run(spec, moe_slices(), host_inputs={0, 1})


def test_combine_output_that_cannot_be_split_over_its_slice() -> None:
    spec = moe(y_shards=1)
    spec.values[6] = ValueSpec(shape=[ROWS, 4], dtype="float32", shards=1)
    with pytest.raises(InvalidArgument, match=r"combine node 3's output.*cannot be split into 3 equal shards"):
        run(spec, moe_slices(combine=[("a", 0), ("a", 1), ("a", 2)]), host_inputs={0, 1})


def test_combine_output_split_differs_from_its_slice() -> None:
    with pytest.raises(InvalidArgument, match="runs on 2 devices but its output 6 is split 1 ways"):
        run(moe(y_shards=1), moe_slices(), host_inputs={0, 1})


def test_combined_value_read_elsewhere_is_emitted_by_the_combine() -> None:
    """y (2-way, on a) read by g over 4 devices of b: the identity computations reshard it."""
    spec = moe()
    spec.values.append(ValueSpec(shape=[ROWS, 4], dtype="float32", shards=4))
    spec.nodes.append(NodeSpec(fn_id="g", slice_id=10, inputs=[6], outputs=[7]))
    spec.outputs = [7]
    lowered = run(spec, [*moe_slices(), make_slice(10, [("b", d) for d in range(4)])], host_inputs={0, 1})
    (emit,) = comp(lowered, 3, "a").emits
    assert (emit.mode, emit.slot, emit.src_shards, emit.targets[0].prefix) == ("block", 1, 2, prefix("d1"))
    x = np.arange(ROWS * 4, dtype=np.float32).reshape(ROWS, 4)
    ids = np.array([0, 1] * (ROWS // 2), np.int32)
    want = np.where((ids == 0)[:, None], FUNCTIONS["e0"](x), FUNCTIONS["e1"](x))
    np.testing.assert_array_equal(simulate(spec, lowered, {0: x, 1: ids})[7], FUNCTIONS["g"](want))


def test_experts_in_a_chain_before_the_combine() -> None:
    """route -> e0 -> e2 (same slice, routed rows in and out) -> combine: the second expert scatters."""
    spec = moe()
    spec.values.append(spec.values[4])
    spec.nodes.insert(2, NodeSpec(fn_id="e2", slice_id=2, inputs=[4], outputs=[7]))
    spec.nodes[4].inputs = [7, 5]
    lowered = run(spec, moe_slices(), host_inputs={0, 1})
    first, second = (c for c in computations(lowered) if c.executor_id == "e0")
    assert first.emits == [] and [(e.mode, e.source) for e in second.emits] == [("scatter", 0)]
    assert second.ragged and second.inputs == [prefix(4)]
    x = np.arange(ROWS * 4, dtype=np.float32).reshape(ROWS, 4)
    ids = np.array([1, 0] * (ROWS // 2), np.int32)
    want = np.where((ids == 0)[:, None], FUNCTIONS["e2"](FUNCTIONS["e0"](x)), FUNCTIONS["e1"](x))
    np.testing.assert_array_equal(simulate(spec, lowered, {0: x, 1: ids})[6], want)


def test_a_proxy_sizes_a_bfloat16_value_it_never_decoded() -> None:
    """A fresh process (a proxy that has not decoded a bfloat16 array, so NumPy does not know the name) sizes
    a bfloat16 output: fetching one computed on the cluster failed with "data type 'bfloat16' not understood"."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    code = "from pwmesh.ir.lower import nbytes; print(nbytes([4, 2], 'bfloat16'), nbytes([3], 'float8_e4m3fn'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["16", "3"]
