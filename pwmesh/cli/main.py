"""``pwmesh``: run a local cluster, submit jobs, show status, run the demo.

Each command parses its options and calls one function in ``commands``, so the
CLI is tested with click's ``CliRunner`` and the functions without click.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import click

from pwmesh.cli import commands
from pwmesh.service.local_cluster import LocalClusterSpec

_address = click.option("--address", envvar="PWMESH_ADDRESS", default=None,
                        help="Proxy address (default: $PWMESH_ADDRESS).")


@click.group()
@click.version_option(package_name="pwmesh")
def main() -> None:
    """pwmesh: one controller for many hosts' accelerators (an open Pathways)."""


def _shape(command: Callable[..., None]) -> Callable[..., None]:
    """The options that shape a local cluster (``pwmesh up``, and ``pwmesh submit``'s embedded one)."""
    for option in reversed((
        click.option("--islands", type=click.IntRange(min=1), default=2, show_default=True),
        click.option("--hosts-per-island", type=click.IntRange(min=1), default=2, show_default=True),
        click.option("--devices-per-host", type=click.IntRange(min=1), default=2, show_default=True),
    )):
        command = option(command)
    return command


@main.command()
@_shape
@click.option("--log-dir", type=click.Path(file_okay=False), default=None, help="Where daemon logs go.")
@click.option("--log-level", default="WARNING", show_default=True)
def up(islands: int, hosts_per_island: int, devices_per_host: int, log_dir: str | None, log_level: str) -> None:
    """Run a local cluster in the foreground until Ctrl-C."""
    commands.up(commands.UpConfig(islands, hosts_per_island, devices_per_host, log_dir, log_level))


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@_address
@_shape
@click.argument("job", type=click.Path(exists=True, dir_okay=False))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def submit(address: str | None, islands: int, hosts_per_island: int, devices_per_host: int, job: str,
           args: tuple[str, ...]) -> None:
    """Run the Python file JOB connected to a cluster: the one at --address, else an embedded one of the
    shape the other options give (a job's SPMD slices must fit one host: e.g. --devices-per-host 4)."""
    cluster = LocalClusterSpec(islands=islands, hosts_per_island=hosts_per_island, devices_per_host=devices_per_host)
    sys.exit(commands.submit(address, job, list(args), cluster))


@main.command()
@_address
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
def status(address: str | None, as_json: bool) -> None:
    """Show islands, hosts, devices, queues and sessions."""
    if not address:
        raise click.UsageError("no cluster address: pass --address or set PWMESH_ADDRESS (see `pwmesh up`)")
    click.echo(commands.status(address, as_json))


@main.command()
@_address
@click.argument("host")
@click.option("--timeout-seconds", type=float, default=600.0, show_default=True,
              help="How long to wait for the host's in-flight work and moves to finish.")
def drain(address: str | None, host: str, timeout_seconds: float) -> None:
    """Move HOST's virtual devices and buffers elsewhere and let its work finish.

    HOST is an executor id or host label, as `pwmesh status` shows. Afterwards the
    host runs nothing new and holds nothing: it can be stopped without losing data.
    """
    if not address:
        raise click.UsageError("no cluster address: pass --address or set PWMESH_ADDRESS (see `pwmesh up`)")
    click.echo(commands.drain(address, host, timeout_seconds))


@main.command()
@_address
@click.option("--out", required=True, type=click.Path(dir_okay=False, writable=True),
              help="Where to write the trace (JSON).")
@click.option("--last-seconds", type=click.FloatRange(min=0), default=None,
              help="Only computations that ended in the last this many seconds.")
@click.option("--limit", type=click.IntRange(min=0), default=0, show_default=True,
              help="At most this many newest computations per executor (0: all they kept).")
def trace(address: str | None, out: str, last_seconds: float | None, limit: int) -> None:
    """Write a Chrome/Perfetto trace of what ran on which device, and when.

    One track per device, grouped by executor; open the file at
    https://ui.perfetto.dev or chrome://tracing.
    """
    if not address:
        raise click.UsageError("no cluster address: pass --address or set PWMESH_ADDRESS (see `pwmesh up`)")
    click.echo(commands.trace(address, out, last_seconds, limit))


@main.command()
@_address
def demo(address: str | None) -> None:
    """Run the paper's Figure-2 program and say where each computation ran."""
    commands.demo(address)


if __name__ == "__main__":
    main()
