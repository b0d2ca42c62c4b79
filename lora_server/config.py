"""The one configuration object of an engine, validated once and passed down."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv_pool.policies import POLICIES

LOAD_FORMATS = ("auto", "hf", "gguf", "dummy")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("auto", "cpu", "cuda")


@dataclass(slots=True)
class EngineConfig:
    """Everything an engine needs to be built.

    model: an HF directory (config.json + safetensors), a .gguf file, or with load_format="dummy" a preset name
    or a directory/file holding config.json; None means the embedded SmolLM2-135M-Instruct GGUF.
    quantization "auto" keeps a GGUF's own blocks (Q4_1 -> int4, Q8_0 -> int8) and leaves HF weights unquantized.
    """

    model: str | None = None
    load_format: str = "auto"
    quantization: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0  # for dummy weights
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: as many as kv_cache_bytes holds
    kv_cache_bytes: int = 1 << 30  # the device budget of the pool: KV blocks and the adapters it keeps resident
    gpu_memory_utilization: float | None = None  # on CUDA: the budget is this share of the memory left free after
    # the weights and adapter slots load (replaces kv_cache_bytes); leave room for activations
    host_kv_bytes: int = 1 << 30  # the host tier for KV swapped out of the device (pinned on CUDA); 0: none
    pool_policy: str = "tree-cost"  # tree-cost | lru-separate | lru-unified (kv_pool.policies)
    max_model_len: int | None = None  # None: the model's own context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    max_waiting_requests: int = 1024
    max_loras: int = 8  # device slots for adapters used by running requests
    max_lora_rank: int = 16
    adapter_roots: tuple[str, ...] | None = None  # directories adapters may be loaded from; None = anywhere
    show_progress: bool = True

    def __post_init__(self) -> None:
        _choice("load_format", self.load_format, LOAD_FORMATS)
        _choice("quantization", self.quantization, QUANTIZATIONS)
        _choice("dtype", self.dtype, tuple(DTYPES))
        _choice("device", self.device, DEVICES)
        for name in ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens", "max_waiting_requests",
                     "max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.host_kv_bytes < 0:
            raise ValueError(f"host_kv_bytes must be >= 0, got {self.host_kv_bytes}")
        _choice("pool_policy", self.pool_policy, tuple(POLICIES))
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but torch sees no CUDA GPU")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        """float32 on the CPU (bf16 matmuls are slow there), bfloat16 on CUDA, unless set."""
        chosen = DTYPES[self.dtype]
        if chosen is not None:
            return chosen
        return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
