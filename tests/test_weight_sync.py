"""Weight sync without a gather copy (issue #31 item 2): a column-split weight's blocks go to another
executor as the pieces of their rows, gathered by the socket's writes (``sendmsg``) or straight into a
shared-memory slot, never into a buffer of their own on the sender.

The geometry is checked against the copy it replaces (pure numpy); the bytes cross real data planes
(real sockets, real shared memory, in this process) and real daemons (a 2x2 trainer on one island to a
replicated sampler on another, TCP and shared memory).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pwmesh as pw
from pwmesh.dataflow.exchange import SEND_GATHERED_BYTES, Gathered, cut, cut_error
from pwmesh.dataflow.layout import Layout, plan
from pwmesh.dataflow.plane import DataPlane, recv_bytes, send_views
from pwmesh.dataflow.secure import plane_key
from pwmesh.ir.lower import Lowered, ShardLocation, lower
from pwmesh.sim.client import Call, Post, Script, SimClient
from pwmesh.sim.cluster import SimCluster, SimConfig
from pwmesh.sim.play import play
from pwmesh.wire import codec
from pwmesh.wire.messages import (
    AwaitBuffers,
    CreateSlice,
    DataTuple,
    Emit,
    ErrorInfo,
    LandingReport,
    NodeSpec,
    OpenSession,
    PhysicalDevice,
    ProgramInput,
    ProgramSpec,
    PutBuffer,
    RegisterProgram,
    RunProgram,
    Sharding,
    ShardRun,
    Site,
    SliceInfo,
    Target,
    TupleBatch,
    ValueSpec,
)

pytestmark = pytest.mark.timeout(60)


def column_emit(shape: list[int], split: int, executors: str = "b") -> Emit:
    """Dimension 1 of ``shape`` split over a trainer's 2x2 mesh ("model", the second axis), to a block
    replicated on two devices of each executor in ``executors``."""
    sites = [Site(executor_id=ex, data=f"tcp://{ex}:2", host=ex, runs=[ShardRun(device=0, shard=2 * k, count=2)])
             for k, ex in enumerate(executors)]
    target = Target(prefix="s/v", shards=2 * len(executors), sites=sites, shape=shape, dtype="float32",
                    sharding=Sharding(mesh=[2 * len(executors)], spec=[[] for _ in shape]))
    spec: list[list[int]] = [[] for _ in shape]
    spec[split] = [1]
    return Emit(mode="block", rows=shape[0], src_shards=4, targets=[target], shape=shape,
                src=Sharding(mesh=[2, 2], spec=spec))


def trainer_shards(x: np.ndarray, split: int) -> dict[int, np.ndarray]:
    spec: list[tuple[int, ...]] = [() for _ in x.shape]
    spec[split] = (1,)
    return {i: np.ascontiguousarray(block) for i, block in enumerate(Layout(x.shape, (2, 2), tuple(spec)).split(x))}


@pytest.mark.parametrize(("shape", "split"), [((256, 128), 1), ((64, 8, 32), 1), ((128, 4, 8, 4), 1)])
def test_a_block_gathered_for_another_executor_is_sent_from_its_pieces(shape: tuple[int, ...], split: int) -> None:
    """Rows of column blocks (a Megatron ``wq``'s heads too): no buffer on the sender, the same bytes."""
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    taken: list[int] = []

    def take(nbytes: int) -> np.ndarray:
        taken.append(nbytes)
        return np.empty(nbytes, np.uint8)

    shards = trainer_shards(x, split)
    sent = cut(column_emit(list(shape), split), shards, take=take, here="a")
    (data,) = [t for _, t in sent if t.array is not None]
    assert isinstance(data.array, Gathered) and taken == []
    assert data.copies == [[1, 1]]  # one block for both replicas
    np.testing.assert_array_equal(data.array.into(np.empty(x.nbytes, np.uint8)).view(np.float32).reshape(shape), x)
    # Views of the trainer's own shards, no copies: every byte comes from one of them.
    views = list(data.array.views())
    assert sum(v.nbytes for v in views) == x.nbytes and len(views) == 2 * shape[0]
    assert all(any(np.shares_memory(np.frombuffer(v, np.uint8), s) for s in shards.values()) for v in views)
    assert b"".join(views) == x.tobytes()  # what the socket's writes send
    np.testing.assert_array_equal(codec.Gather.into(data.array, np.empty(x.nbytes, np.uint8)).view(np.float32),
                                  x.reshape(-1))  # view by view, as any ``Gather``


def test_a_block_also_wanted_here_or_too_small_is_gathered_in_memory() -> None:
    """The executor that cuts keeps its own copy (it lands here too); a small block is one copy, not many
    tiny writes."""
    x = np.arange(256 * 128, dtype=np.float32).reshape(256, 128)
    shards = trainer_shards(x, 1)
    sent = cut(column_emit([256, 128], 1, executors="ab"), shards, here="a")
    arrays = {dest.executor_id: t.array for dest, t in sent if t.array is not None}
    assert isinstance(arrays["a"], np.ndarray) and isinstance(arrays["b"], Gathered)
    np.testing.assert_array_equal(arrays["a"], x)
    small = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    assert small.nbytes < SEND_GATHERED_BYTES
    (got,) = [t.array for _, t in cut(column_emit([8, 16], 1), trainer_shards(small, 1), here="a")
              if t.array is not None]
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, small)


def test_pieces_of_rows_and_columns_are_sent_in_the_blocks_order() -> None:
    """A 2x2 block split (rows and columns): the bands of rows each take their pieces in column order."""
    x = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    src, dst = Layout((64, 48), (2, 2), ((0,), (1,))), Layout.replicated((64, 48), 1)
    blocks = src.split(x)
    moves = plan(src, dst, (0,))
    pieces = [(np.ascontiguousarray(blocks[s]), p) for s, sends in moves.sends.items() for p in sends]
    gathered = Gathered.of((64, 48), np.dtype(np.float32), pieces)
    assert gathered is not None and len(gathered.bands) == 2
    np.testing.assert_array_equal(gathered.into(np.empty(x.nbytes, np.uint8)).view(np.float32).reshape(64, 48), x)
    # Not from a source that is not C-contiguous (its rows' runs are not where the geometry says).
    strided = [(np.asfortranarray(a), p) for a, p in pieces]
    assert Gathered.of((64, 48), np.dtype(np.float32), strided) is None


def test_send_views_writes_every_byte_in_order_across_iov_max() -> None:
    """More views than one ``sendmsg`` takes, and more bytes than a socket buffer holds."""
    parts = [np.full(3000 + i, i % 251, np.uint8) for i in range(2500)]
    want = np.concatenate(parts).tobytes()
    a, b = socket.socketpair()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(recv_bytes(b, len(want))))
    reader.start()
    try:
        send_views(a, iter(memoryview(p) for p in parts))
        reader.join(30)
        assert got == [want]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(("shared_memory", "key"), [(False, None), (True, None), (False, plane_key(b"s" * 40))],
                         ids=["tcp", "shm", "sealed"])
def test_a_gathered_block_crosses_a_real_data_plane(shared_memory: bool, key: bytes | None) -> None:
    """The receiver gets one contiguous array, as for an ndarray, by every path: the socket's writes
    gather it, or it is gathered into a shared-memory slot, or into a buffer to seal."""
    x = np.arange(512 * 256, dtype=np.float32).reshape(512, 256)
    sent = cut(column_emit([512, 256], 1), trainer_shards(x, 1), here="a")
    assert any(isinstance(t.array, Gathered) for _, t in sent)
    got: list[TupleBatch] = []
    arrived = threading.Event()

    def on_batch(batch: TupleBatch) -> None:
        got.append(batch)
        arrived.set()

    receiver = DataPlane(None, on_batch, shared_memory=shared_memory, key=key)
    sender = DataPlane(None, lambda b: None, shared_memory=shared_memory, key=key)
    try:
        sender.send(receiver.address, TupleBatch(tuples=[t for _, t in sent]))
        assert arrived.wait(30), "the batch never arrived"
        (data,) = [t for t in got[0].tuples if t.array is not None]
        np.testing.assert_array_equal(data.array, x)
        moved = receiver.bytes_moved()  # counted as read, before the batch is handed over
        assert moved[("received", "shm" if shared_memory else "tcp")] >= x.nbytes
    finally:
        sender.close()
        receiver.close()


def test_a_gathered_frame_is_encoded_as_an_array() -> None:
    """The codec sends a ``Gather`` as an array's frame; decoded, it is that array."""
    x = np.arange(256 * 128, dtype=np.float32).reshape(256, 128)
    (data,) = [t for _, t in cut(column_emit([256, 128], 1), trainer_shards(x, 1), here="a") if t.array is not None]
    frames = codec.encode(TupleBatch(tuples=[data]), msg_id=0)
    assert isinstance(frames[2], Gathered) and codec.frame_nbytes(frames[2]) == x.nbytes
    frames[2] = frames[2].into(np.empty(x.nbytes, np.uint8))
    message = codec.decode(frames).message
    assert isinstance(message, TupleBatch) and isinstance(message.tuples[0], DataTuple)
    np.testing.assert_array_equal(message.tuples[0].array, x)


# ------------------------------------------------------------------ a reshard node lowered with no computation

OWNER = "s"


def make_slice(slice_id: int, devices: list[tuple[str, int]], island: int = 0) -> SliceInfo:
    return SliceInfo(slice_id=slice_id, owner=OWNER, island=island, map_version=1, scheduler=f"sched{island}", devices=[
        PhysicalDevice(executor_id=ex, island=island, device=d, control=f"tcp://{ex}:1", data=f"tcp://{ex}:2",
                       host=ex) for ex, d in devices])


def lowered(program: ProgramSpec, slices: list[SliceInfo], *, bound: dict[int, list[ShardLocation]] | None = None,
            host_inputs: set[int] | None = None) -> Lowered:
    return lower(program, owner=OWNER, names=[f"v{i}" for i in range(len(program.values))],
                 host_inputs=host_inputs or set(), bound=bound or {}, slices={sl.slice_id: sl for sl in slices},
                 spmd={"f": False}, fresh_name=iter(f"d{k}" for k in range(100)).__next__)


def trainer_to_sampler() -> tuple[ProgramSpec, list[SliceInfo], dict[int, list[ShardLocation]]]:
    """v0, split 2 ways on executor a (island 0), resharded (node 0) onto 2 devices of b (island 1),
    replicated; node 1 reads the result there; node 2 reshards it again, to c."""
    trainer = make_slice(1, [("a", 0), ("a", 1)])
    sampler = make_slice(2, [("b", 0), ("b", 1)], island=1)
    other = make_slice(3, [("c", 0)], island=1)
    rows = ValueSpec(shape=[8, 3], dtype="float32", shards=2)
    whole = ValueSpec(shape=[8, 3], dtype="float32", shards=2, sharding=Sharding(mesh=[2], spec=[]))
    spec = ProgramSpec(values=[rows, whole, whole, ValueSpec(shape=[8, 3], dtype="float32", shards=1)],
                       nodes=[NodeSpec(kind="reshard", fn_id="", slice_id=2, inputs=[0], outputs=[1]),
                              NodeSpec(fn_id="f", slice_id=2, inputs=[1], outputs=[2],
                                       in_shardings=[Sharding(mesh=[2], spec=[])]),
                              NodeSpec(kind="reshard", fn_id="", slice_id=3, inputs=[1], outputs=[3])],
                       inputs=[0], outputs=[1, 2, 3])
    bound = {0: [ShardLocation("a", "tcp://a:1", "tcp://a:2", d, 0, "a") for d in range(2)]}
    return spec, [trainer, sampler, other], bound


def test_a_reshard_node_lands_its_output_with_no_computation() -> None:
    spec, slices, bound = trainer_to_sampler()
    low = lowered(spec, slices, bound=bound)
    nodes = {c.node for comps in low.schedules.values() for c in comps}
    assert nodes == {1}  # the call; neither reshard has a computation
    assert low.derived == []  # nor a buffer of its own: the blocks land under the output's name
    (send,) = low.moves["tcp://a:1"]
    ((target,),) = [e.targets for e in send.emits]
    assert (target.prefix, target.node, target.shards) == ("s/v1", 0, 2)
    # The second reshard's source is the first's output, which no computation makes: its holder sends it.
    (again,) = low.moves["tcp://b:1"]
    assert again.prefix == "s/v1" and [t.node for e in again.emits for t in e.targets] == [2]
    assert low.node_executors[0] == {"b"} and low.node_executors[2] == {"c"}
    assert low.landing == {"tcp://b:1", "tcp://c:1"}
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    out = play(spec, low, {"f": lambda a: a * 2}, owner=OWNER, names=[f"v{i}" for i in range(4)],
               bound={0: x}, bound_at=bound)
    np.testing.assert_array_equal(out[1], x)
    np.testing.assert_array_equal(out[2], x * 2)
    np.testing.assert_array_equal(out[3], x)


def test_a_reshard_with_nothing_to_move_or_from_the_host_keeps_its_computation() -> None:
    spec, slices, bound = trainer_to_sampler()
    from_host = lowered(spec, slices, host_inputs={0})
    assert {c.node: c.kind for comps in from_host.schedules.values() for c in comps if c.node == 0} == {0: "identity"}
    # Already laid out so on those devices: an identity computation names the blocks anew, nothing moves.
    same = ProgramSpec(values=[spec.values[0], spec.values[0]], inputs=[0], outputs=[1],
                       nodes=[NodeSpec(kind="reshard", fn_id="", slice_id=1, inputs=[0], outputs=[1])])
    low = lowered(same, slices, bound=bound)
    assert low.moves == {} and [c.kind for comps in low.schedules.values() for c in comps] == ["identity"]


def test_every_tuple_for_a_landed_reshard_says_whom_to_report_to() -> None:
    """Each destination executor is told its own shards of the value, data and failures alike."""
    x = np.arange(256 * 128, dtype=np.float32).reshape(256, 128)
    emit = column_emit([256, 128], 1, executors="bc")
    emit.targets[0].node = 7
    run = ("tcp://proxy:1", "run-1")
    for sent in (cut(emit, trainer_shards(x, 1), here="a", run=run),
                 cut_error(emit, [0, 1, 2, 3], ErrorInfo(code="internal", message="no"), run)):
        reports = {dest.executor_id: t.report for dest, t in sent}
        assert reports == {"b": LandingReport(proxy=run[0], run_id=run[1], node=7, shards=[0, 1]),
                           "c": LandingReport(proxy=run[0], run_id=run[1], node=7, shards=[2, 3])}
    assert all(t.report is None for _, t in cut(column_emit([256, 128], 1), trainer_shards(x, 1), run=run))


# ------------------------------------------------------------------ real daemons


@pytest.fixture(scope="module", params=[False, True], ids=["tcp", "shm"])
def two_islands(request: pytest.FixtureRequest) -> Iterator[pw.Client]:
    """Two islands of one executor of 4 devices, the executors' data planes by TCP or shared memory."""
    args = () if request.param else ("--no-shared-memory",)
    spec = pw.LocalClusterSpec(islands=2, hosts_per_island=1, devices_per_host=4, executor_args=args)
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address, name="test-weight-sync") as client:
        yield client


@pytest.mark.timeout(120)
def test_a_megatron_tree_reaches_a_replicated_sampler_on_another_island(two_islands: pw.Client) -> None:
    """Column-split weights big enough to go as gathered frames, row-split ones, a replicated one, twice
    (the second sync reuses the lowering and the receiver's pooled buffers)."""
    client = two_islands
    devs = client.make_virtual_device_set()
    trainer = devs.add_slice(devices=4, island=0, mesh={"data": 2, "model": 2})
    sampler = devs.add_slice(devices=2, island=1, mesh={"data": 2})
    rng = np.random.default_rng(0)
    tree = {"wq": rng.random((128, 8, 32), dtype=np.float32), "w1": rng.random((256, 512), dtype=np.float32),
            "w2": rng.random((512, 256), dtype=np.float32), "b1": rng.random((512,), dtype=np.float32),
            "ln": rng.random((256,), dtype=np.float32)}
    specs = {"wq": P(None, "model", None), "w1": P(None, "model"), "w2": P("model", None), "b1": P("model"),
             "ln": P()}
    on_trainer = client.put(tree, trainer, spec=specs)
    for _ in range(2):
        synced = pw.reshard(on_trainer, devices=sampler, spec=P())
        leaves = jax.tree_util.tree_leaves(synced)
        assert all(a.sharding.slice is sampler and a.sharding.spec == P() for a in leaves)
        got = client.fetch(leaves, timeout_seconds=60)
        for value, want in zip(got, jax.tree_util.tree_leaves(tree), strict=True):
            np.testing.assert_array_equal(value, want)
        for a in leaves:
            a.delete()


@pytest.mark.timeout(120)
def test_a_reshard_that_cannot_land_fails_its_node_and_the_next_one_lands() -> None:
    """No computation waits for the landing: the destination executor itself reports the node failed
    (here its memory limit refuses the value), and the client hears the cause."""
    spec = pw.LocalClusterSpec(islands=2, hosts_per_island=1, devices_per_host=4, memory_limit_bytes=4 << 20)
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address, name="test-weight-sync-refused") as client:
        devs = client.make_virtual_device_set()
        trainer = devs.add_slice(devices=4, island=0, mesh={"data": 2, "model": 2})
        sampler = devs.add_slice(devices=2, island=1, mesh={"data": 2})
        big = np.arange(768 * 1024, dtype=np.float32).reshape(768, 1024)  # 3 MiB: 6 MiB as 2 replicas
        on_trainer = client.put(big, trainer, spec=P("data", "model"))
        refused = pw.reshard(on_trainer, devices=sampler, spec=P())
        with pytest.raises(pw.ResourceExhausted, match="does not fit"):
            client.fetch([refused], timeout_seconds=60)
        small = big[:64]
        fits = pw.reshard(client.put(small, trainer, spec=P("data", "model")), devices=sampler, spec=P())
        (got,) = client.fetch([fits], timeout_seconds=60)
        np.testing.assert_array_equal(got, small)


def test_the_simulator_reports_a_landed_reshard_too() -> None:
    """The simulated executors report a reshard node with no computation as the real ones do: a weight sync
    every step from one island's slice to another's, awaited each time, with no computation at all."""
    cluster = SimCluster(SimConfig(islands=2, hosts_per_island=1, devices_per_host=2))
    rows = ValueSpec(shape=[16, 8], dtype="float32", shards=2)
    whole = ValueSpec(shape=[16, 8], dtype="float32", shards=2, sharding=Sharding(mesh=[2], spec=[]))
    synced: list[int] = []

    def script(client: SimClient) -> Script:
        yield Call(OpenSession(name="sync"))
        trainer = (yield Call(CreateSlice(devices=2, island=0))).slice.slice_id
        sampler = (yield Call(CreateSlice(devices=2, island=1))).slice.slice_id
        program = ProgramSpec(values=[rows, whole], inputs=[0], outputs=[1], nodes=[
            NodeSpec(kind="reshard", fn_id="", slice_id=sampler, inputs=[0], outputs=[1])])
        yield Post(RegisterProgram(program_id="sync", program=program))
        yield Call(PutBuffer(buffer=0, slice_id=trainer, array=np.zeros((16, 8), np.float32)))
        for step in range(3):
            yield Post(RunProgram(inputs=[ProgramInput(buffer=0)], outputs=[1 + step], program_id="sync"))
            yield Call(AwaitBuffers(buffers=[1 + step]))
            synced.append(1 + step)

    client = cluster.add_client("sync", script)
    report = cluster.run(until=30.0)
    assert client.failure is None and synced == [1, 2, 3]
    assert report["computations"] == 0 and report["data_plane_bytes"] > 0
