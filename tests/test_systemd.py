"""The systemd units and ``bin/pwmesh-install-systemd``: what they install, and that the daemons accept
the command lines the units run."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

from pwmesh.cli.daemons import executor_main, proxy_main, rm_main, scheduler_main

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bin" / "pwmesh-install-systemd"
UNITS = {"pwmesh-rm.service": rm_main, "pwmesh-proxy.service": proxy_main,
         "pwmesh-scheduler@.service": scheduler_main, "pwmesh-executor@.service": executor_main}


def install(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=30)


def env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))


def exec_start(unit: str, env: dict[str, str], instance: str = "0") -> list[str]:
    """The arguments systemd would pass (``${VAR}`` as one word, even when empty; ``%i`` the instance)."""
    line = next(x for x in (ROOT / "systemd" / unit).read_text().splitlines() if x.startswith("ExecStart="))
    words = shlex.split(line.removeprefix("ExecStart=").replace("%i", instance))
    return [re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), w) for w in words[1:]]


def test_installs_the_unit_the_environment_file_and_the_units_own_metrics_port(tmp_path: Path) -> None:
    done = install("scheduler", "--island", "1", "--metrics-port", "9102", "--prefix", str(tmp_path))
    assert done.returncode == 0, done.stderr
    unit = tmp_path / "etc/systemd/system/pwmesh-scheduler@.service"
    assert unit.read_text() == (ROOT / "systemd/pwmesh-scheduler@.service").read_text()
    assert unit.stat().st_mode & 0o777 == 0o644
    env = tmp_path / "etc/pwmesh/pwmesh.env"
    assert "PWMESH_METRICS_PORT=" in env.read_text()
    assert "PWMESH_KEYS=" in env.read_text()  # the template's, or a placeholder where it has none
    assert env_file(env)["PWMESH_RM_ADDRESS"]  # the example's addresses, to edit
    assert env_file(tmp_path / "etc/pwmesh/pwmesh-scheduler@1.env") == {"PWMESH_METRICS_PORT": "9102"}
    assert "systemctl daemon-reload && sudo systemctl enable --now pwmesh-scheduler@1" in done.stdout

    # A second daemon on the same host: the edited environment file is kept, its port is its own.
    env.write_text(env.read_text().replace("10.0.0.1", "192.168.1.5"))
    edited = env.read_text()
    done = install("rm", "--metrics-port", "9100", "--prefix", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert env.read_text() == edited and "kept" in done.stdout
    assert env_file(tmp_path / "etc/pwmesh/pwmesh-rm.env") == {"PWMESH_METRICS_PORT": "9100"}
    assert (tmp_path / "etc/systemd/system/pwmesh-rm.service").exists()
    assert "enable --now pwmesh-rm\n" in done.stdout


def test_without_a_metrics_port_no_unit_file_of_its_own(tmp_path: Path) -> None:
    done = install("executor", "--island", "0", "--prefix", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "etc/pwmesh").iterdir()) == ["pwmesh.env"]


@pytest.mark.parametrize(("args", "error"), [
    (["scheduler"], "give --island N"),
    (["rm", "--island", "0"], "--island is for scheduler and executor"),
    (["gpu"], "invalid choice"),
    (["proxy", "--metrics-port", "70000"], "0-65535"),
])
def test_bad_usage_is_a_clear_error_and_installs_nothing(tmp_path: Path, args: list[str], error: str) -> None:
    done = install(*args, "--prefix", str(tmp_path))
    assert done.returncode == 2 and error in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_every_unit_passes_its_metrics_port_and_the_daemon_accepts_the_command_line(unit: str) -> None:
    text = (ROOT / "systemd" / unit).read_text()
    assert "--metrics-port ${PWMESH_METRICS_PORT}" in text
    assert "EnvironmentFile=-/etc/pwmesh/%N.env" in text  # after the shared file: the unit's own port wins
    assert text.index("pwmesh.env") < text.index("%N.env")
    env = env_file(ROOT / "systemd/pwmesh.env")
    assert env["PWMESH_METRICS_PORT"] == ""  # off unless set
    command: click.Command = UNITS[unit]
    for port, expected in (("", None), ("9101", 9101)):
        ctx = command.make_context(unit, exec_start(unit, {**env, "PWMESH_METRICS_PORT": port}))
        assert ctx.params["metrics_port"] == expected


def test_with_keys_the_keys_are_installed_private_and_the_unit_runs_as_their_owner(tmp_path: Path) -> None:
    from pwmesh.service.keys import init  # noqa: PLC0415 - only this test makes keys

    keys = init(tmp_path / "made")
    root = tmp_path / "root"
    done = install("executor", "--island", "0", "--keys", str(keys), "--prefix", str(root))
    assert done.returncode == 0, done.stderr
    installed = root / "etc/pwmesh/keys"
    assert (installed / "cluster.key_secret").read_bytes() == (keys / "cluster.key_secret").read_bytes()
    assert (installed / "cluster.key_secret").stat().st_mode & 0o077 == 0
    assert installed.stat().st_mode & 0o777 == 0o700
    drop_in = (root / "etc/systemd/system/pwmesh-executor@.service.d/keys.conf").read_text()
    assert "DynamicUser=no" in drop_in and "User=pwmesh" in drop_in
    assert "chown -R pwmesh:pwmesh /etc/pwmesh/keys" in done.stdout
    assert "PWMESH_KEYS=/etc/pwmesh/keys" in (root / "etc/pwmesh/pwmesh.env").read_text()
    again = install("proxy", "--keys", str(keys), "--prefix", str(root))
    assert again.returncode == 0 and "kept" in again.stdout, "installed keys are never overwritten"
    bad = install("proxy", "--keys", str(tmp_path), "--prefix", str(root))
    assert bad.returncode == 2 and "not a cluster's keys directory" in bad.stderr
