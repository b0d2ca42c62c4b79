"""int4 weight-only matmul: y = x @ dequant(W).T with W stored as packed 4-bit codes with fp16 group scales and
mins, unpacked and dequantized in registers inside the K loop. Torch twin: ``kernels.quant_reference.int4_matmul``.

Format (``lora_server.model.quant``, the GGUF Q4_1 block layout): packed uint8 [N, K // 2], scales and mins fp16
[N, K // group]; w[n, k] = scales[n, k // group] * q[n, k] + mins[n, k // group] with q in 0..15, where within each
group of g values byte j holds q[j] in its low nibble and q[j + g/2] in its high nibble."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.int8_matmul import dot_in_fp32, groups_per_tile, split_k_output


@triton.jit
def _dequant_nibbles(codes, s, mn, GROUPS_PER_TILE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """codes [ROWS, BLOCK_N] (0..15, ROWS bytes of GROUPS_PER_TILE groups) * s + mn, s and mn
    [GROUPS_PER_TILE, BLOCK_N] fp32 broadcast over each group's rows."""
    if GROUPS_PER_TILE == 1:
        return codes.to(tl.float32) * s + mn
    w = tl.reshape(codes.to(tl.float32), (GROUPS_PER_TILE, ROWS // GROUPS_PER_TILE, BLOCK_N))
    return tl.reshape(w * s[:, None, :] + mn[:, None, :], (ROWS, BLOCK_N))


@triton.jit
def _int4_matmul_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    mins_ptr,
    y_ptr,
    M,
    N,
    K,
    half_group,
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
    BLOCK_K: tl.constexpr,
    GROUPS_PER_TILE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (m_block, n_block, split): y[rows, cols] summed over the K blocks split, split + SPLIT_K, ...; a K
    block is BLOCK_K // 2 packed bytes per weight row. Byte p of a row (group p // half_group, j = p % half_group)
    holds the codes of columns g * group + j (low nibble) and that + half_group (high nibble), so each block is two
    dots: x's low-nibble columns with the low codes, x's high-nibble columns with the high codes. A block lies
    inside one group or covers GROUPS_PER_TILE whole groups (the wrapper checks)."""
    BLOCK_P: tl.constexpr = BLOCK_K // 2
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
    num_bytes = K // 2

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for p0 in range(split * BLOCK_P, num_bytes, SPLIT_K * BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)  # [BLOCK_P] byte columns
        p_mask = ps < num_bytes
        k_lo = (ps // half_group) * (2 * half_group) + ps % half_group  # [BLOCK_P] x columns of the low nibbles
        x_mask = row_mask[:, None] & p_mask[None, :]
        x_lo = tl.load(x_rows + k_lo[None, :] * stride_xk, mask=x_mask, other=0.0)  # [BLOCK_M, BLOCK_P]
        x_hi = tl.load(x_rows + (k_lo + half_group)[None, :] * stride_xk, mask=x_mask, other=0.0)
        codes = tl.load(
            p_cols + ps[:, None] * stride_pk, mask=p_mask[:, None] & col_mask[None, :], other=0
        )  # [BLOCK_P, BLOCK_N] uint8
        groups = p0 // half_group + tl.arange(0, GROUPS_PER_TILE)  # [GROUPS_PER_TILE]
        g_mask = (groups < num_groups)[:, None] & col_mask[None, :]
        s = tl.load(s_cols + groups[:, None] * stride_sg, mask=g_mask, other=0.0).to(tl.float32)
        mn = tl.load(m_cols + groups[:, None] * stride_mg, mask=g_mask, other=0.0).to(tl.float32)
        w_lo = _dequant_nibbles(codes & 0xF, s, mn, GROUPS_PER_TILE, BLOCK_P, BLOCK_N)  # [BLOCK_P, BLOCK_N]
        w_hi = _dequant_nibbles(codes >> 4, s, mn, GROUPS_PER_TILE, BLOCK_P, BLOCK_N)
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


def int4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    *,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = 128,
    split_k: int = 1,
    num_warps: int = 4,
) -> torch.Tensor:
    """y = x @ dequant(W).T for int4 weights, in one launch.

    x: [M, K] fp32, fp16 or bf16, any strides; packed: uint8 [N, K // 2]; scales, mins: fp16 (or any float)
    [N, K // group], group even. Returns y [M, N] in x's dtype:

        q = torch.cat([p & 15, p >> 4], -1).flatten(1)  with p = packed.unflatten(1, (K // group, group // 2))
        y = (x.float() @ (q.float() * scales.float().repeat_interleave(group, 1)
                          + mins.float().repeat_interleave(group, 1)).T).to(x.dtype)

    with fp32 accumulation; for fp16/bf16 x the dequantized weight tile is rounded to x's dtype before the dot
    (as the module's dequantize(x.dtype) does). split_k > 1 splits K over that many programs that add into an fp32
    buffer atomically (not bit-reproducible; one more pass to cast). Block sizes are powers of two, block_m and
    block_n >= 16, block_k >= 32 (each dot takes block_k // 2 columns), and block_k and group must line up (one
    group per row, or one of group and block_k divides the other)."""
    num_rows, k = x.shape
    n, num_bytes = packed.shape
    assert num_bytes * 2 == k, f"packed holds {num_bytes * 2} in-features, x has {k}"
    assert packed.dtype == torch.uint8, packed.dtype
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype
    assert scales.shape == mins.shape, f"scales {tuple(scales.shape)} != mins {tuple(mins.shape)}"
    assert scales.dim() == 2 and scales.shape[0] == n and scales.shape[1] >= 1 and k % scales.shape[1] == 0, (
        f"scales {tuple(scales.shape)} do not group packed {tuple(packed.shape)}"
    )
    assert scales.is_floating_point() and mins.is_floating_point(), (scales.dtype, mins.dtype)
    for t in (packed, scales, mins):
        assert t.device == x.device, (t.device, x.device)
    num_groups = scales.shape[1]
    group = k // num_groups
    assert group % 2 == 0, f"int4 group {group} must be even"
    assert all(b >= 16 and b & (b - 1) == 0 for b in (block_m, block_n)), "tl.dot needs powers of two >= 16"
    assert block_k >= 32 and block_k & (block_k - 1) == 0, "block_k: a power of two >= 32"
    assert split_k >= 1
    gpt = groups_per_tile(k, group, block_k)

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
        group // 2,
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
        BLOCK_K=block_k,
        GROUPS_PER_TILE=gpt,
        SPLIT_K=split_k,
        DOT_IN_FP32=in_fp32,
        PRECISION="ieee" if in_fp32 or x.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )
    return y.to(x.dtype)
