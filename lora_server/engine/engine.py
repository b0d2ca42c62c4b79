"""The engine: admission and validation, the step loop (schedule -> run -> update -> detokenize), and the two
ways to drive it: ``Engine.add_request`` (an async stream per request, stepped by a background thread) and the
synchronous ``Engine.generate`` for offline use. Imports nothing from the web stack."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adapters.peft_format import LoraAdapter
from kv_pool import AdapterKey, PolicyParams, PoolConfig, UnifiedPool
from lora_server.config import EngineConfig
from lora_server.engine.adapter_registry import AdapterHandle, AdapterRegistry, UnknownAdapterError
from lora_server.engine.detokenizer import IncrementalDetokenizer
from lora_server.engine.outputs import Completion, RequestOutput, TokenLogprob
from lora_server.engine.request import FinishReason, Request
from lora_server.engine.scheduler import Scheduler, SchedulerConfig
from lora_server.engine.tokenizer import Tokenizer
from lora_server.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    InvalidRequestError,
    LoraServerError,
    QueueFullError,
    RequestFailedError,
)
from lora_server.model.arch import ModelArch
from lora_server.model.loader import open_checkpoint
from lora_server.model.quant import resident_bytes
from lora_server.model.runner import ModelRunner
from lora_server.model.sampler import NON_FINITE, SampleResult
from lora_server.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Sampled = tuple[int, list[TokenLogprob] | None]  # a sampled token and its logprobs entry, if asked for
IDLE_CHECK_S = 5.0  # how often an idle engine thread asserts the pool's integrity
_DEVICE_FAULTS = ("CUDA error", "device-side assert", "CUBLAS_STATUS", "CUDNN_STATUS", "illegal memory access",
                  "unspecified launch failure")
log = logging.getLogger("lora_server")


def is_device_fault(exc: BaseException) -> bool:
    """Whether an exception means the device (or the host's memory) can no longer be trusted: the engine stops
    instead of failing one request."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    if isinstance(exc, MemoryError) and not isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _DEVICE_FAULTS)


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
        self.tokenizer = _open_tokenizer(checkpoint.format, checkpoint.path)
        wanted_len = min(config.max_model_len or self.arch.max_position_embeddings, self.arch.max_position_embeddings)
        self.runner = ModelRunner(config, checkpoint, wanted_len)
        roots = None if config.adapter_roots is None else [Path(r) for r in config.adapter_roots]
        self.adapters = AdapterRegistry(self.runner.adapter_shapes, config.max_lora_rank, self.runner.dtype, roots,
                                        max_pinned=config.max_loras - 1)
        runner = self.runner
        self.pool = UnifiedPool(PoolConfig.for_budget(
            runner.num_blocks, runner.num_host_blocks, config.block_size, runner.kv_bytes_per_block,
            config.pool_policy, PolicyParams(h2d_bytes_per_s=runner.measure_h2d_bandwidth()), config.max_loras,
            runner.lora.slot_nbytes))
        self.max_model_len = min(wanted_len, self.pool.request_blocks * config.block_size)
        budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            budget = max(budget, self.max_model_len)  # a whole prompt must fit one step
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, budget, self.max_model_len,
                                                   config.enable_chunked_prefill, config.max_waiting_requests),
                                   self.pool, self.adapters)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) if self.tokenizer else self.arch.eos_token_ids
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.ttft = TtftSplit()

    # ---- admission -----------------------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                     adapter: str | None = None, cache_salt: str = "") -> Request:
        """Validate and tokenize (safe from any thread); raises InvalidRequestError (ContextLengthExceededError,
        UnknownAdapterError) and changes nothing. ``adapter`` names a registered adapter; None is the base model.
        Requests share cached KV only when their adapter version and ``cache_salt`` are equal.

        The returned request holds its adapter's current version: pass it to the scheduler (which lets go when it
        ends) or to ``discard``."""
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
                    f"token id {bad[0]} is outside the vocabulary (0..{self.arch.vocab_size - 1})", param="prompt")
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        self._check_vocab_bounds(params)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} in the "
                f"completion). Please reduce the prompt or max_tokens.")
        if adapter is not None:
            need = self.pool.blocks_needed(len(ids) + params.max_tokens, self.adapters.get(adapter).device_nbytes)
            if need > self.pool.request_blocks:
                raise ContextLengthExceededError(
                    f"{len(ids)} prompt tokens and max_tokens {params.max_tokens} with adapter `{adapter}` need "
                    f"{need} KV blocks (the adapter's weights included); the pool has {self.pool.request_blocks}. "
                    "Please reduce the prompt or max_tokens.")
        handle = None if adapter is None else self.adapters.acquire(adapter)  # last: nothing raises after it
        return Request(request_id, ids, params, eos_token_ids=self.eos_token_ids, adapter=handle,
                       cache_salt=cache_salt)

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Token ids of a prompt's text; a text too long for the context by its length alone (at least
        len / max_token_chars tokens) is refused without tokenizing it."""
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send token ids", param=param)
        if len(text) > self.max_model_len * self.tokenizer.max_token_chars:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt's "
                f"{len(text)} characters need more.", param=param)
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

    def discard(self, request: Request) -> None:
        """Let go of a request that was made but never added (its adapter hold)."""
        if request.adapter is not None:
            self.adapters.drop(request.adapter)

    def add(self, request: Request) -> None:
        """Queue a made request (QueueFullError, or ValueError for a duplicate id: then nothing changed)."""
        detokenizer = None if self.tokenizer is None else IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.params.stop, request.params.skip_special_tokens,
            request.params.include_stop_str_in_output)
        self.scheduler.add(request)
        if detokenizer is not None:
            self._detokenizers[request.request_id] = detokenizer

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        self._detokenizers.pop(request_id, None)
        return _output(request, "", [], None)

    # ---- the step ------------------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """One engine step. An exception raised while serving one request fails that request alone (an output
        carrying RequestFailedError; its blocks are freed, the rest of the batch goes on); a device fault, or a
        fault in the scheduler or the pool (shared state), propagates and stops the engine."""
        work = self.scheduler.schedule()
        adapter_s = self.runner.apply_copy_ops(self.pool.take_copy_ops(), self._weights)
        if not work.items:
            return []
        for request, _ in work.items:
            if request.adapter_loaded and request.first_token_time is None:
                request.adapter_load_s += adapter_s
        start = time.perf_counter()
        sampled, failed = self._execute(work.items)
        num_tokens = work.num_tokens
        if num_tokens >= 16 and not failed:  # prefill-sized steps: what recomputing a token costs, for the policy
            self.pool.observe_recompute(num_tokens, time.perf_counter() - start)
        outputs = [self._fail(request, reason) for request, reason in failed.items()]
        work.items = [(r, n) for r, n in work.items if r not in failed]
        advanced = self.scheduler.update(work, {rid: token for rid, (token, _) in sampled.items()})
        for request in advanced:
            try:
                if request.num_output_tokens == 1:
                    self.ttft.add(request)
                token = request.token_ids[-1]
                text = self._detokenize(request, token)
                outputs.append(_output(request, text, [token], sampled[request.request_id][1]))
            except Exception as exc:  # noqa: BLE001 (this request's detokenizing or stop handling: it alone fails)
                if is_device_fault(exc):
                    raise
                outputs.append(self._fail(request, _describe(exc)))
        return outputs

    def _weights(self, key: AdapterKey) -> LoraAdapter:
        return self.adapters.weights(key.adapter_id)

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
        sampling, result = self.runner.execute(items)
        if result is None:
            return {}, {}
        logprobs = _logprobs_by_request(sampling, result)
        sampled, failed = {}, {}
        for request, token in zip(sampling, result.token_ids, strict=True):
            if token == NON_FINITE:
                failed[request] = "the model produced non-finite logits (NaN or Inf) for this request"
            else:
                sampled[request.request_id] = (token, logprobs.get(request.request_id))
        return sampled, failed

    def _fail(self, request: Request, reason: str) -> RequestOutput:
        """End a request whose serving raised; its KV is not cached and its blocks are freed."""
        log.error("request %s failed: %s", request.request_id, reason)
        self.scheduler.finish(request, FinishReason.ERROR)
        self._detokenizers.pop(request.request_id, None)
        out = _output(request, "", [], None)
        out.error = RequestFailedError(f"request {request.request_id} failed: {reason}")
        return out

    def _detokenize(self, request: Request, token: int) -> str:
        detok = self._detokenizers.get(request.request_id)
        if detok is None:
            return ""
        text, stop = detok.add_tokens([token])
        if stop is not None:
            self.scheduler.finish(request, FinishReason.STOP, stop)
        elif request.finished:
            text += detok.flush()
        if request.finished:
            del self._detokenizers[request.request_id]
        return text

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def pool_figures(self) -> dict[str, Any]:
        """The pool's figures and the TTFT split, as plain data (engine thread)."""
        stats = self.pool.stats()
        figures: dict[str, Any] = {name: getattr(stats, name) for name in stats.__slots__}
        figures["kv_tokens_by_salt"] = {salt: {"prompt_tokens": p, "cached_tokens": c}
                                        for salt, (p, c) in stats.kv_tokens_by_salt.items()}
        return {"policy": self.pool.config.policy, "block_size": self.config.block_size,
                "gpu_blocks": self.pool.config.num_gpu_blocks, "host_blocks": self.pool.config.num_host_blocks,
                "block_bytes": self.pool.config.block_bytes, "request_blocks": len(self.pool.held_blocks()),
                **figures, "ttft": self.ttft.figures()}


@dataclass(slots=True)
class TtftSplit:
    """Time to first token split into queueing (arrival to first admission), adapter loading (copy operations
    of steps that loaded its adapter) and prefill (the rest); sums over requests that got a first token."""

    count: int = 0
    queueing_s: float = 0.0
    adapter_s: float = 0.0
    prefill_s: float = 0.0

    def add(self, request: Request) -> None:
        assert request.first_token_time is not None and request.scheduled_time is not None
        queueing = request.scheduled_time - request.arrival_time
        self.count += 1
        self.queueing_s += queueing
        self.adapter_s += request.adapter_load_s
        self.prefill_s += request.first_token_time - request.scheduled_time - request.adapter_load_s

    def figures(self) -> dict[str, float]:
        n = max(1, self.count)
        return {"requests": self.count, "mean_s": (self.queueing_s + self.adapter_s + self.prefill_s) / n,
                "queueing_mean_s": self.queueing_s / n, "adapter_loading_mean_s": self.adapter_s / n,
                "prefill_mean_s": self.prefill_s / n}


def _output(request: Request, text: str, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id, text=text, token_ids=token_ids, logprobs=logprobs,
        finished=request.finished,
        finish_reason=None if request.finish_reason is None else request.finish_reason.value,
        stop_reason=request.stop_reason, num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens, num_cached_tokens=request.num_cached_tokens)


def _logprobs_by_request(sampling: list[Request], result: SampleResult | None) -> dict[str, list[TokenLogprob]]:
    if result is None or result.logprobs is None or result.top_logprobs is None:
        return {}
    return {r.request_id: [TokenLogprob(tok, lp, top)]
            for r, tok, lp, top in zip(sampling, result.token_ids, result.logprobs, result.top_logprobs, strict=True)
            if r.params.logprobs is not None}


def _open_tokenizer(fmt: str, path: Path | None) -> Tokenizer | None:
    if fmt == "gguf" and path is not None:
        return Tokenizer.from_gguf(path)
    if fmt == "hf" and path is not None and (path / "tokenizer.json").is_file():
        return Tokenizer.from_hf_dir(path)
    return None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What an engine serves, as plain values (for benchmarks and the start-up summary)."""

    arch: ModelArch
    adapter_features: dict[str, tuple[int, int]]  # canonical module (q, k, v, o, gate, up, down) -> (in, out)
    device: torch.device
    dtype: torch.dtype
    weight_bytes: int  # resident base weights, quantized as they are held
    kv_bytes_per_token: int  # K and V of one token in every layer
    max_model_len: int


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
    resident_slots: dict[int, int]  # adapter version (adapter_id) -> its device slot
    pool: dict[str, Any]  # EngineCore.pool_figures()


class Engine:
    """The public engine. Asyncio callers use ``make_request`` (validation, from any thread), ``submit`` (on the
    event loop; a background thread steps the core), ``abort`` and ``snapshot``; ``generate`` runs requests to
    completion synchronously when that thread is not running.

    Faults: one request's failure ends that request alone (its stream raises RequestFailedError). A fault the
    engine cannot recover from (a device error, or broken scheduler or pool state) stops it: every stream raises
    EngineDeadError, ``dead`` is set and ``dead_error`` holds the cause; the server then exits."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore(config)
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self.dead = threading.Event()
        self.dead_error: BaseException | None = None
        self._snapshot = self._take_snapshot()  # republished by the engine thread, read by any thread
        self._snapshot_time = 0.0

    # ---- what any thread may read ----------------------------------------------------------------------------

    def num_unfinished(self) -> int:
        """Requests accepted and not yet finished (any thread)."""
        return len(self._streams)

    def snapshot(self) -> EngineSnapshot:
        """Queues, residency and pool figures as the engine thread last published them (any thread)."""
        if self._thread is None:
            self._snapshot = self._take_snapshot()
        return self._snapshot

    def pool_figures(self) -> dict[str, Any]:
        return self.snapshot().pool

    def _take_snapshot(self) -> EngineSnapshot:
        scheduler = self.core.scheduler

        def names(requests) -> tuple[str, ...]:
            return tuple(sorted({r.adapter.name for r in requests if r.adapter is not None}))

        running = scheduler.running
        decoding = bool(running) and not scheduler.waiting and all(r.num_uncomputed_tokens == 1 for r in running)
        return EngineSnapshot(len(running), len(scheduler.waiting), decoding, sum(r.num_tokens for r in running),
                              scheduler.num_preemptions,
                              names(scheduler.running), names(scheduler.waiting),
                              {k.adapter_id: slot for k, slot in self.core.pool.resident_adapters().items()},
                              self.core.pool_figures())

    def _publish(self) -> None:
        now = time.monotonic()
        if now - self._snapshot_time >= 0.1:
            self._snapshot, self._snapshot_time = self._take_snapshot(), now

    def describe(self) -> ModelInfo:
        runner = self.core.runner
        return ModelInfo(self.core.arch, dict(runner.adapter_shapes.features), runner.device, runner.dtype,
                         resident_bytes(runner.model), runner.kv_bytes_per_block // runner.block_size,
                         self.max_model_len)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core.arch.vocab_size

    # ---- adapters (any thread) -------------------------------------------------------------------------------

    def add_adapter(self, name: str, path: str | Path, pinned: bool = False,
                    version: int | None = None) -> AdapterHandle:
        """Register a PEFT LoRA directory under ``name`` (a new version if the name exists; ``version``: at least
        the one given); raises AdapterError with the reason when it cannot be served. A pinned adapter is loaded
        onto the device as soon as there is room and never evicted. Safe while serving: running requests are not
        stalled, and those that hold an older version keep it."""
        return self.core.adapters.register(name, path, pinned, version)

    def remove_adapter(self, name: str) -> None:
        """New requests for ``name`` fail (UnknownAdapterError); in-flight ones finish, then its memory is freed."""
        self.core.adapters.unregister(name)

    def adapter_names(self) -> list[str]:
        return self.core.adapters.names()

    def adapter_info(self, name: str) -> dict[str, Any] | None:
        """Where an adapter's current version is served from: its path, bytes, and device slot if resident."""
        adapters = self.core.adapters
        try:
            handle, path, nbytes = adapters.get(name), adapters.path(name), adapters.nbytes(name)
        except UnknownAdapterError:
            return None
        slot = self.snapshot().resident_slots.get(handle.adapter_id)
        return {"path": str(path), "version": handle.version, "pinned": handle.pinned,
                "state": "resident" if slot is not None else "registered", "slot": slot, "bytes": nbytes,
                "device_bytes": handle.device_nbytes}

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion prompt (blocking; see EngineCore.encode)."""
        return self.core.encode(text)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat conversation under the model's chat template, ready for make_request/generate."""
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer or chat template", param="messages")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.core.encode(text, add_special_tokens=False, param="messages")

    # ---- offline -------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams],
                 adapters: str | None | Sequence[str | None] = None, cache_salt: str = "") -> list[Completion]:
        """Run all prompts to completion in continuous batches; results in prompt order. ``adapters`` names one
        adapter for all prompts or one per prompt (None: the base model); ``cache_salt`` as in make_request. A
        request whose serving failed comes back with finish_reason "error" and ``error`` set."""
        self._offline()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        alist = [adapters] * len(prompts) if adapters is None or isinstance(adapters, str) else list(adapters)
        requests: list[Request] = []
        try:
            for p, sp, a in zip(prompts, plist, alist, strict=True):
                requests.append(self.core.make_request(f"gen-{next(self._ids)}", p, sp, a, cache_salt))
        except LoraServerError:
            for r in requests:
                self.core.discard(r)
            raise
        results = {r.request_id: Completion(r.request_id, r.prompt_token_ids, "", [], None, None, None)
                   for r in requests}
        pending = list(requests)
        while pending or self.has_work():
            while pending and len(self.core.scheduler.waiting) < self.config.max_waiting_requests:
                self.add(pending.pop(0))
            for out in self.step():
                _accumulate(results[out.request_id], out)
        return [results[r.request_id] for r in requests]

    def add(self, request: Request) -> None:
        """Queue a made request for ``step`` (offline; QueueFullError when the waiting queue is at its bound)."""
        self._offline()
        self.core.add(request)

    def step(self) -> list[RequestOutput]:
        """One engine step, offline: the outputs of the requests that advanced or ended."""
        self._offline()
        return self.core.step()

    def has_work(self) -> bool:
        return self.core.has_work()

    def _offline(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine thread is running: use submit(), or shutdown() first")

    # ---- async ---------------------------------------------------------------------------------------------

    def make_request(self, prompt: Prompt, params: SamplingParams, adapter: str | None = None, cache_salt: str = "",
                     request_id: str | None = None) -> Request:
        """Validate and tokenize, from any thread (the server calls it off the event loop); raises
        InvalidRequestError / ContextLengthExceededError / UnknownAdapterError and changes nothing. The request
        holds its adapter version: ``submit`` it or ``discard`` it. ``cache_salt``: only requests with the same
        salt share cached KV (per tenant)."""
        return self.core.make_request(request_id or f"req-{next(self._ids)}", prompt, params, adapter, cache_salt)

    def discard(self, request: Request) -> None:
        """Let go of a made request that will not be submitted."""
        self.core.discard(request)

    def submit(self, request: Request) -> _Stream:
        """Queue a made request (call from a running event loop); returns an async iterator of its
        RequestOutputs, the last one with finished=True. Raises QueueFullError or EngineDeadError, after which
        the request is discarded."""
        try:
            if self.dead_error is not None:
                raise EngineDeadError("the engine has stopped after an internal error")
            limit = self.config.max_waiting_requests + self.config.max_num_seqs
            if len(self._streams) >= limit:
                raise QueueFullError("the waiting queue is full; retry later")
            if request.request_id in self._streams:
                raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        except LoraServerError:
            self.discard(request)
            raise
        stream = _Stream(self, request.request_id, asyncio.get_running_loop())
        self._streams[request.request_id] = stream
        self.start()
        self._inbox.put(("add", request))
        self._wake.set()
        return stream

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                    adapter: str | None = None, cache_salt: str = "") -> _Stream:
        """make_request and submit in one call (on the event loop)."""
        return self.submit(self.make_request(prompt, params, adapter, cache_salt, request_id))

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort" and its blocks are freed."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def check_integrity(self, timeout: float = 30.0) -> None:
        """The pool's and the scheduler's invariants, checked on the engine thread (AssertionError if broken)."""
        if self._thread is None:
            self.core.check_integrity()
            return
        done: Future[None] = Future()
        self._inbox.put(("call", (self.core.check_integrity, done)))
        self._wake.set()
        done.result(timeout)

    def start(self) -> None:
        """Start the engine thread (idempotent; submit starts it too)."""
        with self._thread_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
                self._thread.start()

    def shutdown(self) -> None:
        """Stop the engine thread after its current step (``start`` or ``submit`` runs it again; ``generate``
        works again once it has stopped)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._stopping.clear()

    def _loop(self) -> None:
        checked = 0.0
        try:
            while not self._stopping.is_set():
                self._drain_inbox()
                self._publish()
                if not self.core.has_work():
                    if time.monotonic() - checked >= IDLE_CHECK_S:  # the pool's invariants, while nothing runs
                        self.core.check_integrity()
                        checked = time.monotonic()
                    self._wake.wait(timeout=0.1)
                    self._wake.clear()
                    continue
                for out in self.core.step():
                    self._deliver(out)
        except BaseException as exc:  # the engine cannot go on: every waiting stream learns of it, and the server
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        log.critical("engine stopped by an unrecoverable fault", exc_info=exc)
        self.dead_error = exc
        self._snapshot = self._take_snapshot_safely()
        for stream in list(self._streams.values()):
            stream.push_error(EngineDeadError(f"engine failed: {exc!r}"))
        self._streams.clear()
        self.dead.set()

    def _take_snapshot_safely(self) -> EngineSnapshot:
        try:
            return self._take_snapshot()
        except Exception:  # noqa: BLE001 (state may be broken: keep the last published one)
            return self._snapshot

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.core.add(payload)
                except (LoraServerError, ValueError) as exc:  # a full queue or a duplicate id: that request alone
                    self.core.discard(payload)
                    stream = self._streams.pop(payload.request_id, None)
                    if stream is not None:
                        stream.push_error(exc)
            elif kind == "abort":
                out = self.core.abort(payload)
                if out is not None:
                    self._deliver(out)
            else:
                call, done = payload
                try:
                    done.set_result(call())
                except Exception as exc:  # noqa: BLE001 (handed to the caller)
                    done.set_exception(exc)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        if out.error is not None:
            stream.push_error(out.error)
        else:
            stream.push(out)


class _Stream(AsyncIterator[RequestOutput]):
    """One request's outputs, fed from the engine thread. Closing it early (aclose) aborts the request."""

    def __init__(self, engine: Engine, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.request_id, self._loop = engine, request_id, loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._done = False

    def push(self, out: RequestOutput) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, out)

    def push_error(self, exc: BaseException) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, exc)

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self.engine.abort(self.request_id)


def _accumulate(c: Completion, out: RequestOutput) -> None:
    if out.error is not None:
        c.finish_reason, c.error = "error", out.error.message
        return
    c.text += out.text
    c.token_ids.extend(out.token_ids)
    if out.logprobs is not None:
        c.logprobs = (c.logprobs or []) + out.logprobs
    c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
    c.num_cached_tokens = out.num_cached_tokens
