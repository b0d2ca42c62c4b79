"""LoRA expand through the arena's adapter tables: out += y @ B^T for the tiles of a step's tile map, B^T read from
the pages of each tile's adapter (format in ``kernels.lora_table``), y the split planes ``lora_shrink`` wrote; a
DoRA module's columns then scaled and shifted (its epilogue, read through the same table). Torch twin:
``kernels.lora_reference.paged_lora_expand``.

Nothing is allocated or copied in the wrapper (slice_starts is a device tensor, the grid's width bound a host
int), so a launch can be captured in a CUDA graph.

Performance (reasoning, untimed): the grid is (tile, slice, column block). A program reads the B^T columns of its
block once for up to ``block_t`` token rows (an adapter's B^T is read once per tile, not once per token) and reads
and writes its out block once, looping over the rank's 16-row groups (at most 4 at rank 64), summing the split
planes of y as it loads them. The out columns give the parallelism here (4096 / 64 = 64 blocks for q, 14336 / 64
for gate and up), so no split is needed; column blocks past a narrow slice's end (k, v in a fused qkv) exit at
once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_server.kernels.checks import FLOAT_DTYPES, dot_tiles, expect, expect_lora_operands
from lora_server.kernels.lora_table import NUM_MODULES, ROW_GROUP, dora_column, groups, row_len


@triton.jit(do_not_specialize=["row_base", "num_splits"])
def _lora_expand_kernel(
    y_ptr,
    w_ptr,
    table_ptr,
    tiles_ptr,
    slice_starts_ptr,
    out_ptr,
    table_stride,
    row_base,
    row_len,
    num_groups,
    dora_column,
    max_rank,
    num_splits,
    stride_ys,
    stride_yk,
    stride_yt,
    stride_yr,
    stride_ot,
    stride_on,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ALIGN: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (tile, k, n_block): out[tile's rows, slice k's columns n_block * BLOCK_N ...] += (sum over splits
    of y[:, k, rows, :rank]) @ B^T[:rank, those columns], over the rank's groups of BLOCK_R rows; for a DoRA module
    (its table row's scale offset >= 0) the sum is then times its scale plus its shift, per column. Tiles with page
    -1, column blocks past the slice's end and modules of rank 0 exit at once."""
    tile = tl.program_id(0)
    k = tl.program_id(1)
    n_block = tl.program_id(2)

    page = tl.load(tiles_ptr + tile * 3)
    if page < 0:
        return
    # B^T's offsets in the arena are multiples of 8 (the tables' contract), and with ALIGN 8 so are the slices'
    # starts and widths: rows of B^T and of out then load 16 bytes at a time
    col_begin = tl.multiple_of(tl.load(slice_starts_ptr + k), ALIGN)
    width = tl.multiple_of(tl.load(slice_starts_ptr + k + 1) - col_begin, ALIGN)  # also B^T's row stride
    n0 = n_block * BLOCK_N
    if n0 >= width:
        return
    row = page.to(tl.int64) * table_stride + row_base + k * row_len  # the (layer, module) row of the table
    rank = tl.minimum(tl.load(table_ptr + row), max_rank)
    if rank <= 0:
        return

    first = tl.load(tiles_ptr + tile * 3 + 1)
    end = tl.load(tiles_ptr + tile * 3 + 2)
    rows = (first + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BLOCK_T]
    cols = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N], columns within the slice
    rr = tl.arange(0, BLOCK_R)  # [BLOCK_R], rank rows within a group
    row_mask = rows < end
    col_mask = cols < width

    y_rows = y_ptr + k * stride_yk + rows[:, None] * stride_yt  # [BLOCK_T, 1]
    b_offsets = rr[:, None].to(tl.int64) * width + cols[None, :]  # [BLOCK_R, BLOCK_N] within a group
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for group in range(0, (rank + BLOCK_R - 1) // BLOCK_R):
        r_mask = group * BLOCK_R + rr < rank
        y_ptrs = y_rows + (group * BLOCK_R + rr)[None, :] * stride_yr  # [BLOCK_T, BLOCK_R]
        y_mask = row_mask[:, None] & r_mask[None, :]
        y_tile = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for split in range(0, num_splits):
            y_tile += tl.load(y_ptrs + split * stride_ys, mask=y_mask, other=0.0)
        # y is rounded to the weights' dtype, as the tensor cores take it (the twin does the same)
        y_tile = y_tile.to(w_ptr.dtype.element_ty)
        b_start = tl.multiple_of(tl.load(table_ptr + row + 1 + num_groups + group), 8)  # B^T's group rows
        b_tile = tl.load(
            w_ptr + b_start + b_offsets, mask=r_mask[:, None] & col_mask[None, :], other=0.0
        )  # [BLOCK_R, BLOCK_N]
        if DOT_IN_FP32:
            y_tile = y_tile.to(tl.float32)
            b_tile = b_tile.to(tl.float32)
        acc = tl.dot(y_tile, b_tile, acc, input_precision=PRECISION)

    out_ptrs = out_ptr + rows[:, None] * stride_ot + (col_begin + cols)[None, :] * stride_on
    out_mask = row_mask[:, None] & col_mask[None, :]
    value = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32) + acc
    scale_start = tl.load(table_ptr + row + dora_column)
    if scale_start >= 0:  # DoRA: out = (base + LoRA) * scale + shift, per column (scale and shift rows of [width])
        scale_start = tl.multiple_of(scale_start, 8)  # offsets are multiples of 8, as B^T's: 16-byte loads
        shift_start = tl.multiple_of(tl.load(table_ptr + row + dora_column + 1), 8)
        scale = tl.load(w_ptr + scale_start + cols, mask=col_mask, other=0.0).to(tl.float32)
        shift = tl.load(w_ptr + shift_start + cols, mask=col_mask, other=0.0).to(tl.float32)
        value = value * scale[None, :] + shift[None, :]
    tl.store(out_ptrs, value.to(out_ptr.dtype.element_ty), mask=out_mask)


def lora_expand(
    y: torch.Tensor,
    arena_w: torch.Tensor,
    arena_table: torch.Tensor,
    tiles: torch.Tensor,
    slice_starts: torch.Tensor,
    out: torch.Tensor,
    *,
    layer: int,
    module_base: int,
    max_width: int,
    table_stride: int,
    max_rank: int,
    num_splits: int = 1,
    block_t: int = 16,
    block_n: int = 64,
    align: int = 1,
) -> None:
    """Adds the LoRA B product of K = slice_starts.shape[0] - 1 modules (module_base ... module_base + K - 1 of
    lora_table.MODULES) of one layer into out, in place, for every tile of the map, in one launch.

    y: [S', K', T', R'] float32, lora_shrink's workspace after a launch with the same num_splits; arena_w,
    arena_table, tiles as in lora_shrink; out: [T, out_total] in arena_w's dtype; slice_starts: [K + 1] int32 on
    out's device, slice k owning out columns slice_starts[k]:slice_starts[k + 1] (module k's B^T has that width as
    its row stride), each a multiple of ``align`` (8: rows load 16 bytes at a time; 1: no claim); max_width: a host
    bound on the widest slice (the grid's column blocks; those past a slice's end exit). For every tile (p, a, b)
    with p >= 0, slice k = columns c0:c1, r = the rank that p's table gives (layer, module_base + k) and BT [r, c1 -
    c0] the rows its B^T offsets point at:

        out[a:b, c0:c1] = (out[a:b, c0:c1].float()
                           + y[:num_splits, k, a:b, :r].sum(0).to(out.dtype).float() @ BT.float()).to(out.dtype)

    (float32 accumulation; y[..., r:] is never read); for a DoRA module, whose table row gives its scale S and shift
    C [c1 - c0], the sum inside the outer .to(out.dtype) is then * S.float() + C.float(). Rows outside the tiles,
    and slices of rank 0, keep their exact bits. Allocates nothing and copies nothing (CUDA-graph safe)."""
    num_tiles = tiles.shape[0]
    num_slices = slice_starts.shape[0] - 1
    num_groups = groups(max_rank)
    expect(out, "out", dtype=FLOAT_DTYPES, ndim=2)
    expect(slice_starts, "slice_starts", dtype=torch.int32, ndim=1, device=out.device)
    expect_lora_operands(
        out, arena_w, arena_table, tiles, y, num_slices=num_slices, num_splits=num_splits, max_rank=max_rank
    )
    assert module_base >= 0 and module_base + num_slices <= NUM_MODULES and layer >= 0, (layer, module_base)
    assert table_stride >= 1 and max_width >= 0, (table_stride, max_width)
    dot_tiles(block_t=block_t, block_n=block_n)

    if num_tiles == 0 or max_width == 0:
        return
    # the interpreter (CPU tensors) multiplies bfloat16 bit patterns in tl.dot (triton issue #11584)
    dot_in_fp32 = out.device.type == "cpu" and out.dtype == torch.bfloat16
    row_length = row_len(max_rank)
    grid = (num_tiles, num_slices, triton.cdiv(max_width, block_n))
    _lora_expand_kernel[grid](
        y,
        arena_w,
        arena_table,
        tiles,
        slice_starts,
        out,
        table_stride,
        (layer * NUM_MODULES + module_base) * row_length,
        row_length,
        num_groups,
        dora_column(max_rank),
        max_rank,
        num_splits,
        y.stride(0),
        y.stride(1),
        y.stride(2),
        y.stride(3),
        out.stride(0),
        out.stride(1),
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_R=ROW_GROUP,
        ALIGN=align,
        DOT_IN_FP32=dot_in_fp32,
        PRECISION="ieee" if dot_in_fp32 or out.dtype == torch.float32 else "tf32",
    )
