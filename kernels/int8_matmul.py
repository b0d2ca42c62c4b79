"""int8 weight-only matmul: y = x @ dequant(W).T with W stored as int8 codes and fp16 group scales, dequantized in
registers inside the K loop; per-channel weights (one scale per row) are multiplied as codes (exact in any float
dtype) and their scales applied once to the fp32 accumulator. Torch twin: ``kernels.quant_reference.int8_matmul``.

Format (``lora_server.model.quant``): qweight int8 [N, K], scales fp16 [N, K // group],
w[n, k] = scales[n, k // group] * qweight[n, k]; per-channel is group == K, GGUF Q8_0 is group 32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_server.kernels.checks import FLOAT_DTYPES, dot_tiles, expect, expect_int8_weight


@triton.jit(do_not_specialize=["M"])
def _int8_matmul_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    y_ptr,
    M,
    N,
    K,
    group,
    num_groups,
    stride_xm,
    stride_xk,
    stride_qn,
    stride_qk,
    stride_sn,
    stride_sg,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUPS_PER_TILE: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (m_block, n_block, split): y[rows, cols] summed over the K blocks split, split + SPLIT_K, ... A K
    block lies inside one group or covers GROUPS_PER_TILE whole groups (the wrapper checks), so its scales are a
    [GROUPS_PER_TILE, BLOCK_N] tile broadcast over each group's columns. PER_CHANNEL (one group): the loop
    multiplies the codes and the row scales multiply the accumulator once at the end (each split's share alike)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)

    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BLOCK_M]
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BLOCK_N] output features n
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows[:, None] * stride_xm  # [BLOCK_M, 1]
    q_cols = qweight_ptr + cols[None, :] * stride_qn  # [1, BLOCK_N]
    s_cols = scales_ptr + cols[None, :] * stride_sn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(split * BLOCK_K, K, SPLIT_K * BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_mask = ks < K
        x = tl.load(x_rows + ks[None, :] * stride_xk, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        q = tl.load(q_cols + ks[:, None] * stride_qk, mask=k_mask[:, None] & col_mask[None, :], other=0)
        if PER_CHANNEL:
            w = q.to(tl.float32)  # [BLOCK_K, BLOCK_N] codes, exact in any float dtype
        else:
            groups = k0 // group + tl.arange(0, GROUPS_PER_TILE)  # [GROUPS_PER_TILE]
            s = tl.load(
                s_cols + groups[:, None] * stride_sg,
                mask=(groups < num_groups)[:, None] & col_mask[None, :],
                other=0.0,
            ).to(tl.float32)  # [GROUPS_PER_TILE, BLOCK_N]
            if GROUPS_PER_TILE == 1:
                w = q.to(tl.float32) * s  # [BLOCK_K, BLOCK_N] = dequant(W)[cols, ks].T
            else:
                w = tl.reshape(q.to(tl.float32), (GROUPS_PER_TILE, BLOCK_K // GROUPS_PER_TILE, BLOCK_N))
                w = tl.reshape(w * s[:, None, :], (BLOCK_K, BLOCK_N))
        if DOT_IN_FP32:
            x = x.to(tl.float32)
        else:
            w = w.to(x.dtype)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if PER_CHANNEL:
        acc = acc * tl.load(s_cols, mask=col_mask[None, :], other=0.0).to(tl.float32)  # [1, BLOCK_N] row scales

    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    y_mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=y_mask)


def groups_per_tile(k: int, group: int, block_k: int) -> int:
    """How many weight groups one K block of block_k columns covers (1 when it lies inside one group); asserts
    that blocks and groups line up: one group (per-channel), or one of group and block_k divides the other."""
    if group == k or group % block_k == 0:
        return 1
    assert block_k % group == 0, f"block_k {block_k} and group {group}: one must divide the other"
    return block_k // group


def split_k_output(x: torch.Tensor, n: int, split_k: int) -> torch.Tensor:
    """The kernels' output buffer [M, N]: x's dtype, or with split_k > 1 zeroed fp32 that the programs add into
    (the caller casts it back)."""
    if split_k == 1:
        return torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    return torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)


def dot_in_fp32(x: torch.Tensor) -> bool:
    """The interpreter (CPU tensors) multiplies bfloat16 bit patterns in tl.dot (triton issue #11584): dot in fp32
    there."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16


def int8_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    *,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = 128,
    split_k: int = 1,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """y = x @ dequant(W).T for int8 weights, in one launch.

    x: [M, K] fp32, fp16 or bf16, any strides; qweight: int8 [N, K]; scales: fp16 (or any float) [N, K // group].
    Returns y [M, N] in x's dtype:

        y = (x.float() @ (qweight.float() * scales.float().repeat_interleave(group, 1)).T).to(x.dtype)

    with fp32 accumulation. Group-wise: for fp16/bf16 x the dequantized weight tile is rounded to x's dtype before
    the dot (as the module's dequantize(x.dtype) does). Per-channel (group == K): the codes meet x unrounded and
    each row's scale multiplies the fp32 sum once, (x @ qweight.T) * scales.T. split_k > 1 splits K over that many
    programs that add into an fp32 buffer atomically (not bit-reproducible; one more pass to cast). Block sizes are
    powers of two >= 16, and block_k and group must line up (see groups_per_tile); num_stages: the software
    pipeline's depth (compiled GPU code only)."""
    num_rows, k = x.shape
    n, qk, group = expect_int8_weight(qweight, scales, device=x.device)
    assert qk == k, f"qweight in-features {qk} != x's {k}"
    expect(x, "x", dtype=FLOAT_DTYPES)
    dot_tiles(block_m=block_m, block_n=block_n, block_k=block_k)
    assert split_k >= 1
    num_groups = scales.shape[1]
    gpt = groups_per_tile(k, group, block_k)

    y = split_k_output(x, n, split_k)
    if num_rows == 0 or n == 0:
        return y.to(x.dtype)
    in_fp32 = dot_in_fp32(x)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(n, block_n), split_k)
    _int8_matmul_kernel[grid](
        x,
        qweight,
        scales,
        y,
        num_rows,
        n,
        k,
        group,
        num_groups,
        x.stride(0),
        x.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        scales.stride(0),
        scales.stride(1),
        y.stride(0),
        y.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUPS_PER_TILE=gpt,
        PER_CHANNEL=num_groups == 1,
        SPLIT_K=split_k,
        DOT_IN_FP32=in_fp32,
        PRECISION="ieee" if in_fp32 or x.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y.to(x.dtype)
