"""Per-request sampling and stopping parameters, validated at construction."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from lora_server.errors import InvalidRequestError
from lora_server.json_types import JsonObject

MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 300  # entries of logit_bias, as OpenAI allows
MAX_BAD_WORDS = 256  # token sequences of bad_words (each word gives one or two)
StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
_KIND_PARAM = {
    "json": "guided_json",
    "json_object": "response_format",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
    "structural_tag": "tools",
}


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on a request's output text, enforced by masking the logits with a grammar (engine/structured.py).

    kind "json": the output is a JSON value valid under the JSON schema ``spec`` (JSON text, keys in the order
    given: the output's keys follow it); "json_object": any JSON object (``spec`` None); "regex": the output fully
    matches the regular expression ``spec``; "choice": the output is exactly one of the strings ``spec``;
    "grammar": the output is a sentence of the EBNF grammar ``spec`` (xgrammar's GBNF dialect, rule ``root``);
    "structural_tag": the output follows xgrammar's structural tag ``spec`` (JSON text; tool calls, see
    lora_server.tools.grammar), its JSON schemas written as compact JSON.
    Equal constraints are equal and hash alike: the compiled-grammar cache is keyed by them. The shape is checked
    here; the server's limits (sizes, choices, schema depth) and whether the schema or regex compiles when the
    request is made (engine/structured.py)."""

    kind: StructuredKind
    spec: str | tuple[str, ...] | None = None
    param: str = field(default="", compare=False)  # the request field that asked for it (errors name it)

    def __post_init__(self) -> None:
        if self.kind not in _KIND_PARAM:
            raise InvalidRequestError(f"unknown structured output kind {self.kind!r}", param="response_format")
        if not self.param:
            object.__setattr__(self, "param", _KIND_PARAM[self.kind])
        if self.kind in ("json", "structural_tag"):
            _check(isinstance(self.spec, str), self.param, "must be JSON text")
        elif self.kind == "json_object":
            _check(self.spec is None, self.param, "json_object takes no schema")
        elif self.kind in ("regex", "grammar"):
            _check(isinstance(self.spec, str) and bool(self.spec), self.param, "must be a non-empty string")
        else:
            _check(
                isinstance(self.spec, tuple)
                and len(self.spec) > 0
                and all(isinstance(c, str) and c for c in self.spec),
                self.param,
                "must be a non-empty list of non-empty strings",
            )

    @classmethod
    def json_schema(cls, schema: JsonObject | str, param: str = "guided_json") -> StructuredOutput:
        """The constraint of a JSON schema given as an object or as JSON text (InvalidRequestError otherwise)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError):
                raise InvalidRequestError(f"{param} is not valid JSON", param=param) from None
        _check(isinstance(schema, dict), param, "must be a JSON schema object")
        try:
            text = json.dumps(schema, ensure_ascii=False)
        except RecursionError:  # deeper than the interpreter writes (the depth limit refuses far less: structured)
            raise InvalidRequestError(f"{param} is nested too deeply", param=param) from None
        return cls("json", text, param)


@dataclass(slots=True)
class SamplingParams:
    """What to generate and when to stop. temperature == 0 means greedy; top_k <= 0 disables top-k."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output so far
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's and the top-k
    # None: none; k >= 0: each prompt token's logprob given the tokens before it (the first has none), and the top-k
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None  # the grammar its output must follow, if any
    # None: any token; else the only tokens it may generate (end-of-sequence included only if listed)
    allowed_token_ids: tuple[int, ...] | None = None
    # token sequences it may not generate: the last token of each is banned wherever the output ends with the rest
    bad_words: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(
            isinstance(self.max_tokens, int) and (self.max_tokens >= 1 or self.scores_prompt),
            "max_tokens",
            "must be at least 1 (0 only to score the prompt: echo, or prompt_logprobs)",
        )
        _check(_finite(self.temperature) and self.temperature >= 0, "temperature", "must be a number >= 0")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "must be -1, 0 (off) or a positive integer")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, name, "must be between -2 and 2")
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"may hold at most {MAX_LOGIT_BIAS} entries")
        _check(
            all(_int(t) and t >= 0 and _finite(v) and -100 <= v <= 100 for t, v in self.logit_bias.items()),
            "logit_bias",
            "must map token ids to numbers between -100 and 100",
        )
        _check(
            self.seed is None or (_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX),
            "seed",
            "must be an integer in the signed 64-bit range",
        )
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"may hold at most {MAX_STOP_STRINGS} strings")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative token ids",
        )
        _check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be between 0 and max_tokens",
        )
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"must be between 0 and {MAX_LOGPROBS}",
        )
        _check(
            self.prompt_logprobs is None or (_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
            "prompt_logprobs",
            f"must be between 0 and {MAX_LOGPROBS}",
        )
        _check(
            self.allowed_token_ids is None
            or (len(self.allowed_token_ids) > 0 and all(_int(t) and t >= 0 for t in self.allowed_token_ids)),
            "allowed_token_ids",
            "must be a non-empty list of token ids",
        )
        _check(
            len(self.bad_words) <= MAX_BAD_WORDS
            and all(words and all(_int(t) and t >= 0 for t in words) for words in self.bad_words),
            "bad_words",
            f"must be at most {MAX_BAD_WORDS} non-empty token sequences",
        )
        # the grammar alone decides when a constrained output may end; min_tokens could forbid the only allowed token
        _check(
            self.structured is None or self.min_tokens == 0,
            "min_tokens",
            "cannot be combined with structured output (response_format, guided_*) or forced tool calls",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def scores_prompt(self) -> bool:
        """max_tokens 0 with prompt_logprobs: the request computes its prompt's logprobs and generates nothing."""
        return self.max_tokens == 0 and self.prompt_logprobs is not None


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, param: str, what: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{param} {what}", param=param)


def bad_words_token_ids(words: Sequence[str], encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """SamplingParams.bad_words of vLLM's ``bad_words``, tokenized as vLLM tokenizes them (``encode``: text to ids
    without special tokens): each word alone, and after a space when that gives another first token in as many
    tokens (the word in the middle of a text)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        _check(isinstance(word, str) and bool(word.strip()), "bad_words", "must be non-empty words")
        alone = tuple(encode(word.lstrip()))
        spaced = tuple(encode(" " + word.lstrip()))
        out.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
    return tuple(out)
