"""``pwmesh``: run a local cluster, submit jobs, show status, run the demo.

Each command parses its options and calls one function in ``commands``, so the
CLI is tested with click's ``CliRunner`` and the functions without click.
``commands`` (and with it JAX) is imported only by the command that runs, so
``--help`` answers at once. A pwmesh error is one line on stderr and exit status
1; ``--debug`` (or ``$PWMESH_DEBUG``) shows the traceback instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import click

from pwmesh.errors import PwmeshError
from pwmesh.service.local_cluster import LocalClusterSpec
from pwmesh.service.logs import FORMATS

CONNECT_TIMEOUT_SECONDS = 5.0
KEYS_ENV = "PWMESH_KEYS"  # pwmesh.service.keys.ENV (not imported: --help stays light)


def _use_keys(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value:  # every connection this command makes (and a submitted job's) reads it from there
        os.environ[KEYS_ENV] = value


def _connection(command: Callable[..., None]) -> Callable[..., None]:
    """``--address``, ``--connect-timeout`` and ``--keys``: where the cluster is, how long to wait for it to
    answer, and the keys to show it."""
    command = click.option("--keys", envvar=KEYS_ENV, show_envvar=True, default=None, expose_value=False,
                           callback=_use_keys, help="The keys directory this client was given (a cluster "
                           "started with --keys answers only clients with keys).")(command)
    command = click.option("--connect-timeout", "connect_timeout", type=click.FloatRange(min=0.1),
                           envvar="PWMESH_CONNECT_TIMEOUT", show_envvar=True, default=CONNECT_TIMEOUT_SECONDS,
                           show_default=True, help="Seconds to wait for the cluster to answer at all.")(command)
    return click.option("--address", envvar="PWMESH_ADDRESS", show_envvar=True, default=None,
                        help="The cluster's (its proxy's) address.")(command)


def _need(address: str | None) -> str:
    if not address:
        raise click.UsageError("no cluster address: pass --address or set PWMESH_ADDRESS (see `pwmesh up`)")
    return address


class _Main(click.Group):
    """The command group: a pwmesh error becomes one line and exit status 1 (unless ``--debug``)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PwmeshError as exc:
            if ctx.params.get("debug"):
                raise
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise click.ClickException(f"{first}  ({type(exc).__name__}; --debug shows more)") from None


@click.group(cls=_Main)
@click.version_option(package_name="pwmesh")
@click.option("--debug", is_flag=True, envvar="PWMESH_DEBUG", show_envvar=True,
              help="Show the traceback of an error, not just its message.")
def main(debug: bool) -> None:
    """pwmesh: one controller for many hosts' accelerators (an open Pathways)."""


def _shape(command: Callable[..., None]) -> Callable[..., None]:
    """The options that shape a local cluster (``pwmesh up``, and ``pwmesh submit``'s embedded one)."""
    for option in reversed((
        click.option("--islands", type=click.IntRange(min=1), default=2, show_default=True),
        click.option("--hosts-per-island", type=click.IntRange(min=1), default=2, show_default=True),
        click.option("--devices-per-host", type=click.IntRange(min=1), default=2, show_default=True),
        click.option("--collectives/--no-collectives", default=True, show_default=True,
                     help="Each island's executors form one JAX group, so SPMD slices (collectives) may span hosts "
                          "(--no-collectives: no group; the cluster starts sooner, SPMD slices must fit one host)."),
    )):
        command = option(command)
    return command


@main.command()
@_shape
@click.option("--log-dir", type=click.Path(file_okay=False), default=None, help="Where daemon logs go.")
@click.option("--log-level", default="WARNING", show_default=True)
@click.option("--log-format", type=click.Choice(FORMATS), default="text", envvar="PWMESH_LOG_FORMAT",
              show_envvar=True, show_default=True,
              help="Every daemon's log: key=value pairs (text) or one JSON object per line (json).")
@click.option("--keys", envvar=KEYS_ENV, show_envvar=True, default="", type=click.Path(file_okay=False),
              help="The cluster's keys directory (`pwmesh keys init`): every socket speaks CURVE, and clients "
                   "need a key issued with `pwmesh keys add-client`.")
@click.option("--metrics/--no-metrics", default=True, show_default=True,
              help="Every daemon serves Prometheus metrics on a free loopback port; their addresses are printed.")
def up(islands: int, hosts_per_island: int, devices_per_host: int, collectives: bool, log_dir: str | None,
       log_level: str, log_format: str, keys: str, metrics: bool) -> None:
    """Run a local cluster in the foreground until Ctrl-C."""
    from pwmesh.cli import commands  # noqa: PLC0415 - see the module docstring

    commands.up(commands.UpConfig(islands, hosts_per_island, devices_per_host, log_dir, log_level, collectives,
                                  log_format=log_format, keys=keys, metrics=metrics))


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@_connection
@_shape
@click.argument("job", type=click.Path(exists=True, dir_okay=False))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def submit(address: str | None, connect_timeout: float, islands: int, hosts_per_island: int,
           devices_per_host: int, collectives: bool, job: str, args: tuple[str, ...]) -> None:
    """Run the Python file JOB connected to a cluster: the one at --address, else an embedded one of the
    shape the other options give (its islands form JAX groups, so a job's SPMD slices may span hosts, unless
    --no-collectives)."""
    from pwmesh.cli import commands  # noqa: PLC0415

    cluster = LocalClusterSpec(islands=islands, hosts_per_island=hosts_per_island, devices_per_host=devices_per_host,
                               collectives=collectives, private=True)
    sys.exit(commands.submit(address, job, list(args), cluster, connect_timeout_seconds=connect_timeout))


@main.command()
@_connection
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
def status(address: str | None, connect_timeout: float, as_json: bool) -> None:
    """Show islands, hosts, devices, queues and sessions."""
    from pwmesh.cli import commands  # noqa: PLC0415

    click.echo(commands.status(_need(address), as_json, connect_timeout_seconds=connect_timeout))


@main.command()
@_connection
@click.argument("host")
@click.option("--timeout-seconds", type=float, default=600.0, show_default=True,
              help="How long to wait for the host's in-flight work and moves to finish.")
def drain(address: str | None, connect_timeout: float, host: str, timeout_seconds: float) -> None:
    """Move HOST's virtual devices and buffers elsewhere and let its work finish.

    HOST is an executor id or host label, as `pwmesh status` shows. Afterwards the
    host runs nothing new and holds nothing: it can be stopped without losing data.
    """
    from pwmesh.cli import commands  # noqa: PLC0415

    click.echo(commands.drain(_need(address), host, timeout_seconds, connect_timeout_seconds=connect_timeout))


@main.command()
@_connection
@click.argument("session")
def suspend(address: str | None, connect_timeout: float, session: str) -> None:
    """Suspend SESSION's slices to give their devices to another tenant (admins only).

    SESSION is a session id, as `pwmesh status` shows. Its arrays stay where they are (readable);
    its runs fail with SliceSuspended until `pwmesh resume SESSION`.
    """
    from pwmesh.cli import commands  # noqa: PLC0415

    click.echo(commands.suspend(_need(address), session, connect_timeout_seconds=connect_timeout))


@main.command()
@_connection
@click.argument("session")
def resume(address: str | None, connect_timeout: float, session: str) -> None:
    """Resume SESSION's suspended slices on whatever devices are granted now (admins only).

    Its arrays are moved onto them, possibly on other hosts; its client goes on unchanged.
    """
    from pwmesh.cli import commands  # noqa: PLC0415

    click.echo(commands.resume(_need(address), session, connect_timeout_seconds=connect_timeout))


@main.command()
@_connection
@click.option("--out", required=True, type=click.Path(dir_okay=False, writable=True),
              help="Where to write the trace (JSON).")
@click.option("--last-seconds", type=click.FloatRange(min=0), default=None,
              help="Only computations that ended in the last this many seconds.")
@click.option("--limit", type=click.IntRange(min=0), default=0, show_default=True,
              help="At most this many newest computations per executor (0: all they kept).")
def trace(address: str | None, connect_timeout: float, out: str, last_seconds: float | None, limit: int) -> None:
    """Write a Chrome/Perfetto trace of what ran on which device, and when.

    One track per device, grouped by executor; open the file at
    https://ui.perfetto.dev or chrome://tracing.
    """
    from pwmesh.cli import commands  # noqa: PLC0415

    click.echo(commands.trace(_need(address), out, last_seconds, limit, connect_timeout_seconds=connect_timeout))


@main.group()
def debug() -> None:
    """Look inside a running daemon."""


@debug.command(name="events")
@_connection
@click.argument("daemon")
@click.option("--limit", type=click.IntRange(min=0), default=100, show_default=True,
              help="The newest this many events (0: all it keeps, up to 2,000).")
@click.option("--raw", type=click.Path(dir_okay=False, writable=True), default="",
              help="Also write the events themselves to this file, to replay them into a fresh core in a test "
              "(pwmesh.cli.commands.load_events, pwmesh.core.contract.replay).")
def debug_events(address: str | None, connect_timeout: float, daemon: str, limit: int, raw: str) -> None:
    """Print the latest events DAEMON's core handled: time, stimulus id, event, and how many actions it caused.

    DAEMON is `proxy`, `rm`, `scheduler-N` (island N's), an executor id as `pwmesh status` shows it, or an
    address (tcp://...). Each daemon keeps its last 2,000 (heartbeats in a row as one line); a core's log
    can be replayed into a fresh core in a test (`pwmesh.core.contract.replay`). Needs an admin key on a keyed cluster.
    """
    from pwmesh.cli import commands  # noqa: PLC0415

    click.echo(commands.debug_events(_need(address), daemon, limit, connect_timeout_seconds=connect_timeout, raw=raw))


@main.command()
@_connection
def demo(address: str | None, connect_timeout: float) -> None:
    """Run the paper's Figure-2 program and say where each computation ran."""
    from pwmesh.cli import commands  # noqa: PLC0415

    commands.demo(address, connect_timeout_seconds=connect_timeout)


@main.command()
@click.option("--islands", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--hosts-per-island", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--devices-per-host", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--workload", type=click.Choice(("opbyop", "chained", "fused", "pipeline", "clients")),
              default="chained", show_default=True,
              help="Figure 5's chain as separate programs, one program or one fused computation; a pipeline "
                   "over the islands; or many clients with weights sharing devices.")
@click.option("--steps", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--devices", type=click.IntRange(min=1), default=8, show_default=True, help="Devices per slice.")
@click.option("--k", "k", type=click.IntRange(min=1), default=16, show_default=True,
              help="Computations in the chain (opbyop, chained, fused).")
@click.option("--latency-us", type=click.FloatRange(min=0), default=20.0, show_default=True)
@click.option("--bandwidth-gbps", type=click.FloatRange(min=0.001), default=100.0, show_default=True)
@click.option("--jitter", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Extra random delay per message, as a fraction of the latency.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write every figure to this JSON file.")
def sim(islands: int, hosts_per_island: int, devices_per_host: int, workload: str, steps: int, devices: int,
        k: int, latency_us: float, bandwidth_gbps: float, jitter: float, seed: int, json_path: str | None) -> None:
    """Run a workload on a simulated cluster: the real RM, scheduler and proxy cores, fake devices, virtual time.

    Prints the controller's figures: simulated time per step, the proxy's messages and bytes, the
    schedulers' decisions, and the real CPU time the controller's cores spent.
    """
    from pwmesh.cli import simulate  # noqa: PLC0415 - see the module docstring

    text, _ = simulate.simulate(simulate.SimCommand(
        islands, hosts_per_island, devices_per_host, workload, steps, devices, k, latency_us, bandwidth_gbps,
        jitter, seed, json_path))
    click.echo(text)


@main.group()
def keys() -> None:
    """Make and issue the cluster's CURVE keys (ZeroMQ certificates)."""


@keys.command(name="init")
@click.argument("directory", type=click.Path(file_okay=False))
def keys_init(directory: str) -> None:
    """Make the cluster's keys in DIRECTORY (new or empty); give it to every daemon as --keys."""
    from pwmesh.service import keys as cluster_keys  # noqa: PLC0415

    where = cluster_keys.init(directory)
    click.echo(f"made the cluster's keys in {where}: start every daemon with --keys {where} "
               f"(or {KEYS_ENV}={where}); issue clients theirs with `pwmesh keys add-client NAME --keys {where}`")


def _cluster_keys(command: Callable[..., None]) -> Callable[..., None]:
    return click.option("--keys", "directory", envvar=KEYS_ENV, show_envvar=True, required=True,
                        type=click.Path(file_okay=False), help="The cluster's keys directory.")(command)


@keys.command(name="add-client")
@click.argument("name")
@_cluster_keys
def keys_add_client(name: str, directory: str) -> None:
    """Issue client NAME a key pair and authorize it; prints the directory to hand that client."""
    from pwmesh.service import keys as cluster_keys  # noqa: PLC0415

    given = cluster_keys.add_client(directory, name)
    click.echo(f"{given}\n(give the client this directory: pw.connect(address, keys=...) or {KEYS_ENV}; "
               "running daemons accept it from now on)")


@keys.command(name="add-admin")
@click.argument("name")
@_cluster_keys
def keys_add_admin(name: str, directory: str) -> None:
    """Issue admin NAME a key pair: a client that may also drain hosts and see every tenant's sessions."""
    from pwmesh.service import keys as cluster_keys  # noqa: PLC0415

    given = cluster_keys.add_client(directory, name, admin=True)
    click.echo(f"{given}\n(give the admin this directory: pw.connect(address, keys=...) or {KEYS_ENV})")


@keys.command(name="add-daemon")
@click.argument("name")
@click.option("--front", is_flag=True, help="A host that runs the resource manager or a proxy (reached by the "
              "cluster's key): it gets the cluster's secret key too. Executor and scheduler hosts serve with "
              "their own keys and hold no cluster secret.")
@_cluster_keys
def keys_add_daemon(name: str, front: bool, directory: str) -> None:
    """Issue daemon host NAME a key pair of its own: its daemons may act only as NAME, and removing the
    key shuts the host out."""
    from pwmesh.service import keys as cluster_keys  # noqa: PLC0415

    given = cluster_keys.add_daemon(directory, name, front=front)
    click.echo(f"{given}\n(give host {name} this directory as --keys, with a copy of {directory}/authorized "
               f"as its authorized/ unless it reads the cluster's directory itself; its daemons are named {name})")


@keys.command(name="remove")
@click.argument("name")
@_cluster_keys
def keys_remove(name: str, directory: str) -> None:
    """Revoke client, admin or daemon host NAME: within a second every daemon refuses what it sends."""
    from pwmesh.service import keys as cluster_keys  # noqa: PLC0415

    for path in cluster_keys.remove(directory, name):
        click.echo(f"removed {path}")


@keys.command(name="list")
@_cluster_keys
def keys_list(directory: str) -> None:
    """Show the keys the cluster lets in."""
    from pwmesh.service import keys as cluster_keys  # noqa: PLC0415

    for name, role, public in cluster_keys.listing(directory):
        click.echo(f"{name:<24} {role:<11} {public}")


@main.group()
def tenants() -> None:
    """Tenants' shares and limits, which the proxy applies (re-read when the file changes)."""


def _tenants_file(command: Callable[..., None]) -> Callable[..., None]:
    return click.option("--file", "path", default=None, type=click.Path(dir_okay=False),
                        help=f"The policy file (default: tenants.json in ${KEYS_ENV}, the cluster's keys).")(command)


def _policy_path(path: str | None) -> str:
    if path:
        return path
    keys_dir = os.environ.get(KEYS_ENV)
    if not keys_dir:
        raise click.UsageError(f"give --file, or set {KEYS_ENV} to the cluster's keys directory")
    from pwmesh.proxy.tenants import FILE_NAME  # noqa: PLC0415

    return os.path.join(keys_dir, FILE_NAME)


@tenants.command(name="set")
@click.argument("name")
@click.option("--weight", type=float, help="Its share of the devices against other tenants' (default 1).")
@click.option("--priority", type=int, help="Higher runs first, whatever the shares (default 0).")
@click.option("--max-sessions", type=int, help="Sessions open at once (0: no limit).")
@click.option("--max-nodes", type=int, help="Computations in one program.")
@click.option("--max-programs", type=int, help="Programs registered and held, all sessions together.")
@click.option("--max-bytes", type=int, help="Bytes its buffers hold, all sessions together.")
@click.option("--max-bytes-in-flight", type=int, help="Bytes of its puts and fetches passing through the proxy "
              "at once.")
@click.option("--max-run-seconds", type=float, help="A run still going after this fails (pw.DeadlineExceeded).")
@_tenants_file
def tenants_set(name: str, path: str | None, **given: float | int | None) -> None:
    """Set tenant NAME's shares and limits (the name of its key; '*' for every tenant not named)."""
    from pwmesh.proxy import tenants as policy  # noqa: PLC0415

    where = _policy_path(path)
    current = policy.load(where)
    # What it had (its own entry, not '*'), with what is given now on top.
    had = current.tenants[name].as_json() if name in current.tenants else {}
    fields = {**had, **{k: v for k, v in given.items() if v is not None}}
    updated = policy.TenantPolicy({**current.tenants, name: policy.TenantLimits.parse(name, fields)})
    policy.save(where, updated)
    click.echo(f"{name}: {updated.tenants[name].as_json() or 'no limits'} ({where}; the proxy applies it within a "
               "second)")


@tenants.command(name="list")
@_tenants_file
def tenants_list(path: str | None) -> None:
    """Show every tenant's shares and limits."""
    from pwmesh.proxy import tenants as policy  # noqa: PLC0415

    for name, limits in policy.load(_policy_path(path)).as_json().items():
        click.echo(f"{name:<16} " + " ".join(f"{k}={v:g}" for k, v in limits.items()))


if __name__ == "__main__":
    main()
