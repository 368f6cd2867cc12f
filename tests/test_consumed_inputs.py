"""What a run's last reader consumes is deleted by its executor, with no message from the proxy (issue #29 item 3).

A training step donates its state and reads a batch sent with the run; nothing reads either after it. The
lowering marks them on the computation (``Computation.frees``); its executor deletes them once it has run without
error; and the proxy, at a run's end, sends no delete for them when their node succeeded and nobody else holds
them. A node that failed, an aborted run, or a copy held elsewhere is deleted by the proxy as before.

Pure, like ``test_proxy_state`` (the RM's and the island scheduler's real cores; the executors' reports played
by the test). ``test_donation`` checks the executor's part with a real ``Runner``; ``test_e2e`` nothing new: the
real cluster's training loop is ``test_a_training_loop_sends_no_delete_a_step`` below.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import test_lowering as lowering
from jax.sharding import PartitionSpec as P
from test_proxy_state import CLIENT, World, freed_buffers, sent

import pwmesh as pw
from helpers import eventually
from pwmesh.errors import PwmeshError
from pwmesh.ir.keys import function_id
from pwmesh.proxy.state import Inbound
from pwmesh.scheduler.completions import IslandCompletions
from pwmesh.wire.codec import unpack_records
from pwmesh.wire.messages import (
    Computation,
    CreateSlice,
    ErrorInfo,
    InstallTemplate,
    NodeDone,
    NodeSpec,
    Ok,
    ProgramInput,
    ProgramSpec,
    PutBuffer,
    RegisterProgram,
    RegisterProgramFunction,
    RunProgram,
    SliceCreated,
    ValueSpec,
)

pytestmark = pytest.mark.timeout(60)


def step_program(slice_id: int, fn: str, step_slice: int | None = None) -> ProgramSpec:
    """``(w, batch) -> (w', loss)``, ``w`` donated; every value over 4 devices but the scalar loss's 4 copies."""
    values = [ValueSpec(shape=[8, 2], dtype="float32", shards=4) for _ in range(4)]
    node = NodeSpec(fn_id=fn, slice_id=slice_id if step_slice is None else step_slice, inputs=[0, 1], outputs=[2, 3],
                    donate=[0])
    return ProgramSpec(values=values, inputs=[0, 1], outputs=[2, 3], nodes=[node])


def setup(world: World, *, elsewhere: bool = False) -> tuple[str, int, str]:
    """A session whose buffer 1 is ``w``, and program "step" registered; ``elsewhere``: ``w`` lives on another
    slice than the step's (the step reads a copy)."""
    sid, slice_id = world.open()
    step_slice = slice_id
    if elsewhere:
        created = world.ask(CLIENT, CreateSlice(devices=4))
        assert isinstance(created, SliceCreated)
        step_slice = created.slice.slice_id
    fn = function_id(b"step", False, donate=[0])
    assert world.ask(CLIENT, RegisterProgramFunction(fn_id=fn, exported=b"step", slice_id=step_slice, spmd=False,
                                                     donate=[0])) == Ok()
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    world.handle(Inbound(CLIENT, RegisterProgram(program_id="step", program=step_program(slice_id, fn, step_slice))))
    return sid, slice_id, fn


def computations(install: InstallTemplate) -> list[Computation]:
    return [c for part in install.parts for c in unpack_records(part.computations, Computation, "a part")]


def run(world: World, w: int, outputs: list[int], error: PwmeshError | None = None) -> tuple[list[Any], list[str]]:
    """One step on buffer ``w`` and a batch: what the proxy sent (the executors' reports in), and the names of
    ``w``, of the batch, then of what lowering derived (a copy). ``error``: the step fails on its first executor."""
    session = world.proxy.sessions[CLIENT]
    w_name = session.buffers[w].name
    actions = world.handle(Inbound(CLIENT, RunProgram(
        inputs=[ProgramInput(buffer=w), ProgramInput(array=np.zeros((8, 2), np.float32))], outputs=outputs,
        program_id="step")))
    ((_, the_run),) = world.proxy.runs.values()
    temporaries = [b.name for b in the_run.temporaries]  # host data first; then what lowering derived
    out = list(actions)
    for k, done in enumerate(world.executors(actions)):
        if error is not None and k == 0:
            done = NodeDone(run_id=done.run_id, nodes=done.nodes, executor_id=done.executor_id,
                            error=ErrorInfo.of(error))
        out += world.handle(Inbound(b"ex", done))
    assert not world.proxy.runs
    return out, [w_name, *temporaries]


def test_a_steps_donated_state_and_batch_are_freed_by_its_executors_not_the_proxy() -> None:
    world = World()
    sid, _, _ = setup(world)
    first, (w, batch) = run(world, 1, [2, 3])
    (install,) = sent(first, InstallTemplate)
    comps = computations(install.message)
    assert comps and all(c.frees == [0, 1] and c.donate == [0] for c in comps), "its last reader frees both"
    freed = freed_buffers(first)
    assert f"{sid}/{w}" not in freed and f"{sid}/{batch}" not in freed
    # The next step, from the template, donates the new state: neither it nor its batch is named again.
    second, (w2, batch2) = run(world, 2, [4, 5])
    assert not freed_buffers(second) & {f"{sid}/{w2}", f"{sid}/{batch2}"}
    session = world.proxy.sessions[CLIENT]
    assert 1 not in session.buffers and 2 not in session.buffers, "consumed: the client's reference ended"
    assert {3, 4, 5} <= set(session.buffers)


def test_a_failed_step_leaves_what_it_read_for_the_proxy_to_delete() -> None:
    world = World()
    sid, _, _ = setup(world)
    actions, (w, batch) = run(world, 1, [2, 3], error=PwmeshError("boom"))
    assert {f"{sid}/{w}", f"{sid}/{batch}"} <= freed_buffers(actions), "the executor that failed deleted nothing"


def test_a_donated_buffer_read_as_a_copy_elsewhere_is_still_deleted_where_it_lives() -> None:
    world = World()
    sid, _, _ = setup(world, elsewhere=True)
    actions, (w, _, copy) = run(world, 1, [2, 3])
    (install,) = sent(actions, InstallTemplate)
    assert all(c.frees == [0, 1] for c in computations(install.message))
    freed = freed_buffers(actions)
    assert f"{sid}/{w}" in freed, "its executors consumed a copy: the original is the proxy's to delete"
    assert f"{sid}/{copy}" not in freed, "the copy its executors consumed is gone with it"


def test_a_donated_value_whose_other_shard_an_ancestor_may_still_read_there_is_not_freed_by_its_executor() -> None:
    """A value made on [X:0, Y:0] and donated by a node on [Y:1, X:1]: X holds shard 0 (made there, read by an
    ancestor on the first slice) and a copy of shard 1 (the donating node's). The executor deletes a buffer
    whole, so it must not delete this one: the proxy does, once the run is over. Laid out on the same
    executors, it is the donating node's alone and freed by it."""
    def program(step_slice: int) -> ProgramSpec:
        nodes = [NodeSpec(fn_id="a", slice_id=1, inputs=[0], outputs=[1]),
                 NodeSpec(fn_id="c", slice_id=1, inputs=[1], outputs=[2]),
                 NodeSpec(fn_id="b", slice_id=step_slice, inputs=[1, 2], outputs=[3], donate=[0])]
        return ProgramSpec(values=[lowering.value(2) for _ in range(4)], nodes=nodes, inputs=[0], outputs=[3])

    first = lowering.make_slice(1, [("X", 0), ("Y", 0)])
    crossed = lowering.make_slice(2, [("Y", 1), ("X", 1)])
    lowered = lowering.run(program(2), [first, crossed])
    assert all(c.frees == [] for c in lowering.computations(lowered) if c.node == 2)
    assert "v1" not in lowered.frees
    alike = lowering.make_slice(2, [("X", 1), ("Y", 1)])
    lowered = lowering.run(program(2), [first, alike])
    assert all(c.frees == [0] for c in lowering.computations(lowered) if c.node == 2)
    assert lowered.frees["v1"] == (2, {lowering.control("X"), lowering.control("Y")})


def test_a_part_that_failed_whole_fails_every_node_of_it() -> None:
    """A fan-out head that cannot read its own part reports its error naming no node: the island fails every
    node of that executor's part, so the proxy neither takes them for done nor skips the frees they were to do."""
    island = IslandCompletions("tcp://sched:1")
    island.start("r1", "tcp://proxy:1", {"e0": [0, 1], "e1": [0, 1]})
    ((to, done),) = island.node_done(NodeDone(run_id="r1", nodes=[], executor_id="e0",
                                              error=ErrorInfo.of(PwmeshError("unreadable"))))
    assert to == "tcp://proxy:1" and done.nodes == [0, 1] and done.executor_id == "e0" and done.error is not None


@pytest.mark.timeout(180)
def test_a_training_loop_sends_no_delete_a_step() -> None:
    """A real cluster: ``pw.jit`` with donated state and a host batch, the losses kept. Each step used to end with
    a ``DeleteShards`` of what it consumed; now none, and the executor holds no more than the state and losses."""
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=1, devices_per_host=2, metrics=True)
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address, name="steps") as client:
        from test_metrics import scrape, value

        devs = client.make_virtual_device_set().add_slice(devices=2, mesh={"data": 2})

        def train_step(w: Any, batch: Any) -> Any:
            loss = ((batch @ w) ** 2).mean()
            return w - 0.01 * batch.T @ batch @ w, loss

        step = pw.jit(train_step, devices=devs, in_specs=(P(), P("data")), donate_argnums=0)
        w = pw.put(np.eye(4, dtype=np.float32), devs, P())
        rng = np.random.default_rng(0)
        batches = [rng.standard_normal((8, 4)).astype(np.float32) for _ in range(24)]
        losses = []
        for batch in batches[:4]:  # compiled, cached, warm
            w, loss = step(w, batch)
            losses.append(loss)
        float(losses[-1])
        executor = cluster.metrics_addresses()["island0-host0"]

        def settled() -> dict[str, float]:
            samples = scrape(executor)
            return {"deletes": value(samples, "pwmesh_messages_received_total", op="exec.delete_shards"),
                    "buffers": value(samples, "pwmesh_executor_buffers")}

        before = settled()
        for batch in batches[4:]:
            w, loss = step(w, batch)
            losses.append(loss)
        expected = [float(np.asarray(x)) for x in losses]
        after = settled()
        assert after["deletes"] == before["deletes"], "no step sent a delete"
        # What the executor holds grew by the 20 losses kept (a shard each per device), nothing else: each
        # step's consumed state and batch left it.
        assert after["buffers"] - before["buffers"] == 20 * 2
        # Plain JAX's losses: the state went through every step.
        ref, ref_losses = np.eye(4, dtype=np.float32), []
        for batch in batches:
            loss = ((batch @ ref) ** 2).mean()
            ref = ref - 0.01 * batch.T @ batch @ ref
            ref_losses.append(float(loss))
        np.testing.assert_allclose(expected, ref_losses, rtol=1e-5)
        del losses, loss
        eventually(lambda: settled()["buffers"] == before["buffers"] - 4 * 2, 30)
