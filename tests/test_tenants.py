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
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import zmq
from click.testing import CliRunner
from test_liveness import LANES, long_steps, spin
from zmq.utils.monitor import recv_monitor_message

import pwmesh as pw
from helpers import admitted, eventually, refused
from pwmesh.cli.commands import fetch_status
from pwmesh.cli.main import main
from pwmesh.client.connection import ClientConnection
from pwmesh.proxy import tenants
from pwmesh.service import keys as cluster_keys
from pwmesh.wire import decode, encode
from pwmesh.wire.messages import (
    CancelRun,
    ClaimProxy,
    DeleteShards,
    DeviceInfo,
    DrainExecutor,
    DrainHost,
    ErrorInfo,
    EventLines,
    ExecutorInfo,
    FetchShards,
    GetClusterTrace,
    GetEvents,
    GetExecutorStats,
    GetStatus,
    ListHeld,
    NodeDone,
    Ping,
    Pong,
    PutShards,
    ReclaimOwner,
    RegisterExecutor,
    RegisterScheduler,
    ResumedBuffer,
    ResumeSession,
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


def raw(address: str, keys: Path) -> ClientConnection:
    """A connection that opens no session: what a tenant who writes their own frames has."""
    return ClientConnection(address, name="raw", open_session=False, keys=str(keys), connect_timeout_seconds=5.0)


def status(address: str, keys: Path) -> StatusReply:
    return fetch_status(address, keys=str(keys))


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
                # What a restarted proxy asks (sessions that outlive it): never a tenant's to ask.
                ReclaimOwner(prefix=f"{session}/", marker="", why="bob", drop=True),
                ListHeld(),
            ],
            keyed.rm_address: [
                RegisterScheduler(info=SchedulerInfo(island=0, address="tcp://127.0.0.1:1", name="bob")),
                RegisterExecutor(info=ExecutorInfo(
                    executor_id="bob-host", island=0, host="bob", control="tcp://127.0.0.1:1",
                    data="tcp://127.0.0.1:2", pid=1,
                    devices=[DeviceInfo(index=i, kind="cpu", platform="cpu", global_id=100 + i) for i in range(8)])),
                UnregisterExecutor(executor_id=executor.executor_id, reason="bob"),
                DrainExecutor(executor=executor.executor_id),
                ClaimProxy(name="bob", address="tcp://127.0.0.1:1"),  # the active proxy's lease
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


def test_another_key_cannot_resume_a_session_even_with_its_token(keyed: pw.LocalCluster,
                                                                key_dirs: dict[str, Path]) -> None:
    """A session survives a restart of its proxy through its resume token (``pwmesh.proxy.resume``). The token
    is tied to the key that opened the session: bob, given alice's session id and token, is refused, and
    alice's session goes on."""
    with pw.Client(keyed.address, name="alice", keys=str(key_dirs["alice"])) as alice:
        sl = alice.make_virtual_device_set().add_slice(devices=1)
        a = alice.put(np.arange(2.0, dtype=np.float32).reshape(1, 2), sl)
        conn = alice.session.conn
        assert conn.resume_token, "a keyed cluster's proxy gives tokens (its secret comes from the cluster's key)"
        bob = raw(keyed.address, key_dirs["bob"])
        try:
            steal = ResumeSession(session_id=conn.session_id, token=conn.resume_token,
                                  buffers=[ResumedBuffer(buffer=a.buffer_id, spec=a.spec())], slices=[sl.slice_id])
            with pytest.raises(pw.PermissionDenied, match="does not resume session"):
                bob.request(steal, timeout_seconds=10.0)
        finally:
            bob.close()
        np.testing.assert_array_equal(np.asarray(a), [[0.0, 1.0]])
        assert [s.session_id for s in status(keyed.address, key_dirs["alice"]).sessions] == [conn.session_id]


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


def test_a_tenant_cannot_read_a_daemon_s_events(keyed: pw.LocalCluster, key_dirs: dict[str, Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``GetEvents`` (``pwmesh debug events``) shows every tenant's runs and sessions: an admin's only. A
    client key is refused it by every daemon with a clear error, and each goes on serving."""
    state = status(keyed.address, key_dirs["root"]).cluster
    daemons = {"proxy": keyed.address, "rm": keyed.rm_address, "scheduler-0": state.schedulers[0].address,
               state.executors[0].executor_id: state.executors[0].control}
    for name, address in daemons.items():
        conn = raw(address, key_dirs["bob"])
        try:
            with pytest.raises(pw.PermissionDenied, match="debug.get_events from bob"):
                conn.request(GetEvents(), timeout_seconds=10.0)
            assert isinstance(conn.request(Ping(), timeout_seconds=10.0), Pong), f"{name} stopped serving"
        finally:
            conn.close()
        admin = raw(address, key_dirs["root"])
        try:
            assert isinstance(admin.request(GetEvents(limit=5), timeout_seconds=10.0), EventLines), name
        finally:
            admin.close()
    # The command says so in one line, and an admin's key reads the log.
    monkeypatch.setenv("PWMESH_KEYS", str(key_dirs["bob"]))
    refused_cli = CliRunner().invoke(main, ["debug", "events", "rm", "--address", keyed.address])
    assert refused_cli.exit_code == 1 and "debug.get_events from bob" in refused_cli.output, refused_cli.output
    assert "Traceback" not in refused_cli.output
    monkeypatch.setenv("PWMESH_KEYS", str(key_dirs["root"]))
    read = CliRunner().invoke(main, ["debug", "events", "rm", "--address", keyed.address, "--limit", "0"])
    assert read.exit_code == 0 and "Received(message=rm.register_executor" in read.output, read.output


def test_a_removed_key_is_refused_within_a_second(keyed: pw.LocalCluster, key_dirs: dict[str, Path]) -> None:
    carol = cluster_keys.add_client(key_dirs["cluster"], "carol")
    eventually(lambda: admitted(keyed.address, carol), 10)
    conn = raw(keyed.address, carol)
    try:
        assert isinstance(conn.request(GetStatus(), timeout_seconds=10.0), StatusReply)
        cluster_keys.remove(key_dirs["cluster"], "carol")
        removed = time.monotonic()
        eventually(lambda: refused(conn, GetStatus()), 10)
        assert time.monotonic() - removed < 2.5  # refreshed at most once a second, plus a round trip
    finally:
        conn.close()
    with pytest.raises(pw.ConnectionFailed):  # and no new connection gets through
        pw.Client(keyed.address, keys=str(carol), connect_timeout_seconds=2.0)


def test_a_removed_key_s_open_connections_are_closed(keyed: pw.LocalCluster, key_dirs: dict[str, Path]) -> None:
    """Not only refused: the daemon shuts the connection a removed key's messages came in on, within a
    second or so, and ZeroMQ's reconnection then fails the handshake. Seen from a raw socket's monitor."""
    dave = cluster_keys.add_client(key_dirs["cluster"], "dave")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        cluster_keys.Keys.load(dave).connect(sock)
        sock.connect(keyed.address)

        def answered() -> bool:  # a key added counts from the daemons' next read of authorized/
            try:  # no connection yet (its handshake refused until that read): a DEALER's send would wait for one
                sock.send_multipart([b"", *encode(Ping(), msg_id=1)], flags=zmq.NOBLOCK)
            except zmq.Again:
                return False
            return sock.poll(1000) != 0 and isinstance(decode(sock.recv_multipart()[1:]).message, Pong)

        eventually(answered, 10)
        cluster_keys.remove(key_dirs["cluster"], "dave")
        removed = time.monotonic()
        events = []
        while zmq.EVENT_DISCONNECTED not in events:
            assert monitor.poll(10_000), f"no disconnect 10 s after the key's removal (events: {events})"
            events.append(recv_monitor_message(monitor)["event"])
        assert time.monotonic() - removed < 5.0
        while zmq.EVENT_HANDSHAKE_FAILED_AUTH not in events:  # it reconnects, and is refused
            assert monitor.poll(10_000), f"no refused handshake after the disconnect (events: {events})"
            events.append(recv_monitor_message(monitor)["event"])
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()


def test_a_key_added_just_after_a_read_of_authorized_counts_at_its_first_handshake(tmp_path: Path) -> None:
    """A key added within ``MISS_RELOAD_SECONDS`` of the daemon's last read of ``authorized/`` was refused at its
    first handshake, which ZeroMQ never retries: a client connecting at once waited for ever (``test_a_removed_
    key_s_open_connections_are_closed`` timed out on it once). A key folder changed since the read: read again."""
    directory = cluster_keys.init(tmp_path / "keys")
    authorized = cluster_keys.AuthorizedKeys(directory / "authorized")
    dave = cluster_keys.add_client(directory, "dave")
    public, _ = zmq.auth.load_certificate(dave / "dave.key")
    authorized._read_at = time.monotonic()  # as if read just now, after the key was written: within the window
    assert authorized.identify(public) == cluster_keys.Identity("dave", cluster_keys.CLIENT)
    stranger = b"x" * 40
    assert authorized.identify(stranger) is None  # junk, with no folder changed: no read (a stat only)


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


# ------------------------------------------------------------- the tenants' policy (item 4 in part)


@pytest.fixture
def policy(key_dirs: dict[str, Path], keyed: pw.LocalCluster) -> Iterator[Path]:
    """The proxy's policy file (tenants.json in the keys directory), removed again after the test."""
    where = key_dirs["cluster"] / tenants.FILE_NAME
    yield where
    where.unlink(missing_ok=True)

    def lifted() -> bool:  # the proxy has read the file's removal: nobody is limited any more
        try:
            with pw.Client(keyed.address, name="probe", keys=str(key_dirs["bob"]), connect_timeout_seconds=5.0), \
                    pw.Client(keyed.address, name="probe", keys=str(key_dirs["bob"]), connect_timeout_seconds=5.0):
                return True
        except pw.ResourceExhausted:
            return False

    eventually(lifted, 10)


def opened(address: str, keys: Path, **kwargs: Any) -> pw.Client:
    """A client of ``keys`` once the policy now in the file applies to it (the proxy reads it within a second)."""
    return pw.Client(address, keys=str(keys), **kwargs)


def test_shares_come_from_the_policy_not_the_client(keyed: pw.LocalCluster, key_dirs: dict[str, Path],
                                                     policy: Path) -> None:
    tenants.save(policy, tenants.TenantPolicy({"alice": tenants.TenantLimits(weight=3.0, priority=1)}))

    def session_of(keys: Path, name: str) -> Any:
        (info,) = [s for s in status(keyed.address, key_dirs["root"]).sessions if s.name == name]
        return info

    def applied() -> bool:
        with opened(keyed.address, key_dirs["alice"], name="alice-probe", weight=100.0, priority=9):
            info = session_of(key_dirs["alice"], "alice-probe")
            return (info.weight, info.priority) == (3.0, 1)

    eventually(applied, 10)
    with opened(keyed.address, key_dirs["bob"], name="bob-greedy", weight=50.0, priority=5):
        info = session_of(key_dirs["bob"], "bob-greedy")
        assert (info.weight, info.priority) == (1.0, 0), "a tenant without an entry gets the defaults, not its ask"


def test_limits_refuse_what_is_over_them(keyed: pw.LocalCluster, key_dirs: dict[str, Path], policy: Path) -> None:
    tenants.save(policy, tenants.TenantPolicy({"bob": tenants.TenantLimits(max_sessions=1, max_nodes=2,
                                                                           max_bytes=1 << 20, max_programs=2)}))
    bob = opened(keyed.address, key_dirs["bob"], name="bob")
    try:
        def limited() -> bool:
            try:
                pw.Client(keyed.address, keys=str(key_dirs["bob"]), name="bob-2").close()
            except pw.ResourceExhausted as exc:
                assert "max_sessions 1" in str(exc)
                return True
            return False

        eventually(limited, 10)
        sl = bob.make_virtual_device_set().add_slice(devices=1)
        with pytest.raises(pw.ResourceExhausted, match="max_bytes"):
            np.asarray(bob.put(np.zeros((1, 1 << 19), np.float32), sl))  # 2 MiB
        inc = pw.pmap(lambda x: x + 1.0, devices=sl)

        @pw.program
        def three(x: Any) -> Any:
            return inc(inc(inc(x)))

        with pytest.raises(pw.ResourceExhausted, match="max_nodes 2"):
            np.asarray(three(np.zeros((1, 4), np.float32)))
        np.testing.assert_array_equal(np.asarray(inc(np.zeros((1, 4), np.float32))), np.ones((1, 4)))
        # ``three`` and ``inc`` are the two programs he may hold: a third is refused, and its runs say why.
        dec = pw.pmap(lambda x: x - 1.0, devices=sl)
        with pytest.raises(pw.ResourceExhausted, match="max_programs 2"):
            np.asarray(dec(np.zeros((1, 4), np.float32)))
        np.testing.assert_array_equal(np.asarray(inc(np.ones((1, 4), np.float32))), np.full((1, 4), 2.0))
        # Alice is not bob: none of his limits are hers.
        with opened(keyed.address, key_dirs["alice"], name="alice-1"), \
                opened(keyed.address, key_dirs["alice"], name="alice-2") as alice:
            big = alice.put(np.zeros((1, 1 << 19), np.float32), alice.make_virtual_device_set().add_slice(devices=1))
            assert np.asarray(big).shape == (1, 1 << 19)
    finally:
        bob.close()


def test_a_run_past_its_deadline_fails_and_other_tenants_go_on(keyed: pw.LocalCluster, key_dirs: dict[str, Path],
                                                                policy: Path) -> None:
    tenants.save(policy, tenants.TenantPolicy({"bob": tenants.TenantLimits(max_run_seconds=1.0)}))
    with opened(keyed.address, key_dirs["bob"], name="bob") as bob, \
            opened(keyed.address, key_dirs["alice"], name="alice") as alice:
        bob_slice = bob.make_virtual_device_set().add_slice(devices=1)
        alice_slice = alice.make_virtual_device_set().add_slice(devices=1)
        spin_on = pw.pmap(spin, devices=bob_slice)
        x = np.ones((1, LANES), np.float32)

        def deadline_applies() -> bool:  # a run of a few seconds fails at its deadline once the policy is read
            steps, _ = spin_on(x, np.full(1, long_steps(4.0), np.int32))
            try:
                np.asarray(steps)
            except pw.DeadlineExceeded as exc:
                assert "max_run_seconds" in str(exc)
                return True
            return False

        eventually(deadline_applies, 30)
        start = time.monotonic()
        steps, _ = spin_on(x, np.full(1, long_steps(30.0), np.int32))
        inc = pw.pmap(lambda v: v + 1.0, devices=alice_slice)
        np.testing.assert_array_equal(np.asarray(inc(np.zeros((1, 2), np.float32))), [[1.0, 1.0]])
        with pytest.raises(pw.DeadlineExceeded):
            np.asarray(steps)
        assert time.monotonic() - start < 10.0, "failed at its deadline, not when the computation ended"


def test_bytes_in_flight_through_the_proxy_are_limited_and_given_back(keyed: pw.LocalCluster,
                                                                       key_dirs: dict[str, Path], policy: Path) -> None:
    """``max_bytes_in_flight``: a put or fetch that would put the tenant over it is refused naming it; what
    was in flight counts again once it landed (puts one after another, each awaited, all pass)."""
    tenants.save(policy, tenants.TenantPolicy({"bob": tenants.TenantLimits(max_bytes_in_flight=1 << 20)}))
    with opened(keyed.address, key_dirs["bob"], name="bob") as bob:
        sl = bob.make_virtual_device_set().add_slice(devices=1)
        # The limit guards the proxy's memory: values big enough to go direct (``client/direct.py``) never
        # pass through it, and are not counted (checked at the end). Here every value takes the proxy's path.
        bob.session.direct_min_bytes = -1

        def limited() -> bool:  # (until the proxy has read the policy, the put passes and its fetch is refused)
            try:
                np.asarray(bob.put(np.zeros((1, 1 << 19), np.float32), sl))  # 2 MiB
            except pw.ResourceExhausted as exc:
                assert "max_bytes_in_flight 1048576" in str(exc)
                return "a put of 2097152 bytes" in str(exc)
            return False

        eventually(limited, 10)
        for i in range(8):  # 8 x 0.5 MiB, one after another: each is given back when it has landed
            part = bob.put(np.full((1, 1 << 17), i, np.float32), sl)
            assert float(np.asarray(part)[0, 0]) == i
        tiled = pw.pmap(lambda x: jnp.tile(x, 8), devices=sl)(np.ones((1, 1 << 16), np.float32))  # 2 MiB out
        with pytest.raises(pw.ResourceExhausted, match="a fetch of 2097152 bytes"):
            np.asarray(tiled)
        total = pw.pmap(lambda x: x.sum(), devices=sl)(tiled)  # still there, and usable on the devices
        assert float(np.asarray(total)[0]) == 8 * (1 << 16)
        bob.session.direct_min_bytes = 1 << 20  # direct: the same fetch passes, never held by the proxy
        assert np.asarray(tiled).shape == (1, 1 << 19)


def test_tenants_set_and_list(tmp_path: Path) -> None:
    runner = CliRunner()
    path = str(tmp_path / "tenants.json")
    done = runner.invoke(main, ["tenants", "set", "alice", "--weight", "3", "--max-sessions", "2", "--file", path])
    assert done.exit_code == 0, done.output
    assert runner.invoke(main, ["tenants", "set", "alice", "--priority", "1", "--file", path]).exit_code == 0
    assert runner.invoke(main, ["tenants", "set", "*", "--max-run-seconds", "600", "--file", path]).exit_code == 0
    listed = runner.invoke(main, ["tenants", "list", "--file", path]).output.splitlines()
    assert listed == ["*                max_run_seconds=600", "alice            weight=3 priority=1 max_sessions=2"]
    assert tenants.load(path).of("bob").max_run_seconds == 600.0, "'*' is everyone not named"
    bad = runner.invoke(main, ["tenants", "set", "bob", "--weight", "0", "--file", path])
    assert bad.exit_code == 1 and "weight must be positive" in bad.output
