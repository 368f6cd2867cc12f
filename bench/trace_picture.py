"""Draw what the README shows: a real ``pwmesh trace`` of three clients sharing one island.

Starts a local cluster (1 island x 3 hosts x 2 devices), lets three clients
(weights 1, 1 and 3) run gang computations on overlapping slices at once, takes
the cluster's trace (the same data ``pwmesh trace`` writes) and draws each
device's timeline, coloured by client.

    python bench/trace_picture.py --out bench/trace_picture.png
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import tempfile
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import pwmesh as pw
from pwmesh.cli import commands


def work(x):
    m = jnp.full((128, 128), 0.01, jnp.float32)
    return jnp.tanh((jnp.full((128, 128), 0.5, jnp.float32) * x) @ m).sum()


def client(address: str, weight: float, name: str, programs: int, start: threading.Barrier) -> None:
    with pw.Client(address, weight=weight, name=name) as c:
        devs = c.make_virtual_device_set()
        slices = [devs.add_slice(devices=n) for n in (3, 2)]
        fns = [pw.pmap(work, devices=sl) for sl in slices]
        for _ in range(2):  # one untraced round first: every executable compiled, caches warm
            start.wait()
            pw.get([fns[i % 2](np.ones(len(slices[i % 2]))) for i in range(programs)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/trace_picture.png")
    parser.add_argument("--programs", type=int, default=40)
    args = parser.parse_args()
    import matplotlib  # noqa: PLC0415 - optional (the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=3, devices_per_host=2)
    clients = {"alice (w=1)": 1.0, "bob (w=1)": 1.0, "carol (w=3)": 3.0}
    with pw.LocalCluster(spec) as cluster, tempfile.TemporaryDirectory() as tmp:
        start = threading.Barrier(len(clients) + 1)
        with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
            done = [pool.submit(client, cluster.address, w, n, args.programs, start) for n, w in clients.items()]
            start.wait()
            start.wait()  # the second round is the one drawn
            began = time.monotonic()
            for d in done:
                d.result()
        path = Path(tmp) / "trace.json"
        print(commands.trace(cluster.address, str(path), last_seconds=time.monotonic() - began + 0.05))
        trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    procs = {e["pid"]: e["args"]["name"].split(" ")[0] for e in events if e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") == "computation"]
    sessions = sorted({e["args"]["session"] for e in spans})
    colours = dict(zip(sessions, plt.cm.tab10.colors, strict=False))
    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    start = min(e["ts"] for e in spans)
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(rows) + 1.5))
    for y, row in enumerate(rows):
        for e in (e for e in spans if (e["pid"], e["tid"]) == row):
            ax.broken_barh([((e["ts"] - start) / 1000, max(e["dur"], 1) / 1000)], (y - 0.4, 0.8),
                           facecolors=colours[e["args"]["session"]])
    ax.set_yticks(range(len(rows)), [f"{procs.get(p, p)} {names.get((p, t), t)}" for p, t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title("pwmesh trace: three clients' gang computations on one island, steady state (one colour per client)")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[s]) for s in sessions],
              labels=[f"session {s}" for s in sessions], loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
