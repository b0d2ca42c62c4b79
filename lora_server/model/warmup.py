"""Warm-up before serving: the synthetic steps whose forward passes meet every Triton kernel variant the engine's
steps can reach, so that every variant is compiled at start and no request waits for a compiler; the largest of
them is also the profile step whose peak memory the arena is sized around (model.runner).

What decides a variant, besides what is fixed for an engine (the model's shapes, its dtype, quantization and KV
cache dtype, the LoRA workspace):

- a step's token count T, through the weight-only matmuls' tile table (kernels.quant_tiles: one tile configuration
  per bucket of T, the dequantization kernel + cuBLAS from DEQUANT_MIN_TOKENS on); for the output head, T is the
  step's sampled rows;
- whether every sequence computes one token (decode attention; LoRA tiles of DECODE_BLOCK_T rows) or not (paged
  attention, whose query tile is 16 rows while the longest query times the query heads per KV head fits in 16,
  else 64; LoRA tiles of PREFILL_BLOCK_T rows);
- whether decode attention splits a sequence's keys (more than one split) or not;
- whether any token has an adapter (LoRA kernels run at all; a CUDA graph's layout always has them);
- for the output head, the rows a step samples and, for prompt logprobs, the prompt rows it scores (a slice of them
  at a time: model.sampler.score_tokens): the prefill steps score theirs.

Everything else that changes from step to step is a runtime value that Triton does not specialize on (the kernels'
``do_not_specialize``: token counts, split counts, block-table widths, table rows) or is aligned the same way
every step (the step's integer arrays start at 16-byte boundaries: model.step_inputs). So one step per bucket of T
with and without adapters, decode steps with and without split keys, and a short and a long query cover every
variant; tests/engine/test_warmup.py checks it on the meta stand-in for CUDA against a random workload."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lora_server.kernels.quant_tiles import DECODE_TILES, DEQUANT_MIN_TOKENS
from lora_server.model.batch import DraftPosition
from lora_server.sampling_params import SamplingParams

MIN_KEYS_TO_SPLIT = 256  # a decode context that decode attention splits when the batch leaves SMs idle (> 128 keys)


@dataclass(frozen=True, slots=True)
class SyntheticSeq:
    """One sequence of a warm-up step: ``context`` tokens already in the cache, ``new`` computed now."""

    context: int
    new: int
    adapter: bool


@dataclass(frozen=True, slots=True)
class WarmupStep:
    label: str
    seqs: tuple[SyntheticSeq, ...]
    scores_prompt: bool = False  # its new tokens' hidden rows also go through the head (prompt logprobs' scoring)

    @property
    def num_tokens(self) -> int:
        return sum(s.new for s in self.seqs)

    def blocks(self, block_size: int) -> int:
        """The KV blocks its sequences hold, each its own."""
        return sum(-(-(s.context + s.new) // block_size) for s in self.seqs)


@dataclass(frozen=True, slots=True)
class WarmupShapes:
    """What the plan needs of an engine."""

    max_num_seqs: int
    max_step_tokens: int  # the most tokens one step computes (the token budget, or a whole prompt)
    max_model_len: int
    query_heads_per_kv_head: int
    decode_buckets: tuple[int, ...]  # the decode batch sizes of the CUDA graphs (empty: every step eager)
    lora: bool = True  # whether the model can serve adapters (adapters.page_layout.PageGeometry.check_fits)


def token_buckets(max_tokens: int) -> list[int]:
    """One token count per bucket of the quantized matmuls' tiles that a step of at most ``max_tokens`` tokens can
    fall in: each bucket's largest count (capped), and DEQUANT_MIN_TOKENS when reachable."""
    counts = {min(bound, max_tokens) for bound, *_ in DECODE_TILES if bound is not None}
    counts.add(min(DEQUANT_MIN_TOKENS - 1, max_tokens))
    if max_tokens >= DEQUANT_MIN_TOKENS:
        counts.add(DEQUANT_MIN_TOKENS)
    return sorted(counts)


def plan(shapes: WarmupShapes) -> list[WarmupStep]:
    """The warm-up steps of an engine, the profile step (the largest) last."""
    steps: list[WarmupStep] = []
    with_adapters = (True, False) if shapes.lora else (False,)
    # decode steps: every graph bucket (or, with every step eager, every bucket of the matmul tiles), with and
    # without adapters; a single long sequence whose keys decode attention splits, and a short one it does not
    sizes = list(shapes.decode_buckets) or token_buckets(shapes.max_num_seqs)
    for size in sizes:
        for adapter in with_adapters:
            label = f"decode x{size}" + (" + LoRA" if adapter else "")
            steps.append(WarmupStep(label, (SyntheticSeq(1, 1, adapter),) * size))
    longest = min(MIN_KEYS_TO_SPLIT, shapes.max_model_len - 1)
    steps.append(WarmupStep("decode, split keys", (SyntheticSeq(longest, 1, shapes.lora),)))
    # prefill steps: one sequence of each bucket's token count, with and without an adapter, after a short
    # context (a chunk of a longer prompt reads its cached prefix); and a query short enough for the 16-row tile
    for count in token_buckets(min(shapes.max_step_tokens, shapes.max_model_len - 1)):
        if count < 2:
            continue
        for adapter in with_adapters:
            label = f"prefill {count}" + (" + LoRA" if adapter else "")
            steps.append(WarmupStep(label, (SyntheticSeq(1, count, adapter),), scores_prompt=True))
    if 2 * shapes.query_heads_per_kv_head <= 16:
        steps.append(WarmupStep("short query", (SyntheticSeq(1, 2, shapes.lora), SyntheticSeq(1, 1, False))))
    steps.append(profile_step(shapes))
    return steps


def profile_step(shapes: WarmupShapes) -> WarmupStep:
    """The step that needs the most activation memory: the token budget spread over as many sequences as may run,
    each with an adapter and each sampling a token (every logits row at once)."""
    tokens = min(shapes.max_step_tokens, shapes.max_num_seqs * shapes.max_model_len)
    n = max(1, min(shapes.max_num_seqs, tokens))
    sizes = [tokens // n + (i < tokens % n) for i in range(n)]
    return WarmupStep("profile", tuple(SyntheticSeq(0, size, shapes.lora) for size in sizes))


def warmup_sequences(
    step: WarmupStep, block_size: int, adapter_page: int, params: SamplingParams
) -> list[tuple[DraftPosition, int]]:
    """The runner's items of a warm-up step: each sequence its own KV blocks (pages 0, 1, ... of the warm-up
    arena), token id 1 throughout, ``adapter_page`` for those with an adapter; every sequence samples."""
    items, page = [], 0
    for i, seq in enumerate(step.seqs):
        length = seq.context + seq.new
        blocks = -(-length // block_size)
        table = list(range(page, page + blocks))
        page += blocks
        lora_page = adapter_page if seq.adapter else -1
        sequence = DraftPosition(f"warm-up {i}", [1] * length, length, seq.context, table, params, (), lora_page)
        items.append((sequence, seq.new))
    return items


def measure_peak(device: torch.device, run: Callable[[], object]) -> int:
    """The device memory ``run`` allocates at its peak beyond what was allocated before it (CUDA; 0 elsewhere)."""
    if device.type != "cuda":
        run()
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """What warm-up measured (CUDA; zeros elsewhere), in bytes."""

    activations: int  # the profile step's peak beyond the weights, buffers and the warm-up arena
    graphs: int  # the largest decode bucket's eager peak: what the decode graphs' shared pool will hold


def arena_bytes(total: int, free: int, share: float, profile: MemoryProfile) -> int:
    """The arena's size under --gpu-memory-utilization (vLLM's meaning: the share of the device's whole memory
    the engine may have in use once serving): share x total, less everything in use now (weights, buffers, the CUDA
    context, other processes: total - free), the profile step's activations and the decode graphs' pool."""
    return int(share * total) - (total - free) - profile.activations - profile.graphs
