"""Owns the device state of an engine: the model's weights, the KV cache tensors (device blocks and the host
tier) and the adapter slots. Executes the copy operations it is handed (the pool decides them), turns a step's
scheduled sequences into one ForwardBatch, runs the model and samples."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from adapters.peft_format import BaseShapes, LoraAdapter
from kernels.reference import FP8_KV_DTYPE
from kv_pool.tree import AdapterKey, CopyOp, OpKind
from lora_server.config import EngineConfig
from lora_server.model.arch import ModelArch
from lora_server.model.batch import DraftPosition, ForwardBatch, ScheduledSequence
from lora_server.model.kv_scales import calibrate_kv_scales
from lora_server.model.llama import LayerKV, LlamaModel, build_llama
from lora_server.model.loader import Checkpoint
from lora_server.model.lora import LoraBatch, LoraSlots
from lora_server.model.sampler import Sampler, SampleResult

S = TypeVar("S", bound=ScheduledSequence)  # the caller's own request type, handed back in sampling order


def kv_bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block: K and V of block_size tokens in every layer, in the cache's dtype (fp8: one byte a
    value; the per-head scales are fixed and held apart)."""
    return arch.num_layers * 2 * block_size * arch.num_kv_heads * arch.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_model_len: int) -> None:
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.kv_dtype = config.torch_kv_cache_dtype
        cuda = self.device.type == "cuda"
        if self.kv_dtype == FP8_KV_DTYPE and cuda and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ValueError(
                "--kv-cache-dtype fp8 needs compute capability 8.9 or newer (Ada, Hopper): Triton's float8e4nv"
            )
        self.arch = checkpoint.arch
        self.block_size = config.block_size
        with torch.no_grad():
            self.model: LlamaModel = build_llama(
                checkpoint,
                config.quantization,
                self.dtype,
                self.device,
                max_model_len,
                config.show_progress,
                config.cpu_head_copy,
            )
        arch = self.arch
        self.adapter_shapes = BaseShapes.llama(
            arch.num_layers, arch.hidden_size, arch.intermediate_size, arch.q_size, arch.kv_size
        )
        self.lora = LoraSlots(
            self.adapter_shapes, arch.num_layers, config.max_loras, config.max_lora_rank, self.device, self.dtype
        )
        self.lora.attach(self.model.lora_wrappers())
        # an fp8 cache's scales, fixed for the engine's life: [layers, 2 (k, v), kv_heads] float32; None otherwise
        self.kv_scales = (
            calibrate_kv_scales(self.model, arch, self.dtype, self.device, max_model_len)
            if self.kv_dtype == FP8_KV_DTYPE
            else None
        )
        self.num_blocks = config.num_kv_blocks or max(1, self._kv_budget_bytes() // self.kv_bytes_per_block)
        # [layers, 2 (k, v), blocks, block_size, kv_heads, head_dim]
        self.kv_cache = torch.zeros(
            self.arch.num_layers,
            2,
            self.num_blocks,
            self.block_size,
            self.arch.num_kv_heads,
            self.arch.head_dim,
            dtype=self.kv_dtype,
            device=self.device,
        )
        # The host tier, one contiguous block per index so that a block moves in one copy:
        # [host blocks, layers, 2, block_size, kv_heads, head_dim], pinned on CUDA
        self.num_host_blocks = config.host_kv_bytes // self.kv_bytes_per_block
        self.host_kv = torch.zeros(
            self.num_host_blocks,
            *self.kv_cache[:, :, 0].shape,
            dtype=self.kv_dtype,
            pin_memory=self.device.type == "cuda",
        )
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.sampler = Sampler(self.arch.vocab_size)

    def _kv_budget_bytes(self) -> int:
        """The pool's device budget: gpu_memory_utilization x the CUDA memory still free once the weights and the
        adapter slots are allocated, or kv_cache_bytes (always on the CPU)."""
        share = self.config.gpu_memory_utilization
        if share is None or self.device.type != "cuda":
            return self.config.kv_cache_bytes
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free * share)

    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.arch, self.block_size, self.kv_dtype)

    def _kv_caches(self) -> list[LayerKV]:
        if self.kv_scales is None:
            return [LayerKV(layer[0], layer[1]) for layer in self.kv_cache]
        return [
            LayerKV(layer[0], layer[1], *scales) for layer, scales in zip(self.kv_cache, self.kv_scales, strict=True)
        ]

    @torch.inference_mode()
    def measure_h2d_bandwidth(self) -> float:
        """Bytes per second of host-tier-to-device block copies, timed on up to 8 blocks (the pool's restore cost
        for swapped-out KV); 25 GB/s, the policy's default, when there is no host tier."""
        n = min(8, self.num_host_blocks, self.num_blocks)
        if n == 0:
            return 25e9
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for b in range(n):
                self.kv_cache[:, :, b].copy_(self.host_kv[b], non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            best = min(best, time.perf_counter() - start)
        return n * self.kv_bytes_per_block / max(best, 1e-9)

    @torch.inference_mode()
    def apply_copy_ops(self, ops: list[CopyOp], weights: Callable[[AdapterKey], LoraAdapter]) -> float:
        """Execute the pool's moves in order, before this step's forward pass: KV blocks between the device and
        the host tier, adapters into and out of the device slots (``weights``: an adapter version's host copy).
        On CUDA the copies run on a side stream that waits for the previous step's writes, and the next forward
        waits for them on the GPU: the host never blocks on a swap. Returns the seconds spent loading adapters
        (host clock)."""
        if not ops:
            return 0.0
        stream = self._copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        adapter_s = 0.0
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for op in ops:
                if op.kind is OpKind.KV_SWAP_OUT:
                    for src, dst in zip(op.src, op.dst, strict=True):
                        self.host_kv[dst].copy_(self.kv_cache[:, :, src], non_blocking=True)
                elif op.kind is OpKind.KV_SWAP_IN:
                    for src, dst in zip(op.src, op.dst, strict=True):
                        self.kv_cache[:, :, dst].copy_(self.host_kv[src], non_blocking=True)
                elif op.kind is OpKind.ADAPTER_LOAD:
                    assert op.adapter is not None
                    start = time.perf_counter()
                    self.lora.write(op.slot, weights(op.adapter))
                    adapter_s += time.perf_counter() - start
                else:
                    self.lora.clear(op.slot)
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        return adapter_s

    def prepare(self, items: Sequence[tuple[S, int]]) -> tuple[ForwardBatch, list[S]]:
        """Build the batch for (request, number of tokens to compute) pairs; also returns the requests that
        sample a token this step (those whose chunk reaches their last token), in logits-row order. A request
        with draft tokens computes them after its last token (n counts them) and gets a logits row for each of
        its 1 + d last positions. Requests are ordered by adapter slot (stable), so that each adapter's tokens
        are one segment."""
        items = sorted(items, key=lambda item: item[0].lora_slot)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        logits_rows: list[int] = []
        sampling: list[S] = []
        bs = self.block_size
        for request, n in items:
            drafts = request.draft_token_ids
            tokens = request.token_ids + drafts if drafts else request.token_ids
            start = request.num_computed_tokens
            end = start + n
            assert not drafts or end == len(tokens), "draft tokens are scheduled with the request's last token"
            input_ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            table = request.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            starts.append(starts[-1] + n)
            if end == len(tokens):
                logits_rows.extend(range(starts[-1] - 1 - len(drafts), starts[-1]))
                sampling.append(request)
        max_blocks = max(len(r.block_table) for r, _ in items)
        tables = [r.block_table + [0] * (max_blocks - len(r.block_table)) for r, _ in items]

        def dev(data: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

        batch = ForwardBatch(
            lora=self._lora_batch(items),
            max_query_len=max(n for _, n in items),
            input_ids=dev(input_ids, torch.long),
            positions=dev(positions, torch.long),
            slot_mapping=dev(slots, torch.long),
            block_tables=dev(tables, torch.int32),
            seq_lens=dev(seq_lens, torch.int32),
            query_start_loc=dev(starts, torch.int32),
            logits_indices=dev(logits_rows, torch.long),
        )
        return batch, sampling

    def _lora_batch(self, items: Sequence[tuple[ScheduledSequence, int]]) -> LoraBatch | None:
        """Segments of consecutive tokens that share an adapter slot (each request's tokens are contiguous);
        decode-only steps also get the per-token form (BGMV)."""
        if all(r.lora_slot < 0 for r, _ in items):
            return None
        seg_starts, seg_slots = [0], list[int]()
        for request, n in items:
            if seg_slots and seg_slots[-1] == request.lora_slot:
                seg_starts[-1] += n
            else:
                seg_slots.append(request.lora_slot)
                seg_starts.append(seg_starts[-1] + n)
        decode_only = all(n == 1 for _, n in items)
        slot_ids = [r.lora_slot for r, _ in items] if decode_only else None
        rank_of = self.lora.rank_of
        host_segments = [
            (start, end, slot, rank_of[slot])
            for start, end, slot in zip(seg_starts, seg_starts[1:], seg_slots, strict=False)
            if slot >= 0
        ]

        def dev(data: list[int]) -> torch.Tensor:
            return torch.tensor(data, dtype=torch.int32).to(self.device, non_blocking=True)

        return LoraBatch(dev(seg_starts), dev(seg_slots), None if slot_ids is None else dev(slot_ids), host_segments)

    @torch.inference_mode()
    def execute(
        self,
        items: Sequence[tuple[S, int]],
        mask: Callable[[torch.Tensor, Sequence[ScheduledSequence]], None] | None = None,
    ) -> tuple[list[S], SampleResult | None]:
        """Run one step; returns the requests that sampled and their tokens (None when nobody sampled). ``mask``
        (structured output) gets the [R, vocab] logits and their rows' sequences once the forward pass is queued
        (on a GPU its host work overlaps the device's) and forbids tokens in place. The result has
        one row per verified position: 1 + d consecutive rows for a request with d draft tokens (row
        j sampled as if drafts[:j] were accepted; see verify_drafts), one row for the others."""
        batch, sampling = self.prepare(items)
        hidden = self.model(batch, self._kv_caches())
        if not sampling:
            return sampling, None
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        rows: list[ScheduledSequence] = []
        for request in sampling:
            drafts = request.draft_token_ids
            rows.extend([request, *(DraftPosition.of(request, j) for j in range(1, len(drafts) + 1))])
        return sampling, self.sampler(logits, rows, None if mask is None else lambda logits_: mask(logits_, rows))
