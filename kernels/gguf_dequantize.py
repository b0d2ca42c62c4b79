"""Dequantize a whole GGUF block weight (or a gather of its rows) in one launch: for prefill, where kernels.ops-style
dispatch multiplies the result with cuBLAS from kernels.quant_tiles.DEQUANT_MIN_TOKENS tokens on, and for the
embedding's rows. The blocks are decoded as kernels/gguf_matmul.py decodes them (decode_pair: gguf's float32
arithmetic), then rounded once to the dtype. Torch twin: ``kernels.gguf_reference.dequantize_gguf``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_server.kernels.gguf_matmul import SPANS, decode_pair, expect_gguf_weight, low_columns, step_half
from lora_server.kernels.gguf_reference import GGUF_BLOCKS


@triton.jit
def _gguf_dequantize_kernel(
    w_ptr,
    out_ptr,
    N,
    stride_wn,
    stride_on,
    stride_ok,
    QTYPE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    SPAN: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program (n_block, step t): out[rows, low_columns(t)] and out[rows, low_columns(t) + SPAN / 2]."""
    cols = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BLOCK_N] weight rows
    mask = (cols < N)[None, :]
    t = tl.program_id(1)
    k_lo = low_columns(t, HALF, SPAN)[:, None]  # [HALF, 1]
    w_lo, w_hi = decode_pair(w_ptr + cols[None, :] * stride_wn, t, mask, QTYPE, BLOCK_BYTES, HALF)
    out = out_ptr + cols[None, :] * stride_on  # [1, BLOCK_N]
    tl.store(out + k_lo * stride_ok, w_lo.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + (k_lo + SPAN // 2) * stride_ok, w_hi.to(out_ptr.dtype.element_ty), mask=mask)


def gguf_dequantize(w: torch.Tensor, kind: str, dtype: torch.dtype, *, block_n: int = 32) -> torch.Tensor:
    """[N, K] in dtype, one launch: kernels.gguf_reference.dequantize_gguf(w, kind, dtype), bit for bit. w: uint8
    [N, (K // block) * block_bytes] of ``kind`` blocks (gguf_matmul.expect_gguf_weight)."""
    n, k = expect_gguf_weight(w, kind, device=w.device)
    out = torch.empty(n, k, dtype=dtype, device=w.device)
    if n == 0 or k == 0:
        return out
    half = step_half(k, kind)
    grid = (triton.cdiv(n, block_n), k // (2 * half))
    _gguf_dequantize_kernel[grid](
        w,
        out,
        n,
        w.stride(0),
        out.stride(0),
        out.stride(1),
        QTYPE=kind,
        BLOCK_BYTES=GGUF_BLOCKS[kind][1],
        SPAN=SPANS[kind],
        HALF=half,
        BLOCK_N=block_n,
    )
    return out
