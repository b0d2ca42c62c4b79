"""The public engine: ``Engine`` wraps the core with a background thread for asyncio callers (each request an
async stream), a published snapshot for other threads, and a synchronous offline API (add/step, generate).
Imports nothing from the web stack."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from lora_server.config import EngineConfig
from lora_server.engine.adapter_surface import AdapterSurface
from lora_server.engine.admission import Prompt
from lora_server.engine.core import EngineCore
from lora_server.engine.openmp import release_openmp_workers
from lora_server.engine.outputs import Completion, RequestOutput
from lora_server.engine.reports import EngineSnapshot, ModelInfo, PoolReport
from lora_server.engine.request import NO_TENANT, EngineRequest, TenantShare
from lora_server.engine.tokenizer import Tokenizer
from lora_server.errors import (
    EngineDeadError,
    InvalidRequestError,
    LoraServerError,
    QueueFullError,
)
from lora_server.json_types import JsonObject, JsonValue, TemplateMessage, ToolDefinition
from lora_server.model.llama import LlamaModel
from lora_server.model.ranks import CollectiveCounts
from lora_server.sampling_params import SamplingParams
from lora_server.tools.prompt import render_tools_in_messages

IDLE_CHECK_S = 5.0  # how often an idle engine thread asserts the pool's integrity
log = logging.getLogger("lora_server")


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue a made request (Engine.submit)."""

    request: EngineRequest


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Stop a request (Engine.abort)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class CallOnEngineThread:
    """Run ``call`` between steps; its result or exception goes to ``done`` (Engine.check_integrity)."""

    call: Callable[[], None]
    done: Future[None]


InboxMessage = AddRequest | AbortRequest | CallOnEngineThread  # what other threads hand the engine thread


def _resident_pages(engine: weakref.ref[Engine]) -> Mapping[int, int]:
    """The engine's last published residency (adapter id -> table page); none once it is gone."""
    alive = engine()
    return {} if alive is None else alive.snapshot().resident_pages


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
        self.admission = self.core.admission  # requests are made from any thread
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue[InboxMessage] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self.adapters = AdapterSurface(  # registered, staged and removed from any thread
            self.core.adapters,
            self.core.loader,
            config.staging_workers,
            self._wake,
            functools.partial(_resident_pages, weakref.ref(self)),  # weak: an engine let go is freed at once
        )
        self.dead = threading.Event()
        self.dead_error: BaseException | None = None
        self._snapshot = self.core.snapshot()  # republished by the engine thread, read by any thread
        self._snapshot_time = 0.0

    # ---- what any thread may read ----------------------------------------------------------------------------

    def num_unfinished(self) -> int:
        """Requests accepted and not yet finished (any thread)."""
        return len(self._streams)

    def snapshot(self) -> EngineSnapshot:
        """Queues, residency and pool figures as the engine thread last published them (any thread)."""
        if self._thread is None:
            self._snapshot = self.core.snapshot()
        return self._snapshot

    def pool_report(self) -> PoolReport:
        return self.snapshot().pool

    def _publish(self) -> None:
        now = time.monotonic()
        if now - self._snapshot_time >= 0.1:
            self._snapshot, self._snapshot_time = self.core.snapshot(), now

    def describe(self) -> ModelInfo:
        return self.core.describe()

    def collectives(self) -> CollectiveCounts | None:
        """With tensor parallelism, rank 0's count of its collectives (calls and bytes by kind since its last
        ``reset``); None on one rank (engine thread or offline)."""
        return self.core.collectives()

    @property
    def model(self) -> LlamaModel:
        """The resident model as loaded (its layers, quantized as they are held), for inspection: the engine thread
        runs it; nothing outside may call or change it."""
        return self.core.model

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Token ids of a prompt's text (blocking; see EngineCore.encode: errors name ``param``);
        ``add_special_tokens``: BOS first, where the model adds one."""
        return self.admission.encode(text, add_special_tokens, param)

    def chat_prompt(
        self,
        messages: list[TemplateMessage],
        tools: list[ToolDefinition] | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        documents: list[JsonObject] | None = None,
        continue_final_message: bool = False,
        variables: Mapping[str, JsonValue] | None = None,
    ) -> list[int]:
        """Token ids of a chat conversation under the model's chat template, ready for make_request/generate
        (``add_special_tokens``: BOS before what the template writes, where the model adds one); the other
        arguments as in ``render_chat``."""
        text = self.render_chat(messages, tools, add_generation_prompt, documents, continue_final_message, variables)
        return self.encode(text, add_special_tokens, "messages")

    def template_reads(self) -> frozenset[str]:
        """The variables the chat template reads (Tokenizer.template_variables); InvalidRequestError (param
        ``messages``) when there is no template or it does not parse."""
        try:
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer or chat template")
            return self.tokenizer.template_variables
        except ValueError as exc:
            raise InvalidRequestError(str(exc)[:500], param="messages") from None

    def template_shows(self, role: str, field: str) -> bool:
        """Whether the chat template writes a ``role`` message's ``field`` (Tokenizer.template_shows); False
        without a template."""
        return (
            self.tokenizer is not None
            and self.tokenizer.chat_template is not None
            and (self.tokenizer.template_shows(role, field))
        )

    def render_chat(
        self,
        messages: list[TemplateMessage],
        tools: list[ToolDefinition] | None = None,
        add_generation_prompt: bool = True,
        documents: list[JsonObject] | None = None,
        continue_final_message: bool = False,
        variables: Mapping[str, JsonValue] | None = None,
    ) -> str:
        """A chat conversation as the model's chat template writes it (Tokenizer.apply_chat_template: ``documents``,
        ``continue_final_message`` and template ``variables`` as transformers passes them).

        ``tools`` (function tools as JSON schemas) and the messages' tool-call history (an assistant's
        ``tool_calls`` with their arguments as objects, ``tool`` messages) reach a template that reads ``tools`` as
        transformers' ``apply_chat_template(messages, tools=tools)`` passes them; for a template that does not,
        they are written into the messages first (lora_server.tools.prompt). InvalidRequestError (param
        ``messages``) when there is no template or it rejects the conversation (raise_exception)."""
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer or chat template", param="messages")
        try:
            if not self.tokenizer.template_renders_tools:
                messages, tools = render_tools_in_messages(messages, tools), None
            return self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=documents,
                continue_final_message=continue_final_message,
                variables=variables,
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc)[:500], param="messages") from None

    # ---- offline -------------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams],
        adapters: str | None | Sequence[str | None] = None,
        cache_salt: str = "",
    ) -> list[Completion]:
        """Run all prompts to completion in continuous batches; results in prompt order. ``adapters`` names one
        adapter for all prompts or one per prompt (None: the base model); ``cache_salt`` as in make_request. A
        request whose serving failed comes back with finish_reason "error" and ``error`` set. RuntimeError while
        requests queued with ``add`` are in flight (their outputs are ``step``'s caller's, not generate's)."""
        self._offline()
        if self.has_work():
            raise RuntimeError("generate runs alone: requests queued with add() are in flight; step them to the end")
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        alist = [adapters] * len(prompts) if adapters is None or isinstance(adapters, str) else list(adapters)
        requests: list[EngineRequest] = []
        try:
            for p, sp, a in zip(prompts, plist, alist, strict=True):
                requests.append(self.admission.make_request(f"gen-{next(self._ids)}", p, sp, a, cache_salt))
        except LoraServerError:
            for r in requests:
                self.admission.discard(r)
            raise
        results = {
            r.request_id: Completion(r.request_id, list(r.prompt_token_ids), "", [], None, None, None) for r in requests
        }
        pending = list(requests)
        while pending or self.has_work():
            while pending and self.core.num_waiting < self.config.max_waiting_requests:
                self.add(pending.pop(0))
            for out in self.step():
                _accumulate(results[out.request_id], out)
        return [results[r.request_id] for r in requests]

    def full_prompt_logprobs(self, prompt: Sequence[int], adapter: str | None = None) -> torch.Tensor:
        """Offline, with no request in flight: the model's next-token distributions over a token prompt, the whole
        vocabulary (prompt_logprobs gives the top k). Returns [len(prompt) - 1, vocab_size] float32 on the CPU, row
        j the log-probabilities after prompt[: j + 1] (row j scores prompt[j + 1]), under ``adapter`` (None: the
        base model), computed by the serving path itself (quantized weights, KV cache format, adapter kernels);
        see EngineCore.full_prompt_logprobs. Errors as make_request; RuntimeError while requests are in flight."""
        self._offline()
        return self.core.full_prompt_logprobs(f"score-{next(self._ids)}", prompt, adapter)

    def add(self, request: EngineRequest) -> None:
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

    def make_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        adapter: str | None = None,
        cache_salt: str = "",
        request_id: str | None = None,
        *,
        tenant: TenantShare = NO_TENANT,
        priority: int = 0,
        compile_grammar: bool = True,
        arrival_time: float | None = None,
        adapter_wait_s: float = 0.0,
    ) -> EngineRequest:
        """Validate and tokenize, from any thread (the server calls it off the event loop); raises
        InvalidRequestError / ContextLengthExceededError / UnknownAdapterError and changes nothing. Returns the
        request's description (frozen: the engine keeps its own state of the request, and what that state tells
        comes back on the outputs); it holds its adapter version: ``submit`` it or ``discard`` it. ``cache_salt``:
        only requests with the same salt share cached KV (per tenant). ``tenant``: whom it is served for, with the
        tenant's weight and cap of running requests (waiting requests are admitted by weighted fair sharing across
        tenants, unless the config turns it off); ``priority``: lower values are admitted first among the tenant's
        waiting requests. ``compile_grammar`` False: a structured output is checked (its limits, its schema) but
        compiled only by ``attach_grammars``, which must then run before ``submit``. ``arrival_time``: when it
        arrived (time.monotonic; None: now), where its queue time and timings start; ``adapter_wait_s``: how long
        it had waited for its adapter by then (an adapter registered on its first request)."""
        return self.admission.make_request(
            request_id or f"req-{next(self._ids)}",
            prompt,
            params,
            adapter,
            cache_salt,
            tenant=tenant,
            priority=priority,
            compile_grammar=compile_grammar,
            arrival_time=arrival_time,
            adapter_wait_s=adapter_wait_s,
        )

    async def attach_grammars(self, requests: Sequence[EngineRequest]) -> list[EngineRequest]:
        """The requests, those made without their grammar compiled replaced by copies with their matcher (compiled
        in the grammar pool, each within the config's grammar_compile_timeout, without holding a thread of the
        caller's); submit these instead of the ones passed (they hold the same adapter versions).
        InvalidRequestError when one does not compile or takes longer: the requests passed are still as made."""
        attached = list(requests)
        pending = [
            (i, r.params.structured)
            for i, r in enumerate(requests)
            if r.params.structured is not None and r.grammar is None
        ]
        if not pending:
            return attached
        structured = self.admission.structured_outputs()
        matchers = [await structured.matcher_async(constraint) for _, constraint in pending]
        for (i, _), matcher in zip(pending, matchers, strict=True):
            attached[i] = dataclasses.replace(attached[i], grammar=matcher)
        return attached

    def discard(self, request: EngineRequest) -> None:
        """Let go of a made request that will not be submitted."""
        self.admission.discard(request)

    def submit(self, request: EngineRequest) -> _Stream:
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
        self._inbox.put(AddRequest(request))
        self._wake.set()
        return stream

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        adapter: str | None = None,
        cache_salt: str = "",
    ) -> _Stream:
        """make_request and submit in one call (on the event loop)."""
        return self.submit(self.make_request(prompt, params, adapter, cache_salt, request_id))

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort" and its blocks are freed."""
        self._inbox.put(AbortRequest(request_id))
        self._wake.set()

    def check_integrity(self, timeout: float = 30.0) -> None:
        """The pool's and the scheduler's invariants, checked on the engine thread (AssertionError if broken)."""
        if self._thread is None:
            self.core.check_integrity()
            return
        done: Future[None] = Future()
        self._inbox.put(CallOnEngineThread(self.core.check_integrity, done))
        self._wake.set()
        done.result(timeout)

    def start(self) -> None:
        """Start the engine thread (idempotent; submit starts it too). From here the engine thread runs the model:
        the calling thread gives back its OpenMP workers (lora_server.engine.openmp), which would otherwise slow
        every parallel op of the engine thread on a small CPU."""
        with self._thread_lock:
            if self._thread is None:
                if self.core.on_cpu:
                    release_openmp_workers()
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

    def close(self) -> None:
        """Stop the engine thread, then the tensor-parallel workers if any (the engine serves no more; its device
        state is freed with it)."""
        self.shutdown()
        self.core.close()

    def _loop(self) -> None:
        checked = 0.0
        try:
            while not self._stopping.is_set():
                self._drain_inbox()
                self._publish()
                if not self.core.has_work():
                    self.core.idle()
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
            return self.core.snapshot()
        except Exception:  # noqa: BLE001 (state may be broken: keep the last published one)
            return self._snapshot

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, AddRequest):
                request = message.request
                try:
                    self.core.add(request)
                except (LoraServerError, ValueError) as exc:  # a full queue or a duplicate id: that request alone
                    self.admission.discard(request)
                    stream = self._streams.pop(request.request_id, None)
                    if stream is not None:
                        stream.push_error(exc)
            elif isinstance(message, AbortRequest):
                out = self.core.abort(message.request_id)
                if out is not None:
                    self._deliver(out)
            else:
                try:
                    message.call()
                    message.done.set_result(None)
                except Exception as exc:  # noqa: BLE001 (handed to the caller)
                    message.done.set_exception(exc)

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
    if out.prompt_logprobs is not None:
        c.prompt_logprobs = out.prompt_logprobs
