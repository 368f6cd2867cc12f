"""The proxy core's vocabulary: the events ``ProxyState.handle`` takes and the actions it returns (what
each means is in ``proxy/state.py``'s docstring), and two helpers the shells share with it."""

from __future__ import annotations

import dataclasses

from pwmesh.core.contract import describe
from pwmesh.errors import DeviceLost, PwmeshError
from pwmesh.ir.cache import LoweringJob
from pwmesh.ir.lower import value_layout
from pwmesh.proxy.session import Buffer
from pwmesh.wire import Message
from pwmesh.wire.messages import Fence, OwnedShards, ReclaimOwner, ResumeSession, SliceInfo

# ------------------------------------------------------------------ events


@dataclasses.dataclass(frozen=True)
class Inbound:
    """A message ``peer`` sent on the proxy's own socket (a client, or an executor's ``NodeDone``)."""

    peer: bytes
    message: Message
    user: str = ""  # the sender's key's name (``Envelope.user``): a session answers only to its owner


@dataclasses.dataclass(frozen=True)
class Notice:
    """An unsolicited message on the proxy's connection to the resource manager."""

    message: Message


@dataclasses.dataclass(frozen=True)
class SliceGranted:
    """The RM allocated the slice a ``CreateSlice`` from ``peer`` asked for."""

    peer: bytes
    slice: SliceInfo


@dataclasses.dataclass(frozen=True)
class SlicesPlaced:
    """The RM suspended, resumed or reshaped the slices an ``Ask`` named (``SuspendSlices``, ``ResumeSlices``, an
    admin's ``SuspendSession``): ``reshape`` is the ``ResumeSlices`` that reshapes one, if it does."""

    peer: bytes
    slices: list[SliceInfo]
    reshape: Message | None = None


@dataclasses.dataclass(frozen=True)
class FetchEnded:
    """A fetch that ``Fetching`` started is over, whatever its outcome: unpin the buffer."""

    session_id: str
    buffer: Buffer
    owner: str = ""  # whose bytes in flight it was (``Fetching``)
    nbytes: int = 0


@dataclasses.dataclass(frozen=True)
class FunctionChecked:
    """A new function's module was read in the sandbox (``CheckFunction``): refused with ``error``, or not."""

    fn_id: str
    error: PwmeshError | None


@dataclasses.dataclass(frozen=True)
class Delivered:
    """A ``Deliver`` is over, whatever its outcome: its bytes are no longer in flight."""

    owner: str
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Lowered:
    """A ``LowerOffLoop`` job for ``peer``'s session ran (on a thread): keep what it made."""

    peer: bytes
    session_id: str
    job: LoweringJob


@dataclasses.dataclass(frozen=True)
class Tick:
    """Time passed: end the sessions whose client stopped sending heartbeats."""


@dataclasses.dataclass(frozen=True)
class Inherited:
    """At start: the slices the resource manager holds, made for sessions of the proxy before this one."""

    slices: list[SliceInfo]


@dataclasses.dataclass(frozen=True)
class Reclaimed:
    """What the executors hold of a session being resumed (``Reclaim``): by control address, None where one
    did not answer."""

    peer: bytes
    user: str
    resume: ResumeSession
    held: dict[str, OwnedShards | None]
    coming: frozenset[int] = frozenset()  # buffers that requests the client sent before the resume will make
    named: frozenset[int] = frozenset()  # buffers they read or release


@dataclasses.dataclass(frozen=True)
class Inventoried:
    """What an executor back from a stall holds (``Inventory``): its keys."""

    control: str
    executor_id: str
    keys: list[str]


@dataclasses.dataclass(frozen=True)
class KeptChecked:
    """The shard keys donated to aborted run ``run_id`` that its executors hold intact (``CheckKept``)."""

    run_id: str
    intact: list[str]


Event = (Inbound | Notice | SliceGranted | SlicesPlaced | FetchEnded | Delivered | FunctionChecked | Lowered | Tick | Inherited
         | Reclaimed | Inventoried | KeptChecked)

# ------------------------------------------------------------------ actions


@dataclasses.dataclass(frozen=True)
class Send:
    """Post ``message`` to the daemon at ``to``; ``dispatch``: program traffic (``StatusReply``); ``stimulus``:
    the event that caused it (its id in ``events``, ``pwmesh debug events proxy``)."""

    to: str
    message: Message
    dispatch: bool = False
    stimulus: str = ""


@dataclasses.dataclass(frozen=True)
class Reply:
    """The answer to the request being handled: a message, or the error it failed with."""

    message: Message | None = None
    error: PwmeshError | None = None


@dataclasses.dataclass(frozen=True)
class Ask:
    """Send a request to ``to``; its answer comes back as an event (``SliceGranted``, ``SlicesPlaced``)."""

    to: str
    message: Message
    peer: bytes = b""  # the client it is for
    reshape: Message | None = None  # handed back in ``SlicesPlaced``


@dataclasses.dataclass(frozen=True)
class Park:
    """Answer the request being handled later, as the ``Unpark`` of the same ``key`` says (a resume or reshape
    waiting for the runs and fetches that still hold its slice's arrays to let go of them)."""

    key: int


@dataclasses.dataclass(frozen=True)
class Unpark:
    """The request parked as ``key`` goes on: its answer is ``ask``'s (as an ``Ask``'s is), or ``error``."""

    key: int
    ask: Ask | None = None
    error: PwmeshError | None = None


@dataclasses.dataclass(frozen=True)
class Wait:
    """Answer once every buffer is done: ``Ok``, or the first failure (``settled``)."""

    buffers: list[Buffer]


@dataclasses.dataclass(frozen=True)
class Fetching:
    """Fetch ``buffer``'s values (``sources``), early if it is not done yet; then ``FetchEnded``."""

    session_id: str
    buffer: Buffer
    owner: str = ""  # whose bytes in flight it is, and how many (back with ``FetchEnded``)
    nbytes: int = 0
    # A direct fetch: the executors push the blocks to the client's data plane at ``to``, tagged ``tag``,
    # on a stream keyed ``data_key`` (``PushShards``); the answer says how many.
    to: str = ""
    tag: str = ""
    data_key: bytes = b""


@dataclasses.dataclass(frozen=True)
class FetchingAll:
    """Fetch every buffer's values (``FetchBuffers``) once all are done, one ``FetchShards`` an executor;
    then a ``FetchEnded`` for each."""

    fetches: list[Fetching]


@dataclasses.dataclass(frozen=True)
class Expecting:
    """A direct put: ask each executor to expect its shards (``ExpectShards``, by control address), then
    answer ``reply`` (where the client sends them); the first refusal is the answer instead."""

    asks: dict[str, Message]
    reply: Message


@dataclasses.dataclass(frozen=True)
class CheckFunction:
    """Read a new function's module in a child process (``pwmesh.executor.sandbox``) before it is
    registered: then ``FunctionChecked``, and the request that asked is handled again."""

    fn_id: str
    exported: bytes


@dataclasses.dataclass(frozen=True)
class Deliver:
    """Send the request ``message`` (a client's put) to ``to``; then ``Delivered``: ``owner``'s ``nbytes``
    are in flight until the executor has them."""

    to: str
    message: Message
    owner: str
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Resolve:
    """``buffer`` just became done: ready, or failed with ``buffer.error``."""

    buffer: Buffer


@dataclasses.dataclass(frozen=True)
class PeerLost:
    """The executor at ``control`` is gone: fail what waits on it, send it nothing more."""

    control: str
    error: DeviceLost


@dataclasses.dataclass(frozen=True)
class PeerBack:
    """The executor at ``control`` is back (restarted): send what waited for it."""

    control: str


@dataclasses.dataclass(frozen=True)
class FencePeer:
    """The executor at ``control`` restarts: post ``fence``, hold what follows until ``PeerBack``."""

    control: str
    fence: Fence


@dataclasses.dataclass(frozen=True)
class LowerOffLoop:
    """The request being handled is a program too big to lower here: run ``job`` on a thread, apply
    ``Lowered``, then handle the request again (it finds the template) and, after it, whatever its
    session sent meanwhile, in order."""

    session_id: str
    job: LoweringJob


@dataclasses.dataclass(frozen=True)
class Reclaim:
    """Request ``message`` of each executor at ``controls``. For a resume (``resume``): then hand the core
    ``Reclaimed`` with their answers, and answer the request with what that says."""

    controls: list[str]
    message: ReclaimOwner
    resume: ResumeSession | None = None
    peer: bytes = b""
    user: str = ""


@dataclasses.dataclass(frozen=True)
class Inventory:
    """Ask the executor at ``control``, back from a stall it was declared lost in, what it holds (``ListHeld``);
    then ``Inventoried``."""

    control: str
    executor_id: str


@dataclasses.dataclass(frozen=True)
class CheckKept:
    """Ask each executor (by control address) which of its shard keys, donated to aborted run ``run_id``,
    it holds intact (``ListHeld(keys)``, after the run's ``CancelRun``); then ``KeptChecked`` with them all
    (none of an executor that does not answer)."""

    run_id: str
    asks: dict[str, list[str]]


Action = (Send | Reply | Ask | Park | Unpark | Wait | Fetching | FetchingAll | Expecting | Resolve | PeerLost | PeerBack | FencePeer | LowerOffLoop | Reclaim
          | Inventory | CheckKept | CheckFunction | Deliver)


def _summary(event: Event) -> str:
    """A line for the event log: what it is and whom it concerns, without its payload."""
    if isinstance(event, Inbound):
        msg = event.message
        what = getattr(msg, "run_id", None) or getattr(msg, "program_id", None) or getattr(msg, "session_id", None)
        return f"Inbound({msg.op} from {event.peer.hex()[:12]}{f' {what}' if what else ''})"
    if isinstance(event, Notice):
        return f"Notice({event.message.op})"
    if isinstance(event, KeptChecked | Inventoried | Reclaimed):
        return describe(event)[:300]
    return type(event).__name__


def settled(buffers: list[Buffer]) -> PwmeshError | None:
    """What a wait on ``buffers`` (all done) answers: the first failure in their order, or None."""
    for buf in buffers:
        if buf.error is not None:
            return buf.error
        if buf.lost is not None:
            return buf.lost
    return None


def sources(session_id: str, buf: Buffer) -> list[tuple[str, str]]:
    """Where to fetch ``buf`` from: (executor control address, shard key), one per distinct block
    (``Layout.distinct()`` order; replicas are not fetched twice)."""
    keys = buf.keys(session_id)
    return [(buf.locations[i].control, keys[i]) for i in value_layout(buf.spec).distinct()]


# ------------------------------------------------------------------ the core


