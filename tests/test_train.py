"""Training the example Transformer on pwmesh, against the same model trained with plain JAX.

pwmesh trains on a 2x2 mesh of one executor of the 8-device cluster; plain JAX trains
the identical model with the same NamedShardings on 4 CPU devices of a process of its
own (``train_lm --reference``), from the same seed and data. The loss sequences agree.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import pwmesh as pw
from helpers import eventually
from pwmesh.examples import lm, train_lm


@pytest.fixture(scope="module")
def on_wide(wide_cluster: pw.LocalCluster) -> Iterator[pw.Client]:
    """The default client (what the example uses), on the 8-device cluster."""
    client = pw.connect(wide_cluster.address, name="train")
    yield client
    pw.disconnect()


def reference(preset: str, steps: int, out: Path) -> list[float]:
    """``train_lm --reference`` in a process of its own (plain JAX needs 4 devices; this one has 2)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PWMESH_ADDRESS")}
    proc = subprocess.run([sys.executable, "-m", "pwmesh.examples.train_lm", "--reference", "--preset", preset,
                           "--steps", str(steps), "--json", str(out), "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["system"] == "jax"
    return data["losses"]


def train(preset: str, steps: int, **kwargs: object) -> train_lm.Result:
    config = lm.PRESETS[preset]
    optimizer = lm.make_optimizer(config)
    return train_lm.train(config, steps, train_lm.pwmesh_trainer(config, optimizer), optimizer, progress=False,
                          **kwargs)  # type: ignore[arg-type]


@pytest.mark.timeout(300)
def test_twenty_steps_equal_plain_jax(on_wide: pw.Client, tmp_path: Path) -> None:
    ours = train("tiny", 20).losses
    theirs = reference("tiny", 20, tmp_path / "jax.json")
    assert len(ours) == len(theirs) == 20
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)
    assert ours[-1] < ours[0]


@pytest.mark.timeout(300)
def test_a_resumed_run_continues_exactly_where_it_stopped(on_wide: pw.Client, tmp_path: Path) -> None:
    whole = train("tiny", 10).losses
    first = train("tiny", 6, checkpoint=str(tmp_path))
    assert lm.latest_checkpoint(tmp_path) == tmp_path / "ckpt_6.npz"
    rest = train("tiny", 10, checkpoint=str(tmp_path))
    assert rest.first_step == 6 and len(rest.losses) == 4
    np.testing.assert_allclose(first.losses + rest.losses, whole, rtol=1e-5)


@pytest.mark.long
@pytest.mark.timeout(900)
def test_three_hundred_steps_learn_python(on_wide: pw.Client) -> None:
    losses = train("small", 300).losses
    assert np.mean(losses[-20:]) < 2.8, f"the last 20 losses average {np.mean(losses[-20:]):.3f}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.long)])  # one in CI
def test_a_stopped_training_saves_a_checkpoint_says_where_and_resumes_from_it(tmp_path: Path,
                                                                               sig: signal.Signals) -> None:
    """``train_lm`` stopped by SIGTERM (systemd, a scheduler) or Ctrl-C saves the last step it did, says where
    and how to resume, and exits 128 + the signal; resumed, it goes on from that step. (``--reference``:
    the same training loop, in a process of its own.)"""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PWMESH_ADDRESS")}
    where = tmp_path / "ckpt"
    command = [sys.executable, "-m", "pwmesh.examples.train_lm", "--reference", "--preset", "tiny", "--no-progress",
               "--checkpoint", str(where)]
    proc = subprocess.Popen([*command, "--steps", "1000000", "--checkpoint-every", "2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        eventually(lambda: (where / "ckpt_2.npz").exists() or proc.poll() is not None, 120)  # two steps done
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + sig, err[-2000:]
    (said,) = [line for line in out.splitlines() if line.startswith("stopped")]
    step = int(said.split("after step ")[1].split(":")[0])
    assert said == (f"stopped ({sig.name}) after step {step}: checkpoint saved in {where}/ckpt_{step}.npz; "
                    f"resume with --checkpoint {where}")
    assert step >= 2 and lm.latest_checkpoint(where) == where / f"ckpt_{step}.npz"
    resumed = subprocess.run([*command, "--steps", str(step + 2)], env=env, capture_output=True, text=True,
                             timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"training steps {step + 1}..{step + 2}" in resumed.stdout
