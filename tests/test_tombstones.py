"""What an executor remembers of the buffers it deleted (``executor/tombstones.py``): every one, in
memory that does not grow with a session's length.

The pure parts are driven directly; the last test runs a real training-like loop on a real cluster
and reads the executor's count from its stats."""

from __future__ import annotations

import asyncio
import random

import jax
import numpy as np
import pytest

import pwmesh as pw
from pwmesh.errors import NotFound
from pwmesh.executor import spill
from pwmesh.executor.store import ObjectStore
from pwmesh.executor.tombstones import RECENT, Ranges, Tombstones, parse

pytestmark = pytest.mark.timeout(120)


def test_a_proxys_names_parse_to_their_stem_and_number() -> None:
    assert parse("s1-6132dc/t7") == ("s1-6132dc/", 7)
    assert parse("s1-6132dc/b17488.17815") == ("s1-6132dc/", 17815), "one counter for both kinds"
    assert parse("s1/r0a1b2c3d.b5.9") == ("s1/r0a1b2c3d.", 9), "a restarted proxy's names: their own stem"
    assert parse("s1/r0a1b2c3d.t12") == ("s1/r0a1b2c3d.", 12)
    for other in ("s1/x7", "s1/t", "s1/b5", "s1/b.5", "s1/bx.5", "t7", "s1/t7a", "s1/t٣"):
        assert parse(other) is None, other


def test_ranges_hold_exactly_the_integers_added() -> None:
    rng = random.Random(7)
    for _ in range(30):
        ranges, want = Ranges(), set()
        for _ in range(300):
            if rng.random() < 0.2:
                lo = rng.randrange(500)
                hi = lo + rng.randrange(1, 30)
                ranges.add_range(lo, hi)
                want.update(range(lo, hi))
            else:
                n = rng.randrange(520)
                ranges.add(n)
                want.add(n)
        assert [n for n in range(560) if n in ranges] == sorted(want)
        flat = ranges.export()
        assert flat == sorted(flat) and all(flat[i] < flat[i + 1] for i in range(len(flat) - 1)), \
            "sorted, disjoint, not touching"


def test_old_tombstones_become_ranges_and_stay_tombstones() -> None:
    stones = Tombstones(recent=64)
    order = list(range(20_000))
    for i in range(0, len(order) - 8, 8):  # deletes come in about the order names were given
        order[i:i + 8] = reversed(order[i:i + 8])
    kept = set(range(0, 20_000, 997))  # a few buffers live on (a model's parameters)
    for n in order:
        if n not in kept:
            stones.add(f"s1/b{n % 13}.{n}" if n % 2 else f"s1/t{n}")
    stones.add("s1/not-a-proxys-name")
    for n in range(20_000):
        name = f"s1/b{n % 13}.{n}" if n % 2 else f"s1/t{n}"
        assert (name in stones) == (n not in kept), name
    assert "s1/not-a-proxys-name" in stones
    assert "s2/t5" not in stones and "s1/r0a1b2c3d.t5" not in stones, "another session, another proxy"
    assert len(stones) < 64 + 2 * len(kept) + 10, "names became a few ranges"
    back = Tombstones(recent=64)
    back.restore(stones.export())
    assert all((f"s1/t{n}" in back) == (n not in kept) for n in range(0, 20_000, 2))
    stones.forget("s1/")
    assert len(stones) == 0 and "s1/t2" not in stones


def test_a_stems_oldest_ranges_are_forgotten_past_its_bound(monkeypatch) -> None:
    from pwmesh.executor import tombstones
    monkeypatch.setattr(tombstones, "MAX_RANGES", 10)
    stones = Tombstones(recent=4)
    for n in range(0, 20_000, 2):  # every other one: no two touch
        stones.add(f"s1/t{n}")
    assert len(stones) <= 4 + 10 + 1_000
    assert "s1/t19990" in stones and "s1/t0" not in stones, "the newest kept, the oldest forgotten"


def test_a_complete_buffer_needs_no_tombstone_once_old() -> None:
    """One whose shards here all came whole from a computation here: nothing of it can arrive any more."""
    stones = Tombstones(recent=4)
    stones.add("s1/t1", True)
    assert "s1/t1" in stones, "a recent delete still fails a late read at once"
    for n in range(2, 10):
        stones.add(f"s1/t{n}", True)
    assert len(stones) == 4 and "s1/t1" not in stones


def test_tombstones_survive_a_restart_through_the_spill(tmp_path) -> None:
    stones = Tombstones(recent=8)
    for n in range(100):
        stones.add(f"s1/t{n}")
    saved = spill.Saved(values=[], failures={}, tombstones=stones.export(), functions=[], expected_seq={})
    spill.save(saved, tmp_path)
    back = Tombstones()
    back.restore(spill.load(tmp_path).tombstones)
    assert all(f"s1/t{n}" in back for n in range(100)) and "s1/t100" not in back


@pytest.mark.asyncio
async def test_the_store_drops_late_data_for_an_old_delete_and_fails_a_late_read() -> None:
    store = ObjectStore()
    store.delete([f"s1/t{n}" for n in range(RECENT + 5_000)])
    assert store.tombstone_count() <= RECENT + 1
    store.put("s1/t3/0", np.ones(2), 16)  # aged into a range: still a tombstone
    assert len(store) == 0, "late data for a deleted buffer is dropped"
    with pytest.raises(NotFound):
        await asyncio.wait_for(store.get("s1/t3/0"), 5.0)
    store.put("s1/t999999/0", np.ones(2), 16)
    assert len(store) == 1, "a buffer never deleted is stored"


def test_a_computed_piece_is_complete_and_its_old_tombstone_parses_no_name(monkeypatch) -> None:
    """A piece a computation here made (``computed``: a per-device computation's outputs) is all of its buffer
    this executor holds, as an SPMD output stored whole is: once old, its tombstone is dropped, not parsed into
    a range (a training step's ~100 deletes a step were ~6 % of a GPU executor's main thread). A put's piece
    (it came from elsewhere) still ages into a range."""
    from pwmesh.executor import tombstones

    parsed: list[str] = []
    real = tombstones.parse
    monkeypatch.setattr(tombstones, "parse", lambda name: parsed.append(name) or real(name))
    store = ObjectStore()
    store._deleted = Tombstones(recent=4)
    store.put("s1/t1/0", np.ones(2), 16, computed=True)
    store.put("s1/t1/1", np.ones(2), 16, computed=True)
    store.put("s1/t2/0", np.ones(2), 16)
    store.made_here("s1/t3/0")  # made here, consumed as it landed (donated to the next step): nothing stored
    store.delete(["s1/t1", "s1/t2"] + [f"s1/t{n}" for n in range(3, 9)])
    assert parsed == ["s1/t2", "s1/t4"], "the computed buffers aged out without a parse"
    assert "s1/t2" in store._deleted and "s1/t1" not in store._deleted
    parsed.clear()
    store.put("s1/t50/0", np.ones(2), 16, computed=True)  # a new output: checked against the newest deletes only
    assert parsed == [] and len(store) == 1
    store.put("s1/t4/0", np.ones(2), 16)  # late data for an old delete (in a range) is still dropped
    assert parsed == ["s1/t4"] and len(store) == 1


def test_a_long_loop_leaves_the_executors_tombstones_bounded(client: pw.Client) -> None:
    """A training-like loop: every step's 128 outputs replace the last step's, which are deleted. Past
    RECENT deletes the executor's tombstones stop growing (they grew by one a buffer, ~90 bytes each:
    ~10 GB an hour of a tiny model's training); the last step's values are right."""
    sl = client.make_virtual_device_set().add_slice(devices=2)
    leaves = 128
    step = pw.jit(lambda tree: jax.tree.map(lambda x: x + 1.0, tree), devices=sl, donate_argnums=0)
    tree = client.put({f"p{i}": np.full((2, 2), float(i), np.float32) for i in range(leaves)}, devices=sl)
    steps = RECENT // leaves + 60
    for _ in range(steps):
        tree = step(tree)
    got = jax.tree.map(np.asarray, tree)
    assert all(np.array_equal(got[f"p{i}"], np.full((2, 2), float(i + steps), np.float32)) for i in range(leaves))
    del tree, got
    counts = [s.tombstones for s in client.status().executor_stats]
    assert steps * leaves > RECENT + 64, "deletes enough to grow past the bound one a buffer"
    assert max(counts) <= RECENT + 64, f"{steps * leaves} buffers deleted; tombstones held {counts}"
