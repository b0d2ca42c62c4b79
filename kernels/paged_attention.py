"""Paged attention: causal grouped-query attention of each sequence's new queries over its KV cache, read through
a block table. One kernel for decode (one query per sequence) and for prefill chunks over a cached prefix (n queries
per sequence, its last n positions). An fp8 cache is read as stored.float() * the KV head's scale: the kernel loads
fp8, converts it to q's dtype (exact) and applies the key scale to the scores and the value scale to the output.
Torch twin: ``kernels.reference.paged_attention``."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lora_server.kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, dot_tiles, expect, expect_kv_cache

LN2: tl.constexpr = tl.constexpr(math.log(2.0))
LOG2E: tl.constexpr = tl.constexpr(math.log2(math.e))


@triton.jit(do_not_specialize=["stride_tb"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    window,
    softcap,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_tb,
    stride_ti,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Program (b, kv_head, m_tile): the outputs of rows m_tile * BLOCK_M ... of sequence b's (query, head) rows
    of one KV head, row m = query (m // GROUP) with head kv_head * GROUP + m % GROUP, so the GROUP heads that share
    a KV head read each key and value once. Keys stream in BLOCK_N blocks up to the last position a row of the tile
    sees, with an online softmax in fp32 (base 2: qk_scale holds scale * log2(e)). Tiles past the sequence's
    rows exit at once. KV_FP8: the caches hold fp8, k_scale[kv_head] multiplies the scores and v_scale[kv_head]
    the output. window > 0: a row at position p sees keys p - window < key <= p only, and the loop starts at the
    first block a row of the tile sees. SOFTCAP: scores s (natural units) become softcap * tanh(s / softcap)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M

    q_start = tl.load(query_start_loc_ptr + b)
    num_queries = tl.load(query_start_loc_ptr + b + 1) - q_start
    num_rows = num_queries * GROUP
    if m0 >= num_rows:
        return
    seq_len = tl.load(seq_lens_ptr + b)

    m = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_mask = m < num_rows
    query = m // GROUP
    head = kv_head * GROUP + m % GROUP
    token = (q_start + query).to(tl.int64)
    # query i sits at position seq_len - n + i; rows past the last query see every key up to kv_end, so that no
    # row of the tile is fully masked (their results are not stored)
    position = seq_len - num_queries + query  # [BLOCK_M]
    kv_end = seq_len - num_queries + (tl.minimum(m0 + BLOCK_M, num_rows) - 1) // GROUP + 1
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_mask = d < HEAD_DIM

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    if KV_FP8:  # q . (k8 * ks) = (q . k8) * ks; sum p (v8 * vs) = vs * sum p v8
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)

    table_row = block_tables_ptr + b.to(tl.int64) * stride_tb
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running max of the scaled scores
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # window > 0: from the first key the tile's first row sees, down to a block boundary
    first_seen = tl.maximum(seq_len - num_queries + m0 // GROUP - window + 1, 0) // BLOCK_N * BLOCK_N
    kv_start = tl.where(window > 0, first_seen, 0)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        key = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        key_mask = key < kv_end
        page = tl.load(table_row + (key // PAGE_SIZE) * stride_ti, mask=key_mask, other=0).to(tl.int64)
        offset = key % PAGE_SIZE
        k_slot = page * stride_kb + offset * stride_ks + kv_head * stride_kh  # [BLOCK_N]
        v_slot = page * stride_vb + offset * stride_vs + kv_head * stride_vh
        kv_mask = key_mask[:, None] & d_mask[None, :]  # [BLOCK_N, BLOCK_D]
        k = tl.load(k_cache_ptr + k_slot[:, None] + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_slot[:, None] + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if KV_FP8:  # every float8 e4m3 value is exact in fp32, fp16 and bf16
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:  # s is in base 2: back to natural units, capped, and base 2 again; tanh(t) = 1 - 2 / (e^2t + 1)
            t = s * (LN2 / softcap)
            s = (1.0 - 2.0 / (tl.exp(2.0 * t) + 1.0)) * (softcap * LOG2E)
        visible = (key[None, :] <= position[:, None]) & key_mask[None, :]
        visible &= (window <= 0) | (key[None, :] > position[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        # a row may see no key of this block (a sliding window's first blocks): its max stays -inf, and the
        # exponentials are taken against 0 instead so that no -inf - -inf appears
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # 0 only in rows past the last query, which are not stored
    if KV_FP8:
        out = out * tl.load(v_scale_ptr + kv_head)
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def default_tiles(query_rows: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(block_m, block_n, num_warps) for a step whose longest query holds ``query_rows`` (query, head) rows: 16
    rows when they fit, else 64; 64 keys a step and 4 warps, except where that spills (compiled for sm_90a and
    sm_80, tests/engine/test_warmup.py): 32 keys for head_dim >= 128 at 64 rows (64 spilled 72 bytes on sm_80), 16 for
    head_dim >= 256 (32 spilled 88 bytes on sm_80 with soft-capping), and in fp32 (the IEEE dot holds the tile in
    registers) 32 keys with 8 warps at 64 rows (else 35 KB spilled)."""
    block_m = 16 if query_rows <= 16 else 64
    if dtype == torch.float32:
        return block_m, 32, 8 if block_m == 64 else 4
    if block_m == 64 and head_dim >= 256:  # Gemma's heads: 32 keys spilled 88 bytes on sm_80 (soft-capped)
        return block_m, 16, 4
    return block_m, 32 if block_m == 64 and head_dim >= 128 else 64, 4


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
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Causal grouped-query attention of each sequence's new queries over its paged KV, in one launch and without
    a host sync: the same arguments and result as the twin ``kernels.reference.paged_attention``, plus

    max_query_len: an upper bound on query_start_loc[b + 1] - query_start_loc[b] over the batch (1 for a pure
    decode step); it sizes the grid, and queries past it would not be computed.

    q: [T, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D], q's dtype, or float8_e4m3fn with k_scale,
    v_scale [KVH] float32 (None otherwise), H a multiple of KVH (query head h reads KV head h // (H // KVH));
    block_tables: [B, max_blocks] int32; seq_lens: [B] and query_start_loc:
    [B + 1], int32 or int64, with query_start_loc[b + 1] - query_start_loc[b] <= seq_lens[b]. Any strides.
    Returns out [T, H, D] in q's dtype where, for sequence b with n = query_start_loc[b + 1] - query_start_loc[b],
    L = seq_lens[b], the keys and values K_b, V_b [L, KVH, D] = k_cache[block_tables[b]].flatten(0, 1)[:L] (for an
    fp8 cache, .float() * k_scale[:, None], and V alike) and rows t = query_start_loc[b] + i,

        out[t, h] = softmax(scale * K_b[:L - n + i + 1, h // (H // KVH)].float() @ q[t, h].float())
                    @ V_b[:L - n + i + 1, h // (H // KVH)].float()

    (fp32 scores, softmax and accumulation; the probabilities are rounded to q's dtype before they meet V). Rows
    outside every sequence's query range are left as torch.empty left them. window > 0: row i sees only its last
    ``window`` keys (L - n + i - window < key); softcap > 0: the scaled scores are soft-capped (the twin's).

    block_m: (query, head) rows per program (None: 16 when max_query_len * H // KVH <= 16, else 64); block_n: keys
    per loop step; both powers of two >= 16. None: default_tiles' choice."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, kv_dim = k_cache.shape
    batch = seq_lens.shape[0]
    assert kv_dim == head_dim, f"cache head_dim {kv_dim} != q's {head_dim}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly"
    expect(q, "q", dtype=FLOAT_DTYPES)
    kv_fp8 = expect_kv_cache(k_cache, v_cache, k_scale, v_scale, dtype=q.dtype, device=q.device)
    expect(block_tables, "block_tables", dtype=torch.int32, shape=(batch, None), device=q.device)
    expect(seq_lens, "seq_lens", dtype=INDEX_DTYPES, device=q.device)
    expect(query_start_loc, "query_start_loc", dtype=INDEX_DTYPES, shape=(batch + 1,), device=q.device)
    assert isinstance(max_query_len, int) and max_query_len >= 0, max_query_len
    group = num_heads // num_kv_heads
    tiles = default_tiles(max_query_len * group, head_dim, q.dtype)
    block_m = tiles[0] if block_m is None else block_m
    block_n = tiles[1] if block_n is None else block_n
    num_warps = tiles[2] if num_warps is None else num_warps
    dot_tiles(block_m=block_m, block_n=block_n)

    out = torch.empty_like(q)
    if num_tokens == 0 or batch == 0 or max_query_len == 0:
        return out
    # the interpreter (CPU tensors) multiplies bfloat16 bit patterns in tl.dot (triton issue #11584)
    dot_in_fp32 = q.device.type == "cpu" and q.dtype == torch.bfloat16
    grid = (batch, num_kv_heads, triton.cdiv(max_query_len * group, block_m))
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        k_scale if k_scale is not None else q,  # not read unless KV_FP8
        v_scale if v_scale is not None else q,
        scale * math.log2(math.e),
        window,
        softcap,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.stride(3),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        v_cache.stride(3),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        block_tables.stride(0),
        block_tables.stride(1),
        GROUP=group,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_IN_FP32=dot_in_fp32,
        PRECISION="ieee" if dot_in_fp32 or q.dtype == torch.float32 else "tf32",
        KV_FP8=kv_fp8,
        SOFTCAP=softcap > 0,
        num_warps=num_warps,
    )
    return out
