"""What the engine reports to other threads, as typed, immutable values: the pool's figures (PoolReport, in every
EngineSnapshot) and one adapter's registration and residency (AdapterInfo). ``as_json`` gives the JSON the status
page, the admin API and the benchmarks write (names unchanged from the fields)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lora_server.json_types import JsonObject
from lora_server.kv_pool.unified_pool import PoolStats

BASE_NAME = "<base>"  # the base model's entry among the pool's adapters


@dataclass(frozen=True, slots=True)
class Histogram:
    """Durations in fixed buckets: upper bounds (seconds; +Inf implied), observations per bucket (not cumulative,
    +Inf last), their sum and count."""

    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float
    count: int


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    weights_bytes: int  # resident base weights, as held (quantized or not)
    arena_bytes: int  # the arena: adapter and KV pages
    workspace_bytes: int
    host_tier_bytes: int  # the host tier of KV
    staged_adapters: int  # adapters staged in host memory now
    adapter_stagings: int  # stagings (reads from disk) since start
    staged_adapter_bytes: int = 0  # the host memory their images take
    staged_adapter_budget_bytes: int = 0  # what they may take (--cpu-lora-gb)


@dataclass(frozen=True, slots=True)
class AdapterResidency:
    """One adapter version (or the base model) as the pool places it."""

    name: str | None  # the first name served on it (BASE_NAME for the base model; None: no name left)
    names: tuple[str, ...]  # every name served on it
    tier: str  # "gpu" or "host"
    table_page: int  # its table page while on the device, else -1
    staged: bool  # its weights are ready in host memory
    pinned: bool
    rank: int | None  # its largest rank over its modules (None: the base model, or no longer registered)
    weight_blocks: int  # device blocks charged to its weights while resident
    kv_blocks_gpu: int  # KV blocks cached under it on the device
    kv_blocks_host: int  # and in the host tier


@dataclass(frozen=True, slots=True)
class TtftFigures:
    """Time to first token over the requests that got one, split into queueing (arrival to first admission),
    adapter loading and prefill (the rest); means in seconds."""

    requests: int
    mean_s: float
    queueing_mean_s: float
    adapter_loading_mean_s: float
    prefill_mean_s: float


@dataclass(frozen=True, slots=True)
class PoolReport:
    device_memory: DeviceMemory
    policy: str
    block_size: int
    gpu_blocks: int
    host_blocks: int
    block_bytes: int
    request_blocks: int  # device blocks held by requests now
    stats: PoolStats
    adapters: tuple[AdapterResidency, ...]
    ttft: TtftFigures
    adapter_load: Histogram  # disk to host memory
    adapter_activate: Histogram  # host memory to the device

    def as_json(self) -> JsonObject:
        """The figures as JSON: the pool's stats beside the other fields, cache salts' tokens by name, the adapter
        histograms under ``adapter_load_seconds``."""
        out = {k: v for k, v in asdict(self).items() if k not in ("stats", "adapter_load", "adapter_activate")}
        stats = asdict(self.stats)
        stats["kv_tokens_by_salt"] = {
            salt: {"prompt_tokens": p, "cached_tokens": c} for salt, (p, c) in self.stats.kv_tokens_by_salt.items()
        }
        out.update(stats)
        out["adapter_load_seconds"] = {"load": asdict(self.adapter_load), "activate": asdict(self.adapter_activate)}
        return out


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """Where an adapter name's current version is served from."""

    path: str  # its PEFT directory, or the URL it was downloaded from (adapters.sources)
    source: str  # where it was registered from: "demo", "command line", "api" or "on-demand"
    version: int
    pinned: bool
    registered_at: float  # unix seconds
    state: str  # "resident" (its weights on the device) or "registered"
    table_page: int | None  # its table page while resident
    bytes: int  # its weights as registered (host)
    device_bytes: int  # its pages on the device

    def as_json(self) -> JsonObject:
        return asdict(self)
