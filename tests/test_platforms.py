"""Accelerators: executors say what their devices are, slices ask for a kind, functions are
exported for the platform of the slice they run on.

CI has no GPU: the GPU and TPU executors here are registrations (``ExecutorInfo`` records with
``platform="cuda"``), the resource manager's state machine and the client's export are real.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax import export
from rm_driver import DrivenRM

from pwmesh.client.devices import Slice
from pwmesh.client.export import export_jit, export_pmap
from pwmesh.client.sharding import P
from pwmesh.errors import ResourceExhausted
from pwmesh.rm.placement import of_kind
from pwmesh.wire.messages import (
    AllocateSlice,
    DeviceInfo,
    ExecutorInfo,
    Ok,
    PhysicalDevice,
    RegisterExecutor,
    RegisterScheduler,
    SchedulerInfo,
    SliceAllocated,
    SliceInfo,
    UnregisterExecutor,
)

H100 = "NVIDIA H100 80GB HBM3"


def executor(name: str, platform: str, kind: str, devices: int = 2) -> ExecutorInfo:
    return ExecutorInfo(executor_id=name, island=0, host=name, control=f"tcp://{name}:1", data=f"tcp://{name}:2",
                        devices=[DeviceInfo(index=i, kind=kind, platform=platform) for i in range(devices)])


@pytest.fixture
def mixed() -> DrivenRM:
    """One island: two CPU hosts and two H100 hosts."""
    state = DrivenRM(heartbeat_timeout_seconds=10.0)
    assert state.ask(RegisterScheduler(info=SchedulerInfo(island=0, address="tcp://sched0")), now=0.0) == Ok()
    for ex in (executor("c0", "cpu", "cpu"), executor("c1", "cpu", "cpu"),
               executor("g0", "cuda", H100), executor("g1", "cuda", H100)):
        assert state.ask(RegisterExecutor(info=ex), now=0.0) == Ok()
    return state


def allocate(state: DrivenRM, devices: int, kind: str = "") -> SliceInfo:
    reply = state.ask(AllocateSlice(owner="alice", devices=devices, kind=kind), now=0.0)
    assert isinstance(reply, SliceAllocated)
    return reply.slice


@pytest.mark.parametrize(("kind", "platform", "device_kind", "matches"), [
    ("gpu", "cuda", H100, True), ("cuda", "cuda", H100, True), ("h100", "cuda", H100, True),
    ("rocm", "cuda", H100, False), ("tpu", "cuda", H100, False), ("cpu", "cpu", "cpu", True),
    ("gpu", "rocm", "AMD Instinct MI300X", True), ("MI300", "rocm", "AMD Instinct MI300X", True),
])
def test_a_kind_is_a_platform_or_part_of_the_device_kind(kind: str, platform: str, device_kind: str,
                                                          matches: bool) -> None:
    assert of_kind(DeviceInfo(index=0, kind=device_kind, platform=platform), kind) is matches


@pytest.mark.parametrize("kind", ["gpu", "H100", "cuda"])
def test_a_slice_of_a_kind_lands_on_devices_of_that_kind_only(mixed: DrivenRM, kind: str) -> None:
    sl = allocate(mixed, 4, kind)
    assert {d.executor_id for d in sl.devices} == {"g0", "g1"}
    assert {d.platform for d in sl.devices} == {"cuda"} and sl.kind == kind


def test_a_slice_of_a_kind_nobody_has_is_refused_with_what_there_is(mixed: DrivenRM) -> None:
    with pytest.raises(ResourceExhausted, match=r"no live device is of kind 'tpu' \(live devices: cpu \(cpu\), "
                                                r"cuda \(NVIDIA H100 80GB HBM3\)\)"):
        allocate(mixed, 1, "tpu")
    with pytest.raises(ResourceExhausted, match="at most 4 live devices"):
        allocate(mixed, 5, "gpu")


def test_a_slice_stays_on_its_platform_when_its_devices_move(mixed: DrivenRM) -> None:
    sl = allocate(mixed, 2)  # any kind: it lands on one host, and keeps that host's platform
    (platform,) = {d.platform for d in sl.devices}
    assert sl.kind == platform
    lost = sl.devices[0].executor_id
    mixed.ask(UnregisterExecutor(executor_id=lost, reason="gone"), now=1.0)
    moved = mixed.slices[sl.slice_id]
    assert not moved.broken and lost not in {d.executor_id for d in moved.devices}
    assert {d.platform for d in moved.devices} == {platform}, "a remap never crosses platforms"


def fake_slice(platform: str, devices: int, mesh: dict[str, int] | None = None) -> Slice:
    """A slice as the client sees one after the proxy created it (no session: export needs none)."""
    info = SliceInfo(slice_id=1, owner="alice", island=0, map_version=1, scheduler="tcp://sched0", devices=[
        PhysicalDevice(executor_id="g0", island=0, host="g0", device=i, control="tcp://g0:1", data="tcp://g0:2",
                       platform=platform) for i in range(devices)])
    return Slice(None, info, mesh or {"x": devices})  # type: ignore[arg-type]


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
def test_functions_are_exported_for_the_platform_of_their_slice(platform: str) -> None:
    avals = [jax.ShapeDtypeStruct((4, 3), np.float32)]
    spmd = export_jit(lambda x: x * 2.0, fake_slice(platform, 2), avals, [P("x")], P("x"), [], "double")
    mapped = export_pmap(lambda x: x + 1.0, fake_slice(platform, 4), avals, None, "inc")
    for fn in (spmd, mapped):
        assert export.deserialize(bytearray(fn.serialized)).platforms == (platform,)
    assert spmd.fn_id != export_jit(lambda x: x * 2.0, fake_slice("cpu" if platform != "cpu" else "cuda", 2),
                                    avals, [P("x")], P("x"), [], "double").fn_id, "one id per platform"


def test_an_executor_asked_for_a_platform_it_lacks_says_so_and_exits() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run([sys.executable, "-m", "pwmesh.cli.daemons", "executor", "--island", "0",
                           "--rm", "tcp://127.0.0.1:1", "--platform", "tpu"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "asked for tpu devices" in proc.stderr, proc.stderr[-2000:]
