"""What an executor keeps across a restart into its island's next JAX group (``executor/spill.py``):
saved to a private host-memory directory and read back exactly. No daemon, no devices: plain arrays."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from pwmesh.dataflow.exchange import Ragged
from pwmesh.errors import DeviceLost, InvalidArgument
from pwmesh.executor import spill
from pwmesh.wire.messages import RegisterFunction


def test_buffers_failures_tombstones_functions_and_order_come_back_exactly() -> None:
    directory = spill.spill_directory("host0")
    try:
        assert directory.stat().st_mode & 0o777 == 0o700, "a private directory"
        assert str(directory).startswith("/dev/shm/") or not Path("/dev/shm").is_dir(), "in host memory"
        arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([1.5, -2.0], dtype=jnp.bfloat16),
                  np.zeros((0, 5), np.int8), np.array(7, np.int64)]
        ragged = Ragged(np.ones((2, 3), np.float16), np.array([4, 9], np.int32))
        function = RegisterFunction(fn_id="f1", exported=b"\x00\x01bytes", spmd=True, devices=[0, 1], mesh=[2],
                                    axes=["x"], donate=[0])
        saved = spill.Saved(
            values=[(f"s/b{i}/0", i % 2, a, a.nbytes) for i, a in enumerate(arrays)] + [("s/r/0", 1, ragged, 11)],
            failures={"s/gone/0": DeviceLost("its peer died"), "s/bad/1": InvalidArgument("no")},
            tombstones=["s/old/0", "s/old/1"], functions=[function], expected_seq={"tcp://sched:1|ab12": 42})
        spill.save(saved, directory)
        back = spill.load(directory)
        for (key, device, value, nbytes), (k2, d2, v2, n2) in zip(saved.values, back.values, strict=True):
            assert (key, device, nbytes) == (k2, d2, n2)
            if isinstance(value, Ragged):
                assert isinstance(v2, Ragged)
                np.testing.assert_array_equal(v2.array, value.array)
                np.testing.assert_array_equal(v2.index, value.index)
                assert v2.index.dtype == value.index.dtype
            else:
                assert v2.dtype == value.dtype and v2.shape == value.shape
                np.testing.assert_array_equal(v2, value)
        assert {k: (type(e), e.message) for k, e in back.failures.items()} == {
            k: (type(e), e.message) for k, e in saved.failures.items()}
        assert back.tombstones == saved.tombstones
        assert back.functions == [function]
        assert back.expected_seq == saved.expected_seq
    finally:
        spill.remove(directory)
    assert not directory.exists()
