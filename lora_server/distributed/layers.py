"""The modules a rank's shard needs beyond build_llama's, swapped in after it (``parallelize``), so that the model
code (model.llama) runs unchanged on every rank:

- RowParallelLinear (o, down): the rank's partial product, then one all-reduce
- VocabParallelEmbedding: the rank's vocabulary rows looked up (zero rows for ids it does not hold), then one
  all-reduce: each token's row comes from exactly one rank, so the sum is that row exactly
- VocabParallelHead: the rank's logits columns, padded to ceil(V/N), gathered to rank 0, which gets [S, V]; the
  other ranks get their own columns back (they are not read)

The column-parallel linears (q|k|v, gate|up) need no module: their shards are plain linears with fewer rows."""

from __future__ import annotations

import torch
from torch import nn

from lora_server.distributed.group import Comm
from lora_server.distributed.shard import Shard
from lora_server.errors import TensorParallelError
from lora_server.model.llama import LlamaModel
from lora_server.model.quant import DenseLinear


class RowParallelLinear(nn.Module):
    """A dense linear whose input features are split across the ranks: y = all_reduce(x_local @ W_local.T)."""

    def __init__(self, inner: DenseLinear, comm: Comm) -> None:
        super().__init__()
        assert inner.bias is None, "a row-parallel bias would be added once per rank"
        self.inner, self.comm = inner, comm

    @property
    def out_features(self) -> int:
        return self.inner.out_features

    @property
    def bias(self) -> None:
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / N] -> [T, out]
        return self.comm.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """The embedding's vocabulary rows [first, end) (weight [end - first, hidden])."""

    def __init__(self, weight: torch.Tensor, first: int, end: int, comm: Comm) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.first, self.end, self.comm = first, end, comm

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [T] -> [T, hidden]
        held = (ids >= self.first) & (ids < self.end)
        local = torch.where(held, ids - self.first, 0)
        x = self.weight[local].to(dtype)
        x.masked_fill_(~held.unsqueeze(-1), 0)
        return self.comm.all_reduce(x)


class VocabParallelHead(nn.Module):
    """The output head's vocabulary rows [first, end) of ``vocab_size`` (weight [end - first, hidden]; a tied head
    shares the embedding's), each rank's part padded to ``per_rank`` columns for the gather."""

    def __init__(self, weight: torch.Tensor, shard: Shard, comm: Comm) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.per_rank, self.vocab_size, self.comm = shard.vocab_per_rank, shard.arch.vocab_size, comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, V] on rank 0
        try:
            local = nn.functional.linear(hidden, self.weight)  # [S, end - first]
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
    """Swap in this rank's parallel modules (in place): o and down row-parallel, the embedding and the head
    vocabulary-parallel (build_llama built them from the rank's slices: shard.shard_checkpoint)."""
    assert isinstance(model.embed, DenseLinear), "tensor parallelism shards dense weights (check_tensor_parallel)"
    first, end = shard.vocab_range
    embed = VocabParallelEmbedding(model.embed.weight.data, first, end, comm)
    head_weight = embed.weight if model.lm_head is None else _dense(model.lm_head).weight  # None: tied
    model.embed = embed  # type: ignore[assignment]
    model.lm_head = VocabParallelHead(head_weight, shard, comm)  # type: ignore[assignment]
    for wrappers in model.lora_wrappers():
        for group in ("o", "down"):
            wrappers[group].base = RowParallelLinear(_dense(wrappers[group].base), comm)


def _dense(module: nn.Module | None) -> DenseLinear:
    assert isinstance(module, DenseLinear), f"tensor parallelism shards dense weights, not {type(module).__name__}"
    return module
