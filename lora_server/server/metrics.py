"""Prometheus metrics under vLLM's names, rendered by hand in the text exposition format (the event loop thread
records; /metrics renders)."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def render(self, model: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{model_name="{model}",le="{le}"}} {cumulative}')
        lines += [f'{self.name}_sum{{model_name="{model}"}} {self.total}',
                  f'{self.name}_count{{model_name="{model}"}} {self.n}']
        return lines


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.lock = threading.Lock()
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.")
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens in seconds.")
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.")
        self.counters: dict[str, float] = {"vllm:prompt_tokens_total": 0, "vllm:generation_tokens_total": 0,
                                           "vllm:request_success_total": 0}

    def add(self, name: str, value: float) -> None:
        with self.lock:
            self.counters[name] = self.counters.get(name, 0) + value

    def set_counter(self, name: str, value: float) -> None:
        """A counter whose total is kept elsewhere (the pool's), copied in before rendering."""
        with self.lock:
            self.counters[name] = value

    def observe(self, histogram: Histogram, value: float) -> None:
        with self.lock:
            histogram.observe(value)

    def render(self, gauges: dict[str, float], lora_info: dict[str, str], extra: Callable[[], dict[str, float]]) -> str:
        m = self.model_name
        lines: list[str] = []
        with self.lock:
            for name, value in {**gauges, **extra()}.items():
                lines += [f"# TYPE {name} gauge", f'{name}{{model_name="{m}"}} {value}']
            for name, value in self.counters.items():
                lines += [f"# TYPE {name} counter", f'{name}{{model_name="{m}"}} {value}']
            for h in (self.ttft, self.itl, self.e2e):
                lines += h.render(m)
        labels = ",".join(f'{k}="{v}"' for k, v in lora_info.items())
        lines += ["# TYPE vllm:lora_requests_info gauge", f"vllm:lora_requests_info{{{labels}}} 1"]
        return "\n".join(lines) + "\n"
