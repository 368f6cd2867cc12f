"""Weight sync: a model-sized pytree moved from a trainer's mesh to a sampler's (issue #31 item 2).

What an RL loop (``pwmesh/examples/rl.py``) does every step, at the size of a real model: the
parameters of ``pwmesh.examples.lm``'s Transformer (default ~240 MiB of float32 in 65 arrays),
laid out Megatron-style on a trainer slice of 4 devices ``{"data": 2, "model": 2}`` on island 0,
are moved by one ``pw.reshard(tree, devices=sampler, spec=P())`` onto a sampler slice of 2
devices ``{"data": 2}`` on island 1 (replicated: data-parallel sampling), executor to executor.
Against:

- **tcp**: raw TCP between two processes on 127.0.0.1 (``bench/transfer.py``'s, sender
  ``sendall``, receiver ``recv_into`` a reused buffer), the whole tree's bytes as one array:
  what the machine's loopback gives;
- **plane**: pwmesh's data plane with one array of the tree's size, one device to one device
  (island 0's executor to island 1's), by ``pw.reshard``: the plane's own bandwidth, with one
  dispatch and one completion;
- **reshard 1 device**: the same tree onto a sampler of one device (each block lands once; for 2
  devices on one executor it also crosses once, and both devices adopt the one host buffer);
- **round trip**: what a client without executor-to-executor moves does: ``fetch`` the tree
  to the client, then ``put`` it on the sampler.

Every transfer is timed from the call until every destination buffer is ready; GB/s is the
tree's bytes (1e9) over that time; ``wire_bytes`` says what the data plane counted (each block
crosses once per destination executor, whatever its number of devices there); ``daemon CPU s`` is
the CPU time (user + system) the cluster's daemons used over a transfer, a figure a busy machine
moves far less than the times. The executors run with ``--no-shared-memory``
(the path between hosts: TCP) unless ``--shm``. The synced tree is fetched once and compared
with what was put: equal, leaf by leaf.

    python bench/weight_sync.py            # ~1 minute on 2 cores
    python bench/weight_sync.py --smoke    # seconds: a tree of a few MiB
    python bench/weight_sync.py --mib 64 --repeats 5

Writes ``weight_sync.json`` and (with matplotlib) ``weight_sync.png`` into ``--out`` (default:
bench/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import pwmesh as pw
from pwmesh.examples import lm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_OUT, load_average, machine, pyplot, save_figure, save_results, table  # noqa: E402
from transfer import Peers, measure_shm, measure_tcp  # noqa: E402

MiB = 1 << 20
TRAINER_MESH = {"data": 2, "model": 2}
SAMPLER_MESH = {"data": 2}
METHODS = ("tcp", "plane", "reshard", "reshard 1 device", "round trip")


@dataclasses.dataclass
class Config:
    mib: int = 240  # the tree's size, roughly: the model's layers are added until it is reached
    d_model: int = 1024
    repeats: int = 5  # timed transfers per method and round
    rounds: int = 2  # rounds alternating the methods
    warmup: int = 1
    shared_memory: bool = False  # the executors' /dev/shm path (one machine) instead of TCP (between hosts)


def model_config(config: Config) -> lm.Config:
    """A Transformer of ``d_model`` whose parameters come to about ``config.mib`` MiB."""
    d = config.d_model
    per_layer = (4 * d * d + 2 * d * 4 * d) * 4  # q, k, v, o and the MLP's two matrices, float32
    layers = max(1, round(config.mib * MiB / per_layer))
    return lm.Config(d_model=d, n_layers=layers, n_heads=max(2, d // 64), d_ff=4 * d, seq_len=64)


def host_tree(mc: lm.Config) -> Any:
    """``lm.init_params``' structure and shapes, filled with distinct values (fast: numpy, not JAX's random)."""
    shapes = jax.eval_shape(lambda: lm.init_params(mc))
    rng = np.random.default_rng(0)
    return jax.tree_util.tree_map(lambda s: rng.random(s.shape, dtype=np.float32), shapes)


def nbytes(tree: Any) -> int:
    return sum(int(np.prod(leaf.shape)) * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(tree))


def wire_bytes(cluster: pw.LocalCluster) -> float:
    """Bytes the executors' data planes have sent so far (``pwmesh_dataplane_bytes_total``, every path)."""
    total = 0.0
    executors = {c.name for c in cluster.children if c.role == "executor"}
    for name, address in cluster.metrics_addresses().items():
        if name not in executors:
            continue
        with urllib.request.urlopen(address, timeout=10) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("pwmesh_dataplane_bytes_total{") and 'direction="sent"' in line:
                    total += float(line.rsplit(" ", 1)[1])
    return total


class Setup:
    """A cluster of two islands of one executor of 4 devices, a client, and the slices and trees on it."""

    def __init__(self, config: Config) -> None:
        args = () if config.shared_memory else ("--no-shared-memory",)
        self.cluster = pw.LocalCluster(pw.LocalClusterSpec(islands=2, hosts_per_island=1, devices_per_host=4,
                                                           executor_args=args, metrics=True))
        self.cluster.start()
        self.client = pw.Client(self.cluster.address, name="bench-weight-sync")
        devs = self.client.make_virtual_device_set()
        self.trainer = devs.add_slice(devices=4, island=0, mesh=TRAINER_MESH)
        self.sampler = devs.add_slice(devices=2, island=1, mesh=SAMPLER_MESH)
        self.one_src, self.one_dst = devs.add_slice(devices=1, island=0), devs.add_slice(devices=1, island=1)
        self.sampler_of_one = devs.add_slice(devices=1, island=1, mesh={"data": 1})
        self.mc = model_config(config)
        self.values = host_tree(self.mc)
        self.bytes = nbytes(self.values)
        self.tree = self.client.put(self.values, self.trainer, spec=lm.param_specs(self.mc))
        self.flat = self.client.put(np.zeros(self.bytes // 4, np.float32), self.one_src)
        self.ready([self.tree, self.flat])

    def ready(self, tree: Any) -> None:
        leaves = jax.tree_util.tree_leaves(tree)
        self.client.session.await_buffers([a.buffer_id for a in leaves])

    def free(self, tree: Any) -> None:
        for a in jax.tree_util.tree_leaves(tree):
            a.delete()

    def reshard(self) -> Any:
        return pw.reshard(self.tree, devices=self.sampler, spec=P())

    def reshard_to_one(self) -> Any:
        return pw.reshard(self.tree, devices=self.sampler_of_one, spec=P())

    def plane(self) -> Any:
        return pw.reshard(self.flat, devices=self.one_dst)

    def round_trip(self) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(self.tree)
        values = self.client.fetch(leaves)  # not pw.get: an Array keeps its fetched value, a second get is free
        return self.client.put(jax.tree_util.tree_unflatten(treedef, values), self.sampler, spec=P())

    def close(self) -> None:
        self.client.close()
        self.cluster.stop()


def cpu_seconds(cluster: pw.LocalCluster) -> float:
    """CPU seconds (user + system) the cluster's daemons have used so far: what a transfer costs the
    machine, which a loaded machine changes far less than its time."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for child in cluster.children:
        try:
            with open(f"/proc/{child.popen.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # not Linux, or gone
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def timed(setup: Setup, make: Any) -> tuple[float, float]:
    """One timed transfer (call to every destination buffer ready): its seconds, and the daemons' CPU
    seconds over it."""
    cpu = cpu_seconds(setup.cluster)
    start = time.perf_counter()
    out = make()
    setup.ready(out)
    seconds = time.perf_counter() - start
    used = cpu_seconds(setup.cluster) - cpu
    setup.free(out)
    return seconds, used


def check(setup: Setup) -> bool:
    """The synced tree, fetched, equals what was put, leaf by leaf; and it lies on the sampler."""
    synced = setup.reshard()
    leaves = jax.tree_util.tree_leaves(synced)
    assert all(a.sharding.slice is setup.sampler and a.sharding.spec == P() for a in leaves)
    got = setup.client.fetch(leaves)
    equal = all(np.array_equal(g, w) for g, w in zip(got, jax.tree_util.tree_leaves(setup.values), strict=True))
    setup.free(synced)
    return equal


def summarize(method: str, total: int, seconds: list[float], sent: float | None, cpu: list[float]) -> dict[str, Any]:
    median = statistics.median(seconds)
    return {"method": method, "bytes": total, "transfers": len(seconds), "seconds_median": median,
            "seconds_best": min(seconds), "gbytes_per_second": total / median / 1e9,
            "gbytes_per_second_best": total / min(seconds) / 1e9, "wire_bytes_per_transfer": sent,
            "daemon_cpu_seconds_median": statistics.median(cpu) if cpu else None}


def run(config: Config, smoke: bool) -> dict[str, Any]:
    started = time.monotonic()
    load_at_start = load_average()
    setup = Setup(config)
    try:
        leaves = jax.tree_util.tree_leaves(setup.values)
        print(f"tree: {len(leaves)} arrays, {setup.bytes / MiB:.1f} MiB (lm d_model={setup.mc.d_model}, "
              f"{setup.mc.n_layers} layers); trainer {TRAINER_MESH} on island 0 -> sampler {SAMPLER_MESH} "
              f"on island 1", flush=True)
        equal = check(setup)
        print(f"synced tree equals what was put: {equal}", flush=True)
        samples: dict[str, list[float]] = {m: [] for m in METHODS}
        cpu: dict[str, list[float]] = {m: [] for m in METHODS}
        sent: dict[str, list[float]] = {m: [] for m in METHODS}
        makers = {"plane": setup.plane, "reshard": setup.reshard, "reshard 1 device": setup.reshard_to_one,
                  "round trip": setup.round_trip}
        with Peers() as peers:
            for r in range(config.rounds):
                order = METHODS if r % 2 == 0 else tuple(reversed(METHODS))
                for method in order:
                    if method == "tcp":  # the raw path the executors' plane takes: a socket, or /dev/shm
                        raw = measure_shm if config.shared_memory else measure_tcp
                        samples["tcp"] += raw(setup.bytes, config.repeats, peers=peers,
                                              warmup=config.warmup)["samples_seconds"]
                        continue
                    # A method's transfers one after the other (interleaving them would measure a cold plane:
                    # the other methods' buffers push its 256 MiB receive buffer out of the executor's pool).
                    before = wire_bytes(setup.cluster)
                    for i in range(config.warmup + config.repeats):
                        seconds, used = timed(setup, makers[method])
                        if i >= config.warmup:
                            samples[method].append(seconds)
                            cpu[method].append(used)
                    sent[method].append((wire_bytes(setup.cluster) - before) / (config.warmup + config.repeats))
                print(f"  round {r + 1}/{config.rounds}: " + ", ".join(
                    f"{m} {setup.bytes / statistics.median(samples[m]) / 1e9:.2f} GB/s" for m in METHODS), flush=True)
        rows = [summarize(m, setup.bytes, samples[m], statistics.median(sent[m]) if sent[m] else None, cpu[m])
                for m in METHODS]
    finally:
        setup.close()
    by = {r["method"]: r["gbytes_per_second"] for r in rows}
    return {
        "benchmark": "weight_sync",
        "smoke": smoke,
        "config": dataclasses.asdict(config),
        "machine": machine(load_at_start),
        "tree": {"arrays": len(leaves), "bytes": setup.bytes, "model": dataclasses.asdict(setup.mc),
                 "trainer_mesh": TRAINER_MESH, "sampler_mesh": SAMPLER_MESH},
        "equal": equal,
        "results": rows,
        "ratios": {"reshard/plane": by["reshard"] / by["plane"], "reshard/tcp": by["reshard"] / by["tcp"],
                   "reshard 1 device/plane": by["reshard 1 device"] / by["plane"],
                   "reshard/round trip": by["reshard"] / by["round trip"], "plane/tcp": by["plane"] / by["tcp"]},
        "wall_seconds": time.monotonic() - started,
    }


def plot(path: Path, result: dict[str, Any]) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = result["results"]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    labels = {"tcp": "raw TCP\n(one array)", "plane": "pwmesh plane\n(one array)",
              "reshard": "pw.reshard\n(the tree)", "reshard 1 device": "pw.reshard\nto 1 device",
              "round trip": "client\nget + put"}
    ax.bar([labels[r["method"]] for r in rows], [r["gbytes_per_second"] for r in rows],
           color=["grey", "tab:blue", "tab:green", "tab:olive", "tab:orange"])
    for i, r in enumerate(rows):
        ax.annotate(f"{r['gbytes_per_second']:.2f}", (i, r["gbytes_per_second"]), ha="center",
                    textcoords="offset points", xytext=(0, 3), fontsize=8)
    tree = result["tree"]
    ax.set_ylabel("GB/s (tree bytes / time, median)")
    ax.set_title(f"Weight sync: {tree['bytes'] / MiB:.0f} MiB in {tree['arrays']} arrays, trainer 2x2 -> "
                 "sampler 2 (replicated), across islands", fontsize=9)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=None, help="the tree's size in MiB, roughly (240)")
    parser.add_argument("--repeats", type=int, default=None, help="timed transfers per method and round (5)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds alternating the methods (2)")
    parser.add_argument("--shm", action="store_true", help="the executors' shared-memory path instead of TCP")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--smoke", action="store_true", help="a tree of a few MiB (seconds)")
    args = parser.parse_args(argv)
    config = Config(mib=4, d_model=256, repeats=2, rounds=1) if args.smoke else Config()
    for field in ("mib", "repeats", "rounds"):
        if getattr(args, field) is not None:
            setattr(config, field, getattr(args, field))
    config.shared_memory = args.shm
    result = run(config, args.smoke)
    print()
    print(table(["method", "MiB", "median s", "GB/s", "best GB/s", "wire MiB", "daemon CPU s"],
                [[r["method"], f"{r['bytes'] / MiB:.1f}", f"{r['seconds_median']:.3f}",
                  f"{r['gbytes_per_second']:.2f}", f"{r['gbytes_per_second_best']:.2f}",
                  "" if r["wire_bytes_per_transfer"] is None else f"{r['wire_bytes_per_transfer'] / MiB:.1f}",
                  "" if r["daemon_cpu_seconds_median"] is None else f"{r['daemon_cpu_seconds_median']:.3f}"]
                 for r in result["results"]]))
    print()
    print(", ".join(f"{k} {v:.2f}x" for k, v in result["ratios"].items()))
    save_results(args.out, "weight_sync", result, lambda path: plot(path, result))
    return 0 if result["equal"] and math.isfinite(result["ratios"]["reshard/plane"]) else 1


if __name__ == "__main__":
    sys.exit(main())
