"""SiLU-and-multiply (and GELU-tanh-and-multiply, Gemma's): the MLP's activation over the fused gate|up projection
output, in one launch. Torch twins: ``kernels.reference.silu_and_mul`` and ``gelu_tanh_and_mul``, which round as
HF's act_fn(gate) * up does (the activation rounded to the dtype, then the product rounded again)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_server.kernels.checks import FLOAT_DTYPES, expect


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
    GELU_TANH: tl.constexpr,
):
    """Program (row, column tile): out[row, c] = silu(x[row, c]) * x[row, INTERMEDIATE + c] (GELU_TANH: gelu with
    the tanh approximation instead of silu), the activation in fp32 rounded to the dtype, the product in fp32
    rounded again."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + INTERMEDIATE + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if GELU_TANH:  # 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3); 1 + tanh(u) = 2 - 2 / (e^2u + 1)
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = (g - g / (tl.exp(2.0 * u) + 1.0)).to(gate.dtype)
    else:
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, block: int = 1024, *, gelu_tanh: bool = False) -> torch.Tensor:
    """out [T, I] in x's dtype = F.silu(x[:, :I]) * x[:, I:] for x [T, 2 * I] (gate | up), float32, float16 or
    bfloat16, rows contiguous (any row stride); gelu_tanh: F.gelu(x[:, :I], approximate="tanh") instead of the
    SiLU. block: columns per program, a power of two."""
    expect(x, "x", dtype=FLOAT_DTYPES, ndim=2, contiguous="rows")
    assert x.shape[1] % 2 == 0, f"x must be [T, 2 * I], got {tuple(x.shape)}"
    assert block > 0 and block & (block - 1) == 0, block
    num_rows, intermediate = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_rows, intermediate, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    block = min(block, triton.next_power_of_2(intermediate))
    _silu_and_mul_kernel[(num_rows, triton.cdiv(intermediate, block))](
        x, out, x.stride(0), out.stride(0), INTERMEDIATE=intermediate, BLOCK=block, GELU_TANH=gelu_tanh
    )
    return out
