"""``--log-format json``: one JSON object per line, the event's fields as keys, for every daemon."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

import click
import pytest
import zmq
from click.testing import CliRunner

import pwmesh as pw
from pwmesh.cli.daemons import DAEMONS
from pwmesh.cli.main import main
from pwmesh.service.logs import JsonFormatter, TextFormatter
from pwmesh.wire import decode, encode
from pwmesh.wire.messages import Fetch, Ping

EVENT_KEYS = {"ts", "level", "role", "name", "logger", "msg"}


def record(msg: str, *args: object, exc: bool = False, **extra: object) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise KeyError("boom")
        except KeyError:
            exc_info = sys.exc_info()
    made = logging.getLogger("pwmesh.test").makeRecord("pwmesh.test", logging.WARNING, __file__, 1, msg, args,
                                                       exc_info, extra=extra)
    return made


def test_json_lines_carry_the_event_and_its_fields_as_keys() -> None:
    line = JsonFormatter("proxy", "proxy-1").format(record(
        "session %s ended: %s", "s1-ab", "closed", session="s1-ab", run="s1-ab:7", host="island0-host1",
        op="proxy.close_session", reason="closed by client", peer=b"\x00k\x8bEg", weight=math.nan))
    assert "\n" not in line
    event = json.loads(line)
    assert EVENT_KEYS <= event.keys()
    assert (event["level"], event["role"], event["name"], event["logger"]) == ("WARNING", "proxy", "proxy-1",
                                                                               "pwmesh.test")
    assert event["msg"] == "session s1-ab ended: closed"
    assert {k: event[k] for k in ("run", "session", "host", "op", "reason")} == {
        "run": "s1-ab:7", "session": "s1-ab", "host": "island0-host1", "op": "proxy.close_session",
        "reason": "closed by client"}
    assert event["peer"] == "006b8b4567"  # routing ids as hex
    assert event["weight"] == "nan"  # JSON has no NaN
    assert event["ts"].endswith("+00:00") and "T" in event["ts"]


def test_a_traceback_stays_inside_its_json_line() -> None:
    line = JsonFormatter("rm", "rm").format(record("handler failed", exc=True, op="rm.allocate_slice"))
    assert "\n" not in line
    event = json.loads(line)
    assert event["op"] == "rm.allocate_slice"
    assert "Traceback" in event["exc"] and "KeyError: 'boom'" in event["exc"]


def test_text_lines_append_the_fields_as_key_value_pairs() -> None:
    line = TextFormatter("rm", "rm").format(record("rejected %s", "x", peer=b"\x01", reason="bad", op="ping"))
    assert line.split(" ", 2)[2].startswith("level=WARNING role=rm name=rm logger=pwmesh.test msg='rejected x'")
    assert line.endswith(" peer=01 reason='bad' op='ping'")


# ------------------------------------------------------------------ the command line


@pytest.mark.parametrize("role", sorted(DAEMONS))
def test_every_daemon_takes_log_format_from_its_option_or_the_environment(
        role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    command = DAEMONS[role]
    assert CliRunner().invoke(command, ["--help"]).output.count("PWMESH_LOG_FORMAT") == 1
    monkeypatch.setenv("PWMESH_LOG_FORMAT", "json")
    assert _parsed(command)["log_format"] == "json"
    monkeypatch.delenv("PWMESH_LOG_FORMAT")
    assert _parsed(command)["log_format"] == "text"
    with pytest.raises(click.BadParameter):
        _parsed(command, "--log-format", "xml")


def _parsed(command: click.Command, *args: str) -> dict[str, object]:
    required = {"--island": "0", "--rm": "tcp://127.0.0.1:1", "--address": "127.0.0.1:1", "--processes": "2"}
    given = [a for name, value in required.items() if any(name in p.opts for p in command.params)
             for a in (name, value)]
    return command.make_context(command.name, [*given, *args]).params


def test_pwmesh_up_passes_its_log_format_on(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "PWMESH_LOG_FORMAT" in CliRunner().invoke(main, ["up", "--help"]).output
    seen = []
    monkeypatch.setattr("pwmesh.cli.commands.up", seen.append)
    result = CliRunner().invoke(main, ["up", "--log-format", "json"])
    assert result.exit_code == 0, result.output
    assert seen[0].log_format == "json"


# ------------------------------------------------------------------ a cluster logging in JSON


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_a_cluster_started_with_json_logs_writes_nothing_but_json_lines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PWMESH_ADDRESS", raising=False)
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=1, devices_per_host=1, log_level="INFO",
                               log_format="json")
    cluster = pw.LocalCluster(spec, log_dir=str(tmp_path))
    try:
        cluster.start()
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(cluster.rm_address)
            sock.send_multipart([b"", b"not a header", b"not a body"])  # rejected: peer and reason
            sock.send_multipart([b"", *encode(Ping(), msg_id=2)])
            assert sock.poll(10_000)
            sock.recv_multipart()
            sock.disconnect(cluster.rm_address)
            sock.connect(cluster.address)
            sock.send_multipart([b"", *encode(Fetch(buffer=3), msg_id=3)])  # refused: no session (op, reason)
            assert sock.poll(10_000)
            assert decode(sock.recv_multipart()[1:]).message.code == "no_session"
    finally:
        cluster.stop()
    events = {}
    for path in sorted(tmp_path.glob("*.log")):
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        assert lines, f"{path.name} is empty"
        events[path.stem] = [json.loads(line) for line in lines]  # every line is one JSON object
        for event in events[path.stem]:
            assert EVENT_KEYS <= event.keys(), event
    assert set(events) == {"rm", "scheduler-0", "island0-host0", "proxy"}
    assert {e["role"] for e in events["island0-host0"]} == {"executor"}
    rejected = [e for e in events["rm"] if "rejected frame" in e["msg"]]
    assert rejected and rejected[0]["reason"].startswith("unreadable header") \
        and isinstance(rejected[0]["peer"], str)
    refused = [e for e in events["proxy"] if e.get("op") == "proxy.fetch"]
    assert refused and refused[0]["reason"].startswith("this connection has no session") and refused[0]["peer"]
    assert any(e["msg"] == "proxy proxy running" for e in events["proxy"])
