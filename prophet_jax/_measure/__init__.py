"""Measurement: the profiler, the xplane reader and the network probe."""
