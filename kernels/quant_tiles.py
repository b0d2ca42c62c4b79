"""Launch configurations of the weight-only quantized matmuls (kernels/int8_matmul.py, kernels/int4_matmul.py) on a
GPU: tile sizes per batch bucket (M) from a table, split-K where the tile grid alone would leave SMs idle, the int4
pack width chosen at load, and the token count from which prefill goes through dequantization and cuBLAS instead.
Pure Python (no triton import): kernels.ops and the model's module swap read it on any machine.

Where the numbers come from. Nothing here was timed on a GPU (none was available while writing it); they started
from the configurations public Hopper-tuned code uses for the same regime (M small, K and N in the thousands, weights
dequantized in registers), then were changed where compiling them for sm_90a and sm_80 showed register spills
(tests/engine/test_warmup.py compiles every variant the engine reaches; see DECODE_TILES and FP32_TILES):
- decode buckets M <= 16 / 32 / 64: BLOCK_M equal to the bucket (16 is tl.dot's minimum), BLOCK_N 64, BLOCK_K 128,
  4 warps, 3-4 stages: the core of gemlite's split-K GEMM autotune space for batch 1-64 (BLOCK_M 16-64, BLOCK_N
  32-512, BLOCK_K 32-512, split-K 1-16, 4-8 warps, stages 2-5) and the shape of vLLM's triton_scaled_mm heuristic
  (64 x 64 x 256 up to M = 64);
- M <= 128: 64 x 128 x 128 (vLLM's triton_scaled_mm for M <= 128) with 8 warps, and above that 64 x 128 x 64 with 8
  warps (Triton's matmul tutorial's Hopper configuration, 128 x 128 x 64, halved in rows);
- split-K: the smallest power of two that gives at least one program per SM (132 on an H100 SXM), at most 16, and
  at least two K blocks per split: the TK-GEMM / gemlite approach for decode, where M x N alone is a few dozen tiles;
- prefill: from 256 tokens the weight is dequantized by one kernel (kernels/dequantize.py) and multiplied by
  cuBLAS (F.linear), vLLM's AWQ threshold (``num_tokens >= 256``), where a tensor-core GEMM at full tile sizes
  outruns dequantizing in registers per tile.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

DEQUANT_MIN_TOKENS = 256
H100_SMS = 132
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class Tiles:
    """One launch configuration: the kernel wrappers' keyword arguments (block_k is the int4 kernel's pack width,
    fixed by the weight's layout, and is not passed to it)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int

    def kwargs(self, *, with_block_k: bool = True) -> dict[str, int]:
        d = asdict(self)
        if not with_block_k:
            del d["block_k"]
        return d


# (largest M of the bucket, block_m, block_n, block_k, num_warps, num_stages), ascending; the last row has no bound.
# 16-bit activations. Compiled for sm_90a and sm_80 (tests/engine/test_warmup.py), none of these spills: the
# configurations first taken from public code (64 x 128 with 4 warps for M <= 128, 128 x 128 x 64 beyond, 4 stages
# for M <= 32) spilled (int8 64 x 128 x 128: 255 registers, 272 bytes spilled on sm_80; int4 128 x 128: 144 bytes on
# sm_80; int4 32 x 64 with 4 stages: 12 bytes on sm_90a; int4 128 x 64 in 128-column packs: 52 bytes on sm_80), so
# M <= 128 takes 8 warps, M > 128 a 64 x 128 x 64 tile with 8 warps, and M <= 32 three stages.
DECODE_TILES: tuple[tuple[int | None, int, int, int, int, int], ...] = (
    (16, 16, 64, 128, 4, 4),
    (32, 32, 64, 128, 4, 3),
    (64, 64, 64, 128, 4, 3),
    (128, 64, 128, 128, 8, 3),
    (None, 64, 128, 64, 8, 3),
)
# fp32 activations (the GPU test tier's dtype): tl.dot in IEEE fp32 runs on the FMA units and holds the whole tile
# in registers; the 16-bit tiles spill 9-35 KB per thread there, these none (32 x 32 x 32: 188 registers)
FP32_TILES: tuple[tuple[int | None, int, int, int, int, int], ...] = (
    (16, 16, 32, 32, 4, 3),
    (None, 32, 32, 32, 4, 3),
)


def choose_tiles(
    m: int, n: int, k: int, *, num_sms: int = H100_SMS, block_k: int | None = None, itemsize: int = 2
) -> Tiles:
    """The table's tiles for M's bucket (FP32_TILES for 4-byte activations); ``block_k`` overrides the table's
    (the int4 pack width). split_k is the smallest power of two with cdiv(M, block_m) * cdiv(N, block_n) *
    split_k >= num_sms, capped at MAX_SPLIT_K and at half the K blocks (each split runs at least two)."""
    table = FP32_TILES if itemsize >= 4 else DECODE_TILES
    _, block_m, block_n, table_k, warps, stages = next(row for row in table if row[0] is None or m <= row[0])
    block_k = table_k if block_k is None else block_k
    tiles = math.ceil(m / block_m) * math.ceil(n / block_n)
    k_blocks = math.ceil(k / block_k)
    split_k = 1
    while tiles * split_k < num_sms and split_k * 2 <= MAX_SPLIT_K and k_blocks >= 2 * (split_k * 2):
        split_k *= 2
    return Tiles(block_m, block_n, block_k, split_k, warps, stages)


def int4_pack_width(k: int, group: int, itemsize: int = 2) -> int:
    """The GPU layout's int4 pack width for K input features in groups of ``group``: the widest of 128, 64, 32
    that divides K and is a multiple of the group (so that each half of a pack block is one contiguous run of
    activations and covers whole groups, or lies inside one); ``group`` itself (the Q4_1 layout) when none does.
    For 4-byte activations at most 32: a K step of 64 fp32 values per half spills even 16 x 32 tiles."""
    for pack in (128, 64, 32) if itemsize < 4 else (32,):
        if k % pack == 0 and ((pack // 2) % group == 0 or group % pack == 0):
            return pack
    return group
