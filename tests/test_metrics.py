"""Prometheus metrics: every daemon of a real cluster serves them over HTTP, and they move with the work."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
import zmq
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from rm_driver import DrivenRM

import pwmesh as pw
from helpers import eventually
from pwmesh.cli.daemons import rm_main
from pwmesh.errors import InvalidArgument
from pwmesh.rm.daemon import ResourceManager, ResourceManagerConfig
from pwmesh.service.lifecycle import stop_process, wait_ready
from pwmesh.service.metrics import MetricsServer, counter, listen_host
from pwmesh.service.tasks import TaskGroup
from pwmesh.wire.messages import ExecutorInfo, Heartbeat, RegisterExecutor, UnregisterExecutor

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(address: str) -> Samples:
    """Every sample at ``address``, by (name, sorted labels)."""
    with urllib.request.urlopen(address, timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, metric: str, **labels: str) -> float:
    return samples.get((metric, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def metered() -> Iterator[pw.LocalCluster]:
    """One island of two one-device hosts, every daemon serving metrics."""
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=1, metrics=True)
    with pw.LocalCluster(spec) as c:
        yield c


@pytest.mark.timeout(120)
def test_every_daemon_serves_metrics_that_move_with_a_program(metered: pw.LocalCluster) -> None:
    addresses = metered.metrics_addresses()
    assert set(addresses) == {"rm", "scheduler-0", "island0-host0", "island0-host1", "proxy"}
    assert all(a.startswith("http://127.0.0.1:") and a.endswith("/metrics") for a in addresses.values())
    before = {name: scrape(a) for name, a in addresses.items()}
    for name, samples in before.items():
        role = metered.child(name).role
        assert value(samples, "pwmesh_daemon_info", role=role, name=name) == 1

    with pw.Client(metered.address, name="metrics") as client:
        devs = client.make_virtual_device_set()
        on0, on1 = devs.add_slice(devices=1), devs.add_slice(devices=1)
        assert (on0.devices[0].executor, on1.devices[0].executor) == ("island0-host0", "island0-host1")
        double = pw.pmap(lambda x: x * 2.0, devices=on0)
        inc = pw.pmap(lambda x: x + 1.0, devices=on1)

        @pw.program
        def f(v):
            return inc(double(v))  # host0 -> host1 over the data plane

        big = np.ones((1, 100_000), np.float32)  # 400 kB: past the data plane's big-frame threshold
        np.testing.assert_array_equal(np.asarray(f(big)), big * 3.0)
        during = {name: scrape(a) for name, a in addresses.items()}

    proxy, proxy0 = during["proxy"], before["proxy"]
    assert value(proxy, "pwmesh_proxy_sessions") >= 1
    assert value(proxy, "pwmesh_proxy_sessions_opened_total") >= value(proxy0, "pwmesh_proxy_sessions_opened_total") + 1
    assert value(proxy, "pwmesh_proxy_programs_total") == value(proxy0, "pwmesh_proxy_programs_total") + 1
    for op in ("proxy.open_session", "proxy.run_program", "proxy.fetch"):
        assert value(proxy, "pwmesh_messages_received_total", op=op) > value(proxy0, "pwmesh_messages_received_total",
                                                                             op=op), op
    # The program's one run goes to its island as its template, installed and run by name (issue #30 item 1).
    for op in ("sched.install_template", "sched.run_template"):
        assert value(proxy, "pwmesh_messages_sent_total", op=op) == \
            value(proxy0, "pwmesh_messages_sent_total", op=op) + 1, op

    for host in ("island0-host0", "island0-host1"):
        now, then = during[host], before[host]
        for name in ("pwmesh_executor_computations_started_total", "pwmesh_executor_computations_finished_total"):
            assert value(now, name) == value(then, name) + 1, (host, name)
        assert value(now, "pwmesh_executor_computations_failed_total") == value(then,
                                                                               "pwmesh_executor_computations_failed_total")
        assert value(now, "pwmesh_messages_received_total", op="exec.enqueue") > \
            value(then, "pwmesh_messages_received_total", op="exec.enqueue")
        assert value(now, "pwmesh_executor_device_busy_seconds_total", device="0") > \
            value(then, "pwmesh_executor_device_busy_seconds_total", device="0")
        assert value(now, "pwmesh_executor_queue_depth", device="0") == 0
        assert value(now, "pwmesh_executor_memory_limit_bytes") == 0
        assert value(now, "pwmesh_executor_functions") >= 1
        assert value(now, "process_resident_memory_bytes") > 0

    def moved(host: str, direction: str) -> float:
        return sum(value(during[host], "pwmesh_dataplane_bytes_total", direction=direction, path=p)
                   - value(before[host], "pwmesh_dataplane_bytes_total", direction=direction, path=p)
                   for p in ("tcp", "shm"))

    assert moved("island0-host0", "sent") >= big.nbytes
    assert moved("island0-host1", "received") == moved("island0-host0", "sent")

    sched, sched0 = during["scheduler-0"], before["scheduler-0"]
    assert value(sched, "pwmesh_scheduler_sequenced_total") == value(sched0, "pwmesh_scheduler_sequenced_total") + 2
    assert value(sched, "pwmesh_messages_sent_total", op="exec.enqueue") == \
        value(sched0, "pwmesh_messages_sent_total", op="exec.enqueue") + 2

    rm = during["rm"]
    assert value(rm, "pwmesh_rm_executors", state="alive") == 2
    assert value(rm, "pwmesh_rm_schedulers") == 1
    assert value(rm, "pwmesh_messages_received_total", op="rm.allocate_slice") >= 2

    # The session ended with the client: the proxy says so at its next scrape.
    assert value(scrape(addresses["proxy"]), "pwmesh_proxy_sessions") == value(proxy, "pwmesh_proxy_sessions") - 1


# ------------------------------------------------------------ one daemon, with and without the flag


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (Linux: its socket inodes in /proc/net/tcp*)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def start_rm(*args: str) -> tuple[subprocess.Popen[bytes], dict]:
    env = {**os.environ, "PWMESH_PARENT_PID": str(os.getpid())}
    env.pop("PWMESH_METRICS_PORT", None)
    proc = subprocess.Popen([sys.executable, "-m", "pwmesh.cli.daemons", "rm", "--log-level", "WARNING", *args],
                            env=env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        return proc, wait_ready(proc, 60.0, "the resource manager")
    except BaseException:
        stop_process(proc)
        raise


def stop(proc: subprocess.Popen[bytes]) -> None:
    assert stop_process(proc) == 0, "a clean stop"


def zmq_port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(60)
@pytest.mark.timeout(120)
def test_a_chain_reports_its_inner_nodes_with_its_end_not_one_by_one(metered: pw.LocalCluster) -> None:
    """Only the program's outputs matter outside its run: an executor running a chain of 12 nodes
    whose last alone is an output reports the run once, however the nodes' ends fall across its loop's
    turns (each node here takes a few milliseconds), and the proxy hears of it once, from the island's
    scheduler (``IslandDone``; issue 30 item 2), never from the executor."""
    proxy = metered.metrics_addresses()["proxy"]
    with pw.Client(metered.address, name="quiet") as client:
        devs = client.make_virtual_device_set()
        one = devs.add_slice(devices=1)
        step = pw.pmap(lambda x: jnp.tanh(x @ x.T) @ x, devices=one)

        @pw.program
        def chain(v):
            for _ in range(12):
                v = step(v)
            return v

        x = np.full((1, 256, 256), 0.01, np.float32)
        chain(x).block_until_ready()  # the first run: compiles, registers; its completion is in
        metrics = scrape(proxy)
        before = [value(metrics, "pwmesh_messages_received_total", op=op) for op in ("proxy.island_done",
                                                                                   "exec.node_done")]
        chain(x).block_until_ready()  # returns once the proxy has the run's completion
        metrics = scrape(proxy)
        after = [value(metrics, "pwmesh_messages_received_total", op=op) for op in ("proxy.island_done",
                                                                                  "exec.node_done")]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 0]


def test_without_the_flag_a_daemon_serves_no_metrics() -> None:
    proc, info = start_rm()
    try:
        assert "metrics" not in info
        assert listening_ports(proc.pid) == {zmq_port(info["address"])}  # its control socket, nothing else
    finally:
        stop(proc)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(60)
def test_rejected_frames_are_counted_by_reason() -> None:
    proc, info = start_rm("--metrics-port", "0")
    try:
        port = int(info["metrics"].rsplit(":", 1)[1].removesuffix("/metrics"))
        assert listening_ports(proc.pid) == {zmq_port(info["address"]), port}
        before = scrape(info["metrics"])
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(info["address"])
            sock.send_multipart([b"", b"\xc1not msgpack", b""])  # an unreadable header: dropped
            sock.send_multipart([b"", msgpack.packb([99, "ping", 1, None, "junk"]), b"\x80"])  # another version

            def counted(reason: str) -> float:
                after = scrape(info["metrics"])
                return value(after, "pwmesh_frames_rejected_total", reason=reason) - value(
                    before, "pwmesh_frames_rejected_total", reason=reason)

            # The RM pushes nothing about what it rejects: ask until it has counted both.
            eventually(lambda: counted("header") == 1 and counted("version") == 1, 10)
            assert sock.poll(5000), "a frame with a readable header gets an error reply"
    finally:
        stop(proc)


def test_a_bad_metrics_port_is_a_clear_usage_error() -> None:
    result = CliRunner().invoke(rm_main, ["--metrics-port", "http"])
    assert result.exit_code == 2
    assert "'http' is not a port number" in result.output
    result = CliRunner().invoke(rm_main, ["--metrics-port", "70000"])
    assert result.exit_code == 2 and "out of range" in result.output
    assert "PWMESH_METRICS_PORT" in CliRunner().invoke(rm_main, ["--help"]).output


@pytest.mark.asyncio
async def test_a_port_in_use_fails_the_start_and_names_it() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rm = ResourceManager(ResourceManagerConfig(metrics_port=port))
        with pytest.raises(InvalidArgument, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            await rm.start()
    assert rm.metrics is not None and rm.status.value == "closed"


# ------------------------------------------------------------ the HTTP endpoint, in process


async def _http(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return reply


@pytest.mark.asyncio
async def test_the_endpoint_answers_scrapers_and_refuses_the_rest() -> None:
    calls = []

    def collect():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a bug in a collector")
        return [counter("pwmesh_test_events", "Events.", len(calls))]

    tasks = TaskGroup()
    server = MetricsServer(collect, tasks=tasks, name="test")
    await server.start("127.0.0.1", 0)
    try:
        ok = await _http(server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200 OK\r\n") and b"pwmesh_test_events_total 1.0" in ok
        head = await _http(server.port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")  # headers only
        assert (await _http(server.port, b"GET /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 500 ")
        openmetrics = await _http(server.port, b"GET /metrics HTTP/1.1\r\n"
                                               b"Accept: application/openmetrics-text; version=1.0.0\r\n\r\n")
        assert b"application/openmetrics-text" in openmetrics and openmetrics.rstrip().endswith(b"# EOF")
        assert (await _http(server.port, b"GET /other HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 404 ")
        assert (await _http(server.port, b"POST /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 405 ")
        assert (await _http(server.port, b"junk\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
        huge = b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n"
        assert (await _http(server.port, huge)).startswith(b"HTTP/1.1 431 ")
        assert (await _http(server.port, b"GET /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
    finally:
        await server.close()
        await tasks.stop()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", server.port)  # closed with its daemon


def test_metrics_bind_the_host_the_control_socket_binds() -> None:
    assert listen_host("tcp://10.0.0.3:0") == "10.0.0.3"
    assert listen_host("tcp://127.0.0.1:7100") == "127.0.0.1"
    assert listen_host("tcp://*:7100") == "0.0.0.0"
    assert listen_host("tcp://[::1]:7100") == "::1"


def test_the_resource_manager_counts_executors_that_miss_their_heartbeats() -> None:
    state = DrivenRM(heartbeat_timeout_seconds=1.0)
    for name in ("a", "b"):
        state.ask(RegisterExecutor(info=ExecutorInfo(executor_id=name, island=0, host=name, control=f"c-{name}",
                                                        data=f"d-{name}", pid=1, devices=[])), now=0.0)
    state.ask(Heartbeat(role="executor", name="a"), now=0.9)
    assert state.expire(now=1.5) == ["b"]
    assert state.heartbeat_misses[("executor",)] == 1 and state.executors_lost == 1
    state.ask(UnregisterExecutor(executor_id="a", reason="drained"), now=1.6)
    assert state.executors_left == 1 and state.heartbeat_misses[("executor",)] == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(120)
def test_an_executor_restarting_into_its_jax_group_keeps_its_metrics_port() -> None:
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=1, metrics=True, collectives=True)
    with pw.LocalCluster(spec) as c:
        for host in ("island0-host0", "island0-host1"):
            child = c.child(host)
            assert child.info["group_epoch"] >= 1  # it restarted (same process) into the group's forming
            address = child.info["metrics"]
            port = address.rsplit(":", 1)[1].removesuffix("/metrics")
            argv = Path(f"/proc/{child.popen.pid}/cmdline").read_bytes().decode().split("\0")
            flags = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--metrics-port"]
            assert flags == [port]  # the free port it first took (0), passed on, not a new one
            assert value(scrape(address), "pwmesh_daemon_info", role="executor", name=host) == 1


@pytest.mark.timeout(120)
def test_a_daemon_restarted_in_place_is_scraped_at_the_same_address() -> None:
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=1, devices_per_host=1, metrics=True)
    with pw.LocalCluster(spec) as c:  # its own: the restarted process must stop with the test
        before = c.metrics_addresses()["island0-host0"]
        c.restart("island0-host0")  # SIGKILL, then the same command on the same addresses
        assert c.metrics_addresses()["island0-host0"] == before
        samples = scrape(before)
        assert value(samples, "pwmesh_daemon_info", role="executor", name="island0-host0") == 1
        assert value(samples, "pwmesh_executor_computations_finished_total") == 0  # a new process, counted afresh
