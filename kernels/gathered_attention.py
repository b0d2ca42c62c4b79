"""Paged decode attention as one gather and one attention call per layer: the path where there are no Triton
kernels (the CPU), for steps in which every sequence has one new query.

Each sequence's blocks are gathered through its block table into a padded batch [B, max_blocks * block_size]; keys
at or past a sequence's length (the tail of its last block, and the padded table entries) are zeroed and masked out.
Same result as reference.paged_attention for such steps, up to float rounding."""

from __future__ import annotations

import torch

from lora_server.kernels.reference import attend, dequantize_kv


def gathered_decode_attention(
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
    """out [B, H, D] in q's dtype: q [B, H, D] (one query per sequence, at position seq_lens[b] - 1) attends over
    keys 0 .. seq_lens[b] - 1 of its paged cache (the last ``window`` of them where window > 0; scores
    soft-capped where softcap > 0, as reference.attend). k_cache, v_cache [blocks, block_size, KVH, D]; block_tables
    [B, max_blocks] int32 (padding entries any valid block); seq_lens [B] int32; an fp8 cache is read as
    stored.float() * k_scale / v_scale [KVH]. Computed in float32, as the twin."""
    batch, max_blocks = block_tables.shape
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    length = max_blocks * block_size
    blocks = block_tables.view(-1)
    k = k_cache.index_select(0, blocks).view(batch, length, kv_heads, head_dim)
    v = v_cache.index_select(0, blocks).view(batch, length, kv_heads, head_dim)
    key_pos = torch.arange(length, device=q.device)[None, :]
    keep = key_pos < seq_lens[:, None]  # [B, length]
    # slots past a sequence's end hold whatever was there (another request's values, NaN after a failure):
    # zeroed, so that a masked NaN never meets a zero weight
    past_end = (~keep).view(-1).nonzero().squeeze(1)  # rows of the flattened [B * length] gather
    k = dequantize_kv(k, k_scale).view(batch * length, -1).index_fill_(0, past_end, 0.0)  # a fresh tensor: in place
    v = dequantize_kv(v, v_scale).view(batch * length, -1).index_fill_(0, past_end, 0.0)
    k, v = (t.view(batch, length, kv_heads, head_dim) for t in (k, v))
    visible = keep if window <= 0 else keep & (key_pos >= seq_lens[:, None] - window)
    out = attend(
        q.float().unsqueeze(2),  # [B, H, 1, D]
        k.transpose(1, 2),  # [B, KVH, length, D]
        v.transpose(1, 2),
        visible[:, None, None, :],
        scale,
        softcap,
    )
    return out.squeeze(2).to(q.dtype)
