"""CPU cost of the wire codec: encode and decode of typical dispatch messages, in one process.

Messages, built the way the proxy builds them (``pwmesh.ir.lower``): ``NodeDone``
(the most frequent message), and a ``ScheduleRun`` and an ``Enqueue`` holding 1
and 128 ``Computation``\\ s of a chain program: each computation has its shard
runs, an input and an output prefix, and one block ``Emit`` to the next node's
executor (a ``Target`` with one ``Site``). The computations travel packed (the
scheduler forwards them unread), so two more rows time packing them (the proxy,
``run_parts``) and unpacking and validating them (the executor, ``enqueued``).

For each message: *encode* is ``codec.encode`` (``to_wire`` and msgpack), *decode*
is ``codec.decode`` of the frames as a socket delivers them (msgpack and
``from_wire`` validation); *msgpack* is ``msgpack.unpackb`` of the body alone,
the floor under decode. Each figure is the median over ``--repeats`` rounds of
the mean CPU time per call within a round (``time.process_time``: on a loaded
machine, time other processes take from this one does not count).

    python bench/codec_rate.py                 # ~1 minute
    python bench/codec_rate.py --smoke         # seconds: checks that everything runs
    python bench/codec_rate.py --label before  # writes codec_rate-before.json

Writes ``codec_rate[-LABEL].json`` into ``--out`` (default: bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from pwmesh.wire import decode, encode
from pwmesh.wire.messages import Computation, Emit, Enqueue, Message, NodeDone, ScheduleRun, ShardRun, Site, Target
from pwmesh.wire.parts import enqueued, run_parts

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def chain_computations(nodes: int, devices: int = 2) -> list[Computation]:
    """A chain program's computations on one executor: node ``i`` reads ``v{i}``, writes ``v{i+1}``."""
    comps = []
    for i in range(nodes):
        runs = [ShardRun(device=0, shard=0, count=devices)]
        target = Target(prefix=f"s1:7/b{i + 1}x", shards=devices,
                        sites=[Site(executor_id="host-1", data="tcp://10.0.0.2:7001", host="host-1", runs=runs)],
                        shape=[128, 256], dtype="float32")
        comps.append(Computation(
            node=i, fn_id="f" * 64, executor_id="host-0", control="tcp://10.0.0.1:7000",
            runs=[ShardRun(device=0, shard=0, count=devices)], inputs=[f"s1:7/b{i}"], outputs=[f"s1:7/b{i + 1}"],
            emits=[Emit(mode="block", rows=256, src_shards=devices, targets=[target])], seq=1000 + i))
    return comps


def messages() -> dict[str, Message]:
    out: dict[str, Message] = {
        "NodeDone": NodeDone(run_id="s1:7", nodes=[3], executor_id="host-0"),
    }
    for n in (1, 128):
        comps = chain_computations(n)
        (part,) = run_parts(comps)
        out[f"ScheduleRun x{n}"] = ScheduleRun(run_id="s1:7", proxy="tcp://10.0.0.9:6000", parts=[part],
                                               session="s1", weight=1.0, priority=0)
        out[f"Enqueue x{n}"] = Enqueue(run_id="s1:7", proxy="tcp://10.0.0.9:6000", nodes=part.nodes,
                                       computations=part.computations, seqs=list(range(n)),
                                       scheduler="tcp://10.0.0.5:6100", executor_seq=12, epoch="e1")
    return out


def packed_rows(repeats: int, min_round_seconds: float) -> list[dict[str, Any]]:
    """The computations inside those messages: packed once by the proxy (``run_parts``), unpacked
    and validated by the executor (``enqueued``); the scheduler between them forwards the bytes."""
    rows = []
    for n in (1, 128):
        comps = chain_computations(n)
        (part,) = run_parts(comps)
        enqueue = Enqueue(run_id="s1:7", proxy="p", nodes=part.nodes, computations=part.computations)
        assert [c.node for c in enqueued(enqueue)] == part.nodes
        rows.append({
            "message": f"Computation x{n} (packed)",
            "body_bytes": len(part.computations),
            "encode_us": 1e6 * per_call_seconds(lambda c=comps: run_parts(c), repeats, min_round_seconds),
            "decode_us": 1e6 * per_call_seconds(lambda e=enqueue: enqueued(e), repeats, min_round_seconds),
            "msgpack_unpack_us": 1e6 * per_call_seconds(lambda b=part.computations: msgpack.unpackb(b, raw=False),
                                                        repeats, min_round_seconds),
        })
    return rows


def per_call_seconds(fn: Callable[[], Any], repeats: int, min_round_seconds: float) -> float:
    """Median over ``repeats`` rounds of the mean CPU seconds per call; a round takes at least ``min_round_seconds``."""
    loops = 1
    while True:  # calibrate: enough calls that a round is long against the clock's resolution
        start = time.process_time()
        for _ in range(loops):
            fn()
        if time.process_time() - start >= min_round_seconds:
            break
        loops *= 2
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(loops):
            fn()
        samples.append((time.process_time() - start) / loops)
    return statistics.median(samples)


def measure(repeats: int, min_round_seconds: float) -> list[dict[str, Any]]:
    rows = []
    for name, message in messages().items():
        frames = [bytes(f) for f in encode(message, msg_id=1)]
        assert decode(frames).message == message, name
        body = frames[1]
        rows.append({
            "message": name,
            "body_bytes": len(body),
            "encode_us": 1e6 * per_call_seconds(lambda m=message: encode(m, msg_id=1), repeats, min_round_seconds),
            "decode_us": 1e6 * per_call_seconds(lambda f=frames: decode(f), repeats, min_round_seconds),
            "msgpack_unpack_us": 1e6 * per_call_seconds(lambda b=body: msgpack.unpackb(b, raw=False), repeats,
                                                        min_round_seconds),
        })
    return rows + packed_rows(repeats, min_round_seconds)


def show(rows: list[dict[str, Any]]) -> str:
    headers = ["message", "body bytes", "encode us", "decode us", "msgpack unpack us"]  # CPU microseconds per call
    cells = [[r["message"], str(r["body_bytes"]), f"{r['encode_us']:.2f}", f"{r['decode_us']:.2f}",
              f"{r['msgpack_unpack_us']:.2f}"] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--label", default="", help="suffix of the results file (e.g. before, after)")
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--smoke", action="store_true", help="a few short rounds: checks that everything runs")
    args = parser.parse_args(argv)
    repeats, min_round = (3, 0.002) if args.smoke else (args.repeats, 0.05)
    load_at_start = round(os.getloadavg()[0], 2)
    rows = measure(repeats, min_round)
    print(show(rows))
    result = {
        "benchmark": "codec_rate",
        "smoke": args.smoke,
        "repeats": repeats,
        "min_round_seconds": min_round,
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
            "load_average_1m_at_start": load_at_start,
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        },
        "rows": rows,
    }
    name = "codec_rate" + (f"-{args.label}" if args.label else "") + ("-smoke" if args.smoke else "")
    path = args.out / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
