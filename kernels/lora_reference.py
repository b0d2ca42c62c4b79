"""Pure-torch twins of the LoRA kernels (kernels/lora_shrink.py, kernels/lora_expand.py). They define what each
kernel computes, run on any device, and are what kernels.ops runs where use_kernels says no and no faster path
applies. Same arguments and results as the kernel wrappers, less the block sizes.

They read the weights through the arena's adapter tables (kernels.lora_table) for the tiles of a tile map, into a
caller's workspace y [S, K, T, R] float32; they read the tables and the map back to the host, and may allocate."""

from __future__ import annotations

from itertools import pairwise

import torch

from lora_server.kernels import lora_table


def _table_row(
    arena_table: torch.Tensor, page: int, layer: int, module: int, table_stride: int, max_rank: int
) -> tuple[int, list[int], list[int], list[int]]:
    """(rank, A group offsets, B^T group offsets, DoRA's scale and shift offsets) of (layer, module) in the table of
    ``page``."""
    num_groups, length = lora_table.groups(max_rank), lora_table.row_len(max_rank)
    start = page * table_stride + (layer * lora_table.NUM_MODULES + module) * length
    row = arena_table[start : start + length].tolist()
    dora = lora_table.dora_column(max_rank)
    return min(row[0], max_rank), row[1 : 1 + num_groups], row[1 + num_groups : dora], row[dora : dora + 2]


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
            rank, a_starts, _, _ = _table_row(arena_table, page, layer, module_base + k, table_stride, max_rank)
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
    .float() @ BT.float()).to(dtype) for every tile with a page and slice k of rank r > 0 (max_width is unused); for
    a DoRA module, (that sum * S.float() + C.float()).to(dtype), S and C its scale and shift [c1 - c0]."""
    y_sum = y[:num_splits].sum(0)  # [K', T', R']
    starts = slice_starts.tolist()
    for page, first, end in tiles.tolist():
        if page < 0:
            continue
        for k, (c0, c1) in enumerate(pairwise(starts)):
            row = _table_row(arena_table, page, layer, module_base + k, table_stride, max_rank)
            rank, _, b_starts, (scale_at, shift_at) = row
            if rank > 0 and c1 > c0:
                bt = _group_rows(arena_w, b_starts, rank, c1 - c0)  # [r, width]
                delta = y_sum[k, first:end, :rank].to(arena_w.dtype).float() @ bt.float()
                value = out[first:end, c0:c1].float() + delta
                if scale_at >= 0:
                    scale, shift = arena_w[scale_at : scale_at + c1 - c0], arena_w[shift_at : shift_at + c1 - c0]
                    value = value * scale.float() + shift.float()
                out[first:end, c0:c1] = value.to(out.dtype)
