"""The argument checks that the kernel wrappers share. Each is an assert (AssertionError, as every wrapper's own
checks are) whose message names the argument and says what it got and what was expected; checks that only one
wrapper makes stay in that wrapper.

- ``expect``: one tensor's dtype, shape or rank, contiguity and device;
- ``dot_tiles``: block sizes that tl.dot can take;
- ``expect_kv_cache``: a paged KV cache pair and its fp8 scales (the attention and KV-write wrappers);
- ``expect_int8_weight``, ``expect_int4_weight``: the quantized weight formats (the matmuls, the dequantizers);
- ``expect_lora_operands``: the arena views, tile map and workspace of lora_shrink and lora_expand.

Imports torch and no triton (kernels.ops imports the kernel modules on first use)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from lora_server.kernels.lora_table import ROW_GROUP, groups
from lora_server.kernels.reference import FP8_KV_DTYPE

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the kernels compute in
INDEX_DTYPES = (torch.int32, torch.int64)  # slot mappings, sequence lengths, query offsets


def _shape(shape: Sequence[int | None]) -> str:
    sizes = ["*" if s is None else str(s) for s in shape]
    return f"({sizes[0]},)" if len(sizes) == 1 else f"({', '.join(sizes)})"


def expect(
    t: torch.Tensor,
    name: str,
    *,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    floating: bool = False,
    shape: Sequence[int | None] | None = None,
    ndim: int | None = None,
    contiguous: bool | Literal["rows"] = False,
    device: torch.device | None = None,
) -> None:
    """Asserts what a wrapper needs of its tensor argument ``name``: dtype (one dtype, or any of a tuple),
    floating (any floating-point dtype), shape (its rank and sizes; None: any size there), ndim (the rank alone),
    contiguous (True: the whole tensor; "rows": stride 1 along the last dimension, any other strides) and device.
    Unset: not checked."""
    if dtype is not None:
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        assert t.dtype in dtypes, f"{name} is {t.dtype}, expected {' or '.join(map(str, dtypes))}"
    assert not floating or t.is_floating_point(), f"{name} is {t.dtype}, expected a floating-point dtype"
    if shape is not None:
        assert t.dim() == len(shape) and all(s is None or s == n for s, n in zip(shape, t.shape, strict=False)), (
            f"{name} has shape {tuple(t.shape)}, expected {_shape(shape)}"
        )
    assert ndim is None or t.dim() == ndim, f"{name} has shape {tuple(t.shape)}, expected {ndim} dimensions"
    if contiguous == "rows":
        assert t.stride(-1) == 1, f"{name}'s rows must be contiguous, got strides {t.stride()}"
    elif contiguous:
        assert t.is_contiguous(), f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}"
    assert device is None or t.device == device, f"{name} is on {t.device}, expected {device}"


def dot_tiles(**sizes: int) -> None:
    """Asserts that each block size (named by its keyword) can be a side of a tl.dot tile: a power of two >= 16."""
    for name, size in sizes.items():
        assert size >= 16 and size & (size - 1) == 0, f"tl.dot needs powers of two >= 16, got {name} = {size}"


def expect_kv_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    *,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> bool:
    """Asserts a paged KV cache pair: k_cache and v_cache [num_blocks, block_size, KVH, D] of one shape and one
    dtype, on ``device``; the dtype ``dtype`` (None: any) or float8_e4m3fn; for an fp8 cache k_scale and v_scale
    [KVH] float32 on ``device``, contiguous (the kernels read them with stride 1), else both None. Returns whether
    the cache is fp8. The caller checks the cache's heads and head_dim against its own operands."""
    assert v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}"
    assert v_cache.dtype == k_cache.dtype, f"v_cache is {v_cache.dtype}, k_cache {k_cache.dtype}"
    expect(k_cache, "k_cache", device=device)
    expect(v_cache, "v_cache", device=device)
    if k_cache.dtype != FP8_KV_DTYPE:
        assert dtype is None or k_cache.dtype == dtype, f"the cache is {k_cache.dtype}, expected {dtype} or fp8"
        assert k_scale is None and v_scale is None, f"scales are for fp8 caches, not {k_cache.dtype}"
        return False
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        assert scale is not None, "an fp8 cache needs k_scale and v_scale"
        expect(scale, name, dtype=torch.float32, shape=(k_cache.shape[2],), contiguous=True, device=device)
    return True


def expect_int8_weight(qweight: torch.Tensor, scales: torch.Tensor, *, device: torch.device) -> tuple[int, int, int]:
    """Asserts an int8 weight (format: kernels/int8_matmul.py) on ``device``: qweight int8 [N, K], scales any float
    [N, K // group]. Returns (N, K, group)."""
    n, k = qweight.shape
    expect(qweight, "qweight", dtype=torch.int8, device=device)
    return n, k, _group(scales, n, k, device)


def expect_int4_weight(
    packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, *, device: torch.device
) -> tuple[int, int, int]:
    """Asserts an int4 weight (format: kernels/int4_matmul.py) on ``device``: packed uint8 [N, K // 2], scales and
    mins any float [N, K // group]. Returns (N, K, group); the pack width is the caller's (int4_matmul.check_pack)."""
    n, num_bytes = packed.shape
    expect(packed, "packed", dtype=torch.uint8, device=device)
    group = _group(scales, n, num_bytes * 2, device)
    expect(mins, "mins", floating=True, shape=scales.shape, device=device)
    return n, num_bytes * 2, group


def _group(scales: torch.Tensor, n: int, k: int, device: torch.device) -> int:
    """The group size of group scales [N, K // group] for a weight of N rows and K columns, asserted."""
    assert scales.dim() == 2 and scales.shape[0] == n and scales.shape[1] >= 1 and k % scales.shape[1] == 0, (
        f"scales {tuple(scales.shape)} do not group a weight of {n} rows and {k} columns: expected [N, K // group]"
    )
    expect(scales, "scales", floating=True, device=device)
    return k // scales.shape[1]


def expect_lora_operands(
    rows: torch.Tensor,
    arena_w: torch.Tensor,
    arena_table: torch.Tensor,
    tiles: torch.Tensor,
    y: torch.Tensor,
    *,
    num_slices: int,
    num_splits: int,
    max_rank: int,
) -> None:
    """Asserts the operands that lora_shrink and lora_expand share (formats in kernels.lora_table), against
    ``rows``, their [T, *] activations (the shrink's x, the expand's out; the caller checks their dtype): arena_w
    [E] in rows' dtype and arena_table [E'] int64, flat contiguous views; tiles [N, 3] int32, contiguous; the
    workspace y [S', K', T', R'] float32 with S' >= num_splits, K' >= num_slices, T' >= T and
    R' >= 16 * lora_table.groups(max_rank); all on rows' device; num_slices, num_splits and max_rank >= 1."""
    device = rows.device
    expect(arena_w, "arena_w", dtype=rows.dtype, ndim=1, contiguous=True, device=device)
    expect(arena_table, "arena_table", dtype=torch.int64, ndim=1, contiguous=True, device=device)
    expect(tiles, "tiles", dtype=torch.int32, shape=(None, 3), contiguous=True, device=device)
    expect(y, "y", dtype=torch.float32, ndim=4, device=device)
    assert num_slices >= 1 and num_splits >= 1 and max_rank >= 1, (num_slices, num_splits, max_rank)
    assert y.shape[0] >= num_splits and y.shape[1] >= num_slices, (tuple(y.shape), num_splits, num_slices)
    assert y.shape[2] >= rows.shape[0] and y.shape[3] >= groups(max_rank) * ROW_GROUP, (
        tuple(y.shape),
        rows.shape[0],
        max_rank,
    )
