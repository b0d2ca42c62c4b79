"""LoRA in the engine's own terms, end to end below the model: adapters packed by adapters.page_layout, copied into
an arena (model.arena.ResidentAdapters) at scattered pages, then one fused linear's LoRA through kernels.ops every
way it can run: the CPU's segment path over the views ResidentAdapters made (what the CPU engine runs), the twins,
and the kernels (under the Triton interpreter without a GPU). Each against a float64 product of the adapters'
dense weights (the independent reference); rows without an adapter keep their bits."""

from __future__ import annotations

import pytest
import torch

from lora_server.adapters.page_layout import PageGeometry, PageLayout
from lora_server.adapters.peft_format import BaseShapes, LoraAdapter
from lora_server.kernels import ops
from lora_server.kernels.lora_table import GROUPS, MODULE_INDEX, max_tiles, tile_map
from lora_server.model.arch import PRESETS, ModelArch
from lora_server.model.arena import Arena, ResidentAdapters
from lora_server.model.lora import workspace_shape
from tests.kernel_env import DEVICE, force_path

ARCH = ModelArch.from_hf_config(
    PRESETS["tiny-llama"]
)  # hidden 64, 4 heads of 16, 2 KV heads, intermediate 128, 2 layers
SHAPES = BaseShapes.llama(ARCH.num_layers, ARCH.hidden_size, ARCH.intermediate_size, ARCH.q_size, ARCH.kv_size)
BLOCK_SIZE = 64  # a page: 2 layers x 2 x 64 tokens x 32 = 8192 floats (32 KiB), room for 16 rows of 128 and a table
MAX_RANK = 32
WIDTHS = {"qkv": (64, 32, 32), "o": (64,), "gate_up": (128, 128), "down": (64,)}


def _adapter(ranks: dict[tuple[int, str], int], seed: int) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for (layer, module), r in ranks.items():
        in_f, out_f = SHAPES.features[module]
        a = torch.randn(r, in_f, generator=gen) / in_f**0.5
        weights[(layer, module)] = (a, torch.randn(out_f, r, generator=gen) / r**0.5)
    return LoraAdapter(f"a{seed}", None, max(ranks.values()), weights)  # type: ignore[arg-type]


# every module at rank 8; attention only at 20 (two row groups); MLP only at 3, one layer; q and v at 32 and 1
RANKS = [
    {(i, m): 8 for i in range(2) for m in SHAPES.features},
    {(i, m): 20 for i in range(2) for m in ("q", "k", "v", "o")},
    {(1, m): 3 for m in ("gate", "up", "down")},
    {(0, "q"): 32, (0, "v"): 1, (1, "q"): 32},
]


@pytest.fixture(scope="module")
def loaded():
    geometry = PageGeometry(ARCH.num_layers * 2 * BLOCK_SIZE * ARCH.kv_size * 4, torch.float32, MAX_RANK, SHAPES)
    arena = Arena(40, ARCH, BLOCK_SIZE, torch.float32, torch.float32, torch.device(DEVICE))
    arena.pages.fill_(0xFF)  # NaN everywhere no table points
    starts = {g: [0, *torch.tensor(w).cumsum(0).tolist()] for g, w in WIDTHS.items()}
    residents = ResidentAdapters(arena, geometry, starts)
    adapters, table_pages = [], []
    free = [37, 3, 21, 8, 30, 14, 0, 26, 11, 33, 5, 18, 39, 1, 24, 9, 35, 16, 28, 6]  # scattered
    for seed, ranks in enumerate(RANKS):
        adapter = _adapter(ranks, seed)
        layout = PageLayout(geometry, ranks)
        pages = [free.pop(0) for _ in range(layout.num_pages)]
        residents.load(pages, layout, layout.image(adapter).to(DEVICE))
        adapters.append(adapter)
        table_pages.append(pages[0])
    return arena, residents, adapters, table_pages


def _reference(x, out, adapters, segments, layer, group):
    """float64: out + each segment's adapter's (x A^T) B^T per slice."""
    expected = out.double().clone()
    starts = [0, *torch.tensor(WIDTHS[group]).cumsum(0).tolist()]
    for (start, end), adapter in segments:
        for k, module in enumerate(GROUPS[group]):
            pair = adapter.weights.get((layer, module))
            if pair is not None:
                a, b = pair
                expected[start:end, starts[k] : starts[k + 1]] += x[start:end].double() @ a.double().T @ b.double().T
    return expected


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("path", ["segments", "twins", "kernels"])
def test_apply_lora_every_path_against_float64(loaded, monkeypatch, group, layer, path):
    arena, residents, adapters, table_pages = loaded
    gen = torch.Generator().manual_seed(layer * 10 + len(group))
    in_f = SHAPES.features[GROUPS[group][0]][0]
    num_tokens = 37
    x = torch.randn(num_tokens, in_f, generator=gen).to(DEVICE)
    out = torch.randn(num_tokens, sum(WIDTHS[group]), generator=gen).to(DEVICE)
    # runs: adapter 0 (5 rows), none (4), adapter 2 (1), adapter 1 (19), adapter 3 (8)
    runs = [(0, 5, 0), (9, 10, 2), (10, 29, 1), (29, 37, 3)]
    segments = [(s, e, table_pages[i]) for s, e, i in runs]
    starts = [0, *torch.tensor(WIDTHS[group]).cumsum(0).tolist()]
    tiles = torch.tensor(tile_map(segments, 16, max_tiles(num_tokens, 16, 4)), dtype=torch.int32, device=DEVICE).view(
        -1, 3
    )
    kernels = path == "kernels"
    force_path(monkeypatch, "kernels" if kernels else "twins")
    y = torch.full(workspace_shape(num_tokens, MAX_RANK), float("nan"), device=DEVICE) if kernels else None
    result = out.clone()
    ops.apply_lora(
        x,
        result,
        ops.LoraArena(arena.weights, arena.table, arena.table_stride, MAX_RANK),
        tiles,
        layer=layer,
        module_base=MODULE_INDEX[GROUPS[group][0]],
        slice_starts=torch.tensor(starts, dtype=torch.int32, device=DEVICE) if kernels else starts,
        max_width=max(WIDTHS[group]),
        y=y,
        block_t=16,
        host_segments=(
            (lambda: [(s, e, residents.terms(p, layer, group)) for s, e, p in segments]) if path == "segments" else None
        ),
    )
    expected = _reference(x.cpu(), out.cpu(), adapters, [((s, e), adapters[i]) for s, e, i in runs], layer, group)
    torch.testing.assert_close(result.double().cpu(), expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(result[5:9], out[5:9])  # no adapter: not touched
