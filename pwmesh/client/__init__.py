"""The client library: connect, virtual devices, compiled functions, programs, Array futures."""
