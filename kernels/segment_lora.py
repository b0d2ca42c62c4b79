"""Multi-LoRA as a few matmuls per adapter segment: the path where there are no Triton kernels (the CPU).

The step's tokens come ordered so that each adapter's tokens are contiguous (the runner sorts them once per step),
and each segment carries its slot and rank as host integers, so nothing here reads a device tensor, sorts or
searches: per segment one batched shrink over every output slice and one in-place multiply-add per slice, at the
adapter's own rank. Same result as lora_reference.sgmv_shrink + sgmv_expand up to float rounding (the twins round
y to B's dtype and add in float32; here the matmuls accumulate in the model's dtype)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# (slot, rank) -> (A's rows of every slice, transposed [K, in, rank]; B's columns of each slice, transposed
# [rank, width_k]): views into one wrapper's lora_a / lora_b, valid as long as those tensors are
SlotViews = dict[tuple[int, int], tuple[torch.Tensor, list[torch.Tensor]]]


def apply_lora_segments(
    x: torch.Tensor,
    out: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slice_starts: Sequence[int],
    segments: Sequence[tuple[int, int, int, int]],
    views: SlotViews | None = None,
) -> None:
    """In place, for each segment (start, end, slot, rank) and slice k = a:b:
    out[start:end, a:b] += (x[start:end] @ lora_a[k, slot, :rank].T) @ lora_b[slot, a:b, :rank].T.
    x [T, in]; out [T, out_total]; lora_a [K, slots, R, in]; lora_b [slots, out_total, R]; segments with
    rank 0 or slot -1 are skipped; rows outside every segment are not touched. ``views``: a dict the caller keeps
    for these lora_a and lora_b, so that each (slot, rank)'s views are made once."""
    views = {} if views is None else views
    whole = len(segments) == 1 and segments[0][0] == 0 and segments[0][1] == x.shape[0]
    for start, end, slot, rank in segments:
        if slot < 0 or rank <= 0 or end <= start:
            continue
        pair = views.get((slot, rank))
        if pair is None:
            b_rows = lora_b[slot, :, :rank]
            pair = views[(slot, rank)] = (
                lora_a[:, slot, :rank].mT,
                [b_rows[a:b].T for a, b in zip(slice_starts, slice_starts[1:], strict=False)],
            )
        a_t, b_ts = pair
        rows_x, rows_out = (x, out) if whole else (x[start:end], out[start:end])
        y = torch.matmul(rows_x, a_t)  # [K, n, rank]
        if len(b_ts) == 1:
            rows_out.addmm_(y[0], b_ts[0])
            continue
        for k, b_t in enumerate(b_ts):
            rows_out[:, slice_starts[k] : slice_starts[k + 1]].addmm_(y[k], b_t)
