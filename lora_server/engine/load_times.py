"""How long adapters take to become servable, by transition, as histograms the engine publishes in its snapshot
(/metrics exports them as ``vllm:lora_adapter_load_seconds{transition}``, what llm-d's LoRA scorer reads):
``load`` is disk to host memory (the adapter loader thread reads, checks and lays out the files), ``activate`` host
memory to the device (from the step that issues the copy into the arena to the step where the engine learns it
ran)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lora_server.engine.reports import Histogram

# upper bounds in seconds (Prometheus adds +Inf): adapter reads of a few MB to a few GB, copies of microseconds up
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TRANSITIONS = ("load", "activate")


@dataclass(slots=True)
class LatencyHistogram:
    """Durations counted in fixed buckets; its owner observes, others read ``figures()`` (a frozen copy)."""

    buckets: tuple[float, ...] = LOAD_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))  # per bucket, +Inf last
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[next((i for i, le in enumerate(self.buckets) if seconds <= le), len(self.buckets))] += 1
        self.total += seconds

    def figures(self) -> Histogram:
        return Histogram(self.buckets, tuple(self.counts), self.total, sum(self.counts))
