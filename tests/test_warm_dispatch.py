"""A warm run's dispatch in the proxy does not grow with its inputs' shards or its executors (issue #30 (e)).

Pure, like ``test_lowering_cache`` and ``test_proxy_state``: the lowering cache finds a run's template by
where its inputs are without hashing every location each run (``ir.placement``), is not fooled by a
location list rewritten in place, and runs share their template's locations, holders and reporters,
which the proxy replaces (a migration) rather than rewrites, so one run's migration leaves the others' alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_lowering import chain, loc, make_slice
from test_lowering_cache import both
from test_proxy_state import CLIENT, World, sent
from test_proxy_state import chain as proxy_chain

from pwmesh.ir.cache import LoweringCache
from pwmesh.ir.placement import Placement, Placements
from pwmesh.proxy.state import Inbound
from pwmesh.wire.messages import (
    DrainExecutor,
    Ok,
    ProgramInput,
    PutBuffer,
    RegisterProgram,
    RunProgram,
    RunTemplate,
    SendShards,
)

pytestmark = pytest.mark.timeout(60)


def test_a_location_list_is_hashed_once_while_it_is_unchanged() -> None:
    placements = Placements()
    where = [loc("a", 0), loc("a", 1), loc("b", 0)]
    first = placements.of(where)
    assert placements.of(where) is first  # the same list, unchanged: the same placement, no hashing again
    assert placements.of(list(where)) == first and hash(placements.of(list(where))) == hash(first)
    where[1] = loc("c", 0)  # rewritten in place: seen as the new contents, not the old
    moved = placements.of(where)
    assert moved is not first and moved != first and moved == Placement([loc("a", 0), loc("c", 0), loc("b", 0)])


def test_a_memory_of_lists_stays_bounded() -> None:
    placements = Placements(capacity=4)
    lists = [[loc("a", i)] for i in range(10)]
    for where in lists:
        placements.of(where)
    assert len(placements) <= 4
    assert placements.of(lists[-1]) == Placement([loc("a", 9)])
    by_size = Placements(max_locations=5)  # bounded by the locations held too
    for where in ([loc("a", 0), loc("a", 1)], [loc("b", 0), loc("b", 1)], [loc("c", 0), loc("c", 1)]):
        assert by_size.of(where) == Placement(where)
    assert len(by_size) == 1


def test_a_bound_input_rewritten_in_place_is_lowered_for_where_it_is_now() -> None:
    """The cache keys a run by where its bound inputs are: a list changed in place is a new key, not a stale hit."""
    program, slices = chain(2, 1, 1), [make_slice(1, [("a", 1), ("b", 0)])]
    where = [loc("a", 0), loc("a", 1)]
    cache = LoweringCache()
    for _ in range(2):
        cached, fresh = both(cache, program, slices, bound={0: where})
        assert cached == fresh
    assert (cache.misses, cache.hits) == (1, 1)
    where[0] = loc("b", 0)  # as a drain's migration once did
    cached, fresh = both(cache, program, slices, bound={0: where})
    assert cached == fresh and cache.misses == 2


def test_warm_runs_share_their_templates_state_and_a_migration_copies_only_the_moved_buffer() -> None:
    world = World()
    sid, slice_id = world.open()
    fns = [world.function(CLIENT, slice_id, name) for name in (b"f", b"g")]
    assert world.ask(CLIENT, PutBuffer(buffer=1, slice_id=slice_id, array=np.ones((8, 2), np.float32))) == Ok()
    world.handle(Inbound(CLIENT, RegisterProgram(program_id="p", program=proxy_chain(fns, slice_id))))
    session = world.proxy.sessions[CLIENT]
    runs = []
    for output in (2, 3):
        actions = world.handle(Inbound(CLIENT, RunProgram(inputs=[ProgramInput(buffer=1)], outputs=[output],
                                                          program_id="p")))
        assert sent(actions, RunTemplate)
        ((_, run),) = world.proxy.runs.values()
        runs.append(run)
        pending = {node: set(waiting) for node, waiting in run.pending.items()}
        for done in world.executors(actions):  # each executor's own NodeDone shrinks this run's copy only
            world.handle(Inbound(b"ex", done))
        assert not world.proxy.runs
    assert {node: set(waiting) for node, waiting in runs[1].template.pending.items()} == pending
    first, second = session.buffers[2], session.buffers[3]
    assert first.locations is second.locations and first.holders is second.holders  # the template's, shared
    assert isinstance(first.holders, frozenset)
    assert runs[0].executors is runs[1].executors  # one frozen set of the template's executors
    shared = first.locations
    before = list(shared)

    old = first.locations[0]
    assert world.rm.ask(DrainExecutor(executor=old.executor_id), world.now).remapped == 1
    moved = {a.message.prefix for a in sent(world.notices(), SendShards)}
    assert {f"{sid}/{first.name}", f"{sid}/{second.name}"} <= moved
    for buf in (first, second):  # each moved off the draining host, in its own copies
        assert all(where.executor_id != old.executor_id for where in buf.locations)
        assert old.control not in buf.holders
    assert first.locations is not second.locations and first.locations is not shared
    assert shared == before  # the template's (and any other run's) stay as lowered
