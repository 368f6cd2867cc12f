"""``pwmesh-executor --island N``: a host's devices, object store and data plane.

Two listeners: *control*, a ZeroMQ socket (functions, run queues, puts,
fetches, deletes), and *data*, raw TCP streams or shared memory for the
shard-tagged tuples other executors send (``pwmesh.dataflow.plane``), so
control messages never wait behind bulk data.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import random
import socket
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pwmesh.core.contract import Send, Timer
from pwmesh.core.ratelimit import RejectedLog
from pwmesh.dataflow.exchange import Destination, Landing, Ragged, assemble, cut, cut_error, expand, landings
from pwmesh.dataflow.plane import DataPlane
from pwmesh.dataflow.progress import Arrived, Progress, ProgressError
from pwmesh.dataflow.secure import plane_key
from pwmesh.errors import (
    DeviceLost,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    PwmeshError,
    ResourceExhausted,
    Unavailable,
)
from pwmesh.executor import spill
from pwmesh.executor.calls import copied_to, to_host
from pwmesh.executor.direct import DirectTransfers
from pwmesh.executor.fanout import FanOutRelay, split_frees
from pwmesh.executor.functions import FunctionCache
from pwmesh.executor.group import GroupConfig, group_devices, join
from pwmesh.executor.landing import land_all
from pwmesh.executor.runner import Runner, as_error
from pwmesh.executor.sandbox import Sandbox
from pwmesh.executor.state import (
    Action,
    Admit,
    Cancelled,
    CancelWork,
    Completed,
    Completions,
    Event,
    ExecutorState,
    Flush,
    Forgotten,
    Installed,
    Leaving,
    PartEnded,
    Received,
    Reclaimed,
    StartedOver,
)
from pwmesh.executor.store import ObjectStore, buffer_of, format_bytes
from pwmesh.executor.work import Work
from pwmesh.ir.keys import function_id
from pwmesh.service.heartbeat import LoopLag, every
from pwmesh.service.keys import PLANE_SECRET_ENV, Security, speaks_for
from pwmesh.service.lifecycle import Service, Status
from pwmesh.service.metrics import Metric, counter, gauge, listen_host, merged, wire_metrics
from pwmesh.service.rpc import Access, Beats, Connections, Handler, Server, wait_for_peer
from pwmesh.wire import Envelope, Message
from pwmesh.wire.messages import (
    AwaitIdle,
    CancelRun,
    Computation,
    DataLost,
    DataTuple,
    DeleteShards,
    DeviceInfo,
    Emit,
    Enqueue,
    ErrorInfo,
    ExecutorInfo,
    ExecutorStats,
    ExpectShards,
    FanOut,
    FanOutFrees,
    Fence,
    FetchShards,
    ForgetOwner,
    GetEvents,
    GetExecutorStats,
    GetTrace,
    Heartbeat,
    InstallPart,
    JoinGroup,
    LandingReport,
    LeavingForGroup,
    ListHeld,
    Move,
    NodeDone,
    Ok,
    OwnedShards,
    PartsDone,
    Ping,
    PleaseRegister,
    PushShards,
    PutShards,
    ReclaimOwner,
    RegisterExecutor,
    RegisterFunction,
    RegisterGang,
    RunPartDone,
    SendMoves,
    SendShards,
    ShardValues,
    SpillShards,
    SubtreeLost,
    TraceEvent,
    TraceEvents,
    TupleBatch,
    UnregisterExecutor,
    Watchers,
)
from pwmesh.wire.records import check_runs

log = logging.getLogger(__name__)

# Host copies at least this big (a put, an arrival, a fetch) are made on a thread, not the event loop:
# a 256 MiB device_put holds its caller ~240 ms here, during which nothing else is served.
HOST_COPY_INLINE_BYTES = 1 << 20
# A move's tuples to one destination are batched up to this many bytes (fewer messages, each still small
# enough that the receiver lands one while the next is on its way).
MOVE_BATCH_BYTES = 16 << 20
MAX_REPORTS_REMEMBERED = 4096  # reshard outputs reported landed, remembered so that each is reported once


def on_device(array: np.ndarray, device: jax.Device) -> jax.Array:
    """``array`` copied onto ``device``, the copy finished (called on a host-copy thread)."""
    value = jax.device_put(array, device)
    value.block_until_ready()
    return value


def after_wakeups(callback: Callable[[], None]) -> None:
    """Call ``callback`` once the callbacks the loop holds at the end of this turn have run: the
    tasks this turn's work woke (a future it resolved) take their next step before it."""
    loop = asyncio.get_running_loop()
    loop.call_soon(loop.call_soon, callback)


def platform_of(device: jax.Device) -> str:
    """The platform ``jax.export`` names for ``device``: cpu, cuda, rocm or tpu (JAX calls both GPUs "gpu")."""
    if device.platform != "gpu":
        return device.platform
    return "rocm" if "rocm" in device.client.platform_version.lower() else "cuda"


# The fence epoch of a restart to take devices back (``Executor._reclaim``): never a forming's (those are > 0).
RECLAIM_EPOCH = -1
RECLAIM_GRACE_SECONDS = 60.0  # not lost while it restarts (JAX's import takes seconds)


@dataclasses.dataclass
class ExecutorConfig:
    island: int
    rm: str
    devices: int = 1
    name: str = ""
    host: str = ""
    listen: str = "tcp://127.0.0.1:0"
    data_listen: str = "tcp://127.0.0.1:0"  # the data plane's TCP listener (port 0: a free one)
    shared_memory: bool = True  # same-machine peers exchange bulk data through /dev/shm
    rm_timeout_seconds: float = 30.0
    heartbeat_interval_seconds: float = 2.0
    memory_limit_bytes: int = 0  # all this executor's devices together; 0: no limit
    memory_wait_seconds: float = 300.0  # a computation waiting this long for memory fails (ResourceExhausted)
    watchdog_seconds: float = 10.0  # report gang computations in their collectives for longer than this
    # Join the island's JAX group, which its scheduler forms and re-forms, so SPMD computations span executors.
    collectives: bool = False
    group: GroupConfig | None = None  # the forming to join now (None: none yet)
    group_epoch: int = 0  # which forming that is
    group_members: tuple[str, ...] = ()  # its executors: processes 1..N
    resume_from: str = ""  # state saved before restarting into that forming (``pwmesh.executor.spill``)
    platform: str = ""  # cpu, cuda, rocm or tpu: what its devices must be ("": whatever JAX finds)
    metrics_port: int | None = None  # Prometheus metrics over HTTP (0: a free port; None: none)
    # Test-only fault injection: delay each Enqueue by a random time, and (arrival
    # order) run work in the order it arrives instead of the island's order.
    test_enqueue_jitter_seconds: float = 0.0
    test_order_by_arrival: bool = False
    test_seed: int = 0
    data_plane_plaintext: bool = False  # with keys: streams authenticated, not encrypted (a trusted fabric)
    security: Security = dataclasses.field(default_factory=Security)  # --keys, --insecure
    # Stopping: how long computations under way may take to finish before they are given up
    # (failed, naming the stop) so the executor leaves within its grace.
    stop_wait_seconds: float = 5.0
    # A computation of a cancelled run (past its tenant's deadline, say) still holding devices this long
    # after the cancel restarts the executor, to give the devices back to everyone else (0: never).
    reclaim_after_seconds: float = 10.0
    # Read each new function in a child process first (``executor.sandbox``); None: with keys (tenants).
    sandbox_functions: bool | None = None


class Executor(Service):
    role = "executor"

    def __init__(self, config: ExecutorConfig) -> None:
        host = config.host or socket.gethostname()
        super().__init__(config.security.named(config.name, f"{host}-{os.getpid()}"), config.security, metrics_port=config.metrics_port,
                         metrics_host=listen_host(config.listen))
        self.config = config
        self.host = host
        if config.group is not None:
            join(config.group)  # before anything starts JAX's backend: it is formed with the group
        try:
            local = jax.local_devices()
        except RuntimeError as exc:  # JAX cannot start the platform asked for (JAX_PLATFORMS)
            raise InvalidArgument(f"asked for {config.platform or 'the default'} devices, but JAX cannot start "
                                  f"them here: {exc}") from None
        found = platform_of(local[0]) if local else "none"
        if config.platform and found != config.platform:
            raise InvalidArgument(f"asked for {config.platform} devices but JAX found {found} ones")
        if len(local) < config.devices:
            raise InvalidArgument(
                f"asked for {config.devices} devices but JAX sees {len(local)}; on CPU set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={config.devices}"
            )
        self.devices = local[: config.devices]
        self._singles: dict[int, jax.sharding.SingleDeviceSharding] = {}  # ``_single``'s
        self.store = ObjectStore()
        self.restart: list[str] | None = None  # set when leaving to restart into a new forming: the arguments
        self._joining: JoinGroup | None = None

    async def setup(self) -> None:
        config = self.config
        sandboxed = config.sandbox_functions if config.sandbox_functions is not None else bool(config.security.keys)
        self.functions = FunctionCache(Sandbox() if sandboxed else None)
        # Host copies (large puts, arrivals and fetches) and function loads: off the loop, and not behind
        # a device's own thread, which a long computation may hold for minutes.
        self._copies = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="pwmesh-copy")
        self.functions.executor = self._copies  # an SPMD function run by blocks is derived there (it compiles)
        self._copying = 0  # host copies of arrivals under way (``AwaitIdle`` waits for them)
        self._room_waits: dict[str, list[Landing]] = {}  # buffer -> its arrivals waiting for memory
        # (run, node, prefix) of the reshard outputs whose landing here is reported (``_report_when_landed``)
        self._reporting: collections.OrderedDict[tuple[str, int, str], None] = collections.OrderedDict()
        self._landing: dict[tuple[str, str], int] = {}  # (proxy, run) -> its reshard outputs still landing here
        self._landed: dict[tuple[str, str], list[int]] = {}  # (proxy, run) -> its nodes landed, not yet reported
        self._copied = asyncio.Event()
        self._copied.set()
        self._lost_reported = 0  # data-plane batches lost that an AwaitIdle has reported
        self.loop_lag = LoopLag()
        self.abandoned = 0  # computations given up as it stopped (still running on device threads, maybe)
        self.progress = Progress()
        self._dropped_log = RejectedLog(self.name, logger=log)  # tuples a peer made up: a line per producer per 10 s
        self.runner = Runner(self.devices, self.store, self.functions, emit=self._emit, done=self._node_done,
                             part_done=self._part_done, done_together=self._nodes_done, free=self._forget,
                             memory_limit_bytes=self.config.memory_limit_bytes,
                             memory_wait_seconds=self.config.memory_wait_seconds, host=self.host)
        # What it admits, in what order, and what it reports (the pure core; ``Runner`` runs the computations).
        self.state = ExecutorState(self.name, ordered=not self.config.test_order_by_arrival)
        self.event_log = self.state.events
        self._jitter = random.Random(f"{self.config.test_seed}-{self.name}")  # each host its own delays
        self._registered: dict[str, RegisterFunction] = {}  # kept across a restart into a new forming
        self._fences: collections.Counter[int] = collections.Counter()  # forming -> watchers fenced
        self._fenced = asyncio.Event()
        self._reclaiming: set[str] = set()  # cancelled runs whose computations still held devices
        # A new process, not one restarted with its state (``spill``): peers start over with it.
        self._fresh = not self.config.resume_from
        self._incarnation = os.urandom(8).hex()
        self._requeue: list[tuple[str, str, str, Computation]] = []  # to queue again after a restart (``_reclaim``)
        if self.config.group is not None:
            self.runner.group_devices = group_devices(self.name, self.devices, self.config.group_members)
        if self.config.resume_from:
            self._resume(Path(self.config.resume_from))
        self.relay = FanOutRelay(self.name)  # the large runs' subtrees this executor heads
        control: dict[type[Message], Handler] = {
            RegisterFunction: self._register_function,
            RegisterGang: self._register_gang,
            Enqueue: self._enqueue,
            FanOut: self._fan_out,
            FanOutFrees: self._fan_out_frees,
            RunPartDone: self._relay_report,
            NodeDone: self._relay_report,
            PartsDone: self._relay_report,
            SubtreeLost: self._relay_report,
            InstallPart: self._install_part,
            PutShards: self._put,
            SendShards: self._send_shards,
            SendMoves: self._send_moves,
            FetchShards: self._fetch,
            ExpectShards: lambda peer, env: self.direct.expect(peer, env),
            PushShards: lambda peer, env: self.direct.push(peer, env),
            DeleteShards: self._delete,
            SpillShards: self._spill_shards,
            CancelRun: self._cancel_run,
            ForgetOwner: self._forget_owner,
            ReclaimOwner: self._reclaim_owner,
            ListHeld: self._list_held,
            AwaitIdle: self._await_idle,
            JoinGroup: self._join_group,
            Fence: self._fence,
            GetExecutorStats: lambda peer, env: self.stats(),
            GetTrace: self._trace,
            GetEvents: self.events,
            Ping: self.ping,
        }
        # Only daemons put, fetch, delete, enqueue or register here: a client's values reach an executor
        # through the proxy, which checks that they are the client's own. An admin may read its state.
        self.control = Server(self.ctx, self.config.listen, control, tasks=self.tasks, name=self.name,
                              access=Access.of(admin=[GetExecutorStats, GetTrace, GetEvents]), passable=True)
        bind_host, _, port = self.config.data_listen.removeprefix("tcp://").rpartition(":")
        self.ctx.guard_bind(self.config.data_listen, "the data plane at ")
        keys = self.ctx.keys
        # Without keys, a private local cluster's generated secret (``LocalClusterSpec.private``): streams
        # prove it, so another local user cannot feed this executor data; payloads stay in plaintext.
        secret = os.environ.get(PLANE_SECRET_ENV, "")
        self.plane = DataPlane(asyncio.get_running_loop(), self._receive, bind_host=bind_host, port=int(port or 0),
                               shared_memory=self.config.shared_memory,
                               pair=(keys.public, keys.secret) if keys is not None else None,
                               is_daemon=self.ctx.daemon_key, cluster_key=keys.server_public if keys else None,
                               on_lost=self._lost, on_shards=lambda session, batch: self.direct.arrived(session, batch),
                               key=plane_key(bytes.fromhex(secret)) if keys is None and secret else None,
                               plaintext=self.config.data_plane_plaintext or (keys is None and bool(secret)))
        # A test's hook: this executor's data plane refuses every stream, so what is sent to it is lost.
        self.plane.refusing = "PWMESH_TEST_REFUSE_STREAMS" if os.environ.get("PWMESH_TEST_REFUSE_STREAMS") else ""
        self.direct = DirectTransfers(self.name, self.store, self.plane, self._store_value, self._on_host)
        self.control.start()
        self.peers = Connections(self.ctx, tasks=self.tasks, name=self.name, on_message=self._notified)
        self._sending = 0  # transfers waiting for their shard, or under way
        self._sent = asyncio.Event()
        self._sent.set()
        await wait_for_peer(self.peers.get(self.config.rm), RegisterExecutor(info=self.info()),
                            timeout_seconds=self.config.rm_timeout_seconds)
        self._fresh = False  # registered: later registrations (the RM restarted) are of the same process
        self.rm_beats = Beats(self.peers, self.config.rm, "resource manager", self.config.heartbeat_interval_seconds,
                              self._notified)
        self.tasks.spawn(every(self.config.heartbeat_interval_seconds, self._heartbeat), name="heartbeat")
        self.tasks.spawn(every(self.config.watchdog_seconds, self._watchdog), name="watchdog")
        self.tasks.spawn(self.loop_lag.run(), name="loop-lag")
        self._queue_again()

    def info(self) -> ExecutorInfo:
        return ExecutorInfo(
            executor_id=self.name, island=self.config.island, host=self.host,
            control=self.ctx.advertise(self.control.address), data=self.ctx.advertise(self.plane.address), pid=os.getpid(),
            devices=[DeviceInfo(index=i, kind=d.device_kind, platform=platform_of(d), global_id=d.id)
                     for i, d in enumerate(self.devices)],
            group=f"island-{self.config.island}" if self.config.collectives else "",
            group_epoch=self.config.group_epoch if self.config.group is not None else 0,
            fresh=self._fresh, incarnation=self._incarnation,
        )

    def _notified(self, env: Envelope) -> None:
        if isinstance(env.message, PleaseRegister):  # the resource manager restarted, or declared us lost
            if env.message.written_off:
                self._start_over(env.message.written_off)
            else:
                log.warning("the resource manager asked us to register again")
            self.peers.post(self.config.rm, RegisterExecutor(info=self.info()))
            self._fresh = False

    def _start_over(self, why: str) -> None:
        """Back from a stall (SIGSTOP, a host frozen) after the resource manager declared this executor lost:
        every proxy aborted the runs it took part in (the cancels sent here were dropped as to a lost host)
        and took what it held for lost. Cancel what it was doing so nothing waits for inputs that never come,
        drop what those runs were still waiting for, and register as a new executor, with which every peer
        starts over. What is complete here stays: the proxy asks for it (``ListHeld``) as it hears of our
        return, and keeps the buffers that are whole again or deletes the rest."""
        err = DeviceLost(f"executor {self.name} was declared lost ({why}): what it was doing is cancelled")
        runs = list(dict.fromkeys(w.run_id for w in self.runner.core.incomplete()))
        for run_id in runs:
            self._handle(Cancelled(run_id, err))
        shards = self.store.drop_pending()
        self.progress = Progress()
        self._handle(StartedOver())
        self._fresh, self._incarnation = True, os.urandom(8).hex()
        log.warning("declared lost while away (%s): cancelled %d runs and dropped %d buffers they were making; "
                    "keeping %d objects for the proxies to reconcile; registering as a new executor", why, len(runs),
                    shards, len(self.store.held()))

    async def _heartbeat(self) -> None:
        await self.rm_beats.beat(Heartbeat(role=self.role, name=self.name))

    # ------------------------------------------------------------ control plane

    async def _register_function(self, peer: bytes, env: Envelope) -> Ok:
        msg = env.message
        assert isinstance(msg, RegisterFunction)
        if msg.fn_id != function_id(msg.exported, msg.spmd, msg.mesh, msg.axes, msg.donate):
            raise InvalidArgument(f"function {msg.fn_id[:12]}: its id is not the hash of its bytes and calling "
                                  "convention (an id names exactly one function)")
        self._registered.setdefault(msg.fn_id, msg)  # computations wait for it from now on
        fn = await self.functions.load(msg.fn_id, msg.exported, msg.spmd, msg.mesh, msg.axes, msg.donate,
                                       executor=self._copies)
        # Compile for the devices it will run on now, in the background (not an SPMD function over a mesh
        # that spans executors: the devices here are only part of it; it compiles as it first runs).
        devices = [self.devices[i] for i in msg.devices if 0 <= i < len(self.devices)]
        if msg.spmd and len(devices) != fn.exported.nr_devices:
            return Ok()
        assignments = [tuple(devices)] if msg.spmd else [(d,) for d in devices]
        for assignment in assignments:
            self.tasks.spawn(self._warm(fn, assignment), name=f"compile-{msg.fn_id[:8]}")
        return Ok()

    def _register_gang(self, peer: bytes, env: Envelope) -> Ok:
        msg = env.message
        assert isinstance(msg, RegisterGang)
        self.runner.gangs.register(msg)  # its computations wait for it from now on (``Runner._run``)
        return Ok()

    async def _warm(self, fn: Any, devices: tuple[jax.Device, ...]) -> None:
        pool = self.runner.pools[self.devices.index(devices[0])]
        try:
            # As it will most likely run: consuming what it may (a run that must not gets its own compile).
            await asyncio.get_running_loop().run_in_executor(pool, fn.executable, devices, fn.donate)
        except Exception:  # the real call reports it; a warm-up must not crash anything
            log.warning("background compile of %s failed", fn.fn_id, exc_info=True)

    def _enqueue(self, peer: bytes, env: Envelope) -> None:
        msg = env.message
        assert isinstance(msg, Enqueue)
        self._take(msg)

    def _take(self, msg: Enqueue) -> None:
        if self.config.test_enqueue_jitter_seconds > 0:
            delay = self._jitter.uniform(0, self.config.test_enqueue_jitter_seconds)
            self.tasks.spawn(self._arrive_late(msg, delay), name=f"jitter-{msg.run_id}")
        else:
            self._arrive(msg)
        return None

    def _fan_out(self, peer: bytes, env: Envelope) -> None:
        """A large run's parts for the subtree this executor heads, or its own part alone (a leaf): each
        child's bodies on, unread, then its own part, decoded and checked here (``executor/fanout.py``; an
        unreadable one fails this part alone, reported to ``parent``)."""
        msg = env.message
        assert isinstance(msg, FanOut)
        own, sends = self.relay.fan_out(msg)
        for to, message in sends:
            self.peers.post(to, message)
        if own is not None:
            self._take(own)

    def _fan_out_frees(self, peer: bytes, env: Envelope) -> None:
        msg = env.message
        assert isinstance(msg, FanOutFrees)
        for to, message in split_frees(msg):
            self.peers.post(to, message)
        self._delete(peer, dataclasses.replace(env, message=DeleteShards(buffers=msg.buffers)))

    def _relay_report(self, peer: bytes, env: Envelope) -> None:
        """What a child of a fan-out subtree this executor heads reported, or the scheduler's word that one is gone."""
        msg = env.message
        who = msg.head if isinstance(msg, PartsDone) else getattr(msg, "executor_id", "")
        if not isinstance(msg, SubtreeLost) and not speaks_for(env.user, who):
            raise PermissionDenied(f"the daemon key {env.user!r} cannot report for {who}")
        for to, message in self.relay.handle(msg):
            self.peers.post(to, message)

    def _install_part(self, peer: bytes, env: Envelope) -> None:
        msg = env.message
        assert isinstance(msg, InstallPart)
        self.state.control = self.ctx.advertise(self.control.address)
        self._handle(Installed(msg))

    async def _arrive_late(self, msg: Enqueue, delay: float) -> None:
        await asyncio.sleep(delay)  # test-only: a network that reorders messages
        self._arrive(msg)

    def _arrive(self, msg: Enqueue) -> None:
        if msg.template and not self.state.control:  # named in a NeedTemplate, should it need its part again
            self.state.control = self.ctx.advertise(self.control.address)
        self._handle(Received(msg))

    def _handle(self, event: Event) -> None:
        """Hand the core ``event`` and do what it says."""
        self._act(self.state.handle(event, time.monotonic()))

    def _act(self, actions: list[Action]) -> None:
        """Do what the core says."""
        own = self.relay.control  # (a subtree's head: its own parts report to its relay, not to a socket)
        for action in actions:
            if isinstance(action, Send):
                if action.to == own and own:
                    for to, message in self.relay.handle(action.message):
                        self.peers.post(to, message)
                else:
                    self.peers.post(action.to, action.message)
            elif isinstance(action, Admit):
                msg = action.message
                to = msg.report or msg.scheduler  # where its completions go: a fan-out head's, or the scheduler
                for comp, exc in self.runner.enqueue_all(msg.run_id, msg.proxy, action.computations, to):
                    self._handle(Completed(msg.run_id, msg.proxy, comp.node, error=exc, scheduler=to))
            elif isinstance(action, CancelWork):
                self.runner.cancel_run(action.run_id, action.error)
            elif isinstance(action, Timer):
                delay = action.at - time.monotonic()
                if delay > 0:  # a wait given up on (a template's part asked for again)
                    asyncio.get_running_loop().call_later(delay, self._handle, action.event)
                else:
                    after_wakeups(functools.partial(self._handle, action.event))
            else:
                raise TypeError(f"not an executor action: {action!r}")

    def _part_done(self, run_id: str, scheduler: str, device_seconds: float) -> None:
        self._handle(PartEnded(run_id, scheduler, device_seconds))

    async def _watchdog(self) -> None:
        for wait in self.runner.gang_waits(older_than_seconds=self.config.watchdog_seconds):
            log.warning("watchdog: %s", wait)

    def _put(self, peer: bytes, env: Envelope) -> Ok | Any:
        msg = env.message
        assert isinstance(msg, PutShards)
        if not (len(msg.keys) == len(msg.arrays) == len(msg.devices)):
            raise InvalidArgument("put_shards needs as many keys, devices and arrays")
        nbytes = sum(getattr(a, "nbytes", 0) for a in msg.arrays)
        self.store.refuse_put(msg.keys, nbytes, self.name)
        if nbytes >= HOST_COPY_INLINE_BYTES:
            return self._put_off_loop(msg)
        if self._store_arrays(msg.keys, msg.devices, msg.arrays):
            return Ok()
        first: Exception | None = None
        for key, device, array in zip(msg.keys, msg.devices, msg.arrays, strict=True):
            try:
                self._store_array(key, device, array)
            except Exception as exc:  # every key gets a value or a failure: none is left pending
                self.store.fail(key, as_error(exc, f"storing {key}"))
                first = first or exc
        if first is not None:
            raise first
        return Ok()

    async def _put_off_loop(self, msg: PutShards) -> Ok:
        """A large put: each array copied onto its device on a host-copy thread (computations that read a
        key wait for it meanwhile, as for any value not here yet)."""
        first: Exception | None = None
        for key, device, array in zip(msg.keys, msg.devices, msg.arrays, strict=True):
            try:
                await self._store_array_off_loop(key, device, array)
            except Exception as exc:
                self.store.fail(key, as_error(exc, f"storing {key}"))
                first = first or exc
        if first is not None:
            raise first
        return Ok()

    def _device(self, index: int) -> jax.Device:
        if not 0 <= index < len(self.devices):
            raise InvalidArgument(f"device {index} does not exist on {self.name}")
        return self.devices[index]

    async def _store_array_off_loop(self, key: str, device: int, array: np.ndarray) -> None:
        on = self._device(device)
        if self.store.deleted(key):
            return
        value = await asyncio.get_running_loop().run_in_executor(self._copies, on_device, array, on)
        self.store.put(key, value, array.nbytes)

    def _store_array(self, key: str, device: int, array: np.ndarray) -> None:
        if not self._store_arrays([key], [device], [array]):
            self.store.put(key, jax.device_put(array, self._device(device)), array.nbytes)

    def _store_arrays(self, keys: list[str], devices: list[int], arrays: list[np.ndarray]) -> bool:
        """Small arrays copied onto their devices (``_single``) and stored. False (nothing stored) if one
        is not a plain array in JAX's canonical dtype or names no device here: the caller stores them one
        by one through ``device_put``, so each key gets its own value or error."""
        places = []
        for device, array in zip(devices, arrays, strict=True):
            if (type(array) is not np.ndarray or array.dtype != jax.dtypes.canonicalize_dtype(array.dtype)
                    or not 0 <= device < len(self.devices)):
                return False
            places.append(self._single(device))
        for key, sharding, array in zip(keys, places, arrays, strict=True):
            self.store.put(key, copied_to(array, sharding), array.nbytes)
        return True

    def _single(self, device: int) -> jax.sharding.SingleDeviceSharding:
        """Device ``device``'s sharding, made once (``copied_to`` copies onto it)."""
        found = self._singles.get(device)
        if found is None:
            found = self._singles[device] = jax.sharding.SingleDeviceSharding(self._device(device))
        return found

    def _send_shards(self, peer: bytes, env: Envelope) -> Ok:
        msg = env.message
        assert isinstance(msg, SendShards)
        check_runs(msg.runs, f"SendShards of {msg.prefix!r}")
        self._send_moves_of([Move(prefix=msg.prefix, runs=msg.runs, emits=msg.emits)], msg.proxy, msg.run_id)
        return Ok()

    def _send_moves(self, peer: bytes, env: Envelope) -> Ok:
        msg = env.message
        assert isinstance(msg, SendMoves)
        for move in msg.moves:  # all checked before any is sent
            check_runs(move.runs, f"SendMoves of {move.prefix!r}")
        self._send_moves_of(msg.moves, msg.proxy, msg.run_id)
        return Ok()

    def _send_moves_of(self, moves: list[Move], proxy: str, run_id: str) -> None:
        """Send ``moves`` (a run's, if ``run_id``), in order, by one task."""
        # Counted and looked up now, not when the task first runs: ``AwaitIdle`` right
        # behind must see it, and a delete right behind must not turn the lookup into
        # a wait for a key that will never come again.
        looked_up = [(move.emits, {shard: self.store.get(f"{move.prefix}/{shard}")
                                   for r in move.runs for shard in range(r.shard, r.shard + r.count)})
                     for move in moves]
        self._sending += 1
        self._sent.clear()
        run = (proxy, run_id) if run_id else None
        name = f"send-{moves[0].prefix}" if len(moves) == 1 else f"send-{len(moves)}-of-{run_id}"
        self.tasks.spawn(self._send_when_ready(looked_up, run), name=name)

    async def _send_when_ready(self, moves: list[tuple[list[Emit], dict[int, asyncio.Future[Any]]]],
                               run: tuple[str, str] | None) -> None:
        """Each move's tuples once its shards are here, those of consecutive moves to one destination in one
        batch of up to ``MOVE_BATCH_BYTES`` (a weight sync: ~15 batches, not 65); what is cut leaves
        before a wait for a shard not yet here."""
        pending: list[tuple[Destination, DataTuple]] = []
        size = 0
        try:
            for emits, futures in moves:
                if pending and not all(fut.done() for fut in futures.values()):
                    self._send_tuples(pending, run)
                    pending, size = [], 0
                try:
                    local = {shard: await fut for shard, fut in futures.items()}
                    tuples = [t for emit in emits for t in self._cut_values(emit, local, {}, run)]
                except PwmeshError as exc:  # a shard lost, an emit that cannot be cut: its destinations fail
                    tuples = [t for emit in emits for t in cut_error(emit, list(futures), ErrorInfo.of(exc), run)]
                pending += tuples
                size += sum(t.array.nbytes for _, t in tuples if t.array is not None)
                if size >= MOVE_BATCH_BYTES:
                    self._send_tuples(pending, run)
                    pending, size = [], 0
        finally:
            if pending:  # (what was cut goes, whatever failed after it)
                self._send_tuples(pending, run)
            self._sending -= 1
            if self._sending == 0:
                self._sent.set()

    async def _await_idle(self, peer: bytes, env: Envelope) -> Ok:
        """Every queued computation done, every transfer sent and confirmed delivered."""
        await self.runner.wait_idle()
        await self._sent.wait()
        await self.plane.idle.wait()
        await self._copied.wait()
        await self.peers.barrier(timeout_seconds=30.0)
        lost, self._lost_reported = self.plane.lost - self._lost_reported, self.plane.lost
        if lost:  # idle, but not because everything arrived: whoever waits for this must not take it so
            raise DeviceLost(f"{lost} data batch(es) {self.name} sent were lost (their streams broke, and so did "
                             "every retry): what they carried never arrived")
        return Ok()

    async def _fetch(self, peer: bytes, env: Envelope) -> ShardValues:
        msg = env.message
        assert isinstance(msg, FetchShards)
        # ``get``, not ``lookup``: a shard moved here (a drained host) may still be on its way.
        futures = [self.store.get(k) for k in msg.keys]
        values = [await f for f in futures]
        if len(values) > 1:  # every copy to the host under way at once (as jax.device_get): ten losses, one wait
            for value in values:
                if isinstance(value, jax.Array):
                    with contextlib.suppress(RuntimeError):  # (consumed meanwhile: its read below says so)
                        value.copy_to_host_async()
        return ShardValues(arrays=[await self._on_host(value) for value in values])

    async def _on_host(self, value: Any) -> Any:
        """``value`` as a host array: a large device array copied on a host-copy thread."""
        if isinstance(value, jax.Array) and value.nbytes >= HOST_COPY_INLINE_BYTES:
            return await asyncio.get_running_loop().run_in_executor(self._copies, np.asarray, value)
        return np.asarray(value)

    def _cancel_run(self, peer: bytes, env: Envelope) -> None:
        msg = env.message
        assert isinstance(msg, CancelRun)
        err = msg.error.exception()
        self._handle(Cancelled(msg.run_id, err))
        if (self.config.reclaim_after_seconds > 0 and msg.run_id not in self._reclaiming
                and self.runner.running_of(msg.run_id)):
            self._reclaiming.add(msg.run_id)
            self.tasks.spawn(self._reclaim(msg.run_id, err), name=f"reclaim-{msg.run_id}")

    async def _reclaim(self, run_id: str, why: PwmeshError) -> None:
        """``run_id`` was cancelled while a computation of it ran on devices here. If it still holds them
        ``reclaim_after_seconds`` later (a loop that never ends), XLA cannot be made to let go: restart
        this process to take them back. The runaway fails; every other computation not completed here
        is queued again after the restart, in the same order, and the buffers are kept (``spill``)."""
        await asyncio.sleep(self.config.reclaim_after_seconds)  # the grace period: a deadline, not an event
        held = self.runner.running_of(run_id)
        if not held or self.status is not Status.RUNNING or self.restart is not None or self._joining is not None:
            self._reclaiming.discard(run_id)
            return
        devices = sorted({d for work in held for d in work.devices})
        log.error("run %s was cancelled %g s ago (%s) and still holds devices %s here: restarting to take them "
                  "back", run_id, self.config.reclaim_after_seconds, why.message, devices)
        # As for a restart into a forming: not lost while away, and every watcher holds what it sends
        # here until we are back (the fence tells us it does).
        try:
            reply = await self.peers.request(self.config.rm, LeavingForGroup(
                executor_id=self.name, epoch=RECLAIM_EPOCH, grace_seconds=RECLAIM_GRACE_SECONDS),
                timeout_seconds=5.0)
            watchers = reply.count if isinstance(reply, Watchers) else 0
            await asyncio.wait_for(self._wait_fences(RECLAIM_EPOCH, watchers), timeout=5.0)
        except (PwmeshError, TimeoutError) as exc:
            log.warning("restarting without every watcher's fence (%s): messages sent here meanwhile may be lost",
                        exc)
        incomplete = self.runner.core.incomplete()
        given_up = [w for w in incomplete if w.cancelled is not None or w in held]
        self.runner.abandon(Unavailable(
            f"executor {self.name} restarted to take devices {devices} back from run {run_id}, still running "
            f"{self.config.reclaim_after_seconds:g} s after it was cancelled ({why.message})"), only=given_up)
        kept = set(given_up)
        self._requeue = [(w.run_id, w.proxy, w.scheduler, w.comp) for w in incomplete if w not in kept]
        self._handle(Leaving())  # every completion held here goes now
        await self.peers.barrier(timeout_seconds=5.0)  # the failures and completions delivered
        self.runner.silence()  # what is queued again is reported by the next process
        self.restart = [
            "--listen", self.control.address, "--data-listen", self.plane.address,
            *(["--metrics-port", str(self.metrics.port)] if self.metrics is not None else []),
            "--name", self.name,
            # Out of its JAX group, if in one (its forming cannot take a new process): the island's
            # scheduler forms the next with it, as for a member that failed to join.
            *(["--jax-coordinator", "", "--group-epoch", "0", "--group-members", ""]
              if self.config.group is not None else []),
        ]
        log.info("restarting with %d computations to queue again", len(self._requeue))
        self.ctx.linger_on_close_ms = 2000
        self.ctx.keep_listeners = True  # for the next process (``listeners``)
        asyncio.get_running_loop().create_task(self.close(), name="close-to-reclaim")  # noqa: RUF006 - run() awaits it

    def _queue_again(self) -> None:
        """Queue what the process before this one had not completed (``_reclaim``), in its order."""
        requeue, self._requeue = self._requeue, []
        i = 0
        while i < len(requeue):
            run_id, proxy, scheduler, _ = requeue[i]
            comps = []
            while i < len(requeue) and requeue[i][:3] == (run_id, proxy, scheduler):
                comps.append(requeue[i][3])
                i += 1
            for comp, exc in self.runner.enqueue_all(run_id, proxy, comps, scheduler):
                self._handle(Completed(run_id, proxy, comp.node, error=exc, scheduler=scheduler))

    def _forget_owner(self, peer: bytes, env: Envelope) -> None:
        msg = env.message
        assert isinstance(msg, ForgetOwner)
        self.store.forget_owner(msg.prefix)
        self.direct.forget(msg.prefix.rstrip("/"))
        self._handle(Forgotten(msg.prefix.rstrip("/")))

    def _list_held(self, peer: bytes, env: Envelope) -> OwnedShards:
        msg = env.message
        assert isinstance(msg, ListHeld)
        if not msg.keys:
            return self._owned([k for k, _, _ in self.store.held()])
        # Asked after a ``CancelRun`` (it came first on this connection): the run's work that had not
        # started never will (``Runner._run``); what runs now may consume its inputs at any moment.
        busy = self.runner.donating()
        values = [self.store.values([k]) if k not in busy else None for k in msg.keys]
        return self._owned([k for k, v in zip(msg.keys, values, strict=True)
                            if v is not None and not (isinstance(v[0], jax.Array) and v[0].is_deleted())])

    def _owned(self, keys: list[str]) -> OwnedShards:
        """``keys`` (held here) with the index of the device each is on (-1: routed rows, on the host)."""
        index = {d: i for i, d in enumerate(self.devices)}
        values = self.store.values(keys) or []
        return OwnedShards(keys=keys, devices=[
            -1 if isinstance(v, Ragged) else index.get(next(iter(v.devices())), -1) for v in values])

    def _reclaim_owner(self, peer: bytes, env: Envelope) -> OwnedShards:
        """A restarted proxy takes a session's objects back (``ReclaimOwner``): the runs its process before
        sent here are cancelled (and any still to come), and only what is held now or named anew is kept."""
        msg = env.message
        assert isinstance(msg, ReclaimOwner)
        owner = msg.prefix.rstrip("/")
        if not owner or "/" in owner:
            raise InvalidArgument(f"not an owner's prefix: {msg.prefix!r}")
        err = Unavailable(msg.why)
        self._handle(Reclaimed(owner, msg.marker, err))
        runs = {w.run_id.split("#", 1)[0] for w in self.runner.core.incomplete()}
        for run_id in [r for r in runs if self.state.old_run(r) is not None]:
            self._handle(Cancelled(run_id, err))
        held = self.store.fence(owner, msg.marker)
        if msg.drop:
            self.store.delete(sorted({buffer_of(k) for k in held}))
            return OwnedShards(keys=[], devices=[])
        log.info("a restarted proxy took back session %s: %d objects kept, runs before it cancelled", owner,
                 len(held))
        return self._owned(held)

    def _delete(self, peer: bytes, env: Envelope) -> None:
        msg = env.message
        assert isinstance(msg, DeleteShards)
        self._forget(msg.buffers)
        return None  # posted by the proxy, which does not wait: no reply

    def _forget(self, buffers: list[str]) -> None:
        """Delete every shard of ``buffers`` here: the proxy's ``DeleteShards``, or a computation's ``frees``."""
        self.store.delete(buffers)
        for buffer in buffers:
            self.progress.forget(f"{buffer}/")
            for landing in self._room_waits.get(buffer, ()):  # nobody will read it: stop waiting for room
                self.store.memory.cancel(landing, NotFound(f"{buffer} was deleted while it waited for memory"))

    def _spill_shards(self, peer: bytes, env: Envelope) -> None:
        msg = env.message
        assert isinstance(msg, SpillShards)
        moved = self.store.to_host(msg.buffers, to_host)
        log.info("moved %d buffers (%s) off the devices into host memory: their slice was suspended",
                 len(msg.buffers), format_bytes(moved))
        return None  # posted by the proxy, which does not wait: no reply

    def _trace(self, peer: bytes, env: Envelope) -> TraceEvents:
        msg = env.message
        assert isinstance(msg, GetTrace)
        events = [TraceEvent(run_id=s.run_id, node=s.node, seq=s.seq, fn_id=s.fn_id, devices=list(s.devices),
                             arrived=s.arrived, start=s.start, end=s.end, error=s.error)
                  for s in self.runner.trace(since=msg.since, limit=msg.limit)]
        info = self.info()
        return TraceEvents(executor_id=self.name, island=self.config.island, host=self.host, devices=info.devices,
                           events=events)

    def stats(self) -> ExecutorStats:
        return ExecutorStats(executor_id=self.name, objects=len(self.store), bytes=self.store.nbytes,
                             queued=self.runner.queued(), outstanding=self.runner.outstanding,
                             functions=len(self.functions),
                             executed=self.runner.executed,
                             memory_limit=self.runner.memory.limit_bytes,
                             waiting_for_memory=self.runner.memory.waiting,
                             gang_waits=self.runner.gang_waits(),
                             running=self.runner.running(time.time()),
                             loop_lag_max_seconds=self.loop_lag.max_seconds,
                             loop_stalls=[[wall, seconds] for wall, seconds in self.loop_lag.recent],
                             direct_received_bytes=self.direct.received_bytes,
                             direct_pushed_bytes=self.direct.pushed_bytes,
                             tombstones=self.store.tombstone_count())

    def collect(self) -> list[Metric]:
        core, memory = self.runner.core, self.runner.memory
        received, rejected = self.peers.counts()
        devices = [str(i) for i in range(len(self.devices))]
        data_rejected = {f"data_{reason}": n for reason, n in self.plane.rejected.items()}  # the data plane's own
        return [
            *wire_metrics(self.role, self.name, merged(self.control.received, received),
                          merged(self.control.sent, self.peers.sent), merged(self.control.rejected, rejected, data_rejected)),
            gauge("pwmesh_executor_queue_depth", "Computations waiting in each device's queue (behind the one "
                  "it runs).", labels={"device": ""}, values=(((d,), n) for d, n in zip(devices, core.queued(),
                                                                                       strict=True))),
            counter("pwmesh_executor_computations_started", "Computations started on this executor's devices.",
                    core.started),
            counter("pwmesh_executor_computations_finished", "Computations completed (their outputs stored or "
                    "failed), failed ones included.", core.executed),
            counter("pwmesh_executor_computations_failed", "Computations that completed with an error.", core.failed),
            counter("pwmesh_executor_device_busy_seconds", "Seconds each device spent computing.",
                    labels={"device": ""}, values=(((d,), s) for d, s in zip(devices, core.busy_seconds, strict=True))),
            counter("pwmesh_dataplane_bytes", "Bytes of shard-tagged tuples over the data plane, by direction and "
                    "path (tcp: a stream; shm: shared memory between executors of one machine).",
                    labels={"direction": "", "path": ""}, values=self.plane.bytes_moved().items()),
            gauge("pwmesh_executor_buffers", "Buffers (shards) in the object store, values and pending futures.",
                  len(self.store)),
            gauge("pwmesh_executor_memory_used_bytes", "Bytes the devices hold: stored, and reserved for outputs "
                  "being computed.", memory.in_use),
            gauge("pwmesh_executor_memory_limit_bytes", "The memory limit of all devices together (0: none).",
                  memory.limit_bytes),
            gauge("pwmesh_executor_waiting_for_memory", "Computations waiting for memory to be freed.", memory.waiting),
            gauge("pwmesh_executor_functions", "Functions registered here.", len(self.functions)),
            gauge("pwmesh_executor_running_computations", "Computations running on device threads or handed to "
                  "the devices now.", self.runner.running_count),
            gauge("pwmesh_executor_longest_running_seconds", "How long the oldest computation running now has run "
                  "(busy, not dead: heartbeats go on).", self.runner.longest_running_seconds),
            gauge("pwmesh_loop_lag_max_seconds", "The longest the event loop was kept from serving (heartbeats, "
                  "status, signals), since start.", self.loop_lag.max_seconds),
            counter("pwmesh_loop_stalls", f"Times the event loop was held {self.loop_lag.stall_seconds * 1e3:g} ms "
                    "or more.", self.loop_lag.stalls),
        ]

    # --------------------------------------------------------------- data plane

    def _emit(self, work: Work, emit: Emit, local: dict[int, Any], selectors: dict[int, Any],
              err: PwmeshError | None) -> None:
        """A computation's values leave as its emits say (or, if it failed, its failure does)."""
        run = (work.proxy, work.run_id)
        if err is not None:
            self._send_tuples(cut_error(emit, work.shards, ErrorInfo.of(err), run), run)
            return
        try:
            self._emit_values(emit, local, selectors, run)
        except PwmeshError as exc:  # e.g. an expert id out of range: the destinations fail with it
            if work.error is None:
                work.error = exc
            self._send_tuples(cut_error(emit, work.shards, ErrorInfo.of(exc), run), run)

    def _emit_values(self, emit: Emit, local: dict[int, Any], selectors: dict[int, Any],
                     run: tuple[str, str] | None = None) -> None:
        self._send_tuples(self._cut_values(emit, local, selectors, run), run)

    def _cut_values(self, emit: Emit, local: dict[int, Any], selectors: dict[int, Any],
                    run: tuple[str, str] | None) -> list[tuple[Destination, DataTuple]]:
        host = {shard: v if isinstance(v, Ragged) else np.asarray(v) for shard, v in local.items()}
        return cut(emit, host, {shard: np.asarray(v) for shard, v in selectors.items()},
                   take=self.plane.pool.take, here=self.name, run=run)

    def _send_tuples(self, tuples: list[tuple[Destination, DataTuple]], run: tuple[str, str] | None = None) -> None:
        """One batch per destination executor; ours are delivered here without a socket. ``run`` (its
        proxy, its id): the run whose computation sends them, which fails if they are lost."""
        batches: dict[str, list[DataTuple]] = {}
        for dest, t in tuples:
            batches.setdefault(dest.executor_id if dest.executor_id == self.name else dest.data, []).append(t)
        for where, batch in batches.items():
            if where == self.name:
                self._deliver(batch)
            else:
                self.plane.send(where, TupleBatch(tuples=batch), run)

    def _lost(self, runs: list[tuple[str, str]], why: str) -> None:
        """Batches sent for ``runs`` were given up on (``DataPlane.on_lost``): their runs fail, naming it,
        rather than wait for ever for what never arrives."""
        for proxy, run_id in dict.fromkeys(runs):
            self.peers.post(proxy, DataLost(run_id=run_id, executor_id=self.name, error=ErrorInfo.of(DeviceLost(
                f"data that run {run_id} sent from executor {self.name} was lost: {why}"))))

    def _receive(self, batch: TupleBatch) -> None:
        self._deliver(batch.tuples)

    def _deliver(self, tuples: list[DataTuple]) -> None:
        """Progress tracking per destination shard; the complete ones are assembled and stored (replicas
        that arrived as one tuple: assembled once, ``landings``)."""
        arrived: list[tuple[str, int, list[DataTuple], DataTuple]] = []
        reports: list[tuple[list[str], LandingReport]] = []
        for t in expand(tuples, share=True):
            key = f"{t.prefix}/{t.shard}"
            if self.store.deleted(key):
                continue  # its run ended (cancelled, freed): a late tuple is dropped
            if t.report is not None:
                self._report_when_landed(t.prefix, t.report, reports)
            try:
                if t.error is not None:
                    failed = self.progress.fail(key, t.error.exception())
                    if failed is not None:
                        self.store.fail(key, failed.error)
                    continue
                done = None
                if t.seq >= 0:
                    done = self.progress.tuple(key, t.src, t.seq, t.sources, t)
                if t.count >= 0:
                    done = self.progress.marker(key, t.src, t.count, t.sources) or done
            except ProgressError as exc:
                self._dropped_log.warning(t.src, "dropped a tuple: %s", exc)
                continue
            if isinstance(done, Arrived):
                arrived.append((key, t.device, done.payloads, t))
        off_loop = [big for big in map(self._land, landings(arrived)) if big is not None]
        if off_loop:  # one hop to a host-copy thread for all of them (a batch of a weight sync's arrays)
            self._spawn_copy(self._land_off_loop(off_loop), f"land-{off_loop[0].shards[0][0]}")
        if reports:  # one task watches the batch's landed reshard nodes
            self.tasks.spawn(self._report_landed(reports), name=f"landed-{reports[0][0][0]}")

    def _report_when_landed(self, prefix: str, report: LandingReport,
                            reports: list[tuple[list[str], LandingReport]]) -> None:
        """A reshard node's output lands here with no computation of its own: once every shard of it here
        is stored (or has failed), its node is reported done (or failed), once (added to ``reports``, for
        ``_report_landed``)."""
        seen = (report.run_id, report.node, prefix)
        if seen in self._reporting:
            return
        self._reporting[seen] = None
        while len(self._reporting) > MAX_REPORTS_REMEMBERED:  # a tuple sent again must not report twice
            self._reporting.popitem(last=False)
        keys = [f"{prefix}/{shard}" for shard in report.shards]
        run = (report.proxy, report.run_id)
        self._landing[run] = self._landing.get(run, 0) + 1
        reports.append((keys, report))

    async def _report_landed(self, reports: list[tuple[list[str], LandingReport]]) -> None:
        """Each of ``reports``' nodes once its shards here are stored, in order (one task for a batch's,
        not one each). Nodes of one run that landed while others of it were landing here are reported
        together, once none is left (a weight sync of 65 arrays: a few completions, not 65); a failure as
        soon as the reports ahead of it in the batch are settled."""
        for keys, report in reports:
            try:
                await self._report_one(keys, report)
            except Exception:  # not this one's fault: the others are still reported
                log.exception("reporting node %d of run %s", report.node, report.run_id)

    async def _report_one(self, keys: list[str], report: LandingReport) -> None:
        run = (report.proxy, report.run_id)
        try:
            error: PwmeshError | None = None
            for key in keys:
                try:
                    await self.store.get(key)
                except PwmeshError as exc:
                    error = error or exc
            if error is not None and all(self.store.deleted(key) for key in keys):
                return  # its run ended (cancelled, freed) before it landed: nobody waits for it
            if error is not None:
                self._handle(Completed(report.run_id, report.proxy, report.node, False, error))
            else:
                self._landed.setdefault(run, []).append(report.node)
        finally:
            left = self._landing[run] - 1
            if left:
                self._landing[run] = left
            else:
                del self._landing[run]
                for node in self._landed.pop(run, ()):  # one instant: one NodeDone (``_report_later``)
                    self._handle(Completed(report.run_id, report.proxy, node, False))

    def _land(self, landing: Landing, room_held: bool = False) -> Landing | None:
        """A value that arrived for one or more destination shards here: small ones (and routed rows)
        assembled and stored now; big ones returned (those of its live shards), to be assembled and put
        on their devices on a host-copy thread (``_land_off_loop``). One that does not fit now waits for
        room (``_land_when_room``), as a computation's outputs do; ``room_held``: it waited, and holds it."""
        shards = [(key, device) for key, device in landing.shards if not self.store.deleted(key)]
        if not shards:
            return None  # its run ended (cancelled, freed): nobody waits for it
        if len(shards) < len(landing.shards):
            landing = dataclasses.replace(landing, shards=shards)
        nbytes = landing.nbytes * len(shards)
        memory = self.store.memory
        if not room_held and memory.limit_bytes and not memory.fits(nbytes):
            if nbytes > memory.limit_bytes:  # never: fail now
                self._fail_landing(landing, f"does not fit on executor {self.name}, whose memory limit is "
                                            f"{format_bytes(memory.limit_bytes)}")
            else:
                self._spawn_copy(self._land_when_room(landing, nbytes), f"room-{shards[0][0]}")
            return None
        if landing.last.ragged or nbytes < HOST_COPY_INLINE_BYTES:
            try:
                value = assemble(landing.payloads, landing.last, whole=landing.whole)
            except Exception as exc:
                for key, _ in shards:
                    self.store.fail(key, as_error(exc, f"assembling {key}"))
                return None
            if isinstance(value, Ragged) or len(shards) == 1:
                self._store_value(shards[0][0], shards[0][1], value)
                return None
            # Replicas: one device_put for all (JAX adopts host memory as immutable: they may share it).
            try:
                arrays = jax.device_put([value] * len(shards), [self._device(device) for _, device in shards])
            except Exception as exc:
                for key, _ in shards:
                    self.store.fail(key, as_error(exc, f"storing {key}"))
                return None
            for (key, _), array in zip(shards, arrays, strict=True):
                self.store.put(key, array, value.nbytes)
            return None
        return landing

    async def _land_when_room(self, landing: Landing, nbytes: int) -> None:
        """Land ``landing`` once ``nbytes`` fit: a free may be on its way (the run that last read an array
        ended; its delete has not come yet). After ``--memory-wait-seconds`` its shards fail, saying what
        holds the memory, as a computation waiting for room for its outputs does. (Spawned as a host copy
        from ``_land``, so a drain waits for it.)"""
        memory = self.store.memory
        buffer = buffer_of(landing.shards[0][0])
        self._room_waits.setdefault(buffer, []).append(landing)
        try:
            try:
                await asyncio.wait_for(memory.reserve(nbytes, owner=landing), self.config.memory_wait_seconds)
            except NotFound:  # deleted meanwhile (``_delete``)
                return
            except TimeoutError:
                self._fail_landing(landing, f"does not fit on executor {self.name}: it waited "
                                            f"{self.config.memory_wait_seconds:g} s for room, and "
                                            f"{format_bytes(memory.in_use)} of its {format_bytes(memory.limit_bytes)} "
                                            "memory limit stay held")
                return
            try:
                big = self._land(landing, room_held=True)
                if big is not None:
                    await self._land_off_loop([big])
            finally:
                memory.release(nbytes)  # what landed is counted as stored now
        finally:
            waits = [w for w in self._room_waits.pop(buffer) if w is not landing]  # (by identity: it holds arrays)
            if waits:
                self._room_waits[buffer] = waits

    def _fail_landing(self, landing: Landing, why: str) -> None:
        """Fail every shard of ``landing`` not deleted meanwhile, for whatever reads them."""
        nbytes = landing.nbytes * len(landing.shards)
        for key, _ in landing.shards:
            if not self.store.deleted(key):
                self.store.fail(key, ResourceExhausted(
                    f"data arriving for {key.rpartition('/')[0]} ({format_bytes(nbytes)}) {why}; free arrays there, "
                    "or give it more memory (--memory-limit, --memory-wait-seconds)"))

    async def _land_off_loop(self, landings: list[Landing]) -> None:
        try:
            work = [(landing, [self._device(device) for _, device in landing.shards]) for landing in landings]
            landed = await asyncio.get_running_loop().run_in_executor(self._copies, land_all, work,
                                                                      self.plane.pool.take)
            for landing, values in zip(landings, landed, strict=True):
                if isinstance(values, Exception):
                    for key, _ in landing.shards:
                        self.store.fail(key, as_error(values, f"storing {key}"))
                    continue
                for (key, _), value in zip(landing.shards, values, strict=True):
                    self.store.put(key, value, landing.nbytes)
        except Exception as exc:
            for landing in landings:
                for key, _ in landing.shards:
                    self.store.fail(key, as_error(exc, f"storing {key}"))

    def _spawn_copy(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run host-copy work (storing arrivals) in a task that ``AwaitIdle`` and a drain wait for."""
        self._copying += 1
        self._copied.clear()
        try:
            task = self.tasks.spawn(work, name=name)
        except RuntimeError:  # stopping: it never runs
            self._copy_ended()
            raise
        task.add_done_callback(self._copy_ended)  # done, failed or cancelled

    def _copy_ended(self, _task: object = None) -> None:
        self._copying -= 1
        if self._copying == 0:
            self._copied.set()

    def _store_value(self, key: str, device: int, value: np.ndarray | Ragged) -> None:
        if isinstance(value, Ragged):  # routed rows stay on the host until their expert pads them
            self.store.put(key, value, value.nbytes)
        elif value.nbytes >= HOST_COPY_INLINE_BYTES:
            self._spawn_copy(self._store_arrival(key, device, value), f"store-{key}")
        else:
            try:
                self._store_array(key, device, value)
            except Exception as exc:
                self.store.fail(key, as_error(exc, f"storing {key}"))

    async def _store_arrival(self, key: str, device: int, value: np.ndarray) -> None:
        try:
            await self._store_array_off_loop(key, device, value)
        except Exception as exc:
            self.store.fail(key, as_error(exc, f"storing {key}"))

    def _node_done(self, work: Work) -> None:
        """Report a completed computation (the core batches successes per run until the loop's next turns:
        a chain that ran in one go is one message).

        The batch leaves after the replies its outputs woke: an early fetch of the value a chain
        just made goes first, so the proxy forwards it before it takes the chain's completion
        (~0.5 ms for 128 nodes) and frees the chain's buffers (more again, here)."""
        self._handle(Completed(work.run_id, work.proxy, work.comp.node, work.comp.quiet, work.error, work.scheduler))

    def _nodes_done(self, run_id: str, proxy: str, scheduler: str, done: list[tuple[int, bool]]) -> None:
        """Report computations of one run that completed together (``Runner._run_chain``), as ``_node_done``."""
        self._handle(Completions(run_id, proxy, done, scheduler))

    # ------------------------------------------------------------ the JAX group

    def _join_group(self, peer: bytes, env: Envelope) -> Ok:
        """Restart into forming ``epoch`` of the island's JAX group, once the work here is done."""
        msg = env.message
        assert isinstance(msg, JoinGroup)
        if not self.config.collectives:
            raise InvalidArgument(f"executor {self.name} was not started with --collectives: it joins no JAX group")
        if self.name not in msg.members:
            raise InvalidArgument(f"forming {msg.epoch} of the JAX group does not name executor {self.name}")
        current = self.config.group_epoch if self.config.group is not None else 0
        if self.status is not Status.RUNNING:
            return Ok()  # leaving anyway
        if msg.epoch == current or (self._joining is not None and self._joining.epoch == msg.epoch):
            return Ok()  # asked again: already there, or on the way
        first = self._joining is None
        self._joining = msg  # the newest forming wins, if several arrive while the work here finishes
        if first:
            self.tasks.spawn(self._leave_for_group(), name="join-group")
        return Ok()

    def _fence(self, peer: bytes, env: Envelope) -> None:
        msg = env.message
        assert isinstance(msg, Fence)
        self._fences[msg.epoch] += 1
        self._fenced.set()

    async def _drained(self, going: str) -> None:
        """Wait until queued work has finished and what we sent has left (``going``: why, for the log)."""
        await self.runner.wait_idle()
        await self._sent.wait()
        await self._copied.wait()
        try:
            await asyncio.wait_for(self.plane.idle.wait(), timeout=5.0)
        except TimeoutError:
            log.warning("%d data batches were not acknowledged before %s", self.plane.in_flight, going)

    async def _wait_fences(self, epoch: int, watchers: int) -> None:
        while self._fences[epoch] < watchers:
            self._fenced.clear()
            await self._fenced.wait()

    async def _leave_for_group(self) -> None:
        await self._drained("restarting")
        msg = self._joining
        assert msg is not None
        log.info("restarting into forming %d of island %d's JAX group (%d members)", msg.epoch, self.config.island,
                 len(msg.members))
        # Not lost while away (the restart, JAX's import, then every member joining, takes seconds);
        # and every watcher fences: what it posted before arrives here, what it posts next waits for
        # our return (a message arriving while this process closes would be lost with it).
        grace = GroupConfig.timeout_seconds + 30.0
        try:
            reply = await self.peers.request(self.config.rm, LeavingForGroup(executor_id=self.name, epoch=msg.epoch,
                                                                             grace_seconds=grace),
                                             timeout_seconds=5.0)
            watchers = reply.count if isinstance(reply, Watchers) else 0
            await asyncio.wait_for(self._wait_fences(msg.epoch, watchers), timeout=5.0)
        except (PwmeshError, TimeoutError) as exc:
            log.warning("restarting into forming %d without every watcher's fence (%s): messages sent here "
                        "meanwhile may be lost", msg.epoch, exc)
        await self._drained("restarting")  # what arrived before the fences (a move to send, say) is done too
        await self.peers.barrier(timeout_seconds=5.0)  # completions delivered
        self.restart = [
            "--listen", self.control.address, "--data-listen", self.plane.address,
            *(["--metrics-port", str(self.metrics.port)] if self.metrics is not None else []),  # the same again
            "--name", self.name, "--jax-coordinator", msg.coordinator,
            "--jax-processes", str(len(msg.members) + 1), "--jax-process-id", str(msg.members.index(self.name) + 1),
            "--group-epoch", str(msg.epoch), "--group-members", ",".join(msg.members),
        ]
        self.ctx.linger_on_close_ms = 2000
        self.ctx.keep_listeners = True  # for the next process (``listeners``)  # requests still waiting here are answered Unavailable: let that leave
        asyncio.get_running_loop().create_task(self.close(), name="close-to-restart")  # noqa: RUF006 - run() awaits it

    def _spill(self) -> None:
        """Move everything that must outlive the restart to host memory (``restart`` gets where)."""
        index = {d: i for i, d in enumerate(self.devices)}
        values: list[tuple[str, int, Any, int]] = []
        for key, value, nbytes in self.store.held():
            if isinstance(value, Ragged):
                values.append((key, 0, value, nbytes))
            else:
                device = next(iter(value.devices()))
                values.append((key, index.get(device, 0), np.asarray(value), nbytes))
        directory = spill.spill_directory(self.name)
        spill.save(spill.Saved(values=values, failures=self.store.failures(), tombstones=self.store.tombstones(),
                               functions=list(self._registered.values()), gangs=self.runner.gangs.saved(),
                               expected_seq=self.state.expected_seq(), requeue=self._requeue), directory)
        assert self.restart is not None
        self.restart += ["--resume-from", str(directory)]
        log.info("moved %d buffers (%d bytes) to host memory for the restart", len(values),
                 sum(v[3] for v in values))

    def _resume(self, directory: Path) -> None:
        """Take back what ``_spill`` saved before this process restarted into its group's forming."""
        saved = spill.load(directory)
        for key, device, value, nbytes in saved.values:
            if isinstance(value, Ragged):
                self.store.put(key, value, nbytes)
            else:
                self.store.put(key, jax.device_put(value, self.devices[device]), nbytes)
        for key, exc in saved.failures.items():
            self.store.fail(key, exc)
        self.store.bury(saved.tombstones)
        for fn in saved.functions:
            self.functions.register(fn.fn_id, fn.exported, fn.spmd, fn.mesh, fn.axes, fn.donate)
            self._registered[fn.fn_id] = fn
        for gang in saved.gangs:
            self.runner.gangs.register(gang)
        self.state.expect(saved.expected_seq)
        self._requeue = saved.requeue  # queued once this process serves (``_queue_again``)
        spill.remove(directory)
        log.info("took back %d buffers and %d functions after restarting into forming %d", len(saved.values),
                 len(saved.functions), self.config.group_epoch)

    # ------------------------------------------------------------------ leaving

    async def drain(self) -> None:
        """Let every queued computation finish (and its results leave) before closing."""
        if self.restart is not None:  # idle already; not leaving the cluster, only restarting
            return
        try:
            await asyncio.wait_for(self._drained("leaving"), timeout=self.config.stop_wait_seconds)
        except TimeoutError:
            self._abandon()
        await self.peers.barrier(timeout_seconds=5.0)
        # Leave on purpose, so clients learn at once that this host's objects are gone.
        try:
            await self.peers.request(self.config.rm, UnregisterExecutor(executor_id=self.name, reason="drained"),
                                     timeout_seconds=2.0)
        except PwmeshError as exc:
            log.warning("could not unregister from the resource manager: %s", exc)

    def _abandon(self) -> None:
        """Fail what is still under way, naming the stop: the callers learn why now, not at a timeout."""
        why = f" ({self.stop_reason})" if self.stop_reason else ""
        running = self.runner.running(time.time())
        self.abandoned = self.runner.abandon(Unavailable(
            f"executor {self.name} stopped{why} before this computation finished; its outputs are lost"))
        if self.abandoned:
            log.warning("stopping%s: gave up %d computations not finished after %g s%s", why, self.abandoned,
                        self.config.stop_wait_seconds, "".join(f"; {line}" for line in running))
        # Their failures were sent as they were given up; what else completed leaves before the barrier.
        self._handle(Flush())

    async def close(self) -> None:
        await super().close()
        if hasattr(self, "_copies"):
            self._copies.shutdown(wait=False, cancel_futures=True)
        if self.restart is not None:  # sockets closed: nothing more can arrive
            self._spill()
        if hasattr(self, "runner"):
            await self.runner.aclose()
        if hasattr(self, "functions") and self.functions.sandbox is not None:
            self.functions.sandbox.close()
        if hasattr(self, "plane"):
            self.plane.close(keep_listener=self.restart is not None)

    def ready_info(self) -> dict[str, Any]:
        return {**super().ready_info(), "address": self.control.address, "data": self.plane.address,
                "island": self.config.island, "devices": len(self.devices),
                "group_epoch": self.config.group_epoch if self.config.group is not None else 0,
                "group_size": len(self.config.group_members) if self.config.group is not None else 0}

