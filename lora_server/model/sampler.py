"""Turns the logits of a step into one token per sequence, each under its own sampling parameters.

Random draws use the exponential race (argmax of p / E with E ~ Exp(1)), which samples from p exactly. A request
with a seed draws its E from a generator seeded by (seed, output position), so its tokens do not depend on which
other requests share the batch, nor on preemption."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lora_server.model.batch import ScheduledSequence

_NEG_INF = float("-inf")
NON_FINITE = -1  # the token id of a row whose logits were not finite
LogitsMask = Callable[[torch.Tensor], None]  # sets disallowed tokens of [S, vocab] logits to -inf, in place
SCORING_LOGITS_BYTES = 64 << 20  # the float32 logits that exist at once while score_tokens works through its rows


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]  # [S]
    logprobs: list[float] | None  # [S] log-probability of each sampled token under the model
    top_logprobs: list[list[tuple[int, float]]] | None  # [S][k] the k most likely tokens and their logprobs


@dataclass(slots=True)
class TokenScores:
    """Given tokens scored by the rows before them (prompt logprobs): for row j, the logprob of its token, that
    token's rank and the row's k most likely tokens."""

    logprobs: list[float]  # [P]
    ranks: list[int]  # [P] 1 + how many tokens the row found likelier than its token
    top_logprobs: list[list[tuple[int, float]]]  # [P][k] (token id, logprob), most likely first


def scoring_rows(vocab: int) -> int:
    """The rows score_tokens sends through the head at once."""
    return max(1, SCORING_LOGITS_BYTES // (4 * vocab))


def score_tokens(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    k: int,
    logits_of: Callable[[torch.Tensor, Sequence[tuple[int, int, int]]], torch.Tensor],
    vocab: int,
    segments: Sequence[tuple[int, int, int]] = (),
) -> TokenScores:
    """hidden: [P, H] final hidden states, targets: [P] int64 the token each row scores, ``logits_of`` the model's
    head ([m, H] -> [m, >= vocab] float32). Row j's result is log_softmax(logits_of(hidden[j])[:vocab])[targets[j]],
    its rank and topk(k); ``segments`` (first row, end row, table page): the rows' adapters, handed to
    ``logits_of`` for each slice's rows. The rows go through the head a slice at a time, so that at most
    SCORING_LOGITS_BYTES of logits exist at once however long the prompt (never a [P, vocab] tensor); the result
    comes back in one transfer."""
    step = scoring_rows(vocab)
    packed = []
    for start in range(0, hidden.shape[0], step):
        end = min(start + step, hidden.shape[0])
        cut = [(max(s, start) - start, min(e, end) - start, p) for s, e, p in segments if s < end and e > start]
        logprobs = torch.log_softmax(logits_of(hidden[start:end], cut)[:, :vocab], dim=-1)  # [m, vocab]
        chosen = logprobs.gather(1, targets[start : start + step, None])  # [m, 1]
        rank = (logprobs > chosen).sum(-1, keepdim=True) + 1  # [m, 1]
        top_vals, top_ids = logprobs.topk(k, dim=-1)  # [m, k]
        packed.append(torch.cat([chosen.double(), rank.double(), top_ids.double(), top_vals.double()], 1))
    rows = torch.cat(packed).tolist()  # [P][2 + 2k]
    return TokenScores(
        [row[0] for row in rows],
        [int(row[1]) for row in rows],
        [[(int(t), v) for t, v in zip(row[2 : 2 + k], row[2 + k :], strict=True)] for row in rows],
    )


# Columns of the per-row parameter block of the staging buffer (_RESTRICTED: 1.0 when allowed_token_ids is set).
_TEMPERATURE, _TOP_K, _TOP_P, _MIN_P, _REPETITION, _RESTRICTED = range(6)
_NUM_PARAMS = 6


@dataclass(slots=True)
class _Staged:
    """One step's parameters as the device sees them, all views of one device buffer (one host-to-device copy).
    Token ids travel as int32 bit patterns inside the float32 buffer. Pad ids point at column ``vocab`` (an
    extra column that is dropped)."""

    params: torch.Tensor  # [S, _NUM_PARAMS] float32
    seen_ids: torch.Tensor  # [S, Ls] int64: prompt + output tokens of rows with a repetition penalty
    add_ids: torch.Tensor  # [S, La] int64: tokens whose logit gets add_values
    add_values: torch.Tensor  # [S, La] float32: -(frequency * count + presence) + bias, -inf for banned tokens
    allowed_ids: torch.Tensor  # [S, Lw] int64: the only tokens a row with allowed_token_ids may sample
    sampled_rows: torch.Tensor  # [R] int64: the rows that are not greedy


class Sampler:
    """Vectorized over the batch: the per-row parameters go to the device in one copy from a persistent staging
    buffer (pinned when the device is not the CPU), every decision about which work to do is taken from the
    Python-side parameters (no device value is read back to decide), and the result comes back in one transfer
    of one packed tensor. Only seeded rows loop in Python: each draws its noise from its own generator.

    Contract of the staging buffer: it is rewritten at the next call, which is safe because each call ends with
    the device-to-host transfer of its result, ordered after the staging copy on the same stream."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._host = torch.empty(0)  # float32 staging buffer, grown on demand
        self._device = torch.empty(0)  # its device twin

    def __call__(
        self, logits: torch.Tensor, requests: Sequence[ScheduledSequence], mask: LogitsMask | None = None
    ) -> SampleResult:
        """logits: [S, vocab] float32, row i belongs to requests[i] (whose token_ids do not yet hold the new token).
        A row whose logits are not all finite (an adapter's or the model's arithmetic overflowed) samples no token:
        its token id is NON_FINITE, and the engine fails that request alone. ``mask`` (structured output) forbids
        tokens after penalties and biases, before greedy and random sampling alike; logprobs stay the model's."""
        logits = logits[:, : self.vocab_size]
        params = [r.params for r in requests]
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        finite = finite_rows(logits)  # [S]
        staged = self._stage(requests, logits.device)
        work = logits
        if staged is not None:
            work = self._apply_penalties_and_masks(work, staged, requests)
        if mask is not None:
            work = work.clone() if work is logits else work
            mask(work)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = work.argmax(-1)
        else:
            assert staged is not None
            if any(greedy):
                sampled_rows = [i for i, g in enumerate(greedy) if not g]
                tokens = work.argmax(-1)
                drawn = self._sample(
                    work.index_select(0, staged.sampled_rows),
                    staged.params.index_select(0, staged.sampled_rows),
                    [requests[i] for i in sampled_rows],
                )
                tokens = tokens.index_copy(0, staged.sampled_rows, drawn)
            else:
                tokens = self._sample(work, staged.params, requests)
        final = tokens.masked_fill(~finite, NON_FINITE)  # [S]
        if raw_logprobs is None:
            return SampleResult(final.tolist(), None, None)  # the step's one device-to-host transfer
        k = max(p.logprobs or 0 for p in params)
        chosen = raw_logprobs.gather(1, tokens[:, None])  # [S, 1]
        top_vals, top_ids = raw_logprobs.topk(k, dim=-1)  # [S, k]
        packed = torch.cat([final[:, None].double(), chosen.double(), top_ids.double(), top_vals.double()], 1)
        rows = packed.tolist()  # the step's one device-to-host transfer: [S][2 + 2k]
        tops = [
            [(int(t), v) for t, v in zip(row[2 : 2 + n], row[2 + k : 2 + k + n], strict=True)]
            for row, n in zip(rows, (p.logprobs or 0 for p in params), strict=True)
        ]
        return SampleResult([int(row[0]) for row in rows], [row[1] for row in rows], tops)

    def _stage(self, requests: Sequence[ScheduledSequence], device: torch.device) -> _Staged | None:
        """Pack the rows' parameters, penalty token ids and additive terms into the staging buffer and copy it to
        the device once; None when no row needs any of it (all greedy, no penalty, bias or ban)."""
        vocab = self.vocab_size
        params_rows: list[list[float]] = []
        seen: list[list[int]] = []
        adds: list[dict[int, float]] = []
        allowed: list[list[int]] = []
        sampled_rows: list[int] = []
        for i, r in enumerate(requests):
            p = r.params
            if not p.greedy:
                sampled_rows.append(i)
            params_rows.append(
                [
                    1.0 if p.greedy else p.temperature,
                    float(p.top_k if p.top_k > 0 else vocab),
                    p.top_p,
                    p.min_p,
                    p.repetition_penalty,
                    0.0 if p.allowed_token_ids is None else 1.0,
                ]
            )
            seen.append(sorted({t for t in r.token_ids if t < vocab}) if p.repetition_penalty != 1.0 else [])
            adds.append(_additive_terms(r, vocab))
            allowed.append(sorted({t for t in p.allowed_token_ids if t < vocab}) if p.allowed_token_ids else [])
        if not sampled_rows and not any(seen) and not any(adds) and not any(allowed):
            return None
        n = len(requests)
        width_seen = max(1, max(map(len, seen)))
        width_add = max(1, max(map(len, adds)))
        width_allowed = max(1, max(map(len, allowed)))
        ids = torch.full((n, width_seen + width_add + width_allowed), vocab, dtype=torch.int32)
        values = torch.zeros(n, width_add)
        for i, (row_seen, row_add, row_allowed) in enumerate(zip(seen, adds, allowed, strict=True)):
            if row_seen:
                ids[i, : len(row_seen)] = torch.tensor(row_seen, dtype=torch.int32)
            if row_add:
                ids[i, width_seen : width_seen + len(row_add)] = torch.tensor(list(row_add), dtype=torch.int32)
                values[i, : len(row_add)] = torch.tensor(list(row_add.values()))
            if row_allowed:
                start = width_seen + width_add
                ids[i, start : start + len(row_allowed)] = torch.tensor(row_allowed, dtype=torch.int32)
        parts = [torch.tensor(params_rows).flatten(), ids.flatten().view(torch.float32), values.flatten()]
        parts.append(torch.tensor(sampled_rows, dtype=torch.int32).view(torch.float32))
        sizes = [t.numel() for t in parts]
        total = sum(sizes)
        host, dev = self._buffers(total, device)
        torch.cat(parts, out=host[:total])
        dev[:total].copy_(host[:total], non_blocking=True)
        p_dev, ids_dev, values_dev, rows_dev = dev[:total].split(sizes)
        ids_dev = ids_dev.view(torch.int32).view(n, width_seen + width_add + width_allowed).long()
        return _Staged(
            p_dev.view(n, _NUM_PARAMS),
            ids_dev[:, :width_seen],
            ids_dev[:, width_seen : width_seen + width_add],
            values_dev.view(n, width_add),
            ids_dev[:, width_seen + width_add :],
            rows_dev.view(torch.int32).long(),
        )

    def _buffers(self, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The persistent staging pair, at least ``size`` float32 each; grown (doubling) when too small."""
        if self._host.numel() < size or self._device.device != device:
            size = max(size, 2 * self._host.numel(), 1024)
            self._host = torch.empty(size, pin_memory=device.type != "cpu")
            self._device = self._host if device.type == "cpu" else torch.empty(size, device=device)
        return self._host, self._device

    def _apply_penalties_and_masks(
        self, logits: torch.Tensor, staged: _Staged, requests: Sequence[ScheduledSequence]
    ) -> torch.Tensor:
        """Repetition penalty on the tokens each row has seen (positive logits divided, negative multiplied), then
        the additive terms (frequency and presence penalties, logit_bias, -inf for min_tokens and bad_words bans),
        then -inf for every token outside a row's allowed_token_ids. Returns a new tensor; rows without a penalty
        come out unchanged."""
        n, vocab = logits.shape
        if any(r.params.repetition_penalty != 1.0 for r in requests):
            seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=logits.device)
            seen = seen.scatter_(1, staged.seen_ids, True)[:, :vocab]
            penalty = staged.params[:, _REPETITION : _REPETITION + 1]
            logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        if staged.add_ids.shape[1] and any(_has_additive_terms(r) for r in requests):
            added = torch.zeros(n, vocab + 1, dtype=logits.dtype, device=logits.device)
            logits = logits + added.scatter_add_(1, staged.add_ids, staged.add_values)[:, :vocab]
        if any(r.params.allowed_token_ids is not None for r in requests):
            allowed = torch.zeros(n, vocab + 1, dtype=torch.bool, device=logits.device)
            allowed = allowed.scatter_(1, staged.allowed_ids, True)[:, :vocab]
            unrestricted = staged.params[:, _RESTRICTED : _RESTRICTED + 1] == 0  # [S, 1]
            logits = logits.masked_fill(~(allowed | unrestricted), _NEG_INF)
        return logits

    def _sample(
        self, logits: torch.Tensor, params: torch.Tensor, requests: Sequence[ScheduledSequence]
    ) -> torch.Tensor:
        """logits: [R, vocab] of the non-greedy rows, params [R, _NUM_PARAMS] their staged parameters -> [R]
        tokens."""
        device = logits.device
        logits = logits / params[:, _TEMPERATURE : _TEMPERATURE + 1]
        if any(0 < r.params.top_k < self.vocab_size or r.params.top_p < 1 for r in requests):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(logits.shape[-1], device=device)[None, :]
            drop = ranks >= params[:, _TOP_K : _TOP_K + 1]
            sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
            probs = sorted_logits.softmax(-1)
            # drop a token when the tokens ranked above it already reach top_p (the first token always stays)
            drop = (probs.cumsum(-1) - probs) >= params[:, _TOP_P : _TOP_P + 1]
            sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
            logits = torch.full_like(logits, _NEG_INF).scatter(1, order, sorted_logits)
        probs = logits.softmax(-1)
        if any(r.params.min_p > 0 for r in requests):
            probs = probs.masked_fill(probs < params[:, _MIN_P : _MIN_P + 1] * probs.amax(-1, keepdim=True), 0.0)
        noise = torch.empty_like(probs).exponential_()
        for i, r in enumerate(requests):
            if r.params.seed is not None:
                gen = torch.Generator(device=device)
                gen.manual_seed(_mix(r.params.seed, r.num_output_tokens))
                noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(-1)


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[S] bool: every value of the row of logits [S, vocab] is finite, from its max and min (NaN carries through
    both). Two row reductions and no [S, vocab] temporary: isfinite().all(-1) allocated two, about 5 ms a step at
    batch 24 on the CPU."""
    return logits.amax(-1).isfinite() & logits.amin(-1).isfinite()


def _has_additive_terms(r: ScheduledSequence) -> bool:
    p = r.params
    return bool(
        ((p.presence_penalty or p.frequency_penalty) and r.num_output_tokens)
        or p.logit_bias
        or r.num_output_tokens < p.min_tokens
        or p.bad_words
    )


def _additive_terms(r: ScheduledSequence, vocab: int) -> dict[int, float]:
    """token id -> what is added to its logit: -(frequency * count + presence) for each output token, plus its
    logit_bias, and -inf for a token that min_tokens bans or that would complete one of bad_words (the last token
    of a sequence whose other tokens end the output so far, as vLLM bans them). Ids outside the vocabulary are left
    out."""
    if not _has_additive_terms(r):
        return {}
    p = r.params
    terms: dict[int, float] = {}
    if p.presence_penalty or p.frequency_penalty:
        for t, count in Counter(r.output_token_ids).items():
            terms[t] = -(p.frequency_penalty * count + p.presence_penalty)
    for t, bias in p.logit_bias.items():
        terms[t] = terms.get(t, 0.0) + bias
    if r.num_output_tokens < p.min_tokens:
        for t in (*p.stop_token_ids, *([] if p.ignore_eos else r.eos_token_ids)):
            terms[t] = _NEG_INF
    if p.bad_words:
        output = r.output_token_ids
        for words in p.bad_words:
            before = len(words) - 1
            if before <= len(output) and (before == 0 or list(words[:-1]) == output[len(output) - before :]):
                terms[words[-1]] = _NEG_INF
    return {t: v for t, v in terms.items() if 0 <= t < vocab}


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
