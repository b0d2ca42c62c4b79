"""SGMV shrink: the LoRA A product for tokens grouped in contiguous segments, one adapter slot per segment
(prefill and chunked prefill). Torch twin: ``kernels.lora_reference.sgmv_shrink``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    ranks_ptr,
    seg_starts_ptr,
    seg_slots_ptr,
    tile_seg_ptr,
    tile_row_ptr,
    num_segments,
    in_features,
    max_rank,
    stride_xt,
    stride_xi,
    stride_ak,
    stride_as,
    stride_ar,
    stride_ai,
    stride_yk,
    stride_yt,
    stride_yr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (tile, k, r_block * SPLIT_K + split): y[k, rows, r_block cols] of one BLOCK_T-row tile of one
    segment (the tile map says which segment and first row), summing over in-features split, split + SPLIT_K, ...
    (blocks of BLOCK_K). Tiles past the map's end, and rank columns >= the slot's rank, exit at once."""
    tile = tl.program_id(0)
    k = tl.program_id(1).to(tl.int64)  # k * stride_ak may pass 2**31 for large adapter pools
    r_block = tl.program_id(2) // SPLIT_K
    split = tl.program_id(2) % SPLIT_K

    seg = tl.load(tile_seg_ptr + tile)
    if seg >= num_segments:
        return
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)  # >= 0: the tile map holds no -1 segments
    rank = tl.minimum(tl.load(ranks_ptr + slot), max_rank)
    r0 = r_block * BLOCK_R
    if r0 >= rank:
        return

    row0 = tl.load(tile_row_ptr + tile)
    row_end = tl.load(seg_starts_ptr + seg + 1)
    rows = (row0 + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BLOCK_T]
    rcols = r0 + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    row_mask = rows < row_end
    r_mask = rcols < rank

    x_rows = x_ptr + rows[:, None] * stride_xt  # [BLOCK_T, 1]
    a_base = a_ptr + k * stride_ak + slot * stride_as + rcols[None, :] * stride_ar  # [1, BLOCK_R]
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for i0 in range(split * BLOCK_K, in_features, SPLIT_K * BLOCK_K):
        cols = i0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        col_mask = cols < in_features
        x_tile = tl.load(
            x_rows + cols[None, :] * stride_xi, mask=row_mask[:, None] & col_mask[None, :], other=0.0
        )  # [BLOCK_T, BLOCK_K]
        a_tile = tl.load(
            a_base + cols[:, None] * stride_ai, mask=col_mask[:, None] & r_mask[None, :], other=0.0
        )  # [BLOCK_K, BLOCK_R] = A[k, s].T
        if DOT_IN_FP32:
            x_tile = x_tile.to(tl.float32)
            a_tile = a_tile.to(tl.float32)
        acc = tl.dot(x_tile, a_tile, acc, input_precision=PRECISION)

    y_ptrs = y_ptr + k * stride_yk + rows[:, None] * stride_yt + rcols[None, :] * stride_yr
    y_mask = row_mask[:, None] & r_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc, mask=y_mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=y_mask)


def segment_tiles(
    seg_starts: torch.Tensor, seg_slots: torch.Tensor, block_t: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The work list of an SGMV launch, built on the device without a host sync: each segment with a slot >= 0 is
    cut into ceil(len / block_t) tiles of block_t rows; -1 and empty segments get none.

    Returns (tile_seg, tile_row), both [min(T, ceil(T / block_t) + S)] int64 (that many programs on grid axis 0,
    an upper bound on the tile count): tile i covers rows tile_row[i] : min(tile_row[i] + block_t,
    seg_starts[tile_seg[i] + 1]) of segment tile_seg[i]; tile_seg[i] == S marks a program with nothing to do."""
    num_segments = seg_slots.shape[0]
    lengths = (seg_starts[1:] - seg_starts[:-1]).long()  # [S]
    tiles = torch.where(seg_slots >= 0, (lengths + block_t - 1) // block_t, 0)  # [S]
    tile_end = tiles.cumsum(0)  # [S]
    num_programs = min(num_tokens, triton.cdiv(num_tokens, block_t) + num_segments)
    pid = torch.arange(num_programs, device=seg_starts.device)
    tile_seg = torch.searchsorted(tile_end, pid, right=True)  # [P]; S past the last tile
    seg = tile_seg.clamp(max=num_segments - 1)
    tile_row = seg_starts.long()[seg] + (pid - (tile_end - tiles)[seg]) * block_t
    return tile_seg, tile_row


def sgmv_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    ranks: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    block_t: int = 32,
    block_r: int = 16,
    block_k: int = 64,
    split_k: int = 1,
) -> torch.Tensor:
    """The LoRA A product of every slice for segmented tokens, in one launch.

    x: [T, in]; lora_a: [K, slots, R, in], x's dtype; ranks: [slots]; seg_starts: [S + 1] (seg_starts[0] = 0,
    seg_starts[S] = T, empty segments allowed); seg_slots: [S] (-1 = no adapter); integer tensors int32 or int64.
    Returns y: [K, T, R] float32 with, for t in segment g with s = seg_slots[g] >= 0 and r = ranks[s],

        y[:, t, :r] = torch.einsum("i,kri->kr", x[t].float(), lora_a[:, s, :r].float())

    (float32 accumulation) and zeros elsewhere: columns >= r, and tokens of -1 segments, which cost nothing.
    split_k > 1 splits the in-features over that many programs that add into y atomically (not bit-reproducible)."""
    num_tokens, in_features = x.shape
    num_slices, num_slots, max_rank, a_in = lora_a.shape
    num_segments = seg_slots.shape[0]
    assert a_in == in_features, f"lora_a in-features {a_in} != x's {in_features}"
    assert lora_a.dtype == x.dtype, f"lora_a dtype {lora_a.dtype} != x dtype {x.dtype}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype
    assert ranks.shape == (num_slots,), f"ranks {tuple(ranks.shape)} != ({num_slots},)"
    assert seg_starts.shape == (num_segments + 1,), f"seg_starts {tuple(seg_starts.shape)} != ({num_segments + 1},)"
    for t in (ranks, seg_starts, seg_slots):
        assert t.dtype in (torch.int32, torch.int64) and t.device == x.device, (t.dtype, t.device)
    assert lora_a.device == x.device
    assert min(block_t, block_r, block_k) >= 16 and split_k >= 1, "tl.dot needs tile sides >= 16"
    assert all(b & (b - 1) == 0 for b in (block_t, block_r, block_k)), "block sizes must be powers of two"

    y = torch.zeros(num_slices, num_tokens, max_rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0 or num_segments == 0:
        return y
    # the interpreter (CPU tensors) multiplies bfloat16 bit patterns in tl.dot (triton issue #11584)
    dot_in_fp32 = x.device.type == "cpu" and x.dtype == torch.bfloat16
    tile_seg, tile_row = segment_tiles(seg_starts, seg_slots, block_t, num_tokens)
    grid = (tile_seg.shape[0], num_slices, triton.cdiv(max_rank, block_r) * split_k)
    _sgmv_shrink_kernel[grid](
        x,
        lora_a,
        y,
        ranks,
        seg_starts,
        seg_slots,
        tile_seg,
        tile_row,
        num_segments,
        in_features,
        max_rank,
        x.stride(0),
        x.stride(1),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_a.stride(2),
        lora_a.stride(3),
        y.stride(0),
        y.stride(1),
        y.stride(2),
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        DOT_IN_FP32=dot_in_fp32,
        PRECISION="ieee" if dot_in_fp32 or x.dtype == torch.float32 else "tf32",
    )
    return y
