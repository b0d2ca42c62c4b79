"""Owns the device state of an engine: the model's weights and the KV cache tensors. Turns a step's scheduled
work into one ForwardBatch, runs the model and samples."""

from __future__ import annotations

from pathlib import Path

import torch

from kernels import lora_ops
from lora_server.config import EngineConfig
from lora_server.forward_batch import ForwardBatch
from lora_server.llama import LlamaModel, build_llama
from lora_server.loader import Checkpoint
from lora_server.lora import LoraBatch, LoraManager
from lora_server.request import Request
from lora_server.sampler import Sampler, SampleResult


class ModelRunner:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_model_len: int) -> None:
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.arch = checkpoint.arch
        self.block_size = config.block_size
        with torch.no_grad():
            self.model: LlamaModel = build_llama(checkpoint, config.quantization, self.dtype, self.device,
                                                 max_model_len, config.show_progress)
        self.num_blocks = config.num_kv_blocks or max(1, config.kv_cache_bytes // self.kv_bytes_per_block)
        # [layers, 2 (k, v), blocks, block_size, kv_heads, head_dim]
        self.kv_cache = torch.zeros(self.arch.num_layers, 2, self.num_blocks, self.block_size,
                                    self.arch.num_kv_heads, self.arch.head_dim, dtype=self.dtype, device=self.device)
        self.sampler = Sampler(self.arch.vocab_size)
        roots = None if config.adapter_roots is None else [Path(r) for r in config.adapter_roots]
        self.lora = LoraManager(self.arch, config.max_loras, config.max_lora_rank, self.device, self.dtype, roots)
        self.lora.attach(self.model.lora_wrappers())

    @property
    def kv_bytes_per_block(self) -> int:
        a = self.arch
        return a.num_layers * 2 * self.block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize

    def _kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer[0], layer[1]) for layer in self.kv_cache]

    def prepare(self, items: list[tuple[Request, int]]) -> tuple[ForwardBatch, list[Request]]:
        """Build the batch for (request, number of tokens to compute) pairs; also returns the requests that
        sample a token this step (those whose chunk reaches their last token), in logits-row order."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        logits_rows: list[int] = []
        sampling: list[Request] = []
        bs = self.block_size
        for request, n in items:
            start = request.num_computed_tokens
            end = start + n
            input_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            table = request.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            starts.append(starts[-1] + n)
            if end == request.num_tokens:
                logits_rows.append(starts[-1] - 1)
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

    def _lora_batch(self, items: list[tuple[Request, int]]) -> LoraBatch | None:
        """Segments of consecutive tokens that share an adapter slot (each request's tokens are contiguous);
        decode-only steps on the GPU also get the per-token form for the BGMV kernels."""
        if all(r.lora_slot < 0 for r, _ in items):
            return None
        seg_starts, seg_slots = [0], []
        for request, n in items:
            if seg_slots and seg_slots[-1] == request.lora_slot:
                seg_starts[-1] += n
            else:
                seg_slots.append(request.lora_slot)
                seg_starts.append(seg_starts[-1] + n)
        triton = lora_ops.use_triton(self.device, interpret=False)  # Triton on CUDA, the torch twin on the CPU
        decode_only = all(n == 1 for _, n in items)
        slot_ids = [r.lora_slot for r, _ in items] if triton and decode_only else None

        def dev(data: list[int]) -> torch.Tensor:
            return torch.tensor(data, dtype=torch.int32).to(self.device, non_blocking=True)

        return LoraBatch(dev(seg_starts), dev(seg_slots), None if slot_ids is None else dev(slot_ids), triton)

    @torch.inference_mode()
    def execute(self, items: list[tuple[Request, int]]) -> tuple[list[Request], SampleResult | None]:
        """Run one step; returns the requests that sampled and their tokens (None when nobody sampled)."""
        batch, sampling = self.prepare(items)
        hidden = self.model(batch, self._kv_caches())
        if not sampling:
            return sampling, None
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        return sampling, self.sampler(logits, sampling)
