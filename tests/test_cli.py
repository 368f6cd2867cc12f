"""The ``pwmesh`` command line: parsing with CliRunner, and real processes for up/submit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

import pwmesh as pw
from pwmesh.cli.main import main


def test_status_without_address_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PWMESH_ADDRESS", raising=False)
    result = CliRunner().invoke(main, ["status"])
    assert result.exit_code == 2
    assert "no cluster address" in result.output


def test_status_shows_islands_hosts_devices_and_sessions(cluster: pw.LocalCluster, client: pw.Client) -> None:
    client.make_virtual_device_set().add_slice(devices=2)
    result = CliRunner().invoke(main, ["status", "--address", cluster.address])
    assert result.exit_code == 0, result.output
    for executor in ("island0-host0", "island0-host1", "island1-host0", "island1-host1"):
        assert executor in result.output
    assert "scheduler" in result.output and "cpu0[" in result.output
    assert client.session_id in result.output
    raw = CliRunner().invoke(main, ["status", "--address", cluster.address, "--json"])
    state = json.loads(raw.output)
    assert len(state["cluster"]["executors"]) == 4
    assert client.session_id in [s["session_id"] for s in state["sessions"]]


def test_demo_against_a_running_cluster(cluster: pw.LocalCluster) -> None:
    result = CliRunner().invoke(main, ["demo", "--address", cluster.address])
    assert result.exit_code == 0, result.output
    assert "[2. 3.] [2. 4.]" in result.output
    assert "ran on island" in result.output


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PWMESH_ADDRESS"}
    return {**env, **extra}


def test_submit_runs_a_job_file_and_returns_its_exit_code(cluster: pw.LocalCluster, tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent("""
        import sys
        import numpy as np
        import pwmesh as pw
        s = pw.make_virtual_device_set().add_slice(devices=2)
        print("result", np.asarray(pw.pmap(lambda x: x * 10, devices=s)(np.array([1.0, 2.0]))), sys.argv[1:])
        sys.exit(3)
    """))
    done = subprocess.run([sys.executable, "-m", "pwmesh.cli.main", "submit", str(job), "--flag", "x"],
                          env=_env(PWMESH_ADDRESS=cluster.address), capture_output=True, text=True, timeout=120)
    assert "result [10. 20.] ['--flag', 'x']" in done.stdout, done.stderr
    assert done.returncode == 3


def _children_of(pid: int) -> list[int]:
    """Live processes started by the launcher ``pid`` (they carry PWMESH_PARENT_PID)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PWMESH_PARENT_PID={pid}".encode() in environ:
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_up_serves_until_ctrl_c_and_stops_every_process(tmp_path: Path) -> None:
    up = subprocess.Popen(
        [sys.executable, "-m", "pwmesh.cli.main", "up", "--islands", "1", "--hosts-per-island", "1",
         "--devices-per-host", "1", "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    try:
        assert up.stdout is not None
        address = ""
        for line in up.stdout:  # ends at EOF if `up` dies; the test timeout bounds it
            if line.startswith("address:"):
                address = line.split()[1]
                break
        assert address, "pwmesh up printed no address"
        assert len(_children_of(up.pid)) == 4  # rm, scheduler, executor, proxy
        status = CliRunner().invoke(main, ["status", "--address", address])
        assert "island0-host0" in status.output
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
        assert "stopped." in up.stdout.read()
        assert _children_of(up.pid) == []
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        if up.stdout is not None:
            up.stdout.close()
