"""Sharded dataflow in the manner of PLAQUE: shard-tagged tuples between executors.

``layout`` is the arithmetic of blocks (which rows of which producer shard go to
which consumer shard), ``progress`` the per-edge, per-step completion tracking
that tells a consumer shard when all of its input has arrived, and ``exchange``
how an executor cuts its outputs into tuples and assembles the ones it receives.
"""
