"""Prompt-lookup (n-gram) drafts for speculative decoding without a draft model.

A request that copies from its own context (summarise, edit, quote, repeat a text) tends to continue an earlier
occurrence of its last few tokens. The proposer finds the most recent earlier occurrence of the request's last n
tokens (the longest n in [min_n, max_n] that occurs) and proposes the tokens that followed it. The engine then
verifies the proposal in one forward pass (Sampler.verify_drafts): drafts only ever cost compute, never change
what is generated."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens for a sequence whose tokens so far are ``token_ids``: for n from ``max_n`` down to
    ``min_n``, the tokens that followed the most recent earlier occurrence of the last n tokens (an occurrence
    that ends before the last token, so at least one token follows it). [] when no such n-gram occurs."""
    if k < 1 or len(token_ids) < 2:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[:-1], n)  # [L - n, n]: window i is tokens[i : i + n], i + n < L
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
