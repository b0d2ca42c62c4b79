"""Multi-LoRA in the model: each step's token-to-adapter mapping and the linear wrapper that adds each token's
adapter to a base layer's output, reading the adapter's weights where they live, in the arena (model.arena). Which
adapters exist is the registry's (lora_server.engine.adapter_registry); which are in the arena, and in which pages,
is the pool's (kv_pool)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from lora_server.kernels import ops
from lora_server.kernels.lora_table import GROUPS, MODULE_INDEX, groups
from lora_server.kernels.segment_lora import LoraTerm

if TYPE_CHECKING:
    from lora_server.adapters.peft_format import TokenIds
    from lora_server.model.quant import QuantLinear


@dataclass(slots=True)
class LoraBatch:
    """Each token's adapter for one step. The runner orders a step's tokens so that each adapter's are one run."""

    # (start, end, table page) of every run of tokens with an adapter, as host integers (the CPU path reads these)
    host_segments: list[tuple[int, int, int]]
    tiles: torch.Tensor | None  # [N, 3] int32 the step's tile map (kernels.lora_table) where the kernels run
    block_t: int  # the tile map's rows per tile


@dataclass(frozen=True, slots=True)
class LoraWorkspace:
    """What every LoRA wrapper of a model shares: the arena's views, the resident adapters' CPU terms, and the
    kernels' float32 partial sums (persistent: the LoRA launches allocate nothing)."""

    arena: ops.LoraArena
    terms: Callable[[int, int, str], list[LoraTerm]]  # (table page, layer, group) -> the CPU's terms
    y: torch.Tensor | None  # [splits, 3, max tokens, groups * 16] float32, where the kernels run


class LoraLinear(nn.Module):
    """A base linear plus each token's LoRA: out = base(x) + (x @ A.T) @ B.T per output slice, A and B the token's
    adapter's for this layer and module, read through the adapter's table in the arena."""

    def __init__(self, base: nn.Module, layer: int, group: str, slice_widths: Sequence[int]) -> None:
        super().__init__()
        self.base, self.layer, self.group = base, layer, group
        self.module_base = MODULE_INDEX[GROUPS[group][0]]
        self.slice_starts = [0]
        for width in slice_widths:
            self.slice_starts.append(self.slice_starts[-1] + width)
        self.max_width = max(slice_widths)
        self.slice_align = 8 if all(s % 8 == 0 for s in self.slice_starts) else 1  # the LoRA kernels' load width
        self.workspace: LoraWorkspace | None = None  # set by attach
        self.device_slice_starts: torch.Tensor | None = None  # [K + 1] int32 on the device, where the kernels run

    def attach(self, workspace: LoraWorkspace) -> None:
        """Read adapters from ``workspace`` (the runner's arena)."""
        self.workspace = workspace
        device = workspace.arena.weights.device
        if ops.use_kernels(device):
            self.device_slice_starts = torch.tensor(self.slice_starts, dtype=torch.int32, device=device)

    def detach(self) -> None:
        """Let go of the arena (the runner's warm-up arena, before the real one is allocated)."""
        self.workspace = None

    def forward(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:  # [T, in] -> [T, out_total]
        out = self.base(x)
        self.add_lora(x, out, lora)
        return out

    def add_lora(self, x: torch.Tensor, out: torch.Tensor, lora: LoraBatch | None) -> None:
        """In place: out [T, out_total] (the base's output for x [T, in]) += each token's adapter's LoRA of x."""
        workspace = self.workspace
        if lora is None or workspace is None:
            return
        layer, group, terms = self.layer, self.group, workspace.terms
        ops.apply_lora(
            x,
            out,
            workspace.arena,
            lora.tiles,
            layer=layer,
            module_base=self.module_base,
            slice_starts=self.slice_starts if self.device_slice_starts is None else self.device_slice_starts,
            max_width=self.max_width,
            y=workspace.y,
            block_t=lora.block_t,
            slice_align=self.slice_align,
            host_segments=lambda: [(s, e, terms(page, layer, group)) for s, e, page in lora.host_segments],
        )


RowRuns = list[tuple[int, int, torch.Tensor]]  # a matrix held in runs of rows: (row0, row1, view [row1 - row0, width])


class VocabTerms:
    """One resident adapter's changes to the embedding and the output head (adapters.peft_format.VocabLora), as the
    model applies them to its tokens' rows, on any device: ``pieces`` are views of its matrices in the arena's pages
    (adapters.page_layout.vocab_pieces, each in runs of rows), and the trainable tokens' ids are kept on the device.
    With tensor parallelism every rank holds them whole: each applies the embedding's to the all-reduced rows, and
    rank 0 the head's to the gathered logits.
    Nothing here reads a device value on the host (no sync)."""

    def __init__(self, pieces: dict[str, RowRuns], ids: TokenIds, vocab_size: int, device: torch.device) -> None:
        """``ids``: the trainable tokens' ids, whose rows are embed_rows' and head_rows' in order."""
        self.pieces = pieces
        # token id -> its row in embed_rows, -1 for the ids the adapter does not replace: [vocab] int64
        self.embed_slot: torch.Tensor | None = None
        if ids.embed is not None:
            embed_ids = ids.embed.to(device)
            self.embed_slot = torch.full((vocab_size,), -1, dtype=torch.int64, device=device)
            self.embed_slot[embed_ids] = torch.arange(embed_ids.numel(), device=device)
        # the head rows' token ids [n] int64, in head_rows' order
        self.head_ids = None if ids.head is None else ids.head.to(device)

    @property
    def changes_embedding(self) -> bool:
        return "embed_a_t" in self.pieces or self.embed_slot is not None

    def embed_(self, x: torch.Tensor, ids: torch.Tensor) -> None:
        """In place: x [n, hidden], the embedding rows of token ids [n] (before any embedding scale), become the
        adapter's: + A^T[id] @ B^T (scaled) with LoRA on the embedding; a trainable token's own row."""
        pieces = self.pieces
        if "embed_a_t" in pieces:
            y = _gather(pieces["embed_a_t"], ids)  # [n, r]
            for r0, r1, b_t in pieces["embed_b_t"]:
                x.add_(y[:, r0:r1] @ b_t)
        if self.embed_slot is not None:
            slot = self.embed_slot[ids]
            x.copy_(torch.where((slot >= 0)[:, None], _gather(pieces["embed_rows"], slot), x))

    def head_(self, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """In place: logits [n, >= vocab] float32 of hidden [n, hidden] (before any soft-cap) become the adapter's:
        + (h @ A^T) @ B^T (scaled) with LoRA on the head; a trainable token's column from its own head row."""
        pieces = self.pieces
        if "head_a" in pieces:
            y = torch.cat([hidden @ a.T for _, _, a in pieces["head_a"]], dim=1)  # [n, r]
            for r0, r1, b in pieces["head_b"]:  # b [rows, r]: the scaled B's rows r0:r1, the head's columns
                logits[:, r0:r1] += (y @ b.T).float()
        if self.head_ids is not None:
            for r0, r1, rows in pieces["head_rows"]:
                logits[:, self.head_ids[r0:r1]] = (hidden @ rows.T).float()


def _gather(runs: RowRuns, index: torch.Tensor) -> torch.Tensor:  # index [n] int64 -> [n, width]
    """Rows ``index`` of the matrix held in ``runs``; zeros for an index in no run (-1)."""
    out: torch.Tensor | None = None
    for r0, r1, rows in runs:
        got = rows[(index - r0).clamp(0, r1 - r0 - 1)]
        inside = ((index >= r0) & (index < r1))[:, None]
        out = torch.where(inside, got, 0 if out is None else out)
    assert out is not None, "a piece without rows"
    return out


class BaseRowNorms:
    """What DoRA needs of the base model (adapters.dora.BaseRowNorms): for one (layer, module), ||W + B A|| of each
    output row, W the weight that module's LoRA wrapper's base linear serves (dequantized to the model's dtype), and
    the module's bias; float32 on the host. For the adapter loader's thread: it reads the weights and writes nothing
    the engine reads. On CUDA it runs on a stream of its own and waits for that stream alone (the engine's stream
    and graphs are not touched), W dequantized ``chunk_elems`` values at a time so that it takes little device
    memory beside the arena."""

    def __init__(
        self,
        wrappers: list[dict[str, LoraLinear]],
        dtype: torch.dtype,
        device: torch.device,
        chunk_elems: int = 1 << 22,
    ) -> None:
        self.wrappers, self.dtype, self.device, self.chunk_elems = wrappers, dtype, device, chunk_elems
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @torch.no_grad()
    def __call__(
        self, layer: int, module: str, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # A [r, in], B [out, r] -> ([out], [out] | None)
        group = next(g for g, modules in GROUPS.items() if module in modules)
        wrapper, k = self.wrappers[layer][group], GROUPS[group].index(module)
        base = cast("QuantLinear", wrapper.base)
        first, end = wrapper.slice_starts[k], wrapper.slice_starts[k + 1]  # the module's rows of the fused weight
        chunk = max(1, self.chunk_elems // a.shape[1])
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            a_dev, b_dev = a.to(self.device, torch.float32), b.to(self.device, torch.float32)
            norms = []
            for row in range(first, end, chunk):
                ids = torch.arange(row, min(row + chunk, end), device=self.device)
                w = base.rows(ids, self.dtype).float()  # [rows, in], maybe the weight itself: not in place
                w = torch.addmm(w, b_dev[row - first : row - first + ids.shape[0]], a_dev)
                norms.append(torch.linalg.vector_norm(w, dim=1))
            bias = base.bias
            return torch.cat(norms).cpu(), None if bias is None else bias[first:end].float().cpu()


def workspace_shape(max_tokens: int, max_rank: int) -> tuple[int, int, int, int]:
    """The kernels' partial sums for steps of up to max_tokens rows: [splits, 3 slices, max_tokens, groups * 16]."""
    from lora_server.kernels.lora_shrink import MAX_SPLITS

    return MAX_SPLITS, 3, max_tokens, groups(max_rank) * 16
