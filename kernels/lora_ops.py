"""The batched multi-LoRA ops the model calls: shrink (x @ A.T), expand (out += y @ B.T) and both together, for one
fused linear (K output slices) of one layer, with tokens mapped to adapter slots either per row (BGMV, decode) or by
contiguous segments (SGMV, prefill). Each op runs the Triton kernel where use_triton says so, else its torch twin
(kernels.lora_reference); both compute the same thing (see the kernel wrappers' docstrings).

Shapes: x [T, in]; out [T, out_total], x's dtype; lora_a [K, slots, R, in] and lora_b [slots, out_total, R], x's
dtype, scaling folded into B, columns r >= ranks[s] zero and never read; ranks [slots]; y [K, T, R] float32;
slice_starts [K + 1] (list or tensor), slice k = out columns slice_starts[k]:slice_starts[k + 1]. The mapping: either
slot_ids [T] or seg_starts [S + 1] with seg_slots [S]; -1 = no adapter; integer tensors int32 or int64, on x's
device."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

import torch

from kernels import lora_reference


def triton_interpret_requested() -> bool:
    """Whether the environment asks for the Triton interpreter (TRITON_INTERPRET=1, the CPU test tier): the one
    place this module reads it, at call time."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(device: torch.device | str, *, interpret: bool | None = None) -> bool:
    """True where the ops run the Triton kernels: tensors on CUDA, or on any device under the Triton interpreter
    (interpret; None: triton_interpret_requested()). False, and the torch twins run, elsewhere or without triton."""
    if importlib.util.find_spec("triton") is None:
        return False
    if interpret is None:
        interpret = triton_interpret_requested()
    return torch.device(device).type == "cuda" or interpret


def _is_segmented(slot_ids: torch.Tensor | None, seg_starts: torch.Tensor | None,
                  seg_slots: torch.Tensor | None) -> bool:
    if slot_ids is not None:
        assert seg_starts is None and seg_slots is None, "give slot_ids or (seg_starts, seg_slots), not both"
        return False
    assert seg_starts is not None and seg_slots is not None, "give slot_ids, or both seg_starts and seg_slots"
    return True


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, *, slot_ids: torch.Tensor | None = None,
                seg_starts: torch.Tensor | None = None, seg_slots: torch.Tensor | None = None,
                use_kernels: bool | None = None) -> torch.Tensor:
    """y [K, T, R] float32: y[k, t, :r] = x[t].float() @ lora_a[k, s, :r].float().T for tokens with slot s >= 0
    and r = ranks[s]; zeros elsewhere. use_kernels: force the Triton kernel (True) or the twin (False); None:
    use_triton(x.device)."""
    if use_kernels is None:
        use_kernels = use_triton(x.device)
    if _is_segmented(slot_ids, seg_starts, seg_slots):
        assert seg_starts is not None and seg_slots is not None
        if use_kernels:
            from kernels.sgmv_shrink import sgmv_shrink  # imported on use: triton is optional on CPU machines

            return sgmv_shrink(x, lora_a, ranks, seg_starts, seg_slots)
        return lora_reference.sgmv_shrink(x, lora_a, ranks, seg_starts, seg_slots)
    assert slot_ids is not None
    if use_kernels:
        from kernels.bgmv_shrink import bgmv_shrink

        return bgmv_shrink(x, lora_a, ranks, slot_ids)
    return lora_reference.bgmv_shrink(x, lora_a, ranks, slot_ids)


def lora_expand(y: torch.Tensor, lora_b: torch.Tensor, ranks: torch.Tensor, slice_starts: Sequence[int] | torch.Tensor,
                out: torch.Tensor, *, slot_ids: torch.Tensor | None = None, seg_starts: torch.Tensor | None = None,
                seg_slots: torch.Tensor | None = None, use_kernels: bool | None = None) -> None:
    """In place: out[t, a:b] += y[k, t, :r].to(lora_b.dtype) @ lora_b[s, a:b, :r].T for every slice k = a:b and
    token with slot s >= 0, r = ranks[s] (float32 accumulation, one rounding to out's dtype); rows with slot -1 are
    not touched. use_kernels: as in lora_shrink."""
    if use_kernels is None:
        use_kernels = use_triton(out.device)
    if _is_segmented(slot_ids, seg_starts, seg_slots):
        assert seg_starts is not None and seg_slots is not None
        if use_kernels:
            from kernels.sgmv_expand import sgmv_expand

            sgmv_expand(y, lora_b, ranks, slice_starts, seg_starts, seg_slots, out)
        else:
            lora_reference.sgmv_expand(y, lora_b, ranks, slice_starts, seg_starts, seg_slots, out)
        return
    assert slot_ids is not None
    if use_kernels:
        from kernels.bgmv_expand import bgmv_expand

        bgmv_expand(y, lora_b, ranks, slice_starts, slot_ids, out)
    else:
        lora_reference.bgmv_expand(y, lora_b, ranks, slice_starts, slot_ids, out)


def apply_lora(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, ranks: torch.Tensor,
               slice_starts: Sequence[int] | torch.Tensor, *, slot_ids: torch.Tensor | None = None,
               seg_starts: torch.Tensor | None = None, seg_slots: torch.Tensor | None = None,
               use_kernels: bool | None = None) -> None:
    """out += LoRA(x), in place: lora_expand(lora_shrink(x, ...), ...) with the same mapping. use_kernels: as in
    lora_shrink."""
    mapping = {"slot_ids": slot_ids, "seg_starts": seg_starts, "seg_slots": seg_slots}
    y = lora_shrink(x, lora_a, ranks, **mapping, use_kernels=use_kernels)
    lora_expand(y, lora_b, ranks, slice_starts, out, **mapping, use_kernels=use_kernels)
