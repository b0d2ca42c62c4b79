"""GGUF quantized weights kept as the file's own blocks (Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; the formats are
kernels.gguf_reference's docstring), and the fused linear whose parts keep different formats.

GGUFBlockLinear holds the raw blocks, uint8 [out, in / block * block_bytes], rows in HF order (llama.cpp's Q/K row
permutation undone row by row: blocks lie within rows), so a weight takes in memory what it takes in the file:
4.5 bits per weight for Q4_0 and Q4_K, 5.5 for Q5_0 and Q5_K, 6 for Q5_1, 6.5625 for Q6_K. Every read dequantizes
exactly (gguf.quants.dequantize's float32 values, rounded once to the dtype asked for). Where kernels.ops runs the
Triton kernels (use_kernels: CUDA with triton, or the meta stand-in), the matmul is kernels.gguf_matmul (blocks
decoded in registers) below quant_tiles.DEQUANT_MIN_TOKENS rows and kernels.gguf_dequantize + F.linear from there,
as kernels.ops does for int4 and int8; elsewhere (the CPU) the torch twin dequantizes and F.linear multiplies.

StackedLinear: q|k|v or gate|up whose parts are of different formats (a Q4_K_M file stores v, or down, as Q6_K in
some layers and q and k as Q4_K; llama.cpp's fallbacks mix in Q5_0 and Q8_0): each part keeps its own format and
memory, and the fused output is their outputs side by side."""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from lora_server.kernels import ops
from lora_server.kernels.gguf_reference import GGUF_BLOCKS, dequantize_gguf


class LinearPart(Protocol):
    """What StackedLinear asks of a part: any of model.quant's linears or a GGUFBlockLinear."""

    @property
    def out_features(self) -> int: ...

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class GGUFBlockLinear(nn.Module):
    """A weight of GGUF type ``kind`` as its raw blocks; the same surface as the modules of model.quant."""

    blocks: torch.Tensor

    def __init__(self, kind: str, blocks: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        assert kind in GGUF_BLOCKS and blocks.dtype == torch.uint8 and blocks.dim() == 2, (kind, blocks.dtype)
        assert blocks.shape[1] % GGUF_BLOCKS[kind][1] == 0, (kind, blocks.shape)
        self.kind = kind
        self.register_buffer("blocks", blocks)  # [out, in / block * block_bytes]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def in_features(self) -> int:
        values, nbytes = GGUF_BLOCKS[self.kind]
        return self.blocks.shape[1] // nbytes * values

    def _dequantize(self, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if ops.use_kernels(blocks.device):
            from lora_server.kernels.gguf_dequantize import gguf_dequantize

            return gguf_dequantize(blocks, self.kind, dtype)
        return dequantize_gguf(blocks, self.kind, dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self._dequantize(self.blocks, dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows weight[ids] -> [len(ids), in] (the embedding lookup): only those rows' blocks."""
        return self._dequantize(self.blocks[ids], dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        if not ops.use_kernels(x.device):
            return F.linear(x, dequantize_gguf(self.blocks, self.kind, x.dtype), self.bias)
        from lora_server.kernels.quant_tiles import DEQUANT_MIN_TOKENS, choose_tiles

        if x.shape[0] >= DEQUANT_MIN_TOKENS:
            return F.linear(x, self.dequantize(x.dtype), self.bias)
        from lora_server.kernels.gguf_matmul import gguf_matmul, step_half

        n, k, itemsize = self.out_features, self.in_features, x.dtype.itemsize
        half = step_half(k, self.kind, itemsize)
        tiles = choose_tiles(x.shape[0], n, k, num_sms=ops._num_sms(x.device), block_k=2 * half, itemsize=itemsize)
        y = gguf_matmul(x, self.blocks, self.kind, half=half, **tiles.kwargs(with_block_k=False))
        return y if self.bias is None else y + self.bias


class StackedLinear(nn.Module):
    """Linears side by side along the output rows, each in its own format (and with its own bias, if any):
    forward(x) = cat([part(x) for part in parts], -1)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.bias = None  # the parts add their own

    def linears(self) -> list[LinearPart]:
        return [cast(LinearPart, p) for p in self.parts]

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.linears())

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.linears()])

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize(dtype)[ids]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        return torch.cat([p(x) for p in self.linears()], dim=-1)
