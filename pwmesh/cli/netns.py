"""A pwmesh cluster over a real network on one Linux machine: network namespaces joined by veth links.

Each daemon runs in a namespace of its own, with an address of its own that exists only inside these
namespaces (``SUBNET``.0/24 by default), so every message between daemons crosses a real (virtual)
Ethernet link through a bridge, as between hosts: the resource manager and the island schedulers in
``PREFIX-rm``, the proxy in ``PREFIX-proxy``, one executor per island in ``PREFIX-island0`` and
``PREFIX-island1``, and clients in ``PREFIX-client``. The bridge lives in ``PREFIX-hub``, where
``capture`` records what crosses the links. Needs root (``CAP_NET_ADMIN``) and ``ip`` (iproute2).

``bin/pwmesh-netns-cluster`` starts one for people to try; ``tests/test_netns.py`` runs the Figure-2
program and a cross-island reshard on one with CURVE keys and checks what crossed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pwmesh.service.lifecycle import wait_ready, wait_stopped

ISLANDS = 2
RM_PORT, PROXY_PORT, SCHEDULER_PORT, EXECUTOR_PORT, DATA_PORT = 7100, 7200, 7300, 7400, 7401

# Records every frame on the hub's links (AF_PACKET on all its interfaces) into a file until SIGTERM.
_CAPTURE = """
import signal, socket, sys
out = open(sys.argv[1], "wb")
sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))  # ETH_P_ALL
# Room for a burst while this loop waits for a core: with the default (~200 KiB) the kernel drops frames
# of a fast transfer on a busy machine, and the capture misses bytes that crossed.
try:
    sock.setsockopt(socket.SOL_SOCKET, 33, 256 << 20)  # SO_RCVBUFFORCE (root: past rmem_max)
except OSError:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 << 20)
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
sock.settimeout(0.05)
print("capturing", flush=True)
while not stopping:
    try:
        out.write(sock.recv(65536))
    except (TimeoutError, InterruptedError):
        pass
sock.setblocking(False)  # what crossed before the stop and is not read yet is still the capture's
while True:
    try:
        out.write(sock.recv(65536))
    except BlockingIOError:
        break
out.close()
"""


def available() -> str:
    """Why a namespace cluster cannot run here ("" if it can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    probe = f"pwmesh-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return ""


@dataclasses.dataclass
class NetnsCluster:
    keys: str  # the cluster's keys directory (``pwmesh keys init``); daemons bind off loopback only with keys
    prefix: str = "pwmesh"
    subnet: str = "10.77.0"
    devices_per_host: int = 2
    log_dir: Path | None = None
    startup_timeout_seconds: float = 120.0
    # Separate hosts share no memory: without this, executors on one kernel would pass big frames
    # through /dev/shm and never over the links.
    executor_args: tuple[str, ...] = ("--no-shared-memory",)
    heartbeat_timeout_seconds: float = 10.0  # the resource manager's; every daemon beats four times as often

    def __post_init__(self) -> None:
        # A temporary log directory of our own is removed on a clean stop and kept when a daemon failed or
        # was killed, as ``LocalCluster`` does (every test run left one in /tmp before).
        self._own_log_dir = self.log_dir is None
        self._keep_logs = False
        self.log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix="pwmesh-netns-"))
        self.hosts = {"rm": 1, "proxy": 2, **{f"island{i}": 3 + i for i in range(ISLANDS)}, "client": 9}
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.made: list[str] = []

    # ------------------------------------------------------------------ names and addresses

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def ip(self, host: str) -> str:
        return f"{self.subnet}.{self.hosts[host]}"

    @property
    def address(self) -> str:
        """The proxy's address, as clients in ``PREFIX-client`` reach it."""
        return f"tcp://{self.ip('proxy')}:{PROXY_PORT}"

    def exec_in(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host)]

    # ------------------------------------------------------------------ the network

    def _ip(self, *args: str, ns: str = "") -> None:
        cmd = ["ip", "-n", ns, *args] if ns else ["ip", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")

    def _network(self) -> None:
        hub = self.ns("hub")
        self._ip("netns", "add", hub)
        self.made.append(hub)
        self._ip("link", "add", "br0", "type", "bridge", ns=hub)
        self._ip("link", "set", "br0", "up", ns=hub)
        for host in self.hosts:
            ns = self.ns(host)
            self._ip("netns", "add", ns)
            self.made.append(ns)
            # One veth pair per host: eth0 in its namespace, the other end a port of the hub's bridge.
            self._ip("link", "add", f"{host}", "netns", hub, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip("link", "set", host, "master", "br0", "up", ns=hub)
            self._ip("link", "set", "lo", "up", ns=ns)
            self._ip("addr", "add", f"{self.ip(host)}/24", "dev", "eth0", ns=ns)
            self._ip("link", "set", "eth0", "up", ns=ns)

    # ------------------------------------------------------------------ the daemons

    def _start(self, host: str, name: str, role: str, *args: str) -> dict[str, object]:
        assert self.log_dir is not None
        env = {**os.environ, "PWMESH_PARENT_PID": str(os.getpid()), "JAX_PLATFORMS": "cpu"}
        env.pop("XLA_FLAGS", None)
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child writes to it
        with log:
            popen = subprocess.Popen([*self.exec_in(host), sys.executable, "-m", "pwmesh.cli.daemons", role, *args,
                                      "--keys", self.keys, "--log-level", "INFO"],
                                     stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=env)
        self.children.append((name, popen))
        return wait_ready(popen, self.startup_timeout_seconds, f"{name} (logs in {self.log_dir})")

    def up(self) -> NetnsCluster:
        try:
            self._network()
            rm = f"tcp://{self.ip('rm')}:{RM_PORT}"
            beat = ["--heartbeat-interval-seconds", str(self.heartbeat_timeout_seconds / 4)]
            self._start("rm", "rm", "rm", "--listen", rm, "--heartbeat-timeout-seconds",
                        str(self.heartbeat_timeout_seconds))
            for island in range(ISLANDS):
                self._start("rm", f"scheduler-{island}", "scheduler", "--island", str(island), "--rm", rm,
                            "--listen", f"tcp://{self.ip('rm')}:{SCHEDULER_PORT + island}", *beat)
            self._start("proxy", "proxy", "proxy", "--rm", rm, "--listen", self.address, *beat)
            for island in range(ISLANDS):
                host = f"island{island}"
                self._start(host, f"{host}-host0", "executor", "--island", str(island), "--rm", rm,
                            "--devices", str(self.devices_per_host), "--name", f"{host}-host0", "--host", host,
                            "--listen", f"tcp://{self.ip(host)}:{EXECUTOR_PORT}",
                            "--data-listen", f"tcp://{self.ip(host)}:{DATA_PORT}", *beat, *self.executor_args)
        except BaseException:
            self.down()
            raise
        return self

    def client(self, args: list[str], *, keys: str | None, timeout_seconds: float = 300.0,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``args`` (a command) in ``PREFIX-client`` with ``PWMESH_ADDRESS`` set, and ``PWMESH_KEYS`` if
        ``keys``."""
        child_env = {k: v for k, v in os.environ.items() if k not in ("PWMESH_KEYS", "XLA_FLAGS")}
        child_env.update({"PWMESH_ADDRESS": self.address, "JAX_PLATFORMS": "cpu", **(env or {})})
        if keys:
            child_env["PWMESH_KEYS"] = keys
        return subprocess.run([*self.exec_in("client"), *args], capture_output=True, text=True,
                              timeout=timeout_seconds, env=child_env, check=False)

    @contextlib.contextmanager
    def capture(self, path: Path) -> Iterator[Path]:
        """Record every frame that crosses the hub's links (inside ``PREFIX-hub``) into ``path``."""
        proc = subprocess.Popen([*self.exec_in("hub"), sys.executable, "-c", _CAPTURE, str(path)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != b"capturing":
                raise RuntimeError("the capture did not start")
            yield path
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    def link(self, host: str, up: bool) -> None:
        """Bring ``host``'s link to the others down (a partition) or up again."""
        self._ip("link", "set", host, "up" if up else "down", ns=self.ns("hub"))

    def down(self) -> None:
        """Stop every daemon (SIGTERM, then SIGKILL), then remove the namespaces (and with them the links)."""
        for _, popen in reversed(self.children):
            if popen.poll() is None:
                popen.send_signal(signal.SIGTERM)  # all at once: each drains while the others do
        for _, popen in reversed(self.children):
            if wait_stopped(popen) != 0:  # it failed, or was killed (by a test, or after ignoring SIGTERM)
                self._keep_logs = True
        self.children.clear()
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self.made.clear()
        if self._own_log_dir and self.log_dir is not None and self.log_dir.exists():
            if self._keep_logs:
                print(f"netns cluster: a daemon failed or was killed; its logs are in {self.log_dir}",
                      file=sys.stderr)
            else:
                shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> NetnsCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def remove_namespaces(prefix: str) -> list[str]:
    """Delete every namespace named ``PREFIX-*`` (a cluster whose launcher died); returns their names."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.startswith(f"{prefix}-")]
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    return names
