"""Tenants' limits and shares, set by an admin, not chosen by clients.

A policy is a JSON file (``pwmesh tenants set NAME ...`` writes it; by default
``tenants.json`` in the cluster's keys directory), keyed by the name of a client's key
(``"*"``: everyone not named; ``"local"``: the one user of a cluster without keys)::

    {"alice": {"weight": 3, "priority": 1, "max_sessions": 4, "max_nodes": 10000, "max_programs": 100,
               "max_bytes": 8589934592, "max_bytes_in_flight": 1073741824, "max_run_seconds": 600}}

Left out or 0, a limit is off. The proxy re-reads the file when it changes (at most once
a second) and applies it from then on: a session's weight and priority when it opens,
the rest to each request. On a cluster with keys a client's own weight and priority are
ignored (``weight`` 1 and ``priority`` 0 unless the policy says otherwise); without keys
the one user's are taken, as before.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from pwmesh.errors import InvalidArgument

FILE_NAME = "tenants.json"
EVERYONE = "*"


@dataclasses.dataclass(frozen=True)
class TenantLimits:
    weight: float | None = None  # its share of the devices against others (None: 1, or the client's own)
    priority: int | None = None
    max_sessions: int = 0  # sessions open at once
    max_nodes: int = 0  # computations in one program
    max_programs: int = 0  # programs registered and held (``@pw.program``'s), all sessions together
    max_bytes: int = 0  # bytes its buffers hold on executors, all sessions together
    # Bytes of its puts and fetches passing through the proxy at once (arrived and not yet stored on
    # the executors; fetched and not yet sent on): what one tenant may make the controller hold.
    max_bytes_in_flight: int = 0
    max_run_seconds: float = 0.0  # a run still going after this fails with pw.DeadlineExceeded

    @classmethod
    def parse(cls, name: str, data: Any) -> TenantLimits:
        if not isinstance(data, dict) or set(data) - {f.name for f in dataclasses.fields(cls)}:
            raise InvalidArgument(f"tenant {name!r}: expected an object with fields among "
                                  f"{[f.name for f in dataclasses.fields(cls)]}, got {data!r}")
        checked: dict[str, Any] = {}
        for key, value in data.items():
            kind = float if key in ("weight", "max_run_seconds") else int
            if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and value != int(value)):
                raise InvalidArgument(f"tenant {name!r}: {key} must be a number, got {value!r}")
            if value < 0 or (key == "weight" and value <= 0):
                raise InvalidArgument(f"tenant {name!r}: {key} must be {'positive' if key == 'weight' else '>= 0'}")
            checked[key] = kind(value)
        return cls(**checked)

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None and v != 0}


@dataclasses.dataclass(frozen=True)
class TenantPolicy:
    tenants: dict[str, TenantLimits] = dataclasses.field(default_factory=dict)

    def of(self, name: str) -> TenantLimits:
        return self.tenants.get(name) or self.tenants.get(EVERYONE) or TenantLimits()

    @classmethod
    def parse(cls, data: Any) -> TenantPolicy:
        if not isinstance(data, dict):
            raise InvalidArgument(f"a tenants policy is an object of tenant names, got {type(data).__name__}")
        return cls({str(name): TenantLimits.parse(str(name), limits) for name, limits in data.items()})

    def as_json(self) -> dict[str, Any]:
        return {name: limits.as_json() for name, limits in sorted(self.tenants.items())}


def load(path: str | os.PathLike[str]) -> TenantPolicy:
    """The policy in ``path`` (none there: no limits)."""
    where = Path(path)
    if not where.exists():
        return TenantPolicy()
    try:
        data = json.loads(where.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read the tenants policy {where}: {exc}") from None
    return TenantPolicy.parse(data)


def save(path: str | os.PathLike[str], policy: TenantPolicy) -> None:
    """Write ``policy`` to ``path`` whole (a reader never sees half of it)."""
    where = Path(path)
    partial = where.with_name(f".{where.name}.{os.getpid()}")
    partial.write_text(json.dumps(policy.as_json(), indent=2) + "\n")
    partial.replace(where)


class PolicyFile:
    """The policy in a file, read again when the file changes (the caller decides how often to ask)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int] | None = None
        self.policy = TenantPolicy()
        self.error = ""  # why the last change could not be applied ("": it was)

    def current(self) -> TenantPolicy:
        """The policy now: re-read if the file changed; a file that does not parse leaves the last good one."""
        try:
            info = self.path.stat()
            stamp = (info.st_mtime_ns, info.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self.policy, self.error = load(self.path), ""
            except InvalidArgument as exc:
                self.error = exc.message
        return self.policy
