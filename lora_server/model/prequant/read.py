"""The readers of each layout's tensors (prequant.config.LAYOUT_TENSORS) into the neutral PackedLinear
(prequant.packed), one per layout, registered in READERS. Bit orders, as the packers write them:

- AWQ GEMM (AutoAWQ WQLinear_GEMM.from_linear): qweight int32 [in, out / 8] packed along out, nibble i (bits 4i..4i+3)
  of word c holding column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; qzeros int32 [in / group, out / 8] alike; scales
  [in / group, out]; w = (q - z) * s.
- GPTQ (AutoGPTQ QuantLinear.pack, GPTQModel): qweight int32 [in * bits / 32, out] packed along in, sequentially:
  element k of row r is input feature r * 32 / bits + k, at bits k * bits; qzeros int32 [groups, out * bits / 32]
  packed along out alike; scales [groups, out]; g_idx int32 [in] gives each input feature's group;
  w = s[g_idx] * (q - z[g_idx]). checkpoint_format gptq (v1) stores z - 1, gptq_v2 stores z.
- compressed-tensors pack-quantized (pack_to_int32): weight_packed int32 [out, ceil(in * bits / 32)] packed along
  in, sequentially, each code stored as q + 2**(bits - 1); weight_zero_point (asymmetric) int32
  [ceil(out * bits / 32), groups] packed along out alike; weight_scale [out, groups]; w = (q - zp) * s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lora_server.errors import ModelLoadError
from lora_server.model.prequant.config import WeightFormat
from lora_server.model.prequant.packed import Fp8Weight, IntWeight, PackedLinear

_INT32 = (torch.int32,)
_INDEX = (torch.int32, torch.int64)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)  # scales: each converts to float32 exactly

# Column j of each 8 sits in nibble _AWQ_NIBBLE_OF_COLUMN[j]: the inverse of AutoAWQ's order [0, 2, 4, 6, 1, 3, 5, 7].
_AWQ_NIBBLE_OF_COLUMN = [0, 4, 1, 5, 2, 6, 3, 7]


@dataclass(frozen=True)
class ModuleTensors:
    """One module's tensors in the checkpoint, each fetched by its suffix ("qweight") and checked as it is read."""

    module: str  # HF module path
    tensor: Callable[[str], torch.Tensor]  # full tensor name -> tensor
    names: set[str]  # every tensor name in the checkpoint

    def has(self, suffix: str) -> bool:
        return f"{self.module}.{suffix}" in self.names

    def get(self, suffix: str, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...] | None = None) -> torch.Tensor:
        name = f"{self.module}.{suffix}"
        if name not in self.names:
            raise ModelLoadError(f"{name} is missing: the quantization_config stores {self.module} quantized")
        t = self.tensor(name)
        if t.dtype not in dtypes:
            raise ModelLoadError(f"{name} is {t.dtype}, expected {' or '.join(str(d) for d in dtypes)}")
        if shape is not None and tuple(t.shape) != shape:
            raise ModelLoadError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        return t

    def refuse(self, suffix: str, why: str) -> ModelLoadError:
        return ModelLoadError(f"{self.module}.{suffix}: {why}")


def unpack_int32(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., n * 32 // bits]: word i's bits [k * bits, (k + 1) * bits) are element
    i * 32 // bits + k (sequential, least significant first)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2).to(torch.uint8)


def _group(fmt: WeightFormat, n_in: int, t: ModuleTensors, suffix: str) -> int:
    group = fmt.group if fmt.strategy == "group" else n_in
    if n_in % group:
        raise t.refuse(suffix, f"{n_in} input features are not a whole number of groups of {group}")
    return group


def read_awq(fmt: WeightFormat, t: ModuleTensors) -> PackedLinear:
    qweight = t.get("qweight", _INT32)  # [in, out / 8]
    n_in, n_out = qweight.shape[0], qweight.shape[1] * 8
    groups = n_in // (group := _group(fmt, n_in, t, "qweight"))
    qzeros = t.get("qzeros", _INT32, (groups, n_out // 8))
    scales = t.get("scales", _FLOAT, (groups, n_out))

    def columns(packed: torch.Tensor) -> torch.Tensor:  # int32 [rows, out / 8] -> uint8 [out, rows]
        nibbles = unpack_int32(packed, 4).unflatten(-1, (-1, 8))
        return nibbles[..., _AWQ_NIBBLE_OF_COLUMN].flatten(-2).t().contiguous()

    zeros = columns(qzeros).float()
    return IntWeight(columns(qweight), scales.t().float().contiguous(), zeros, 4, group, None, fmt.activations)


def read_gptq(fmt: WeightFormat, t: ModuleTensors) -> PackedLinear:
    bits, per_word = fmt.bits, 32 // fmt.bits
    qweight = t.get("qweight", _INT32)  # [in / per_word, out]
    n_in, n_out = qweight.shape[0] * per_word, qweight.shape[1]
    if n_out % per_word:
        raise t.refuse("qweight", f"{n_out} output features do not pack into whole qzeros words")
    groups = n_in // (group := _group(fmt, n_in, t, "qweight"))
    qzeros = t.get("qzeros", _INT32, (groups, n_out // per_word))
    scales = t.get("scales", _FLOAT, (groups, n_out))
    codes = unpack_int32(qweight.t(), bits)  # [out, in]
    zero = unpack_int32(qzeros, bits).t().to(torch.int32)  # [out, groups], as stored
    if fmt.layout == "gptq":
        if (zero == (1 << bits) - 1).any():
            raise t.refuse(
                "qzeros",
                f"holds {(1 << bits) - 1}, the gptq (v1) format's overflow of a zero point of 0 (readers disagree on "
                "it: AutoGPTQ reads 2**bits, GPTQModel's v1 -> v2 conversion carries into the next zero point); "
                "re-save as gptq_v2",
            )
        zero = zero + 1
    in_perm = _gptq_in_perm(fmt, t, n_in, group)
    if in_perm is not None:
        codes = codes[:, in_perm]
    zeros: torch.Tensor | None = zero.float()
    if fmt.sym:
        if (zero != 1 << (bits - 1)).any():
            raise t.refuse("qzeros", f"sym is true but the zero points are not all {1 << (bits - 1)}")
        zeros = None
    return IntWeight(codes.contiguous(), scales.t().float().contiguous(), zeros, bits, group, in_perm, fmt.activations)


def _gptq_in_perm(fmt: WeightFormat, t: ModuleTensors, n_in: int, group: int) -> torch.Tensor | None:
    """The stored column order that makes act-order groups contiguous (features ascending within a group), or None
    where g_idx is the plain grouping (feature c in group c // group) or absent."""
    if not t.has("g_idx"):
        if fmt.act_order:
            raise t.refuse("g_idx", "missing, and desc_act is true")
        return None
    g_idx = t.get("g_idx", _INDEX, (n_in,)).long()
    if torch.equal(g_idx, torch.arange(n_in) // group):
        return None
    if not fmt.act_order:
        raise t.refuse("g_idx", "not the plain grouping while desc_act is false (readers disagree on applying it)")
    groups = n_in // group
    if g_idx.min() < 0 or g_idx.max() >= groups or (torch.bincount(g_idx, minlength=groups) != group).any():
        raise t.refuse("g_idx", f"does not put exactly {group} input features in each of {groups} groups")
    return torch.argsort(g_idx, stable=True)


def read_ct_packed(fmt: WeightFormat, t: ModuleTensors) -> PackedLinear:
    bits, per_word = fmt.bits, 32 // fmt.bits
    n_out, n_in = (int(v) for v in t.get("weight_shape", _INDEX, (2,)).tolist())
    packed = t.get("weight_packed", _INT32, (n_out, math.ceil(n_in / per_word)))
    groups = n_in // (group := _group(fmt, n_in, t, "weight_shape"))
    scales = t.get("weight_scale", _FLOAT, (n_out, groups))
    codes = unpack_int32(packed, bits)[:, :n_in]  # q + 2**(bits - 1)
    zeros = None
    if not fmt.sym:
        zp = t.get("weight_zero_point", _INT32, (math.ceil(n_out / per_word), groups))  # packed along out
        zeros = unpack_int32(zp.t(), bits)[:, :n_out].t().float()  # zp + 2**(bits - 1)
    elif t.has("weight_zero_point"):
        raise t.refuse("weight_zero_point", "present, but the scheme is symmetric")
    return IntWeight(codes.contiguous(), scales.float(), zeros, bits, group, None, fmt.activations)


def read_ct_float(fmt: WeightFormat, t: ModuleTensors) -> PackedLinear:
    weight = t.get("weight", (torch.float8_e4m3fn,))
    return Fp8Weight(weight, _row_scales(fmt, t, weight.shape[0]), fmt.activations)


def read_ct_int(fmt: WeightFormat, t: ModuleTensors) -> PackedLinear:
    weight = t.get("weight", (torch.int8,))  # [out, in]
    codes = (weight.to(torch.int16) + 128).to(torch.uint8)
    scales = _row_scales(fmt, t, weight.shape[0]).unsqueeze(1)  # [out, 1]
    return IntWeight(codes, scales, None, 8, weight.shape[1], None, fmt.activations)


def _row_scales(fmt: WeightFormat, t: ModuleTensors, n_out: int) -> torch.Tensor:
    """float32 [out]: weight_scale per channel ([out, 1]), or per tensor (one value) repeated on every row. A
    symmetric scheme's weight_zero_point, which older compressed-tensors files keep, must be all zeros."""
    scale = t.get("weight_scale", _FLOAT)
    per_tensor = fmt.strategy == "tensor"
    if scale.numel() != (1 if per_tensor else n_out) or (not per_tensor and scale.shape not in ((n_out, 1), (n_out,))):
        raise t.refuse("weight_scale", f"shape {tuple(scale.shape)} is not that of {fmt.strategy} scales")
    if t.has("weight_zero_point"):
        zp = t.get("weight_zero_point", (torch.int8, torch.int32, *_FLOAT, torch.float8_e4m3fn))
        if zp.shape != scale.shape or (zp.float() != 0).any():
            raise t.refuse("weight_zero_point", "a symmetric scheme's zero points are not all 0")
    return scale.float().reshape(-1).expand(n_out).contiguous()


READERS: dict[str, Callable[[WeightFormat, ModuleTensors], PackedLinear]] = {
    "awq_gemm": read_awq,
    "gptq": read_gptq,
    "gptq_v2": read_gptq,
    "ct_packed": read_ct_packed,
    "ct_float": read_ct_float,
    "ct_int": read_ct_int,
}
