"""Parallel asynchronous dispatch, and its sequential fallback after a data-dependent step.

A program ``slow`` (host A) -> ``after`` (host B): with parallel dispatch, B holds
its computation (inputs posted) while A is still computing; behind a ``pw.host``
step whose output shape depends on the data, nothing reaches B until that step ran.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import pwmesh as pw
from helpers import eventually, slow
from pwmesh.cli.commands import fetch_status


def _outstanding(address: str) -> dict[str, int]:
    return {s.executor_id: s.outstanding for s in fetch_status(address).executor_stats}


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
    host_a, host_b = a.devices[0].executor, b.devices[0].executor
    eventually(lambda: _outstanding(cluster.address)[host_a] == 1, 30)
    # A is still computing, and B already holds its part, waiting for A's output.
    assert _outstanding(cluster.address)[host_b] == 1
    assert not y.is_ready()
    assert np.isfinite(np.asarray(y)).all()


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
    result: list[Any] = []
    caller = threading.Thread(target=lambda: result.append(np.asarray(f(np.ones(1)))))
    caller.start()
    try:
        eventually(lambda: _outstanding(cluster.address)[host_a] == 1, 30)
        # A computes; the step after the host function cannot have been sent anywhere yet.
        assert _outstanding(cluster.address)[host_b] == 0
    finally:
        caller.join(timeout=60)
    (value,) = result
    assert value.shape == (1, 2)  # x > 0 kept two columns
    assert np.isfinite(value).all()
    # Outside a program, a host function just runs on fetched values.
    assert keep(np.zeros(1)).shape == (1, 1)
