"""DoRA (PEFT's use_dora) as the engine serves it: a per-output-channel epilogue after base + LoRA.

PEFT computes, for a DoRA module with base weight W [out, in], bias b, magnitude m [out] and scaled B A:

    out = b + s * (x W^T + x A^T B^T),   s = m / ||W + B A||_row   (the L2 norm of each output row, over in)

The weights never change while an adapter is served, so s is computed once, when the adapter is staged, from the
base weights the engine serves (dequantized, in the model's dtype). With the base output base(x) = x W^T + b that
the LoRA is added to, the served result is

    out = s * (base(x) + x A^T B^T) + (1 - s) * b

so each DoRA module carries two rows [2, out]: the scale s (rounded to the model's dtype, as the arena holds it)
and the shift (1 - s) * b computed from that rounded s (zero for a module without bias). They lie in the adapter's
pages beside A and B^T (adapters.page_layout; kernels/lora_table.py says where), and the LoRA expand (its kernel,
its twin, the CPU's segment path) applies them to the columns it writes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lora_server.adapters.peft_format import AdapterError, LoraAdapter

# (layer, canonical module, A [r, in], scaled B [out, r], both float32 on the host) -> (||W + B A|| of each output
# row [out], the module's bias [out] or None), float32 on the host, W the base weight as the engine serves it. The
# model's side (model.lora.BaseRowNorms) computes it where the weights live.
BaseRowNorms = Callable[[int, str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


def dora_epilogues(
    adapter: LoraAdapter, row_norms: BaseRowNorms, dtype: torch.dtype
) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, module) -> [2, out] float32: the scale s = m / ||W + B A||_row rounded to ``dtype`` (the arena's)
    and the shift (1 - s) * b, for every module of a DoRA adapter (empty for a plain LoRA). AdapterError when one
    is not finite in ``dtype`` (a row of W + B A is zero, or a value overflows)."""
    epilogues = {}
    for (layer, module), magnitude in sorted(adapter.magnitudes.items()):
        a, b = adapter.weights[(layer, module)]
        norms, bias = row_norms(layer, module, a, b)
        scale = (magnitude / norms).to(dtype).float()
        shift = torch.zeros_like(scale) if bias is None else (1 - scale) * bias.float()
        rows = torch.stack([scale, shift])
        if not torch.isfinite(rows.to(dtype)).all():
            raise AdapterError(
                f"layer {layer} {module}: DoRA's scale (magnitude / the norm of a row of W + B A) or shift is not "
                f"finite in {dtype} (a zero row of the base weight plus this adapter, or an overflow)"
            )
        epilogues[(layer, module)] = rows
    return epilogues
