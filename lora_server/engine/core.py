"""The engine's single-threaded core: admission and validation, then the step loop (schedule -> copy -> run ->
update -> detokenize). One request's failure is that request's alone; device faults and broken shared state
propagate. Only the engine thread (or the offline caller) touches it."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lora_server.adapters.page_layout import PageLayout
from lora_server.adapters.sources import AdapterSources
from lora_server.config import EngineConfig
from lora_server.distributed.tensor_parallel import TensorParallel
from lora_server.engine.adapter_loader import AdapterLoader
from lora_server.engine.adapter_registry import AdapterRegistry
from lora_server.engine.detokenizer import IncrementalDetokenizer
from lora_server.engine.load_times import LatencyHistogram
from lora_server.engine.outputs import RequestOutput, RequestTimings, TokenLogprob
from lora_server.engine.reports import BASE_NAME, AdapterResidency, DeviceMemory, PoolReport, TtftFigures
from lora_server.engine.request import (
    MAX_PRIORITY,
    MIN_PRIORITY,
    NO_TENANT,
    EngineRequest,
    FinishReason,
    Request,
    TenantShare,
    activation_start,
)
from lora_server.engine.residency import Residency
from lora_server.engine.scheduler import Scheduler, SchedulerConfig
from lora_server.engine.tokenizer import Tokenizer
from lora_server.errors import (
    AdapterUnavailableError,
    ContextLengthExceededError,
    InvalidRequestError,
    LoraServerError,
    ModelLoadError,
    RequestFailedError,
    TensorParallelError,
)
from lora_server.kernels.lora_table import MODULES
from lora_server.kv_pool import BASE_ADAPTER_ID, POLICIES, PolicyParams, PoolConfig, UnifiedPool
from lora_server.kv_pool.tree import OpKind
from lora_server.model.loader import open_checkpoint
from lora_server.model.runner import CopyCosts, ModelRunner
from lora_server.model.sampler import NON_FINITE, SampleResult, TokenScores, verify_drafts
from lora_server.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lora_server.engine.structured import GrammarMatcher, StructuredOutputs

Prompt = str | Sequence[int]
Sampled = tuple[list[int], list[TokenLogprob] | None]  # a request's new tokens (1 + accepted drafts), logprobs
_DEVICE_FAULTS = (
    "CUDA error",
    "device-side assert",
    "CUBLAS_STATUS",
    "CUDNN_STATUS",
    "illegal memory access",
    "unspecified launch failure",
)
log = logging.getLogger("lora_server")


def is_device_fault(exc: BaseException) -> bool:
    """Whether an exception means the device (or the host's memory) can no longer be trusted: the engine stops
    instead of failing one request."""
    if isinstance(exc, TensorParallelError):  # a rank died or the ranks fell out of step
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    if isinstance(exc, MemoryError) and not isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _DEVICE_FAULTS)


def _failed(request: Request, reason: str) -> RequestFailedError:
    return RequestFailedError(f"request {request.request_id} failed: {reason}")


def _unavailable(request: Request, reason: str) -> AdapterUnavailableError:
    """The error of a request whose adapter the loader could not stage (``reason`` names no path)."""
    name = "?" if request.adapter is None else request.adapter.name
    return AdapterUnavailableError(f"adapter `{name}` cannot be served now: {reason}")


def _describe(exc: BaseException) -> str:
    """Why a request failed, for its error message; the log gets the innermost frame too."""
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    if frame:
        log.error("serving a request raised %s at %s:%d", type(exc).__name__, frame[0].filename, frame[0].lineno)
    return f"{type(exc).__name__}: {exc}"


class EngineCore:
    """Single-threaded core: owns the scheduler, the runner and each request's detokenizer."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        checkpoint = open_checkpoint(config)
        self.arch = checkpoint.arch
        self.source = (checkpoint.format, checkpoint.path)  # how and where the weights were read
        self.tokenizer = _open_tokenizer(checkpoint.format, checkpoint.path, config.chat_template)
        wanted_len = min(config.max_model_len or self.arch.max_position_embeddings, self.arch.max_position_embeddings)
        # above 1: this process is rank 0 of the tensor-parallel ranks (it starts the others)
        tp = TensorParallel(config, checkpoint, wanted_len) if config.tensor_parallel_size > 1 else None
        try:
            self.runner = ModelRunner(config, checkpoint, wanted_len, tp)
        except BaseException:
            if tp is not None:
                tp.abort()
            raise
        roots = None if config.adapter_roots is None else [Path(r) for r in config.adapter_roots]
        runner = self.runner
        self.copy_costs = runner.measure_copy_costs()
        self.pool = UnifiedPool(_pool_config(config, runner, self.arch.num_layers, self.copy_costs))
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
        self._structured: StructuredOutputs | None = None  # built by the first structured request (xgrammar loads)
        self._structured_lock = threading.Lock()

    # ---- admission -----------------------------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        adapter: str | None = None,
        cache_salt: str = "",
        *,
        tenant: TenantShare = NO_TENANT,
        priority: int = 0,
        compile_grammar: bool = True,
        arrival_time: float | None = None,
        adapter_wait_s: float = 0.0,
    ) -> EngineRequest:
        """Validate and tokenize (safe from any thread); raises InvalidRequestError (ContextLengthExceededError,
        UnknownAdapterError) and changes nothing. ``compile_grammar`` False: a structured output is checked but
        not compiled; its matcher must be attached (``Engine.attach_grammars``) before the request is added.
        ``adapter`` names a registered adapter; None is the base model.
        Requests share cached KV only when their adapter version and ``cache_salt`` are equal. ``tenant``: whom it
        is served for and that tenant's share; ``priority``: its place among the tenant's waiting requests (lower
        first), an integer in [MIN_PRIORITY, MAX_PRIORITY]. ``arrival_time``: when it arrived on the engine's clock
        (time.monotonic; None: now), where its queueing and time to first token start; ``adapter_wait_s``: how
        long it had waited for its adapter by then (registered on its first request).

        The returned description holds its adapter's current version: pass it to ``add`` (the scheduler lets go
        when the request ends) or to ``discard``."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            ids = self.encode(prompt, param="prompt")
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidRequestError("prompt token ids must be integers", param="prompt")
            bad = [t for t in ids if not 0 <= t < self.arch.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"token id {bad[0]} is outside the vocabulary (0..{self.arch.vocab_size - 1})", param="prompt"
                )
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise InvalidRequestError(
                f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority!r}", param="priority"
            )
        self._check_vocab_bounds(params)
        grammar = self._grammar(params, compile_grammar)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} in the "
                f"completion). Please reduce the prompt or max_tokens."
            )
        if adapter is not None:
            need = self.pool.blocks_needed(len(ids) + params.max_tokens, self.adapters.get(adapter).device_nbytes)
            if need > self.pool.request_blocks:
                raise ContextLengthExceededError(
                    f"{len(ids)} prompt tokens and max_tokens {params.max_tokens} with adapter `{adapter}` need "
                    f"{need} KV blocks (the adapter's weights included); the pool has {self.pool.request_blocks}. "
                    "Please reduce the prompt or max_tokens."
                )
        handle = None if adapter is None else self.adapters.acquire(adapter)  # last: nothing raises after it
        adapter_from = 0 if handle is None else activation_start(ids, handle.invocation_tokens)
        return EngineRequest(
            request_id,
            tuple(ids),
            params,
            eos_token_ids=self.eos_token_ids,
            adapter=handle,
            cache_salt=cache_salt,
            tenant=tenant,
            priority=priority,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            grammar=grammar,
            adapter_from=adapter_from,
            adapter_wait_s=adapter_wait_s,
        )

    def _grammar(self, params: SamplingParams, compile_grammar: bool) -> GrammarMatcher | None:
        """A fresh matcher of the request's structured output (its grammar compiled here, or found in the cache);
        without ``compile_grammar`` the constraint is only checked (None)."""
        if params.structured is None:
            return None
        if not compile_grammar:
            self.structured_outputs().check(params.structured)
            return None
        return self.structured_outputs().matcher(params.structured)

    def structured_outputs(self) -> StructuredOutputs:
        """The grammar compiler and cache, built on first use (safe from any thread)."""
        with self._structured_lock:
            if self._structured is None:
                if self.tokenizer is None:
                    raise InvalidRequestError(
                        "structured output needs the model's tokenizer; this model has none", param="response_format"
                    )
                from lora_server.engine.structured import StructuredOutputs  # xgrammar loads only when used

                self._structured = StructuredOutputs(self.tokenizer, self.arch.vocab_size, self.config)
            return self._structured

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Token ids of a prompt's text; a text too long for the context by its length alone (at least
        len / max_token_chars tokens) is refused without tokenizing it."""
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send token ids", param=param)
        if len(text) > self.max_model_len * self.tokenizer.max_token_chars:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt's "
                f"{len(text)} characters need more.",
                param=param,
            )
        return self.tokenizer.encode(text, add_special_tokens)

    def _check_vocab_bounds(self, params: SamplingParams) -> None:
        """Sampling fields that name tokens or count them must stay inside the vocabulary."""
        vocab = self.arch.vocab_size
        if params.top_k > vocab:
            raise InvalidRequestError(f"top_k must be at most the vocabulary size ({vocab})", param="top_k")
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be inside the vocabulary", param="stop_token_ids")
        if any(t >= vocab for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias keys must be token ids below {vocab}", param="logit_bias")
        if any(t >= vocab for t in params.allowed_token_ids or ()):
            raise InvalidRequestError(f"allowed_token_ids must be token ids below {vocab}", param="allowed_token_ids")
        if any(t >= vocab for words in params.bad_words for t in words):
            raise InvalidRequestError(f"bad_words must be token sequences below {vocab}", param="bad_words")

    def discard(self, request: EngineRequest) -> None:
        """Let go of a request that was made but never added (its adapter hold)."""
        if request.adapter is not None:
            self.adapters.drop(request.adapter)

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
        return _output(request, "", [], None)

    # ---- scoring a text over the whole vocabulary ------------------------------------------------------------

    def full_prompt_logprobs(self, request_id: str, prompt: Sequence[int], adapter: str | None) -> torch.Tensor:
        """Offline, with no other request in flight (RuntimeError otherwise): run ``prompt`` through the serving
        path as a request that scores its prompt and generates nothing (admission, the adapter made resident,
        chunked prefill, the paged KV cache, the weights as quantized, no prefix reuse) and keep the head's output
        whole. Returns [len(prompt) - 1, vocab] float32 on the CPU: row j = log_softmax over the vocabulary of the
        logits after prompt[: j + 1], the distribution that scores prompt[j + 1]. Validation as make_request
        (at least 2 tokens; InvalidRequestError, ContextLengthExceededError, UnknownAdapterError); a failed
        request raises its error.

        The runner scores prompt tokens through model.compute_logits a slice of rows at a time, in order (see
        sampler.score_tokens), and this request is the step's only one and samples nothing: so every head call
        while it runs is one of its slices. Those calls are observed by shadowing compute_logits on the model
        instance for the request's lifetime (restored however it ends); the row count is checked."""
        if self.has_work():
            raise RuntimeError("full_prompt_logprobs runs alone: the engine has requests in flight")
        if len(prompt) < 2:
            raise InvalidRequestError("scoring needs at least 2 prompt tokens", param="prompt")
        described = self.make_request(request_id, prompt, SamplingParams(max_tokens=0, prompt_logprobs=0), adapter)
        model, vocab = self.runner.model, self.arch.vocab_size
        head = model.compute_logits
        rows: list[torch.Tensor] = []

        def observed(hidden: torch.Tensor, segments: Sequence[tuple[int, int, int]] = ()) -> torch.Tensor:
            logits = head(hidden, segments)  # [m, hidden] -> [m, >= vocab] float32
            rows.append(torch.log_softmax(logits[:, :vocab].float(), dim=-1).cpu())  # [m, vocab]
            return logits

        setattr(model, "compute_logits", observed)  # noqa: B010 (an instance attribute shadows the method)
        try:
            self.add(described)
            while self.has_work():
                for out in self.step():
                    if out.error is not None:
                        raise out.error
        finally:
            delattr(model, "compute_logits")
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
        failed_early = [self._fail(request, _unavailable(request, reason)) for request, reason in work.failed]
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
        outputs = failed_early + [self._fail(request, _failed(request, reason)) for request, reason in failed.items()]
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
                out = _output(request, text, tokens, None if logprobs is None else logprobs[: len(tokens)])
                if first and request.params.prompt_logprobs is not None:
                    out.prompt_logprobs = [None, *request.prompt_logprobs]
                outputs.append(out)
            except Exception as exc:  # noqa: BLE001 (this request's detokenizing or stop handling: it alone fails)
                if is_device_fault(exc):
                    raise
                outputs.append(self._fail(request, _failed(request, _describe(exc))))
        return outputs

    def _advance_grammar(self, request: Request) -> None:
        """The matcher takes the token the request appended (once: recomputing after a preemption samples no token
        again); a complete structured output ends the request (stop), even with ignore_eos."""
        assert request.grammar is not None and self._structured is not None
        if self._structured.accept(request.grammar, request.token_ids[-1]) and not request.finished:
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
                return {}, {items[0][0]: _describe(exc)}
        sampled: dict[str, Sampled] = {}
        failed: dict[Request, str] = {}
        for item in items:
            try:
                one, bad = self._run([item])
            except Exception as exc:  # noqa: BLE001
                if is_device_fault(exc):
                    raise
                failed[item[0]] = _describe(exc)
                continue
            sampled.update(one)
            failed.update(bad)
        return sampled, failed

    def _run(self, items: list[tuple[Request, int]]) -> tuple[dict[str, Sampled], dict[Request, str]]:
        structured = self._structured
        mask = structured.mask_logits if structured and any(r.grammar is not None for r, _ in items) else None
        sampling, result, scores = self.runner.execute(items, mask)
        if scores:
            _store_prompt_logprobs([r for r, _ in items], scores)
        if result is None:
            return {}, {}
        logprobs = _logprobs_by_request(sampling, result)
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
        out = _output(request, "", [], None)
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
            if i == len(tokens) - 1 and _ended_by_eos(request, token):
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

    def check_integrity(self) -> None:
        """The scheduler's and the pool's invariants, and the arena holds exactly the adapters the pool placed
        there (after this step's copies); with tensor parallelism, every rank's arena and block tables too."""
        self.scheduler.check_integrity()
        loads, unloads = self.pool.pending_adapter_pages(), self.pool.pending_adapter_pages(unloads=True)
        placed = (set(self.pool.resident_adapters().values()) - loads) | unloads
        assert self.runner.adapters.table_pages() == placed, "the arena's adapters differ from the pool's"
        self.runner.check_ranks()

    def pool_report(self) -> PoolReport:
        """The pool's figures, its adapters' placement and the TTFT split (engine thread)."""
        names = self.adapters.names_by_id()

        def served(adapter_id: int) -> tuple[str, ...]:
            return (BASE_NAME,) if adapter_id == BASE_ADAPTER_ID else tuple(names.get(adapter_id, ()))

        placement = tuple(
            AdapterResidency(
                name=next(iter(served(p.key.adapter_id)), None),
                names=served(p.key.adapter_id),
                tier=p.tier,
                table_page=p.table_page,
                staged=p.staged,
                pinned=p.pinned,
                rank=self._rank(p.key.adapter_id),
                weight_blocks=p.weight_blocks,
                kv_blocks_gpu=p.kv_blocks_gpu,
                kv_blocks_host=p.kv_blocks_host,
            )
            for p in self.pool.adapter_placement()
        )
        runner, pool = self.runner, self.pool.config
        return PoolReport(
            device_memory=DeviceMemory(
                weights_bytes=runner.weight_bytes,
                arena_bytes=runner.arena.nbytes,
                workspace_bytes=runner.workspace_bytes,
                host_tier_bytes=runner.host_kv.nbytes,
                staged_adapters=len(self.loader.staged_ids()),
                adapter_stagings=self.loader.num_staged,
                staged_adapter_bytes=self.loader.staged_bytes(),
                staged_adapter_budget_bytes=self.loader.budget_bytes,
            ),
            policy=pool.policy,
            block_size=self.config.block_size,
            gpu_blocks=pool.num_gpu_blocks,
            host_blocks=pool.num_host_blocks,
            block_bytes=pool.block_bytes,
            request_blocks=len(self.pool.held_blocks()),
            stats=self.pool.stats(),
            adapters=placement,
            ttft=self.ttft.figures(),
            adapter_load=self.loader.load_times(),
            adapter_activate=self.activate_times.figures(),
        )

    def _rank(self, adapter_id: int) -> int | None:
        """An adapter's largest rank over its modules (None: the base model, or weights no longer registered)."""
        content = None if adapter_id == BASE_ADAPTER_ID else self.adapters.content(adapter_id)
        return None if content is None else content.rank


def _pool_config(config: EngineConfig, runner: ModelRunner, num_layers: int, costs: CopyCosts) -> PoolConfig:
    """The pool of ``config`` on the runner's arena, its cost model priced with ``costs`` (measured on the device).
    A slot policy's slot is the pages of an adapter of the largest rank on every module."""
    slot_bytes = 0
    if POLICIES[config.pool_policy].adapter_slots:
        full = {(i, m): config.max_lora_rank for i in range(num_layers) for m in MODULES}
        slot_bytes = PageLayout(runner.geometry, full).nbytes
    return PoolConfig.for_budget(
        num_gpu_blocks=runner.num_blocks,
        num_host_blocks=runner.num_host_blocks,
        block_size=config.block_size,
        block_bytes=runner.geometry.page_bytes,
        policy=config.pool_policy,
        params=PolicyParams(
            h2d_bytes_per_s=costs.h2d_bytes_per_s,
            d2h_bytes_per_s=costs.d2h_bytes_per_s,
            copy_latency_s=costs.latency_s,
            copies_stall_compute=costs.stalls_compute,
        ),
        max_loras=config.max_loras,
        adapter_slot_bytes=slot_bytes,
    )


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


@dataclass(slots=True)
class TtftSplit:
    """Time to first token split into queueing, adapter loading and prefill, summed over requests that got a
    first token: adapter loading is every wait for its adapter (registered on first use before the engine saw the
    request, read and staged on the host before its first admission, copied into the arena after it: the copy
    operations of its steps, or on CUDA the steps it waited for the copy); queueing the rest of arrival to first
    admission, prefill the rest of first admission to first token. The three add up to its TTFT."""

    count: int = 0
    queueing_s: float = 0.0
    adapter_s: float = 0.0
    prefill_s: float = 0.0

    def add(self, request: Request) -> None:
        assert request.first_token_time is not None and request.scheduled_time is not None
        after_admission = request.copy_wait_s + request.adapter_load_s
        self.count += 1
        self.queueing_s += request.scheduled_time - request.arrival_time - request.adapter_wait_s
        self.adapter_s += request.adapter_wait_s + after_admission
        self.prefill_s += request.first_token_time - request.scheduled_time - after_admission

    def figures(self) -> TtftFigures:
        n = max(1, self.count)
        return TtftFigures(
            requests=self.count,
            mean_s=(self.queueing_s + self.adapter_s + self.prefill_s) / n,
            queueing_mean_s=self.queueing_s / n,
            adapter_loading_mean_s=self.adapter_s / n,
            prefill_mean_s=self.prefill_s / n,
        )


def _output(request: Request, text: str, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        text=text,
        token_ids=token_ids,
        logprobs=logprobs,
        finished=request.finished,
        finish_reason=None if request.finish_reason is None else request.finish_reason.value,
        stop_reason=request.stop_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_cached_tokens=request.num_cached_tokens,
        queue_time_s=None if request.scheduled_time is None else request.scheduled_time - request.arrival_time,
        timings=_timings(request) if request.finished else None,
    )


def _timings(request: Request) -> RequestTimings:
    return RequestTimings(
        arrival=request.arrival_time,
        first_admission=request.scheduled_time,
        first_token=request.first_token_time,
        adapter_load_s=request.adapter_load_s,
        adapter_loaded=request.adapter_loaded,
        adapter_wait_s=request.adapter_wait_s + request.copy_wait_s,
    )


def _store_prompt_logprobs(requests: list[Request], scores: dict[str, tuple[int, TokenScores]]) -> None:
    """Append the prompt tokens a step scored to their requests' prompt_logprobs (the runner scores each token once,
    from the first one a request lacks)."""
    for request in requests:
        scored = scores.get(request.request_id)
        if scored is None:
            continue
        first, rows = scored
        assert first == request.num_prompt_logprobs + 1, "prompt tokens are scored in order, each once"
        prompt = request.prompt_token_ids
        request.prompt_logprobs.extend(
            TokenLogprob(prompt[first + j], lp, top, rank)
            for j, (lp, rank, top) in enumerate(zip(rows.logprobs, rows.ranks, rows.top_logprobs, strict=True))
        )


def _ended_by_eos(request: Request, token: int) -> bool:
    return (
        request.finish_reason is FinishReason.STOP
        and request.stop_reason is None
        and token in request.eos_token_ids
        and not request.params.include_stop_str_in_output
    )


def _logprobs_by_request(sampling: list[Request], result: SampleResult | None) -> dict[str, list[TokenLogprob]]:
    """Each request's logprobs entries, one per row of the result that is its (1 + its drafts' rows)."""
    if result is None or result.logprobs is None or result.top_logprobs is None:
        return {}
    entries = [
        TokenLogprob(tok, lp, top)
        for tok, lp, top in zip(result.token_ids, result.logprobs, result.top_logprobs, strict=True)
    ]
    by_request, row = {}, 0
    for r in sampling:
        rows = len(r.draft_token_ids) + 1
        if r.params.logprobs is not None:
            by_request[r.request_id] = entries[row : row + rows]
        row += rows
    return by_request


def _open_tokenizer(fmt: str, path: Path | None, chat_template: str | None) -> Tokenizer | None:
    """The checkpoint's tokenizer, with ``chat_template`` (a file, or the template's text) instead of its own."""
    tokenizer = None
    try:
        if fmt == "gguf" and path is not None:
            tokenizer = Tokenizer.from_gguf(path)
        elif fmt == "hf" and path is not None and (path / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_hf_dir(path)
    except Exception as exc:  # noqa: BLE001 (the tokenizers package raises plain Exception on a bad file)
        where = path if fmt == "gguf" else path / "tokenizer.json" if path is not None else "the model"
        raise ModelLoadError(f"{where}: its tokenizer cannot be read: {type(exc).__name__}: {exc}") from exc
    if chat_template is None:
        return tokenizer
    if tokenizer is None:
        raise ValueError("--chat-template needs a model with a tokenizer")
    if "{" in chat_template:  # Jinja markup: the template itself (a file name has none)
        return tokenizer.with_chat_template(chat_template)
    if not Path(chat_template).is_file():
        raise ValueError(f"--chat-template {chat_template!r} is neither a file nor a Jinja template")
    return tokenizer.with_chat_template(Path(chat_template).read_text(encoding="utf-8"))
