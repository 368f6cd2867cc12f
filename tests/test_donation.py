"""Donation inside the executor and the proxy, without daemons.

The executor part drives a real ``Runner`` (real JAX on the 2 CPU devices of this
process, a real object store): a computation that may consume its input hands the
buffer to XLA (aliased into an output here), and the store drops it and its bytes;
one told to keep it (someone else still reads it) leaves it. The proxy part checks
when a donated buffer may be consumed at all.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec
from test_fast_path import Recorder, device_loops

from pwmesh.errors import InvalidArgument
from pwmesh.executor import state as executor_state
from pwmesh.executor.functions import FunctionCache
from pwmesh.executor.runner import Runner
from pwmesh.executor.store import ObjectStore
from pwmesh.proxy.intake import bind
from pwmesh.proxy.session import Buffer, Session
from pwmesh.wire.messages import Computation, NodeSpec, ProgramInput, ProgramSpec, RunProgram, ShardRun, ValueSpec

pytestmark = pytest.mark.timeout(60)

ROWS = 4  # per device


def _spmd_update() -> bytes:
    """``(w, g) -> (w - 0.5 g, sum(w))`` over a 2-device mesh, rows split: w's buffer can become the new w's."""
    mesh = AbstractMesh((2,), ("x",))
    rows, whole = NamedSharding(mesh, PartitionSpec("x")), NamedSharding(mesh, PartitionSpec())
    avals = [jax.ShapeDtypeStruct((2 * ROWS, 8), jnp.float32, sharding=rows)] * 2
    fn = jax.jit(lambda w, g: [w - 0.5 * g, w.sum()], out_shardings=[rows, whole])
    return bytes(export.export(fn, platforms=["cpu"])(*avals).serialize())


def _single_update() -> bytes:
    aval = jax.ShapeDtypeStruct((ROWS, 8), jnp.float32)
    return bytes(export.export(jax.jit(lambda w: [w * 2.0]), platforms=["cpu"])(aval).serialize())


def _update(run: str, donate: list[int], w: str = "w") -> Computation:
    return Computation(node=0, fn_id="update", executor_id="e", control="c", spmd=True, donate=donate,
                       runs=[ShardRun(device=0, shard=0, count=2)], inputs=[w, "g"], outputs=[f"{run}/w", f"{run}/s"])


async def _runner() -> tuple[Runner, Recorder]:
    devices = jax.devices("cpu")[:2]
    rec = Recorder()
    r = Runner(devices, ObjectStore(), FunctionCache(), emit=lambda *_: None, done=rec.on_done, part_done=rec.on_part)
    r.functions.register("update", _spmd_update(), spmd=True, mesh=[2], axes=["x"], donate=[0])
    r.functions.register("double", _single_update(), spmd=False, donate=[0])
    for i, d in enumerate(devices):
        r.store.put(f"g/{i}", jax.device_put(np.ones((ROWS, 8), np.float32), d), ROWS * 8 * 4)
    return r, rec


def _put_w(r: Runner, name: str = "w") -> None:
    for i, d in enumerate(r.devices):
        r.store.put(f"{name}/{i}", jax.device_put(np.full((ROWS, 8), 2.0, np.float32), d), ROWS * 8 * 4)


@pytest.mark.asyncio
async def test_a_donated_input_leaves_the_store_with_its_bytes_on_every_path() -> None:
    r, rec = await _runner()
    async with device_loops(r):
        block = ROWS * 8 * 4
        for k in range(4):  # the first compiles on a device thread; later ones take the quick paths
            _put_w(r, f"w{k}")
            before = r.memory.stored
            r.enqueue_all(f"r{k}", "p", [_update(f"r{k}", donate=[0], w=f"w{k}")])
            await rec.part(f"r{k}")
            assert all(w.error is None for w in rec.done), [w.error for w in rec.done]
            assert r.store.values([f"w{k}/0"]) is None and r.store.values([f"w{k}/1"]) is None, "consumed"
            # The new w took the donated buffers' place: only the scalar sum is new (4 bytes a device).
            assert r.memory.stored == before - 2 * block + 2 * block + 2 * 4
            new = r.store.values([f"r{k}/w/0", f"r{k}/w/1"])
            assert new is not None and all(np.all(np.asarray(v) == 1.5) for v in new)


@pytest.mark.asyncio
async def test_an_input_it_must_keep_stays() -> None:
    r, rec = await _runner()
    async with device_loops(r):
        _put_w(r)
        r.enqueue_all("r1", "p", [_update("r1", donate=[])])  # the proxy said: someone else reads it
        await rec.part("r1")
        kept = r.store.values(["w/0", "w/1"])
        assert kept is not None and all(not v.is_deleted() for v in kept)


@pytest.mark.asyncio
async def test_a_per_device_function_consumes_its_input_too() -> None:
    r, rec = await _runner()
    async with device_loops(r):
        r.store.put("v/0", jax.device_put(np.ones((ROWS, 8), np.float32), r.devices[0]), ROWS * 8 * 4)
        comp = Computation(node=0, fn_id="double", executor_id="e", control="c", donate=[0],
                           runs=[ShardRun(device=0, shard=0)], inputs=["v"], outputs=["r1/v"])
        r.enqueue_all("r1", "p", [comp])
        await rec.part("r1")
        assert r.store.values(["v/0"]) is None
        (out,) = r.store.values(["r1/v/0"]) or [None]
        np.testing.assert_array_equal(np.asarray(out), np.full((ROWS, 8), 2.0))


@pytest.mark.asyncio
async def test_what_a_computation_read_last_leaves_the_store_once_it_ran() -> None:
    """``Computation.frees``: its donated state and a batch it alone reads are deleted here as it completes (no
    delete comes from the proxy for them), whichever path runs it; what it was not told to free stays."""
    r, rec = await _runner()
    async with device_loops(r):
        block = ROWS * 8 * 4
        for k in range(4):  # the first compiles on a device thread; later ones take the quick paths
            _put_w(r, f"w{k}")
            for i, d in enumerate(r.devices):
                r.store.put(f"b{k}/{i}", jax.device_put(np.ones((ROWS, 8), np.float32), d), block)
            before = r.memory.stored
            comp = _update(f"r{k}", donate=[0], w=f"w{k}")
            comp.inputs[1], comp.frees = f"b{k}", [0, 1]
            r.enqueue_all(f"r{k}", "p", [comp])
            await rec.part(f"r{k}")
            assert all(w.error is None for w in rec.done), [w.error for w in rec.done]
            for key in (f"w{k}/0", f"w{k}/1", f"b{k}/0", f"b{k}/1"):
                assert r.store.values([key]) is None and r.store.deleted(key), key
            assert r.memory.stored == before - 2 * block + 2 * 4, "the batch's bytes went; the new w took w's"
        assert r.store.values(["g/0", "g/1"]) is not None, "read, not freed: it stays"


@pytest.mark.asyncio
async def test_a_computation_that_failed_frees_nothing() -> None:
    r, rec = await _runner()
    async with device_loops(r):
        for i, d in enumerate(r.devices):  # the wrong shape: the call fails
            r.store.put(f"bad/{i}", jax.device_put(np.ones((ROWS + 1, 8), np.float32), d), (ROWS + 1) * 8 * 4)
        _put_w(r)
        comp = _update("r1", donate=[0])
        comp.inputs[1], comp.frees = "bad", [0, 1]
        r.enqueue_all("r1", "p", [comp])
        await rec.part("r1")
        (work,) = rec.done
        assert work.error is not None
        assert r.store.values(["bad/0", "bad/1"]) is not None and not r.store.deleted("bad/0")
        assert r.store.values(["w/0", "w/1"]) is not None, "not run: not consumed, and left for the proxy"


# ------------------------------------------------------------------ the proxy: may it be consumed?


def _program() -> ProgramSpec:
    value = ValueSpec(shape=[4], dtype="float32", shards=1)
    return ProgramSpec(values=[value, value], inputs=[0], outputs=[1],
                       nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1], donate=[0])])


@pytest.mark.asyncio
async def test_a_donated_buffer_is_consumed_only_when_nobody_else_reads_it() -> None:
    # (async: a Buffer's readiness future belongs to the running loop)
    session = Session(session_id="s1", name="t", peer=b"p")
    buf = Buffer.new("b1.0", ValueSpec(shape=[4], dtype="float32", shards=1), client_ref=True)
    session.buffers[7] = buf
    run = RunProgram(inputs=[ProgramInput(buffer=7)], outputs=[8], program_id="x")
    assert bind(session, run, _program()).keep == frozenset(), "nobody else: the executors may consume it"
    buf.readers = 1  # another run in flight reads it, or a fetch is under way
    assert bind(session, run, _program()).keep == frozenset({0})
    buf.readers = 0
    buf.read_by_its_run = True  # the run that made it still has nodes that read it
    assert bind(session, run, _program()).keep == frozenset({0})
    session.donate(7, "run s1:3")
    with pytest.raises(InvalidArgument, match="buffer 7 was donated to run s1:3 and can no longer be used"):
        bind(session, run, _program())


def _slow_update() -> bytes:
    """``update``, but a few milliseconds a call: it is streamed to the devices, not run on the loop."""
    mesh = AbstractMesh((2,), ("x",))
    rows, whole = NamedSharding(mesh, PartitionSpec("x")), NamedSharding(mesh, PartitionSpec())
    avals = [jax.ShapeDtypeStruct((2 * ROWS, 8), jnp.float32, sharding=rows)] * 2

    def update(w: jax.Array, g: jax.Array) -> list[jax.Array]:
        m = jnp.full((96, 96), 0.01, jnp.float32)
        busy = jax.lax.fori_loop(0, 60, lambda i, a: jnp.tanh(a @ m), jnp.ones((96, 96), jnp.float32)).sum()
        return [w - 0.5 * g + 0.0 * busy, w.sum()]

    return bytes(export.export(jax.jit(update, out_shardings=[rows, whole]), platforms=["cpu"])(*avals).serialize())


@pytest.mark.asyncio
async def test_a_streamed_chain_consumes_outputs_still_being_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Step k + 1 takes step k's output before it lands (as jax.jit does with donated arguments), and
    the landing of step k then stores nothing of it: no error, the right values, bytes that stay flat."""
    # Every step must be streamed. The estimate that decides "inline or streamed" (tested in
    # test_fast_path.py) put a later step inline in fresh-clone CI: ``_slow_update`` takes ~1.6 ms a
    # shard here, and a quicker CPU, or a landing timed low, brings it under the inline threshold.
    monkeypatch.setattr(executor_state, "runs_inline", lambda timing, seconds, asynchronous=False: False)
    r, rec = await _runner()
    r.functions.register("slow", _slow_update(), spmd=True, mesh=[2], axes=["x"], donate=[0])
    async with device_loops(r):
        _put_w(r, "w")
        steps = 6
        comps = []
        for k in range(steps):  # node k reads what node k - 1 made (the first reads w)
            comp = _update(f"r{k}", donate=[0], w="w" if k == 0 else f"r{k - 1}/w")
            comp.fn_id, comp.node = "slow", k
            comps.append(comp)
        for k in range(2):  # compile and time it first, so the chain is streamed
            _put_w(r, f"warm{k}")
            r.enqueue_all(f"warm{k}", "p", [dataclasses.replace(comps[0], inputs=[f"warm{k}", "g"],
                                                                 outputs=[f"warm{k}/w", f"warm{k}/s"])])
            await rec.part(f"warm{k}")
        rec.done.clear()
        before = r.memory.stored
        r.enqueue_all("chain", "p", comps)
        await rec.part("chain")
        assert all(w.error is None for w in rec.done), [w.error for w in rec.done]
        assert all(w.streamed for w in rec.done), "every step was streamed"
        for k in range(steps - 1):
            assert r.store.values([f"r{k}/w/0"]) is None, f"step {k}'s output was consumed by step {k + 1}"
        last = r.store.values([f"r{steps - 1}/w/0", f"r{steps - 1}/w/1"])
        assert last is not None and all(np.all(np.asarray(v) == 2.0 - 0.5 * steps) for v in last)
        block = ROWS * 8 * 4
        assert r.memory.stored == before - 2 * block + 2 * block + steps * 2 * 4, "w's bytes, once; the sums"
