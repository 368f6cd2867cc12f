"""Runnable programs shipped with pwmesh (``pwmesh demo``, ``pwmesh submit``)."""
