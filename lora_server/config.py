"""The configuration objects: ``EngineConfig`` (what an engine needs to be built) and ``ServerConfig`` (what
``lora-server serve`` needs beside it). Each is validated once in ``__post_init__`` and passed down. Every field
that has a command-line flag carries its help text, unit and choices in ``metadata`` (see ``flag``): the CLI
builds its flags and defaults from here, so no default is written twice."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from lora_server import envs
from lora_server.kv_pool.policies import POLICIES
from lora_server.tools.parsers import TOOL_PARSERS

LOAD_FORMATS = ("auto", "hf", "gguf", "dummy")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("auto", "cpu", "cuda")
RAY_ROUTINGS = ("adapter", "random")
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}  # vLLM's names
GIB, MIB, KIB = 1 << 30, 1 << 20, 1 << 10
CPU_MAX_NUM_SEQS, CPU_MAX_BATCHED_TOKENS = 64, 512
CUDA_MAX_NUM_SEQS = 256
# vLLM's step budget for an online server: (device memory from which the larger applies, larger, smaller)
CUDA_MAX_BATCHED_TOKENS = (70 * GIB, 8192, 2048)
HOST_ADAPTER_SHARE = 0.25  # of the host memory available at start, for staged adapters (--cpu-lora-gb's help says)


def available_memory_bytes() -> int:
    """Host memory available to new allocations now: Linux's MemAvailable, else the physical memory."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * KIB
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def flag(
    help: str,
    *,
    name: str | None = None,
    unit: int = 1,
    unit_name: str = "",
    choices: tuple[str, ...] = (),
    negate: str | None = None,
) -> dict[str, Any]:
    """A field's command-line flag: ``--field-name`` unless ``name``; the value given is in ``unit`` (e.g. GiB for
    a bytes field); ``negate``: a boolean whose default is True gets this flag to turn it off."""
    return {"help": help, "flag": name, "unit": unit, "unit_name": unit_name, "choices": choices, "negate": negate}


@dataclass(slots=True)
class EngineConfig:
    """Everything an engine needs to be built.

    quantization "auto" keeps a checkpoint's own quantized form: a GGUF's blocks (Q4_1 -> int4, Q8_0 -> int8, Q4_0,
    Q5_x, Q4_K, Q5_K, Q6_K as blocks), a pre-quantized HF checkpoint's codes; float HF weights stay unquantized.
    """

    model: str | None = field(
        default=None,
        metadata=flag(
            "the base model: an HF directory (config.json + safetensors) or a .gguf file; with --load-format dummy a "
            "preset (llama-3-8b, tiny-llama) or a config.json; default: the embedded SmolLM2-135M-Instruct"
        ),
    )
    load_format: str = field(default="auto", metadata=flag("how to read --model", choices=LOAD_FORMATS))
    chat_template: str | None = field(
        default=None,
        metadata=flag(
            "a Jinja chat template used instead of the model's own (vLLM's flag): a file, or the template itself; "
            "one that reads `tools` shows the model its tools its own way"
        ),
    )
    quantization: str = field(
        default="auto",
        metadata=flag(
            "how the base weights are held: auto keeps a GGUF's blocks (Q4_1 -> int4, Q8_0 -> int8) and HF weights "
            "as they are; fp8 is W8A8 (float8 e4m3 weights per output channel, activations per token): "
            "torch._scaled_mm on CUDA capability 8.9-9.x, the same numbers by dequantization elsewhere",
            choices=QUANTIZATIONS,
        ),
    )
    dtype: str = field(
        default="auto",
        metadata=flag(
            "activations and unquantized weights: auto is float32 on the CPU, bfloat16 on CUDA", choices=tuple(DTYPES)
        ),
    )
    device: str = field(default="auto", metadata=flag("auto: CUDA when torch sees a GPU", choices=DEVICES))
    cpu_head_copy: bool = field(
        default=True,
        metadata=flag(
            "on the CPU, give a quantized tied output head (the embedding) its own copy in a layout the CPU multiplies "
            "fast: float32 for int8 (vocab x hidden x 4 bytes: 113 MB for SmolLM2), torch's int4 layout for int4; "
            "without it the head is dequantized at every step",
            negate="--no-cpu-head-copy",
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=flag(
            "the KV cache's element type: auto is the model's dtype; fp8 (or fp8_e4m3) stores float8 e4m3 with a "
            "scale per layer, K/V and KV head calibrated at start: half of bf16's bytes per block, a quarter of "
            "fp32's, so the same --kv-cache-gb holds 2x / 4x the tokens",
            choices=tuple(KV_CACHE_DTYPES),
        ),
    )
    seed: int = field(default=0, metadata=flag("the seed of dummy weights", name="--dummy-seed"))
    block_size: int = field(default=16, metadata=flag("tokens per KV block"))
    num_kv_blocks: int | None = field(
        default=None, metadata=flag("KV blocks of the device budget (default: as many as --kv-cache-gb holds)")
    )
    kv_cache_bytes: int = field(
        default=GIB,
        metadata=flag(
            "the pool's device budget for KV blocks and resident adapters",
            name="--kv-cache-gb",
            unit=GIB,
            unit_name="GiB",
        ),
    )
    gpu_memory_utilization: float | None = field(
        default=None,
        metadata=flag(
            "on CUDA, instead of --kv-cache-gb: the share of the device's whole memory the engine may have in use "
            "once serving (vLLM's meaning); the arena gets what is left after the weights, buffers, everything "
            "else on the device, the largest step's activations and the decode graphs, measured at start"
        ),
    )
    host_kv_bytes: int = field(
        default=GIB,
        metadata=flag(
            "the host tier for KV swapped out of the device (pinned memory on CUDA); 0: none",
            name="--host-kv-gb",
            unit=GIB,
            unit_name="GiB",
        ),
    )
    pool_policy: str = field(
        default="tree-cost",
        metadata=flag(
            "what the pool keeps on the device: tree-cost (FastLibra's cost model), lru-separate (vLLM-like), "
            "lru-unified (S-LoRA-like)",
            choices=tuple(POLICIES),
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=flag("the longest sequence, prompt and output (default: the model's context, capped by the pool)"),
    )
    max_num_seqs: int = field(
        default=0,
        metadata=flag(
            "the most requests running at once (default: 0, sized for the device: 64 on the CPU, "
            f"{CUDA_MAX_NUM_SEQS} on CUDA)"
        ),
    )
    max_num_batched_tokens: int = field(
        default=0,
        metadata=flag(
            "the token budget of one engine step (default: 0, sized for the device as vLLM's: 512 on the CPU; on "
            f"CUDA {CUDA_MAX_BATCHED_TOKENS[1]} with {CUDA_MAX_BATCHED_TOKENS[0] // GIB} GiB of device memory or "
            f"more, else {CUDA_MAX_BATCHED_TOKENS[2]})"
        ),
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=flag("split long prompts across steps", negate="--no-chunked-prefill")
    )
    long_prefill_token_threshold: int | None = field(
        default=None,
        metadata=flag(
            "the most tokens of one prompt computed in a step while other requests run or wait, so that a long "
            "prompt never holds back the others' first tokens (vLLM's flag; default: a quarter of the step's token "
            "budget; 0: no cap; alone, a prompt takes the whole budget)"
        ),
    )
    max_num_partial_prefills: int = field(
        default=0,
        metadata=flag(
            "with chunked prefill, the most prompts that prefill at once; more wait (vLLM's flag; 0: no limit; "
            "refused with --no-chunked-prefill)"
        ),
    )
    max_long_partial_prefills: int | None = field(
        default=None,
        metadata=flag(
            "with chunked prefill, the most prompts with more than --long-prefill-token-threshold tokens left that "
            "prefill at once, so that several long prompts cannot fill the step between them: another long prompt "
            "waits, and shorter prompts behind it start (vLLM's flag; default: 1; 0: no limit; refused with "
            "--long-prefill-token-threshold 0 or --no-chunked-prefill, where no prompt is long)"
        ),
    )
    enforce_eager: bool = field(
        default=False,
        metadata=flag(
            "run every step eagerly: no CUDA graphs (by default, on CUDA, decode steps replay a graph captured at "
            "start for their batch-size bucket)"
        ),
    )
    max_waiting_requests: int = field(
        default=1024, metadata=flag("requests that may wait beyond the running ones; more get 429")
    )
    fair_sharing: bool = field(
        default=True,
        metadata=flag(
            "admit waiting requests by weighted fair sharing of tokens across tenants (weights and caps of running "
            "requests from the admin API), then by priority within a tenant; off: arrival order alone",
            negate="--no-fair-sharing",
        ),
    )
    speculative_ngram: int = field(
        default=0,
        metadata=flag(
            "speculative decoding by prompt lookup: draft tokens proposed per decode from the request's own context "
            "(n-gram match) and verified in one forward pass; greedy output and the sampled distribution are "
            "unchanged; 0: off"
        ),
    )
    speculative_ngram_min: int = field(default=2, metadata=flag("the shortest n-gram a draft is looked up by"))
    speculative_ngram_max: int = field(default=4, metadata=flag("the longest n-gram a draft is looked up by"))
    speculative_max_batch: int = field(
        default=8,
        metadata=flag(
            "speculation turns itself off while more requests than this run: a large batch's decode is no longer "
            "memory-bound, so verifying drafts costs more than it saves"
        ),
    )
    max_loras: int = field(
        default=16,
        metadata=flag(
            "the most distinct adapters in one batch (vLLM's meaning); how many stay resident on the device is the "
            "pool's decision within --kv-cache-gb, where adapters and KV share one arena"
        ),
    )
    max_lora_rank: int = field(default=16, metadata=flag("the largest adapter rank accepted"))
    max_cpu_loras: int | None = field(
        default=None,
        metadata=flag(
            "the most adapters kept staged in host memory, besides --cpu-lora-gb (vLLM's flag; default: no count, "
            "the bytes decide)"
        ),
    )
    cpu_lora_bytes: int | None = field(
        default=None,
        metadata=flag(
            "host memory for adapters staged beside the device, laid out for it (pinned on CUDA): they load without "
            "a disk read; the least recently used beyond are read from disk again when a request needs them, in "
            "the background (default: a quarter of the memory available at start)",
            name="--cpu-lora-gb",
            unit=GIB,
            unit_name="GiB",
        ),
    )
    adapter_staging_workers: int = field(
        default=0,
        metadata=flag(
            "threads that read adapters' files and lay them out in host memory, the adapters of the earliest "
            "waiting requests first (default: 0, half the CPU cores, 1 to 8)"
        ),
    )
    adapter_roots: tuple[str, ...] | None = field(
        default=None,
        metadata=flag(
            "directories adapters may be loaded from (the shipped demo adapters' is always one); takes commas, may "
            "repeat",
            name="--adapter-root",
        ),
    )  # None: anywhere (offline use)
    adapter_sources: tuple[str, ...] | None = field(
        default=None,
        metadata=flag(
            "URL schemes adapters may be registered from, downloaded into --adapter-cache-dir: hf "
            "(hf://ORG/NAME[@REVISION], the Hugging Face Hub), s3 (s3://BUCKET/PREFIX; pip install lora-server[s3]) "
            "or any installed fsspec filesystem's; takes commas, may repeat (default: none, only local paths: the "
            "server reaches no network and uses no cloud credentials unless told to)",
            name="--adapter-source",
        ),
    )
    adapter_cache_dir: str | None = field(
        default=None,
        metadata=flag(
            "where adapters from an --adapter-source are kept, each checked against its sha256 when reused (default: "
            "$XDG_CACHE_HOME/lora-server/adapters, i.e. ~/.cache/lora-server/adapters)"
        ),
    )
    adapter_cache_bytes: int = field(
        default=10 * GIB,
        metadata=flag(
            "the most disk the adapter cache may hold: the least recently used entries that no registered adapter "
            "reads go first; a download that cannot fit is refused",
            name="--adapter-cache-gb",
            unit=GIB,
            unit_name="GiB",
        ),
    )
    max_json_schema_bytes: int = field(
        default=64 * KIB,
        metadata=flag(
            "the largest JSON schema of structured output (response_format, guided_json, each tool's parameters), "
            "as compact JSON",
            name="--max-json-schema-kb",
            unit=KIB,
            unit_name="KiB",
        ),
    )
    max_json_schema_depth: int = field(
        default=32, metadata=flag("the deepest nesting of subschemas in a structured output's JSON schema")
    )
    max_guided_choices: int = field(default=256, metadata=flag("the most strings of a guided_choice"))
    max_choice_bytes: int = field(
        default=64 * KIB,
        metadata=flag(
            "the most bytes of a guided_choice's strings together", name="--max-choice-kb", unit=KIB, unit_name="KiB"
        ),
    )
    max_regex_bytes: int = field(
        default=16 * KIB,
        metadata=flag("the longest guided_regex", name="--max-regex-kb", unit=KIB, unit_name="KiB"),
    )
    max_grammar_bytes: int = field(
        default=64 * KIB,
        metadata=flag(
            "the longest guided_grammar (EBNF), and the largest tool-call grammar (structural tag) a request's tools "
            "make",
            name="--max-grammar-kb",
            unit=KIB,
            unit_name="KiB",
        ),
    )
    grammar_compile_timeout: float = field(
        default=10.0,
        metadata=flag(
            "seconds a request waits for its structured output's grammar to compile; longer is a 400 (the compile "
            "finishes in the background and is cached; xgrammar cannot be interrupted)"
        ),
    )
    grammar_compile_threads: int = field(
        default=2,
        metadata=flag(
            "threads that compile grammars (their own pool: a slow compile holds neither the server's worker "
            "threads nor the engine); requests beyond wait for one, within --grammar-compile-timeout"
        ),
    )
    grammar_cache_bytes: int = field(
        default=256 * MIB,
        metadata=flag(
            "memory the compiled grammars kept for reuse may hold (xgrammar's estimate of each); the least recently "
            "used go first",
            name="--grammar-cache-mb",
            unit=MIB,
            unit_name="MiB",
        ),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=flag(
            "split the base model across this many ranks (torch.distributed, gloo on the CPU): this process is rank "
            "0 and starts the others; each holds its share of the heads, the MLP, the vocabulary and the KV cache "
            "(per rank: --kv-cache-gb) and its share of every adapter; it must divide the heads and KV heads (1: no "
            "tensor parallelism)"
        ),
    )
    show_progress: bool = True  # a progress bar while loading weights

    def __post_init__(self) -> None:
        self._size_for_device()
        _choice("load_format", self.load_format, LOAD_FORMATS)
        _choice("quantization", self.quantization, QUANTIZATIONS)
        _choice("dtype", self.dtype, tuple(DTYPES))
        _choice("device", self.device, DEVICES)
        _choice("kv_cache_dtype", self.kv_cache_dtype, tuple(KV_CACHE_DTYPES))
        for name in (
            "block_size",
            "kv_cache_bytes",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_waiting_requests",
            "max_loras",
            "max_lora_rank",
            "max_json_schema_bytes",
            "max_json_schema_depth",
            "max_guided_choices",
            "max_choice_bytes",
            "max_regex_bytes",
            "max_grammar_bytes",
            "grammar_compile_threads",
            "adapter_cache_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.grammar_compile_timeout > 0 or self.grammar_cache_bytes < 0:
            raise ValueError("grammar_compile_timeout must be > 0 and grammar_cache_bytes >= 0")
        if self.host_kv_bytes < 0:
            raise ValueError(f"host_kv_bytes must be >= 0, got {self.host_kv_bytes}")
        for name in ("max_cpu_loras", "cpu_lora_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.adapter_staging_workers < 0:
            raise ValueError(
                f"adapter_staging_workers must be >= 0 (0: by the cores), got {self.adapter_staging_workers}"
            )
        _choice("pool_policy", self.pool_policy, tuple(POLICIES))
        if self.adapter_sources:
            from lora_server.adapters.sources import check_schemes

            check_schemes(self.adapter_sources)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.max_num_partial_prefills < 0 or (self.max_long_partial_prefills or 0) < 0:
            raise ValueError("max_num_partial_prefills and max_long_partial_prefills must be >= 0 (0: no limit)")
        if self.max_num_partial_prefills and not self.enable_chunked_prefill:
            raise ValueError("max_num_partial_prefills needs chunked prefill: without it no prompt prefills in parts")
        no_cap = not self.enable_chunked_prefill or self.long_prefill_token_threshold == 0
        if self.max_long_partial_prefills is not None and no_cap:
            raise ValueError(
                "max_long_partial_prefills needs chunked prefill and a long_prefill_token_threshold above 0: "
                "without them no prompt is long"
            )
        if self.speculative_ngram < 0:
            raise ValueError(f"speculative_ngram must be >= 0, got {self.speculative_ngram}")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError("speculative_ngram_min and speculative_ngram_max must satisfy 1 <= min <= max")
        if self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel()
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but torch sees no CUDA GPU")

    def _size_for_device(self) -> None:
        """Fill in the step's limits left at 0 for the device: vLLM's online-serving sizes on CUDA (a batch of many
        requests, a step of thousands of tokens), a CPU's small ones elsewhere."""
        if self.max_num_seqs < 0 or self.max_num_batched_tokens < 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1 (0: sized for the device)")
        cuda = self.device != "cpu" and torch.cuda.is_available()
        if self.max_num_seqs == 0:
            self.max_num_seqs = CUDA_MAX_NUM_SEQS if cuda else CPU_MAX_NUM_SEQS
        if self.max_num_batched_tokens == 0:
            self.max_num_batched_tokens = CPU_MAX_BATCHED_TOKENS
            if cuda:
                large, larger, smaller = CUDA_MAX_BATCHED_TOKENS
                memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
                self.max_num_batched_tokens = larger if memory >= large else smaller

    @property
    def staging_workers(self) -> int:
        """adapter_staging_workers, or half the CPU cores this process may run on, 1 to 8."""
        if self.adapter_staging_workers:
            return self.adapter_staging_workers
        return max(1, min(8, len(os.sched_getaffinity(0)) // 2))

    def host_adapter_bytes(self) -> int:
        """cpu_lora_bytes, or HOST_ADAPTER_SHARE of the memory available now (at least 256 MiB)."""
        if self.cpu_lora_bytes is not None:
            return self.cpu_lora_bytes
        return max(256 * MIB, int(HOST_ADAPTER_SHARE * available_memory_bytes()))

    def _check_tensor_parallel(self) -> None:
        """What tensor parallelism does not do yet, refused by name (the model's own refusals, heads that do not
        divide and quantized weights that cannot be cut where a rank's share begins, come at load:
        distributed.shard)."""
        n = self.tensor_parallel_size
        if self.torch_device.type != "cpu":
            raise ValueError(
                f"tensor_parallel_size {n} runs on the CPU (gloo) only so far: on {self.torch_device.type} the "
                "warm-up, the decode graphs and NCCL are not built for it yet; pass --device cpu"
            )
        if self.kv_cache_dtype != "auto":
            raise ValueError(f"tensor_parallel_size {n} does not shard an fp8 KV cache (its calibration) yet")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def adapter_cache_path(self) -> str:
        """--adapter-cache-dir, else the user's cache directory (lora_server.envs)."""
        return self.adapter_cache_dir or envs.adapter_cache_dir()

    @property
    def torch_dtype(self) -> torch.dtype:
        """float32 on the CPU (bf16 matmuls are slow there), bfloat16 on CUDA, unless set."""
        chosen = DTYPES[self.dtype]
        if chosen is not None:
            return chosen
        return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32

    @property
    def torch_kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's element type: the model's dtype, or float8_e4m3fn for fp8."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype

    def long_prefill_threshold(self, budget: int) -> int:
        """The long-prefill cap for a step budget of ``budget`` tokens: the flag's value, by default a quarter of
        the budget; 0 (no cap) without chunked prefill."""
        if not self.enable_chunked_prefill:
            return 0
        return budget // 4 if self.long_prefill_token_threshold is None else self.long_prefill_token_threshold

    def long_partial_prefills(self) -> int:
        """max_long_partial_prefills, by default 1."""
        return 1 if self.max_long_partial_prefills is None else self.max_long_partial_prefills


@dataclass(slots=True)
class ServerConfig:
    """What ``lora-server serve`` needs beside its engine. Keys and directories left None come from the
    environment (lora_server.envs) at start."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = field(default="127.0.0.1", metadata=flag("the address to listen on"))
    port: int = field(default=8000, metadata=flag("the port to listen on"))
    served_model_name: str | None = field(
        default=None, metadata=flag("the base model's id in the API (default: the model file's name)")
    )
    adapters: tuple[str, ...] | None = field(
        default=None,
        metadata=flag(
            "adapters to load at start, NAME=PATH or a shipped demo NAME; takes commas, may repeat (default: the "
            "shipped demo adapters with the embedded model, none with another --model)",
            name="--adapter",
        ),
    )
    adapter_dirs: tuple[str, ...] | None = field(
        default=None,
        metadata=flag(
            "directories whose every subdirectory is an adapter to load at start, named after it (thousands at "
            "once: their files read and checked on several threads); one that cannot be served is logged and "
            "skipped; takes commas, may repeat (default: none)",
            name="--adapter-dir",
        ),
    )
    admin_key: str | None = field(
        default=None,
        metadata=flag("the admin API's key (default: $LORA_SERVER_ADMIN_KEY, else a random one printed at start)"),
    )
    api_key: str | None = field(
        default=None,
        metadata=flag("a key that grants the global /v1 endpoints (a tenant's key acts as its tenant there too)"),
    )
    allow_anonymous: bool = field(
        default=False,
        metadata=flag(
            "keep /v1 open to callers without a key once tenants exist (without it and without --api-key, /v1 is "
            "open only while no tenant exists)"
        ),
    )
    load_adapters_on_demand: bool = field(
        default=False,
        metadata=flag(
            "a request naming an adapter that is not registered but lies in an adapter root as ROOT/NAME registers "
            "it on first use (vLLM's filesystem resolver; a tenant's allow-list is checked first; this server's "
            "own, not written to the registry store)"
        ),
    )
    max_request_bytes: int = field(
        default=4 * MIB,
        metadata=flag("request bodies above this size get 413", name="--max-request-mb", unit=MIB, unit_name="MiB"),
    )
    data_dir: str | None = field(
        default=None,
        metadata=flag(
            "where the embedded registry (SQLite) lives (default: $LORA_SERVER_DATA_DIR, else "
            "$XDG_DATA_HOME/lora-server, i.e. ~/.local/share/lora-server)"
        ),
    )
    redis_url: str | None = field(
        default=None,
        metadata=flag("keep the registry in Redis instead, so that several replicas share it (redis://HOST:PORT/DB)"),
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata=flag(
            "how the model writes tool calls, for tool_choice auto (vLLM's names): hermes (Qwen2.5/Qwen3, Hermes, "
            "SmolLM2), llama3_json (Llama 3.x), mistral; default: the one its chat template shows (hermes for a "
            "template that does not read tools: the tools are then rendered in the system prompt)",
            choices=tuple(TOOL_PARSERS),
        ),
    )
    shutdown_timeout: float = field(
        default=30.0,
        metadata=flag("seconds to let in-flight requests finish after SIGTERM (a second signal stops at once)"),
    )
    max_lora_metric_labels: int = field(
        default=16,
        metadata=flag(
            "/metrics' per-adapter latency series: the adapters with the most requests over the last 5 minutes (the "
            "first ones seen before that) get their own lora_name label, at most this many; the rest share "
            'lora_name="<other>"'
        ),
    )
    allowed_origins: tuple[str, ...] | None = field(
        default=None,
        metadata=flag(
            "origins whose web pages may call the API (CORS; * for any); takes commas, may repeat (default: none: "
            "CORS is off)"
        ),
    )
    allowed_methods: tuple[str, ...] | None = field(
        default=None, metadata=flag("with --allowed-origins: the HTTP methods they may use (default: all)")
    )
    allowed_headers: tuple[str, ...] | None = field(
        default=None, metadata=flag("with --allowed-origins: the request headers they may send (default: all)")
    )
    allow_credentials: bool = field(
        default=False, metadata=flag("with --allowed-origins: let them send cookies and authorization headers")
    )

    request_head_timeout: float = field(
        default=10.0,
        metadata=flag(
            "seconds a request's head (request line and headers) may take to arrive, from the connection's start "
            "or the previous response's end; a connection past it is closed"
        ),
    )
    request_body_timeout: float = field(
        default=60.0, metadata=flag("seconds a request's body may take to arrive after its head; then it is closed")
    )
    keep_alive_timeout: float = field(
        default=5.0, metadata=flag("seconds an idle kept-alive connection stays open (uvicorn's timeout_keep_alive)")
    )
    max_connections: int | None = field(
        default=None,
        metadata=flag(
            "the most open connections; newer ones are closed at once (default: the descriptor limit, raised at "
            "start to the hard limit, less 256 kept for files)"
        ),
    )
    docs: bool = field(
        default=True,
        metadata=flag(
            "serve /openapi.json and /docs (the admin routes appear only to the admin key)", negate="--no-docs"
        ),
    )

    ray_replicas: int = field(
        default=0,
        metadata=flag(
            "run this many engine replicas under Ray Serve behind one address (0: one process, no Ray; needs "
            "pip install lora-server[ray])"
        ),
    )
    ray_routing: str = field(
        default="adapter",
        metadata=flag(
            "with --ray-replicas: adapter routes by the request's model as Serve's multiplexed model id (to a "
            "replica that already holds it); random is Serve's default (two random replicas, the shorter queue)",
            choices=RAY_ROUTINGS,
        ),
    )
    ray_address: str | None = field(
        default=None,
        metadata=flag("with --ray-replicas: the Ray cluster to join (default: start a local one on this machine)"),
    )

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_request_bytes < 1 or self.shutdown_timeout < 0:
            raise ValueError("max_request_bytes must be >= 1 and shutdown_timeout >= 0")
        if min(self.request_head_timeout, self.request_body_timeout, self.keep_alive_timeout) <= 0:
            raise ValueError("request_head_timeout, request_body_timeout and keep_alive_timeout must be > 0")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.max_lora_metric_labels < 0:
            raise ValueError(f"max_lora_metric_labels must be >= 0, got {self.max_lora_metric_labels}")
        if self.ray_replicas < 0:
            raise ValueError(f"ray_replicas must be >= 0, got {self.ray_replicas}")
        _choice("ray_routing", self.ray_routing, RAY_ROUTINGS)
        if not self.allowed_origins and (self.allowed_methods or self.allowed_headers or self.allow_credentials):
            raise ValueError("--allowed-methods, --allowed-headers and --allow-credentials need --allowed-origins")
        if self.tool_call_parser is not None:
            _choice("tool_call_parser", self.tool_call_parser, tuple(TOOL_PARSERS))


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
