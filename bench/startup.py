"""What forming each island's JAX group costs a cluster's start (issue #27 item 6).

Starts the default local cluster (2 islands x 2 hosts x 2 devices, every daemon a real
process) ``--rounds`` times with groups (the default of ``pw.connect()``, ``pwmesh up`` and
the systemd units) and without (``--no-collectives``), alternating, and reports the median
time until it serves (``LocalCluster.start`` returns once every group is formed) and until
a first SPMD step over a slice spanning two hosts has run (with groups only: without, such a
slice is refused). Writes ``startup.json`` into ``--out`` (default: bench/results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import DEFAULT_OUT, load_average, machine, table, write_json  # noqa: E402

import pwmesh as pw  # noqa: E402


def once(collectives: bool) -> dict[str, float]:
    start = time.perf_counter()
    with pw.LocalCluster(pw.LocalClusterSpec(collectives=collectives)) as cluster:
        ready = time.perf_counter() - start
        first = float("nan")
        if collectives:
            with pw.Client(cluster.address, name="bench-startup") as client:
                sl = client.make_virtual_device_set().add_slice(devices=4, mesh={"data": 4})
                step = pw.jit(lambda x: x - x.mean(), devices=sl, in_specs=P("data"), out_specs=P("data"))
                np.asarray(step(np.arange(8.0, dtype=np.float32)))
                first = time.perf_counter() - start
    return {"ready_seconds": ready, "first_spmd_step_seconds": first}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--smoke", action="store_true", help="one round of each")
    args = parser.parse_args(argv)
    rounds = 1 if args.smoke else args.rounds
    load_at_start = load_average()
    runs: dict[str, list[dict[str, float]]] = {"groups": [], "no groups": []}
    for _ in range(rounds):
        runs["no groups"].append(once(False))
        runs["groups"].append(once(True))
    summary: dict[str, Any] = {
        name: {key: statistics.median(r[key] for r in found) for key in found[0]} for name, found in runs.items()}
    summary["groups_cost_seconds"] = summary["groups"]["ready_seconds"] - summary["no groups"]["ready_seconds"]
    print(table(["cluster", "ready s (median)", "first SPMD step over 2 hosts s"],
                [[name, f"{summary[name]['ready_seconds']:.2f}",
                  "refused" if name == "no groups" else f"{summary[name]['first_spmd_step_seconds']:.2f}"]
                 for name in ("no groups", "groups")]))
    print(f"\nforming the groups costs {summary['groups_cost_seconds']:.2f} s of start-up ({rounds} rounds each)")
    write_json(args.out / "startup.json", {"benchmark": "startup", "smoke": args.smoke, "rounds": rounds,
                                           "runs": runs, "summary": summary, "machine": machine(load_at_start)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
