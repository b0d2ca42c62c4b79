"""Pure-torch twins of the kernels. They define what each kernel computes, run on any device, and are what
kernels.ops runs where use_kernels says no (the CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The fp8 KV format: float8 e4m3 (finite max 448, 3 mantissa bits) with one float32 scale per KV head (per layer,
# for K and V apart): the cache stores x / scale clamped to +-448, and x is read back as stored.float() * scale.
FP8_KV_DTYPE = torch.float8_e4m3fn


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """x [tokens, kv_heads, head_dim] as a cache of cache_dtype stores it: x.to(cache_dtype), or for an fp8 cache
    (x.float() / scale[:, None]).clamp(-448, 448).to(FP8_KV_DTYPE) with scale [kv_heads] float32."""
    if cache_dtype != FP8_KV_DTYPE:
        assert scale is None, f"scales are for fp8 caches, not {cache_dtype}"
        return x.to(cache_dtype)
    assert scale is not None, "an fp8 cache needs a scale per KV head"
    fp8_max = torch.finfo(FP8_KV_DTYPE).max
    return (x.float() / scale[:, None]).clamp(-fp8_max, fp8_max).to(FP8_KV_DTYPE)


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """float32 [..., kv_heads, head_dim] of cache rows: stored.float(), times scale[:, None] for an fp8 cache."""
    if scale is None:
        return stored.float()
    return stored.float() * scale[:, None]


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k_cache.view(-1, kv_heads, head_dim)[slot_mapping] = quantize_kv(k, k_cache.dtype, k_scale) (and v alike),
    in place, for the tokens whose slot is >= 0.

    k, v: [tokens, kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim], any
    strides; slot_mapping: [tokens] int64, slot = block_id * block_size + offset; a negative slot (a padding token)
    writes nothing; k_scale, v_scale: [kv_heads] float32 for an fp8 cache, else None."""
    if slot_mapping.numel() and slot_mapping.min() < 0:  # padding rows (never on the CPU engine's own steps)
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    block_size = k_cache.shape[1]
    where = (slot_mapping // block_size, slot_mapping % block_size)  # caches may be strided (the arena's pages)
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        stored = quantize_kv(x, cache.dtype, scale)
        if cache.dtype == FP8_KV_DTYPE:  # index_put_ has no float8 kernel on the CPU: move the bytes
            cache, stored = cache.view(torch.uint8), stored.view(torch.uint8)
        cache.index_put_(where, stored)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal grouped-query attention of each sequence's new queries over its paged KV, in float32 over the keys
    and values dequantize_kv reads (an fp8 cache: stored values times k_scale / v_scale [kv_heads]). window > 0:
    a sliding window, the query at position p sees keys p - window < key <= p only (HF's sliding_window);
    softcap > 0: the scaled scores s become softcap * tanh(s / softcap) before the softmax (Gemma 2's logit
    soft-capping).

    q: [tokens, heads, head_dim], the queries of all sequences back to back; sequence b owns rows
    query_start_loc[b]:query_start_loc[b + 1], which are its last (query_start_loc[b+1] - query_start_loc[b])
    positions. seq_lens: [batch], the KV length of each sequence including this step's tokens (already written to
    the cache). block_tables: [batch, max_blocks] int32. Returns [tokens, heads, head_dim] in q's dtype."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_b = q[starts[b] : starts[b + 1]]  # [n, heads, head_dim]
        n = q_b.shape[0]
        if n == 0:
            continue
        blocks = block_tables[b, : (seq_len + block_size - 1) // block_size].long()
        k_b = dequantize_kv(k_cache[blocks].flatten(0, 1)[:seq_len], k_scale)  # [seq_len, kv_heads, head_dim]
        v_b = dequantize_kv(v_cache[blocks].flatten(0, 1)[:seq_len], v_scale)
        # query i sits at position seq_len - n + i and sees keys 0 ..= that position
        key_pos = torch.arange(seq_len, device=q.device)
        query_pos = key_pos[seq_len - n :, None]
        mask = key_pos[None, :] <= query_pos  # [n, seq_len]
        if window > 0:
            mask &= key_pos[None, :] > query_pos - window
        # with a batch dimension: 3-D inputs take torch's math path on the CPU (a pass over [heads, n, seq_len]
        # per elementwise step, 3x slower at a few thousand keys), 4-D ones its flash kernel
        o = attend(
            q_b.transpose(0, 1).float()[None],
            k_b.transpose(0, 1)[None],
            v_b.transpose(0, 1)[None],
            mask,
            scale,
            softcap,
        )
        out[starts[b] : starts[b + 1]] = o[0].transpose(0, 1).to(q.dtype)
    return out


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float = 0.0
) -> torch.Tensor:
    """softmax(scale * q @ k^T, soft-capped where softcap > 0, masked) @ v in float32: q [B, H, n, D], k and v
    [B, KVH, L, D] (query head h reads KV head h // (H // KVH)), mask [..., n, L] broadcastable, True = visible.
    Without soft-capping, torch's scaled_dot_product_attention."""
    if softcap <= 0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap  # HF's order: scale, divide, tanh
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v


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
) -> torch.Tensor:
    """Decode attention, one query per sequence: q [B, H, D], row b at position seq_lens[b] - 1 of sequence b,
    attends over its keys 0 .. seq_lens[b] - 1, the last ``window`` of them where window > 0 (paged_attention
    with one query per sequence, softcap alike); out [B, H, D] in
    q's dtype, zeros for a sequence of length 0 (a padding row), whose block table is not read. The split-KV
    kernel (kernels.decode_attention) computes the same: splitting the keys only reorders its fp32 sums."""
    out = torch.zeros_like(q)
    live = [b for b, n in enumerate(seq_lens.tolist()) if n > 0]
    if live:
        rows = torch.tensor(live, device=q.device)
        starts = torch.arange(len(live) + 1, device=q.device)
        out[rows] = paged_attention(
            q[rows],
            k_cache,
            v_cache,
            block_tables[rows],
            seq_lens[rows],
            starts,
            scale,
            k_scale,
            v_scale,
            window=window,
            softcap=softcap,
        )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] normalized in float32 and scaled by weight [hidden]. A weight in x's dtype multiplies the
    normalized rows once they are rounded to x's dtype (HF's LlamaRMSNorm); a float32 weight with x of another
    dtype multiplies them in float32, rounded once at the end (Gemma's norm, whose weight is 1 + w in float32)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype != x.dtype:
        return (xf * weight).to(x.dtype)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x, then x = rms_norm(residual, weight, eps) (HF's residual + hidden_states, then
    the next norm; the sum is rounded to the dtype before it is normalized). The normalized rows are rounded into
    x, then multiplied by weight in place: rms_norm's roundings, without its temporaries."""
    residual.add_(x)
    if weight.dtype != x.dtype:
        x.copy_(rms_norm(residual, weight, eps))
        return
    xf = residual.float()
    torch.mul(xf, torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps), out=x)
    x.mul_(weight)


def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: every head of x [T, heads, D] becomes rms_norm(head, weight [D], eps) (Qwen3's and Gemma 3's
    q_norm and k_norm, applied before the rotary embedding)."""
    x.copy_(rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape))


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, rotary_dim: int = 0) -> None:
    """In place: x [T, heads, D] = x * cos + x.roll(D // 2, -1) * sin_signed with cos, sin_signed [T, 1, D] in
    x's dtype, sin_signed being sin with its first half negated: HF's x * cos + rotate_half(x) * sin, with its
    two roundings (each product rounded to the dtype, then the sum; a fused multiply-add would round once).
    rotary_dim R in (0, D) (partial rotary embeddings): the roll is within the first R dimensions, the others
    pair with themselves (their cos is 1 and their sin 0, so they pass unchanged)."""
    d = x.shape[-1]
    if 0 < rotary_dim < d:
        rolled = x.clone()
        rolled[..., :rotary_dim] = x[..., :rotary_dim].roll(rotary_dim // 2, -1)
    else:
        rolled = x.roll(d // 2, -1)
    rolled.mul_(sin_signed)
    x.mul_(cos).add_(rolled)


def rotary_write_kv(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    rotary_dim: int = 0,
) -> None:
    """In place: the query and key heads qk [T, H + KVH, D] rotated (apply_rotary_), then the rotated keys
    qk[:, H:] and the values v [T, KVH, D] written to their slots (write_kv_cache; negative slots write nothing)."""
    apply_rotary_(qk, cos, sin_signed, rotary_dim)
    write_kv_cache(qk[:, qk.shape[1] - k_cache.shape[2] :], v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, I] = F.silu(gate) * up for x [T, 2 * I] = gate | up (HF's act_fn(gate_proj(x)) * up_proj(x))."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, I] = gelu(gate, approximate="tanh") * up for x [T, 2 * I] = gate | up (Gemma's gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
