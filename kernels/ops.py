"""The one switch between the Triton kernels and their torch twins, and the ops the model calls through it.

``use_kernels(device)`` decides: the Triton kernels for tensors on CUDA where triton is installed, the torch twins
(kernels.reference, kernels.lora_reference, kernels.quant_reference) everywhere else, the CPU included, except
where a batched torch path computes the same thing faster (decode attention: kernels.gathered_attention; LoRA
over host-known segments: kernels.segment_lora), each tested against its twin. Each op
below asks it for its tensors' device and returns what its kernel wrapper's docstring states; the twins compute the
same thing. Callers never choose: the test tier runs the kernel wrappers themselves under the Triton interpreter.
Kernel modules are imported on first use, so CPU machines need no triton.

LoRA shapes: x [T, in]; out [T, out_total], x's dtype; lora_a [K, slots, R, in] and lora_b [slots, out_total, R],
x's dtype, scaling folded into B, columns r >= ranks[s] zero and never read; ranks [slots]; y [K, T, R] float32;
slice_starts [K + 1] (list or tensor), slice k = out columns slice_starts[k]:slice_starts[k + 1]. The token to
slot mapping: either slot_ids [T] (per row, BGMV) or seg_starts [S + 1] with seg_slots [S] (contiguous segments,
SGMV); -1 = no adapter; integer tensors int32 or int64, on x's device."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels import lora_reference, quant_reference, reference


def use_kernels(device: torch.device | str) -> bool:
    """True where the ops run the Triton kernels: a CUDA device, with triton installed. False elsewhere (the CPU,
    or CUDA without triton): the torch twins run. Whatever TRITON_INTERPRET says."""
    return torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None


def _segments(
    slot_ids: torch.Tensor | None, seg_starts: torch.Tensor | None, seg_slots: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(seg_starts, seg_slots) for the segmented form, None for the per-row form; asserts exactly one is given."""
    if slot_ids is not None:
        assert seg_starts is None and seg_slots is None, "give slot_ids or (seg_starts, seg_slots), not both"
        return None
    assert seg_starts is not None and seg_slots is not None, "give slot_ids, or both seg_starts and seg_slots"
    return seg_starts, seg_slots


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    ranks: torch.Tensor,
    *,
    slot_ids: torch.Tensor | None = None,
    seg_starts: torch.Tensor | None = None,
    seg_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [K, T, R] float32: y[k, t, :r] = x[t].float() @ lora_a[k, s, :r].float().T for tokens with slot s >= 0
    and r = ranks[s]; zeros elsewhere (kernels.sgmv_shrink / bgmv_shrink)."""
    segments = _segments(slot_ids, seg_starts, seg_slots)
    if segments is not None:
        if use_kernels(x.device):
            from kernels.sgmv_shrink import sgmv_shrink

            return sgmv_shrink(x, lora_a, ranks, *segments)
        return lora_reference.sgmv_shrink(x, lora_a, ranks, *segments)
    assert slot_ids is not None
    if use_kernels(x.device):
        from kernels.bgmv_shrink import bgmv_shrink

        return bgmv_shrink(x, lora_a, ranks, slot_ids)
    return lora_reference.bgmv_shrink(x, lora_a, ranks, slot_ids)


def lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    slice_starts: Sequence[int] | torch.Tensor,
    out: torch.Tensor,
    *,
    slot_ids: torch.Tensor | None = None,
    seg_starts: torch.Tensor | None = None,
    seg_slots: torch.Tensor | None = None,
) -> None:
    """In place: out[t, a:b] += y[k, t, :r].to(lora_b.dtype) @ lora_b[s, a:b, :r].T for every slice k = a:b and
    token with slot s >= 0, r = ranks[s] (float32 accumulation, one rounding to out's dtype); rows with slot -1 are
    not touched (kernels.sgmv_expand / bgmv_expand)."""
    segments = _segments(slot_ids, seg_starts, seg_slots)
    if segments is not None:
        if use_kernels(out.device):
            from kernels.sgmv_expand import sgmv_expand

            sgmv_expand(y, lora_b, ranks, slice_starts, *segments, out)
        else:
            lora_reference.sgmv_expand(y, lora_b, ranks, slice_starts, *segments, out)
        return
    assert slot_ids is not None
    if use_kernels(out.device):
        from kernels.bgmv_expand import bgmv_expand

        bgmv_expand(y, lora_b, ranks, slice_starts, slot_ids, out)
    else:
        lora_reference.bgmv_expand(y, lora_b, ranks, slice_starts, slot_ids, out)


def apply_lora(
    x: torch.Tensor,
    out: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    slice_starts: Sequence[int] | torch.Tensor,
    *,
    slot_ids: torch.Tensor | None = None,
    seg_starts: torch.Tensor | None = None,
    seg_slots: torch.Tensor | None = None,
    host_segments: Sequence[tuple[int, int, int, int]] | None = None,
    views: dict | None = None,
) -> None:
    """out += LoRA(x), in place: lora_expand(lora_shrink(x, ...), ...) with the same mapping. ``host_segments``
    (start, end, slot, rank), the same mapping as host integers where each slot's tokens are contiguous: without
    the kernels it takes the segment path (kernels.segment_lora, which reads no device tensor; ``views`` its
    per-slot views, kept by the caller)."""
    if host_segments is not None and not use_kernels(x.device):
        from kernels.segment_lora import apply_lora_segments

        starts = slice_starts.tolist() if isinstance(slice_starts, torch.Tensor) else slice_starts
        apply_lora_segments(x, out, lora_a, lora_b, starts, host_segments, views)
        return
    mapping = {"slot_ids": slot_ids, "seg_starts": seg_starts, "seg_slots": seg_slots}
    lora_expand(lora_shrink(x, lora_a, ranks, **mapping), lora_b, ranks, slice_starts, out, **mapping)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """In place: k_cache.view(-1, KVH, D)[slot_mapping] = k, and v alike; an fp8 cache stores k / k_scale[:, None]
    clamped to +-448; tokens with a negative slot write nothing (kernels.write_kv)."""
    if use_kernels(k.device):
        from kernels.write_kv import write_kv_cache as kernel

        kernel(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        reference.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rotary_write_kv(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """In place: the query and key heads qk [T, H + KVH, D] rotated with HF's two roundings (qk * cos +
    qk.roll(D // 2, -1) * sin_signed, cos and sin_signed [T, 1, D]), then the rotated keys qk[:, H:] and v written
    to their slots as write_kv_cache does (kernels.rotary_write_kv: one launch)."""
    if use_kernels(qk.device):
        from kernels.rotary_write_kv import rotary_write_kv as kernel

        kernel(qk, v, cos, sin_signed, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        reference.rotary_write_kv(qk, v, cos, sin_signed, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """out [T, H, D]: causal grouped-query attention of each sequence's new queries over its paged KV, for decode
    steps and prefill chunks alike; an fp8 cache is read as stored.float() * k_scale / v_scale [KVH]; a decode row
    whose sequence has length 0 (padding) is zero. A step with one query per sequence takes the decode path: with
    the kernels, split-KV decode attention in ``num_splits`` chunks per sequence (kernels.decode_attention; None:
    its default, from the shapes), without them one gather per layer (kernels.gathered_attention); other steps
    take kernels.paged_attention, or its twin (which needs no max_query_len)."""
    decode = max_query_len == 1 and q.shape[0] == block_tables.shape[0]
    if use_kernels(q.device):
        if decode:
            from kernels.decode_attention import paged_decode_attention

            return paged_decode_attention(
                q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, num_splits=num_splits
            )
        from kernels.paged_attention import paged_attention as kernel

        return kernel(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, k_scale, v_scale
        )
    if decode:
        from kernels.gathered_attention import gathered_decode_attention

        return gathered_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale)
    return reference.paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, hidden] = weight * (x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype), HF's LlamaRMSNorm
    (kernels.rms_norm)."""
    if use_kernels(x.device):
        from kernels.rms_norm import rms_norm as kernel

        return kernel(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x, then x = rms_norm(residual, weight, eps) (kernels.rms_norm: one launch)."""
    if use_kernels(x.device):
        from kernels.rms_norm import fused_add_rms_norm as kernel

        kernel(x, residual, weight, eps)
    else:
        reference.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, I] = F.silu(x[:, :I]) * x[:, I:] for the fused gate | up output x [T, 2 * I] (kernels.silu_and_mul)."""
    if use_kernels(x.device):
        from kernels.silu_and_mul import silu_and_mul as kernel

        return kernel(x)
    return reference.silu_and_mul(x)


def _num_sms(device: torch.device) -> int:
    """The device's SM count, which split-K aims to fill (an H100's under the interpreter on the CPU)."""
    if device.type != "cuda":
        from kernels.quant_tiles import H100_SMS

        return H100_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def int8_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y [M, N] in x's dtype = x @ dequant(W).T (+ bias) for int8 weights. With the kernels: below
    quant_tiles.DEQUANT_MIN_TOKENS rows kernels.int8_matmul with the tiles and split-K of quant_tiles.choose_tiles;
    from there the weight dequantized by kernels.dequantize (float32, rounded once to x's dtype) and F.linear.
    Without the kernels: F.linear over the twin's dequantize_int8(qweight, scales, x.dtype), which for float32 x is
    bit for bit the twin quant_reference.int8_matmul (and folds the bias in as F.linear does)."""
    if use_kernels(x.device):
        from kernels.quant_tiles import DEQUANT_MIN_TOKENS, choose_tiles

        if x.shape[0] >= DEQUANT_MIN_TOKENS:
            from kernels.dequantize import dequantize_int8

            return F.linear(x, dequantize_int8(qweight, scales, x.dtype), bias)
        from kernels.int8_matmul import int8_matmul as kernel

        n, k = qweight.shape
        tiles = choose_tiles(x.shape[0], n, k, num_sms=_num_sms(x.device))
        y = kernel(x, qweight, scales, **tiles.kwargs())
        return y if bias is None else y + bias
    return F.linear(x, quant_reference.dequantize_int8(qweight, scales, x.dtype), bias)


def int4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None = None,
    pack: int | None = None,
) -> torch.Tensor:
    """y [M, N] in x's dtype = x @ dequant(W).T (+ bias) for int4 weights whose nibbles pair within blocks of
    ``pack`` columns (None: the group, Q4_1). With the kernels: kernels.int4_matmul (one K step per pack block) or,
    from quant_tiles.DEQUANT_MIN_TOKENS rows, kernels.dequantize + F.linear, as int8_matmul. Without the kernels:
    F.linear over the twin's dequantize_int4(packed, scales, mins, x.dtype, pack), as int8_matmul."""
    if use_kernels(x.device):
        from kernels.quant_tiles import DEQUANT_MIN_TOKENS, choose_tiles

        if x.shape[0] >= DEQUANT_MIN_TOKENS:
            from kernels.dequantize import dequantize_int4

            return F.linear(x, dequantize_int4(packed, scales, mins, x.dtype, pack=pack), bias)
        from kernels.int4_matmul import int4_matmul as kernel

        n, k = packed.shape[0], packed.shape[1] * 2
        block_k = k // scales.shape[1] if pack is None else pack
        tiles = choose_tiles(x.shape[0], n, k, num_sms=_num_sms(x.device), block_k=block_k)
        y = kernel(x, packed, scales, mins, pack=pack, **tiles.kwargs(with_block_k=False))
        return y if bias is None else y + bias
    return F.linear(x, quant_reference.dequantize_int4(packed, scales, mins, x.dtype, pack), bias)


def fp8_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y [M, N] in x's dtype (+ bias): fp8 W8A8, x quantized per token and multiplied with the fp8 weight codes,
    both scales applied to the fp32 sum (kernels.fp8_matmul: its Triton quantization and torch._scaled_mm, on CUDA
    capability 8.9-9.x). Elsewhere (the CPU, older GPUs, shapes _scaled_mm does not take) the twin
    quant_reference.fp8_matmul computes the same numbers by dequantizing the codes to float32."""
    if use_kernels(x.device):
        from kernels.fp8_matmul import fp8_matmul as kernel
        from kernels.fp8_matmul import scaled_mm_supported

        if scaled_mm_supported(x, qweight):
            y = kernel(x, qweight, scales)
            return y if bias is None else y + bias
    y = quant_reference.fp8_matmul(x, qweight, scales)
    return y if bias is None else y + bias
