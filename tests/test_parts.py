"""A run's per-executor parts: packed by the proxy, forwarded unread by the scheduler, checked by the executor."""

from __future__ import annotations

import msgpack
import pytest

from pwmesh.errors import ProtocolError
from pwmesh.wire import decode, encode
from pwmesh.wire.messages import Computation, DeviceRange, Enqueue, ShardRun
from pwmesh.wire.parts import device_ranges, enqueued, run_parts


def comp(node: int, executor: str, *runs: tuple[int, int]) -> Computation:
    return Computation(node=node, fn_id="f", executor_id=executor, control=f"tcp://{executor}:1",
                       runs=[ShardRun(device=d, shard=d, count=n) for d, n in runs], inputs=["i"], outputs=["o"])


def test_parts_group_by_executor_in_order_and_round_trip() -> None:
    comps = [comp(0, "a", (0, 2)), comp(1, "b", (0, 1)), comp(2, "a", (4, 1))]
    a, b = run_parts(comps)
    assert (a.executor_id, a.control, a.nodes) == ("a", "tcp://a:1", [0, 2])
    assert a.devices == [DeviceRange(first=0, count=2), DeviceRange(first=4)]
    enq = Enqueue(run_id="r", proxy="p", nodes=a.nodes, computations=a.computations, seqs=[7, 9])
    got = enqueued(decode(encode(enq, msg_id=1)).message)  # type: ignore[arg-type]
    assert [(c.node, c.seq, c.runs) for c in got] == [(0, 7, comps[0].runs), (2, 9, comps[2].runs)]


def test_device_ranges_are_flat_in_the_number_of_devices() -> None:
    assert device_ranges([comp(0, "a", (0, 64)), comp(1, "a", (0, 64))]) == [DeviceRange(first=0, count=64)]
    assert device_ranges([comp(0, "a", (0, 2)), comp(1, "a", (2, 2)), comp(2, "a", (6, 1))]) == [
        DeviceRange(first=0, count=4), DeviceRange(first=6)]


@pytest.mark.parametrize(("payload", "nodes", "match"), [
    (b"\xc1garbage", [0], "unreadable Enqueue.computations"),
    (msgpack.packb({"not": "a list"}), [0], "expected a list"),
    (msgpack.packb([{"node": 0}]), [0], r"Enqueue.computations\[0\]"),
    (run_parts([comp(0, "a", (0, 1))])[0].computations, [5], "names \\[5\\]"),
])
def test_a_bad_part_is_a_protocol_error_naming_what_is_wrong(payload: bytes, nodes: list[int], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        enqueued(Enqueue(run_id="r", proxy="p", nodes=nodes, computations=payload))
