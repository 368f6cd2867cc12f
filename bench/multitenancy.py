"""Multi-tenancy: device-time shares of weighted clients on one island, with and without quotas; throughput vs
clients; what the per-message authorisation checks cost.

Part 1 (shares): four clients with weights 1:2:4:8 (``pw.Client(address, weight=w)``)
saturate one island with a small compiled computation on a slice spanning every
device of the island, so every run of every client competes for the same
devices. Each client keeps ``--depth`` runs outstanding (it fetches the oldest
quarter whenever that many are in flight), so its queue at the island scheduler
never runs dry. After a warm-up, the island scheduler's own accounting
(``GetSchedulerStats``: device-seconds per session, as the executors report them)
is read twice, ``--duration`` seconds apart; each client's share of the
device-seconds in between is compared with its share of the total weight.

Part 2 (shares with quotas, issue #26 item 6): the same four clients on a cluster
with keys, each with a client key of its own (t1, t2, t4, t8). On such a cluster
the client's ``weight=`` is ignored: the weights 1:2:4:8 come from the tenants
policy (``tenants.json`` in the keys directory), which also sets every quota
(``max_sessions``, ``max_nodes``, ``max_programs``, ``max_bytes``,
``max_run_seconds``) high enough never to be hit. Every message now passes CURVE
and the daemons' authorisation checks, and every request the proxy's quota
checks: the shares should not move. The scheduler's own weight for each session
is read back, so a policy not applied fails the run instead of measuring 1:1:1:1.

Part 3 (throughput): 1, 4, 8 and 16 equal-weight clients run the same loop;
aggregate throughput is the number of computations the scheduler released in the
measurement window divided by its length.

Part 4 (authorisation per message), in this process, no daemons: what a daemon's
``Server._received`` adds per message for access control, ``Context.identify``
(the ZAP User-Id of a frame that really came over a CURVE connection, looked up in
``authorized/``) then ``Access.allows``, with keys (a client key sending a
``RunProgram``) and without (every peer is ``LOCAL``); against ``decode`` of the
same received frames and a ``Ping`` round trip through ``Server``/``Connection``
(both ends on one loop), so the checks' fraction of a message's cost shows.

    python bench/multitenancy.py                 # ~3 minutes on a 2-core machine
    python bench/multitenancy.py --quotas        # parts 2 and 4 alone (~1 minute)
    python bench/multitenancy.py --smoke         # a few seconds: checks that it all runs

Writes ``multitenancy.json`` and ``multitenancy.png`` (matplotlib, if installed)
into ``--out`` (default: bench/results).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

import pwmesh as pw
from pwmesh.cli.commands import fetch_status
from pwmesh.client.connection import ClientConnection
from pwmesh.proxy import tenants
from pwmesh.proxy.tenants import TenantLimits, TenantPolicy
from pwmesh.service import keys
from pwmesh.service.keys import AuthorizedKeys, Keys
from pwmesh.service.rpc import Access, Connection, Server, next_id
from pwmesh.service.tasks import TaskGroup
from pwmesh.service.transport import Context
from pwmesh.wire import decode, encode
from pwmesh.wire.messages import Ok, Ping, RunProgram
from pwmesh.wire.records import ProgramInput

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_OUT,
    SchedulerProbe,
    load_average,
    machine,
    pyplot,
    save_figure,
    save_results,
    table,
)

WEIGHTS = (1.0, 2.0, 4.0, 8.0)
TENANTS = ("t1", "t2", "t4", "t8")  # part 2: one client key per weight, named after it
ADMIN = "bench-admin"  # part 2: the key the scheduler probe and the policy check use
# Part 2's quotas: each set, none ever reached. A client holds 1 session, registers 1 one-node program, keeps
# ~1 MiB on the executors, and its runs wait at most ~10 s at the scheduler (weight 1 of 15, 64 queued).
QUOTAS = TenantLimits(max_sessions=4, max_nodes=1_000, max_programs=100, max_bytes=1 << 30, max_run_seconds=600.0)


@dataclasses.dataclass
class Config:
    hosts: int = 2
    devices_per_host: int = 2
    size: int = 256  # each device multiplies a size x size block by itself
    depth: int = 64  # runs each client keeps outstanding (>> the scheduler's window of 8 per device)
    warmup: float = 5.0
    duration: float = 30.0  # measurement window of the shares part
    throughput_duration: float = 10.0  # measurement window per client count
    client_counts: tuple[int, ...] = (1, 4, 8, 16)
    target_error: float = 0.05  # |share - target| / target
    sample_interval: float = 0.25  # seconds between scheduler samples inside the window
    auth_calls: int = 100_000  # part 4: checks timed back to back, per repeat
    auth_repeats: int = 5  # part 4: the best repeat counts (the others met the machine's other work)
    round_trips: int = 2_000  # part 4: Ping round trips per repeat

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host


_T0 = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _T0:5.1f} s] {message}", flush=True)


def work(x: Any) -> Any:
    """A small computation with a measurable device time: one matmul, a nonlinearity, a reduction."""
    return jnp.tanh(x @ x).sum()


class ClientThread(threading.Thread):
    """One tenant: its own session, one slice over the whole island, runs kept in flight until ``stop``.

    With ``keys`` (a client key's directory) it asks for no weight: on a cluster with keys the tenants
    policy gives it, and ``weight`` is only what the policy is expected to give."""

    def __init__(self, address: str, name: str, weight: float, depth: int, config: Config,
                 ready: threading.Barrier, stop: threading.Event, keys: str | None = None) -> None:
        super().__init__(name=name, daemon=True)
        self.address = address
        self.weight = weight
        self.keys = keys
        self.depth = depth
        self.config = config
        self.ready = ready
        self.stop = stop
        self.session = ""
        self.placement: list[str] = []
        self.completed = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the main thread
            self.error = exc
            self.ready.abort()

    def _run(self) -> None:
        cfg = self.config
        asked = self.weight if self.keys is None else 1.0
        with pw.Client(self.address, name=self.name, weight=asked, keys=self.keys) as client:
            self.session = client.session_id
            sl = client.make_virtual_device_set().add_slice(devices=cfg.devices)
            self.placement = [f"{d.executor}:{d.device}" for d in sl.devices]
            fn = pw.pmap(work, devices=sl)
            rng = np.random.default_rng(len(self.name))
            x = client.put(rng.standard_normal((cfg.devices, cfg.size, cfg.size), np.float32) / cfg.size, sl)
            client.fetch([fn(x)], timeout_seconds=120.0)  # compile everywhere before the clock starts
            self.ready.wait(timeout=300.0)
            outstanding: collections.deque[pw.Array] = collections.deque()
            batch = max(1, self.depth // 4)  # fetch the oldest quarter; the rest stays queued
            while not self.stop.is_set():
                outstanding.append(fn(x))
                if len(outstanding) >= self.depth:
                    client.fetch([outstanding.popleft() for _ in range(batch)], timeout_seconds=120.0)
                    self.completed += batch
            if outstanding:  # drain: leave nothing queued behind
                client.fetch(list(outstanding), timeout_seconds=120.0)
                self.completed += len(outstanding)


def measure(address: str, probe: SchedulerProbe, weights: list[float], config: Config, duration: float,
            depth: int, client_keys: list[str] | None = None) -> dict[str, Any]:
    """Run one client per weight (with ``client_keys``, each with its key); the scheduler's device-seconds
    and runs per client over the window, and the weight the scheduler gave each."""
    ready = threading.Barrier(len(weights) + 1)
    stop = threading.Event()
    if client_keys is None:
        threads = [ClientThread(address, f"tenant{i}-w{w:g}", w, depth, config, ready, stop)
                   for i, w in enumerate(weights)]
    else:
        threads = [ClientThread(address, f"{Path(k).name}-w{w:g}", w, depth, config, ready, stop, keys=k)
                   for w, k in zip(weights, client_keys, strict=True)]
    begun = time.monotonic()
    for t in threads:
        t.start()
    try:
        try:
            ready.wait(timeout=300.0)
        except threading.BrokenBarrierError:
            pass
        setup = time.monotonic() - begun
        failed = [t for t in threads if t.error is not None]
        if failed:
            raise RuntimeError(f"{failed[0].name} failed") from failed[0].error
        time.sleep(config.warmup)
        t0, s0 = probe.snapshot()
        samples = []  # is each client backlogged (runs waiting at the scheduler) during the window?
        while time.monotonic() < t0 + duration:
            time.sleep(min(config.sample_interval, max(0.0, t0 + duration - time.monotonic())))
            samples.append(probe.snapshot())
        t1, s1 = samples[-1]
        applied = {c.session: c.weight for c in probe.stats().clients}  # while every session is still open
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300.0)
    failed = [t for t in threads if t.error is not None or t.is_alive()]
    log(f"{len(weights)} clients: setup {setup:.1f} s, drain {time.monotonic() - t1:.1f} s")
    if failed:
        raise RuntimeError(f"{failed[0].name} failed or hung") from failed[0].error
    elapsed = t1 - t0
    clients = []
    for t in threads:
        ds0, runs0, _ = s0.get(t.session, (0.0, 0, 0))
        ds1, runs1, _ = s1.get(t.session, (0.0, 0, 0))
        waiting = [snap.get(t.session, (0.0, 0, 0))[2] for _, snap in samples]
        clients.append({"name": t.name, "session": t.session, "weight": t.weight,
                        "scheduler_weight": applied.get(t.session), "placement": t.placement,
                        "device_seconds": ds1 - ds0, "runs": runs1 - runs0, "completed_total": t.completed,
                        # fraction of samples in which the client had runs waiting at the scheduler: the
                        # policy can only enforce its share while it is backlogged (close to 1.0)
                        "backlogged": sum(w > 0 for w in waiting) / len(waiting) if waiting else 0.0,
                        "mean_waiting": sum(waiting) / len(waiting) if waiting else 0.0})
    return {"seconds": elapsed, "clients": clients}


def shares_part(address: str, probe: SchedulerProbe, config: Config,
                client_keys: list[str] | None = None) -> dict[str, Any]:
    window = measure(address, probe, list(WEIGHTS), config, config.duration, config.depth, client_keys)
    wrong = [c for c in window["clients"] if c["scheduler_weight"] != c["weight"]]
    if wrong:  # the shares would measure some other policy than the one named
        raise RuntimeError("the scheduler did not get the expected weights: " + ", ".join(
            f"{c['name']} has {c['scheduler_weight']}, expected {c['weight']:g}" for c in wrong))
    total_ds = sum(c["device_seconds"] for c in window["clients"])
    total_w = sum(WEIGHTS)
    rows = []
    for c in window["clients"]:
        target = c["weight"] / total_w
        share = c["device_seconds"] / total_ds if total_ds > 0 else 0.0
        rows.append({**c, "target_share": target, "share": share, "error": share - target,
                     "relative_error": (share - target) / target})
    return {
        "seconds": window["seconds"],
        "device_seconds_total": total_ds,
        "device_utilisation": total_ds / (window["seconds"] * config.devices),
        "runs_total": sum(c["runs"] for c in rows),
        "runs_per_second": sum(c["runs"] for c in rows) / window["seconds"],
        "max_relative_error": max(abs(r["relative_error"]) for r in rows),
        "max_error_points": max(abs(100 * r["error"]) for r in rows),
        # The target: every share within +/-5% of its weight share, relative (the strict reading);
        # within_target_points is the loose one (+/-5 percentage points of the island).
        "within_target": all(abs(r["relative_error"]) <= config.target_error for r in rows),
        "within_target_points": all(abs(r["error"]) <= config.target_error for r in rows),
        "clients": rows,
    }


def throughput_part(address: str, probe: SchedulerProbe, config: Config) -> list[dict[str, Any]]:
    results = []
    for n in config.client_counts:
        # Fewer runs per client as clients grow (at least 16 each, 256 in all): the island stays
        # saturated and the drain after the window stays short.
        depth = max(16, min(config.depth, 256 // n))
        window = measure(address, probe, [1.0] * n, config, config.throughput_duration, depth)
        runs = [c["runs"] for c in window["clients"]]
        ds = [c["device_seconds"] for c in window["clients"]]
        results.append({
            "clients": n,
            "depth_per_client": depth,
            "seconds": window["seconds"],
            "computations": sum(runs),
            "computations_per_second": sum(runs) / window["seconds"],
            "device_utilisation": sum(ds) / (window["seconds"] * config.devices),
            "per_client_computations": runs,
            # Jain's index over device-seconds: 1.0 = perfectly even between equal weights.
            "fairness": (sum(ds) ** 2 / (n * sum(d * d for d in ds))) if any(ds) else 0.0,
        })
        log(f"{n:2d} clients: {results[-1]['computations_per_second']:.0f} computations/s")
    return results


class KeyedSchedulerProbe(SchedulerProbe):
    """``SchedulerProbe`` on a cluster with keys: the status comes only to a key the proxy knows, and
    ``GetSchedulerStats`` only to an admin's (``_common``'s probe connects with ``$PWMESH_KEYS`` at most)."""

    def __init__(self, address: str, admin_keys: str, island: int = 0) -> None:
        schedulers = fetch_status(address, keys=admin_keys).cluster.schedulers
        found = [s for s in schedulers if s.island == island]
        if not found:
            raise RuntimeError(f"no scheduler for island {island} in {schedulers}")
        self.address = found[0].address
        self.conn = ClientConnection(self.address, name="bench-stats", open_session=False, keys=admin_keys)


@dataclasses.dataclass(frozen=True)
class KeyedSetup:
    """Part 2's keys directory: the cluster's keys, an admin's, one client key per weight, the policy."""

    cluster: str
    admin: str
    clients: list[str]  # in the order of WEIGHTS
    policy: TenantPolicy


def make_keys(root: Path) -> KeyedSetup:
    """The cluster's keys in ``root/keys``, keys for the admin and for t1..t8, and ``tenants.json`` with
    each tenant's weight and the quotas, written before any daemon starts."""
    cluster = keys.init(root / "keys")
    admin = keys.add_client(cluster, ADMIN, admin=True)
    clients = [keys.add_client(cluster, name) for name in TENANTS]
    policy = TenantPolicy({name: dataclasses.replace(QUOTAS, weight=w) for name, w in zip(TENANTS, WEIGHTS, strict=True)})
    tenants.save(cluster / tenants.FILE_NAME, policy)
    return KeyedSetup(str(cluster), str(admin), [str(c) for c in clients], policy)


def check_policy(address: str, setup: KeyedSetup) -> None:
    """Fail at once, not after the window, unless the proxy gives new sessions the policy's weight (it reads
    ``tenants.json`` before it serves): a probe session with the heaviest tenant's key, asking for nothing,
    as the admin's status shows it. The weights the scheduler held are checked again after the window."""
    name, client = TENANTS[-1], setup.clients[-1]
    want = setup.policy.of(name).weight
    with pw.Client(address, name="policy-probe", keys=client) as probe:
        got = [s.weight for s in fetch_status(address, keys=setup.admin).sessions if s.session_id == probe.session_id]
    if got != [want]:
        raise RuntimeError(f"the proxy gave a new session of {name} weight {got}, not the policy's {want}")


def quotas_part(config: Config, root: Path) -> dict[str, Any]:
    """Part 2: the shares on a cluster with keys, weights and quotas from the tenants policy."""
    setup = make_keys(root)
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=config.hosts, devices_per_host=config.devices_per_host,
                               policy="fair", keys=setup.cluster)
    with pw.LocalCluster(spec) as cluster:
        check_policy(cluster.address, setup)
        with KeyedSchedulerProbe(cluster.address, setup.admin) as probe:
            shares = shares_part(cluster.address, probe, config, setup.clients)
    return {**shares, "policy": setup.policy.as_json()}


def compare_shares(plain: dict[str, Any] | None, quotas: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Per weight: the target share, and each run's measured share and share / target side by side."""
    rows = []
    for i, w in enumerate(WEIGHTS):
        row: dict[str, Any] = {"weight": w, "target_share": w / sum(WEIGHTS)}
        for key, part in (("no_keys", plain), ("quotas", quotas)):
            if part is not None:
                c = part["clients"][i]
                row[f"share_{key}"] = c["share"]
                row[f"ratio_{key}"] = c["share"] / c["target_share"]
        rows.append(row)
    return rows


# ----------------------------------------------------------------- part 4: authorisation per message


def run_loop(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """``main`` on uvloop where installed, as the daemons run."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())


def best_us(body: Callable[[int], float], calls: int, repeats: int) -> dict[str, float]:
    """µs per call of ``body(calls)`` (which returns its seconds): the best repeat, and the median."""
    seconds = [body(calls) for _ in range(repeats)]
    return {"us": 1e6 * min(seconds) / calls, "median_us": 1e6 * statistics.median(seconds) / calls}


def time_checks(ctx: Context, access: Access, frame: Any, op: str, calls: int) -> float:
    """What ``Server._received`` does for access control, ``calls`` times (the same attribute lookups)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        access.allows(ctx.identify(frame), op)
    return time.perf_counter() - t0


def time_identify(ctx: Context, frame: Any, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        ctx.identify(frame)
    return time.perf_counter() - t0


def time_decode(payload: list[Any], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        decode(payload)
    return time.perf_counter() - t0


def time_loop(calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        pass
    return time.perf_counter() - t0


async def auth_case(server_keys: Keys | None, client_keys: Keys | None, config: Config) -> dict[str, Any]:
    """One side of part 4: a bound socket of a daemon's ``Context`` (CURVE with ``server_keys``) receives a
    ``Ping`` and a ``RunProgram`` from a client's; the checks are timed on the frames it really received,
    then ``Ping`` round trips go through a ``Server`` and a ``Connection`` over the same kind of sockets."""
    server_ctx, client_ctx = Context(keys=server_keys), Context(keys=client_keys)
    tasks = TaskGroup()
    access = Access.of(client=[RunProgram])  # as the proxy's: a tenant may send RunProgram
    # What a client sends for each run of a registered one-node program (this benchmark's runs).
    run = RunProgram(program_id="p0123456789abcdef", inputs=[ProgramInput(buffer=3)], outputs=[7])
    try:
        router = server_ctx.router("tcp://127.0.0.1:0")
        dealer = client_ctx.dealer(router.address)
        received: dict[str, list[Any]] = {}
        for message in (Ping(), run):
            dealer.send_nowait(encode(message, msg_id=next_id(), sender="bench-client"))
            _, received[message.op] = await asyncio.wait_for(router.recv(), timeout=30.0)
        payload = received[run.op]
        identity = server_ctx.identify(payload[0])
        if identity is None or not access.allows(identity, run.op):
            raise RuntimeError(f"the received RunProgram was not let through: identity {identity}")
        n, r = config.auth_calls, config.auth_repeats
        out: dict[str, Any] = {
            "identity": f"{identity.name} ({identity.role})",
            "checks": best_us(lambda k: time_checks(server_ctx, access, payload[0], run.op, k), n, r),
            "identify": best_us(lambda k: time_identify(server_ctx, payload[0], k), n, r),
            "loop": best_us(time_loop, n, r),  # the timing loop alone, included in each figure above
            "decode_run_program": best_us(lambda k: time_decode(payload, k), n // 4 or 1, r),
            "decode_ping": best_us(lambda k: time_decode(received[Ping.op], k), n // 4 or 1, r),
        }
        server = Server(server_ctx, "tcp://127.0.0.1:0", {Ping: lambda peer, env: Ok()}, tasks=tasks,
                        name="bench-auth", access=access)
        server.start()
        conn = Connection(client_ctx, server.address, tasks=tasks, name="bench-client")

        async def round_trips(k: int) -> float:
            t0 = time.perf_counter()
            for _ in range(k):
                await conn.request(Ping(), timeout_seconds=30.0)
            return time.perf_counter() - t0

        await round_trips(max(1, config.round_trips // 10))  # the handshake, and a warm-up
        seconds = [await round_trips(config.round_trips) for _ in range(r)]
        out["round_trip"] = {"us": 1e6 * min(seconds) / config.round_trips,
                             "median_us": 1e6 * statistics.median(seconds) / config.round_trips}
        return out
    finally:
        await tasks.stop()
        client_ctx.close()
        server_ctx.close()


def auth_part(config: Config, root: Path) -> dict[str, Any]:
    """Part 4: the access checks per message, with keys and without, and what they are a fraction of."""
    cluster = keys.init(root / "auth-keys")
    client = keys.add_client(cluster, "t1")
    cluster_keys = Keys.load(cluster)
    keyed = run_loop(lambda: auth_case(cluster_keys, Keys.load(client), config))
    keyless = run_loop(lambda: auth_case(None, None, config))
    # ``identify`` re-reads ``authorized/`` at most once a second, inside the call of the message that finds
    # it due: a cost per second, not per message, and one the best repeat leaves out. What one re-read costs:
    assert cluster_keys.authorized is not None
    reads = [time_reload(cluster_keys.authorized) for _ in range(max(3, config.auth_repeats))]
    result: dict[str, Any] = {"keyed": keyed, "keyless": keyless,
                              "reload_authorized_us": 1e6 * min(reads),
                              "authorized_keys": len(list(cluster_keys.authorized.rglob("*.key")))}
    for name, case in (("keyed", keyed), ("keyless", keyless)):
        checks = case["checks"]["us"]
        result[f"{name}_fraction_of_decode"] = checks / case["decode_run_program"]["us"]
        result[f"{name}_fraction_of_round_trip"] = checks / case["round_trip"]["us"]
    return result


def time_reload(authorized: Path) -> float:
    t0 = time.perf_counter()
    AuthorizedKeys(authorized)  # reads every key file, as ``identify``'s once-a-second re-read does
    return time.perf_counter() - t0


def plot(path: Path, compared: list[dict[str, Any]], throughput: list[dict[str, Any]]) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2 if throughput else 1, figsize=(11 if throughput else 6, 4.2), squeeze=False)
    ax1 = axes[0][0]
    xs = np.arange(len(compared))
    bars = [("target (weight share)", [100 * r["target_share"] for r in compared], "#bbbbbb")]
    for key, label, color in (("no_keys", "no keys, client weights", "#1f77b4"),
                              ("quotas", "keys + tenants policy, quotas", "#ff7f0e")):
        if f"share_{key}" in compared[0]:
            bars.append((label, [100 * r[f"share_{key}"] for r in compared], color))
    width = 0.8 / len(bars)
    for i, (label, heights, color) in enumerate(bars):
        ax1.bar(xs + (i - (len(bars) - 1) / 2) * width, heights, width, label=label, color=color)
    ax1.set_xticks(xs, [f"w={r['weight']:g}" for r in compared])
    ax1.set_ylabel("share of island device time (%)")
    ax1.set_title("4 clients, weights 1:2:4:8, fair policy")
    ax1.legend()
    if throughput:
        ax2 = axes[0][1]
        ns = [r["clients"] for r in throughput]
        ax2.plot(ns, [r["computations_per_second"] for r in throughput], "o-")
        ax2.set_xticks(ns)
        ax2.set_xlabel("equal-weight clients")
        ax2.set_ylabel("computations / s (all clients)")
        ax2.set_ylim(bottom=0)
        ax2.set_title("aggregate throughput")
    return save_figure(fig, path)


def print_shares(title: str, shares: dict[str, Any], config: Config) -> None:
    print()
    print(title)
    print(table(["client", "weight", "sched. weight", "target %", "measured %", "error (pp)", "rel. error %",
                 "computations", "backlogged %"],
                [[c["name"], f"{c['weight']:g}", f"{c['scheduler_weight']:g}", f"{100 * c['target_share']:.1f}",
                  f"{100 * c['share']:.1f}", f"{100 * c['error']:+.1f}", f"{100 * c['relative_error']:+.1f}",
                  c["runs"], f"{100 * c['backlogged']:.0f}"]
                 for c in shares["clients"]]))
    verdict = "within" if shares["within_target"] else "NOT within"
    print(f"max error {shares['max_error_points']:.1f} percentage points, {100 * shares['max_relative_error']:.1f}% "
          f"relative ({verdict} the +/-{100 * config.target_error:.0f}% relative target); "
          f"{shares['runs_per_second']:.0f} computations/s, island device utilisation "
          f"{100 * shares['device_utilisation']:.0f}%")


def print_comparison(compared: list[dict[str, Any]], plain: dict[str, Any] | None,
                     quotas: dict[str, Any] | None) -> None:
    headers = ["weight", "target %"]
    parts = [(key, label, part) for key, label, part in (("no_keys", "no keys", plain), ("quotas", "keys+quotas", quotas))
             if part is not None]
    for _, label, _ in parts:
        headers += [f"{label} %", f"{label} share/target"]
    rows = []
    for r in compared:
        row: list[Any] = [f"{r['weight']:g}", f"{100 * r['target_share']:.1f}"]
        for key, _, _ in parts:
            row += [f"{100 * r[f'share_{key}']:.1f}", f"{r[f'ratio_{key}']:.3f}"]
        rows.append(row)
    rows.append(["all", "100.0", *[x for _, _, part in parts
                                   for x in (f"{part['runs_per_second']:.0f}/s", f"util. {100 * part['device_utilisation']:.0f}%")]])
    print()
    print("shares side by side (last row: computations/s and device utilisation in the window)")
    print(table(headers, rows))


def print_auth(auth: dict[str, Any], config: Config) -> None:
    keyed, keyless = auth["keyed"], auth["keyless"]
    print()
    print(f"authorisation per message (Context.identify + Access.allows, best of {config.auth_repeats} x "
          f"{config.auth_calls:,} calls, in this process)")
    print(table(["", "identify + allows µs", "identify µs", "decode RunProgram µs", "decode Ping µs",
                 "Ping round trip µs", "checks / decode", "checks / round trip"],
                [[f"{label} ({case['identity']})", f"{case['checks']['us']:.2f}", f"{case['identify']['us']:.2f}",
                  f"{case['decode_run_program']['us']:.2f}", f"{case['decode_ping']['us']:.2f}",
                  f"{case['round_trip']['us']:.0f}", f"{100 * auth[f'{name}_fraction_of_decode']:.1f}%",
                  f"{100 * auth[f'{name}_fraction_of_round_trip']:.2f}%"]
                 for name, label, case in (("keyed", "keys", keyed), ("keyless", "no keys", keyless))]))
    print(f"the timing loop alone: {keyed['loop']['us']:.3f} µs a call (included above); re-reading authorized/ "
          f"({auth['authorized_keys']} keys), at most once a second: {auth['reload_authorized_us']:.0f} µs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=None, help="measurement window of the shares parts (s)")
    parser.add_argument("--throughput-duration", type=float, default=None, help="window per client count (s)")
    parser.add_argument("--warmup", type=float, default=None, help="seconds of load before each window")
    parser.add_argument("--clients", default=None, help="client counts for throughput, e.g. 1,4,8,16")
    parser.add_argument("--hosts", type=int, default=None, help="hosts in the island")
    parser.add_argument("--devices-per-host", type=int, default=None)
    parser.add_argument("--size", type=int, default=None, help="matrix size per device")
    parser.add_argument("--depth", type=int, default=None, help="runs each client keeps in flight")
    parser.add_argument("--auth-calls", type=int, default=None, help="access checks timed per repeat")
    parser.add_argument("--quotas", action="store_true",
                        help="only the shares with keys and a tenants policy with quotas, and the checks' cost")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--smoke", action="store_true", help="tiny run (seconds) to check that everything works")
    args = parser.parse_args(argv)

    config = Config()
    if args.smoke:
        # Smaller island and windows: checks every code path in a few seconds, measures nothing.
        config = Config(hosts=1, devices_per_host=2, size=128, depth=16, warmup=0.25, duration=1.0,
                        throughput_duration=0.5, client_counts=(1, 2), auth_calls=2_000, auth_repeats=2,
                        round_trips=50)
    for field, value in (("duration", args.duration), ("throughput_duration", args.throughput_duration),
                         ("warmup", args.warmup), ("hosts", args.hosts), ("devices_per_host", args.devices_per_host),
                         ("size", args.size), ("depth", args.depth), ("auth_calls", args.auth_calls)):
        if value is not None:
            setattr(config, field, value)
    if args.clients:
        config.client_counts = tuple(int(n) for n in args.clients.split(","))

    started = time.monotonic()
    load_at_start = load_average()
    log(f"multitenancy: 1 island x {config.hosts} hosts x {config.devices_per_host} devices, fair policy, "
        f"{config.size}x{config.size} matmul per device")
    shares: dict[str, Any] | None = None
    throughput: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pwmesh-bench-keys-") as tmp:
        # First, while no daemon runs: the in-process timings want a quiet machine.
        log(f"authorisation per message: {config.auth_repeats} x {config.auth_calls:,} checks, "
            f"{config.auth_repeats} x {config.round_trips:,} round trips, with keys and without")
        auth = auth_part(config, Path(tmp))
        if not args.quotas:
            spec = pw.LocalClusterSpec(islands=1, hosts_per_island=config.hosts,
                                       devices_per_host=config.devices_per_host, policy="fair")
            with pw.LocalCluster(spec) as cluster, SchedulerProbe(cluster.address) as probe:
                log(f"shares, no keys: weights {':'.join(f'{w:g}' for w in WEIGHTS)} asked by the clients, "
                    f"{config.warmup:g} s warm-up, {config.duration:g} s window")
                shares = shares_part(cluster.address, probe, config)
                log("throughput:")
                throughput = throughput_part(cluster.address, probe, config)
        log(f"shares with keys: weights {':'.join(f'{w:g}' for w in WEIGHTS)} and quotas from the tenants policy")
        quotas = quotas_part(config, Path(tmp))
    compared = compare_shares(shares, quotas)

    if shares is not None:
        print_shares("no keys, weights asked by the clients:", shares, config)
    print_shares("keys, weights and quotas from the tenants policy:", quotas, config)
    print_comparison(compared, shares, quotas)
    if throughput:
        print()
        print(table(["clients", "computations/s", "device util. %", "fairness (Jain)"],
                    [[r["clients"], f"{r['computations_per_second']:.0f}", f"{100 * r['device_utilisation']:.0f}",
                      f"{r['fairness']:.3f}"] for r in throughput]))
    print_auth(auth, config)

    result = {
        "benchmark": "multitenancy",
        "smoke": args.smoke,
        "quotas_only": args.quotas,
        "config": {**dataclasses.asdict(config), "client_counts": list(config.client_counts),
                   "cluster": {"islands": 1, "hosts_per_island": config.hosts,
                               "devices_per_host": config.devices_per_host, "policy": "fair"},
                   "quotas": QUOTAS.as_json()},
        "machine": machine(load_at_start),
        "shares": shares,  # no keys: the weights the clients ask for
        "shares_quotas": quotas,  # keys: weights and quotas from the tenants policy
        "shares_compared": compared,
        "throughput": throughput,
        "auth_cost": auth,
        "wall_seconds": time.monotonic() - started,
    }
    save_results(args.out, "multitenancy", result, lambda path: plot(path, compared, throughput))
    return 0


if __name__ == "__main__":
    sys.exit(main())
