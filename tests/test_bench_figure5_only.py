"""``bench/scale.py --figure5-only`` runs part (d) alone (Figure 5 on the simulator, for re-measuring the
controller at 16 to 1,024 hosts without parts a-c and e) and writes ``scale_figure5.json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.timeout(90)
def test_figure5_only_runs_part_d_alone(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PWMESH_ADDRESS"}
    proc = subprocess.run([sys.executable, str(BENCH / "scale.py"), "--figure5-only", "--smoke", "--hosts", "16,20",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    data = json.loads((tmp_path / "scale_figure5.json").read_text())
    assert data["benchmark"] == "scale (d)" and data["smoke"] is True
    rows = data["figure5"]["rows"]
    assert {(r["hosts"], r["mode"], r["in_flight"]) for r in rows} == {
        (h, m, 1) for h in (16, 20) for m in ("opbyop", "chained", "fused")} | {(16, "chained", 2), (20, "chained", 2)}
    assert all(r["computations_per_second"] > 0 and r["scheduler_cpu_us"] > 0 for r in rows)
    rate = {(r["hosts"], r["mode"], r["in_flight"]): r["computations_per_second"] for r in rows}
    for hosts in (16, 20):  # a second step in flight overlaps the first's hops
        assert rate[hosts, "chained", 2] > 1.2 * rate[hosts, "chained", 1], rate
    assert not (tmp_path / "scale.json").exists(), "parts a-c and e did not run"
