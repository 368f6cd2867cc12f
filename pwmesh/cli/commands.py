"""What the ``pwmesh`` commands do, as plain functions (no click here)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import msgpack

import pwmesh as pw
from pwmesh.client.connection import ClientConnection
from pwmesh.examples import figure2
from pwmesh.executor.store import format_bytes
from pwmesh.service.local_cluster import LocalCluster, LocalClusterSpec
from pwmesh.wire.messages import (
    ClusterTrace,
    DrainHost,
    EventLines,
    GetClusterTrace,
    GetEvents,
    GetStatus,
    HostDrained,
    RecordedEvent,
    ResumeSuspended,
    SlicesChanged,
    StatusReply,
    SuspendSession,
    TraceEvent,
)


@dataclasses.dataclass
class UpConfig:
    islands: int
    hosts_per_island: int
    devices_per_host: int
    log_dir: str | None = None
    log_level: str = "WARNING"
    collectives: bool = True
    log_format: str = "text"
    keys: str = ""  # the cluster's keys directory: every socket speaks CURVE
    metrics: bool = True


def up(config: UpConfig) -> None:
    spec = LocalClusterSpec(islands=config.islands, hosts_per_island=config.hosts_per_island,
                            devices_per_host=config.devices_per_host, log_level=config.log_level,
                            log_format=config.log_format, collectives=config.collectives, keys=config.keys,
                            metrics=config.metrics)
    # Handlers go in before start-up so no stop signal is lost; the children
    # get default handlers again (their signal mask is never touched).
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    cluster = LocalCluster(spec, log_dir=config.log_dir)
    try:
        daemons = 2 + config.islands * (1 + config.hosts_per_island)
        if not sys.stderr.isatty():
            print(f"starting {daemons} daemons...", file=sys.stderr, flush=True)
        address = cluster.start_visibly()
        total = config.islands * config.hosts_per_island * config.devices_per_host
        print(f"pwmesh cluster up: {config.islands} islands x {config.hosts_per_island} hosts x "
              f"{config.devices_per_host} devices = {total} devices")
        print(f"address: {address}")
        print(f"logs:    {cluster.log_dir}")
        metrics = cluster.metrics_addresses()
        if metrics:
            print("metrics:")
            width = max(map(len, metrics))
            for name, where in metrics.items():
                print(f"  {name:<{width}}  {where}")
        print(f"in another shell:  export PWMESH_ADDRESS={address}")
        if config.keys:
            print(f"keys:    {config.keys} (a client needs its own: pwmesh keys add-client NAME --keys {config.keys};"
                  " then export PWMESH_KEYS=<the directory it prints>)")
        print("Ctrl-C stops every daemon.", flush=True)
        stop.wait()
        print("stopping...", flush=True)
    finally:
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("stopped.")


def submit(address: str | None, job: str, args: list[str], cluster: LocalClusterSpec | None = None, *,
           connect_timeout_seconds: float = 10.0) -> int:
    pw.connect(address, name=os.path.basename(job), cluster=cluster, connect_timeout_seconds=connect_timeout_seconds)
    old_argv = sys.argv
    sys.argv = [job, *args]
    try:
        runpy.run_path(job, run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception:  # the job's own error: shown as Python shows it, the job's exit status 1
        traceback.print_exc()
        return 1
    finally:
        sys.argv = old_argv
        pw.disconnect()
    return 0


def fetch_status(address: str, connect_timeout_seconds: float = 10.0, *, keys: str | None = None) -> StatusReply:
    """The cluster's status as the proxy shows it to ``keys``'s owner (else ``$PWMESH_KEYS``'s): a client's
    own sessions, or every tenant's to an admin."""
    conn = ClientConnection(address, name="status", open_session=False, probe=True,
                            connect_timeout_seconds=connect_timeout_seconds, keys=keys)
    try:
        reply = conn.request(GetStatus(), timeout_seconds=30.0)
    finally:
        conn.close()
    assert isinstance(reply, StatusReply)
    return reply


def debug_events(address: str, target: str, limit: int, *, connect_timeout_seconds: float = 10.0,
                 raw: str = "") -> str:
    """The latest events a daemon's core handled (``GetEvents``), one line each: ``target`` is ``proxy``,
    ``rm``, ``scheduler-N`` (island N's), an executor id as ``pwmesh status`` shows it, or an address.
    ``raw``: also write the events themselves to that file (``load_events`` reads it back, to replay)."""
    where = target
    if "://" not in target:
        status = fetch_status(address, connect_timeout_seconds)
        schedulers = {f"scheduler-{s.island}": s.address for s in status.cluster.schedulers}
        executors = {e.executor_id: e.control for e in status.cluster.executors if e.alive}
        known = {"proxy": address, "rm": status.rm, **schedulers, **executors}
        if not known.get(target):
            raise pw.NotFound(f"no daemon {target!r}: name one of {', '.join(sorted(k for k, v in known.items() if v))} "
                              "or give its address")
        where = known[target]
    conn = ClientConnection(where, name="debug", open_session=False, probe=True,
                            connect_timeout_seconds=connect_timeout_seconds)
    try:
        reply = conn.request(GetEvents(limit=limit, raw=bool(raw)), timeout_seconds=30.0)
    finally:
        conn.close()
    assert isinstance(reply, EventLines)
    if raw:
        Path(raw).write_bytes(msgpack.packb([e.to_wire() for e in reply.recorded]))
    if not reply.lines:
        return f"{reply.daemon} ({where}) keeps no events yet"
    return "\n".join([f"# {reply.daemon} at {where}: its latest {len(reply.lines)} events (time, stimulus id, "
                      "event -> how many actions it caused)", *reply.lines])


def load_events(path: str) -> list[RecordedEvent]:
    """The events ``debug_events(..., raw=path)`` wrote (``pwmesh.core.contract.recorded`` makes them
    replayable)."""
    data = msgpack.unpackb(Path(path).read_bytes())
    if not isinstance(data, list):
        raise pw.InvalidArgument(f"{path} holds no recorded events")
    return [RecordedEvent.from_wire(e, f"event {i}") for i, e in enumerate(data)]


def drain(address: str, host: str, timeout_seconds: float, *, connect_timeout_seconds: float = 10.0) -> str:
    conn = ClientConnection(address, name="drain", open_session=False, probe=True,
                            connect_timeout_seconds=connect_timeout_seconds)
    try:
        reply = conn.request(DrainHost(executor=host), timeout_seconds=timeout_seconds)
    finally:
        conn.close()
    assert isinstance(reply, HostDrained)
    return (f"{reply.executor_id} drained: {reply.slices} slice(s) and {reply.buffers} buffer(s) moved off it; "
            "it runs nothing new and can be stopped")


def suspend(address: str, session: str, *, connect_timeout_seconds: float = 10.0) -> str:
    """Suspend every slice of ``session`` (an admin's): its devices go to whoever asks next."""
    reply = _admin_request(address, SuspendSession(session_id=session), connect_timeout_seconds)
    devices = sum(len(sl.devices) for sl in reply.slices)
    return (f"session {session} suspended: {len(reply.slices)} slice(s), {devices} device(s) freed; its arrays wait "
            f"where they are and its runs fail with SliceSuspended until `pwmesh resume {session}`")


def resume(address: str, session: str, *, connect_timeout_seconds: float = 10.0) -> str:
    """Resume ``session``'s suspended slices on whatever devices the resource manager grants now."""
    reply = _admin_request(address, ResumeSuspended(session_id=session), connect_timeout_seconds)
    hosts = sorted({d.host or d.executor_id for sl in reply.slices for d in sl.devices})
    return f"session {session} resumed: {len(reply.slices)} slice(s) on {', '.join(hosts)}"


def _admin_request(address: str, message: SuspendSession | ResumeSuspended,
                   connect_timeout_seconds: float) -> SlicesChanged:
    conn = ClientConnection(address, name="admin", open_session=False, probe=True,
                            connect_timeout_seconds=connect_timeout_seconds)
    try:
        reply = conn.request(message, timeout_seconds=120.0)
    finally:
        conn.close()
    assert isinstance(reply, SlicesChanged)
    return reply


def table(headers: list[str], rows: list[list[object]], *, right: bool = False) -> str:
    """A plain-text table under a dashed rule; ``right`` aligns columns right (numbers)."""
    cells = [headers, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    pad = str.rjust if right else str.ljust
    lines = ["  ".join(pad(c, w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_status(reply: StatusReply) -> str:
    state = reply.cluster
    stats = {s.executor_id: s for s in reply.executor_stats}
    load: dict[tuple[str, int], int] = {}
    for sl in state.slices:
        for d in sl.devices:
            load[(d.executor_id, d.device)] = load.get((d.executor_id, d.device), 0) + 1
    islands = sorted({e.island for e in state.executors} | {s.island for s in state.schedulers})
    island_rows = []
    for isl in islands:
        execs = [e for e in state.executors if e.island == isl]
        sched = next((s.address for s in state.schedulers if s.island == isl), "-")
        island_rows.append([isl, len(execs), sum(len(e.devices) for e in execs), sched])
    host_rows = []
    for e in sorted(state.executors, key=lambda e: (e.island, e.executor_id)):
        st = stats.get(e.executor_id)
        devices = " ".join(f"{d.platform}{d.index}[{load.get((e.executor_id, d.index), 0)}]" for d in e.devices)
        kinds = ", ".join(sorted({d.kind for d in e.devices})) or "-"
        memory = "?"
        if st:
            # What the executor holds against its limit (all its devices together).
            memory = f"{format_bytes(st.bytes)} / {format_bytes(st.memory_limit) if st.memory_limit else '-'}"
            if st.waiting_for_memory:
                memory += f", {st.waiting_for_memory} waiting"
        # Busy is not dead: a host running a long computation still beats, and says what it runs.
        state_word = "LOST" if not e.alive else ("draining" if e.draining else "busy" if st and st.running else "up")
        host_rows.append([e.island, e.executor_id, e.host, state_word, kinds, devices,
                          st.objects if st else "?", memory, st.executed if st else "?",
                          " ".join(map(str, st.queued)) if st else "?"])
    running = [f"{e.executor_id}: {line}" for e in state.executors
               for line in (stats[e.executor_id].running if e.executor_id in stats else [])]
    session_rows = [[s.session_id, s.name, s.buffers, s.programs, s.weight, s.priority, s.registered,
                     f"{s.reused}/{s.reused + s.lowered}"] for s in reply.sessions]
    return "\n\n".join([
        f"map version {state.map_version}, {len(state.slices)} slices",
        table(["island", "hosts", "devices", "scheduler"], island_rows),
        table(["island", "executor", "host", "state", "device kind", "devices[slices]", "objects", "memory", "executed",
                "queued"], host_rows),
        *(["running now:\n" + "\n".join(f"  {line}" for line in running)] if running else []),
        table(["session", "name", "buffers", "running", "weight", "priority", "programs", "lowerings reused"],
              session_rows)
        if session_rows else "no sessions",
    ])


def status(address: str, as_json: bool, *, connect_timeout_seconds: float = 10.0) -> str:
    reply = fetch_status(address, connect_timeout_seconds)
    if as_json:
        return json.dumps(reply.to_wire(), indent=2, default=str)
    return format_status(reply)


def fetch_trace(address: str, since: float = 0.0, limit: int = 0, connect_timeout_seconds: float = 10.0) -> ClusterTrace:
    conn = ClientConnection(address, name="trace", open_session=False, probe=True,
                            connect_timeout_seconds=connect_timeout_seconds)
    try:
        reply = conn.request(GetClusterTrace(since=since, limit=limit), timeout_seconds=60.0)
    finally:
        conn.close()
    assert isinstance(reply, ClusterTrace)
    return reply


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _origin(reply: ClusterTrace) -> float:
    """A whole second before every event: timestamps count from it, small enough to keep sub-µs precision."""
    return float(math.floor(min((ev.arrived for t in reply.executors for ev in t.events), default=0.0)))


def trace_json(reply: ClusterTrace) -> dict[str, Any]:
    """The Chrome trace-event / Perfetto JSON of ``reply``: a process per executor, a thread per device.

    Every computation is one complete event (``"ph": "X"``) on each device it ran on;
    if its devices then waited (for its inputs, its compiled function or memory)
    at least 0.1 ms before it started, a ``wait`` event covers that time. Timestamps are each
    host's wall clock, in microseconds since ``otherData.origin_unix_seconds``."""
    origin = _origin(reply)
    events: list[dict[str, object]] = []
    executors = sorted(reply.executors, key=lambda t: (t.island, t.executor_id))
    for pid, got in enumerate(executors, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"{got.executor_id} (island {got.island}, host {got.host})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for d in got.devices:
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": d.index,
                           "args": {"name": f"{d.platform}{d.index}"}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": d.index,
                           "args": {"sort_index": d.index}})
        for ev in got.events:
            events.extend(_trace_events(pid, got.executor_id, got.island, ev, origin))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "clock": "wall clock of each executor's host, microseconds since origin_unix_seconds; "
                     "events of different hosts line up only as well as their clocks do",
            "origin_unix_seconds": origin,
            "limit_per_executor": reply.limit,
            "missing_executors": reply.missing,
        },
    }


# Shorter waits (bookkeeping between a device's arrival and the start) stay in the
# computation's args only, so they do not double the events in the file.
_WAIT_EVENT_MIN_SECONDS = 1e-4


def _trace_events(pid: int, executor_id: str, island: int, ev: TraceEvent,
                  origin: float) -> list[dict[str, object]]:
    name = f"{ev.fn_id[:8]} node {ev.node}"
    args: dict[str, object] = {
        "run_id": ev.run_id, "node": ev.node, "seq": ev.seq,
        "session": ev.run_id.partition(":")[0],  # run ids are "<session id>:<n>" (proxy Session.next_run_id)
        "fn_id": ev.fn_id, "executor": executor_id, "island": island,
        "input_wait_us": _us(ev.start - ev.arrived),  # its local devices all there, waiting for inputs, function, memory
    }
    if ev.error:
        args["error"] = ev.error
    out: list[dict[str, object]] = []
    for device in ev.devices:
        if ev.start - ev.arrived >= _WAIT_EVENT_MIN_SECONDS:
            out.append({"ph": "X", "cat": "wait", "name": f"wait: {name}", "pid": pid, "tid": device,
                        "ts": _us(ev.arrived - origin), "dur": _us(ev.start - ev.arrived), "args": args})
        out.append({"ph": "X", "cat": "error" if ev.error else "computation", "name": name, "pid": pid,
                    "tid": device, "ts": _us(ev.start - origin), "dur": _us(max(0.0, ev.end - ev.start)),
                    "args": args})
    return out


def trace(address: str, out: str, last_seconds: float | None = None, limit: int = 0, *,
          connect_timeout_seconds: float = 10.0) -> str:
    """Write the cluster's trace to ``out``; returns what to tell the user."""
    since = time.time() - last_seconds if last_seconds is not None else 0.0
    reply = fetch_trace(address, since=since, limit=limit, connect_timeout_seconds=connect_timeout_seconds)
    doc = trace_json(reply)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    computations = sum(len(t.events) for t in reply.executors)
    lines = [f"wrote {len(doc['traceEvents'])} events ({computations} computations on {len(reply.executors)} "
             f"executors) to {out}",
             "open it at https://ui.perfetto.dev or chrome://tracing"]
    if reply.missing:
        lines.append(f"no answer from {', '.join(reply.missing)}: their devices are not in the trace")
    full = [t.executor_id for t in reply.executors if reply.limit and len(t.events) >= reply.limit]
    if full:
        lines.append(f"only the newest {reply.limit} computations of {', '.join(full)} (use --last-seconds)")
    return "\n".join(lines)


def demo(address: str | None, *, connect_timeout_seconds: float = 10.0) -> None:
    start = time.monotonic()
    client = pw.connect(address, name="demo", connect_timeout_seconds=connect_timeout_seconds)
    where = f"the cluster at {client.address}" if client.cluster is None else "an embedded local cluster"
    print(f"connected to {where} in {time.monotonic() - start:.1f} s")
    try:
        figure2.main()
    finally:
        pw.disconnect()
    print(f"demo finished in {time.monotonic() - start:.1f} s")
