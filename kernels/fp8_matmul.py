"""fp8 W8A8 matmul: activations quantized per token to float8 e4m3 by one Triton launch
(``_quantize_per_token_kernel``), then torch._scaled_mm multiplies the fp8 codes on the tensor cores with both
scales applied once to the fp32 accumulator (row-wise scales: one per token, one per output channel). Torch twins:
``kernels.quant_reference.quantize_fp8_per_token`` and ``kernels.quant_reference.fp8_matmul``.

Format (``lora_server.model.quant``): qweight float8_e4m3fn [N, K], scales float32 [N], w[n, k] = scales[n] *
qweight[n, k]. torch._scaled_mm's row-wise scaling runs on compute capability 8.9 (Ada) and 9.x (Hopper), with K
and N multiples of 16 (``scaled_mm_supported`` says whether a call qualifies)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_server.kernels.checks import FLOAT_DTYPES, expect
from lora_server.kernels.quant_reference import FP8_DTYPE, FP8_MAX, FP8_MIN_AMAX
from lora_server.kernels.write_kv import _round_to_e4m3


@triton.jit
def _quantize_per_token_kernel(
    x_ptr,
    q_ptr,
    scales_ptr,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    BLOCK_K: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
):
    """Program (row): two passes over the row in BLOCK_K chunks: its largest magnitude, then each value divided by
    the row's scale (rounded division, as torch's), clamped to +-FP8_MAX and rounded to the e4m3 grid."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + ks * stride_xk, mask=ks < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), MIN_AMAX), FP8_MAX)
    tl.store(scales_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + ks * stride_xk, mask=ks < K, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX))
        tl.store(q_ptr + row * stride_qm + ks, q.to(q_ptr.dtype.element_ty), mask=ks < K)


def quantize_per_token(x: torch.Tensor, *, block_k: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [M, K] contiguous, scales float32 [M]) in one launch:

        scales = x.float().abs().amax(-1).clamp(min=1e-12) / 448
        q = (x.float() / scales[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)

    x: [M, K] fp32, fp16 or bf16, any strides. block_k: a power of two, the chunk each program reads at a time."""
    expect(x, "x", dtype=FLOAT_DTYPES, ndim=2)
    assert block_k >= 16 and block_k & (block_k - 1) == 0, block_k
    num_rows, k = x.shape
    q = torch.empty(num_rows, k, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scales
    _quantize_per_token_kernel[(num_rows,)](
        x,
        q,
        scales,
        k,
        x.stride(0),
        x.stride(1),
        q.stride(0),
        BLOCK_K=min(block_k, triton.next_power_of_2(max(k, 16))),
        FP8_MAX=FP8_MAX,
        MIN_AMAX=FP8_MIN_AMAX,
    )
    return q, scales


def scaled_mm_supported(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether torch._scaled_mm takes this call with row-wise scales: CUDA tensors on compute capability 8.9 to 9.x
    (Blackwell's row-wise support varies with the cuBLAS version: not taken), an fp8 weight, K and N multiples
    of 16."""
    if x.device.type != "cuda" or qweight.dtype != FP8_DTYPE:
        return False
    n, k = qweight.shape
    return (8, 9) <= torch.cuda.get_device_capability(x.device) < (10, 0) and k % 16 == 0 and n % 16 == 0


def fp8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y [M, N] in x's dtype, two launches (the per-token quantization, then torch._scaled_mm):

        xq, xs = quantize_per_token(x)
        y = ((xq.float() @ qweight.float().T) * xs[:, None] * scales[None, :]).to(x.dtype)

    accumulated in fp32 on the tensor cores; the product is rounded to bfloat16 (row-wise _scaled_mm's only output
    type on every supported torch) before the cast to x's dtype. x: [M, K] on CUDA; qweight: float8_e4m3fn [N, K]
    (row-major: its transpose is the column-major operand _scaled_mm wants); scales: float32 [N]. Needs
    scaled_mm_supported(x, qweight)."""
    num_rows, k = x.shape
    n = qweight.shape[0]
    assert qweight.shape == (n, k), f"qweight {tuple(qweight.shape)} vs x {tuple(x.shape)}"
    expect(scales, "scales", dtype=torch.float32, shape=(n,))
    assert scaled_mm_supported(x, qweight), "fp8_matmul needs CUDA capability 8.9-9.x and K, N multiples of 16"
    if num_rows == 0:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    xq, xs = quantize_per_token(x)
    y = torch._scaled_mm(
        xq, qweight.t(), scale_a=xs.unsqueeze(1), scale_b=scales.unsqueeze(0), out_dtype=torch.bfloat16
    )
    return y.to(x.dtype)
