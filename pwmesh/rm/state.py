"""The resource manager's state machine, with no sockets: ``handle(event, now) -> actions``.

Events:
    ``Received(message)``  a request from a daemon (register, heartbeat, watch, allocate, release, drain...).
    ``Tick()``             time passed: daemons that missed their heartbeats are lost.

Actions (each carrying the id of the event that caused it, ``stimulus``):
    ``Notify(message)``    tell every watcher (proxies, schedulers): ``ExecutorJoined``, ``ExecutorLost`` when
                           a host leaves or falls silent (carrying the remaps that loss caused),
                           ``SliceRemapped`` when a slice's virtual devices move off a draining host or back
                           onto new capacity, ``SchedulerJoined``/``SchedulerLost``, ``ProxyLost``...
    ``Reply(message, error)`` the answer to a ``Received`` request (after its notices, which watchers hear
                           before the requester hears back).

Every event but heartbeats is kept in ``events`` (heartbeats in a row are kept as one entry, the latest of
each daemon: all a replay needs of them); ``EventLog.timed`` hands them to a fresh core to replay. The
state can be rebuilt after a restart from what registrants send again (``WatchCluster.slices``).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import itertools

from pwmesh.core.contract import EventLog, Received, Reply
from pwmesh.core.liveness import Liveness
from pwmesh.errors import InvalidArgument, NotFound, PwmeshError, ResourceExhausted, Unavailable
from pwmesh.rm.placement import DeviceRef, of_kind, place
from pwmesh.wire.messages import (
    AllocateSlice,
    ClaimProxy,
    ClusterState,
    ClusterStateReply,
    DeviceMove,
    DrainExecutor,
    DrainStarted,
    ExecutorInfo,
    ExecutorJoined,
    ExecutorLost,
    ExecutorRestarting,
    GetClusterState,
    Heartbeat,
    LeavingForGroup,
    Message,
    Ok,
    PhysicalDevice,
    PleaseRegister,
    ProxyLease,
    ProxyLost,
    RegisterExecutor,
    RegisterScheduler,
    RegrantSlices,
    ReleaseSlices,
    SchedulerInfo,
    SchedulerJoined,
    SchedulerLost,
    SliceAllocated,
    SliceInfo,
    SliceRemapped,
    SlicesUpdated,
    UnregisterExecutor,
    VacateSlices,
    WatchCluster,
)

MAX_REQUESTS_KEPT = 10_000  # requests remembered (made, or given up), the oldest forgotten first
MAX_RESTORED_ID = 1 << 62  # a restored slice's id and map version: the RM adds 1 to each, and it must stay encodable
# Requests whose objects the state keeps and changes (an executor's info, a restored slice): logged as copies,
# so a replay starts from what arrived, not from what it became.
_KEPT = (RegisterExecutor, RegisterScheduler, WatchCluster)

# ------------------------------------------------------------------ events


@dataclasses.dataclass(slots=True)
class Tick:
    """Time passed: who missed their heartbeats is lost."""


@dataclasses.dataclass(slots=True)
class Heartbeats:
    """In the event log: heartbeats in a row, the latest of each daemon ((role, name) -> when). Replayed, they
    leave liveness as the originals did: a heartbeat changes nothing else, and nothing else came between."""

    latest: dict[tuple[str, str], float]

    def timed(self) -> list[tuple[float, Received]]:
        return sorted(((now, Received(Heartbeat(role=role, name=name))) for (role, name), now in self.latest.items()),
                      key=lambda pair: pair[0])


Event = Received | Tick

# ----------------------------------------------------------------- actions


@dataclasses.dataclass(slots=True)
class Notify:
    """Tell every watcher ``message``."""

    message: Message
    stimulus: str = ""


Action = Notify | Reply


@dataclasses.dataclass
class ResourceManagerState:
    heartbeat_timeout_seconds: float = 10.0
    first_slice_id: int = 1
    map_version: int = 0
    executors: dict[str, ExecutorInfo] = dataclasses.field(default_factory=dict)
    schedulers: dict[int, SchedulerInfo] = dataclasses.field(default_factory=dict)
    slices: dict[int, SliceInfo] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.liveness = Liveness(self.heartbeat_timeout_seconds)
        self.events = EventLog()  # the latest events handled (``pwmesh debug events``)
        self.notifications: list[Message] = []  # made while an event is handled: its ``Notify`` actions
        self._physicals: dict[str, tuple[ExecutorInfo, dict[int, PhysicalDevice]]] = {}
        self.known: set[tuple[str, str]] = set()  # (role, name) of every registrant
        # Ever, for the metrics: daemons found silent by role ((role,) keys), executors lost and left.
        self.heartbeat_misses: dict[tuple[str], int] = {("executor",): 0, ("scheduler",): 0, ("proxy",): 0}
        self.active_proxy: tuple[str, str] | None = None  # (name, address) of the proxy holding the lease
        self.executors_lost = 0
        self.executors_left = 0
        self._slice_ids = itertools.count(self.first_slice_id)
        # Requests by (owner or what, request): what each made (a slice id), and those given up before they
        # arrived (``AllocateSlice.request``, ``DrainExecutor.request``).
        self._by_request: collections.OrderedDict[tuple[str, str], int] = collections.OrderedDict()
        self._given_up: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()

    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply ``event``; return what watchers must be told and, for a request, its answer, in order."""
        if type(event) is Tick:
            stimulus = self.events.stimulus("tick")
            silent = self._expire(now)
            actions = self._actions(stimulus)
            if silent:  # a tick that finds everyone alive changes nothing: not logged, so the log shows the rest
                self.events.record(now, stimulus, event, len(actions))
            return actions
        if not isinstance(event, Received):
            raise TypeError(f"not a resource manager event: {event!r}")
        message = event.message
        if type(message) is Heartbeat:  # the bulk of its traffic: the latest of each kept, in one entry
            stimulus = self.events.stimulus("heartbeat")
            actions = self._answer(message, now, stimulus)
            entries = self.events.entries
            last = entries[-1][2] if entries else None
            if type(last) is Heartbeats:
                last.latest.pop((message.role, message.name), None)  # re-inserted: the dict keeps beats in order
                last.latest[(message.role, message.name)] = now
            else:
                self.events.record(now, stimulus, Heartbeats({(message.role, message.name): now}), len(actions))
            return actions
        stimulus = self.events.stimulus(message.op)
        kept = Received(copy.deepcopy(message)) if isinstance(message, _KEPT) else event
        actions = self._answer(message, now, stimulus)
        self.events.record(now, stimulus, kept, len(actions))
        return actions

    def _answer(self, message: Message, now: float, stimulus: str) -> list[Action]:
        try:
            reply = Reply(self._handle(message, now), stimulus=stimulus)
        except PwmeshError as exc:
            reply = Reply(error=exc, stimulus=stimulus)
        actions = self._actions(stimulus)
        actions.append(reply)
        return actions

    def _actions(self, stimulus: str) -> list[Action]:
        """The notices made while handling an event, as actions."""
        notes, self.notifications = self.notifications, []
        return [Notify(note, stimulus) for note in notes]

    def _handle(self, message: Message, now: float) -> Message | None:
        match message:
            case RegisterExecutor(info=info):
                return self._register_executor(info, now)
            case UnregisterExecutor(executor_id=executor_id, reason=reason):
                if executor_id in self.executors:
                    self._lose(executor_id, reason, graceful=True)
                return Ok()
            case RegisterScheduler(info=info):
                self._register_scheduler(info, now)
                return Ok()
            case WatchCluster(role=role, name=name, slices=slices):
                self.known.add((role, name))
                self._restore(slices)
                return Ok()
            case Heartbeat(role=role, name=name):
                if (role, name) not in self.known:
                    lost = self.executors.get(name) if role == "executor" else None
                    if lost is not None and not lost.alive:  # back from a stall, after we declared it lost
                        return PleaseRegister(written_off="the resource manager declared it lost while it "
                                                          "did not answer")
                    return PleaseRegister()  # we restarted, or it registered elsewhere
                if role in ("executor", "scheduler"):
                    self.liveness.beat(f"{role}:{name}" if role == "scheduler" else name, now)
                if role == "proxy":
                    if self.active_proxy is not None and self.active_proxy[0] == name:
                        self.liveness.beat(f"proxy:{name}", now)
                    return self._lease(name)
                return Ok()  # answered: the daemon knows the RM is there (``rpc.Beats``)
            case ClaimProxy(name=name, address=address):
                if self.active_proxy is None or self.active_proxy[0] == name:
                    self.active_proxy = (name, address)
                    self.liveness.beat(f"proxy:{name}", now)
                return self._lease(name)
            case LeavingForGroup(executor_id=executor_id, epoch=epoch, grace_seconds=grace):
                leaving = self.executors.get(executor_id)
                if leaving is None:
                    return PleaseRegister()
                # The grace counts as a beat that far in the future: a restart under way is no loss.
                self.liveness.excuse(executor_id, now + max(0.0, min(grace, 600.0)))
                self.notifications.append(ExecutorRestarting(executor_id=executor_id, control=leaving.control,
                                                             epoch=epoch))
                return Ok()
            case AllocateSlice(owner=owner, devices=n, island=island, kind=kind, request=request):
                if request and (owner, request) in self._given_up:
                    raise Unavailable(f"slice request {request} was given up by its caller before it arrived")
                sl = self._allocate(owner, n, island, kind)
                if request:
                    self._remember((owner, request), sl.slice_id)
                return SliceAllocated(slice=sl)
            case ReleaseSlices(owner=owner, slice_ids=ids, requests=requests):
                if ids is not None or not requests:
                    self._release(owner, ids)
                made = []
                for request in requests:
                    sid = self._by_request.pop((owner, request), None)
                    if sid is None:  # not arrived yet (or failed): refused if it does
                        self._give_up((owner, request))
                    else:
                        made.append(sid)
                if made:
                    self._release(owner, made)
                return Ok()
            case VacateSlices(owner=owner, slice_ids=ids):
                return SlicesUpdated(slices=self._vacate(owner, ids))
            case RegrantSlices(owner=owner, slice_ids=ids, devices=n, island=island):
                return SlicesUpdated(slices=self._regrant(owner, ids, n, island))
            case DrainExecutor(executor=name, request=request, cancel=cancel):
                key = ("drain " + name, request)
                if cancel:
                    if self._by_request.pop(key, None) is not None:
                        self._undrain(name)
                    else:
                        self._give_up(key)
                    return Ok()
                if request and key in self._given_up:
                    raise Unavailable(f"the drain of {name} was given up by its caller before it arrived")
                started = self._drain(name)
                if request:
                    self._remember(key, 1)
                return started
            case GetClusterState():
                return ClusterStateReply(state=self.snapshot())
        raise InvalidArgument(f"the resource manager does not handle {message.op}")

    # ------------------------------------------------------------------ hosts

    def _register_executor(self, info: ExecutorInfo, now: float) -> Ok:
        # New, back from the dead (paused, partitioned, restarted), or restarted into its JAX group's
        # next forming: watchers deliver to it again, and its island's scheduler tracks the group.
        old = self.executors.get(info.executor_id)
        new_process = info.fresh and (old is None or not old.fresh or old.incarnation != info.incarnation)
        if new_process and old is not None and old.alive:
            # Killed and started again before it was found silent: the old process and everything it
            # held or was running are gone, exactly as if it had been declared lost.
            self._lose(info.executor_id, "it restarted: a new process registered under its name")
        self.notifications.append(ExecutorJoined(executor_id=info.executor_id, control=info.control,
                                                 island=info.island, group=info.group,
                                                 group_epoch=info.group_epoch, fresh=new_process))
        info.alive = True
        info.draining = False
        self.executors[info.executor_id] = info
        self.known.add(("executor", info.executor_id))
        self.liveness.forget(info.executor_id)  # registered again: any excuse for a restart ends
        self.liveness.beat(info.executor_id, now)
        self.map_version += 1
        self._remap(f"capacity returned with {info.executor_id}", only_broken=True)
        return Ok()

    def _register_scheduler(self, info: SchedulerInfo, now: float) -> None:
        held = self.schedulers.get(info.island)
        if held is not None and held.epoch and info.epoch and held.epoch != info.epoch:
            # Killed and started again before it was found silent: the runs the old instance was
            # ordering are lost with it (their proxies fail them), exactly as if it had been lost.
            self._lose_scheduler(held.name, f"it restarted: a new instance registered for island {info.island}; "
                                            "the runs it was ordering fail (run them again)")
        self.schedulers[info.island] = info
        self.known.add(("scheduler", info.name))
        self.liveness.beat(f"scheduler:{info.name}", now)
        self.notifications.append(SchedulerJoined(island=info.island, address=info.address))
        # Slices of the island follow their scheduler if it came back on another address.
        for sl in self.slices.values():
            if sl.island == info.island and sl.scheduler != info.address:
                sl.scheduler = info.address
                self.notifications.append(SliceRemapped(slice=sl, moves=[], reason=f"scheduler of island "
                                                        f"{info.island} is now at {info.address}"))

    def _lease(self, name: str) -> ProxyLease:
        holder, address = self.active_proxy or ("", "")
        return ProxyLease(active=holder == name, holder=holder, address=address)

    def _expire(self, now: float) -> list[str]:
        """Mark executors (and schedulers, and the active proxy) that missed their heartbeats as lost (``Tick``);
        returns who was silent."""
        silent = self.liveness.expired(now)
        why = f"missed heartbeats for {self.heartbeat_timeout_seconds} seconds"
        for name in [n for n in silent if n.startswith("proxy:")]:
            if self.active_proxy is not None and self.active_proxy[0] == name.removeprefix("proxy:"):
                self.heartbeat_misses[("proxy",)] += 1
                self.notifications.append(ProxyLost(name=self.active_proxy[0], address=self.active_proxy[1],
                                                    reason=why))
                self.active_proxy = None
        for name in [n for n in silent if n.startswith("scheduler:")]:
            self.heartbeat_misses[("scheduler",)] += 1
            self._lose_scheduler(name.removeprefix("scheduler:"), why)
        lost = [e for e in silent if e in self.executors and self.executors[e].alive]
        self.heartbeat_misses[("executor",)] += len(lost)
        for executor_id in lost:
            self._lose(executor_id, why)
        return silent

    def _lose_scheduler(self, name: str, reason: str) -> None:
        self.known.discard(("scheduler", name))
        for island, info in list(self.schedulers.items()):
            if info.name == name:
                del self.schedulers[island]  # no new slices there until one registers
                self.map_version += 1
                self.notifications.append(SchedulerLost(island=island, address=info.address, reason=reason))

    def _lose(self, executor_id: str, reason: str, graceful: bool = False) -> None:
        info = self.executors[executor_id]
        if not info.alive:
            return
        info.alive = False
        if graceful:
            self.executors_left += 1
        else:
            self.executors_lost += 1
        self.liveness.forget(executor_id)
        self.known.discard(("executor", executor_id))
        self.map_version += 1
        before = len(self.notifications)
        self._remap(f"{executor_id} is gone ({reason})")
        # Only SliceRemapped: they travel inside the loss.
        remapped = [n for n in self.notifications[before:] if isinstance(n, SliceRemapped)]
        del self.notifications[before:]
        self.notifications.append(ExecutorLost(executor_id=executor_id, host=info.host, control=info.control,
                                               reason=reason, graceful=graceful, remapped=remapped))

    def _remember(self, key: tuple[str, str], made: int) -> None:
        self._by_request[key] = made
        while len(self._by_request) > MAX_REQUESTS_KEPT:
            self._by_request.popitem(last=False)

    def _give_up(self, key: tuple[str, str]) -> None:
        self._given_up[key] = None
        while len(self._given_up) > MAX_REQUESTS_KEPT:
            self._given_up.popitem(last=False)

    def _undrain(self, name: str) -> None:
        """A drain its caller gave up on: the host takes new slices again (what moved off it stays moved)."""
        info = self._find(name)
        if info.draining:
            info.draining = False
            self.map_version += 1
            self._remap(f"the drain of {info.executor_id} was given up", only_broken=True)  # what it broke heals

    def _find(self, name: str) -> ExecutorInfo:
        found = [e for e in self.executors.values() if name in (e.executor_id, e.host)]
        if not found:
            raise NotFound(f"no executor or host named {name!r}")
        if len(found) > 1:
            raise InvalidArgument(f"{name!r} names several executors; give an executor id")
        return found[0]

    def _drain(self, name: str) -> DrainStarted:
        info = self._find(name)
        if not info.alive:
            raise NotFound(f"executor {info.executor_id} is not alive")
        info.draining = True
        self.map_version += 1
        before = len(self.notifications)
        self._remap(f"{info.executor_id} is draining")
        remapped = sum(1 for n in self.notifications[before:] if isinstance(n, SliceRemapped) and n.moves)
        return DrainStarted(executor_id=info.executor_id, control=info.control, remapped=remapped)

    # ----------------------------------------------------------------- slices

    def _usable(self, kind: str = "") -> list[ExecutorInfo]:
        """Live executors that take new slices, with only their devices of ``kind``."""
        usable = [e for e in self.executors.values() if e.alive and not e.draining]
        if not kind:
            return usable
        return [dataclasses.replace(e, devices=[d for d in e.devices if of_kind(d, kind)]) for e in usable]

    def _physical(self, ref: DeviceRef) -> PhysicalDevice:
        """Where ``ref`` lives, made once per registration of its executor (a whole-island slice asks
        for 8,192 of them: building each anew was most of its placement time). Shared by the slices
        that hold it; nothing changes one in place, a remap puts another in the slice."""
        ex = self.executors[ref[0]]
        known = self._physicals.get(ref[0])
        if known is None or known[0] is not ex:  # registered again: control, group may differ
            known = self._physicals[ref[0]] = (ex, {})
        physical = known[1].get(ref[1])
        if physical is None:
            info = next((d for d in ex.devices if d.index == ref[1]), None)
            physical = known[1][ref[1]] = PhysicalDevice(
                executor_id=ex.executor_id, island=ex.island, host=ex.host, device=ref[1], control=ex.control,
                data=ex.data, group=ex.group, platform=info.platform if info else "cpu")
        return physical

    def load(self) -> dict[DeviceRef, int]:
        """Slices per device (a suspended slice's devices are free: it counts nowhere)."""
        counts: dict[DeviceRef, int] = {}
        for sl in self.slices.values():
            if sl.suspended:
                continue
            for d in sl.devices:
                ref = (d.executor_id, d.device)
                counts[ref] = counts.get(ref, 0) + 1
        return counts

    def _allocate(self, owner: str, n: int, island: int | None, kind: str = "") -> SliceInfo:
        usable = self._usable(kind)
        if kind and not any(e.devices for e in usable):
            kinds = sorted({f"{d.platform} ({d.kind})" for e in self._usable() for d in e.devices}) or ["none"]
            raise ResourceExhausted(f"no live device is of kind {kind!r} (live devices: {', '.join(kinds)})")
        isl, refs = place(usable, self.load(), n, island)
        if isl not in self.schedulers:
            raise NotFound(f"island {isl} has devices but no scheduler has registered for it yet")
        self.map_version += 1
        devices = [self._physical(r) for r in refs]
        platforms = {d.platform for d in devices}
        # Its functions are exported for its devices' platform: a replacement must be of it too.
        kind = kind or (platforms.pop() if len(platforms) == 1 else "")
        sl = SliceInfo(slice_id=next(self._slice_ids), owner=owner, island=isl, devices=devices,
                       map_version=self.map_version, scheduler=self.schedulers[isl].address, kind=kind)
        self.slices[sl.slice_id] = sl
        return sl

    def _needs_move(self, d: PhysicalDevice) -> bool:
        ex = self.executors.get(d.executor_id)
        return ex is None or not ex.alive or ex.draining

    def _remap(self, reason: str, only_broken: bool = False) -> None:
        """Move every slice's devices off dead or draining executors, where the island has room.

        A slice that cannot be fully backed is marked ``broken`` (using it fails clearly)
        and is repaired when capacity returns."""
        for sl in sorted(self.slices.values(), key=lambda s: s.slice_id):
            if (only_broken and not sl.broken) or sl.suspended:  # a suspended one is placed anew when resumed
                continue
            stale = [i for i, d in enumerate(sl.devices) if self._needs_move(d)]
            if not stale:
                if sl.broken:  # its executors came back (restarted, resumed, reconnected): heal in place
                    self._heal(sl, reason)
                continue
            taken = {(d.executor_id, d.device) for d in sl.devices}
            candidates = [
                dataclasses.replace(e, devices=[d for d in e.devices if (e.executor_id, d.index) not in taken])
                for e in self._usable(sl.kind) if e.island == sl.island
            ]
            try:
                _, refs = place(candidates, self.load(), len(stale), sl.island)
            except ResourceExhausted as exc:
                why = (f"{len(stale)} of its {len(sl.devices)} devices have no live backing and island "
                       f"{sl.island} cannot replace them ({exc.message})")
                if sl.broken != why:
                    sl.broken = why
                    self.notifications.append(SliceRemapped(slice=sl, moves=[], reason=reason))
                continue
            self.map_version += 1
            moves = []
            for i, ref in zip(stale, refs, strict=True):
                moves.append(DeviceMove(index=i, old=sl.devices[i], new=self._physical(ref)))
                sl.devices[i] = moves[-1].new
            sl.broken = ""
            sl.map_version = self.map_version
            self.notifications.append(SliceRemapped(slice=sl, moves=moves, reason=reason))

    def _heal(self, sl: SliceInfo, reason: str) -> None:
        """``sl`` was broken, and every executor it names is live again: it runs again, on where each
        device lives now (a restarted executor may listen at a new address)."""
        self.map_version += 1
        moves = []
        for i, d in enumerate(sl.devices):
            now = self._physical((d.executor_id, d.device))
            if now != d:
                moves.append(DeviceMove(index=i, old=d, new=now))
                sl.devices[i] = now
        sl.broken = ""
        sl.map_version = self.map_version
        self.notifications.append(SliceRemapped(slice=sl, moves=moves, reason=reason))

    def _owned(self, owner: str, ids: list[int]) -> list[SliceInfo]:
        if not ids:
            raise InvalidArgument("name at least one slice")
        found = []
        for sid in dict.fromkeys(ids):
            sl = self.slices.get(sid)
            if sl is None or sl.owner != owner:
                raise NotFound(f"slice {sid} is not one of {owner}'s")
            found.append(sl)
        return found

    def _vacate(self, owner: str, ids: list[int]) -> list[SliceInfo]:
        """Suspend slices: their devices go to whoever asks next (``load`` skips them); their ids stay theirs."""
        slices = self._owned(owner, ids)
        for sl in slices:
            if not sl.suspended:
                sl.suspended = True
                self.map_version += 1
                sl.map_version = self.map_version
        return slices

    def _regrant(self, owner: str, ids: list[int], devices: int, island: int | None) -> list[SliceInfo]:
        """Resume (or reshape) slices: each placed anew, as a new slice would be, as if its old devices were
        free; all placed, or none (``ResourceExhausted``)."""
        slices = self._owned(owner, ids)
        if devices and len(slices) != 1:
            raise InvalidArgument(f"a reshape names one slice, not {len(slices)}")
        load = self.load()
        for sl in slices:
            if not sl.suspended:
                for d in sl.devices:
                    load[(d.executor_id, d.device)] -= 1
        placed = []
        for sl in slices:
            count = devices or len(sl.devices)
            isl, refs = place(self._usable(sl.kind), load, count, sl.island if island is None else island)
            if isl not in self.schedulers:
                raise NotFound(f"island {isl} has devices but no scheduler has registered for it yet")
            for ref in refs:  # the next slice of this request sees these as taken
                load[ref] = load.get(ref, 0) + 1
            placed.append((sl, isl, refs))
        for sl, isl, refs in placed:
            self.map_version += 1
            sl.devices = [self._physical(r) for r in refs]
            sl.island, sl.scheduler = isl, self.schedulers[isl].address
            sl.suspended, sl.broken, sl.map_version = False, "", self.map_version
        return slices

    def _release(self, owner: str, ids: list[int] | None) -> None:
        doomed = [sid for sid, sl in self.slices.items() if sl.owner == owner and (ids is None or sid in ids)]
        for sid in doomed:
            del self.slices[sid]
        if doomed:
            self.map_version += 1

    def _restore(self, slices: list[SliceInfo]) -> None:
        """Take back slices a proxy still holds (after a restart of this resource manager)."""
        for sl in slices:  # all checked before any is taken: a refused restore changes nothing
            if not (0 <= sl.slice_id < MAX_RESTORED_ID and 0 <= sl.map_version < MAX_RESTORED_ID):
                # It adds 1 to both: at 2^64 - 1 no message holding them could be encoded again.
                raise InvalidArgument(f"cannot restore slice {sl.slice_id} at map version {sl.map_version}: "
                                      f"ids and versions must be below 2^62")
        for sl in slices:
            self.slices.setdefault(sl.slice_id, sl)
        if slices:
            self.map_version = max(self.map_version, *(s.map_version for s in slices)) + 1
            top = max(self.slices)
            self._slice_ids = itertools.count(max(top + 1, next(self._slice_ids)))

    def snapshot(self) -> ClusterState:
        return ClusterState(
            map_version=self.map_version,
            executors=list(self.executors.values()),
            schedulers=sorted(self.schedulers.values(), key=lambda s: s.island),
            slices=list(self.slices.values()),
        )
