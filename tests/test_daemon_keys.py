"""Daemon hosts with keys of their own (issue #26, item 1): ``pwmesh keys add-daemon NAME``.

A cluster of real daemons, each started with its own key (``LocalClusterSpec(daemon_keys=True)``),
runs programs as one with the cluster's key does. A daemon host's key acts only as that host: a
second daemon key, "rogue", tries to register, unregister, take over and complete work as the
cluster's executors and scheduler, and to allocate slices as the proxy; each is refused with
``pw.PermissionDenied`` and the cluster goes on. Removing the rogue's key shuts it out.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from jax.sharding import PartitionSpec as P

import pwmesh as pw
from helpers import admitted, eventually, refused
from pwmesh.cli.commands import fetch_status
from pwmesh.cli.main import main
from pwmesh.client.connection import ClientConnection
from pwmesh.errors import InvalidArgument
from pwmesh.service import keys as cluster_keys
from pwmesh.wire.messages import (
    AllocateSlice,
    DeviceInfo,
    ExecutorInfo,
    NodeDone,
    Ping,
    Pong,
    RegisterExecutor,
    RegisterScheduler,
    RunPartDone,
    UnregisterExecutor,
    WatchCluster,
)
from pwmesh.wire.records import SchedulerInfo


@pytest.fixture(scope="module")
def key_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cluster = cluster_keys.init(tmp_path_factory.mktemp("daemon-keys") / "cluster")
    return {"cluster": cluster, "alice": cluster_keys.add_client(cluster, "alice"),
            "root": cluster_keys.add_client(cluster, "root", admin=True),
            "rogue": cluster_keys.add_daemon(cluster, "rogue")}


@pytest.fixture(scope="module")
def hosts(key_dirs: dict[str, Path]) -> Iterator[pw.LocalCluster]:
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=1, keys=str(key_dirs["cluster"]),
                               daemon_keys=True)
    with pw.LocalCluster(spec) as running:
        yield running


def test_keys_add_daemon_makes_a_host_directory_bound_to_its_name(tmp_path: Path) -> None:
    runner = CliRunner()
    directory = tmp_path / "keys"
    assert runner.invoke(main, ["keys", "init", str(directory)]).exit_code == 0
    added = runner.invoke(main, ["keys", "add-daemon", "host-a", "--keys", str(directory)])
    assert added.exit_code == 0, added.output
    given = directory / "daemons" / "host-a"
    # An executor or scheduler host holds no cluster secret: it serves and connects with its own key.
    assert sorted(p.name for p in given.iterdir()) == ["cluster.key", "host-a.key", "host-a.key_secret"]
    keys = cluster_keys.Keys.load(given)
    assert keys.daemon_name == "host-a"
    assert keys.authorized == directory / "authorized"  # inside the cluster's directory: its authorized/
    assert keys.own is not None and keys.own[1] == keys.public != keys.server_public
    assert cluster_keys.unkeyed(keys.advertise("tcp://127.0.0.1:7")) == ("tcp://127.0.0.1:7", keys.public)
    # A front host (the resource manager's, a proxy's) also serves with the cluster's pair.
    front = cluster_keys.Keys.load(cluster_keys.add_daemon(directory, "front-a", front=True))
    assert front.daemon_name == "front-a" and front.public == front.server_public != front.own[1]
    assert front.advertise("tcp://127.0.0.1:7") == "tcp://127.0.0.1:7"
    assert runner.invoke(main, ["keys", "remove", "front-a", "--keys", str(directory)]).exit_code == 0
    listed = runner.invoke(main, ["keys", "list", "--keys", str(directory)])
    assert [line.split()[:3] for line in listed.output.splitlines()] == [
        ["cluster", "daemons", keys.server_public.decode()], ["host-a", "daemon", "host"]]
    assert cluster_keys.Security(str(given)).named("", "fallback") == "host-a"
    assert cluster_keys.Security(str(given)).named("given", "fallback") == "given"
    for name in ("cluster", "local", "host-a", "bad name"):
        with pytest.raises(InvalidArgument):
            cluster_keys.add_daemon(directory, name)
    removed = runner.invoke(main, ["keys", "remove", "host-a", "--keys", str(directory)])
    assert removed.exit_code == 0 and "host-a.key" in removed.output
    assert [line.split()[0] for line in runner.invoke(main, ["keys", "list", "--keys", str(directory)])
            .output.splitlines()] == ["cluster"]


@pytest.mark.parametrize(("user", "daemon", "allowed"), [
    ("cluster", "island0-host0", True), ("local", "anything", True),
    ("host-a", "host-a", True), ("host-a", "host-a:1", True),
    ("host-a", "host-b", False), ("host-a", "host-ab", False), ("host", "host-a", False)])
def test_a_daemon_key_speaks_only_for_its_own_name(user: str, daemon: str, allowed: bool) -> None:
    assert cluster_keys.speaks_for(user, daemon) is allowed


def test_daemons_with_keys_of_their_own_run_programs(hosts: pw.LocalCluster, key_dirs: dict[str, Path]) -> None:
    with pw.Client(hosts.address, name="alice", keys=str(key_dirs["alice"])) as alice:
        sl = alice.make_virtual_device_set().add_slice(devices=2)
        a = alice.put(np.arange(4.0, dtype=np.float32).reshape(2, 2), sl)
        np.testing.assert_array_equal(np.asarray(pw.pmap(lambda x: x * 2, devices=sl)(a)), [[0, 2], [4, 6]])
    state = fetch_status(hosts.address, keys=str(key_dirs["root"])).cluster
    assert sorted(e.executor_id for e in state.executors) == ["island0-host0", "island0-host1"]
    assert [s.name for s in state.schedulers] == ["scheduler-0"]  # each named by its own key


def test_executor_and_scheduler_hosts_serve_with_their_own_keys_and_stream_pairwise(
        hosts: pw.LocalCluster, key_dirs: dict[str, Path]) -> None:
    """No executor or scheduler host holds the cluster's secret: each serves with its own key, which its
    advertised addresses carry; a connection expecting the cluster's key gets nothing there. Data between
    two such hosts moves on streams keyed by the pair (a reshard that swaps the executors' halves)."""
    state = fetch_status(hosts.address, keys=str(key_dirs["root"])).cluster
    controls = [*((e.control, e.executor_id) for e in state.executors), *((s.address, s.name) for s in state.schedulers)]
    for address, name in [*controls, *((e.data, e.executor_id) for e in state.executors)]:
        assert cluster_keys.unkeyed(address)[1] == cluster_keys.Keys.load(
            key_dirs["cluster"] / "daemons" / name).public, address
        assert not (key_dirs["cluster"] / "daemons" / name / "cluster.key_secret").exists()
    for address, name in controls:
        assert admitted(address, key_dirs["root"])
        assert not admitted(cluster_keys.unkeyed(address)[0], key_dirs["root"]), f"{name}: not the cluster's key"
    with pw.Client(hosts.address, name="alice", keys=str(key_dirs["alice"])) as alice:
        sl = alice.make_virtual_device_set().add_slice(devices=2)
        assert len(sl.executors) == 2
        x = alice.put(np.arange(8.0, dtype=np.float32).reshape(2, 4), sl)
        flipped = pw.reshard(pw.pmap(lambda v: v[::-1], devices=sl)(x), devices=sl, spec=P())
        np.testing.assert_array_equal(np.asarray(flipped), np.arange(8.0, dtype=np.float32).reshape(2, 4)[:, ::-1])


def raw(address: str, keys: Path) -> ClientConnection:
    return ClientConnection(address, name="raw", open_session=False, keys=str(keys), connect_timeout_seconds=5.0)


def test_a_daemon_key_acts_only_as_its_own_host(hosts: pw.LocalCluster, key_dirs: dict[str, Path]) -> None:
    with pw.Client(hosts.address, name="alice", keys=str(key_dirs["alice"])) as alice:
        sl = alice.make_virtual_device_set().add_slice(devices=2)
        a = alice.put(np.arange(4.0, dtype=np.float32).reshape(2, 2), sl)
        add = pw.pmap(lambda x, y: x + y, devices=sl)
        np.testing.assert_array_equal(np.asarray(add(a, a)), [[0, 2], [4, 6]])
        state = fetch_status(hosts.address, keys=str(key_dirs["root"])).cluster
        victim = state.executors[0]
        session = fetch_status(hosts.address, keys=str(key_dirs["alice"])).sessions[0].session_id
        devices = [DeviceInfo(index=0, kind="cpu", platform="cpu", global_id=900)]
        attacks = {
            hosts.rm_address: [
                (RegisterExecutor(info=ExecutorInfo(executor_id=victim.executor_id, island=0, host="rogue",
                                                    control="tcp://127.0.0.1:1", data="tcp://127.0.0.1:2",
                                                    devices=devices)), "may act only as 'rogue'"),
                (RegisterExecutor(info=ExecutorInfo(executor_id="rogue", island=0, host="rogue",
                                                    control=victim.control, data=victim.data,
                                                    devices=devices)), "cannot advertise"),
                (UnregisterExecutor(executor_id=victim.executor_id, reason="rogue"), "may act only as 'rogue'"),
                (WatchCluster(role="proxy", name="proxy"), "may act only as 'rogue'"),
                (RegisterScheduler(info=SchedulerInfo(island=0, address="tcp://127.0.0.1:1", name="rogue")),
                 "has a live scheduler"),
                (AllocateSlice(owner=session, devices=1), "is a proxy's"),
            ],
            state.schedulers[0].address: [
                (RunPartDone(run_id=f"{session}:1", executor_id=victim.executor_id, device_seconds=1.0),
                 "cannot report"),
            ],
            hosts.address: [
                (NodeDone(run_id=f"{session}:1-00000000", nodes=[0], executor_id=victim.executor_id),
                 "cannot report"),
            ],
        }
        for address, messages in attacks.items():
            conn = raw(address, key_dirs["rogue"])
            try:
                for message, why in messages:
                    with pytest.raises(pw.PermissionDenied, match=why):
                        conn.request(message, timeout_seconds=10.0)
                assert isinstance(conn.request(Ping(), timeout_seconds=10.0), Pong)  # and it keeps serving
            finally:
                conn.close()
        # Nothing changed: the hosts, the island's scheduler, alice's values and programs.
        after = fetch_status(hosts.address, keys=str(key_dirs["root"])).cluster
        assert [(e.executor_id, e.control, e.alive) for e in after.executors] == [
            (e.executor_id, e.control, e.alive) for e in state.executors]
        assert [s.address for s in after.schedulers] == [s.address for s in state.schedulers]
        np.testing.assert_array_equal(np.asarray(add(a, a)), [[0, 2], [4, 6]])


def test_a_removed_daemon_key_is_shut_out(hosts: pw.LocalCluster, key_dirs: dict[str, Path]) -> None:
    spare = cluster_keys.add_daemon(key_dirs["cluster"], "spare")
    eventually(lambda: admitted(hosts.rm_address, spare), 10)
    conn = raw(hosts.rm_address, spare)
    try:
        assert isinstance(conn.request(Ping(), timeout_seconds=10.0), Pong)
        cluster_keys.remove(key_dirs["cluster"], "spare")
        eventually(lambda: refused(conn, Ping()), 10)
    finally:
        conn.close()
    assert not admitted(hosts.rm_address, spare)
