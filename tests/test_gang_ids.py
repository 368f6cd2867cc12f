"""Gangs named once (issue #30, item 3): an SPMD computation spanning executors carries its gang's id;
the devices come once per slice version in a ``RegisterGang``. The executor's side: its registry
(``executor.gangs``) and its runner, which waits for a gang that has not come yet, and fails, never
hangs, when it does not come. (The proxy's side: tests/test_proxy_state.py; the lowering's:
tests/test_lowering.py; real gangs across executors: tests/test_gang.py, tests/test_collectives.py.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import jax
import numpy as np
import pytest
from test_fast_path import psum_function

from pwmesh.errors import InvalidArgument, NotFound
from pwmesh.executor.functions import FunctionCache
from pwmesh.executor.gangs import Gang, Gangs
from pwmesh.executor.runner import Runner
from pwmesh.executor.store import ObjectStore
from pwmesh.executor.work import Work
from pwmesh.ir.keys import gang_id
from pwmesh.wire.messages import Computation, GangRange, RegisterGang, ShardRun

pytestmark = pytest.mark.timeout(60)


def gang(*ranges: tuple[str, int, int]) -> RegisterGang:
    devices = [GangRange(executor_id=ex, first=first, count=count) for ex, first, count in ranges]
    return RegisterGang(gang_id=gang_id(devices), devices=devices)


def test_a_gang_is_its_devices_in_mesh_order_checked_against_its_id() -> None:
    found = Gang.of(gang(("a", 0, 2), ("b", 0, 2), ("a", 2, 1)))
    assert found.mesh == (("a", 0), ("a", 1), ("b", 0), ("b", 1), ("a", 2))
    assert found.label == "5 devices of a, b"
    forged = gang(("a", 0, 2))
    forged.devices.append(GangRange(executor_id="b", first=0))
    with pytest.raises(InvalidArgument, match="its id is not the hash of its devices"):
        Gang.of(forged)
    with pytest.raises(InvalidArgument, match="out of range"):
        Gang.of(gang(("a", 0, 1 << 40)))
    with pytest.raises(InvalidArgument, match="no devices"):
        Gang.of(RegisterGang(gang_id=gang_id([]), devices=[]))


@pytest.mark.asyncio
async def test_a_computation_waits_for_its_gang_and_fails_if_it_never_comes() -> None:
    gangs = Gangs(wait_seconds=0.2, capacity=2)
    msg = gang(("a", 0, 1), ("b", 0, 1))
    early = gangs.get(msg.gang_id)  # asked for before it came: it comes, and wakes the waiter
    assert not early.done()
    gangs.register(msg)
    assert (await asyncio.wait_for(early, 5)).mesh == (("a", 0), ("b", 0))
    assert gangs.get(msg.gang_id).result() is gangs.known(msg.gang_id)

    never = gangs.get("0" * 24)
    with pytest.raises(NotFound, match=r"gang 0{24}'s devices were not sent to this executor within 0.2 s"):
        await asyncio.wait_for(never, 5)
    late = gang(("c", 0, 1), ("d", 0, 1))
    waits_again = gangs.get(late.gang_id)
    gangs.register(late)
    assert (await asyncio.wait_for(waits_again, 5)).gang_id == late.gang_id

    gangs.register(gang(("e", 0, 1), ("f", 0, 1)))  # a third: the oldest goes (capacity 2)
    assert gangs.known(msg.gang_id) is None and len(gangs) == 2
    assert [m.gang_id for m in gangs.saved()] == [late.gang_id, gangs.saved()[-1].gang_id]


# ------------------------------------------------------------------ the runner


@contextlib.asynccontextmanager
async def runner(wait_seconds: float) -> AsyncIterator[tuple[Runner, asyncio.Queue[Work]]]:
    """A runner of two CPU devices, which its JAX group knows as ("e", 0) and ("e", 1)."""
    devices = jax.devices("cpu")[:2]
    assert len(devices) == 2, "conftest sets 2 CPU devices"
    done: asyncio.Queue[Work] = asyncio.Queue()
    r = Runner(devices, ObjectStore(), FunctionCache(), emit=lambda *_: None, done=done.put_nowait)
    r.gangs.wait_seconds = wait_seconds
    r.group_devices = {("e", i): d for i, d in enumerate(devices)}
    r.functions.register("psum", bytes(psum_function().serialize()), spmd=True, mesh=[2], axes=["i"])
    for i, d in enumerate(devices):
        r.store.put(f"x/{i}", jax.device_put(np.full(1, float(i), np.float32), d), 4)
    try:
        yield r, done
    finally:
        await r.aclose()


def in_gang(gang_id: str, node: int, run: str) -> Computation:
    return Computation(node=node, fn_id="psum", executor_id="e", control="c", spmd=True, gang=gang_id,
                       runs=[ShardRun(device=0, shard=0, count=2)], inputs=["x"], outputs=[f"{run}/y"])


@pytest.mark.asyncio
async def test_the_runner_runs_a_gang_whose_devices_come_after_it_and_fails_one_that_never_comes() -> None:
    msg = gang(("e", 0, 2))
    async with runner(wait_seconds=1.0) as (r, done):
        r.enqueue_all("r1", "p", [in_gang(msg.gang_id, 0, "r1")])
        await asyncio.sleep(0)  # (the Enqueue overtook the RegisterGang: the computation waits for it)
        assert done.empty()
        r.gangs.register(msg)
        ran = await asyncio.wait_for(done.get(), 30)
        assert ran.error is None, ran.error
        assert [float(a[0]) for a in r.store.values(["r1/y/0", "r1/y/1"]) or []] == [1.5, 1.5]

        r.enqueue_all("r2", "p", [in_gang("f" * 24, 0, "r2")])
        failed = await asyncio.wait_for(done.get(), 30)
        assert isinstance(failed.error, NotFound) and f"gang {'f' * 24}'s devices were not sent" in failed.error.message
        with pytest.raises(NotFound):
            await r.store.get("r2/y/0")
        r.enqueue_all("r3", "p", [in_gang(msg.gang_id, 0, "r3")])  # the devices were not held: it runs
        assert (await asyncio.wait_for(done.get(), 30)).error is None
