"""Write KV: this step's keys and values into their slots of the paged KV cache (reshape-and-cache), quantized to
float8 e4m3 with a scale per KV head where the cache is fp8. Torch twin: ``kernels.reference.write_kv_cache``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_server.kernels.checks import INDEX_DTYPES, expect, expect_kv_cache
from lora_server.kernels.reference import FP8_KV_DTYPE


@triton.jit
def _round_to_e4m3(x):
    """x (float32, |x| <= 448) rounded to the nearest float8 e4m3 value, ties to even, still as float32, so that the
    cast to fp8 after it is exact on every backend (the Triton interpreter's float32 -> float8 cast neither rounds
    ties to even nor carries a rounded-up mantissa into the exponent). e4m3 steps are 2^(e - 3) in [2^e, 2^(e+1))
    for e >= -6 and 2^-9 below 2^-6 (subnormals); |x| / step < 16, and adding then subtracting 2^23 rounds it to an
    integer, ties to even. Every product here is by a power of two, hence exact."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127  # floor(log2 |x|) for normal x
    exponent = tl.maximum(exponent, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3)
    inv_step = ((3 - exponent + 127) << 23).to(tl.float32, bitcast=True)
    steps = (tl.abs(x) * inv_step + 8388608.0) - 8388608.0
    return tl.where(bits < 0, -steps, steps) * step  # the sign bit: -0.0 stays -0.0


@triton.jit
def _write_kv_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
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
    QUANTIZE: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """Program (token): copies k[token] and v[token] ([KVH, D], cast to the cache's dtype) into slot
    slot_mapping[token] = block * PAGE_SIZE + offset. A negative slot (a padding token) writes nothing. QUANTIZE:
    the cache is fp8 and each head's values are divided by its scale (k_scale / v_scale [KVH], rounded division as
    torch's), clamped to +-FP8_MAX and rounded to the e4m3 grid before the cast."""
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
    if QUANTIZE:
        k_scale = tl.load(k_scale_ptr + h, mask=h < NUM_KV_HEADS, other=1.0)  # [BLOCK_H, 1]
        v_scale = tl.load(v_scale_ptr + h, mask=h < NUM_KV_HEADS, other=1.0)
        k = _round_to_e4m3(tl.clamp(tl.math.div_rn(k.to(tl.float32), k_scale), -FP8_MAX, FP8_MAX))
        v = _round_to_e4m3(tl.clamp(tl.math.div_rn(v.to(tl.float32), v_scale), -FP8_MAX, FP8_MAX))
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
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """In place, one launch: k_cache.view(-1, KVH, D)[slot_mapping] = k.to(k_cache.dtype), and v alike; for a
    float8_e4m3fn cache, = (k.float() / k_scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn) (v with
    v_scale), i.e. ``kernels.reference.quantize_kv``.

    k, v: [T, KVH, D], any strides (slices of a fused QKV output are fine); k_cache, v_cache: [num_blocks,
    block_size, KVH, D], any strides; slot_mapping: [T] int32 or int64, slot = block_id * block_size + offset,
    distinct; k_scale, v_scale: [KVH] float32, given exactly when the caches are fp8. Tokens with a negative slot
    are skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    expect(v, "v", shape=k.shape, device=k.device)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), f"cache {tuple(k_cache.shape)} vs k {tuple(k.shape)}"
    expect(slot_mapping, "slot_mapping", dtype=INDEX_DTYPES, shape=(num_tokens,), device=k.device)
    quantize = expect_kv_cache(k_cache, v_cache, k_scale, v_scale, device=k.device)
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if k_scale is not None else k,  # not read unless QUANTIZE
        v_scale if v_scale is not None else v,
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
        QUANTIZE=quantize,
        FP8_MAX=torch.finfo(FP8_KV_DTYPE).max,
    )
