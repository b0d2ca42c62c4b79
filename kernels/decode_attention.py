"""Paged decode attention with split KV (flash-decoding): one query per sequence, its keys cut into ``num_splits``
equal chunks that separate programs attend over (partial outputs with their softmax max and sum), then a reduce
kernel that merges a sequence's chunks. With one split the first kernel writes the output itself (one launch).
Batch 1 at a long context so spreads over the GPU instead of a few programs. Grouped-query heads share each key
load; an fp8 cache is read as kernels.paged_attention reads it. A sequence of length 0 (a padding row of a
CUDA-graph bucket) reads nothing and gets zeros. Torch twin: ``kernels.reference.paged_decode_attention``."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lora_server.kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, dot_tiles, expect, expect_kv_cache
from lora_server.kernels.paged_attention import LN2, LOG2E

MAX_SPLITS = 32
MIN_KEYS_PER_SPLIT = 128
DEFAULT_SMS = 132  # an H100's streaming multiprocessors: the default's guess where the device cannot say


@triton.jit(do_not_specialize=["num_splits", "stride_tb"])
def _decode_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    window,
    softcap,
    stride_qb,
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
    stride_ob,
    stride_oh,
    stride_od,
    stride_tb,
    stride_ti,
    num_splits,
    NUM_HEADS: tl.constexpr,
    SPLIT: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Program (b, kv_head, split): the GROUP query heads of kv_head (rows of a BLOCK_G tile) attend over keys [W +
    split * chunk, min(W + (split + 1) * chunk, L)) of sequence b, W = max(L - window, 0) where window > 0 (a sliding
    window: the last ``window`` keys) else 0, chunk = ceil(ceil((L - W) / num_splits) / BLOCK_N) * BLOCK_N, scores
    soft-capped as kernels.paged_attention does under SOFTCAP, with an online softmax in fp32 (base 2: qk_scale holds
    scale * log2(e)). Not SPLIT (num_splits 1): stores acc / sum (0 where L == 0) times the value scale to out. SPLIT:
    stores the unnormalized acc [D] to part_acc[b, head, split] and (max, sum) to part_ml[b, head, split]: (-inf, 0) for
    an empty chunk. The split count is a runtime value (one compiled variant for every count: warm-up compiles two,
    split or not)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    g = tl.arange(0, BLOCK_G)  # [BLOCK_G]
    row_mask = g < GROUP
    head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    if KV_FP8:  # q . (k8 * ks) = (q . k8) * ks; sum p (v8 * vs) = vs * sum p v8
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)

    table_row = block_tables_ptr + b.to(tl.int64) * stride_tb
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        key = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        key_mask = key < end
        page = tl.load(table_row + (key // PAGE_SIZE) * stride_ti, mask=key_mask, other=0).to(tl.int64)
        offset = key % PAGE_SIZE
        kv_mask = key_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_cache_ptr
            + (page * stride_kb + offset * stride_ks + kv_head * stride_kh)[:, None]
            + d[None, :] * stride_kd,
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + (page * stride_vb + offset * stride_vs + kv_head * stride_vh)[:, None]
            + d[None, :] * stride_vd,
            mask=kv_mask,
            other=0.0,
        )
        if KV_FP8:  # every float8 e4m3 value is exact in fp32, fp16 and bf16
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        if SOFTCAP:  # as kernels.paged_attention: natural units, capped, base 2 again
            t = s * (LN2 / softcap)
            s = (1.0 - 2.0 / (tl.exp(2.0 * t) + 1.0)) * (softcap * LOG2E)
        s = tl.where(key_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: key n0 < end is visible
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    out_mask = row_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # L == 0: acc is 0, so is the output
        if KV_FP8:
            out = out * tl.load(v_scale_ptr + kv_head)
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        part = (b.to(tl.int64) * NUM_HEADS + head) * num_splits + split  # [BLOCK_G] rows of [B, H, S]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_attention_reduce_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    v_scale_ptr,
    stride_ob,
    stride_oh,
    stride_od,
    num_splits,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Program (b, head): out[b, head] = sum_s w_s acc_s / sum_s w_s l_s with w_s = exp2(m_s - max_s m_s), the
    num_splits (<= BLOCK_S) partials merged; 0 where every split is empty (L == 0); times the value scale for an
    fp8 cache."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    s_mask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    part = (b * NUM_HEADS + head) * num_splits + s
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=float("-inf"))
    total = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # 0 for an empty split
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0
    )
    num = tl.sum(acc * w[:, None], axis=0)  # [BLOCK_D]
    den = tl.sum(total * w, axis=0)
    out = num / tl.where(den > 0, den, 1.0)
    if KV_FP8:
        out = out * tl.load(v_scale_ptr + head // GROUP)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + d * stride_od, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def default_num_splits(batch: int, num_kv_heads: int, max_kv_len: int, device: torch.device) -> int:
    """Splits per sequence so that batch x KV heads x splits programs cover the GPU's multiprocessors about twice,
    each split at least MIN_KEYS_PER_SPLIT of the longest possible context (max_kv_len, the block table's width
    in tokens), at most MAX_SPLITS. Depends on shapes alone, so a CUDA-graph bucket keeps one count."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else DEFAULT_SMS
    by_occupancy = triton.cdiv(2 * sms, max(1, batch * num_kv_heads))
    by_length = triton.cdiv(max_kv_len, MIN_KEYS_PER_SPLIT)
    return max(1, min(MAX_SPLITS, by_occupancy, by_length))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    window: int = 0,
    softcap: float = 0.0,
    num_splits: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """Decode attention, one query per sequence, with split KV: one launch for one split, two (partials, reduce)
    for more; no host sync. The result of ``kernels.reference.paged_decode_attention``:

    q: [B, H, D] (row b is sequence b's query, at position seq_lens[b] - 1), any strides; k_cache, v_cache:
    [num_blocks, block_size, KVH, D], q's dtype, or float8_e4m3fn with k_scale, v_scale [KVH] float32; H a
    multiple of KVH; block_tables: [B, max_blocks] int32; seq_lens: [B] int32 or int64, each <= max_blocks *
    block_size. Returns out [B, H, D] in q's dtype,

        out[b, h] = softmax(scale * K_b[:, h // (H // KVH)].float() @ q[b, h].float()) @ V_b[:, h // (H // KVH)]

    with K_b, V_b [L, KVH, D] = k_cache[block_tables[b]].flatten(0, 1)[:L] (fp8: .float() * k_scale[:, None], V
    alike), L = seq_lens[b]; out[b] = 0 where L == 0, whose block table is not read. fp32 scores, softmax and sums;
    the probabilities meet V rounded to q's dtype. window > 0: only the last ``window`` keys of K_b, V_b;
    softcap > 0: the scaled scores soft-capped (the twin's).

    num_splits: how many chunks each sequence's keys are cut into (None: default_num_splits, from the shapes);
    block_n: keys per loop step (a power of two >= 16); a split's chunk is a multiple of block_n."""
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, kv_dim = k_cache.shape
    assert kv_dim == head_dim, f"cache head_dim {kv_dim} != q's {head_dim}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly"
    expect(q, "q", dtype=FLOAT_DTYPES)
    kv_fp8 = expect_kv_cache(k_cache, v_cache, k_scale, v_scale, dtype=q.dtype, device=q.device)
    expect(block_tables, "block_tables", dtype=torch.int32, shape=(batch, None), device=q.device)
    expect(seq_lens, "seq_lens", dtype=INDEX_DTYPES, shape=(batch,), device=q.device)
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, block_tables.shape[1] * page_size, q.device)
    assert isinstance(num_splits, int) and num_splits >= 1, num_splits
    dot_tiles(block_n=block_n)

    out = torch.empty_like(q)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    if num_splits > 1:  # [B, H, S, D] unnormalized outputs and [B, H, S, (max, sum)], all written by the kernel
        part_acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(batch, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # not touched
    # the interpreter (CPU tensors) multiplies bfloat16 bit patterns in tl.dot (triton issue #11584)
    dot_in_fp32 = q.device.type == "cpu" and q.dtype == torch.bfloat16
    scales = (k_scale if k_scale is not None else q, v_scale if v_scale is not None else q)  # read only if fp8
    _decode_attention_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_acc,
        part_ml,
        block_tables,
        seq_lens,
        *scales,
        scale * math.log2(math.e),
        window,
        softcap,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        *block_tables.stride(),
        num_splits,
        NUM_HEADS=num_heads,
        SPLIT=num_splits > 1,
        GROUP=group,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_IN_FP32=dot_in_fp32,
        PRECISION="ieee" if dot_in_fp32 or q.dtype == torch.float32 else "tf32",
        KV_FP8=kv_fp8,
        SOFTCAP=softcap > 0,
        num_warps=num_warps,
    )
    if num_splits > 1:
        _decode_attention_reduce_kernel[(batch, num_heads)](
            out,
            part_acc,
            part_ml,
            scales[1],
            *out.stride(),
            num_splits,
            NUM_HEADS=num_heads,
            GROUP=group,
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(MAX_SPLITS),
            BLOCK_D=triton.next_power_of_2(head_dim),
            KV_FP8=kv_fp8,
        )
    return out
