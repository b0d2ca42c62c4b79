"""Pure-torch twins of the weight-only quantized matmuls (kernels/int8_matmul.py, kernels/int4_matmul.py): they
dequantize the whole weight in fp32, then multiply in fp32. They define what each kernel computes and run on any
device. Same arguments and results as the kernel wrappers, less the block sizes. The dequantizers are also the
format's one implementation: lora_server.model.quant dequantizes (and unpacks int4) with them.

Formats (as ``lora_server.model.quant`` documents them; rows = output features N, columns = input features K, groups run
along K): int8: qweight int8 [N, K], scales [N, K // group], w = scale * q. int4: packed uint8 [N, K // 2], scales
and mins [N, K // group], w = scale * q + min, q in 0..15, within each group of g values byte j holding q[j] in its
low nibble and q[j + g/2] in its high nibble (GGUF Q4_1). Any leading rows dimensions [..., N] work alike."""

from __future__ import annotations

import torch


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., K] in dtype: qweight * scales, each scale over its group of K // scales.shape[-1] columns, computed in
    dtype (both factors cast to it, one rounding of the product)."""
    w = qweight.to(dtype).unflatten(-1, (scales.shape[-1], -1)) * scales.to(dtype).unsqueeze(-1)
    return w.flatten(-2)


def unpack_int4(packed: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[..., K // 2] uint8 -> [..., K] uint8 codes in 0..15, in column order."""
    by_group = packed.unflatten(-1, (num_groups, -1))  # [..., groups, group // 2]
    return torch.cat([by_group & 0xF, by_group >> 4], dim=-1).flatten(-2)


def dequantize_int4(
    packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[..., K] in dtype: q * scale + min, each scale and min over its group, computed in dtype (all cast to it,
    the product and the sum each rounded once)."""
    num_groups = scales.shape[-1]
    q = unpack_int4(packed, num_groups).to(dtype).unflatten(-1, (num_groups, -1))  # [..., groups, group]
    return (q * scales.to(dtype).unsqueeze(-1) + mins.to(dtype).unsqueeze(-1)).flatten(-2)


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y [M, N] in x's dtype = x [M, K] @ dequant(W).T, in fp32."""
    return (x.float() @ dequantize_int8(qweight, scales).T).to(x.dtype)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """y [M, N] in x's dtype = x [M, K] @ dequant(W).T, in fp32."""
    return (x.float() @ dequantize_int4(packed, scales, mins).T).to(x.dtype)
