"""The device arena: one buffer of pages that holds the KV cache and the resident adapters' weights, S-LoRA's unified
paging. A page is one KV block's bytes: as KV, every layer's K and V of block_size tokens; as part of an adapter,
a run of its weight blocks (adapters.page_layout), its first page starting with its table (kernels/lora_table.py).
Which page holds what is the pool's decision (kv_pool); this module holds the tensor and its views, and writes an
adapter's staged pages and table where a load says (the runner moves KV pages to and from the host tier).

Owned by the model runner. ``ResidentAdapters`` keeps, for each adapter in the arena (by its table page), its layout,
on the CPU the views the CPU's LoRA path multiplies with, and on every device the views of its embedding and head
changes (views into the arena: no second copy)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lora_server.adapters.lora_types import BaseShapes, LoraAdapter, TokenIds
from lora_server.adapters.page_layout import VOCAB_LAYER, Block, PageGeometry, PageLayout
from lora_server.adapters.peft_adapter import PeftAdapter
from lora_server.kernels import ops
from lora_server.kernels.lora_table import GROUPS
from lora_server.kernels.segment_lora import LoraTerm
from lora_server.model.arch import ModelArch
from lora_server.model.llama import LlamaModel
from lora_server.model.lora import LoraWorkspace, RowRuns, VocabTerms
from lora_server.model.moe import ExpertTerms


class Arena:
    """``num_pages`` pages of ``page_bytes`` on ``device``, zero-filled, and three views of them:

    kv       [pages, layers, 2 (k, v), block_size, kv_heads, head_dim], the KV dtype: page p's KV
    weights  [pages * page_bytes / itemsize], the model's dtype, flat: what adapter tables' offsets index
    table    [pages * page_bytes / 8] int64, flat: page p's table starts at p * table_stride"""

    def __init__(
        self,
        num_pages: int,
        arch: ModelArch,
        block_size: int,
        kv_dtype: torch.dtype,
        weight_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.page_bytes = page_bytes(arch, block_size, kv_dtype)
        self.num_pages = num_pages
        self.pages = torch.zeros(num_pages, self.page_bytes, dtype=torch.uint8, device=device)  # [pages, bytes]
        kv_shape = (num_pages, arch.num_layers, 2, block_size, arch.num_kv_heads, arch.head_dim)
        self.kv = self.pages.view(kv_dtype).view(kv_shape)
        self.weights = self.pages.view(-1).view(weight_dtype)
        self.table = self.pages.view(-1).view(torch.int64)
        self.table_stride = self.page_bytes // 8

    @property
    def nbytes(self) -> int:
        return self.pages.nbytes

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V caches: [pages, block_size, kv_heads, head_dim] each (strided: a page holds
        every layer)."""
        return self.kv[:, layer, 0], self.kv[:, layer, 1]


def page_bytes(arch: ModelArch, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one page: K and V of block_size tokens in every layer, in the cache's dtype (fp8: one byte a value;
    the per-head scales are held apart)."""
    return arch.num_layers * 2 * block_size * arch.num_kv_heads * arch.head_dim * kv_dtype.itemsize


def adapter_shapes(arch: ModelArch) -> BaseShapes:
    """What an adapter of a model shaped ``arch`` must fit: its modules' features, its vocabulary (LoRA on the
    embedding and head is served on every device: model.lora.VocabTerms), its context (what an aLoRA's invocation
    must fit in). With tensor parallelism, ``arch`` is the whole model's for validating adapters and a rank's (its
    share of the heads and the MLP) for their pages."""
    shapes = BaseShapes.llama(
        arch.num_layers,
        arch.hidden_size,
        arch.intermediate_size,
        arch.q_size,
        arch.kv_size,
        fused=arch.fused_projections,
        architecture=arch.architecture,
        head_dim=arch.head_dim,
        vocab_size=arch.vocab_size,
        tied_embeddings=arch.tie_word_embeddings,
        vocab_refusal="",
        max_positions=arch.max_position_embeddings,
    )
    if not arch.num_experts:
        return shapes
    mixtral = arch.architecture == "MixtralForCausalLM"  # PEFT's per-expert module names (adapters.peft_experts)
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    return dataclasses.replace(
        shapes,
        experts=arch.num_experts,
        expert_width=arch.moe_intermediate_size,
        dense_layers=arch.dense_layers,
        experts_path="block_sparse_moe.experts" if mixtral else "mlp.experts",
        expert_modules=dict(zip(names, ("gate", "up", "down"), strict=True)),
    )


def page_geometry(
    arch: ModelArch, block_size: int, kv_dtype: torch.dtype, dtype: torch.dtype, max_rank: int
) -> PageGeometry:
    """How adapters are laid out in the pages of an arena for a model shaped ``arch`` (a rank's, with tensor
    parallelism: every rank lays out its share of an adapter alike, in pages of its own size)."""
    return PageGeometry(page_bytes(arch, block_size, kv_dtype), dtype, max_rank, adapter_shapes(arch))


@dataclass(frozen=True, slots=True)
class AdapterForm:
    """How an engine takes adapters: what they are validated against (the whole model's ``shapes``), why one is
    not served (``refusal``: "" when it is), how each rank's share is laid out in its pages (``geometry``: the same
    layout on every rank) and each rank's share of a validated adapter (``shards``: rank 0's first; None on one
    device, which takes the adapter itself)."""

    shapes: BaseShapes
    geometry: PageGeometry
    refusal: Callable[[LoraAdapter | PeftAdapter], str] = lambda adapter: ""
    shards: Callable[[LoraAdapter], list[LoraAdapter]] | None = None


def attach_arena(
    model: LlamaModel, arena: Arena, geometry: PageGeometry, lora_y: torch.Tensor | None
) -> ResidentAdapters:
    """Serve ``model``'s adapters from ``arena``: its resident adapters (none yet), which every LoRA wrapper and
    the embedding's and head's changes read from then on. ``lora_y``: the LoRA kernels' workspace, where they run."""
    wrappers = model.lora_wrappers()
    starts = {g: w.slice_starts for layer in wrappers for g, w in layer.items()}  # MoE layers: no dense gate_up
    adapters = ResidentAdapters(arena, geometry, starts)
    model.vocab_terms = adapters.vocab
    for moe in model.sparse_mlps():
        moe.expert_terms = adapters.expert_terms
    lora_arena = ops.LoraArena(arena.weights, arena.table, arena.table_stride, geometry.max_rank)
    workspace = LoraWorkspace(lora_arena, adapters.terms, lora_y)
    for layer in wrappers:
        for wrapper in layer.values():
            wrapper.attach(workspace)
    return adapters


@dataclass(slots=True)
class ResidentAdapter:
    layout: PageLayout
    pages: list[int]  # its arena pages, table page first
    # CPU only: [layer][group] -> the terms its LoRA is computed as (segment_lora), views into the arena
    terms: list[dict[str, list[LoraTerm]]] | None = None
    # its changes to the embedding and head: views of its pages, and the trainable tokens' ids
    vocab: VocabTerms | None = None
    # its LoRA on a mixture of experts: [layer] -> its router's and experts' terms (None: none on that layer),
    # views of its pages (model.moe)
    experts: list[ExpertTerms | None] | None = None


class ResidentAdapters:
    """The adapters in the arena, by table page: what an ADAPTER_LOAD wrote and an ADAPTER_UNLOAD forgets. On the
    CPU each also gets its LoRA terms: per layer and fused group, views of its A blocks as [in, K * r] (the group's
    slices at once where they lie back to back with one rank) and of its B^T rows per slice, and of a DoRA module's
    scale and shift (on the group's last term)."""

    def __init__(self, arena: Arena, geometry: PageGeometry, slice_starts: dict[str, list[int]]) -> None:
        self.arena, self.geometry, self.slice_starts = arena, geometry, slice_starts
        self._by_page: dict[int, ResidentAdapter] = {}
        self._cpu = arena.pages.device.type == "cpu"

    def __contains__(self, table_page: int) -> bool:
        return table_page in self._by_page

    def __len__(self) -> int:
        return len(self._by_page)

    def load(
        self, pages: list[int], layout: PageLayout, image: torch.Tensor, token_ids: TokenIds | None = None
    ) -> None:
        """Copy a staged image (uint8 [n, page_bytes], pinned on CUDA) into arena ``pages`` (at least n; the first
        is the table page) and write its table there. Asynchronous on CUDA (the caller's stream): ``image`` must
        stay untouched until the copy has run (torch's pinned allocator keeps it alive). ``token_ids``: the
        trainable tokens' ids of an adapter that changes the embedding or head (the layout's vocabulary pieces,
        whose rows are in the image), kept on the device until it is unloaded."""
        assert len(pages) >= layout.num_pages == image.shape[0], (len(pages), layout.num_pages, image.shape)
        arena = self.arena
        pages = pages[: layout.num_pages]
        if self._cpu:
            arena.pages.index_copy_(0, torch.tensor(pages, dtype=torch.int64), image)
        else:
            for i, page in enumerate(pages):
                arena.pages[page].copy_(image[i], non_blocking=True)
        values = layout.table(pages)
        start = pages[0] * arena.table_stride
        dst = arena.table[start : start + values.size]
        # off the CPU the table goes from pinned memory too: no copy of a load waits for the host
        table = torch.empty(values.size, dtype=torch.int64, pin_memory=dst.device.type != "cpu")
        table.numpy()[:] = values
        dst.copy_(table, non_blocking=True)
        resident = ResidentAdapter(layout, pages)
        assert layout.vocab or all(ids is None for ids in token_ids or ()), "trainable tokens' ids without their rows"
        if layout.vocab:
            pieces = self._vocab_pieces(layout, pages)
            ids = token_ids or TokenIds()
            resident.vocab = VocabTerms(pieces, ids, self.geometry.shapes.vocab_size, arena.pages.device)
        if self._cpu:
            resident.terms = self._terms(layout, pages)
        if layout.experts:
            resident.experts = self._expert_terms(layout, pages)
        self._by_page[pages[0]] = resident

    def pages(self) -> set[int]:
        """Every page that holds an adapter's weights."""
        return {p for resident in self._by_page.values() for p in resident.pages}

    def pages_of(self, table_page: int) -> list[int]:
        """The arena pages of the adapter whose table is on ``table_page``, table page first."""
        return self._by_page[table_page].pages

    def table_pages(self) -> set[int]:
        """The table pages of the adapters in the arena."""
        return set(self._by_page)

    def unload(self, table_page: int) -> None:
        """Forget the adapter whose table is on ``table_page`` (its pages go back to the pool: nothing to copy)."""
        del self._by_page[table_page]

    def vocab(self, table_page: int) -> VocabTerms | None:
        """The embedding and head changes of the adapter whose table is on ``table_page`` (None: it has none)."""
        return self._by_page[table_page].vocab

    def terms(self, table_page: int, layer: int, group: str) -> list[LoraTerm]:
        """The CPU's LoRA terms of one resident adapter's layer and fused group (empty: it targets none of them)."""
        terms = self._by_page[table_page].terms
        assert terms is not None, "LoRA terms are built on the CPU only"
        return terms[layer].get(group, [])

    def expert_terms(self, table_page: int, layer: int) -> ExpertTerms | None:
        """One resident adapter's LoRA on one layer's router and experts (None: it has none there)."""
        experts = self._by_page[table_page].experts
        return None if experts is None else experts[layer]

    def _expert_terms(self, layout: PageLayout, pages: list[int]) -> list[ExpertTerms | None]:
        """Each layer's router terms and expert -> (gate|up terms, down terms): one term per A run (an expert's A
        rows on one page), its outputs the B^T runs of the same rows; gate and up write their half of gate|up,
        gate_up both."""
        runs: dict[tuple[int, str, int, bool], list[tuple[int, torch.Tensor]]] = {}
        for block in layout.blocks:
            if block.expert >= 0:
                runs.setdefault((block.layer, block.module, block.expert, block.is_b), []).append(
                    (block.row0, self._rows(block, pages))
                )
        shapes = self.geometry.shapes
        width, hidden = shapes.expert_width, shapes.hidden
        columns = {"gate": [0, width], "up": [width, 2 * width], "gate_up": [0, 2 * width], "down": [0, hidden]}
        columns["router"] = [0, shapes.experts]
        out: list[ExpertTerms | None] = [None] * shapes.num_layers
        for (layer, module, expert, is_b), a_runs in sorted(runs.items(), key=lambda item: item[0]):
            if is_b:
                continue
            b_runs = runs[(layer, module, expert, True)]
            terms = [
                LoraTerm(a.T, _outputs(0, row0, row0 + a.shape[0], 0, columns[module], b_runs)) for row0, a in a_runs
            ]
            layer_terms = out[layer] = out[layer] or ExpertTerms([], {})
            if module == "router":
                layer_terms.router.extend(terms)
                continue
            gate_up, down = layer_terms.experts.setdefault(expert, ([], []))
            (down if module == "down" else gate_up).extend(terms)
        return out

    def _rows(self, block: Block, pages: list[int]) -> torch.Tensor:
        """The view [rows, width] of the arena that holds ``block`` of an adapter laid out in ``pages``."""
        start = pages[block.page] * self.geometry.page_elems + block.offset
        return self.arena.weights[start : start + (block.row1 - block.row0) * block.width].view(-1, block.width)

    def _vocab_pieces(self, layout: PageLayout, pages: list[int]) -> dict[str, RowRuns]:
        """Views of an adapter's vocabulary pieces in the arena, by name, each as its runs of rows."""
        pieces: dict[str, RowRuns] = {}
        for block in layout.blocks:
            if block.layer == VOCAB_LAYER:
                pieces.setdefault(block.module, []).append((block.row0, block.row1, self._rows(block, pages)))
        return pieces

    def _terms(self, layout: PageLayout, pages: list[int]) -> list[dict[str, list[LoraTerm]]]:
        found: dict[tuple[int, str, bool], list[tuple[int, torch.Tensor]]] = {}
        dora: dict[tuple[int, str], list[torch.Tensor]] = {}  # (layer, module) -> [scale, shift], each [out]
        for block in layout.blocks:
            if block.layer == VOCAB_LAYER or block.expert >= 0:
                continue
            rows = self._rows(block, pages)
            if block.dora:
                dora.setdefault((block.layer, block.module), [rows[0], rows[0]])[block.row0] = rows[0]
                continue
            found.setdefault((block.layer, block.module, block.is_b), []).append((block.row0, rows))
        out: list[dict[str, list[LoraTerm]]] = []
        for layer in range(self.geometry.shapes.num_layers):
            by_group: dict[str, list[LoraTerm]] = {}
            for group, modules in GROUPS.items():
                if group not in self.slice_starts:  # every layer's MLP a mixture of experts
                    continue
                terms = self._group_terms(layer, group, modules, found)
                starts, epilogues = self.slice_starts[group], []
                for k, module in enumerate(modules):
                    if (layer, module) in dora:
                        scale, shift = dora[(layer, module)]  # a shift of zeros (no bias) is left out
                        epilogues.append((starts[k], starts[k + 1], scale, shift if shift.any() else None))
                if epilogues:  # after every term of the group: on its last
                    terms[-1] = dataclasses.replace(terms[-1], epilogues=tuple(epilogues))
                if terms:
                    by_group[group] = terms
            out.append(by_group)
        return out

    def _group_terms(
        self,
        layer: int,
        group: str,
        modules: tuple[str, ...],
        found: dict[tuple[int, str, bool], list[tuple[int, torch.Tensor]]],
    ) -> list[LoraTerm]:
        """One term for the whole group when its A blocks are one [K, r, in] run (every slice targeted with one
        rank, whole, back to back); otherwise a term per A piece (a slice's block, or a row group of it), each
        output pairing the rows it computes with the B^T rows of the same slice that overlap them."""
        starts = self.slice_starts[group]
        a_parts = [found.get((layer, m, False), []) for m in modules]
        b_parts = [found.get((layer, m, True), []) for m in modules]
        if all(len(p) == 1 for p in a_parts) and len({p[0][1].shape for p in a_parts}) == 1:
            first = a_parts[0][0][1]
            rank, width = first.shape
            run = first.as_strided((len(modules) * rank, width), (width, 1))  # every slice's A rows in a row
            if all(run[k * rank].data_ptr() == p[0][1].data_ptr() for k, p in enumerate(a_parts)):
                outputs = [o for k in range(len(modules)) for o in _outputs(k * rank, 0, rank, k, starts, b_parts[k])]
                return [LoraTerm(run.T, outputs)]
        terms = []
        for k, a_list in enumerate(a_parts):
            for row0, a_rows in a_list:
                outputs = _outputs(0, row0, row0 + a_rows.shape[0], k, starts, b_parts[k])
                terms.append(LoraTerm(a_rows.T, outputs))
        return terms


def _outputs(
    y_base: int, row0: int, row1: int, k: int, starts: list[int], b_list: list[tuple[int, torch.Tensor]]
) -> list[tuple[int, int, int, int, torch.Tensor]]:
    """The outputs of y's columns from ``y_base`` on, holding rank rows [row0, row1) of slice k: for each B^T piece
    of slice k that overlaps those rows, (y's first and end column, slice k's columns, the overlapping B^T rows)."""
    out = []
    for b0, bt in b_list:
        lo, hi = max(row0, b0), min(row1, b0 + bt.shape[0])
        if lo < hi:
            out.append((y_base + lo - row0, y_base + hi - row0, starts[k], starts[k + 1], bt[lo - b0 : hi - b0]))
    return out
