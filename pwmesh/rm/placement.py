"""Where a virtual slice goes: a pure function of the cluster and its load.

Policy: pick the island whose least-loaded ``n`` devices carry the least load
(ties: the island with the lower average load, then the lower number), then take
those ``n`` devices, preferring fewer hosts among equally loaded ones so that a
gang computation stays on one host's interconnect when it can.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pwmesh.errors import InvalidArgument, ResourceExhausted
from pwmesh.wire.messages import DeviceInfo, ExecutorInfo

DeviceRef = tuple[str, int]  # (executor_id, device index)


def of_kind(device: DeviceInfo, kind: str) -> bool:
    """Whether ``device`` is of ``kind``: its platform (cpu, cuda, rocm, tpu; gpu for either GPU), or
    part of its device kind, in any case ("H100" is an "NVIDIA H100 80GB HBM3")."""
    wanted = kind.lower()
    return (wanted == device.platform or (wanted == "gpu" and device.platform in ("cuda", "rocm"))
            or wanted in device.kind.lower())


def place(
    executors: Iterable[ExecutorInfo],
    load: Mapping[DeviceRef, int],
    devices: int,
    island: int | None = None,
) -> tuple[int, list[DeviceRef]]:
    """``(island, [(executor_id, device), ...])`` for a slice of ``devices`` devices."""
    if devices < 1:
        raise InvalidArgument(f"a slice needs at least one device, got {devices}")
    by_island: dict[int, list[tuple[int, int, int, DeviceRef]]] = {}
    for order, ex in enumerate(sorted((e for e in executors if e.alive), key=lambda e: e.executor_id)):
        loads = [load.get((ex.executor_id, dev.index), 0) for dev in ex.devices]
        for dev, dev_load in zip(ex.devices, loads, strict=True):
            # Among equally loaded devices, those on a host with more such devices come
            # first, so a slice lands on as few hosts as it can.
            same = loads.count(dev_load)
            by_island.setdefault(ex.island, []).append((dev_load, -same, order, (ex.executor_id, dev.index)))
    if island is not None and island not in by_island:
        known = sorted(by_island) or "none"
        raise ResourceExhausted(f"island {island} has no live devices (islands with devices: {known})")
    candidates = [island] if island is not None else sorted(by_island)
    best: tuple[tuple[int, float, int], list[DeviceRef]] | None = None
    for isl in candidates:
        devs = sorted(by_island[isl])
        if len(devs) < devices:
            continue
        chosen = devs[:devices]
        score = (sum(d[0] for d in chosen), sum(d[0] for d in devs) / len(devs), isl)
        if best is None or score < best[0]:
            best = (score, [d[3] for d in chosen])
    if best is None:
        largest = max((len(v) for k, v in by_island.items() if island is None or k == island), default=0)
        where = f"island {island}" if island is not None else "any island"
        raise ResourceExhausted(
            f"asked for a slice of {devices} devices, but {where} has at most {largest} live devices"
        )
    return best[0][2], best[1]
