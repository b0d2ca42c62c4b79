"""The engine: admission and validation, the step loop (schedule -> run -> update -> detokenize), and the two
ways to drive it: ``Engine.add_request`` (an async stream per request, stepped by a background thread) and the
synchronous ``Engine.generate`` for offline use. Imports nothing from the web stack."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kv_pool.policies import PolicyParams
from kv_pool.unified_pool import PoolConfig, UnifiedPool
from lora_server.config import EngineConfig
from lora_server.detokenizer import IncrementalDetokenizer
from lora_server.errors import ContextLengthExceededError, EngineDeadError, InvalidRequestError, QueueFullError
from lora_server.loader import open_checkpoint
from lora_server.lora import AdapterHandle, UnknownAdapterError
from lora_server.model_runner import ModelRunner
from lora_server.outputs import Completion, RequestOutput, TokenLogprob
from lora_server.request import FinishReason, Request
from lora_server.sampler import SampleResult
from lora_server.sampling_params import SamplingParams
from lora_server.scheduler import Scheduler, SchedulerConfig
from lora_server.tokenizer import Tokenizer

Prompt = str | Sequence[int]
IDLE_CHECK_S = 5.0  # how often an idle engine thread asserts the pool's integrity


class EngineCore:
    """Single-threaded core: owns the scheduler, the runner and each request's detokenizer."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        checkpoint = open_checkpoint(config)
        self.arch = checkpoint.arch
        self.tokenizer = _open_tokenizer(checkpoint.format, checkpoint.path)
        wanted_len = min(config.max_model_len or self.arch.max_position_embeddings, self.arch.max_position_embeddings)
        self.runner = ModelRunner(config, checkpoint, wanted_len)
        self.adapters = self.runner.lora
        self.pool = UnifiedPool(self._pool_config())
        # one request must fit the blocks left beside the fixed slots' reserve; make_request checks that an adapter
        # request also fits beside its adapter
        pc = self.pool.config
        self._request_blocks = pc.num_gpu_blocks - (pc.adapter_slots * pc.adapter_slot_blocks
                                                    if self.pool.policy.adapter_slots else 0)
        self.max_model_len = min(wanted_len, self._request_blocks * config.block_size)
        budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            budget = max(budget, self.max_model_len)  # a whole prompt must fit one step
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, budget, self.max_model_len,
                                                   config.enable_chunked_prefill, config.max_waiting_requests),
                                   self.pool, self.adapters)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) if self.tokenizer else self.arch.eos_token_ids
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.ttft = TtftSplit()

    def _pool_config(self) -> PoolConfig:
        """The pool's budget in blocks of the KV cache: adapters are charged ceil(bytes / block bytes) blocks of
        it while resident (their weights sit in the LoRA slot buffers the kernels read, at most max_loras of them).
        Restore costs: the host-to-device bandwidth measured now; recompute time per token from observed steps."""
        runner, config = self.runner, self.config
        block_bytes = runner.kv_bytes_per_block
        slot_blocks = -(-self.adapters.slot_nbytes // block_bytes)
        if config.pool_policy == "lru-separate" and config.max_loras * slot_blocks >= runner.num_blocks:
            raise ValueError(f"lru-separate reserves {config.max_loras} adapter slots of {slot_blocks} KV blocks "
                             f"each, more than the {runner.num_blocks} blocks of the KV budget: raise "
                             "kv_cache_bytes or lower max_loras / max_lora_rank")
        return PoolConfig(
            num_gpu_blocks=runner.num_blocks, num_host_blocks=runner.num_host_blocks, block_size=config.block_size,
            block_bytes=block_bytes, policy=config.pool_policy,
            params=PolicyParams(h2d_bytes_per_s=runner.measure_h2d_bandwidth()),
            adapter_slots=config.max_loras, adapter_slot_blocks=slot_blocks,
            free_watermark_blocks=runner.num_blocks // 32, max_resident_adapters=config.max_loras)

    # ---- admission -----------------------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                     adapter: str | None = None, cache_salt: str = "") -> Request:
        """Validate and tokenize; raises InvalidRequestError (ContextLengthExceededError, UnknownAdapterError)
        and changes nothing. ``adapter`` names a registered adapter; None is the base model. Requests share
        cached KV only when their adapter version and ``cache_salt`` are equal."""
        handle = None if adapter is None else self.adapters.get(adapter)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: send token ids", param="prompt")
            ids = self.tokenizer.encode(prompt)
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
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} in the "
                f"completion). Please reduce the prompt or max_tokens.")
        if handle is not None and not self.pool.policy.adapter_slots:
            try:
                adapter_bytes = self.adapters.device_nbytes(handle.adapter_id)
            except KeyError:  # unloaded meanwhile
                raise UnknownAdapterError(handle.name) from None
            pool = self.pool
            need = pool.gpu.blocks_for_tokens(len(ids) + params.max_tokens) + pool.config.adapter_blocks(adapter_bytes)
            if need > self._request_blocks:
                raise ContextLengthExceededError(
                    f"{len(ids)} prompt tokens and max_tokens {params.max_tokens} with adapter `{adapter}` need "
                    f"{need} KV blocks (the adapter's weights included); the pool has {self._request_blocks}. "
                    "Please reduce the prompt or max_tokens.")
        if any(t >= self.arch.vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be inside the vocabulary", param="stop_token_ids")
        return Request(request_id, ids, params, eos_token_ids=self.eos_token_ids, adapter=handle,
                       cache_salt=cache_salt)

    def add(self, request: Request) -> None:
        self.scheduler.add(request)
        if self.tokenizer is not None:
            self._detokenizers[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.params.stop,
                request.params.skip_special_tokens, request.params.include_stop_str_in_output)

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
        work = self.scheduler.schedule()
        adapter_s = self.runner.apply_copy_ops(self.pool.take_copy_ops())
        if not work.items:
            return []
        for request, _ in work.items:
            if request.adapter_loaded and request.first_token_time is None:
                request.adapter_load_s += adapter_s
        start = time.perf_counter()
        sampling, result = self.runner.execute(work.items)
        sampled = {} if result is None else dict(zip([r.request_id for r in sampling], result.token_ids, strict=True))
        num_tokens = work.num_tokens
        if num_tokens >= 16:  # prefill-sized steps: what recomputing a token costs, for the pool's policy
            self.pool.observe_recompute(num_tokens, time.perf_counter() - start)
        advanced = self.scheduler.update(work, sampled)
        for request in advanced:
            if request.num_output_tokens == 1:
                self.ttft.add(request)
        logprobs = _logprobs_by_request(sampling, result)
        outputs = []
        for request in advanced:
            token = request.token_ids[-1]
            text = self._detokenize(request, token)
            outputs.append(_output(request, text, [token], logprobs.get(request.request_id)))
        return outputs

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


class Engine:
    """The public engine. ``add_request`` and ``abort`` are for asyncio callers (a background thread steps the
    core); ``generate`` runs requests to completion synchronously when that thread is not running."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore(config)
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self.dead_error: BaseException | None = None
        self._figures = self.core.pool_figures()  # republished by the engine thread, read by any thread
        self._figures_time = 0.0

    def num_unfinished(self) -> int:
        """Requests accepted and not yet finished (any thread)."""
        return len(self._streams)

    def pool_figures(self) -> dict[str, Any]:
        """The pool's latest figures (at most ~0.1 s old while the engine thread runs)."""
        if self._thread is None:
            self._figures = self.core.pool_figures()
        return self._figures

    def _publish_figures(self) -> None:
        now = time.monotonic()
        if now - self._figures_time >= 0.1:
            self._figures, self._figures_time = self.core.pool_figures(), now

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def add_adapter(self, name: str, path: str | Path) -> AdapterHandle:
        """Register a PEFT LoRA directory under ``name`` (a new version if the name exists); raises AdapterError
        with the reason when it cannot be served. Safe while serving: running requests are not stalled."""
        return self.core.adapters.register(name, path)

    def remove_adapter(self, name: str) -> None:
        """New requests for ``name`` fail (UnknownAdapterError); in-flight ones finish, then its memory is freed."""
        self.core.adapters.unregister(name)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat conversation under the model's chat template, ready for add_request/generate."""
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer or chat template", param="messages")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- offline -------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams],
                 adapters: str | None | Sequence[str | None] = None, cache_salt: str = "") -> list[Completion]:
        """Run all prompts to completion in continuous batches; results in prompt order. ``adapters`` names one
        adapter for all prompts or one per prompt (None: the base model); ``cache_salt`` as in add_request."""
        if self._thread is not None:
            raise RuntimeError("generate() cannot run while the async loop is running; use add_request()")
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        alist = [adapters] * len(prompts) if adapters is None or isinstance(adapters, str) else list(adapters)
        requests = [self.core.make_request(f"gen-{next(self._ids)}", p, sp, a, cache_salt)
                    for p, sp, a in zip(prompts, plist, alist, strict=True)]
        results = {r.request_id: Completion(r.request_id, r.prompt_token_ids, "", [], None, None, None)
                   for r in requests}
        pending = list(requests)
        while pending or self.core.has_work():
            while pending and len(self.core.scheduler.waiting) < self.config.max_waiting_requests:
                self.core.add(pending.pop(0))
            for out in self.core.step():
                _accumulate(results[out.request_id], out)
        return [results[r.request_id] for r in requests]

    # ---- async ---------------------------------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                    adapter: str | None = None, cache_salt: str = "") -> _Stream:
        """Validate (raising InvalidRequestError / ContextLengthExceededError / QueueFullError at once) and queue
        a request; returns an async iterator of its RequestOutputs, the last one with finished=True. Call from a
        running event loop. ``cache_salt``: only requests with the same salt share cached KV (per tenant)."""
        if self.dead_error is not None:
            raise EngineDeadError("the engine has stopped after an internal error")

        request_id = request_id or f"req-{next(self._ids)}"
        request = self.core.make_request(request_id, prompt, params, adapter, cache_salt)
        if len(self.core.scheduler.waiting) + self._inbox.qsize() >= self.config.max_waiting_requests:
            raise QueueFullError("the waiting queue is full; retry later")
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        stream = _Stream(self, request_id, asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._start()
        self._inbox.put(("add", request))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort" and its blocks are freed."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        checked = 0.0
        try:
            while not self._stopping.is_set():
                self._drain_inbox()
                self._publish_figures()
                if not self.core.has_work():
                    if time.monotonic() - checked >= IDLE_CHECK_S:  # the pool's invariants, while nothing runs
                        self.core.check_integrity()
                        checked = time.monotonic()
                    self._wake.wait(timeout=0.1)
                    self._wake.clear()
                    continue
                for out in self.core.step():
                    self._deliver(out)
        except BaseException as exc:  # the loop must not die silently: every waiting stream learns of it
            self.dead_error = exc
            for stream in list(self._streams.values()):
                stream.push_error(EngineDeadError(f"engine failed: {exc!r}"))
            self._streams.clear()
            raise

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.core.add(payload)
                except Exception as exc:  # QueueFullError or a duplicate id: that request alone fails
                    stream = self._streams.pop(payload.request_id, None)
                    if stream is not None:
                        stream.push_error(exc)
            else:
                out = self.core.abort(payload)
                if out is not None:
                    self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
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
    c.text += out.text
    c.token_ids.extend(out.token_ids)
    if out.logprobs is not None:
        c.logprobs = (c.logprobs or []) + out.logprobs
    c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
    c.num_cached_tokens = out.num_cached_tokens
