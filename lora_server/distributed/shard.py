"""How each checkpoint tensor is split across the ranks: a transform of the Checkpoint at load time (each rank
reads a tensor, keeps its slice and lets the rest go), so that build_llama builds the rank's shard as it builds a
whole model, from a ModelArch with the rank's share of the heads and of the MLP.

Rank r of N holds (H q heads, KVH kv heads, I intermediate, V vocabulary rows):
- q, q_bias: rows of q heads [r H/N, (r+1) H/N); k, v and their biases: rows of kv heads [r KVH/N, (r+1) KVH/N)
  (grouped-query attention stays within a rank: q head h reads kv head h // (H/KVH))
- gate, up: rows [r I/N, (r+1) I/N); o, down: the matching columns (row-parallel: each rank's product is a partial
  sum, all-reduced by distributed.layers.RowParallelLinear)
- a mixture of experts' experts (model.moe): each expert split as a dense MLP is, over its own width W (gate, up:
  rows [r W/N, (r+1) W/N); down: those columns), so that each rank's weighted sum over a token's experts is a
  partial sum of the whole, all-reduced once after the layer's experts (distributed.layers.RowParallelMoE); the
  router whole on every rank (every rank routes alike: the same input, the same weights). vLLM's tensor-parallel
  MoE splits the experts so too: every rank holds every expert, 1/N of each, the memory divided, the routing
  unchanged (expert parallelism, whole experts per rank, would balance only as the routing does)
- embed, lm_head: the vocabulary rows of ``vocab_range`` (ceil(V/N) a rank, the last fewer)
- the norms, rope_freqs: whole on every rank.

A quantized weight is quantized whole, as at TP=1, then its packed codes are cut along the same axis with their
scales (``shard_linear``): every rank computes with TP=1's very codes. A row-parallel cut must fall on a
quantization group's edge (int4's groups, a grouped int8's, a GGUF block); a per-channel scale (int8, fp8) stays
whole. fp8 and W8A8-int8 quantize their input per token at every call: on the row-parallel o and down each rank
scales its share of a token by that share's own maximum (as vLLM does), so their results differ from TP=1's by
that rounding; every other mode computes TP=1's products, summed in another order.

An adapter's LoRA follows its module's split (vLLM's layout, not its fully sharded one: no collective of its own):
- column-parallel q, k, v, gate, up: A [r, in] whole (the input is whole on every rank), B's rows of the rank's
  output shard; the rank's LoRA lands in its own output columns
- row-parallel o, down: A's columns of the rank's input shard, B [out, r] whole; the rank's LoRA, x_local @
  A_local.T @ B.T, is a partial sum like its base product, and joins it before the one all-reduce
  (distributed.layers.RowParallelLoraLinear): sum over ranks of x_r A_r^T B^T = x A^T B^T
- an expert's LoRA alike: gate, up, gate_up (both halves' rows of the rank) column-parallel, down row-parallel."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lora_server.adapters.peft_format import LoraAdapter
from lora_server.config import EngineConfig
from lora_server.errors import ConfigError
from lora_server.kernels.gguf_reference import GGUF_BLOCKS
from lora_server.model.arch import ModelArch
from lora_server.model.checkpoint import Checkpoint, WeightSource
from lora_server.model.gguf_linear import GGUFBlockLinear
from lora_server.model.quant import (
    DenseLinear,
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    Int8TokenInput,
    PermutedInput,
    QuantLinear,
)

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
            a,
            num_heads=a.num_heads // n,
            num_kv_heads=a.num_kv_heads // n,
            intermediate_size=a.intermediate_size // n,
            moe_intermediate_size=a.moe_intermediate_size // n,
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
        if ".experts." in name:  # layers.{i}.experts.{e}.gate / up / down: the expert's own width
            rows["gate"] = rows["up"] = cols["down"] = local.moe_intermediate_size
        if name in ("embed", "lm_head"):
            return (0, *self.vocab_range)
        if name.startswith("layers.") and kind in rows:
            return 0, self.rank * rows[kind], (self.rank + 1) * rows[kind]
        if name.startswith("layers.") and kind in cols:
            return 1, self.rank * cols[kind], (self.rank + 1) * cols[kind]
        return None

    def adapter(self, adapter: LoraAdapter) -> LoraAdapter:
        """This rank's share of a validated adapter (see the module): B's rows of a column-parallel module's output
        shard, A's columns of a row-parallel module's input shard, the rest whole (its changes to the embedding and
        head: each rank applies them to whole rows, model.lora.VocabTerms). DoRA is refused before
        (TensorParallel.adapter_refusal)."""
        assert not adapter.magnitudes, "refused under tensor parallelism"
        weights = {}
        for (layer, module), (a, b) in adapter.weights.items():
            if module in _COLUMN_PARALLEL:
                out = b.shape[0] // self.world
                b = b[self.rank * out : (self.rank + 1) * out]
            else:
                width = a.shape[1] // self.world
                a = a[:, self.rank * width : (self.rank + 1) * width]
            weights[(layer, module)] = (a.contiguous(), b.contiguous())
        width, full = self.local_arch.moe_intermediate_size, self.arch.moe_intermediate_size
        rows = torch.arange(self.rank * width, (self.rank + 1) * width)
        experts = {}
        for (layer, module, expert), (a, b) in adapter.experts.items():
            if module == "router":  # whole, as the router is
                pass
            elif module == "down":
                a = a[:, rows]
            else:  # gate, up: the rank's rows; gate_up: the rank's rows of each half
                b = b[torch.cat([rows, rows + full])] if module == "gate_up" else b[rows]
            experts[(layer, module, expert)] = (a.contiguous(), b.contiguous())
        return dataclasses.replace(adapter, weights=weights, experts=experts)


def check_tensor_parallel(arch: ModelArch, config: EngineConfig) -> None:
    """Refuse (ConfigError) a world that does not divide the heads, the kv heads or the MLP (a quantized weight
    that cannot be cut where its rank's share begins is refused as it is read: shard_linear)."""
    n = config.tensor_parallel_size
    uneven = [
        f"{what} ({count})"
        for what, count in (
            ("num_heads", arch.num_heads),
            ("num_kv_heads", arch.num_kv_heads),
            ("intermediate_size", arch.intermediate_size),
            ("moe_intermediate_size", arch.moe_intermediate_size),
        )
        if count % n
    ]
    if uneven:
        raise ConfigError(
            f"--tensor-parallel-size {n} must divide the model's num_heads ({arch.num_heads}) and num_kv_heads "
            f"({arch.num_kv_heads}) and its intermediate_size ({arch.intermediate_size}; a mixture of experts' "
            "moe_intermediate_size too); it does not divide " + ", ".join(uneven)
        )


def shard_linear(module: QuantLinear, dim: int, start: int, end: int, name: str) -> QuantLinear:
    """Rows (``dim`` 0) or input columns (1) [start, end) of a linear as it is held (see the module): its packed
    weight cut along that axis with its scales, copies, so that the whole tensor is let go. ConfigError naming the
    tensor where a column cut falls inside a quantization group or through act-order's gathered columns."""

    def cut(t: torch.Tensor, axis: int, a: int, b: int) -> torch.Tensor:
        return t.narrow(axis, a, b - a).clone(memory_format=torch.contiguous_format)

    def columns(t: torch.Tensor, width: int, per: int) -> torch.Tensor:
        """``t``'s columns for input columns [start, end), where each ``width`` input columns (a group) are ``per``
        of t's."""
        if start % width or end % width:
            raise ConfigError(
                f"{name} cannot be split across the ranks at input column {start if start % width else end}: it is "
                f"held in groups of {width} columns; use another --tensor-parallel-size, or --quantization none or "
                "int8 (which re-quantize it per channel)"
            )
        return cut(t, 1, start * per // width, end * per // width)

    if dim == 1 and module.bias is not None:
        raise ConfigError(f"{name} has a bias: a row-parallel bias would be added once per rank")
    bias = None if module.bias is None else cut(module.bias.data, 0, start, end)
    if isinstance(module, DenseLinear):
        return DenseLinear(cut(module.weight.data, dim, start, end), bias)
    if isinstance(module, Fp8Linear):  # per-channel scales: rows cut, whole for a column cut
        scales = cut(module.scales, 0, start, end) if dim == 0 else module.scales
        return Fp8Linear(cut(module.qweight, dim, start, end), scales, bias)
    if isinstance(module, Int8Linear):
        groups = module.scales.shape[1]
        if dim == 0:
            return Int8Linear(cut(module.qweight, 0, start, end), cut(module.scales, 0, start, end), bias)
        width = module.qweight.shape[1] // groups
        scales = module.scales if groups == 1 else columns(module.scales, width, 1)
        per = 1 if groups == 1 else width  # a per-channel weight's columns cut anywhere
        return Int8Linear(columns(module.qweight, per, per), scales, bias)
    if isinstance(module, Int4Linear):
        if dim == 0:
            packed, scales, mins = (cut(t, 0, start, end) for t in (module.packed, module.scales, module.mins))
            return Int4Linear(packed, scales, mins, bias, module.pack)
        group, pairs = module.group_size, module.pack or module.group_size  # nibbles pair within `pairs` columns
        packed = columns(module.packed, max(group, pairs), max(group, pairs) // 2)
        scales, mins = columns(module.scales, group, 1), columns(module.mins, group, 1)
        return Int4Linear(packed, scales, mins, pack=module.pack)
    if isinstance(module, GGUFBlockLinear):
        values, nbytes = GGUF_BLOCKS[module.kind]
        blocks = cut(module.blocks, 0, start, end) if dim == 0 else columns(module.blocks, values, nbytes)
        return GGUFBlockLinear(module.kind, blocks, bias)
    if isinstance(module, Int8TokenInput):
        return Int8TokenInput(shard_linear(module.inner, dim, start, end, name))
    if isinstance(module, PermutedInput):
        if dim == 1:
            raise ConfigError(
                f"{name} gathers its input columns (act-order GPTQ): a rank's share of them is not contiguous, so it "
                "cannot be split across the ranks; use --quantization none or int8 (which re-quantize it in order)"
            )
        return PermutedInput(shard_linear(module.inner, 0, start, end, name), module.perm)
    raise ConfigError(f"{name}: a {type(module).__name__} is not split across the ranks")


class ShardedWeight(WeightSource):
    """One rank's slice of the checkpoint tensor ``name``, cut when read (the whole tensor is let go at once); as a
    linear, the whole one built as at TP=1 (quantized as it would be) and then cut (shard_linear)."""

    def __init__(self, name: str, source: WeightSource, dim: int, start: int, end: int) -> None:
        self.name, self.source, self.dim, self.start, self.end = name, source, dim, start, end
        self.native = source.native

    def dense(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        whole = self.source.dense(dtype, device)
        return whole.narrow(self.dim, self.start, self.end - self.start).clone(memory_format=torch.contiguous_format)

    def linear(self, mode: str, dtype: torch.dtype, device: torch.device) -> QuantLinear:
        whole = self.source.linear(mode, dtype, device)
        return shard_linear(whole, self.dim, self.start, self.end, self.name)


def shard_checkpoint(checkpoint: Checkpoint, shard: Shard) -> Checkpoint:
    """The checkpoint as rank ``shard.rank`` reads it: its slices of the split tensors, the local arch."""
    weights: dict[str, WeightSource] = {}
    for name, source in checkpoint.weights.items():
        split = shard.split(name)
        weights[name] = source if split is None else ShardedWeight(name, source, *split)
    return Checkpoint(shard.local_arch, weights, checkpoint.format, checkpoint.path)
