"""BGMV expand: the LoRA B product added into the base layer's output, with one adapter slot per token (decode).
Torch twin: ``kernels.lora_reference.bgmv_expand``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.sgmv_expand import slice_table


@triton.jit
def _bgmv_expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    ranks_ptr,
    slice_starts_ptr,
    slot_ids_ptr,
    max_rank,
    stride_yk,
    stride_yt,
    stride_yr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_ot,
    stride_on,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Program (token, k, n_block): out[token, slice k's columns n_block * BLOCK_N ...] += B[slot, those columns,
    :rank] @ y[k, token, :rank], summing over rank blocks of BLOCK_R. Tokens with slot -1, column blocks past the
    slice's end and rank-0 slots exit at once."""
    t = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    n_block = tl.program_id(2)

    slot = tl.load(slot_ids_ptr + t).to(tl.int64)
    if slot < 0:
        return
    col_begin = tl.load(slice_starts_ptr + k)
    col_end = tl.load(slice_starts_ptr + k + 1)
    n0 = col_begin + n_block * BLOCK_N
    if n0 >= col_end:
        return
    rank = tl.minimum(tl.load(ranks_ptr + slot), max_rank)
    if rank <= 0:
        return

    cols = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_mask = cols < col_end
    b_rows = b_ptr + slot * stride_bs + cols[:, None] * stride_bn  # [BLOCK_N, 1]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rcols = r0 + tl.arange(0, BLOCK_R)  # [BLOCK_R]
        r_mask = rcols < rank
        y_vec = tl.load(y_ptr + k * stride_yk + t * stride_yt + rcols * stride_yr, mask=r_mask, other=0.0)
        # y is rounded to B's dtype, as in the SGMV kernel's tensor-core product (the twin does the same)
        y_vec = y_vec.to(b_ptr.dtype.element_ty).to(tl.float32)  # [BLOCK_R]
        b_tile = tl.load(
            b_rows + rcols[None, :] * stride_br, mask=col_mask[:, None] & r_mask[None, :], other=0.0
        )  # [BLOCK_N, BLOCK_R]
        acc += tl.sum(b_tile.to(tl.float32) * y_vec[None, :], axis=1)

    out_ptrs = out_ptr + t * stride_ot + cols * stride_on
    base = tl.load(out_ptrs, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + acc).to(out_ptr.dtype.element_ty), mask=col_mask)


def bgmv_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    slice_starts: Sequence[int] | torch.Tensor,
    slot_ids: torch.Tensor,
    out: torch.Tensor,
    *,
    block_n: int = 128,
    block_r: int = 16,
) -> None:
    """Adds the LoRA B product of every slice into out, in place, in one launch, with one slot per token.

    y: [K, T, R] float32 (lora shrink's result); lora_b: [slots, out_total, R], out's dtype; out: [T, out_total];
    slice_starts: [K + 1] ints, slice k owns out columns slice_starts[k]:slice_starts[k + 1]; ranks, slot_ids as in
    bgmv_shrink. For each t with s = slot_ids[t] >= 0, r = ranks[s] and every k, with a, b = slice_starts[k],
    slice_starts[k + 1]:

        out[t, a:b] = (out[t, a:b].float()
                       + y[k, t, :r].to(lora_b.dtype).float() @ lora_b[s, a:b, :r].float().T).to(out.dtype)

    (float32 accumulation). y[:, t, r:] is never read. Rows with slot -1 are not touched and cost nothing."""
    num_slices, num_tokens, max_rank = y.shape
    num_slots, out_total, b_rank = lora_b.shape
    assert y.dtype == torch.float32, f"y must be float32, got {y.dtype}"
    assert b_rank == max_rank, f"lora_b rank {b_rank} != y's {max_rank}"
    assert out.shape == (num_tokens, out_total), f"out {tuple(out.shape)} != ({num_tokens}, {out_total})"
    assert lora_b.dtype == out.dtype, f"lora_b dtype {lora_b.dtype} != out dtype {out.dtype}"
    assert out.dtype in (torch.float32, torch.float16, torch.bfloat16), out.dtype
    assert ranks.shape == (num_slots,), f"ranks {tuple(ranks.shape)} != ({num_slots},)"
    assert slot_ids.shape == (num_tokens,), f"slot_ids {tuple(slot_ids.shape)} != ({num_tokens},)"
    for t in (ranks, slot_ids):
        assert t.dtype in (torch.int32, torch.int64) and t.device == out.device, (t.dtype, t.device)
    assert y.device == lora_b.device == out.device
    assert all(b >= 1 and b & (b - 1) == 0 for b in (block_n, block_r)), "block sizes must be powers of two"
    starts, max_width = slice_table(slice_starts, out_total, out.device)
    assert starts.shape == (num_slices + 1,), f"{num_slices} slices in y but slice_starts has {starts.shape[0]} entries"

    if num_tokens == 0 or max_width == 0:
        return
    grid = (num_tokens, num_slices, triton.cdiv(max_width, block_n))
    _bgmv_expand_kernel[grid](
        y,
        lora_b,
        out,
        ranks,
        starts,
        slot_ids,
        max_rank,
        y.stride(0),
        y.stride(1),
        y.stride(2),
        lora_b.stride(0),
        lora_b.stride(1),
        lora_b.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_N=block_n,
        BLOCK_R=block_r,
    )
