"""Pure-torch twins of the weight-only quantized matmuls (kernels/int8_matmul.py, kernels/int4_matmul.py): they
dequantize the whole weight in fp32, then multiply in fp32. They define what each kernel computes and run on any
device. Same arguments and results as the kernel wrappers, less the block sizes.

Formats (as ``lora_server.model.quant`` documents them; rows = output features N, columns = input features K, groups run
along K): int8: qweight int8 [N, K], scales [N, K // group], w = scale * q. int4: packed uint8 [N, K // 2], scales
and mins [N, K // group], w = scale * q + min, q in 0..15, within each group of g values byte j holding q[j] in its
low nibble and q[j + g/2] in its high nibble (GGUF Q4_1)."""

from __future__ import annotations

import torch


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32: qweight * scales, each scale repeated over its group of K // scales.shape[1] columns."""
    group = qweight.shape[1] // scales.shape[1]
    return qweight.float() * scales.float().repeat_interleave(group, dim=1)


def unpack_int4(packed: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[N, K // 2] uint8 -> [N, K] int64 codes in 0..15, in column order."""
    by_group = packed.long().unflatten(1, (num_groups, -1))  # [N, groups, group // 2]
    return torch.cat([by_group & 0xF, by_group >> 4], dim=-1).flatten(1)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32: q * scale + min, each scale and min repeated over its group."""
    num_groups = scales.shape[1]
    group = packed.shape[1] * 2 // num_groups
    q = unpack_int4(packed, num_groups).float()
    return q * scales.float().repeat_interleave(group, dim=1) + mins.float().repeat_interleave(group, dim=1)


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y [M, N] in x's dtype = x [M, K] @ dequant(W).T, in fp32."""
    return (x.float() @ dequantize_int8(qweight, scales).T).to(x.dtype)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """y [M, N] in x's dtype = x [M, K] @ dequant(W).T, in fp32."""
    return (x.float() @ dequantize_int4(packed, scales, mins).T).to(x.dtype)
