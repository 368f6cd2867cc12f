"""Helpers shared by the tests that start their own clusters."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import zmq

import pwmesh as pw
from pwmesh.cli.commands import fetch_status
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


def slow_then_after(client: pw.Client, address: str) -> tuple[Any, pw.Slice, pw.Slice, pw.Array, pw.Array]:
    """``x = slow(v)`` on host0 feeds ``after(x)`` on host1 in one program; returns
    ``(program, on0, on1, x, y)`` once host0 reports it is computing."""
    devs = client.make_virtual_device_set()
    on0, on1 = devs.add_slice(devices=1), devs.add_slice(devices=1)
    assert (on0.devices[0].executor, on1.devices[0].executor) == ("island0-host0", "island0-host1")
    remote_slow = pw.pmap(slow, devices=on0)
    after = pw.pmap(lambda s: s + 1.0, devices=on1)

    @pw.program
    def f(v):
        x = remote_slow(v)
        return x, after(x)

    x, y = f(np.ones(1))
    eventually(lambda: fetch_status(address).executor_stats[0].outstanding == 1, 30)
    return f, on0, on1, x, y
