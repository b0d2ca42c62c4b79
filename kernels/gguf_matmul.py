"""GGUF block weight matmul: y = x @ dequant(W).T with W stored as the file's own quantized blocks (Q4_0, Q5_0,
Q5_1, Q4_K, Q5_K, Q6_K), decoded in registers inside the K loop, scales and all, like llama.cpp's and vLLM's GGUF
dequantize-and-multiply kernels. Torch twin: ``kernels.gguf_reference.gguf_matmul``; the block formats are
``kernels.gguf_reference``'s docstring.

How a K step reads the blocks: every format stores its codes so that one byte's two nibbles are two values half a
span apart (``SPAN``: 32 for the legacy types, 64 for Q4_K and Q5_K, 128 for Q6_K's low four bits). A step takes
HALF such pairs: the "low" columns k_lo (the first half of each span, HALF of them in order) and the "high"
columns k_lo + SPAN / 2, so each byte is loaded once and feeds two dots, x[:, k_lo] @ w_lo and x[:, k_hi] @ w_hi.
Each weight's decode is gguf's own arithmetic in float32 (exact products, see kernels.gguf_reference), so the
decoded tile equals dequantize_gguf's values; for fp16/bf16 x it is rounded to x's dtype before the dot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_server.kernels.checks import FLOAT_DTYPES, dot_tiles, expect
from lora_server.kernels.gguf_reference import GGUF_BLOCKS
from lora_server.kernels.int8_matmul import dot_in_fp32, split_k_output

SPANS = {"Q4_0": 32, "Q5_0": 32, "Q5_1": 32, "Q4_K": 64, "Q5_K": 64, "Q6_K": 128}
# low columns that share their scales: a legacy block's 16 bytes, half a K sub-block's 32, a Q6_K scale's 16
LANES = 16
_LANES = tl.constexpr(LANES)


@triton.jit
def _f16(ptr, mask):
    """The fp16 field at ``ptr`` (2-aligned: every block and every fp16 field in it starts at an even byte) as
    float32."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _k_scale_min(blk, s, mask):
    """Q4_K / Q5_K: sub-block s's 6-bit scale and min (kernels.gguf_reference.k_scales_mins) as float32, from the
    12 scale bytes at blk + 4."""
    a = tl.load(blk + 8 + s, mask=mask, other=0)  # b[s + 4]
    b = tl.load(blk + 4 + (s & 3), mask=mask, other=0)  # b[s % 4]
    c = tl.load(blk + 4 + s, mask=mask, other=0)  # b[s]
    low = s < 4
    sc = tl.where(low, b & 63, (a & 15) | ((b >> 6) << 4))
    mn = tl.where(low, a & 63, (a >> 4) | ((c >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def decode_pair(rows, t, mask, QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, HALF: tl.constexpr):
    """(w_lo, w_hi) float32 [HALF, BLOCK_N]: the weights of K step t's low columns (low_columns(t)) and of the
    columns SPAN / 2 to their right, for the rows that start at ``rows`` [1, BLOCK_N] (uint8 pointers), masked
    (``mask`` [1, BLOCK_N]) rows zero. The step's lanes come in HALF // LANES groups of LANES that share their
    scales: scales load once per group and row, codes once per byte."""
    G: tl.constexpr = HALF // _LANES
    gi = tl.arange(0, G)[:, None, None] + t * G  # [G, 1, 1] the groups, counted along the row
    r = tl.arange(0, _LANES)[None, :, None]  # [1, LANES, 1] the lane within its group
    rows = rows[None, :, :]  # [1, 1, BLOCK_N]
    mask = mask[None, :, :]
    if QTYPE == "Q4_0" or QTYPE == "Q5_0" or QTYPE == "Q5_1":  # a group is a block: low column r, high r + 16
        qs_at: tl.constexpr = 2 if QTYPE == "Q4_0" else (6 if QTYPE == "Q5_0" else 8)
        blk = rows + gi * BLOCK_BYTES  # [G, 1, BLOCK_N]
        byte = tl.load(blk + qs_at + r, mask=mask, other=0)  # [G, LANES, BLOCK_N]
        q_lo = (byte & 15).to(tl.int32)
        q_hi = (byte >> 4).to(tl.int32)
        if QTYPE != "Q4_0":  # the fifth bit: bit v of the uint32 qh, read as two uint16 (v = r, r + 16)
            qh = (blk + qs_at - 4).to(tl.pointer_type(tl.uint16))
            q_lo = q_lo | (((tl.load(qh, mask=mask, other=0).to(tl.int32) >> r) & 1) << 4)
            q_hi = q_hi | (((tl.load(qh + 1, mask=mask, other=0).to(tl.int32) >> r) & 1) << 4)
        d = _f16(blk, mask)
        if QTYPE == "Q5_1":
            m = _f16(blk + 2, mask)
            w_lo = d * q_lo.to(tl.float32) + m
            w_hi = d * q_hi.to(tl.float32) + m
        else:
            offset: tl.constexpr = 8 if QTYPE == "Q4_0" else 16
            w_lo = d * (q_lo - offset).to(tl.float32)
            w_hi = d * (q_hi - offset).to(tl.float32)
    elif QTYPE == "Q4_K" or QTYPE == "Q5_K":  # two groups a span, span c of a block: sub-blocks 2c (low), 2c + 1
        span = gi // 2
        blk = rows + (span // 4) * BLOCK_BYTES
        c = span % 4
        col = (gi % 2) * 16 + r  # [G, LANES, 1] the column within the span's low 32
        qs_at2: tl.constexpr = 16 if QTYPE == "Q4_K" else 48
        byte = tl.load(blk + qs_at2 + c * 32 + col, mask=mask, other=0)
        q_lo = (byte & 15).to(tl.int32)
        q_hi = (byte >> 4).to(tl.int32)
        if QTYPE == "Q5_K":  # bit s of qh[col] is column 32 s + col's fifth
            qh = tl.load(blk + 16 + col, mask=mask, other=0).to(tl.int32)
            q_lo = q_lo | (((qh >> (2 * c)) & 1) << 4)
            q_hi = q_hi | (((qh >> (2 * c + 1)) & 1) << 4)
        d = _f16(blk, mask)
        dmin = _f16(blk + 2, mask)
        sc_lo, mn_lo = _k_scale_min(blk, 2 * c, mask)  # [G, 1, BLOCK_N]
        sc_hi, mn_hi = _k_scale_min(blk, 2 * c + 1, mask)
        w_lo = (d * sc_lo) * q_lo.to(tl.float32) - dmin * mn_lo
        w_hi = (d * sc_hi) * q_hi.to(tl.float32) - dmin * mn_hi
    else:  # Q6_K: a group is 16 columns p of half a of a block (low column 128 a + p, p < 64; high p + 64)
        half_index = gi // 4  # [G, 1, 1] halves of 128 columns, counted along the row
        blk = rows + (half_index // 2) * BLOCK_BYTES
        a = half_index % 2
        p = (gi % 4) * 16 + r  # [G, LANES, 1]
        ql = tl.load(blk + a * 64 + p, mask=mask, other=0).to(tl.int32)
        qh = tl.load(blk + 128 + a * 32 + p % 32, mask=mask, other=0).to(tl.int32)
        shift = 2 * ((gi % 4) // 2)  # p // 32
        q_lo = (ql & 15) | (((qh >> shift) & 3) << 4)
        q_hi = (ql >> 4) | (((qh >> (shift + 4)) & 3) << 4)
        # the low column's int8 scale (one per 16 values); the high column's is 4 scales on
        scale_at = (blk + 192 + a * 8 + gi % 4).to(tl.pointer_type(tl.int8))
        sc_lo = tl.load(scale_at, mask=mask, other=0).to(tl.float32)
        sc_hi = tl.load(scale_at + 4, mask=mask, other=0).to(tl.float32)
        d = _f16(blk + 208, mask)
        w_lo = (d * sc_lo) * (q_lo - 32).to(tl.float32)
        w_hi = (d * sc_hi) * (q_hi - 32).to(tl.float32)
    return tl.reshape(w_lo, (HALF, w_lo.shape[2])), tl.reshape(w_hi, (HALF, w_hi.shape[2]))


@triton.jit
def low_columns(t, HALF: tl.constexpr, SPAN: tl.constexpr):
    """[HALF] the low columns of K step t: the low-half columns of the spans, HALF at a time, in order."""
    g = t * HALF + tl.arange(0, HALF)
    return (g // (SPAN // 2)) * SPAN + g % (SPAN // 2)


@triton.jit(do_not_specialize=["M"])
def _gguf_matmul_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_ym,
    stride_yn,
    QTYPE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    SPAN: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (m_block, n_block, split): y[rows, cols] summed over the K steps split, split + SPLIT_K, ...; step
    t covers the low columns low_columns(t) and the high ones SPAN / 2 to their right (2 * HALF columns)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)

    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BLOCK_M]
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BLOCK_N] output features n
    x_rows = x_ptr + rows[:, None] * stride_xm  # [BLOCK_M, 1]
    x_mask = (rows < M)[:, None]
    w_rows = w_ptr + cols[None, :] * stride_wn  # [1, BLOCK_N]
    c_mask = (cols < N)[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(split, K // (2 * HALF), SPLIT_K):
        k_lo = low_columns(t, HALF, SPAN)  # [HALF]
        x_lo = tl.load(x_rows + k_lo[None, :] * stride_xk, mask=x_mask, other=0.0)  # [BLOCK_M, HALF]
        x_hi = tl.load(x_rows + (k_lo + SPAN // 2)[None, :] * stride_xk, mask=x_mask, other=0.0)
        w_lo, w_hi = decode_pair(w_rows, t, c_mask, QTYPE, BLOCK_BYTES, HALF)  # [HALF, BLOCK_N]
        if DOT_IN_FP32:
            x_lo = x_lo.to(tl.float32)
            x_hi = x_hi.to(tl.float32)
        else:
            w_lo = w_lo.to(x_lo.dtype)
            w_hi = w_hi.to(x_hi.dtype)
        acc = tl.dot(x_lo, w_lo, acc, input_precision=PRECISION)
        acc = tl.dot(x_hi, w_hi, acc, input_precision=PRECISION)

    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    y_mask = x_mask & c_mask
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=y_mask)


def expect_gguf_weight(w: torch.Tensor, kind: str, *, device: torch.device) -> tuple[int, int]:
    """Asserts a GGUF block weight of ``kind``: uint8 [N, (K // block) * block_bytes] with contiguous rows and an
    even row stride (the fp16 fields are read 2 bytes at a time); returns (N, K)."""
    assert kind in GGUF_BLOCKS, f"GGUF type {kind} is not one of {', '.join(GGUF_BLOCKS)}"
    block, block_bytes = GGUF_BLOCKS[kind]
    expect(w, "w", dtype=torch.uint8, ndim=2, contiguous="rows", device=device)
    assert w.shape[1] % block_bytes == 0, f"w has {w.shape[1]} bytes a row, not whole {kind} blocks of {block_bytes}"
    assert w.stride(0) % 2 == 0 and w.data_ptr() % 2 == 0, "w's rows must start at even addresses"
    return w.shape[0], w.shape[1] // block_bytes * block


def step_half(k: int, kind: str, itemsize: int = 2) -> int:
    """Low columns a K step takes (HALF) for ``kind`` blocks and activations of ``itemsize`` bytes: 32 for 16-bit
    ones, 16 (LANES, also tl.dot's least K) for float32 ones, for Q6_K (the widest decode) and where 32 does not
    divide K / 2 (K is a multiple of 32, one block). With these every variant the model launches compiles for
    sm_90a and sm_80 without spilling (docs/quantization.md has the figures)."""
    half = LANES if itemsize >= 4 or kind == "Q6_K" else 2 * LANES
    return half if (k // 2) % half == 0 else LANES


def gguf_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    kind: str,
    *,
    half: int | None = None,
    block_m: int = 16,
    block_n: int = 64,
    split_k: int = 1,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """y = x @ dequant(W).T for a GGUF block weight, in one launch.

    x: [M, K] fp32, fp16 or bf16, any strides; w: uint8 [N, (K // block) * block_bytes] of ``kind`` blocks
    (expect_gguf_weight). Returns y [M, N] in x's dtype:

        y = (x.float() @ kernels.gguf_reference.dequantize_gguf(w, kind).T).to(x.dtype)

    with fp32 accumulation; for fp16/bf16 x each decoded weight is rounded to x's dtype before the dot (as
    dequantize_gguf(w, kind, x.dtype) does). ``half``: low columns per K step (None: step_half). split_k > 1 splits
    the steps over that many programs that add into an fp32 buffer atomically (not bit-reproducible). block_m and
    block_n: powers of two >= 16; num_stages: the software pipeline's depth (compiled GPU code only)."""
    num_rows, k = x.shape
    n, wk = expect_gguf_weight(w, kind, device=x.device)
    assert wk == k, f"w holds {wk} in-features, x has {k}"
    expect(x, "x", dtype=FLOAT_DTYPES)
    half = step_half(k, kind, x.dtype.itemsize) if half is None else half
    assert (k // 2) % half == 0, f"half {half} does not tile K = {k}"
    dot_tiles(block_m=block_m, block_n=block_n, half=half)
    assert split_k >= 1

    y = split_k_output(x, n, split_k)
    if num_rows == 0 or n == 0:
        return y.to(x.dtype)
    in_fp32 = dot_in_fp32(x)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(n, block_n), split_k)
    _gguf_matmul_kernel[grid](
        x,
        w,
        y,
        num_rows,
        n,
        k,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        y.stride(0),
        y.stride(1),
        QTYPE=kind,
        BLOCK_BYTES=GGUF_BLOCKS[kind][1],
        SPAN=SPANS[kind],
        HALF=half,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SPLIT_K=split_k,
        DOT_IN_FP32=in_fp32,
        PRECISION="ieee" if in_fp32 or x.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y.to(x.dtype)
