"""The proxy's pure core: sessions, runs, buffers and their reference counts, remaps and losses.

``ProxyState.handle(event, now) -> actions`` does no I/O and never awaits: the daemon
(``proxy/daemon.py``) turns actions into messages and holds the futures of the requests
that wait (an ``AwaitBuffers``, a ``Fetch``); the simulator (``pwmesh/sim``) runs the
same core over its in-memory network in virtual time. A buffer's readiness is state
(``Buffer.done``, ``Buffer.error``); when it changes the core says so with ``Resolve``.

Events:
    ``Inbound(peer, message)``   a message a peer sent on the proxy's own socket: a client's
                                 request or post, an executor's ``NodeDone``.
    ``Notice(message)``          an unsolicited message on the proxy's connection to the RM
                                 (``ExecutorLost``, ``SliceRemapped``, ``SchedulerLost``...).
    ``SliceGranted(peer, slice)`` the RM's answer to the ``Ask`` a ``CreateSlice`` produced.
    ``FetchEnded(peer, buffer)`` a fetch ``Fetching`` started is over (the buffer is unpinned).
    ``Tick()``                   end the sessions whose client stopped sending heartbeats.

Actions:
    ``Send(to, message, dispatch)`` post ``message`` to the daemon at address ``to`` (the RM,
                                 a scheduler, an executor's control address); ``dispatch``: it is
                                 program traffic (counted in ``StatusReply``).
    ``Reply(message, error)``    the answer to the request being handled (one of the two).
    ``Ask(to, message)``         a request whose answer comes back as an event (``SliceGranted``).
    ``Wait(buffers, then)``      answer once every buffer is ``done`` (``AwaitBuffers``; a ``Fetch``
                                 with ``then=Fetching``).
    ``Fetching(buffer, keys)``   fetch these shard keys (by executor control address, in
                                 ``Layout.distinct()`` order); send ``FetchEnded`` when done.
    ``Resolve(buffer)``          ``buffer`` just became done (ready, or failed with ``buffer.error``).
    ``PeerLost(control, error)`` the executor at ``control`` is gone: fail what waits on it.
    ``PeerBack(control)``        it is back (restarted): send what waited for it.
    ``FencePeer(control, fence)`` it restarts: post ``fence`` and hold later posts until ``PeerBack``.
"""
