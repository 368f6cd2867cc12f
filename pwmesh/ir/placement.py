"""Where a run's bound inputs are, as a lowering-cache key whose cost does not grow with their shards.

A cached lowering is found by its program id and where each input's shards are (``ir.cache._key``).
A tuple of a buffer's locations hashes every location on every lookup (a tuple keeps no hash): an
input over 2,048 devices is 2,048 Python ``__hash__`` calls a run, 32,768 for a GPipe step's 8
microbatches hashed twice — most of a warm run's dispatch at 1,024 hosts. Here each buffer's
location list is turned into a ``Placement`` once: its tuple and hash kept, the same object again
while the list is the same object with the same contents (checked in C: a list compare tests each
element's identity first). Two keys holding the same ``Placement`` compare by identity.
"""

from __future__ import annotations

from collections.abc import Sequence

from pwmesh.ir.lower import ShardLocation

# What one cache remembers (the buffers its runs read lately; forgotten all at once past either bound, then
# learnt again): lists, and the locations they hold (each kept twice, ~16 bytes a location: ~16 MiB at most).
MAX_PLACEMENTS = 4096
MAX_PLACED_LOCATIONS = 1 << 20


class Placement:
    """A buffer's shard locations, frozen, with their hash computed once."""

    __slots__ = ("_hash", "locations")

    def __init__(self, locations: Sequence[ShardLocation]) -> None:
        self.locations = tuple(locations)
        self._hash = hash(self.locations)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Placement):
            return NotImplemented
        return self._hash == other._hash and self.locations == other.locations

    def __repr__(self) -> str:
        return f"Placement({len(self.locations)} shards)"


class Placements:
    """The ``Placement`` of each location list seen lately, by the list's identity, checked against its contents."""

    def __init__(self, capacity: int = MAX_PLACEMENTS, max_locations: int = MAX_PLACED_LOCATIONS) -> None:
        self.capacity = capacity
        self.max_locations = max_locations
        self._locations = 0  # held in ``_seen``'s copies
        # id(list) -> (the list, held so its id is not reused; a copy of its contents then; its Placement)
        self._seen: dict[int, tuple[list[ShardLocation], list[ShardLocation], Placement]] = {}
        # Each Placement once by its contents: a new list with the locations of one seen before (a training
        # step's outputs, which the next step reads, are new lists each step) gets that one's Placement, so keys
        # holding either compare by identity, not location by location (~80 compares a warm step, ~1 us each).
        self._interned: dict[Placement, Placement] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def of(self, where: list[ShardLocation]) -> Placement:
        """``where`` as a ``Placement``: the one made before if the list is the same and unchanged (it may be
        rewritten in place: a buffer migrated off a draining host), else a new one."""
        seen = self._seen.get(id(where))
        if seen is not None and seen[0] is where and seen[1] == where:
            return seen[2]
        placement = Placement(where)
        if seen is not None:  # rewritten in place: its old copy goes
            self._locations -= len(seen[1])
            del self._seen[id(where)]
        if (len(self._seen) >= self.capacity or len(self._interned) >= 2 * self.capacity
                or self._locations + len(where) > self.max_locations):
            self._seen.clear()
            self._interned.clear()
            self._locations = 0
        placement = self._interned.setdefault(placement, placement)
        self._seen[id(where)] = (where, list(where), placement)
        self._locations += len(where)
        return placement
