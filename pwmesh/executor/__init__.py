"""Host executor: a host's JAX devices, their run queues, the compile cache and the object store."""
