"""Programs as dataflow graphs (one node per sharded computation) and their lowering."""
