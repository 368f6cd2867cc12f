"""A model nobody here wrote: JAX's "Distributed arrays and automatic parallelization" MLP (#27, item 8).

``pwmesh.examples.jax_tutorial`` holds the tutorial twice: ``with_jax`` as written for ``jax.jit`` and
``NamedSharding``s (8 CPU devices of one process), ``with_pwmesh`` with the fewest edits (the README's
"A JAX tutorial on pwmesh" lists them). Both train 20 steps of data parallelism on a mesh (8,), then 20
of data and tensor parallelism on (4, 2), from the same seed, at sizes a CPU runs in seconds. Plain JAX
runs in a process of its own (this one has 2 CPU devices); pwmesh on real daemons.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

import pwmesh as pw
from pwmesh.examples import jax_tutorial

STEPS = 20
SIZES = [784, 128, 128, 128, 10]  # the tutorial's input and output widths; its 8192-wide layers take minutes here
BATCH = 256


@pytest.fixture(scope="module")
def plain_jax(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    """``with_jax``'s losses, from ``python -m pwmesh.examples.jax_tutorial --system jax``."""
    out = tmp_path_factory.mktemp("jax_tutorial") / "jax.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PWMESH_ADDRESS")}
    proc = subprocess.run([sys.executable, "-m", "pwmesh.examples.jax_tutorial", "--system", "jax",
                           "--steps", str(STEPS), "--layer-sizes", ",".join(map(str, SIZES)),
                           "--batch-size", str(BATCH), "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["system"] == "jax"
    return data["losses"]


@pytest.fixture
def on_one_executor() -> Iterator[pw.Client]:
    """The default client (what the example uses) on an island of one executor of 8 devices. (Not the
    shared ``wide_cluster``: its second island would take the second slice, and a cross-island move of
    the 800 KB batch hangs there, a pwmesh bug reported with #27.)"""
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=1, devices_per_host=8)
    with pw.LocalCluster(spec) as running:
        client = pw.connect(running.address, name="jax-tutorial")
        yield client
        pw.disconnect()


@pytest.fixture
def on_two_executors() -> Iterator[pw.Client]:
    """The default client on an island of two executors of 4 devices each, one JAX group: each slice of
    8 devices spans both, its programs SPMD across two processes."""
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=4, collectives=True)
    with pw.LocalCluster(spec) as running:
        client = pw.connect(running.address, name="jax-tutorial")
        yield client
        pw.disconnect()


def test_both_forms_train(plain_jax: dict[str, list[float]]) -> None:
    """What the equality below is worth: the losses move, and the second section starts where the first ended."""
    assert list(plain_jax) == ["data", "data_and_model"]
    for losses in plain_jax.values():
        assert len(losses) == STEPS + 1  # before training, and after every step
        assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert plain_jax["data_and_model"][0] == pytest.approx(plain_jax["data"][-1], rel=1e-6)


@pytest.mark.timeout(180)
def test_on_one_executor_the_losses_are_plain_jax_bit_for_bit(plain_jax: dict[str, list[float]],
                                                               on_one_executor: pw.Client) -> None:
    ours = jax_tutorial.with_pwmesh(SIZES, BATCH, STEPS)
    assert ours == plain_jax  # float equality, every step of both sections


@pytest.mark.timeout(180)
def test_across_two_executors_the_losses_agree_to_two_ulps(plain_jax: dict[str, list[float]],
                                                           on_two_executors: pw.Client) -> None:
    """Not bit for bit: the loss before any step already differs by one ulp now and then. The exported
    programs are the same; they run as one SPMD program over two processes, whose collectives go through
    gloo, where plain JAX runs one process of 8 devices. Where the last bit goes is not pinned down (the
    order of the loss's final 8-way sum alone does not explain it). Seen: at most 2 ulps of float32."""
    sl = pw.make_virtual_device_set().add_slice(devices=8)
    assert len({d.executor for d in sl.devices}) == 2, "a slice of 8 devices spans both executors"
    ours = jax_tutorial.with_pwmesh(SIZES, BATCH, STEPS)
    for section, losses in plain_jax.items():
        theirs = np.float32(losses)
        assert np.all(np.abs(np.float32(ours[section]) - theirs) <= 2 * np.spacing(theirs)), (ours[section], losses)
