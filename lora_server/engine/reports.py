"""What the engine reports to other threads, as typed values: what it serves (ModelInfo), its state as the engine
thread last published it (EngineSnapshot: queues, residency, the pool's figures as PoolReport, a copy of its
StepTimes), and one adapter's registration and residency (AdapterInfo). ``as_json`` gives the JSON the status
page, the admin API and the benchmarks write (names unchanged from the fields)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lora_server.json_types import JsonObject
from lora_server.kv_pool.unified_pool import PoolStats
from lora_server.model.arch import ModelArch
from lora_server.model.runner import CopyCosts

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


@dataclass(slots=True)
class StepTimes:
    """Where the engine's steps spent their time, summed since start (host clock): scheduling (the scheduler and
    the pool's policy: admission, eviction, swap decisions), the pool's copy operations (KV swaps and adapter
    loads: their execution off CUDA, their issue on CUDA) and the forward pass with sampling."""

    steps: int = 0
    schedule_s: float = 0.0
    copy_s: float = 0.0
    forward_s: float = 0.0

    def add(self, schedule_s: float, copy_s: float) -> None:
        self.steps += 1
        self.schedule_s += schedule_s
        self.copy_s += copy_s

    def since(self, earlier: StepTimes) -> StepTimes:
        """The steps after ``earlier`` (a copy taken before them)."""
        return StepTimes(
            self.steps - earlier.steps,
            self.schedule_s - earlier.schedule_s,
            self.copy_s - earlier.copy_s,
            self.forward_s - earlier.forward_s,
        )


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What an engine serves, as plain values (for benchmarks and the start-up summary)."""

    arch: ModelArch
    format: str  # how the weights were read: "gguf", "hf" or "dummy"
    path: Path | None  # the checkpoint file or directory (None: dummy weights)
    adapter_features: dict[str, tuple[int, int]]  # canonical module (q, k, v, o, gate, up, down) -> (in, out)
    device: torch.device
    dtype: torch.dtype
    weight_bytes: int  # resident base weights, quantized as they are held
    kv_bytes_per_token: int  # K and V of one token in every layer
    max_model_len: int
    startup_s: dict[str, float]  # seconds per start-up phase: weights, warm-up (where kernels compile), graphs
    activation_bytes: int  # device memory of the largest step's activations, measured at warm-up (CUDA; else 0)
    graph_bytes: int  # the decode graphs' share, estimated at warm-up (CUDA with graphs; else 0)
    copy_costs: CopyCosts  # the pool's copies as measured at start (their prices in the pool's cost model)


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What the engine thread publishes for other threads: plain values, at most ~0.1 s old while it runs."""

    running: int
    waiting: int
    decoding: bool  # something runs, nothing waits, and every running request computes one token next step
    context_tokens: int  # tokens (prompt + output so far) of the running requests
    num_preemptions: int
    running_adapters: tuple[str, ...]  # adapter names of running requests (sorted, distinct)
    waiting_adapters: tuple[str, ...]
    resident_pages: dict[int, int]  # adapter weights (adapter_id) on the device -> their table page
    pool: PoolReport
    step_times: StepTimes  # where the steps spent their time since start (a copy)
    spec_draft_tokens: int = 0  # speculative draft tokens verified since start
    spec_accepted_tokens: int = 0  # of them, those accepted
