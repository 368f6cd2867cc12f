"""What ``pwmesh sim`` does: build a simulated cluster, run a workload, print the controller's figures.

Kept apart from ``commands`` so that it imports neither JAX nor sockets: the simulator
needs neither.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from pwmesh.sim.cluster import SimCluster, SimConfig, format_report
from pwmesh.sim.network import LinkSpec
from pwmesh.sim.workloads import Workload, install


@dataclasses.dataclass(frozen=True)
class SimCommand:
    islands: int = 4
    hosts_per_island: int = 256
    devices_per_host: int = 8
    workload: str = "chained"
    steps: int = 10
    devices: int = 8  # per slice
    k: int = 16
    latency_us: float = 20.0
    bandwidth_gbps: float = 100.0
    jitter: float = 0.0
    seed: int = 0
    json_path: str | None = None


def simulate(command: SimCommand) -> tuple[str, dict[str, Any]]:
    """Run it; returns the figures as text and as a dict (written to ``json_path`` too, if given)."""
    config = SimConfig(islands=command.islands, hosts_per_island=command.hosts_per_island,
                       devices_per_host=command.devices_per_host, seed=command.seed,
                       link=LinkSpec(latency_seconds=command.latency_us * 1e-6,
                                     bandwidth_bytes_per_second=command.bandwidth_gbps * 1e9 / 8,
                                     jitter=command.jitter))
    workload = Workload(name=command.workload, steps=command.steps, devices=command.devices, k=command.k,
                        stages=min(4, max(1, command.islands)) if command.workload == "pipeline" else 4)
    cluster = SimCluster(config)
    install(cluster, workload)
    report = cluster.run()
    report["workload"] = dataclasses.asdict(workload)
    if command.json_path:
        Path(command.json_path).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return f"workload: {command.workload}\n{format_report(report)}", report
