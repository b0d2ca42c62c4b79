"""What the engine reports to other threads, as typed values: what it serves (ModelInfo), and its state as the engine
thread last published it (EngineSnapshot: queues, residency, the pool's figures as PoolReport with each adapter's
kv_pool.AdapterPlacement, a copy of its StepTimes); one adapter's registration is adapters.served.AdapterInfo.
``as_json`` gives the JSON the status page, the admin API and the benchmarks write (names unchanged from the
fields)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, is_dataclass
from pathlib import Path

import torch

from lora_server.json_types import JsonObject
from lora_server.kv_pool.unified_pool import AdapterPlacement, PoolStats
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
    adapters: tuple[AdapterPlacement, ...]  # each adapter version and the base model, names and ranks filled
    ttft: TtftFigures
    adapter_load: Histogram  # disk to host memory
    adapter_activate: Histogram  # host memory to the device

    def as_json(self) -> JsonObject:
        """The figures as JSON: the pool's stats beside the other fields, cache salts' tokens by name, the adapter
        histograms under ``adapter_load_seconds``."""
        out: JsonObject = {}
        for f in fields(self):  # in the fields' order; the adapters' placements made once, each as the page reads it
            value = getattr(self, f.name)
            if f.name == "adapters":
                out[f.name] = [_placement_json(a) for a in value]
            elif f.name not in ("stats", "adapter_load", "adapter_activate"):
                out[f.name] = asdict(value) if is_dataclass(value) and not isinstance(value, type) else value
        stats = asdict(self.stats)
        stats["kv_tokens_by_salt"] = {
            salt: {"prompt_tokens": p, "cached_tokens": c} for salt, (p, c) in self.stats.kv_tokens_by_salt.items()
        }
        out.update(stats)
        out["adapter_load_seconds"] = {"load": asdict(self.adapter_load), "activate": asdict(self.adapter_activate)}
        return out


def _placement_json(a: AdapterPlacement) -> JsonObject:
    """An adapter's placement as the status page reads it (its id left out)."""
    return {
        "name": a.name,
        "names": list(a.names),
        "tier": a.tier,
        "table_page": a.table_page,
        "staged": a.staged,
        "pinned": a.pinned,
        "rank": a.rank,
        "weight_blocks": a.weight_blocks,
        "kv_blocks_gpu": a.kv_blocks_gpu,
        "kv_blocks_host": a.kv_blocks_host,
    }


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
    expert_bytes: int = 0  # a mixture of experts': one expert's resident weights (gate|up and down; 0: dense)


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
    # a mixture of experts' reads since start, over its layers (model.moe): experts run, (expert, adapter run) LoRAs
    experts_read: int = 0
    expert_loras_read: int = 0
