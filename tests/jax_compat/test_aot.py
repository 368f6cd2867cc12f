"""Ahead-of-time ``.lower()`` / ``.compile()`` (issue #27, item 5), on both layouts; a case ported from JAX's
tests names its upstream test. The module is exported when lowered; each executor compiles it when it
first runs it (the cluster's devices are not the client's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pwmesh as pw

pytestmark = pytest.mark.timeout(180)


# pjit_test.py: PJitTest.testLowerWithDuckTyping
def test_lower_with_duck_typing(mesh_2x1: pw.Slice) -> None:
    x = jax.ShapeDtypeStruct((2, 2), jnp.float32)
    lowered = pw.jit(lambda x: x + 4, devices=mesh_2x1, in_specs=P("x"), out_specs=P("x")).lower(x)
    assert "stablehlo" in lowered.as_text() or "func.func" in lowered.as_text()
    assert lowered.out_info.shape == (2, 2) and lowered.out_info.dtype == jnp.float32


# Not a port: lower -> compile -> call, and the compiled call's type check (jax.stages.Compiled raises TypeError)
def test_lower_compile_and_call(mesh_2x1: pw.Slice) -> None:
    f = pw.jit(lambda x, y: x @ y, devices=mesh_2x1, in_specs=(P("x"), P()))
    x, y = np.ones((4, 3), np.float32), np.arange(6, dtype=np.float32).reshape(3, 2)
    compiled = f.lower(x, y).compile()
    np.testing.assert_allclose(np.asarray(compiled(x, y)), x @ y)
    with pytest.raises(TypeError, match="argument types differ"):
        compiled(np.ones((4, 3), np.int32), y)
    assert f.lower(x, y).exported is f.lower(x, y).exported, "lowered once per signature"
