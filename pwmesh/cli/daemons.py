"""One click command per daemon: parse options into the daemon's config and run it.

Every option can also come from an environment variable (``PWMESH_RM_ADDRESS``,
``PWMESH_LISTEN``...), which is how the systemd units configure them.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn

import click

from pwmesh.errors import PwmeshError
from pwmesh.service import listeners
from pwmesh.service.keys import Security
from pwmesh.service.lifecycle import run
from pwmesh.service.logs import FORMATS, setup_logging

_log_level = click.option("--log-level", default="INFO", envvar="PWMESH_LOG_LEVEL", show_envvar=True,
                          show_default=True)
_log_format = click.option("--log-format", type=click.Choice(FORMATS), default="text", envvar="PWMESH_LOG_FORMAT",
                           show_envvar=True, show_default=True,
                           help="text: one line of key=value pairs per event; json: one JSON object per line, "
                                "the event's fields (run, session, host, op, reason, peer...) as keys.")
_rm = click.option("--rm", "rm", required=True, envvar="PWMESH_RM_ADDRESS",
                   help="Resource manager address, e.g. tcp://10.0.0.1:7100.")
_heartbeat = click.option("--heartbeat-interval-seconds", type=float, default=2.0, show_default=True,
                          envvar="PWMESH_HEARTBEAT_INTERVAL_SECONDS",
                          help="How often to tell the resource manager this daemon is alive.")


class _Daemon(click.Command):
    """A daemon's command: a pwmesh error while it starts (bad keys, a refused bind) is one line on stderr
    and exit status 1, not a traceback."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except PwmeshError as exc:
            raise click.ClickException(f"{ctx.info_name}: {exc.message}") from None


def _security(command: Callable[..., None]) -> Callable[..., None]:
    """``--keys`` and ``--insecure``: how the daemon's sockets are guarded."""
    command = click.option("--insecure", is_flag=True, envvar="PWMESH_INSECURE", show_envvar=True,
                           help="Bind off loopback without keys: every peer that reaches the daemon is "
                                "trusted, traffic is plaintext. Only on a network you trust.")(command)
    return click.option("--keys", default="", envvar="PWMESH_KEYS", show_envvar=True,
                        help="The cluster's keys directory (`pwmesh keys init DIR`): every socket speaks "
                             "CURVE and only authorized peers get through. Without it a daemon binds only "
                             "loopback (or with --insecure).")(command)


class _MetricsPort(click.ParamType):
    """A TCP port for the metrics (0: a free one); empty or ``off``: no metrics, so a unit can pass
    ``--metrics-port ${PWMESH_..._METRICS_PORT}`` whether the environment file sets it or not."""

    name = "port"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int | None:
        if value is None or isinstance(value, int):
            return value
        text = str(value).strip().lower()
        if text in ("", "off", "none"):
            return None
        try:
            port = int(text)
        except ValueError:
            self.fail(f"{value!r} is not a port number (0-65535; 0 picks a free one; empty or 'off': none)",
                      param, ctx)
        if not 0 <= port <= 65535:
            self.fail(f"port {port} is out of range 0-65535", param, ctx)
        return port


_metrics_port = click.option("--metrics-port", type=_MetricsPort(), default=None, envvar="PWMESH_METRICS_PORT",
                             show_envvar=True,
                             help="Serve Prometheus metrics over HTTP at http://HOST:PORT/metrics, HOST being "
                                  "--listen's; 0 picks a free port (the ready line and `pwmesh up` show it). "
                                  "Default: none served.")
_listen = click.option("--listen", default="tcp://127.0.0.1:0", envvar="PWMESH_LISTEN", show_default=True,
                       help="Address to bind; port 0 picks a free port.")


@click.command(name="pwmesh-rm", cls=_Daemon)
@_listen
@click.option("--name", default="rm")
@click.option("--heartbeat-timeout-seconds", type=float, default=10.0, show_default=True)
@_security
@_metrics_port
@_log_level
@_log_format
def rm_main(listen: str, name: str, heartbeat_timeout_seconds: float, keys: str, insecure: bool,
            metrics_port: int | None, log_level: str,
            log_format: str) -> None:
    """Run the resource manager."""
    from pwmesh.rm.daemon import ResourceManager, ResourceManagerConfig  # noqa: PLC0415 - keep CLI import light

    setup_logging("rm", name, log_level, log_format)
    run(ResourceManager(ResourceManagerConfig(listen=listen, name=name,
                                              heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                                              security=Security(keys, insecure), metrics_port=metrics_port)))


@click.command(name="pwmesh-scheduler", cls=_Daemon)
@click.option("--island", type=int, required=True, envvar="PWMESH_ISLAND")
@_rm
@_listen
@click.option("--name", default="")
@click.option("--policy", type=click.Choice(["fair", "fifo"]), default="fair", envvar="PWMESH_POLICY",
              show_default=True,
              help="fair: strict priority, then least device time per unit of weight; fifo: arrival order.")
@click.option("--window", type=click.IntRange(min=1), default=8, envvar="PWMESH_WINDOW", show_default=True,
              help="Runs in flight per device; the policy chooses among the rest.")
@click.option("--collectives/--no-collectives", default=False, envvar="PWMESH_COLLECTIVES", show_envvar=True,
              show_default=True,
              help="Form the island's JAX group of its --collectives executors (and form it again as they come "
                   "and go), serving each forming's coordinator as a child process on this host.")
@_heartbeat
@_security
@_metrics_port
@_log_level
@_log_format
def scheduler_main(island: int, rm: str, listen: str, name: str, policy: str, window: int, collectives: bool,
                   heartbeat_interval_seconds: float, keys: str, insecure: bool, metrics_port: int | None,
                   log_level: str,
                   log_format: str) -> None:
    """Run the island scheduler of island ISLAND."""
    from pwmesh.scheduler.daemon import Scheduler, SchedulerConfig  # noqa: PLC0415

    config = SchedulerConfig(island=island, rm=rm, listen=listen, name=name, policy=policy, window=window,
                             collectives=collectives, heartbeat_interval_seconds=heartbeat_interval_seconds,
                             security=Security(keys, insecure), metrics_port=metrics_port)
    setup_logging("scheduler", config.name or f"scheduler-{island}", log_level, log_format)
    run(Scheduler(config))


class _ByteSize(click.ParamType):
    """``1048576``, ``64M``, ``2G``, ``512KiB``: bytes; K, M, G, T are powers of 1024."""

    name = "bytes"
    _UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().lower().removesuffix("b").removesuffix("i")
        scale = self._UNITS.get(text[-1:], 1)
        number = text[:-1] if scale > 1 else text
        try:
            size = float(number)
        except ValueError:
            self.fail(f"{value!r} is not a size in bytes (e.g. 1048576, 64M, 2G)", param, ctx)
        if size < 0:
            self.fail(f"{value!r}: a size cannot be negative", param, ctx)
        return int(size * scale)


@click.command(name="pwmesh-executor", cls=_Daemon)
@click.option("--island", type=int, required=True, envvar="PWMESH_ISLAND")
@_rm
@click.option("--devices", type=int, default=1, envvar="PWMESH_DEVICES", show_default=True,
              help="JAX devices to expose (on CPU: sets --xla_force_host_platform_device_count).")
@_listen
@click.option("--data-listen", default="tcp://127.0.0.1:0", envvar="PWMESH_DATA_LISTEN", show_default=True)
@click.option("--name", default="", help="Executor id (default: HOST-PID).")
@click.option("--host", default="", help="Host label shown in status (default: the hostname).")
@click.option("--memory-limit", "memory_limit_bytes", type=_ByteSize(), default="0", envvar="PWMESH_MEMORY_LIMIT",
              show_default=True,
              help="Bytes this executor's devices may hold, all of them together (not per device); "
                   "suffixes K, M, G, T are powers of 1024, e.g. 64M, 2G. A computation whose outputs do not "
                   "fit waits until buffers are freed; one that could never fit fails with ResourceExhausted. "
                   "0: no limit.")
@click.option("--memory-wait-seconds", type=float, default=300.0, show_default=True,
              help="How long a computation (or data moved here) may wait for memory under --memory-limit: then it "
                   "fails with ResourceExhausted saying what holds the memory (a full executor never blocks silently).")
@click.option("--watchdog-seconds", type=float, default=10.0, show_default=True,
              help="Log gang computations that wait in their collectives for longer than this.")
@click.option("--sandbox-functions/--no-sandbox-functions", default=None,
              help="Read each new function in a child process first, so a crafted one crashes that and not "
                   "the executor (default: on with --keys, where tenants share it).")
@click.option("--reclaim-after-seconds", type=float, default=10.0, show_default=True,
              help="Restart to take devices back from a computation still running this long after its run "
                   "was cancelled (a deadline, say); the rest of the work goes on after it. 0: never.")
@click.option("--collectives/--no-collectives", default=False, envvar="PWMESH_COLLECTIVES", show_envvar=True,
              show_default=True,
              help="Join the island's JAX multi-process group, so SPMD computations (collectives) span this "
                   "executor and the island's others; the island's scheduler (also --collectives) forms the "
                   "group and re-forms it as executors come and go (this process then restarts its JAX runtime, "
                   "keeping its buffers).")
# Set by the executor itself when it restarts into a forming of its island's JAX group.
@click.option("--jax-coordinator", default="", hidden=True)
@click.option("--jax-processes", type=int, default=0, hidden=True)
@click.option("--jax-process-id", type=int, default=1, hidden=True)
@click.option("--group-epoch", type=int, default=0, hidden=True)
@click.option("--group-members", default="", hidden=True)
@click.option("--resume-from", default="", hidden=True)
@click.option("--data-plane-plaintext", is_flag=True, envvar="PWMESH_DATA_PLANE_PLAINTEXT", show_envvar=True,
              help="With --keys: data-plane streams are still authenticated but not encrypted (both ends must "
                   "ask). For fabrics you trust, where the encryption's CPU cost matters.")
@click.option("--shared-memory/--no-shared-memory", default=True, show_default=True,
              help="Exchange bulk data with executors on the same machine through /dev/shm (else TCP).")
@click.option("--platform", type=click.Choice(["cpu", "cuda", "rocm", "tpu"]), default=None,
              envvar="PWMESH_PLATFORM", show_envvar=True,
              help="The devices to expose (sets JAX_PLATFORMS). Default: what JAX finds.")
@click.option("--test-enqueue-jitter-seconds", type=float, default=0.0, hidden=True)
@click.option("--test-order-by-arrival", is_flag=True, hidden=True,
              help="TEST ONLY: ignore the island order (shows why it exists: gangs can deadlock).")
@click.option("--test-seed", type=int, default=0, hidden=True)
@_heartbeat
@_security
@_metrics_port
@_log_level
@_log_format
def executor_main(island: int, rm: str, devices: int, listen: str, data_listen: str, name: str, host: str,
                  watchdog_seconds: float, sandbox_functions: bool | None, reclaim_after_seconds: float,
                  collectives: bool, jax_coordinator: str, jax_processes: int,
                  jax_process_id: int, group_epoch: int, group_members: str, resume_from: str,
                  data_plane_plaintext: bool, shared_memory: bool, platform: str | None, test_enqueue_jitter_seconds: float,
                  test_order_by_arrival: bool,
                  test_seed: int,
                  memory_limit_bytes: int, memory_wait_seconds: float, heartbeat_interval_seconds: float, keys: str,
                  insecure: bool,
                  metrics_port: int | None,
                  log_level: str, log_format: str) -> None:
    """Run a host executor on island ISLAND."""
    # XLA reads its flags once, when JAX initialises: set them before importing it.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    if platform:
        os.environ["JAX_PLATFORMS"] = platform
    from pwmesh.executor.daemon import Executor, ExecutorConfig  # noqa: PLC0415
    from pwmesh.executor.group import GroupConfig, GroupJoinFailed  # noqa: PLC0415

    config = ExecutorConfig(island=island, rm=rm, devices=devices, listen=listen, data_listen=data_listen,
                            name=name, host=host, heartbeat_interval_seconds=heartbeat_interval_seconds,
                            memory_limit_bytes=memory_limit_bytes, memory_wait_seconds=memory_wait_seconds,
                            watchdog_seconds=watchdog_seconds,
                            reclaim_after_seconds=reclaim_after_seconds, sandbox_functions=sandbox_functions,
                            collectives=collectives,
                            group=GroupConfig(jax_coordinator, jax_processes, jax_process_id)
                            if collectives and jax_coordinator else None,
                            group_epoch=group_epoch, group_members=tuple(filter(None, group_members.split(","))),
                            resume_from=resume_from,
                            shared_memory=shared_memory, platform=platform or "",
                            data_plane_plaintext=data_plane_plaintext,
                            test_enqueue_jitter_seconds=test_enqueue_jitter_seconds,
                            test_order_by_arrival=test_order_by_arrival, test_seed=test_seed,
                            security=Security(keys, insecure), metrics_port=metrics_port)
    setup_logging("executor", name or f"island{island}", log_level, log_format)
    try:
        executor = Executor(config)
    except GroupJoinFailed as exc:  # that forming failed: start outside any; the scheduler forms another
        logging.getLogger("pwmesh.executor").error("%s; restarting outside the group", exc.message)
        restart(["--jax-coordinator", "", "--group-epoch", "0", "--group-members", ""])
    run(executor)
    if executor.restart is not None:  # into its island's JAX group's next forming
        restart(executor.restart)
    # Closed: everything it served is answered, its sockets, data plane and pools are shut. Leave without
    # the interpreter's finalization: threads JAX and XLA still hold (a landing thread, the runtime's
    # own pools) are stopped there by forced unwinding, which aborts the process from inside XLA's C++
    # ("terminate called after throwing an instance of ''", exit status 134: seen after a short training
    # run); and computations it gave up on may still run on device threads, which the interpreter's exit
    # would wait for (it joins its thread pools). What they make has nowhere to go.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# The options a restart sets (each takes one value): an earlier restart's are dropped, not piled up.
_RESTART_OPTIONS = {"--listen", "--data-listen", "--metrics-port", "--name", "--jax-coordinator", "--jax-processes",
                    "--jax-process-id", "--group-epoch", "--group-members", "--resume-from"}


def restart(options: list[str]) -> NoReturn:
    """Replace this executor process by a new one (same pid, same arguments but ``options``): JAX's runtime
    can join a multi-process group only when it starts."""
    args, given = [], sys.argv[1:]
    i = 0
    while i < len(given):
        flag = given[i].split("=", 1)[0]
        if flag in _RESTART_OPTIONS and "=" not in given[i] and flag in options:
            i += 2
            continue
        if flag in _RESTART_OPTIONS and flag in options:
            i += 1
            continue
        args.append(given[i])
        i += 1
    for handler in logging.getLogger().handlers:
        handler.flush()
    listeners.pass_on()  # the new process listens where this one did, without a gap
    os.execv(sys.executable, [sys.executable, "-m", "pwmesh.cli.daemons", "executor", *args, *options])


@click.command(name="pwmesh-proxy", cls=_Daemon)
@_rm
@_listen
@click.option("--name", default="", help="The proxy's name (default: its host's own key's, else proxy).")
@click.option("--session-timeout-seconds", type=float, default=30.0, show_default=True)
@click.option("--rm-timeout-seconds", type=float, default=30.0, show_default=True,
              help="How long a request to the resource manager (a new slice) may wait for its answer.")
@click.option("--tenants", "tenants_file", default="", help="The tenants' limits and shares (JSON, see `pwmesh "
              "tenants set`), re-read when it changes; default: tenants.json in the keys directory.")
@click.option("--sandbox-functions/--no-sandbox-functions", default=None,
              help="Read each new function's module in a child process before registering it, refusing host "
                   "callbacks and custom calls JAX does not keep stable (default: on with --keys).")
@_heartbeat
@click.option("--standby", is_flag=True, help="Serve no session until the active proxy is lost (it missed its "
              "heartbeats to the resource manager), then take over: its clients, given both addresses, resume "
              "their sessions here. Needs the active proxy's session secret (the same --session-secret-file "
              "contents, or the cluster's keys).")
@click.option("--session-secret-file", default="", help="Where the secret that sessions' resume tokens are made "
              "with is kept (made if missing), so clients take their sessions back after this proxy restarts "
              "(default: derived from the proxy's key with --keys; else sessions end with the process).")
@_security
@_metrics_port
@_log_level
@_log_format
def proxy_main(rm: str, listen: str, name: str, session_timeout_seconds: float, rm_timeout_seconds: float,
               tenants_file: str, sandbox_functions: bool | None, heartbeat_interval_seconds: float, standby: bool,
               session_secret_file: str, keys: str,
               insecure: bool, metrics_port: int | None,
               log_level: str, log_format: str) -> None:
    """Run a client proxy."""
    from pwmesh.proxy.daemon import Proxy, ProxyConfig  # noqa: PLC0415

    name = Security(keys, insecure).named(name, "proxy")
    setup_logging("proxy", name, log_level, log_format)
    run(Proxy(ProxyConfig(rm=rm, listen=listen, name=name, session_timeout_seconds=session_timeout_seconds,
                          rm_timeout_seconds=rm_timeout_seconds,
                          tenants_file=tenants_file, sandbox_functions=sandbox_functions,
                          session_secret_file=session_secret_file, standby=standby,
                          rm_heartbeat_interval_seconds=heartbeat_interval_seconds,
                          security=Security(keys, insecure), metrics_port=metrics_port)))


@click.command(name="pwmesh-jax-coordinator")
@click.option("--address", required=True, envvar="PWMESH_JAX_COORDINATOR", show_envvar=True,
              help="HOST:PORT to serve a forming of an island's JAX group on (the island's scheduler starts one "
                   "per forming).")
@click.option("--processes", type=int, required=True, envvar="PWMESH_JAX_PROCESSES", show_envvar=True,
              help="How many processes the group has: this one and every executor in it.")
@_log_level
@_log_format
def jax_coordinator_main(address: str, processes: int, log_level: str, log_format: str) -> None:
    """Serve an island's JAX group (process 0, which computes nothing) until SIGTERM."""
    from pwmesh.executor.group import GroupConfig, serve  # noqa: PLC0415
    from pwmesh.service.lifecycle import READY_PREFIX, die_with_parent  # noqa: PLC0415

    setup_logging("jax-coordinator", address, log_level, log_format)
    die_with_parent()
    serve(GroupConfig(address, processes, 0), READY_PREFIX)


DAEMONS = {"rm": rm_main, "scheduler": scheduler_main, "executor": executor_main, "proxy": proxy_main,
           "jax-coordinator": jax_coordinator_main}

if __name__ == "__main__":  # ``python -m pwmesh.cli.daemons ROLE ...``, used by the local launcher
    role = sys.argv.pop(1)
    DAEMONS[role](prog_name=f"pwmesh-{role}")
