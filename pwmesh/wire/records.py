"""The records messages carry: errors, the cluster's state, lowered computations,
programs and trace events. Re-exported by ``pwmesh.wire.messages``, which holds
the messages themselves."""

from __future__ import annotations

import dataclasses

import numpy as np

from pwmesh.errors import InvalidArgument, PwmeshError, error_class
from pwmesh.wire.schema import Record, record


@record
class ErrorInfo(Record):
    """An exception on the wire: its code picks the class it becomes again on the other side."""

    code: str
    message: str
    traceback: str = ""

    @classmethod
    def of(cls, exc: PwmeshError) -> ErrorInfo:
        return cls(code=exc.code, message=exc.message, traceback=exc.remote_traceback)

    def exception(self) -> PwmeshError:
        return error_class(self.code)(self.message, remote_traceback=self.traceback)


@record
class DeviceInfo(Record):
    index: int
    kind: str = "cpu"  # JAX's device kind ("cpu", "NVIDIA H100 80GB HBM3", "TPU v5 lite")
    platform: str = "cpu"  # what functions are exported for: cpu, cuda, rocm or tpu
    global_id: int = -1  # its JAX device id in the executor's JAX group now (it changes when the group re-forms)


@record
class ExecutorInfo(Record):
    executor_id: str
    island: int
    host: str
    control: str
    data: str
    devices: list[DeviceInfo]
    alive: bool = True
    draining: bool = False  # being emptied: no new slices land here
    pid: int = 0
    # The JAX multi-process group it belongs to ("island-N": its island's scheduler forms and re-forms
    # it; "" for none): SPMD computations may span the executors of one group, collectives joined by JAX.
    group: str = ""
    group_epoch: int = 0  # which forming of that group it is in now (0: not in one yet)
    # A process registering for its first time without saved state: nothing an earlier process under
    # this name held or was sent survives it (what peers keep per executor starts over). ``incarnation``
    # tells its retries from a new process.
    fresh: bool = False
    incarnation: str = ""


@record
class SchedulerInfo(Record):
    island: int
    address: str
    name: str = ""
    epoch: str = ""  # its instance (a new process, a new epoch): what the old one was ordering is lost with it


@record
class PhysicalDevice(Record):
    """Where one virtual device of a slice lives right now."""

    executor_id: str
    island: int
    host: str
    device: int
    control: str
    data: str
    group: str = ""  # the executor's JAX group ("" for none)
    platform: str = "cpu"  # cpu, cuda, rocm or tpu


@record
class SliceInfo(Record):
    slice_id: int
    owner: str
    island: int
    devices: list[PhysicalDevice]
    map_version: int
    scheduler: str
    broken: str = ""  # why some devices have no live backing (the island cannot replace them)
    kind: str = ""  # the kind of device asked for ("": any), which replacements must be too
    # Suspended (``Slice.suspend``): its devices count in nobody's load and are never remapped; ``devices`` says
    # where its shards wait until it is resumed onto devices granted anew.
    suspended: bool = False


@record
class SessionInfo(Record):
    session_id: str
    name: str
    buffers: int
    programs: int  # runs in flight
    weight: float = 1.0
    priority: int = 0
    registered: int = 0  # programs registered (traced once, run by id)
    lowered: int = 0  # program lowerings made (first run, new bindings, a remap)
    reused: int = 0  # runs that reused a cached lowering


@record
class ClusterState(Record):
    map_version: int
    executors: list[ExecutorInfo]
    schedulers: list[SchedulerInfo]
    slices: list[SliceInfo]


@record
class Sharding(Record):
    """How a value is cut over a slice's devices (``pwmesh.dataflow.layout.Layout`` without the shape):
    the slice's logical mesh (axis sizes, devices row-major) and, per dimension, the mesh axes (by
    index, major to minor) that split it; axes that split nothing replicate it."""

    mesh: list[int]
    spec: list[list[int]] = dataclasses.field(default_factory=list)


@record
class GangRange(Record):
    """Devices ``[first, first + count)`` of executor ``executor_id``, consecutive members of a gang's mesh
    (a device's JAX id depends on the group's current forming, so a gang names devices by executor)."""

    executor_id: str
    first: int
    count: int = 1


MAX_DEVICES = 1 << 16  # per executor: a device range or shard run beyond this is a bad message, not a big host


def check_runs(runs: list[ShardRun], what: str) -> None:
    """Refuse shard runs no executor could hold (a count of 2^62 would be expanded until memory runs out)."""
    for r in runs:
        if not (0 <= r.device < MAX_DEVICES and 0 <= r.shard < 1 << 62 and 1 <= r.count <= MAX_DEVICES):
            raise InvalidArgument(f"{what}: shard run (device {r.device}, shard {r.shard}, count {r.count}) is out "
                                  f"of range (at most {MAX_DEVICES} devices an executor)")


@record
class ShardRun(Record):
    """Shards ``[shard, shard + count)`` of a value on devices ``[device, device + count)`` of one executor.

    Layouts travel as runs, so a computation over 64 contiguous devices is described
    in as many bytes as one over 2 (the compact representation)."""

    device: int
    shard: int
    count: int = 1


@record
class Site(Record):
    """One executor's part of a layout: where its shards live and how to reach its data plane."""

    executor_id: str
    data: str
    host: str
    runs: list[ShardRun]


@record
class Target(Record):
    """Where an emitted value goes: shard ``j`` is stored under ``f"{prefix}/{j}"`` on its site."""

    prefix: str
    shards: int
    sites: list[Site]
    shape: list[int]  # one destination shard's shape (for a ragged value: its capacity)
    dtype: str
    sharding: Sharding | None = None  # its layout (None: ``shards`` equal blocks along the leading axis)
    # The reshard node (>= 0) whose output this is, landed straight under its name with no computation
    # of its own: each destination executor reports the node done once its shards of it are stored.
    node: int = -1


@record
class Emit(Record):
    """Send a value's local shards onward as shard-tagged tuples, with progress markers.

    ``mode``: ``"block"`` re-cuts blocks from the source layout (``src``, else ``src_shards``
    leading-axis blocks) into the target's (a copy when layouts match, else a reshard:
    n-dimensional blocks, replicas, gathers and scatters alike); ``"route"`` sends each row to the target its
    expert id (in ``selector``) names, with its row number; ``"scatter"`` sends rows
    back to the block of the target that holds their row number (combining routed
    rows in order). ``slot`` and ``selector`` index the computation's inputs, then
    its outputs."""

    mode: str
    rows: int  # the value's leading-axis length (all shards together)
    src_shards: int
    targets: list[Target]
    slot: int = 0
    selector: int = -1
    source: int = -1  # scatter: the producer id it reports as (its expert's index); -1: its shard
    shape: list[int] | None = None  # block: the value's global shape (None: ``rows`` by the target's block)
    src: Sharding | None = None  # block: the source layout (None: ``src_shards`` leading-axis blocks)


@record
class Computation(Record):
    """One node of a program on one executor. ``seq`` is its place in the island order.

    ``kind``: ``"call"`` runs ``fn_id``; ``"route"`` only emits (its inputs' rows, by
    expert); ``"identity"`` stores its inputs as its outputs (a combine's landing).
    Shard ``i``'s keys are ``f"{prefix}/{i}"`` for every prefix in ``inputs`` and ``outputs``."""

    node: int
    fn_id: str
    executor_id: str
    control: str
    runs: list[ShardRun]
    inputs: list[str]
    outputs: list[str]
    emits: list[Emit] = dataclasses.field(default_factory=list)
    spmd: bool = False
    kind: str = "call"
    donate: list[int] = dataclasses.field(default_factory=list)  # inputs whose buffers it may consume (reuse)
    # Inputs whose buffers the executor deletes (every shard of them it holds) once this computation has run
    # without error: it is their last reader there, and the proxy sends no delete for them when its node
    # succeeded (what it was donated; a batch sent with the run and read by it alone). A failure leaves them.
    frees: list[int] = dataclasses.field(default_factory=list)
    ragged: bool = False  # its inputs are routed rows: padded to the function's capacity, outputs cut back
    seq: int = -1
    # An SPMD computation spanning executors: the id of its gang (``RegisterGang``: all its devices, in
    # shard order, sent to each executor once per slice version); "" for none. Each executor runs its own
    # shards of it; their collectives join through the JAX group.
    gang: str = ""
    # None of its outputs is one of the program's: nobody outside its run waits for it, so the executor
    # reports its completion with the end of its part of the run, not at once (a chain of k nodes: one
    # NodeDone per executor, not k).
    quiet: bool = False

    def shards(self) -> list[tuple[int, int]]:
        """(device, shard) of every local shard, in order."""
        return [(r.device + k, r.shard + k) for r in self.runs for k in range(r.count)]

    def freed(self) -> list[str]:
        """The input buffers it frees once it ran (``frees``; an index out of range names none)."""
        return [self.inputs[k] for k in self.frees if 0 <= k < len(self.inputs)]


@record
class NodeSpec(Record):
    """One sharded computation of a program (one node, however many shards)."""

    fn_id: str
    slice_id: int
    inputs: list[int]
    outputs: list[int]
    # "call" (fn_id); "route": inputs [rows, expert ids] -> one ragged output per
    # expert, output k living on slice targets[k]; "combine": the experts' ragged
    # outputs -> one value in row order on slice_id.
    kind: str = "call"
    targets: list[int] = dataclasses.field(default_factory=list)
    # A call's inputs' layouts on its slice, one per input (empty: each in equal leading-axis blocks).
    in_shardings: list[Sharding] = dataclasses.field(default_factory=list)
    donate: list[int] = dataclasses.field(default_factory=list)  # inputs it consumes (``donate_argnums``)


@record
class ValueSpec(Record):
    """One logical, sharded buffer (an edge): global shape, dtype and shard count."""

    shape: list[int]
    dtype: str
    shards: int  # devices it lives on (one shard each, replicas included)
    ragged: bool = False  # routed rows: the leading axis is a capacity, the rows present vary per run
    sharding: Sharding | None = None  # how (None: ``shards`` equal blocks along the leading axis)


@record
class ProgramSpec(Record):
    values: list[ValueSpec]
    nodes: list[NodeSpec]
    inputs: list[int]
    outputs: list[int]


@record
class ProgramInput(Record):
    """A program argument: host data to scatter, or an existing buffer of the session."""

    array: np.ndarray | None = None
    buffer: int | None = None


@record
class TraceEvent(Record):
    """One computation an executor ran (all its local shards), for ``pwmesh trace``.

    Times are wall-clock seconds (``time.time()``) on the executor's host:
    ``arrived`` (all local devices at it), ``start`` (inputs, function and memory
    there: handed to the devices), ``end``."""

    run_id: str  # "<session id>:<n>..."
    node: int
    seq: int  # its place in the island order
    fn_id: str
    devices: list[int]  # the executor's device indices it ran on
    arrived: float
    start: float
    end: float
    error: str = ""
