"""Rotary embedding fused with the KV write: one launch rotates this step's query and key heads in place (neox /
HF rotate_half layout, from the step's gathered cos/sin rows) and writes the rotated keys and the values into their
slots of the paged KV cache, quantized to float8 e4m3 with a scale per KV head where the cache is fp8. Torch twin:
``kernels.reference.rotary_write_kv`` (``kernels.reference.apply_rotary_`` then ``write_kv_cache``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_server.kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, expect, expect_kv_cache
from lora_server.kernels.reference import FP8_KV_DTYPE
from lora_server.kernels.write_kv import _round_to_e4m3


@triton.jit
def _rotary_write_kv_kernel(
    qk_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ct,
    stride_cd,
    stride_st,
    stride_sd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
):
    """Program (token): every head h of qk[token] ([H + KVH, D], query heads then key heads, BLOCK_H at a time)
    becomes x * cos + x.roll(D // 2) * sin_signed (each product rounded to the dtype, then the sum: HF's two
    roundings), stored back in place; heads h >= H (keys) also go to slot slot_mapping[token], and v[token] to
    the same slot of the value cache. A negative slot (a padding token) writes no cache row; its heads are still
    rotated. QUANTIZE: the cache is fp8, values divided by their KV head's scale, clamped and rounded to e4m3 as
    kernels.write_kv does."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    d_mask = d < HEAD_DIM
    # as a [1, BLOCK_D] tensor: the interpreter rejects masks broadcast from a scalar boolean
    write = tl.zeros([1, BLOCK_D], dtype=tl.int64) + slot >= 0
    # x.roll(D // 2)[d] = x[(d + D // 2) % D]; with partial rotary (ROTARY_DIM < D) the roll is within the first
    # ROTARY_DIM dimensions and the others pair with themselves (their sin is 0)
    partner = tl.where(d < ROTARY_DIM, (d + ROTARY_DIM // 2) % ROTARY_DIM, d)
    cos = tl.load(cos_ptr + token * stride_ct + d * stride_cd, mask=d_mask, other=0.0)  # [1, BLOCK_D]
    sin = tl.load(sin_ptr + token * stride_st + d * stride_sd, mask=d_mask, other=0.0)
    row = qk_ptr + token * stride_qt
    for h0 in tl.static_range(0, NUM_Q_HEADS + NUM_KV_HEADS, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
        mask = (h < NUM_Q_HEADS + NUM_KV_HEADS) & d_mask
        x = tl.load(row + h * stride_qh + d * stride_qd, mask=mask, other=0.0)
        x_partner = tl.load(row + h * stride_qh + partner * stride_qd, mask=mask, other=0.0)
        a = (x.to(tl.float32) * cos.to(tl.float32)).to(x.dtype)
        b = (x_partner.to(tl.float32) * sin.to(tl.float32)).to(x.dtype)
        x = (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
        tl.store(row + h * stride_qh + d * stride_qd, x, mask=mask)
        kv_head = h - NUM_Q_HEADS
        k_mask = mask & (kv_head >= 0) & write
        if QUANTIZE:
            k_scale = tl.load(k_scale_ptr + kv_head, mask=k_mask, other=1.0)  # [BLOCK_H, 1]
            k8 = tl.clamp(tl.math.div_rn(x.to(tl.float32), k_scale), -FP8_MAX, FP8_MAX)
            x = _round_to_e4m3(k8)
        tl.store(
            k_cache_ptr + page * stride_kcb + offset * stride_kcs + kv_head * stride_kch + d * stride_kcd,
            x.to(k_cache_ptr.dtype.element_ty),
            mask=k_mask,
        )
    h = tl.arange(0, BLOCK_KVH)[:, None]  # [BLOCK_KVH, 1]
    v_mask = (h < NUM_KV_HEADS) & d_mask & write
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d * stride_vd, mask=v_mask, other=0.0)
    if QUANTIZE:
        v_scale = tl.load(v_scale_ptr + h, mask=h < NUM_KV_HEADS, other=1.0)
        v = _round_to_e4m3(tl.clamp(tl.math.div_rn(v.to(tl.float32), v_scale), -FP8_MAX, FP8_MAX))
    tl.store(
        v_cache_ptr + page * stride_vcb + offset * stride_vcs + h * stride_vch + d * stride_vcd,
        v.to(v_cache_ptr.dtype.element_ty),
        mask=v_mask,
    )


def rotary_write_kv(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    rotary_dim: int = 0,
) -> None:
    """In place, one launch:

        qk.copy_(qk * cos + qk.roll(D // 2, -1) * sin_signed)   # each product rounded to qk's dtype, then the sum
        write_kv_cache(qk[:, H:], v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    i.e. ``kernels.reference.rotary_write_kv``: the query and key heads rotated (HF's q * cos + rotate_half(q) *
    sin, sin_signed being sin with its first half negated), then the rotated keys and the values written to their
    slots (k_cache.view(-1, KVH, D)[slot_mapping] = k.to(k_cache.dtype), or quantized to fp8 with k_scale /
    v_scale as kernels.write_kv). Tokens with a negative slot (padding) are rotated and write nothing.

    qk: [T, H + KVH, D], the query heads then the key heads (a view of a fused QKV output: any strides);
    v: [T, KVH, D], any strides, qk's dtype (float32, float16, bfloat16); cos, sin_signed: [T, 1, D] in qk's
    dtype; k_cache, v_cache: [num_blocks, block_size, KVH, D], qk's dtype or float8_e4m3fn with k_scale, v_scale
    [KVH] float32 contiguous; slot_mapping: [T] int32 or int64, distinct where >= 0. rotary_dim R in (0, D):
    partial rotary, the roll within the first R dimensions (the twin's apply_rotary_); 0: all of D."""
    num_tokens, num_heads_total, head_dim = qk.shape
    num_kv_heads = k_cache.shape[2]
    num_q_heads = num_heads_total - num_kv_heads
    assert num_q_heads > 0 and head_dim % 2 == 0, (tuple(qk.shape), tuple(k_cache.shape))
    expect(qk, "qk", dtype=FLOAT_DTYPES)
    expect(v, "v", dtype=qk.dtype, shape=(num_tokens, num_kv_heads, head_dim), device=qk.device)
    expect(cos, "cos", dtype=qk.dtype, shape=(num_tokens, 1, head_dim), device=qk.device)
    expect(sin_signed, "sin_signed", dtype=qk.dtype, shape=(num_tokens, 1, head_dim), device=qk.device)
    assert k_cache.shape[3] == head_dim, f"cache {tuple(k_cache.shape)} vs qk {tuple(qk.shape)}"
    expect(slot_mapping, "slot_mapping", dtype=INDEX_DTYPES, shape=(num_tokens,), device=qk.device)
    quantize = expect_kv_cache(k_cache, v_cache, k_scale, v_scale, dtype=qk.dtype, device=qk.device)
    if num_tokens == 0:
        return
    _rotary_write_kv_kernel[(num_tokens,)](
        qk,
        v,
        cos,
        sin_signed,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if k_scale is not None else cos,  # not read unless QUANTIZE
        v_scale if v_scale is not None else cos,
        *qk.stride(),
        *v.stride(),
        cos.stride(0),
        cos.stride(2),
        sin_signed.stride(0),
        sin_signed.stride(2),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=min(16, triton.next_power_of_2(num_heads_total)),
        BLOCK_KVH=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANTIZE=quantize,
        FP8_MAX=torch.finfo(FP8_KV_DTYPE).max,
        ROTARY_DIM=rotary_dim if 0 < rotary_dim < head_dim else head_dim,
    )
