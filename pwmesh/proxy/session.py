"""A client session's state: its slices, functions, logical buffers and runs.

Reference counts are kept per *logical* buffer (never per shard): a buffer is
freed — ``DeleteShards`` to every executor holding a shard — once the client has
dropped it and no in-flight run still reads it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import secrets

from pwmesh.errors import PwmeshError
from pwmesh.ir.cache import LoweringCache
from pwmesh.ir.lower import ShardLocation, shard_key
from pwmesh.wire.messages import Computation, InstallTemplate, ProgramSpec, RunTemplate, SliceInfo, ValueSpec


@dataclasses.dataclass(eq=False)
class Buffer:
    """One logical, sharded buffer and where its shards are.

    Whether it is complete is state (``done``, and ``error`` if it failed), not a future: the proxy's
    core (``proxy/state.py``) reports the change as a ``Resolve`` action to whoever waits."""

    name: str
    spec: ValueSpec
    locations: list[ShardLocation]  # replaced, never rewritten in place: a cached lowering's runs share theirs
    holders: set[str] | frozenset[str]  # frozen: a cached lowering's, shared by its runs (replaced, not mutated)
    done: bool = False
    error: PwmeshError | None = None  # why it failed (set with ``done``)
    client_ref: bool = True
    pins: int = 0
    lost: PwmeshError | None = None  # set when a host holding a shard is gone
    slice_id: int | None = None  # the slice whose devices hold its shards (moves with it)
    # Who may still read it besides a run that is given it to consume (donation): runs in flight that
    # read it, fetches under way, and its own run's other nodes until that run ends.
    readers: int = 0
    read_by_its_run: bool = False

    @classmethod
    def new(cls, name: str, spec: ValueSpec, client_ref: bool) -> Buffer:
        return cls(name=name, spec=spec, locations=[], holders=set(), client_ref=client_ref)

    def keys(self, owner: str) -> list[str]:
        return [shard_key(owner, self.name, i) for i in range(self.spec.shards)]

    def resolve(self, error: PwmeshError | None) -> bool:
        """Complete it (the first outcome stays); whether this changed anything."""
        if self.done:
            return False
        self.done, self.error = True, error
        return True

    @property
    def freeable(self) -> bool:
        return not self.client_ref and self.pins == 0

    @property
    def consumable(self) -> bool:
        """Whether a run it is donated to may consume it (nobody else can read it any more)."""
        return self.readers == 0 and not self.read_by_its_run


@dataclasses.dataclass(eq=False)
class Run:
    """One submitted program run: what is still pending and what it holds."""

    run_id: str
    # node -> executors yet to report (a cached lowering's frozen set, shared by its runs, until one reports)
    pending: dict[int, set[str] | frozenset[str]]
    outputs_of: dict[int, list[Buffer]]  # node -> the buffers it produces
    pinned: list[Buffer]  # inputs it reads
    temporaries: list[Buffer]
    executors: frozenset[str]  # every executor taking part (to cancel the run if one is lost); never mutated
    # A computation of it is a gang over several executors (``ir.lower``): a failure reported by one member
    # aborts the run (``ProxyState._island_done``).
    gangs: bool = False
    schedulers: set[str] = dataclasses.field(default_factory=set)  # islands' schedulers it went through
    outputs: list[Buffer] = dataclasses.field(default_factory=list)  # pinned until it finishes
    read_inside: list[Buffer] = dataclasses.field(default_factory=list)  # its outputs its own nodes read too
    deadline: float = float("inf")  # monotonic: failed with DeadlineExceeded if still going then
    # Sequential dispatch: nodes not sent yet, and the nodes each still waits for.
    held: dict[int, list[tuple[str, Computation]]] = dataclasses.field(default_factory=dict)
    waits_for: dict[int, set[int]] = dataclasses.field(default_factory=dict)
    donated: list[tuple[int, Buffer]] = dataclasses.field(default_factory=list)  # (client id, buffer) it consumes
    # A run of an installed template: per scheduler what was sent (to send again if the scheduler lacked it).
    templated: dict[str, tuple[InstallTemplate, RunTemplate]] = dataclasses.field(default_factory=dict)
    template: object | None = None  # the cached lowering it ran (``ir.cache``)
    template_retries: int = 0
    # A cached lowering's temporaries, by name (no buffer each): (slice id, the controls holding them, their
    # names), freed with the run (``Lowered.temps``).
    named_temps: list[tuple[int, frozenset[str], list[str]]] = dataclasses.field(default_factory=list)
    # Buffers its executors delete themselves when the node reading them last succeeds (``Lowered.frees``),
    # and the nodes that failed somewhere (what they were to free stays for the proxy to delete).
    frees: dict[str, tuple[int, set[str] | frozenset[str]]] = dataclasses.field(default_factory=dict)
    failed: set[int] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(eq=False)
class Session:
    session_id: str
    name: str
    peer: bytes
    owner: str = ""  # the name of the key that opened it: only that key acts on it (or sees it in status)
    weight: float = 1.0
    priority: int = 0
    slices: dict[int, SliceInfo] = dataclasses.field(default_factory=dict)
    functions: dict[str, bool] = dataclasses.field(default_factory=dict)  # fn_id -> spmd
    buffers: dict[int, Buffer] = dataclasses.field(default_factory=dict)  # client id -> buffer
    # Buffers handed to a run to consume (donated), by client id -> what to: the recent ones, for the error
    # a later use of the id gets (the client library stops that use itself).
    donated: collections.OrderedDict[int, str] = dataclasses.field(default_factory=collections.OrderedDict)
    runs: dict[str, Run] = dataclasses.field(default_factory=dict)
    # Donated buffers a run was aborted before it consumed: the client's again once it asks (``TakeBack``),
    # freed when it releases them; client id -> buffer.
    returnable: dict[int, Buffer] = dataclasses.field(default_factory=dict)
    ended: bool = False
    hosts: set[str] = dataclasses.field(default_factory=set)  # executors that may hold its keys
    # Cached lowerings' executor sets already in ``hosts`` (by identity and cached hash: a warm run's end adds
    # nothing and looks at none of its executors); emptied with ``hosts``, bounded by ``MAX_MERGED``.
    merged: set[frozenset[str]] = dataclasses.field(default_factory=set)
    programs: dict[str, ProgramSpec] = dataclasses.field(default_factory=dict)  # registered, by id
    # Registrations over the tenant's ``max_programs``: what their runs fail with (the last 64).
    refused_programs: dict[str, PwmeshError] = dataclasses.field(default_factory=dict)
    # Functions the proxy's sandbox refused: what runs that call them fail with.
    refused_functions: dict[str, PwmeshError] = dataclasses.field(default_factory=dict)
    # Programs coming in parts (``RegisterProgram.parts``): id -> (the next part, what came so far).
    arriving: dict[str, tuple[int, ProgramSpec]] = dataclasses.field(default_factory=dict)
    lowerings: LoweringCache = dataclasses.field(default_factory=LoweringCache)  # its programs, lowered
    # What begins every name this proxy gives the session's runs and buffers: "" for a session opened here;
    # ``r<hex>.`` for one resumed after a restart (``proxy/resume.py``), so executors tell its runs and
    # buffers from those of the proxy before.
    marker: str = ""
    _run_ids: itertools.count = dataclasses.field(default_factory=itertools.count)
    _temp_ids: itertools.count = dataclasses.field(default_factory=itertools.count)

    def next_run_id(self) -> str:
        # Unguessable: a completion for a run can only come from an executor that was told of it.
        return f"{self.session_id}:{self.marker}{next(self._run_ids)}-{secrets.token_hex(4)}"

    def temp_name(self) -> str:
        return f"{self.marker}t{next(self._temp_ids)}"

    def buffer_name(self, client_id: int) -> str:
        """Object-store names never repeat, even if a client reuses an id it released."""
        return f"{self.marker}b{client_id}.{next(self._temp_ids)}"

    def donate(self, client_id: int, what: str) -> None:
        """The client handed buffer ``client_id`` to a run to consume: it is no longer the client's."""
        self.buffers.pop(client_id, None)
        self.donated[client_id] = what
        while len(self.donated) > 10_000:
            self.donated.popitem(last=False)

    def fail_buffer(self, client_id: int, spec: ValueSpec, error: PwmeshError) -> None:
        """A request the client did not wait for failed: the buffer it expects carries the cause."""
        if client_id not in self.buffers:
            buf = Buffer.new(self.buffer_name(client_id), spec, client_ref=True)
            buf.resolve(error)
            self.buffers[client_id] = buf
