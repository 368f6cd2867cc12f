"""A complete cluster on this machine, every daemon a real child process.

Used by ``pw.connect()`` with no address (embedded), by ``pwmesh up`` and by the
tests. Each child prints one ``PWMESH_READY`` line once it serves; the launcher
waits on those lines (with a deadline), never on a sleep. Stopping is staged:
SIGTERM (the daemon drains), then SIGKILL for whoever is still there. Children
also die with their parent (``PWMESH_PARENT_PID``), so nothing is left behind.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pwmesh.errors import PwTimeoutError
from pwmesh.service.keys import DAEMONS, PLANE_SECRET_ENV, add_daemon
from pwmesh.service.lifecycle import READY_PREFIX

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (for a listener that cannot pick its own)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclasses.dataclass
class LocalClusterSpec:
    islands: int = 2
    hosts_per_island: int = 2
    devices_per_host: int = 2
    session_timeout_seconds: float = 30.0
    heartbeat_timeout_seconds: float = 10.0
    log_level: str = "WARNING"
    log_format: str = "text"  # every daemon's: "text" (key=value) or "json" (see pwmesh.service.logs)
    startup_timeout_seconds: float = 120.0
    stop_timeout_seconds: float = 10.0
    memory_limit_bytes: int = 0  # per executor (all its devices together); 0: no limit
    policy: str = "fair"  # the island schedulers' sharing policy
    executor_args: tuple[str, ...] = ()  # extra flags for every executor (tests: fault injection)
    proxy_args: tuple[str, ...] = ()  # extra flags for the proxy
    # Each island's executors form one JAX group, so SPMD computations (collectives) may span them; the
    # island's scheduler re-forms it as executors join, drain or are lost. ``start`` returns once formed.
    collectives: bool = False
    platform: str = "cpu"  # the executors' devices: cpu (the default, on any machine), cuda, rocm or tpu
    keys: str = ""  # the cluster's keys directory (``pwmesh keys init``): every socket speaks CURVE
    # With ``keys``: each daemon runs with a key of its own (``pwmesh keys add-daemon NAME``, made where
    # missing; the resource manager's and the proxy's ``--front``), as on a cluster of many hosts; else
    # every daemon uses the cluster's own key.
    daemon_keys: bool = False
    # Without keys: serve on Unix sockets in a directory only this user can enter, and give the executors'
    # data plane a generated secret, so another local user cannot reach the cluster (as Jupyter keys
    # its kernels). ``pw.connect()``'s embedded cluster is private.
    private: bool = False
    metrics: bool = False  # every daemon serves Prometheus metrics on a free loopback port (``metrics_addresses``)
    tenants: str = ""  # the proxy's tenants policy file (``pwmesh tenants set``); "": the keys directory's


@dataclasses.dataclass
class Child:
    role: str
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    args: list[str]
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class LocalCluster:
    def __init__(self, spec: LocalClusterSpec | None = None, log_dir: str | None = None) -> None:
        self.spec = spec or LocalClusterSpec()
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pwmesh-cluster-"))
        self.children: list[Child] = []
        self.address = ""
        self.rm_address = ""
        self._progress: Callable[[str], None] | None = None
        # A temporary log directory of our own is removed on a clean stop; kept when something failed.
        self._keep_logs = False
        self._private_dir: Path | None = None  # the Unix sockets of a private cluster (mode 0700)
        self._plane_secret = ""

    # -------------------------------------------------------------- processes

    def _spawn(self, role: str, name: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        if self.spec.metrics and "--metrics-port" not in args:
            args = [*args, "--metrics-port", "0"]
        private = self.spec.private and not self.spec.keys
        if private and "--listen" not in args:
            if self._private_dir is None:
                self._private_dir = Path(tempfile.mkdtemp(prefix="pwmesh-"))  # 0700: no one else may connect
                self._plane_secret = secrets.token_hex(32)
            args = [*args, "--listen", f"ipc://{self._private_dir / name}.sock"]
        log_path = self.log_dir / f"{name}.log"
        keys = self.spec.keys
        if keys and self.spec.daemon_keys:
            own = Path(keys) / DAEMONS / name
            keys = str(own if own.is_dir() else add_daemon(keys, name, front=role in ("rm", "proxy")))
        child_env = {**os.environ, "PWMESH_PARENT_PID": str(os.getpid()), "JAX_PLATFORMS": self.spec.platform,
                     **({PLANE_SECRET_ENV: self._plane_secret} if private else {}), **(env or {})}
        child_env.pop("XLA_FLAGS", None)  # each executor sets its own device count
        with open(log_path, "ab") as log_file:
            popen = subprocess.Popen(
                [sys.executable, "-m", "pwmesh.cli.daemons", role, *args, "--log-level", self.spec.log_level,
                 "--log-format", self.spec.log_format, *(("--keys", keys) if keys else ())],
                stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL, env=child_env,
                # Out of the terminal's process group: Ctrl-C reaches the launcher alone, which stops every
                # daemon in stages (a SIGINT to each as well made the launcher's SIGTERM their second signal:
                # they exited 1 at once, and every stop looked like a failure). They still die with it.
                start_new_session=True,
            )
        child = Child(role, name, popen, log_path, args)
        self.children.append(child)
        return child

    def _wait_ready(self, children: list[Child], deadline: float, group_size: int = 0) -> None:
        """Wait for each child's ready line (an executor's, with ``group_size``: the one it prints once in
        a forming of its island's JAX group with that many members; it restarts into it first)."""
        waiting = {c.popen.stdout.fileno(): c for c in children if c.popen.stdout is not None}
        ready: list[Child] = []
        buffers: dict[int, bytes] = {fd: b"" for fd in waiting}
        with selectors.DefaultSelector() as sel:
            for fd in waiting:
                sel.register(fd, selectors.EVENT_READ)
            while waiting:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    names = ", ".join(c.name for c in waiting.values())
                    raise PwTimeoutError(f"local cluster: {names} not ready within "
                                         f"{self.spec.startup_timeout_seconds} seconds; logs in {self.log_dir}")
                for key, _ in sel.select(timeout=remaining):
                    fd = key.fd
                    chunk = os.read(fd, 65536)
                    child = waiting[fd]
                    if not chunk:
                        sel.unregister(fd)
                        del waiting[fd]
                        tail = child.log_path.read_text(errors="replace")[-3000:]
                        raise RuntimeError(f"local cluster: {child.name} exited during startup "
                                           f"(code {child.popen.wait()}):\n{tail}")
                    *lines, buffers[fd] = (buffers[fd] + chunk).split(b"\n")
                    for line in lines:
                        text = line.decode(errors="replace")
                        if text.startswith(READY_PREFIX):
                            info = json.loads(text[len(READY_PREFIX):])
                            if child.role == "executor" and info.get("group_size", 0) < group_size:
                                continue  # up, but not in its island's JAX group yet
                            child.info = info
                            sel.unregister(fd)
                            del waiting[fd]
                            ready.append(child)
                            if len(children) > 1:
                                self._starting(ready, list(waiting.values()))
                            break

    def start(self, progress: Callable[[str], None] | None = None) -> str:
        """Start every daemon and return the proxy's address (the cluster's address). ``progress`` is told,
        in words, each time another daemon is ready (``pwmesh up`` and the embedded cluster show it)."""
        if self.address:
            return self.address
        spec = self.spec
        deadline = time.monotonic() + spec.startup_timeout_seconds
        self._progress = progress
        try:
            rm = self._spawn("rm", "rm", ["--heartbeat-timeout-seconds", str(spec.heartbeat_timeout_seconds)])
            self._say("starting the resource manager")
            self._wait_ready([rm], deadline)
            self.rm_address = rm.info["address"]
            rest = []
            collectives = ["--collectives"] if spec.collectives else []
            for island in range(spec.islands):
                rest.append(self._spawn("scheduler", f"scheduler-{island}",
                                        ["--island", str(island), "--rm", self.rm_address, "--policy", spec.policy,
                                         *collectives, *self._beat()]))
                for host in range(spec.hosts_per_island):
                    rest.append(self._spawn_executor(island, f"island{island}-host{host}", spec.devices_per_host))
            proxy = self._spawn("proxy", "proxy", ["--rm", self.rm_address, "--session-timeout-seconds",
                                                   str(spec.session_timeout_seconds),
                                                   # Sessions outlive a restart of the proxy (``restart``).
                                                   "--session-secret-file", str(self.log_dir / "proxy.secret"),
                                                   *self._beat(),
                                                   *(("--tenants", spec.tenants) if spec.tenants else ()),
                                                   *spec.proxy_args])
            self._wait_ready([*rest, proxy], deadline, group_size=spec.hosts_per_island if spec.collectives else 0)
        except BaseException:
            self._keep_logs = True  # what went wrong is in them
            self.stop()
            raise
        finally:
            self._progress = None
        self.address = proxy.info["address"]
        return self.address

    def start_visibly(self) -> str:
        """``start``, showing on stderr which daemons are ready while they start, where stderr is a terminal
        (a spinner that is gone once the cluster is up)."""
        if not sys.stderr.isatty():
            return self.start()
        from rich.console import Console  # noqa: PLC0415 - only a terminal needs it

        console = Console(stderr=True)
        with console.status("starting a local pwmesh cluster") as shown:
            return self.start(progress=lambda what: shown.update(f"local pwmesh cluster: {what}"))

    def _say(self, what: str) -> None:
        if self._progress is not None:
            self._progress(what)

    def _starting(self, ready: list[Child], waiting: list[Child]) -> None:
        """Tell ``progress`` how many of each role are ready."""
        if self._progress is None:
            return
        parts = []
        for role, label in (("scheduler", "schedulers"), ("executor", "executors"), ("proxy", "proxy")):
            total = sum(c.role == role for c in ready + waiting)
            if total:
                done = sum(c.role == role for c in ready)
                parts.append(f"{label} {done}/{total}" if total > 1 else f"{label} {'ready' if done else '...'}")
        self._say("starting " + ", ".join(parts))

    # Each stage drains while the peers it confirms delivery to are still up: executors (to the
    # proxy, the schedulers and the RM), then the proxy and the schedulers together (each to the
    # other: stopped one after the other, the schedulers waited out their barrier's 2 s for a
    # proxy already gone, at every stop), the RM.
    STOP_STAGES = (("executor",), ("proxy", "scheduler"), ("rm",))

    def _beat(self) -> list[str]:
        # Four beats per timeout: one late beat never gets a live daemon declared lost.
        return ["--heartbeat-interval-seconds", str(self.spec.heartbeat_timeout_seconds / 4)]

    def _spawn_executor(self, island: int, name: str, devices: int, extra: list[str] | None = None) -> Child:
        return self._spawn("executor", name, [
            "--island", str(island), "--rm", self.rm_address, "--devices", str(devices),
            "--name", name, "--host", name, "--memory-limit", str(self.spec.memory_limit_bytes), *self._beat(),
            "--platform", self.spec.platform, *(["--collectives"] if self.spec.collectives else []),
            *(extra or []), *self.spec.executor_args])

    def add_executor(self, island: int, name: str, devices: int | None = None) -> Child:
        """Start one more executor (a host joining the running cluster); returns once it serves (with
        collectives: once it is in its island's JAX group, re-formed with it)."""
        child = self._spawn_executor(island, name, devices or self.spec.devices_per_host)
        size = sum(c.role == "executor" and c.popen.poll() is None and c.info.get("island") == island
                   for c in self.children if c is not child) + 1
        self._wait_ready([child], time.monotonic() + self.spec.startup_timeout_seconds,
                         group_size=size if self.spec.collectives else 0)
        return child

    def add_proxy(self, name: str = "proxy-standby", *, standby: bool = True) -> Child:
        """Start another proxy beside the cluster's, with its session secret: a standby by default, which takes
        over the sessions if the active proxy is lost (clients given both addresses, ``address,other``, move
        to it). Returns once it serves; its address is ``child.info["address"]``."""
        spec = self.spec
        child = self._spawn("proxy", name, [
            "--rm", self.rm_address, "--name", name, "--session-timeout-seconds", str(spec.session_timeout_seconds),
            "--session-secret-file", str(self.log_dir / "proxy.secret"), *self._beat(),
            *(["--standby"] if standby else []), *(("--tenants", spec.tenants) if spec.tenants else ()),
            *spec.proxy_args])
        self._wait_ready([child], time.monotonic() + spec.startup_timeout_seconds)
        return child

    def restart(self, name: str) -> Child:
        """Kill daemon ``name`` (SIGKILL) and start it again on the same address."""
        old = self.child(name)
        if old.popen.poll() is None:
            old.popen.kill()
        old.popen.wait()
        if old.popen.stdout is not None:
            old.popen.stdout.close()
        self.children.remove(old)
        args = [*old.args, "--listen", old.info["address"]]
        if old.info.get("metrics"):  # scraped at the same address as before
            args += ["--metrics-port", old.info["metrics"].rpartition(":")[2].removesuffix("/metrics")]
        if old.role == "executor":
            args += ["--data-listen", old.info["data"]]
        child = self._spawn(old.role, name, args)
        self._wait_ready([child], time.monotonic() + self.spec.startup_timeout_seconds)
        return child

    def stop(self) -> None:
        """Stop in stages: SIGTERM (drain), then SIGKILL whoever outlives the timeout."""
        for roles in self.STOP_STAGES:
            stage = [c for c in self.children if c.role in roles]
            for child in stage:
                if child.popen.poll() is None:
                    child.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.spec.stop_timeout_seconds
            for child in stage:
                try:
                    child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s (pid %s) ignored SIGTERM; killing it", child.name, child.popen.pid)
                    child.popen.kill()
                    child.popen.wait()
                    self._keep_logs = True
        for child in self.children:
            if child.popen.poll() is None:  # a role no stage names
                child.popen.kill()
                child.popen.wait()
            if child.popen.stdout is not None:
                child.popen.stdout.close()
            if child.popen.returncode not in (0, None):  # it failed, or was killed: keep its log
                self._keep_logs = True
        self.children.clear()
        self.address = ""
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None
        if self._own_log_dir and self.log_dir.exists():
            if self._keep_logs:
                log.warning("local cluster: a daemon failed or was killed; its logs are in %s", self.log_dir)
            else:
                shutil.rmtree(self.log_dir, ignore_errors=True)

    def metrics_addresses(self) -> dict[str, str]:
        """Each running daemon's metrics address by name (with ``LocalClusterSpec.metrics``)."""
        return {c.name: c.info["metrics"] for c in self.children if c.info.get("metrics")}

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
