"""Program validation and lowering on hand-built programs and slices (pure: no sockets, no JAX)."""

from __future__ import annotations

import collections
import itertools

import pytest

from pwmesh.errors import InvalidArgument
from pwmesh.ir.lower import HostPut, Lowered, ShardLocation, lower, shard_key, slice_locations, validate
from pwmesh.wire.messages import (
    Computation,
    NodeSpec,
    PhysicalDevice,
    ProgramSpec,
    SendTask,
    SliceInfo,
    ValueSpec,
)

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
    return ShardLocation(executor, control(executor), data(executor), device, island)


def value(shards: int, rows: int | None = None) -> ValueSpec:
    return ValueSpec(shape=[rows if rows is not None else 2 * shards, 3], dtype="float32", shards=shards)


def chain(shards: int, first: int = 1, second: int = 2) -> ProgramSpec:
    """v0 -f-> v1 -g-> v2, f on slice ``first`` and g on slice ``second``."""
    return ProgramSpec(
        values=[value(shards) for _ in range(3)],
        nodes=[NodeSpec(fn_id="f", slice_id=first, inputs=[0], outputs=[1]),
               NodeSpec(fn_id="g", slice_id=second, inputs=[1], outputs=[2])],
        inputs=[0],
        outputs=[2],
    )


def run(program: ProgramSpec, slices: list[SliceInfo], *, host_inputs: set[int] | None = None,
        bound: dict[int, list[ShardLocation]] | None = None, spmd: dict[str, bool] | None = None) -> Lowered:
    fns = {n.fn_id for n in program.nodes}
    return lower(
        program,
        owner=OWNER,
        names=[f"v{i}" for i in range(len(program.values))],
        host_inputs={0} if host_inputs is None and bound is None else (host_inputs or set()),
        bound=bound or {},
        slices={sl.slice_id: sl for sl in slices},
        spmd={fn: False for fn in fns} | (spmd or {}),
    )


def computations(lowered: Lowered) -> list[Computation]:
    return [c for comps in lowered.schedules.values() for c in comps]


def comp(lowered: Lowered, node: int, executor: str) -> Computation:
    (found,) = [c for c in computations(lowered) if c.node == node and c.executor_id == executor]
    return found


def key(v: int, shard: int) -> str:
    return shard_key(OWNER, f"v{v}", shard)


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
        assert c.spmd is False
        assert c.seq == -1, "sequence numbers belong to the island scheduler"
        first = 0 if c.executor_id == "a" else 2
        assert [s.device for s in c.shards] == [0, 1]
        assert [s.inputs for s in c.shards] == [[key(c.node, i)] for i in (first, first + 1)]
        assert [s.outputs for s in c.shards] == [[key(c.node + 1, i)] for i in (first, first + 1)]
    assert lowered.node_executors == {0: {"a", "b"}, 1: {"a", "b"}}


def test_multi_input_multi_output_shard_keys() -> None:
    spec = ProgramSpec(values=[value(2) for _ in range(4)],
                       nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0, 1], outputs=[2, 3])],
                       inputs=[0, 1], outputs=[2, 3])
    lowered = run(spec, [make_slice(1, [("a", 0), ("a", 1)])], host_inputs={0, 1})
    (c,) = computations(lowered)
    assert [(s.inputs, s.outputs) for s in c.shards] == [
        ([key(0, i), key(1, i)], [key(2, i), key(3, i)]) for i in (0, 1)
    ]


def test_chain_stays_two_computations_per_executor_as_shards_grow() -> None:
    for shards in (2, 4, 8, 16, 32, 64):
        half = shards // 2
        devices = [("a", d) for d in range(half)] + [("b", d) for d in range(half)]
        swapped = devices[half:] + devices[:half]
        lowered = run(chain(shards), [make_slice(1, devices), make_slice(2, swapped)])
        per_executor = collections.Counter(c.executor_id for c in computations(lowered))
        assert per_executor == {"a": 2, "b": 2}, shards
        assert all(len(c.shards) == half for c in computations(lowered)), shards
        # Every shard of v1 crosses executors, yet rides inside the two producer computations.
        assert sum(len(c.sends) for c in computations(lowered)) == shards


def test_produced_locations() -> None:
    x, y = make_slice(1, [("a", 0), ("b", 1)]), make_slice(2, [("c", 0), ("c", 1)])
    lowered = run(chain(2), [x, y])
    assert lowered.produced == {1: slice_locations(x), 2: slice_locations(y)}


# --------------------------------------------------------------- sends


def test_sends_when_producer_and_consumer_shards_are_on_different_executors() -> None:
    lowered = run(chain(2), [make_slice(1, [("a", 0), ("a", 1)]), make_slice(2, [("b", 1), ("b", 0)])])
    assert comp(lowered, 0, "a").sends == [
        SendTask(key=key(1, 0), dest_executor="b", dest_data=data("b"), dest_device=1),
        SendTask(key=key(1, 1), dest_executor="b", dest_data=data("b"), dest_device=0),
    ]
    assert comp(lowered, 1, "b").sends == []
    assert lowered.moves == {}


def test_no_sends_on_the_same_executor_even_across_devices() -> None:
    lowered = run(chain(2), [make_slice(1, [("a", 0), ("a", 1)]), make_slice(2, [("a", 1), ("a", 0)])])
    assert all(c.sends == [] for c in computations(lowered))
    assert lowered.moves == {}


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


def test_sends_exactly_where_shards_cross_executors() -> None:
    shards = 3
    for producer_devices, consumer_devices in itertools.product(assignments(shards, "ab"), repeat=2):
        lowered = run(chain(shards), [make_slice(1, producer_devices), make_slice(2, consumer_devices)])
        expected = {
            (src, key(1, i), dst, dst_dev)
            for i, ((src, _), (dst, dst_dev)) in enumerate(zip(producer_devices, consumer_devices, strict=True))
            if src != dst
        }
        got = {(c.executor_id, s.key, s.dest_executor, s.dest_device)
               for c in computations(lowered) if c.node == 0 for s in c.sends}
        assert got == expected, (producer_devices, consumer_devices)
        assert all(s.dest_data == data(s.dest_executor) for c in computations(lowered) for s in c.sends)
        assert all(c.sends == [] for c in computations(lowered) if c.node == 1), "g's outputs are read by no one"


def test_one_send_per_shard_and_destination_executor() -> None:
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
    sends = comp(lowered, 0, "a").sends
    assert sorted((s.key, s.dest_executor) for s in sends) == [
        (key(1, 0), "b"), (key(1, 0), "c"), (key(1, 1), "b"), (key(1, 1), "c")]


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
        HostPut(value=0, shard=0, location=loc("a", 0), key=key(0, 0)),
        HostPut(value=0, shard=1, location=loc("b", 0), key=key(0, 1)),
        HostPut(value=0, shard=0, location=loc("b", 0), key=key(0, 0)),
        HostPut(value=0, shard=1, location=loc("a", 0), key=key(0, 1)),
    ]
    assert lowered.moves == {}
    assert all(s.key.startswith(f"{OWNER}/v1/") for c in computations(lowered) for s in c.sends)


def test_unread_host_input_is_not_put() -> None:
    spec = ProgramSpec(values=[value(1), value(1), value(1)],
                       nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[1], outputs=[2])],
                       inputs=[0, 1], outputs=[2])
    lowered = run(spec, [make_slice(1, [("a", 0)])], host_inputs={0, 1})
    assert [p.value for p in lowered.puts] == [1]


def test_bound_buffers_on_another_executor_become_moves() -> None:
    bound = {0: [loc("a", 0), loc("a", 1)]}
    lowered = run(chain(2, 1, 1), [make_slice(1, [("a", 1), ("b", 0)])], bound=bound)
    assert lowered.puts == []
    assert lowered.moves == {
        control("a"): [SendTask(key=key(0, 1), dest_executor="b", dest_data=data("b"), dest_device=0)],
    }
    assert lowered.holders["v0"] == {control("a"), control("b")}


def test_bound_buffers_already_in_place_need_no_move() -> None:
    lowered = run(chain(2, 1, 1), [make_slice(1, [("a", 1), ("a", 0)])], bound={0: [loc("a", 0), loc("a", 1)]})
    assert lowered.moves == {}
    assert lowered.puts == []


def test_bound_buffer_moves_are_sent_once_per_executor() -> None:
    spec = ProgramSpec(values=[value(1), value(1), value(1)],
                       nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1]),
                              NodeSpec(fn_id="f", slice_id=2, inputs=[0], outputs=[2])],
                       inputs=[0], outputs=[1, 2])
    lowered = run(spec, [make_slice(1, [("b", 0)]), make_slice(2, [("b", 1)])], bound={0: [loc("a", 0)]})
    assert [s.dest_executor for s in lowered.moves[control("a")]] == ["b"]


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
    assert [s.dest_executor for s in lowered.schedules[x.scheduler][0].sends] == ["b", "b"]


def test_one_island_gives_one_schedule_in_program_order() -> None:
    sl = make_slice(1, [("a", 0), ("b", 0)])
    lowered = run(chain(2, 1, 1), [sl])
    assert list(lowered.schedules) == [sl.scheduler]
    assert [c.node for c in lowered.schedules[sl.scheduler]] == [0, 0, 1, 1]


# --------------------------------------------------------------- refusals


def test_spmd_node_over_a_slice_spanning_two_executors() -> None:
    with pytest.raises(InvalidArgument, match="several executors"):
        run(chain(2, 1, 1), [make_slice(1, [("a", 0), ("b", 0)])], spmd={"f": True})


def test_spmd_node_on_one_executor_is_fine() -> None:
    lowered = run(chain(2, 1, 1), [make_slice(1, [("a", 0), ("a", 1)])], spmd={"f": True, "g": True})
    assert [len(c.shards) for c in computations(lowered)] == [2, 2]


@pytest.mark.parametrize("devices", [1, 4])
def test_shard_count_that_differs_from_the_slice(devices: int) -> None:
    with pytest.raises(InvalidArgument, match="2 shards"):
        run(chain(2, 1, 1), [make_slice(1, [("a", d) for d in range(devices)])])
