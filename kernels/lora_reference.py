"""Pure-torch twins of the LoRA kernels (sgmv_shrink, sgmv_expand, bgmv_shrink, bgmv_expand). They define what
each kernel computes, run on any device, and are what kernels.ops runs where use_kernels says no (the
CPU). Same arguments and results as the kernel wrappers, less the block sizes.

Layout: x [T, in]; lora_a [K, slots, R, in]; lora_b [slots, out_total, R] (slices concatenated along the rows,
slice k owning slice_starts[k]:slice_starts[k + 1]); ranks [slots]; y [K, T, R] float32. Columns r >= ranks[s] of
A and B are never read, nor y[:, t, r:] by expand."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import pairwise

import torch


def tokens_by_slot(slot_ids: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(slot, indices of the tokens with that slot) for each slot >= 0 present in slot_ids [T]."""
    ids = slot_ids.long()
    for slot in torch.unique(ids).tolist():
        if slot >= 0:
            yield slot, (ids == slot).nonzero().squeeze(1)


def segment_slot_ids(seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> torch.Tensor:
    """The per-token slots [T] of a segmented batch: seg_slots[g] repeated over seg_starts[g]:seg_starts[g + 1]."""
    lengths = (seg_starts[1:] - seg_starts[:-1]).long()
    return torch.repeat_interleave(seg_slots, lengths)


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """y [K, T, R] float32: y[:, t, :r] = einsum("i,kri->kr", x[t].float(), lora_a[:, s, :r].float()) for
    s = slot_ids[t] >= 0, r = ranks[s]; zeros elsewhere."""
    num_slices, _, max_rank, _ = lora_a.shape
    y = torch.zeros(num_slices, x.shape[0], max_rank, dtype=torch.float32, device=x.device)
    rank_of = ranks.tolist()
    for slot, rows in tokens_by_slot(slot_ids):
        r = min(rank_of[slot], max_rank)
        if r > 0:
            y[:, rows, :r] = torch.einsum("ti,kri->ktr", x[rows].float(), lora_a[:, slot, :r].float())
    return y


def bgmv_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    slice_starts: Sequence[int] | torch.Tensor,
    slot_ids: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """In place, for each t with s = slot_ids[t] >= 0, r = ranks[s] and slice k = a:b,
    out[t, a:b] = (out[t, a:b].float() + y[k, t, :r].to(lora_b.dtype).float() @ lora_b[s, a:b, :r].float().T)
    .to(out.dtype). Rows with slot -1 are not touched."""
    starts = slice_starts.tolist() if isinstance(slice_starts, torch.Tensor) else list(slice_starts)
    max_rank = y.shape[2]
    rank_of = ranks.tolist()
    for slot, rows in tokens_by_slot(slot_ids):
        r = min(rank_of[slot], max_rank)
        if r <= 0:
            continue
        y_rounded = y[:, rows, :r].to(lora_b.dtype).float()  # [K, n, r]
        for k, (a, b) in enumerate(pairwise(starts)):
            delta = y_rounded[k] @ lora_b[slot, a:b, :r].float().T  # [n, b - a]
            out[rows, a:b] = (out[rows, a:b].float() + delta).to(out.dtype)


def sgmv_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor
) -> torch.Tensor:
    """bgmv_shrink with the per-token slots of the segments (see segment_slot_ids)."""
    return bgmv_shrink(x, lora_a, ranks, segment_slot_ids(seg_starts, seg_slots))


def sgmv_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    slice_starts: Sequence[int] | torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """bgmv_expand with the per-token slots of the segments (see segment_slot_ids)."""
    bgmv_expand(y, lora_b, ranks, slice_starts, segment_slot_ids(seg_starts, seg_slots), out)
