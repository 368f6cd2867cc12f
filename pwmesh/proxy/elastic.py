"""Elastic slices in the proxy: suspending a slice, resuming it on other devices, reshaping it.

The resource manager decides where a slice goes (``VacateSlices``, ``RegrantSlices``); this
module says what that means for a session's buffers, as pure functions the core calls:

* Suspended, a slice's devices count in nobody's load. Its buffers leave the devices for their
  executors' host memory (``spill``: one ``SpillShards`` per holding executor), stay readable
  (``pw.get`` works), and nothing new runs or is put on it (``refuse``).
* Resumed or reshaped, the slice keeps its id and gets the devices the resource manager grants.
  Every live buffer of it is copied executor to executor into a buffer of a new name laid out on
  the new devices (one ``SendShards`` per holding executor, as a drain moves shards, but cut to the
  new layout: ``block_emit``), and the session's client id is bound to that buffer, so the client's
  ``pw.Array`` stays the same object. The old copies are deleted right behind, one ``DeleteShards``
  per holder on the same connection as its ``SendShards`` (an executor looks up what it sends when
  the ``SendShards`` arrives), never as a ``FreeShards`` through the island's scheduler, which has no
  order against the proxy's send. New names, because old and new devices may share
  an executor, where a shard key can be held once only.
* Both count the buffers a run was given (donated) and aborted before it consumed them: its client's
  to take back (``Session.returnable``), so they leave the devices and move with the slice as well.

A resume or reshape waits for nothing: it is refused while a run or a fetch still pins a buffer
of the slice (the client library waits for its arrays first).
"""

from __future__ import annotations

from pwmesh.errors import InvalidArgument, NotFound, SliceSuspended, Unavailable
from pwmesh.ir.lower import block_emit, runs_of, sites_of, slice_locations, value_layout
from pwmesh.proxy.session import Buffer, Session
from pwmesh.wire.messages import (
    ProgramSpec,
    ResumeSlices,
    RunProgram,
    SendShards,
    Sharding,
    SliceInfo,
    SpillShards,
    ValueSpec,
)


def owned(session: Session, ids: list[int]) -> list[SliceInfo]:
    """The session's slices ``ids``; ``NotFound`` naming one it does not hold."""
    if not ids:
        raise InvalidArgument("name at least one slice")
    missing = [sid for sid in ids if sid not in session.slices]
    if missing:
        raise NotFound(f"session {session.session_id} holds no slice {missing[0]}")
    return [session.slices[sid] for sid in dict.fromkeys(ids)]


def suspended_error(sl: SliceInfo, what: str) -> SliceSuspended:
    return SliceSuspended(f"{what}: slice {sl.slice_id} is suspended (its devices were given to others); resume it "
                          "(slice.resume(), or an admin's `pwmesh resume`) and call again")


def refuse(session: Session, msg: RunProgram, program: ProgramSpec) -> None:
    """``SliceSuspended`` if the run computes on, moves to or reads from a suspended slice."""
    if not any(sl.suspended for sl in session.slices.values()):  # most runs: nothing to look for in the nodes
        return                                                     # (a million-node program's would hold the loop)
    for node in program.nodes:
        for sid in (node.slice_id, *node.targets):
            sl = session.slices.get(sid)
            if sl is not None and sl.suspended:
                raise suspended_error(sl, "the run was not started")
    for inp in msg.inputs:
        buf = session.buffers.get(inp.buffer) if inp.buffer is not None else None
        sl = session.slices.get(buf.slice_id) if buf is not None and buf.slice_id is not None else None
        if sl is not None and sl.suspended:
            raise suspended_error(sl, f"the run was not started (it reads pw.Array {inp.buffer})")


def check_reshape(session: Session, msg: ResumeSlices) -> None:
    """A reshape's request is whole: one slice, a mesh of ``devices`` devices, a layout over it per buffer that
    its value can take."""
    if not msg.devices:
        if msg.mesh or msg.buffers or msg.shardings:
            raise InvalidArgument("a resume keeps its slice's mesh: give devices= to reshape it")
        return
    if msg.devices < 1 or len(msg.slice_ids) != 1:
        raise InvalidArgument(f"a reshape names one slice and a positive number of devices, got {msg.devices} "
                              f"devices for slices {msg.slice_ids}")
    product = 1
    for size in msg.mesh:
        product *= size
    if not msg.mesh or product != msg.devices or any(size < 1 for size in msg.mesh):
        raise InvalidArgument(f"the new mesh {msg.mesh} does not have {msg.devices} devices")
    if len(msg.buffers) != len(msg.shardings):
        raise InvalidArgument(f"{len(msg.buffers)} buffers and {len(msg.shardings)} shardings: give one per buffer")
    for sharding in msg.shardings:
        if sharding.mesh != msg.mesh:
            raise InvalidArgument(f"a buffer's sharding is over mesh {sharding.mesh}, not the new mesh {msg.mesh}")
    for cid, sharding in zip(msg.buffers, msg.shardings, strict=True):
        buf = session.buffers.get(cid) or session.returnable.get(cid)
        if buf is not None:
            value_layout(ValueSpec(shape=list(buf.spec.shape), dtype=buf.spec.dtype, shards=msg.devices,
                                   sharding=sharding)).check(f"pw.Array {cid} on {msg.devices} devices")


def held(session: Session, slices: list[SliceInfo]) -> list[int]:
    """The buffers of ``slices`` a run or fetch still pins, or that are not computed yet: nothing moves under them."""
    ids = {sl.slice_id for sl in slices}
    return [cid for cid, buf in session.buffers.items() if buf.slice_id in ids and (buf.pins or not buf.done)]


def held_error(session: Session, slices: list[SliceInfo], busy: list[int]) -> Unavailable:
    """Why ``slices`` cannot move yet (``busy``: what ``held`` found), naming the runs that hold the first."""
    buf = session.buffers[busy[0]]
    runs = [run.run_id for run in session.runs.values() if any(b is buf for b in (*run.pinned, *run.outputs))]
    why = (f"{'computed' if buf.done else 'not computed'}, {buf.pins} pin(s), {buf.readers} reader(s), "
           f"runs holding it: {', '.join(runs) or 'none'}")
    return Unavailable(f"pw.Array {busy[0]} ({why}; and {len(busy) - 1} more) of slice "
                       f"{min(sl.slice_id for sl in slices)} are still being computed or read")


def spill(session: Session, sl: SliceInfo) -> list[tuple[str, SpillShards]]:
    """The messages (control address, message) that move every buffer of suspended slice ``sl`` off its devices
    into its executors' host memory, one per holding executor: its devices are others' now."""
    by_control: dict[str, list[str]] = {}
    for buf in [*session.buffers.values(), *session.returnable.values()]:
        if buf.slice_id != sl.slice_id:
            continue
        for control in sorted({loc.control for loc in buf.locations}):
            by_control.setdefault(control, []).append(f"{session.session_id}/{buf.name}")
    return [(control, SpillShards(buffers=buffers)) for control, buffers in by_control.items()]


def move(session: Session, new: SliceInfo, reshape: ResumeSlices | None) -> tuple[list[tuple[str, SendShards]],
                                                                                 list[Buffer]]:
    """Bind every live buffer of slice ``new.slice_id`` to a copy laid out on ``new``'s devices (as ``reshape``
    says, if it reshapes). Returns the sends that copy them (control address, message), in order, and the old
    buffers, which the caller frees right behind."""
    layouts: dict[int, Sharding] = dict(zip(reshape.buffers, reshape.shardings, strict=True)) if reshape else {}
    locations = slice_locations(new)
    sites = sites_of(locations)
    holders = {loc.control for loc in locations}
    sends: list[tuple[str, SendShards]] = []
    old: list[Buffer] = []
    for held in (session.buffers, session.returnable):  # the client's, and those it may take back
        for cid, buf in list(held.items()):
            if buf.slice_id != new.slice_id:
                continue
            sharding = buf.spec.sharding
            if reshape is not None:  # a buffer the client did not lay out (dropped meanwhile): replicated
                sharding = layouts.get(cid, Sharding(mesh=list(reshape.mesh), spec=[]))
            spec = ValueSpec(shape=list(buf.spec.shape), dtype=buf.spec.dtype, shards=len(locations),
                             sharding=sharding)
            copy = Buffer.new(session.buffer_name(cid), spec, client_ref=buf.client_ref)
            copy.slice_id = new.slice_id
            failure = buf.error or buf.lost
            if failure is not None or not buf.locations:
                copy.resolve(failure)  # failed it stays, with its cause
                copy.lost = buf.lost
            else:
                emit = block_emit(buf.spec, f"{session.session_id}/{copy.name}", value_layout(spec), sites)
                by_holder: dict[str, list[tuple[int, int]]] = {}
                control: dict[str, str] = {}
                for i, loc in enumerate(buf.locations):
                    by_holder.setdefault(loc.executor_id, []).append((loc.device, i))
                    control[loc.executor_id] = loc.control
                for executor_id, pairs in by_holder.items():
                    sends.append((control[executor_id], SendShards(prefix=f"{session.session_id}/{buf.name}",
                                                                   runs=runs_of(pairs), emits=[emit])))
                copy.locations = list(locations)
                copy.holders = set(holders)
                copy.resolve(None)  # its executors wait for the shards' arrival before they use or send them
            held[cid] = copy
            buf.client_ref = False
            old.append(buf)
    return sends, old
