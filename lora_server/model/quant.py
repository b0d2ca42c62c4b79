"""Weight-only quantization: an offline transform (float weight -> quantized tensors) plus the linear modules
that keep the weights quantized in memory and dequantize on the fly. The matmuls go through kernels.ops (the Triton
kernels or their twins); dequantizing and int4 unpacking are kernels.quant_reference's, the format's one
implementation.

Formats (rows = output features, columns = input features, groups run along the input):
- dense: weight [out, in] in the model dtype.
- int8: symmetric, qweight int8 [out, in], scales fp16 [out, in // group]; w = scale * q.
  Per-channel is group == in; GGUF Q8_0 is group 32, copied as is.
- int4: asymmetric, packed uint8 [out, in // 2], scales and mins fp16 [out, in // group]; w = scale * q + min,
  q in 0..15. Within each group of g values, byte j holds q[j] in its low nibble and q[j + g/2] in its high
  nibble: the GGUF Q4_1 block layout, so Q4_1 blocks are copied as is. On CUDA the module swap (swap_for_cuda)
  repacks the nibbles to pair within wider blocks (``pack`` columns, kernels.quant_tiles.int4_pack_width), the
  layout the GPU kernel reads contiguously.
- fp8: W8A8, qweight float8_e4m3fn [out, in], scales float32 [out] (per output channel, amax / 448); w = scale * q.
  Activations are quantized per token at every call (kernels.quant_reference.quantize_fp8_per_token).
- GGUF blocks (Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): the file's own blocks, read by model.gguf_linear's modules.
"""

from __future__ import annotations

import functools
import itertools
from ctypes import CDLL
from typing import Any, cast

import torch
from torch import nn

from lora_server import envs
from lora_server.kernels import cpu_decode, ops
from lora_server.kernels.quant_reference import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_MIN_AMAX,
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    unpack_int4,
)
from lora_server.model.gguf_linear import GGUFBlockLinear, StackedLinear

INT4_GROUP_SIZE = 32


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows weight[ids] -> [len(ids), in] (the embedding lookup)."""
        return self.weight[ids].to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        return nn.functional.linear(x, self.weight, self.bias)


class Int8Linear(nn.Module):
    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        assert qweight.dtype == torch.int8 and qweight.shape[1] % scales.shape[1] == 0
        self.register_buffer("qweight", qweight)  # [out, in]
        self.register_buffer("scales", scales)  # [out, in // group]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scales, dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int8(self.qweight[ids], self.scales[ids], dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        return ops.int8_matmul(x, self.qweight, self.scales, self.bias)


class Int4Linear(nn.Module):
    """int4 weights; ``pack``: the columns within which the nibbles pair (None: the group, Q4_1's layout)."""

    packed: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    def __init__(
        self,
        packed: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        bias: torch.Tensor | None = None,
        pack: int | None = None,
    ) -> None:
        super().__init__()
        assert packed.dtype == torch.uint8 and scales.shape == mins.shape
        assert pack is None or (packed.shape[1] * 2) % pack == 0, (packed.shape, pack)
        self.register_buffer("packed", packed)  # [out, in // 2]
        self.register_buffer("scales", scales)  # [out, in // group]
        self.register_buffer("mins", mins)  # [out, in // group]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.pack = pack

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def group_size(self) -> int:
        return self.packed.shape[1] * 2 // self.scales.shape[1]

    def codes(self) -> torch.Tensor:
        """[out, in] uint8 codes 0..15 in column order, whatever the pack."""
        k = self.packed.shape[1] * 2
        return unpack_int4(self.packed, k // (self.pack or self.group_size))

    def repacked(self, pack: int) -> Int4Linear:
        """The same weights with the nibbles paired within blocks of ``pack`` columns."""
        k = self.packed.shape[1] * 2
        return Int4Linear(pack_int4(self.codes(), k // pack), self.scales, self.mins, self.bias, pack)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4(self.packed, self.scales, self.mins, dtype, self.pack)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4(self.packed[ids], self.scales[ids], self.mins[ids], dtype, self.pack)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        return ops.int4_matmul(x, self.packed, self.scales, self.mins, self.bias, self.pack)


class Fp8Linear(nn.Module):
    """W8A8 fp8: the weight in float8 e4m3 with a float32 scale per output channel; each call quantizes its
    activations per token (ops.fp8_matmul)."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        assert qweight.dtype == FP8_DTYPE, qweight.dtype
        assert scales.shape == qweight.shape[:1] and scales.dtype == torch.float32, (scales.shape, scales.dtype)
        self.register_buffer("qweight", qweight)  # [out, in]
        self.register_buffer("scales", scales)  # [out]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(self.qweight, self.scales, dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(self.qweight[ids], self.scales[ids], dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        return ops.fp8_matmul(x, self.qweight, self.scales, self.bias)


# From this many rows (prefill) Int4CpuLinear dequantizes its weight (to cpu_prefill_dtype) and multiplies with
# torch's dense matmul, where that is as fast as torch's int4 kernel (docs/benchmarks.md, "The CPU prefill's int4
# crossover").
CPU_DEQUANT_MIN_ROWS = 96
# Up to this many rows (a decode step's sequences) the CPU linears take kernels.cpu_decode's kernels, which read the
# weight once per pair (int4) or four (int8) of rows; from there torch's (docs/benchmarks.md, "The CPU decode step").
CPU_GEMV_MAX_ROWS = 4
CPU_GEMV_MAX_HEAD_ROWS = 8


@functools.cache
def cpu_decode_library() -> CDLL | None:
    """kernels.cpu_decode's built library, or None where LORA_SERVER_CPU_KERNELS=0 turns it off or it cannot be built
    (torch's CPU kernels serve then)."""
    return cpu_decode.load(envs.kernel_cache_dir()) if envs.cpu_kernels_enabled() else None


@functools.cache
def cpu_gemv_library() -> CDLL | None:
    """cpu_decode_library where its matrix-vector products are vectorized (AVX-512), else None: the linears keep
    torch's kernels."""
    lib = cpu_decode_library()
    return lib if lib is not None and cpu_decode.vectorized(lib) else None


class DequantScratch:
    """Working memory for Int4CpuLinear's dequantized weights, shared by every module of one model (the engine
    runs one forward pass at a time): one weight's uint8 codes and ``dtype`` values at a time, at most ``cap``
    elements (a larger weight is dequantized in column chunks). Not a parameter or buffer: it holds no weights
    between calls, and resident_bytes does not count it."""

    def __init__(self, cap: int = 1 << 22, dtype: torch.dtype = torch.float32) -> None:
        self.cap, self.dtype = cap, dtype
        self._codes = torch.empty(0, dtype=torch.uint8)
        self._values = torch.empty(0, dtype=dtype)

    def buffers(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 [numel], dtype [numel]), grown on demand and reused."""
        if self._codes.numel() < numel:
            self._codes = torch.empty(numel, dtype=torch.uint8)
            self._values = torch.empty(numel, dtype=self.dtype)
        return self._codes[:numel], self._values[:numel]


def cpu_prefill_dtype() -> torch.dtype:
    """The dtype Int4CpuLinear's prefill dequantizes and multiplies in: bfloat16 where the CPU multiplies it natively
    (AVX512-BF16 or AMX: 384 x 576 x 3072 in 4.9 ms against 19.2 in float32 on the 2-core machine), the numbers
    of the int4 kernel's own bound (bf16 activations, weights and result); float32 elsewhere."""
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.bfloat16 if native else torch.float32


def int4pack_cpu_block() -> int | None:
    """The row block B of torch's CPU int4 layout on this machine, probed: _convert_weight_to_int4pack_for_cpu
    stores [N / B, K, B / 2] bytes, byte (b, k, d) = q[b * B + d, k] | q[b * B + B / 2 + d, k] << 4 (torch 2.13:
    B = 32 with AVX2, 64 with AVX512). None when neither matches: the layout is torch's own, and without it
    Int4CpuLinear only uses the kernel."""
    q = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1).reshape(-1)
    for block in (32, 64):
        t = q.view(128 // block, block, 64)
        expected = (t[:, : block // 2] | (t[:, block // 2 :] << 4)).permute(0, 2, 1).reshape(-1).to(torch.uint8)
        if torch.equal(packed, expected):
            return block
    return None


class Int4CpuLinear(nn.Module):
    """int4 weights in torch's CPU int4 matmul layout (the same bits as Int4Linear, tiled differently): the CPU
    module swap for Int4Linear, which would otherwise unpack every weight each step. Up to CPU_GEMV_MAX_ROWS rows,
    with torch's AVX-512 layout and the CPU kernels built (cpu_gemv_library), kernels.cpu_decode.int4_gemv
    multiplies (activations in 16-bit fixed point per 32 columns, sums in float32) from the same bfloat16 scales and
    zeros. Below CPU_DEQUANT_MIN_ROWS rows activations are rounded to bfloat16 for torch's int4 kernel (fast only in
    bf16) and its bfloat16 result is cast back to the input dtype. From there (prefill), with a ``scratch`` and a
    known layout (``block``, int4pack_cpu_block), the weight is dequantized into the scratch in its dtype, (q - 8) *
    scale + zero from the same bfloat16 scales and zeros as the kernel, and multiplied in that dtype: in float32,
    or in bfloat16 (activations, weight and result rounded to it, as in the kernel) where the CPU has bfloat16
    matmuls."""

    cpu_packed: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(self, source: Int4Linear, scratch: DequantScratch | None = None, block: int | None = None) -> None:
        super().__init__()
        self.group_size = source.group_size
        self.in_features = source.packed.shape[1] * 2
        codes = source.codes().to(torch.int32)  # [out, in]
        self.register_buffer("cpu_packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        # the kernel computes (q - 8) * scale + zero, so zero = min + 8 * scale: [groups, out, 2]
        scales, mins = source.scales.float(), source.mins.float()
        self.register_buffer(
            "scales_and_zeros",
            torch.stack([scales.t(), (mins + 8 * scales).t()], dim=-1).to(torch.bfloat16).contiguous(),
        )
        self.bias = source.bias
        usable = block is not None and scratch is not None and self.out_features % block == 0
        self.scratch, self.block = (scratch, block) if usable else (None, None)
        # the AVX-512 layout, which int4_gemv reads
        self.gemv = block == cpu_decode.INT4_BLOCK and self.out_features % block == 0 and self.group_size % 32 == 0

    @staticmethod
    def available() -> bool:
        return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")

    @property
    def out_features(self) -> int:
        return self.cpu_packed.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        lib = cpu_gemv_library() if self.gemv and x.shape[0] <= CPU_GEMV_MAX_ROWS else None
        if lib is not None:
            y = cpu_decode.int4_gemv(lib, x, self.cpu_packed, self.scales_and_zeros, self.group_size)
            y = y.to(x.dtype)
        elif x.shape[0] >= CPU_DEQUANT_MIN_ROWS and self.scratch is not None:
            y = self._dequantized_matmul(x.to(self.scratch.dtype)).to(x.dtype)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self.cpu_packed, self.group_size, self.scales_and_zeros
            ).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _dequantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ the weight dequantized to x's dtype (the scratch's), in column chunks of whole row blocks
        that fit the scratch: per chunk of the layout [blocks, K, B / 2] the nibbles go to codes [K, blocks * B] (the
        weight transposed, row b * B + d low, b * B + B / 2 + d high), then (codes - 8) * scale + zero."""
        assert self.scratch is not None and self.block is not None
        n, k, b, g = self.out_features, self.in_features, self.block, self.group_size
        layout = self.cpu_packed.view(n // b, k, b // 2)
        # [groups, 1, N], contiguous: addcmul over the strided views of [groups, N, 2] is 10x slower
        scales = self.scales_and_zeros[..., 0].to(x.dtype).contiguous().unsqueeze(1)
        zeros = self.scales_and_zeros[..., 1].to(x.dtype).contiguous().unsqueeze(1)
        blocks_per_chunk = max(1, self.scratch.cap // (k * b))
        y = torch.empty(x.shape[0], n, dtype=x.dtype)
        for first in range(0, n // b, blocks_per_chunk):
            chunk = layout[first : first + blocks_per_chunk]  # [blocks, K, B / 2]
            cols = chunk.shape[0] * b
            codes, values = self.scratch.buffers(k * cols)
            codes_t = codes.view(k, chunk.shape[0], b)  # [K, blocks, B]: the weight's columns, transposed
            torch.bitwise_and(chunk, 15, out=codes_t.permute(1, 0, 2)[..., : b // 2])
            torch.bitwise_right_shift(chunk, 4, out=codes_t.permute(1, 0, 2)[..., b // 2 :])
            w_t = values.view(k, cols)
            w_t.copy_(codes.view(k, cols)).sub_(8)
            c0 = first * b
            by_group = w_t.view(k // g, g, cols)
            torch.addcmul(zeros[..., c0 : c0 + cols], by_group, scales[..., c0 : c0 + cols], out=by_group)
            if cols == n:
                torch.mm(x, w_t, out=y)
            else:
                y[:, c0 : c0 + cols] = x @ w_t
        return y

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return (
            torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.cpu_packed, self.group_size, self.scales_and_zeros)
            .t()
            .to(dtype)
        )

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize(dtype)[ids]


class InputTransform(nn.Module):
    """A linear whose input is transformed before its ``inner`` linear (a QuantLinear) sees it; the weight, bias
    and shape are the inner's. Subclasses define forward (and, where the transform moves columns, dequantize and
    rows)."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner: Any = inner

    @property
    def out_features(self) -> int:
        return self.inner.out_features

    @property
    def bias(self) -> nn.Parameter | None:
        return self.inner.bias

    @bias.setter
    def bias(self, value: nn.Parameter | None) -> None:
        self.inner.bias = value

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.inner.dequantize(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.inner.rows(ids, dtype)


class PermutedInput(InputTransform):
    """A linear whose stored columns are the input's features gathered by ``perm`` [in] int64 (act-order GPTQ):
    forward(x) = inner(x[:, perm]); dequantize() gives the weight in the input's own column order."""

    perm: torch.Tensor
    inverse: torch.Tensor

    def __init__(self, inner: Any, perm: torch.Tensor) -> None:
        super().__init__(inner)
        self.register_buffer("perm", perm)
        self.register_buffer("inverse", torch.argsort(perm))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.inner.dequantize(dtype)[:, self.inverse]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.inner.rows(ids, dtype)[:, self.inverse]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        return self.inner(x.index_select(-1, self.perm))


INT8_TOKEN_HALF_RANGE = 127.5  # compressed-tensors' symmetric int8 scale: amax / ((127 - -128) / 2)


def int8_token_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, in] quantized to int8 per token and back, as compressed-tensors quantizes W8A8-int8 activations
    (dynamic, symmetric, in x's dtype): scale = amax(|row|) / 127.5 (0 -> the dtype's eps), q = round(x / scale)
    (half to even) clamped to -128..127, returned as q * scale."""
    amax = x.abs().amax(-1, keepdim=True)
    scale = amax / amax.new_full((), INT8_TOKEN_HALF_RANGE)  # a tensor divisor: CUDA divides, not x reciprocal
    scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    return (x / scale).round().clamp(-128, 127) * scale


class Int8TokenInput(InputTransform):
    """A linear whose input is quantized per token to int8 first (a W8A8-int8 checkpoint's dynamic activations):
    forward(x) = inner(int8_token_round_trip(x)); the product of the int8 codes, scaled by both scales, is what
    the inner int8 weight computes on the round-tripped input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        return self.inner(int8_token_round_trip(x))


class Int8CpuHead(nn.Module):
    """A tied int8 head on the CPU: up to CPU_GEMV_MAX_HEAD_ROWS rows kernels.cpu_decode.int8_gemv multiplies the
    embedding's own int8 weight and group scales (Q8_0 read at a quarter of float32's bytes, in float32), with the
    CPU kernels built (cpu_gemv_library); beyond, or without them, ``dense`` (the dequantized weight, cpu_head's
    copy) and torch's matmul: the same numbers up to float32 rounding."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, embed: Int8Linear, dense: DenseLinear) -> None:
        super().__init__()
        self.qweight = embed.qweight  # the embedding's buffer, not this module's: counted, and moved, there
        self.register_buffer("scales", embed.scales.float().contiguous())  # [out, in // group] float32
        self.dense = dense
        self.bias = None

    @property
    def out_features(self) -> int:
        return self.dense.out_features

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.dense.dequantize(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.dense.rows(ids, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        lib = cpu_gemv_library() if x.shape[0] <= CPU_GEMV_MAX_HEAD_ROWS else None
        if lib is None:
            return self.dense(x)
        return cpu_decode.int8_gemv(lib, x, self.qweight, self.scales).to(x.dtype)


QuantLinear = (
    DenseLinear
    | Int8CpuHead
    | Int8Linear
    | Int4Linear
    | Int4CpuLinear
    | Fp8Linear
    | GGUFBlockLinear
    | StackedLinear
    | PermutedInput
    | Int8TokenInput
)


def swap_for_cpu(module: nn.Module, keep: tuple[str, ...] = ()) -> None:
    """The CPU module swap: every Int4Linear below ``module`` becomes an Int4CpuLinear (when torch has the op),
    except children named in ``keep``; all of them share one DequantScratch for their prefill path."""
    if not Int4CpuLinear.available():
        return
    scratch, block = DequantScratch(dtype=cpu_prefill_dtype()), int4pack_cpu_block()

    def swap(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if name in keep:
                continue
            if isinstance(child, Int4Linear) and child.out_features % 16 == 0:  # the kernel's tiling needs it
                setattr(parent, name, Int4CpuLinear(child, scratch, block))
            else:
                swap(child)

    swap(module)


def quantizes_activations(module: nn.Module) -> bool:
    """Whether a linear below ``module`` rounds its activations to codes (W8A8-int8, fp8): a float32 sum computed in
    another order than HF's can move such a code by one step, so these models keep the torch twins' order."""
    return any(isinstance(m, Int8TokenInput | Fp8Linear) for m in module.modules())


def swap_for_cuda(module: nn.Module, dtype: torch.dtype) -> None:
    """The CUDA module swap: every Int4Linear below ``module`` repacked to the GPU kernel's pack width for ``dtype``
    activations (kernels.quant_tiles.int4_pack_width: each K step's activations load as two contiguous runs), where
    K allows another pack than its own."""
    from lora_server.kernels.quant_tiles import int4_pack_width

    for name, child in module.named_children():
        if isinstance(child, Int4Linear):
            pack = int4_pack_width(child.packed.shape[1] * 2, child.group_size, dtype.itemsize)
            if pack != (child.pack or child.group_size):
                setattr(module, name, child.repacked(pack))
        else:
            swap_for_cuda(child, dtype)


def cpu_head(embed: QuantLinear, dtype: torch.dtype) -> QuantLinear | None:
    """The tied output head's own copy on the CPU, where a quantized matmul dequantizes the whole weight at every
    call: an Int4CpuLinear of an int4 embedding, the dequantized weight in ``dtype`` of an int8 one (the same
    numbers: torch's CPU int8 matmul takes one scale per row, not Q8_0's 32-value groups) and of a GGUF-block one
    (which would decode every block at every call); None (the embedding itself) for a dense one. (The embedding is
    never fp8: tensor_mode.)"""
    if isinstance(embed, Int4Linear) and Int4CpuLinear.available() and embed.out_features % 16 == 0:
        return Int4CpuLinear(embed)
    if isinstance(embed, Int8Linear) and embed.qweight.shape[1] % 32 == 0 and embed.scales.shape[1] > 0:
        group = embed.qweight.shape[1] // embed.scales.shape[1]
        if group % 32 == 0 and embed.qweight.is_contiguous():
            return Int8CpuHead(embed, DenseLinear(embed.dequantize(dtype)))
    if isinstance(embed, Int4Linear | Int8Linear | GGUFBlockLinear):
        return DenseLinear(embed.dequantize(dtype))
    return None


def quantize_int8(w: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8; group None = per output channel. Returns (qweight int8 [out, in], scales fp16)."""
    out_f, in_f = w.shape
    group = in_f if group is None else group
    wg = w.float().reshape(out_f, in_f // group, group)
    scales = (wg.abs().amax(-1) / 127.0).clamp(min=1e-10).half()
    q = torch.round(wg / scales.float().unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q.reshape(out_f, in_f), scales


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4. Returns (packed uint8 [out, in // 2], scales fp16, mins fp16)."""
    out_f, in_f = w.shape
    if in_f % group:
        raise ValueError(f"int4 needs in_features ({in_f}) divisible by the group size {group}")
    wg = w.float().reshape(out_f, in_f // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scales = ((hi - lo) / 15.0).clamp(min=1e-10).half()
    mins = lo.half()
    q = torch.round((wg - mins.float().unsqueeze(-1)) / scales.float().unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    half = group // 2
    packed = q[..., :half] | (q[..., half:] << 4)
    return packed.reshape(out_f, in_f // 2), scales, mins


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 per output channel. Returns (qweight float8_e4m3fn [out, in], scales float32 [out]) with
    scales = max(|w|.amax(-1), 1e-12) / 448 and qweight = w / scale rounded to the nearest float8 value."""
    wf = w.float()
    scales = wf.abs().amax(-1).clamp(min=FP8_MIN_AMAX) / FP8_MAX
    return (wf / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def tensor_mode(quantization: str, name: str) -> str:
    """The mode the checkpoint tensor ``name`` (canonical: embed, lm_head, layers.{i}.q, ...) is held in under
    ``quantization``: fp8 (W8A8) quantizes the decoder's linears only; the embedding and the output head keep the
    checkpoint's own format ("auto"), as vLLM's fp8 does, since quantizing the head's input per token costs
    greedy agreement where the model is nearly undecided. int4 holds them in int8 (a GGUF's Q8_0 blocks as they
    are): 4-bit groups of the output head cost the embedded model 16% of its top-1 agreement with the unquantized
    model, int8 none of it (bench-quality). Every other mode applies to every tensor."""
    if name in ("embed", "lm_head") and quantization in ("fp8", "int4"):
        return "auto" if quantization == "fp8" else "int8"
    return quantization


def make_linear(w: torch.Tensor, mode: str, bias: torch.Tensor | None = None) -> QuantLinear:
    """The offline transform: a float weight [out, in] -> the linear module of the given mode."""
    if mode == "none":
        return DenseLinear(w, bias)
    if mode == "int8":
        return Int8Linear(*quantize_int8(w), bias=bias)
    if mode == "int4":
        return Int4Linear(*quantize_int4(w), bias=bias)
    if mode == "fp8":
        return Fp8Linear(*quantize_fp8(w), bias=bias)
    raise ValueError(f"unknown quantization mode {mode!r}")


def cat_linears(parts: list[QuantLinear], dtype: torch.dtype) -> QuantLinear:
    """Fuse linears along the output dimension (q|k|v, gate|up). Parts of one format and group size stay in
    that format (fp8's per-channel scales concatenate; GGUF blocks of one type concatenate their rows); a mix that
    holds GGUF blocks stays as it is, part by part (StackedLinear: a Q4_K_M layer's Q4_K q and k beside its Q6_K
    v; each part adds its own bias); other mixed formats fall back to per-channel int8 of the dequantized
    weights."""
    biases = [p.bias for p in parts]
    bias = (
        None
        if all(b is None for b in biases)
        else torch.cat(
            [
                b if b is not None else torch.zeros(p.out_features, dtype=dtype, device=_dev(p))
                for b, p in zip(biases, parts, strict=True)
            ]
        )
    )
    if any(isinstance(p, Int8TokenInput) for p in parts):  # W8A8-int8: one quantization of the shared input
        if not all(isinstance(p, Int8TokenInput) for p in parts):
            raise ValueError("a fused projection mixes int8-quantized and float inputs")
        return Int8TokenInput(cat_linears([cast(Int8TokenInput, p).inner for p in parts], dtype))
    if any(isinstance(p, PermutedInput) for p in parts):  # act-order GPTQ: fused where the gathers agree
        perms = [p.perm if isinstance(p, PermutedInput) else None for p in parts]
        first = perms[0]
        if first is not None and all(q is not None and torch.equal(first, q) for q in perms[1:]):
            return PermutedInput(cat_linears([cast(PermutedInput, p).inner for p in parts], dtype), first)
        return StackedLinear(list(parts))  # each part gathers its own input
    if any(isinstance(p, GGUFBlockLinear | StackedLinear) for p in parts):
        gguf_kinds = {p.kind if isinstance(p, GGUFBlockLinear) else None for p in parts}
        if len(gguf_kinds) == 1 and None not in gguf_kinds:
            blocks = torch.cat([cast(GGUFBlockLinear, p).blocks for p in parts])
            return GGUFBlockLinear(cast(GGUFBlockLinear, parts[0]).kind, blocks, bias)
        flat = [cast(QuantLinear, q) for p in parts for q in (p.parts if isinstance(p, StackedLinear) else [p])]
        stacked: list[nn.Module] = []  # neighbours of one GGUF type fused (a Q4_K_M layer's q|k): a launch fewer
        for _, run in itertools.groupby(flat, key=lambda p: p.kind if isinstance(p, GGUFBlockLinear) else id(p)):
            same = list(run)
            stacked.append(cat_linears(same, dtype) if len(same) > 1 else same[0])
        return StackedLinear(stacked)
    kinds = {type(p) for p in parts}
    groups = {p.scales.shape[1] for p in parts if isinstance(p, Int8Linear | Int4Linear)}
    if kinds == {DenseLinear}:
        return DenseLinear(torch.cat([cast(DenseLinear, p).weight for p in parts]), bias)
    if kinds == {Int8Linear} and len(groups) == 1:
        int8 = [cast(Int8Linear, p) for p in parts]
        return Int8Linear(torch.cat([p.qweight for p in int8]), torch.cat([p.scales for p in int8]), bias)
    if kinds == {Int4Linear} and len(groups) == 1 and len({cast(Int4Linear, p).pack for p in parts}) == 1:
        int4 = [cast(Int4Linear, p) for p in parts]
        return Int4Linear(
            torch.cat([p.packed for p in int4]),
            torch.cat([p.scales for p in int4]),
            torch.cat([p.mins for p in int4]),
            bias,
            int4[0].pack,
        )
    if kinds == {Fp8Linear}:
        fp8 = [cast(Fp8Linear, p) for p in parts]
        return Fp8Linear(torch.cat([p.qweight for p in fp8]), torch.cat([p.scales for p in fp8]), bias)
    w = torch.cat([p.dequantize(torch.float32) for p in parts])
    return Int8Linear(*quantize_int8(w), bias=bias)


def _dev(m: nn.Module) -> torch.device:
    return next(itertools.chain(m.buffers(), m.parameters())).device


def resident_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of a module (what stays in memory)."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
