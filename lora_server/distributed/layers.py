"""The modules a rank's shard needs beyond build_llama's, swapped in after it (``parallelize``), so that the model
code (model.llama) runs unchanged on every rank:

- RowParallelLoraLinear (o, down): the rank's partial product and its adapters' partial LoRA, then one all-reduce
- RowParallelMoE (a mixture of experts' MLP): the rank's share of each expert (and of its adapters' LoRA on it),
  weighted and summed over a token's experts, then one all-reduce
- VocabParallelEmbedding: the rank's vocabulary rows looked up (zero rows for ids it does not hold), then one
  all-reduce: each token's row comes from exactly one rank, so the sum is that row exactly
- VocabParallelHead: the rank's logits columns, padded to ceil(V/N), gathered to rank 0, which gets [S, V]; the
  other ranks get their own columns back (they are not read)

The column-parallel linears (q|k|v, gate|up) need no module: their shards are plain linears with fewer rows, and
their LoRA wrappers add each adapter's share into them as they do on one device (distributed.shard)."""

from __future__ import annotations

import torch
from torch import nn

from lora_server.distributed.group import Comm
from lora_server.distributed.shard import Shard
from lora_server.errors import TensorParallelError
from lora_server.model.llama import MLP, DecoderLayer, LlamaModel
from lora_server.model.lora import LoraBatch, LoraLinear
from lora_server.model.moe import SparseMoE
from lora_server.model.quant import QuantLinear


class RowParallelLoraLinear(LoraLinear):
    """A LoRA wrapper whose base linear and adapters' A take the rank's share of the input features:
    y = all_reduce(x_local @ W_local.T + each token's x_local @ A_local.T @ B.T), B whole on every rank."""

    def __init__(self, wrapper: LoraLinear, comm: Comm) -> None:
        widths = [end - start for start, end in zip(wrapper.slice_starts, wrapper.slice_starts[1:], strict=False)]
        super().__init__(wrapper.base, wrapper.layer, wrapper.group, widths)
        assert getattr(self.base, "bias", None) is None, "a row-parallel bias would be added once per rank"
        self.comm = comm

    def forward(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:  # [T, in / N] -> [T, out]
        return self.comm.all_reduce(super().forward(x, lora))


class RowParallelMoE(SparseMoE):
    """A mixture of experts whose experts hold the rank's share of their width (distributed.shard): its output, a
    partial sum over the ranks (the down projections are row-parallel), all-reduced."""

    def __init__(self, moe: SparseMoE, comm: Comm) -> None:
        super().__init__(moe.layer, moe.router.data, list(moe.gate_up), list(moe.down), moe.top_k, moe.norm_topk_prob)
        self.comm = comm

    def forward(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.comm.all_reduce(super().forward(x, lora))


class VocabParallelEmbedding(nn.Module):
    """The embedding's vocabulary rows [first, end): ``inner`` a linear of them as held (dense or quantized, read by
    rows)."""

    def __init__(self, inner: QuantLinear, first: int, end: int, comm: Comm) -> None:
        super().__init__()
        self.inner, self.first, self.end, self.comm = inner, first, end, comm

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [T] -> [T, hidden]
        held = (ids >= self.first) & (ids < self.end)
        local = torch.where(held, ids - self.first, 0)
        x = self.inner.rows(local, dtype)
        x.masked_fill_(~held.unsqueeze(-1), 0)
        return self.comm.all_reduce(x)


class VocabParallelHead(nn.Module):
    """The output head's vocabulary rows [first, end) of ``vocab_size`` (``inner``: a linear of them as held; a tied
    head's is the embedding's, or its CPU copy), each rank's part padded to ``per_rank`` columns for the gather."""

    def __init__(self, inner: QuantLinear, shard: Shard, comm: Comm) -> None:
        super().__init__()
        self.inner = inner
        self.per_rank, self.vocab_size, self.comm = shard.vocab_per_rank, shard.arch.vocab_size, comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, V] on rank 0
        try:
            local = self.inner(hidden).float()  # [S, end - first]
            pad = self.per_rank - local.shape[1]
            if pad:
                local = nn.functional.pad(local, (0, pad))
        except Exception as exc:  # the other ranks wait in the gather: the engine cannot go on
            raise TensorParallelError(f"rank {self.comm.rank}'s output head raised {exc!r}") from exc
        parts = self.comm.gather_to_first(local.contiguous())
        if parts is None:
            return local
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]


def parallelize(model: LlamaModel, shard: Shard, comm: Comm) -> None:
    """Swap in this rank's parallel modules (in place), before the LoRA wrappers are attached to an arena: o and
    down row-parallel (a mixture of experts as a whole), the embedding and the head vocabulary-parallel
    (build_llama built them from the rank's slices: shard.shard_checkpoint)."""
    first, end = shard.vocab_range
    head = model.embed if model.lm_head is None else model.lm_head  # None: tied, and used as it is
    model.embed = VocabParallelEmbedding(model.embed, first, end, comm)  # type: ignore[assignment]
    model.lm_head = VocabParallelHead(head, shard, comm)  # type: ignore[assignment]
    layers: list[DecoderLayer] = list(model.layers)  # type: ignore[arg-type]
    for layer in layers:
        layer.attn.o_proj = RowParallelLoraLinear(layer.attn.o_proj, comm)
        if isinstance(layer.mlp, MLP):
            layer.mlp.down_proj = RowParallelLoraLinear(layer.mlp.down_proj, comm)
        else:
            layer.mlp = RowParallelMoE(layer.mlp, comm)
