"""The executor's fast path: quick computations that can start at once run inside ``enqueue``.

These drive a real ``Runner`` (real JAX on 2 CPU devices, real object store) on the
test's event loop, without daemons: what is checked is which path a computation
takes, that the island's order and the run accounting stay right, and what the
store keeps. End to end, every other test's programs go through the same path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from pwmesh.errors import NotFound, PwmeshError
from pwmesh.executor import calls as calls_module
from pwmesh.executor import runner as runner_module
from pwmesh.executor.calls import pieces
from pwmesh.executor.daemon import after_wakeups
from pwmesh.executor.functions import CompiledFunction, FunctionCache
from pwmesh.executor.runner import Runner
from pwmesh.executor.state import INLINE_SECONDS, How, how_to_run, runs_inline
from pwmesh.executor.store import ObjectStore
from pwmesh.executor.work import Work
from pwmesh.wire.messages import Computation, ShardRun

pytestmark = pytest.mark.timeout(60)


class Recorder:
    """What the runner reports: completed computations and ended run parts, in order."""

    def __init__(self) -> None:
        self.done: list[Work] = []
        self.parts: list[str] = []
        self.finished = asyncio.Event()

    def on_done(self, work: Work) -> None:
        self.done.append(work)

    def on_part(self, run_id: str, scheduler: str, seconds: float) -> None:
        self.parts.append(run_id)
        self.finished.set()

    async def part(self, run_id: str) -> None:
        while run_id not in self.parts:
            self.finished.clear()
            await asyncio.wait_for(self.finished.wait(), 10)


@contextlib.asynccontextmanager
async def runner() -> AsyncIterator[tuple[Runner, Recorder]]:
    devices = jax.devices("cpu")[:2]
    assert len(devices) == 2, "conftest sets 2 CPU devices"
    rec = Recorder()
    r = Runner(devices, ObjectStore(), FunctionCache(), emit=lambda *_: None, done=rec.on_done, part_done=rec.on_part)
    exported = export.export(jax.jit(lambda v: v + 1.0), platforms=["cpu"])(jax.ShapeDtypeStruct((1,), jnp.float32))
    r.functions.register("inc", bytes(exported.serialize()), spmd=False)
    for i, d in enumerate(devices):
        r.store.put(f"x/{i}", jax.device_put(np.zeros(1, np.float32), d), 4)
    async with device_loops(r):
        yield r, rec


@contextlib.asynccontextmanager
async def device_loops(r: Runner) -> AsyncIterator[None]:
    """Let ``r`` run for the block; then stop what it runs and close it."""
    try:
        yield
    finally:
        await r.aclose()


def chain(run: str, n: int, first: str = "x", shards: int = 2) -> list[Computation]:
    """``n`` nodes on devices [0, shards), node i reading node i-1's output."""
    return [Computation(node=i, fn_id="inc", executor_id="e", control="c",
                        runs=[ShardRun(device=0, shard=0, count=shards)],
                        inputs=[first if i == 0 else f"{run}/v{i - 1}"], outputs=[f"{run}/v{i}"])
            for i in range(n)]


async def warm(r: Runner, rec: Recorder) -> None:
    """The first run compiles, and runs once, on a device thread (the fast path never compiles). Then the
    function is measured quick, as a scalar add is on the loop: the policy takes measured time as data
    (``how_to_run``), so the test says what was measured rather than waiting for a loaded machine to
    time a run under INLINE_SECONDS (it used to loop until one did)."""
    r.enqueue_all("warm0", "p", chain("warm0", 1))
    await rec.part("warm0")
    fn = r.functions.get("inc").result()
    fn.ran(20e-6)
    assert runs_inline(fn, fn.seconds * 2) and fn.seconds < INLINE_SECONDS / 2
    # And it stays so: each run in a chain is timed again, and one timed slow on a busy machine (the other
    # xdist worker's tests) would end the chain there, as the policy says it should (how_to_run's own tests
    # cover that); these tests are of the chain, not of the timing.
    fn.ran = lambda seconds: None  # type: ignore[method-assign]
    rec.parts.clear()
    rec.done.clear()


@pytest.mark.asyncio
async def test_a_warm_chain_runs_inside_enqueue_and_ends_its_part_once() -> None:
    async with runner() as (r, rec):
        await warm(r, rec)
        stored = r.memory.stored
        r.enqueue_all("r1", "p", chain("r1", 16))
        # No await since: every node ran in the call, in order, and the part ended once.
        assert [w.comp.node for w in rec.done] == list(range(16))
        assert not any(w.queued for w in rec.done)
        assert rec.parts == ["r1"]
        assert [float(v[0]) for v in r.store.values(["r1/v15/0", "r1/v15/1"])] == [16.0, 16.0]
        assert r.outstanding == 0 and r.queued() == [0, 0]
        assert r.memory.reserved == 0 and r.memory.stored == stored + 16 * 8  # 16 outputs of 2 x 4 bytes


@pytest.mark.asyncio
async def test_a_warm_chain_deletes_what_its_nodes_read_last() -> None:
    """A node's ``frees`` (a batch it alone reads) go as the chain runs it, as on the ordinary path."""
    async with runner() as (r, rec):
        await warm(r, rec)
        for i, d in enumerate(r.devices):
            r.store.put(f"batch/{i}", jax.device_put(np.ones(1, np.float32), d), 4)
        stored = r.memory.stored
        comps = chain("r1", 3, first="batch")
        comps[0].frees = [0]
        r.enqueue_all("r1", "p", comps)
        assert [w.comp.node for w in rec.done] == [0, 1, 2] and not any(w.queued for w in rec.done), "the chain"
        assert r.store.values(["batch/0"]) is None and r.store.deleted("batch/1")
        assert [float(v[0]) for v in r.store.values(["r1/v2/0", "r1/v2/1"])] == [4.0, 4.0]
        assert r.memory.stored == stored - 2 * 4 + 3 * 8


class Together:
    """``done_together``'s calls: (run, [(node, quiet)]) in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[tuple[int, bool]]]] = []

    def __call__(self, run_id: str, proxy: str, scheduler: str, done: list[tuple[int, bool]]) -> None:
        self.calls.append((run_id, list(done)))


@pytest.mark.asyncio
async def test_a_warm_part_runs_as_one_chain_and_is_reported_once() -> None:
    """A runner with ``done_together`` (as the executor's): the part's computations run in ``enqueue_all`` with
    no ``Work`` each, and are reported in one call, in order; counted, traced and stored as one by one."""
    async with runner() as (r, rec):
        await warm(r, rec)
        r._done_together = together = Together()
        executed, stored, spans = r.executed, r.memory.stored, len(r.trace())
        comps = chain("r1", 16)
        for c in comps[:-1]:
            c.quiet = True
        r.enqueue_all("r1", "p", comps)
        assert together.calls == [("r1", [(i, i < 15) for i in range(16)])]
        assert rec.done == [] and rec.parts == ["r1"]  # no report each; the part ended once, after them
        assert [float(v[0]) for v in r.store.values(["r1/v15/0", "r1/v15/1"])] == [16.0, 16.0]
        assert r.executed == executed + 16 and r.core.started == r.core.executed and r.outstanding == 0
        assert [s.node for s in r.trace()[spans:]] == list(range(16))
        assert r.memory.reserved == 0 and r.memory.stored == stored + 16 * 8
        assert all(seconds > 0 for seconds in r.core.busy_seconds)


@pytest.mark.asyncio
async def test_a_chain_stops_at_the_first_computation_that_cannot_run_at_once() -> None:
    """Node 3 waits for an input: 0-2 run as the chain (reported together), 3 and what follows queue, in
    order, and run once the input is there; the part ends once, after the last."""
    async with runner() as (r, rec):
        await warm(r, rec)
        r._done_together = together = Together()
        comps = chain("r1", 6)
        comps[3].inputs = ["late"]
        r.enqueue_all("r1", "p", comps)
        assert together.calls == [("r1", [(0, False), (1, False), (2, False)])]
        assert rec.done == [] and rec.parts == [] and r.queued() == [2, 2]
        for i in range(2):
            r.store.put(f"late/{i}", jax.device_put(np.ones(1, np.float32), r.devices[i]), 4)
        await rec.part("r1")
        assert [w.comp.node for w in rec.done] == [3, 4, 5] and all(w.queued for w in rec.done)
        assert float(r.store.values(["r1/v5/1"])[0][0]) == 4.0 and rec.parts == ["r1"]


class Exploding:
    """Fault injection: an output whose device reports a failure when it is waited for (no CPU computation
    can be made to fail so on demand)."""

    def block_until_ready(self) -> None:
        raise RuntimeError("injected: the device failed")


@pytest.mark.asyncio
async def test_a_computation_that_fails_in_a_chain_is_reported_after_those_before_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with runner() as (r, rec):
        await warm(r, rec)
        r._done_together = together = Together()
        real, calls = calls_module.dispatch_together, {"n": 0}

        def failing_third(exes: list[object], devices: list[jax.Device], per_shard: list[list[object]]
                          ) -> list[list[object]]:
            calls["n"] += 1
            outs = real(exes, devices, per_shard)
            return [[Exploding()] for _ in outs] if calls["n"] == 3 else outs

        monkeypatch.setattr(calls_module, "dispatch_together", failing_third)  # (the warm paths' dispatch_plain)
        r.enqueue_all("r1", "p", chain("r1", 5))
        await rec.part("r1")
        assert together.calls == [("r1", [(0, False), (1, False)])]
        assert [(w.comp.node, w.error is not None) for w in rec.done] == [(2, True), (3, True), (4, True)]
        assert "injected: the device failed" in rec.done[0].error.message  # type: ignore[union-attr]
        assert "injected: the device failed" in rec.done[2].error.message  # type: ignore[union-attr]  # its cause
        with pytest.raises(PwmeshError, match="injected"):
            await r.store.get("r1/v2/0")
        assert rec.parts == ["r1"] and r.outstanding == 0 and r.memory.reserved == 0


@pytest.mark.asyncio
async def test_a_computation_never_overtakes_queued_work_on_its_devices() -> None:
    async with runner() as (r, rec):
        await warm(r, rec)
        rec.done.clear()
        # r1 waits for an input that is not there: it sits at the head of device 0's queue.
        r.enqueue_all("r1", "p", chain("r1", 1, first="late", shards=1))
        # r2 on device 0 could start at once, but r1 is ahead of it in the island's order.
        r.enqueue_all("r2", "p", chain("r2", 1, shards=1))
        # r3 uses only device 1, which nothing occupies: it runs now.
        r.enqueue_all("r3", "p", [Computation(node=0, fn_id="inc", executor_id="e", control="c",
                                              runs=[ShardRun(device=1, shard=1)], inputs=["x"], outputs=["r3/v0"])])
        assert [w.run_id for w in rec.done] == ["r3"]
        r.store.put("late/0", jax.device_put(np.ones(1, np.float32), r.devices[0]), 4)
        await rec.part("r2")
        assert [w.run_id for w in rec.done] == ["r3", "r1", "r2"]
        assert all(w.queued for w in rec.done[1:])
        assert float(r.store.values(["r1/v0/0"])[0][0]) == 2.0 and float(r.store.values(["r2/v0/0"])[0][0]) == 1.0


@pytest.mark.asyncio
async def test_a_run_mixing_both_paths_ends_its_part_after_its_last_computation() -> None:
    async with runner() as (r, rec):
        await warm(r, rec)
        comps = chain("r1", 3)
        comps[1].inputs = ["late"]  # node 1 waits (queued); node 2, behind it on the same devices, queues too
        r.enqueue_all("r1", "p", comps)
        assert rec.parts == [] and [w.comp.node for w in rec.done[-1:]] == [0]  # node 0 ran at once; not over
        for i in range(2):
            r.store.put(f"late/{i}", jax.device_put(np.ones(1, np.float32), r.devices[i]), 4)
        await rec.part("r1")
        assert rec.parts == ["r1"]
        assert float(r.store.values(["r1/v2/1"])[0][0]) == 3.0


@pytest.mark.asyncio
async def test_a_chain_behind_a_waiting_computation_runs_on_once_it_starts() -> None:
    """A chain whose first node waits for an input queues whole; once that node has run, each one behind it
    that has everything it needs runs at once in the same task (in order), not a task and a loop turn each."""
    async with runner() as (r, rec):
        await warm(r, rec)
        tasks: list[asyncio.Task[object] | None] = []
        r._done = lambda work: (rec.on_done(work), tasks.append(asyncio.current_task()))  # type: ignore[func-returns-value]
        r.enqueue_all("r1", "p", chain("r1", 32, first="late"))
        assert rec.done == [] and r.queued() == [31, 31]  # all of it waits behind node 0
        for i in range(2):
            r.store.put(f"late/{i}", jax.device_put(np.ones(1, np.float32), r.devices[i]), 4)
        await rec.part("r1")
        assert [w.comp.node for w in rec.done] == list(range(32)) and all(w.queued for w in rec.done)
        assert len(set(tasks)) == 1, f"the chain took {len(set(tasks))} tasks"
        assert [float(v[0]) for v in r.store.values(["r1/v31/0", "r1/v31/1"])] == [33.0, 33.0]
        assert r.outstanding == 0 and r.queued() == [0, 0] and r.memory.reserved == 0


@pytest.mark.asyncio
async def test_a_warm_computation_that_is_malformed_fails_alone_and_says_why() -> None:
    """The warm path runs nothing it cannot finish as the general one would: a computation naming more outputs
    than its function makes, or calling it with the wrong inputs, fails with the reason, its run goes on."""
    async with runner() as (r, rec):
        await warm(r, rec)
        two_outputs, two_inputs = chain("r1", 1)[0], chain("r2", 1)[0]
        two_outputs.outputs = ["r1/v0", "r1/b"]  # (its readers, behind it, fail with it)
        two_inputs.inputs = ["x", "x"]
        r.enqueue_all("r1", "p", [two_outputs, *chain("r1", 3)[1:]])
        r.enqueue_all("r2", "p", [two_inputs])
        await rec.part("r2")
        failed = {(w.run_id, w.comp.node): w.error for w in rec.done if w.error is not None}
        assert sorted(failed) == [("r1", 0), ("r1", 1), ("r1", 2), ("r2", 0)]
        assert "produced 1 outputs, expected 2" in failed["r1", 0].message
        assert "produced 1 outputs, expected 2" in failed["r1", 2].message  # its cause, passed down the chain
        assert "computation 0" in failed["r2", 0].message
        with pytest.raises(PwmeshError, match="produced 1 outputs"):
            await r.store.get("r1/b/1")
        assert r.outstanding == 0 and r.memory.reserved == 0 and rec.parts == ["r1", "r2"]


@pytest.mark.asyncio
async def test_a_computed_buffer_is_stored_or_dropped_as_its_deletes_and_failures_say() -> None:
    """What the warm path stores (``put(..., computed=True)`` a piece): a new buffer's pieces; nothing of a deleted
    one; and a piece that failed before it came keeps its failure."""
    store = ObjectStore()
    for shard, value in enumerate(["a0", "a1"]):
        store.put(f"o/a/{shard}", value, 4, computed=True)
    assert store.values(["o/a/0", "o/a/1"]) == ["a0", "a1"] and store.nbytes == 8 and store.memory.stored == 8
    store.delete(["o/a"])
    assert store.deleted("o/a/0") and store.nbytes == 0
    for shard in range(2):  # deleted: dropped
        store.put(f"o/a/{shard}", "late", 4, computed=True)
    assert store.values(["o/a/0"]) is None and store.nbytes == 0
    store.fail("o/b/1", PwmeshError("boom"))  # one piece failed before it came: that failure stands
    for shard, value in enumerate(["b0", "b1"]):
        store.put(f"o/b/{shard}", value, 4, computed=True)
    assert store.values(["o/b/0"]) == ["b0"] and store.values(["o/b/1"]) is None and store.nbytes == 4


@pytest.mark.asyncio
async def test_a_failed_input_takes_the_queue_and_fails_the_outputs() -> None:
    async with runner() as (r, rec):
        await warm(r, rec)
        r.store.fail("bad/0", PwmeshError("producer failed"))
        r.enqueue_all("r1", "p", chain("r1", 1, first="bad", shards=1))
        await rec.part("r1")
        (work,) = [w for w in rec.done if w.run_id == "r1"]
        assert work.queued and isinstance(work.error, PwmeshError) and "producer failed" in work.error.message
        with pytest.raises(PwmeshError, match="producer failed"):
            await r.store.get("r1/v0/0")


@pytest.mark.asyncio
async def test_a_run_whose_computations_are_all_refused_still_ends_its_part() -> None:
    async with runner() as (r, rec):
        bad = Computation(node=0, fn_id="inc", executor_id="e", control="c", runs=[ShardRun(device=5, shard=0)],
                          inputs=["x"], outputs=["r1/v0"])
        refused = r.enqueue_all("r1", "p", [bad])
        assert [c.node for c, _ in refused] == [0] and "names devices [5]" in refused[0][1].message
        assert rec.parts == ["r1"]  # the scheduler gets its window slot back


@pytest.mark.asyncio
async def test_the_store_keeps_values_without_futures_and_remembers_deletes() -> None:
    store = ObjectStore()
    store.put("o/b/0", "v", 10)
    assert store.values(["o/b/0"]) == ["v"] and await store.get("o/b/0") == "v"
    waiting = store.get("o/c/0")  # a posted receive
    assert store.values(["o/c/0"]) is None and not waiting.done()
    store.put("o/c/0", "w", 5)
    assert await waiting == "w" and store.values(["o/b/0", "o/c/0"]) == ["v", "w"]
    store.fail("o/d/0", PwmeshError("boom"))
    store.put("o/d/0", "late", 1)  # the failure stands
    assert store.values(["o/d/0"]) is None
    store.put("o/b/0", "again", 10)  # the first value stands
    assert store.values(["o/b/0"]) == ["v"] and store.nbytes == 15 and len(store) == 3
    assert store.delete(["o/b", "o/c", "o/d"]) == 3 and len(store) == 0 and store.nbytes == 0
    store.put("o/b/0", "after", 10)  # a late arrival for a deleted buffer is dropped
    assert store.values(["o/b/0"]) is None and store.nbytes == 0
    with pytest.raises(NotFound):
        await store.get("o/b/0")


def test_which_computations_run_on_the_loop() -> None:
    """Quick ones run inline; anything expected to hold the loop over INLINE_SECONDS goes to a device thread."""

    class Timed:  # only what runs_inline reads: how often the function ran
        def __init__(self, runs: int = 1) -> None:
            self.runs = runs
            self.bounded = True

    def inline(seconds: float, runs: int = 1) -> bool:
        return runs_inline(Timed(runs), seconds)  # type: ignore[arg-type]

    assert inline(80e-6) and inline(900e-6)
    assert not inline(1.2e-3) and not inline(5e-3), "the loop is held at most INLINE_SECONDS"
    assert inline(1.2e-3, runs=32), "every 16th run goes inline, to be timed without thread contention"
    assert not inline(5e-3, runs=32), "but not one that is surely slow"
    assert not inline(float("inf"), runs=0), "never ran: it compiles first, on a device thread"


def test_how_a_computation_runs_follows_what_was_measured_of_it() -> None:
    """The choice between the loop, the devices' streams and their threads, from measured time as data."""

    class Measured:
        def __init__(self, seconds: float, bounded: bool | None = True, runs: int = 1) -> None:
            self.seconds, self.bounded, self.runs = seconds, bounded, runs

    plain = Computation(node=0, fn_id="f", executor_id="e", control="c", runs=[ShardRun(device=0, shard=0)],
                        inputs=["x"], outputs=["y"])
    assert how_to_run(plain, Measured(50e-6), shards=2) is How.INLINE
    assert how_to_run(plain, Measured(800e-6), shards=2) is How.STREAM, "1.6 ms over both shards: too long"
    assert how_to_run(plain, Measured(50e-6, bounded=False), shards=2) is How.THREAD, "it may loop for ever"
    assert how_to_run(plain, Measured(50e-6, bounded=None), shards=2) is How.THREAD, "not read yet"
    assert how_to_run(plain, None, shards=2) is How.THREAD, "not compiled for its devices: it compiles there"
    ragged = dataclasses.replace(plain, ragged=True)
    assert how_to_run(ragged, Measured(50e-6), shards=2) is How.THREAD, "routed rows are cut on the host"
    # On an accelerator the devices compute while the loop goes on: a quick one is streamed, never waited out
    # on the loop (a GPU's tiny training step held the executor's loop ~0.7 ms a step).
    assert how_to_run(plain, Measured(50e-6), shards=2, asynchronous=True) is How.STREAM
    assert how_to_run(plain, Measured(50e-6, bounded=False), shards=2, asynchronous=True) is How.THREAD


def test_a_streamed_run_never_makes_a_function_look_slower() -> None:
    """The estimate that decides inline or streamed: a streamed run is timed by a thread that
    waited for the interpreter, so it may only lower it; runs timed where they were waited for
    count as before (a quicker one at once, a slower one a quarter)."""
    exported = export.export(jax.jit(lambda v: v + 1.0))(jax.ShapeDtypeStruct((1,), np.float32))
    fn = CompiledFunction("inc", exported, spmd=False)
    fn.executable((jax.devices("cpu")[0],))  # compiling it finds it bounded: it may run inline
    assert fn.bounded
    fn.ran(2e-3)  # the first run, on a device thread: taken as it is
    assert fn.seconds == 2e-3
    for _ in range(8):
        fn.landed(5e-3)  # landing times include the wait for the interpreter: never slower
        fn.landed(None)  # computed while the thread waited for the one ahead: its end is unknown
    assert fn.seconds == 2e-3 and fn.runs == 17, "streamed runs count for the 16th-run rule"
    assert not runs_inline(fn, fn.seconds * 2)
    fn.landed(100e-6)
    assert fn.seconds == 100e-6 and runs_inline(fn, fn.seconds * 2), "a streamed run that ended sooner brings it back"
    fn.ran(80e-6)
    assert fn.seconds == 80e-6
    fn.ran(10e-3)
    assert fn.seconds == pytest.approx(0.75 * 80e-6 + 0.25 * 10e-3)


@pytest.mark.asyncio
async def test_a_bug_on_the_fast_path_loses_neither_the_computation_nor_the_run() -> None:
    """Fault injection (a real Runner, a patched store method): the fast path's checks raise once."""
    async with runner() as (r, rec):
        await warm(r, rec)
        real = r.store.values
        calls = {"n": 0}

        def flaky(keys: list[str]) -> list[object] | None:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected")
            return real(keys)

        r.store.values = flaky  # type: ignore[method-assign]
        r.enqueue_all("r1", "p", chain("r1", 3))
        await rec.part("r1")  # node 0 went through the queues; the chain behind it too
        assert [w.comp.node for w in rec.done if w.run_id == "r1"] == [0, 1, 2]
        assert all(w.error is None for w in rec.done)
        assert float(real(["r1/v2/1"])[0][0]) == 3.0  # type: ignore[index]


@pytest.mark.asyncio
async def test_a_computation_that_cannot_be_enqueued_fails_alone() -> None:
    async with runner() as (r, rec):
        await warm(r, rec)
        comps = chain("r1", 2)
        broken = chain("r1", 2)[0]
        broken.node, broken.runs = 7, [None]  # type: ignore[list-item]  # a malformed computation (a bug upstream)
        refused = r.enqueue_all("r1", "p", [comps[0], broken, comps[1]])
        assert [c.node for c, _ in refused] == [7] and "enqueueing computation 7" in refused[0][1].message
        await rec.part("r1")
        assert [w.comp.node for w in rec.done] == [0, 1]


def psum_function() -> export.Exported:
    """An SPMD function over 2 devices (``psum(v) / 2 + 1`` per block), exported as the client does."""
    mesh = AbstractMesh((2,), ("i",))
    spec = PartitionSpec("i")
    mapped = jax.shard_map(lambda b: jax.lax.psum(b, "i") / 2 + 1.0, mesh=mesh, in_specs=spec, out_specs=spec)
    arg = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=NamedSharding(mesh, spec))
    return export.export(jax.jit(mapped), platforms=["cpu"])(arg)


def spmd_chain(run: str, n: int) -> list[Computation]:
    return [Computation(node=i, fn_id="psum", executor_id="e", control="c", spmd=True,
                        runs=[ShardRun(device=0, shard=0, count=2)],
                        inputs=["x" if i == 0 else f"{run}/v{i - 1}"], outputs=[f"{run}/v{i}"])
            for i in range(n)]


def count_assembled(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, ...]]:
    """The calls that assemble a global array from pieces (``make_array_from_single_device_arrays``), as made."""
    assembled: list[tuple[object, ...]] = []
    real = jax.make_array_from_single_device_arrays

    def counting(*args: object, **kwargs: object) -> jax.Array:
        assembled.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(jax, "make_array_from_single_device_arrays", counting)
    return assembled


@pytest.mark.asyncio
async def test_an_spmd_chain_hands_each_output_whole_to_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-assembling a global array from its pieces for every SPMD call cost ~0.1-0.3 ms a node:
    only the chain's first input (two host-put pieces) is assembled; every output goes on whole
    for as long as its buffer lives, whichever path (device thread, inline, streamed) ran it."""
    assembled = count_assembled(monkeypatch)
    cut: list[str] = []

    def cutting(array: jax.Array, local: tuple[jax.Device, ...]) -> list[jax.Array]:
        cut.append(str(array))
        return pieces(array, local)

    monkeypatch.setattr(runner_module, "pieces", cutting)
    async with runner() as (r, rec):
        r.functions.register("psum", bytes(psum_function().serialize()), spmd=True, mesh=[2], axes=["i"])
        for k in range(3):  # the first compiles on a device thread; the others take the quick paths
            assembled.clear()
            cut.clear()
            r.enqueue_all(f"r{k}", "p", spmd_chain(f"r{k}", 6))
            await rec.part(f"r{k}")
            assert all(w.error is None for w in rec.done), [w.error for w in rec.done]
            last = r.store.values([f"r{k}/v5/0", f"r{k}/v5/1"])
            assert last is not None and [float(a[0]) for a in last] == [6.0, 6.0]
            assert len(assembled) == 1, f"chain {k}: {len(assembled)} inputs assembled, expected the first only"
            assert len(cut) == 1, f"chain {k}: {len(cut)} outputs cut into pieces, expected the one read (v5)"
            r.store.delete([f"r{k}/v{i}" for i in range(6)])
            shardings = r.functions.get("psum").result().shardings(tuple(r.devices))[0]
            assert r.store.whole(f"r{k}/v5", shardings[0], (0, 1)) is None, "dropped with its buffer"


@pytest.mark.asyncio
async def test_a_warm_spmd_part_on_this_executors_devices_runs_as_one_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pmap with a collective over this executor's devices alone (Figure 5's add+psum, Chained): warm, its part
    runs as one chain in ``enqueue_all``, each output stored whole and handed on whole, reported once."""
    assembled = count_assembled(monkeypatch)
    async with runner() as (r, rec):
        r.functions.register("psum", bytes(psum_function().serialize()), spmd=True, mesh=[2], axes=["i"])
        r.enqueue_all("r0", "p", spmd_chain("r0", 1))  # compiles, on a device thread
        await rec.part("r0")
        # Quick, whatever a busy machine measures of the collective as the chain runs (each run is timed again,
        # and a slow one would end the chain: how_to_run's own tests cover that policy).
        monkeypatch.setattr(runner_module, "runs_inline", lambda *args, **kwargs: True)
        r._done_together = together = Together()
        executed, stored, spans = r.executed, r.memory.stored, len(r.trace())
        assembled.clear()
        r.enqueue_all("r1", "p", spmd_chain("r1", 6))
        assert together.calls == [("r1", [(i, False) for i in range(6)])]  # no await: all ran in the call
        assert rec.parts == ["r0", "r1"] and len(rec.done) == 1  # r0's alone: no report each
        assert len(assembled) == 1, "only the first input is assembled from its pieces"
        shardings = r.functions.get("psum").result().shardings(tuple(r.devices))[0]
        assert all(r.store.whole(f"r1/v{i}", shardings[0], (0, 1)) is not None for i in range(6))
        last = r.store.values(["r1/v5/0", "r1/v5/1"])
        assert last is not None and [float(a[0]) for a in last] == [6.0, 6.0]
        assert r.executed == executed + 6 and r.core.started == r.core.executed and r.outstanding == 0
        assert [s.node for s in r.trace()[spans:]] == list(range(6))
        assert r.memory.reserved == 0 and r.memory.stored == stored + 6 * 8  # 6 outputs of 2 x 4 bytes


def test_a_whole_goes_in_only_over_exactly_its_sharding_and_shards() -> None:
    devices = jax.devices("cpu")[:2]
    sharding = NamedSharding(Mesh(np.array(devices), ("x",)), PartitionSpec("x"))
    other = NamedSharding(Mesh(np.array(devices), ("x",)), PartitionSpec("x"))  # equal, not the same object
    whole = jax.device_put(np.arange(2, dtype=np.float32), sharding)
    store = ObjectStore(pieces)
    store.put_whole("s/b", whole, sharding, (0, 1), tuple(devices), 4)
    assert store.whole("s/b", sharding, (0, 1)) is whole
    assert store.whole("s/a", sharding, (0, 1)) is None, "another buffer"
    assert store.whole("s/b", sharding, (1, 0)) is None, "other shards (order)"
    assert store.whole("s/b", other, (0, 1)) is None, "readers' shardings are interned: another object is another layout"
    store.delete(["s/b"])
    assert store.whole("s/b", sharding, (0, 1)) is None
    store.put_whole("s/b", whole, sharding, (0, 1), tuple(devices), 4)  # an output landing after its buffer was deleted
    assert store.whole("s/b", sharding, (0, 1)) is None and store.nbytes == 0


def test_a_whole_is_cut_into_pieces_only_when_one_is_asked_for() -> None:
    """SPMD outputs are stored whole: cutting a step's outputs into per-device pieces it never needs
    was the executor's largest per-step cost. A piece asked for (a per-device reader, a fetch, a
    transfer, a listing) makes them all, and the bytes are counted once throughout."""
    devices = jax.devices("cpu")[:2]
    sharding = NamedSharding(Mesh(np.array(devices), ("x",)), PartitionSpec("x"))
    cut: list[object] = []

    def counting(array: object, local: tuple[jax.Device, ...]) -> list[object]:
        cut.append(array)
        return pieces(array, local)

    store = ObjectStore(counting)
    whole = jax.device_put(np.arange(4, dtype=np.float32), sharding)
    store.put_whole("s/b", whole, sharding, (3, 5), tuple(devices), 8)
    assert (store.nbytes, len(store), cut) == (16, 2, []), "held whole: no piece made"
    values = store.values(["s/b/5", "s/b/3"])
    assert values is not None and [v.tolist() for v in values] == [[2.0, 3.0], [0.0, 1.0]]
    assert [v.devices() for v in values] == [{devices[1]}, {devices[0]}]
    assert len(cut) == 1 and store.nbytes == 16 and len(store) == 2
    assert store.whole("s/b", sharding, (3, 5)) is whole, "kept beside its pieces for SPMD readers"
    store.consume("s/b/3")  # a per-device reader took a piece over: the whole is no longer whole
    assert store.whole("s/b", sharding, (3, 5)) is None and store.nbytes == 8
    store.put_whole("s/c", whole, sharding, (3, 5), tuple(devices), 8)
    store.consume("s/c/3")  # an SPMD reader took the whole over (donated): all its bytes went
    assert store.nbytes == 8 and store.values(["s/c/5"]) is None and len(cut) == 1
    store.put_whole("s/d", whole, sharding, (3, 5), tuple(devices), 8)
    assert sorted(k for k, _, _ in store.held()) == ["s/b/5", "s/d/3", "s/d/5"] and store.nbytes == 24
    store.delete(["s/b", "s/d"])
    assert store.nbytes == 0 and len(store) == 0


@pytest.mark.asyncio
async def test_a_receive_posted_before_a_whole_lands_gets_its_piece() -> None:
    devices = jax.devices("cpu")[:2]
    sharding = NamedSharding(Mesh(np.array(devices), ("x",)), PartitionSpec("x"))
    store = ObjectStore(pieces)
    early = store.get("s/b/1")  # an early fetch, before the computation making it landed
    whole = jax.device_put(np.arange(2, dtype=np.float32), sharding)
    store.put_whole("s/b", whole, sharding, (0, 1), tuple(devices), 4)
    assert early.done() and early.result().tolist() == [1.0]
    assert store.nbytes == 8 and (await store.get("s/b/0")).tolist() == [0.0]


@pytest.mark.asyncio
async def test_completions_leave_after_the_early_fetch_their_last_output_woke() -> None:
    """The executor reports a chain's completions with ``after_wakeups``, queued at its first
    node: the fetch its last output woke still replies first (plain ``call_soon`` would not)."""
    loop = asyncio.get_running_loop()
    for defer, expected in ((after_wakeups, ["value", "completions"]),
                            (loop.call_soon, ["completions", "value"])):
        sent: list[str] = []
        last_output = loop.create_future()
        reported = asyncio.Event()

        async def fetch(output: asyncio.Future[None] = last_output, sent: list[str] = sent) -> None:
            await output
            sent.append("value")

        fetching = asyncio.create_task(fetch())
        await asyncio.sleep(0)  # the fetch waits for the output (a posted receive)

        def report(sent: list[str] = sent, reported: asyncio.Event = reported) -> None:
            sent.append("completions")
            reported.set()

        defer(report)  # the chain's first node completes
        last_output.set_result(None)  # ... and, in the same turn, its last one
        await asyncio.wait_for(asyncio.gather(fetching, reported.wait()), 5)
        assert sent == expected, defer


@pytest.mark.asyncio
async def test_an_spmd_reader_waits_for_an_input_whole_without_cutting_it() -> None:
    """A gang's steps run on device threads, so the next step often waits for its inputs: it waits for the
    buffer (``arrival``), not for its pieces, so the output lands whole and goes in whole."""
    devices = jax.devices("cpu")[:2]
    sharding = NamedSharding(Mesh(np.array(devices), ("x",)), PartitionSpec("x"))
    cut: list[object] = []
    store = ObjectStore(lambda array, local: cut.append(array) or pieces(array, local))
    arrived = store.arrival("s/b")
    assert not arrived.done() and store.arrival("s/b") is arrived
    store.put_whole("s/b", jax.device_put(np.arange(2, dtype=np.float32), sharding), sharding, (0, 1),
                    tuple(devices), 4)
    assert arrived.done() and cut == [] and store.whole("s/b", sharding, (0, 1)) is not None
    assert store.arrival("s/b").done(), "here already"
    settles: list[Callable[[ObjectStore], object]] = [
        lambda st: st.put("s/c/0", np.zeros(1), 4), lambda st: st.fail("s/c/0", PwmeshError("lost")),
        lambda st: st.delete(["s/c"])]
    for settle in settles:
        store = ObjectStore(pieces)
        arrived = store.arrival("s/c")
        settle(store)
        assert arrived.done(), "a piece, a failure or a delete ends the wait: the reader then reads pieces"
    store = ObjectStore(pieces)
    store.arrival("s/d")
    assert store.drop_pending() == 1 and store.deleted("s/d/0"), "a cancelled run's awaited buffer goes"


@pytest.mark.parametrize("fast", [True, False], ids=["jax-internal", "public"])
@pytest.mark.parametrize("value", [
    np.arange(12, dtype=np.int32).reshape(3, 4), np.float32(2.5) * np.ones((2, 3), np.float32),
    np.array(True), np.zeros((0, 5), np.float32), np.arange(4, dtype=jnp.bfloat16),
], ids=["int32", "float32", "bool-scalar", "empty", "bfloat16"])
def test_a_put_copies_onto_the_device_what_device_put_would(monkeypatch, fast, value):
    """``copied_to`` (a put's small arrays) gives what ``jax.device_put`` gives: the same values, dtype,
    shape, device and strong type, through JAX's internal batched copy or, without it, the public call."""
    from pwmesh.executor import calls
    if not fast:
        monkeypatch.setattr(calls, "_batched_device_put", None)
    device = jax.devices()[-1]
    got = calls.copied_to(value, jax.sharding.SingleDeviceSharding(device))
    want = jax.device_put(value, device)
    assert (got.dtype, got.shape, got.weak_type, got.devices()) == (want.dtype, want.shape, want.weak_type, {device})
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.committed
