"""How each checkpoint tensor is split across the ranks: a transform of the Checkpoint at load time (each rank
reads a tensor, keeps its slice and lets the rest go), so that build_llama builds the rank's shard as it builds a
whole model, from a ModelArch with the rank's share of the heads and of the MLP.

Rank r of N holds (H q heads, KVH kv heads, I intermediate, V vocabulary rows):
- q, q_bias: rows of q heads [r H/N, (r+1) H/N); k, v and their biases: rows of kv heads [r KVH/N, (r+1) KVH/N)
  (grouped-query attention stays within a rank: q head h reads kv head h // (H/KVH))
- gate, up: rows [r I/N, (r+1) I/N); o, down: the matching columns (row-parallel: each rank's product is a partial
  sum, all-reduced by distributed.layers.RowParallelLinear)
- embed, lm_head: the vocabulary rows of ``vocab_range`` (ceil(V/N) a rank, the last fewer)
- the norms, rope_freqs: whole on every rank.

An adapter's LoRA follows its module's split (vLLM's layout, not its fully sharded one: no collective of its own):
- column-parallel q, k, v, gate, up: A [r, in] whole (the input is whole on every rank), B's rows of the rank's
  output shard; the rank's LoRA lands in its own output columns
- row-parallel o, down: A's columns of the rank's input shard, B [out, r] whole; the rank's LoRA, x_local @
  A_local.T @ B.T, is a partial sum like its base product, and joins it before the one all-reduce
  (distributed.layers.RowParallelLoraLinear): sum over ranks of x_r A_r^T B^T = x A^T B^T."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from lora_server.adapters.peft_format import LoraAdapter
from lora_server.config import EngineConfig
from lora_server.errors import ConfigError
from lora_server.model.arch import ModelArch
from lora_server.model.checkpoint import Checkpoint, WeightSource
from lora_server.model.quant import tensor_mode

_LINEARS = re.compile(r"embed|lm_head|layers\.\d+\.(q|k|v|o|gate|up|down)")
_COLUMN_PARALLEL = ("q", "k", "v", "gate", "up")  # split by output rows; o and down by input columns


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank ``rank`` of ``world``'s share of a model whose whole shape is ``arch``."""

    arch: ModelArch
    rank: int
    world: int

    @property
    def local_arch(self) -> ModelArch:
        """The shape build_llama builds on this rank: heads, kv heads and intermediate divided by the world (the
        vocabulary stays whole: the vocabulary-parallel modules know their rows)."""
        a, n = self.arch, self.world
        return dataclasses.replace(
            a, num_heads=a.num_heads // n, num_kv_heads=a.num_kv_heads // n, intermediate_size=a.intermediate_size // n
        )

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.arch.vocab_size // self.world)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """[first, end) of the vocabulary rows this rank holds."""
        per, v = self.vocab_per_rank, self.arch.vocab_size
        return min(self.rank * per, v), min((self.rank + 1) * per, v)

    def split(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, end) of the canonical tensor ``name`` this rank keeps; None: it keeps it whole."""
        local = self.local_arch
        kind = name.rsplit(".", 1)[-1]
        rows = {
            "q": local.q_size,
            "q_bias": local.q_size,
            "k": local.kv_size,
            "k_bias": local.kv_size,
            "v": local.kv_size,
            "v_bias": local.kv_size,
            "gate": local.intermediate_size,
            "up": local.intermediate_size,
        }
        cols = {"o": local.q_size, "down": local.intermediate_size}
        if name in ("embed", "lm_head"):
            return (0, *self.vocab_range)
        if name.startswith("layers.") and kind in rows:
            return 0, self.rank * rows[kind], (self.rank + 1) * rows[kind]
        if name.startswith("layers.") and kind in cols:
            return 1, self.rank * cols[kind], (self.rank + 1) * cols[kind]
        return None

    def adapter(self, adapter: LoraAdapter) -> LoraAdapter:
        """This rank's share of a validated adapter (see the module): B's rows of a column-parallel module's output
        shard, A's columns of a row-parallel module's input shard, the rest whole. Plain LoRA only: DoRA and the
        vocabulary's changes are refused before (TensorParallel.adapter_refusal)."""
        assert not adapter.magnitudes and adapter.vocab is None, "refused under tensor parallelism"
        weights = {}
        for (layer, module), (a, b) in adapter.weights.items():
            if module in _COLUMN_PARALLEL:
                out = b.shape[0] // self.world
                b = b[self.rank * out : (self.rank + 1) * out]
            else:
                width = a.shape[1] // self.world
                a = a[:, self.rank * width : (self.rank + 1) * width]
            weights[(layer, module)] = (a.contiguous(), b.contiguous())
        return dataclasses.replace(adapter, weights=weights)


def check_tensor_parallel(arch: ModelArch, config: EngineConfig, checkpoint: Checkpoint) -> None:
    """Refuse (ConfigError) what this tensor-parallel build would serve wrongly: a world that does not divide the
    heads, the kv heads or the MLP; a linear held quantized (this slice shards dense weights only)."""
    n = config.tensor_parallel_size
    uneven = [
        f"{what} ({count})"
        for what, count in (
            ("num_heads", arch.num_heads),
            ("num_kv_heads", arch.num_kv_heads),
            ("intermediate_size", arch.intermediate_size),
        )
        if count % n
    ]
    if uneven:
        raise ConfigError(
            f"--tensor-parallel-size {n} must divide the model's num_heads ({arch.num_heads}) and num_kv_heads "
            f"({arch.num_kv_heads}) and its intermediate_size ({arch.intermediate_size}); it does not divide "
            + ", ".join(uneven)
        )
    for name, source in checkpoint.weights.items():
        if not _LINEARS.fullmatch(name):
            continue
        mode = tensor_mode(config.quantization, name)
        held = source.native if mode == "auto" else mode
        if held != "none":
            raise ConfigError(
                f"--tensor-parallel-size {n} serves dense weights only: --quantization {config.quantization} holds "
                f"{name} as {held}; pass --quantization none (the weights are dequantized to --dtype)"
            )


class ShardedWeight(WeightSource):
    """One rank's slice of a checkpoint tensor, cut when read (the whole tensor is let go at once)."""

    def __init__(self, source: WeightSource, dim: int, start: int, end: int) -> None:
        self.source, self.dim, self.start, self.end = source, dim, start, end

    def dense(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        whole = self.source.dense(dtype, device)
        return whole.narrow(self.dim, self.start, self.end - self.start).clone(memory_format=torch.contiguous_format)


def shard_checkpoint(checkpoint: Checkpoint, shard: Shard) -> Checkpoint:
    """The checkpoint as rank ``shard.rank`` reads it: its slices of the split tensors, the local arch."""
    weights: dict[str, WeightSource] = {}
    for name, source in checkpoint.weights.items():
        split = shard.split(name)
        weights[name] = source if split is None else ShardedWeight(source, *split)
    return Checkpoint(shard.local_arch, weights, checkpoint.format, checkpoint.path)
