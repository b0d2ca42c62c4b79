"""Owns the device state of an engine: the model's weights, the KV cache tensors (device blocks and the host
tier), the adapter slots, the step's persistent input buffers and the decode CUDA graphs. Executes the copy
operations it is handed (the pool decides them), turns a step's scheduled sequences into one ForwardBatch (its
inputs reach the device in one copy from pinned memory), runs the model (a decode step replays its bucket's graph
on CUDA) and samples."""

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
from lora_server.model.cuda_graphs import DecodeGraphs, bucket_for, decode_buckets
from lora_server.model.kv_scales import calibrate_kv_scales
from lora_server.model.llama import LayerKV, LlamaModel, build_llama
from lora_server.model.loader import Checkpoint
from lora_server.model.lora import LoraBatch, LoraSlots
from lora_server.model.sampler import Sampler, SampleResult
from lora_server.model.step_inputs import BlockTables, HostArrays, StepInputs

S = TypeVar("S", bound=ScheduledSequence)  # the caller's own request type, handed back in sampling order
HostSegment = tuple[int, int, int, int]  # (start, end, slot, rank): see LoraBatch.host_segments


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
        self._init_step(max_model_len)

    def _init_step(self, max_model_len: int) -> None:
        """The step's persistent buffers, the decode buckets and, on CUDA unless --enforce-eager, the decode
        graphs (captured now that the KV cache and the adapter slots exist: graphs read them where they are).

        Decode steps are padded to their bucket wherever the CUDA code path runs (CUDA, or the meta device that
        stands for it in bench-engine --host-work); on the CPU they are not (padding is pure cost there), unless a
        test sets ``decode_buckets``. ``graph_layout``: padded steps take the layout a graph reads (the block
        tables at full width, the LoRA mapping even when no row has an adapter)."""
        config = self.config
        max_seqs = config.max_num_seqs
        width = -(-max_model_len // self.block_size)  # the most blocks a sequence holds
        max_tokens = max(config.max_num_batched_tokens, max_seqs)
        if not config.enable_chunked_prefill:
            max_tokens = max(max_tokens, max_model_len)  # a whole prompt in one step
        self.block_tables = BlockTables(max_seqs, width, self.device)
        # per token: ids, positions, slots, logits rows (int64), LoRA slot (int32); per sequence: five int32 arrays;
        # block table updates (int64 index, int32 value): at most every entry of every row in one step
        capacity = max_tokens * 36 + (max_seqs + 2) * 20 + max_seqs * width * 12 + 16 * 8
        self.step_inputs = StepInputs(self.device, capacity)
        eager = config.enforce_eager or self.device.type == "cpu"
        self.decode_buckets: list[int] = [] if eager else decode_buckets(max_seqs)
        self.graph_layout = self.device.type == "cuda" and not eager
        self.graphs: DecodeGraphs | None = None
        if self.graph_layout:
            self.graphs = self._capture_decode_graphs()

    @torch.inference_mode()
    def _capture_decode_graphs(self) -> DecodeGraphs:
        """One graph per decode bucket, captured on a batch of padding rows only (no KV is written)."""
        graphs = DecodeGraphs()
        for bucket in reversed(self.decode_buckets):
            batch, _ = self._build([], bucket)
            graphs.capture(batch, self._eager_forward)
        return graphs

    def _eager_forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch, self._kv_caches())

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
        are one segment. A step of one token per sequence is padded to its decode bucket (see _init_step)."""
        items = sorted(items, key=lambda item: item[0].lora_slot)
        bucket = None
        if self.decode_buckets and all(n == 1 and not r.draft_token_ids for r, n in items):
            bucket = bucket_for(len(items), self.decode_buckets)
        return self._build(items, bucket)

    def _build(self, items: Sequence[tuple[S, int]], bucket: int | None) -> tuple[ForwardBatch, list[S]]:
        """prepare's batch of ``items`` (already in slot order), padded to ``bucket`` sequences when given: the
        step's integer arrays go to the device in one copy (StepInputs), the block tables are updated and
        gathered on the device (BlockTables)."""
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
        padding = 0 if bucket is None else bucket - len(items)
        if padding:  # one token each, writing no KV (slot -1), attending to nothing (length 0)
            input_ids.extend([0] * padding)
            positions.extend([0] * padding)
            slots.extend([-1] * padding)
            seq_lens.extend([0] * padding)
            starts.extend(range(starts[-1] + 1, starts[-1] + 1 + padding))
        graph_layout = bucket is not None and self.graph_layout
        plan = self.block_tables.plan(
            [r.request_id for r, _ in items],
            [r.block_table for r, _ in items],
            padding,
            self.block_tables.width if graph_layout else None,
        )
        lora = self._lora_batch(items, padding, always=graph_layout)
        lora_arrays, host_segments = lora if lora is not None else ({}, [])
        # Arrays whose length is fixed by the bucket come first, so that a padded decode step finds every array a
        # graph reads at the offsets it was captured with (the LoRA arrays put their per-token ones first)
        arrays: HostArrays = {
            "input_ids": (input_ids, torch.int64),
            "positions": (positions, torch.int64),
            "slot_mapping": (slots, torch.int64),
            "seq_lens": (seq_lens, torch.int32),
            "query_start_loc": (starts, torch.int32),
            "table_rows": (plan.rows, torch.int32),
            **{f"lora.{name}": (values, torch.int32) for name, values in lora_arrays.items()},
            "logits_indices": (logits_rows, torch.int64),
            "table_update_index": (plan.update_index, torch.int64),
            "table_update_value": (plan.update_value, torch.int32),
        }
        dev = self.step_inputs.upload(arrays)
        block_tables = self.block_tables.apply(
            plan, dev["table_rows"], dev["table_update_index"], dev["table_update_value"]
        )
        lora_batch = None
        if lora is not None:
            fields: dict[str, torch.Tensor | None] = {name: dev[f"lora.{name}"] for name in lora_arrays}
            fields.setdefault("slot_ids", None)
            lora_batch = LoraBatch(**fields, host_segments=host_segments)  # type: ignore[arg-type]
        batch = ForwardBatch(
            lora=lora_batch,
            max_query_len=max((n for _, n in items), default=1),
            input_ids=dev["input_ids"],
            positions=dev["positions"],
            slot_mapping=dev["slot_mapping"],
            block_tables=block_tables,
            seq_lens=dev["seq_lens"],
            query_start_loc=dev["query_start_loc"],
            logits_indices=dev["logits_indices"],
            num_padding=padding,
        )
        return batch, sampling

    def _lora_batch(
        self, items: Sequence[tuple[ScheduledSequence, int]], padding: int = 0, always: bool = False
    ) -> tuple[dict[str, list[int]], list[HostSegment]] | None:
        """Segments of consecutive tokens that share an adapter slot (each request's tokens are contiguous);
        decode-only steps also get the per-token form (BGMV). Returns the int32 arrays, named as LoraBatch's
        fields (per-token ones first), and the host segments; None when no token has an adapter, unless
        ``always``. ``padding`` rows at the end have no adapter."""
        if not always and all(r.lora_slot < 0 for r, _ in items):
            return None
        seg_starts, seg_slots = [0], list[int]()
        for slot, n in [*((r.lora_slot, n) for r, n in items), *([(-1, padding)] if padding else [])]:
            if seg_slots and seg_slots[-1] == slot:
                seg_starts[-1] += n
            else:
                seg_slots.append(slot)
                seg_starts.append(seg_starts[-1] + n)
        arrays: dict[str, list[int]] = {}
        if all(n == 1 for _, n in items):
            arrays["slot_ids"] = [r.lora_slot for r, _ in items] + [-1] * padding
        arrays["seg_starts"], arrays["seg_slots"] = seg_starts, seg_slots
        rank_of = self.lora.rank_of
        host_segments = [
            (start, end, slot, rank_of[slot])
            for start, end, slot in zip(seg_starts, seg_starts[1:], seg_slots, strict=False)
            if slot >= 0
        ]
        return arrays, host_segments

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
        hidden = self.graphs.replay(batch) if self.graphs is not None else None
        if hidden is None:
            hidden = self._eager_forward(batch)
        if not sampling:
            return sampling, None
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        rows: list[ScheduledSequence] = []
        for request in sampling:
            drafts = request.draft_token_ids
            rows.extend([request, *(DraftPosition.of(request, j) for j in range(1, len(drafts) + 1))])
        return sampling, self.sampler(logits, rows, None if mask is None else lambda logits_: mask(logits_, rows))
