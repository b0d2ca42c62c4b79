"""Serving /v1/chat/completions and /v1/completions on the engine: requests in, OpenAI-shaped JSON or server-sent
events out. The HTTP layer resolves the tenant and the adapter first; this module never sees keys.

A request goes through three stages so that the event loop never tokenizes: ``prepare_chat`` /
``prepare_completion`` (blocking: chat template, tokenization, validation, a structured output's limits checked;
the server runs them in a worker thread), ``attach_grammars`` (the structured output compiled in the grammar pool;
the server calls it once the tenant's limits let the request in) and ``run`` (on the event loop: submit, then
stream or collect). Whatever happens after ``prepare``, the request's ``Meter`` is settled exactly once with the
tokens the engine produced for it, dropped streams and disconnected clients included."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from lora_server.engine import Engine, Prompt
from lora_server.engine.outputs import RequestOutput, TokenLogprob
from lora_server.engine.request import NO_TENANT, EngineRequest, TenantShare, with_client_salt
from lora_server.engine.tokenizer import Tokenizer
from lora_server.errors import InvalidRequestError, LoraServerError
from lora_server.sampling_params import SamplingParams
from lora_server.server.chat_prompt import chat_prompt, check_tool_schemas, truncated
from lora_server.server.logprobs import LogprobsFormatter
from lora_server.server.metrics import Metrics, RequestSeries
from lora_server.server.protocol import ChatCompletionRequest, CompletionRequest
from lora_server.server.tool_calls import ChoiceToolCalls
from lora_server.tools.calling import ToolCalling, plan_tool_calls
from lora_server.tools.parsers import TOOL_PARSERS, ToolParser, parser_for_template

# the most prompt-logprob entries one request's answer holds (tokens x (top-k + 1) x n): a whole 8,192-token prompt
# with its top 20, once
MAX_PROMPT_LOGPROBS = 1 << 18


class Meter(Protocol):
    """A tenant's account of one HTTP request: ``settle`` is called once, when it has ended, with the tokens it
    used (blocking: the server calls it in a worker thread)."""

    def settle(self, prompt_tokens: int, completion_tokens: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Arrival:
    """When an HTTP request arrived (time.monotonic) and how long resolving its model took, which is time it waited
    for its adapter (one registered on its first request: its files read and hashed): where its TTFT starts."""

    time: float = field(default_factory=time.monotonic)
    adapter_wait_s: float = 0.0


@dataclass
class Prepared:
    """A validated HTTP request: its engine requests (``n`` per prompt, in prompt order), made but not yet submitted
    (each holds its adapter version until submitted or discarded)."""

    kind: str  # "chat" | "completion"
    response_id: str  # the answer's id: "chatcmpl-" or "cmpl-" and the HTTP request's id
    requests: list[EngineRequest]
    n: int
    stream: bool
    include_usage: bool
    echo: list[str] | None = None  # echo: each prompt's text (chat: the final message's), which its choices start with
    echo_logprobs: bool = False  # the logprobs object starts with the prompt's tokens (echo with logprobs)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs shown, with their top-k; None: not shown
    tool_calling: ToolCalling | None = None  # how a chat request's output is read for tool calls

    def choice(self, index: int, out: RequestOutput) -> _Choice:
        """A choice's record, made at its first output."""
        tools = None if self.tool_calling is None else ChoiceToolCalls(self.tool_calling.reader())
        return _Choice(index, out.num_prompt_tokens, out.num_cached_tokens, tools=tools)

    @property
    def prompt_tokens(self) -> int:
        """Each prompt counts once, however many choices (n) it produces."""
        return sum(r.num_prompt_tokens for r in self.requests[:: self.n])

    @property
    def max_tokens(self) -> int:
        """The most tokens it can use: its prompts plus max_tokens for every choice."""
        return self.prompt_tokens + sum(r.params.max_tokens for r in self.requests)


@dataclass
class _Choice:
    index: int
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens served from cached KV
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (None for the first)
    sent_chars: int = 0  # characters streamed so far (echoed prompt included): the next text_offset
    echoed: bool = False  # its stream has sent the echoed prompt
    tools: ChoiceToolCalls | None = None  # its output read for tool calls

    def chat_message(self) -> tuple[dict[str, Any], str | None]:
        """A whole chat answer's message and finish reason (its tool calls read from its whole text: call once)."""
        if self.tools is None:
            return {"role": "assistant", "content": self.text}, self.finish_reason
        self.tools.deltas(self.text, finished=True)
        return self.tools.message(), self.tools.finish_reason(self.finish_reason)

    def chat_deltas(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The stream deltas of its next output."""
        if self.tools is None:
            return [{"content": out.text}] if out.text else []
        return self.tools.deltas(out.text, out.finished)


class ClientDisconnected(Exception):
    """The client of a non-streaming request went away; its requests were aborted."""


class OpenAIServing:
    def __init__(self, engine: Engine, metrics: Metrics, tool_call_parser: str | None = None) -> None:
        """``tool_call_parser``: the model's tool-call format (lora_server.tools.parsers), else chosen from its chat
        template."""
        self.engine, self.metrics = engine, metrics
        self.logprobs = LogprobsFormatter(engine.tokenizer)
        self.tool_parser = model_tool_parser(engine.tokenizer, tool_call_parser)

    # ---- stage 1 (blocking, in a worker thread) -------------------------------------------------------------

    def prepare_chat(
        self,
        req: ChatCompletionRequest,
        adapter: str | None,
        cache_salt: str,
        tenant: TenantShare = NO_TENANT,
        request_id: str | None = None,
        arrival: Arrival | None = None,
    ) -> Prepared:
        """``tenant``: whom it is served for, with the tenant's share of the engine (weight, cap); ``request_id``:
        the HTTP request's (x-request-id), which the answer's id carries (default: a new one); ``arrival``: when it
        arrived (default: now)."""
        tool_request = req.tool_request()
        tools = None if tool_request is None else tool_request.definitions()
        check_tool_schemas(self.engine, tools)  # bounded before anything walks them (the call grammar, the prompt)
        calling = None if tool_request is None else plan_tool_calls(tool_request, self.tool_parser)
        prompt = chat_prompt(self.engine, req, tools)
        params = self._bad_words(req, req.to_params(self.engine.max_model_len - len(prompt)))
        if calling is not None:
            params = _with_tool_calling(params, calling)
            if req.echo_text is not None:
                raise InvalidRequestError("echo cannot be combined with tools", param="echo")
        prepared = self._prepare("chat", [prompt], params, req, adapter, cache_salt, tenant, request_id, arrival)
        prepared.prompt_logprobs = req.prompt_logprobs
        prepared.tool_calling = calling
        prepared.echo = None if req.echo_text is None else [req.echo_text]
        return prepared

    def prepare_completion(
        self,
        req: CompletionRequest,
        adapter: str | None,
        cache_salt: str,
        tenant: TenantShare = NO_TENANT,
        request_id: str | None = None,
        arrival: Arrival | None = None,
    ) -> Prepared:
        given = req.prompts()
        prompts: list[Prompt] = list(given)
        if self.engine.tokenizer is not None:  # tokenized once here; the engine takes the ids
            special = req.add_special_tokens is not False
            prompts = [self.engine.encode(p, special) if isinstance(p, str) and p else p for p in prompts]
        else:
            for field in ("add_special_tokens", "truncate_prompt_tokens"):  # bad_words: _bad_words says
                if getattr(req, field) is not None:
                    raise InvalidRequestError(f"{field} needs the model's tokenizer", param=field)
        if req.truncate_prompt_tokens is not None:  # a text left here is empty (the engine refuses it)
            keep = req.truncate_prompt_tokens
            prompts = [
                p if isinstance(p, str) else truncated(list(p), keep, self.engine.max_model_len) for p in prompts
            ]
        longest = max(len(p) for p in prompts)
        params = self._bad_words(req, req.to_params(self.engine.max_model_len - longest))
        prepared = self._prepare("completion", prompts, params, req, adapter, cache_salt, tenant, request_id, arrival)
        if req.echo:  # a text prompt as it was sent; token ids as their text
            prepared.echo = [p if isinstance(p, str) else self._text(p) for p in given]
        prepared.echo_logprobs = req.echoes_logprobs
        # vLLM shows the prompt's logprobs on each choice when asked, and with echo and logprobs
        prepared.prompt_logprobs = (
            req.logprobs if req.prompt_logprobs is None and req.echoes_logprobs else req.prompt_logprobs
        )
        return prepared

    def _bad_words(self, req: ChatCompletionRequest | CompletionRequest, params: SamplingParams) -> SamplingParams:
        """``params`` with the request's bad_words as token sequences, as vLLM bans them: each word's tokens, and
        those of the word after a space where that makes a different first token of the same length."""
        if not req.bad_words:
            return params
        if self.engine.tokenizer is None:
            raise InvalidRequestError("bad_words needs the model's tokenizer", param="bad_words")
        sequences: list[tuple[int, ...]] = []
        for word in req.bad_words:
            plain = self.engine.encode(word.lstrip(), False, "bad_words")
            spaced = self.engine.encode(" " + word.lstrip(), False, "bad_words")
            if not plain or not spaced:
                raise InvalidRequestError("bad_words must not hold an empty word", param="bad_words")
            sequences.append(tuple(plain))
            if spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(tuple(spaced))
        return replace(params, bad_words=tuple(sequences))

    def _text(self, token_ids: list[int]) -> str:
        tok = self.engine.tokenizer
        return "" if tok is None else tok.decode(token_ids, skip_special_tokens=False)

    def _prepare(
        self,
        kind: str,
        prompts: list[Prompt],
        params: SamplingParams,
        req: ChatCompletionRequest | CompletionRequest,
        adapter: str | None,
        cache_salt: str,
        tenant: TenantShare,
        request_id: str | None,
        arrival: Arrival | None,
    ) -> Prepared:
        n = req.n
        arrival = arrival or Arrival()
        request_id = request_id or req.request_id
        response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id or uuid.uuid4().hex}"
        cache_salt = with_client_salt(cache_salt, req.cache_salt)  # within the tenant's own
        unique = uuid.uuid4().hex[:8]  # engine ids stay unique when a client sends one x-request-id twice
        requests: list[EngineRequest] = []
        try:
            for p_index, prompt in enumerate(prompts):
                for i in range(n):
                    sub = params if params.seed is None or n == 1 else replace(params, seed=_seed(params.seed + i))
                    requests.append(
                        self.engine.make_request(
                            prompt,
                            sub,
                            adapter,
                            cache_salt,
                            f"{response_id}-{unique}-{p_index}-{i}",
                            tenant=tenant,
                            priority=req.priority,
                            compile_grammar=False,  # after admission: attach_grammars
                            arrival_time=arrival.time,
                            adapter_wait_s=arrival.adapter_wait_s if adapter is not None else 0.0,
                        )
                    )
            _check_prompt_logprobs(requests, params)
        except LoraServerError:
            self.discard(requests)
            raise
        return Prepared(kind, response_id, requests, n, req.stream, _include_usage(req))

    async def attach_grammars(self, prepared: Prepared) -> None:
        """Compile the prepared requests' grammars (``prepare`` only checked them), on the event loop without
        holding a worker thread; InvalidRequestError (400) when one fails or exceeds the compile budget (then
        ``prepared`` keeps the requests as made)."""
        prepared.requests = await self.engine.attach_grammars(prepared.requests)

    def discard(self, requests: list[EngineRequest]) -> None:
        for r in requests:
            self.engine.discard(r)

    # ---- stage 2 (event loop) -------------------------------------------------------------------------------

    async def run(
        self, prepared: Prepared, model: str, meter: Meter | None, disconnected: Callable[[], Awaitable[None]]
    ) -> dict[str, Any] | AsyncIterator[str]:
        """Submit every request (all or none: a full queue aborts those already in) and answer: a JSON body, or
        for streams an iterator of server-sent events, returned once the first output has come (so that a request
        that fails before its first token, an adapter whose files cannot be read, is an HTTP error, not a 200 and
        an error event). ``disconnected()`` is awaited until the answer or the first output (later, a stream learns
        of a gone client when its generator is closed); it completes when the client goes away: the requests are
        aborted at once and ClientDisconnected is raised."""
        streams: list = []
        try:
            for r in prepared.requests:
                streams.append(self.engine.submit(r))
        except LoraServerError:
            for s in streams:
                await s.aclose()
            self.discard(prepared.requests[len(streams) + 1 :])  # submit discarded the one it refused
            raise
        request_id = prepared.response_id
        created = int(time.time())
        if prepared.stream:
            merged = self._merged(prepared, streams)
            try:
                first = await _first_or_gone(merged, disconnected)
            except BaseException:
                await merged.aclose()  # aborts the requests
                _settle(meter, {}, prepared.n)
                raise
            return self._sse(prepared, request_id, created, model, merged, first, meter)
        choices: dict[int, _Choice] = {}
        collect = asyncio.ensure_future(self._collect(prepared, streams, choices))
        gone = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait([collect, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client left: closing the merged streams aborts every request
                collect.cancel()
                await asyncio.gather(collect, return_exceptions=True)
            _settle(meter, choices, prepared.n)
        if not collect.done() or collect.cancelled():
            raise ClientDisconnected
        collect.result()  # re-raises an engine error
        return self._final(prepared, request_id, created, model, [choices[i] for i in sorted(choices)])

    async def _tracked(
        self, index: int, stream, series: RequestSeries, arrival: float
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The stream's outputs, its latencies observed in ``series`` (its adapter's), from its ``arrival``."""
        start = last = first_token = arrival
        first = True
        async for out in stream:
            now = time.monotonic()
            if out.token_ids:
                (series.ttft if first else series.itl).observe(now - (start if first else last))
                if first:
                    first_token = now
                first, last = False, now
            if out.finished:
                series.e2e.observe(now - start)
                if out.num_output_tokens > 1:
                    series.tpot.observe((last - first_token) / (out.num_output_tokens - 1))
                if out.queue_time_s is not None:
                    series.queue.observe(out.queue_time_s)
                if out.timings is not None and out.timings.first_token is not None:
                    series.adapter.observe(out.timings.adapter_wait_s + out.timings.adapter_load_s)
                self.metrics.prompt_tokens.inc(out.num_prompt_tokens)
                self.metrics.generation_tokens.inc(out.num_output_tokens)
                self.metrics.request_success.inc()
            yield index, out

    async def _merged(self, prepared: Prepared, streams: list) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Outputs of several streams as they come; closing this aborts whatever is still running."""
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()
        series = [self.metrics.series(None if r.adapter is None else r.adapter.name) for r in prepared.requests]

        async def pump(index: int, stream) -> None:
            try:
                async for item in self._tracked(index, stream, series[index], prepared.requests[index].arrival_time):
                    await queue.put(item)
                await queue.put(None)
            except BaseException as exc:  # handed to the consumer, which re-raises it
                await queue.put(exc)

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            for s in streams:
                await s.aclose()

    async def _collect(self, prepared: Prepared, streams: list, choices: dict[int, _Choice]) -> None:
        merged = self._merged(prepared, streams)
        try:
            async for index, out in merged:
                if index not in choices:
                    choices[index] = prepared.choice(index, out)
                c = choices[index]
                _add(c, out)
        finally:
            await merged.aclose()

    async def _sse(
        self,
        prepared: Prepared,
        request_id: str,
        created: int,
        model: str,
        merged: AsyncGenerator[tuple[int, RequestOutput], None],
        first: tuple[int, RequestOutput] | None,
        meter: Meter | None,
    ) -> AsyncIterator[str]:
        """The events of ``merged`` (the request's streams merged), whose first output ``first`` was already taken
        (None: there was none)."""
        kind = prepared.kind
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        choices: dict[int, _Choice] = {}
        base = {"id": request_id, "object": obj, "created": created, "model": model}
        try:
            if kind == "chat":
                for i in range(len(prepared.requests)):
                    yield _event(
                        {
                            **base,
                            "choices": [
                                {
                                    "index": i,
                                    "delta": {"role": "assistant", "content": (prepared.echo or [""])[0]},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                        }
                    )
            async for index, out in _chain(first, merged):
                if index not in choices:
                    choices[index] = prepared.choice(index, out)
                c = choices[index]
                echo = kind == "completion" and prepared.echo is not None and not c.echoed
                _add(c, out)
                if kind == "chat":
                    for choice in self._chat_chunk_choices(c, out):
                        yield _event({**base, "choices": [choice]})
                    continue
                if not out.text and not out.finished and not out.logprobs and not echo:
                    continue
                text_choice: dict[str, Any] = {
                    "index": index,
                    "finish_reason": out.finish_reason if out.finished else None,
                }
                text_choice["text"], text_choice["logprobs"] = self._completion_delta(prepared, c, out, echo)
                if out.finished:
                    text_choice["stop_reason"] = out.stop_reason
                yield _event({**base, "choices": [text_choice]})
            if prepared.include_usage:
                yield _event(
                    {**base, "choices": [], "usage": _usage([choices[i] for i in sorted(choices)], prepared.n)}
                )
        except LoraServerError as exc:  # after the stream started, an error arrives as an event
            yield _event(
                {"error": {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.code}}
            )
        finally:  # also when the client dropped the stream (the generator is closed): abort, then settle
            await merged.aclose()
            _settle(meter, choices, prepared.n)
        yield "data: [DONE]\n\n"

    def _completion_delta(
        self, prepared: Prepared, c: _Choice, out: RequestOutput, echo: bool
    ) -> tuple[str, dict[str, Any] | None]:
        """A streamed completions choice's text and logprobs for ``out``; the choice's first carries the echoed
        prompt (and its tokens' logprobs with echo and logprobs)."""
        text = out.text
        entries: list[tuple[int, TokenLogprob | None]] = [(e.token_id, e) for e in out.logprobs or []]
        if echo:
            assert prepared.echo is not None
            text = prepared.echo[c.index // prepared.n] + text
            entries = self._prompt_entries(prepared, c) + entries
            c.echoed = True
        k = prepared.requests[c.index].params.logprobs
        logprobs = None if k is None else self.logprobs.completion(entries, k, c.sent_chars)
        c.sent_chars += len(text)
        return text, logprobs

    def _prompt_entries(self, prepared: Prepared, c: _Choice) -> list[tuple[int, TokenLogprob | None]]:
        """The choice's prompt tokens with their logprobs, when the logprobs object echoes them."""
        if not prepared.echo_logprobs:
            return []
        assert c.prompt_logprobs is not None, "echo with logprobs computes the prompt's logprobs"
        return list(zip(prepared.requests[c.index].prompt_token_ids, c.prompt_logprobs, strict=True))

    def _chat_chunk_choices(self, c: _Choice, out: RequestOutput) -> list[dict[str, Any]]:
        """The chunks' choices for a chat choice's next output: one per delta (text, or a piece of a tool call),
        its logprobs on the first, the finish reason on the last; none when there is nothing to tell."""
        deltas = c.chat_deltas(out)
        lp = self.logprobs.chat(out.logprobs) if out.logprobs else None
        if not deltas and not out.finished and lp is None:
            return []
        choices: list[dict[str, Any]] = [
            {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None} for delta in deltas or [{}]
        ]
        choices[0]["logprobs"] = lp
        if out.finished:
            reason = out.finish_reason if c.tools is None else c.tools.finish_reason(out.finish_reason)
            choices[-1]["finish_reason"] = reason
            choices[-1]["stop_reason"] = out.stop_reason
        return choices

    def _final(
        self, prepared: Prepared, request_id: str, created: int, model: str, choices: list[_Choice]
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": request_id,
            "created": created,
            "model": model,
            "usage": _usage(choices, prepared.n),
        }
        shown = prepared.prompt_logprobs
        if prepared.kind == "chat":
            body["object"] = "chat.completion"
            body["choices"] = []
            for c in choices:
                message, reason = c.chat_message()
                if prepared.echo is not None:  # chat echo: the final message's text, then the answer's
                    message["content"] = prepared.echo[0] + (message.get("content") or "")
                body["choices"].append(
                    {
                        "index": c.index,
                        "message": message,
                        "logprobs": self.logprobs.chat(c.logprobs) if c.logprobs else None,
                        "finish_reason": reason,
                        "stop_reason": c.stop_reason,
                    }
                )
            if shown is not None:  # vLLM's: one list for the response (every choice has the same prompt)
                body["prompt_logprobs"] = self.logprobs.prompt(choices[0].prompt_logprobs or [], shown)
            return body
        body["object"] = "text_completion"
        body["choices"] = []
        for c in choices:
            k = prepared.requests[c.index].params.logprobs
            entries = self._prompt_entries(prepared, c) + [(e.token_id, e) for e in c.logprobs]
            choice = {
                "index": c.index,
                "text": c.text if prepared.echo is None else prepared.echo[c.index // prepared.n] + c.text,
                "logprobs": None if k is None else self.logprobs.completion(entries, k),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if shown is not None:
                choice["prompt_logprobs"] = self.logprobs.prompt(c.prompt_logprobs or [], shown)
            body["choices"].append(choice)
        return body


def _seed(seed: int) -> int:
    """A choice's seed (the request's + its index), kept in the signed 64-bit range."""
    return (seed + 2**63) % 2**64 - 2**63


def model_tool_parser(tokenizer: Tokenizer | None, name: str | None) -> ToolParser | None:
    """The tool-call format of the served model: ``name``'s (``--tool-call-parser``), else the one its chat
    template shows (None: unknown, or no template)."""
    if name is not None:
        return TOOL_PARSERS[name]
    if tokenizer is None or tokenizer.chat_template is None:
        return None
    try:
        return parser_for_template(tokenizer.chat_template, tokenizer.template_renders_tools)
    except ValueError:  # a template that does not parse: every chat request fails on it anyway
        return None


def _with_tool_calling(params: SamplingParams, calling: ToolCalling) -> SamplingParams:
    """The sampling parameters of a request whose output is read for tool calls: its output follows the call
    grammar if the plan has one, and is detokenized with special tokens where the format's markers are some. An
    output constraint of the request's own would keep the model from calling (a 400 naming it)."""
    if params.structured is not None:
        raise InvalidRequestError(
            f'{params.structured.param} cannot be combined with tools unless tool_choice is "none"',
            param=params.structured.param,
        )
    skip = params.skip_special_tokens and not calling.special_tokens_in_text
    return replace(params, structured=calling.constraint, skip_special_tokens=skip)


def _include_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _add(c: _Choice, out: RequestOutput) -> None:
    c.text += out.text
    c.token_ids.extend(out.token_ids)
    c.logprobs.extend(out.logprobs or [])
    if out.prompt_logprobs is not None:
        c.prompt_logprobs = out.prompt_logprobs
    if out.finished:
        c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason


def _usage(choices: list[_Choice], n: int) -> dict[str, Any]:
    prompt = sum(c.prompt_tokens for c in choices[:: max(1, n)])
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(c.cached_tokens for c in choices[:: max(1, n)])
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _check_prompt_logprobs(requests: list[EngineRequest], params: SamplingParams) -> None:
    """Refuse prompt logprobs whose answer would hold more than MAX_PROMPT_LOGPROBS entries (each prompt token's
    logprob and its top-k, for each of the n choices of each prompt): a small body could otherwise ask for an
    answer of hundreds of MB (8,000 tokens, top 20 and n 16: 2.7 million entries)."""
    k = params.prompt_logprobs
    if k is None:
        return
    entries = sum(r.num_prompt_tokens * (k + 1) for r in requests)
    if entries > MAX_PROMPT_LOGPROBS:
        raise InvalidRequestError(
            f"prompt logprobs of {entries:,} entries (prompt tokens x (top-k + 1) x n) asked for; at most "
            f"{MAX_PROMPT_LOGPROBS:,} in one request: lower prompt_logprobs (or logprobs with echo) or n",
            param="prompt_logprobs",
        )


async def _first_or_gone(
    merged: AsyncGenerator[tuple[int, RequestOutput], None], disconnected: Callable[[], Awaitable[None]]
) -> tuple[int, RequestOutput] | None:
    """``merged``'s first output (None: it ended without one), its error, or ClientDisconnected when the client
    goes away first."""
    first = asyncio.ensure_future(anext(merged, None))
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([first, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not first.done():
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
    if first.cancelled():
        raise ClientDisconnected
    return first.result()


async def _chain(
    first: tuple[int, RequestOutput] | None, rest: AsyncIterator[tuple[int, RequestOutput]]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    if first is not None:
        yield first
        async for item in rest:
            yield item


def _settle(meter: Meter | None, choices: dict[int, _Choice], n: int) -> None:
    """Hand the request's real usage to its meter off the event loop (the store may be slow or down)."""
    if meter is None:
        return
    usage = _usage([choices[i] for i in sorted(choices)], n)
    asyncio.get_running_loop().run_in_executor(None, meter.settle, usage["prompt_tokens"], usage["completion_tokens"])


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
