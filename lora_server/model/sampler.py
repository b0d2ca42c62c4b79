"""Turns the logits of a step into one token per sequence, each under its own sampling parameters.

Random draws use the exponential race (argmax of p / E with E ~ Exp(1)), which samples from p exactly. A request
with a seed draws its E from a generator seeded by (seed, output position), so its tokens do not depend on which
other requests share the batch, nor on preemption."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lora_server.model.batch import ScheduledSequence

_NEG_INF = float("-inf")
NON_FINITE = -1  # the token id of a row whose logits were not finite
LogitsMask = Callable[[torch.Tensor], None]  # sets disallowed tokens of [S, vocab] logits to -inf, in place


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]  # [S]
    logprobs: list[float] | None  # [S] log-probability of each sampled token under the model
    top_logprobs: list[list[tuple[int, float]]] | None  # [S][k] the k most likely tokens and their logprobs


class Sampler:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(
        self, logits: torch.Tensor, requests: Sequence[ScheduledSequence], mask: LogitsMask | None = None
    ) -> SampleResult:
        """logits: [S, vocab] float32, row i belongs to requests[i] (whose token_ids do not yet hold the new token).
        A row whose logits are not all finite (an adapter's or the model's arithmetic overflowed) samples no token:
        its token id is NON_FINITE, and the engine fails that request alone. ``mask`` (structured output) forbids
        tokens after penalties and biases, before greedy and random sampling alike; logprobs stay the model's."""
        logits = logits[:, : self.vocab_size]
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if any(r.params.logprobs is not None for r in requests) else None
        )
        finite = torch.isfinite(logits).all(-1)  # [S]
        logits = self._apply_penalties_and_masks(logits.clone(), requests)
        if mask is not None:
            mask(logits)
        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        if greedy:
            tokens[greedy] = logits[greedy].argmax(-1)
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        if sampled:
            tokens[sampled] = self._sample(logits[sampled], [requests[i] for i in sampled])
        token_list = torch.where(finite, tokens, NON_FINITE).tolist()  # the step's one device-to-host transfer
        if raw_logprobs is None:
            return SampleResult(token_list, None, None)
        chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        k = max(r.params.logprobs or 0 for r in requests)
        top_vals, top_ids = raw_logprobs.topk(k, dim=-1) if k else (raw_logprobs[:, :0], tokens[:, None][:, :0])
        tops = [
            list(
                zip(
                    top_ids[i, : r.params.logprobs or 0].tolist(),
                    top_vals[i, : r.params.logprobs or 0].tolist(),
                    strict=True,
                )
            )
            for i, r in enumerate(requests)
        ]
        return SampleResult(token_list, chosen, tops)

    def _apply_penalties_and_masks(self, logits: torch.Tensor, requests: Sequence[ScheduledSequence]) -> torch.Tensor:
        for i, r in enumerate(requests):
            p = r.params
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.token_ids)), dtype=torch.long, device=logits.device)
                seen = seen[seen < self.vocab_size]
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and r.num_output_tokens:
                ids, counts = torch.tensor(r.output_token_ids, dtype=torch.long).unique(return_counts=True)
                ids, counts = ids.to(logits.device), counts.to(logits.device, logits.dtype)
                logits[i, ids] -= p.frequency_penalty * counts + p.presence_penalty
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
            if r.num_output_tokens < p.min_tokens:
                banned = [
                    t for t in (*p.stop_token_ids, *([] if p.ignore_eos else r.eos_token_ids)) if t < self.vocab_size
                ]
                logits[i, banned] = _NEG_INF
        return logits

    def _sample(self, logits: torch.Tensor, requests: Sequence[ScheduledSequence]) -> torch.Tensor:
        """logits: [R, vocab] of the non-greedy rows -> [R] tokens."""
        device = logits.device
        temps = torch.tensor([r.params.temperature for r in requests], device=device)
        logits = logits / temps[:, None]
        top_k = torch.tensor(
            [r.params.top_k if r.params.top_k > 0 else self.vocab_size for r in requests], device=device
        )
        top_p = torch.tensor([r.params.top_p for r in requests], device=device)
        min_p = torch.tensor([r.params.min_p for r in requests], device=device)
        if (top_k < self.vocab_size).any() or (top_p < 1).any():
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(logits.shape[-1], device=device)[None, :]
            drop = ranks >= top_k[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
            probs = sorted_logits.softmax(-1)
            # drop a token when the tokens ranked above it already reach top_p (the first token always stays)
            drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
            logits = torch.full_like(logits, _NEG_INF).scatter(1, order, sorted_logits)
        probs = logits.softmax(-1)
        if (min_p > 0).any():
            probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
        noise = torch.empty_like(probs)
        for i, r in enumerate(requests):
            gen = None
            if r.params.seed is not None:
                gen = torch.Generator(device=device)
                gen.manual_seed(_mix(r.params.seed, r.num_output_tokens))
            noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(-1)


def verify_drafts(samples: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens a request keeps from one speculative step: ``samples`` [d + 1] are the tokens drawn at its d + 1
    verified positions (row j under the sequence with drafts[:j] accepted, see DraftPosition), ``drafts`` [d] the
    proposal. Drafts are kept while each equals its position's sample; the first sample that differs (the
    correction) or, when every draft matched, the last one (the bonus token) ends the list: 1 to d + 1 tokens.

    This is speculative sampling's rejection rule for a draft that is a point mass q = 1{x}: it accepts x with
    probability min(1, p(x) / q(x)) = p(x) and otherwise draws from the residual norm(max(0, p - q)), p without x
    renormalised. Drawing y ~ p and accepting iff y == x is that rule exactly: P(accept) = p(x), and given y != x,
    y ~ p(. | . != x). Greedy rows (y = argmax p) accept exactly the drafts greedy decoding would produce. Since y
    is the draw the non-speculative sampler makes at that output position, a seeded request (whose generator
    depends only on the seed and the position) gets the same tokens with and without speculation. A NON_FINITE
    sample never matches a draft: it ends the list and the engine fails the request."""
    assert len(samples) == len(drafts) + 1, "one sample per draft, and one after them"
    kept: list[int] = []
    for sample, draft in zip(samples, drafts, strict=False):
        kept.append(sample)
        if sample != draft:
            return kept
    kept.append(samples[-1])
    return kept


def _mix(seed: int, position: int) -> int:
    """A 63-bit seed for draw number ``position`` of a request seeded with ``seed`` (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
