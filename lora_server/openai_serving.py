"""Serving /v1/chat/completions and /v1/completions on the engine: requests in, OpenAI-shaped JSON or server-sent
events out. The HTTP layer resolves the adapter and the tenant first; this module never sees keys."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from lora_server.engine import Engine, Prompt
from lora_server.errors import LoraServerError
from lora_server.metrics import Metrics
from lora_server.outputs import RequestOutput, TokenLogprob
from lora_server.protocol import ChatCompletionRequest, CompletionRequest
from lora_server.sampling_params import SamplingParams

UsageHook = Callable[[int, int], None]  # (prompt tokens, completion tokens) once a request has ended


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


class OpenAIServing:
    def __init__(self, engine: Engine, model_id: str, metrics: Metrics) -> None:
        self.engine, self.model_id, self.metrics = engine, model_id, metrics

    # ---- entry points --------------------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, adapter: str | None, model: str,
                   on_usage: UsageHook | None = None, cache_salt: str = "") -> dict[str, Any] | AsyncIterator[str]:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        prompt = self.engine.chat_prompt(messages)
        params = req.to_params(self.engine.max_model_len - len(prompt))
        return await self._run("chat", [prompt], params, req.n, req.stream,
                               bool(req.stream_options and req.stream_options.include_usage), adapter, model, on_usage,
                               cache_salt)

    async def completion(self, req: CompletionRequest, adapter: str | None, model: str,
                         on_usage: UsageHook | None = None,
                         cache_salt: str = "") -> dict[str, Any] | AsyncIterator[str]:
        prompts: list[Prompt] = list(req.prompts())
        longest = max(len(p) if not isinstance(p, str) else 0 for p in prompts)
        if any(isinstance(p, str) for p in prompts) and self.engine.tokenizer is not None:
            longest = max(longest, *(len(self.engine.tokenizer.encode(p)) for p in prompts if isinstance(p, str)))
        params = req.to_params(self.engine.max_model_len - longest)
        return await self._run("completion", prompts, params, req.n, req.stream,
                               bool(req.stream_options and req.stream_options.include_usage), adapter, model, on_usage,
                               cache_salt)

    # ---- the common path -----------------------------------------------------------------------------------

    async def _run(self, kind: str, prompts: list[Prompt], params: SamplingParams, n: int, stream: bool,
                   include_usage: bool, adapter: str | None, model: str, on_usage: UsageHook | None,
                   cache_salt: str) -> dict[str, Any] | AsyncIterator[str]:
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        streams = []
        try:  # every request is validated (and queued) before anything is sent back
            for p_index, prompt in enumerate(prompts):
                for i in range(n):
                    sub = params if params.seed is None or n == 1 else _with_seed(params, params.seed + i)
                    streams.append(self.engine.add_request(prompt, sub, f"{request_id}-{p_index}-{i}", adapter,
                                                           cache_salt))
        except LoraServerError:
            for s in streams:
                await s.aclose()
            raise
        created = int(time.time())
        if stream:
            return self._sse(kind, request_id, created, model, streams, n, include_usage, on_usage)
        choices = await self._collect(streams)
        if on_usage is not None:
            on_usage(_prompt_tokens(choices, n), sum(len(c.token_ids) for c in choices))
        return self._final(kind, request_id, created, model, choices, n)

    async def _tracked(self, index: int, stream) -> AsyncIterator[tuple[int, RequestOutput]]:
        start = last = time.monotonic()
        first = True
        async for out in stream:
            now = time.monotonic()
            if out.token_ids:
                self.metrics.observe(self.metrics.ttft if first else self.metrics.itl, now - (start if first else last))
                first, last = False, now
            if out.finished:
                self.metrics.observe(self.metrics.e2e, now - start)
                self.metrics.add("vllm:prompt_tokens_total", out.num_prompt_tokens)
                self.metrics.add("vllm:generation_tokens_total", out.num_output_tokens)
                self.metrics.add("vllm:request_success_total", 1)
            yield index, out

    async def _merged(self, streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several streams as they come; closing this aborts whatever is still running."""
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(index: int, stream) -> None:
            try:
                async for item in self._tracked(index, stream):
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

    async def _collect(self, streams: list) -> list[_Choice]:
        choices: dict[int, _Choice] = {}
        async for index, out in self._merged(streams):
            c = choices.setdefault(index, _Choice(index, out.num_prompt_tokens, out.num_cached_tokens))
            _add(c, out)
        return [choices[i] for i in sorted(choices)]

    async def _sse(self, kind: str, request_id: str, created: int, model: str, streams: list, n: int,
                   include_usage: bool, on_usage: UsageHook | None) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        choices: dict[int, _Choice] = {}
        base = {"id": request_id, "object": obj, "created": created, "model": model}
        try:
            if kind == "chat":
                for i in range(len(streams)):
                    yield _event({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}]})
            async for index, out in self._merged(streams):
                c = choices.setdefault(index, _Choice(index, out.num_prompt_tokens, out.num_cached_tokens))
                _add(c, out)
                if not out.text and not out.finished and not out.logprobs:
                    continue
                lp = self._logprobs(kind, out.logprobs) if out.logprobs else None
                choice: dict[str, Any] = {"index": index, "logprobs": lp,
                                          "finish_reason": out.finish_reason if out.finished else None}
                if kind == "chat":
                    choice["delta"] = {"content": out.text} if out.text else {}
                else:
                    choice["text"] = out.text
                if out.finished:
                    choice["stop_reason"] = out.stop_reason
                yield _event({**base, "choices": [choice]})
        except LoraServerError as exc:  # after the stream started, an error arrives as an event
            yield _event({"error": {"message": exc.message, "type": exc.error_type, "param": exc.param,
                                    "code": exc.code or exc.http_status}})
            yield "data: [DONE]\n\n"
            return
        done = [choices[i] for i in sorted(choices)]
        usage = _usage(done, n)
        if on_usage is not None:
            on_usage(usage["prompt_tokens"], usage["completion_tokens"])
        if include_usage:
            yield _event({**base, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    def _final(self, kind: str, request_id: str, created: int, model: str, choices: list[_Choice],
               n: int) -> dict[str, Any]:
        body: dict[str, Any] = {"id": request_id, "created": created, "model": model, "usage": _usage(choices, n)}
        if kind == "chat":
            body["object"] = "chat.completion"
            body["choices"] = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": self._logprobs(kind, c.logprobs) if c.logprobs else None,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in choices]
        else:
            body["object"] = "text_completion"
            body["choices"] = [{"index": c.index, "text": c.text,
                                "logprobs": self._logprobs(kind, c.logprobs) if c.logprobs else None,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in choices]
        return body

    def _token(self, token_id: int) -> str:
        tok = self.engine.tokenizer
        return str(token_id) if tok is None else tok.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, kind: str, entries: list[TokenLogprob]) -> dict[str, Any]:
        if kind == "chat":
            return {"content": [
                {"token": (t := self._token(e.token_id)), "logprob": e.logprob, "bytes": list(t.encode()),
                 "top_logprobs": [{"token": (s := self._token(i)), "logprob": v, "bytes": list(s.encode())}
                                  for i, v in e.top]} for e in entries]}
        return {"tokens": [self._token(e.token_id) for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._token(i): v for i, v in e.top} for e in entries]}


def _add(c: _Choice, out: RequestOutput) -> None:
    c.text += out.text
    c.token_ids.extend(out.token_ids)
    c.logprobs.extend(out.logprobs or [])
    if out.finished:
        c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason


def _prompt_tokens(choices: list[_Choice], n: int) -> int:
    """Each prompt counts once, however many choices (n) it produced."""
    return sum(c.prompt_tokens for c in choices[::n])


def _usage(choices: list[_Choice], n: int) -> dict[str, Any]:
    prompt = _prompt_tokens(choices, max(1, n))
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(c.cached_tokens for c in choices[::max(1, n)])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
