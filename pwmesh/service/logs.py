"""Every daemon's log: one line per event on stderr, as ``key=value`` pairs or as one JSON object.

Both formats carry the same keys: ``ts``, ``level``, ``role`` and ``name`` (the daemon), ``logger``,
``msg``, and every field the call passed with ``extra=`` (``run``, ``session``, ``host``, ``op``,
``reason``, ``peer``...): ``log.warning("...", extra={"peer": peer, "reason": why})``. In JSON every
line is one object (a traceback is its key ``exc``), so a log is read with ``json.loads`` per line:

    {"ts": "2026-11-24T18:13:47.595+00:00", "level": "WARNING", "role": "rm", "name": "rm",
     "logger": "pwmesh.service.rpc", "msg": "rm: rejected frame ...", "peer": "006b8b4567",
     "reason": "header must be [version, op, msg_id, reply_to, sender]"}

Python warnings and exceptions that escape a thread are logged too, so they keep the format.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import sys
import threading
from typing import Any

FORMATS = ("text", "json")

# What a LogRecord holds of its own: anything else on a record came with ``extra=``.
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a log call passed with ``extra=``, in the order given."""
    return {k: v for k, v in vars(record).items() if k not in _RECORD_ATTRIBUTES and not k.startswith("_")}


def plain(value: Any) -> Any:
    """``value`` as JSON can hold it: routing ids (bytes) as hex, non-finite floats and the rest as text."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: the daemon, the event, and its ``extra=`` fields as keys."""

    def __init__(self, role: str, name: str) -> None:
        super().__init__()
        self.role = role
        self.name = name

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "role": self.role, "name": self.name, "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in fields(record).items():
            out.setdefault(key, plain(value))  # an extra field never hides the event's own keys
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``ts=... level=... role=... name=... logger=... msg='...'``, then the ``extra=`` fields as ``key=value``
    (strings quoted), then a traceback, if any, on the lines below."""

    def __init__(self, role: str, name: str) -> None:
        super().__init__(f"ts=%(asctime)s level=%(levelname)s role={role} name={name} logger=%(name)s "
                         "msg=%(message)r")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        line = super().formatMessage(record)
        extra = fields(record)
        if not extra:
            return line
        return line + "".join(f" {key}={value!r}" if isinstance(value, str) else f" {key}={plain(value)}"
                              for key, value in extra.items())


def setup_logging(role: str, name: str, level: str = "INFO", log_format: str = "text") -> None:
    """One line per event on stderr, ``text`` (key=value) or ``json``; warnings and uncaught thread
    exceptions go through the same handler."""
    if log_format not in FORMATS:
        raise ValueError(f"log format {log_format!r}: expected one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(role, name) if log_format == "json" else TextFormatter(role, name))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)
    logging.captureWarnings(True)
    threading.excepthook = _log_thread_exception


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    thread = args.thread.name if args.thread is not None else "?"
    exc_info = (args.exc_type, args.exc_value, args.exc_traceback)
    # typeshed's exc_info triple must hold an exception; logging formats one whose value is None too.
    logging.getLogger("pwmesh").error("uncaught exception in thread %s", thread, extra={"thread_name": thread},
                                      exc_info=exc_info)  # type: ignore[arg-type]
