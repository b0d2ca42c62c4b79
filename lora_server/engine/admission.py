"""Admission: a request made from the API's fields, validated (its prompt, priority, sampling fields against
the vocabulary, its length against the context and the pool), tokenized, its structured output compiled, and
its adapter version held. Safe from any thread: it changes nothing but the hold it returns."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lora_server.config import EngineConfig
from lora_server.engine.adapter_registry import AdapterRegistry
from lora_server.engine.request import (
    MAX_PRIORITY,
    MIN_PRIORITY,
    NO_TENANT,
    EngineRequest,
    TenantShare,
    activation_start,
)
from lora_server.engine.tokenizer import Tokenizer
from lora_server.errors import ContextLengthExceededError, InvalidRequestError
from lora_server.kv_pool import UnifiedPool
from lora_server.model.arch import ModelArch
from lora_server.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lora_server.engine.structured import GrammarMatcher, StructuredOutputs

Prompt = str | Sequence[int]


class Admission:
    """Makes EngineRequests for a model shaped ``arch`` served in ``max_model_len`` tokens of context and ``pool``'s
    blocks, with ``adapters`` registered; ``structured``: the grammar compiler and cache once a structured request
    built it (xgrammar loads only then)."""

    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArch,
        tokenizer: Tokenizer | None,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        pool: UnifiedPool,
        adapters: AdapterRegistry,
    ) -> None:
        self.config, self.arch, self.tokenizer = config, arch, tokenizer
        self.max_model_len, self.eos_token_ids = max_model_len, eos_token_ids
        self.pool, self.adapters = pool, adapters
        self.structured: StructuredOutputs | None = None
        self._structured_lock = threading.Lock()

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
            if self.structured is None:
                if self.tokenizer is None:
                    raise InvalidRequestError(
                        "structured output needs the model's tokenizer; this model has none", param="response_format"
                    )
                from lora_server.engine.structured import StructuredOutputs  # xgrammar loads only when used

                self.structured = StructuredOutputs(self.tokenizer, self.arch.vocab_size, self.config)
            return self.structured

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
