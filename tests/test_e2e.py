"""End to end through real daemons: programs, placement, futures, buffers."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
import pytest

import pwmesh as pw
from helpers import eventually
from pwmesh.examples import figure2


def back_to(objects: Callable[[], dict[str, int]], before: dict[str, int], timeout_seconds: float = 10) -> None:
    """Wait until the executors hold ``before`` objects again; say what they hold if they do not."""
    try:
        eventually(lambda: objects() == before, timeout_seconds)
    except TimeoutError:
        raise AssertionError(f"the executors hold {objects()} objects, not {before} as before") from None


def test_figure2_program_spans_three_executors_and_two_islands(default_client: pw.Client) -> None:
    y, z = figure2.main()
    np.testing.assert_array_equal(y, [2.0, 3.0])
    np.testing.assert_array_equal(z, [2.0, 4.0])
    slices = default_client.device_sets[-1].slices
    executors = {d.executor for sl in slices for d in sl.devices}
    assert len(slices) == 3
    assert len(executors) == 3, f"each slice on its own executor, got {executors}"
    assert {sl.island for sl in slices} == {0, 1}


def test_program_is_one_node_per_computation(client: pw.Client) -> None:
    devs = client.make_virtual_device_set()
    s1, s2 = devs.add_slice(devices=2), devs.add_slice(devices=2)
    a = pw.pmap(lambda x: x * 2.0, devices=s1)
    b = pw.pmap(lambda x: x + 1.0, devices=s2)

    @pw.program
    def chain(v):
        return b(a(v))

    traced = chain.trace(np.zeros(2, np.float32))
    assert len(traced.spec.nodes) == 2
    assert [v.shards for v in traced.spec.values] == [2, 2, 2]
    np.testing.assert_array_equal(np.asarray(chain(np.array([1.0, 2.0]))), [3.0, 5.0])


def test_outputs_are_futures_with_static_shape(client: pw.Client) -> None:
    sl = client.make_virtual_device_set().add_slice(devices=4)
    f = pw.pmap(lambda x: (x.sum(), x * 2), devices=sl)
    total, doubled = f(np.arange(12.0).reshape(4, 3))
    assert isinstance(total, pw.Array) and isinstance(doubled, pw.Array)
    assert (total.shape, total.dtype) == ((4,), np.float32)
    assert (doubled.shape, doubled.dtype) == ((4, 3), np.float32)
    assert total.block_until_ready() is total
    assert total.is_ready()
    np.testing.assert_array_equal(np.asarray(total), [3.0, 12.0, 21.0, 30.0])
    np.testing.assert_array_equal(np.asarray(doubled), np.arange(12.0).reshape(4, 3) * 2)


def test_put_get_and_chained_buffers_across_islands(client: pw.Client) -> None:
    devs = client.make_virtual_device_set()
    s0 = devs.add_slice(devices=2, island=0)
    s1 = devs.add_slice(devices=2, island=1)
    x = client.put(np.array([[1.0, 2.0], [3.0, 4.0]]), s0)
    inc = pw.pmap(lambda r: r + 1.0, devices=s1)
    y = inc(x)  # an existing buffer on island 0 moves to island 1, executor to executor
    z = inc(y)
    got = pw.get({"x": x, "z": z, "other": 7})
    np.testing.assert_array_equal(got["x"], [[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(got["z"], [[3.0, 4.0], [5.0, 6.0]])
    assert got["other"] == 7


def test_collectives_with_axis_name(client: pw.Client) -> None:
    sl = client.make_virtual_device_set().add_slice(devices=2)
    assert len({d.executor for d in sl.devices}) == 1
    total = pw.pmap(lambda x: jax.lax.psum(x, "i"), devices=sl, axis_name="i")
    np.testing.assert_array_equal(np.asarray(total(np.array([1.0, 5.0]))), [6.0, 6.0])


def test_released_buffers_leave_no_objects(cluster: pw.LocalCluster, objects: Callable[[], dict[str, int]]) -> None:
    before = objects()
    with pw.Client(cluster.address, name="leak-check") as c:
        devs = c.make_virtual_device_set()
        s1, s2 = devs.add_slice(devices=2, island=0), devs.add_slice(devices=2, island=1)
        a = pw.pmap(lambda x: x * 3.0, devices=s1)
        b = pw.pmap(lambda x: x - 1.0, devices=s2)

        @pw.program
        def f(v):
            return b(a(v)), a(v)

        outs = [f(np.array([1.0, 2.0])) for _ in range(3)]
        for pair in outs:
            np.testing.assert_array_equal(np.asarray(pair[0]), [2.0, 5.0])
        during = objects()
        assert sum(during.values()) > sum(before.values())
        del outs, pair
        kept = c.put(np.ones(2), s1)
        kept.delete()
        with pytest.raises(ValueError, match="deleted"):
            np.asarray(kept)
        # Deletes go through the islands' schedulers (one FreeShards an island): a status request may overtake them.
        back_to(objects, before)
    back_to(objects, before)


def test_dropped_arrays_are_freed_together_and_never_forgotten(cluster: pw.LocalCluster,
                                                              objects: Callable[[], dict[str, int]],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An array garbage-collected is freed with others (one ``ReleaseBuffers`` for many, not one a drop):
    ahead of the session's next message, so that message sees them freed; and, if the session sends
    nothing more, by its next heartbeat. ``delete()`` frees at once."""
    from pwmesh.client import connection

    releases: list[int] = []  # the ReleaseBuffers this process sends, and how many buffers each names
    encode = connection.encode

    def counting(message, **kwargs):
        if isinstance(message, connection.ReleaseBuffers):
            releases.append(len(message.buffers))
        return encode(message, **kwargs)

    monkeypatch.setattr(connection, "encode", counting)
    before = objects()
    with pw.Client(cluster.address, name="drops") as c:
        sl = c.make_virtual_device_set().add_slice(devices=2, island=0)
        double = pw.jit(lambda x: x * 2.0, devices=sl)
        arrays = [double(np.full(2, float(i), np.float32)) for i in range(connection.RELEASE_BATCH // 2)]
        np.testing.assert_array_equal(np.asarray(arrays[-1]), np.full(2, 2.0 * (len(arrays) - 1)))
        made = sum(objects().values()) - sum(before.values())
        assert made > 0
        dropped = len(arrays)
        del arrays  # fewer than a batch: held back...
        assert c.status().sessions, "...until this request, which they go ahead of"
        back_to(objects, before)
        assert sum(releases) == dropped and len(releases) <= 2, f"{dropped} drops said in {releases}"
        more = [double(np.ones(2, np.float32)) for _ in range(3)]
        np.asarray(more[-1])
        del more  # and with nothing sent after them, the next heartbeat takes them
        back_to(objects, before)
        kept = c.put(np.ones(2, np.float32), sl)
        assert sum(objects().values()) > sum(before.values())
        kept.delete()
        back_to(objects, before)
    pw.disconnect()


def test_value_split_mismatch_is_a_clear_error(client: pw.Client) -> None:
    devs = client.make_virtual_device_set()
    two, four = devs.add_slice(devices=2), devs.add_slice(devices=4)
    f = pw.pmap(lambda x: x, devices=two)
    g = pw.pmap(lambda x: x, devices=four)
    with pytest.raises(pw.InvalidArgument, match="leading axis of size 2"):
        f(np.zeros(4))

    @pw.program
    def both(v):
        return f(v), g(v)

    with pytest.raises(pw.InvalidArgument):
        both(np.zeros(2))
