"""Launch configurations of the weight-only quantized matmuls (kernels/int8_matmul.py, kernels/int4_matmul.py) on a
GPU: tile sizes per batch bucket (M) from a table, split-K where the tile grid alone would leave SMs idle, the int4
pack width chosen at load, and the token count from which prefill goes through dequantization and cuBLAS instead.
Pure Python (no triton import): kernels.ops and the model's module swap read it on any machine.

Where the numbers come from. Nothing here was timed on a GPU (none was available while writing it); they follow
the configurations public Hopper-tuned code uses for the same regime (M small, K and N in the thousands, weights
dequantized in registers):
- decode buckets M <= 16 / 32 / 64: BLOCK_M equal to the bucket (16 is tl.dot's minimum), BLOCK_N 64, BLOCK_K 128,
  4 warps, 3-4 stages: the core of gemlite's split-K GEMM autotune space for batch 1-64 (BLOCK_M 16-64, BLOCK_N
  32-512, BLOCK_K 32-512, split-K 1-16, 4-8 warps, stages 2-5) and the shape of vLLM's triton_scaled_mm heuristic
  (64 x 64 x 256 up to M = 64);
- M <= 128: 64 x 128 x 128 (vLLM's triton_scaled_mm for M <= 128), and above that 128 x 128 x 64 with 8 warps
  (Triton's matmul tutorial's Hopper configurations);
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


# (largest M of the bucket, block_m, block_n, block_k, num_warps, num_stages), ascending; the last row has no bound
DECODE_TILES: tuple[tuple[int | None, int, int, int, int, int], ...] = (
    (16, 16, 64, 128, 4, 4),
    (32, 32, 64, 128, 4, 4),
    (64, 64, 64, 128, 4, 3),
    (128, 64, 128, 128, 4, 3),
    (None, 128, 128, 64, 8, 3),
)


def choose_tiles(m: int, n: int, k: int, *, num_sms: int = H100_SMS, block_k: int | None = None) -> Tiles:
    """The table's tiles for M's bucket; ``block_k`` overrides the table's (the int4 pack width). split_k is the
    smallest power of two with cdiv(M, block_m) * cdiv(N, block_n) * split_k >= num_sms, capped at MAX_SPLIT_K
    and at half the K blocks (each split runs at least two)."""
    _, block_m, block_n, table_k, warps, stages = next(row for row in DECODE_TILES if row[0] is None or m <= row[0])
    block_k = table_k if block_k is None else block_k
    tiles = math.ceil(m / block_m) * math.ceil(n / block_n)
    k_blocks = math.ceil(k / block_k)
    split_k = 1
    while tiles * split_k < num_sms and split_k * 2 <= MAX_SPLIT_K and k_blocks >= 2 * (split_k * 2):
        split_k *= 2
    return Tiles(block_m, block_n, block_k, split_k, warps, stages)


def int4_pack_width(k: int, group: int) -> int:
    """The GPU layout's int4 pack width for K input features in groups of ``group``: the widest of 128, 64, 32
    that divides K and is a multiple of the group (so that each half of a pack block is one contiguous run of
    activations and covers whole groups, or lies inside one); ``group`` itself (the Q4_1 layout) when none does."""
    for pack in (128, 64, 32):
        if k % pack == 0 and ((pack // 2) % group == 0 or group % pack == 0):
            return pack
    return group
