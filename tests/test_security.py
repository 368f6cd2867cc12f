"""CURVE keys: ``pwmesh keys``, a cluster whose every socket speaks CURVE, and peers without the key.

The daemons are real processes with ``--keys``; the refused peers are real ZeroMQ sockets and real
clients. A peer without an authorized key fails the CURVE handshake inside ZeroMQ: it gets no reply,
leaves no session and makes no log line in the daemons.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from click.testing import CliRunner

import pwmesh as pw
from pwmesh.cli.commands import fetch_status
from pwmesh.cli.main import main
from pwmesh.client.connection import ClientConnection
from pwmesh.service import keys as cluster_keys
from pwmesh.service.transport import Context
from pwmesh.wire import encode
from pwmesh.wire.messages import Ping


@pytest.fixture(scope="module")
def key_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("keys")
    cluster = cluster_keys.init(root / "cluster")
    stranger = cluster_keys.init(root / "another-cluster")
    return {"cluster": cluster, "alice": cluster_keys.add_client(cluster, "alice"),
            "stranger": cluster_keys.add_client(stranger, "mallory")}


@pytest.fixture(scope="module")
def keyed(key_dirs: dict[str, Path]) -> Iterator[pw.LocalCluster]:
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=1, devices_per_host=2, keys=str(key_dirs["cluster"]))
    with pw.LocalCluster(spec) as running:
        yield running


@pytest.fixture(autouse=True)
def no_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PWMESH_KEYS", raising=False)


def test_keys_init_add_client_and_list(tmp_path: Path) -> None:
    where = tmp_path / "k"
    runner = CliRunner()
    assert runner.invoke(main, ["keys", "init", str(where)]).exit_code == 0
    assert (where / "cluster.key_secret").stat().st_mode & 0o077 == 0, "the secret is the owner's alone"
    added = runner.invoke(main, ["keys", "add-client", "bob", "--keys", str(where)])
    assert added.exit_code == 0, added.output
    given = where / "clients" / "bob"
    assert {p.name for p in given.iterdir()} == {"bob.key", "bob.key_secret", "cluster.key"}
    listed = runner.invoke(main, ["keys", "list"], env={"PWMESH_KEYS": str(where)})
    assert [line.split()[:2] for line in listed.output.splitlines()] == [["bob", "client"], ["cluster", "daemons"]]
    again = runner.invoke(main, ["keys", "init", str(where)])
    assert again.exit_code == 1 and "not empty" in again.output, "never overwrites a cluster's keys"
    twice = runner.invoke(main, ["keys", "add-client", "bob", "--keys", str(where)])
    assert twice.exit_code == 1 and "already has keys" in twice.output


def test_a_secret_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    where = cluster_keys.init(tmp_path / "k")
    (where / "cluster.key_secret").chmod(0o644)
    with pytest.raises(pw.InvalidArgument, match="readable by others"):
        cluster_keys.Keys.load(where)


def test_a_client_with_the_key_runs_programs(keyed: pw.LocalCluster, key_dirs: dict[str, Path]) -> None:
    with pw.Client(keyed.address, name="alice", keys=str(key_dirs["alice"])) as client:
        double = pw.pmap(lambda x: x * 2.0, devices=client.make_virtual_device_set().add_slice(devices=2))
        np.testing.assert_array_equal(np.asarray(double(np.array([1.0, 2.0], np.float32))), [2.0, 4.0])


@pytest.mark.parametrize("who", ["no keys", "another cluster's client"])
def test_a_client_without_an_authorized_key_gets_nothing(keyed: pw.LocalCluster, key_dirs: dict[str, Path],
                                                         who: str, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = None if who == "no keys" else str(key_dirs["stranger"])
    logs_before = {c.name: c.log_path.stat().st_size for c in keyed.children}
    for _ in range(3):
        start = time.monotonic()
        with pytest.raises(pw.ConnectionFailed, match="nothing answered"):
            ClientConnection(keyed.address, name="intruder", connect_timeout_seconds=0.5, keys=keys)
        assert time.monotonic() - start < 5.0
    monkeypatch.setenv("PWMESH_KEYS", str(key_dirs["alice"]))  # as `pwmesh status --keys` passes them on
    sessions = fetch_status(keyed.address, connect_timeout_seconds=10.0).sessions
    assert not any(s.name == "intruder" for s in sessions), "no session was opened"
    assert {c.name: c.log_path.stat().st_size for c in keyed.children} == logs_before, "and nothing was logged"


def test_raw_frames_without_curve_get_no_reply(keyed: pw.LocalCluster) -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(keyed.address)
        sock.send_multipart(encode(Ping(), msg_id=1, sender="plaintext"))
        sock.send_multipart([b"junk", b"\x00" * 64])
        assert sock.poll(timeout=1000) == 0, "a plaintext peer gets nothing back"
    finally:
        ctx.destroy(linger=0)


def test_binding_off_loopback_without_keys_is_refused_with_a_clear_message() -> None:
    ctx = Context()
    try:
        with pytest.raises(pw.InvalidArgument, match="refusing to bind .* without keys.*--insecure"):
            ctx.router("tcp://0.0.0.0:0")  # refused before anything binds
    finally:
        ctx.close()
    daemon = subprocess.run([sys.executable, "-m", "pwmesh.cli.daemons", "rm", "--listen", "tcp://0.0.0.0:0"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert daemon.returncode == 1
    assert "Traceback" not in daemon.stderr
    assert daemon.stderr.strip().splitlines()[-1] == (
        "Error: pwmesh-rm: refusing to bind tcp://0.0.0.0:0 without keys: anyone who reaches it could run code "
        "on the cluster. Give --keys DIR (`pwmesh keys init DIR`), or --insecure on a network you trust")
