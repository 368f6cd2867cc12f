"""An island's executors as one JAX multi-process group, so SPMD computations span them.

The island's scheduler forms the group, and forms it again whenever its membership
changes (``pwmesh.scheduler.group``): a new coordinator, and each member restarts its
JAX runtime into the new forming (``JoinGroup``; ``pwmesh.executor.spill`` keeps its
buffers across the restart).

JAX joins the collectives of processes that ran ``jax.distributed.initialize``
with one coordinator: gloo on CPU, NCCL on GPU. An executor joins before anything
touches its JAX backend (the group is fixed when the backend starts, and cannot be
re-formed in the same process: measured with jax 0.10.2, a second ``initialize``
after ``shutdown`` keeps the first topology).

JAX process 0 serves the group's coordination service, and when it dies every
member is terminated. So process 0 is a process of its own that computes nothing
(``serve``: ``python -m pwmesh.cli.daemons jax-coordinator``), one per island,
and the executors are processes 1..N: losing one of them fails only the
collectives that need it.

Everything listens on the coordinator's host only: JAX's coordinator would bind
every interface, and gloo the address the hostname resolves to.
"""

from __future__ import annotations

import dataclasses
import json
import signal

import jax
from jax._src import distributed, xla_bridge
from jax._src.lib import _jax

from pwmesh.errors import InvalidArgument, PwmeshError


class GroupJoinFailed(PwmeshError):
    """This process could not join its JAX group's forming (a member never came, the coordinator went)."""

    code = "group_join_failed"


@dataclasses.dataclass(frozen=True)
class GroupConfig:
    coordinator: str  # host:port of process 0's coordination service
    processes: int  # the coordinator and every executor of the group
    process_id: int  # 0: the coordinator
    timeout_seconds: float = 60.0  # for every member to join
    # A member JAX hears nothing from this long is lost to the others (pwmesh's own heartbeats declare
    # an executor lost sooner; this only has to outlast a busy moment on an overloaded host).
    heartbeat_timeout_seconds: float = 100.0

    @property
    def host(self) -> str:
        return self.coordinator.rsplit(":", 1)[0].strip("[]")


def join(group: GroupConfig) -> None:
    """Join the group: returns once every member has (or raises after ``timeout_seconds``)."""
    if not 0 <= group.process_id < group.processes:
        raise InvalidArgument(f"JAX process id {group.process_id} is not in a group of {group.processes}")
    if ":" not in group.coordinator:
        raise InvalidArgument(f"JAX coordinator {group.coordinator!r} is not HOST:PORT")
    # A lost member fails the collectives that need it; it must not take the survivors down with it.
    jax.config.update("jax_enable_recoverability", True)
    port = group.coordinator.rsplit(":", 1)[1]
    try:
        jax.distributed.initialize(
            group.coordinator, num_processes=group.processes, process_id=group.process_id,
            coordinator_bind_address=f"{group.host}:{port}",
            initialization_timeout=max(1, int(group.timeout_seconds)),
            heartbeat_timeout_seconds=max(1, int(group.heartbeat_timeout_seconds)))
    except Exception as exc:  # JAX raises its runtime's errors as they come (timeouts, refused connections)
        raise GroupJoinFailed(f"could not join the JAX group at {group.coordinator} as process {group.process_id} "
                              f"of {group.processes}: {exc}") from exc
    jax.config.update("jax_cpu_collectives_implementation", "gloo")

    def cpu_client() -> object:  # gloo on the coordinator's host, not the hostname's address
        collectives = _jax.make_gloo_tcp_collectives(distributed_client=distributed.global_state.client,
                                                     hostname=group.host)
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", cpu_client, priority=0, fail_quietly=False)


def group_devices(name: str, local: list[jax.Device], members: tuple[str, ...]) -> dict[tuple[str, int], jax.Device]:
    """Every device of the group by (executor, device index): member ``i`` is JAX process ``i + 1``, its
    devices in JAX id order (as each executor exposes its own: ``local`` for this one)."""
    by_process: dict[int, list[jax.Device]] = {}
    for device in sorted(jax.devices(), key=lambda d: d.id):
        by_process.setdefault(device.process_index, []).append(device)
    out = {}
    for rank, member in enumerate(members, start=1):
        devices = local if member == name else by_process.get(rank, [])
        for index, device in enumerate(devices):
            out[member, index] = device
    return out


def serve(group: GroupConfig, ready_prefix: str) -> None:
    """Be the group's process 0: serve its coordination service until SIGTERM or SIGINT."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    jax.config.update("jax_num_cpu_devices", 1)  # it computes nothing: one device, which nothing uses
    join(dataclasses.replace(group, process_id=0))
    jax.devices()  # the members start their backends only once every process has told its topology
    print(ready_prefix + json.dumps({"address": group.coordinator, "processes": group.processes}), flush=True)
    signal.sigwait({signal.SIGINT, signal.SIGTERM})


# What JAX's collectives say when a member of the group is gone (JAX has no error type for it).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Gloo", "NCCL")


def peer_gone(exc: BaseException) -> bool:
    """Whether a gang computation failed because its collectives lost a member of the group."""
    return isinstance(exc, jax.errors.JaxRuntimeError) and any(s in str(exc) for s in _PEER_GONE)
