"""Helpers shared by the tests that start their own clusters."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import zmq

from pwmesh.wire import decode, encode
from pwmesh.wire.messages import Ping, Pong


def slow(x):
    # A second or more of real work on one CPU core.
    m = jnp.full((192, 192), 0.01, jnp.float32)
    v = jnp.full((192, 192), 0.5, jnp.float32) * x
    return jax.lax.fori_loop(0, 3000, lambda i, a: jnp.tanh(a @ m), v).sum()


def eventually(condition: Callable[[], bool], timeout_seconds: float) -> None:
    """Re-check ``condition`` until it holds. Only for states a daemon reports on request
    and pushes to nobody (an executor's outstanding work, its lifecycle status)."""
    deadline = time.monotonic() + timeout_seconds
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_seconds} seconds")
        time.sleep(0.02)


def ping_status(address: str) -> str:
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(address)
        sock.send_multipart([b"", *encode(Ping(), msg_id=1)])
        reply = decode(sock.recv_multipart()[1:]).message
    assert isinstance(reply, Pong)
    return reply.status
