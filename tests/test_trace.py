"""``pwmesh trace``: every device's timeline as a Chrome trace-event / Perfetto JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import pwmesh as pw
from pwmesh.cli import commands
from pwmesh.cli.main import main
from pwmesh.wire.messages import ClusterTrace, DeviceInfo, TraceEvent, TraceEvents

Track = tuple[str, str]  # (executor, device name)


def _load(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    assert isinstance(doc["traceEvents"], list)
    assert doc["displayTimeUnit"] == "ms"
    return doc


def _tracks(doc: dict[str, Any]) -> tuple[dict[int, str], dict[tuple[int, int], str]]:
    """Executor names by pid and device names by (pid, tid), from the metadata events."""
    processes = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
                 if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    return processes, threads


def _computations(doc: dict[str, Any], session: str) -> dict[tuple[str, int], dict[Track, dict[str, Any]]]:
    """The session's computation events: by (run, node), then by device track."""
    processes, threads = _tracks(doc)
    found: dict[tuple[str, int], dict[Track, dict[str, Any]]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] != "X" or e["cat"] != "computation" or e["args"]["session"] != session:
            continue
        executor = processes[e["pid"]].split(" ")[0]
        track = (executor, threads[(e["pid"], e["tid"])])
        by_track = found.setdefault((e["args"]["run_id"], e["args"]["node"]), {})
        assert track not in by_track, f"two events for one computation on {track}"
        by_track[track] = e
    return found


def _assert_no_overlap(doc: dict[str, Any]) -> None:
    """A device runs one thing at a time (non-preemptive FIFO): its events never overlap."""
    per_track: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            per_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    assert per_track
    for track, spans in per_track.items():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert start >= end - 0.01, f"events overlap on {track}: one ends at {end}, the next starts at {start}"


def _slice_tracks(sl: pw.Slice) -> set[Track]:
    return {(d.executor, f"cpu{d.device}") for d in sl.devices}


def test_trace_has_an_event_per_computation_per_device(cluster: pw.LocalCluster, client: pw.Client,
                                                       tmp_path: Path) -> None:
    devs = client.make_virtual_device_set()
    s1, s2 = devs.add_slice(devices=2, island=0), devs.add_slice(devices=2, island=1)
    assert len({d.executor for d in s1.devices} | {d.executor for d in s2.devices}) == 2
    a = pw.pmap(lambda x: x * 2.0, devices=s1)
    b = pw.pmap(lambda x: x + 1.0, devices=s2)

    @pw.program
    def chain(v):
        return b(a(v))

    runs = 3
    for i in range(runs):
        np.testing.assert_array_equal(np.asarray(chain(np.array([1.0, 2.0]) + i)), [3.0 + 2 * i, 5.0 + 2 * i])

    message = commands.trace(cluster.address, str(tmp_path / "trace.json"))
    assert "ui.perfetto.dev" in message and "chrome://tracing" in message
    doc = _load(tmp_path / "trace.json")
    processes, threads = _tracks(doc)
    assert sorted(name.split(" ")[0] for name in processes.values()) == [
        "island0-host0", "island0-host1", "island1-host0", "island1-host1"]
    assert all("island" in name for name in processes.values())
    assert set(threads.values()) == {"cpu0", "cpu1"}

    mine = _computations(doc, client.session_id)
    assert len({run for run, _ in mine}) == runs
    assert len(mine) == runs * 2, "one entry per node of each run"
    for (run_id, node), by_track in mine.items():
        assert run_id.startswith(f"{client.session_id}:")
        assert set(by_track) == _slice_tracks(s1 if node == 0 else s2)
        seqs = {e["args"]["seq"] for e in by_track.values()}
        assert len(seqs) == 1 and seqs.pop() >= 0, "every device of a computation has its one island-order seq"
        for e in by_track.values():
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
            assert e["dur"] >= 0
            assert e["name"] == f"{e['args']['fn_id'][:8]} node {node}"
            assert e["args"]["input_wait_us"] >= 0
    # Within a run, node 1 consumes node 0's output: it starts after node 0 ended.
    for run_id in {run for run, _ in mine}:
        first_end = max(e["ts"] + e["dur"] for e in mine[(run_id, 0)].values())
        assert min(e["ts"] for e in mine[(run_id, 1)].values()) >= first_end - 0.01
    # On each device, computations run in island order.
    per_track: dict[Track, list[tuple[float, int]]] = {}
    for by_track in mine.values():
        for track, e in by_track.items():
            per_track.setdefault(track, []).append((e["ts"], e["args"]["seq"]))
    for track, order in per_track.items():
        seqs = [seq for _, seq in sorted(order)]
        assert seqs == sorted(seqs), f"{track} ran out of island order: {seqs}"
    _assert_no_overlap(doc)

    # The same through the command line.
    out = tmp_path / "cli.json"
    result = CliRunner().invoke(main, ["trace", "--out", str(out), "--address", cluster.address])
    assert result.exit_code == 0, result.output
    assert "ui.perfetto.dev" in result.output
    again = _computations(_load(out), client.session_id)
    assert set(again) == set(mine)
    recent = CliRunner().invoke(main, ["trace", "--out", str(out), "--address", cluster.address, "--limit", "1"])
    assert recent.exit_code == 0, recent.output
    last_run = max(mine, key=lambda key: max(e["ts"] for e in mine[key].values()))[0]
    assert set(_computations(_load(out), client.session_id)) == {(last_run, 0), (last_run, 1)}, \
        "the newest computation of each executor: the last run's two nodes"


def test_a_gang_over_two_executors_shows_on_both(cluster: pw.LocalCluster, client: pw.Client,
                                                  tmp_path: Path) -> None:
    wide = client.make_virtual_device_set().add_slice(devices=4, island=1)
    assert len({d.executor for d in wide.devices}) == 2
    f = pw.pmap(lambda x: x - 1.0, devices=wide)
    np.testing.assert_array_equal(np.asarray(f(np.arange(4.0))), np.arange(4.0) - 1.0)
    commands.trace(cluster.address, str(tmp_path / "trace.json"))
    doc = _load(tmp_path / "trace.json")
    ((run_node, by_track),) = _computations(doc, client.session_id).items()
    assert set(by_track) == _slice_tracks(wide)
    assert len({e["pid"] for e in by_track.values()}) == 2
    # Each executor's part of the gang has its own place in the island order, shared by its devices.
    seqs = {(e["pid"], e["args"]["seq"]) for e in by_track.values()}
    assert len(seqs) == 2 and len({seq for _, seq in seqs}) == 2
    assert all(e["args"]["input_wait_us"] >= 0 for e in by_track.values())
    _assert_no_overlap(doc)


def test_trace_without_address_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PWMESH_ADDRESS", raising=False)
    result = CliRunner().invoke(main, ["trace", "--out", str(tmp_path / "t.json")])
    assert result.exit_code == 2
    assert "no cluster address" in result.output


def test_trace_json_shows_waits_and_errors_without_a_cluster() -> None:
    t0 = 1_700_000_000.0
    waited = TraceEvent(run_id="s1-abc:7", node=2, seq=11, fn_id="f" * 32, devices=[0, 1],
                        arrived=t0, start=t0 + 0.5, end=t0 + 1.0)
    failed = TraceEvent(run_id="s1-abc:8#0", node=0, seq=12, fn_id="e" * 32, devices=[1],
                        arrived=t0 + 2.0, start=t0 + 2.0, end=t0 + 2.0, error="boom")
    reply = ClusterTrace(executors=[TraceEvents(executor_id="x0", island=3, host="h", events=[waited, failed],
                                                devices=[DeviceInfo(index=0), DeviceInfo(index=1)])],
                         limit=0, missing=["x1"])
    doc = commands.trace_json(reply)
    json.dumps(doc)
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    waits = [e for e in xs if e["cat"] == "wait"]
    assert doc["otherData"]["origin_unix_seconds"] == t0
    assert [(e["tid"], e["ts"], e["dur"]) for e in waits] == [(0, 0.0, 500_000.0), (1, 0.0, 500_000.0)]
    runs = [e for e in xs if e["cat"] == "computation"]
    assert [(e["tid"], e["ts"], e["dur"]) for e in runs] == [(0, 500_000.0, 500_000.0), (1, 500_000.0, 500_000.0)]
    assert runs[0]["args"]["input_wait_us"] == 500_000.0
    assert runs[0]["args"]["session"] == "s1-abc"
    (err,) = [e for e in xs if e["cat"] == "error"]
    assert err["ts"] == 2_000_000.0 and err["dur"] == 0 and err["args"]["error"] == "boom" and err["args"]["session"] == "s1-abc"
    assert doc["otherData"]["missing_executors"] == ["x1"]
    assert {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"} == {
        "x0 (island 3, host h)"}
