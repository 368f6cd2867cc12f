"""Every message type, in one place, grouped by the daemon that receives it (the records they
carry are in ``pwmesh.wire.records``, and importable from here too).

A message is a ``Record`` with an ``op`` tag; defining a subclass registers it.
Keys of object-store entries are strings ``"<owner>/<buffer>/<shard>"`` (see
``pwmesh.ir.keys``).
"""

from __future__ import annotations

import dataclasses
import itertools
import struct
from typing import Any, ClassVar

import msgpack
import numpy as np

from pwmesh.errors import ProtocolError
from pwmesh.wire.records import (  # noqa: F401 - re-exported: records travel inside messages
    ClusterState,
    Computation,
    DeviceInfo,
    Emit,
    ErrorInfo,
    ExecutorInfo,
    GangRange,
    NodeSpec,
    PhysicalDevice,
    ProgramInput,
    ProgramSpec,
    SchedulerInfo,
    SessionInfo,
    Sharding,
    ShardRun,
    Site,
    SliceInfo,
    Target,
    TraceEvent,
    ValueSpec,
)
from pwmesh.wire.schema import Record, record

_REGISTRY: dict[str, type[Message]] = {}
_unpack = msgpack.unpackb


class Message(Record):
    """A record with an ``op``; subclasses register themselves by op."""

    __slots__ = ()
    op: ClassVar[str] = ""

    def __init_subclass__(cls, op: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if op:
            if op in _REGISTRY:
                raise TypeError(f"op {op!r} registered twice")
            cls.op = op
            _REGISTRY[op] = cls
        elif "op" in cls.__dict__ and cls.__qualname__ == getattr(_REGISTRY.get(cls.op), "__qualname__", None):
            # ``dataclass(slots=True)`` rebuilds the class: the registry keeps the final one.
            _REGISTRY[cls.op] = cls


def message_types() -> dict[str, type[Message]]:
    return _REGISTRY


# ------------------------------------------------------------------ everywhere


@record
class Error(Message, op="error"):
    code: str
    message: str
    traceback: str = ""


@record
class Ok(Message, op="ok"):
    pass


@record
class Ping(Message, op="ping"):
    pass


@record
class Pong(Message, op="pong"):
    role: str
    name: str
    status: str = ""


@record
class Heartbeat(Message, op="heartbeat"):
    role: str
    name: str


# ---------------------------------------------------------- resource manager


@record
class RegisterExecutor(Message, op="rm.register_executor"):
    info: ExecutorInfo


@record
class ClaimProxy(Message, op="rm.claim_proxy"):
    """A proxy asks to be the cluster's active one, whose sessions are the clients'. Granted if there is none,
    if it is the active one (restarted under its name), or if the active one is lost (missed heartbeats);
    the others are standbys (``pwmesh-proxy --standby``) until then."""

    name: str
    address: str


@record
class ProxyLease(Message, op="rm.proxy_lease"):
    """Who the active proxy is: the answer to ``ClaimProxy``, and to every proxy's heartbeat."""

    active: bool  # the asker is it
    holder: str  # its name ("": none)
    address: str  # where it serves


@record
class ProxyLost(Message, op="rm.proxy_lost"):
    """The active proxy missed its heartbeats: a standby may claim the lease now."""

    name: str
    address: str
    reason: str


@record
class RegisterScheduler(Message, op="rm.register_scheduler"):
    info: SchedulerInfo


@record
class UnregisterExecutor(Message, op="rm.unregister_executor"):
    """An executor leaving on purpose (it drained); its objects are gone with it."""

    executor_id: str
    reason: str


@record
class WatchCluster(Message, op="rm.watch_cluster"):
    """Subscribe this connection to notifications (``ExecutorLost``, ``SliceRemapped``).

    A proxy also hands over the slices its sessions hold, so a restarted resource
    manager rebuilds its map from them."""

    role: str
    name: str
    slices: list[SliceInfo] = dataclasses.field(default_factory=list)


@record
class SchedulerLost(Message, op="rm.scheduler_lost"):
    """An island's scheduler missed its heartbeats: what went through it will not run."""

    island: int
    address: str
    reason: str


@record
class SchedulerJoined(Message, op="rm.scheduler_joined"):
    island: int
    address: str


@record
class ExecutorJoined(Message, op="rm.executor_joined"):
    """An executor registered: new, back from the dead, or restarted into its JAX group's next forming."""

    executor_id: str
    control: str
    island: int = -1
    group: str = ""
    group_epoch: int = 0
    fresh: bool = False  # a new process under this name: what peers keep per executor starts over


@record
class LeavingForGroup(Message, op="rm.leaving_for_group"):
    """An executor about to restart into forming ``epoch`` of its island's JAX group: not lost for
    ``grace_seconds`` (the restart takes seconds), and every watcher is told (``ExecutorRestarting``).
    The reply (``Watchers``) says how many ``Fence`` messages to wait for before going."""

    executor_id: str
    epoch: int
    grace_seconds: float


@record
class Watchers(Message, op="rm.watchers"):
    count: int


@record
class ExecutorRestarting(Message, op="rm.executor_restarting"):
    """To watchers: the executor restarts into forming ``epoch``. Post it a ``Fence``, then hold
    what would go there until it registers again (``ExecutorJoined``) or is lost: a message arriving
    while it closes would be lost with its old process."""

    executor_id: str
    control: str
    epoch: int


@record
class PleaseRegister(Message, op="rm.please_register"):
    """The resource manager does not know the sender (it restarted): register again. ``written_off``: it
    knew the sender and declared it lost (why): everyone wrote off what it held and was doing, so it
    starts over (``Executor._start_over``) and registers as a new executor."""

    written_off: str = ""


@record
class DeviceMove(Record):
    index: int  # which virtual device of the slice
    old: PhysicalDevice
    new: PhysicalDevice


@record
class SliceRemapped(Message, op="rm.slice_remapped"):
    """A slice's virtual devices now live elsewhere (or, with ``slice.broken``, nowhere)."""

    slice: SliceInfo
    moves: list[DeviceMove]
    reason: str


@record
class DrainExecutor(Message, op="rm.drain_executor"):
    """Move every virtual device off this executor; no new slice lands on it."""

    executor: str  # executor id or host label
    # Names the request; with ``cancel``, its caller gave up waiting: the drain it asked for is undone
    # (no longer draining) or, not arrived yet, refused when it does.
    request: str = ""
    cancel: bool = False


@record
class ExecutorLost(Message, op="rm.executor_lost"):
    """An executor is gone, with where its slices went: one message, so no receiver ever
    acts between the loss and the remap (a retry that came in between would find the
    slices still mapped to the dead host)."""

    executor_id: str
    host: str
    control: str
    reason: str
    graceful: bool = False  # it drained: everything it sent has left
    remapped: list[SliceRemapped] = dataclasses.field(default_factory=list)  # applied after the loss


@record
class AllocateSlice(Message, op="rm.allocate_slice"):
    owner: str
    devices: int
    island: int | None = None
    kind: str = ""  # see CreateSlice
    # Names this request: a caller that gave up waiting releases what it made (``ReleaseSlices.requests``),
    # so a request that arrives late (the RM was down) leaves no slice nobody holds.
    request: str = ""


@record
class SliceAllocated(Message, op="rm.slice_allocated"):
    slice: SliceInfo


@record
class ReleaseSlices(Message, op="rm.release_slices"):
    owner: str
    slice_ids: list[int] | None = None
    requests: list[str] = dataclasses.field(default_factory=list)  # what these AllocateSlices made, or will


@record
class VacateSlices(Message, op="rm.vacate_slices"):
    """Suspend these slices of ``owner``: their devices are free for others (``SliceInfo.suspended``)."""

    owner: str
    slice_ids: list[int]


@record
class RegrantSlices(Message, op="rm.regrant_slices"):
    """Place these slices of ``owner`` anew, keeping their ids: a resume, or a reshape (``devices``: that many
    devices, for one slice; 0: as many as it had), in its island unless ``island`` is given."""

    owner: str
    slice_ids: list[int]
    devices: int = 0
    island: int | None = None


@record
class SlicesUpdated(Message, op="rm.slices_updated"):
    slices: list[SliceInfo]


@record
class DrainStarted(Message, op="rm.drain_started"):
    executor_id: str
    control: str
    remapped: int  # slices moved off it


@record
class GetClusterState(Message, op="rm.get_cluster_state"):
    pass


@record
class ClusterStateReply(Message, op="rm.cluster_state"):
    state: ClusterState


# ---------------------------------------------------------- island scheduler


@record
class DeviceRange(Record):
    """Devices ``[first, first + count)`` of one executor (compact, like ``ShardRun``)."""

    first: int
    count: int = 1


@record
class RunPart(Record):
    """One executor's computations of a run. The proxy encodes them once (``wire.pack_records``);
    the island scheduler orders the run by the devices they use and forwards the bytes unread."""

    executor_id: str
    control: str
    devices: list[DeviceRange]  # every device its computations use
    nodes: list[int]  # its computations' nodes, in order
    computations: bytes  # list[Computation], packed
    # The run's buffer names its computations refer to as "@<k>" (a cached lowering's part, packed once
    # and sent again for every run of its program); empty: they name their buffers themselves.
    names: list[str] = dataclasses.field(default_factory=list)
    # A part of an installed template (``InstallTemplate``): its "@<k>" stands for the run's
    # ``RunTemplate.names[refs[k]]``.
    refs: list[int] = dataclasses.field(default_factory=list)


@record
class InstallTemplate(Message, op="sched.install_template"):
    """A cached lowering's parts for one island (program x slice version), sent once before its first
    ``RunTemplate``: the scheduler keeps them to order its runs and hands each executor its part."""

    template_id: str  # random: unique across proxies and their restarts
    parts: list[RunPart]  # with ``refs``, no ``names``


@record
class RunTemplate(Message, op="sched.run_template"):
    """A run of an installed template: one small message per island, whatever its executors."""

    template_id: str
    run_id: str
    proxy: str
    names: list[str]  # the run's buffer names its parts refer to (``RunPart.refs``)
    session: str = ""
    weight: float = 1.0
    priority: int = 0


@record
class NeedTemplate(Message, op="sched.need_template"):
    """An executor was sent a run of a template it does not hold (it restarted, or evicted it): the
    scheduler sends it its part again (``InstallPart``)."""

    template_id: str
    executor_id: str
    control: str  # where the executor is reached (used only if the scheduler no longer has the template)


@record
class ScheduleRun(Message, op="sched.schedule_run"):
    """One message per island per program run: every computation it holds there, per executor."""

    run_id: str
    proxy: str
    parts: list[RunPart]
    session: str = ""
    weight: float = 1.0
    priority: int = 0


@record
class RunPartDone(Message, op="sched.run_part_done"):
    """An executor finished its part of a run: frees the run's window slots, charges its client. It stands
    for every computation of the part: those not reported before (``NodeDone``) completed. The scheduler
    reports the run to its proxy once every executor of the island with a part has sent this (``IslandDone``)."""

    run_id: str
    executor_id: str
    device_seconds: float


@record
class FreeGroup(Record):
    """Buffers (``"<owner>/<buffer>"``) to delete on every executor at ``controls``."""

    buffers: list[str]
    controls: list[str]


@record
class FreeShards(Message, op="sched.free_shards"):
    """The proxy's frees for one island, in one message: the scheduler sends each executor named its
    ``DeleteShards`` (executors that drop alike buffers share a group: the names travel once)."""

    groups: list[FreeGroup]


@record
class GetSchedulerStats(Message, op="sched.get_stats"):
    pass


@record
class ClientUsage(Record):
    session: str
    weight: float
    priority: int
    device_seconds: float
    runs: int
    waiting: int


@record
class SchedulerStats(Message, op="sched.stats"):
    island: int
    policy: str
    next_seq: int
    clients: list[ClientUsage]


# ------------------------------------------------------------- host executor


@record
class RegisterFunction(Message, op="exec.register_function"):
    fn_id: str
    exported: bytes
    spmd: bool
    devices: list[int]
    mesh: list[int] = dataclasses.field(default_factory=list)  # SPMD: the mesh's axis sizes (empty: one axis)
    axes: list[str] = dataclasses.field(default_factory=list)  # and names, as the function was exported over
    donate: list[int] = dataclasses.field(default_factory=list)  # inputs it may consume (``donate_argnums``)


@record
class RegisterGang(Message, op="exec.register_gang"):
    """An SPMD gang spanning executors (a slice's devices at one version), named once per executor: the
    computations that run in it carry only ``gang_id`` (``Computation.gang``), so a part's bytes do not
    grow with the gang. ``gang_id`` is a hash of ``devices`` (``ir.lower.gang_id``)."""

    gang_id: str
    devices: list[GangRange]  # its mesh's devices in shard order, as runs per executor


@record
class Enqueue(Message, op="exec.enqueue"):
    """An executor's part of a run (``RunPart.computations`` as the proxy packed them), in island order."""

    run_id: str
    proxy: str
    nodes: list[int]
    computations: bytes  # list[Computation], packed; decoded by the executor only
    seqs: list[int] = dataclasses.field(default_factory=list)  # each computation's place in the island order
    names: list[str] = dataclasses.field(default_factory=list)  # RunPart.names: what "@<k>" stands for
    scheduler: str = ""  # where to report the part's completions (NodeDone, RunPartDone); "": to ``proxy``
    executor_seq: int = -1  # this executor's n-th Enqueue from that scheduler: restores order
    epoch: str = ""  # the scheduler instance: a restarted scheduler counts from 0 again
    # A run of an installed template: its id. ``computations`` (with ``refs``) come with the first run
    # the scheduler sends this executor; later ones carry only ``names`` (``InstallTemplate``).
    template: str = ""
    refs: list[int] = dataclasses.field(default_factory=list)
    # Where this part's completions go (``NodeDone``, ``RunPartDone``): the fan-out head it came through
    # (``FanOut``); "": to ``scheduler``. Its order and templates are still the scheduler's.
    report: str = ""


PACKED = np.dtype("<i8")  # a ``TemplateRun``'s packed integers: little-endian int64, one after another


def packed(values: Any) -> bytes:
    """Integers as a ``TemplateRun`` carries them."""
    return np.asarray(values, PACKED).tobytes()


@record
class TemplateRun(Record):
    """A run of an installed template, for a ``FanOut``'s parts said once (``FanOut.run``): all that differs
    by part is its nodes and its executor's running count; the rest is the run's, written once for the
    subtree. The parts' places in the island order follow one another from ``seq`` (part 0's first), as a
    template's parts do in a run. The per-part integers travel packed (``PACKED``), so a head reads and
    cuts them as bytes, not as thousands of checked values: part ``i`` has ``counts[i]`` nodes, the next
    ones of ``nodes``."""

    proxy: str
    names: list[str]  # the run's buffer names (``RunTemplate.names``)
    scheduler: str
    epoch: str
    template: str
    seq: int  # part 0's first place in the island order
    counts: bytes  # each part's number of nodes
    nodes: bytes  # every part's nodes, part after part
    executor_seqs: bytes  # each part's ``executor_seq``

    def problem(self, parts: int) -> str:
        """What does not line up with ``parts`` parts ("": nothing)."""
        if len(self.counts) != 8 * parts or len(self.executor_seqs) != 8 * parts:
            return f"{len(self.counts)} bytes of counts and {len(self.executor_seqs)} of executor_seqs"
        counts = _unpack_ints(self.counts)
        if len(self.nodes) % 8 or min(counts, default=0) < 0 or sum(counts) != len(self.nodes) // 8:
            return f"counts of {sum(counts)} nodes and {len(self.nodes)} bytes of nodes"
        return ""

    def cut(self, ranges: list[tuple[int, int]]) -> list[TemplateRun]:
        """Parts ``[i, j)`` of it for each range (the child subtrees'), each with its own ``seq``."""
        ends = list(itertools.accumulate(_unpack_ints(self.counts)))  # each part's nodes end here
        out = []
        for i, j in ranges:
            a, b = ends[i - 1] if i else 0, ends[j - 1]
            out.append(TemplateRun(proxy=self.proxy, names=self.names, scheduler=self.scheduler, epoch=self.epoch,
                                   template=self.template, seq=self.seq + a, counts=self.counts[8 * i:8 * j],
                                   nodes=self.nodes[8 * a:8 * b], executor_seqs=self.executor_seqs[8 * i:8 * j]))
        return out

    def first(self, run_id: str, report: str) -> Enqueue:
        """Part 0's ``Enqueue``, its completions going to ``report`` ("": the scheduler)."""
        (count,), (executor_seq,) = _INT64.unpack_from(self.counts), _INT64.unpack_from(self.executor_seqs)
        return Enqueue(run_id=run_id, proxy=self.proxy, nodes=_unpack_ints(self.nodes, count), computations=b"",
                       seqs=list(range(self.seq, self.seq + count)), names=self.names, scheduler=self.scheduler,
                       executor_seq=executor_seq, epoch=self.epoch, template=self.template, report=report)

    def unpacked(self) -> tuple[list[list[int]], list[int]]:
        """Each part's nodes and ``executor_seq`` (to read it: the relay cuts it as bytes)."""
        nodes = _unpack_ints(self.nodes)
        ends = list(itertools.accumulate(_unpack_ints(self.counts)))
        return [nodes[a:b] for a, b in zip([0, *ends], ends, strict=False)], _unpack_ints(self.executor_seqs)


_INT64 = struct.Struct("<q")


def _unpack_ints(data: bytes, count: int | None = None) -> list[int]:
    """The first ``count`` (None: all) packed integers of ``data`` (a ``TemplateRun``'s)."""
    n = len(data) // 8 if count is None else count
    return list(struct.unpack_from(f"<{n}q", data))


@record
class FanOut(Message, op="exec.fan_out"):
    """A large run's parts for one subtree of its executors (``scheduler/tree.py``), sent to the subtree's
    head: part 0 is the head's own, then each child subtree's in preorder (``sizes[i]``: part i's subtree,
    itself included; 1: a leaf). The head takes its own part, sends each child its slice of the parts as a
    ``FanOut`` of its own (a leaf's: of one), and reports the completions its children report to it up to
    ``parent`` as ``PartsDone`` (``executor/fanout.py``); its own part reports to ``parent`` too ("" in its
    ``report`` when that is the scheduler).

    The parts come one of two ways. A run of a template every executor holds comes as ``run``: the run's
    fields once, and per part only its nodes and ``executor_seq``, packed (``TemplateRun``), so neither the
    scheduler nor a head handles a body per executor. Any other run's parts travel as ``bodies``: each
    ``Enqueue`` encoded, opaque to the heads it passes (a head decodes only its own, ``enqueue_body``, and
    sends each child its slice unread). The sender may give ``parts`` instead of ``bodies`` (the scheduler:
    the Enqueues the order made): they are encoded into ``bodies`` when the message is, once each, after
    the bodies given; ``parts`` never travels (a frame that holds it is refused)."""

    run_id: str
    parent: str  # where the head's ``PartsDone`` go: the scheduler, or the head above
    bodies: list[bytes]  # each part's ``Enqueue`` body (``enqueue_body``), never decoded on the way
    executors: list[str]  # each part's executor
    controls: list[str]  # where each part's executor is reached
    sizes: list[int]
    run: TemplateRun | None = None  # the parts, said together (then ``bodies`` is empty)
    # (the sender's only, never on the wire: see above)
    parts: list[Enqueue] = dataclasses.field(default_factory=list, metadata={"wire": False})

    def to_wire(self) -> dict[str, Any]:
        bodies = list(self.bodies)
        if self.parts:
            pack = msgpack.Packer().pack  # one packer for all (a packb each costs ~10% more)
            bodies += [pack(p.to_wire()) for p in self.parts]
        return {"run_id": self.run_id, "parent": self.parent, "bodies": bodies, "executors": list(self.executors),
                "controls": list(self.controls), "sizes": list(self.sizes),
                "run": None if self.run is None else self.run.to_wire()}

    @classmethod
    def from_wire(cls, data: Any, path: str = "") -> FanOut:
        if isinstance(data, dict) and "parts" in data:
            raise ProtocolError(f"{path or 'FanOut'}.parts: a FanOut's parts travel as bodies")
        return Record.from_wire.__func__(cls, data, path)  # type: ignore[attr-defined, no-any-return]

    def count(self) -> int:
        """How many parts it carries (its subtree's executors)."""
        return len(self.executors) if self.run is not None else len(self.bodies) + len(self.parts)


def enqueue_body(data: bytes, what: str = "part") -> Enqueue:
    """An ``Enqueue`` from its encoded body (a ``FanOut``'s ``bodies[i]``), validated like any message;
    ``ProtocolError`` on anything wrong."""
    try:
        body = _unpack(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise ProtocolError(f"unreadable {what}: {type(exc).__name__}: {exc}") from None
    return Enqueue.from_wire(body, what)


@record
class PartsDone(Message, op="sched.parts_done"):
    """What a fan-out head's subtree reported of a run, sent up once: ``ended``, the executors whose part
    ended (each's ``RunPartDone``), with their device seconds summed; ``reports``, their ``NodeDone``s
    unchanged (a failure goes up at once, in a ``PartsDone`` of its own with ``last`` false). ``last``:
    every part of the head's subtree is in (its last word on the run). ``lost``: the answer to
    ``SubtreeLost``: the executor named there is gone, and what of its subtree is not in ``ended`` (now or
    before) never will be."""

    run_id: str
    head: str  # the executor sending it
    ended: list[str] = dataclasses.field(default_factory=list)
    device_seconds: float = 0.0
    reports: list[NodeDone] = dataclasses.field(default_factory=list)
    last: bool = True
    lost: str = ""


@record
class FanOutFrees(Message, op="exec.fan_out_frees"):
    """The island's frees (``FreeShards``) for a subtree of executors wider than the fan-out width: the
    receiver (``controls[0]``) deletes ``buffers`` and sends each child subtree its slice (``sizes`` as in
    ``FanOut``; a leaf gets a ``DeleteShards``)."""

    buffers: list[str]
    controls: list[str]
    sizes: list[int]


def subtree_frees(buffers: list[str], controls: list[str], sizes: list[int],
                  start: int = 0) -> list[tuple[str, Message]]:
    """The frees of ``buffers`` for each subtree of a preorder tree (``controls``; ``sizes[i]``: the subtree
    ``controls[i]`` heads) from ``start`` on: a ``FanOutFrees`` to each subtree's head, a ``DeleteShards`` to a
    subtree of one (the scheduler, from 0; a head, for its children, from 1). A size under 1 counts as 1."""
    out: list[tuple[str, Message]] = []
    i, n = start, len(controls)
    while i < n:
        size = max(1, sizes[i])
        if size == 1:
            out.append((controls[i], DeleteShards(buffers=buffers)))
        else:
            out.append((controls[i], FanOutFrees(buffers=buffers, controls=controls[i:i + size],
                                                 sizes=sizes[i:i + size])))
        i += size
    return out


@record
class SubtreeLost(Message, op="exec.subtree_lost"):
    """The scheduler to a fan-out head: ``executor_id`` below it is gone; stop waiting for its subtree in
    ``run_ids`` and say what of it had ended (``PartsDone`` with ``lost``)."""

    executor_id: str
    run_ids: list[str]


@record
class InstallPart(Message, op="exec.install_part"):
    """An executor's part of a template, sent again on its ask (``NeedTemplate``); ``missing``: the
    scheduler no longer has it, and the runs waiting for it fail with that."""

    template_id: str
    nodes: list[int] = dataclasses.field(default_factory=list)
    computations: bytes = b""
    refs: list[int] = dataclasses.field(default_factory=list)
    missing: str = ""


@record
class PutShards(Message, op="exec.put_shards"):
    keys: list[str]
    devices: list[int]
    arrays: list[np.ndarray]


@record
class SendShards(Message, op="exec.send_shards"):
    """Send this executor's shards ``runs`` of buffer ``prefix`` as ``emits`` say (moves, reshards)."""

    prefix: str
    runs: list[ShardRun]
    emits: list[Emit]
    run_id: str = ""  # the run it is part of ("": a drain's move), which fails if what it sends is lost
    proxy: str = ""  # where that run's losses are reported (``DataLost``)


@record
class Move(Record):
    """One buffer's part of a ``SendMoves``: this executor's shards ``runs`` of ``prefix``, sent as ``emits`` say."""

    prefix: str
    runs: list[ShardRun]
    emits: list[Emit]


@record
class SendMoves(Message, op="exec.send_moves"):
    """A run's moves from this executor, every buffer of it in one message (a weight sync of 65 arrays: one,
    not 65 ``SendShards``): sent in one pass, the tuples for each destination batched across buffers. The
    run fails if what it sends is lost (``DataLost`` to ``proxy``)."""

    moves: list[Move]
    run_id: str
    proxy: str


@record
class FetchShards(Message, op="exec.fetch_shards"):
    keys: list[str]


@record
class ExpectShards(Message, op="exec.expect_shards"):
    """Session ``session``'s client will send these shards over the data plane (a direct put): take
    them from a stream keyed ``data_key`` (``Ok``), or refuse now (``ResourceExhausted``: they do not fit)."""

    session: str
    data_key: bytes
    keys: list[str]
    devices: list[int]
    shapes: list[list[int]]
    dtype: str


@record
class PushShards(Message, op="exec.push_shards"):
    """Send these shards (each once it exists) to the data plane of session ``session``'s client at ``to``
    (a direct fetch), as one ``ShardBatch`` tagged ``tag``; ``Ok`` once it holds them."""

    session: str
    data_key: bytes
    to: str
    tag: str
    keys: list[str]
    indices: list[int]  # each shard's place in what the client assembles (``Layout.distinct()`` order)


@record
class ShardBatch(Message, op="data.shards"):
    """Data plane, between a client and an executor: a direct put's shards (``keys`` on ``devices``), or a
    direct fetch's (``indices``, for the request ``tag``)."""

    tag: str
    keys: list[str]
    arrays: list[np.ndarray]
    devices: list[int] = dataclasses.field(default_factory=list)
    indices: list[int] = dataclasses.field(default_factory=list)


@record
class ShardValues(Message, op="exec.shard_values"):
    arrays: list[np.ndarray]


@record
class DeleteShards(Message, op="exec.delete_shards"):
    """Delete every shard this executor holds of each buffer (``"<owner>/<buffer>"``): sent by the island's
    scheduler for the proxy (``FreeShards``), or by the proxy itself (a buffer of no live island)."""

    buffers: list[str]


@record
class SpillShards(Message, op="exec.spill_shards"):
    """Move every shard this executor holds of each buffer (``"<owner>/<buffer>"``) off its devices into host
    memory: their slice was suspended, its devices given to others (``SuspendSlices``). They stay readable;
    what reads them on a device copies them there."""

    buffers: list[str]


@record
class GetExecutorStats(Message, op="exec.get_stats"):
    pass


@record
class ListHeld(Message, op="exec.list_held"):
    """Every value this executor holds (``OwnedShards``): what a proxy reconciles with its buffers when the
    executor comes back from a stall it was declared lost in.

    With ``keys``, only those of them held *intact*: stored, not consumed by a computation they were
    donated to, and read by none running now (and the executor's cancelled runs never start, so none
    will): what a proxy gives back to the client when a run they were donated to was aborted."""

    keys: list[str] = dataclasses.field(default_factory=list)


@record
class ExecutorStats(Message, op="exec.stats"):
    executor_id: str
    objects: int
    bytes: int
    queued: list[int]
    outstanding: int
    functions: int
    executed: int
    memory_limit: int = 0  # bytes; 0: no limit
    waiting_for_memory: int = 0  # computations held back until memory is freed
    gang_waits: list[str] = dataclasses.field(default_factory=list)  # collectives that wait for peers
    running: list[str] = dataclasses.field(default_factory=list)  # on device threads now, and for how long
    loop_lag_max_seconds: float = 0.0  # the longest its event loop was held, since it started
    loop_stalls: list[list[float]] = dataclasses.field(default_factory=list)  # recent [wall clock, seconds] held
    direct_received_bytes: int = 0  # clients' direct puts stored here (``executor/direct.py``)
    direct_pushed_bytes: int = 0  # clients' direct fetches delivered from here
    tombstones: int = 0  # entries remembering deleted buffers (names and ranges): bounded, not one a buffer


@record
class AwaitIdle(Message, op="exec.await_idle"):
    """Reply once every queued computation and outgoing transfer is done and delivered."""


@record
class JoinGroup(Message, op="exec.join_group"):
    """From the island's scheduler: leave the JAX group and join its forming ``epoch`` (coordinator at
    ``coordinator``; ``members`` are processes 1..N in order, 0 is the coordinator). The executor
    finishes its queued work, moves its buffers to host memory, restarts its JAX runtime in the new
    group and registers again with ``group_epoch`` = ``epoch``."""

    epoch: int
    coordinator: str
    members: list[str]


@record
class Fence(Message, op="exec.fence"):
    """From a watcher told of ``ExecutorRestarting``: everything it posted here before has arrived
    (one ordered connection), and it holds what it posts next until this executor is back."""

    epoch: int


@record
class ForgetOwner(Message, op="exec.forget_owner"):
    """A session ended and its runs finished: its deleted keys will never arrive again."""

    prefix: str


@record
class ReclaimOwner(Message, op="exec.reclaim_owner"):
    """A restarted proxy takes a session's objects back (or frees an unclaimed session's): cancel its runs
    still here (their proxy is gone), and from now on drop any object of the owner that is neither held here
    now nor named with ``marker`` (what the new proxy names; "" with ``drop``). ``drop``: delete what is
    held too. The answer lists what is held (nothing with ``drop``)."""

    prefix: str  # "<owner>/"
    marker: str
    why: str  # what its cancelled runs fail with
    drop: bool = False


@record
class OwnedShards(Message, op="exec.owned_shards"):
    keys: list[str]
    devices: list[int]


@record
class CancelRun(Message, op="exec.cancel_run"):
    """Fail whatever of ``run_id`` has not run yet (a peer it depends on is gone)."""

    run_id: str
    error: ErrorInfo


@record
class LandingReport(Record):
    """A tuple's destination executor reports ``node`` of ``run_id`` done to ``proxy`` once its ``shards`` of
    the tuple's value are stored (a reshard node that lands its output with no computation: ``Target.node``)."""

    proxy: str
    run_id: str
    node: int
    shards: list[int]


@record
class DataTuple(Record):
    """One shard-tagged tuple and/or progress marker, for shard ``shard`` of ``prefix``.

    ``src`` is the producer, ``sources`` how many producers report to this shard,
    ``count`` (when >= 0) the marker: how many tuples ``src`` sends here in all.
    ``array`` holds a block (at ``offset``, per dimension, in the shard, for block moves); ``index``
    the rows' numbers for routed rows; ``error`` replaces the data when the
    producer failed."""

    prefix: str
    shard: int
    device: int
    src: int
    sources: int
    shape: list[int]
    dtype: str
    count: int = -1
    seq: int = -1  # -1: a marker alone
    offset: list[int] = dataclasses.field(default_factory=list)  # empty: at the shard's origin
    ragged: bool = False
    array: np.ndarray | None = None
    index: np.ndarray | None = None
    error: ErrorInfo | None = None
    # More destination shards of the same executor that get this very tuple, as [shard, device] each
    # (replicas of one block): its bytes travel once, and the receiver gives each its own copy.
    copies: list[list[int]] = dataclasses.field(default_factory=list)
    report: LandingReport | None = None  # who to tell once the value has landed here (a reshard node's output)


@record
class TupleBatch(Message, op="data.tuples"):
    """Data plane: the tuples one producer step sends one executor, batched in one message."""

    tuples: list[DataTuple]


@record
class NodeDone(Message, op="exec.node_done"):
    """Computations of one run that completed on an executor, all alike: done, or failed with ``error``.

    Sent to the island's scheduler that sent the part (to the proxy only for a part that came with no
    scheduler): failures at once, and completions someone outside the run may wait for (the program's
    outputs: ``Computation.quiet`` false) after the loop's turn, unless the part ended in the same turn
    (its ``RunPartDone`` stands for them). The scheduler forwards failures to the proxy unchanged
    (``IslandDone.error``), and the rest once every executor of the island completed the node."""

    run_id: str
    nodes: list[int]
    executor_id: str
    error: ErrorInfo | None = None


@record
class IslandDone(Message, op="proxy.island_done"):
    """An island's scheduler reports computations of a run to its proxy: one message per run per island
    once every executor with a part of it there has ended it (``RunPartDone``), listing the nodes not
    reported before; earlier, a node someone may wait for (a program output) once every executor of the
    island completed it; and at once, a failure an executor reported (``NodeDone.error``), ``executor_id``
    and ``error`` as the executor sent them. ``lost``: ``executor_id`` left the cluster (drained) before
    it ended its part: the run cannot finish (the proxy aborts it with ``error``)."""

    run_id: str
    scheduler: str
    nodes: list[int]
    executor_id: str = ""  # a failure's executor
    error: ErrorInfo | None = None
    lost: bool = False


@record
class TemplateMissing(Message, op="proxy.template_missing"):
    """An island's scheduler was sent a run of a template it does not hold (it restarted, or evicted it):
    nothing of the run was ordered there; the proxy installs the template again and sends the run again."""

    run_id: str
    template_id: str
    scheduler: str


@record
class DataLost(Message, op="exec.data_lost"):
    """Data a computation of ``run_id`` on ``executor_id`` sent never arrived (its stream broke, and so
    did every retry): what waits for it would wait for ever, so the run fails with ``error``."""

    run_id: str
    executor_id: str
    error: ErrorInfo


@record
class GetEvents(Message, op="debug.get_events"):
    """The newest ``limit`` (0: all kept) events the daemon's core handled, one line each (``EventLines``):
    ``pwmesh debug events``."""

    limit: int = 0
    raw: bool = False  # also the events themselves (``EventLines.recorded``), to replay in a test


@record
class RecordedEvent(Record):
    """One event of a core's log, replayable: a message it received, as its wire frames; or an event of
    the core's own with no fields (``kind``: its class name, e.g. ``Tick``); else only its ``line``."""

    time: float
    kind: str
    frames: list[bytes] = dataclasses.field(default_factory=list)
    line: str = ""


@record
class EventLines(Message, op="debug.events"):
    daemon: str
    lines: list[str]
    recorded: list[RecordedEvent] = dataclasses.field(default_factory=list)  # asked ``raw``


@record
class GetTrace(Message, op="exec.get_trace"):
    """The newest ``limit`` (0: all kept) computations that ended at or after ``since`` (wall clock)."""

    since: float = 0.0
    limit: int = 0


@record
class TraceEvents(Message, op="exec.trace_events"):
    executor_id: str
    island: int
    host: str
    devices: list[DeviceInfo]
    events: list[TraceEvent]


# --------------------------------------------------------------- client proxy


@record
class OpenSession(Message, op="proxy.open_session"):
    name: str
    weight: float = 1.0
    priority: int = 0


@record
class SessionOpened(Message, op="proxy.session_opened"):
    session_id: str
    heartbeat_interval_seconds: float
    session_timeout_seconds: float
    # What a client shows to take its session back from a restarted proxy (``ResumeSession``); "": this
    # proxy cannot resume sessions after a restart (it has no lasting secret).
    resume_token: str = ""
    # What the client's data plane and the executors key the session's direct transfers with ("": none).
    data_key: bytes = b""


@record
class CloseSession(Message, op="proxy.close_session"):
    pass


@record
class CreateSlice(Message, op="proxy.create_slice"):
    devices: int
    island: int | None = None
    kind: str = ""  # a platform (cpu, gpu, cuda, rocm, tpu) or part of a device kind ("H100"); "": any


@record
class SliceCreated(Message, op="proxy.slice_created"):
    slice: SliceInfo


@record
class SuspendSlices(Message, op="proxy.suspend_slices"):
    """Suspend these slices of the session (``Slice.suspend``): their devices are freed for others; their
    buffers stay readable; runs on them fail with ``SliceSuspended`` until they are resumed."""

    slice_ids: list[int]


@record
class ResumeSlices(Message, op="proxy.resume_slices"):
    """Put these slices of the session on devices granted anew, their buffers moved there (``Slice.resume``);
    with ``devices``, one slice reshaped to that many devices (``Slice.reshape``): ``mesh`` its new mesh's
    sizes, and each live buffer of it (``buffers``) laid out as ``shardings`` says (the others replicated)."""

    slice_ids: list[int]
    devices: int = 0
    island: int | None = None
    mesh: list[int] = dataclasses.field(default_factory=list)
    buffers: list[int] = dataclasses.field(default_factory=list)
    shardings: list[Sharding] = dataclasses.field(default_factory=list)


@record
class SuspendSession(Message, op="proxy.suspend_session"):
    """An admin's: suspend every slice of session ``session_id`` (``pwmesh suspend``)."""

    session_id: str


@record
class ResumeSuspended(Message, op="proxy.resume_suspended"):
    """An admin's: resume every suspended slice of session ``session_id`` (``pwmesh resume``)."""

    session_id: str


@record
class SlicesChanged(Message, op="proxy.slices_changed"):
    slices: list[SliceInfo]


@record
class RegisterProgramFunction(Message, op="proxy.register_function"):
    fn_id: str
    exported: bytes
    slice_id: int
    spmd: bool
    mesh: list[int] = dataclasses.field(default_factory=list)  # see ``RegisterFunction``
    axes: list[str] = dataclasses.field(default_factory=list)
    donate: list[int] = dataclasses.field(default_factory=list)


@record
class RegisterProgram(Message, op="proxy.register_program"):
    """A traced program, sent once per session; its runs then name it by ``program_id``."""

    program_id: str  # a digest of ``program`` (the client's, made once per trace); the first registration stands
    program: ProgramSpec
    # A big program comes in ``parts`` messages, in order (``part`` 0, 1, ...): each carries the next of its
    # values and nodes, the last its inputs and outputs; the proxy decodes each between other clients'
    # messages, where one 64 MiB message held its loop ~3.5 s.
    part: int = 0
    parts: int = 1


@record
class ResumedBuffer(Record):
    """One array a resuming client still holds: its id and what it is."""

    buffer: int
    spec: ValueSpec


@record
class ResumeSession(Message, op="proxy.resume_session"):
    """Take a session back after the proxy restarted: the client's live arrays and slices. What the executors
    hold of them is kept; arrays whose values are not all there fail with ``Unavailable`` naming the restart;
    whatever else the session held is freed."""

    session_id: str
    token: str
    name: str = ""
    weight: float = 1.0
    priority: int = 0
    buffers: list[ResumedBuffer] = dataclasses.field(default_factory=list)
    slices: list[int] = dataclasses.field(default_factory=list)
    # Arrays it dropped or donated lately: what it sent before the resume (a run, a release) may still name them.
    released: list[ResumedBuffer] = dataclasses.field(default_factory=list)
    # Its registrations, as it sent them: handled right after the resume, before anything else it sent.
    functions: list[RegisterProgramFunction] = dataclasses.field(default_factory=list)
    programs: list[RegisterProgram] = dataclasses.field(default_factory=list)


@record
class SessionResumed(Message, op="proxy.session_resumed"):
    heartbeat_interval_seconds: float
    session_timeout_seconds: float
    failed: list[int] = dataclasses.field(default_factory=list)  # buffers now failed: their values were not all there
    why: str = ""  # what they fail with
    # Requests (message ids) the client sent before the resume that this proxy held and answers after it.
    held: list[int] = dataclasses.field(default_factory=list)


@record
class RunProgram(Message, op="proxy.run_program"):
    """Run a program: the one registered as ``program_id``, or ``program`` itself (a one-off trace)."""

    inputs: list[ProgramInput]
    outputs: list[int]
    program: ProgramSpec | None = None
    program_id: str = ""  # the proxy caches a registered program's lowering under it
    sequential: bool = False  # dispatch each node only once its predecessors are done


@record
class PutBuffer(Message, op="proxy.put_buffer"):
    buffer: int
    slice_id: int
    array: np.ndarray
    sharding: Sharding | None = None  # None: equal blocks along the leading axis


@record
class AwaitBuffers(Message, op="proxy.await_buffers"):
    buffers: list[int]


@record
class QueryBuffers(Message, op="proxy.query_buffers"):
    buffers: list[int]


@record
class BuffersState(Message, op="proxy.buffers_state"):
    ready: list[bool]


@record
class PutDirect(Message, op="proxy.put_direct"):
    """A put whose bytes go from the client to the executors over the data plane, never through the proxy:
    the proxy checks it, names the shards, tells the executors to expect them, and answers where they go."""

    buffer: int
    slice_id: int
    shape: list[int]
    dtype: str
    sharding: Sharding | None = None


@record
class ShardPlaces(Message, op="proxy.shard_places"):
    """Where a direct put's shards go, in ``Layout.split`` order: data plane address, key, device."""

    addresses: list[str]
    keys: list[str]
    devices: list[int]


@record
class Fetch(Message, op="proxy.fetch"):
    buffer: int
    to: str = ""  # the client's data plane: the executors push the value there (a direct fetch)
    tag: str = ""  # what the pushed shards are tagged with


@record
class BufferValue(Message, op="proxy.buffer_value"):
    shards: list[np.ndarray]  # one per distinct block, in ``Layout.distinct()`` order
    pushed: int = 0  # a direct fetch: how many blocks were pushed to the client's data plane instead


@record
class FetchBuffers(Message, op="proxy.fetch_buffers"):
    """Several buffers' values in one request (``pw.get`` of many small arrays: a training loop's losses):
    ``BufferValues`` once every one is computed, or the first failure among them. The proxy asks each
    executor once for all of their shards it holds."""

    buffers: list[int]


@record
class BufferValues(Message, op="proxy.buffer_values"):
    shards: list[list[np.ndarray]]  # per buffer, as ``FetchBuffers`` lists them: ``BufferValue.shards``


@record
class ReleaseBuffers(Message, op="proxy.release_buffers"):
    buffers: list[int]


@record
class TakeBack(Message, op="proxy.take_back"):
    """Take back buffer ``buffer``, donated to a run that was aborted before it consumed it (``Ok``), or
    learn why not (``InvalidArgument``: it was consumed, or the run has not failed)."""

    buffer: int


@record
class GetStatus(Message, op="proxy.get_status"):
    pass


@record
class DrainHost(Message, op="proxy.drain_host"):
    """Move a host's virtual devices and buffers elsewhere, let its work finish."""

    executor: str  # executor id or host label


@record
class HostDrained(Message, op="proxy.host_drained"):
    executor_id: str
    slices: int
    buffers: int


@record
class StatusReply(Message, op="proxy.status"):
    cluster: ClusterState
    sessions: list[SessionInfo]
    executor_stats: list[ExecutorStats]
    # What the proxy has sent to dispatch and finish programs, ever (not status or fetch traffic):
    # with one node per sharded computation, flat in the number of devices.
    programs: int = 0
    dispatch_messages: int = 0
    dispatch_bytes: int = 0
    rm: str = ""  # the resource manager's address, as the proxy reaches it


@record
class GetClusterTrace(Message, op="proxy.get_cluster_trace"):
    """Every live executor's ``TraceEvents`` (see ``GetTrace``; ``limit`` is per executor)."""

    since: float = 0.0
    limit: int = 0


@record
class ClusterTrace(Message, op="proxy.cluster_trace"):
    executors: list[TraceEvents]
    limit: int  # the per-executor limit applied (the request's, or less so the reply fits one message)
    missing: list[str] = dataclasses.field(default_factory=list)  # live executors that did not answer
