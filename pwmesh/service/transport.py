"""The socket layer, behind one small interface.

Daemon logic sees ``RouterSocket`` (bound, many peers) and ``DealerSocket``
(connected to one peer) sending and receiving lists of frames. Today both sit on
``zmq.asyncio``; the hot path can move to plain ``zmq.Socket`` driven by the
loop's reader callbacks without touching any daemon (issue: fast dispatch path).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

# Frames at least this big are sent without a copy; below it, copying is cheaper
# than the bookkeeping zero-copy needs (pyzmq's own guidance is ~64 KiB).
ZERO_COPY_THRESHOLD_BYTES = 64 << 10


def _needs_copy(frames: Sequence[Any]) -> bool:
    return all(memoryview(f).nbytes < ZERO_COPY_THRESHOLD_BYTES for f in frames)


def is_loopback(address: str) -> bool:
    return address.startswith(("ipc://", "inproc://")) or any(
        host in address for host in ("://127.", "://localhost", "://[::1]")
    )


class Context:
    """One ZeroMQ context per process; owns every socket made from it."""

    def __init__(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sockets: list[zmq.asyncio.Socket] = []

    def _socket(self, kind: int, identity: bytes | None = None) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        # Never block forever on a peer that is gone; drop when its queue is full.
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        self._sockets.append(sock)
        return sock

    def router(self, bind: str) -> RouterSocket:
        if not is_loopback(bind):
            log.warning("binding %s without authentication: CURVE is not implemented yet, so keep pwmesh "
                        "on a private network you trust", bind)
        sock = self._socket(zmq.ROUTER)
        # An unknown routing id is an error we want to hear about, not a silent drop.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if bind.endswith(":0"):
            port = sock.bind_to_random_port(bind[: -len(":0")])
            address = f"{bind[: -len(':0')]}:{port}"
        else:
            sock.bind(bind)
            address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return RouterSocket(sock, address)

    def dealer(self, connect: str, identity: bytes | None = None) -> DealerSocket:
        sock = self._socket(zmq.DEALER, identity)
        sock.connect(connect)
        return DealerSocket(sock, connect)

    def close(self) -> None:
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets.clear()
        self._ctx.term()


class RouterSocket:
    """A bound socket serving many peers; frames are ``[peer, b"", *payload]``."""

    def __init__(self, sock: zmq.asyncio.Socket, address: str) -> None:
        self._sock = sock
        self.address = address

    async def recv(self) -> tuple[bytes, list[Any]]:
        """``(peer, payload)``; a message without the routing envelope gets ``payload == []``."""
        frames = await self._sock.recv_multipart(copy=False)
        peer = frames[0].bytes
        if len(frames) < 2 or frames[1].bytes != b"":
            return peer, []
        return peer, frames[2:]

    async def send(self, peer: bytes, payload: Sequence[Any]) -> None:
        await self._sock.send_multipart([peer, b"", *payload], copy=_needs_copy(payload))

    def close(self) -> None:
        self._sock.close(linger=0)


class DealerSocket:
    """A socket connected to one peer's ROUTER."""

    def __init__(self, sock: zmq.asyncio.Socket, address: str) -> None:
        self._sock = sock
        self.address = address

    async def recv(self) -> list[Any]:
        frames = await self._sock.recv_multipart(copy=False)
        if not frames or frames[0].bytes != b"":
            return []
        return frames[1:]

    async def send(self, payload: Sequence[Any]) -> None:
        await self._sock.send_multipart([b"", *payload], copy=_needs_copy(payload))

    def close(self) -> None:
        self._sock.close(linger=0)
