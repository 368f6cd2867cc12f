"""The gangs an executor was sent: what an SPMD computation spanning executors runs over.

Such a computation names its gang by id (``Computation.gang``); the gang's devices, every
(executor, device) of its mesh in shard order, come once per slice version in a
``RegisterGang`` from the proxy, before the first run that uses them, so a run's parts do
not grow with the gang. They come directly, not through the island scheduler, so a
computation may reach its devices first: it waits for its gang as it does for its
function, but not for ever. After ``wait_seconds`` it fails, naming the gang that never
came (the proxy sends a gang again to an executor that restarted as a new process;
this executor keeps the newest ``capacity`` gangs, and those it had across a restart
into its group's next forming: ``spill``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses

from pwmesh.errors import InvalidArgument, NotFound
from pwmesh.ir.keys import gang_id
from pwmesh.wire.messages import RegisterGang
from pwmesh.wire.records import MAX_DEVICES

MAX_GANG_DEVICES = 1 << 20  # devices in one gang: more is a bad message, not a big slice


@dataclasses.dataclass(frozen=True)
class Gang:
    gang_id: str
    mesh: tuple[tuple[str, int], ...]  # (executor, device index) of every device, in shard order
    label: str  # "16 devices of ex0, ex1": for the watchdog and errors

    @classmethod
    def of(cls, msg: RegisterGang) -> Gang:
        """The gang ``msg`` describes, checked: ranges an executor could hold, and the id its devices hash to."""
        total = 0
        for r in msg.devices:
            if not (0 <= r.first < MAX_DEVICES and 1 <= r.count <= MAX_DEVICES - r.first):
                raise InvalidArgument(f"gang {msg.gang_id[:12]}: devices [{r.first}, {r.first}+{r.count}) of "
                                      f"{r.executor_id} are out of range (at most {MAX_DEVICES} an executor)")
            total += r.count
            if total > MAX_GANG_DEVICES:
                raise InvalidArgument(f"gang {msg.gang_id[:12]} has over {MAX_GANG_DEVICES} devices")
        if not msg.devices:
            raise InvalidArgument(f"gang {msg.gang_id[:12]} has no devices")
        if gang_id(msg.devices) != msg.gang_id:
            raise InvalidArgument(f"gang {msg.gang_id[:12]}: its id is not the hash of its devices")
        mesh = tuple((r.executor_id, r.first + k) for r in msg.devices for k in range(r.count))
        hosts = sorted({r.executor_id for r in msg.devices})
        return cls(msg.gang_id, mesh, f"{len(mesh)} devices of {', '.join(hosts)}")


class Gangs:
    """The gangs this executor knows, by id (the newest ``capacity``); computations wait for theirs."""

    def __init__(self, wait_seconds: float = 60.0, capacity: int = 4096) -> None:
        self.wait_seconds = wait_seconds
        self.capacity = capacity
        self._known: collections.OrderedDict[str, tuple[Gang, RegisterGang]] = collections.OrderedDict()
        self._waiting: dict[str, asyncio.Future[Gang]] = {}  # ids asked for before they came

    def __len__(self) -> int:
        return len(self._known)

    def register(self, msg: RegisterGang) -> Gang:
        """Learn a gang (again: the same id is the same devices); wakes the computations waiting for it."""
        found = self._known.get(msg.gang_id)
        if found is None:
            found = (Gang.of(msg), msg)
            self._known[msg.gang_id] = found
            while len(self._known) > self.capacity:
                self._known.popitem(last=False)
        else:
            self._known.move_to_end(msg.gang_id)
        waiting = self._waiting.pop(msg.gang_id, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(found[0])
        return found[0]

    def known(self, gang_id: str) -> Gang | None:
        found = self._known.get(gang_id)
        return None if found is None else found[0]

    def get(self, gang_id: str) -> asyncio.Future[Gang]:
        """The gang's future: resolved at once if it is known, at its registration if that comes within
        ``wait_seconds``, else failed (``NotFound``) saying so."""
        loop = asyncio.get_running_loop()
        found = self.known(gang_id)
        if found is not None:
            fut: asyncio.Future[Gang] = loop.create_future()
            fut.set_result(found)
            return fut
        waiting = self._waiting.get(gang_id)
        if waiting is None:
            waiting = self._waiting[gang_id] = loop.create_future()
            loop.call_later(self.wait_seconds, self._give_up, gang_id, waiting)
        return waiting

    def _give_up(self, gang_id: str, waiting: asyncio.Future[Gang]) -> None:
        if waiting.done():
            return
        if self._waiting.get(gang_id) is waiting:
            del self._waiting[gang_id]  # a later computation waits afresh
        waiting.set_exception(NotFound(
            f"gang {gang_id}'s devices were not sent to this executor within "
            f"{self.wait_seconds:g} s (RegisterGang: the proxy sends each executor a gang once per slice "
            "version, before the first run that uses it; one that restarted as a new process is sent it again "
            "with its next run)"))
        waiting.exception()  # retrieved: those waiting read it; nobody else need

    def saved(self) -> list[RegisterGang]:
        """What a restart into the group's next forming keeps (``spill``), oldest first."""
        return [msg for _, msg in self._known.values()]
