"""Dequantize a whole int8 or int4 weight in one launch, for prefill: kernels.ops multiplies the result with cuBLAS
(F.linear) from kernels.quant_tiles.DEQUANT_MIN_TOKENS tokens on, where a full-size tensor-core GEMM outruns
dequantizing per tile in registers. The weight is transient (one layer's, freed after its matmul). Torch twins:
``kernels.quant_reference.dequantize_int8`` / ``dequantize_int4`` computed in float32, then rounded to the dtype.

Formats as kernels/int8_matmul.py and kernels/int4_matmul.py state them (int4 with any pack width)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_server.kernels.checks import expect_int4_weight, expect_int8_weight
from lora_server.kernels.int4_matmul import check_pack


@triton.jit
def _dequantize_int8_kernel(
    q_ptr,
    scales_ptr,
    out_ptr,
    N,
    K,
    stride_qn,
    stride_qk,
    stride_sn,
    stride_sg,
    stride_on,
    stride_ok,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (n_block, k_block): out[rows, cols] = q * scale of each element's group, in fp32, rounded once. The
    group size is fixed per weight: a constant, so that cols // GROUP is a shift (a runtime divisor costs registers
    and spills)."""
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]  # [BLOCK_N, 1]
    cols = (tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)[None, :]  # [1, BLOCK_K]
    mask = (rows < N) & (cols < K)
    q = tl.load(q_ptr + rows * stride_qn + cols * stride_qk, mask=mask, other=0).to(tl.float32)
    s = tl.load(scales_ptr + rows * stride_sn + (cols // GROUP) * stride_sg, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * stride_on + cols * stride_ok, (q * s).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_int4_kernel(
    packed_ptr,
    scales_ptr,
    mins_ptr,
    out_ptr,
    N,
    stride_pn,
    stride_pk,
    stride_sn,
    stride_sg,
    stride_mn,
    stride_mg,
    stride_on,
    stride_ok,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PACK: tl.constexpr,
):
    """Program (n_block, pack block b): the block's bytes [BLOCK_N, PACK / 2] unpacked into out columns
    b * PACK + [0, PACK/2) (low nibbles) and b * PACK + [PACK/2, PACK) (high nibbles), q * scale + min in fp32,
    rounded once."""
    HALF: tl.constexpr = PACK // 2
    b = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]  # [BLOCK_N, 1]
    halves = tl.arange(0, HALF)[None, :]  # [1, HALF]
    mask = rows < N
    codes = tl.load(packed_ptr + rows * stride_pn + (b * HALF + halves) * stride_pk, mask=mask, other=0)
    for part in tl.static_range(2):
        cols = (b * PACK + part * HALF + halves).to(tl.int64)  # [1, HALF]
        q = ((codes >> (4 * part)) & 0xF).to(tl.float32)
        g = cols // GROUP
        s = tl.load(scales_ptr + rows * stride_sn + g * stride_sg, mask=mask, other=0.0).to(tl.float32)
        mn = tl.load(mins_ptr + rows * stride_mn + g * stride_mg, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows * stride_on + cols * stride_ok, (q * s + mn).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_int8(
    qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, *, block_n: int = 64, block_k: int = 128
) -> torch.Tensor:
    """[N, K] in dtype, one launch: (qweight.float() * scales.float().repeat_interleave(group, 1)).to(dtype).
    qweight int8 [N, K]; scales any float [N, K // group]."""
    n, k, group = expect_int8_weight(qweight, scales, device=qweight.device)
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    if n == 0 or k == 0:
        return out
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequantize_int8_kernel[grid](
        qweight,
        scales,
        out,
        n,
        k,
        qweight.stride(0),
        qweight.stride(1),
        scales.stride(0),
        scales.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


def dequantize_int4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    dtype: torch.dtype,
    *,
    pack: int | None = None,
    block_n: int = 32,
) -> torch.Tensor:
    """[N, K] in dtype, one launch: quant_reference.dequantize_int4(packed, scales, mins, torch.float32,
    pack).to(dtype). packed uint8 [N, K // 2] with nibbles paired within blocks of ``pack`` columns (None: the
    group); scales, mins any float [N, K // group]; pack as int4_matmul.check_pack allows. block_n rows a program
    (64 rows of a 128-column pack spilled 152-264 bytes on sm_90a / sm_80)."""
    n, k, group = expect_int4_weight(packed, scales, mins, device=packed.device)
    pack = group if pack is None else pack
    check_pack(k, group, pack)
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    if n == 0 or k == 0:
        return out
    grid = (triton.cdiv(n, block_n), k // pack)
    _dequantize_int4_kernel[grid](
        packed,
        scales,
        mins,
        out,
        n,
        packed.stride(0),
        packed.stride(1),
        scales.stride(0),
        scales.stride(1),
        mins.stride(0),
        mins.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_N=block_n,
        PACK=pack,
    )
    return out
