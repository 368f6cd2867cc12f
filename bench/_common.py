"""Helpers shared by the benchmarks: the scheduler's accounting, tables, results files."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pwmesh.cli import commands
from pwmesh.cli.commands import fetch_status
from pwmesh.client.connection import ClientConnection
from pwmesh.wire.messages import GetSchedulerStats, GetTrace, SchedulerStats, TraceEvents

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


class SchedulerProbe:
    """A sessionless connection to one island's scheduler, for ``SchedulerStats`` snapshots."""

    def __init__(self, address: str, island: int = 0) -> None:
        schedulers = fetch_status(address).cluster.schedulers
        found = [s for s in schedulers if s.island == island]
        if not found:
            raise RuntimeError(f"no scheduler for island {island} in {schedulers}")
        self.address = found[0].address
        self.conn = ClientConnection(self.address, name="bench-stats", open_session=False)

    def stats(self) -> SchedulerStats:
        reply = self.conn.request(GetSchedulerStats(), timeout_seconds=30.0)
        assert isinstance(reply, SchedulerStats)
        return reply

    def snapshot(self) -> tuple[float, dict[str, tuple[float, int, int]]]:
        """(monotonic time, {session: (device_seconds, runs released, runs waiting)})."""
        stats = self.stats()
        return time.monotonic(), {c.session: (c.device_seconds, c.runs, c.waiting) for c in stats.clients}

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> SchedulerProbe:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def executor_trace(address: str, session: str, since: float) -> list[Any]:
    """This session's computations since ``since`` on every executor, by start time."""
    events = []
    for ex in fetch_status(address).cluster.executors:
        conn = ClientConnection(ex.control, name="bench-trace", open_session=False)
        try:
            reply = conn.request(GetTrace(since=since), timeout_seconds=30.0)
        finally:
            conn.close()
        assert isinstance(reply, TraceEvents)
        events.extend(ev for ev in reply.events if ev.run_id.startswith(session))
    return sorted(events, key=lambda ev: ev.start)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """Benchmark tables: the CLI's, right-aligned for numbers."""
    return commands.table(headers, rows, right=True)


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def machine(load_at_start: float | None = None, devices: str = "cpu") -> dict[str, Any]:
    """The machine, for the results file. Load averages count the benchmark's own processes too.
    ``devices``: the executors' platform (``--platform``), plain JAX's the same."""
    import jax

    backend = ("cpu (JAX CPU devices, --xla_force_host_platform_device_count per executor)" if devices == "cpu"
               else f"{devices} (executors --platform {devices}; plain JAX on the same devices)")
    return {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "cpus": os.cpu_count(),
        "load_average_1m_at_start": load_at_start,
        "load_average_1m_at_end": load_average(),
        "backend": backend,
    }


PLATFORMS = ("cpu", "cuda", "rocm", "tpu")  # the executors' --platform; plain JAX runs on the same


def share_accelerator(devices: str) -> None:
    """On an accelerator the benchmark's processes (its executors, plain JAX) share the devices, so none may
    take most of their memory when it starts, as JAX does by default: each allocates as it goes. Set before
    JAX starts a backend here; the executors and subprocesses inherit it. Nothing changes on CPU."""
    if devices != "cpu":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def save_results(out: Path, name: str, result: dict[str, Any], draw: Callable[[Path], bool]) -> None:
    """Write ``out/name.json``, then ``out/name.png`` through ``draw`` (False: no matplotlib)."""
    out_json = out / f"{name}.json"
    write_json(out_json, result)
    print(f"\nwrote {out_json}")
    if draw(out / f"{name}.png"):
        print(f"wrote {out / f'{name}.png'}")
    else:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None if matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> bool:
    """Lay ``fig`` out, write it to ``path`` as a PNG and close it; True (for the plot functions)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def threshold_crossing(points: list[dict[str, Any]], threshold: float) -> dict[str, Any]:
    """Over ``points`` (each a ``compute_ms_per_step`` and a pwmesh/JAX ``ratio``, in growing compute), the
    smallest compute time from which every larger point reaches ``threshold`` (a lone point above it among
    points below it is noise): that point, its time, and the time interpolated (log) from the one below."""
    first = len(points)
    while first > 0 and points[first - 1]["ratio"] >= threshold:
        first -= 1
    if first == len(points):
        return {"point": None, "min_ms": None, "min_ms_interpolated": None}
    hit = points[first]
    interpolated = hit["compute_ms_per_step"]
    if first > 0:
        below = points[first - 1]
        lo, hi = math.log(below["compute_ms_per_step"]), math.log(hit["compute_ms_per_step"])
        if hit["ratio"] > below["ratio"] and hi > lo:
            frac = (threshold - below["ratio"]) / (hit["ratio"] - below["ratio"])
            interpolated = math.exp(lo + frac * (hi - lo))
    return {"point": hit, "min_ms": hit["compute_ms_per_step"], "min_ms_interpolated": interpolated}


def fixed_overhead(points: list[dict[str, Any]], threshold: float) -> dict[str, float]:
    """pwmesh's extra time per step, if it simply adds to the compute time c: ratio = c / (c + o), so
    o = c (1/ratio - 1), median over the points; then the threshold needs c >= o * threshold / (1 - threshold).
    Less noisy than the crossing on a shared machine, where one point's ratio can jump."""
    extra = statistics.median(p["compute_ms_per_step"] * (1 / p["ratio"] - 1) for p in points)
    return {"overhead_ms": extra, "predicted_min_ms": max(0.0, extra) * threshold / (1 - threshold)}
