"""RMSNorm, alone (a model's first norm) or fused with the residual add before it (vLLM's fused_add_rms_norm): one
program per row, the whole row in one tile. Torch twins: ``kernels.reference.rms_norm`` and
``kernels.reference.fused_add_rms_norm``, which round where HF's LlamaRMSNorm does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_server.kernels.checks import FLOAT_DTYPES, expect


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    WEIGHT_IN_FP32: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_STRIDE: tl.constexpr,
):
    """Program (row): ADD_RESIDUAL: residual[row] = x[row] + residual[row] (rounded to the row's dtype) and the
    row normalized is that sum; else x[row]. The norm: y = row * rsqrt(mean(row^2) + eps) in fp32, rounded to the
    dtype, times weight (rounded again), stored to out[row] (out may be x itself); WEIGHT_IN_FP32: y times the
    float32 weight in fp32, rounded once (Gemma's order). Rows are heads where HEADS > 1: row r is head r % HEADS
    of token r // HEADS, at token * stride + head * HEAD_STRIDE (x and out alike)."""
    row = tl.program_id(0).to(tl.int64)
    if HEADS > 1:
        row_x = (row // HEADS) * stride_x + (row % HEADS) * HEAD_STRIDE
        row_o = (row // HEADS) * stride_o + (row % HEADS) * HEAD_STRIDE
    else:
        row_x = row * stride_x
        row_o = row * stride_o
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / HIDDEN + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = xf * inv_rms if WEIGHT_IN_FP32 else (xf * inv_rms).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    expect(x, "x", dtype=FLOAT_DTYPES, ndim=2, contiguous="rows")
    _check_weight(x, weight)


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    dtypes = (x.dtype, torch.float32)
    expect(weight, "weight", dtype=dtypes, shape=(x.shape[-1],), contiguous=True, device=x.device)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor, eps: float
) -> None:
    num_rows, hidden = x.shape[0] * (x.shape[1] if x.ndim == 3 else 1), x.shape[-1]
    if num_rows == 0:
        return
    _rms_norm_kernel[(num_rows,)](
        x,
        residual if residual is not None else x,  # not read unless ADD_RESIDUAL
        weight,
        out,
        eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        HIDDEN=hidden,
        BLOCK=triton.next_power_of_2(hidden),
        ADD_RESIDUAL=residual is not None,
        WEIGHT_IN_FP32=weight.dtype != x.dtype,
        HEADS=x.shape[1] if x.ndim == 3 else 1,
        HEAD_STRIDE=x.stride(1) if x.ndim == 3 else 0,
        num_warps=4 if hidden <= 4096 else 8,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """out [T, hidden] in x's dtype, one launch: weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
    .to(x.dtype) with xf = x.float() (HF's LlamaRMSNorm). x: [T, hidden] float32, float16 or bfloat16, rows
    contiguous (any row stride); weight: [hidden] in x's dtype, or float32 (then multiplied before the rounding,
    Gemma's order: the twin's)."""
    _check(x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, out, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place, one launch: residual += x (rounded to the dtype), then x = rms_norm(residual, weight, eps).
    x, residual: [T, hidden], same dtype, rows contiguous (any row strides), not overlapping; weight: [hidden]."""
    _check(x, weight)
    expect(residual, "residual", dtype=x.dtype, shape=x.shape, contiguous="rows", device=x.device)
    _launch(x, residual, weight, x, eps)


def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place, one launch: every head x[t, h] ([D], contiguous) of x [T, heads, D] (any token and head strides)
    becomes rms_norm(x[t, h], weight, eps); weight [D] as rms_norm's."""
    expect(x, "x", dtype=FLOAT_DTYPES, ndim=3)
    assert x.stride(2) == 1, f"x's head dimension must be contiguous, got strides {x.stride()}"
    _check_weight(x, weight)
    _launch(x, None, weight, x, eps)
