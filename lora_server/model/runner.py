"""Owns the device state of an engine: the model's weights, the KV cache tensors (device blocks and the host
tier), the adapter slots, the step's persistent input buffers and the decode CUDA graphs. Executes the copy
operations it is handed (the pool decides them), turns a step's scheduled sequences into one ForwardBatch (its
inputs reach the device in one copy from pinned memory), runs the model (a decode step replays its bucket's graph
on CUDA) and samples."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from lora_server.adapters.page_layout import PageLayout
from lora_server.adapters.peft_format import AdapterError
from lora_server.config import EngineConfig
from lora_server.kernels import ops
from lora_server.kernels.lora_table import MODULES, max_tiles, tile_map
from lora_server.kernels.reference import FP8_KV_DTYPE
from lora_server.kv_pool.tree import AdapterKey, CopyOp, OpKind
from lora_server.model.arena import AdapterForm, Arena, adapter_shapes, attach_arena, page_geometry
from lora_server.model.batch import DraftPosition, ForwardBatch, PromptScoring, ScheduledSequence
from lora_server.model.copy_order import CopyOrder, CudaStreams
from lora_server.model.cuda_graphs import DecodeGraphs, bucket_for, decode_buckets
from lora_server.model.kv_scales import calibrate_kv_scales
from lora_server.model.llama import LayerKV, LlamaModel, build_llama
from lora_server.model.lora import BaseRowNorms, LoraBatch, workspace_shape
from lora_server.model.pinned import pinned_zeros
from lora_server.model.ranks import Ranks, StagedImage
from lora_server.model.sampler import Sampler, SampleResult, TokenScores, score_tokens, scoring_rows
from lora_server.model.step_inputs import BlockTables, StepArrays, StepInputs
from lora_server.model.warmup import MemoryProfile, WarmupShapes, arena_bytes, measure_peak, warmup_sequences
from lora_server.model.warmup import plan as warmup_plan
from lora_server.sampling_params import SamplingParams

S = TypeVar("S", bound=ScheduledSequence)  # the caller's own request type, handed back in sampling order
DECODE_BLOCK_T, PREFILL_BLOCK_T = 16, 64  # token rows per LoRA tile: a decode step's few rows per adapter, a chunk's


COPY_PROBE_BYTES = 64 << 20  # measure_copy_costs copies at least this much (beyond the CPU's caches)


@dataclass(frozen=True, slots=True)
class CopyCosts:
    """The pool's copies as measured on the device at start (ModelRunner.measure_copy_costs)."""

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    latency_s: float  # one copy's fixed cost, beside its bytes
    stalls_compute: bool  # copies take their time from the forward passes (off CUDA)


class ModelRunner:
    """Start-up, in order (``startup_s`` keeps each phase's seconds): the weights; the step's persistent buffers;
    where the Triton kernels run, warm-up (model.warmup: every kernel variant the engine's steps can reach is
    compiled, on a small arena of its own, and the largest step's memory is measured); the arena, sized from the
    memory really left; the decode CUDA graphs, captured on it."""

    def __init__(self, config: EngineConfig, ranks: Ranks, max_model_len: int) -> None:
        """``ranks``: model.ranks.SingleRank (the whole model here), or with --tensor-parallel-size above 1 this
        process's rank 0 (distributed.tensor_parallel.TensorParallel: the runner builds rank 0's shard from it and
        starts the workers once its arena is sized)."""
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.kv_dtype = config.torch_kv_cache_dtype
        cuda = self.device.type == "cuda"
        if self.kv_dtype == FP8_KV_DTYPE and cuda and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ValueError(
                "--kv-cache-dtype fp8 needs compute capability 8.9 or newer (Ada, Hopper): Triton's float8e4nv"
            )
        self.block_size = config.block_size
        self.startup_s: dict[str, float] = {}
        start = time.perf_counter()
        self.ranks = ranks
        checkpoint = ranks.checkpoint
        self.arch = checkpoint.arch  # with tensor parallelism, the rank's share of the heads and the MLP
        with torch.no_grad():
            self.model: LlamaModel = build_llama(
                checkpoint,
                config.quantization,
                self.dtype,
                self.device,
                max_model_len,
                config.show_progress,
                config.cpu_head_copy,
                exact_kv=self.kv_dtype != FP8_KV_DTYPE,
            )
            ranks.parallelize(self.model)
        self.weight_bytes = sum(t.nbytes for t in (*self.model.parameters(), *self.model.buffers()))
        arch = self.arch
        # what adapters are validated against (the whole model's modules); their pages hold this rank's share
        self.adapter_shapes = adapter_shapes(ranks.arch)
        self.geometry = page_geometry(arch, self.block_size, self.kv_dtype, self.dtype, config.max_lora_rank)
        # what staging a DoRA adapter reads of the base weights (on the adapter loader's thread)
        self.base_row_norms = BaseRowNorms(self.model.lora_wrappers(), self.dtype, self.device)
        # an fp8 cache's scales, fixed for the engine's life: [layers, 2 (k, v), kv_heads] float32; None otherwise
        self.kv_scales = (
            calibrate_kv_scales(self.model, arch, self.dtype, self.device, max_model_len)
            if self.kv_dtype == FP8_KV_DTYPE
            else None
        )
        # The host tier, one page per index, so that a block moves in one copy: [host blocks, page bytes], pinned
        # on CUDA (to its size)
        self.num_host_blocks = config.host_kv_bytes // self.geometry.page_bytes
        self.host_kv = pinned_zeros((self.num_host_blocks, self.geometry.page_bytes), torch.uint8, self.device)
        self.copy_order = CopyOrder(CudaStreams(self.device) if cuda else None)
        self.sampler = Sampler(self.arch.vocab_size)
        # where a list: every prompt-scoring slice's whole log-softmax rows [m, vocab] float32 on the CPU, appended
        # in order (EngineCore.full_prompt_logprobs)
        self.kept_scores: list[torch.Tensor] | None = None
        self._init_step(max_model_len)
        self.startup_s["weights"] = time.perf_counter() - start
        self.memory = MemoryProfile(0, 0)
        self.graphs: DecodeGraphs | None = None
        if ops.use_kernels(self.device):
            start = time.perf_counter()
            self.memory = self._warm_up(max_model_len)
            self.startup_s["warm-up"] = time.perf_counter() - start
        self.num_blocks = config.num_kv_blocks or max(1, self._arena_bytes() // self.geometry.page_bytes)
        self._use_arena(Arena(self.num_blocks, arch, self.block_size, self.kv_dtype, self.dtype, self.device))
        ranks.start(self.num_blocks, self.num_host_blocks, self.block_tables.width, self.max_step_tokens)
        if self.graph_layout:
            start = time.perf_counter()
            self.graphs = self._capture_decode_graphs()
            self.startup_s["graphs"] = time.perf_counter() - start

    def _init_step(self, max_model_len: int) -> None:
        """The step's persistent buffers, the LoRA kernels' workspace and the decode buckets.

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
        self.max_step_tokens = max_tokens
        self.block_tables = BlockTables(max_seqs, width, self.device)
        self.max_tiles = max_tiles(max_tokens, DECODE_BLOCK_T, config.max_loras)
        # per token: ids, positions, slots, logits rows, scored prompt rows and their targets (int64); per sequence:
        # five int32 arrays; block table updates (int64 index, int32 value): at most every entry of every row in
        # one step; the LoRA tile map; and up to 15 bytes of alignment after each of the 12 arrays
        capacity = max_tokens * 48 + (max_seqs + 2) * 20 + max_seqs * width * 12 + self.max_tiles * 12 + 16 * 16
        self.step_inputs = StepInputs(self.device, capacity)
        self.lora_y = None  # the LoRA kernels' persistent float32 partial sums, where they run
        if ops.use_kernels(self.device):
            shape = workspace_shape(max_tokens, config.max_lora_rank)
            self.lora_y = torch.empty(shape, dtype=torch.float32, device=self.device)
        # a mixture of experts routes on the host (model.moe: which experts a step's tokens took), which a CUDA
        # graph cannot capture: its steps run eagerly
        eager = config.enforce_eager or self.device.type == "cpu" or self.arch.num_experts > 0
        self.decode_buckets: list[int] = [] if eager else decode_buckets(max_seqs)
        self.graph_layout = self.device.type == "cuda" and not eager

    def _use_arena(self, arena: Arena) -> None:
        """Serve from ``arena``: the adapters in it (none yet), and every LoRA wrapper pointed at it."""
        self.arena = arena
        self.adapters = attach_arena(self.model, arena, self.geometry, self.lora_y)

    @torch.inference_mode()
    def _warm_up(self, max_model_len: int) -> MemoryProfile:
        """Run every step of model.warmup's plan on a small arena of its own (one adapter of the largest rank on
        every module, zeros), so that every kernel variant is compiled now; measure the profile step's and the
        largest decode bucket's peak memory (CUDA)."""
        try:
            modules = {(i, m): self.config.max_lora_rank for i in range(self.arch.num_layers) for m in MODULES}
            layout: PageLayout | None = PageLayout(self.geometry, modules)
        except AdapterError:  # a model that cannot serve adapters: its steps never run the LoRA kernels
            layout = None
        shapes = WarmupShapes(
            self.config.max_num_seqs,
            self.max_step_tokens,
            max_model_len,
            self.arch.num_heads // self.arch.num_kv_heads,
            tuple(self.decode_buckets),
            lora=layout is not None,
        )
        steps = warmup_plan(shapes)
        kv_pages = max(step.blocks(self.block_size) for step in steps)
        adapter_pages = list(range(kv_pages, kv_pages + (layout.num_pages if layout else 0)))
        arch, bs = self.arch, self.block_size
        self._use_arena(Arena(kv_pages + len(adapter_pages), arch, bs, self.kv_dtype, self.dtype, self.device))
        if layout is not None:
            image = torch.zeros(layout.num_pages, self.geometry.page_bytes, dtype=torch.uint8)
            self.adapters.load(adapter_pages, layout, image)
        params = SamplingParams(max_tokens=1)
        peaks: dict[str, int] = {}
        for step in steps:
            items = warmup_sequences(step, bs, adapter_pages[0] if adapter_pages else -1, params)
            head_rows = min(step.num_tokens, scoring_rows(self.arch.vocab_size)) if step.scores_prompt else 0
            run = functools.partial(self._forward_and_logits, items, head_rows)
            peaks[step.label] = measure_peak(self.device, run)
        self.block_tables = BlockTables(self.config.max_num_seqs, self.block_tables.width, self.device)
        largest = f"decode x{max(self.decode_buckets)}" if self.decode_buckets else None
        graphs = max((peaks.get(f"{largest}{lora}", 0) for lora in ("", " + LoRA")), default=0) if largest else 0
        profile = MemoryProfile(peaks["profile"], graphs)
        for layer in self.model.lora_wrappers():  # nothing holds the warm-up arena any more: its memory goes back
            for wrapper in layer.values():
                wrapper.detach()
        del self.arena, self.adapters
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return profile

    def _forward_and_logits(self, items: Sequence[tuple[ScheduledSequence, int]], head_rows: int) -> None:
        """A step's forward pass and logits, and the head over its first ``head_rows`` hidden rows (the slices
        prompt scoring sends through it), without sampling: nothing is read back (the meta stand-in runs it)."""
        batch, _ = self.prepare(items)
        hidden = self._eager_forward(batch)
        self.model.compute_logits(hidden[batch.logits_indices])
        if head_rows:
            self.model.compute_logits(hidden[:head_rows])

    @property
    def workspace_bytes(self) -> int:
        """Device bytes beside the weights and the arena held for good: the LoRA workspace, the step's buffers, the
        block tables."""
        held = [self.block_tables.store, self.block_tables.gathered]
        y = 0 if self.lora_y is None else self.lora_y.nbytes
        return y + sum(t.nbytes for t in held) + self.step_inputs.capacity_bytes

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

    @property
    def adapter_form(self) -> AdapterForm:
        """How this runner takes adapters: validated against the whole model, laid out in its pages; with tensor
        parallelism, each rank's share, and the forms it does not serve refused."""
        return self.ranks.adapter_form(self.adapter_shapes, self.geometry)

    def check_ranks(self) -> None:
        """With tensor parallelism, every rank's arena holds the adapters this one holds, in the same pages, and its
        block tables are this one's (AssertionError naming the rank that differs); nothing to check otherwise."""
        self.ranks.check_integrity(self.adapters, self.block_tables.store)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine's device state is otherwise freed with it)."""
        self.ranks.close()

    def _arena_bytes(self) -> int:
        """The arena's size: on CUDA with --gpu-memory-utilization, what model.warmup.arena_bytes leaves (a
        ValueError when that is not one page); else kv_cache_bytes."""
        share = self.config.gpu_memory_utilization
        if share is None or self.device.type != "cuda":
            return self.config.kv_cache_bytes
        free, total = torch.cuda.mem_get_info(self.device)
        size = arena_bytes(total, free, share, self.memory)
        if size < self.geometry.page_bytes:
            gib = 2**30
            raise ValueError(
                f"--gpu-memory-utilization {share} leaves no room for the arena: {share * total / gib:.2f} GiB of the "
                f"device's {total / gib:.2f} GiB, of which {(total - free) / gib:.2f} GiB are in use (weights, "
                f"buffers, CUDA context, other processes), {self.memory.activations / gib:.2f} GiB go to the largest "
                f"step's activations and {self.memory.graphs / gib:.2f} GiB to the decode graphs: raise the share, "
                "or lower --max-num-batched-tokens / --max-num-seqs"
            )
        return size

    @property
    def kv_bytes_per_block(self) -> int:
        return self.geometry.page_bytes

    def _kv_caches(self) -> list[LayerKV]:
        layers = [self.arena.layer_kv(i) for i in range(self.arch.num_layers)]
        if self.kv_scales is None:
            return [LayerKV(k, v) for k, v in layers]
        return [LayerKV(k, v, *scales) for (k, v), scales in zip(layers, self.kv_scales, strict=True)]

    @torch.inference_mode()
    def measure_copy_costs(self) -> CopyCosts:
        """What the pool's copies cost on this device, timed as apply_copy_ops makes them: one copy per block, on
        at least 8 blocks and 64 MiB where the tiers hold them (more than a CPU's caches), best of 3. Returns the
        bandwidth each way and the fixed cost of one copy (a 1-value copy). On the CPU copies run on the cores that
        compute (they stall it); on CUDA on side streams. Without a host tier, a PCIe 4 GPU's defaults."""
        n = min(max(8, -(-COPY_PROBE_BYTES // self.kv_bytes_per_block)), self.num_host_blocks, self.num_blocks)
        stalls = self.device.type == "cpu"  # CUDA (and its meta stand-in): side streams
        if n == 0:
            return CopyCosts(25e9, 25e9, 0.0, stalls)
        pages, host = self.arena.pages, self.host_kv

        def best(copy: Callable[[int], object], count: int) -> float:
            fastest = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for b in range(count):
                    copy(b)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                fastest = min(fastest, time.perf_counter() - start)
            return fastest

        latency = best(lambda b: pages[b][:1].copy_(host[b][:1], non_blocking=True), n) / n
        h2d = best(lambda b: pages[b].copy_(host[b], non_blocking=True), n) / n
        d2h = best(lambda b: host[b].copy_(pages[b], non_blocking=True), n) / n
        payload = self.kv_bytes_per_block

        def rate(seconds: float) -> float:
            return payload / max(seconds - latency, seconds / 2, 1e-9)

        return CopyCosts(rate(h2d), rate(d2h), latency, stalls)

    @torch.inference_mode()
    def apply_copy_ops(self, ops: list[CopyOp], images: Mapping[AdapterKey, StagedImage] | None = None) -> float:
        """Execute the pool's moves in order, before this step's forward pass: KV pages between the device and the
        host tier, adapters into and out of the arena (``images``: the staged layout and pinned image of each
        adapter an op loads).
        On CUDA the copies run on side streams, ordered by the pages they touch (model.copy_order): the next
        forward pass waits for the KV copies on the device, not for adapter loads (the scheduler holds back the
        requests of an adapter until ``adapter_loaded`` says its copy ran); the host never blocks on a copy.
        Returns the seconds spent issuing adapter loads (host clock)."""
        self.ranks.check_alive()  # the engine's idle loop comes here too: a dead rank stops it
        self.ranks.mirror_copy_ops(ops, images)
        if not ops:
            return 0.0
        order = self.copy_order
        order.begin()
        adapter_s = 0.0
        pages, host = self.arena.pages, self.host_kv
        for op in ops:
            if op.kind is OpKind.KV_SWAP_OUT:
                with order.kv_copy(op.src, (), "kv swap-out"):
                    for src, dst in zip(op.src, op.dst, strict=True):
                        host[dst].copy_(pages[src], non_blocking=True)
            elif op.kind is OpKind.KV_SWAP_IN:
                with order.kv_copy((), op.dst, "kv swap-in"):
                    for src, dst in zip(op.src, op.dst, strict=True):
                        pages[dst].copy_(host[src], non_blocking=True)
            elif op.kind is OpKind.ADAPTER_LOAD:
                assert op.adapter is not None
                start = time.perf_counter()
                assert images is not None and op.adapter in images, f"no staged image for {op.adapter}"
                image = images[op.adapter]
                with order.adapter_load(list(op.dst), image.image):
                    ids = None if image.vocab is None else image.vocab.token_ids
                    self.adapters.load(list(op.dst), image.layout, image.image, ids)
                adapter_s += time.perf_counter() - start
            else:
                self.adapters.unload(op.src[0])
                order.adapter_unload(op.src[0])
        order.end()
        return adapter_s

    def adapter_loaded(self, table_page: int) -> bool:
        """Whether the copy of the adapter whose table is on ``table_page`` has run (always, off CUDA): a query of
        its event, no sync."""
        return self.copy_order.loaded(table_page)

    def prepare(self, items: Sequence[tuple[S, int]]) -> tuple[ForwardBatch, list[S]]:
        """Build the batch for (request, number of tokens to compute) pairs; also returns the requests that
        sample a token this step (those whose chunk reaches their last token), in logits-row order. A request
        with draft tokens computes them after its last token (n counts them) and gets a logits row for each of
        its 1 + d last positions. Requests are ordered by adapter slot (stable), so that each adapter's tokens
        are one segment. A step of one token per sequence is padded to its decode bucket (see _init_step)."""
        items = sorted(items, key=lambda item: item[0].lora_page)
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
        scored_rows: list[int] = []  # prompt logprobs: hidden rows that score the next prompt token
        scored_targets: list[int] = []
        owners: list[tuple[str, int, int, int]] = []
        logits_segments: list[tuple[int, int, int]] = []  # adapters' logits rows (compute_logits' segments)
        scored_segments: list[tuple[int, int, int]] = []  # adapters' scored prompt rows
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
            first_row = starts[-1] - start  # the row of position 0, were it in this step
            starts.append(starts[-1] + n)
            params = request.params
            if params.prompt_logprobs is not None:  # position p scores prompt token p + 1, each once
                num_prompt = request.num_tokens - request.num_output_tokens
                scored = range(max(start, request.num_prompt_logprobs), min(end, num_prompt - 1))
                if scored:
                    if request.lora_page >= 0:
                        first = len(scored_rows)
                        scored_segments.append((first, first + len(scored), request.lora_page))
                    scored_rows.extend(first_row + p for p in scored)
                    scored_targets.extend(tokens[scored.start + 1 : scored.stop + 1])
                    owners.append((request.request_id, params.prompt_logprobs, scored.start + 1, len(scored)))
            if end == len(tokens) and not params.scores_prompt:
                if request.lora_page >= 0:
                    first = len(logits_rows)
                    logits_segments.append((first, first + 1 + len(drafts), request.lora_page))
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
        segments, tiles, block_t = self._lora_mapping(items, bucket if graph_layout else None)
        max_query_len = max((n for _, n in items), default=1)
        arrays: StepArrays[Sequence[int]] = StepArrays(  # (not StepArrays[...](): frozen slots refuse __orig_class__)
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slots,
            seq_lens=seq_lens,
            query_start_loc=starts,
            table_rows=plan.rows,
            lora_tiles=tiles or [],
            logits_indices=logits_rows,
            table_update_index=plan.update_index,
            table_update_value=plan.update_value,
            scored_rows=scored_rows,
            scored_targets=scored_targets,
        )
        self.ranks.send_step(arrays, max_query_len, padding, plan.width, segments)
        dev = self.step_inputs.upload_step(arrays)
        block_tables = self.block_tables.apply(plan, dev.table_rows, dev.table_update_index, dev.table_update_value)
        lora_batch = None
        if segments or graph_layout:
            lora_tiles = dev.lora_tiles.view(-1, 3) if tiles is not None else None
            lora_batch = LoraBatch(segments, lora_tiles, block_t)
        batch = ForwardBatch.of_arrays(
            dev,
            block_tables,
            lora=lora_batch,
            max_query_len=max_query_len,
            num_padding=padding,
            prompt_scoring=(
                PromptScoring(dev.scored_rows, dev.scored_targets, owners, scored_segments) if owners else None
            ),
            logits_segments=logits_segments,
        )
        return batch, sampling

    def _lora_mapping(
        self, items: Sequence[tuple[ScheduledSequence, int]], bucket: int | None
    ) -> tuple[list[tuple[int, int, int]], list[int] | None, int]:
        """The step's runs of tokens that share an adapter, (start, end, table page), each request's tokens being
        contiguous and the requests in page order; where the kernels run, their tile map (flattened; with a
        ``bucket``, padded to the bucket's fixed tile count, what a graph reads); and its rows per tile."""
        segments: list[tuple[int, int, int]] = []
        row = 0
        for request, n in items:
            page = request.lora_page
            if page >= 0 and segments and segments[-1][2] == page and segments[-1][1] == row:
                segments[-1] = (segments[-1][0], row + n, page)
            elif page >= 0:
                segments.append((row, row + n, page))
            row += n
        decode = all(n == 1 for _, n in items)
        block_t = DECODE_BLOCK_T if decode else PREFILL_BLOCK_T
        if not ops.use_kernels(self.device) or (not segments and bucket is None):
            return segments, None, block_t
        num_tiles = None if bucket is None else max_tiles(bucket, block_t, self.config.max_loras)
        return segments, tile_map(segments, block_t, num_tiles), block_t

    @torch.inference_mode()
    def execute(
        self,
        items: Sequence[tuple[S, int]],
        mask: Callable[[torch.Tensor, Sequence[ScheduledSequence]], None] | None = None,
    ) -> tuple[list[S], SampleResult | None, dict[str, tuple[int, TokenScores]]]:
        """Run one step; returns the requests that sampled and their tokens (None when nobody sampled), and the
        prompt tokens scored for requests that ask for prompt logprobs (request id -> (index in its prompt of the
        first token scored, one row per token scored in order), each scored once). ``mask`` (structured output)
        gets the [R, vocab] logits and their rows' sequences once the forward pass is queued (on a GPU its host
        work overlaps the device's) and forbids tokens in place. The sample result has one row per verified
        position: 1 + d consecutive rows for a request with d draft tokens (row j sampled as if drafts[:j] were
        accepted; see verify_drafts), one row for the others."""
        with self.ranks.in_step():  # the ranks' part of the step
            batch, sampling = self.prepare(items)
            hidden = None
            if self.graphs is not None and not self._changes_embedding(batch):
                hidden = self.graphs.replay(batch)
            if hidden is None:
                hidden = self._eager_forward(batch)
            scores = self._score_prompts(hidden, batch.prompt_scoring)
            if not sampling:
                return sampling, None, scores
            logits = self.model.compute_logits(hidden[batch.logits_indices], batch.logits_segments)
        rows: list[ScheduledSequence] = []
        for request in sampling:
            drafts = request.draft_token_ids
            rows.extend([request, *(DraftPosition.of(request, j) for j in range(1, len(drafts) + 1))])
        sampled = self.sampler(logits, rows, None if mask is None else lambda logits_: mask(logits_, rows))
        return sampling, sampled, scores

    def _changes_embedding(self, batch: ForwardBatch) -> bool:
        """Whether an adapter of the batch changes the embedding (LoRA on it, trainable tokens). The decode graphs
        hold no such change (they are captured on padding rows; the model applies it per host segment), so such a
        step runs eagerly. The head's changes need nothing: the logits are computed after the graph."""
        lora = batch.lora
        if lora is None:
            return False
        terms = (self.adapters.vocab(page) for _, _, page in lora.host_segments)
        return any(t is not None and t.changes_embedding for t in terms)

    def _score_prompts(self, hidden: torch.Tensor, scoring: PromptScoring | None) -> dict[str, tuple[int, TokenScores]]:
        """Each owner's scored prompt tokens (see execute), its top-k cut from the step's largest k."""
        if scoring is None:
            return {}
        k, head, kept = max(owner_k for _, owner_k, _, _ in scoring.owners), self.model.compute_logits, self.kept_scores

        def logits_of(rows: torch.Tensor, segments: Sequence[tuple[int, int, int]]) -> torch.Tensor:
            logits = head(rows, segments)  # [m, hidden] -> [m, >= vocab] float32
            if kept is not None:
                kept.append(torch.log_softmax(logits[:, : self.arch.vocab_size].float(), dim=-1).cpu())
            return logits

        scores = score_tokens(
            hidden[scoring.rows], scoring.targets, k, logits_of, self.arch.vocab_size, scoring.segments
        )
        by_request, row = {}, 0
        for request_id, owner_k, first, count in scoring.owners:
            end = row + count
            top = [t[:owner_k] for t in scores.top_logprobs[row:end]]
            by_request[request_id] = (first, TokenScores(scores.logprobs[row:end], scores.ranks[row:end], top))
            row = end
        return by_request
