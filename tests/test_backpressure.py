"""Memory back-pressure: on a full executor new outputs wait for room; impossible ones fail at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pwmesh as pw
from helpers import eventually
from pwmesh.cli.commands import fetch_status, format_status
from pwmesh.cli.daemons import _ByteSize
from pwmesh.errors import DeviceLost
from pwmesh.executor.functions import FunctionCache
from pwmesh.executor.runner import Runner
from pwmesh.executor.store import MemoryBudget, ObjectStore, format_bytes
from pwmesh.executor.work import Work
from pwmesh.wire.messages import Computation, ExecutorStats, ShardRun

MiB = 1 << 20
LIMIT = 4 * MiB  # per executor
HELD = 3 * MiB  # a put buffer that leaves too little room for...
OUT = 2 * MiB  # ...one computation's output


@pytest.fixture(scope="module")
def small() -> Iterator[pw.LocalCluster]:
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=1, devices_per_host=1, memory_limit_bytes=LIMIT)
    with pw.LocalCluster(spec) as c:
        yield c


def filled(nbytes: int) -> Callable[[jax.Array], jax.Array]:
    """A per-device function whose output takes ``nbytes`` (float32), however small its input."""
    return lambda s: jnp.full((nbytes // 4,), s * 2.0, jnp.float32)


def test_outputs_that_can_never_fit_fail_at_once(small: pw.LocalCluster) -> None:
    with pw.Client(small.address) as client:
        sl = client.make_virtual_device_set().add_slice(devices=1)
        out = pw.pmap(filled(2 * LIMIT), devices=sl)(np.ones(1, np.float32))
        with pytest.raises(pw.ResourceExhausted, match="island0-host0") as info:
            out.block_until_ready()
        assert "8.0 MiB" in str(info.value) and "4.0 MiB" in str(info.value)
        # Nothing was reserved or left waiting: the executor keeps serving.
        inc = pw.pmap(lambda s: s + 1.0, devices=sl)
        np.testing.assert_array_equal(np.asarray(inc(np.ones(1, np.float32))), [2.0])
        assert fetch_status(small.address).executor_stats[0].waiting_for_memory == 0


def test_outputs_wait_until_a_buffer_is_freed(small: pw.LocalCluster) -> None:
    def stats() -> ExecutorStats:
        return fetch_status(small.address).executor_stats[0]

    with pw.Client(small.address) as client:
        sl = client.make_virtual_device_set().add_slice(devices=1)
        held = client.put(np.zeros((1, HELD // 4), np.float32), sl)
        held.block_until_ready()  # the proxy has sent it; a put this large is copied onto the device off the loop
        eventually(lambda: stats().bytes >= HELD, 30)
        out = pw.pmap(filled(OUT), devices=sl)(np.ones(1, np.float32))
        eventually(lambda: stats().waiting_for_memory == 1, 30)
        assert not out.is_ready()
        reply = fetch_status(small.address)
        assert reply.executor_stats[0].memory_limit == LIMIT
        assert "/ 4.0 MiB, 1 waiting" in format_status(reply)
        held.delete()  # frees 3 MiB: the waiting computation runs
        np.testing.assert_array_equal(np.asarray(out), np.full((1, OUT // 4), 2.0, np.float32))
        after = stats()
        assert after.waiting_for_memory == 0 and after.bytes < LIMIT


def test_a_put_that_does_not_fit_is_refused_and_others_go_on(small: pw.LocalCluster) -> None:
    """Issue #28, item 4: a put once only counted, so a 100 MB put into a 64 MiB executor succeeded and the
    next computation there (another tenant's) waited for memory with no error. Now it is refused."""
    with pw.Client(small.address) as client, pw.Client(small.address) as other:
        sl = client.make_virtual_device_set().add_slice(devices=1)
        # 5 MiB into 4: a put that big goes straight to the executor (``client/direct.py``), which refuses it
        # before a byte is sent: ``pw.put`` raises (a small put, posted through the proxy, fails on first use).
        with pytest.raises(pw.ResourceExhausted, match="does not fit on executor island0-host0"):
            client.put(np.zeros((1, (LIMIT + MiB) // 4), np.float32), sl)
        assert fetch_status(small.address).executor_stats[0].bytes < LIMIT
        theirs = other.make_virtual_device_set().add_slice(devices=1)
        np.testing.assert_array_equal(np.asarray(pw.pmap(filled(OUT), devices=theirs)(np.ones(1, np.float32))),
                                      np.full((1, OUT // 4), 2.0, np.float32))


def test_a_computation_that_waits_too_long_for_memory_fails_saying_what_holds_it() -> None:
    """Issue #28, item 4: a full executor never blocks another tenant's computation without an error. One
    tenant holds the memory and never frees it; another's computation waits ``--memory-wait-seconds``,
    then fails with ``ResourceExhausted`` naming the wait and the memory held; the executor goes on."""
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=1, devices_per_host=1, memory_limit_bytes=LIMIT,
                               executor_args=("--memory-wait-seconds", "2"))
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address, name="hog") as hog, \
            pw.Client(cluster.address, name="victim") as victim:
        held = hog.put(np.zeros((1, HELD // 4), np.float32), hog.make_virtual_device_set().add_slice(devices=1))
        np.asarray(held)  # on the executor
        mine = victim.make_virtual_device_set().add_slice(devices=1)
        out = pw.pmap(filled(OUT), devices=mine)(np.ones(1, np.float32))
        with pytest.raises(pw.ResourceExhausted, match=r"waited 2 s for 2\.0 MiB of memory") as info:
            out.block_until_ready()
        assert "3.0 MiB of the executor's 4.0 MiB limit stay held" in str(info.value)
        assert fetch_status(cluster.address).executor_stats[0].waiting_for_memory == 0
        np.testing.assert_array_equal(np.asarray(pw.pmap(lambda s: s + 1.0, devices=mine)(np.ones(1, np.float32))),
                                      [2.0])


def test_data_arriving_from_another_executor_that_never_finds_room_fails_naming_why() -> None:
    """Issue #28, item 4: transfers count against the limit as puts do. A value made on one executor and
    moved to another that is full, and stays full, fails there with ``ResourceExhausted`` after
    ``--memory-wait-seconds`` (it once landed, over the limit)."""
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=1, memory_limit_bytes=LIMIT,
                               executor_args=("--memory-wait-seconds", "2"))
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address) as client:
        devs = client.make_virtual_device_set()
        here, there = devs.add_slice(devices=1), devs.add_slice(devices=1)
        assert here.executors != there.executors
        (full,) = there.executors
        held = client.put(np.zeros((1, HELD // 4), np.float32), there)
        np.asarray(held)
        made = pw.pmap(filled(OUT), devices=here)(np.ones(1, np.float32))
        moved = pw.reshard(made, devices=there)
        with pytest.raises(pw.ResourceExhausted, match=f"does not fit on executor {full}: it waited 2 s for room, "
                                                        r"and 3\.0 MiB of its 4\.0 MiB memory limit stay held"):
            np.asarray(moved)
        assert all(s.waiting_for_memory == 0 for s in fetch_status(cluster.address).executor_stats)
        stats = {s.executor_id: s for s in fetch_status(cluster.address).executor_stats}
        assert stats[full].bytes <= LIMIT
        held.delete()  # room again, once its free has reached the executor: then the same move succeeds
        # (The free goes through the island's scheduler, the move's data straight from the other executor:
        # nothing orders the two, and under two test workers the data once arrived first.)
        eventually(lambda: next(s.bytes for s in fetch_status(cluster.address).executor_stats
                                if s.executor_id == full) + OUT <= LIMIT, 10)
        np.testing.assert_array_equal(np.asarray(pw.reshard(made, devices=there)), np.full((1, OUT // 4), 2.0))


def test_data_arriving_at_a_full_executor_waits_for_a_free_and_lands() -> None:
    """Data moved to an executor that is full now waits for room, as a computation's outputs do: a free may be
    on its way (it was once refused at once, so a move right behind a delete could fail for nothing). Here it
    waits, seen in the executor's stats, until the buffer holding the memory is deleted; then it lands."""
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=1, memory_limit_bytes=LIMIT)
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address) as client:
        devs = client.make_virtual_device_set()
        here, there = devs.add_slice(devices=1), devs.add_slice(devices=1)
        (full,) = there.executors

        def stats() -> ExecutorStats:
            return next(s for s in fetch_status(cluster.address).executor_stats if s.executor_id == full)

        held = client.put(np.zeros((1, HELD // 4), np.float32), there)
        np.asarray(held)
        made = pw.pmap(filled(OUT), devices=here)(np.ones(1, np.float32))
        moved = pw.reshard(made, devices=there)
        eventually(lambda: stats().waiting_for_memory == 1, 30)
        assert not moved.is_ready()
        held.delete()
        np.testing.assert_array_equal(np.asarray(moved), np.full((1, OUT // 4), 2.0, np.float32))
        after = stats()
        assert after.waiting_for_memory == 0 and OUT <= after.bytes <= LIMIT


def test_data_waiting_for_room_stops_waiting_when_its_owner_goes() -> None:
    """An arrival waiting for memory that another tenant holds, whose own session then ends, stops waiting
    at once: its buffer's delete cancels the wait (it would otherwise sit in the executor's memory queue,
    and hold up a drain, for ``--memory-wait-seconds``). The executor goes on serving the other tenant."""
    spec = pw.LocalClusterSpec(islands=2, hosts_per_island=1, devices_per_host=1, memory_limit_bytes=LIMIT)
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address, name="hog") as hog:
        mine = hog.make_virtual_device_set().add_slice(devices=1, island=1)
        (full,) = mine.executors
        held = hog.put(np.zeros((1, HELD // 4), np.float32), mine)
        np.asarray(held)

        def waiting() -> int:
            return next(s.waiting_for_memory for s in fetch_status(cluster.address).executor_stats
                        if s.executor_id == full)

        with pw.Client(cluster.address, name="mover") as mover:
            devs = mover.make_virtual_device_set()
            here, there = devs.add_slice(devices=1, island=0), devs.add_slice(devices=1, island=1)
            assert there.executors == {full}
            made = pw.pmap(filled(OUT), devices=here)(np.ones(1, np.float32))
            pw.reshard(made, devices=there)
            eventually(lambda: waiting() == 1, 30)
        eventually(lambda: waiting() == 0, 30)  # not --memory-wait-seconds (300 s)
        np.testing.assert_array_equal(np.asarray(pw.pmap(lambda s: s + 1.0, devices=mine)(np.ones(1, np.float32))),
                                      [2.0])


def test_memory_limit_option_takes_suffixes() -> None:
    size = _ByteSize()
    assert [size.convert(v, None, None) for v in ("0", "1024", "64M", "64MiB", "2g", "1.5K")] == [
        0, 1024, 64 * MiB, 64 * MiB, 2 << 30, 1536]
    for bad in ("lots", "-1M", "M"):
        with pytest.raises(Exception, match="size"):
            size.convert(bad, None, None)
    assert (format_bytes(512), format_bytes(12 * MiB)) == ("512 B", "12.0 MiB")


# ------------------------------------------------------------------ unit: no sockets


@pytest.mark.asyncio
async def test_budget_reserves_waits_and_wakes_on_free() -> None:
    budget = MemoryBudget(limit_bytes=100)
    budget.allocated(60)  # stored objects count, and are never refused
    first = budget.request(30, owner="a")
    assert first.done() and budget.in_use == 90  # fits: reserved at once
    big, small = budget.request(50, owner="b"), budget.request(20, owner="c")
    assert not big.done() and not small.done() and budget.waiting == 2
    budget.allocated(30)  # "a"'s outputs land in the store, then its reservation ends (as the runner does)
    budget.release(30)
    assert not big.done() and not small.done()
    budget.freed(20)  # a deletion: room for "c" only; "b" does not hold it back
    assert small.done() and not big.done() and budget.waiting == 1
    budget.freed(50)
    assert big.done() and budget.waiting == 0
    assert (budget.stored, budget.reserved) == (20, 70)


@pytest.mark.asyncio
async def test_budget_refuses_the_impossible_and_cancels_waiters() -> None:
    budget = MemoryBudget(limit_bytes=100)
    with pytest.raises(pw.ResourceExhausted, match="101 > 100"):
        budget.request(101, owner="x")
    budget.allocated(100)
    waiting = budget.request(10, owner="run1")
    budget.cancel("run1", DeviceLost("host gone"))
    with pytest.raises(DeviceLost):
        waiting.result()
    assert budget.waiting == 0 and budget.reserved == 0
    assert MemoryBudget().request(1 << 40, owner="y").done()  # no limit


@pytest.mark.asyncio
async def test_budget_gives_back_what_a_cancelled_task_was_granted() -> None:
    budget = MemoryBudget(limit_bytes=100)
    budget.allocated(100)
    # Drive the coroutine by hand: it stops at its wait, then is cancelled as a task would be.
    waits = budget.reserve(10, owner="a")
    waits.send(None)
    assert budget.waiting == 1
    with pytest.raises(asyncio.CancelledError):
        waits.throw(asyncio.CancelledError())
    assert budget.waiting == 0
    # Granted, but cancelled before it resumed: the bytes go back.
    granted_late = budget.reserve(10, owner="b")
    granted_late.send(None)
    budget.freed(10)
    assert budget.reserved == 10
    with pytest.raises(asyncio.CancelledError):
        granted_late.throw(asyncio.CancelledError())
    assert budget.reserved == 0


async def until(condition: Callable[[], bool]) -> None:
    """Let the event loop run until ``condition`` holds (in-process state nobody signals)."""
    while not condition():
        await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def running(limit: int) -> AsyncIterator[tuple[Runner, asyncio.Queue[Work]]]:
    store = ObjectStore()
    functions = FunctionCache()
    finished: asyncio.Queue[Work] = asyncio.Queue()
    runner = Runner(jax.devices("cpu")[:1], store, functions, emit=lambda *_: None, done=finished.put_nowait,
                    memory_limit_bytes=limit)
    for name, nbytes in (("big", OUT), ("one", 4)):
        fn = filled(nbytes) if nbytes > 4 else (lambda s: s + 1.0)
        exported = export.export(jax.jit(fn), platforms=["cpu"])(jax.ShapeDtypeStruct((), jnp.float32))
        functions.register(name, bytes(exported.serialize()), spmd=False)
    try:
        yield runner, finished
    finally:
        await runner.aclose()


def computation(node: int, fn_id: str, inputs: list[str], output: str) -> Computation:
    return Computation(node=node, fn_id=fn_id, executor_id="e", control="c",
                       runs=[ShardRun(device=0, shard=0)], inputs=inputs, outputs=[output])


@pytest.mark.asyncio
async def test_cancel_run_releases_a_computation_waiting_for_memory() -> None:
    async with running(LIMIT) as (runner, finished):
        runner.store.put("x/0", np.float32(1.0), 4)
        runner.store.put("held/0", np.zeros(HELD // 4, np.float32), HELD)
        runner.enqueue("r1", "proxy", computation(0, "big", ["x"], "r1/out"))
        runner.enqueue("r2", "proxy", computation(0, "one", ["x"], "r2/out"))
        await until(lambda: runner.memory.waiting == 1)
        runner.cancel_run("r1", DeviceLost("island0-host1 is gone"))
        cancelled = await finished.get()
        assert cancelled.run_id == "r1" and isinstance(cancelled.error, DeviceLost)
        with pytest.raises(DeviceLost):
            await runner.store.get("r1/out/0")
        # The queue behind it is not blocked, and nothing stays reserved.
        assert (await finished.get()).run_id == "r2"
        assert float(await runner.store.get("r2/out/0")) == 2.0
        assert runner.memory.reserved == 0 and runner.memory.stored == 4 + HELD + 4
