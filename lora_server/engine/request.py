"""A request in its two forms. ``EngineRequest``: what a caller decided (frozen; ``Engine.make_request`` makes it,
callers pass it to ``submit`` / ``add`` / ``discard``). ``Request``: the engine's own state of it, built when it is
added (its tokens, counters, block table and status); the scheduler moves it between queues, only the request
holds these fields, and nothing outside lora_server.engine sees it: what callers learn comes back on outputs."""

from __future__ import annotations

import enum
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lora_server.engine.adapter_registry import AdapterHandle
from lora_server.engine.outputs import TokenLogprob
from lora_server.kv_pool.unified_pool import Admission
from lora_server.sampling_params import SamplingParams

if TYPE_CHECKING:
    from xgrammar import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"
    ERROR = "error"  # serving it raised; it ended alone (RequestFailedError)


MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1  # vLLM's priority field, held to 32 bits


@dataclass(frozen=True, slots=True)
class TenantShare:
    """Whom a request is served for, and that tenant's share of the engine (the admin API sets it; the server
    passes it with each request, so the engine needs no store). Waiting requests are admitted by weighted fair
    sharing across tenants: a tenant with weight 2 gets twice the tokens of one with weight 1 while both wait
    (see engine.fair_queue). ``max_running``: the most of its requests running at once, 0 = no cap."""

    name: str = ""  # "": callers without a tenant (anonymous, --api-key) are one tenant
    weight: float = 1.0
    max_running: int = 0

    def __post_init__(self) -> None:
        weight = self.weight
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
            raise ValueError(f"a tenant's weight must be a positive finite number, got {self.weight!r}")
        if isinstance(self.max_running, bool) or not isinstance(self.max_running, int) or self.max_running < 0:
            raise ValueError(f"a tenant's max_running must be a non-negative integer, got {self.max_running!r}")


NO_TENANT = TenantShare()  # requests of callers without a tenant, and offline ones


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A validated request as its caller decided it (``make_request`` makes it; ``EngineCore.add`` builds the
    engine's ``Request`` from it). It holds its adapter version: it is added once (``submit`` / ``add``, which take
    over that hold and its grammar matcher) or ``discard``-ed."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    adapter: AdapterHandle | None = None  # None: the base model
    cache_salt: str = ""  # KV is shared only between requests with the same salt (the server's per-tenant salt)
    tenant: TenantShare = NO_TENANT
    priority: int = 0  # vLLM's: among its tenant's waiting requests, lower values are admitted first
    arrival_time: float = field(default_factory=time.monotonic)  # the engine's clock (time.monotonic)
    # its structured output's compiled matcher (opaque to callers; None without one, or until attach_grammars):
    # the engine advances it once the request is added
    grammar: GrammarMatcher | None = None
    adapter_from: int = 0  # the position from which its adapter applies (activation_start)
    # seconds it waited for its adapter before the engine saw it (an adapter registered on its first request)
    adapter_wait_s: float = 0.0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


CLIENT_SALT = "\x00salt:"  # between the server's (tenant's) cache salt and a client's own cache_salt


def with_client_salt(server_salt: str, client_salt: str | None) -> str:
    """The cache salt of a request of a tenant (``server_salt``, derived by the server) that sent its own
    ``cache_salt``: it shares KV only with requests of the same tenant and the same client salt."""
    return server_salt if client_salt is None else f"{server_salt}{CLIENT_SALT}{client_salt}"


def server_salt(cache_salt: str) -> str:
    """The server's part of a cache salt (with_client_salt): the account its figures count under, one per tenant
    however many salts clients send."""
    return cache_salt.partition(CLIENT_SALT)[0]


def activation_start(prompt: Sequence[int], invocation: Sequence[int]) -> int:
    """The position from which an adapter applies to a request of ``prompt``: 0 for a plain LoRA (``invocation``
    empty); for an activated LoRA (PEFT's alora_invocation_tokens) the start of the last occurrence of
    ``invocation`` in the prompt, every later token (generated ones included) computed with the adapter and every
    earlier one as the base model's; without an occurrence, the adapter applies to no token (PEFT's rule: the
    base model answers), i.e. sys.maxsize."""
    if not invocation:
        return 0
    n, first = len(invocation), invocation[0]
    for start in range(len(prompt) - n, -1, -1):
        if prompt[start] == first and tuple(prompt[start : start + n]) == tuple(invocation):
            return start
    return sys.maxsize


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    adapter: AdapterHandle | None = None  # None: the base model
    cache_salt: str = ""  # KV is shared only between requests with the same salt (the server's per-tenant salt)
    tenant: TenantShare = NO_TENANT
    priority: int = 0  # vLLM's: among its tenant's waiting requests, lower values are admitted first
    admission: Admission | None = None  # its hold on the pool while running
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    draft_token_ids: list[int] = field(default_factory=list)  # this step's speculative tokens (else empty)
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from cached KV at its first admission
    scheduled_time: float | None = None  # first admission (monotonic clock): queueing ends
    adapter_loaded: bool = False  # an admission of it loaded its adapter onto the device
    adapter_load_s: float = 0.0  # time spent loading adapters in its steps before its first token
    # before its first admission, seconds it waited for its adapter: registered on first use, read, staged
    adapter_wait_s: float = 0.0
    adapter_wait_since: float | None = None  # waiting for its adapter to be staged since then (None: not waiting)
    # after its first admission, seconds it waited for its adapter's copy into the arena (asynchronous loads)
    copy_wait_s: float = 0.0
    copy_wait_since: float | None = None  # admitted while its adapter's copy was under way, then (None: computing)
    first_token_time: float | None = None
    grammar: GrammarMatcher | None = None  # its structured output's state: the output so far, accepted token by token
    # with params.prompt_logprobs: the logprobs of prompt tokens 1, 2, ... computed so far (token 0 has none)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # the position from which its adapter applies (activation_start): an activated LoRA's earlier tokens are
    # computed, cached and shared as the base model's, and no step's chunk crosses it
    adapter_from: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @classmethod
    def from_description(cls, described: EngineRequest) -> Request:
        """The engine's state of a described request, nothing computed yet (it takes over the description's adapter
        hold and grammar matcher)."""
        return cls(
            described.request_id,
            list(described.prompt_token_ids),
            described.params,
            eos_token_ids=described.eos_token_ids,
            adapter=described.adapter,
            cache_salt=described.cache_salt,
            tenant=described.tenant,
            priority=described.priority,
            arrival_time=described.arrival_time,
            grammar=described.grammar,
            adapter_from=described.adapter_from,
            adapter_wait_s=described.adapter_wait_s,
        )

    def wait_for_adapter(self, now: float) -> None:
        """Its adapter is not staged yet: its wait for it runs from now (or from when it began)."""
        if self.adapter_wait_since is None and self.scheduled_time is None:
            self.adapter_wait_since = now

    def adapter_ready(self, since: float) -> None:
        """Its adapter has been ready (staged or on the device) since ``since``: its wait, if any, ended then."""
        if self.adapter_wait_since is not None:
            self.adapter_wait_s += max(0.0, since - self.adapter_wait_since)
            self.adapter_wait_since = None

    def copy_wait(self, now: float, copying: bool) -> None:
        """Whether it computes nothing this step for its adapter's copy into the arena (asynchronous loads):
        before its first token, that time is its copy wait."""
        if copying and self.copy_wait_since is None and self.first_token_time is None:
            self.copy_wait_since = now
        elif not copying and self.copy_wait_since is not None:
            self.copy_wait_s += now - self.copy_wait_since
            self.copy_wait_since = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_prompt_logprobs(self) -> int:
        """Prompt tokens scored so far (prompt_logprobs): the runner scores the positions after them."""
        return len(self.prompt_logprobs)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs are asked for and some are not computed yet: its prompt cannot come from the
        prefix cache (a cached prefix's logits were never computed)."""
        return self.params.prompt_logprobs is not None and self.num_prompt_logprobs < self.num_prompt_tokens - 1

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def lora_page(self) -> int:
        """Its adapter's table page in the arena while admitted (the pool's placement) for the tokens it computes
        next; -1 = no adapter (also an activated LoRA's tokens before its invocation)."""
        if self.admission is None or self.num_computed_tokens < self.adapter_from:
            return -1
        return self.admission.adapter_page

    def chunk_limit(self) -> int:
        """The most tokens its next step may compute: a chunk ends where its adapter switches on."""
        if self.num_computed_tokens < self.adapter_from:
            return self.adapter_from - self.num_computed_tokens
        return sys.maxsize

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def drop_last(self, n: int) -> None:
        """Drop the last n output tokens of a request that has finished: the tokens a speculative step produced
        after the one where a stop string ended it."""
        assert self.finished and 0 <= n <= self.num_output_tokens
        del self.token_ids[len(self.token_ids) - n :]
        self.num_computed_tokens = min(self.num_computed_tokens, len(self.token_ids))
