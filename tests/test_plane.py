"""The data plane between two real planes in this process (real sockets, real shared memory)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pwmesh.dataflow.plane import BIG_FRAME_BYTES, DataPlane
from pwmesh.wire.messages import DataTuple, TupleBatch

pytestmark = pytest.mark.timeout(60)


def test_a_batch_with_more_big_frames_than_shared_memory_slots_arrives() -> None:
    """A slot is freed when its message is acknowledged: a batch of more big frames than the stream has
    slots (a reshard's 16 pieces of 100 KB, 8 slots) waited for itself for ever, and the run hung."""
    got: list[TupleBatch] = []
    arrived = threading.Event()

    def on_batch(batch: TupleBatch) -> None:
        got.append(batch)
        arrived.set()

    receiver = DataPlane(None, on_batch)
    sender = DataPlane(None, lambda b: None, max_segments=8)
    try:
        pieces = [np.full(BIG_FRAME_BYTES // 4 + 1000, i, np.float32) for i in range(16)]
        tuples = [DataTuple(prefix="s/b", shard=i, device=0, src=0, sources=1, shape=[p.size], dtype="float32",
                            count=1, seq=0, array=p) for i, p in enumerate(pieces)]
        sender.send(receiver.address, TupleBatch(tuples=tuples))
        assert arrived.wait(30), "the batch never arrived"
        assert [t.shard for t in got[0].tuples] == list(range(16))
        for t, p in zip(got[0].tuples, pieces, strict=True):
            np.testing.assert_array_equal(t.array, p)
        moved = sender.bytes_moved()
        assert moved[("sent", "shm")] > 0 and moved[("sent", "tcp")] > 0  # 8 through slots, the rest inline
    finally:
        sender.close()
        receiver.close()
