"""int4 weight-only matmul: y = x @ dequant(W).T with W stored as packed 4-bit codes with fp16 group scales and
mins, unpacked and dequantized in registers inside the K loop. Torch twin: ``kernels.quant_reference.int4_matmul``.

Format (``lora_server.model.quant``): packed uint8 [N, K // 2], scales and mins fp16 [N, K // group];
w[n, k] = scales[n, k // group] * q[n, k] + mins[n, k // group] with q in 0..15. The nibbles pair up within pack
blocks of ``pack`` columns: byte j of a block holds q[j] in its low nibble and q[j + pack/2] in its high nibble.
pack == group is GGUF's Q4_1 layout; on the GPU the model repacks its weights at load to a wider pack
(kernels.quant_tiles.int4_pack_width, 128 where K allows), so that each K step of the kernel is one pack block
whose two halves are two contiguous runs of activations: x[:, k0 : k0 + pack/2] meets the low nibbles,
x[:, k0 + pack/2 : k0 + pack] the high ones, and both loads coalesce."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_server.kernels.checks import FLOAT_DTYPES, dot_tiles, expect, expect_int4_weight
from lora_server.kernels.int8_matmul import dot_in_fp32, split_k_output


@triton.jit
def _dequant_nibbles(codes, s, mn, GROUPS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """codes [ROWS, BLOCK_N] (0..15, ROWS columns of GROUPS whole groups, or inside one group) * s + mn, s and mn
    [GROUPS, BLOCK_N] fp32 broadcast over each group's rows."""
    if GROUPS == 1:
        return codes.to(tl.float32) * s + mn
    w = tl.reshape(codes.to(tl.float32), (GROUPS, ROWS // GROUPS, BLOCK_N))
    return tl.reshape(w * s[:, None, :] + mn[:, None, :], (ROWS, BLOCK_N))


@triton.jit(do_not_specialize=["M"])
def _int4_matmul_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    mins_ptr,
    y_ptr,
    M,
    N,
    K,
    group,
    num_groups,
    stride_xm,
    stride_xk,
    stride_pn,
    stride_pk,
    stride_sn,
    stride_sg,
    stride_mn,
    stride_mg,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PACK: tl.constexpr,
    GROUPS_PER_HALF: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (m_block, n_block, split): y[rows, cols] summed over the pack blocks split, split + SPLIT_K, ...
    Pack block b is PACK // 2 bytes of each weight row: its low nibbles are columns b * PACK + [0, PACK/2), its
    high nibbles b * PACK + [PACK/2, PACK), so each block is two dots, each with one contiguous slice of x. A half
    covers GROUPS_PER_HALF whole groups or lies inside one group (the wrapper checks)."""
    HALF: tl.constexpr = PACK // 2
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)

    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BLOCK_M]
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BLOCK_N] output features n
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows[:, None] * stride_xm  # [BLOCK_M, 1]
    p_cols = packed_ptr + cols[None, :] * stride_pn  # [1, BLOCK_N]
    s_cols = scales_ptr + cols[None, :] * stride_sn
    m_cols = mins_ptr + cols[None, :] * stride_mn
    halves = tl.arange(0, HALF)  # [HALF]
    x_mask = row_mask[:, None]
    c_mask = col_mask[None, :]
    g_offs = tl.arange(0, GROUPS_PER_HALF)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(split, K // PACK, SPLIT_K):
        k0 = b * PACK
        x_lo = tl.load(x_rows + (k0 + halves)[None, :] * stride_xk, mask=x_mask, other=0.0)  # [BLOCK_M, HALF]
        x_hi = tl.load(x_rows + (k0 + HALF + halves)[None, :] * stride_xk, mask=x_mask, other=0.0)
        codes = tl.load(p_cols + (b * HALF + halves)[:, None] * stride_pk, mask=c_mask, other=0)  # [HALF, BLOCK_N]
        g_lo = k0 // group + g_offs  # [GROUPS_PER_HALF] the low half's groups, then the high half's
        g_hi = (k0 + HALF) // group + g_offs
        s_lo = tl.load(s_cols + g_lo[:, None] * stride_sg, mask=c_mask, other=0.0).to(tl.float32)
        m_lo = tl.load(m_cols + g_lo[:, None] * stride_mg, mask=c_mask, other=0.0).to(tl.float32)
        s_hi = tl.load(s_cols + g_hi[:, None] * stride_sg, mask=c_mask, other=0.0).to(tl.float32)
        m_hi = tl.load(m_cols + g_hi[:, None] * stride_mg, mask=c_mask, other=0.0).to(tl.float32)
        w_lo = _dequant_nibbles(codes & 0xF, s_lo, m_lo, GROUPS_PER_HALF, HALF, BLOCK_N)  # [HALF, BLOCK_N]
        w_hi = _dequant_nibbles(codes >> 4, s_hi, m_hi, GROUPS_PER_HALF, HALF, BLOCK_N)
        if DOT_IN_FP32:
            x_lo = x_lo.to(tl.float32)
            x_hi = x_hi.to(tl.float32)
        else:
            w_lo = w_lo.to(x_lo.dtype)
            w_hi = w_hi.to(x_hi.dtype)
        acc = tl.dot(x_lo, w_lo, acc, input_precision=PRECISION)
        acc = tl.dot(x_hi, w_hi, acc, input_precision=PRECISION)

    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    y_mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=y_mask)


def check_pack(k: int, group: int, pack: int) -> int:
    """Asserts that int4 weights of K columns in groups of ``group`` can pair their nibbles within blocks of
    ``pack`` columns for the kernels (pack even, >= 32 for tl.dot's K >= 16 per half, dividing K; each half of a
    block whole groups, or the block inside one group); returns the groups per half-block."""
    half = pack // 2
    assert pack >= 32 and pack & (pack - 1) == 0, f"int4 pack {pack}: a power of two >= 32"
    assert k % pack == 0, f"int4 pack {pack} does not divide K = {k}"
    assert half % group == 0 or group % pack == 0, f"int4 pack {pack} and group {group} do not line up"
    return max(1, half // group)


def int4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    *,
    pack: int | None = None,
    block_m: int = 16,
    block_n: int = 64,
    split_k: int = 1,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """y = x @ dequant(W).T for int4 weights, in one launch.

    x: [M, K] fp32, fp16 or bf16, any strides; packed: uint8 [N, K // 2], nibbles paired within blocks of ``pack``
    columns (None: the group, GGUF's Q4_1 layout); scales, mins: fp16 (or any float) [N, K // group]. Returns y
    [M, N] in x's dtype:

        q = torch.cat([p & 15, p >> 4], -1).flatten(1)  with p = packed.unflatten(1, (K // pack, pack // 2))
        y = (x.float() @ (q.float() * scales.float().repeat_interleave(group, 1)
                          + mins.float().repeat_interleave(group, 1)).T).to(x.dtype)

    with fp32 accumulation; for fp16/bf16 x the dequantized weight tile is rounded to x's dtype before the dot
    (as the module's dequantize(x.dtype) does). Each K step is one pack block (check_pack states which packs
    work). split_k > 1 splits the pack blocks over that many programs that add into an fp32 buffer atomically (not
    bit-reproducible; one more pass to cast). block_m and block_n: powers of two >= 16; num_stages: the software
    pipeline's depth (compiled GPU code only)."""
    num_rows, k = x.shape
    n, packed_k, group = expect_int4_weight(packed, scales, mins, device=x.device)
    assert packed_k == k, f"packed holds {packed_k} in-features, x has {k}"
    expect(x, "x", dtype=FLOAT_DTYPES)
    num_groups = scales.shape[1]
    pack = group if pack is None else pack
    groups_per_half = check_pack(k, group, pack)
    dot_tiles(block_m=block_m, block_n=block_n)
    assert split_k >= 1

    y = split_k_output(x, n, split_k)
    if num_rows == 0 or n == 0:
        return y.to(x.dtype)
    in_fp32 = dot_in_fp32(x)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(n, block_n), split_k)
    _int4_matmul_kernel[grid](
        x,
        packed,
        scales,
        mins,
        y,
        num_rows,
        n,
        k,
        group,
        num_groups,
        x.stride(0),
        x.stride(1),
        packed.stride(0),
        packed.stride(1),
        scales.stride(0),
        scales.stride(1),
        mins.stride(0),
        mins.stride(1),
        y.stride(0),
        y.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PACK=pack,
        GROUPS_PER_HALF=groups_per_half,
        SPLIT_K=split_k,
        DOT_IN_FP32=in_fp32,
        PRECISION="ieee" if in_fp32 or x.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y.to(x.dtype)
