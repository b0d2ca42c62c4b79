"""BGMV shrink: the LoRA A product with one adapter slot per token (decode). Torch twin:
``kernels.lora_reference.bgmv_shrink``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    ranks_ptr,
    slot_ids_ptr,
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
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Program (token, k, r_block * SPLIT_K + split): y[k, token, r_block cols] as a matrix-vector product over
    in-features split, split + SPLIT_K, ... (blocks of BLOCK_K). Tokens with slot -1, and rank columns >= the slot's
    rank, exit at once."""
    t = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1).to(tl.int64)  # k * stride_ak may pass 2**31 for large adapter pools
    r_block = tl.program_id(2) // SPLIT_K
    split = tl.program_id(2) % SPLIT_K

    slot = tl.load(slot_ids_ptr + t).to(tl.int64)
    if slot < 0:
        return
    rank = tl.minimum(tl.load(ranks_ptr + slot), max_rank)
    r0 = r_block * BLOCK_R
    if r0 >= rank:
        return

    rcols = r0 + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    r_mask = rcols < rank
    a_rows = a_ptr + k * stride_ak + slot * stride_as + rcols[:, None] * stride_ar  # [BLOCK_R, 1]
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for i0 in range(split * BLOCK_K, in_features, SPLIT_K * BLOCK_K):
        cols = i0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        col_mask = cols < in_features
        x_vec = tl.load(x_ptr + t * stride_xt + cols * stride_xi, mask=col_mask, other=0.0)  # [BLOCK_K]
        a_tile = tl.load(
            a_rows + cols[None, :] * stride_ai, mask=r_mask[:, None] & col_mask[None, :], other=0.0
        )  # [BLOCK_R, BLOCK_K]
        acc += tl.sum(a_tile.to(tl.float32) * x_vec.to(tl.float32)[None, :], axis=1)

    y_ptrs = y_ptr + k * stride_yk + t * stride_yt + rcols * stride_yr
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc, mask=r_mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=r_mask)


def bgmv_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    ranks: torch.Tensor,
    slot_ids: torch.Tensor,
    *,
    block_r: int = 16,
    block_k: int = 256,
    split_k: int = 1,
) -> torch.Tensor:
    """The LoRA A product of every slice with one slot per token, in one launch.

    x: [T, in]; lora_a: [K, slots, R, in], x's dtype; ranks: [slots]; slot_ids: [T] (-1 = no adapter); integer
    tensors int32 or int64. Returns y: [K, T, R] float32 with, for each t with s = slot_ids[t] >= 0 and r = ranks[s],

        y[:, t, :r] = torch.einsum("i,kri->kr", x[t].float(), lora_a[:, s, :r].float())

    (float32 accumulation) and zeros elsewhere: columns >= r, and tokens with slot -1, which cost nothing.
    split_k > 1 splits the in-features over that many programs that add into y atomically (not bit-reproducible)."""
    num_tokens, in_features = x.shape
    num_slices, num_slots, max_rank, a_in = lora_a.shape
    assert a_in == in_features, f"lora_a in-features {a_in} != x's {in_features}"
    assert lora_a.dtype == x.dtype, f"lora_a dtype {lora_a.dtype} != x dtype {x.dtype}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype
    assert ranks.shape == (num_slots,), f"ranks {tuple(ranks.shape)} != ({num_slots},)"
    assert slot_ids.shape == (num_tokens,), f"slot_ids {tuple(slot_ids.shape)} != ({num_tokens},)"
    for t in (ranks, slot_ids):
        assert t.dtype in (torch.int32, torch.int64) and t.device == x.device, (t.dtype, t.device)
    assert lora_a.device == x.device
    assert all(b >= 1 and b & (b - 1) == 0 for b in (block_r, block_k)), "block sizes must be powers of two"
    assert split_k >= 1

    y = torch.zeros(num_slices, num_tokens, max_rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return y
    grid = (num_tokens, num_slices, triton.cdiv(max_rank, block_r) * split_k)
    _bgmv_shrink_kernel[grid](
        x,
        lora_a,
        y,
        ranks,
        slot_ids,
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
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
    )
    return y
