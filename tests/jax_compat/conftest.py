"""The clusters JAX's ported tests run on, shared by every file here (started once per layout).

Each case runs on both layouts: one executor holding every device of the mesh, and two executors
in one JAX group holding half each (an SPMD computation then spans two processes, as across hosts).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import pwmesh as pw

LAYOUTS = ["one-executor", "two-executors-one-group"]


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
