"""bench/scale.py (e) on the simulator: a GPipe step's dispatch is one template run per island, its
completions one report per island (and per early output), whatever the hosts (issue #30 (e))."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pwmesh.sim.cluster import SimCluster, SimConfig
from pwmesh.sim.workloads import Workload, install

pytestmark = pytest.mark.timeout(60)

BENCH = Path(__file__).resolve().parent.parent / "bench"
ISLANDS, STEPS, MICROBATCHES = 4, 3, 4


def warm_traffic(hosts_per_island: int) -> tuple[dict[str, int], dict[str, float]]:
    """The proxy's messages out by kind over the whole run, and its traffic in the warm steps."""
    cluster = SimCluster(SimConfig(islands=ISLANDS, hosts_per_island=hosts_per_island, devices_per_host=2))
    install(cluster, Workload(name="pipeline", steps=STEPS, devices=2 * hosts_per_island, stages=ISLANDS,
                              microbatches=MICROBATCHES, compute_seconds=1e-3))
    report = cluster.run()
    assert report["clients"]["c0"] == {"steps": STEPS, "runs": 0, "failure": None, "errors": 0}
    assert report["computations"] == STEPS * MICROBATCHES * ISLANDS * hosts_per_island
    return report["proxy"]["messages_out_by_op"], report["in_steps"]


def test_a_pipeline_step_is_one_template_run_per_island_at_every_size() -> None:
    small, small_steps = warm_traffic(2)
    large, large_steps = warm_traffic(16)
    for out in (small, large):
        # Every step goes as a run of the template installed once per island, never as whole parts.
        assert out["sched.run_template"] == STEPS * ISLANDS and out["sched.install_template"] == ISLANDS
        assert "sched.schedule_run" not in out and "exec.enqueue" not in out
    # The warm steps' messages in and out of the proxy do not grow with the hosts (8x more here).
    assert small_steps["messages"] == large_steps["messages"]


def test_scale_runs_its_pipeline_part_alone(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PWMESH_ADDRESS"}
    proc = subprocess.run([sys.executable, str(BENCH / "scale.py"), "--pipeline-only", "--smoke", "--out",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "scale_pipeline.json").read_text())
    assert data["benchmark"] == "scale_pipeline" and data["smoke"] is True
    one, two, free = data["pipeline_synchronous"], data["pipeline"], data["pipeline_schedulers_free"]
    assert (one["in_flight"], two["in_flight"], free["in_flight"]) == (1, 2, 1)
    assert one["schedulers_charged"] and not free["schedulers_charged"]
    for run in (one, two, free):
        assert 0 < run["efficiency"] <= 1.0 and run["proxy_messages"] > 0 and run["scheduler_cpu_us"] > 0
    assert "sched CPU ms/step" in proc.stdout and "proxy msgs/step" in proc.stdout
