"""pwmesh: a single-controller, asynchronous, sharded dataflow runtime for JAX.

    import pwmesh as pw
    from jax.sharding import PartitionSpec as P
    pw.connect()                                  # $PWMESH_ADDRESS, else an embedded local cluster
    s = pw.make_virtual_device_set().add_slice(devices=4, mesh={"data": 2, "model": 2})
    step = pw.jit(train_step, devices=s, in_specs=(param_specs, P("data")), donate_argnums=0)

Pipeline-parallel training over several slices (and islands): ``pw.pipeline``.
"""

from typing import TYPE_CHECKING

from pwmesh.errors import (
    ConnectionFailed,
    DeadlineExceeded,
    DeviceLost,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ProtocolError,
    PwmeshError,
    PwTimeoutError,
    RemoteError,
    ResourceExhausted,
    SliceSuspended,
    Unavailable,
)

# The API is imported on first use (PEP 562): ``import pwmesh`` stays cheap for the CLI and the
# daemons, and JAX is loaded only by what needs it.
_LAZY = {
    "pwmesh.client.api": ("Client", "NamedSharding", "connect", "default_client", "device_put", "disconnect", "get",
                          "make_virtual_device_set", "put"),
    "pwmesh.client.array": ("Array",),
    "pwmesh.client.devices": ("Slice", "VirtualDevice", "VirtualDeviceSet"),
    "pwmesh.client.functions": ("JitFunction", "MappedFunction", "jit", "pmap"),
    "pwmesh.client.program": ("HostFunction", "Program", "host", "program"),
    "pwmesh.client.routing": ("Router", "reshard"),
    "pwmesh.client.sharding": ("SliceSharding",),
    "pwmesh.service.local_cluster": ("LocalCluster", "LocalClusterSpec"),
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}

if TYPE_CHECKING:  # what static tools see: the same names, imported for real
    from pwmesh import pipeline
    from pwmesh.client.api import (
        Client,
        NamedSharding,
        connect,
        default_client,
        device_put,
        disconnect,
        get,
        make_virtual_device_set,
        put,
    )
    from pwmesh.client.array import Array
    from pwmesh.client.devices import Slice, VirtualDevice, VirtualDeviceSet
    from pwmesh.client.functions import JitFunction, MappedFunction, jit, pmap
    from pwmesh.client.program import HostFunction, Program, host, program
    from pwmesh.client.routing import Router, reshard
    from pwmesh.client.sharding import SliceSharding
    from pwmesh.service.local_cluster import LocalCluster, LocalClusterSpec

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    import importlib  # noqa: PLC0415

    if name == "pipeline":  # a submodule (it brings optax)
        return importlib.import_module("pwmesh.pipeline")
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'pwmesh' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE, "pipeline"])


__all__ = [
    "Array",
    "Client",
    "ConnectionFailed",
    "DeadlineExceeded",
    "DeviceLost",
    "HostFunction",
    "InvalidArgument",
    "JitFunction",
    "LocalCluster",
    "LocalClusterSpec",
    "MappedFunction",
    "NamedSharding",
    "NotFound",
    "PermissionDenied",
    "Program",
    "ProtocolError",
    "PwTimeoutError",
    "PwmeshError",
    "RemoteError",
    "ResourceExhausted",
    "Router",
    "Slice",
    "SliceSharding",
    "SliceSuspended",
    "Unavailable",
    "VirtualDevice",
    "VirtualDeviceSet",
    "connect",
    "default_client",
    "device_put",
    "disconnect",
    "get",
    "host",
    "jit",
    "make_virtual_device_set",
    "pipeline",
    "pmap",
    "program",
    "put",
    "reshard",
]
