"""pwmesh: a single-controller, asynchronous, sharded dataflow runtime for JAX.

    import pwmesh as pw
    from jax.sharding import PartitionSpec as P
    pw.connect()                                  # $PWMESH_ADDRESS, else an embedded local cluster
    s = pw.make_virtual_device_set().add_slice(devices=4, mesh={"data": 2, "model": 2})
    step = pw.jit(train_step, devices=s, in_specs=(param_specs, P("data")), donate_argnums=0)

Pipeline-parallel training over several slices (and islands): ``pw.pipeline``.
"""

from pwmesh.client.api import (
    Client,
    connect,
    default_client,
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
from pwmesh.errors import (
    ConnectionFailed,
    DeviceLost,
    InvalidArgument,
    NotFound,
    ProtocolError,
    PwmeshError,
    PwTimeoutError,
    RemoteError,
    ResourceExhausted,
)
from pwmesh.service.local_cluster import LocalCluster, LocalClusterSpec

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``pw.pipeline``, imported on first use (it brings optax, which plain pwmesh does not need)."""
    if name == "pipeline":
        import importlib  # noqa: PLC0415

        return importlib.import_module("pwmesh.pipeline")
    raise AttributeError(f"module 'pwmesh' has no attribute {name!r}")


__all__ = [
    "Array",
    "Client",
    "ConnectionFailed",
    "DeviceLost",
    "HostFunction",
    "InvalidArgument",
    "JitFunction",
    "LocalCluster",
    "LocalClusterSpec",
    "MappedFunction",
    "NotFound",
    "Program",
    "ProtocolError",
    "PwTimeoutError",
    "PwmeshError",
    "RemoteError",
    "ResourceExhausted",
    "Router",
    "Slice",
    "SliceSharding",
    "VirtualDevice",
    "VirtualDeviceSet",
    "connect",
    "default_client",
    "disconnect",
    "get",
    "host",
    "jit",
    "make_virtual_device_set",
    "pmap",
    "program",
    "put",
    "reshard",
]
