"""adapters.page_layout: where an adapter's blocks go in its pages, its table, its image. A small case by hand
(every offset computed here from the packing rule), then larger adapters that split per module and per row group,
checked against the rule's invariants and by reading every weight back through the table, the kernels' way; the
embedding's and head's pieces by hand."""

from __future__ import annotations

import pytest
import torch

from lora_server.adapters.page_layout import VOCAB_LAYER, PageGeometry, PageLayout, vocab_shapes
from lora_server.adapters.peft_format import AdapterError, BaseShapes, LoraAdapter, VocabLora
from lora_server.kernels.lora_table import MODULE_INDEX, MODULES, ROW_GROUP, groups, row_len

# 2 layers, hidden 8, intermediate 16, q 8, kv 4
SHAPES = BaseShapes.llama(2, 8, 16, 8, 4)


def _adapter(ranks: dict[tuple[int, str], int], seed: int = 0) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for (layer, module), r in ranks.items():
        in_f, out_f = SHAPES.features[module]
        weights[(layer, module)] = (torch.randn(r, in_f, generator=gen), torch.randn(out_f, r, generator=gen))
    return LoraAdapter("t", None, max(ranks.values()), weights)  # type: ignore[arg-type]


def test_a_small_adapter_by_hand():
    # pages of 2048 bytes = 512 float32; the table: 2 layers x 7 modules x (1 + 2 * 1 + 2) int64 = 560 bytes, 640
    # aligned
    geometry = PageGeometry(2048, torch.float32, 16, SHAPES)
    assert (geometry.page_elems, geometry.table_elems) == (512, 160)
    layout = PageLayout(geometry, {(0, "q"): 4, (0, "v"): 4})
    # layer 0, qkv, A: q [4, 8] at 160, v [4, 8] right after (64 elements, 256 bytes); then B^T: q [4, 8] at 224,
    # v [4, 4] at 256 (48 elements, 192 bytes -> 256 aligned)
    where = {(b.module, b.is_b): (b.page, b.offset, b.row0, b.row1) for b in layout.blocks}
    assert where == {
        ("q", False): (0, 160, 0, 4),
        ("v", False): (0, 192, 0, 4),
        ("q", True): (0, 224, 0, 4),
        ("v", True): (0, 256, 0, 4),
    }
    assert layout.num_pages == 1 and layout.nbytes == 2048
    table = layout.table([5]).reshape(2, 7, 5)  # given arena page 5: offsets + 5 * 512; no DoRA rows (-1)
    assert table[0, MODULE_INDEX["q"]].tolist() == [4, 2720, 2784, -1, -1]
    assert table[0, MODULE_INDEX["v"]].tolist() == [4, 2752, 2816, -1, -1]
    assert table[0, MODULE_INDEX["k"]].tolist() == [0, -1, -1, -1, -1]
    assert (table[1, :, 0] == 0).all() and (table[1, :, 1:] == -1).all()


def _check_by_table(layout: PageLayout, adapter: LoraAdapter, pages: list[int], num_pages: int) -> None:
    """Place the image in an arena of num_pages at ``pages`` and read every block back through the table."""
    g = layout.geometry
    arena = torch.full((num_pages, g.page_bytes), 0xFF, dtype=torch.uint8)  # 0xFF bytes: NaN as float32
    image = layout.image(adapter)
    for i, page in enumerate(pages):
        arena[page] = image[i]
    weights = arena.view(-1).view(torch.float32)
    table = layout.table(pages).reshape(SHAPES.num_layers, len(MODULES), row_len(g.max_rank))
    for layer in range(SHAPES.num_layers):
        for module in MODULES:
            row = table[layer, MODULE_INDEX[module]]
            pair = adapter.weights.get((layer, module))
            if pair is None:
                assert row[0] == 0 and (row[1:] == -1).all()
                continue
            a, b = pair
            r = a.shape[0]
            assert row[0] == r
            for mat, first in ((a, 1), (b.t(), 1 + groups(g.max_rank))):
                width = mat.shape[1]
                for g_i in range(groups(g.max_rank)):
                    rows = mat[g_i * ROW_GROUP : (g_i + 1) * ROW_GROUP]
                    if rows.numel() == 0:
                        assert row[first + g_i] == -1
                        continue
                    start = int(row[first + g_i])
                    got = weights[start : start + rows.numel()].view(-1, width)
                    assert torch.equal(got, rows), (layer, module, g_i)


@pytest.mark.parametrize(
    ("page_bytes", "max_rank", "ranks"),
    [
        pytest.param(2048, 16, {(i, m): 8 for i in range(2) for m in MODULES}, id="every-module-r8"),
        pytest.param(2048, 32, {(0, "gate"): 32, (0, "up"): 32, (1, "down"): 20, (1, "q"): 3}, id="row-groups"),
        pytest.param(1664, 16, {(0, "gate"): 16, (0, "up"): 16, (0, "q"): 16, (1, "v"): 1}, id="per-module"),
    ],
)
def test_blocks_fit_their_pages_and_read_back_through_the_table(page_bytes, max_rank, ranks):
    geometry = PageGeometry(page_bytes, torch.float32, max_rank, SHAPES)
    adapter = _adapter(ranks, seed=len(ranks))
    layout = PageLayout(geometry, ranks)
    spans: dict[int, list[tuple[int, int]]] = {}
    for block in layout.blocks:
        size = (block.row1 - block.row0) * block.width
        assert block.offset >= 0 and block.offset + size <= geometry.page_elems, block  # never across a page
        assert block.page > 0 or block.offset >= geometry.table_elems, block  # never over the table
        assert (block.row1 - block.row0) <= ROW_GROUP or block.row0 == 0, block  # split blocks are row groups
        spans.setdefault(block.page, []).append((block.offset, block.offset + size))
    for intervals in spans.values():
        intervals.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(intervals, intervals[1:], strict=False))
    needed = sum(r * (sum(SHAPES.features[m])) for (_, m), r in ranks.items()) * 4 + geometry.table_elems * 4
    assert layout.num_pages == max(spans) + 1 >= -(-needed // page_bytes)
    _check_by_table(layout, adapter, [7, 2, 5, 0, 3, 6][: layout.num_pages], 8)  # pages scattered in the arena


def test_a_page_too_small_for_a_row_group_is_refused():
    geometry = PageGeometry(1024, torch.float32, 16, SHAPES)  # 16 rows of 16 floats beside the table need more
    with pytest.raises(AdapterError, match="raise --block-size"):
        PageLayout(geometry, {(0, "q"): 4})


def test_vocabulary_pieces_by_hand():
    """The embedding's and head's pieces after the layers, in runs of whole rows: as many as what is left of the
    page holds, the rest on the next page; read back from the image. Pages of 512 float32 (table 160)."""
    vocab, r = 300, 2
    gen = torch.Generator().manual_seed(2)
    lora = VocabLora(
        embed_lora=(torch.randn(vocab, r, generator=gen), torch.randn(r, 8, generator=gen)),
        head_lora=(torch.randn(r, 8, generator=gen), torch.randn(r, vocab, generator=gen)),
        embed_tokens=(torch.tensor([1, 2, 3]), torch.randn(3, 8, generator=gen)),
        head_tokens=(torch.tensor([4, 5]), torch.randn(2, 8, generator=gen)),
    )
    adapter = _adapter({(0, "q"): 4})
    adapter.vocab = lora
    geometry = PageGeometry(2048, torch.float32, 16, SHAPES)
    layout = PageLayout(geometry, {(0, "q"): 4}, vocab=vocab_shapes(lora))
    # q's A [4, 8] at 160, B^T [4, 8] at 192: the cursor at 224. embed_a_t [300, 2]: (512 - 224) // 2 = 144 rows on
    # page 0 (to 512), 156 rows (312 values, 1248 bytes -> 1280) at page 1's start: the cursor at 320. embed_b_t
    # [2, 8] at 320 (64 bytes -> 128), head_a at 352; head_b [300, 2]: (512 - 384) // 2 = 64 rows at 384, 236 rows
    # (472 values, 1888 bytes -> 1920) on page 2: the cursor at 480; embed_rows [3, 8]: (512 - 480) // 8 = 4 rows fit,
    # at 480; head_rows on page 3
    where = [(b.module, b.row0, b.row1, b.page, b.offset) for b in layout.blocks if b.layer == VOCAB_LAYER]
    assert where == [
        ("embed_a_t", 0, 144, 0, 224),
        ("embed_a_t", 144, 300, 1, 0),
        ("embed_b_t", 0, 2, 1, 320),
        ("head_a", 0, 2, 1, 352),
        ("head_b", 0, 64, 1, 384),
        ("head_b", 64, 300, 2, 0),
        ("embed_rows", 0, 3, 2, 480),
        ("head_rows", 0, 2, 3, 0),
    ]
    assert layout.num_pages == 4
    values = layout.image(adapter).view(-1).view(torch.float32).view(4, 512)
    whole = {
        "embed_a_t": lora.embed_lora[0],
        "embed_b_t": lora.embed_lora[1],
        "head_a": lora.head_lora[0],
        "head_b": lora.head_lora[1].t(),
        "embed_rows": lora.embed_tokens[1],
        "head_rows": lora.head_tokens[1],
    }
    for name, _, _, _, _ in where:
        runs = [b for b in layout.blocks if b.module == name]
        got = torch.cat([values[b.page, b.offset : b.offset + (b.row1 - b.row0) * b.width] for b in runs])
        assert torch.equal(got.view(-1, runs[0].width), whole[name])
    table = layout.table([0, 1, 2, 3]).reshape(2, 7, 5)  # the table lists q alone
    assert (table[:, :, 0] > 0).sum() == 1
