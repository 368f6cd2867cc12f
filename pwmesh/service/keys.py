"""The cluster's CURVE keys: ZeroMQ certificates made and read with pyzmq's ``zmq.auth``.

A keys directory, as ``pwmesh keys init DIR`` makes it::

    DIR/cluster.key, cluster.key_secret   the cluster's pair: every daemon serves with it; daemons run
                                          from DIR itself also connect with it (full trust, one host)
    DIR/authorized/*.key                  public keys allowed in: the cluster's, and each client's
    DIR/authorized/admins/NAME.key        admins' (``pwmesh keys add-admin NAME``)
    DIR/authorized/daemons/NAME.key       daemon hosts' own (``pwmesh keys add-daemon NAME``)
    DIR/clients/NAME/                     what a client NAME is given: its pair and cluster.key
    DIR/daemons/NAME/                     what daemon host NAME is given: its own pair, which it serves
                                          and connects with, and cluster.key; a front host's (``--front``:
                                          one that runs the resource manager or a proxy, which everyone
                                          reaches by the cluster's key) also the cluster's pair to serve with

Daemons take ``--keys DIR`` (or ``$PWMESH_KEYS``), or on a host of their own ``--keys DIR/daemons/NAME``;
a client takes the directory it was given (``pw.connect(..., keys=DIR/clients/NAME)``). A daemon with a
key of its own is known by it: it may act only as daemon NAME (an executor or scheduler named NAME or
``NAME:...``), as Kubernetes' node authorizer binds a kubelet's credential to its own Node, and removing
its key (``pwmesh keys remove NAME``) shuts that host out of the cluster. Only front hosts hold the
cluster's secret: an executor or scheduler host serves with its own key and advertises it in its
addresses (``keyed``: ``tcp://host:port#<hex key>``, as the resource manager hands them out), so its
peers know whom they reach, and its data plane keys each stream by the pair of hosts (``dataflow.secure``).
Taking one host's directory gives its own key, not the cluster's. A daemon host's directory has
no ``authorized/`` of its own: it reads ``DIR/authorized`` when it sits inside DIR (a shared mount), else
its own copy (``DIR/daemons/NAME/authorized``, kept in step with the cluster's). A peer whose
key is not in ``authorized/`` fails the CURVE handshake: ZeroMQ drops it before any message reaches
pwmesh, so it gets no reply, creates no state and logs nothing above DEBUG. Keys added to or removed
from ``authorized/`` count from the next handshake on (no restart).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import threading
import time
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from pwmesh.errors import InvalidArgument

CLUSTER = "cluster"
DAEMONS = "daemons"  # daemon hosts' own keys: ``authorized/daemons/``, and what each host is given
ENV = "PWMESH_KEYS"
# A private local cluster's data-plane secret (hex), which it gives its executors in their environment
# (``LocalClusterSpec.private``): without keys, what their streams prove.
PLANE_SECRET_ENV = "PWMESH_PLANE_SECRET"
# Handshakes re-read ``authorized/`` at most this often (junk cannot make us read a directory per
# connection attempt), and as soon as ``MISS_RELOAD_SECONDS`` after the last read when a key is unknown:
# ZeroMQ does not retry a handshake refused once, so a key made just before its daemon starts must count.
RELOAD_INTERVAL_SECONDS = 1.0
MISS_RELOAD_SECONDS = 0.1


@dataclasses.dataclass(frozen=True)
class Keys:
    """One party's keys: the cluster's public key (what every daemon serves with), its own pair, and,
    for a daemon, where the public keys it lets in are."""

    server_public: bytes  # the cluster's: what an address with no key of its own is served with
    public: bytes  # the pair it serves with (the cluster's, or a daemon host's own)
    secret: bytes
    directory: Path
    authorized: Path | None = None  # None: a client's keys (it serves nothing)
    # A daemon host's own pair (``pwmesh keys add-daemon NAME``), which it connects with (and serves
    # with, unless a front host's). None: it connects with ``public``/``secret``.
    own: tuple[str, bytes, bytes] | None = None  # (NAME, public, secret)

    @property
    def daemon_name(self) -> str:
        """The name a daemon host's own key binds it to ("": no key of its own, no binding)."""
        return self.own[0] if self.own is not None else ""

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Keys:
        where = Path(directory).expanduser()
        if not where.is_dir():
            raise InvalidArgument(f"no keys directory at {where} (make one with `pwmesh keys init {where}`)")
        server = where / f"{CLUSTER}.key"
        if not server.is_file():
            raise InvalidArgument(f"{where} holds no {CLUSTER}.key: not a pwmesh keys directory")
        server_public, _ = zmq.auth.load_certificate(server)
        secrets = sorted(where.glob("*.key_secret"))
        if not secrets:
            raise InvalidArgument(f"{where} holds no secret key (*.key_secret): a client needs its own pair")
        own = None
        if len(secrets) == 2 and CLUSTER in (s.stem for s in secrets):  # a daemon host's: see the docstring
            (mine,) = [s for s in secrets if s.stem != CLUSTER]
            _check_private(mine)
            own_public, own_secret = zmq.auth.load_certificate(mine)
            assert own_secret is not None
            own = (mine.stem, own_public, own_secret)
            secrets = [s for s in secrets if s.stem == CLUSTER]
        if len(secrets) > 1:
            raise InvalidArgument(f"{where} holds several secret keys ({', '.join(s.name for s in secrets)}): "
                                  "give a directory with exactly one")
        _check_private(secrets[0])
        public, secret = zmq.auth.load_certificate(secrets[0])
        assert secret is not None  # a .key_secret file always has it
        if own is None and secrets[0].stem != CLUSTER and (
                (where / "authorized").is_dir() or where.parent.name == DAEMONS):
            own = (secrets[0].stem, public, secret)  # a daemon host's, not a front's: it serves with its own
        authorized = None
        if own is not None or secrets[0].stem == CLUSTER:
            authorized = where / "authorized"
            if own is not None and not authorized.is_dir() and where.parent.name == DAEMONS:
                authorized = where.parent.parent / "authorized"  # a host's directory inside the cluster's
        return cls(server_public=server_public, public=public, secret=secret, directory=where,
                   authorized=authorized, own=own)

    @classmethod
    def from_option(cls, directory: str | os.PathLike[str] | None) -> Keys | None:
        """``directory``, else ``$PWMESH_KEYS``, else no keys."""
        chosen = directory or os.environ.get(ENV) or None
        return cls.load(chosen) if chosen else None

    def serve(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` (bound) a CURVE server: only authorized peers get through."""
        if self.authorized is None:
            raise InvalidArgument(f"the keys in {self.directory} are a client's: a daemon needs the cluster's "
                                  f"({CLUSTER}.key_secret)")
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def connect(self, sock: zmq.Socket[bytes], server: bytes | None = None) -> None:
        """Make ``sock`` (before it connects) a CURVE client of the server whose public key (z85) is
        ``server``, by default the cluster's (with a daemon host's own pair where it has one: that is who
        its peers see)."""
        _, public, secret = self.own if self.own is not None else ("", self.public, self.secret)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_serverkey = server or self.server_public

    def advertise(self, address: str) -> str:
        """``address`` as peers are told it: with the key it is served with, unless that is the cluster's."""
        return address if self.public == self.server_public else keyed(address, self.public)


def keyed(address: str, public: bytes) -> str:
    """``address`` carrying the public key (z85) it is served with: ``tcp://host:port#<64 hex digits>``.
    The key travels wherever the address does (slices, runs, the cluster's view), so whoever connects
    knows whom it must reach, with no directory to ask; an address with no key is served with the
    cluster's."""
    return f"{address}#{z85.decode(public).hex()}"


def unkeyed(address: str) -> tuple[str, bytes | None]:
    """(the address to connect to, the public key (z85) it is served with, or None: the cluster's)."""
    plain, _, key = address.partition("#")
    if not key:
        return plain, None
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise InvalidArgument(f"{address!r}: the key after '#' is not 64 hex digits")
    return plain, z85.encode(raw)


@dataclasses.dataclass(frozen=True)
class Security:
    """A daemon's ``--keys DIR`` and ``--insecure``, as its config carries them."""

    keys: str = ""  # the cluster's keys directory; "": none (loopback only, unless insecure)
    insecure: bool = False  # bind off loopback without keys (a network you trust), loudly

    def load(self) -> Keys | None:
        return Keys.load(self.keys) if self.keys else None

    def named(self, given: str, fallback: str) -> str:
        """A daemon's name: ``given``, else its host's own key's name (that key may act only as it),
        else ``fallback``."""
        if given:
            return given
        keys = self.load()
        return (keys.daemon_name if keys is not None else "") or fallback


def _check_private(path: Path) -> None:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise InvalidArgument(f"{path} is readable by others (mode {stat.filemode(mode)}): chmod 600 it")


# Roles, by where a key sits in ``authorized/``: ``cluster.key`` is the daemons'; ``admins/NAME.key``
# an admin's (drain hosts, see every session); any other ``NAME.key`` a client's (its own sessions only).
DAEMON, ADMIN, CLIENT = "daemon", "admin", "client"


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who sent a message: the name and role of the key its connection authenticated with (ZAP's
    User-Id), as ``authorized/`` says now."""

    name: str
    role: str


# A cluster without keys serves one user on loopback: every peer is trusted as a daemon is.
LOCAL = Identity("local", DAEMON)
# Daemon identities bound to no name: the cluster's own key, and every peer of a keyless cluster.
_UNBOUND = frozenset({CLUSTER, LOCAL.name, ""})


def speaks_for(user: str, daemon: str) -> bool:
    """May the daemon key named ``user`` act as daemon ``daemon`` (an executor id, a scheduler's name)?
    The cluster's own key may act as any; a daemon host's own key (``add-daemon NAME``) only as NAME or
    ``NAME:...``. Completions, registrations, heartbeats and leaving all name who sends them: each is
    checked against the key it came with, never taken on its word."""
    return user in _UNBOUND or daemon == user or daemon.startswith(user + ":")


def authorized_keys(authorized: Path) -> list[tuple[Path, Identity]]:
    """Every key file in ``authorized`` (and its ``admins/`` and ``daemons/``), by name, with whose it is."""
    found = []
    for path in sorted([*authorized.glob("*.key"), *(authorized / "admins").glob("*.key"),
                        *(authorized / DAEMONS).glob("*.key")], key=lambda p: p.stem):
        if path.parent.name == DAEMONS:
            if path.stem in _UNBOUND:
                continue  # never a daemon host's name: it would be bound to nothing
            role = DAEMON
        else:
            role = DAEMON if path.stem == CLUSTER and path.parent == authorized else (
                ADMIN if path.parent.name == "admins" else CLIENT)
        found.append((path, Identity(path.stem, role)))
    return found


class AuthorizedKeys:
    """ZAP credentials and identities: is this public key in ``authorized/``, and whose is it? Re-read
    at most once a second: a key added counts from its next handshake, a key removed (``pwmesh keys
    remove``) from its next message on (and ``Context.close_revoked`` closes its connections)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._keys: dict[bytes, Identity] = {}
        self._read_at = float("-inf")
        self._stamp: tuple[int, ...] = ()
        self._reload(time.monotonic())

    def _stamps(self) -> tuple[int, ...]:
        """The key folders' modification times (a key file added or removed changes its folder's)."""
        stamps = []
        for folder in (self.directory, self.directory / "admins", self.directory / DAEMONS):
            try:
                stamps.append(folder.stat().st_mtime_ns)
            except OSError:
                stamps.append(0)
        return tuple(stamps)

    def _reload(self, now: float) -> None:
        stamp = self._stamps()
        keys = {}
        for path, identity in authorized_keys(self.directory):
            try:
                public, _ = zmq.auth.load_certificate(path)
            except (OSError, ValueError):
                continue  # a half-written or foreign file: not a key
            keys[public] = identity
        self._keys, self._read_at, self._stamp = keys, now, stamp

    def identify(self, key: bytes) -> Identity | None:
        """Whose ``key`` (z85) is, or None if it is not (or no longer) authorized."""
        with self._lock:
            now = time.monotonic()
            # An unknown key re-reads at once if a key folder changed since the last read: a key added within
            # MISS_RELOAD_SECONDS of a read was refused, and ZeroMQ never retries a refused handshake (the
            # client's socket stayed unconnected: seen once in tests/test_tenants.py). Junk costs a stat.
            if now - self._read_at >= RELOAD_INTERVAL_SECONDS or (key not in self._keys and (
                    now - self._read_at >= MISS_RELOAD_SECONDS or self._stamps() != self._stamp)):
                self._reload(now)
            return self._keys.get(key)

    def callback(self, domain: str, key: bytes) -> bool:  # pyzmq's credentials-provider protocol (z85 key)
        return self.identify(key) is not None


def start_authenticator(ctx: zmq.Context[zmq.Socket[bytes]], keys: Keys) -> tuple[ThreadAuthenticator, AuthorizedKeys]:
    """Serve ZeroMQ's authentication requests for ``ctx``'s CURVE servers (pyzmq's ZAP handler thread);
    also returns who the authorized keys are."""
    assert keys.authorized is not None
    auth = ThreadAuthenticator(ctx)
    auth.start()
    authorized = AuthorizedKeys(keys.authorized)
    auth.configure_curve_callback(domain="*", credentials_provider=authorized)
    return auth, authorized


# ------------------------------------------------------------------ pwmesh keys


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)


def _make_pair(directory: Path, name: str) -> tuple[Path, Path]:
    public, secret = (Path(p) for p in zmq.auth.create_certificates(directory, name))
    secret.chmod(0o600)
    return public, secret


def init(directory: str | os.PathLike[str]) -> Path:
    """Make the cluster's keys in ``directory`` (new, or empty); returns it."""
    where = Path(directory).expanduser()
    if where.exists() and any(where.iterdir()):
        raise InvalidArgument(f"{where} is not empty: the cluster's keys go in a new directory")
    _private_dir(where)
    _private_dir(where / "authorized")
    _private_dir(where / "clients")
    public, _ = _make_pair(where, CLUSTER)
    shutil.copy(public, where / "authorized" / public.name)  # daemons connect to each other
    return where


def _cluster_keys(directory: str | os.PathLike[str]) -> Keys:
    keys = Keys.load(directory)
    if keys.authorized is None:
        raise InvalidArgument(f"{keys.directory} is a client's keys directory, not the cluster's")
    return keys


def _authorized_files(keys: Keys, name: str) -> list[Path]:
    assert keys.authorized is not None
    return [p for p in (keys.authorized / f"{name}.key", keys.authorized / "admins" / f"{name}.key",
                        keys.authorized / DAEMONS / f"{name}.key") if p.exists()]


def _check_name(keys: Keys, name: str, what: str) -> None:
    if not name or not name.replace("-", "").replace("_", "").replace(".", "").isalnum() or name in _UNBOUND:
        raise InvalidArgument(f"a {what} name is letters, digits, '-', '_' and '.', not {CLUSTER!r} or "
                              f"{LOCAL.name!r}: {name!r}")
    if _authorized_files(keys, name) or (keys.directory / "clients" / name).exists() or (
            keys.directory / DAEMONS / name).exists():
        raise InvalidArgument(f"{name!r} already has keys (`pwmesh keys list`)")


def add_client(directory: str | os.PathLike[str], name: str, *, admin: bool = False) -> Path:
    """Issue client ``name`` a key pair (and authorize it, as an admin with ``admin``); returns the
    directory to give that client."""
    keys = _cluster_keys(directory)
    assert keys.authorized is not None
    _check_name(keys, name, "client")
    given = keys.directory / "clients" / name
    _private_dir(given)
    public, _ = _make_pair(given, name)
    shutil.copy(keys.directory / f"{CLUSTER}.key", given / f"{CLUSTER}.key")
    where = keys.authorized / "admins" if admin else keys.authorized
    if admin:
        _private_dir(where)
    shutil.copy(public, where / public.name)
    return given


def add_daemon(directory: str | os.PathLike[str], name: str, *, front: bool = False) -> Path:
    """Issue daemon host ``name`` a key pair of its own and authorize it; returns the directory to give
    that host (``--keys``): its own pair, which it serves and connects with, and the cluster's public key.
    A ``front`` host (the resource manager's, a proxy's: reached by the cluster's key) also gets the
    cluster's pair to serve with. Its daemons may act only as ``name`` (see ``speaks_for``); ``remove``
    shuts the host out."""
    keys = _cluster_keys(directory)
    assert keys.authorized is not None
    _check_name(keys, name, "daemon")
    _private_dir(keys.directory / DAEMONS)
    given = keys.directory / DAEMONS / name
    _private_dir(given)
    public, _ = _make_pair(given, name)
    for part in (f"{CLUSTER}.key", f"{CLUSTER}.key_secret") if front else (f"{CLUSTER}.key",):
        shutil.copy(keys.directory / part, given / part)
    if front:
        (given / f"{CLUSTER}.key_secret").chmod(0o600)
    _private_dir(keys.authorized / DAEMONS)
    shutil.copy(public, keys.authorized / DAEMONS / public.name)
    return given


def remove(directory: str | os.PathLike[str], name: str) -> list[Path]:
    """Revoke client, admin or daemon host ``name``: its key leaves ``authorized/``, so within a second every
    daemon refuses what it sends and no new connection of it gets through. Returns the files removed."""
    keys = _cluster_keys(directory)
    if name == CLUSTER:
        raise InvalidArgument(f"{CLUSTER!r} is the daemons' key: make a new cluster's keys instead")
    found = _authorized_files(keys, name)
    if not found:
        raise InvalidArgument(f"no authorized key named {name!r} in {keys.authorized}")
    for path in found:
        path.unlink()
    return found


def listing(directory: str | os.PathLike[str]) -> list[tuple[str, str, str]]:
    """(name, role, public key) of every key a cluster's keys directory authorizes."""
    keys = _cluster_keys(directory)
    assert keys.authorized is not None
    rows = []
    for path, identity in authorized_keys(keys.authorized):
        public, _ = zmq.auth.load_certificate(path)
        role = "daemons" if identity.name == CLUSTER else ("daemon host" if identity.role == DAEMON else identity.role)
        rows.append((identity.name, role, public.decode()))
    return rows
