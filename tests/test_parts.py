"""A run's per-executor parts: packed by the proxy, forwarded unread by the scheduler, checked by the executor."""

from __future__ import annotations

import msgpack
import pytest

from pwmesh.errors import InvalidArgument, ProtocolError
from pwmesh.wire import decode, encode
from pwmesh.wire.codec import pack_records
from pwmesh.wire.messages import Computation, DeviceRange, Enqueue, RunPart, ShardRun
from pwmesh.wire.parts import PartTemplates, device_ranges, enqueued, referenced_parts, renamed, run_parts


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


# --------------------------------------------------------------- parts with references


def through_the_wire(part: RunPart, seqs: list[int] | None = None) -> Enqueue:
    enq = Enqueue(run_id="r", proxy="p", nodes=part.nodes, computations=part.computations, seqs=seqs or [],
                  names=part.names)
    msg = decode(encode(enq, msg_id=1)).message
    assert isinstance(msg, Enqueue)
    return msg


def test_referenced_parts_name_each_buffer_once_in_first_use_order() -> None:
    comps = [comp(0, "a", (0, 1)), comp(1, "a", (0, 1))]
    comps[1].inputs, comps[1].outputs = ["o"], ["o2"]
    ((part, names),) = referenced_parts(comps)
    assert names == ["i", "o", "o2"]
    part.names = ["x", "y", "z"]
    refs = [(c.inputs, c.outputs) for c in enqueued(through_the_wire(part), PartTemplates())]
    assert refs == [(["x"], ["y"]), (["y"], ["z"])]


def test_templates_unpack_a_part_once_and_fill_in_each_runs_names() -> None:
    ((part, _),) = referenced_parts([comp(0, "a", (0, 2)), comp(1, "a", (0, 2))])
    templates = PartTemplates()
    runs = []
    for run in range(3):
        part.names = [f"s/r{run}-in", f"s/r{run}-out"]
        runs.append(enqueued(through_the_wire(part, seqs=[10 * run, 10 * run + 1]), templates))
    assert len(templates) == 1
    for run, got in enumerate(runs):  # fresh records each run: setting one run's seq touches no other
        assert [(c.node, c.seq, c.inputs, c.outputs) for c in got] == [
            (0, 10 * run, [f"s/r{run}-in"], [f"s/r{run}-out"]), (1, 10 * run + 1, [f"s/r{run}-in"], [f"s/r{run}-out"])]


def test_templates_keep_the_newest_parts() -> None:
    templates = PartTemplates(capacity=2)
    parts = [referenced_parts([comp(node, "a", (0, 1))])[0][0] for node in range(3)]
    for part in [*parts, parts[2], parts[0]]:
        part.names = ["x", "y"]
        enqueued(through_the_wire(part), templates)
    assert len(templates) == 2


@pytest.mark.parametrize(("ref", "names", "match"), [
    ("@1", ["only-one"], r"refers to buffer '@1'; it names 1"),
    ("@-1", ["only-one"], r"refers to buffer '@-1'; it names 1"),
    ("@x", ["only-one"], r"refers to buffer '@x'; it names 1"),
    ("@0", [], "refers to buffers by number but the Enqueue names none"),
])
def test_a_reference_without_its_name_is_refused(ref: str, names: list[str], match: str) -> None:
    """Refused (its nodes fail with the reason) rather than waiting forever for a buffer named '@1'."""
    (part,) = run_parts([renamed(comp(0, "a", (0, 1)), lambda _: ref)])  # every buffer it names is ``ref``
    part.names = names
    with pytest.raises(ProtocolError, match=match):
        enqueued(through_the_wire(part), PartTemplates())


@pytest.mark.parametrize(("refs", "names", "match"), [
    ([0, 1], ["x", "y"], None),
    ([0, 5], ["x", "y"], r"refers to buffer '@1'; it names 2"),
    ([0], ["x", "y"], r"refers to buffer '@1'; it names 2"),
])
def test_an_installed_templates_runs_fill_in_their_names_or_are_refused(refs: list[int], names: list[str],
                                                                     match: str | None) -> None:
    """A template's part (installed once) resolves its "@<k>" to indices once; each run only indexes its names,
    and a reference past them is refused as the uninstalled path refuses it."""
    c = comp(0, "a", (0, 1))
    c.inputs, c.outputs = ["@0", "kept"], ["@1"]
    (part,) = run_parts([c])
    templates = PartTemplates()
    first = Enqueue(run_id="r", proxy="p", nodes=[0], computations=part.computations, names=names, template="t",
                    refs=refs)
    if match is not None:
        with pytest.raises(ProtocolError, match=match):
            enqueued(first, templates)
        return
    (done,) = enqueued(first, templates)
    assert (done.inputs, done.outputs) == (["x", "kept"], ["y"])
    again = Enqueue(run_id="r2", proxy="p", nodes=[0], computations=b"", names=["u", "v"], template="t")
    (done,) = enqueued(again, templates)
    assert (done.inputs, done.outputs) == (["u", "kept"], ["v"])


@pytest.mark.parametrize("device, count", [(0, 2**62), (0, 0), (0, -1), (-1, 1), (1 << 16, 1)])
def test_a_shard_run_no_executor_could_hold_is_refused_before_it_is_expanded(device: int, count: int) -> None:
    """Found by fuzzing: an executor expanded a ShardRun of count 2^62 into a list until memory ran out."""
    (part,) = run_parts([comp(0, "a", (0, 1))])
    part.computations = pack_records([comp(0, "a", (device, count))])  # as a peer could send it
    with pytest.raises(InvalidArgument, match=r"shard run .* is out of range"):
        enqueued(through_the_wire(part))
    # A cached lowering's part (its buffers by number) is checked as it is unpacked, once.
    part.computations, part.names = pack_records([renamed(comp(0, "a", (device, count)), lambda _: "@0")]), ["b"]
    templates = PartTemplates()
    with pytest.raises(InvalidArgument, match=r"shard run .* is out of range"):
        enqueued(through_the_wire(part), templates)
    assert len(templates) == 0, "a refused part is not kept"
    (fine,) = run_parts([comp(0, "a", (0, 1 << 16))])
    assert len(enqueued(through_the_wire(fine))[0].shards()) == 1 << 16
