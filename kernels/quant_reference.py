"""Pure-torch twins of the quantized matmuls (kernels/int8_matmul.py, kernels/int4_matmul.py, kernels/fp8_matmul.py)
and of the dequantizers (kernels/dequantize.py). The weight-only twins dequantize the whole weight in fp32, then
multiply in fp32; the fp8 twin quantizes activations per token and multiplies the fp8 codes, as the kernel does.
They define what each kernel computes and run on any device. Same arguments and results as the kernel wrappers,
less the block sizes. The dequantizers are also the formats' one implementation: lora_server.model.quant
dequantizes (and unpacks and repacks int4) with them.

Formats (as ``lora_server.model.quant`` documents them; rows = output features N, columns = input features K, groups
run along K):
- int8: qweight int8 [N, K], scales [N, K // group], w = scale * q.
- int4: packed uint8 [N, K // 2], scales and mins [N, K // group], w = scale * q + min, q in 0..15. The nibbles pair
  up within pack blocks of ``pack`` columns (a multiple of the group, or the group itself): byte j of a block holds
  q[j] in its low nibble and q[j + pack/2] in its high nibble. pack == group is GGUF's Q4_1 block layout (the
  default everywhere); the GPU kernel takes wider blocks (repack_int4), so that each half of a block is one
  contiguous run of activations.
- fp8: qweight float8_e4m3fn [N, K], scales float32 [N] per output channel,
  w = scale * q; activations are quantized per token at each call (quantize_fp8_per_token), W8A8.
Any leading rows dimensions [..., N] work alike for the dequantizers."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # float8 e4m3's largest finite value
FP8_MIN_AMAX = 1e-12  # a row whose largest magnitude is below this is scaled as if it were this (all-zero rows)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., K] in dtype: qweight * scales, each scale over its group of K // scales.shape[-1] columns, computed in
    dtype (both factors cast to it, one rounding of the product)."""
    w = qweight.to(dtype).unflatten(-1, (scales.shape[-1], -1)) * scales.to(dtype).unsqueeze(-1)
    return w.flatten(-2)


def unpack_int4(packed: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[..., K // 2] uint8 -> [..., K] uint8 codes in 0..15, in column order; the nibbles pair up within
    ``num_blocks`` pack blocks of K // num_blocks columns each (Q4_1: one block per group)."""
    by_block = packed.unflatten(-1, (num_blocks, -1))  # [..., blocks, pack // 2]
    return torch.cat([by_block & 0xF, by_block >> 4], dim=-1).flatten(-2)


def pack_int4(codes: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The inverse of unpack_int4: [..., K] codes in 0..15 -> [..., K // 2] uint8, nibbles paired within
    ``num_blocks`` blocks."""
    by_block = codes.to(torch.uint8).unflatten(-1, (num_blocks, -1))  # [..., blocks, pack]
    half = by_block.shape[-1] // 2
    return (by_block[..., :half] | (by_block[..., half:] << 4)).flatten(-2)


def repack_int4(packed: torch.Tensor, pack: int, new_pack: int) -> torch.Tensor:
    """The same codes with their nibbles paired within blocks of ``new_pack`` columns instead of ``pack``."""
    k = packed.shape[-1] * 2
    assert k % pack == 0 and k % new_pack == 0, (k, pack, new_pack)
    return pack_int4(unpack_int4(packed, k // pack), k // new_pack)


def dequantize_int4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    pack: int | None = None,
) -> torch.Tensor:
    """[..., K] in dtype: q * scale + min, each scale and min over its group, computed in dtype (all cast to it,
    the product and the sum each rounded once). ``pack``: the nibbles' pack block (None: the group, Q4_1)."""
    num_groups = scales.shape[-1]
    k = packed.shape[-1] * 2
    codes = unpack_int4(packed, num_groups if pack is None else k // pack)
    q = codes.to(dtype).unflatten(-1, (num_groups, -1))  # [..., groups, group]
    return (q * scales.to(dtype).unsqueeze(-1) + mins.to(dtype).unsqueeze(-1)).flatten(-2)


def dequantize_fp8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., K] in dtype: qweight * scales[..., None] (one scale per row), computed in float32, rounded once."""
    return (qweight.float() * scales.float().unsqueeze(-1)).to(dtype)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token (per-row) fp8: (q float8_e4m3fn [M, K], scales float32 [M]) with
    scales = max(|x|.amax(-1), FP8_MIN_AMAX) / 448 and q = (x.float() / scales[:, None]).clamp(-448, 448) rounded
    to the nearest float8 value (ties to even), so that q * scale is x up to float8's rounding."""
    xf = x.float()
    # divided by a tensor, not a Python number: on CUDA torch multiplies by the number's reciprocal, which is off
    # by an ulp for some amax; a scale an ulp off moves every code that sits on a rounding midpoint (common with
    # bfloat16 inputs), so the twin would not be the correctly rounded division the kernel computes
    amax = xf.abs().amax(-1).clamp(min=FP8_MIN_AMAX)
    scales = amax / amax.new_full((), FP8_MAX)
    q = (xf / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y [M, N] in x's dtype = x [M, K] @ dequant(W).T, in fp32."""
    return (x.float() @ dequantize_int8(qweight, scales).T).to(x.dtype)


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, pack: int | None = None
) -> torch.Tensor:
    """y [M, N] in x's dtype = x [M, K] @ dequant(W).T, in fp32."""
    return (x.float() @ dequantize_int4(packed, scales, mins, pack=pack).T).to(x.dtype)


def fp8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y [M, N] in x's dtype: x quantized per token (quantize_fp8_per_token: codes xq, scales xs), then
    ((xq.float() @ qweight.float().T) * xs[:, None] * scales[None, :]): the fp8 codes multiplied and summed in fp32
    (each product of two float8 values is exact in fp32), both scales applied once to the sum, as
    torch._scaled_mm with row-wise scales does."""
    xq, xs = quantize_fp8_per_token(x)
    acc = xq.float() @ qweight.float().T  # [M, N]
    return (acc * xs.unsqueeze(-1) * scales.float().unsqueeze(0)).to(x.dtype)
