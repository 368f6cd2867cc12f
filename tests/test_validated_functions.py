"""Validated functions (issue #26 item 3): an executor loads only what it can trust to compile.

A ``jax.export`` artifact is data from a client. JAX checks its custom calls when it exports,
not when it deserializes: an artifact edited to call a host callback crashed an executor, and
every tenant's buffers on it were lost. Executors now recompute a function's id from its bytes
and refuse a module that calls anything ``jax.export`` does not guarantee stable, before it is
compiled. The crafted artifact here is made as an attacker would: a real export whose module
text is edited and serialized again (with JAX's own private helpers, as a test may).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax._src.export import _export
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

import pwmesh as pw
from pwmesh.cli.commands import fetch_status
from pwmesh.client.connection import ClientConnection
from pwmesh.executor import sandbox
from pwmesh.executor.artifacts import ALLOWED_CUSTOM_CALLS, custom_calls
from pwmesh.executor.functions import load
from pwmesh.ir.keys import function_id
from pwmesh.wire.messages import RegisterFunction, RunProgram
from pwmesh.wire.records import NodeSpec, ProgramInput, ProgramSpec, ValueSpec


def qr_export() -> export.Exported:
    return export.export(jax.jit(lambda a: jnp.linalg.qr(a)[0]))(jax.ShapeDtypeStruct((4, 4), jnp.float32))


def crafted() -> bytes:
    """A real export (QR: a LAPACK custom call) edited to call the host-callback target instead."""
    honest = qr_export()
    (target,) = [t for t in custom_calls(honest) if t.endswith("geqrf_ffi")]
    edited = honest.mlir_module().replace(f"@{target}", "@xla_ffi_python_cpu_callback")
    with mlir.make_ir_context():
        module = _export._module_to_bytecode(ir.Module.parse(edited))
    return bytes(dataclasses.replace(honest, mlir_module_serialized=module).serialize())


def test_an_honest_export_loads_and_a_crafted_one_is_refused() -> None:
    honest = bytes(qr_export().serialize())
    fn = load(function_id(honest, False), honest, spmd=False)
    assert custom_calls(fn.exported) <= ALLOWED_CUSTOM_CALLS and custom_calls(fn.exported)
    bad = crafted()
    assert "xla_ffi_python_cpu_callback" in custom_calls(export.deserialize(bytearray(bad)))
    with pytest.raises(pw.InvalidArgument, match="xla_ffi_python_cpu_callback"):
        load(function_id(bad, False), bad, spmd=False)
    assert not any("callback" in t for t in ALLOWED_CUSTOM_CALLS)


def test_an_executor_refuses_the_crafted_artifact_and_a_forged_id(cluster: pw.LocalCluster) -> None:
    executor = fetch_status(cluster.address).cluster.executors[0]
    bad = crafted()
    honest = bytes(qr_export().serialize())
    conn = ClientConnection(executor.control, name="crafter", open_session=False)
    try:
        with pytest.raises(pw.InvalidArgument, match="xla_ffi_python_cpu_callback"):
            conn.request(RegisterFunction(fn_id=function_id(bad, False), exported=bad, spmd=False, devices=[0]),
                         timeout_seconds=30.0)
        # An honest function's bytes under another function's id: "the first registration wins" no more.
        with pytest.raises(pw.InvalidArgument, match="not the hash of its bytes"):
            conn.request(RegisterFunction(fn_id="0" * 32, exported=honest, spmd=False, devices=[0]),
                         timeout_seconds=30.0)
    finally:
        conn.close()
    # The executor is alive and serves everyone as before.
    with pw.Client(cluster.address, name="after") as client:
        sl = client.make_virtual_device_set().add_slice(devices=2)
        q = pw.pmap(lambda a: jnp.linalg.qr(a)[0], devices=sl)(np.stack([np.eye(4, dtype=np.float32)] * 2))
        np.testing.assert_allclose(np.abs(np.asarray(q)), np.stack([np.eye(4)] * 2), atol=1e-6)
    assert all(e.alive for e in fetch_status(cluster.address).cluster.executors)


def test_the_sandbox_reads_a_function_first_and_survives_its_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--sandbox-functions`` (the default with keys): a child process reads each new function before the
    executor does. It refuses the crafted artifact as the executor would; one that crashes it (made to
    abort here: a parser that segfaults cannot be had on demand) is refused naming the signal, and the
    next function is read by a new child."""
    honest = bytes(qr_export().serialize())
    honest_id = function_id(honest, False)
    bad = crafted()
    doomed = bytes(export.export(jax.jit(jnp.sin))(jax.ShapeDtypeStruct((3,), jnp.float32)).serialize())
    doomed_id = function_id(doomed, False)
    monkeypatch.setenv(sandbox.TEST_CRASH_ENV, doomed_id)
    box = sandbox.Sandbox()
    try:
        box.check(honest_id, honest)
        with pytest.raises(pw.InvalidArgument, match="xla_ffi_python_cpu_callback"):
            box.check(function_id(bad, False), bad)
        with pytest.raises(pw.InvalidArgument, match=r"crashed the process that reads functions.*signal 6"):
            box.check(doomed_id, doomed)
        box.check(honest_id, honest)  # a new child
        assert (box.checked, box.crashes) == (3, 1)
        with pytest.raises(pw.InvalidArgument, match="crashed"):  # load goes through it
            load(doomed_id, doomed, spmd=False, sandbox=box)
        assert load(honest_id, honest, spmd=False, sandbox=box).fn_id == honest_id
    finally:
        box.close()


@pytest.mark.timeout(120)
def test_the_proxy_reads_a_new_function_in_its_sandbox_and_refuses_the_crafted_one() -> None:
    """``pwmesh-proxy --sandbox-functions`` (the default with keys): the proxy, which imports no JAX, has a
    child process read each new function's module before registering it, with the executors' checks. The
    crafted artifact is refused there, before any executor sees it, and the run that calls it fails with
    that cause; an honest function goes on as before."""
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=1, devices_per_host=1, proxy_args=("--sandbox-functions",))
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address, name="crafter") as client:
        sl = client.make_virtual_device_set().add_slice(devices=1)
        bad = crafted()
        fn_id = function_id(bad, False)
        client.session.register_function(fn_id, exported=bad, slice_id=sl.slice_id, spmd=False, mesh=[], axes=[],
                                         donate=[])
        program = ProgramSpec(values=[ValueSpec(shape=[4, 4], dtype="float32", shards=1)] * 2,
                              nodes=[NodeSpec(fn_id=fn_id, slice_id=sl.slice_id, inputs=[0], outputs=[1])],
                              inputs=[0], outputs=[1])
        out = client.session.new_buffer_id()
        client.session.post(RunProgram(inputs=[ProgramInput(array=np.eye(4, dtype=np.float32))], outputs=[out],
                                       program=program))
        with pytest.raises(pw.InvalidArgument, match=r"the proxy refused function .*xla_ffi_python_cpu_callback"):
            client.session.fetch([out], timeout_seconds=60)
        q = pw.pmap(lambda a: jnp.linalg.qr(a)[0], devices=sl)(np.eye(4, dtype=np.float32)[None])
        np.testing.assert_allclose(np.abs(np.asarray(q)), np.eye(4)[None], atol=1e-6)
