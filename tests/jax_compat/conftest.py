"""The clusters JAX's ported tests run on, shared by every file here (started once per layout).

Each case runs on both layouts: one executor holding every device of the mesh, and two executors
in one JAX group holding half each (an SPMD computation then spans two processes, as across hosts).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import jax
import pytest
from jax._src import compilation_cache

import pwmesh as pw

LAYOUTS = ["one-executor", "two-executors-one-group"]


@pytest.fixture(scope="package", autouse=True)
def compiled_once_for_both_layouts() -> Iterator[None]:
    """JAX's persistent compilation cache, in this process only, while these cases run: ``pw.jit`` compiles each
    function here once to learn the layout XLA gives its outputs (``client/export.py``, ``_propagated``), the
    same module on either layout (the same mesh shape), so a case's second layout finds what its first
    compiled (about a tenth of the package's CPU time). The cache is the package's own temporary folder, and
    is switched off again at its end: other tests compile as before. The executors are not affected."""
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    before = {key: getattr(jax.config, key) for key in keys}
    with tempfile.TemporaryDirectory(prefix="pwmesh-jax-compat-cache-") as folder:
        compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", folder)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        try:
            yield
        finally:
            for key, value in before.items():
                jax.config.update(key, value)
            compilation_cache.reset_cache()


def _cluster(layout: str, devices: int) -> pw.LocalCluster:
    if layout == "one-executor":
        return pw.LocalCluster(pw.LocalClusterSpec(islands=1, hosts_per_island=1, devices_per_host=devices))
    return pw.LocalCluster(pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=devices // 2,
                                               collectives=True))


def _layout(layout: str, mesh: dict[str, int]) -> Iterator[tuple[pw.Client, pw.Slice]]:
    devices = mesh["x"] * mesh["y"]
    with _cluster(layout, devices) as cluster, pw.Client(cluster.address, name="jax-compat") as client:
        sl = client.make_virtual_device_set().add_slice(devices=devices, mesh=mesh)
        assert len(sl.executors) == (1 if layout == "one-executor" else 2)
        yield client, sl


@pytest.fixture(scope="package", params=LAYOUTS)
def layout_2x1(request: pytest.FixtureRequest) -> Iterator[tuple[pw.Client, pw.Slice]]:
    """A client and a 2 x 1 mesh ('x', 'y'), as upstream's ``jtu.with_mesh([('x', 2), ('y', 1)])``."""
    yield from _layout(request.param, {"x": 2, "y": 1})


@pytest.fixture
def mesh_2x1(layout_2x1: tuple[pw.Client, pw.Slice]) -> pw.Slice:
    return layout_2x1[1]


@pytest.fixture(scope="package", params=LAYOUTS)
def layout_2x2(request: pytest.FixtureRequest) -> Iterator[tuple[pw.Client, pw.Slice]]:
    """A client and a 2 x 2 mesh ('x', 'y'), as upstream's ``jtu.with_mesh([('x', 2), ('y', 2)])``."""
    yield from _layout(request.param, {"x": 2, "y": 2})


@pytest.fixture
def mesh_2x2(layout_2x2: tuple[pw.Client, pw.Slice]) -> pw.Slice:
    return layout_2x2[1]
