"""Pre-quantized HF checkpoints, kept quantized: config.json's quantization_config -> QuantScheme (scheme_of), and
each linear layer's quantized tensors -> one neutral PackedLinear (read_linear), whatever format stored them:

- AWQ (GEMM packing, 4-bit, zero points), GPTQ (gptq and gptq_v2 checkpoint formats, 4 and 8 bits, sym or not,
  act-order, group sizes dividing the input or -1) -> IntWeight;
- compressed-tensors pack-quantized (W4A16, W8A16; group or channel scales; sym or zero points) -> IntWeight;
  int-quantized (W8A8-int8: int8 weights, tensor or channel scales, dynamic per-token int8 activations) ->
  IntWeight (8-bit, zeros None); float-quantized (W8A8-FP8: e4m3 weights, tensor or channel scales, dynamic
  per-token FP8 activations, or none) -> Fp8Weight.

Anything else that would change the numbers is a ModelLoadError naming it (prequant.config, prequant.ct_config,
prequant.read): unknown methods and keys, other bit widths and packings, static activation scales, kv-cache and
sparsity schemes, malformed tensors. The contracts of the neutral form are prequant.packed's.

The loader's part: for each linear layer, read_linear; a PackedLinear means the names scheme.consumed(module)
lists (those in the file) are read; None means the layer is a float ``weight``, read as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lora_server.errors import ModelLoadError
from lora_server.model.prequant.config import LAYOUT_TENSORS, QuantScheme, WeightFormat, awq_scheme, gptq_scheme
from lora_server.model.prequant.config import refuse as _refuse
from lora_server.model.prequant.ct_config import ct_scheme
from lora_server.model.prequant.packed import ACTIVATIONS, Fp8Weight, IntWeight, PackedLinear
from lora_server.model.prequant.read import READERS, ModuleTensors

__all__ = [
    "ACTIVATIONS",
    "Fp8Weight",
    "IntWeight",
    "PackedLinear",
    "QuantScheme",
    "WeightFormat",
    "read_linear",
    "scheme_of",
]

_SCHEMES: dict[str, Callable[[dict], QuantScheme]] = {
    "awq": awq_scheme,
    "gptq": gptq_scheme,
    "compressed-tensors": ct_scheme,
}

# Tensors of a layer that no implemented layout reads, each refused with why: a static activation scale would be
# the input's quantization, group act-order in compressed-tensors the columns' groups, a global scale NVFP4's.
_REFUSED_TENSORS = {
    "input_scale": "static activation quantization is not implemented",
    "input_zero_point": "static activation quantization is not implemented",
    "input_global_scale": "global activation scales are not implemented",
    "output_scale": "output quantization is not implemented",
    "output_zero_point": "output quantization is not implemented",
    "weight_g_idx": "compressed-tensors group act-order is not implemented",
    "weight_global_scale": "global weight scales are not implemented",
}
_QUANTIZED_SUFFIXES = sorted({s for suffixes in LAYOUT_TENSORS.values() for s in suffixes} - {"weight"})


def scheme_of(config: dict) -> QuantScheme:
    """The quantization of an HF config.json (its ``quantization_config``, or ``compression_config``)."""
    present = [key for key in ("quantization_config", "compression_config") if config.get(key)]
    if len(present) != 1:
        raise ModelLoadError(
            "config.json has both quantization_config and compression_config"
            if present
            else "config.json has no quantization_config"
        )
    spec = config[present[0]]
    if not isinstance(spec, dict):
        raise ModelLoadError(f"config.json {present[0]} is {spec!r}, not a JSON object")
    method = spec.get("quant_method")
    parse = _SCHEMES.get(method) if isinstance(method, str) else None
    if parse is None:
        raise _refuse("quant_method", method, f"not implemented (read: {', '.join(_SCHEMES)})")
    return parse(spec)


def read_linear(
    scheme: QuantScheme, module: str, tensor: Callable[[str], torch.Tensor], names: set[str]
) -> PackedLinear | None:
    """``module``'s (an HF module path, "model.layers.0.self_attn.q_proj") weight in the neutral form, read with
    ``tensor`` (full name -> tensor) from the checkpoint whose tensor names are ``names``; None where the layer is
    stored as a float ``weight`` (the scheme keeps it float, or, AWQ and GPTQ, the file holds no qweight for it:
    lm_head), after checking that its weight is a float tensor and that no quantized tensor of it is left over.
    A ModelLoadError names any tensor missing, malformed or not implemented."""
    for suffix, why in _REFUSED_TENSORS.items():
        if f"{module}.{suffix}" in names:
            raise ModelLoadError(f"{module}.{suffix}: {why}")
    fmt = scheme.format_of(module)
    if fmt is not None and (scheme.method == "compressed-tensors" or f"{module}.qweight" in names):
        return READERS[fmt.layout](fmt, ModuleTensors(module, tensor, names))
    leftover = [f"{module}.{s}" for s in _QUANTIZED_SUFFIXES if f"{module}.{s}" in names]
    if leftover:
        raise ModelLoadError(f"{', '.join(leftover)}: quantized tensors of {module}, which the scheme keeps float")
    name = f"{module}.weight"
    if name not in names:
        raise ModelLoadError(f"{name} is missing (neither a float nor a quantized weight of {module} is in the file)")
    dtype = tensor(name).dtype
    if not dtype.is_floating_point or dtype.itemsize < 2:
        raise ModelLoadError(f"{name} is {dtype}, but the quantization_config keeps {module} float")
    return None
