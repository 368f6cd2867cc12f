"""pwmesh: a single-controller, asynchronous, sharded dataflow runtime for JAX.

    import pwmesh as pw
    pw.connect()                                  # $PWMESH_ADDRESS, else an embedded local cluster
    s = pw.make_virtual_device_set().add_slice(devices=2)
    double = pw.pmap(lambda x: x * 2.0, devices=s.devices)
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
from pwmesh.client.program import Program, program
from pwmesh.client.routing import Router, reshard
from pwmesh.client.tracing import HostFunction, host
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

__all__ = [
    "Array",
    "Client",
    "ConnectionFailed",
    "DeviceLost",
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
    "VirtualDevice",
    "VirtualDeviceSet",
    "connect",
    "default_client",
    "disconnect",
    "get",
    "host",
    "jit",
    "HostFunction",
    "make_virtual_device_set",
    "pmap",
    "program",
    "put",
    "reshard",
]
