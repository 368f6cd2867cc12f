"""Listening sockets that outlive an exec.

An executor replaces its own process to join a JAX group or to take its devices back
(``pwmesh.cli.daemons.restart``), and must listen where its peers expect it. Closing its
listeners and binding again in the new process would leave the port free for seconds (the
new interpreter imports JAX first), and in that window the kernel may hand it to any
outgoing connection as its local port — ZeroMQ reconnecting to this very executor every
100 ms walks the ephemeral range — so the new process could fail with "address already in
use". Instead the listening sockets stay open across the exec: connections that arrive
meanwhile wait in their backlog, and the new process takes them over by descriptor.

``tcp_listener`` opens (or takes over) one; ``pass_on`` marks every open one to survive the
next exec and names them, by address, in the environment the new process reads.
"""

from __future__ import annotations

import os
import socket

ENV = "PWMESH_LISTENERS"  # "port=fd,..." for the process an exec starts

_open: list[socket.socket] = []  # for ``pass_on``
_inherited: dict[int, int] | None = None  # port -> descriptor


def _taken_over() -> dict[int, int]:
    global _inherited  # noqa: PLW0603 - read once: the environment is passed on to children
    if _inherited is None:
        _inherited = {}
        for item in filter(None, os.environ.pop(ENV, "").split(",")):
            port, _, fd = item.partition("=")
            _inherited[int(port)] = int(fd)
    return _inherited


def tcp_listener(address: str, *, backlog: int = 128) -> socket.socket:
    """A socket listening at ``address`` (``tcp://host:port``; port 0: a free one; ``*``: every interface):
    the one the process before this one passed on for that port (``pass_on``), else a new one."""
    host, _, port_text = address.removeprefix("tcp://").rpartition(":")
    port = int(port_text or 0)
    fd = _taken_over().pop(port, None) if port else None
    if fd is not None:
        sock = socket.socket(fileno=fd)
        sock.set_inheritable(False)
    else:
        host = "" if host == "*" else host.strip("[]")
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    backlog=backlog)
    _open.append(sock)
    return sock


def close(sock: socket.socket) -> None:
    """Close a listener for good (not to be passed on)."""
    if sock in _open:
        _open.remove(sock)
    sock.close()


def pass_on() -> None:
    """Keep every open listener open across the next exec, named in ``ENV`` by its port."""
    named = [f"{port}={fd}" for port, fd in _taken_over().items()]  # handed to this one, not taken yet
    for sock in _open:
        if sock.fileno() >= 0:
            sock.set_inheritable(True)
            named.append(f"{sock.getsockname()[1]}={sock.fileno()}")
    os.environ[ENV] = ",".join(named)
