"""Gang scheduling end to end: the island order is what keeps overlapping collectives
from deadlocking. Four clients at once submit programs whose collectives (a psum)
span executors (one JAX group per island) and overlap on devices in seeded random
patterns, over a network that reorders messages (test-only jitter). With the
island order, all complete. With each executor ordering by arrival instead, the
same workload really deadlocks inside JAX's cross-process collectives, and the
watchdogs report which devices are stuck in which collective. No executor waits
for another before it starts a computation: the collectives synchronise. The long
version runs with ``pytest -m long`` (and ``python -m pwmesh.examples.gang_stress``)."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import pytest

import pwmesh as pw
from helpers import eventually
from pwmesh.cli.commands import fetch_status
from pwmesh.examples import gang_stress

JITTER = ("--test-enqueue-jitter-seconds", "0.02", "--test-seed", "3", "--watchdog-seconds", "1")


def _cluster(*extra: str) -> Iterator[pw.LocalCluster]:
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=3, devices_per_host=2, executor_args=(*JITTER, *extra),
                               stop_timeout_seconds=3.0, collectives=True)
    with pw.LocalCluster(spec) as c:
        yield c


@pytest.fixture
def ordered() -> Iterator[pw.LocalCluster]:
    yield from _cluster()


@pytest.fixture
def by_arrival() -> Iterator[pw.LocalCluster]:
    yield from _cluster("--test-order-by-arrival")


def test_overlapping_gangs_all_complete_in_island_order(ordered: pw.LocalCluster) -> None:
    results = gang_stress.run(ordered.address, clients=4, programs=20, seed=1, timeout_seconds=60)
    assert [(r.correct, r.programs) for r in results] == [(20, 20)] * 4


@pytest.mark.long
def test_overlapping_gangs_long(ordered: pw.LocalCluster) -> None:
    results = gang_stress.run(ordered.address, clients=8, programs=200, seed=2, timeout_seconds=600)
    assert all(r.correct == r.programs for r in results)


def _wait_for_graph(address: str) -> dict[str, set[str]]:
    """Executor -> the executors it waits for (from the watchdogs): those its devices' collectives span
    that are not in the same collective (they run another one first)."""
    status = fetch_status(address)
    stuck: dict[str, dict[str, set[str]]] = {}  # executor -> collective ("run R node N") -> executors it spans
    for stats in status.executor_stats:
        for wait in stats.gang_waits:
            found = re.search(r"in (run \S+ node \d+) .*over \d+ devices of (.*?), for ", wait)
            assert found is not None, wait
            spans = set(found.group(2).split(", "))
            stuck.setdefault(stats.executor_id, {})[found.group(1)] = spans
    return {executor: {other for label, spans in mine.items() for other in spans
                       if other != executor and label not in stuck.get(other, {})}
            for executor, mine in stuck.items()}


def _has_cycle(graph: dict[str, set[str]]) -> bool:
    def reaches(start: str, node: str, seen: set[str]) -> bool:
        for nxt in graph.get(node, ()):
            if nxt == start or (nxt not in seen and reaches(start, nxt, seen | {nxt})):
                return True
        return False

    return any(reaches(n, n, {n}) for n in graph)


@pytest.mark.long  # ~12 s: the control (the ordered run above passes in CI; this shows it could fail)
def test_without_the_island_order_the_same_workload_deadlocks(by_arrival: pw.LocalCluster) -> None:
    outcome: list[BaseException | None] = []

    def clients() -> None:
        try:
            gang_stress.run(by_arrival.address, clients=4, programs=20, seed=1, timeout_seconds=12)
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=clients)
    thread.start()
    try:
        # Executors' devices are in collectives, each waiting for an executor whose devices are
        # in another collective first: a cycle, as the watchdogs report it.
        eventually(lambda: _has_cycle(_wait_for_graph(by_arrival.address)), 11)
    finally:
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], pw.PwTimeoutError), outcome


def test_the_stress_run_reports_the_root_cause_not_a_broken_barrier(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client waiting at the start barrier only learns that another failed (or was late): the
    run raises the other's error. Clients are stand-ins here (no cluster): only run() is tested."""

    def workload(address: str, index: int, programs: int, seed: int, sizes: tuple[int, ...],
                 started: threading.Barrier, timeout_seconds: float | None) -> gang_stress.ClientResult:
        if index == 1:  # its warm-up never finished: the deadlock's symptom
            raise pw.PwTimeoutError("did not answer fetch within 1 seconds")
        started.wait(timeout=timeout_seconds)  # broken: by the abort, or by its own deadline
        return gang_stress.ClientResult(programs, programs, 0.0)

    monkeypatch.setattr(gang_stress, "client_workload", workload)
    with pytest.raises(pw.PwTimeoutError, match="fetch"):
        gang_stress.run("tcp://127.0.0.1:1", clients=3, programs=1, seed=0, timeout_seconds=5)
