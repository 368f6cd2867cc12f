"""A client's ``pw.put`` and ``np.asarray(arr)`` against a raw socket and shared memory (issue #29, item 4).

One embedded cluster of one island, 2 hosts x 2 devices (two executor processes), and a client in
this process. A float32 array of each size is put sharded ``P("x")`` over the 4 devices (timed from
the call to the buffer being ready on every device), then fetched (``np.asarray`` of a fresh array:
from the call to the assembled value here). Both ways twice in the same run: **direct** (the bytes
go between the client and the executors over the data plane, ``pwmesh/client/direct.py``; on one
machine through shared memory) and **through the proxy** (``$PWMESH_DIRECT_MIN_BYTES=-1``: the old
path, client -> proxy -> executor over ZeroMQ). Baselines from ``bench/transfer.py``, same run: a raw
TCP socket on 127.0.0.1 and a reused ``/dev/shm`` segment between two processes.

Goal (issue #29): direct >= 0.8x raw TCP both ways. Writes ``client_transfer.json`` into --out.

    python bench/client_transfer.py            # 64 MiB, 5 transfers a way and path (~1 minute)
    python bench/client_transfer.py --smoke    # 2 MiB, 2 transfers
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

import pwmesh as pw

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_OUT, load_average, machine, table, write_json  # noqa: E402
from transfer import measure_shm, measure_tcp  # noqa: E402

from pwmesh.client.direct import DIRECT_MIN_BYTES  # noqa: E402

MiB = 1 << 20


WARMUP = 3  # untimed round trips first: the streams' shared-memory slots are made and mapped then


def client_rows(client: pw.Client, sl: Any, nbytes: int, repeats: int, direct: bool) -> list[dict[str, Any]]:
    """Put then fetch ``WARMUP`` + ``repeats`` arrays (the first untimed); a row per way."""
    client.session.direct_min_bytes = DIRECT_MIN_BYTES if direct else -1
    x = np.arange(nbytes // 4, dtype=np.float32)
    put_s, get_s = [], []
    for i in range(WARMUP + repeats):
        t0 = time.perf_counter()
        a = pw.put(x, sl, P("x"))
        a.block_until_ready()
        t1 = time.perf_counter()
        value = np.asarray(a)
        t2 = time.perf_counter()
        assert value[-1] == x[-1]
        if i >= WARMUP:
            put_s.append(t1 - t0)
            get_s.append(t2 - t1)
        del a, value
    path = "direct" if direct else "proxy"
    # pw.put returns once the executors hold the bytes; their copy onto the devices may end during the
    # fetch that follows, so the round trip is the fair single figure.
    return [{"method": f"pw.put ({path})", "bytes": nbytes, "seconds": put_s, "size": nbytes},
            {"method": f"np.asarray ({path})", "bytes": nbytes, "seconds": get_s, "size": nbytes},
            {"method": f"round trip ({path})", "bytes": 2 * nbytes, "size": nbytes,
             "seconds": [p + g for p, g in zip(put_s, get_s, strict=True)]}]


def summarized(row: dict[str, Any]) -> dict[str, Any]:
    median = statistics.median(row["seconds"])
    return {**row, "seconds_median": median, "gbytes_per_second": row["bytes"] / median / 1e9,
            "gbytes_per_second_best": row["bytes"] / min(row["seconds"]) / 1e9}


def run(sizes: list[int], repeats: int) -> dict[str, Any]:
    load = load_average()
    rows: list[dict[str, Any]] = []
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=2)
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address, name="bench-client-transfer") as client:
        sl = client.make_virtual_device_set().add_slice(devices=4)
        for nbytes in sizes:
            for direct in (True, False):
                rows += [summarized(r) for r in client_rows(client, sl, nbytes, repeats, direct)]
    for nbytes in sizes:
        for name, measure in (("raw TCP", measure_tcp), ("shared memory", measure_shm)):
            base = measure(nbytes, repeats)
            rows.append({"method": name, "bytes": nbytes, "seconds": base["samples_seconds"],
                         "seconds_median": base["seconds_median"], "gbytes_per_second": base["gbytes_per_second"],
                         "gbytes_per_second_best": base["gbytes_per_second_best"], "size": nbytes})
    ratios = {}
    for nbytes in sizes:
        rate = {r["method"]: r["gbytes_per_second"] for r in rows if r["size"] == nbytes}
        ratios[f"{nbytes // MiB} MiB"] = {
            f"{way} direct / {base}": rate[f"{way} (direct)"] / rate[base]
            for way in ("pw.put", "np.asarray") for base in ("raw TCP", "shared memory")} | {
            f"{way} direct / proxy": rate[f"{way} (direct)"] / rate[f"{way} (proxy)"]
            for way in ("pw.put", "np.asarray", "round trip")} | {
            "round trip direct / raw TCP": rate["round trip (direct)"] / rate["raw TCP"]}
    return {"benchmark": "client_transfer", "machine": machine(load), "sizes": sizes, "repeats": repeats,
            "results": rows, "ratios": ratios,
            "goal": "direct >= 0.8x raw TCP both ways (issue #29 item 4)"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64", help="array sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="timed transfers a way, path and size")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--smoke", action="store_true", help="2 MiB, 2 transfers: checks that it all runs")
    args = parser.parse_args(argv)
    sizes = [2 * MiB] if args.smoke else [int(s) * MiB for s in args.sizes.split(",")]
    result = run(sizes, 2 if args.smoke else args.repeats)
    result["smoke"] = args.smoke
    print(table(["method", "size", "GB/s median", "GB/s best", "ms median"],
                [[r["method"], f"{r['size'] // MiB} MiB", f"{r['gbytes_per_second']:.2f}",
                  f"{r['gbytes_per_second_best']:.2f}", f"{1000 * r['seconds_median']:.1f}"]
                 for r in result["results"]]))
    for size, ratio in result["ratios"].items():
        print(f"\n{size}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "client_transfer.json", result)
    print(f"\nwrote {args.out / 'client_transfer.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
