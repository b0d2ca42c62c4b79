"""Write KV: this step's keys and values into their slots of the paged KV cache (reshape-and-cache). Torch twin:
``kernels.reference.write_kv_cache``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (token): copies k[token] and v[token] ([KVH, D], cast to the cache's dtype) into slot
    slot_mapping[token] = block * PAGE_SIZE + offset. A negative slot (a padding token) writes nothing."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(
        k_cache_ptr + page * stride_kcb + offset * stride_kcs + h * stride_kch + d * stride_kcd,
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_cache_ptr + page * stride_vcb + offset * stride_vcs + h * stride_vch + d * stride_vcd,
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """In place, one launch: k_cache.view(-1, KVH, D)[slot_mapping] = k.to(k_cache.dtype), and v alike.

    k, v: [T, KVH, D], any strides (slices of a fused QKV output are fine); k_cache, v_cache: [num_blocks,
    block_size, KVH, D], any strides; slot_mapping: [T] int32 or int64, slot = block_id * block_size + offset,
    distinct. Tokens with a negative slot are skipped (the twin needs every slot >= 0)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape, f"v {tuple(v.shape)} != k {tuple(k.shape)}"
    assert k_cache.shape == v_cache.shape, f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}"
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), f"cache {tuple(k_cache.shape)} vs k {tuple(k.shape)}"
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)} != ({num_tokens},)"
    assert slot_mapping.dtype in (torch.int32, torch.int64), slot_mapping.dtype
    for t in (v, k_cache, v_cache, slot_mapping):
        assert t.device == k.device, (t.device, k.device)
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.stride(3),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        v_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
