"""The cluster's CURVE keys: ZeroMQ certificates made and read with pyzmq's ``zmq.auth``.

A keys directory, as ``pwmesh keys init DIR`` makes it::

    DIR/cluster.key, cluster.key_secret   the daemons' key pair (every daemon serves and connects with it)
    DIR/authorized/*.key                  public keys allowed in: the cluster's, and each client's
    DIR/clients/NAME/                     what a client NAME is given: its pair and cluster.key

Daemons take ``--keys DIR`` (or ``$PWMESH_KEYS``); a client takes the directory it was given
(``pw.connect(..., keys=DIR/clients/NAME)``), or ``DIR`` itself on a host of the cluster. A peer whose
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

from pwmesh.errors import InvalidArgument

CLUSTER = "cluster"
ENV = "PWMESH_KEYS"
# Handshakes re-read ``authorized/`` at most this often (junk cannot make us read a directory per
# connection attempt).
RELOAD_INTERVAL_SECONDS = 1.0


@dataclasses.dataclass(frozen=True)
class Keys:
    """One party's keys: the cluster's public key (what every daemon serves with), its own pair, and,
    for a daemon, where the public keys it lets in are."""

    server_public: bytes
    public: bytes
    secret: bytes
    directory: Path
    authorized: Path | None = None  # None: a client's keys (it serves nothing)

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
        if len(secrets) > 1:
            raise InvalidArgument(f"{where} holds several secret keys ({', '.join(s.name for s in secrets)}): "
                                  "give a directory with exactly one")
        _check_private(secrets[0])
        public, secret = zmq.auth.load_certificate(secrets[0])
        assert secret is not None  # a .key_secret file always has it
        authorized = where / "authorized" if secrets[0].stem == CLUSTER else None
        return cls(server_public=server_public, public=public, secret=secret, directory=where,
                   authorized=authorized)

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

    def connect(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` (before it connects) a CURVE client of the cluster."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server_public


@dataclasses.dataclass(frozen=True)
class Security:
    """A daemon's ``--keys DIR`` and ``--insecure``, as its config carries them."""

    keys: str = ""  # the cluster's keys directory; "": none (loopback only, unless insecure)
    insecure: bool = False  # bind off loopback without keys (a network you trust), loudly

    def load(self) -> Keys | None:
        return Keys.load(self.keys) if self.keys else None


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


def authorized_keys(authorized: Path) -> list[tuple[Path, Identity]]:
    """Every key file in ``authorized`` (and its ``admins/``), by name, with whose it is."""
    found = []
    for path in sorted([*authorized.glob("*.key"), *(authorized / "admins").glob("*.key")], key=lambda p: p.stem):
        role = DAEMON if path.stem == CLUSTER and path.parent == authorized else (
            ADMIN if path.parent.name == "admins" else CLIENT)
        found.append((path, Identity(path.stem, role)))
    return found


class AuthorizedKeys:
    """ZAP credentials and identities: is this public key in ``authorized/``, and whose is it? Re-read
    at most once a second: a key added counts from its next handshake, a key removed (``pwmesh keys
    remove``) from its next message on (its connections stay open, but everything it sends is refused)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._keys: dict[bytes, Identity] = {}
        self._read_at = float("-inf")
        self._reload(time.monotonic())

    def _reload(self, now: float) -> None:
        keys = {}
        for path, identity in authorized_keys(self.directory):
            try:
                public, _ = zmq.auth.load_certificate(path)
            except (OSError, ValueError):
                continue  # a half-written or foreign file: not a key
            keys[public] = identity
        self._keys, self._read_at = keys, now

    def identify(self, key: bytes) -> Identity | None:
        """Whose ``key`` (z85) is, or None if it is not (or no longer) authorized."""
        with self._lock:
            now = time.monotonic()
            if now - self._read_at >= RELOAD_INTERVAL_SECONDS:
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
    return [p for p in (keys.authorized / f"{name}.key", keys.authorized / "admins" / f"{name}.key") if p.exists()]


def add_client(directory: str | os.PathLike[str], name: str, *, admin: bool = False) -> Path:
    """Issue client ``name`` a key pair (and authorize it, as an admin with ``admin``); returns the
    directory to give that client."""
    keys = _cluster_keys(directory)
    assert keys.authorized is not None
    if not name or not name.replace("-", "").replace("_", "").replace(".", "").isalnum() or name == CLUSTER:
        raise InvalidArgument(f"a client name is letters, digits, '-', '_' and '.', not {CLUSTER!r}: {name!r}")
    given = keys.directory / "clients" / name
    if given.exists() or _authorized_files(keys, name):
        raise InvalidArgument(f"client {name!r} already has keys ({given})")
    _private_dir(given)
    public, _ = _make_pair(given, name)
    shutil.copy(keys.directory / f"{CLUSTER}.key", given / f"{CLUSTER}.key")
    where = keys.authorized / "admins" if admin else keys.authorized
    if admin:
        _private_dir(where)
    shutil.copy(public, where / public.name)
    return given


def remove(directory: str | os.PathLike[str], name: str) -> list[Path]:
    """Revoke client (or admin) ``name``: its key leaves ``authorized/``, so within a second every daemon
    refuses what it sends and no new connection of it gets through. Returns the files removed."""
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
        rows.append((identity.name, "daemons" if identity.role == DAEMON else identity.role, public.decode()))
    return rows
