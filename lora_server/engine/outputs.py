"""Typed messages from the engine to its callers."""

from __future__ import annotations

from dataclasses import dataclass, field

from lora_server.errors import LoraServerError


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first
    rank: int | None = None  # 1 + how many tokens were likelier (known for prompt tokens)


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """When a request reached each stage of its serving, on the engine's clock (time.monotonic), and the time it
    spent on its adapter (core.TtftSplit's adapter loading: ``adapter_wait_s + adapter_load_s``)."""

    arrival: float  # EngineRequest.arrival_time
    first_admission: float | None  # None: it was never admitted
    first_token: float | None  # None: it ended without a token
    adapter_load_s: float  # copy time of its steps that loaded adapters, before its first token
    adapter_loaded: bool  # an admission of it loaded its adapter onto the device (False: it was resident)
    # every other wait for its adapter before its first token: registered on first use, read and staged, copied
    adapter_wait_s: float = 0.0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass(slots=True)
class RequestOutput:
    """What one request produced since its previous output (a streaming delta)."""

    request_id: str
    text: str  # new text
    token_ids: list[int]  # new token ids
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: str | int | None  # the stop string or stop token id that ended it, if any
    num_prompt_tokens: int
    num_output_tokens: int  # all output tokens so far
    num_cached_tokens: int = 0
    error: LoraServerError | None = None  # set on the last output of a request whose serving failed
    queue_time_s: float | None = None  # from its arrival to its first admission (None while it has not been admitted)
    timings: RequestTimings | None = None  # on its last output (finished) only
    # with SamplingParams.prompt_logprobs, on the request's first output: one entry per prompt token, None for the
    # first (nothing precedes it)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(slots=True)
class Completion:
    """A finished request as a whole (what Engine.generate returns)."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: str | int | None
    num_cached_tokens: int = 0  # prompt tokens served from cached KV
    error: str | None = None  # why it failed (finish_reason "error")
    prompt_logprobs: list[TokenLogprob | None] | None = None  # as in RequestOutput
