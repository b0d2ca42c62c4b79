"""Per-request sampling and stopping parameters, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lora_server.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    """What to generate and when to stop. temperature == 0 means greedy; top_k <= 0 disables top-k."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's and the top-k
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be at least 1")
        _check(_finite(self.temperature) and self.temperature >= 0, "temperature", "must be a number >= 0")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "must be -1, 0 (off) or a positive integer")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        _check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative token ids")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               "must be between 0 and max_tokens")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"must be between 0 and {MAX_LOGPROBS}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, param: str, what: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{param} {what}", param=param)
