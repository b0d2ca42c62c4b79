"""Benchmarks run by ``lora-server bench-engine`` and ``lora-server bench-pool``."""
