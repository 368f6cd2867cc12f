"""Per-message cost of the socket layer, and what it adds up to for a program.

Three measurements, each in steady state:

- **rpc** (two processes): a bench server (``Server`` of ``pwmesh.service.rpc`` in
  a daemon started with ``lifecycle.run``, as every daemon is) and, in this
  process, a ``Connection`` on an asyncio loop (uvloop where installed, as the
  daemons use):
  *round trip*: ``request(Ping)`` back to back;
  *one-way in*: ``post(NodeDone)`` N times, then one request (the ordered pipe
  proves every post arrived before its reply);
  *one-way out*: one request that makes the server ``post`` N ``NodeDone`` back
  before its reply.
  Rates are the median over rounds; CPU microseconds per message are measured
  on both processes (client: ``time.process_time``, server: ``/proc/PID/stat``).
- **program**: a one-node program on a local cluster (1 island x 1 host x 1
  device): ``np.asarray(f(x))`` for a one-device ``pw.pmap`` of ``x + 1``, with
  ``x`` already on the device; median latency.
- **chain**: a 128-node ``@pw.program``, each node ``x + 1`` fed by the previous,
  on the same cluster; median latency, and per node.

    python bench/message_rate.py                 # ~1-2 minutes on a 2-core machine
    python bench/message_rate.py --smoke         # seconds: checks that everything runs
    python bench/message_rate.py --label before  # writes message_rate-before.json

Writes ``message_rate[-LABEL].json`` into ``--out`` (default: bench/results).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_OUT, load_average, machine, table, write_json  # noqa: E402

BURST = "burst:"  # a Heartbeat named "burst:N" asks the bench server to post N messages back


@dataclasses.dataclass
class Config:
    rpc_rounds: int = 9
    round_trips: int = 2000  # per round
    one_way: int = 20000  # messages per round, each direction
    programs: int = 300
    chain_nodes: int = 128
    chains: int = 25
    warmup: int = 20


SMOKE = Config(rpc_rounds=2, round_trips=50, one_way=200, programs=5, chain_nodes=16, chains=2, warmup=2)


# ------------------------------------------------------------------ rpc server


def serve() -> None:
    """The bench server daemon: answers Ping, swallows NodeDone, bursts on request."""
    from pwmesh.service.lifecycle import Service, run
    from pwmesh.service.rpc import Server
    from pwmesh.wire import Envelope
    from pwmesh.wire.messages import Heartbeat, NodeDone, Ok, Ping

    class BenchServer(Service):
        role = "bench"

        async def setup(self) -> None:
            handlers: dict[Any, Any] = {Ping: self.ping, NodeDone: self._count, Heartbeat: self._burst}
            self.server = Server(self.ctx, "tcp://127.0.0.1:0", handlers, tasks=self.tasks, name=self.name)
            self.server.start()
            self.received = 0

        def _count(self, peer: bytes, env: Envelope) -> None:
            self.received += 1

        def _burst(self, peer: bytes, env: Envelope) -> Ok:
            msg = env.message
            assert isinstance(msg, Heartbeat) and msg.name.startswith(BURST)
            for i in range(int(msg.name[len(BURST):])):
                self.server.post(peer, NodeDone(run_id="s1-abcdef/r123", nodes=[i], executor_id="island0-host0"))
            return Ok()

        def ready_info(self) -> dict[str, Any]:
            return {**super().ready_info(), "address": self.server.address}

    run(BenchServer("bench-server"))


def start_server(timeout_seconds: float = 60.0) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    from pwmesh.service.lifecycle import wait_ready

    env = {**os.environ, "PWMESH_PARENT_PID": str(os.getpid())}
    proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env=env)
    try:
        return proc, wait_ready(proc, timeout_seconds, "the bench server")
    except BaseException:
        stop(proc)
        raise


def stop(proc: subprocess.Popen[bytes]) -> None:
    from pwmesh.service.lifecycle import stop_process

    stop_process(proc, timeout_seconds=10.0)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux), all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_loop(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())


def bench_rpc(config: Config) -> dict[str, Any]:
    from pwmesh.service.rpc import Connection
    from pwmesh.service.tasks import TaskGroup
    from pwmesh.service.transport import Context
    from pwmesh.wire.messages import Heartbeat, NodeDone, Ping

    proc, info = start_server()

    async def main() -> dict[str, Any]:
        ctx = Context()
        tasks = TaskGroup()
        pushed = 0

        def on_message(env: Any) -> None:
            nonlocal pushed
            pushed += 1

        conn = Connection(ctx, info["address"], tasks=tasks, name="bench-client", on_message=on_message)
        samples: dict[str, list[dict[str, float]]] = {"round_trip": [], "one_way_in": [], "one_way_out": []}
        note = NodeDone(run_id="s1-abcdef/r123", nodes=[5], executor_id="island0-host0")

        async def measure(kind: str, n: int, body: Callable[[], Coroutine[Any, Any, None]]) -> None:
            c0, s0, t0 = time.process_time(), cpu_seconds(proc.pid), time.perf_counter()
            await body()
            t1, c1, s1 = time.perf_counter(), time.process_time(), cpu_seconds(proc.pid)
            samples[kind].append({"per_second": n / (t1 - t0), "client_cpu_us": 1e6 * (c1 - c0) / n,
                                  "server_cpu_us": 1e6 * (s1 - s0) / n, "wall_us": 1e6 * (t1 - t0) / n})

        async def round_trips() -> None:
            for _ in range(config.round_trips):
                await conn.request(Ping(), timeout_seconds=30.0)

        async def one_way_in() -> None:
            for _ in range(config.one_way):
                conn.post(note)
            await conn.request(Ping(), timeout_seconds=60.0)

        async def one_way_out() -> None:
            nonlocal pushed
            pushed = 0
            await conn.request(Heartbeat(role="bench", name=f"{BURST}{config.one_way}"), timeout_seconds=60.0)
            assert pushed == config.one_way, (pushed, config.one_way)

        try:
            await conn.request(Ping(), timeout_seconds=30.0)
            for _ in range(2):  # warm-up
                await round_trips()
            for _ in range(config.rpc_rounds):
                await measure("round_trip", config.round_trips, round_trips)
                await measure("one_way_in", config.one_way, one_way_in)
                await measure("one_way_out", config.one_way, one_way_out)
        finally:
            await tasks.stop()
            ctx.close()
        result: dict[str, Any] = {}
        for kind, rows in samples.items():
            result[kind] = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
            result[kind]["rounds_per_second"] = [r["per_second"] for r in rows]
        return result

    try:
        return run_loop(main)
    finally:
        stop(proc)


# ------------------------------------------------------------------- programs


def bench_programs(config: Config) -> dict[str, Any]:
    import pwmesh as pw

    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=1, devices_per_host=1)
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address, name="message-rate") as client:
        devs = client.make_virtual_device_set()
        sl = devs.add_slice(devices=1)
        add = pw.pmap(lambda v: v + 1.0, devices=sl)
        x = client.put(np.zeros(1, np.float32), sl)

        def timed(fn: Callable[[Any], Any], n: int, expected: float) -> list[float]:
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                value = np.asarray(fn(x))
                times.append(time.perf_counter() - t0)
                if value[0] != expected:
                    raise AssertionError(f"got {value}, expected {expected}")
            return times

        timed(add, config.warmup, 1.0)
        one = timed(add, config.programs, 1.0)

        @pw.program
        def chain(v: Any) -> Any:
            for _ in range(config.chain_nodes):
                v = add(v)
            return v

        timed(chain, max(2, config.warmup // 4), float(config.chain_nodes))
        many = timed(chain, config.chains, float(config.chain_nodes))
    return {
        "program": {"median_ms": 1e3 * statistics.median(one), "p10_ms": 1e3 * float(np.percentile(one, 10)),
                    "p90_ms": 1e3 * float(np.percentile(one, 90)), "per_second": 1 / statistics.median(one),
                    "n": len(one)},
        "chain": {"nodes": config.chain_nodes, "median_ms": 1e3 * statistics.median(many),
                  "p10_ms": 1e3 * float(np.percentile(many, 10)), "p90_ms": 1e3 * float(np.percentile(many, 90)),
                  "per_node_us": 1e6 * statistics.median(many) / config.chain_nodes, "n": len(many)},
    }


# ------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--smoke", action="store_true", help="tiny run (seconds) to check that everything works")
    parser.add_argument("--label", default="", help="suffix of the results file (e.g. before, after)")
    parser.add_argument("--only", default="rpc,programs", help="what to run: rpc, programs, or both")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the rpc server process
    args = parser.parse_args(argv)
    if args.serve:
        serve()
        return 0
    config = SMOKE if args.smoke else Config()
    only = set(args.only.split(","))
    started = time.monotonic()
    load_at_start = load_average()
    result: dict[str, Any] = {"benchmark": "message_rate", "smoke": args.smoke, "label": args.label,
                              "config": dataclasses.asdict(config)}
    if "rpc" in only:
        print("rpc: a Server and a Connection in two processes ...", flush=True)
        result["rpc"] = bench_rpc(config)
    if "programs" in only:
        print("programs: a local cluster of 1 island x 1 host x 1 device ...", flush=True)
        result.update(bench_programs(config))
    result["machine"] = machine(load_at_start)
    result["wall_seconds"] = time.monotonic() - started

    if "rpc" in result:
        print()
        print(table(["rpc", "msgs/s", "wall us/msg", "client CPU us/msg", "server CPU us/msg"],
                    [[kind, f"{r['per_second']:.0f}", f"{r['wall_us']:.1f}", f"{r['client_cpu_us']:.1f}",
                      f"{r['server_cpu_us']:.1f}"] for kind, r in result["rpc"].items()]))
    if "program" in result:
        p, c = result["program"], result["chain"]
        print()
        print(table(["program", "median ms", "p10 ms", "p90 ms", "per node us"],
                    [["1 node", f"{p['median_ms']:.2f}", f"{p['p10_ms']:.2f}", f"{p['p90_ms']:.2f}", ""],
                     [f"{c['nodes']}-node chain", f"{c['median_ms']:.2f}", f"{c['p10_ms']:.2f}",
                      f"{c['p90_ms']:.2f}", f"{c['per_node_us']:.0f}"]]))
    name = f"message_rate-{args.label}" if args.label else "message_rate"
    out_json = args.out / f"{name}.json"
    write_json(out_json, result)
    print(f"\nwrote {out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
