"""The ``pwmesh`` command line: parsing with CliRunner, and real processes for up/submit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import pwmesh as pw
from helpers import reap
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


def test_debug_events_dumps_each_daemons_latest_events(cluster: pw.LocalCluster, client: pw.Client) -> None:
    """Issue #29 item 2: every daemon's core keeps its latest events, stimulus ids on each, and
    ``pwmesh debug events DAEMON`` prints them: the run a client just made is in the proxy's, its
    scheduler's and its executor's logs."""
    sl = client.make_virtual_device_set().add_slice(devices=1)
    np.testing.assert_array_equal(np.asarray(pw.pmap(lambda x: x + 1.0, devices=sl)(np.zeros(1))), [1.0])
    (executor,) = sl.executors
    scheduler = f"scheduler-{sl.island}"

    def events(daemon: str) -> str:
        result = CliRunner().invoke(main, ["debug", "events", daemon, "--address", cluster.address, "--limit", "0"])
        assert result.exit_code == 0, result.output
        return result.output

    ran = events(executor)
    assert f"# {executor} at tcp://" in ran
    assert "enqueue-" in ran and "Received(message=exec.enqueue(run_id=" in ran and "done-" in ran
    assert "Inbound(proxy.run_program" in events("proxy")
    ordered = events(scheduler)
    # A program with an id runs by its template: installed once, then run by name (issue #30 item 1).
    assert "install-" in ordered and "Received(message=sched.install_template(" in ordered
    assert "run-" in ordered and "Received(message=sched.run_template(" in ordered
    assert "part-done-" in ordered and "Received(message=sched.run_part_done(run_id=" in ordered
    assert "Received(message=rm.allocate_slice" in events("rm")
    unknown = CliRunner().invoke(main, ["debug", "events", "nosuch", "--address", cluster.address])
    assert unknown.exit_code != 0 and "no daemon 'nosuch'" in unknown.output and "proxy" in unknown.output


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
        metrics = {}
        for line in up.stdout:  # ends at EOF if `up` dies; the test timeout bounds it
            if line.startswith("address:"):
                address = line.split()[1]
            elif line.startswith("  ") and line.strip().endswith("/metrics"):
                name, where = line.split()
                metrics[name] = where
            elif line.startswith("Ctrl-C"):
                break
        assert address, "pwmesh up printed no address"
        assert len(_children_of(up.pid)) == 4  # rm, scheduler, executor, proxy
        assert set(metrics) == {"rm", "scheduler-0", "island0-host0", "proxy"}  # each daemon's, scrapeable
        with urllib.request.urlopen(metrics["island0-host0"], timeout=10) as reply:
            assert b"pwmesh_executor_computations_finished_total" in reply.read()
        status = CliRunner().invoke(main, ["status", "--address", address])
        assert "island0-host0" in status.output
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
        assert "stopped." in up.stdout.read()
        assert _children_of(up.pid) == []
    finally:
        reap(up)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_in_a_terminal_stops_up_cleanly_and_removes_its_logs() -> None:
    """Issue #28 item 6. A terminal's Ctrl-C signals its whole foreground process group. The daemons were in
    it: each took the SIGINT and then the launcher's SIGTERM as a second signal, exited 1 at once, and every
    stop said "a daemon failed or was killed" and kept its logs. Now they have a session of their own."""
    up = subprocess.Popen(
        [sys.executable, "-m", "pwmesh.cli.main", "up", "--islands", "1", "--hosts-per-island", "2",
         "--devices-per-host", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), start_new_session=True)
    try:
        assert up.stdout is not None
        logs = ""
        for line in up.stdout:
            if line.startswith("logs:"):
                logs = line.split()[1]
            elif line.startswith("Ctrl-C"):
                break
        assert logs and Path(logs).is_dir()
        os.killpg(up.pid, signal.SIGINT)  # what the terminal does
        assert up.wait(timeout=60) == 0
        said = up.stdout.read()
        assert "stopped." in said and "failed or was killed" not in said, said
        assert not Path(logs).exists(), "a clean stop removes its logs"
        assert _children_of(up.pid) == []
    finally:
        reap(up)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_in_a_terminal_stops_an_embedded_cluster_cleanly_and_removes_its_logs() -> None:
    """Issue #28 item 6, the embedded cluster's part: a script on ``pw.connect()`` interrupted by Ctrl-C."""
    script = textwrap.dedent("""
        import threading, numpy as np, pwmesh as pw
        client = pw.connect(cluster=pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=1))
        sl = client.make_virtual_device_set().add_slice(devices=2)
        print(np.asarray(pw.pmap(lambda v: v + 1, devices=sl)(np.zeros((2, 1), np.float32))).sum(), flush=True)
        print(client.cluster.log_dir, flush=True)
        threading.Event().wait()
    """)
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=_env(), start_new_session=True)
    try:
        assert run.stdout is not None and run.stderr is not None
        assert run.stdout.readline().strip() == "2.0"
        logs = Path(run.stdout.readline().strip())
        assert logs.is_dir()
        os.killpg(run.pid, signal.SIGINT)
        run.wait(timeout=60)
        said = run.stderr.read()
        assert "KeyboardInterrupt" in said and "failed or was killed" not in said, said[-2000:]
        assert not logs.exists(), "a clean stop removes its logs"
        assert _children_of(run.pid) == []
    finally:
        reap(run)


# ------------------------------------------------------------------ behaving as people expect


def test_help_imports_neither_jax_nor_the_client() -> None:
    """What keeps every --help quick: the CLI loads JAX only inside the command that runs."""
    code = textwrap.dedent("""
        import sys
        from click.testing import CliRunner
        from pwmesh.cli.main import main
        for args in (["--help"], *([c, "--help"] for c in main.commands)):
            result = CliRunner().invoke(main, args)
            assert result.exit_code == 0, (args, result.output)
        print(sorted(m for m in sys.modules if m == "jax" or m.startswith("pwmesh.client")))
    """)
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_options_show_the_environment_variables_they_read() -> None:
    text = CliRunner().invoke(main, ["status", "--help"]).output
    assert "PWMESH_ADDRESS" in text and "PWMESH_CONNECT_TIMEOUT" in text
    assert "PWMESH_DEBUG" in CliRunner().invoke(main, ["--help"]).output


def test_nothing_answering_is_one_line_within_the_connect_timeout() -> None:
    result = CliRunner().invoke(main, ["status", "--address", "tcp://127.0.0.1:1", "--connect-timeout", "0.5"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "nothing answered at tcp://127.0.0.1:1 within 0.5 seconds" in lines[0], result.output
    debug = CliRunner().invoke(main, ["--debug", "status", "--address", "tcp://127.0.0.1:1", "--connect-timeout",
                                      "0.5"])
    assert isinstance(debug.exception, pw.ConnectionFailed), "--debug lets the exception (and traceback) through"


def test_a_user_error_from_the_cluster_is_one_line(cluster: pw.LocalCluster) -> None:
    result = CliRunner().invoke(main, ["drain", "nosuchhost", "--address", cluster.address])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: no executor or host named 'nosuchhost'  (NotFound; --debug shows more)"]


TINY = pw.LocalClusterSpec(islands=1, hosts_per_island=1, devices_per_host=1)


def test_a_clean_stop_logs_no_loss_and_removes_its_own_directory(tmp_path: Path) -> None:
    with pw.LocalCluster(TINY, log_dir=str(tmp_path)) as kept:
        assert kept.log_dir == tmp_path
    rm_log = (tmp_path / "rm.log").read_text()
    assert "lost" not in rm_log, rm_log
    assert tmp_path.exists(), "a directory it was given stays"
    with pw.LocalCluster(TINY) as own:
        made = own.log_dir
        assert made.exists()
    assert not made.exists(), "its own temporary directory is gone after a clean stop"


def test_executors_stop_cleanly_after_streamed_training_steps() -> None:
    """Issue #28 item 6: an executor that had streamed computations to its devices (a short training loop,
    as ``bench/train.py --smoke`` runs) aborted at exit, inside XLA ("terminate called after throwing an
    instance of ''", status 134), so the cluster kept its logs and said a daemon failed. Now every daemon
    exits 0: the embedded cluster's own directory is gone after the stop."""
    from pwmesh.examples import lm, train_lm  # noqa: PLC0415 - the same loop as the benchmark's

    config = lm.PRESETS["tiny"]
    optimizer = lm.make_optimizer(config)
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=1, devices_per_host=4)
    with pw.LocalCluster(spec) as cluster:
        made = cluster.log_dir
        pw.connect(cluster.address, name="steps")
        try:
            result = train_lm.train(config, 8, train_lm.pwmesh_trainer(config, optimizer), optimizer, progress=False)
        finally:
            pw.disconnect()
        assert len(result.losses) == 8
    assert not made.exists(), f"a daemon did not exit 0: logs kept in {made}"


def test_a_second_connect_while_an_embedded_cluster_runs_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PWMESH_ADDRESS", raising=False)
    first = pw.connect(cluster=TINY)
    try:
        assert first.cluster is not None
        with pytest.raises(pw.InvalidArgument, match=r"already runs an embedded cluster .* pw.disconnect\(\) first"):
            pw.connect(cluster=TINY)
        assert pw.default_client() is first, "the running cluster and its client are untouched"
        with pw.Client(first.address, name="second") as second:  # what the error suggests
            assert second.session_id != first.session_id
    finally:
        pw.disconnect()
    pw.disconnect()
