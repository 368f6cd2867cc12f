"""Shared fixtures: one real local cluster per test session, a fresh client per test.

The cluster is real: a resource manager, one scheduler per island and several
executors, each its own process on 127.0.0.1, with real JAX on CPU devices.
Tests that need a cluster of another shape start their own.

Every test that uses a cluster is marked ``cluster`` here (``pytest -m "not cluster"``
runs the rest) and gets leak checks, as dask's ``gen_cluster`` tests do: the threads,
child processes, file descriptors and ZeroMQ contexts it took must be given back when
it ends, and those a longer-lived cluster fixture took when that fixture is torn down.
"""

from __future__ import annotations

import inspect
import os
import types
from collections.abc import Callable, Iterator
from typing import Any

import jax
import pytest

import pwmesh as pw
from helpers import (
    HEARTBEAT_TIMEOUT_SECONDS,
    Resources,
    check_no_leaks,
    check_released,
    eventually,
    frees_settled,
    held,
    start_zmq_garbage_collector,
    track_zmq_contexts,
)
from pwmesh.cli.commands import fetch_status

# The leak-check tests run pytest on small suites of their own.
pytest_plugins = ("pytester",)

track_zmq_contexts()  # before any test or fixture makes one
start_zmq_garbage_collector()

# In this process too (tests that drive an executor's parts directly): two CPU devices.
# The daemons set their own device count (LocalCluster drops XLA_FLAGS for them).
jax.config.update("jax_num_cpu_devices", 2)

# Two islands x two hosts x two devices: enough for three slices on three
# executors across both islands (Figure 2) and for same-host collectives.
SPEC = pw.LocalClusterSpec(islands=2, hosts_per_island=2, devices_per_host=2, session_timeout_seconds=30.0)

# One executor of eight devices per island: every slice of up to 8 devices fits on one host
# of either island (SPMD over a 2x2 mesh included), and island 0 -> island 1 is always
# another executor. Slices may share devices (placement balances load).
WIDE = pw.LocalClusterSpec(islands=2, hosts_per_island=1, devices_per_host=8)


@pytest.fixture(autouse=True)
def no_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The developer's ``$PWMESH_KEYS`` never reaches a test (one that needs keys says which)."""
    monkeypatch.delenv("PWMESH_KEYS", raising=False)


@pytest.fixture
def fragile() -> Iterator[pw.LocalCluster]:
    """A cluster of its own, one island of 2 hosts x 1 device, with short heartbeats: for tests that kill,
    stop or drain its daemons."""
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=1,
                               heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_SECONDS)
    with pw.LocalCluster(spec) as c:
        yield c


@pytest.fixture(scope="session")
def cluster() -> Iterator[pw.LocalCluster]:
    os.environ.pop("PWMESH_ADDRESS", None)
    with pw.LocalCluster(SPEC) as running:
        yield running


@pytest.fixture(scope="session")
def wide_cluster() -> Iterator[pw.LocalCluster]:
    os.environ.pop("PWMESH_ADDRESS", None)
    with pw.LocalCluster(WIDE) as running:
        yield running


@pytest.fixture
def client(cluster: pw.LocalCluster) -> Iterator[pw.Client]:
    """A session of its own; closing it frees its slices and buffers."""
    with pw.Client(cluster.address, name="test") as c:
        yield c


@pytest.fixture
def default_client(cluster: pw.LocalCluster) -> Iterator[pw.Client]:
    """The module-level API (pw.get, pw.make_virtual_device_set...) bound to the test cluster."""
    c = pw.connect(cluster.address, name="test-default")
    yield c
    pw.disconnect()


@pytest.fixture
def objects(cluster: pw.LocalCluster) -> Iterator[Callable[[], dict[str, int]]]:
    """Live objects per executor, from a settled start: every free issued before the test (earlier tests' on
    this shared cluster) has reached the executors (``frees_settled``; its arrays are held until the end).
    Deletes go from the proxy through the islands' schedulers (``FreeShards``), so a status request may
    overtake them: compare with ``eventually``."""
    with pw.Client(cluster.address, name="settled") as c:
        # A session an earlier test left (a client killed, say) frees its arrays when it times out: first none.
        def others() -> list[str]:
            return [f"{s.name} ({s.session_id}, {s.buffers} buffers)" for s in c.status().sessions
                    if s.session_id != c.session_id]

        try:
            eventually(lambda: not others(), 2 * SPEC.session_timeout_seconds)
        except TimeoutError:
            pytest.fail(f"sessions earlier tests left on the shared cluster did not end: {others()}")
        settled = frees_settled(c)
        yield lambda: {s.executor_id: s.objects for s in fetch_status(cluster.address).executor_stats}
        del settled


# ------------------------------------------------------------------ the cluster marker

# The fixtures above that are, or hold a session on, a cluster. A fixture that depends on
# one, or whose code starts a ``LocalCluster`` (itself or through a function of its
# module), is a cluster fixture too; so is a test whose own code starts one.
CLUSTER_FIXTURES = frozenset({"cluster", "wide_cluster", "client", "default_client", "objects", "fragile"})
CLUSTER_NAMES = frozenset({"LocalCluster", "LocalClusterSpec"})


def starts_a_cluster(func: Any, seen: set[types.CodeType] | None = None) -> bool:
    """Whether ``func``'s code names ``LocalCluster``, ``LocalClusterSpec`` or a global spec
    (``pw.connect(cluster=TINY)``), itself or through a function defined in its module."""
    func = inspect.unwrap(getattr(func, "__func__", func))
    code = getattr(func, "__code__", None)
    if code is None:
        return False
    seen = set() if seen is None else seen
    scope = getattr(func, "__globals__", {})
    codes = [code]
    while codes:
        code = codes.pop()
        if code in seen:
            continue
        seen.add(code)
        codes += [const for const in code.co_consts if isinstance(const, types.CodeType)]  # lambdas, inner defs
        for name in code.co_names:
            value = scope.get(name)
            if name in CLUSTER_NAMES or isinstance(value, pw.LocalClusterSpec):
                return True
            if (isinstance(value, types.FunctionType) and value.__module__ == func.__module__
                    and starts_a_cluster(value, seen)):
                return True
    return False


# Whether each fixture definition collected is a cluster fixture (the leak checks look them up).
_cluster_fixturedefs: dict[Any, bool] = {}


def _is_cluster_fixture(fixturedef: Any, name2fixturedefs: dict[str, Any]) -> bool:
    known = _cluster_fixturedefs.get(fixturedef)
    if known is not None:
        return known
    _cluster_fixturedefs[fixturedef] = False  # a dependency cycle ends here
    found = (fixturedef.argname in CLUSTER_FIXTURES or starts_a_cluster(fixturedef.func)
             or any(_is_cluster_fixture(defs[-1], name2fixturedefs)
                    for arg in fixturedef.argnames if (defs := name2fixturedefs.get(arg)) and defs[-1] is not fixturedef))
    _cluster_fixturedefs[fixturedef] = found
    return found


def uses_a_cluster(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    name2fixturedefs = info.name2fixturedefs if info is not None else {}
    # ``fixturenames`` is the whole closure: every fixture the test's fixtures depend on is in it.
    fixtures = [defs[-1] for name in getattr(item, "fixturenames", ()) if (defs := name2fixturedefs.get(name))]
    # Every fixture is classified (not just up to the first cluster one): the checks look them up.
    found = [_is_cluster_fixture(fixturedef, name2fixturedefs) for fixturedef in fixtures]
    return any(found) or starts_a_cluster(getattr(item, "function", None))


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if uses_a_cluster(item) and item.get_closest_marker("cluster") is None:
            item.add_marker(pytest.mark.cluster)
        # The unit a worker takes (``-n 2 --dist loadgroup``): a file, so its module-scoped clusters start once;
        # JAX's ported tests all together, so their package-scoped clusters (one per layout) start once too.
        path = item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group("jax_compat" if path.startswith("tests/jax_compat/") else path))


# ------------------------------------------------------------------ leak checks

# What each cluster fixture of a wider scope than a test took while it was set up: its
# own to hold until its teardown, which must then give all of it back.
_taken_by_fixtures: dict[Any, Resources] = {}


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: pytest.FixtureRequest) -> Any:
    if fixturedef.scope == "function" or not _cluster_fixturedefs.get(fixturedef):
        return (yield)  # a test's own fixtures are inside its check
    before = held()
    try:
        return (yield)
    finally:
        _taken_by_fixtures[fixturedef] = held() - before


def pytest_fixture_post_finalizer(fixturedef: Any, request: pytest.FixtureRequest) -> None:
    taken = _taken_by_fixtures.pop(fixturedef, None)
    if taken:
        check_released(taken, what=f"the {fixturedef.scope}-scoped fixture {fixturedef.argname!r}, torn down,")


@pytest.fixture(autouse=True)
def check_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test of a cluster gives back every thread, child process, file descriptor and ZeroMQ
    context it took (those of its function-scoped fixtures included: they end before this)."""
    if request.node.get_closest_marker("cluster") is None:
        yield
        return
    before = held()
    yield
    # A wider fixture first set up during the test (``getfixturevalue``) holds its own until its teardown.
    fixtures = Resources()
    for taken in _taken_by_fixtures.values():
        fixtures |= taken
    check_no_leaks(before, what=request.node.nodeid, allowed=fixtures)
