"""The neutral form a pre-quantized checkpoint's linear weight is read into (lora_server.model.prequant), whatever
format stored it: integer codes with per-group scales (IntWeight: AWQ, GPTQ, compressed-tensors pack-quantized and
int-quantized) or float8 codes with per-row scales (Fp8Weight: compressed-tensors float-quantized). Rows are output
features, columns input features, in HF's [out, in] orientation. Every field is exact: no value is rounded on the
way from the file, so ``dequantize()`` is the checkpoint's own weight in float32.

``activations`` says what the checkpoint's scheme does to the layer's input, which the matmul must do likewise:
- "none": nothing (weight-only: AWQ, GPTQ, W4A16, FP8 or int8 weights without input quantization);
- "fp8_token": quantized per token (per row of x) to float8_e4m3fn at each call, symmetric, no zero point;
- "int8_token": quantized per token to int8 at each call, symmetric, no zero point.
The checkpoint fixes the kind, not the rounding of the activation scale (vLLM takes amax / 448 and amax / 127).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ACTIVATIONS = ("none", "fp8_token", "int8_token")


@dataclass(frozen=True)
class IntWeight:
    """Integer codes, one scale (and zero point) per group of ``group`` stored columns:

        w[o, c] = scales[o, j // group] * (codes[o, j] - zero[o, j // group]),  c = in_perm[j] (c = j if None)
        zero = zeros if zeros is not None else 2 ** (bits - 1)

    computed in float32 (codes - zero is an exact small integer; one rounding of the product). Stored column j holds
    input feature in_perm[j]: act-order GPTQ's columns are gathered so that each group is contiguous, and a matmul
    with the stored columns takes the gathered input x[:, in_perm]. Per-channel scales are group == in (one group).
    Symmetric formats have zeros None (the zero point is the middle code): ``signed_codes()`` is then the two's
    complement form (int8 W8A8's int8 weight, GPTQ sym's q - 2**(bits - 1))."""

    codes: torch.Tensor  # uint8 [out, in], 0 .. 2**bits - 1
    scales: torch.Tensor  # float32 [out, in // group]
    zeros: torch.Tensor | None  # float32 [out, in // group], exact integers in 0 .. 2**bits - 1; None: 2**(bits - 1)
    bits: int  # 4 or 8
    group: int  # stored columns per scale; divides in
    in_perm: torch.Tensor | None  # int64 [in], a permutation of range(in); None: identity
    activations: str = "none"  # one of ACTIVATIONS

    def __post_init__(self) -> None:
        out, n_in = self.codes.shape
        assert self.codes.dtype == torch.uint8 and self.bits in (4, 8), (self.codes.dtype, self.bits)
        assert self.group > 0 and n_in % self.group == 0, (n_in, self.group)
        assert self.scales.dtype == torch.float32 and self.scales.shape == (out, n_in // self.group)
        assert self.zeros is None or (self.zeros.dtype == torch.float32 and self.zeros.shape == self.scales.shape)
        assert self.in_perm is None or (self.in_perm.dtype == torch.int64 and self.in_perm.shape == (n_in,))
        assert self.activations in ACTIVATIONS, self.activations

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1]

    def signed_codes(self) -> torch.Tensor:
        """int8 [out, in]: codes - 2**(bits - 1), the stored columns' codes of a symmetric format (w = scale * q)."""
        assert self.zeros is None, "asymmetric codes have no signed form"
        return (self.codes.to(torch.int16) - (1 << (self.bits - 1))).to(torch.int8)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in] in HF's column order (in_perm undone)."""
        zero = self.zeros if self.zeros is not None else torch.full_like(self.scales, float(1 << (self.bits - 1)))
        groups = self.scales.shape[1]
        diff = self.codes.float().unflatten(1, (groups, self.group)) - zero.unsqueeze(-1)  # [out, groups, group]
        stored = (self.scales.unsqueeze(-1) * diff).flatten(1)  # [out, in], stored column order
        if self.in_perm is None:
            return stored
        w = torch.empty_like(stored)
        w[:, self.in_perm] = stored
        return w


@dataclass(frozen=True)
class Fp8Weight:
    """float8_e4m3fn codes, one scale per output row (a per-tensor scale is repeated on every row):

    w[o, c] = float32(weight[o, c]) * scales[o]   (one rounding in float32)
    """

    weight: torch.Tensor  # float8_e4m3fn [out, in]
    scales: torch.Tensor  # float32 [out]
    activations: str = "none"  # one of ACTIVATIONS

    def __post_init__(self) -> None:
        assert self.weight.dtype == torch.float8_e4m3fn and self.weight.dim() == 2, self.weight.dtype
        assert self.scales.dtype == torch.float32 and self.scales.shape == (self.weight.shape[0],)
        assert self.activations in ACTIVATIONS, self.activations

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1]

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]."""
        return self.weight.float() * self.scales.unsqueeze(1)


PackedLinear = IntWeight | Fp8Weight
