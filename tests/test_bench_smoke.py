"""The benchmarks under bench/ run end to end: each one's ``--smoke`` mode, as a subprocess.

Smoke mode measures nothing meaningful (windows of a second or two); it checks
that every code path runs, that the results JSON has its keys, and, where
matplotlib is installed (``pip install -e '.[bench]'``), that the plot is written.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
try:  # the same test the benchmarks make before they plot
    import matplotlib  # noqa: F401

    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False

pytestmark = pytest.mark.cluster


def run_smoke(script: str, out: Path, timeout_seconds: float = 100) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PWMESH_ADDRESS"}  # each starts its own cluster
    proc = subprocess.run([sys.executable, str(BENCH / script), "--smoke", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=timeout_seconds)
    assert proc.returncode == 0, f"{script} --smoke exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def check_plot(path: Path) -> None:
    if not HAVE_MATPLOTLIB:
        pytest.skip("matplotlib is not installed (pip install -e '.[bench]'): the JSON was checked, the PNG not")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(110)
@pytest.mark.long  # ~13 s in CI: weighted sharing itself is test_tenants' and test_scheduler_order's
def test_multitenancy_smoke(tmp_path: Path) -> None:
    proc = run_smoke("multitenancy.py", tmp_path)
    data = json.loads((tmp_path / "multitenancy.json").read_text())
    assert {"benchmark", "config", "machine", "shares", "throughput"} <= data.keys()
    assert data["benchmark"] == "multitenancy" and data["smoke"] is True
    shares = data["shares"]
    assert {"seconds", "clients", "max_relative_error", "within_target", "device_utilisation"} <= shares.keys()
    assert [c["weight"] for c in shares["clients"]] == [1.0, 2.0, 4.0, 8.0]
    for c in shares["clients"]:
        assert {"target_share", "share", "error", "relative_error", "device_seconds", "runs"} <= c.keys()
        # A client whose work used no device in the window, or that completed nothing at all, starved or
        # stalled: say which, and what the others got. (Its count of runs *released* in a one-second window
        # may be 0 on a loaded machine even though its earlier runs ran in it: weight 1 of 15 is a small share.)
        assert c["device_seconds"] > 0 and c["completed_total"] > 0, (c["name"], shares["clients"],
                                                                        proc.stdout[-2000:])
    assert abs(sum(c["share"] for c in shares["clients"]) - 1.0) < 1e-6
    assert [r["clients"] for r in data["throughput"]] == data["config"]["client_counts"]
    for r in data["throughput"]:
        assert r["computations_per_second"] > 0
    # The same shares with keys, a tenants policy and quotas on (issue #26), and what the checks cost.
    quotas = data["shares_quotas"]
    assert [c["weight"] for c in quotas["clients"]] == [1.0, 2.0, 4.0, 8.0]
    assert abs(sum(c["share"] for c in quotas["clients"]) - 1.0) < 1e-6
    assert [c["weight"] for c in data["shares_compared"]] == [1.0, 2.0, 4.0, 8.0]
    for side in ("keyed", "keyless"):
        assert 0 < data["auth_cost"][side]["checks"]["us"] < data["auth_cost"][side]["round_trip"]["us"]
    check_plot(tmp_path / "multitenancy.png")


@pytest.mark.timeout(110)
def test_dispatch_modes_smoke(tmp_path: Path) -> None:
    run_smoke("dispatch_modes.py", tmp_path)
    data = json.loads((tmp_path / "dispatch_modes.json").read_text())
    assert {"benchmark", "config", "machine", "results"} <= data.keys()
    assert data["benchmark"] == "dispatch_modes" and data["smoke"] is True
    assert [r["k"] for r in data["results"]] == data["config"]["ks"]
    for r in data["results"]:
        assert len(set(r["placement"])) == r["k"]  # one stage per host
        assert set(r["breakdown"]) == {"parallel", "sequential"}
        for kind in ("latency", "pipelined"):
            row = r[kind]
            assert {"parallel_ms", "sequential_ms", "parallel_over_sequential"} <= row.keys()
            assert row["parallel_ms"] > 0
            assert row["sequential_ms"] is not None and row["sequential_ms"] > 0, r["note"]
    check_plot(tmp_path / "dispatch_modes.png")


@pytest.mark.long  # ~12 s: what it drives (OpByOp, programs, fused) is tested in CI (test_dispatch, test_sim)
@pytest.mark.timeout(110)
def test_dispatch_smoke(tmp_path: Path) -> None:
    proc = run_smoke("dispatch.py", tmp_path)
    data = json.loads((tmp_path / "dispatch.json").read_text())
    assert {"benchmark", "config", "machine", "results", "ratios", "targets", "systems"} <= data.keys()
    assert data["benchmark"] == "dispatch" and data["smoke"] is True
    results = data["results"]
    assert set(results) == {"pwmesh", "jax", "ray"}
    expected_modes = {"pwmesh": ("opbyop", "chained", "fused"), "jax": ("opbyop", "fused"),
                      "ray": ("opbyop", "chained", "fused")}
    have_ray = importlib.util.find_spec("ray") is not None
    for system, modes in expected_modes.items():
        if system == "ray" and not have_ray:
            assert results["ray"] is None and "ray is not installed" in proc.stdout
            continue
        for computation in ("add", "add_psum"):
            for mode in modes:
                assert results[system][computation][mode]["computations_per_second"] > 0, (system, mode)
    assert results["jax"]["add"]["chained"] is None  # plain JAX has no Chained mode
    assert len(data["targets"]) == 6
    for t in data["targets"]:
        assert {"computation", "pwmesh_mode", "versus", "target", "measured", "met"} <= t.keys()
        assert (t["measured"] is None) == (t["versus"].startswith("ray") and not have_ray)
    assert data["systems"]["pwmesh"]["placement"] and len(data["systems"]["pwmesh"]["placement"]) == 1
    assert "| system | mode |" in (tmp_path / "dispatch.md").read_text()
    check_plot(tmp_path / "dispatch.png")


@pytest.mark.timeout(110)
def test_min_compute_smoke(tmp_path: Path) -> None:
    run_smoke("min_compute.py", tmp_path)
    data = json.loads((tmp_path / "min_compute.json").read_text())
    assert {"benchmark", "config", "machine", "sweeps", "target_ms"} <= data.keys()
    assert data["benchmark"] == "min_compute" and data["smoke"] is True
    assert [s["layout"] for s in data["sweeps"]] == data["config"]["layouts"]
    for s in data["sweeps"]:
        assert {"points", "placement", "stopped", "min_compute_ms", "min_compute_ms_interpolated", "target_met",
                "overhead_ms_per_step", "predicted_min_compute_ms"} <= s.keys()
        assert len(s["placement"]) == (2 if s["layout"] == "span" else 1)
        assert s["points"]
        for p in s["points"]:
            assert p["compute_ms_per_step"] > 0 and p["pwmesh_steps_per_second"] > 0 and p["ratio"] > 0
    check_plot(tmp_path / "min_compute.png")


@pytest.mark.timeout(110)
def test_client_transfer_smoke(tmp_path: Path) -> None:
    run_smoke("client_transfer.py", tmp_path)
    data = json.loads((tmp_path / "client_transfer.json").read_text())
    assert data["benchmark"] == "client_transfer" and data["smoke"] is True
    methods = {r["method"] for r in data["results"]}
    assert methods == {"pw.put (direct)", "np.asarray (direct)", "round trip (direct)", "pw.put (proxy)",
                       "np.asarray (proxy)", "round trip (proxy)", "raw TCP", "shared memory"}
    assert all(r["gbytes_per_second"] > 0 for r in data["results"])
    assert {"pw.put direct / raw TCP", "np.asarray direct / proxy", "round trip direct / raw TCP"} <= \
        data["ratios"]["2 MiB"].keys()


@pytest.mark.long  # ~8 s: the data plane and the client's direct path have their own tests in CI
@pytest.mark.timeout(110)
def test_transfer_smoke(tmp_path: Path) -> None:
    run_smoke("transfer.py", tmp_path)
    data = json.loads((tmp_path / "transfer.json").read_text())
    assert {"benchmark", "config", "machine", "results", "ratios", "control_under_bulk"} <= data.keys()
    assert data["benchmark"] == "transfer" and data["smoke"] is True
    methods = {r["method"] for r in data["results"]}
    assert methods == {"tcp", "zmq", "shm", "pwmesh", "pwmesh-shm", "pwmesh-sealed", "pwmesh-authed"}
    for r in data["results"]:
        assert r["measured"] and r["gbytes_per_second"] > 0, r["method"]
    for ratios in data["ratios"].values():
        assert ratios["pwmesh/tcp"] > 0 and ratios["pwmesh-shm/shm"] > 0 and ratios["pwmesh-sealed/pwmesh"] > 0
    control = data["control_under_bulk"]
    assert control["idle_ping_ms_median"] > 0 and control["bulk_gbytes_per_second"] > 0
    check_plot(tmp_path / "transfer.png")


@pytest.mark.timeout(110)
def test_message_rate_smoke(tmp_path: Path) -> None:
    run_smoke("message_rate.py", tmp_path)
    data = json.loads((tmp_path / "message_rate.json").read_text())
    assert data["benchmark"] == "message_rate" and data["smoke"] is True
    assert set(data["rpc"]) == {"round_trip", "one_way_in", "one_way_out"}
    for r in data["rpc"].values():
        assert r["per_second"] > 0 and r["client_cpu_us"] >= 0 and r["server_cpu_us"] >= 0
    assert data["program"]["median_ms"] > 0
    assert data["chain"]["nodes"] == data["config"]["chain_nodes"] and data["chain"]["per_node_us"] > 0


@pytest.mark.timeout(110)
def test_codec_rate_smoke(tmp_path: Path) -> None:
    run_smoke("codec_rate.py", tmp_path)
    data = json.loads((tmp_path / "codec_rate-smoke.json").read_text())
    assert data["benchmark"] == "codec_rate" and data["smoke"] is True
    names = [r["message"] for r in data["rows"]]
    assert names == ["NodeDone", "ScheduleRun x1", "Enqueue x1", "ScheduleRun x128", "Enqueue x128",
                     "Computation x1 (packed)", "Computation x128 (packed)"]
    for r in data["rows"]:
        assert r["body_bytes"] > 0 and r["encode_us"] > 0 and r["decode_us"] > 0


@pytest.mark.timeout(110)
def test_scheduler_core_smoke(tmp_path: Path) -> None:
    run_smoke("scheduler_core.py", tmp_path)
    data = json.loads((tmp_path / "scheduler_core-smoke.json").read_text())
    assert data["benchmark"] == "scheduler_core" and data["smoke"] is True
    assert [(r["hosts"], r["cache"]) for r in data["rows"]] == [(16, "warm"), (16, "cold"), (300, "warm"),
                                                                (300, "cold")]
    assert all(r["run_template_us"] > 0 and r["report_us"] > 0 for r in data["rows"])
    # 16 executors are sent directly (a report each); 300 through the tree (one PartsDone per top-level head).
    assert [r["reports_per_run"] for r in data["rows"]] == [16, 16, 16, 16]


@pytest.mark.timeout(110)
def test_train_smoke(tmp_path: Path) -> None:
    run_smoke("train.py", tmp_path)
    data = json.loads((tmp_path / "train.json").read_text())
    assert {"benchmark", "config", "machine", "points", "min_step_ms", "overhead_ms_per_step"} <= data.keys()
    assert data["benchmark"] == "train" and data["smoke"] is True
    (point,) = data["points"]
    assert point["preset"] == "tiny" and point["ratio"] > 0
    assert point["jax_tokens_per_second"] > 0 and point["pwmesh_tokens_per_second"] > 0
    assert point["losses_identical"], "pwmesh and plain JAX train the same model to the same losses"
    check_plot(tmp_path / "train.png")


@pytest.mark.long  # ~30 s (a cluster and plain JAX's process, each compiling the model): what it drives is test_train's
def test_step_cpu_smoke(tmp_path: Path) -> None:
    run_smoke("step_cpu.py", tmp_path)
    data = json.loads((tmp_path / "step_cpu.json").read_text())
    assert data["benchmark"] == "step_cpu" and data["smoke"] is True and data["preset"] == "tiny"
    assert data["jax"]["wall_ms"] > 0 and data["pwmesh"]["wall_ms"] > 0 and data["ratio"] > 0
    for role in ("client", "proxy", "scheduler", "executor"):
        assert data["pwmesh"][f"{role}_cpu_ms"] >= 0, role
    assert 0 < data["pwmesh"]["executor_main_thread_cpu_ms"] <= data["pwmesh"]["executor_cpu_ms"]
    # Plain JAX again beside a load of the controller's CPU (the gap's explanation).
    assert data["load_cpu_ms"] > 0 and data["jax_beside_load"]["wall_ms"] > 0 and data["ratio_beside_load"] > 0


@pytest.mark.timeout(170)
@pytest.mark.long  # 26 s in CI, which keeps well under 15 minutes: the RL loop itself is test_rl's
def test_rl_smoke(tmp_path: Path) -> None:
    # Four runs of 8 steps, each compiling its sampler and trainer, one of them in a process of its own:
    # ~40 s on 2 idle cores, twice that when the machine is busy.
    run_smoke("rl.py", tmp_path, timeout_seconds=160)
    data = json.loads((tmp_path / "rl.json").read_text())
    assert {"benchmark", "config", "machine", "points"} <= data.keys()
    assert data["benchmark"] == "rl" and data["smoke"] is True
    (point,) = data["points"]
    modes = {"overlap", "overlap-calls", "sequential", "jax"}
    assert set(point["ms_per_step"]) == modes and all(v > 0 for v in point["ms_per_step"].values())
    assert all(len(point["rewards"][m]) == point["steps"] for m in modes)
    # On-policy on one slice, pwmesh samples and trains exactly as plain JAX does; the overlapped loop is
    # one step off-policy, its three-call form the same program's calls.
    assert point["rewards"]["sequential"] == point["rewards"]["jax"]
    assert point["rewards"]["overlap"] == point["rewards"]["overlap-calls"]
    check_plot(tmp_path / "rl.png")


@pytest.mark.timeout(110)
def test_weight_sync_smoke(tmp_path: Path) -> None:
    run_smoke("weight_sync.py", tmp_path)
    data = json.loads((tmp_path / "weight_sync.json").read_text())
    assert {"benchmark", "config", "machine", "tree", "equal", "results", "ratios"} <= data.keys()
    assert data["benchmark"] == "weight_sync" and data["smoke"] is True
    assert data["equal"], "the synced tree equals what was put"
    assert [r["method"] for r in data["results"]] == ["tcp", "plane", "reshard", "reshard 1 device", "round trip"]
    assert all(r["gbytes_per_second"] > 0 for r in data["results"])
    assert data["tree"]["arrays"] > 10 and data["tree"]["trainer_mesh"] == {"data": 2, "model": 2}
    check_plot(tmp_path / "weight_sync.png")


@pytest.mark.long  # 38 s in CI, which keeps well under 15 minutes: the pipeline itself is test_pipeline's
@pytest.mark.timeout(260)
def test_pipeline_smoke(tmp_path: Path) -> None:
    # Three clusters (1, 2 and 4 islands), each compiling four stages: ~90 s on 2 idle cores (measured at
    # c504b41 and now alike), so 100 s failed whenever the machine was busy.
    run_smoke("pipeline.py", tmp_path, timeout_seconds=240)
    data = json.loads((tmp_path / "pipeline.json").read_text())
    assert {"benchmark", "config", "machine", "arrangements", "ratios", "jax", "trace"} <= data.keys()
    assert data["benchmark"] == "pipeline" and data["smoke"] is True
    arrangements = data["arrangements"]
    assert {name: a["islands"] for name, a in arrangements.items()} == {"a": 1, "b": 2, "c": 4}
    for a in arrangements.values():
        assert a["tokens_per_second"] > 0 and len(set(a["executors"])) == 4, "each stage on an executor of its own"
    assert set(data["ratios"]) == {"b/a", "c/a"} and data["jax"]["tokens_per_second"] > 0
    assert data["losses_identical"], "the arrangements train the same model to the same losses"
    m = data["config"]["microbatches"]
    kinds = sorted((s["stage"], s["kind"]) for s in data["trace"])
    assert kinds.count((0, "F")) == m and kinds.count((3, "B")) == m, "the trace is one whole step"
    check_plot(tmp_path / "pipeline.png")
    check_plot(tmp_path / "pipeline_trace.png")


@pytest.mark.timeout(110)
def test_scale_smoke(tmp_path: Path) -> None:
    proc = run_smoke("scale.py", tmp_path)
    data = json.loads((tmp_path / "scale.json").read_text())
    assert {"benchmark", "config", "machine", "proxy", "scheduler", "placement", "figure5", "pipeline",
            "sim_costs"} <= data.keys()
    assert data["benchmark"] == "scale" and data["smoke"] is True
    config = data["config"]
    for kind in ("pmap", "spmd"):
        rows = data["proxy"][kind]["rows"]
        assert [r["devices"] for r in rows] == config["proxy_devices"]
        for r in rows:
            # One island: a warm program is one RunTemplate of its names (issue #30 item 1), the same
            # bytes however many devices.
            assert r["messages"] == 1 and r["message_types"] == {"RunTemplate": 1}, r
            assert 0 < r["bytes"] < 400 and r["warm_cpu_us"] > 0 and r["cold_cpu_us"] > 0
            assert r["executors"] == max(1, r["devices"] // 8) == r["scheduler_enqueues"]
            # The proxy's own core ran the chain to its end, told by the island's scheduler: one IslandDone
            # (the executors' one RunPartDone each went to the scheduler), and one FreeShards for its
            # temporaries (one island; a DeleteShards where one executor holds them), whatever the size.
            assert r["completion_messages_in"] == 1 and r["island_reports_in"] == r["executors"], r
            assert r["completion_messages_out"] == 1, r
            # A gang across executors goes once, in the first run (one RegisterGang per executor), not in
            # the parts: an executor's part is about as many bytes at every size.
            gang = kind == "spmd" and r["executors"] > 1
            assert r["setup_register_gang_messages"] == (r["executors"] if gang else 0), r
            assert r["part_bytes"] < 1024, r
        assert data["proxy"][kind]["ratio"]["messages"] == 1.0
    chain = {r["kind"]: r for r in data["proxy_chain_simulated"]}
    assert chain.keys() == {"pmap", "spmd"} and all(r["steps"] == 3 for r in chain.values())
    assert chain["spmd"]["devices"] == 8 * config["sim_chain_hosts"]
    assert chain["spmd"]["register_gang_messages"] == config["sim_chain_hosts"]
    assert chain["spmd"]["proxy_bytes_per_step"] <= 1.1 * chain["pmap"]["proxy_bytes_per_step"], chain
    for shape in ("small", "gang"):
        rows = data["scheduler"][shape]["rows"]
        assert [r["clients"] for r in rows] == config["client_counts"]
        for r in rows:
            assert r["decisions"] >= config["scheduler_decisions"] and r["decisions_per_second"] > 0
            assert r["clients_served"] == r["clients"], "every client's runs were released"
    # 16 gang clients: clients 8 apart share both executors, weights 1 and 2; the fair policy gives
    # the heavier twice the runs (the harness drives the policy, not just the bookkeeping).
    (gang16,) = [r for r in data["scheduler"]["gang"]["rows"] if r["clients"] == 16]
    light, heavy = gang16["mean_runs_by_weight"]["1.0"], gang16["mean_runs_by_weight"]["2.0"]
    assert heavy / light == pytest.approx(2.0, rel=0.2), gang16["mean_runs_by_weight"]
    sizes = {(r["islands"], r["load"], r["slice_devices"]) for r in data["placement"]}
    assert sizes == {(i, load, n) for i in config["rm_islands"] for load in ("idle", "loaded")
                     for n in config["rm_slice_sizes"]}
    assert all(r["median_ms"] > 0 for r in data["placement"])
    # (d): every mode at every simulated size, each a real rate; fused does the same work in fewer
    # computations, so the controller handles fewer messages per computation than OpByOp.
    rows = data["figure5"]["rows"]
    assert {(r["hosts"], r["mode"]) for r in rows} == {(h, m) for h in config["sim_hosts"]
                                                       for m in ("opbyop", "chained", "fused")}
    for h in config["sim_hosts"]:
        by_mode = {r["mode"]: r for r in rows if r["hosts"] == h}
        assert all(r["computations_per_second"] > 0 and 0 <= r["proxy_busy"] <= 1 for r in by_mode.values())
        assert by_mode["fused"]["proxy_messages"] < by_mode["opbyop"]["proxy_messages"]
    # (e): every microbatch went through every island's stage, no faster than the pipeline's ideal
    # (a lower bound: the devices' own time along the pipeline's dependencies).
    pipe = data["pipeline"]
    assert pipe["islands"] == config["pipeline_islands"] and pipe["steps"] == config["pipeline_steps"]
    assert pipe["computations"] == (config["pipeline_steps"] * config["pipeline_microbatches"]
                                    * config["pipeline_islands"] * config["pipeline_hosts_per_island"])
    assert (pipe["in_flight"], data["pipeline_synchronous"]["in_flight"]) == (2, 1)
    assert 0 < pipe["efficiency"] <= 1.0 and {s["island"] for s in pipe["timeline"]} == set(range(pipe["islands"]))
    assert "simulated executors' costs" in proc.stdout
    assert "| node | devices |" in (tmp_path / "scale.md").read_text()
    check_plot(tmp_path / "scale.png")
    check_plot(tmp_path / "scale_sim.png")


@pytest.mark.timeout(90)
@pytest.mark.long  # ~10 s in CI: the simulator's agreement with its cores is test_sim's and test_sim_play's
def test_sim_check_smoke(tmp_path: Path) -> None:
    run_smoke("sim_check.py", tmp_path, timeout_seconds=80)
    data = json.loads((tmp_path / "sim_check.json").read_text())
    assert {"benchmark", "config", "machine", "measured", "calibration", "rows", "worst_ratio"} <= data.keys()
    assert data["benchmark"] == "sim_check" and data["smoke"] is True
    calibration = data["calibration"]
    assert {"latency_seconds", "launch_seconds", "host_overhead_seconds", "client_send_seconds",
            "proxy_service_seconds", "compute_seconds"} <= calibration.keys()
    assert all(math.isfinite(v) and v >= 0 for v in calibration.values()), calibration
    lengths = data["config"]["lengths"]
    rows = data["rows"]
    assert {(r["mode"], r["length"]) for r in rows} == {(m, n) for m in ("opbyop", "chained", "fused") for n in lengths}
    for r in rows:
        assert r["real_seconds"] > 0 and r["sim_seconds"] > 0, r
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0, r
    fitted = {(r["mode"], r["length"]) for r in rows if r["calibration"]}
    assert fitted == {(c["mode"], c["length"]) for c in data["calibration_rows"]} and len(fitted) < len(rows)
    assert data["worst_ratio"] in [r["ratio"] for r in rows]
    # The larger check: a real cluster of one-device executors, the slice over all of them, against the
    # simulator at that shape (every row a prediction).
    large = data["large"]
    assert large["hosts"] == data["config"]["large_hosts"] and large["startup_seconds"] > 0
    assert {(r["mode"], r["length"]) for r in large["rows"]} == {
        (m, n) for m in ("opbyop", "chained", "fused") for n in data["config"]["large_lengths"]}
    assert all(r["real_seconds"] > 0 and r["sim_seconds"] > 0 and not r["calibration"] for r in large["rows"])
    assert "executors x 1 device" in (tmp_path / "sim_check.md").read_text()
    # What bench/scale.py would read back (in a subprocess: importing sim_check sets XLA_FLAGS for its process).
    read = subprocess.run([sys.executable, "-c", "import json, sys; sys.path.insert(0, sys.argv[1]); "
                           "from sim_check import calibration_from; print(json.dumps(calibration_from(sys.argv[2])))",
                           str(BENCH), str(tmp_path / "sim_check.json")], capture_output=True, text=True, timeout=60)
    assert read.returncode == 0, read.stderr
    assert json.loads(read.stdout) == calibration
    assert "| mode | length |" in (tmp_path / "sim_check.md").read_text()
    check_plot(tmp_path / "sim_check.png")


def test_liveness_smoke(tmp_path: Path) -> None:
    run_smoke("liveness.py", tmp_path)
    data = json.loads((tmp_path / "liveness.json").read_text())
    assert data["benchmark"] == "liveness" and data["smoke"] is True
    assert [p["host_stayed_up"] for p in data["phases"]] == [True, True, True]
    assert data["baseline"]["seconds"] > 0


@pytest.mark.long  # ~10 s in CI (two clusters started): forming groups is test_group's
def test_startup_smoke(tmp_path: Path) -> None:
    run_smoke("startup.py", tmp_path)
    data = json.loads((tmp_path / "startup.json").read_text())
    assert data["benchmark"] == "startup" and data["smoke"] is True
    assert data["summary"]["groups"]["first_spmd_step_seconds"] > data["summary"]["groups"]["ready_seconds"] > 0


@pytest.mark.timeout(200)
@pytest.mark.long  # ~16-30 s in CI: its three benchmarks each have their smoke test above
def test_gpu_sh_cpu_dry_run(tmp_path: Path) -> None:
    # bench/gpu.sh's steps on CPU with tiny sizes, the three benchmarks side by side:
    # the one-device flags it gives them (--platform, --mesh 1x1, --devices 1, layout single), its budgets,
    # each one's status and its summary.
    env = {k: v for k, v in os.environ.items() if k != "PWMESH_ADDRESS"}
    proc = subprocess.run(["bash", str(BENCH / "gpu.sh"), "--cpu-dry-run", str(tmp_path)],
                          env={**env, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=190)
    assert proc.returncode == 0, f"gpu.sh exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    train = json.loads((tmp_path / "train.json").read_text())
    assert train["config"]["mesh"] == {"data": 1, "model": 1} and train["config"]["platform"] == "cpu"
    assert train["points"][0]["losses_identical"]
    dispatch = json.loads((tmp_path / "dispatch.json").read_text())
    assert dispatch["config"]["devices"] == 1 and dispatch["results"]["ray"] is None
    assert dispatch["results"]["pwmesh"]["add_psum"]["chained"]["computations_per_second"] > 0
    (sweep,) = json.loads((tmp_path / "min_compute.json").read_text())["sweeps"]
    assert sweep["layout"] == "single" and sweep["devices"] == 1 and len(sweep["placement"]) == 1
    summary = (tmp_path / "summary.txt").read_text()
    assert "pwmesh/JAX" in summary and summary.count("\ndispatch ") == 6 and "single n=32:" in summary
    assert "bench/gpu.sh: done" in proc.stdout
    assert "train: ok, " in summary and "dispatch: ok, " in summary and "min_compute: ok, " in summary
    assert not list(tmp_path.glob(".*")), "its status and log files are removed"
    check_plot(tmp_path / "train.png")
