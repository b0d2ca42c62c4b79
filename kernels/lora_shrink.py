"""LoRA shrink through the arena's adapter tables: y = x @ A^T for the tiles of a step's tile map, A read from the
pages of each tile's adapter (format in ``kernels.lora_table``). Torch twin: ``kernels.lora_reference.
paged_lora_shrink``.

Nothing is allocated or copied in the wrapper: the tile map, the arena and the workspace y are the caller's, so a
launch can be captured in a CUDA graph and replayed with new contents in the same buffers.

Performance (reasoning, untimed): the grid is (tile, slice, rank group * split). A program reads one 16-row group
of A once for up to ``block_t`` token rows, so an adapter's A is read once per tile, not once per token as a
per-token (BGMV) kernel reads it; for decode (one row per adapter) a tile degenerates to one row and the read is
the same as BGMV's. Decode grids are small (tens of tiles x a few slices x 1-4 groups on 132 SMs) while A's rows are
long (an 8B model's down_proj has 14336 in-features: 224 steps of 64), so the in-features are split over
``num_splits`` programs. Each split writes its own plane y[s] (no atomics: deterministic, and nothing has to be
zeroed before the launch, which would be one more graph node); the expand kernel adds the planes as it loads y,
which costs S x block_t x 16 float32 loads per program, small next to a B^T tile."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_server.kernels.checks import FLOAT_DTYPES, dot_tiles, expect, expect_lora_operands
from lora_server.kernels.lora_table import NUM_MODULES, ROW_GROUP, groups, row_len

MAX_SPLITS = 8


def choose_splits(
    num_tiles: int, num_slices: int, max_rank: int, in_features: int, num_sms: int, block_k: int = 64
) -> int:
    """The split count of a launch (untimed, from the shapes alone, so that a CUDA graph's launch stays fixed for
    its bucket): enough programs for two waves of the SMs, num_tiles x num_slices x rank groups x splits >= 2 x SMs,
    each split keeping at least 4 blocks of block_k in-features, at most MAX_SPLITS. Decode of an 8B model on an
    H100 (about 20 tiles): qkv 3 slices -> 4 splits, down_proj (14336 in) -> 8; a prefill of hundreds of tiles: 1."""
    programs = max(1, num_tiles * num_slices * groups(max_rank))
    wanted = -(-2 * num_sms // programs)
    return max(1, min(wanted, in_features // (4 * block_k), MAX_SPLITS))


@triton.jit(do_not_specialize=["row_base", "num_splits"])
def _lora_shrink_kernel(
    x_ptr,
    w_ptr,
    table_ptr,
    tiles_ptr,
    y_ptr,
    in_features,
    table_stride,
    row_base,
    row_len,
    max_rank,
    stride_xt,
    stride_xi,
    stride_ys,
    stride_yk,
    stride_yt,
    stride_yr,
    num_splits,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (tile, k, group * num_splits + split): y[split, k, tile's rows, 16 group .. 16 group + 15] = the
    tile's x rows @ A[those rank rows].T over in-feature blocks split, split + num_splits, ... (of BLOCK_K). Tiles
    with page -1, and groups at or past the module's rank, exit at once."""
    tile = tl.program_id(0)
    k = tl.program_id(1)
    group = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    page = tl.load(tiles_ptr + tile * 3)
    if page < 0:
        return
    row = page.to(tl.int64) * table_stride + row_base + k * row_len  # the (layer, module) row of the table
    rank = tl.minimum(tl.load(table_ptr + row), max_rank)
    r0 = group * BLOCK_R
    if r0 >= rank:
        return
    # int64 element index of A's rows r0 .. r0 + 15: a multiple of 8 (the tables' contract), which lets each row's
    # load be 16 bytes wide
    a_start = tl.multiple_of(tl.load(table_ptr + row + 1 + group), 8)

    first = tl.load(tiles_ptr + tile * 3 + 1)
    end = tl.load(tiles_ptr + tile * 3 + 2)
    rows = (first + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BLOCK_T]
    rr = tl.arange(0, BLOCK_R)  # [BLOCK_R], rank rows within the group
    row_mask = rows < end
    r_mask = r0 + rr < rank

    x_rows = x_ptr + rows[:, None] * stride_xt  # [BLOCK_T, 1]
    a_rows = w_ptr + a_start + rr[None, :].to(tl.int64) * in_features  # [1, BLOCK_R]; A's row stride is in
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for i0 in range(split * BLOCK_K, in_features, num_splits * BLOCK_K):
        cols = i0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        col_mask = cols < in_features
        x_tile = tl.load(
            x_rows + cols[None, :] * stride_xi, mask=row_mask[:, None] & col_mask[None, :], other=0.0
        )  # [BLOCK_T, BLOCK_K]
        a_tile = tl.load(
            a_rows + cols[:, None], mask=col_mask[:, None] & r_mask[None, :], other=0.0
        )  # [BLOCK_K, BLOCK_R] = A[group rows].T
        if DOT_IN_FP32:
            x_tile = x_tile.to(tl.float32)
            a_tile = a_tile.to(tl.float32)
        acc = tl.dot(x_tile, a_tile, acc, input_precision=PRECISION)

    # every split stores, those whose share of the in-features is empty too (zeros): y is not zeroed beforehand
    y_ptrs = (
        y_ptr + split * stride_ys + k * stride_yk + rows[:, None] * stride_yt + (r0 + rr)[None, :] * stride_yr
    )  # [BLOCK_T, BLOCK_R]
    tl.store(y_ptrs, acc, mask=row_mask[:, None] & r_mask[None, :])


def lora_shrink(
    x: torch.Tensor,
    arena_w: torch.Tensor,
    arena_table: torch.Tensor,
    tiles: torch.Tensor,
    y: torch.Tensor,
    *,
    layer: int,
    module_base: int,
    num_slices: int,
    table_stride: int,
    max_rank: int,
    num_splits: int = 1,
    block_t: int = 16,
    block_k: int = 64,
) -> None:
    """The LoRA A product of ``num_slices`` modules (module_base, module_base + 1, ... of lora_table.MODULES) of one
    layer, for every tile of the map, written into the caller's workspace y in one launch.

    x: [T, in]; arena_w: [E] in x's dtype and arena_table: [E'] int64, two flat views of the arena; tiles: [N, 3]
    int32 (table page, first row, end row), built by lora_table.tile_map with end - first <= block_t, page -1 =
    nothing to do, rows of different tiles disjoint; every offset the tables hold a multiple of 8 elements (the
    kernel loads 16 bytes at a time from there: adapters.page_layout's blocks start at 128 bytes within pages of a
    multiple of 16 values, and row groups are 16 rows); y: [S', K', T', R'] float32,
    S' >= num_splits, K' >= num_slices, T' >= T, R' >= 16 * lora_table.groups(max_rank). For every tile (p, a, b) with
    p >= 0, slice k, r = the rank that p's table gives (layer, module_base + k), and A [r, in] the rows its A
    offsets point at:

        y[:num_splits, k, a:b, :r].sum(0) == x[a:b].float() @ A.float().T

    (float32 accumulation), y[s, k, a:b, :r] holding the sum over in-feature blocks s, s + S, s + 2S, ... of
    block_k (S = num_splits; a split with no block holds zeros). Nothing else of y is written: columns r:, rows
    outside the tiles, planes s >= S and slices k >= num_slices keep what they held.

    Allocates nothing and copies nothing (CUDA-graph safe); block_t must bound every tile's length (not checked:
    that would read the map back)."""
    _, in_features = x.shape
    num_tiles = tiles.shape[0]
    num_groups = groups(max_rank)
    expect(x, "x", dtype=FLOAT_DTYPES)
    expect_lora_operands(
        x, arena_w, arena_table, tiles, y, num_slices=num_slices, num_splits=num_splits, max_rank=max_rank
    )
    assert module_base >= 0 and module_base + num_slices <= NUM_MODULES and layer >= 0, (layer, module_base)
    assert table_stride >= 1, table_stride
    dot_tiles(block_t=block_t, block_k=block_k)

    if num_tiles == 0:
        return
    # the interpreter (CPU tensors) multiplies bfloat16 bit patterns in tl.dot (triton issue #11584)
    dot_in_fp32 = x.device.type == "cpu" and x.dtype == torch.bfloat16
    row_length = row_len(max_rank)
    grid = (num_tiles, num_slices, num_groups * num_splits)
    _lora_shrink_kernel[grid](
        x,
        arena_w,
        arena_table,
        tiles,
        y,
        in_features,
        table_stride,
        (layer * NUM_MODULES + module_base) * row_length,
        row_length,
        max_rank,
        x.stride(0),
        x.stride(1),
        y.stride(0),
        y.stride(1),
        y.stride(2),
        y.stride(3),
        num_splits,
        BLOCK_T=block_t,
        BLOCK_K=block_k,
        BLOCK_R=ROW_GROUP,
        DOT_IN_FP32=dot_in_fp32,
        PRECISION="ieee" if dot_in_fp32 or x.dtype == torch.float32 else "tf32",
    )
