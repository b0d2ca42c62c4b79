"""Pure-torch twins of the kernels. They define what each kernel computes, run on any device, and are what
kernels.ops runs where use_kernels says no (the CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k_cache.view(-1, kv_heads, head_dim)[slot_mapping] = k (and v alike), in place.

    k, v: [tokens, kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim];
    slot_mapping: [tokens] int64, slot = block_id * block_size + offset."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal grouped-query attention of each sequence's new queries over its paged KV.

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
        k_b = k_cache[blocks].flatten(0, 1)[:seq_len]  # [seq_len, kv_heads, head_dim]
        v_b = v_cache[blocks].flatten(0, 1)[:seq_len]
        # query i sits at position seq_len - n + i and sees keys 0 ..= that position
        key_pos = torch.arange(seq_len, device=q.device)
        mask = key_pos[None, :] <= key_pos[seq_len - n :, None]  # [n, seq_len]
        o = F.scaled_dot_product_attention(
            q_b.transpose(0, 1).float(),
            k_b.transpose(0, 1).float(),
            v_b.transpose(0, 1).float(),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[starts[b] : starts[b + 1]] = o.transpose(0, 1).to(q.dtype)
    return out
