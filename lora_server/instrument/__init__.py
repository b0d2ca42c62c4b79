"""Instrumentation that tests and benchmarks share, never imported by the engine or the server: a stand-in for CUDA
with a counter of the host work of its code path (host_work), and a recorder of the order of the runner's copies on
stand-in streams (stream_recorder)."""
