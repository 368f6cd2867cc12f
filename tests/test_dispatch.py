"""Parallel asynchronous dispatch, and its sequential fallback after a data-dependent step.

A program ``slow`` (host A) -> ``after`` (host B): with parallel dispatch, B holds
its computation (inputs posted) while A is still computing; behind a ``pw.host``
step whose output shape depends on the data, nothing reaches B until that step ran.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pwmesh as pw
from helpers import last_event, slow
from pwmesh.wire.messages import ProgramSpec, RegisterProgram, RunProgram, ValueSpec


def _part_arrived(address: str, executor: str) -> float:
    return last_event(address, executor, "Received(message=exec.enqueue")


def _computed(address: str, executor: str) -> float:
    return last_event(address, executor, "Completion")


@pytest.fixture
def two_slices(client: pw.Client) -> tuple[pw.Slice, pw.Slice]:
    devs = client.make_virtual_device_set()
    a, b = devs.add_slice(devices=1, island=0), devs.add_slice(devices=1, island=1)
    assert a.devices[0].executor != b.devices[0].executor
    return a, b


def test_parallel_dispatch_queues_successors_before_predecessors_run(
        cluster: pw.LocalCluster, two_slices: tuple[pw.Slice, pw.Slice]) -> None:
    a, b = two_slices
    remote_slow = pw.pmap(slow, devices=a)
    after = pw.pmap(lambda s: s + 1.0, devices=b)

    @pw.program
    def f(v):
        return after(remote_slow(v))

    np.asarray(f(np.ones(1)))  # compile both first
    y = f(np.ones(1))  # returns at once: futures
    assert not y.is_ready()
    assert np.isfinite(np.asarray(y)).all()
    # B held its part, waiting for A's output, before A's computation was done (the event logs, read
    # afterwards: sampling the executors while A computes can miss the window on two busy cores).
    host_a, host_b = a.devices[0].executor, b.devices[0].executor
    assert _part_arrived(cluster.address, host_b) < _computed(cluster.address, host_a)


def test_a_data_dependent_step_makes_what_follows_sequential(
        cluster: pw.LocalCluster, two_slices: tuple[pw.Slice, pw.Slice]) -> None:
    a, b = two_slices
    remote_slow = pw.pmap(slow, devices=a)
    double = pw.pmap(lambda r: r * 2.0, devices=b)
    # Keeps a data-dependent number of columns: no shape is known before the value is.
    keep = pw.host(lambda x: np.repeat(x, 3, axis=0)[None, : 1 + int(x[0] > 0)])

    @pw.program
    def f(v):
        return double(keep(remote_slow(v)))

    host_a, host_b = a.devices[0].executor, b.devices[0].executor
    value = np.asarray(f(np.ones(1)))
    # Read from the executors' event logs afterwards, not sampled while A computes (a window that two
    # busy cores can make a poll miss): B's part, the step after the host function, left only once A's
    # computation was done.
    assert _part_arrived(cluster.address, host_b) > _computed(cluster.address, host_a)
    assert value.shape == (1, 2)  # x > 0 kept two columns
    assert np.isfinite(value).all()
    # Outside a program, a host function just runs on fetched values.
    assert keep(np.zeros(1)).shape == (1, 1)


# --------------------------------------------------------------- registered programs


def _session(client: pw.Client) -> Any:
    (info,) = [s for s in client.status().sessions if s.session_id == client.session_id]
    return info


def test_a_program_is_registered_once_and_lowered_once(client: pw.Client) -> None:
    """Each run names its traced program by id; the proxy lowers it once and reuses the lowering."""
    sl = client.make_virtual_device_set().add_slice(devices=2)
    inc = pw.pmap(lambda v: v + 1.0, devices=sl)

    @pw.program
    def twice(v):
        return inc(inc(v))

    x = client.put(np.zeros(2, np.float32), sl, spec=P("x"))  # laid out as inc's outputs: one signature
    for i in range(3):
        x = twice(x)
        np.testing.assert_array_equal(np.asarray(x), np.full(2, 2.0 * (i + 1), np.float32))
    for _ in range(3):
        x = inc(x)  # called outside a program: a one-node program of its own, registered too
    np.testing.assert_array_equal(np.asarray(x), np.full(2, 9.0, np.float32))
    info = _session(client)
    assert (info.registered, info.lowered, info.reused) == (2, 2, 4)


def test_a_run_of_an_unknown_program_fails_its_outputs(client: pw.Client) -> None:
    """Never registered, or refused at registration: the outputs carry why, and the session goes on."""
    sl = client.make_virtual_device_set().add_slice(devices=1)
    client.conn.post(RegisterProgram(program_id="x" * 500, program=ProgramSpec(values=[], nodes=[], inputs=[],
                                                                               outputs=[])))
    for program_id in ("never-registered", "x" * 500):
        buffer_id = client.new_buffer_id()
        client.conn.post(RunProgram(program_id=program_id, inputs=[], outputs=[buffer_id]))
        with pytest.raises(pw.NotFound, match="never registered"):
            np.asarray(pw.Array(client.session, buffer_id, (1,), np.dtype(np.float32), pw.SliceSharding(sl, P())))
    # A registered program that is not valid fails when it runs, with what is wrong with it.
    bad = ProgramSpec(values=[ValueSpec(shape=[1], dtype="float32", shards=1)], nodes=[], inputs=[], outputs=[0])
    client.conn.post(RegisterProgram(program_id="bad", program=bad))
    buffer_id = client.new_buffer_id()
    client.conn.post(RunProgram(program_id="bad", inputs=[], outputs=[buffer_id]))
    with pytest.raises(pw.InvalidArgument, match="never defined"):
        np.asarray(pw.Array(client.session, buffer_id, (1,), np.dtype(np.float32), pw.SliceSharding(sl, P())))
    inc = pw.pmap(lambda v: v + 1.0, devices=sl)
    np.testing.assert_array_equal(np.asarray(inc(np.zeros(1, np.float32))), np.ones(1, np.float32))
