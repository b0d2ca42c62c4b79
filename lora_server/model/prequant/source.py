"""A pre-quantized linear as the model builder reads it: a WeightSource over a PackedLinear (the neutral form of
lora_server.model.prequant) whose ``linear("auto")`` keeps the checkpoint's codes resident:

- 4-bit IntWeight -> Int4Linear with the checkpoint's group size, float32 scales and mins = -scale * zero (exact:
  the codes times an fp16-born scale fit float32), wrapped in PermutedInput where act-order gathered the columns;
- 8-bit symmetric IntWeight -> Int8Linear (its signed codes, float32 scales); with W8A8-int8's per-token int8
  activations, wrapped in Int8TokenInput, which quantizes the input per token as compressed-tensors does;
- Fp8Weight with fp8 activations -> Fp8Linear (the weight, per-row scales, activations quantized per token);
- what the project has no resident layout for (8-bit with zero points, FP8 weight-only) -> the exact float weight
  in the model's dtype (DenseLinear), said in the start-up log.

Other modes (--quantization int8 / int4 / fp8) re-quantize the exact float32 weight like any float checkpoint."""

from __future__ import annotations

import logging

import torch
from torch import nn

from lora_server.errors import ModelLoadError
from lora_server.kernels.quant_reference import pack_int4
from lora_server.model.checkpoint import WeightSource
from lora_server.model.prequant.packed import Fp8Weight, IntWeight, PackedLinear
from lora_server.model.quant import (
    DenseLinear,
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    Int8TokenInput,
    PermutedInput,
    QuantLinear,
)

log = logging.getLogger(__name__)


def split_rows(packed: PackedLinear, start: int, end: int) -> PackedLinear:
    """Rows start:end of a packed weight (a fused projection's part: Phi-3's qkv_proj)."""
    if isinstance(packed, Fp8Weight):
        return Fp8Weight(packed.weight[start:end], packed.scales[start:end], packed.activations)
    zeros = None if packed.zeros is None else packed.zeros[start:end]
    return IntWeight(
        packed.codes[start:end],
        packed.scales[start:end],
        zeros,
        packed.bits,
        packed.group,
        packed.in_perm,
        packed.activations,
    )


class PackedSource(WeightSource):
    """One linear's pre-quantized weight (``native``: the resident format ``linear("auto")`` builds)."""

    def __init__(self, name: str, packed: PackedLinear) -> None:
        if packed.activations == "int8_token" and (isinstance(packed, Fp8Weight) or packed.zeros is not None):
            raise ModelLoadError(f"{name}: int8 per-token input_activations beside these weights are not implemented")
        self.name, self.packed = name, packed
        if isinstance(packed, Fp8Weight):
            self.native = "fp8" if packed.activations == "fp8_token" else "none"
        else:
            self.native = f"int{packed.bits}" if packed.bits == 4 or packed.zeros is None else "none"

    def dense(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.packed.dequantize().to(device=device, dtype=dtype)

    def linear(self, mode: str, dtype: torch.dtype, device: torch.device) -> QuantLinear:
        if mode not in ("auto", self.native):
            return super().linear(mode, dtype, device)
        packed = self.packed
        if isinstance(packed, Fp8Weight):
            if self.native == "fp8":
                return Fp8Linear(packed.weight.to(device), packed.scales.to(device))
            log.info("%s: FP8 weight-only layers have no resident layout here; held in %s", self.name, dtype)
            return DenseLinear(self.dense(dtype, device))
        module: nn.Module
        if packed.bits == 4:
            zero = packed.zeros if packed.zeros is not None else torch.full_like(packed.scales, 8.0)
            groups = packed.scales.shape[1]
            module = Int4Linear(
                pack_int4(packed.codes, groups).to(device), packed.scales.to(device), (-packed.scales * zero).to(device)
            )
        elif packed.zeros is None:
            module = Int8Linear(packed.signed_codes().to(device), packed.scales.to(device))
            if packed.activations == "int8_token":  # W8A8-int8: the input quantized per token as the scheme says
                module = Int8TokenInput(module)
        else:
            log.info("%s: 8-bit weights with zero points have no resident layout here; held in %s", self.name, dtype)
            return DenseLinear(self.dense(dtype, device))
        if packed.in_perm is not None:
            return PermutedInput(module, packed.in_perm.to(device))  # type: ignore[return-value]
        return module  # type: ignore[return-value]
