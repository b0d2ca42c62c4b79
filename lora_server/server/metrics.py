"""Prometheus metrics under vLLM's names, through ``prometheus_client``, in one registry per app (several apps can
live in one process). Request metrics (latency histograms, token and request counters) are recorded by
OpenAIServing on the event loop; the engine's state is read from its published snapshot at scrape time by
``EngineCollector``, so nothing is copied ahead of a scrape and nothing goes stale between scrapes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from lora_server.engine import Engine

# vLLM's bucket edges (vllm/v1/metrics/loggers.py), so dashboards and routers built for vLLM read ours unchanged
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
BASE_PLACEMENT_NAME = "<base>"  # the base model's entry in the pool's placement (EngineCore.pool_figures)
POOL_FIGURES = (
    "adapter_hit_rate",
    "kv_token_hit_rate",
    "invalid_kv_ratio",
    "bytes_to_gpu",
    "bytes_to_host",
    "gpu_free",
    "gpu_cached",
    "gpu_in_use",
    "host_free",
    "host_cached",
)


class Metrics:
    """One app's metrics. OpenAIServing calls ``ttft``/``itl``/``e2e``.observe and the counters' ``inc``; the
    /metrics route serves ``render()`` as ``content_type``."""

    content_type = CONTENT_TYPE_PLAIN_0_0_4  # what generate_latest writes; every Prometheus scraper reads it

    def __init__(self, model_name: str, engine: Engine) -> None:
        self.registry = CollectorRegistry()

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(name, help_text, ["model_name"], registry=self.registry, buckets=buckets)
            return family.labels(model_name)

        def counter(name: str, help_text: str) -> Counter:
            return Counter(name, help_text, ["model_name"], registry=self.registry).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between output tokens in seconds.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", E2E_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Output tokens of finished requests.")
        self.request_success = counter("vllm:request_success", "Finished requests.")
        self.registry.register(EngineCollector(engine, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """Gauges and the pool's own running totals from the engine's last published snapshot (at most ~0.1 s old),
    read when the registry is collected.

    What the Gateway API Inference Extension's model-server protocol reads, with the meanings it gives them:
    ``vllm:num_requests_waiting`` / ``_running`` (requests queued / in the running batch), ``vllm:kv_cache_usage_perc``
    (the share, 0 to 1, of the device's KV blocks that requests hold; cached blocks no request holds can be
    reclaimed and count as free, as in vLLM), ``vllm:cache_config_info{block_size, num_gpu_blocks}`` (the device
    budget in blocks of ``block_size`` tokens) and ``vllm:lora_requests_info``: ``running_lora_adapters`` = the
    adapters loaded on the device and ready to serve (the protocol's meaning; vLLM itself lists those with running
    requests, a subset), ``waiting_lora_adapters`` = the adapters of waiting requests, ``max_lora`` = the most
    adapters on the device at once (``--max-loras``); only the current label set is exported, its value the
    wall-clock time of the reading (routers take the newest series).

    Residency per adapter, as vLLM's proposal has it (vllm-project/vllm#54830): ``vllm:lora_adapter_loaded
    {adapter_name, level, pinned}`` = 1 for each adapter whose weights are loaded somewhere, level "gpu" while they
    are on the device, "cpu" while they are only staged in host memory (a registered adapter on neither is read
    from disk when a request needs it: no series); ``vllm:num_gpu_loaded_lora_adapters`` counts those on the
    device, ``vllm:num_cpu_loaded_lora_adapters`` those staged in host memory (some also on the device)."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self) -> Iterator[Metric]:
        snap = self.engine.snapshot()
        pool: dict[str, Any] = snap.pool
        salts = pool["kv_tokens_by_salt"].values()
        residency = adapter_residency(pool["adapters"])
        on_device = sorted(name for name, (level, _, _) in residency.items() if level == "gpu")
        counters = {
            "vllm:num_preemptions": ("Preemptions since start.", snap.num_preemptions),
            "vllm:prefix_cache_queries": (
                "Prompt tokens looked up in the prefix cache.",
                sum(s["prompt_tokens"] for s in salts),
            ),
            "vllm:prefix_cache_hits": (
                "Prompt tokens served from the prefix cache.",
                sum(s["cached_tokens"] for s in salts),
            ),
        }
        gauges = {
            "vllm:num_requests_running": ("Requests in the running batch.", snap.running),
            "vllm:num_requests_waiting": ("Requests waiting to be scheduled.", snap.waiting),
            "vllm:kv_cache_usage_perc": (
                "Fraction of GPU KV blocks held by requests (1 = 100%).",
                pool["request_blocks"] / pool["gpu_blocks"],
            ),
            "vllm:num_gpu_loaded_lora_adapters": ("Adapters with weights on the device.", len(on_device)),
            "vllm:num_cpu_loaded_lora_adapters": (
                "Adapters with weights staged in host memory (those also on the device included).",
                sum(staged for _, _, staged in residency.values()),
            ),
            "lora_server:adapters_resident": ("Adapters with weights on the GPU.", pool["resident_adapters"]),
            "lora_server:adapters_registered": ("Adapters registered.", len(self.engine.adapter_names())),
            **{
                f"lora_server:pool_{name}": (f"Pool figure {name} (see /admin/pool).", pool[name])
                for name in POOL_FIGURES
            },
            **{
                f"lora_server:pool_evicted_blocks_{kind}": (f"Blocks evicted so far by {kind}.", n)
                for kind, n in pool["evicted_blocks"].items()
            },
            **{
                f"lora_server:ttft_{part}_mean_seconds": (
                    f"Mean {part} share of TTFT in seconds.",
                    pool["ttft"][f"{part}_mean_s"],
                )
                for part in ("queueing", "adapter_loading", "prefill")
            },
        }
        for kind, figures in ((CounterMetricFamily, counters), (GaugeMetricFamily, gauges)):
            for name, (help_text, value) in figures.items():
                family = kind(name, help_text, labels=["model_name"])
                family.add_metric([self.model_name], value)
                yield family
        loaded = GaugeMetricFamily(
            "vllm:lora_adapter_loaded",
            "1 per loaded adapter: level gpu while its weights are on the device, cpu while only in host memory.",
            labels=["model_name", "adapter_name", "level", "pinned"],
        )
        for name, (level, pinned, _) in sorted(residency.items()):
            loaded.add_metric([self.model_name, name, level, str(pinned).lower()], 1)
        yield loaded
        cache = GaugeMetricFamily(
            "vllm:cache_config_info", "KV cache configuration (value 1).", labels=["block_size", "num_gpu_blocks"]
        )
        cache.add_metric([str(pool["block_size"]), str(pool["gpu_blocks"])], 1)
        yield cache
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Adapters on the device (running) and of waiting requests (value: wall-clock time).",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        lora.add_metric(
            [",".join(on_device), ",".join(snap.waiting_adapters), str(self.engine.config.max_loras)], time.time()
        )
        yield lora


def adapter_residency(placement: list[dict[str, Any]]) -> dict[str, tuple[str, bool, bool]]:
    """Adapter name -> (level, pinned, staged) from the pool's placement in a snapshot (``EngineCore.pool_figures``
    "adapters"): level "gpu" while its weights are in the device's arena, "cpu" while they are only staged in host
    memory; names whose weights are on neither (registered, read from disk when needed) are left out, as are the
    base model and weights no name points to any more (kept while their last requests run). Names with equal
    weights share one entry of the placement."""
    residency: dict[str, tuple[str, bool, bool]] = {}
    for adapter in placement:
        level = "gpu" if adapter["tier"] == "gpu" else "cpu" if adapter["staged"] else None
        if level is None:
            continue
        for name in adapter["names"]:
            if name != BASE_PLACEMENT_NAME:
                residency[name] = (level, bool(adapter["pinned"]), bool(adapter["staged"]))
    return residency
