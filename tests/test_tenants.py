"""Tenants on one keyed cluster (issue #26, items 1 and 2 in part): each operation is checked
against who sends it, by the key its connection authenticated with (ZAP's User-Id).

Real daemons with ``--keys``; two client keys, alice and bob, and an admin key. Bob tries,
with his own key, what a tenant could do before: talk to the executors, the resource
manager, the scheduler and the proxy as a daemon does (read, overwrite and delete alice's
shards, register a fake executor or scheduler, unregister or drain a host, forge a
completion). Each is refused with ``pw.PermissionDenied``, the daemons keep serving, and
alice's values are intact. Clients see only their own sessions in status and trace; an admin
sees all. A removed key is refused within a second.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import pwmesh as pw
from helpers import eventually
from pwmesh.cli.main import main
from pwmesh.client.connection import ClientConnection
from pwmesh.service import keys as cluster_keys
from pwmesh.wire.messages import (
    CancelRun,
    DeleteShards,
    DeviceInfo,
    DrainExecutor,
    DrainHost,
    ErrorInfo,
    ExecutorInfo,
    FetchShards,
    GetClusterTrace,
    GetExecutorStats,
    GetStatus,
    NodeDone,
    Ping,
    Pong,
    PutShards,
    RegisterExecutor,
    RegisterScheduler,
    ScheduleRun,
    StatusReply,
    UnregisterExecutor,
)
from pwmesh.wire.records import SchedulerInfo


@pytest.fixture(scope="module")
def key_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tenant-keys")
    cluster = cluster_keys.init(root / "cluster")
    return {"cluster": cluster, "alice": cluster_keys.add_client(cluster, "alice"),
            "bob": cluster_keys.add_client(cluster, "bob"),
            "root": cluster_keys.add_client(cluster, "root", admin=True)}


@pytest.fixture(scope="module")
def keyed(key_dirs: dict[str, Path]) -> Iterator[pw.LocalCluster]:
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=1, keys=str(key_dirs["cluster"]))
    with pw.LocalCluster(spec) as running:
        yield running


@pytest.fixture(autouse=True)
def no_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PWMESH_KEYS", raising=False)


def raw(address: str, keys: Path) -> ClientConnection:
    """A connection that opens no session: what a tenant who writes their own frames has."""
    return ClientConnection(address, name="raw", open_session=False, keys=str(keys), connect_timeout_seconds=5.0)


def status(address: str, keys: Path) -> StatusReply:
    conn = raw(address, keys)
    try:
        reply = conn.request(GetStatus(), timeout_seconds=30.0)
    finally:
        conn.close()
    assert isinstance(reply, StatusReply)
    return reply


def test_a_client_key_cannot_act_as_a_daemon(keyed: pw.LocalCluster, key_dirs: dict[str, Path]) -> None:
    with pw.Client(keyed.address, name="alice", keys=str(key_dirs["alice"])) as alice:
        sl = alice.make_virtual_device_set().add_slice(devices=2)
        a = alice.put(np.arange(4.0, dtype=np.float32).reshape(2, 2), sl)
        add = pw.pmap(lambda x, y: x + y, devices=sl)
        np.testing.assert_array_equal(np.asarray(add(a, a)), [[0.0, 2.0], [4.0, 6.0]])
        state = status(keyed.address, key_dirs["root"]).cluster
        executor = state.executors[0]
        (session,) = [s.session_id for s in status(keyed.address, key_dirs["alice"]).sessions]
        # What bob would need to guess is given to him: alice's session id and her shards' keys.
        keys = [f"{session}/b{i}.{j}/0" for i in range(4) for j in range(4)]
        attacks = {
            executor.control: [
                FetchShards(keys=keys[:1]),
                PutShards(keys=keys, devices=[0] * len(keys), arrays=[np.full(2, 666.0, np.float32)] * len(keys)),
                DeleteShards(buffers=[k.rpartition("/")[0] for k in keys]),
                CancelRun(run_id=f"{session}:1-00000000", error=ErrorInfo(code="internal", message="bob")),
            ],
            keyed.rm_address: [
                RegisterScheduler(info=SchedulerInfo(island=0, address="tcp://127.0.0.1:1", name="bob")),
                RegisterExecutor(info=ExecutorInfo(
                    executor_id="bob-host", island=0, host="bob", control="tcp://127.0.0.1:1",
                    data="tcp://127.0.0.1:2", pid=1,
                    devices=[DeviceInfo(index=i, kind="cpu", platform="cpu", global_id=100 + i) for i in range(8)])),
                UnregisterExecutor(executor_id=executor.executor_id, reason="bob"),
                DrainExecutor(executor=executor.executor_id),
            ],
            state.schedulers[0].address: [ScheduleRun(run_id="bob:1", proxy=keyed.address, parts=[])],
            keyed.address: [NodeDone(run_id=f"{session}:1-00000000", nodes=[0], executor_id=executor.executor_id),
                            DrainHost(executor=executor.executor_id)],
        }
        for address, messages in attacks.items():
            conn = raw(address, key_dirs["bob"])
            try:
                for message in messages:
                    with pytest.raises(pw.PermissionDenied, match=f"{message.op} from bob"):
                        conn.request(message, timeout_seconds=10.0)
                # Each daemon still answers him what anyone may ask.
                assert isinstance(conn.request(Ping(), timeout_seconds=10.0), Pong)
            finally:
                conn.close()
        # Nothing changed: alice's values, her executors and the island's scheduler are as they were.
        np.testing.assert_array_equal(np.asarray(a), [[0.0, 1.0], [2.0, 3.0]])
        np.testing.assert_array_equal(np.asarray(add(a, a)), [[0.0, 2.0], [4.0, 6.0]])
        after = status(keyed.address, key_dirs["root"]).cluster
        assert sorted(e.executor_id for e in after.executors) == sorted(e.executor_id for e in state.executors)
        assert all(e.alive and not e.draining for e in after.executors)
        assert [s.address for s in after.schedulers] == [s.address for s in state.schedulers]


def test_clients_see_their_own_sessions_and_an_admin_sees_all(keyed: pw.LocalCluster,
                                                               key_dirs: dict[str, Path]) -> None:
    with pw.Client(keyed.address, name="alice-job", keys=str(key_dirs["alice"])) as alice, \
            pw.Client(keyed.address, name="bob-job", keys=str(key_dirs["bob"])) as bob:
        for client in (alice, bob):
            sl = client.make_virtual_device_set().add_slice(devices=1)
            np.asarray(pw.pmap(lambda x: x * 2.0, devices=sl)(np.ones((1, 2), np.float32)))
        assert [s.name for s in status(keyed.address, key_dirs["bob"]).sessions] == ["bob-job"]
        assert [s.name for s in status(keyed.address, key_dirs["alice"]).sessions] == ["alice-job"]
        assert {s.name for s in status(keyed.address, key_dirs["root"]).sessions} >= {"alice-job", "bob-job"}
        mine = {s.session_id for s in status(keyed.address, key_dirs["bob"]).sessions}
        conn = raw(keyed.address, key_dirs["bob"])
        try:
            trace = conn.request(GetClusterTrace(), timeout_seconds=30.0)
        finally:
            conn.close()
        runs = {e.run_id.split(":")[0] for t in trace.executors for e in t.events}
        assert runs and runs <= mine, "bob's trace shows his runs only"
        # An admin's key passes the check that a client's fails (the host named does not exist).
        conn = raw(keyed.address, key_dirs["root"])
        try:
            with pytest.raises(pw.NotFound):
                conn.request(DrainHost(executor="no-such-host"), timeout_seconds=10.0)
            executor = status(keyed.address, key_dirs["root"]).cluster.executors[0]
            admin_view = raw(executor.control, key_dirs["root"])
            try:
                assert admin_view.request(GetExecutorStats(), timeout_seconds=10.0).executor_id == executor.executor_id
            finally:
                admin_view.close()
        finally:
            conn.close()


def test_a_removed_key_is_refused_within_a_second(keyed: pw.LocalCluster, key_dirs: dict[str, Path]) -> None:
    carol = cluster_keys.add_client(key_dirs["cluster"], "carol")

    def admitted() -> bool:  # a key added counts from the daemons' next read of authorized/ (once a second)
        try:
            ClientConnection(keyed.address, name="probe", open_session=False, probe=True, keys=str(carol),
                             connect_timeout_seconds=1.5).close()
        except pw.ConnectionFailed:
            return False
        return True

    eventually(admitted, 10)
    conn = raw(keyed.address, carol)
    try:
        assert isinstance(conn.request(GetStatus(), timeout_seconds=10.0), StatusReply)
        cluster_keys.remove(key_dirs["cluster"], "carol")
        removed = time.monotonic()

        def refused() -> bool:
            try:
                conn.request(GetStatus(), timeout_seconds=5.0)
            except pw.PermissionDenied:
                return True
            return False

        eventually(refused, 10)
        assert time.monotonic() - removed < 2.5  # refreshed at most once a second, plus a round trip
    finally:
        conn.close()
    with pytest.raises(pw.ConnectionFailed):  # and no new connection gets through
        pw.Client(keyed.address, keys=str(carol), connect_timeout_seconds=2.0)


def test_keys_add_admin_remove_and_list(tmp_path: Path) -> None:
    runner = CliRunner()
    directory = str(tmp_path / "keys")
    assert runner.invoke(main, ["keys", "init", directory]).exit_code == 0
    assert runner.invoke(main, ["keys", "add-client", "bob", "--keys", directory]).exit_code == 0
    added = runner.invoke(main, ["keys", "add-admin", "root", "--keys", directory])
    assert added.exit_code == 0, added.output
    listed = runner.invoke(main, ["keys", "list", "--keys", directory])
    assert [line.split()[:2] for line in listed.output.splitlines()] == [
        ["bob", "client"], ["cluster", "daemons"], ["root", "admin"]]
    removed = runner.invoke(main, ["keys", "remove", "bob", "--keys", directory])
    assert removed.exit_code == 0 and "bob.key" in removed.output
    listed = runner.invoke(main, ["keys", "list", "--keys", directory])
    assert [line.split()[0] for line in listed.output.splitlines()] == ["cluster", "root"]
    refused = runner.invoke(main, ["keys", "remove", "cluster", "--keys", directory])
    assert refused.exit_code == 1 and "daemons' key" in refused.output
