"""An SPMD function run by blocks (``executor/blockwise.py``): the part each device runs of the partitioned
program, as a per-device function, when it needs no peers; refused, saying why, when it does. Real JAX on
this process's CPU devices (the cluster side is in test_sharding.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from pwmesh.errors import InvalidArgument
from pwmesh.executor.blockwise import communication, per_device

pytestmark = pytest.mark.timeout(60)

MESH = (2, 2)
AXES = ("data", "model")


def exported(fn: Callable[[Any], Any], spec_in: PartitionSpec, spec_out: PartitionSpec,
             shape: tuple[int, ...] = (8, 4)) -> export.Exported:
    """``fn`` as the client exports a ``pw.jit`` function: over the slice's abstract mesh of 4 devices."""
    mesh = AbstractMesh(MESH, AXES)
    jitted = jax.jit(fn, in_shardings=NamedSharding(mesh, spec_in), out_shardings=NamedSharding(mesh, spec_out))
    arg = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec_in))
    return export.export(jitted, platforms=["cpu"])(arg)


def test_a_part_that_needs_no_peers_runs_alone_on_one_block_as_the_whole_program_would() -> None:
    spec = PartitionSpec("data", "model")
    blocks = per_device(exported(lambda v: jnp.tanh(v * 2.0 + v.shape[0]), spec, spec), MESH, AXES, "f")
    part = blocks.exported
    assert part.nr_devices == 1 and not blocks.per_partition
    assert [a.shape for a in part.in_avals] == [(4, 2)] == [a.shape for a in part.out_avals]
    x = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    block = x[4:, 2:]  # device 3's: the global shape (8) stays the program's constant
    out = jax.jit(part.call)(jax.device_put(block, jax.devices("cpu")[1]))
    np.testing.assert_allclose(np.asarray(out), np.tanh(block * 2.0 + 8.0), rtol=1e-6)


def test_a_part_that_asks_its_partition_gets_its_number_as_a_constant() -> None:
    """A replicated input cut into blocks: each device's part slices out its own (``partition-id``)."""
    blocks = per_device(exported(lambda v: v * 3.0, PartitionSpec(), PartitionSpec("data")), MESH, AXES, "f")
    assert blocks.per_partition
    x = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    device = jax.devices("cpu")[0]
    for partition in range(4):  # mesh (data 2, model 2): partitions 0, 1 hold rows 0-3, partitions 2, 3 rows 4-7
        out = jax.jit(blocks.for_partition(partition).call)(jax.device_put(x, device))
        rows = slice(0, 4) if partition < 2 else slice(4, 8)
        np.testing.assert_array_equal(np.asarray(out), x[rows] * 3.0)


def test_a_part_that_needs_its_peers_is_refused_naming_why() -> None:
    with pytest.raises(InvalidArgument, match=r"devices communicate \(all-reduce\).*one JAX group"):
        per_device(exported(lambda v: v - v.sum(), PartitionSpec("data", "model"), PartitionSpec("data", "model")),
                   MESH, AXES, "f")


def test_communication_is_read_from_the_partitioned_module() -> None:
    hlo = "%a = f32[2] all-reduce-start(f32[2] %x)\n%b = u32[] partition-id()\n%c = f32[2] collective-permute(%a)"
    assert communication(hlo) == ["all-reduce", "collective-permute"]
    assert communication("%c = f32[2] add(%a, %a)\n%d = f32[2] sendrecv_like(%c)") == []
