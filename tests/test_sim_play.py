"""The player's own checks (``pwmesh.sim.play``): a lowering that drops, doubles or starves a
transfer fails naming the shard, instead of playing on with wrong values.

test_lowering.py plays correct lowerings; here each one is broken by hand first.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pwmesh.dataflow.progress import ProgressError
from pwmesh.ir.lower import Lowered, lower
from pwmesh.sim.play import PlayError, play
from pwmesh.wire.messages import Computation, NodeSpec, PhysicalDevice, ProgramSpec, SliceInfo, ValueSpec

OWNER = "sess1"
FUNCTIONS = {"f": lambda x: x * 2 + 1, "g": lambda x: x - 3}
NAMES = ["v0", "v1", "v2"]


def make_slice(slice_id: int, devices: list[tuple[str, int]]) -> SliceInfo:
    return SliceInfo(
        slice_id=slice_id, owner=OWNER, island=0, map_version=1, scheduler="tcp://sched0",
        devices=[PhysicalDevice(executor_id=ex, island=0, host=ex, device=d, control=f"tcp://{ex}:1",
                                data=f"tcp://{ex}:2") for ex, d in devices],
    )


def chain(first: list[tuple[str, int]], second: list[tuple[str, int]]) -> tuple[ProgramSpec, Lowered]:
    """v0 -f-> v1 (on ``first``) -g-> v2 (on ``second``), lowered: v1 crosses executors."""
    spec = ProgramSpec(
        values=[ValueSpec(shape=[4, 3], dtype="float32", shards=len(first)),
                ValueSpec(shape=[4, 3], dtype="float32", shards=len(first)),
                ValueSpec(shape=[4, 3], dtype="float32", shards=len(second))],
        nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1]),
               NodeSpec(fn_id="g", slice_id=2, inputs=[1], outputs=[2])],
        inputs=[0], outputs=[2])
    lowered = lower(spec, owner=OWNER, names=NAMES, host_inputs={0}, bound={},
                    slices={1: make_slice(1, first), 2: make_slice(2, second)}, spmd={"f": False, "g": False})
    return spec, lowered


def run(spec: ProgramSpec, lowered: Lowered) -> dict[int, np.ndarray]:
    return play(spec, lowered, FUNCTIONS, owner=OWNER, names=NAMES,
                host={0: np.arange(12, dtype=np.float32).reshape(4, 3)})


def producer(lowered: Lowered, executor: str) -> Computation:
    """Node 0's computation on ``executor``: the one whose emits send v1 on."""
    (found,) = [c for comps in lowered.schedules.values() for c in comps if c.node == 0 and c.executor_id == executor]
    return found


def test_an_intact_lowering_plays() -> None:
    spec, lowered = chain([("a", 0)], [("b", 0)])
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.testing.assert_array_equal(run(spec, lowered)[2], x * 2 + 1 - 3)


def test_a_transfer_sent_twice_is_progress_after_the_destination_completed() -> None:
    spec, lowered = chain([("a", 0)], [("b", 0)])
    comp = producer(lowered, "a")
    comp.emits.append(comp.emits[0])
    with pytest.raises(ProgressError, match=f"{OWNER}/v1/0: progress from producer 0 after the destination completed"):
        run(spec, lowered)


def test_a_shard_both_put_and_sent_arrives_twice() -> None:
    spec, lowered = chain([("a", 0)], [("b", 0)])
    (put,) = lowered.puts
    b = dataclasses.replace(put.location, executor_id="b", control="tcp://b:1", data="tcp://b:2", host="b")
    lowered.puts.append(dataclasses.replace(put, location=b, key=f"{OWNER}/v1/0"))
    with pytest.raises(PlayError, match=f"{OWNER}/v1/0 arrived twice on b"):
        run(spec, lowered)


def test_a_dropped_transfer_is_a_read_of_a_shard_that_never_arrived() -> None:
    spec, lowered = chain([("a", 0)], [("b", 0)])
    producer(lowered, "a").emits.clear()
    with pytest.raises(PlayError, match="node 1 reads .* on b, which never arrived there"):
        run(spec, lowered)


def test_a_destination_missing_one_producer_is_left_waiting() -> None:
    # Two producers (a and c) each send half of b's one shard; c's half never leaves, and
    # nobody reads the shard, so only the end-of-play check can see it.
    spec, lowered = chain([("a", 0), ("c", 0)], [("b", 0)])
    producer(lowered, "c").emits.clear()
    for comps in lowered.schedules.values():
        comps[:] = [c for c in comps if c.node != 1]
    with pytest.raises(PlayError, match=r"left waiting.*'b': \{'sess1/.*/0': \(1, 2\)\}"):
        run(spec, lowered)


def test_a_function_missing_from_the_table_is_named() -> None:
    spec, lowered = chain([("a", 0)], [("b", 0)])
    with pytest.raises(PlayError, match="node 1 calls 'g'"):
        play(spec, lowered, {"f": FUNCTIONS["f"]}, owner=OWNER, names=NAMES,
             host={0: np.zeros((4, 3), np.float32)})


def test_a_host_input_without_a_value_is_named() -> None:
    spec, lowered = chain([("a", 0)], [("b", 0)])
    with pytest.raises(PlayError, match="host input 0"):
        play(spec, lowered, FUNCTIONS, owner=OWNER, names=NAMES)
