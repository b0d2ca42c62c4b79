"""The one switch between the Triton kernels and their torch twins, and the ops the model calls through it.

``use_kernels(device)`` decides: the Triton kernels for tensors on CUDA where triton is installed, the torch twins
(kernels.reference, kernels.lora_reference, kernels.quant_reference) everywhere else, the CPU included, except
where a batched torch path computes the same thing faster (decode attention: kernels.gathered_attention; LoRA
over host-known segments: kernels.segment_lora), each tested against its twin. Each op
below asks it for its tensors' device and returns what its kernel wrapper's docstring states; the twins compute the
same thing. Callers never choose: the test tier runs the kernel wrappers themselves under the Triton interpreter.
Kernel modules are imported on first use, so CPU machines need no triton.

LoRA: adapters live in the arena's pages and are found through their tables (kernels/lora_table.py); a step's
tokens reach the ops grouped by adapter, as a tile map (the kernels, the twins) or as host segments carrying the
adapters' views (the CPU path)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from ctypes import CDLL
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lora_server.kernels import cpu_decode, lora_reference, quant_reference, reference

if TYPE_CHECKING:
    from lora_server.kernels.segment_lora import LoraTerm


def use_kernels(device: torch.device | str) -> bool:
    """True where the ops run the Triton kernels: a CUDA device, with triton installed. False elsewhere (the CPU,
    or CUDA without triton): the torch twins run. Whatever TRITON_INTERPRET says."""
    return torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None


@dataclass(frozen=True, slots=True)
class LoraArena:
    """The arena as the LoRA ops read it (kernels.lora_table): two flat views of the same pages."""

    weights: torch.Tensor  # [E] the arena in the model's dtype: what tables' offsets index
    table: torch.Tensor  # [E * itemsize / 8] int64: page p's table starts at p * table_stride
    table_stride: int  # int64 values per page
    max_rank: int  # the engine's largest rank: the tables' row length


def apply_lora(
    x: torch.Tensor,
    out: torch.Tensor,
    arena: LoraArena,
    tiles: torch.Tensor | None,
    *,
    layer: int,
    module_base: int,
    slice_starts: Sequence[int] | torch.Tensor,
    max_width: int,
    y: torch.Tensor | None,
    block_t: int,
    host_segments: Callable[[], Sequence[tuple[int, int, Sequence[LoraTerm]]]] | None = None,
    slice_align: int = 1,
) -> None:
    """out += LoRA(x), in place, for one fused linear of one layer (slice k is module module_base + k; its output
    columns slice_starts[k]:slice_starts[k + 1]). For every tile (page p, rows a:b) of the tile map ``tiles``
    [N, 3] and slice k with rank r = the table of page p's rank for (layer, module):
    out[a:b, slice k] += (x[a:b] @ A[:r].T) @ BT[:r], A and BT read through the table (kernels.lora_table).

    With the kernels: kernels.lora_shrink into the persistent float32 workspace ``y`` [splits, K, T, R], its
    reduction split as lora_shrink.choose_splits says for these shapes, then kernels.lora_expand (``slice_align``:
    what every slice start is a multiple of, 8 letting it load 16 bytes at a time); nothing is allocated. Without
    them, where the caller has the same mapping as host segments (start, end, terms) with the adapters' views, the
    segment path (kernels.segment_lora: a few matmuls per adapter); else the twins."""
    if use_kernels(x.device):
        from lora_server.kernels.lora_expand import lora_expand
        from lora_server.kernels.lora_shrink import choose_splits, lora_shrink

        assert tiles is not None and y is not None and isinstance(slice_starts, torch.Tensor)
        num_slices = slice_starts.shape[0] - 1
        splits = choose_splits(tiles.shape[0], num_slices, arena.max_rank, x.shape[1], _num_sms(x.device))
        common = {"layer": layer, "module_base": module_base, "table_stride": arena.table_stride}
        common |= {"max_rank": arena.max_rank, "num_splits": splits, "block_t": block_t}
        lora_shrink(x, arena.weights, arena.table, tiles, y, num_slices=num_slices, **common)
        lora_expand(
            y, arena.weights, arena.table, tiles, slice_starts, out, max_width=max_width, align=slice_align, **common
        )
        return
    if host_segments is not None:
        from lora_server.kernels.segment_lora import apply_lora_segments

        apply_lora_segments(x, out, host_segments())
        return
    assert tiles is not None
    starts = slice_starts if isinstance(slice_starts, torch.Tensor) else torch.tensor(slice_starts, dtype=torch.int32)
    num_slices = starts.shape[0] - 1
    workspace = torch.empty(1, num_slices, x.shape[0], -(-arena.max_rank // 16) * 16, dtype=torch.float32)
    common = {"layer": layer, "module_base": module_base, "table_stride": arena.table_stride}
    common |= {"max_rank": arena.max_rank, "num_splits": 1}
    lora_reference.paged_lora_shrink(x, arena.weights, arena.table, tiles, workspace, num_slices=num_slices, **common)
    lora_reference.paged_lora_expand(
        workspace, arena.weights, arena.table, tiles, starts, out, max_width=max_width, **common
    )


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
        from lora_server.kernels.write_kv import write_kv_cache as kernel

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
    rotary_dim: int = 0,
    cpu: CDLL | None = None,
) -> None:
    """In place: the query and key heads qk [T, H + KVH, D] rotated with HF's two roundings (qk * cos +
    qk.roll(D // 2, -1) * sin_signed, cos and sin_signed [T, 1, D]; rotary_dim R in (0, D): the roll within the
    first R dimensions, partial rotary), then the rotated keys qk[:, H:] and v written to their slots as
    write_kv_cache does (kernels.rotary_write_kv: one launch; ``cpu``: kernels.cpu_decode's library, for float32
    tensors on the CPU)."""
    if use_kernels(qk.device):
        from lora_server.kernels.rotary_write_kv import rotary_write_kv as kernel

        kernel(qk, v, cos, sin_signed, k_cache, v_cache, slot_mapping, k_scale, v_scale, rotary_dim)
    elif cpu is not None and cpu_decode.takes_rotary(qk, v, cos, k_cache, k_scale):
        cpu_decode.rotary_write_kv_(cpu, qk, v, cos, sin_signed, k_cache, v_cache, slot_mapping, rotary_dim)
    else:
        reference.rotary_write_kv(qk, v, cos, sin_signed, k_cache, v_cache, slot_mapping, k_scale, v_scale, rotary_dim)


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
    window: int = 0,
    softcap: float = 0.0,
    num_splits: int | None = None,
    cpu: CDLL | None = None,
) -> torch.Tensor:
    """out [T, H, D]: causal grouped-query attention of each sequence's new queries over its paged KV, for decode steps
    and prefill chunks alike (window > 0: each query sees its last ``window`` keys only; softcap > 0: the scaled scores
    s become softcap * tanh(s / softcap)); an fp8 cache is read as stored.float() * k_scale / v_scale [KVH]; a decode
    row whose sequence has length 0 (padding) is zero. A step with one query per sequence takes the decode path: with
    the kernels, split-KV decode attention in ``num_splits`` chunks per sequence (kernels.decode_attention; None: its
    default, from the shapes), without them one gather per layer (kernels.gathered_attention), or with ``cpu`` (the
    library of kernels.cpu_decode) its decode_attention where it takes the tensors; other steps take
    kernels.paged_attention, or its twin (which needs no max_query_len)."""
    decode = max_query_len == 1 and q.shape[0] == block_tables.shape[0]
    if use_kernels(q.device):
        if decode:
            from lora_server.kernels.decode_attention import paged_decode_attention

            return paged_decode_attention(
                q,
                k_cache,
                v_cache,
                block_tables,
                seq_lens,
                scale,
                k_scale,
                v_scale,
                window=window,
                softcap=softcap,
                num_splits=num_splits,
            )
        from lora_server.kernels.paged_attention import paged_attention as kernel

        return kernel(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            max_query_len,
            k_scale,
            v_scale,
            window=window,
            softcap=softcap,
        )
    if decode and cpu is not None and cpu_decode.takes_attention(q, k_cache, k_scale):
        return cpu_decode.decode_attention(cpu, q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap)
    if decode:
        from lora_server.kernels.gathered_attention import gathered_decode_attention

        return gathered_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, window=window, softcap=softcap
        )
    return reference.paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        k_scale,
        v_scale,
        window=window,
        softcap=softcap,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cpu: CDLL | None = None) -> torch.Tensor:
    """[T, hidden] = weight * (x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype), HF's LlamaRMSNorm
    (kernels.rms_norm); a float32 weight with x of another dtype multiplies before the rounding (Gemma's norm).
    ``cpu``: kernels.cpu_decode's library, for float32 rows on the CPU."""
    if use_kernels(x.device):
        from lora_server.kernels.rms_norm import rms_norm as kernel

        return kernel(x, weight, eps)
    if cpu is not None and x.dim() == 2 and cpu_decode.takes_norm(x, x, weight):
        out = torch.empty_like(x)
        cpu_decode.add_rms_norm_(cpu, out, x, weight, eps, add=False)
        return out
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, cpu: CDLL | None = None
) -> None:
    """In place: residual += x, then x = rms_norm(residual, weight, eps) (kernels.rms_norm: one launch; ``cpu``:
    kernels.cpu_decode's library, for float32 rows on the CPU)."""
    if use_kernels(x.device):
        from lora_server.kernels.rms_norm import fused_add_rms_norm as kernel

        kernel(x, residual, weight, eps)
        return
    if cpu is not None and x.dim() == 2 and cpu_decode.takes_norm(x, residual, weight):
        cpu_decode.add_rms_norm_(cpu, x, residual, weight, eps, add=True)
    else:
        reference.fused_add_rms_norm(x, residual, weight, eps)


def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: every head of x [T, heads, D] normalized as rms_norm does, weight [D] (Qwen3's and Gemma 3's
    q_norm and k_norm; kernels.rms_norm)."""
    if use_kernels(x.device):
        from lora_server.kernels.rms_norm import rms_norm_heads_ as kernel

        kernel(x, weight, eps)
    else:
        reference.rms_norm_heads_(x, weight, eps)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, I] = F.gelu(x[:, :I], approximate="tanh") * x[:, I:] (Gemma's MLP; kernels.silu_and_mul)."""
    if use_kernels(x.device):
        from lora_server.kernels.silu_and_mul import silu_and_mul as kernel

        return kernel(x, gelu_tanh=True)
    return reference.gelu_tanh_and_mul(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, I] = F.silu(x[:, :I]) * x[:, I:] for the fused gate | up output x [T, 2 * I] (kernels.silu_and_mul)."""
    if use_kernels(x.device):
        from lora_server.kernels.silu_and_mul import silu_and_mul as kernel

        return kernel(x)
    return reference.silu_and_mul(x)


def _num_sms(device: torch.device) -> int:
    """The device's SM count, which split-K aims to fill (an H100's under the interpreter on the CPU)."""
    if device.type != "cuda":
        from lora_server.kernels.quant_tiles import H100_SMS

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
        from lora_server.kernels.quant_tiles import DEQUANT_MIN_TOKENS, choose_tiles

        if x.shape[0] >= DEQUANT_MIN_TOKENS:
            from lora_server.kernels.dequantize import dequantize_int8

            return F.linear(x, dequantize_int8(qweight, scales, x.dtype), bias)
        from lora_server.kernels.int8_matmul import int8_matmul as kernel

        n, k = qweight.shape
        tiles = choose_tiles(x.shape[0], n, k, num_sms=_num_sms(x.device), itemsize=x.dtype.itemsize)
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
        from lora_server.kernels.quant_tiles import DEQUANT_MIN_TOKENS, choose_tiles

        if x.shape[0] >= DEQUANT_MIN_TOKENS:
            from lora_server.kernels.dequantize import dequantize_int4

            return F.linear(x, dequantize_int4(packed, scales, mins, x.dtype, pack=pack), bias)
        from lora_server.kernels.int4_matmul import int4_matmul as kernel

        n, k = packed.shape[0], packed.shape[1] * 2
        block_k = k // scales.shape[1] if pack is None else pack
        tiles = choose_tiles(x.shape[0], n, k, num_sms=_num_sms(x.device), block_k=block_k, itemsize=x.dtype.itemsize)
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
        from lora_server.kernels.fp8_matmul import fp8_matmul as kernel
        from lora_server.kernels.fp8_matmul import scaled_mm_supported

        if scaled_mm_supported(x, qweight):
            y = kernel(x, qweight, scales)
            return y if bias is None else y + bias
    y = quant_reference.fp8_matmul(x, qweight, scales)
    return y if bias is None else y + bias
