"""An adapter in the arena's layout: which of its pages each weight block goes to, the page image that a load copies
to the device, and the table (kernels/lora_table.py) that tells the kernels where the blocks are.

A page is one KV block's bytes (``page_bytes``). An adapter takes as many pages as its own ranks need: its first
page starts with its table, then come its blocks, packed in order (layer, fused group, A, B^T, DoRA's rows): a
group's A blocks of every slice back to back when they fit in a page (so that a CPU matmul can read them as one
[K, r, in] view), else each slice's alone; B^T slice by slice; a block larger than a page in row groups of
ROW_GROUP rows; a DoRA module's scale and shift (adapters.dora) a row each. A unit that does not fit in what is
left of a page starts the next. Blocks: A [r, in], B^T [r, out] (B transposed, its scaling folded in) and DoRA's
[2, out], row-major, in the model's dtype. After the layers come the adapter's changes to the embedding and the head
(``vocab_pieces``: layer VOCAB_LAYER), each matrix in runs of whole rows, as many as what is left of a page holds, so
that a vocabulary-long one spans pages. The image holds every page in order with the table left zero: the table's
offsets depend on which pages the adapter is given, so ``table`` computes it at load (the table does not list the
vocabulary pieces: model.arena reads them through views)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from lora_server.adapters.errors import AdapterError
from lora_server.adapters.lora_types import BaseShapes, LoraAdapter, VocabLora
from lora_server.adapters.peft_adapter import PeftAdapter
from lora_server.kernels.lora_table import (
    GROUPS,
    MODULE_INDEX,
    NUM_MODULES,
    ROW_GROUP,
    dora_column,
    groups,
    row_len,
    table_len,
)

_ALIGN_BYTES = 128  # every unit starts on a 128-byte boundary (whole cache lines and vector loads)
VOCAB_LAYER = -1  # Block.layer of the embedding's and head's pieces (vocab_pieces)
VOCAB_PIECES = ("embed_a_t", "embed_b_t", "head_a", "head_b", "embed_rows", "head_rows")  # vocab_pieces' names


def vocab_pieces(vocab: VocabLora | None) -> dict[str, torch.Tensor]:
    """The matrices that hold an adapter's changes to the embedding and head (adapters.peft_format.VocabLora) in its
    pages, [rows, width] each, by name: embed_a_t [vocab, r] and embed_b_t [r, hidden] (LoRA on the embedding, its
    scaling in embed_b_t), head_a [r, hidden] and head_b [vocab, r] (LoRA on the head, its scaling in head_b),
    embed_rows and head_rows [n, hidden] (trainable tokens' rows; their ids stay with VocabLora)."""
    if vocab is None:
        return {}
    pieces = {}
    if vocab.embed_lora is not None:
        pieces["embed_a_t"], pieces["embed_b_t"] = vocab.embed_lora
    if vocab.head_lora is not None:
        pieces["head_a"], pieces["head_b"] = vocab.head_lora[0], vocab.head_lora[1].t()
    if vocab.embed_tokens is not None:
        pieces["embed_rows"] = vocab.embed_tokens[1]
    if vocab.head_tokens is not None:
        pieces["head_rows"] = vocab.head_tokens[1]
    return pieces


# ((layer, module, expert), rank) of an adapter's LoRA on the experts (LoraAdapter.experts), in order: its widths
# are the geometry's (BaseShapes.expert_features; a rank's share with tensor parallelism), as a module's are
ExpertRanks = tuple[tuple[tuple[int, str, int], int], ...]


def expert_ranks(adapter: LoraAdapter | PeftAdapter) -> ExpertRanks:
    """What a PageLayout needs to place an adapter's LoRA on the experts, in a fixed order."""
    return tuple((key, a.shape[0]) for key, (a, _, _) in sorted(adapter.expert_parts().items()))


def vocab_shapes(vocab: VocabLora | None) -> dict[str, tuple[int, int]]:
    """vocab_pieces' [rows, width] by name: what a PageLayout needs to place them."""
    return {name: (t.shape[0], t.shape[1]) for name, t in vocab_pieces(vocab).items()}


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """What every adapter of an engine is laid out for: the pages' size, the weights' dtype, the largest rank (the
    table's row length) and the base model's module shapes."""

    page_bytes: int
    dtype: torch.dtype
    max_rank: int
    shapes: BaseShapes

    def __post_init__(self) -> None:
        if self.page_bytes % 8 or self.page_bytes % (16 * self.dtype.itemsize):
            # 16 values: every offset a table holds is then a multiple of 16 (blocks start at 128-byte boundaries
            # and row groups are 16 rows), which the LoRA kernels rely on to load 16 bytes at a time
            raise ValueError(f"a page of {self.page_bytes} bytes does not hold whole int64 and 16 {self.dtype} values")

    def check_fits(self) -> None:
        """AdapterError unless a page holds the table and a row group of the widest module (true of real models,
        whose page is every layer's KV of a block: MiBs; a tiny test model may need a larger --block-size)."""
        widest = max(max(f) for f in self.shapes.features.values())
        if min(ROW_GROUP, self.max_rank) * widest > self.page_elems - self.table_elems:
            raise AdapterError(
                f"this model's pages ({self.page_bytes} bytes: one KV block of every layer) cannot hold "
                f"{min(ROW_GROUP, self.max_rank)} rows of {widest} {self.dtype} values beside an adapter table, "
                "so it cannot serve adapters: raise --block-size"
            )

    @property
    def page_elems(self) -> int:
        return self.page_bytes // self.dtype.itemsize

    @property
    def table_elems(self) -> int:
        """Elements (of the weights' dtype) the table takes at the start of an adapter's first page, aligned."""
        return _align(table_len(self.shapes.num_layers, self.max_rank) * 8) // self.dtype.itemsize


def _align(nbytes: int) -> int:
    """nbytes rounded up to the unit alignment."""
    return -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES


@dataclass(frozen=True, slots=True)
class Block:
    """Where one weight block lies in an adapter's pages: rows [row0, row1) of A, B^T or (``dora``) DoRA's [2, out]
    (row 0 the scale, row 1 the shift) of one (layer, module); or, with layer VOCAB_LAYER, of the vocabulary piece
    named ``module`` (vocab_pieces)."""

    layer: int
    module: str
    is_b: bool
    row0: int
    row1: int
    width: int  # elements per row: in (A) or out (B^T, DoRA's); a vocabulary piece's width
    page: int  # index into the adapter's pages
    offset: int  # element offset inside that page
    dora: bool = False  # a row of DoRA's epilogue (is_b is then False)
    expert: int = -1  # an expert's A or B^T (module gate, up, gate_up or down; adapters.peft_experts); -1: not one


class PageLayout:
    """Where each block of one adapter goes in its pages, for a PageGeometry; ``ranks``: (layer, module) -> r for
    the modules it targets; ``dora``: those of them that are DoRA modules (LoraAdapter.magnitudes' keys);
    ``vocab``: the [rows, width] of its embedding and head pieces by name (vocab_shapes)."""

    def __init__(
        self,
        geometry: PageGeometry,
        ranks: dict[tuple[int, str], int],
        dora: Collection[tuple[int, str]] = (),
        vocab: Mapping[str, tuple[int, int]] | None = None,
        experts: ExpertRanks = (),
    ) -> None:
        geometry.check_fits()
        if any(r > geometry.max_rank for r in ranks.values()):
            raise AdapterError(f"rank {max(ranks.values())} is above the server's maximum {geometry.max_rank}")
        self.geometry, self.ranks, self.dora = geometry, dict(ranks), frozenset(dora)
        assert all(ranks.get(key, 0) > 0 for key in self.dora), "a DoRA module the adapter does not target"
        self.blocks: list[Block] = []
        self.num_pages = 1
        self._cursor = geometry.table_elems
        features, item = geometry.shapes.features, geometry.dtype.itemsize
        for layer in range(geometry.shapes.num_layers):
            for modules in GROUPS.values():
                targeted = [m for m in modules if ranks.get((layer, m), 0) > 0]
                self._place_unit(layer, False, [(m, ranks[(layer, m)], features[m][0]) for m in targeted], item)
                for m in targeted:  # B^T slice by slice: nothing reads them as one
                    self._place_unit(layer, True, [(m, ranks[(layer, m)], features[m][1])], item)
                for m in (m for m in targeted if (layer, m) in self.dora):
                    for row in (0, 1):  # scale, shift: a unit each, so that each fits what a page has room for
                        page, offset = self._claim(features[m][1], item)
                        self.blocks.append(Block(layer, m, False, row, row + 1, features[m][1], page, offset, True))
        self.vocab = dict(vocab or {})
        for name, (rows, width) in self.vocab.items():
            self._place_rows(VOCAB_LAYER, name, rows, width, item)
        self.experts = experts
        for (layer, module, expert), rank in experts:  # A, then B^T, each in runs of whole rows
            in_f, out_f = geometry.shapes.expert_features(module)
            self._place_rows(layer, module, rank, in_f, item, expert=expert)
            self._place_rows(layer, module, rank, out_f, item, expert=expert, is_b=True)
        self.gaps = self._gaps()

    def _gaps(self) -> list[tuple[int, int, int]]:
        """(page, first element, end element) of every run of the pages that no block covers: the table, what
        alignment leaves between blocks, each page's tail."""
        covered: list[list[tuple[int, int]]] = [[] for _ in range(self.num_pages)]
        for block in self.blocks:
            covered[block.page].append((block.offset, block.offset + (block.row1 - block.row0) * block.width))
        gaps, page_elems = [], self.geometry.page_elems
        for page, runs in enumerate(covered):
            at = 0
            for start, end in sorted(runs):
                if start > at:
                    gaps.append((page, at, start))
                at = max(at, end)
            if at < page_elems:
                gaps.append((page, at, page_elems))
        return gaps

    def _place_rows(
        self, layer: int, name: str, rows: int, width: int, item: int, expert: int = -1, is_b: bool = False
    ) -> None:
        """Put a vocabulary piece or an expert's A or B^T [rows, width] in runs of whole rows: as many as what is
        left of the page holds, the rest on the next pages (a row is at most hidden wide: check_fits makes room for
        16 of those)."""
        page_elems, row0 = self.geometry.page_elems, 0
        while row0 < rows:
            fit = (page_elems - self._cursor) // width
            if fit == 0:
                self.num_pages, self._cursor = self.num_pages + 1, 0
                fit = page_elems // width
            row1 = min(rows, row0 + fit)
            page, offset = self._claim((row1 - row0) * width, item)
            self.blocks.append(Block(layer, name, is_b, row0, row1, width, page, offset, expert=expert))
            row0 = row1

    def _place_unit(self, layer: int, is_b: bool, pieces: list[tuple[str, int, int]], item: int) -> None:
        """Put one unit (these blocks back to back) where it fits whole; split it per module, then per row group,
        when it is larger than a page."""
        if not pieces:
            return
        size = sum(r * w for _, r, w in pieces)
        page_elems = self.geometry.page_elems
        if size > page_elems and len(pieces) > 1:
            for piece in pieces:
                self._place_unit(layer, is_b, [piece], item)
            return
        if size > page_elems:  # one module's block: its row groups one by one
            module, r, w = pieces[0]
            for row0 in range(0, r, ROW_GROUP):
                row1 = min(r, row0 + ROW_GROUP)
                page, offset = self._claim((row1 - row0) * w, item)
                self.blocks.append(Block(layer, module, is_b, row0, row1, w, page, offset))
            return
        page, offset = self._claim(size, item)
        for module, r, w in pieces:
            self.blocks.append(Block(layer, module, is_b, 0, r, w, page, offset))
            offset += r * w

    def _claim(self, size: int, item: int) -> tuple[int, int]:
        """(page, offset) of ``size`` elements at the cursor, on the next page when they do not fit in this one."""
        if self._cursor + size > self.geometry.page_elems:
            self.num_pages += 1
            self._cursor = 0
        place = (self.num_pages - 1, self._cursor)
        self._cursor += _align(size * item) // item
        return place

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.geometry.page_bytes

    def image(
        self,
        adapter: LoraAdapter | PeftAdapter,
        out: torch.Tensor | None = None,
        dora: Mapping[tuple[int, str], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The adapter's pages as the device will hold them: uint8 [num_pages, page_bytes], the table left zero,
        unused bytes zero; written into ``out`` when given (the caller's memory, of that shape: its blocks written,
        the gaps between them zeroed, nothing written twice). ``dora``: the
        [2, out] epilogue of each DoRA module (adapters.dora.dora_epilogues), exactly the layout's.

        Each block is one copy from the adapter's tensors; a PeftAdapter's B is scaled in that copy, rounded once
        into the pages' dtype from its float32 product, so that its pages equal those of its LoraAdapter (whose B
        was scaled in float32) byte for byte."""
        assert set(dora or {}) == self.dora, "the DoRA epilogues are not the layout's DoRA modules"
        pieces = vocab_pieces(adapter.vocab)
        assert vocab_shapes(adapter.vocab) == self.vocab, "the adapter's vocabulary pieces are not the layout's"
        g = self.geometry
        shape = (self.num_pages, g.page_bytes)
        if out is None:
            pages = torch.zeros(shape, dtype=torch.uint8)
        else:
            assert out.shape == shape and out.dtype == torch.uint8, (tuple(out.shape), out.dtype, shape)
            pages = out
        values = pages.view(-1).view(g.dtype).view(self.num_pages, g.page_elems)
        if out is not None:  # what no block writes (a reused buffer's old bytes)
            for page, start, end in self.gaps:
                values[page, start:end].zero_()
        parts, experts = adapter.scaled_parts(), adapter.expert_parts()
        assert expert_ranks(adapter) == self.experts, "the adapter's experts are not the layout's"
        for block in self.blocks:
            dst = values[block.page, block.offset : block.offset + (block.row1 - block.row0) * block.width]
            dst = dst.view(block.row1 - block.row0, block.width)
            if block.layer == VOCAB_LAYER:
                dst.copy_(pieces[block.module][block.row0 : block.row1])
            elif block.expert >= 0:
                a, b, scaling = experts[(block.layer, block.module, block.expert)]
                src = b[:, block.row0 : block.row1].t() if block.is_b else a[block.row0 : block.row1]
                _scaled_copy(dst, src, scaling if block.is_b else 1.0)
            elif dora and block.dora:
                dst.copy_(dora[(block.layer, block.module)][block.row0 : block.row1])
            else:
                a, b, scaling = parts[(block.layer, block.module)]
                if block.is_b:
                    _scaled_copy(dst, b[:, block.row0 : block.row1].t(), scaling)
                else:
                    _scaled_copy(dst, a[block.row0 : block.row1], 1.0)
        return pages

    def table(self, pages: list[int]) -> np.ndarray:
        """The table (int64 [table_len]) of the adapter laid out in arena pages ``pages`` (its pages in order):
        offsets into the arena's flat weight view, -1 where there is no block."""
        g = self.geometry
        num_groups, width = groups(g.max_rank), row_len(g.max_rank)
        table = np.full((g.shapes.num_layers, NUM_MODULES, width), -1, dtype=np.int64)
        table[:, :, 0] = 0
        for (layer, module), r in self.ranks.items():
            table[layer, MODULE_INDEX[module], 0] = r
        page_elems = g.page_elems
        for block in self.blocks:
            if block.layer == VOCAB_LAYER or block.expert >= 0:  # read through views (model.arena)
                continue
            base = pages[block.page] * page_elems + block.offset
            if block.dora:
                table[block.layer, MODULE_INDEX[block.module], dora_column(g.max_rank) + block.row0] = base
                continue
            column = 1 + (num_groups if block.is_b else 0)
            for row in range(block.row0, block.row1, ROW_GROUP):
                table[block.layer, MODULE_INDEX[block.module], column + row // ROW_GROUP] = (
                    base + (row - block.row0) * block.width
                )
        return table.reshape(-1)


def adapter_ranks(adapter: LoraAdapter | PeftAdapter) -> dict[tuple[int, str], int]:
    """(layer, module) -> rank of every module the adapter targets."""
    return adapter.ranks


def _scaled_copy(dst: torch.Tensor, src: torch.Tensor, scaling: float) -> None:
    """dst = src * scaling, as float32 computes it from src's values (float64 first rounded to float32, as a
    LoraAdapter's are), rounded once into dst's dtype."""
    if src.dtype == torch.float64:
        src = src.float()
    if src.dtype == dst.dtype and not src.is_contiguous():  # B^T: numpy copies a transpose ~3x as fast as torch
        np.copyto(_bits(dst), _bits(src))
        if scaling != 1.0:
            dst.mul_(scaling)  # the same float32 product and rounding as torch.mul(src, scaling, out=dst)
    elif scaling == 1.0:
        dst.copy_(src)
    elif src.dtype == dst.dtype or src.dtype == torch.float32:  # opmath: float32 product, one rounding into dst
        torch.mul(src, scaling, out=dst)
    elif dst.dtype == torch.float32:  # a wider dst holds src exactly
        dst.copy_(src)
        dst.mul_(scaling)
    else:
        dst.copy_(src.float().mul_(scaling))


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's elements as unsigned integers of their width (numpy has no bfloat16): copies move them exactly."""
    return tensor.view(_UINTS[tensor.element_size()]).numpy()


_UINTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
