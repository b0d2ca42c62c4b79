"""Pure-torch twins of the LoRA kernels (sgmv_shrink, sgmv_expand, bgmv_shrink, bgmv_expand, lora_shrink,
lora_expand). They define what each kernel computes, run on any device, and are what kernels.ops runs where
use_kernels says no (the CPU). Same arguments and results as the kernel wrappers, less the block sizes.

Layout: x [T, in]; lora_a [K, slots, R, in]; lora_b [slots, out_total, R] (slices concatenated along the rows,
slice k owning slice_starts[k]:slice_starts[k + 1]); ranks [slots]; y [K, T, R] float32. Columns r >= ranks[s] of
A and B are never read, nor y[:, t, r:] by expand.

The paged twins (paged_lora_shrink, paged_lora_expand) read the weights through the arena's adapter tables
(kernels.lora_table) for the tiles of a tile map, into a caller's workspace y [S, K, T, R] float32; they read the
tables and the map back to the host, and may allocate."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import pairwise

import torch

from kernels import lora_table


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


def _table_row(
    arena_table: torch.Tensor, page: int, layer: int, module: int, table_stride: int, max_rank: int
) -> tuple[int, list[int], list[int]]:
    """(rank, A group offsets, B^T group offsets) of (layer, module) in the table of ``page``."""
    num_groups, length = lora_table.groups(max_rank), lora_table.row_len(max_rank)
    start = page * table_stride + (layer * lora_table.NUM_MODULES + module) * length
    row = arena_table[start : start + length].tolist()
    return min(row[0], max_rank), row[1 : 1 + num_groups], row[1 + num_groups :]


def _group_rows(arena_w: torch.Tensor, starts: list[int], rank: int, row_len: int) -> torch.Tensor:
    """The [rank, row_len] matrix whose 16-row groups start at arena_w[starts[g]]."""
    sizes = [min(lora_table.ROW_GROUP, rank - g * lora_table.ROW_GROUP) * row_len for g in range(len(starts))]
    return torch.cat([arena_w[s : s + n] for s, n in zip(starts, sizes, strict=True) if n > 0]).view(rank, row_len)


def paged_lora_shrink(
    x: torch.Tensor,
    arena_w: torch.Tensor,
    arena_table: torch.Tensor,
    tiles: torch.Tensor,
    y: torch.Tensor,
    *,
    layer: int,
    module_base: int,
    num_slices: int,
    table_stride: int,
    max_rank: int,
    num_splits: int = 1,
) -> None:
    """lora_shrink's result, read as y[:num_splits].sum(0): the whole product goes into y[0, k, a:b, :r] and zeros
    into y[1:num_splits, k, a:b, :r] (the entries the kernel writes, no others), so y[0] alone equals the sum too
    and an expand with num_splits=1 gives the same out."""
    for page, first, end in tiles.tolist():
        if page < 0:
            continue
        for k in range(num_slices):
            rank, a_starts, _ = _table_row(arena_table, page, layer, module_base + k, table_stride, max_rank)
            if rank > 0:
                a = _group_rows(arena_w, a_starts, rank, x.shape[1])  # [r, in]
                y[0, k, first:end, :rank] = x[first:end].float() @ a.float().T
                y[1:num_splits, k, first:end, :rank] = 0.0


def paged_lora_expand(
    y: torch.Tensor,
    arena_w: torch.Tensor,
    arena_table: torch.Tensor,
    tiles: torch.Tensor,
    slice_starts: torch.Tensor,
    out: torch.Tensor,
    *,
    layer: int,
    module_base: int,
    max_width: int,
    table_stride: int,
    max_rank: int,
    num_splits: int = 1,
) -> None:
    """lora_expand: out[a:b, c0:c1] = (out[a:b, c0:c1].float() + y[:num_splits, k, a:b, :r].sum(0).to(dtype)
    .float() @ BT.float()).to(dtype) for every tile with a page and slice k of rank r > 0 (max_width is unused)."""
    y_sum = y[:num_splits].sum(0)  # [K', T', R']
    starts = slice_starts.tolist()
    for page, first, end in tiles.tolist():
        if page < 0:
            continue
        for k, (c0, c1) in enumerate(pairwise(starts)):
            rank, _, b_starts = _table_row(arena_table, page, layer, module_base + k, table_stride, max_rank)
            if rank > 0 and c1 > c0:
                bt = _group_rows(arena_w, b_starts, rank, c1 - c0)  # [r, width]
                delta = y_sum[k, first:end, :rank].to(arena_w.dtype).float() @ bt.float()
                out[first:end, c0:c1] = (out[first:end, c0:c1].float() + delta).to(out.dtype)
