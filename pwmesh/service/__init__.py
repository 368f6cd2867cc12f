"""One lifecycle, one socket interface and one RPC layer for every daemon."""
