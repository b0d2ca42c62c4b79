"""Prometheus metrics under vLLM's names, through ``prometheus_client``, in one registry per app (several apps can
live in one process). Request metrics (latency histograms, token and request counters) are recorded by
OpenAIServing on the event loop; the engine's state is read from its published snapshot at scrape time by
``EngineCollector``, so nothing is copied ahead of a scrape and nothing goes stale between scrapes."""

from __future__ import annotations

import itertools
import time
from collections import Counter as CounterOf
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from lora_server.engine import Engine
from lora_server.engine.reports import BASE_NAME
from lora_server.kv_pool import AdapterPlacement

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
OTHER_ADAPTERS = "<other>"  # lora_name of the adapters beyond the labelled ones (no adapter name has < or >)
LORA_LABEL_WINDOW_S = 300.0  # the labelled adapters are re-chosen by their requests over this window
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


@dataclass(frozen=True, slots=True)
class RequestSeries:
    """The latency series one request is observed in: its adapter's (see AdapterLabels)."""

    ttft: Histogram
    itl: Histogram  # one observation per output token after the first
    tpot: Histogram  # one per request: its decode time over its output tokens after the first
    e2e: Histogram
    queue: Histogram  # one per admitted request: arrival to first admission
    adapter: Histogram  # one per request with a first token: its TTFT's adapter loading (TtftSplit's)


class Metrics:
    """One app's metrics. OpenAIServing takes a request's ``series(adapter)`` when it starts and observes its
    latencies there, and calls the counters' ``inc``; the /metrics route serves ``render()`` as ``content_type``.

    The latency histograms carry ``lora_name`` beside ``model_name``: "" (no label) for the base model, the adapter's
    name for at most ``max_lora_labels`` adapters, OTHER_ADAPTERS for the rest (AdapterLabels)."""

    content_type = CONTENT_TYPE_PLAIN_0_0_4  # what generate_latest writes; every Prometheus scraper reads it

    def __init__(self, model_name: str, engine: Engine, max_lora_labels: int = 16) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(name, help_text, ["model_name", "lora_name"], registry=self.registry, buckets=buckets)
            family.labels(model_name, "")  # the base model's series exist from the start
            return family

        def counter(name: str, help_text: str) -> Counter:
            return Counter(name, help_text, ["model_name"], registry=self.registry).labels(model_name)

        self._latencies = {
            "ttft": histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS),
            "itl": histogram("vllm:inter_token_latency_seconds", "Time between output tokens in seconds.", ITL_BUCKETS),
            "tpot": histogram(
                "vllm:request_time_per_output_token_seconds",
                "Per request: time per output token after the first, in seconds.",
                ITL_BUCKETS,
            ),
            "e2e": histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", E2E_BUCKETS),
            "queue": histogram(
                "vllm:request_queue_time_seconds", "Time from arrival to first admission in seconds.", E2E_BUCKETS
            ),
            "adapter": histogram(
                "lora_server:request_adapter_wait_seconds",
                "Per request, the part of its time to first token spent on its adapter: registered on first use, "
                "read and staged in host memory, copied to the device, in seconds.",
                TTFT_BUCKETS,
            ),
        }
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Output tokens of finished requests.")
        self.request_success = counter("vllm:request_success", "Finished requests.")
        self.adapter_labels = AdapterLabels(max_lora_labels, self._drop)
        self.registry.register(EngineCollector(engine, model_name))

    def series(self, adapter: str | None) -> RequestSeries:
        """The series a request of ``adapter`` (None: the base model) is observed in, counted as one request."""
        label = self.adapter_labels.label(adapter)
        return RequestSeries(**{k: family.labels(self.model_name, label) for k, family in self._latencies.items()})

    def _drop(self, names: set[str]) -> None:
        """Remove the series of adapters that lost their label (their later requests count as OTHER_ADAPTERS)."""
        for family in self._latencies.values():
            for name in names:
                family.remove(self.model_name, name)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class AdapterLabels:
    """The bound on lora_name values: at most ``limit`` adapters have their own series. Until the first window of
    LORA_LABEL_WINDOW_S ends, the first ``limit`` adapters requested get one; from then on, at the end of each
    window, the ``limit`` adapters with the most requests in it (ties by name) keep or get theirs, and the series of
    those that lose theirs are removed (``on_drop``). Requests of the others are observed under OTHER_ADAPTERS.
    The base model is always "" (its own series). Used on the event loop only."""

    def __init__(self, limit: int, on_drop: Callable[[set[str]], None], clock: Callable[[], float] = time.monotonic):
        self.limit, self.on_drop, self.clock = limit, on_drop, clock
        self.labelled: set[str] = set()
        self._counts: CounterOf[str] = CounterOf()  # requests per adapter in the current window
        self._window_start = clock()

    def label(self, adapter: str | None) -> str:
        """``adapter``'s lora_name for a request that starts now (counted in the window)."""
        if adapter is None:
            return ""
        if self.clock() - self._window_start >= LORA_LABEL_WINDOW_S:
            self._roll()
        self._counts[adapter] += 1
        if adapter not in self.labelled and len(self.labelled) < self.limit:
            self.labelled.add(adapter)
        return adapter if adapter in self.labelled else OTHER_ADAPTERS

    def _roll(self) -> None:
        top = set(sorted(self._counts, key=lambda a: (-self._counts[a], a))[: self.limit])
        dropped = self.labelled - top
        self.labelled = top
        self._counts.clear()
        self._window_start = self.clock()
        if dropped:
            self.on_drop(dropped)


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
    device, ``vllm:num_cpu_loaded_lora_adapters`` those staged in host memory (some also on the device), and
    ``rank`` on each series (the adapter's largest rank). What llm-d's LoRA scorer reads beside them:
    ``vllm:max_gpu_lora_adapters`` (the device's adapter slots: ``--max-loras``, the most distinct adapters one
    batch serves) and ``vllm:lora_adapter_load_seconds{transition}``, how long adapters took to become servable:
    ``load`` disk to host memory, ``activate`` host memory to the device (engine/load_times.py)."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self) -> Iterator[Metric]:
        snap = self.engine.snapshot()
        pool = snap.pool
        stats = pool.stats
        salts = stats.kv_tokens_by_salt.values()
        residency = adapter_residency(pool.adapters)
        on_device = sorted(name for name, r in residency.items() if level(r) == "gpu")
        counters = {
            "vllm:num_preemptions": ("Preemptions since start.", snap.num_preemptions),
            "vllm:prefix_cache_queries": (
                "Prompt tokens looked up in the prefix cache.",
                sum(prompt for prompt, _ in salts),
            ),
            "vllm:prefix_cache_hits": (
                "Prompt tokens served from the prefix cache.",
                sum(cached for _, cached in salts),
            ),
        }
        gauges = {
            "vllm:num_requests_running": ("Requests in the running batch.", snap.running),
            "vllm:num_requests_waiting": ("Requests waiting to be scheduled.", snap.waiting),
            "vllm:kv_cache_usage_perc": (
                "Fraction of GPU KV blocks held by requests (1 = 100%).",
                pool.request_blocks / pool.gpu_blocks,
            ),
            "vllm:num_gpu_loaded_lora_adapters": ("Adapters with weights on the device.", len(on_device)),
            "vllm:num_cpu_loaded_lora_adapters": (
                "Adapters with weights staged in host memory (those also on the device included).",
                sum(r.staged for r in residency.values()),
            ),
            "vllm:max_gpu_lora_adapters": (
                "The most distinct adapters one batch serves (--max-loras), the device's adapter slots.",
                self.engine.config.max_loras,
            ),
            "lora_server:adapters_resident": ("Adapters with weights on the GPU.", stats.resident_adapters),
            "lora_server:adapters_registered": ("Adapters registered.", len(self.engine.adapters.names())),
            **{
                f"lora_server:pool_{name}": (f"Pool figure {name} (see /admin/pool).", getattr(stats, name))
                for name in POOL_FIGURES
            },
            **{
                f"lora_server:pool_evicted_blocks_{kind}": (f"Blocks evicted so far by {kind}.", n)
                for kind, n in stats.evicted_blocks.items()
            },
            **{
                f"lora_server:ttft_{part}_mean_seconds": (
                    f"Mean {part} share of TTFT in seconds.",
                    getattr(pool.ttft, f"{part}_mean_s"),
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
            "1 per loaded adapter: level gpu while its weights are on the device, cpu while only in host memory; "
            "rank its largest LoRA rank.",
            labels=["model_name", "adapter_name", "level", "pinned", "rank"],
        )
        for name, r in sorted(residency.items()):
            loaded.add_metric([self.model_name, name, level(r), str(r.pinned).lower(), str(r.rank)], 1)
        yield loaded
        load_seconds = HistogramMetricFamily(
            "vllm:lora_adapter_load_seconds",
            "Seconds an adapter took to become servable, by transition: load (disk to host memory), activate (host "
            "memory to the device).",
            labels=["model_name", "transition"],
        )
        for transition, h in (("load", pool.adapter_load), ("activate", pool.adapter_activate)):
            cumulative = list(itertools.accumulate(h.counts))
            edges = [*(str(le) for le in h.buckets), "+Inf"]
            load_seconds.add_metric([self.model_name, transition], list(zip(edges, cumulative, strict=True)), h.sum)
        yield load_seconds
        cache = GaugeMetricFamily(
            "vllm:cache_config_info", "KV cache configuration (value 1).", labels=["block_size", "num_gpu_blocks"]
        )
        cache.add_metric([str(pool.block_size), str(pool.gpu_blocks)], 1)
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


def adapter_residency(placement: Iterable[AdapterPlacement]) -> dict[str, AdapterPlacement]:
    """Adapter name -> its placement in a snapshot (PoolReport.adapters), for names whose weights are on the device
    or staged in host memory (the others are read from disk when needed); the base model and weights no name
    points to any more (kept while their last requests run) are left out. Names with equal weights share one
    placement."""
    return {
        name: adapter
        for adapter in placement
        if adapter.tier == "gpu" or adapter.staged
        for name in adapter.names
        if name != BASE_NAME
    }


def level(adapter: AdapterPlacement) -> str:
    """Where vLLM's proposal says an adapter's weights are: "gpu" (in the device's arena), else "cpu" (staged)."""
    return "gpu" if adapter.tier == "gpu" else "cpu"
