"""A whole simulated cluster in one process: the real RM, island-scheduler and proxy cores,
simulated executors and clients, one in-memory network, one virtual clock.

    cluster = SimCluster(SimConfig(islands=4, hosts_per_island=256, devices_per_host=8))
    cluster.add_client("c0", script)          # see sim.client and sim.workloads
    report = cluster.run()                    # runs until nothing is left to do
    print(format_report(report))

Hosts register with the RM core directly before the clock starts (bootstrap is not
what is measured); everything after that travels as real messages.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from pwmesh.core.contract import Received
from pwmesh.errors import InvalidArgument
from pwmesh.proxy.state import ProxyState
from pwmesh.rm.state import ResourceManagerState
from pwmesh.scheduler.order import IslandOrder
from pwmesh.scheduler.state import SchedulerState
from pwmesh.sim.client import Script, SimClient
from pwmesh.sim.clock import Clock
from pwmesh.sim.controller import SimResourceManager, SimScheduler
from pwmesh.sim.cost import CostModel
from pwmesh.sim.executor import SimExecutor
from pwmesh.sim.network import LinkSpec, Network
from pwmesh.sim.proxy import SimProxy
from pwmesh.wire.messages import DeviceInfo, ExecutorInfo, RegisterExecutor, RegisterScheduler, SchedulerInfo

RM = "sim://rm"
PROXY = "sim://proxy"


@dataclasses.dataclass(frozen=True)
class SimConfig:
    islands: int = 1
    hosts_per_island: int = 2
    devices_per_host: int = 8
    link: LinkSpec = LinkSpec()  # every link, control and data alike
    seed: int = 0  # the network's jitter
    cost: CostModel = CostModel()
    policy: str = "fair"  # the island schedulers'
    window: int = 2
    # Virtual time each controller daemon takes per message (see sim.node); with ``charge_cpu`` the real
    # CPU time of its core is added (then runs are no longer deterministic).
    proxy_service_seconds: float = 0.0
    scheduler_service_seconds: float = 0.0
    rm_service_seconds: float = 0.0
    charge_cpu: bool = False
    # And the real CPU of the wire codec on every message a controller daemon receives or sends (its shell's
    # work per message, which the cores' CPU leaves out): a daemon that sends or hears per host pays it per host.
    charge_codec: bool = False
    client_send_seconds: float = 0.0  # each client's own time per message it sends (see sim.client)
    collectives: bool = True  # each island's executors in one JAX group: an SPMD slice may span hosts
    keep_spans: bool = False  # executors record (start, end, run, node, devices) of every computation
    session_timeout_seconds: float = 30.0  # the proxy's (clients heartbeat at a quarter of it)

    def __post_init__(self) -> None:
        if min(self.islands, self.hosts_per_island, self.devices_per_host) < 1:
            raise InvalidArgument("a simulated cluster needs at least 1 island, host per island and device per host")


def executor_address(island: int, host: int) -> tuple[str, str, str]:
    """(executor id, control address, data-plane address) of host ``host`` of island ``island``."""
    name = f"i{island}h{host:04d}"
    return name, f"sim://{name}/control", f"sim://{name}/data"


class SimCluster:
    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config = config or SimConfig()
        self.clock = Clock()
        self.network = Network(self.clock, config.link, seed=config.seed)
        node = {"charge_cpu": config.charge_cpu, "charge_codec": config.charge_codec}
        self.rm = SimResourceManager(RM, self.clock, self.network, ResourceManagerState(),
                                     service_seconds=config.rm_service_seconds, **node)
        self.schedulers: list[SimScheduler] = []
        for island in range(config.islands):
            address = f"sim://scheduler-{island}"
            order = IslandOrder(island, policy=config.policy, window=config.window, scheduler=address)
            self.schedulers.append(SimScheduler(address, self.clock, self.network, SchedulerState(order),
                                                service_seconds=config.scheduler_service_seconds, **node))
            # Nobody watches yet: the registrations' notices go nowhere.
            self.rm.core(self.rm.state.handle, Received(RegisterScheduler(info=SchedulerInfo(
                island=island, address=address, name=f"scheduler-{island}"))), 0.0)
        self.executors: list[SimExecutor] = []
        by_data: dict[str, SimExecutor] = {}
        for island in range(config.islands):
            for host in range(config.hosts_per_island):
                name, control, data = executor_address(island, host)
                ex = SimExecutor(executor_id=name, island=island, host=name, control=control, data=data,
                                 devices=config.devices_per_host, clock=self.clock, network=self.network,
                                 cost=config.cost, peers=by_data, keep_spans=config.keep_spans)
                by_data[data] = ex
                self.executors.append(ex)
                self.rm.core(self.rm.state.handle, Received(RegisterExecutor(info=ExecutorInfo(
                    executor_id=name, island=island, host=name, control=control, data=data,
                    devices=[DeviceInfo(index=i, kind="sim", platform="cpu") for i in range(config.devices_per_host)],
                    group=f"island-{island}" if config.collectives else ""))), 0.0)
        self.proxy = SimProxy(PROXY, self.clock, self.network, ProxyState(
            rm=RM, address=PROXY, session_timeout_seconds=config.session_timeout_seconds), RM,
                              service_seconds=config.proxy_service_seconds, **node)
        self.proxy.start()
        self.clients: list[SimClient] = []
        # The controller's counters when each step began (the first step of any client, then its second...).
        self._at_steps: list[dict[str, float]] = []

    def add_client(self, name: str, script: Callable[[SimClient], Script], *, start_at: float = 0.0) -> SimClient:
        client = SimClient(name, f"sim://client-{name}", PROXY, self.clock, self.network, script,
                           send_seconds=self.config.client_send_seconds, on_mark=self._marked)
        self.clients.append(client)
        client.start(start_at)
        return client

    def _counters(self) -> dict[str, float]:
        sent, received = self.network.sent[PROXY], self.network.received[PROXY]
        return {"messages": sent.messages + received.messages, "bytes": sent.bytes + received.bytes,
                "proxy_cpu_seconds": self.proxy.cpu_seconds,
                "scheduler_cpu_seconds": sum(s.cpu_seconds for s in self.schedulers)}

    def _marked(self, label: str, now: float) -> None:
        if label == "step" and len(self._at_steps) < 2:
            self._at_steps.append(self._counters())

    def run(self, until: float | None = None, max_events: int | None = None) -> dict[str, Any]:
        """Run until every client's script ended (or ``until`` virtual seconds); returns ``report()``."""
        # The simulator's own objects (a thousand executors' state) make the cyclic garbage collector's
        # pauses, charged to whichever core runs when one strikes, far longer than a daemon's own (one
        # 100 ms pause in a measured step of (d) at 512 hosts cut its rate 30-fold): no collections while
        # the clock runs. (The daemons' pauses are measured on them: bench/scale.py (c)'s maxima.)
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        started, cpu = time.perf_counter(), time.process_time()
        try:
            self.proxy.tick_every(self.config.session_timeout_seconds / 4,
                                  lambda: not all(c.done for c in self.clients))
            self.clock.run(until=until, max_events=max_events)
        finally:
            if was_enabled:
                gc.enable()
        self.real_seconds = time.perf_counter() - started
        self.real_cpu_seconds = time.process_time() - cpu
        return self.report()

    # ------------------------------------------------------------ figures

    def report(self) -> dict[str, Any]:
        """The controller's figures: simulated step times, traffic, decisions, and its cores' real CPU."""
        sent, received = self.network.sent, self.network.received
        steps = []
        for c in self.clients:
            begins, ends = c.marked("step"), c.marked("step_end")
            steps += [e - b for b, e in zip(begins, ends, strict=False)]
        executed = sum(ex.queues.executed for ex in self.executors)
        # The warm steps' window (the second step's start to the last step's end; the first step fills the
        # lowering cache and sends the functions to the executors): how busy the controller was meanwhile.
        begins = sorted(t for c in self.clients for t in c.marked("step"))
        ends = [t for c in self.clients for t in c.marked("step_end")]
        window = (begins[1 if len(begins) > 1 else 0], max(ends)) if begins and ends else None
        warm = []
        for c in self.clients:
            b, e = c.marked("step"), c.marked("step_end")
            warm += [t1 - t0 for t0, t1 in list(zip(b, e, strict=False))[1:]]

        def busy(node: Any) -> float | None:
            if window is None or window[1] <= window[0]:
                return None
            return node.busy_between(*window) / (window[1] - window[0])

        proxy_in, proxy_out = received[PROXY], sent[PROXY]
        return {
            "cluster": {"islands": self.config.islands, "hosts": len(self.executors),
                        "devices": len(self.executors) * self.config.devices_per_host},
            # When the last script ended (the clock may run on to a housekeeping tick).
            "virtual_seconds": max((c.finished_at for c in self.clients if c.finished_at is not None),
                                   default=self.clock.now),
            "events": self.clock.events_run,
            "real_seconds": getattr(self, "real_seconds", 0.0),
            "real_cpu_seconds": getattr(self, "real_cpu_seconds", 0.0),
            "steps": len(steps),
            "step_seconds_mean": statistics.fmean(steps) if steps else None,
            "step_seconds_median": statistics.median(steps) if steps else None,
            "warm_step_seconds_median": statistics.median(warm) if warm else None,  # every step but the first
            "clients": {c.name: {"steps": len(c.marked("step_end")), "runs": len(c.marked("run_done")),
                                 "failure": str(c.failure) if c.failure else None, "errors": len(c.errors)}
                        for c in self.clients},
            "computations": executed,
            "device_busy_seconds": sum(sum(ex.queues.busy_seconds) for ex in self.executors),
            "data_plane_bytes": sum(ex.data_bytes_out for ex in self.executors),
            "proxy": {
                "messages_in": proxy_in.messages, "bytes_in": proxy_in.bytes,
                "messages_out": proxy_out.messages, "bytes_out": proxy_out.bytes,
                "dispatch_messages": proxy_out.tagged_messages["dispatch"],
                "dispatch_bytes": proxy_out.tagged_bytes["dispatch"],
                "messages_out_by_op": dict(proxy_out.by_op),
                "core_cpu_seconds": self.proxy.cpu_seconds, "core_calls": self.proxy.core_calls,
                # Share of the steps' window the proxy spent handling messages (timed runs: ``charge_cpu`` or
                # a service time; None otherwise): near 1, the one controller is what limits the run.
                "busy_in_steps": busy(self.proxy),
            },
            "schedulers": {
                "decisions": sum(s.decisions for s in self.schedulers),
                "enqueues": sum(s.enqueues for s in self.schedulers),
                "core_cpu_seconds": sum(s.cpu_seconds for s in self.schedulers),
                "core_calls": sum(s.core_calls for s in self.schedulers),
                "busy_in_steps": max((x for s in self.schedulers if (x := busy(s)) is not None), default=None),
                "usage": {u.session: {"weight": u.weight, "runs": u.runs, "device_seconds": u.device_seconds}
                          for s in self.schedulers for u in s.order.usage()},
            },
            # The proxy's traffic and the cores' CPU from the second step's start to the end (the warm steps:
            # setup and the first step's lowering and function registrations excluded); the first step's own.
            "in_steps": None if len(self._at_steps) < 2 else {
                k: v - self._at_steps[1][k] for k, v in self._counters().items()},
            "first_step": None if len(self._at_steps) < 2 else {
                k: v - self._at_steps[0][k] for k, v in self._at_steps[1].items()},
            "rm": {"core_cpu_seconds": self.rm.cpu_seconds, "core_calls": self.rm.core_calls,
                   "messages_in": received[RM].messages},
        }


def format_report(report: dict[str, Any]) -> str:
    """The figures as a few lines for a terminal."""
    c, p, s, r = report["cluster"], report["proxy"], report["schedulers"], report["rm"]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1e3 * x:.3f} ms"

    lines = [
        f"cluster: {c['islands']} island(s), {c['hosts']:,} hosts, {c['devices']:,} devices",
        f"simulated: {report['virtual_seconds'] * 1e3:.3f} ms, {report['steps']} steps, "
        f"step {ms(report['step_seconds_mean'])} mean, {ms(report['step_seconds_median'])} median; "
        f"{report['computations']:,} computations, {report['device_busy_seconds'] * 1e3:.3f} device-ms, "
        f"{report['data_plane_bytes']:,} data-plane bytes",
        f"proxy: {p['messages_in']:,} messages in ({p['bytes_in']:,} B), {p['messages_out']:,} out "
        f"({p['bytes_out']:,} B), of which dispatch {p['dispatch_messages']:,} ({p['dispatch_bytes']:,} B); "
        f"core CPU {p['core_cpu_seconds'] * 1e3:.1f} ms over {p['core_calls']:,} calls",
        f"schedulers: {s['decisions']:,} decisions, {s['enqueues']:,} Enqueues; "
        f"core CPU {s['core_cpu_seconds'] * 1e3:.1f} ms over {s['core_calls']:,} calls",
        f"rm: core CPU {r['core_cpu_seconds'] * 1e3:.1f} ms over {r['core_calls']:,} calls",
        f"real: {report['real_seconds']:.2f} s ({report['events']:,} events)",
    ]
    for name, client in report["clients"].items():
        if client["failure"] or client["errors"]:
            lines.append(f"client {name}: failed: {client['failure']}; {client['errors']} refused posts")
    return "\n".join(lines)
