"""Layouts over a named mesh and the reshard plans between them (pure: no sockets).

Every layout a user can write on slices of 1 to 4 devices (one axis, or a 2x2 mesh)
is checked against JAX's own ``NamedSharding`` (the blocks each device holds), and
every pair of them is resharded through ``cut`` -> ``Progress`` -> ``assemble`` as
the executors do it: every destination gets exactly its block, hearing from the
sources the plan names.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pwmesh.client.sharding import propagation_mesh, spec_indices
from pwmesh.dataflow.exchange import Destination, assemble, cut, expand
from pwmesh.dataflow.layout import Layout, plan
from pwmesh.dataflow.progress import Progress
from pwmesh.errors import InvalidArgument
from pwmesh.wire.messages import Emit, Sharding, ShardRun, Site, Target

SHAPE = (12, 12)  # splits over 1, 2, 3 and 4 devices, and 2x2, along either dimension

# (mesh axis names and sizes, spec): the specs of the issue over slices of 1, 2, 3 and 4 devices.
MESHES = [(("x",), (n,)) for n in (1, 2, 3, 4)] + [(("x", "y"), (2, 2))]
SPECS_1D = [P(), P("x"), P(None, "x")]
SPECS_2D = [P(), P("x"), P(None, "x"), P("x", "y"), P(("x", "y")), P("y", "x"), P(None, ("y", "x"))]
CASES = [(names, sizes, spec) for names, sizes in MESHES for spec in (SPECS_2D if len(names) == 2 else SPECS_1D)]


def layout_of(names: tuple[str, ...], sizes: tuple[int, ...], spec: P, shape: tuple[int, ...] = SHAPE) -> Layout:
    return Layout.of(shape, Sharding(mesh=list(sizes), spec=spec_indices(spec, names, "test")), int(np.prod(sizes)))


def label(case: tuple[tuple[str, ...], tuple[int, ...], P]) -> str:
    names, sizes, spec = case
    return f"{'x'.join(map(str, sizes))}{spec}"


@pytest.mark.parametrize("case", CASES, ids=label)
def test_each_device_holds_the_block_jax_gives_it(case: tuple[tuple[str, ...], tuple[int, ...], P]) -> None:
    names, sizes, spec = case
    mesh = propagation_mesh(sizes, names)
    by_device = NamedSharding(mesh, spec).devices_indices_map(SHAPE)
    layout = layout_of(names, sizes, spec)
    for i, device in enumerate(mesh.devices.flat):
        want = tuple(slice(s.start or 0, SHAPE[d] if s.stop is None else s.stop) for d, s in enumerate(by_device[device]))
        assert layout.index(i) == want, f"device {i}"
    assert layout.shard_shape == NamedSharding(mesh, spec).shard_shape(SHAPE)


@pytest.mark.parametrize("case", CASES, ids=label)
def test_split_and_assemble_round_trip(case: tuple[tuple[str, ...], tuple[int, ...], P]) -> None:
    layout = layout_of(*case)
    x = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    blocks = layout.split(x)
    assert all(b.shape == layout.shard_shape for b in blocks)
    np.testing.assert_array_equal(layout.assemble([blocks[d] for d in layout.distinct()], x.dtype), x)
    assert len(layout.distinct()) == int(np.prod(layout.splits)), "one device per distinct block"


PAIRS = list(itertools.product(CASES, CASES))


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{label(a)}->{label(b)}" for a, b in PAIRS])
def test_every_pair_of_layouts_reshards_exactly(src: tuple[tuple[str, ...], tuple[int, ...], P],
                                                 dst: tuple[tuple[str, ...], tuple[int, ...], P]) -> None:
    """Each destination element comes from exactly one source that holds it; sends and sources agree;
    a destination whose own index holds its block on the source side takes it from there."""
    a, b = layout_of(*src), layout_of(*dst)
    moves = plan(a, b)
    heard = {(s, p.dest) for s, pieces in moves.sends.items() for p in pieces}
    assert heard == {(s, j) for j, sources in moves.sources.items() for s in sources}
    for j in range(b.devices):
        covered = np.zeros(b.shard_shape, int)
        for s in moves.sources[j]:
            for p in moves.sends[s]:
                if p.dest == j:
                    covered[p.dest_index()] += 1
                    src_box, dst_box = a.box(s), b.box(j)
                    for d, (lo, hi, off) in enumerate(zip(p.lo, p.hi, p.offset, strict=True)):
                        assert src_box[d][0] + lo == dst_box[d][0] + off, "the same global element"
                        assert 0 <= lo <= hi <= a.shard_shape[d]
        assert (covered == 1).all(), f"destination {j}"
        if j < a.devices and a.same_blocks(b):
            assert moves.sources[j] == [j], "laid out alike: every device keeps its own block"


def spread(layout: Layout) -> Target:
    """The destinations alternate between executors a and b (device j // 2 there)."""
    by: dict[str, list[ShardRun]] = {}
    for j in range(layout.devices):
        by.setdefault("ab"[j % 2], []).append(ShardRun(device=j // 2, shard=j))
    sites = [Site(executor_id=ex, data=f"tcp://{ex}:2", host=ex, runs=runs) for ex, runs in by.items()]
    return Target(prefix="s/v", shards=layout.devices, sites=sites, shape=list(layout.shard_shape), dtype="float32",
                  sharding=Sharding(mesh=list(layout.mesh), spec=[list(axes) for axes in layout.spec]))


def move(a: Layout, b: Layout, x: np.ndarray, *, together: bool = False) -> dict[int, np.ndarray]:
    """``x``, laid out as ``a``, cut by every source and delivered (in reverse) to ``b``'s destinations;
    ``together``: all the sources on one executor, cutting at once (it gathers what it can send whole)."""
    emit = Emit(mode="block", rows=x.shape[0], src_shards=a.devices, targets=[spread(b)], shape=list(x.shape),
                src=Sharding(mesh=list(a.mesh), spec=[list(axes) for axes in a.spec]))
    tuples: list[tuple[Destination, object]] = []
    if together:
        tuples.extend(cut(emit, dict(enumerate(a.split(x)))))
    for s, block in enumerate(a.split(x) if not together else []):  # every source device cuts its own block
        tuples.extend(cut(emit, {s: block}))
    progress: dict[str, Progress] = {}
    got = {}
    # As an executor receives them: a tuple's copies are tuples of their own (``expand``).
    for dest, t in reversed([(d, each) for d, sent in tuples for each in expand([sent])]):  # any order
        box = progress.setdefault(dest.executor_id, Progress())
        done = box.tuple(f"s/v/{t.shard}", t.src, t.seq, t.sources, t) if t.seq >= 0 else None  # (a marker alone)
        done = box.marker(f"s/v/{t.shard}", t.src, t.count, t.sources) or done
        if done is not None:
            got[t.shard] = assemble(done.payloads, t)
    assert all(len(p) == 0 for p in progress.values()), "destinations left waiting"
    return got


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{label(a)}->{label(b)}" for a, b in PAIRS])
def test_every_pair_of_layouts_moves_through_the_data_plane(src: tuple[tuple[str, ...], tuple[int, ...], P],
                                                             dst: tuple[tuple[str, ...], tuple[int, ...], P]) -> None:
    a, b = layout_of(*src), layout_of(*dst)
    x = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    got = move(a, b, x)
    assert sorted(got) == list(range(b.devices))
    for j, value in got.items():
        np.testing.assert_array_equal(value, x[b.index(j)])


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{label(a)}->{label(b)}" for a, b in PAIRS])
def test_every_pair_of_layouts_moves_from_one_executor(src: tuple[tuple[str, ...], tuple[int, ...], P],
                                                       dst: tuple[tuple[str, ...], tuple[int, ...], P]) -> None:
    """A source all on one executor (a trainer's host) gathers a destination's column blocks itself and
    sends them whole, with the other sources' markers: every destination still gets exactly its block."""
    a, b = layout_of(*src), layout_of(*dst)
    x = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    got = move(a, b, x, together=True)
    assert sorted(got) == list(range(b.devices))
    for j, value in got.items():
        np.testing.assert_array_equal(value, x[b.index(j)])


@pytest.mark.parametrize(("src", "dst"), [(CASES[-4], CASES[4]), (CASES[4], CASES[-1]), (CASES[0], CASES[-3])],
                         ids=label)
def test_empty_dimensions_still_complete_every_destination(src: tuple[tuple[str, ...], tuple[int, ...], P],
                                                           dst: tuple[tuple[str, ...], tuple[int, ...], P]) -> None:
    shape = (0, 12)
    a, b = layout_of(*src, shape=shape), layout_of(*dst, shape=shape)
    got = move(a, b, np.zeros(shape, np.float32))
    assert sorted(got) == list(range(b.devices))
    assert all(v.shape == b.shard_shape for v in got.values())


@pytest.mark.parametrize(("names", "sizes", "spec", "shape", "match"), [
    (("x",), (4,), P("x"), (6, 4), r"dimension 0 of shape \(6, 4\) \(6\) cannot be split into 4"),
    (("x", "y"), (2, 2), P(None, ("x", "y")), (4, 6), r"dimension 1 .* cannot be split into 4"),
    (("x",), (2,), P(None, None, "x"), (4, 4), r"a spec for 3 dimensions, but the value has shape \(4, 4\)"),
    (("x",), (2,), P("x"), (), r"a spec for 1 dimensions"),
])
def test_layouts_that_cannot_be_made(names: tuple[str, ...], sizes: tuple[int, ...], spec: P, shape: tuple[int, ...],
                                     match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        Layout.of(shape, Sharding(mesh=list(sizes), spec=spec_indices(spec, names, "v")), int(np.prod(sizes))).check("v")


def test_an_axis_used_twice_or_missing() -> None:
    with pytest.raises(InvalidArgument, match="splits more than one dimension"):
        Layout((4, 4), (2, 2), ((0,), (0,))).check("v")
    with pytest.raises(InvalidArgument, match="mesh axis 2 does not exist"):
        Layout((4, 4), (2, 2), ((2,),)).check("v")
    with pytest.raises(InvalidArgument, match="names mesh axis 'z', which the slice's mesh"):
        spec_indices(P("z"), ("x", "y"), "v")
