"""The simulator (pwmesh/sim): virtual time, the in-memory network with the real codec, simulated
executors on the real device queues, and whole clusters of the real controller cores.
No sockets, no sleeps, no JAX: every test runs in virtual time."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from pwmesh.cli.main import main
from pwmesh.scheduler.order import IslandOrder
from pwmesh.scheduler.state import SchedulerState
from pwmesh.sim.client import Call, Mark, Script, SimClient
from pwmesh.sim.clock import Clock
from pwmesh.sim.cluster import SimCluster, SimConfig, format_report
from pwmesh.sim.controller import SimScheduler
from pwmesh.sim.cost import CostModel, FunctionCost
from pwmesh.sim.executor import SimExecutor
from pwmesh.sim.network import LinkSpec, Network
from pwmesh.sim.node import Node
from pwmesh.sim.workloads import Workload, install
from pwmesh.wire import Envelope, encode
from pwmesh.wire.messages import (
    Computation,
    IslandDone,
    NodeDone,
    OpenSession,
    Ping,
    PutShards,
    RegisterFunction,
    ScheduleRun,
    ShardRun,
)
from pwmesh.wire.parts import run_parts

pytestmark = pytest.mark.timeout(30)

COST = CostModel(launch_seconds=5e-6, host_overhead_seconds=20e-6)


class Sink(Node):
    """A daemon that only records what it is sent, and when."""

    def __init__(self, address: str, clock: Clock, network: Network) -> None:
        super().__init__(address, clock, network)
        self.got: list[tuple[float, Envelope]] = []

    def handle(self, env: Envelope) -> None:
        self.got.append((self.clock.now, env))


# ------------------------------------------------------------------ clock and network


def test_clock_runs_events_in_time_order_and_ties_in_schedule_order() -> None:
    clock, seen = Clock(), []
    clock.at(2.0, lambda: seen.append("b"))
    clock.at(1.0, lambda: clock.after(1.0, lambda: seen.append("c")))  # also at 2.0, scheduled later
    clock.at(1.0, lambda: seen.append("a"))
    assert clock.run() == 4
    assert seen == ["a", "b", "c"] and clock.now == 2.0
    clock.at(5.0, lambda: seen.append("late"))
    clock.run(until=3.0)
    assert clock.now == 3.0 and "late" not in seen


def test_network_encodes_every_message_and_counts_its_real_size() -> None:
    clock = Clock()
    net = Network(clock, LinkSpec(latency_seconds=1e-3, bandwidth_bytes_per_second=1e6))
    a, b = Sink("a", clock, net), Sink("b", clock, net)
    msg = PutShards(keys=["s/b/0"], devices=[0], arrays=[np.arange(1000, dtype=np.float32)])
    a.post("b", msg)
    clock.run()
    size = sum(memoryview(f).nbytes for f in encode(msg, msg_id=1, sender="a"))
    assert net.sent["a"].bytes == net.received["b"].bytes == size > 4000
    (when, env), = b.got
    assert isinstance(env.message, PutShards) and env.sender == "a"  # decoded from the frames
    np.testing.assert_array_equal(env.message.arrays[0], np.arange(1000, dtype=np.float32))
    assert when == pytest.approx(1e-3 + size / 1e6)  # latency plus transmission


def test_network_keeps_each_link_in_order_under_jitter() -> None:
    clock = Clock()
    net = Network(clock, LinkSpec(latency_seconds=1e-3, jitter=5.0), seed=7)
    a, b = Sink("a", clock, net), Sink("b", clock, net)
    for i in range(200):
        clock.at(i * 1e-5, lambda i=i: a.post("b", Ping() if i % 2 else OpenSession(name=str(i))))
    clock.run()
    order = [int(env.message.name) for _, env in b.got if isinstance(env.message, OpenSession)]
    assert order == sorted(order) and len(order) == 100
    times = [t for t, _ in b.got]
    assert times == sorted(times) and len(set(times)) > 5  # jittered (later ones catch up: FIFO), yet in order


# ------------------------------------------------------------------ an executor under the real scheduler


def chain_on_one_executor(k: int, seconds: float, devices: int = 1) -> tuple[Clock, Sink, SimExecutor, SimScheduler]:
    clock = Clock()
    net = Network(clock, LinkSpec(latency_seconds=10e-6))
    peers: dict[str, SimExecutor] = {}
    ex = SimExecutor(executor_id="ex0", island=0, host="h0", control="sim://ex0", data="sim://ex0/data",
                     devices=devices, clock=clock, network=net, cost=COST, peers=peers, keep_spans=True)
    peers[ex.data] = ex
    sched = SimScheduler("sim://s0", clock, net, SchedulerState(IslandOrder(0, scheduler="sim://s0")))
    proxy = Sink("sim://proxy", clock, net)
    fn = FunctionCost("f", ((4, 4),), ((4, 4),), seconds=seconds)
    proxy.post(ex.address, RegisterFunction(fn_id="f", exported=fn.artifact(512), spmd=False, devices=[0]))
    proxy.post(ex.address, PutShards(keys=["o/b0/0"], devices=[0], arrays=[np.zeros((4, 4), np.float32)]))
    comps = [Computation(node=i, fn_id="f", executor_id="ex0", control=ex.address,
                         runs=[ShardRun(device=0, shard=0)], inputs=[f"o/b{i}"], outputs=[f"o/b{i + 1}"])
             for i in range(k)]
    proxy.post(sched.address, ScheduleRun(run_id="r1", proxy=proxy.address, parts=run_parts(comps), session="s"))
    return clock, proxy, ex, sched


def test_a_chain_takes_its_modelled_time_on_one_device() -> None:
    k, t = 8, 1e-3
    clock, proxy, ex, sched = chain_on_one_executor(k, t)
    clock.run()
    # The executor reports to its scheduler; the proxy hears of the run once, from the island (#30 item 2).
    assert not [env for _, env in proxy.got if isinstance(env.message, NodeDone)]
    # Every node here is an output (none is quiet): each is told as it completes, once.
    done = [env.message for _, env in proxy.got if isinstance(env.message, IslandDone)]
    assert sorted(n for d in done for n in d.nodes) == list(range(k))
    assert all(d.run_id == "r1" and d.error is None for d in done)
    per = t + COST.launch_seconds + COST.host_overhead_seconds
    first_start, last_end = ex.spans[0][0], ex.spans[-1][1]
    assert last_end - first_start == pytest.approx(k * per - COST.host_overhead_seconds)
    # plus the proxy->scheduler->executor->scheduler->proxy hops
    assert clock.now == pytest.approx(k * per + 4 * 10e-6, rel=0.01)
    assert sched.decisions == 1 and sched.order.in_flight == 0  # RunPartDone came back
    assert ex.stored["o/b8/0"] == ((4, 4), "float32")


def test_the_scheduler_hears_the_device_seconds_of_a_part() -> None:
    clock, proxy, ex, sched = chain_on_one_executor(3, 2e-3)
    clock.run()
    (usage,) = sched.order.usage()
    assert usage.device_seconds == pytest.approx(3 * (2e-3 + COST.launch_seconds))
    assert usage.runs == 1


# ------------------------------------------------------------------ whole clusters (the real proxy core)


def run(config: SimConfig, workload: Workload) -> dict:
    cluster = SimCluster(config)
    install(cluster, workload)
    report = cluster.run()
    for name, c in report["clients"].items():
        assert c["failure"] is None and c["errors"] == 0, (name, c)
    return report


@pytest.mark.parametrize("name", ["opbyop", "chained", "fused"])
def test_figure5_workloads_complete_and_cost_what_the_model_says(name: str) -> None:
    k, t, steps = 8, 100e-6, 3
    report = run(SimConfig(islands=1, hosts_per_island=1, devices_per_host=2, cost=COST),
                 Workload(name=name, steps=steps, k=k, devices=2, compute_seconds=t))
    assert report["steps"] == steps
    nodes = 1 if name == "fused" else k
    assert report["computations"] == steps * nodes
    per_step = report["step_seconds_mean"]
    compute = k * t  # the same work either way
    assert per_step > compute
    if name != "fused":
        assert per_step >= k * (t + COST.launch_seconds + COST.host_overhead_seconds)
    assert report["proxy"]["bytes_in"] > 0 and report["proxy"]["dispatch_bytes"] > 0
    print(format_report(report))


def test_fused_beats_chained_beats_opbyop_on_tiny_computations() -> None:
    config = SimConfig(islands=1, hosts_per_island=1, devices_per_host=2, cost=COST,
                       link=LinkSpec(latency_seconds=50e-6))
    step = {name: run(config, Workload(name=name, steps=3, k=16, devices=2, compute_seconds=5e-6))[
        "step_seconds_mean"] for name in ("opbyop", "chained", "fused")}
    assert step["fused"] < step["chained"] <= step["opbyop"], step


def test_a_clients_send_time_spaces_its_messages_out() -> None:
    """OpByOp's k posts leave one send time apart: a slow client stretches a step by at least k of them."""
    k, send = 8, 1e-3  # far above anything else in the step
    config = SimConfig(islands=1, hosts_per_island=1, devices_per_host=2, cost=COST)
    workload = Workload(name="opbyop", steps=3, k=k, devices=2, compute_seconds=5e-6)
    fast = run(config, workload)["step_seconds_median"]
    slow = run(dataclasses.replace(config, client_send_seconds=send), workload)["step_seconds_median"]
    assert slow >= fast + k * send, (fast, slow)
    assert slow < fast + (k + 3) * send, (fast, slow)  # k runs, the wait, the previous step's release


def test_a_pipeline_over_two_islands_moves_data_between_them() -> None:
    report = run(SimConfig(islands=2, hosts_per_island=2, devices_per_host=4, cost=COST),
                 Workload(name="pipeline", steps=2, stages=2, microbatches=3, devices=4, compute_seconds=50e-6))
    assert report["steps"] == 2
    assert report["computations"] == 2 * 2 * 3
    assert report["data_plane_bytes"] > 0
    assert report["schedulers"]["decisions"] == 2 * 2  # one run per island per step


def test_weighted_clients_get_shares_that_follow_their_weights() -> None:
    report = run(SimConfig(islands=1, hosts_per_island=1, devices_per_host=2, cost=COST, window=1),
                 Workload(name="clients", clients=3, weights=(1.0, 2.0, 4.0), devices=2, compute_seconds=200e-6,
                          backlog=4, duration_seconds=0.05))
    usage = report["schedulers"]["usage"]
    runs = {u["weight"]: u["device_seconds"] for u in usage.values()}
    assert runs[2.0] / runs[1.0] == pytest.approx(2.0, rel=0.25), runs
    assert runs[4.0] / runs[1.0] == pytest.approx(4.0, rel=0.25), runs


def test_a_seeded_run_is_deterministic() -> None:
    def once() -> dict:
        report = run(SimConfig(islands=2, hosts_per_island=2, devices_per_host=2, cost=COST, seed=3,
                               link=LinkSpec(latency_seconds=20e-6, jitter=0.5)),
                     Workload(name="pipeline", steps=2, stages=2, microbatches=2, devices=2))
        return {k: report[k] for k in ("virtual_seconds", "events", "computations", "data_plane_bytes")} | {
            "proxy": {k: v for k, v in report["proxy"].items() if "cpu" not in k}}

    assert once() == once()


def test_a_client_error_comes_back_as_the_exception() -> None:
    cluster = SimCluster(SimConfig(islands=1, hosts_per_island=1, devices_per_host=2))

    def script(client: SimClient) -> Script:
        yield Mark("start")
        yield Call(OpenSession(name="bad", weight=-1.0))

    client = cluster.add_client("bad", script)
    cluster.run()
    assert client.failure is not None and "weight" in str(client.failure)


def test_4_islands_of_256_hosts_run_a_small_workload_in_seconds() -> None:
    report = run(SimConfig(islands=4, hosts_per_island=256, devices_per_host=8, cost=COST),
                 Workload(name="chained", steps=2, k=4, devices=64))
    assert report["cluster"]["devices"] == 8192
    assert report["steps"] == 2 and report["real_seconds"] < 20


def test_an_spmd_chain_over_every_host_sends_its_gang_once_per_host() -> None:
    """Issue #30 item 3: one SPMD program over 4 hosts' devices (a gang across them); its devices go to each
    host once (``RegisterGang``), and its warm steps cost the proxy the bytes a per-device chain's do."""
    config = SimConfig(islands=1, hosts_per_island=4, devices_per_host=2, cost=COST)
    spmd = run(config, Workload(name="chained", steps=3, k=4, devices=8, spmd=True))
    pmap = run(config, Workload(name="chained", steps=3, k=4, devices=8))
    assert spmd["steps"] == 3 and spmd["computations"] == 3 * 4 * 4  # a computation per host per node
    assert spmd["proxy"]["messages_out_by_op"]["exec.register_gang"] == 4
    assert "exec.register_gang" not in pmap["proxy"]["messages_out_by_op"]
    assert spmd["in_steps"]["bytes"] <= 1.1 * pmap["in_steps"]["bytes"], (spmd["in_steps"], pmap["in_steps"])


def test_the_sim_command_prints_the_controller_figures(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(main, ["sim", "--islands", "1", "--hosts-per-island", "2", "--devices-per-host", "2",
                                       "--workload", "chained", "--steps", "2", "--devices", "2", "--k", "3",
                                       "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "proxy:" in result.output and "schedulers:" in result.output
    assert out.exists() and '"steps": 2' in out.read_text()
