"""The controller at scale (issue 20, item 3, parts a-c): the real pure cores, driven in one process.

Pathways' claim is that one controller keeps up with thousands of accelerators because its
work grows with the number of sharded computations, not of shards. No sockets, no daemons,
no JAX: each part drives the same pure object the daemon wraps, with a synthetic cluster.

(a) **The proxy per program** as a slice grows from 2 to 8,192 devices (executors of 8
    devices; one island; the slice spans ``ceil(N / 8)`` executors). A 3-node chain
    ``w = c(b(a(x)))`` on the slice, ``x`` an existing buffer there (a training step's
    parameters), ``w`` returned. The harness drives the proxy's own core
    (``proxy/state.py::ProxyState``, what the daemon runs short of its sockets): the
    ``RunProgram``, every message it sends encoded with the wire codec; then the run's
    completion as the island's scheduler tells it (one ``IslandDone`` per run per island,
    made by the scheduler's own completions core from each executor's ``RunPartDone``: the
    chain's inner nodes are quiet) and what the proxy sends because of it (the temporaries'
    frees, one ``FreeShards`` per island).
    *warm*: the same program again (a cache hit); *cold*: an empty lowering cache (first
    run in a session; functions already registered). CPU is ``time.process_time``, median
    of the repeats. Two kinds of node: ``pmap`` (a function per device, as ``pw.pmap``)
    and ``spmd`` (one program over the slice, as ``pw.jit``; across executors a gang: its
    devices go to each executor once, in the first run's ``RegisterGang``, and every
    computation names it by id, so an executor's part is as many bytes at 8,192 devices
    as at 16). The island scheduler's fan-out of the same run (``IslandOrder.submit``: one
    ``Enqueue`` per executor) is shown beside it. Then the same chain, both kinds, run on
    the simulator over the largest slice (``--sim-chain-hosts``: 1,024 hosts x 8, 8,192
    devices; see ``bench/_scale_sim.py``).
(b) **Island-scheduler decisions per second** with 1 to 64 clients: ``IslandOrder`` (policy
    ``fair``, window 2, weights 1/2/4/8 in turn among clients sharing executors), each client
    keeping 4 runs queued: the oldest part in flight completes; when its run is done, its client
    submits another. A decision is one run released and sequenced (``Send`` actions of an ``Enqueue``:
    one per executor of the run). CPU is ``time.process_time`` inside ``submit``/``part_done`` only. Two run shapes: ``small``
    (1 node on 8 devices of one executor) and ``gang`` (4 nodes on 16 devices over two
    executors); 16 executors, client ``c`` on executor ``c`` (small) or ``2c, 2c+1`` (gang),
    mod 16, so clients share executors from 17 (small) or 9 (gang) clients on.
(c) **RM slice placement** at 8,192 devices (1,024 executors x 8): ``ResourceManagerState``
    handling ``AllocateSlice`` of 1 to 8,192 devices, on 1 island of 8,192 or 4 of 2,048,
    idle or loaded (512 slices of 8 devices held: half the devices carry one); each slice
    released after it is timed, so every repeat sees the same state. CPU time, median.

(d) **Figure 5 at 16 to 1,024 simulated hosts** and (e) **a pipeline over 4 islands x 256
    hosts**: on the simulator (``pwmesh.sim``: the same cores, simulated executors, virtual
    time; each controller charged the real CPU its core took), with the executors' costs
    ``bench/sim_check.py`` measured on this machine. See ``bench/_scale_sim.py``.

    python bench/scale.py            # ~10 minutes on a 2-core machine
    python bench/scale.py --smoke    # seconds
    python bench/scale.py --scheduler-only    # (b) alone, ~1 minute; writes scale_scheduler.json
    python bench/scale.py --figure5-only --hosts 16,64,256,1024    # (d) alone, ~40 s; scale_figure5.json

Writes ``scale.json``, ``scale.md``, ``scale.png`` (a-c) and ``scale_sim.png`` (d, e) into
``--out`` (default: bench/results).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pwmesh.core import contract
from pwmesh.ir.cache import LoweringCache
from pwmesh.ir.keys import function_id
from pwmesh.proxy.state import Ask, Inbound, ProxyState, Reply, Send, SliceGranted
from pwmesh.rm.state import ResourceManagerState
from pwmesh.scheduler.completions import IslandCompletions
from pwmesh.scheduler.order import IslandOrder
from pwmesh.scheduler.state import SchedulerState
from pwmesh.scheduler.tree import fanout_width
from pwmesh.wire import DEFAULT_LIMITS, Message, encode
from pwmesh.wire.messages import (
    AllocateSlice,
    Computation,
    CreateSlice,
    DeviceInfo,
    Enqueue,
    ExecutorInfo,
    FanOut,
    InstallTemplate,
    IslandDone,
    NodeSpec,
    OpenSession,
    PartsDone,
    ProgramInput,
    ProgramSpec,
    PutBuffer,
    RegisterExecutor,
    RegisterFunction,
    RegisterGang,
    RegisterProgram,
    RegisterProgramFunction,
    RegisterScheduler,
    ReleaseBuffers,
    ReleaseSlices,
    RunPartDone,
    RunProgram,
    RunTemplate,
    SchedulerInfo,
    ScheduleRun,
    ShardRun,
    SliceAllocated,
    SliceCreated,
    SliceInfo,
    ValueSpec,
)
from pwmesh.wire.parts import run_parts

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _scale_sim  # noqa: E402
from _common import (  # noqa: E402
    DEFAULT_OUT,
    load_average,
    machine,
    pyplot,
    save_figure,
    save_results,
    table,
    write_json,
)

DEVICES_PER_EXECUTOR = 8
PROXY_GOAL = "flat: the same messages, bytes and CPU per program at 8,192 devices as at 2"
DECISIONS_GOAL_PER_SECOND = 50_000
PLACEMENT_GOAL_MS = 10.0
EXPORTED_BYTES = 4096  # a stand-in for a function's jax.export bytes (only in the one-time RegisterFunction)


@dataclasses.dataclass
class Config:
    proxy_devices: tuple[int, ...] = (2, 8, 32, 128, 512, 1024, 2048, 4096, 8192)
    proxy_warm_repeats: int = 21
    proxy_cold_repeats: int = 5
    sim_chain_hosts: int = 1024  # (a) on the simulator: the chain over every device of this many hosts
    client_counts: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    scheduler_decisions: int = 40_000  # runs released per (shape, clients) point
    scheduler_rounds: int = 3  # the median round is reported
    rm_executors: int = 1024
    rm_islands: tuple[int, ...] = (1, 4)
    rm_slice_sizes: tuple[int, ...] = (1, 8, 64, 1024, 2048, 8192)
    rm_background_slices: int = 512  # "loaded": this many slices of 8 devices held
    rm_repeats: int = 31
    sim_hosts: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)  # (d)
    sim_k: int = 16  # (d): computations in the chain
    sim_steps: int = 4  # (d): the first is a warm-up
    sim_ahead: int = 2  # (d): Chained once more with this many steps in flight (1: not)
    pipeline_steps: int = 5  # (e): the first is a warm-up
    pipeline_islands: int = 4  # (e)
    pipeline_hosts_per_island: int = 256
    pipeline_microbatches: int = 8
    pipeline_stage_seconds: float = 2e-3  # one stage's device time per microbatch


SMOKE = Config(proxy_devices=(2, 8, 64), proxy_warm_repeats=3, proxy_cold_repeats=2, sim_chain_hosts=8,
               client_counts=(1, 16),
               scheduler_decisions=1000, scheduler_rounds=1, rm_executors=64, rm_slice_sizes=(1, 8, 64),
               rm_background_slices=16, rm_repeats=3, sim_hosts=(16, 32), sim_k=4, pipeline_hosts_per_island=4,
               pipeline_microbatches=4)


def median_cpu(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median CPU seconds of ``repeats`` calls, and the last call's result."""
    samples, result = [], None
    for _ in range(repeats):
        start = time.process_time()
        result = fn()
        samples.append(time.process_time() - start)
    return statistics.median(samples), result


# ------------------------------------------------------------------ a synthetic cluster


def rm_ask(rm: ResourceManagerState, message: Message) -> Message | None:
    """The RM core's answer to ``message`` (raised if it failed); its notices go nowhere: nobody watches here."""
    (reply,) = [a for a in rm.handle(contract.Received(message), 0.0) if isinstance(a, contract.Reply)]
    if reply.error is not None:
        raise reply.error
    return reply.message


def resource_manager(executors: int, islands: int = 1) -> ResourceManagerState:
    """An RM that knows ``executors`` hosts of 8 devices, dealt round-robin over ``islands`` islands,
    each island in one JAX group (so an SPMD node may span its executors)."""
    rm = ResourceManagerState()
    for isl in range(islands):
        rm_ask(rm, RegisterScheduler(info=SchedulerInfo(island=isl, address=f"tcp://sched-{isl}:6100",
                                                        name=f"sched-{isl}")))
    for e in range(executors):
        isl = e % islands
        ip = f"10.{e // 256}.{e % 256}.1"
        rm_ask(rm, RegisterExecutor(info=ExecutorInfo(
            executor_id=f"ex{e:05d}", island=isl, host=f"host{e:05d}", control=f"tcp://{ip}:7000",
            data=f"tcp://{ip}:7001", devices=[DeviceInfo(index=i) for i in range(DEVICES_PER_EXECUTOR)],
            group=f"island-{isl}")))
    return rm


def allocate(rm: ResourceManagerState, owner: str, devices: int, island: int | None = None) -> SliceInfo:
    reply = rm_ask(rm, AllocateSlice(owner=owner, devices=devices, island=island))
    assert isinstance(reply, SliceAllocated)
    return reply.slice


# ------------------------------------------------------------------ (a) the proxy per program


def encoded_bytes(message: Message) -> int:
    return sum(len(frame) for frame in encode(message, msg_id=1))


CLIENT = b"bench-client"


class ProxyHarness:
    """One session of the proxy's pure core (``ProxyState``) on one slice, running a 3-node chain:
    exactly what the daemon runs, minus its sockets (the messages are encoded, as it would)."""

    def __init__(self, devices: int, spmd: bool) -> None:
        self.rm = resource_manager(max(1, -(-devices // DEVICES_PER_EXECUTOR)))
        self.proxy = ProxyState(rm="tcp://rm:5000", address="tcp://proxy:6000")
        self.ask(OpenSession(name="bench-scale"))
        created = self.ask(CreateSlice(devices=devices))
        assert isinstance(created, SliceCreated)
        self.slice = created.slice
        fns = []
        for k in "abc":
            exported = k.encode() * EXPORTED_BYTES  # a stand-in for a function's jax.export bytes
            fn_id = function_id(exported, spmd)
            self.ask(RegisterProgramFunction(fn_id=fn_id, exported=exported, slice_id=self.slice.slice_id, spmd=spmd))
            fns.append(fn_id)
        values = [ValueSpec(shape=[4 * devices, 16], dtype="float32", shards=devices) for _ in range(4)]
        program = ProgramSpec(values=values, inputs=[0], outputs=[3], nodes=[
            NodeSpec(fn_id=fns[k], slice_id=self.slice.slice_id, inputs=[k], outputs=[k + 1]) for k in range(3)])
        self.handle(Inbound(CLIENT, RegisterProgram(program_id="chain3", program=program)))
        # The parameters, already on the slice.
        self.ask(PutBuffer(buffer=0, slice_id=self.slice.slice_id, array=np.zeros((4 * devices, 16), np.float32)))
        self.session = self.proxy.sessions[CLIENT]
        self.next_output = 1
        self.order = IslandOrder(island=0, scheduler="tcp://sched-0:6100")
        self.install: InstallTemplate | None = None  # the latest template installed (once per cache)
        self.island_reports = 0  # executors' RunPartDone to the island's scheduler, ever

    def handle(self, event: Any) -> list[Any]:
        return self.proxy.handle(event, 0.0)

    def ask(self, message: Message) -> Message | None:
        actions = self.handle(Inbound(CLIENT, message))
        for ask in [a for a in actions if isinstance(a, Ask)]:  # the daemon's part: the RM answers
            granted = rm_ask(self.rm, ask.message)
            assert isinstance(granted, SliceAllocated)
            actions = self.handle(SliceGranted(ask.peer, granted.slice))
        replies = [a for a in actions if isinstance(a, Reply)]
        if replies and replies[0].error is not None:
            raise replies[0].error
        return replies[0].message if replies else None

    def dispatch(self) -> tuple[list[Message], int]:
        """One run handed to the core and its messages encoded: (what it sends, their bytes)."""
        msg = RunProgram(inputs=[ProgramInput(buffer=0)], outputs=[self.next_output], program_id="chain3")
        self.next_output += 1
        out = [a.message for a in self.handle(Inbound(CLIENT, msg)) if isinstance(a, Send)]
        self.install = next((m for m in out if isinstance(m, InstallTemplate)), self.install)  # (a new cache's)
        return out, sum(encoded_bytes(m) for m in out)

    def island_done(self, run_id: str) -> list[IslandDone]:
        """What the island's scheduler tells the proxy of the run, as the real cluster does (not timed): its
        completions core (``scheduler/completions.py``) counts each executor's ``RunPartDone`` (the chain's
        inner nodes are quiet) and makes one ``IslandDone`` per run per island."""
        run = self.proxy.runs[run_id][1]
        (scheduler,) = run.schedulers  # one island
        parts: dict[str, list[int]] = {}
        for node, executors in sorted(run.pending.items()):
            for executor_id in sorted(executors):
                parts.setdefault(executor_id, []).append(node)
        island = IslandCompletions(scheduler)
        assert island.start(run_id, self.proxy.address, parts) == []
        told = []
        for executor_id in parts:
            self.island_reports += 1  # RunPartDone(run_id, executor_id): to the scheduler, not to the proxy
            told += [done for _, done in island.part_done(run_id, executor_id)]
        return told

    def complete(self, run_id: str, told: list[IslandDone] | None = None) -> tuple[list[Message], list[Message]]:
        """The island's report of the run (``told``, else made now) handed to the proxy's core; (what the
        island's scheduler sent the proxy, what the core sends because of it)."""
        done = self.island_done(run_id) if told is None else told
        out = []
        for d in done:
            out += [a.message for a in self.handle(Inbound(b"scheduler", d)) if isinstance(a, Send)]
        return list(done), out

    def release(self) -> None:
        """The client drops the run's output (not timed): every repeat starts from the same session."""
        self.handle(Inbound(CLIENT, ReleaseBuffers(buffers=[self.next_output - 1])))


def proxy_point(devices: int, spmd: bool, config: Config) -> dict[str, Any]:
    harness = ProxyHarness(devices, spmd)
    first, _ = harness.dispatch()  # registers the functions (once per proxy) and fills the cache
    setup = [m for m in first if isinstance(m, RegisterFunction)]
    gangs = [m for m in first if isinstance(m, RegisterGang)]
    (install,) = [m for m in first if isinstance(m, InstallTemplate)]  # once per template and island
    harness.complete(run_of(first).run_id)
    harness.release()

    def cold() -> tuple[list[Message], int]:
        harness.session.lowerings = LoweringCache()  # empty, as in a new session
        return harness.dispatch()

    def repeat(fn: Callable[[], tuple[list[Message], int]], repeats: int) -> tuple[float, float, list[Message]]:
        """Median CPU of dispatching (and encoding), and of taking the completions; the last run's messages."""
        dispatch_s, done_s = [], []
        for _ in range(repeats):
            start = time.process_time()
            sent, _ = fn()
            dispatch_s.append(time.process_time() - start)
            run_id = run_of(sent).run_id
            told = harness.island_done(run_id)  # (the scheduler's work: not the proxy's CPU)
            start = time.process_time()
            harness.complete(run_id, told)
            done_s.append(time.process_time() - start)
            harness.release()
        return statistics.median(dispatch_s), statistics.median(done_s), sent

    cold_s, _, _ = repeat(cold, config.proxy_cold_repeats)
    warm_s, done_s, messages = repeat(harness.dispatch, config.proxy_warm_repeats)
    assert harness.session.lowerings.hits >= config.proxy_warm_repeats, "the warm runs must hit the cache"
    schedule = run_of(messages)
    nbytes = sum(encoded_bytes(m) for m in messages)
    # The run's completion: what the island's scheduler sends the proxy, and what it sends because of it;
    # the executors' reports go to the scheduler (one RunPartDone each).
    reports = harness.island_reports
    done, frees = harness.complete(run_of(harness.dispatch()[0]).run_id)  # (a last run, untimed: counted)
    reports = harness.island_reports - reports
    assert not harness.proxy.runs, "every run finished"
    # The island's side of the same run (the scheduler's core, ``SchedulerState``): one Enqueue per executor
    # sent directly, or (more executors than the fan-out width) one FanOut per subtree head (``tree.py``).
    assert harness.install is not None
    install = harness.install  # the warm runs' template
    controls = {part.control: part.executor_id for part in install.parts}
    island: dict[str, Any] = {}
    for how, width in (("direct", 1 << 30), ("tree", fanout_width())):
        core = SchedulerState(IslandOrder(island=0, scheduler="tcp://sched-0:6100"), fanout=width, above=width)
        core.handle(contract.Received(install), 0.0)
        _submit_and_finish(core, schedule, controls)  # the first run carries each executor's part: later ones names
        sched_s, (actions, reports_in) = median_cpu(lambda core=core: _submit_and_finish(core, schedule, controls),
                                                    config.proxy_warm_repeats)
        island[how] = {"sends": len(actions), "bytes": sum(encoded_bytes(a.message) for a in actions),
                       "reports_in": reports_in, "cpu_us": 1e6 * sched_s}
    executors = len({d.executor_id for d in harness.slice.devices})
    return {
        "devices": devices, "executors": executors,
        "messages": len(messages), "message_types": dict(collections.Counter(type(m).__name__ for m in messages)),
        "bytes": nbytes, "bytes_per_executor": nbytes / executors,
        "part_bytes": max(len(p.computations) for p in install.parts),  # an executor's packed computations
        "install_template_bytes": encoded_bytes(install),  # once per template and island
        "warm_cpu_us": 1e6 * warm_s, "cold_cpu_us": 1e6 * cold_s,
        "completion_messages_in": len(done), "completion_bytes_in": sum(encoded_bytes(m) for m in done),
        "island_reports_in": reports,  # the executors' RunPartDone, to the island's scheduler
        "completion_messages_out": len(frees), "completion_cpu_us": 1e6 * done_s,
        "setup_register_function_messages": len(setup),
        "setup_register_function_bytes": sum(encoded_bytes(m) for m in setup),
        "setup_register_gang_messages": len(gangs),
        "setup_register_gang_bytes": sum(encoded_bytes(m) for m in gangs),
        # The island scheduler's sends per run (Enqueue, or FanOut to subtree heads), their bytes, the reports it
        # takes in (RunPartDone, PartsDone) and its core's CPU: through the tree, and directly (the tree off).
        "scheduler_enqueues": island["tree"]["sends"], "scheduler_enqueue_bytes": island["tree"]["bytes"],
        "scheduler_reports_in": island["tree"]["reports_in"], "scheduler_cpu_us": island["tree"]["cpu_us"],
        "scheduler_direct": island["direct"], "scheduler_fanout": fanout_width(),
    }


def run_of(sent: list[Message]) -> ScheduleRun | RunTemplate:
    """The run among what the proxy sent (one island): a run of its installed template, or a whole one."""
    (run,) = [m for m in sent if isinstance(m, ScheduleRun | RunTemplate)]
    return run


def _submit_and_finish(core: SchedulerState, run: ScheduleRun | RunTemplate | None,
                       executors: dict[str, str]) -> tuple[list[Any], int]:
    """``run`` submitted and each of its parts reported done as the executors would (a subtree head: its own
    part's ``RunPartDone`` and its subtree's ``PartsDone``); ``executors``: control address -> executor.
    Returns the scheduler's sends of the run and how many reports it took in."""
    assert run is not None
    sends = [a for a in core.handle(contract.Received(run), 0.0)
             if isinstance(a, contract.Send) and isinstance(a.message, Enqueue | FanOut)]
    reports: list[Message] = []
    for send in sends:
        if isinstance(send.message, FanOut):
            head, *below = send.message.executors
            reports += [RunPartDone(run_id=run.run_id, executor_id=head, device_seconds=0.001),
                        PartsDone(run_id=run.run_id, head=head, ended=below, device_seconds=0.001 * len(below))]
        else:
            reports.append(RunPartDone(run_id=run.run_id, executor_id=executors[send.to], device_seconds=0.001))
    for report in reports:
        core.handle(contract.Received(report), 0.0)
    return sends, len(reports)


def proxy_scaling(config: Config) -> dict[str, Any]:
    """Both node kinds over the device counts."""
    out: dict[str, Any] = {}
    for kind in ("pmap", "spmd"):
        rows: list[dict[str, Any]] = []
        stopped = None
        for n in config.proxy_devices:
            row = proxy_point(n, kind == "spmd", config)
            print(f"  {kind} N={n:>5}: {row['messages']} messages, {row['bytes']:>10,} bytes "
                  f"({row['part_bytes']:,} a part), warm {row['warm_cpu_us']:>9,.0f} us, cold "
                  f"{row['cold_cpu_us']:>10,.0f} us; completions {row['completion_messages_in']:,} in, "
                  f"{row['completion_cpu_us']:,.0f} us; first run: {row['setup_register_gang_messages']:,} "
                  f"RegisterGang ({row['setup_register_gang_bytes']:,} bytes)", flush=True)
            rows.append(row)
            if row["bytes"] > DEFAULT_LIMITS.max_body_bytes // 2:  # the next would not fit one message
                stopped = (f"stopped after {n:,} devices: its ScheduleRun is {row['bytes'] / 2**20:,.1f} MiB, half the "
                           f"codec's {DEFAULT_LIMITS.max_body_bytes / 2**20:.0f} MiB body limit")
                print(f"  {kind}: {stopped}", flush=True)
                break
        lo, hi = rows[0], rows[-1]
        ratio = {key: hi[key] / lo[key] if lo[key] else None for key in (
            "messages", "bytes", "warm_cpu_us", "cold_cpu_us", "completion_messages_in", "completion_cpu_us")}
        out[kind] = {"rows": rows, "stopped": stopped, "ratio_devices": [lo["devices"], hi["devices"]],
                     "ratio": ratio}
    return out


# ------------------------------------------------------------------ (b) island-scheduler decisions


SHAPES = {"small": (1, 1), "gang": (4, 2)}  # (nodes, executors of 8 devices) per run
SHAPE_NAMES = {"small": "small (1 node, 1 executor)", "gang": "gang (4 nodes, 2 executors)"}
SCHEDULER_EXECUTORS = 16
WEIGHTS = (1.0, 2.0, 4.0, 8.0)


def weight_of(client: int) -> float:
    """1, 2, 4, 8 in turn among the clients that share executors (clients 8 apart share some)."""
    return WEIGHTS[(client // 8) % len(WEIGHTS)]


def client_parts(client: int, nodes: int, executors: int) -> list[Any]:
    mine = [f"ex{(executors * client + k) % SCHEDULER_EXECUTORS:02d}" for k in range(executors)]
    comps = [Computation(node=node, fn_id="f" * 32, executor_id=ex, control=f"tcp://{ex}:7000",
                         runs=[ShardRun(device=0, shard=k * DEVICES_PER_EXECUTOR, count=DEVICES_PER_EXECUTOR)],
                         inputs=[f"@{node}"], outputs=[f"@{node + 1}"])
             for node in range(nodes) for k, ex in enumerate(mine)]
    return run_parts(comps)


def decisions_round(clients: int, shape: str, decisions: int, backlog: int = 4) -> dict[str, Any]:
    nodes, executors = SHAPES[shape]
    order = IslandOrder(island=0, policy="fair", window=2, scheduler="tcp://sched-0:6100")
    parts = {c: client_parts(c, nodes, executors) for c in range(clients)}
    counts = collections.Counter[int]()

    def new_run(c: int) -> ScheduleRun:
        # Built outside the clock: building a run is the proxy's work, not the scheduler's.
        counts[c] += 1
        return ScheduleRun(run_id=f"c{c}:{counts[c]}", proxy="tcp://proxy:6000", parts=parts[c], session=f"c{c}",
                           weight=weight_of(c))

    client_of = {f"c{c}": c for c in range(clients)}
    in_flight: collections.deque[tuple[str, str]] = collections.deque()  # (run, executor's control), oldest first
    parts_left: collections.Counter[str] = collections.Counter()
    released = enqueues = 0
    cpu = 0.0

    def took(actions: list[Any]) -> None:
        nonlocal released, enqueues
        # A released run's Enqueues all come from the one call that released it.
        released += len({a.message.run_id for a in actions})
        enqueues += len(actions)
        for a in actions:
            in_flight.append((a.message.run_id, a.to))
            parts_left[a.message.run_id] += 1

    for c in range(clients):
        for _ in range(backlog):
            run = new_run(c)
            start = time.process_time()
            actions = order.submit(run)
            cpu += time.process_time() - start
            took(actions)
    while released < decisions and in_flight:
        run_id, control = in_flight.popleft()
        client = client_of[run_id.split(":", 1)[0]]
        executor_id = control.removeprefix("tcp://").rsplit(":", 1)[0]
        parts_left[run_id] -= 1
        # A run done: its client submits the next, so each keeps its backlog.
        run = new_run(client) if not parts_left[run_id] else None
        start = time.process_time()
        actions = order.part_done(run_id, executor_id, 0.001)
        if run is not None:
            actions += order.submit(run)
        cpu += time.process_time() - start
        if run is not None:
            del parts_left[run_id]
        took(actions)
    runs = {u.session: u.runs for u in order.usage()}
    assert sum(runs.values()) == released, (runs, released)
    return {"decisions": released, "enqueues": enqueues, "computations": released * nodes * executors,
            "cpu_seconds": cpu, "runs_per_client": runs}


def scheduler_rate(config: Config) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for shape in SHAPES:
        rows = []
        for clients in config.client_counts:
            rounds = [decisions_round(clients, shape, config.scheduler_decisions)
                      for _ in range(config.scheduler_rounds)]
            rounds.sort(key=lambda r: r["decisions"] / r["cpu_seconds"])
            rates = [r["decisions"] / r["cpu_seconds"] for r in rounds]
            mid = rounds[len(rounds) // 2]
            per_second = mid["decisions"] / mid["cpu_seconds"]
            served = sum(1 for n in mid["runs_per_client"].values() if n > 0)
            by_weight: dict[float, list[int]] = {}
            for session, n in mid["runs_per_client"].items():
                by_weight.setdefault(weight_of(int(session.removeprefix("c"))), []).append(n)
            row = {"clients": clients, "decisions_per_second": per_second,
                   "enqueues_per_second": mid["enqueues"] / mid["cpu_seconds"],
                   "computations_per_second": mid["computations"] / mid["cpu_seconds"],
                   "us_per_decision": 1e6 / per_second, "decisions": mid["decisions"], "clients_served": served,
                   "mean_runs_by_weight": {w: statistics.mean(ns) for w, ns in sorted(by_weight.items())},
                   "rounds_decisions_per_second": rates,
                   "met": per_second >= DECISIONS_GOAL_PER_SECOND}
            print(f"  {shape:>5} x {clients:>2} clients: {per_second:>9,.0f} decisions/s "
                  f"({row['computations_per_second']:,.0f} computations/s)", flush=True)
            rows.append(row)
        out[shape] = {"nodes": SHAPES[shape][0], "executors": SHAPES[shape][1], "rows": rows}
    return out


def scheduler_only(out: Path, config: Config, smoke: bool) -> int:
    """(b) alone (``--scheduler-only``): its table printed, ``scale_scheduler.json`` written."""
    load_at_start = load_average()
    print("(b) island-scheduler decisions (fair policy, window 2)", flush=True)
    sched = scheduler_rate(config)
    print(f"\n(b) island-scheduler decisions per CPU second (fair, window 2):\n{table(*scheduler_table(sched))}")
    path = out / "scale_scheduler.json"
    write_json(path, {"benchmark": "scale (b)", "smoke": smoke, "config": dataclasses.asdict(config),
                      "load_average": [load_at_start, load_average()], "scheduler": sched,
                      "scheduler_goal_decisions_per_second": DECISIONS_GOAL_PER_SECOND})
    print(f"\nwrote {path}")
    return 0


def figure5_only(out: Path, config: Config, costs: _scale_sim.Costs, smoke: bool) -> int:
    """(d) alone (``--figure5-only``): its table printed, ``scale_figure5.json`` written."""
    load_at_start = load_average()
    print(f"(d) Figure 5 on the simulator, {config.sim_hosts[0]:,} to {config.sim_hosts[-1]:,} hosts; costs from "
          f"{costs.source}", flush=True)
    figure5 = _scale_sim.figure5(config.sim_hosts, DEVICES_PER_EXECUTOR, config.sim_k, config.sim_steps, costs,
                                 config.sim_ahead)
    print(f"\n(d) Figure 5 on the simulator:\n{table(*_scale_sim.figure5_table(figure5))}")
    print("\n".join(_scale_sim.figure5_lines(figure5)))
    path = out / "scale_figure5.json"
    write_json(path, {"benchmark": "scale (d)", "smoke": smoke, "config": dataclasses.asdict(config),
                      "load_average": [load_at_start, load_average()], "sim_costs_source": costs.source,
                      "figure5": figure5})
    print(f"\nwrote {path}")
    return 0


# ------------------------------------------------------------------ (c) RM slice placement


def placement_time(config: Config) -> list[dict[str, Any]]:
    rows = []
    devices = config.rm_executors * DEVICES_PER_EXECUTOR
    for islands in config.rm_islands:
        rm = resource_manager(config.rm_executors, islands)
        per_island = devices // islands
        for load, background in (("idle", 0), ("loaded", config.rm_background_slices)):
            rm_ask(rm, ReleaseSlices(owner="background"))
            for _ in range(background):
                allocate(rm, "background", DEVICES_PER_EXECUTOR)
            held = sum(len(sl.devices) for sl in rm.slices.values())
            for n in config.rm_slice_sizes:
                if n > per_island:
                    continue

                samples = []
                for _ in range(config.rm_repeats):
                    start = time.process_time()
                    sl = allocate(rm, "bench", n)
                    samples.append(time.process_time() - start)
                    rm_ask(rm, ReleaseSlices(owner="bench"))
                    assert len(sl.devices) == n
                ms = 1000 * statistics.median(samples)
                row = {"devices": devices, "islands": islands, "load": load, "held_device_slots": held,
                       "slice_devices": n, "median_ms": ms, "max_ms": 1000 * max(samples),
                       "met": ms < PLACEMENT_GOAL_MS}
                print(f"  {islands} island(s), {load:>6}: slice of {n:>5} in {ms:6.2f} ms (median)", flush=True)
                rows.append(row)
    return rows


# ------------------------------------------------------------------ report


def proxy_table(proxy: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["node", "devices", "executors", "proxy msgs", "proxy bytes", "part bytes", "warm CPU us",
               "cold CPU us", "IslandDone in", "frees out", "completion CPU us", "1st-run RegisterFunction",
               "1st-run RegisterGang (bytes)", "island sends (direct)", "island send bytes", "island reports in (direct)",
               "island CPU us (direct)"]
    rows = []
    for kind, data in proxy.items():
        for r in data["rows"]:
            rows.append([kind, f"{r['devices']:,}", f"{r['executors']:,}", str(r["messages"]), f"{r['bytes']:,}",
                         f"{r['part_bytes']:,}", f"{r['warm_cpu_us']:,.0f}", f"{r['cold_cpu_us']:,.0f}",
                         f"{r['completion_messages_in']:,}", f"{r['completion_messages_out']:,}",
                         f"{r['completion_cpu_us']:,.0f}", f"{r['setup_register_function_messages']:,}",
                         f"{r['setup_register_gang_messages']:,} ({r['setup_register_gang_bytes']:,})",
                         f"{r['scheduler_enqueues']:,} ({r['scheduler_direct']['sends']:,})",
                         f"{r['scheduler_enqueue_bytes']:,}",
                         f"{r['scheduler_reports_in']:,} ({r['scheduler_direct']['reports_in']:,})",
                         f"{r['scheduler_cpu_us']:,.0f} ({r['scheduler_direct']['cpu_us']:,.0f})"])
    return headers, rows


def ratio_lines(proxy: dict[str, Any]) -> list[str]:
    lines = []
    for kind, data in proxy.items():
        lo, hi = data["ratio_devices"]
        r = data["ratio"]
        lines.append(f"{kind}: N={hi:,} over N={lo:,}: messages x{r['messages']:.3g}, bytes x{r['bytes']:,.0f}, "
                     f"warm CPU x{r['warm_cpu_us']:,.0f}, cold CPU x{r['cold_cpu_us']:,.0f}; completions: "
                     f"messages x{r['completion_messages_in']:,.0f}, CPU x{r['completion_cpu_us']:,.0f} "
                     f"(goal: x1){'; ' + data['stopped'] if data['stopped'] else ''}")
    return lines


def scheduler_table(sched: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["run shape", "clients", "decisions/s", "us/decision", "Enqueues/s", "computations/s",
               f">= {DECISIONS_GOAL_PER_SECOND:,}/s"]
    rows = []
    for shape, data in sched.items():
        for r in data["rows"]:
            rows.append([SHAPE_NAMES[shape], str(r["clients"]),
                         f"{r['decisions_per_second']:,.0f}", f"{r['us_per_decision']:.1f}",
                         f"{r['enqueues_per_second']:,.0f}", f"{r['computations_per_second']:,.0f}",
                         "yes" if r["met"] else "no"])
    return headers, rows


def placement_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["devices", "islands", "load", "slice devices", "median ms", "max ms", f"< {PLACEMENT_GOAL_MS:g} ms"]
    return headers, [[f"{r['devices']:,}", str(r["islands"]), f"{r['load']} ({r['held_device_slots']:,} held)",
                      f"{r['slice_devices']:,}", f"{r['median_ms']:.2f}", f"{r['max_ms']:.2f}",
                      "yes" if r["met"] else "no"] for r in rows]


def markdown(headers: list[str], rows: list[list[str]], text_columns: int = 1) -> str:
    align = ["---" if i < text_columns else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def plot(path: Path, result: dict[str, Any]) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    ax = axes[0]
    for i, (kind, data) in enumerate(result["proxy"].items()):
        xs = [r["devices"] for r in data["rows"]]
        ax.plot(xs, [r["bytes"] for r in data["rows"]], "o-", color=f"C{i}", label=f"{kind}: bytes")
        ax.plot(xs, [r["warm_cpu_us"] for r in data["rows"]], "s--", color=f"C{i}", label=f"{kind}: warm CPU us")
        ax.plot(xs, [r["cold_cpu_us"] for r in data["rows"]], "^:", color=f"C{i}", label=f"{kind}: cold CPU us")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices in the slice")
    ax.set_title("(a) proxy per program (goal: flat)", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(which="both", alpha=0.3)
    ax = axes[1]
    for shape, data in result["scheduler"].items():
        ax.plot([r["clients"] for r in data["rows"]], [r["decisions_per_second"] for r in data["rows"]], "o-",
                label=SHAPE_NAMES[shape])
    ax.axhline(DECISIONS_GOAL_PER_SECOND, color="red", linestyle="--", label="goal")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("clients")
    ax.set_ylabel("runs sequenced per CPU second")
    ax.set_title("(b) island-scheduler decisions/s", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(which="both", alpha=0.3)
    ax = axes[2]
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in result["placement"]:
        groups.setdefault((r["islands"], r["load"]), []).append(r)
    for (islands, load), rows in groups.items():
        ax.plot([r["slice_devices"] for r in rows], [r["median_ms"] for r in rows], "o-",
                label=f"{islands} island(s), {load}")
    ax.axhline(PLACEMENT_GOAL_MS, color="red", linestyle="--", label="goal")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("slice devices")
    ax.set_ylabel("ms (CPU, median)")
    ax.set_ylim(bottom=0)
    devices = result["placement"][0]["devices"] if result["placement"] else 0
    ax.set_title(f"(c) RM placement at {devices:,} devices", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(which="both", alpha=0.3)
    fig.suptitle("The controller at scale: the real cores in one process (pure CPU)")
    return save_figure(fig, path)


def plot_sim(path: Path, result: dict[str, Any]) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.6))
    _scale_sim.plot_figure5(axes[0], result["figure5"])
    _scale_sim.plot_pipeline(axes[1], result["pipeline_synchronous"])  # one step alone: its dispatch shows
    fig.suptitle("The controller at scale, simulated: the real cores, executors' costs measured on this machine")
    return save_figure(fig, path)


def pipelines(config: Config, costs: _scale_sim.Costs) -> list[dict[str, Any]]:
    """(e): one step in flight, then two."""
    return [_scale_sim.pipeline(config.pipeline_islands, config.pipeline_hosts_per_island, DEVICES_PER_EXECUTOR,
                                config.pipeline_microbatches, config.pipeline_steps, config.pipeline_stage_seconds,
                                costs, in_flight=in_flight) for in_flight in (1, 2)]


def pipeline_only(config: Config, costs: _scale_sim.Costs, out: Path, smoke: bool) -> int:
    """``--pipeline-only``: (e) alone, its table printed and written (``scale_pipeline.json``, ``.png``)."""
    started, load_at_start = time.monotonic(), load_average()
    print(f"(e) a pipeline over {config.pipeline_islands} islands x {config.pipeline_hosts_per_island:,} hosts "
          f"on the simulator; costs from {costs.source}", flush=True)
    pipes = pipelines(config, costs)
    # The same step with the island schedulers' work free (counted, not charged): how much of what is left
    # over the ideal is theirs (their fan-out of each run to every executor, and of its completions).
    free = _scale_sim.pipeline(config.pipeline_islands, config.pipeline_hosts_per_island, DEVICES_PER_EXECUTOR,
                               config.pipeline_microbatches, config.pipeline_steps, config.pipeline_stage_seconds,
                               costs, in_flight=1, charge_schedulers=False)
    print(table(*_scale_sim.pipeline_table([*pipes, free])))
    result = {"benchmark": "scale_pipeline", "smoke": smoke, "config": dataclasses.asdict(config),
              "machine": {**machine(load_at_start),
                          "backend": "none: pure cores in one process, no JAX, no sockets"},
              "sim_costs": {"source": costs.source}, "pipeline": pipes[-1], "pipeline_synchronous": pipes[0],
              "pipeline_schedulers_free": free,
              "wall_seconds": time.monotonic() - started}
    out.mkdir(parents=True, exist_ok=True)

    def draw(path: Path) -> bool:
        plt = pyplot()
        if plt is None:
            return False
        fig, ax = plt.subplots(1, 1, figsize=(8, 4.6))
        _scale_sim.plot_pipeline(ax, pipes[0])
        return save_figure(fig, path)

    save_results(out, "scale_pipeline", result, draw)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--smoke", action="store_true", help="tiny run (seconds) to check that everything works")
    parser.add_argument("--proxy-devices", default=None, help="comma-separated slice sizes for (a)")
    parser.add_argument("--sim-chain-hosts", type=int, default=None,
                        help="hosts of 8 devices the chain of (a) runs over on the simulator")
    parser.add_argument("--clients", default=None, help="comma-separated client counts for (b)")
    parser.add_argument("--decisions", type=int, default=None, help="runs released per point in (b)")
    parser.add_argument("--scheduler-only", action="store_true",
                        help="run (b) alone and write scale_scheduler.json (scale.json and scale.md are left as they are)")
    parser.add_argument("--hosts", default=None, help="comma-separated simulated host counts for (d)")
    parser.add_argument("--pipeline-only", action="store_true",
                        help="run (e) alone (the pipeline over 4 islands x 256 hosts, one and two steps in flight, "
                             "then one with the island schedulers' CPU not charged; ~3 minutes): writes "
                             "scale_pipeline.json and scale_pipeline.png")
    parser.add_argument("--figure5-only", action="store_true",
                        help="run (d) alone and write scale_figure5.json (scale.json and scale.md are left as they are)")
    parser.add_argument("--costs", type=Path, default=None,
                        help="sim_check.json whose calibration sets the simulated executors' costs "
                             "(default: bench/results/sim_check.json if it exists, else the simulator's defaults)")
    args = parser.parse_args(argv)
    config = dataclasses.replace(SMOKE) if args.smoke else Config()
    try:
        if args.proxy_devices:
            config.proxy_devices = tuple(int(n) for n in args.proxy_devices.split(","))
        if args.clients:
            config.client_counts = tuple(int(n) for n in args.clients.split(","))
        if args.hosts:
            config.sim_hosts = tuple(int(n) for n in args.hosts.split(","))
    except ValueError as exc:
        parser.error(f"expected comma-separated integers: {exc}")
    if args.decisions is not None:
        config.scheduler_decisions = args.decisions
    if args.sim_chain_hosts is not None:
        config.sim_chain_hosts = args.sim_chain_hosts
    if any(n < 1 for n in (*config.proxy_devices, *config.client_counts, *config.sim_hosts,
                           config.scheduler_decisions, config.sim_chain_hosts)):
        parser.error("device, client and host counts and --decisions must be at least 1")
    if args.scheduler_only:
        return scheduler_only(args.out, config, args.smoke)
    try:
        costs = _scale_sim.load_costs(args.costs)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    if args.figure5_only:
        return figure5_only(args.out, config, costs, args.smoke)
    if args.pipeline_only:
        return pipeline_only(config, costs, args.out, args.smoke)
    started = time.monotonic()
    load_at_start = load_average()
    print("(a) the proxy per program: a 3-node chain on a slice of N devices", flush=True)
    proxy = proxy_scaling(config)
    print(f"(a) run on the simulator over {config.sim_chain_hosts:,} hosts x {DEVICES_PER_EXECUTOR}", flush=True)
    chain_sim = _scale_sim.chain_on_slice(config.sim_chain_hosts, DEVICES_PER_EXECUTOR, 3, 3, costs)
    print("(b) island-scheduler decisions (fair policy, window 2)", flush=True)
    sched = scheduler_rate(config)
    print(f"(c) RM slice placement at {config.rm_executors * DEVICES_PER_EXECUTOR:,} devices", flush=True)
    placement = placement_time(config)
    print(f"(d) Figure 5 on the simulator, {config.sim_hosts[0]:,} to {config.sim_hosts[-1]:,} hosts; costs from "
          f"{costs.source}", flush=True)
    figure5 = _scale_sim.figure5(config.sim_hosts, DEVICES_PER_EXECUTOR, config.sim_k, config.sim_steps, costs,
                                 config.sim_ahead)
    print(f"(e) a pipeline over {config.pipeline_islands} islands x {config.pipeline_hosts_per_island:,} hosts "
          "on the simulator", flush=True)
    pipes = pipelines(config, costs)
    result = {
        "benchmark": "scale",
        "smoke": args.smoke,
        "config": dataclasses.asdict(config),
        "machine": {**machine(load_at_start), "backend": "none: pure cores in one process, no JAX, no sockets"},
        "proxy": proxy,
        "proxy_goal": PROXY_GOAL,
        "proxy_chain_simulated": chain_sim,
        "scheduler": sched,
        "scheduler_goal_decisions_per_second": DECISIONS_GOAL_PER_SECOND,
        "placement": placement,
        "placement_goal_ms": PLACEMENT_GOAL_MS,
        "sim_costs": {"source": costs.source, "cost_model": dataclasses.asdict(costs.cost),
                      "link": dataclasses.asdict(costs.link), "daemons": costs.daemons, "op_seconds": costs.op_seconds,
                      "jax_op_seconds": costs.jax_op_seconds},
        "figure5": figure5,
        "pipeline": pipes[-1],  # the next step dispatched while one runs, as a training loop does
        "pipeline_synchronous": pipes[0],  # each step dispatched once the last one ended
        "wall_seconds": time.monotonic() - started,
    }
    sections = [
        ("(a) the proxy per program (3-node chain, x an existing buffer; the proxy's core: dispatch CPU with the "
         "messages encoded, then the run's completion as its island's scheduler tells it, one IslandDone, and the "
         "frees it causes)",
         proxy_table(proxy), 1),
        (f"(a) the same chain run on the simulator over {config.sim_chain_hosts * DEVICES_PER_EXECUTOR:,} devices "
         "(warm steps; the first sends the functions and the gang)", _scale_sim.chain_table(chain_sim), 1),
        ("(b) island-scheduler decisions per CPU second (fair, window 2)", scheduler_table(sched), 1),
        ("(c) RM slice placement (CPU of ResourceManagerState.handle(AllocateSlice))", placement_table(placement), 0),
        (f"(d) Figure 5 on the simulator: a chain of {config.sim_k} tiny computations over every device "
         "(warm steps; per computation: the proxy's messages in and out, its core's and the island scheduler's CPU)",
         _scale_sim.figure5_table(figure5), 0),
        ("(e) a pipeline on the simulator (GPipe forward, one stage per island, warm steps; steps in flight: "
         "dispatched ahead of the one awaited)", _scale_sim.pipeline_table(pipes), 0),
    ]
    for title, (headers, rows), _ in sections:
        print(f"\n{title}:")
        print(table(headers, rows))
        if title.startswith("(a) the proxy"):
            print("\n".join(ratio_lines(proxy)))
        if title.startswith("(d)"):
            print("\n".join(_scale_sim.figure5_lines(figure5)))
    print(f"\n(d, e) the simulated executors' costs: {costs.source}")
    md = []
    for title, (headers, rows), text_columns in sections:
        md += [f"{title}:", markdown(headers, rows, text_columns)]
        if title.startswith("(a) the proxy"):
            md.append("\n".join(f"- {line}" for line in ratio_lines(proxy)))
        if title.startswith("(d)"):
            md.append("\n".join(f"- {line}" for line in _scale_sim.figure5_lines(figure5)))
    md.append(f"(d, e) the simulated executors' costs: {costs.source}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale.md").write_text("\n\n".join(md) + "\n")
    print(f"\nwrote {args.out / 'scale.md'}")
    save_results(args.out, "scale", result, lambda path: plot(path, result))
    if plot_sim(args.out / "scale_sim.png", result):
        print(f"wrote {args.out / 'scale_sim.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
