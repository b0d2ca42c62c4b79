"""Multi-LoRA as a few matmuls per adapter segment: the path where there are no Triton kernels (the CPU).

The step's tokens come ordered so that each adapter's tokens are contiguous (the runner sorts them once per step),
and each segment carries its adapter's terms: views of its weights where they lie (the arena's pages), made once
when the adapter was loaded. Nothing here reads a device tensor, sorts or searches: per segment and term one batched
shrink over the term's slices and one in-place multiply-add per output, at the adapter's own rank. Same result as
the twins (kernels.lora_reference) up to float rounding: the twins round y to the weights' dtype and add in
float32, here the matmuls accumulate in the model's dtype. A DoRA module's epilogue (out * scale + shift on its
columns, kernels.lora_table) runs after every term of its segment has added its part."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LoraTerm:
    """Part of one adapter's LoRA in one fused linear: y = x @ a_t (y [T, R']) and, for each output
    (y0, y1, c0, c1, bt), out[:, c0:c1] += y[:, y0:y1] @ bt. Usually one term holds a whole group (its slices' A
    back to back: one 2-D shrink for all of them, one output per slice); larger adapters split into a term per
    piece."""

    a_t: torch.Tensor  # [in, R'] A's rows of the term, transposed (a view)
    outputs: list[tuple[int, int, int, int, torch.Tensor]]  # (y0, y1, c0, c1, bt [y1 - y0, c1 - c0])
    # DoRA: (c0, c1, scale [c1 - c0], shift [c1 - c0] or None for zeros): out[:, c0:c1] = out[:, c0:c1] * scale +
    # shift, after this term's outputs; the builder gives them to a group's last term, so they follow every term
    epilogues: tuple[tuple[int, int, torch.Tensor, torch.Tensor | None], ...] = ()


def apply_lora_segments(
    x: torch.Tensor, out: torch.Tensor, segments: Sequence[tuple[int, int, Sequence[LoraTerm]]]
) -> None:
    """In place, for each segment (start, end, terms) and term: out[start:end] += the term's LoRA of x[start:end].
    x [T, in]; out [T, out_total]; rows outside every segment are not touched. Two-dimensional matmuls only: a
    batched one would broadcast x over the slices at a cost of its own (measured: most of this path's time)."""
    whole = len(segments) == 1 and segments[0][0] == 0 and segments[0][1] == x.shape[0]
    for start, end, terms in segments:
        if end <= start:
            continue
        rows_x, rows_out = (x, out) if whole else (x[start:end], out[start:end])
        for term in terms:
            y = torch.mm(rows_x, term.a_t)  # [rows, R']
            for y0, y1, c0, c1, bt in term.outputs:
                target = rows_out if c0 == 0 and c1 == out.shape[1] else rows_out[:, c0:c1]
                target.addmm_(y if y0 == 0 and y1 == y.shape[1] else y[:, y0:y1], bt)
            for c0, c1, scale, shift in term.epilogues:
                target = rows_out[:, c0:c1].mul_(scale)
                if shift is not None:
                    target.add_(shift)
