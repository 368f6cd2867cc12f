"""The island scheduler's core alone, per message, warm and with its cache evicted (issue #30 (d)).

``scale.py`` (d) runs the real cores on the simulator and charges each controller the CPU its core
took for each message (``pwmesh.sim.node.Node.core``). At 1,024 hosts the simulated cluster shares the
process with the cores: between two scheduler messages the simulated executors' work runs over
gigabytes of objects, so the scheduler's core runs with its data out of the CPU's caches. A real
scheduler runs in its own process, on its own core. This measures the same core in a small process
over a template of ``--hosts`` executors (8 devices each, a 16-node chain on every one, the
island's default fan-out tree), run after run, each run followed by the reports its tree's heads
send (one ``PartsDone`` per top-level subtree, its head's own part in it; ``RunPartDone`` from an
executor reached directly): the median CPU (``time.process_time``) of a warm ``RunTemplate`` and of
one report, handled back to back (*warm*), and with ~40 MB of memory read between any two messages
(*cold*: what the simulated cluster does to it; fewer runs, as each read takes milliseconds).

    python bench/scheduler_core.py                  # seconds: 16, 256 and 1,024 hosts
    python bench/scheduler_core.py --hosts 1024 --runs 500
    python bench/scheduler_core.py --smoke          # a second: 16 and 300 hosts (through a tree), a few runs

Writes ``scheduler_core.json`` (``scheduler_core-smoke.json``) into ``--out`` (default: bench/results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_OUT, load_average, machine, table, write_json  # noqa: E402

from pwmesh.core.contract import Received, Send  # noqa: E402
from pwmesh.scheduler.order import IslandOrder  # noqa: E402
from pwmesh.scheduler.state import SchedulerState  # noqa: E402
from pwmesh.sim.island import schedule_run  # noqa: E402
from pwmesh.wire import Message  # noqa: E402
from pwmesh.wire.messages import Enqueue, FanOut, InstallTemplate, PartsDone, RunPartDone, RunTemplate  # noqa: E402

NODES = 16
WARMUP = 50


class Evictor:
    """Reads ~40 MB (an array and scattered small objects, as a simulated cluster's state is) when called:
    more than this machine's last-level cache."""

    def __init__(self) -> None:
        self.array = np.ones(4 << 20)  # 32 MiB of float64
        self.objects: list[dict[str, Any]] = [{"n": i, "name": str(i)} for i in range(200_000)]

    def __call__(self) -> None:
        self.array.sum()
        sum(o["n"] for o in self.objects[::16])


def reports_for(actions: list[Any], run_id: str) -> list[Message]:
    """What the executors of a run send the scheduler once every part has ended (no early reports)."""
    out: list[Message] = []
    for action in actions:
        if not isinstance(action, Send):
            continue
        message = action.message
        if isinstance(message, FanOut) and len(message.executors) > 1:  # a head: its relay's one PartsDone
            out.append(PartsDone(run_id=run_id, head=message.executors[0], ended=list(message.executors)))
        elif isinstance(message, FanOut):  # a subtree of one reports itself
            out.append(RunPartDone(run_id=run_id, executor_id=message.executors[0], device_seconds=0.0))
        elif isinstance(message, Enqueue):
            out.append(RunPartDone(run_id=run_id, executor_id=action.to.removeprefix("tcp://").removesuffix(":1"),
                                   device_seconds=0.0))
    return out


def measure(hosts: int, runs: int, evict: Evictor | None) -> dict[str, Any]:
    executors = [f"island0-host{i}" for i in range(hosts)]
    state = SchedulerState(IslandOrder(0, scheduler="tcp://sched", window=2))
    parts = schedule_run("template", [(n, ex) for n in range(NODES) for ex in executors]).parts
    for part in parts:
        part.refs = [0]
        part.control = f"tcp://{part.executor_id}:1"
    state.handle(Received(InstallTemplate(template_id="t", parts=parts)), 0.0)
    run_seconds: list[float] = []
    report_seconds: list[float] = []
    reports_per_run = 0
    for k in range(WARMUP + runs):
        if evict is not None:
            evict()
        start = time.process_time()
        actions = state.handle(Received(RunTemplate(template_id="t", run_id=f"r{k}", proxy="tcp://proxy",
                                                    names=["b"], session="s")), 0.0)
        spent = time.process_time() - start
        reports = reports_for(actions, f"r{k}")
        reports_per_run = len(reports)
        for report in reports:
            if evict is not None:
                evict()
            begin = time.process_time()
            state.handle(Received(report), 0.0)
            if k >= WARMUP:
                report_seconds.append(time.process_time() - begin)
        if k >= WARMUP:
            run_seconds.append(spent)
    assert state.order.in_flight == 0, "every run ended"
    return {"hosts": hosts, "cache": "cold" if evict is not None else "warm", "runs": runs,
            "run_template_us": 1e6 * statistics.median(run_seconds),
            "report_us": 1e6 * statistics.median(report_seconds), "reports_per_run": reports_per_run,
            "per_run_us": 1e6 * (statistics.median(run_seconds) + reports_per_run * statistics.median(report_seconds))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="16,256,1024", help="comma-separated executor counts")
    parser.add_argument("--runs", type=int, default=300, help="runs timed per size (after a warm-up of 50)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and few runs (CI checks it runs)")
    args = parser.parse_args()
    if args.smoke:
        args.hosts, args.runs = "16,300", 10
    load = load_average()
    evictor = Evictor()
    rows = []
    for hosts in [int(h) for h in args.hosts.split(",")]:
        for cold in (None, evictor):
            rows.append(measure(hosts, args.runs if cold is None else max(1, args.runs // 5), cold))
            print(f"  {hosts:,} hosts, {rows[-1]['cache']}: RunTemplate {rows[-1]['run_template_us']:.1f} us, "
                  f"a report {rows[-1]['report_us']:.1f} us", flush=True)
    print(table(["hosts", "cache", "RunTemplate us", "a report us", "reports a run", "CPU a run us"],
                [[f"{r['hosts']:,}", r["cache"], f"{r['run_template_us']:.1f}", f"{r['report_us']:.1f}",
                  str(r["reports_per_run"]), f"{r['per_run_us']:.0f}"] for r in rows]))
    path = args.out / ("scheduler_core-smoke.json" if args.smoke else "scheduler_core.json")
    write_json(path, {"benchmark": "scheduler_core", "smoke": args.smoke, "machine": machine(load), "nodes": NODES,
                      "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
