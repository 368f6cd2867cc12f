"""Sessions that outlive their proxy: resume tokens, and a session rebuilt from the ground truth.

A proxy keeps its sessions in memory only. When it restarts, what the sessions held is still
in the cluster: the resource manager holds their slices (each owned by its session's id) and
the executors hold their buffers' shards (keyed ``"<session>/<buffer>/<shard>"``). A client
that finds its session gone (a heartbeat answered "no session") resumes it
(``ResumeSession``): it shows the token its session was opened with and declares what it
still holds (its live arrays, with their specs, and its slices). The new proxy asks the
executors of those slices what they hold of the session (``ReclaimOwner``, which also
cancels the runs the proxy before had sent and makes the executors drop anything of that
run still to come) and rebuilds the session from the two: an array whose every shard is
there is kept as it is; one whose shards are not all there (its run was in flight) fails
with ``Unavailable`` naming the restart; whatever nobody declared is freed. Sessions nobody
resumes within the session timeout of the restart are freed whole.

No journal is kept: everything a session is made of is held by the resource manager, the
executors or the client already, so a journal could only repeat it (and would have to be
kept in step with it on every request, the proxy's hot path). What is lost with the proxy
are its runs in flight: their outcomes were the proxy's to collect.

The token is an HMAC of the session id and its key's name under a secret that outlives the
process (``--session-secret-file``, or derived from the proxy's key): a new proxy checks it
without any state, and a token opens only its own session, for its own key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
from collections.abc import Sequence

from pwmesh.errors import Unavailable
from pwmesh.ir.lower import location, split_key
from pwmesh.proxy.session import Buffer, Session
from pwmesh.wire.messages import OwnedShards, PhysicalDevice, ResumedBuffer, SliceInfo

# A buffer's name in the object store: ``b<client id>.<n>``, after the marker of the proxy that named it
# (``r<hex>.``, for a session resumed before).
_CLIENT_BUFFER = re.compile(r"(?:r[0-9a-f]+\.)?b(\d+)\.\d+")


def resume_token(secret: bytes, session_id: str, owner: str) -> str:
    """What opens ``session_id`` for key ``owner`` again at a proxy holding ``secret`` ("" with none)."""
    if not secret:
        return ""
    return hmac.new(secret, f"{session_id}\0{owner}".encode(), hashlib.sha256).hexdigest()


def data_key(secret: bytes, session_id: str) -> bytes:
    """What session ``session_id``'s direct transfers are keyed with (its client and the executors hold it):
    derived, so a proxy restarted with the same ``secret`` gives the executors the key the client has."""
    return hmac.new(secret, f"data\0{session_id}".encode(), hashlib.sha256).digest()


def token_matches(secret: bytes, session_id: str, owner: str, token: str) -> bool:
    expected = resume_token(secret, session_id, owner)
    return bool(expected) and hmac.compare_digest(expected, token)


@dataclasses.dataclass
class Orphan:
    """A session of the proxy before this one, as the resource manager still holds it."""

    slices: list[SliceInfo] = dataclasses.field(default_factory=list)


def slice_controls(slices: list[SliceInfo]) -> list[str]:
    """The executors (control addresses) the slices' devices are on, each once, in order."""
    return list(dict.fromkeys(d.control for sl in slices for d in sl.devices))


@dataclasses.dataclass
class Adopted:
    failed: list[int]  # declared buffers whose values are not all there (now failed)
    unclaimed: dict[str, set[str]]  # executor control -> buffers ("<owner>/<name>") nobody declared


def adopt(session: Session, declared: list[ResumedBuffer], held: dict[str, OwnedShards | None],
          why: str, optional: Sequence[ResumedBuffer] = ()) -> Adopted:
    """Rebuild ``session``'s buffers from what its client declared and what the executors hold (``held``: by
    control address; None where one did not answer). ``session.slices`` must be set. ``optional``: kept if
    they are all there, else left out (not failed)."""
    owner = session.session_id
    devices: dict[tuple[str, int], tuple[int, PhysicalDevice]] = {
        (d.control, d.device): (sl.slice_id, d) for sl in session.slices.values() for d in sl.devices}
    shards: dict[str, dict[int, tuple[str, int]]] = {}  # name -> shard -> (control, device)
    for control, got in held.items():
        for key, device in zip(got.keys if got else [], got.devices if got else [], strict=True):
            parts = split_key(key)
            if parts is not None and parts[0] == owner:
                shards.setdefault(parts[1], {})[parts[2]] = (control, device)
    by_client: dict[int, list[str]] = {}
    for name in shards:
        match = _CLIENT_BUFFER.fullmatch(name)
        if match:
            by_client.setdefault(int(match.group(1)), []).append(name)
    failed: list[int] = []
    claimed: set[str] = set()
    must = {b.buffer for b in declared}
    for declared_buffer in [*declared, *optional]:
        cid, spec = declared_buffer.buffer, declared_buffer.spec
        if cid in session.buffers:
            continue
        buf = None
        for name in by_client.get(cid, ()):
            found = shards[name]
            if sorted(found) != list(range(spec.shards)) or any(where not in devices for where in found.values()):
                continue
            buf = Buffer.new(name, spec, client_ref=True)
            buf.locations = [location(devices[found[i]][1]) for i in range(spec.shards)]
            buf.holders = {control for control, _ in found.values()}
            buf.slice_id = devices[found[0]][0] if found else None
            buf.resolve(None)
            claimed.add(name)
            break
        if buf is None and cid not in must:
            continue
        if buf is None:
            buf = Buffer.new(session.buffer_name(cid), spec, client_ref=True)
            buf.resolve(Unavailable(why))
            failed.append(cid)
        session.buffers[cid] = buf
    unclaimed: dict[str, set[str]] = {}
    for name, found in shards.items():
        if name not in claimed:
            for control, _ in found.values():
                unclaimed.setdefault(control, set()).add(f"{owner}/{name}")
    return Adopted(failed, unclaimed)
