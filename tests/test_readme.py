"""The README's training example runs as written (against the 8-device test cluster)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pwmesh as pw

README = Path(__file__).resolve().parent.parent / "README.md"


def block_under(heading: str) -> str:
    """The first Python block after ``heading``."""
    text = README.read_text()
    found = re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S)
    assert found is not None, f"no python block under {heading!r}"
    return found.group(1)


@pytest.mark.timeout(120)
def test_the_training_example_trains(wide_cluster: pw.LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PWMESH_ADDRESS", wide_cluster.address)  # its pw.connect() finds the cluster there
    rng = np.random.default_rng(0)
    scope = {"batches": [rng.standard_normal((8, 64)).astype(np.float32) for _ in range(5)]}
    try:
        exec(compile(block_under("## Training a model"), str(README), "exec"), scope)  # noqa: S102
        assert np.isfinite(np.asarray(scope["loss"]))
        assert scope["params"]["w1"].sharding.spec == P(None, "model")
        assert scope["params"]["w2"].sharding.spec == P("model", None)
    finally:
        pw.disconnect()


@pytest.mark.timeout(300)
def test_the_training_example_trains_on_a_plain_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #27 item 6: on the default embedded cluster (2 islands x 2 hosts x 2 devices), the snippet's
    2x2 mesh spans two executors, which form their island's JAX group by default."""
    monkeypatch.delenv("PWMESH_ADDRESS", raising=False)  # its pw.connect() starts the embedded cluster
    rng = np.random.default_rng(0)
    scope = {"batches": [rng.standard_normal((8, 64)).astype(np.float32) for _ in range(5)]}
    try:
        exec(compile(block_under("## Training a model"), str(README), "exec"), scope)  # noqa: S102
        assert np.isfinite(np.asarray(scope["loss"]))
        executors = {d.executor for d in scope["params"]["w1"].sharding.slice.devices}
        assert len(executors) == 2, f"the mesh spans two hosts: {executors}"
    finally:
        pw.disconnect()


@pytest.mark.timeout(120)
def test_the_resharding_example_reshards(wide_cluster: pw.LocalCluster) -> None:
    code = block_under("**Resharding.**").strip().splitlines()
    *body, refused = code
    assert "InvalidArgument" in refused
    with pw.Client(wide_cluster.address, name="readme") as client:
        scope = {"devs": client.make_virtual_device_set(), "np": np, "pw": pw, "P": P}
        exec(compile("\n".join(body), str(README), "exec"), scope)  # noqa: S102
        np.testing.assert_array_equal(np.asarray(scope["f"](np.ones((12, 4), np.float32))), np.full((1, 4), 24.0))
        y = scope["y"]
        assert (y.sharding.slice.mesh, y.sharding.spec) == ({"x": 3}, P("x"))
        np.testing.assert_array_equal(np.asarray(y), np.arange(12.0))
        with pytest.raises(pw.InvalidArgument, match="cannot be split"):
            exec(compile(refused, str(README), "exec"), scope)  # noqa: S102


@pytest.mark.timeout(180)
def test_the_pipeline_example_trains(wide_cluster: pw.LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PWMESH_ADDRESS", wide_cluster.address)
    code = block_under("## Pipeline-parallel training")
    assert "range(100)" in code
    scope: dict[str, object] = {}
    try:
        exec(compile(code.replace("range(100)", "range(3)"), str(README), "exec"), scope)  # noqa: S102
        assert np.isfinite(np.asarray(scope["loss"]))
        slices = scope["slices"]
        assert [sl.island for sl in slices] == [0, 0, 1, 1]  # type: ignore[attr-defined]
    finally:
        pw.disconnect()
