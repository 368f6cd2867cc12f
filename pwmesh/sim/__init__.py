"""A simulated pwmesh cluster: the real RM, island-scheduler and proxy cores, simulated
executors, an in-memory network and virtual time, in one process (``pwmesh sim``)."""
