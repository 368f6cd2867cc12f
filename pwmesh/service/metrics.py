"""Prometheus metrics for one daemon, served over HTTP on the daemon's own event loop.

Each daemon owns one ``CollectorRegistry`` (never the process-wide default: tests run
several daemons' code in one process) holding one collector, which reads the daemon's
existing counters and state at scrape time. So nothing is counted on a hot path for
metrics' sake beyond the integer increments the daemons keep anyway, and since the
scrape runs on the loop, it reads state no other thread is changing.

The HTTP server is a few lines on ``asyncio.start_server`` rather than
``prometheus_client.start_http_server``: that one runs in a thread of its own,
which would read the daemon's dicts while the loop changes them. Every connection
is an owned task, bounded in size and time; ``close()`` stops listening, and the
service's task group ends what is still being answered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from pwmesh.core.ratelimit import RejectedLog
from pwmesh.errors import InvalidArgument
from pwmesh.service.tasks import TaskGroup

__all__ = ["Metric", "MetricsServer", "counter", "gauge", "listen_host", "merged", "wire_metrics"]

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8192  # request line and headers; a scraper sends a few hundred
REQUEST_TIMEOUT_SECONDS = 10.0  # to send its request, and to take the answer


def counter(name: str, doc: str, value: float | None = None, *, labels: Mapping[str, str] | None = None,
            values: Iterable[tuple[tuple[str, ...], float]] = ()) -> CounterMetricFamily:
    """A counter family: one ``value``, or ``values`` keyed by the label values of ``labels``' names."""
    if value is not None:
        return CounterMetricFamily(name, doc, value=value)
    family = CounterMetricFamily(name, doc, labels=list(labels or ()))
    for key, v in values:
        family.add_metric(list(key), v)
    return family


def gauge(name: str, doc: str, value: float | None = None, *, labels: Mapping[str, str] | None = None,
          values: Iterable[tuple[tuple[str, ...], float]] = ()) -> GaugeMetricFamily:
    if value is not None:
        return GaugeMetricFamily(name, doc, value=value)
    family = GaugeMetricFamily(name, doc, labels=list(labels or ()))
    for key, v in values:
        family.add_metric(list(key), v)
    return family


def listen_host(listen: str) -> str:
    """The host a daemon's ``--listen`` address binds (``tcp://10.0.0.1:7100`` -> ``10.0.0.1``): its metrics
    are served there too, on no more interfaces than its control socket."""
    if listen.startswith(("ipc://", "inproc://")):  # a Unix socket: metrics on loopback
        return "127.0.0.1"
    host = listen.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return "0.0.0.0" if host in ("*", "") else host


def by(label: str) -> dict[str, str]:
    return {label: label}


def wire_metrics(role: str, name: str, received: Mapping[str, int], sent: Mapping[str, int],
                 rejected: Mapping[str, int]) -> Iterator[Metric]:
    """What every daemon serves: who it is, and its messages in and out by op, rejected frames by reason."""
    yield gauge("pwmesh_daemon_info", "This daemon: its role and name (value 1).", labels={"role": "", "name": ""},
                values=[((role, name), 1)])
    yield counter("pwmesh_messages_received", "Control messages received and decoded, by op.", labels=by("op"),
                  values=(((op,), n) for op, n in sorted(received.items())))
    yield counter("pwmesh_messages_sent", "Control messages sent (replies, notifications, requests), by op.",
                  labels=by("op"), values=(((op,), n) for op, n in sorted(sent.items())))
    yield counter("pwmesh_frames_rejected", "Inbound frames dropped or answered with a protocol error, by reason.",
                  labels=by("reason"), values=(((r,), n) for r, n in sorted(rejected.items())))


def merged(*counts: Mapping[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for key, n in c.items():
            out[key] = out.get(key, 0) + n
    return out


class _Collector(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return list(self._collect())


class MetricsServer:
    """One daemon's registry, served at ``http://HOST:PORT/metrics`` while the daemon runs."""

    def __init__(self, collect: Callable[[], Iterable[Metric]], *, tasks: TaskGroup, name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(collect))
        ProcessCollector(registry=self.registry)  # the process's memory, CPU and open files (Linux: /proc)
        self._tasks = tasks
        self._name = name
        self._server: asyncio.Server | None = None
        self._failures = RejectedLog(f"{name} metrics", logger=log)
        self.address = ""
        self.port = 0

    async def start(self, host: str, port: int) -> str:
        """Listen on ``host:port`` (port 0: a free one); returns the scrape address."""
        try:
            self._server = await asyncio.start_server(self._connected, host, port, limit=MAX_REQUEST_BYTES)
        except OSError as exc:
            raise InvalidArgument(f"{self._name}: cannot serve metrics on {host}:{port}: {exc}") from None
        bound_host, self.port = self._server.sockets[0].getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.address = f"http://{shown}:{self.port}/metrics"
        return self.address

    async def close(self) -> None:
        """Stop listening (answers under way end with the service's task group)."""
        if self._server is not None:
            self._server.close()
            self._server = None

    def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self._tasks.spawn(self._serve(reader, writer), name=f"{self._name}.metrics")
        except RuntimeError:  # the daemon is stopping
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_SECONDS):
                head = b""
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.LimitOverrunError:
                    status, headers, body = 431, {"Content-Type": "text/plain"}, b"request header too large\n"
                else:
                    status, headers, body = self.respond(head)
                lines = [f"HTTP/1.1 {status} {_REASONS[status]}", *(f"{k}: {v}" for k, v in headers.items()),
                         f"Content-Length: {len(body)}", "Connection: close", "", ""]
                writer.write("\r\n".join(lines).encode("latin-1"))
                if not head.startswith(b"HEAD "):
                    writer.write(body)
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass  # a scraper that went away or never finished asking: nothing to answer
        finally:
            writer.close()

    def respond(self, head: bytes) -> tuple[int, dict[str, str], bytes]:
        """``(status, headers, body)`` for one request's head (request line and headers)."""
        request, *header_lines = head.decode("latin-1").split("\r\n")
        parts = request.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, {"Content-Type": "text/plain"}, b"malformed request line\n"
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            return 405, {"Content-Type": "text/plain", "Allow": "GET, HEAD"}, b"only GET and HEAD\n"
        if target.split("?", 1)[0] not in ("/metrics", "/"):
            return 404, {"Content-Type": "text/plain"}, b"metrics are at /metrics\n"
        accept = ""
        for line in header_lines:
            key, _, value = line.partition(":")
            if key.strip().lower() == "accept":
                accept = value.strip()
        encoder, content_type = choose_encoder(accept)
        try:
            body = encoder(self.registry)
        except Exception as exc:  # a bug in a collector: the scraper sees a 500, the daemon goes on
            more = self._failures.allow(type(exc).__name__, alike="like it")
            if more is not None:
                log.error("%s: collecting metrics failed%s", self._name, more, exc_info=exc,
                          extra={"reason": f"{type(exc).__name__}: {exc}"})
            return 500, {"Content-Type": "text/plain"}, b"collecting metrics failed\n"
        return 200, {"Content-Type": content_type}, body


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error"}
