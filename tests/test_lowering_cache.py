"""The proxy's lowering cache: a program lowered once, instantiated per run with that run's names.

Pure, like ``test_lowering``: what a cached lowering gives must be exactly what
lowering the program afresh with the same names gives — computations, emits,
puts, moves, holders and derived buffers — for every kind of node and transfer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from test_lowering import OWNER, chain, loc, make_slice, moe, moe_slices, value

from pwmesh.errors import InvalidArgument
from pwmesh.ir.cache import LoweringCache
from pwmesh.ir.lower import Lowered, ShardLocation, lower
from pwmesh.wire.messages import Enqueue, NodeSpec, ProgramSpec, SliceInfo
from pwmesh.wire.parts import PartTemplates, enqueued, run_parts

pytestmark = pytest.mark.timeout(60)


class Names:
    """A session's name source: each run's buffers get names never used before."""

    def __init__(self) -> None:
        self.count = itertools.count()

    def fresh(self) -> str:
        return f"t{next(self.count)}"

    def run(self, n: int) -> list[str]:
        return [self.fresh() for _ in range(n)]


def args(program: ProgramSpec, slices: list[SliceInfo], names: list[str], host_inputs: set[int],
         bound: dict[int, list[ShardLocation]], fresh: Callable[[], str]) -> dict[str, object]:
    return dict(owner=OWNER, names=names, host_inputs=host_inputs, bound=bound,
                slices={sl.slice_id: sl for sl in slices},
                spmd={n.fn_id: False for n in program.nodes if n.kind == "call"}, fresh_name=fresh)


def both(cache: LoweringCache, program: ProgramSpec, slices: list[SliceInfo], *, host_inputs: set[int] = frozenset(),
         bound: dict[int, list[ShardLocation]] | None = None) -> tuple[Lowered, Lowered]:
    """The cached lowering and a fresh one, each with the same names (two name sources in step)."""
    a, b = Names(), Names()
    names = a.run(len(program.values))
    assert names == b.run(len(program.values))
    _, cached = cache.lower("p1", program, **args(program, slices, names, set(host_inputs), bound or {}, a.fresh))
    fresh = lower(program, **args(program, slices, names, set(host_inputs), bound or {}, b.fresh))
    return cached, fresh


CASES = {
    "chain-one-executor": (chain(2, 1, 1), [make_slice(1, [("a", 0), ("a", 1)])], {0}, None),
    "chain-across-executors": (chain(2), [make_slice(1, [("a", 0), ("a", 1)]), make_slice(2, [("a", 0), ("b", 0)])],
                               {0}, None),
    "reshard-2-to-3": (ProgramSpec(values=[value(2, 24), value(2, 24), value(3, 24)],
                                   nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1]),
                                          NodeSpec(fn_id="g", slice_id=2, inputs=[1], outputs=[2])],
                                   inputs=[0], outputs=[2]),
                       [make_slice(1, [("a", 0), ("a", 1)]), make_slice(2, [("b", 0), ("b", 1), ("c", 0)])], {0},
                       None),
    "bound-moved": (chain(2, 1, 1), [make_slice(1, [("a", 1), ("b", 0)])], set(), {0: [loc("a", 0), loc("a", 1)]}),
    "route-and-combine": (moe(), moe_slices(), {0, 1}, None),
}


@pytest.mark.parametrize("case", CASES)
def test_cached_lowering_is_the_fresh_lowering_with_the_runs_names(case: str) -> None:
    program, slices, host_inputs, bound = CASES[case]
    cache = LoweringCache()
    for run in range(3):  # the first lowers the template, the others instantiate it
        cached, fresh = both(cache, program, slices, host_inputs=host_inputs, bound=bound)
        assert cached == fresh, f"run {run}"
    assert (cache.misses, cache.hits) == (1, 2)


def test_runs_share_the_templates_locations_and_frozen_holders() -> None:
    """A warm run copies no per-shard or per-executor state: its outputs' locations and holders are the
    template's (the proxy replaces a buffer's when it migrates, never rewrites them in place:
    ``test_warm_dispatch``), and holders are frozen, so one run cannot change another's."""
    program, slices, host_inputs, _ = CASES["chain-across-executors"]
    cache = LoweringCache()
    first, _ = both(cache, program, slices, host_inputs=host_inputs)
    second, _ = both(cache, program, slices, host_inputs=host_inputs)
    assert first.produced[1] is second.produced[1]
    assert first.holders and all(isinstance(h, frozenset) for h in first.holders.values())
    assert first.controls is second.controls and first.pending is second.pending
    third, fresh = both(cache, program, slices, host_inputs=host_inputs)
    assert third == fresh


def test_each_run_gets_its_own_derived_buffers() -> None:
    program, slices, host_inputs, _ = CASES["reshard-2-to-3"]
    cache = LoweringCache()
    first, _ = both(cache, program, slices, host_inputs=host_inputs)
    names = Names()
    names.run(100)  # a later run, later names
    _, second = cache.lower("p1", program, **args(program, slices, names.run(len(program.values)), host_inputs, {},
                                                  names.fresh))
    assert first.derived and second.derived
    assert not set(first.derived) & set(second.derived)


def test_a_remapped_slice_lowers_the_program_again() -> None:
    """The proxy replaces a slice's SliceInfo when its map changes: the old lowering is not used."""
    program = chain(2, 1, 1)
    cache = LoweringCache()
    both(cache, program, [make_slice(1, [("a", 0), ("a", 1)])], host_inputs={0})
    moved = make_slice(1, [("b", 0), ("b", 1)])
    cached, fresh = both(cache, program, [moved], host_inputs={0})
    assert cached == fresh
    assert {c.executor_id for comps in cached.schedules.values() for c in comps} == {"b"}
    assert (cache.misses, cache.hits) == (2, 0)


def test_other_bindings_are_other_entries() -> None:
    """Where a bound input lives, and whether an input comes from the host, change the lowering."""
    program = chain(2, 1, 1)
    slices = [make_slice(1, [("a", 0), ("a", 1)])]
    cache = LoweringCache()
    for bound in ({0: [loc("a", 0), loc("a", 1)]}, {0: [loc("b", 0), loc("b", 1)]}, None):
        cached, fresh = both(cache, program, slices, host_inputs=set() if bound else {0}, bound=bound)
        assert cached == fresh
    assert (cache.misses, cache.hits) == (3, 0)


def test_two_inputs_bound_to_one_buffer_are_lowered_each_time() -> None:
    """Lowering sees that they are one buffer (by its name); placeholders would tell them apart."""
    program = ProgramSpec(values=[value(1), value(1), value(1)],
                          nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0, 1], outputs=[2])],
                          inputs=[0, 1], outputs=[2])
    slices = [make_slice(1, [("b", 0)])]
    bound = {0: [loc("a", 0)], 1: [loc("a", 0)]}
    cache = LoweringCache()
    for _ in range(2):
        _, cached = cache.lower("p1", program, **args(program, slices, ["same", "same", "out"], set(), bound,
                                                      Names().fresh))
        assert cached == lower(program, **args(program, slices, ["same", "same", "out"], set(), bound, Names().fresh))
    assert (len(cache), cache.misses, cache.hits) == (0, 0, 0)


def test_no_program_id_is_never_cached() -> None:
    program, slices, host_inputs, _ = CASES["chain-one-executor"]
    cache = LoweringCache()
    for _ in range(2):
        cache.lower("", program, **args(program, slices, Names().run(3), host_inputs, {}, Names().fresh))
    assert (len(cache), cache.misses, cache.hits) == (0, 0, 0)


def test_an_id_naming_another_program_is_refused() -> None:
    program, slices, host_inputs, _ = CASES["chain-one-executor"]
    other = ProgramSpec(values=[value(2), value(2)], nodes=[NodeSpec(fn_id="f", slice_id=1, inputs=[0], outputs=[1])],
                        inputs=[0], outputs=[1])
    cache = LoweringCache()
    cache.lower("p1", program, **args(program, slices, Names().run(3), host_inputs, {}, Names().fresh))
    with pytest.raises(InvalidArgument, match="names another program"):
        cache.lower("p1", other, **args(other, slices, Names().run(2), host_inputs, {}, Names().fresh))
    with pytest.raises(InvalidArgument, match="at most"):
        cache.lower("x" * 500, program, **args(program, slices, Names().run(3), host_inputs, {}, Names().fresh))


def test_lowering_errors_are_not_cached() -> None:
    program = chain(2, 1, 1)
    cache = LoweringCache()
    with pytest.raises(InvalidArgument, match="does not own"):
        cache.lower("p1", program, **args(program, [], Names().run(3), {0}, {}, Names().fresh))
    assert len(cache) == 0


def test_least_recently_used_programs_are_dropped() -> None:
    program, slices, host_inputs, _ = CASES["chain-one-executor"]
    cache = LoweringCache(capacity=2)
    for pid in ("p1", "p2", "p1", "p3"):
        cache.lower(pid, program, **args(program, slices, Names().run(3), host_inputs, {}, Names().fresh))
    assert len(cache) == 2
    cache.lower("p1", program, **args(program, slices, Names().run(3), host_inputs, {}, Names().fresh))
    cache.lower("p2", program, **args(program, slices, Names().run(3), host_inputs, {}, Names().fresh))
    assert (cache.misses, cache.hits) == (4, 2)  # p1 stayed (used last), p2 had been dropped


@pytest.mark.parametrize("case", CASES)
def test_packed_runs_unpack_to_the_fresh_computations(case: str) -> None:
    """Installed once as the template's parts, then run with the run's names, each executor gets what a fresh
    lowering makes."""
    program, slices, host_inputs, bound = CASES[case]
    cache = LoweringCache()
    templates: dict[str, PartTemplates] = {}  # one per executor
    sent = []
    for _ in range(3):
        a, b = Names(), Names()
        names = a.run(len(program.values))
        b.run(len(program.values))
        _, cached = cache.lower("p1", program, **args(program, slices, names, host_inputs, bound or {}, a.fresh),
                                packed=True)
        fresh = lower(program, **args(program, slices, names, host_inputs, bound or {}, b.fresh))
        assert cached.parts is not None and cached.derived == fresh.derived and cached.holders == fresh.holders
        assert cached.moves == fresh.moves and cached.puts == fresh.puts
        for scheduler, parts in cached.parts.items():
            expected = run_parts(fresh.schedules[scheduler])
            assert [(p.executor_id, p.nodes, p.devices) for p in parts] == [
                (p.executor_id, p.nodes, p.devices) for p in expected]
            assert cached.run_names is not None and cached.template_id
            for part in parts:
                mine = templates.setdefault(part.executor_id, PartTemplates())
                first = not mine.holds(cached.template_id)  # the part's bytes come with the first run only
                got = enqueued(Enqueue(run_id="r", proxy="p", nodes=part.nodes,
                                       computations=part.computations if first else b"",
                                       names=cached.run_names[scheduler], template=cached.template_id,
                                       refs=part.refs if first else []), mine)
                assert got == [c for c in fresh.schedules[scheduler] if c.executor_id == part.executor_id]
                sent.append(part.computations)
    assert len(set(sent)) == len(sent) // 3  # every run sends the same bytes
    assert all(len(t) == 1 for t in templates.values())


def test_equal_locations_are_one_object() -> None:
    """A run's lowering is looked up by its inputs' locations: equal ones are one object, so the lookup
    compares them by identity (a dataclass ``__eq__`` for each of a step's ~600 was most of its cost)."""
    from pwmesh.ir.lower import location
    from pwmesh.wire.records import PhysicalDevice
    a = PhysicalDevice(executor_id="e0", control="tcp://c:1", data="tcp://d:1", device=3, island=0, host="h0")
    b = PhysicalDevice(executor_id="e0", control="tcp://c:1", data="tcp://d:1", device=3, island=0, host="h0")
    c = PhysicalDevice(executor_id="e0", control="tcp://c:1", data="tcp://d:1", device=2, island=0, host="h0")
    assert location(a) is location(b) and location(a) == location(b)
    assert location(c) is not location(a) and location(c) != location(a)
