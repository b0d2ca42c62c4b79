"""The engine's single-threaded core: admission and validation, then the step loop (schedule -> copy -> run ->
update -> detokenize). One request's failure is that request's alone; device faults and broken shared state
propagate. Only the engine thread (or the offline caller) touches it."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from lora_server.adapters.sources import AdapterSources
from lora_server.config import EngineConfig
from lora_server.distributed.tensor_parallel import TensorParallel
from lora_server.engine.adapter_loader import AdapterLoader
from lora_server.engine.adapter_registry import AdapterRegistry
from lora_server.engine.admission import Admission
from lora_server.engine.detokenizer import IncrementalDetokenizer
from lora_server.engine.failures import adapter_unavailable, describe, is_device_fault, request_failed
from lora_server.engine.load_times import LatencyHistogram
from lora_server.engine.outputs import RequestOutput, TokenLogprob
from lora_server.engine.pool_report import pool_config, pool_report
from lora_server.engine.reports import EngineSnapshot, ModelInfo, PoolReport, StepTimes
from lora_server.engine.request import (
    EngineRequest,
    FinishReason,
    Request,
)
from lora_server.engine.residency import Residency
from lora_server.engine.scheduler import Scheduler, SchedulerConfig
from lora_server.engine.step_results import (
    ended_by_eos,
    logprobs_by_request,
    request_output,
    store_prompt_logprobs,
)
from lora_server.engine.step_times import TtftSplit
from lora_server.engine.tokenizer import open_tokenizer
from lora_server.errors import (
    InvalidRequestError,
    LoraServerError,
)
from lora_server.kv_pool import UnifiedPool
from lora_server.kv_pool.tree import OpKind
from lora_server.model.llama import LlamaModel
from lora_server.model.loader import open_checkpoint
from lora_server.model.quant import resident_bytes
from lora_server.model.ranks import CollectiveCounts, Ranks, SingleRank
from lora_server.model.runner import ModelRunner
from lora_server.model.sampler import NON_FINITE, verify_drafts
from lora_server.sampling_params import SamplingParams

Sampled = tuple[list[int], list[TokenLogprob] | None]  # a request's new tokens (1 + accepted drafts), logprobs
log = logging.getLogger("lora_server")


class EngineCore:
    """Single-threaded core: owns the scheduler, the runner and each request's detokenizer."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        checkpoint = open_checkpoint(config)
        self.arch = checkpoint.arch
        self.source = (checkpoint.format, checkpoint.path)  # how and where the weights were read
        self.tokenizer = open_tokenizer(checkpoint.format, checkpoint.path, config.chat_template)
        wanted_len = min(config.max_model_len or self.arch.max_position_embeddings, self.arch.max_position_embeddings)
        # above 1: this process is rank 0 of the tensor-parallel ranks (it starts the others)
        ranks: Ranks = (
            TensorParallel(config, checkpoint, wanted_len)
            if config.tensor_parallel_size > 1
            else SingleRank(checkpoint)
        )
        try:
            self.runner = ModelRunner(config, ranks, wanted_len)
        except BaseException:
            ranks.abort()
            raise
        roots = None if config.adapter_roots is None else [Path(r) for r in config.adapter_roots]
        runner = self.runner
        self.copy_costs = runner.measure_copy_costs()
        self.pool = UnifiedPool(pool_config(config, runner, self.arch.num_layers, self.copy_costs))
        sources = AdapterSources(config.adapter_sources or (), config.adapter_cache_path, config.adapter_cache_bytes)
        self.adapters = AdapterRegistry(runner.adapter_form, roots, self.pool.config, sources)
        self.loader = AdapterLoader(
            self.adapters,
            runner.device,
            config.host_adapter_bytes(),
            config.max_cpu_loras,
            config.staging_workers,
            runner.base_row_norms,
        )
        self.max_model_len = min(wanted_len, self.pool.request_blocks * config.block_size)
        self.residency = Residency(
            self.adapters,
            self.loader,
            self.pool,
            adapter_loaded=runner.adapter_loaded if runner.copy_order.asynchronous else None,
        )
        self.scheduler = Scheduler(SchedulerConfig.from_engine(config, self.max_model_len), self.pool, self.residency)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) if self.tokenizer else self.arch.eos_token_ids
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.ttft = TtftSplit()
        self.step_times = StepTimes()
        self.activate_times = LatencyHistogram()  # adapters' host -> device copies (see _copy)
        self._activating: dict[int, float] = {}  # table page -> when its load was issued, until it has run
        self.admission = Admission(
            config, self.arch, self.tokenizer, self.max_model_len, self.eos_token_ids, self.pool, self.adapters
        )

    def add(self, described: EngineRequest) -> None:
        """Queue a made request: the engine's own Request is built from its description here (QueueFullError, or
        ValueError for a duplicate id: then nothing changed)."""
        request = Request.from_description(described)
        detokenizer = (
            None
            if self.tokenizer is None
            else IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                request.params.stop,
                request.params.skip_special_tokens,
                request.params.include_stop_str_in_output,
            )
        )
        self.scheduler.add(request)
        if detokenizer is not None:
            self._detokenizers[request.request_id] = detokenizer

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        self._detokenizers.pop(request_id, None)
        return request_output(request, "", [], None)

    # ---- scoring a text over the whole vocabulary ------------------------------------------------------------

    def full_prompt_logprobs(self, request_id: str, prompt: Sequence[int], adapter: str | None) -> torch.Tensor:
        """Offline, with no other request in flight (RuntimeError otherwise): run ``prompt`` through the serving
        path as a request that scores its prompt and generates nothing (admission, the adapter made resident,
        chunked prefill, the paged KV cache, the weights as quantized, no prefix reuse) and keep the head's output
        whole. Returns [len(prompt) - 1, vocab] float32 on the CPU: row j = log_softmax over the vocabulary of the
        logits after prompt[: j + 1], the distribution that scores prompt[j + 1]. Validation as make_request
        (at least 2 tokens; InvalidRequestError, ContextLengthExceededError, UnknownAdapterError); a failed
        request raises its error.

        The runner keeps every prompt-scoring slice's whole rows while it runs (runner.kept_scores: this request
        is the step's only one), in order; the row count is checked."""
        if self.has_work():
            raise RuntimeError("full_prompt_logprobs runs alone: the engine has requests in flight")
        if len(prompt) < 2:
            raise InvalidRequestError("scoring needs at least 2 prompt tokens", param="prompt")
        described = self.admission.make_request(
            request_id, prompt, SamplingParams(max_tokens=0, prompt_logprobs=0), adapter
        )
        vocab = self.arch.vocab_size
        rows: list[torch.Tensor] = []
        self.runner.kept_scores = rows
        try:
            self.add(described)
            while self.has_work():
                for out in self.step():
                    if out.error is not None:
                        raise out.error
        finally:
            self.runner.kept_scores = None
        result = torch.cat(rows) if rows else torch.empty(0, vocab)
        if result.shape[0] != len(prompt) - 1:
            raise RuntimeError(f"scored {result.shape[0]} rows for a prompt of {len(prompt)} tokens")
        return result

    # ---- the step ------------------------------------------------------------------------------------------

    def idle(self) -> None:
        """What an idle engine still does: let the pool act on adapter changes and its policy, and execute the
        copies it decides (pinned adapters loading, host KV coming back)."""
        self.scheduler.tick()
        self._copy()

    def _copy(self) -> float:
        """Execute the pool's copy operations (runner.apply_copy_ops; returns its seconds of adapter loads) and time
        adapter activations: from issuing a load to the step that learns its copy ran (at once off CUDA)."""
        ops = self.pool.take_copy_ops()
        images = self.residency.images(ops)
        issued = time.perf_counter()
        adapter_s = self.runner.apply_copy_ops(ops, images)
        for op in ops:
            if op.kind is OpKind.ADAPTER_LOAD:
                self._activating[op.dst[0]] = issued
            elif op.kind is OpKind.ADAPTER_UNLOAD:
                self._activating.pop(op.src[0], None)
        now = time.perf_counter()
        for page, start in list(self._activating.items()):
            if self.runner.adapter_loaded(page):
                self.activate_times.observe(now - start)
                del self._activating[page]
        return adapter_s

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """One engine step. An exception raised while serving one request fails that request alone (an output
        carrying RequestFailedError; its blocks are freed, the rest of the batch goes on); a device fault, or a
        fault in the scheduler or the pool (shared state), propagates and stops the engine."""
        t0 = time.perf_counter()
        work = self.scheduler.schedule()
        t1 = time.perf_counter()
        adapter_s = self._copy()
        self.step_times.add(t1 - t0, time.perf_counter() - t1)
        failed_early = [self._fail(request, adapter_unavailable(request, reason)) for request, reason in work.failed]
        if not work.items:
            if not failed_early and self.scheduler.has_work() and self.residency.staging():
                self.residency.wait_for_staging(0.01)  # nothing to run until an adapter is staged: no busy loop
            return failed_early
        for request, _ in work.items:
            if request.adapter_loaded and request.first_token_time is None:
                request.adapter_load_s += adapter_s
        start = time.perf_counter()
        sampled, failed = self._execute(work.items)
        self.step_times.forward_s += time.perf_counter() - start
        num_tokens = work.num_tokens
        if num_tokens >= 16 and not failed:  # prefill-sized steps: what recomputing a token costs, for the policy
            self.pool.observe_recompute(num_tokens, time.perf_counter() - start)
        outputs = failed_early + [
            self._fail(request, request_failed(request, reason)) for request, reason in failed.items()
        ]
        work.items = [(r, n) for r, n in work.items if r not in failed]
        lengths = {r.request_id: r.num_tokens for r, _ in work.items}
        advanced = self.scheduler.update(work, {rid: tokens for rid, (tokens, _) in sampled.items()})
        for request in advanced:
            try:
                tokens = request.token_ids[lengths[request.request_id] :]  # those kept: a stop drops the rest
                if request.grammar is not None:  # never speculated: one new token
                    self._advance_grammar(request)
                first = request.num_output_tokens == len(tokens)
                if first:
                    self.ttft.add(request)
                text, tokens = self._detokenize(request, tokens)
                logprobs = sampled[request.request_id][1] if tokens else None
                out = request_output(request, text, tokens, None if logprobs is None else logprobs[: len(tokens)])
                if first and request.params.prompt_logprobs is not None:
                    out.prompt_logprobs = [None, *request.prompt_logprobs]
                outputs.append(out)
            except Exception as exc:  # noqa: BLE001 (this request's detokenizing or stop handling: it alone fails)
                if is_device_fault(exc):
                    raise
                outputs.append(self._fail(request, request_failed(request, describe(exc))))
        return outputs

    def _advance_grammar(self, request: Request) -> None:
        """The matcher takes the token the request appended (once: recomputing after a preemption samples no token
        again); a complete structured output ends the request (stop), even with ignore_eos."""
        structured = self.admission.structured
        assert request.grammar is not None and structured is not None
        if structured.accept(request.grammar, request.token_ids[-1]) and not request.finished:
            self.scheduler.finish(request, FinishReason.STOP)

    def _execute(self, items: list[tuple[Request, int]]) -> tuple[dict[str, Sampled], dict[Request, str]]:
        """Run the batch; returns each sampling request's (token, logprobs) and the requests that failed, with
        why. When the batched run raises, each request runs alone to find the one(s) at fault: re-running a chunk
        rewrites the same KV slots with the same values, and nothing else of the step has changed yet."""
        try:
            return self._run(items)
        except Exception as exc:  # noqa: BLE001 (sorted out below: device faults propagate)
            if is_device_fault(exc):
                raise
            if len(items) == 1:
                return {}, {items[0][0]: describe(exc)}
        sampled: dict[str, Sampled] = {}
        failed: dict[Request, str] = {}
        for item in items:
            try:
                one, bad = self._run([item])
            except Exception as exc:  # noqa: BLE001
                if is_device_fault(exc):
                    raise
                failed[item[0]] = describe(exc)
                continue
            sampled.update(one)
            failed.update(bad)
        return sampled, failed

    def _run(self, items: list[tuple[Request, int]]) -> tuple[dict[str, Sampled], dict[Request, str]]:
        structured = self.admission.structured
        mask = structured.mask_logits if structured and any(r.grammar is not None for r, _ in items) else None
        sampling, result, scores = self.runner.execute(items, mask)
        if scores:
            store_prompt_logprobs([r for r, _ in items], scores)
        if result is None:
            return {}, {}
        logprobs = logprobs_by_request(sampling, result)
        sampled, failed = {}, {}
        row = 0
        for request in sampling:
            drafts = request.draft_token_ids
            tokens = verify_drafts(result.token_ids[row : row + len(drafts) + 1], drafts)
            entries = logprobs.get(request.request_id)
            if tokens[-1] == NON_FINITE:
                failed[request] = "the model produced non-finite logits (NaN or Inf) for this request"
            else:
                sampled[request.request_id] = (tokens, None if entries is None else entries[: len(tokens)])
            row += len(drafts) + 1
        return sampled, failed

    def _fail(self, request: Request, error: LoraServerError) -> RequestOutput:
        """End a request whose serving raised, or whose adapter could not be staged, with ``error``; its KV is not
        cached and its blocks are freed."""
        log.error("request %s failed: %s", request.request_id, error.message)
        self.scheduler.finish(request, FinishReason.ERROR)
        self._detokenizers.pop(request.request_id, None)
        out = request_output(request, "", [], None)
        out.error = error
        return out

    def _detokenize(self, request: Request, tokens: list[int]) -> tuple[str, list[int]]:
        """The text of a request's new tokens, one at a time so that a stop string ends it where it occurs: the
        tokens after it are dropped (from the request too). The end-of-sequence token that ends a request is no
        text, even with skip_special_tokens false (as in vLLM), unless include_stop_str_in_output. Returns the text
        and the tokens kept."""
        detok = self._detokenizers.get(request.request_id)
        if detok is None:
            return "", tokens
        text = ""
        for i, token in enumerate(tokens):
            if i == len(tokens) - 1 and ended_by_eos(request, token):
                continue
            delta, stop = detok.add_tokens([token])
            text += delta
            if stop is not None:
                if request.finished:  # by a later kept token (EOS, a stop id, length): the stop string came first
                    request.finish_reason, request.stop_reason = FinishReason.STOP, stop
                self.scheduler.finish(request, FinishReason.STOP, stop)
                request.drop_last(len(tokens) - i - 1)
                tokens = tokens[: i + 1]
                break
        else:
            if request.finished:
                text += detok.flush()
        if request.finished:
            del self._detokenizers[request.request_id]
        return text, tokens

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any."""
        self.runner.close()

    def collectives(self) -> CollectiveCounts | None:
        return self.runner.ranks.collectives

    def check_integrity(self) -> None:
        """The scheduler's and the pool's invariants, and the arena holds exactly the adapters the pool placed
        there (after this step's copies); with tensor parallelism, every rank's arena and block tables too."""
        self.scheduler.check_integrity()
        loads, unloads = self.pool.pending_adapter_pages(), self.pool.pending_adapter_pages(unloads=True)
        placed = (set(self.pool.resident_adapters().values()) - loads) | unloads
        assert self.runner.adapters.table_pages() == placed, "the arena's adapters differ from the pool's"
        self.runner.check_ranks()

    def snapshot(self) -> EngineSnapshot:
        """Queues, residency, pool figures and step times as plain values (engine thread)."""
        scheduler = self.scheduler

        def names(requests) -> tuple[str, ...]:
            return tuple(sorted({r.adapter.name for r in requests if r.adapter is not None}))

        running = scheduler.running
        decoding = bool(running) and not scheduler.waiting and all(r.num_uncomputed_tokens == 1 for r in running)
        return EngineSnapshot(
            len(running),
            len(scheduler.waiting),
            decoding,
            sum(r.num_tokens for r in running),
            scheduler.num_preemptions,
            names(scheduler.running),
            names(scheduler.waiting),
            {k.adapter_id: slot for k, slot in self.pool.resident_adapters().items()},
            self.pool_report(),
            dataclasses.replace(self.step_times),
            spec_draft_tokens=scheduler.num_draft_tokens,
            spec_accepted_tokens=scheduler.num_accepted_drafts,
            experts_read=sum(moe.experts_read for moe in self.runner.model.sparse_mlps()),
            expert_loras_read=sum(moe.expert_loras_read for moe in self.runner.model.sparse_mlps()),
        )

    def describe(self) -> ModelInfo:
        """What this engine serves, as plain values."""
        runner = self.runner
        return ModelInfo(
            self.arch,
            *self.source,
            dict(runner.adapter_shapes.features),
            runner.device,
            runner.dtype,
            resident_bytes(runner.model),
            runner.kv_bytes_per_block // runner.block_size,
            self.max_model_len,
            dict(runner.startup_s),
            runner.memory.activations,
            runner.memory.graphs,
            self.copy_costs,
            _expert_bytes(runner.model),
        )

    @property
    def model(self) -> LlamaModel:
        return self.runner.model

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def on_cpu(self) -> bool:
        return self.runner.device.type == "cpu"

    def pool_report(self) -> PoolReport:
        """The pool's figures, its adapters' placement and the TTFT split (engine thread)."""
        return pool_report(
            self.pool,
            self.adapters,
            self.loader,
            self.runner,
            self.config.block_size,
            self.ttft.figures(),
            self.activate_times.figures(),
        )


def _expert_bytes(model: LlamaModel) -> int:
    """One expert's resident weights, gate|up and down (every expert of a model is held alike); 0 for a dense
    model."""
    sparse = model.sparse_mlps()
    return resident_bytes(sparse[0].gate_up[0]) + resident_bytes(sparse[0].down[0]) if sparse else 0
