"""A cluster over a real network: each daemon in a Linux network namespace of its own, joined by veth
links through a bridge (``pwmesh.cli.netns``), with CURVE keys. Needs root: skipped, with the reason,
where namespaces cannot be made.

What crosses the links is captured inside the hub namespace: the Figure-2 program and a cross-island
reshard of an array holding a known byte pattern run, and the pattern never crosses in cleartext
(while a datagram sent in cleartext on purpose is seen, so the capture does see the links). A client
without the cluster's key, or with another cluster's, gets nothing.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import reap
from pwmesh.cli import netns
from pwmesh.service import keys as cluster_keys

pytestmark = pytest.mark.timeout(600)

REASON = netns.available()
CANARY = b"PWMESH-CLEARTEXT-CANARY!"
CONTROL = b"PWMESH-PLAINTEXT-CONTROL"

JOB = textwrap.dedent(f"""
    import numpy as np
    from jax.sharding import PartitionSpec as P
    import pwmesh as pw

    pw.connect(name="netns-job")
    devs = pw.make_virtual_device_set()
    a, b = devs.add_slice(devices=2, island=0), devs.add_slice(devices=2, island=1)
    canary = np.frombuffer({CANARY!r} * (1 << 15), dtype=np.uint8).reshape(2, -1)  # 768 KiB
    x = pw.put(canary, devices=a, spec=P("x"))
    y = pw.reshard(x, devices=b, spec=P("x"))  # island 0's executor to island 1's, over the data plane
    np.testing.assert_array_equal(np.asarray(y), canary)
    print("resharded", canary.nbytes)
""")


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("netns-keys")
    cluster = cluster_keys.init(root / "cluster")
    other = cluster_keys.init(root / "other")
    return {"cluster": str(cluster), "alice": str(cluster_keys.add_client(cluster, "alice")),
            "mallory": str(cluster_keys.add_client(other, "mallory"))}


@pytest.fixture(scope="module")
def cluster(keys: dict[str, str]) -> Iterator[netns.NetnsCluster]:
    if REASON:
        pytest.skip(REASON)
    with netns.NetnsCluster(keys=keys["cluster"], prefix="pwt") as running:
        yield running
    assert running.log_dir is not None and not running.log_dir.exists(), \
        "a clean stop removes the cluster's own temporary log directory"


def test_figure2_and_a_cross_island_reshard_never_cross_the_links_in_cleartext(
        cluster: netns.NetnsCluster, keys: dict[str, str], tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text(JOB)
    with cluster.capture(tmp_path / "links.raw") as captured:
        demo = cluster.client([sys.executable, "-m", "pwmesh.cli.main", "demo"], keys=keys["alice"])
        assert demo.returncode == 0, demo.stdout + demo.stderr
        assert "demo finished" in demo.stdout
        moved = cluster.client([sys.executable, str(job)], keys=keys["alice"])
        assert moved.returncode == 0, moved.stdout + moved.stderr
        assert "resharded" in moved.stdout
        control = cluster.client([sys.executable, "-c", "import socket; socket.socket(socket.AF_INET, "
                                  f"socket.SOCK_DGRAM).sendto({CONTROL!r}, ('{cluster.ip('rm')}', 9))"], keys=None)
        assert control.returncode == 0, control.stderr
    seen = captured.read_bytes()
    assert CONTROL in seen, "the capture sees what crosses the links"
    assert len(seen) > 3 * (len(CANARY) << 15), "the array crossed (put, reshard, fetch), sealed"
    assert CANARY not in seen, "no piece of the array crossed in cleartext"


@pytest.mark.parametrize("who", ["no key", "another cluster's key"])
def test_a_client_without_the_cluster_key_gets_nothing(cluster: netns.NetnsCluster, keys: dict[str, str],
                                                      who: str) -> None:
    probe = cluster.client([sys.executable, "-m", "pwmesh.cli.main", "status", "--connect-timeout", "2"],
                           keys=None if who == "no key" else keys["mallory"])
    assert probe.returncode == 1
    assert "nothing answered" in probe.stderr


BIN = Path(__file__).resolve().parent.parent / "bin" / "pwmesh-netns-cluster"


def namespaces(prefix: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(f"{prefix}-")]


@pytest.mark.skipif(bool(REASON), reason=REASON or "namespaces available")
def test_the_operator_script_starts_a_cluster_people_can_use_and_removes_it_on_ctrl_c() -> None:
    script = subprocess.Popen([sys.executable, str(BIN), "up", "--prefix", "pwb", "--subnet", "10.78.0"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert script.stdout is not None
        lines = []
        for line in script.stdout:  # ends at EOF if the script dies
            lines.append(line)
            if line.startswith("Ctrl-C"):
                break
        command = next(line for line in lines if line.startswith("  ip netns exec")).split()
        assert command[:4] == ["ip", "netns", "exec", "pwb-client"]
        status = subprocess.run([*command[:-1], "status"], capture_output=True,
                                text=True, timeout=120, check=False)
        assert status.returncode == 0, status.stderr
        assert "island1-host0" in status.stdout, "the printed client command reaches the cluster"
        script.send_signal(signal.SIGINT)
        assert script.wait(timeout=60) == 0
        assert "stopped." in script.stdout.read()
    finally:
        reap(script)
        subprocess.run([sys.executable, str(BIN), "down", "--prefix", "pwb"], capture_output=True, check=False)
    assert namespaces("pwb") == [], "Ctrl-C removed every namespace"
    made = {line.split()[0].rstrip(":"): Path(line.split()[1]) for line in lines if line.startswith(("logs:", "keys:"))}
    assert set(made) == {"logs", "keys"} and not any(path.exists() for path in made.values()), \
        "a clean stop removes the log directory and the keys it made"


@pytest.mark.skipif(bool(REASON), reason=REASON or "namespaces available")
def test_down_removes_the_namespaces_a_killed_cluster_left() -> None:
    subprocess.run(["ip", "netns", "add", "pwd-left-behind"], check=True)
    done = subprocess.run([sys.executable, str(BIN), "down", "--prefix", "pwd"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0 and "pwd-left-behind" in done.stdout
    assert namespaces("pwd") == []
