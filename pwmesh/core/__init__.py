"""What every daemon's pure core shares: the actions any core may return, the stimulus ids that tie an
action to the event that caused it, and the bounded log of recent events a core keeps
(``pwmesh debug events DAEMON`` dumps it), in the manner of dask's ``stimulus_id`` and ``stimulus_log``.

A core is ``handle(event, now) -> actions``: no threads, sockets or clocks of its own; ``now`` is given.
The pure helpers cores use live here too: ``liveness.Liveness`` (who missed their heartbeats) and
``ratelimit.RejectedLog`` (what a peer can make a daemon log, bounded; its clock is injected).
"""

from pwmesh.core.contract import EventLog, Received, Reply, Send, Timer, describe, replay

__all__ = ["EventLog", "Received", "Reply", "Send", "Timer", "describe", "replay"]
