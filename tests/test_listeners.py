"""Listeners that outlive an exec (``pwmesh.service.listeners``): an executor that replaces its own
process keeps its ports, with no moment in which another socket could take them. Real processes,
a real exec, real sockets on loopback."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap

import pytest

from pwmesh.service.transport import Context

pytestmark = pytest.mark.timeout(60)

# The first process listens, says where, waits for a word, then execs into the second, which takes the
# listener over by its address and reads what a client sent before the exec (it waited in the backlog).
FIRST = textwrap.dedent("""
    import os, sys
    from pwmesh.service import listeners
    sock = listeners.tcp_listener("tcp://127.0.0.1:0")
    print(sock.getsockname()[1], flush=True)
    sys.stdin.readline()
    listeners.pass_on()
    os.execv(sys.executable, [sys.executable, "-c", sys.argv[1], str(sock.getsockname()[1])])
""")
SECOND = textwrap.dedent("""
    import sys
    from pwmesh.service import listeners
    sock = listeners.tcp_listener(f"tcp://127.0.0.1:{sys.argv[1]}")
    conn, _ = sock.accept()
    print(sock.getsockname()[1], conn.recv(100).decode(), flush=True)
""")


def test_a_listener_is_kept_across_an_exec_with_what_waits_in_its_backlog() -> None:
    proc = subprocess.Popen([sys.executable, "-c", FIRST, SECOND], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(b"before-the-exec")
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0
        assert out.split() == [str(port), "before-the-exec"], "the same port, and nothing lost in the exec"
    finally:
        proc.kill()
        proc.wait()


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.asyncio
@pytest.mark.parametrize("keep", [False, True])
async def test_a_passable_router_serves_on_its_own_listener_and_closes_it_unless_kept(keep: bool) -> None:
    server, client = Context(), Context()
    router = server.router("tcp://127.0.0.1:0", passable=True)
    assert router.listener is not None
    port = router.listener.getsockname()[1]
    assert router.address == f"tcp://127.0.0.1:{port}"
    dealer = client.dealer(router.address)
    try:
        await dealer.send([b"hello"])
        _, payload = await asyncio.wait_for(router.recv(), timeout=10)
        assert [bytes(f) for f in payload] == [b"hello"]
        server.keep_listeners = keep
    finally:
        server.close()
        client.close()
    assert _refused(port) is not keep, "kept open for an exec only when asked, never leaked otherwise"
    if keep:
        router.listener.close()
