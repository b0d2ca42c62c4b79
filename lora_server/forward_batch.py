"""The per-step batch description the model runner builds and the model reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_server.lora import LoraBatch


@dataclass(slots=True)
class ForwardBatch:
    """One forward pass over the scheduled tokens of B sequences (T tokens in all, sequence b's tokens contiguous).

    All tensors live on the model's device; the model reads them without copying back to the host."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, each token's position in its sequence
    slot_mapping: torch.Tensor  # [T] int64, KV cache slot (block_id * block_size + offset) each token writes
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32, KV length of each sequence after this step
    query_start_loc: torch.Tensor  # [B + 1] int32, sequence b's tokens are rows [qsl[b], qsl[b+1])
    logits_indices: torch.Tensor  # [S] int64, rows whose hidden state becomes logits (one per sampled sequence)
    max_query_len: int = 1  # the most tokens any one sequence has in this step (bounds the attention grid)
    lora: LoraBatch | None = None  # each token's adapter slot; None when no token has an adapter

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
