"""The peer the socket-layer tests talk to: a daemon with one Server, run as every daemon is
(``lifecycle.run``), in a process of its own: ``python tests/echo_daemon.py HIGH_WATER_MARK``.

It counts the NodeDone it receives and whether they came in order;
``Heartbeat(role=PAD, name="push:N[:PEER_HEX]")`` makes it post N NodeDone (run_id=PAD) to
PEER (default: the asker). Every command answers
``Pong(role=received, name=out_of_order, status="BACKLOG:UNREACHABLE")``.
"""

from __future__ import annotations

import sys
from typing import Any

from pwmesh.service.lifecycle import Service, run
from pwmesh.service.rpc import Server
from pwmesh.service.transport import Context
from pwmesh.wire.messages import Heartbeat, NodeDone, Ping, Pong


class Echo(Service):
    role = "test-echo"

    def __init__(self, high_water_mark: int) -> None:
        super().__init__("echo")
        # Tests of a full peer need a small high-water mark: replace the context the service made.
        self.ctx.close()
        self.ctx = Context(high_water_mark=high_water_mark)
        self.received = self.out_of_order = 0
        self.unreachable: list[bytes] = []

    async def setup(self) -> None:
        handlers = {Ping: self.ping, NodeDone: self.note, Heartbeat: self.command}
        self.server = Server(self.ctx, "tcp://127.0.0.1:0", handlers, tasks=self.tasks, name=self.name,
                             on_unreachable=self.unreachable.append)
        self.server.start()

    def note(self, peer: bytes, env: Any) -> None:
        self.out_of_order += env.message.nodes != [self.received]
        self.received += 1

    def command(self, peer: bytes, env: Any) -> Pong:
        verb, _, arg = env.message.name.partition(":")
        if verb == "push":
            count, _, to = arg.partition(":")
            for i in range(int(count)):
                self.server.post(bytes.fromhex(to) if to else peer,
                                 NodeDone(run_id=env.message.role, nodes=[i], executor_id="echo"))
        return Pong(role=str(self.received), name=str(self.out_of_order),
                    status=f"{self.server.backlog}:{len(self.unreachable)}")

    def ready_info(self) -> dict[str, Any]:
        return {**super().ready_info(), "address": self.server.address}


if __name__ == "__main__":
    run(Echo(int(sys.argv[1])))
