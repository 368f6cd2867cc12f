"""The data plane's authentication and encryption, keyed by the cluster's CURVE keys.

A stream's key comes from the two ends' CURVE keys (``pwmesh.service.keys``): X25519 of one end's
secret key and the other's public key (``pair_key``), where the receiver's public key travels in its
address and the sender's in its hello, checked against the daemon keys in ``authorized/``; so only
the two hosts can open or accept their streams. (Without keys of their own, a private local cluster's
executors share one generated secret, ``plane_key``.)
A stream's handshake is a challenge and response over fresh nonces from both ends (HMAC-SHA256,
compared in constant time): a replayed hello fails, and each end proves the key before the other
sends a byte of data. The stream's payload (preambles and inline frames) is then sealed with
AES-256-GCM under a key of that stream alone, one 96-bit counter nonce per sealed piece, so a
reordered, replayed or altered piece fails to open and closes the stream.

Why not TLS (Python's ``ssl``): it would need certificates for every executor and its record layer
splits and copies every frame into 16 KiB records. AES-GCM from ``cryptography`` (OpenSSL, with the
CPU's AES instructions) seals a whole frame in one call at several GB/s, and the key already exists.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from zmq.utils import z85

NONCE_BYTES = 16  # each end's handshake nonce
TAG_BYTES = 16  # what sealing adds to a piece
_CONTEXT = b"pwmesh data plane v1\x00"


def plane_key(cluster_secret: bytes) -> bytes:
    """The data plane's key, from the cluster's secret CURVE key (never the CURVE key itself)."""
    return hashlib.sha256(_CONTEXT + cluster_secret).digest()


def pair_key(secret: bytes, theirs: bytes, client: bytes, server: bytes) -> bytes:
    """A stream's key between two daemon hosts with keys of their own: X25519 of this end's secret CURVE
    key and the other end's public one (both z85; CURVE keys are X25519 keys), bound to both ends'
    public keys. Only the two hosts can derive it: no host holds a secret that opens another pair's
    streams."""
    shared = X25519PrivateKey.from_private_bytes(z85.decode(secret)).exchange(
        X25519PublicKey.from_public_bytes(z85.decode(theirs)))
    return hashlib.sha256(_CONTEXT + b"pair" + shared + client + server).digest()


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def proof(key: bytes, role: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """What ``role`` (b"client" or b"server") sends to show it holds ``key``, bound to both nonces."""
    return hmac.new(key, _CONTEXT + role + client_nonce + server_nonce, hashlib.sha256).digest()


def proves(key: bytes, role: bytes, client_nonce: bytes, server_nonce: bytes, given: Any) -> bool:
    return isinstance(given, bytes) and hmac.compare_digest(proof(key, role, client_nonce, server_nonce), given)


class SealError(ValueError):
    """A sealed piece did not open: altered, replayed, reordered, or sealed with another key."""


class Seal:
    """One direction of one stream: seals (or opens) its pieces in order."""

    def __init__(self, key: bytes, client_nonce: bytes, server_nonce: bytes, purpose: bytes = b"stream") -> None:
        """``purpose``: ``b"stream"`` for the sender's batches, ``b"acks"`` for the receiver's
        acknowledgements (a key of their own: each direction counts its own nonces)."""
        stream_key = hmac.new(key, _CONTEXT + purpose + client_nonce + server_nonce, hashlib.sha256).digest()
        self._aead = AESGCM(stream_key)
        self._counter = 0

    def _nonce(self) -> bytes:
        nonce = self._counter.to_bytes(12, "big")
        self._counter += 1
        return nonce

    def seal(self, data: Any) -> bytes:
        return self._aead.encrypt(self._nonce(), data, None)

    def seal_into(self, data: Any, out: Any) -> None:
        """``seal`` into ``out`` (``len(data) + TAG_BYTES`` bytes): a big frame reuses a warm buffer
        instead of faulting in fresh pages for every send."""
        self._aead.encrypt_into(self._nonce(), data, None, out)

    def open(self, data: Any) -> bytes:
        try:
            return self._aead.decrypt(self._nonce(), data, None)
        except InvalidTag:
            raise SealError("a data-plane piece failed its authentication tag") from None

    def open_into(self, data: Any, out: Any) -> None:
        """``open`` into ``out`` (``len(data) - TAG_BYTES`` bytes): a big frame lands in a pooled,
        page-aligned buffer that JAX can adopt without a copy, as an unsealed one does."""
        try:
            self._aead.decrypt_into(self._nonce(), data, None, out)
        except InvalidTag:
            raise SealError("a data-plane piece failed its authentication tag") from None
