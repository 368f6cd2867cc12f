"""A standby proxy takes over when the active one's host dies (issue #28, item 1).

``pwmesh-proxy --standby`` serves no session while the active proxy holds the resource
manager's lease. When the active one misses its heartbeats, the RM declares it lost, the
standby claims the lease and takes the sessions over; clients given both addresses move
to it and resume their sessions there, arrays and all. The proxy killed comes back as a
standby (two active proxies would free each other's sessions).
"""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

import pwmesh as pw
from helpers import eventually
from pwmesh.cli.commands import fetch_status

HEARTBEAT = 2.0  # the RM declares a silent proxy lost after this
pytestmark = pytest.mark.timeout(180)


def test_a_standby_takes_the_sessions_over_when_the_active_proxy_dies() -> None:
    spec = pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=1, session_timeout_seconds=8.0,
                               heartbeat_timeout_seconds=HEARTBEAT)
    with pw.LocalCluster(spec) as cluster:
        standby = cluster.add_proxy()
        both = f"{cluster.address},{standby.info['address']}"
        with pytest.raises(pw.Unavailable, match="standby"):  # it serves no session while the other is active
            pw.Client(standby.info["address"], name="early", connect_timeout_seconds=5.0)
        with pw.Client(both, name="trainer") as client:
            sl = client.make_virtual_device_set().add_slice(devices=2)
            step = pw.pmap(lambda w: w * 0.5 + 1.0, devices=sl)
            w = step(np.zeros((2, 3), np.float32))
            before = np.asarray(w)

            primary = cluster.child("proxy")
            primary.popen.send_signal(signal.SIGKILL)  # its host dies: nobody restarts it
            primary.popen.wait()
            killed = time.monotonic()
            lost = step(w)  # posted to the dead proxy: it fails, naming why, once the session is resumed
            with pytest.raises(pw.Unavailable, match="restarted or was replaced"):
                np.asarray(lost)
            took = time.monotonic() - killed
            np.testing.assert_allclose(np.asarray(w), before)  # what it held before is kept
            w = step(w)
            np.testing.assert_allclose(np.asarray(w), before * 0.5 + 1.0)
            assert client.session.conn.address == standby.info["address"] and client.session.conn.resumed == 1
            # The RM declares it lost within its heartbeat timeout (and a quarter, its check's period); the
            # client moves on after two unanswered beats of its own and resumes at once.
            assert took < 2 * HEARTBEAT + 2 * client.session.conn.failover_seconds, f"{took:.1f} s"
            status = fetch_status(standby.info["address"])
            assert [s.session_id for s in status.sessions] == [client.session_id]

            # The one killed comes back (a restarted unit): a standby now, the sessions stay where they are.
            cluster.restart("proxy")
            returned = cluster.child("proxy").info["address"]
            with pytest.raises(pw.Unavailable, match="standby"):
                pw.Client(returned, name="late", connect_timeout_seconds=5.0)
            eventually(lambda: len(fetch_status(standby.info["address"]).cluster.slices) == 1, 10)
            np.testing.assert_allclose(np.asarray(step(w)), np.asarray(w) * 0.5 + 1.0)
            assert client.session.conn.resumed == 1
