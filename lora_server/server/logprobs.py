"""Log-probabilities in the shapes clients read: chat's ``logprobs.content``, the legacy completions object
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``) and vLLM's ``prompt_logprobs``. Non-finite values
are written as MIN_LOGPROB (JSON has no infinities), as vLLM does."""

from __future__ import annotations

import math
from typing import Any

from lora_server.engine.outputs import TokenLogprob
from lora_server.engine.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0


class LogprobsFormatter:
    """Formats a request's TokenLogprob entries; a token's text is its own decoding, special tokens included (the
    token id as text for a model without a tokenizer)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        tok = self.tokenizer
        return str(token_id) if tok is None else tok.decode([token_id], skip_special_tokens=False)

    def chat(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        """OpenAI chat's ``logprobs``: each token with its bytes and the top-k (the request's top_logprobs)."""
        return {
            "content": [
                {
                    "token": (t := self.token(e.token_id)),
                    "logprob": finite(e.logprob),
                    "bytes": list(t.encode()),
                    "top_logprobs": [
                        {"token": (s := self.token(i)), "logprob": finite(v), "bytes": list(s.encode())}
                        for i, v in e.top
                    ],
                }
                for e in entries
            ]
        }

    def completion(self, entries: list[tuple[int, TokenLogprob | None]], k: int, offset: int = 0) -> dict[str, Any]:
        """The completions ``logprobs`` object of (token id, its entry) pairs (entry None: the prompt's first
        token, which has no logprob). ``top_logprobs`` holds the token itself and the top ``k``, so up to k + 1
        entries (OpenAI's legacy API, and vLLM's); ``text_offset`` is where each token's text (as in ``tokens``)
        starts, counting from ``offset`` (the choice's text before these tokens), cumulative as vLLM counts it."""
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, e in entries:
            text = self.token(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if e is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(finite(e.logprob))
            top = {text: finite(e.logprob)}
            top.update((self.token(i), finite(v)) for i, v in e.top[:k])
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def prompt(self, entries: list[TokenLogprob | None], k: int) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else {token id: {logprob, rank,
        decoded_token}} for the token itself (its rank in the model's ordering) and the top ``k`` (ranks 1..k)."""
        out: list[dict[str, dict[str, Any]] | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            ranked = {e.token_id: (e.logprob, e.rank)}
            for rank, (i, v) in enumerate(e.top[:k], start=1):
                ranked.setdefault(i, (v, rank))
            out.append(
                {
                    str(i): {"logprob": finite(v), "rank": r, "decoded_token": self.token(i)}
                    for i, (v, r) in ranked.items()
                }
            )
        return out


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB
