"""A run's computations per executor, packed once by the proxy and unpacked by that executor.

The island scheduler orders runs by the devices they use; it never needs the
computations themselves, so it forwards each executor's part as the bytes the
proxy packed (decoding and re-encoding a 128-node program cost it ~7 ms).
"""

from __future__ import annotations

from collections.abc import Iterable

from pwmesh.errors import ProtocolError
from pwmesh.wire.codec import pack_records, unpack_records
from pwmesh.wire.messages import Computation, DeviceRange, Enqueue, RunPart


def run_parts(comps: Iterable[Computation]) -> list[RunPart]:
    """One part per executor, its computations in the order given."""
    by_executor: dict[str, list[Computation]] = {}
    for comp in comps:
        by_executor.setdefault(comp.executor_id, []).append(comp)
    return [RunPart(executor_id=executor_id, control=mine[0].control, devices=device_ranges(mine),
                    nodes=[c.node for c in mine], computations=pack_records(mine))
            for executor_id, mine in by_executor.items()]


def device_ranges(comps: Iterable[Computation]) -> list[DeviceRange]:
    """The devices ``comps`` use, as few ranges as cover them (a 64-device node: one)."""
    ranges: list[DeviceRange] = []
    for device in sorted({device for c in comps for device, _ in c.shards()}):
        if ranges and ranges[-1].first + ranges[-1].count == device:
            ranges[-1].count += 1
        else:
            ranges.append(DeviceRange(first=device))
    return ranges


def enqueued(msg: Enqueue) -> list[Computation]:
    """An Enqueue's computations, checked against the nodes it names, with their places in the island order."""
    comps: list[Computation] = unpack_records(msg.computations, Computation, "Enqueue.computations")
    if [c.node for c in comps] != msg.nodes or (msg.seqs and len(msg.seqs) != len(comps)):
        raise ProtocolError(f"Enqueue of run {msg.run_id}: its computations are nodes {[c.node for c in comps]}, "
                            f"it names {msg.nodes} with {len(msg.seqs)} places")
    for comp, seq in zip(comps, msg.seqs, strict=False):
        comp.seq = seq
    return comps
