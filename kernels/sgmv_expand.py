"""SGMV expand: the LoRA B product added into the base layer's output, for tokens grouped in contiguous segments,
one adapter slot per segment (prefill and chunked prefill). Torch twin: ``kernels.lora_reference.sgmv_expand``."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
import triton
import triton.language as tl

from kernels.sgmv_shrink import segment_tiles


@triton.jit
def _sgmv_expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    ranks_ptr,
    slice_starts_ptr,
    seg_starts_ptr,
    seg_slots_ptr,
    tile_seg_ptr,
    tile_row_ptr,
    num_segments,
    max_rank,
    stride_yk,
    stride_yt,
    stride_yr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_ot,
    stride_on,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (tile, k, n_block): out[rows, slice k's columns n_block * BLOCK_N ...] += y[k, rows, :rank] @
    B[slot, those columns, :rank].T for one BLOCK_T-row tile of one segment, summing over rank blocks of BLOCK_R.
    Tiles past the map's end, column blocks past the slice's end and rank-0 slots exit at once."""
    tile = tl.program_id(0)
    k = tl.program_id(1)
    n_block = tl.program_id(2)

    seg = tl.load(tile_seg_ptr + tile)
    if seg >= num_segments:
        return
    col_begin = tl.load(slice_starts_ptr + k)
    col_end = tl.load(slice_starts_ptr + k + 1)
    n0 = col_begin + n_block * BLOCK_N
    if n0 >= col_end:
        return
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)  # >= 0: the tile map holds no -1 segments
    rank = tl.minimum(tl.load(ranks_ptr + slot), max_rank)
    if rank <= 0:
        return

    row0 = tl.load(tile_row_ptr + tile)
    row_end = tl.load(seg_starts_ptr + seg + 1)
    rows = (row0 + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BLOCK_T]
    cols = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_mask = rows < row_end
    col_mask = cols < col_end

    y_rows = y_ptr + k * stride_yk + rows[:, None] * stride_yt  # [BLOCK_T, 1]
    b_cols = b_ptr + slot * stride_bs + cols[None, :] * stride_bn  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rcols = r0 + tl.arange(0, BLOCK_R)  # [BLOCK_R]
        r_mask = rcols < rank
        y_tile = tl.load(
            y_rows + rcols[None, :] * stride_yr, mask=row_mask[:, None] & r_mask[None, :], other=0.0
        )  # [BLOCK_T, BLOCK_R] float32
        b_tile = tl.load(
            b_cols + rcols[:, None] * stride_br, mask=r_mask[:, None] & col_mask[None, :], other=0.0
        )  # [BLOCK_R, BLOCK_N] = B[s].T
        # y is rounded to B's dtype, as the tensor cores take it (the twin does the same)
        y_tile = y_tile.to(b_ptr.dtype.element_ty)
        if DOT_IN_FP32:
            y_tile = y_tile.to(tl.float32)
            b_tile = b_tile.to(tl.float32)
        acc = tl.dot(y_tile, b_tile, acc, input_precision=PRECISION)

    out_ptrs = out_ptr + rows[:, None] * stride_ot + cols[None, :] * stride_on
    out_mask = row_mask[:, None] & col_mask[None, :]
    base = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + acc).to(out_ptr.dtype.element_ty), mask=out_mask)


def slice_table(
    slice_starts: Sequence[int] | torch.Tensor, out_total: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """(slice_starts as an integer tensor [K + 1] on device, the widest slice's width).

    A list (or CPU tensor) is copied to the device on every call, from pinned memory without waiting for the
    stream. A tensor already on a non-CPU device is used as is, with nothing copied (what CUDA graphs need); the
    width returned is then out_total, a bound (the grid gets more column blocks than needed; those exit at once)."""
    if isinstance(slice_starts, torch.Tensor) and slice_starts.device.type != "cpu":
        assert slice_starts.device == device, (slice_starts.device, device)
        return slice_starts, out_total
    starts = slice_starts.tolist() if isinstance(slice_starts, torch.Tensor) else list(slice_starts)
    assert starts[0] == 0 and starts[-1] == out_total, f"slice_starts {starts} must run from 0 to {out_total}"
    widths = [b - a for a, b in pairwise(starts)]
    assert min(widths) >= 0, f"slice_starts {starts} must not decrease"
    host = torch.tensor(starts, dtype=torch.int32, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True), max(widths)  # pinned: the copy does not wait for the stream


def sgmv_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    slice_starts: Sequence[int] | torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    out: torch.Tensor,
    *,
    block_t: int = 32,
    block_n: int = 64,
    block_r: int = 16,
) -> None:
    """Adds the LoRA B product of every slice into out, in place, in one launch.

    y: [K, T, R] float32 (lora shrink's result); lora_b: [slots, out_total, R], out's dtype; out: [T, out_total];
    slice_starts: [K + 1] ints, slice k owns out columns slice_starts[k]:slice_starts[k + 1]; ranks, seg_starts,
    seg_slots as in sgmv_shrink. For t in segment g with s = seg_slots[g] >= 0, r = ranks[s] and every k, with
    a, b = slice_starts[k], slice_starts[k + 1]:

        out[t, a:b] = (out[t, a:b].float()
                       + y[k, t, :r].to(lora_b.dtype).float() @ lora_b[s, a:b, :r].float().T).to(out.dtype)

    (float32 accumulation). y[:, t, r:] is never read. Rows of -1 segments are not touched and cost nothing."""
    num_slices, num_tokens, max_rank = y.shape
    num_slots, out_total, b_rank = lora_b.shape
    num_segments = seg_slots.shape[0]
    assert y.dtype == torch.float32, f"y must be float32, got {y.dtype}"
    assert b_rank == max_rank, f"lora_b rank {b_rank} != y's {max_rank}"
    assert out.shape == (num_tokens, out_total), f"out {tuple(out.shape)} != ({num_tokens}, {out_total})"
    assert lora_b.dtype == out.dtype, f"lora_b dtype {lora_b.dtype} != out dtype {out.dtype}"
    assert out.dtype in (torch.float32, torch.float16, torch.bfloat16), out.dtype
    assert ranks.shape == (num_slots,), f"ranks {tuple(ranks.shape)} != ({num_slots},)"
    assert seg_starts.shape == (num_segments + 1,), f"seg_starts {tuple(seg_starts.shape)} != ({num_segments + 1},)"
    for t in (ranks, seg_starts, seg_slots):
        assert t.dtype in (torch.int32, torch.int64) and t.device == out.device, (t.dtype, t.device)
    assert y.device == lora_b.device == out.device
    assert min(block_t, block_n, block_r) >= 16, "tl.dot needs tile sides >= 16"
    assert all(b & (b - 1) == 0 for b in (block_t, block_n, block_r)), "block sizes must be powers of two"
    starts, max_width = slice_table(slice_starts, out_total, out.device)
    assert starts.shape == (num_slices + 1,), f"{num_slices} slices in y but slice_starts has {starts.shape[0]} entries"

    if num_tokens == 0 or num_segments == 0 or max_width == 0:
        return
    # the interpreter (CPU tensors) multiplies bfloat16 bit patterns in tl.dot (triton issue #11584)
    dot_in_fp32 = out.device.type == "cpu" and out.dtype == torch.bfloat16
    tile_seg, tile_row = segment_tiles(seg_starts, seg_slots, block_t, num_tokens)
    grid = (tile_seg.shape[0], num_slices, triton.cdiv(max_width, block_n))
    _sgmv_expand_kernel[grid](
        y,
        lora_b,
        out,
        ranks,
        starts,
        seg_starts,
        seg_slots,
        tile_seg,
        tile_row,
        num_segments,
        max_rank,
        y.stride(0),
        y.stride(1),
        y.stride(2),
        lora_b.stride(0),
        lora_b.stride(1),
        lora_b.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        DOT_IN_FP32=dot_in_fp32,
        PRECISION="ieee" if dot_in_fp32 or out.dtype == torch.float32 else "tf32",
    )
