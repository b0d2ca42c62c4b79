"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral) with each token's LoRA on the experts its router picked.

The router is a dense [experts, hidden] matrix in the model's dtype, never quantized (a quantized router moves
routing decisions, which are discrete); each expert is a gated MLP whose gate|up and down are linears of the
model's quantization (model.quant), like a dense layer's. As HF computes it: the router's logits in the model's
dtype, their softmax in float32, the top experts_per_token probabilities (renormalized to sum to 1 where the family
does), rounded to the model's dtype; then expert by expert, in index order, the tokens it was picked for go through
it, times their weight, added into the output.

LoRA on the experts (adapters.peft_experts) follows the routing: each token's adapter's A/B of the expert, where the
adapter has them, add to that expert's gate|up and down outputs for that token. A step's tokens come ordered so that
each adapter's are one run (model.lora.LoraBatch.host_segments); an expert's tokens, taken in order, keep that
order, so each adapter's are again one run of them, and its LoRA is one shrink and expand per run (segment_lora)."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from lora_server.kernels import ops
from lora_server.kernels.segment_lora import LoraTerm, apply_lora_segments
from lora_server.model.lora import LoraBatch


class ExpertTerms(NamedTuple):
    """One resident adapter's LoRA on one layer's mixture of experts, views into the arena (model.arena): its
    router's terms (empty: none), and expert -> (its gate|up terms, its down terms) (an expert it leaves alone is
    not in the dict)."""

    router: list[LoraTerm]
    experts: dict[int, tuple[list[LoraTerm], list[LoraTerm]]]


ExpertTermsOf = Callable[[int, int], ExpertTerms | None]  # (table page, layer) -> its terms there, None: none


class SparseMoE(nn.Module):
    def __init__(
        self,
        layer: int,
        router: torch.Tensor,
        gate_up: list[nn.Module],
        down: list[nn.Module],
        experts_per_token: int,
        norm_topk_prob: bool,
    ) -> None:
        """``router`` [experts, hidden]; ``gate_up``: each expert's fused gate|up linear [2 * width, hidden];
        ``down``: each expert's [hidden, width]."""
        super().__init__()
        assert len(gate_up) == len(down) == router.shape[0], (len(gate_up), len(down), tuple(router.shape))
        self.layer = layer
        self.router = nn.Parameter(router, requires_grad=False)
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.top_k, self.norm_topk_prob = experts_per_token, norm_topk_prob
        self.expert_terms: ExpertTermsOf | None = None  # set by model.arena.attach_arena
        # what the steps read, since start (bench-engine's floor): experts run, and (expert, adapter run) LoRAs
        self.experts_read = 0
        self.expert_loras_read = 0

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    def route(
        self,
        x: torch.Tensor,
        runs: Sequence[tuple[int, int, ExpertTerms]] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, experts [T, k] int64): each token's top k experts, from
        the router's logits and, for the tokens of each run whose adapter has one, its router LoRA's."""
        logits = F.linear(x, self.router)
        router_runs = [(start, end, terms.router) for start, end, terms in runs if terms.router]
        if router_runs:
            apply_lora_segments(x, logits, router_runs)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        """Each token's top k (token, expert) pairs sorted by expert (tokens ascending within one): every expert's
        pairs are one run of rows, each adapter's tokens one run of those; per projection, each expert's base on its
        rows and one grouped LoRA pass over every (expert, adapter run); the weighted rows summed into their tokens
        in expert order (HF's)."""
        runs = self._lora_runs(lora)
        weights, experts = self.route(x, runs)
        k = experts.shape[1]
        order = torch.argsort(experts.flatten(), stable=True)  # [P = T * k] pairs by expert, then token
        tokens = order // k  # each sorted pair's token
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts).tolist()  # pairs per expert
        rows = x[tokens]  # [P, hidden]
        starts = [0, *itertools.accumulate(counts)]  # expert e's pairs: rows starts[e] .. starts[e + 1]
        slices = [(e, starts[e], starts[e + 1]) for e, n in enumerate(counts) if n]
        self.experts_read += len(slices)
        gate_up = torch.cat([self.gate_up[e](rows[a:b]) for e, a, b in slices])  # [P, 2 * width]
        segments = _lora_segments(tokens, slices, runs) if runs else []
        self.expert_loras_read += len(segments)
        if segments:
            apply_lora_segments(rows, gate_up, [(a, b, terms[0]) for a, b, terms in segments])
        hidden = ops.silu_and_mul(gate_up)  # [P, width]
        y = torch.cat([self.down[e](hidden[a:b]) for e, a, b in slices])  # [P, hidden]
        if segments:
            apply_lora_segments(hidden, y, [(a, b, terms[1]) for a, b, terms in segments])
        y *= weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, y)

    def _lora_runs(self, lora: LoraBatch | None) -> list[tuple[int, int, ExpertTerms]]:
        """(first token, end token, that adapter's terms on this layer's router and experts) of each run of tokens
        whose adapter has LoRA on them."""
        of = self.expert_terms
        if lora is None or of is None:
            return []
        runs = []
        for start, end, page in lora.host_segments:
            terms = of(page, self.layer)
            if terms is not None:
                runs.append((start, end, terms))
        return runs


def _lora_segments(
    tokens: torch.Tensor, slices: list[tuple[int, int, int]], runs: list[tuple[int, int, ExpertTerms]]
) -> list[tuple[int, int, tuple[list[LoraTerm], list[LoraTerm]]]]:
    """(first row, end row, the adapter's terms of that expert) of every run of sorted pairs (``tokens`` [P], each
    expert's ascending; ``slices``: (expert, first row, end row)) whose token's adapter has LoRA on its expert: a
    run of tokens (first, end) is rows searchsorted(first) .. searchsorted(end) of its expert's."""
    host = tokens.tolist()
    out = []
    for e, a, b in slices:
        for start, end, terms in runs:
            lora = terms.experts.get(e)
            if lora is not None:
                first, last = bisect.bisect_left(host, start, a, b), bisect.bisect_left(host, end, a, b)
                if first < last:
                    out.append((first, last, lora))
    return out
