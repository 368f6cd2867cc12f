"""Island scheduler: the one order in which every computation runs on an island's devices."""
