"""Runs named by id (issue #30, item 1) across a JAX group's re-forming: a member's template parts live in its
process, and a member restarts its process to join each new forming (``JoinGroup``), so it comes back without
them while the island's scheduler, which saw no new executor, believes it holds them. Its next run names the
template only; the executor asks for its part (``NeedTemplate``) and the run goes on. Real daemons: the
re-forming is brought by a third host, which holds nothing of the slice (so the slice is not remapped and
its cached lowering, the template, stays the same), restarted."""

from __future__ import annotations

import signal

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pwmesh as pw
from pwmesh.cli.commands import debug_events

pytestmark = pytest.mark.timeout(120)


def test_members_restarted_into_a_new_forming_ask_for_their_parts_and_the_warm_program_runs() -> None:
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=3, devices_per_host=1, collectives=True,
                               heartbeat_timeout_seconds=2.0)
    with pw.LocalCluster(spec) as cluster, pw.Client(cluster.address) as client:
        sl = client.make_virtual_device_set().add_slice(devices=2, mesh={"x": 2})
        assert sl.executors == {"island0-host0", "island0-host1"}
        step = pw.jit(lambda v: v * 2.0 + v.sum(), devices=sl, in_specs=P("x"), out_specs=P("x"))
        x = np.arange(4.0, dtype=np.float32)
        for _ in range(3):  # the first installs the template, the next run by id
            np.testing.assert_array_equal(np.asarray(step(x)), x * 2 + x.sum())

        def asked() -> list[str]:
            return [line for line in debug_events(cluster.address, "scheduler-0", 0).splitlines()
                    if "sched.need_template" in line]

        assert asked() == []
        other = cluster.child("island0-host2")
        other.popen.send_signal(signal.SIGKILL)
        other.popen.wait()
        cluster.restart("island0-host2")  # the group forms again: host0 and host1 restart into it
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(step(x)), x * 2 + x.sum())
        # Both members of the slice came back without their part and asked for it (once each per forming they
        # restarted into before a run: the loss and the return may each bring one).
        assert len(asked()) >= 2
        assert [s.slice_id for s in client.session.status().cluster.slices if s.broken] == []
