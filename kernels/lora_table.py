"""How the LoRA kernels find an adapter's weights in the arena: the adapter table and the step's tile map.

The arena is the engine's one device buffer of pages (a page is one KV block's bytes); a resident adapter occupies
pages of it at its own rank. Its first page (its *table page*) starts with its table, int64 values that the kernels
read through a flat int64 view of the arena; the weights are read through a flat view in the model's dtype. For
each layer and module (MODULES order) the table holds one row of ``row_len(max_rank)`` values:

    row = (layer * NUM_MODULES + module) * row_len(max_rank), relative to the table page's first int64
    table[row]              r, the module's rank in this layer (0: the adapter does not target it)
    table[row + 1 + g]      where rows 16g .. 16g + 15 of A [r, in] start (A row-major: row stride in)
    table[row + 1 + G + g]  where rows 16g .. 16g + 15 of B^T [r, out] start (row stride out; scaling folded in)
    table[row + 1 + 2G]     DoRA: where the scale s [out] starts (-1: not a DoRA module)
    table[row + 2 + 2G]     DoRA: where the shift [out] starts (-1 likewise)

for g < G = groups(max_rank). Offsets are element indices into the arena's flat weight view; the rows of one group
are contiguous (the last group of a module holds r - 16g rows: nothing is padded to 16); groups at or past
ceil(r / 16) hold -1. A group never straddles two pages, so an adapter's pages need not be contiguous; groups
start on 128-byte boundaries (the packer aligns them). Every table of an arena has the engine's max_rank, and
r <= max_rank (kernels clamp to it). A page holds every layer's KV of one block (MiBs on real models), so the
table and 16 rows of the widest module fit one page; adapters.page_layout.PageGeometry refuses a page that does
not. A DoRA module's output columns become out * s + shift after base + LoRA (its epilogue, which the expand
applies; adapters.dora says what s and the shift are); s and the shift are one row each, each on one page.

The tile map of a step lists the work of every LoRA launch in that step: tiles of at most ``block_t`` consecutive
token rows that share an adapter, as (table page, first row, end row) int32 triples; a table page of -1 is a tile
with nothing to do (padding up to a fixed count, so that a CUDA graph's launch grid stays the same). It is built
once per step on the host (the runner orders a step's tokens so that each adapter's are contiguous).

Imports nothing: the adapter packer (adapters/), the runner and the kernels all read this one definition."""

from __future__ import annotations

from collections.abc import Sequence

MODULES = ("q", "k", "v", "o", "gate", "up", "down")
NUM_MODULES = len(MODULES)
MODULE_INDEX = {m: i for i, m in enumerate(MODULES)}
ROW_GROUP = 16  # rank rows per table offset: the kernels' rank tile
# the fused linear groups of a Llama layer: (first module index, modules), the module indices consecutive
GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


def groups(max_rank: int) -> int:
    """G: the rank-row groups a table row has room for."""
    return -(-max_rank // ROW_GROUP)


def row_len(max_rank: int) -> int:
    """int64 values per (layer, module) row of a table: the rank, G offsets of A, G of B^T, DoRA's two."""
    return dora_column(max_rank) + 2


def dora_column(max_rank: int) -> int:
    """Where in a (layer, module) row of a table DoRA's scale offset is (its shift's: the next)."""
    return 1 + 2 * groups(max_rank)


def table_len(num_layers: int, max_rank: int) -> int:
    """int64 values of a whole table."""
    return num_layers * NUM_MODULES * row_len(max_rank)


def max_tiles(num_tokens: int, block_t: int, max_adapters: int) -> int:
    """The most tiles a step of ``num_tokens`` rows can need with at most ``max_adapters`` distinct adapters, each
    adapter's rows one run (the runner's order): each run adds at most one partial tile."""
    return -(-num_tokens // block_t) + min(num_tokens, max_adapters)


def tile_map(segments: Sequence[tuple[int, int, int]], block_t: int, num_tiles: int | None = None) -> list[int]:
    """The tile map of ``segments`` (start, end, table page), flattened: [page, first, end] per tile, segments with
    page -1 or no rows left out; padded with (-1, 0, 0) to ``num_tiles`` triples when given (ValueError when they
    do not fit)."""
    out: list[int] = []
    for start, end, page in segments:
        if page < 0:
            continue
        for first in range(start, end, block_t):
            out.extend((page, first, min(first + block_t, end)))
    if num_tiles is not None:
        if len(out) > 3 * num_tiles:
            raise ValueError(f"{len(out) // 3} tiles do not fit a map of {num_tiles}")
        out.extend((-1, 0, 0) * (num_tiles - len(out) // 3))
    return out
