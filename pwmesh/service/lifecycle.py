"""One lifecycle for every daemon.

``Service`` gives each daemon a status, an idempotent ``start()`` bounded by a
startup timeout, ``async with``, a ``close()`` that always finishes (drain, then
cancel and await every owned task, then close every socket), and ``run()``:
the process entry point where the first SIGTERM/SIGINT drains and the second
forces an exit. When started by a launcher, a daemon prints one ``PWMESH_READY``
JSON line on stdout once it serves, so the launcher waits on an event, not a sleep.
"""

from __future__ import annotations

import asyncio
import ctypes
import enum
import gc
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pwmesh.core.contract import EventLog, record
from pwmesh.errors import PwTimeoutError
from pwmesh.service.keys import Security
from pwmesh.service.tasks import TaskGroup
from pwmesh.service.transport import Context
from pwmesh.wire import Envelope
from pwmesh.wire.messages import EventLines, GetEvents, Pong

if TYPE_CHECKING:
    from pwmesh.service.metrics import Metric, MetricsServer

log = logging.getLogger(__name__)

READY_PREFIX = "PWMESH_READY "
_PR_SET_PDEATHSIG = 1


class Status(enum.Enum):
    INIT = "init"
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    CLOSED = "closed"


class Service:
    """Base of every daemon: subclasses implement ``setup()`` and may override ``drain()``."""

    role = "service"
    startup_timeout_seconds = 60.0
    drain_timeout_seconds = 10.0

    def __init__(self, name: str, security: Security | None = None, *, metrics_port: int | None = None,
                 metrics_host: str = "127.0.0.1") -> None:
        self.name = name
        self.status = Status.INIT
        self.security = security or Security()
        self.ctx = Context(keys=self.security.load(), allow_insecure=self.security.insecure)
        self.tasks = TaskGroup(on_crash=self._crashed)
        # Prometheus metrics over HTTP on this port once started (0: a free one; None: none served).
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.metrics: MetricsServer | None = None
        self._start_task: asyncio.Task[None] | None = None
        self._closed: asyncio.Event | None = None
        self._close_task: asyncio.Task[None] | None = None
        self.stop_reason = ""  # why it is stopping, for what it tells those it gives up on ("SIGTERM")

    async def setup(self) -> None:
        """Bind sockets and spawn the background tasks; runs once inside ``start()``."""

    async def drain(self) -> None:
        """Finish in-flight work before sockets close (bounded by ``drain_timeout_seconds``)."""

    def collect(self) -> Iterable[Metric]:
        """What this daemon's metrics endpoint serves, read from its state at scrape time (on the loop)."""
        return ()

    def ready_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"role": self.role, "name": self.name, "pid": os.getpid()}
        if self.metrics is not None:
            info["metrics"] = self.metrics.address
        return info

    # The bounded log of the events its core handled lately (``pwmesh.core.contract``), if it keeps one.
    event_log: EventLog | None = None

    def events(self, peer: bytes, env: Envelope) -> EventLines:
        """Its core's latest events (``GetEvents``), for ``pwmesh debug events``."""
        msg = env.message
        assert isinstance(msg, GetEvents)
        if self.event_log is None:
            return EventLines(daemon=self.name, lines=[])
        recorded = []
        if msg.raw:
            timed = self.event_log.timed()
            recorded = [record(now, event) for now, event in (timed[-msg.limit:] if msg.limit > 0 else timed)]
        return EventLines(daemon=self.name, lines=self.event_log.lines(msg.limit), recorded=recorded)

    def ping(self, peer: bytes, env: Envelope) -> Pong:
        """Every daemon answers ``Ping`` with who it is and its lifecycle status."""
        return Pong(role=self.role, name=self.name, status=self.status.value)

    async def start(self) -> None:
        if self._start_task is None:
            self._closed = asyncio.Event()
            self.status = Status.STARTING
            self._start_task = asyncio.get_running_loop().create_task(self._start(), name=f"{self.name}.start")
        await asyncio.shield(self._start_task)

    async def _start(self) -> None:
        try:
            async with asyncio.timeout(self.startup_timeout_seconds):
                await self.setup()
                if self.metrics_port is not None:  # last: a scrape finds everything it reads set up
                    # Here, not at the top: the CLI imports this module, and prometheus-client costs ~50 ms.
                    from pwmesh.service.metrics import MetricsServer  # noqa: PLC0415

                    self.metrics = MetricsServer(self.collect, tasks=self.tasks, name=self.name)
                    await self.metrics.start(self.metrics_host, self.metrics_port)
        except BaseException:
            await self.close()
            raise
        self.status = Status.RUNNING
        log.info("%s %s running", self.role, self.name)

    async def close(self) -> None:
        if self._close_task is None:
            self._close_task = asyncio.get_running_loop().create_task(self._close(), name=f"{self.name}.close")
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        if self.status is Status.RUNNING:
            self.status = Status.DRAINING
            try:
                async with asyncio.timeout(self.drain_timeout_seconds):
                    await self.drain()
            except TimeoutError:
                log.warning("%s: drain did not finish within %s seconds", self.name, self.drain_timeout_seconds)
            except Exception:
                log.exception("%s: drain failed", self.name)
        if self.metrics is not None:
            await self.metrics.close()
        await self.tasks.stop()
        self.ctx.close()
        self.status = Status.CLOSED
        if self._closed is not None:
            self._closed.set()
        log.info("%s %s closed", self.role, self.name)

    async def wait_closed(self) -> None:
        assert self._closed is not None, "start() first"
        await self._closed.wait()

    def _crashed(self, exc: BaseException) -> None:
        log.error("%s: a critical task failed; closing", self.name)
        if self._close_task is None:
            self._close_task = asyncio.get_running_loop().create_task(self._close(), name=f"{self.name}.close")

    async def __aenter__(self) -> Service:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def wait_ready(proc: subprocess.Popen[bytes], timeout_seconds: float, what: str = "the daemon") -> dict[str, Any]:
    """The info of ``proc``'s ready line (a daemon started with ``stdout=PIPE``): ``PwTimeoutError`` if none
    comes within ``timeout_seconds``, ``RuntimeError`` if it exits first."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_seconds
    buffered = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sel.select(timeout=remaining):
                raise PwTimeoutError(f"{what} was not ready within {timeout_seconds} seconds")
            chunk = os.read(proc.stdout.fileno(), 65536)  # not readline: a buffered line would hide from select
            if not chunk:
                raise RuntimeError(f"{what} exited while starting (code {proc.wait()})")
            *lines, buffered = (buffered + chunk).split(b"\n")
            for line in lines:
                text = line.decode(errors="replace")
                if text.startswith(READY_PREFIX):
                    return json.loads(text[len(READY_PREFIX):])  # type: ignore[no-any-return]


def stop_process(proc: subprocess.Popen[bytes], timeout_seconds: float = 15.0) -> int:
    """Stop a daemon we started: SIGTERM (it drains), SIGKILL if it is still there after ``timeout_seconds``;
    returns its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return wait_stopped(proc, timeout_seconds)


def wait_stopped(proc: subprocess.Popen[bytes], timeout_seconds: float = 15.0) -> int:
    """Wait for a daemon already sent SIGTERM to exit, SIGKILL it after ``timeout_seconds``; returns its exit
    status. (A second SIGTERM would make it stop draining and exit at once.)"""
    try:
        code = proc.wait(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    return code


def die_with_parent() -> None:
    """If started by a launcher (``PWMESH_PARENT_PID``), exit when it dies (Linux)."""
    parent = os.environ.get("PWMESH_PARENT_PID")
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the parent died before prctl took effect
        sys.exit(1)


def run(service: Service) -> None:
    """Run ``service`` until a signal: the first drains and closes, the second forces."""
    die_with_parent()
    # A launcher may have blocked these signals; a daemon must always hear them.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})

    async def main() -> None:
        loop = asyncio.get_running_loop()
        signals = 0

        def on_signal(signum: int) -> None:
            nonlocal signals
            signals += 1
            if signals == 1:
                service.stop_reason = f"{signal.Signals(signum).name} received"
                log.info("%s: %s received, draining (send again to force)", service.name, signal.Signals(signum).name)
                loop.create_task(service.close(), name="close-on-signal")  # noqa: RUF006 - awaited via wait_closed
            else:
                log.warning("%s: second signal, exiting now", service.name)
                os._exit(1)

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        await service.start()
        # What start-up imported and built (JAX alone: ~100k objects) never becomes garbage:
        # keep it out of the collector's full passes, which otherwise stall the loop (measured
        # in-process with an executor's modules: one full pass 67 ms, 16 ms after this).
        gc.freeze()
        print(READY_PREFIX + json.dumps(service.ready_info()), flush=True)
        await service.wait_closed()

    try:
        import uvloop  # noqa: PLC0415 - optional speed-up, absent on some platforms
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
