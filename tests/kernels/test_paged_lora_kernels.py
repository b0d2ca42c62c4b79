"""The LoRA kernels that read adapters through the arena's tables (kernels/lora_shrink.py, kernels/lora_expand.py)
and their torch twins (kernels.lora_reference.paged_lora_shrink / paged_lora_expand).

The arenas are packed here by hand from kernels/lora_table.py's format: each adapter gets pages in a random order
(scattered), its table at the start of its first page, then its 16-row groups of A and B^T one after the other,
with a few NaN elements between groups and a new page whenever a group would straddle one. Ranks are mixed per
(layer, module) (0 = untargeted, 1, 3, 8, 16, 17, 32), so a module has one or two groups and the last is partial.
Every arena byte the table does not point at holds NaN in the weight dtype, so a read past a group, past a rank
or of the wrong (layer, module) row shows up as NaN or as a wrong value.

Each kernel is checked against its twin and each twin against a float64 loop over tokens written here from the
dense weights (the independent reference), over a seeded sweep: a base case, each other value of each axis once
(dtype, max rank, token count, adapter spread, fused group of slices, split count, padding tiles and rows without
an adapter, layer, block sizes), plus random combinations. y is pre-filled with NaN: the entries the contract says
are not written must keep those bits, and expand, fed the kernel's y, would turn any read of them into NaN.
Rows outside the tiles and slices of rank 0 keep their exact bits. Without a CUDA GPU the kernels run in the
Triton interpreter on the CPU; with one, the same tests run compiled on it.

Tolerances: y 1e-5 (float32 accumulation of exact products in any dtype); out as in test_lora_kernels.py (one
rounding of y and one of out to the weight dtype; bfloat16 2 ulps: the interpreter rounds toward zero)."""

from __future__ import annotations

import dataclasses
import os
import random
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lora_server.kernels.lora_expand as lora_expand_module
import lora_server.kernels.lora_shrink as lora_shrink_module
from lora_server.instrument.host_work import _ALLOCATIONS
from lora_server.kernels import lora_reference as ref
from lora_server.kernels import lora_table
from lora_server.kernels.lora_expand import lora_expand
from lora_server.kernels.lora_shrink import lora_shrink
from tests.kernel_env import DEVICE, TOL_VS_TWIN

REPO = Path(__file__).resolve().parents[2]
Y_TOL = {"atol": 1e-5, "rtol": 1e-5}
OUT_TOL_VS_LOOP = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}

# A small Llama-shaped layer: (in, out) per module; q is wider than k and v, so qkv's slices are unequal.
SMALL_SHAPES = {"q": (40, 40), "k": (40, 24), "v": (40, 24), "o": (40, 40), "gate": (40, 72), "up": (40, 72)}
SMALL_SHAPES["down"] = (72, 40)
NUM_LAYERS = 2
PAGE_BYTES = 8192  # a float32 16-row group of a 72-wide matrix (4608 bytes) takes most of a page
ADAPTER_RANKS = (0, 1, 3, 8, 16, 17, 32)
SPREADS = ("distinct", "uniform", "zipf", "identical", "none")
BLOCKS = {"small": {"block_k": 16, "block_n": 16}, "default": {}}  # small: several loop steps and column blocks
BLOCK_T = 16


# ---- arenas ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Arena:
    w: torch.Tensor  # [P * PAGE_BYTES / elsize], the weight view of the arena
    table: torch.Tensor  # [P * PAGE_BYTES / 8] int64, the table view of the same bytes
    table_stride: int  # int64 values per page
    pages: list[int]  # adapter i's table page
    weights: list[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]]  # per adapter, (layer, module) ->
    # (A [r, in], B [out, r]) float64, exactly the values stored; a module absent has rank 0


def pack_arena(
    num_adapters: int,
    max_rank: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    *,
    shapes: dict[str, tuple[int, int]] = SMALL_SHAPES,
    page_bytes: int = PAGE_BYTES,
    device: str = DEVICE,
) -> Arena:
    """Adapters with random ranks (at most max_rank; adapter 0 has max_rank in every module) packed into a NaN
    arena per lora_table's format, each on pages drawn in a random order; every group starts at a multiple of 8
    elements (the kernels load 16 bytes at a time from there), after a gap of 0, 8 or 16."""
    elsize = torch.finfo(dtype).bits // 8
    page_elems, table_stride = page_bytes // elsize, page_bytes // 8
    num_groups, length = lora_table.groups(max_rank), lora_table.row_len(max_rank)
    table_elems = lora_table.table_len(NUM_LAYERS, max_rank) * 8 // elsize
    assert table_elems <= page_elems, "the table must fit its page"
    ranks = [r for r in ADAPTER_RANKS if r <= max_rank]
    num_pages = num_adapters * (1 + NUM_LAYERS * len(shapes) * 2 * num_groups)  # an upper bound: a page per group
    free_pages = iter(torch.randperm(num_pages, generator=gen).tolist())
    arena_bytes = torch.empty(num_pages * page_bytes, dtype=torch.uint8)
    w, table = arena_bytes.view(dtype), arena_bytes.view(torch.int64)
    w.fill_(float("nan"))

    pages, weights = [], []
    for adapter in range(num_adapters):
        page, cursor = next(free_pages), -(-table_elems // 16) * 16  # offsets are multiples of 8: the kernels' contract
        pages.append(page)
        entries = torch.full((lora_table.table_len(NUM_LAYERS, max_rank),), -1, dtype=torch.int64)
        dense = {}
        for layer in range(NUM_LAYERS):
            for module, name in enumerate(lora_table.MODULES):
                rank = max_rank if adapter == 0 else ranks[int(torch.randint(len(ranks), (1,), generator=gen))]
                row = (layer * lora_table.NUM_MODULES + module) * length
                entries[row] = rank
                if rank == 0:
                    continue
                in_f, out_f = shapes[name]
                a = (torch.randn(rank, in_f, generator=gen) / in_f**0.5).to(dtype)
                b = (torch.randn(out_f, rank, generator=gen) / rank**0.5).to(dtype)
                dense[layer, name] = (a.double(), b.double())
                for which, matrix in ((0, a), (1, b.T)):
                    for g in range(lora_table.groups(rank)):
                        group = matrix[g * lora_table.ROW_GROUP : (g + 1) * lora_table.ROW_GROUP].flatten()
                        gap = 8 * int(torch.randint(3, (1,), generator=gen))  # NaN between groups
                        if cursor + gap + group.numel() > page_elems:  # a group never straddles two pages
                            page, cursor = next(free_pages), 0
                        start = page * page_elems + cursor + gap
                        w[start : start + group.numel()] = group
                        entries[row + 1 + which * num_groups + g] = start
                        cursor += gap + group.numel()
        table[pages[-1] * table_stride :][: entries.numel()] = entries
        weights.append(dense)
    arena_bytes = arena_bytes.to(device)
    return Arena(arena_bytes.view(dtype), arena_bytes.view(torch.int64), table_stride, pages, weights)


# ---- cases -------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: torch.dtype = torch.float32
    max_rank: int = 32
    tokens: int = 21
    spread: str = "uniform"  # how the tokens' segments spread over adapters, see make_step
    group: str = "qkv"  # the fused linear (lora_table.GROUPS): its modules are the slices
    num_splits: int = 2
    padding: bool = True  # -1 tiles among the real ones, and rows without an adapter
    layer: int = 1
    blocks: str = "small"
    seed: int = 0

    def __str__(self) -> str:
        return (
            f"{str(self.dtype).removeprefix('torch.')}-r{self.max_rank}-T{self.tokens}-{self.spread}-{self.group}"
            f"-split{self.num_splits}{'-pad' if self.padding else ''}-layer{self.layer}-{self.blocks}-s{self.seed}"
        )


AXES = {
    "dtype": (torch.float32, torch.float16, torch.bfloat16),
    "max_rank": (8, 17, 32),
    "tokens": (0, 1, 5, 21, 40),
    "spread": SPREADS,
    "group": ("qkv", "gate_up", "o", "down"),
    "num_splits": (1, 2, 3),
    "padding": (False, True),
    "layer": (0, 1),
    "blocks": tuple(BLOCKS),
}
QUICK = {"base", "dtype", "spread", "group"}  # the axes whose cases stay in the quick tier


def sweep_cases(num_random: int = 12) -> list:
    """The base case, each other value of each axis on it, then seeded random combinations (slow tier but the
    axes in QUICK)."""
    base = Case()
    cases = [pytest.param(base, id=str(base))]
    for axis, values in AXES.items():
        for v in values:
            if v != getattr(base, axis):
                case = dataclasses.replace(base, **{axis: v})
                cases.append(pytest.param(case, id=str(case), marks=() if axis in QUICK else pytest.mark.slow))
    rng = random.Random(4321)
    for i in range(num_random):
        pick = {axis: rng.choice(values) for axis, values in AXES.items()}
        pick["tokens"] = pick["tokens"] or 21  # the axis sweep has the empty step; these should have work
        case = Case(**pick, seed=100 + i)
        cases.append(pytest.param(case, id=str(case), marks=pytest.mark.slow))
    return cases


@dataclasses.dataclass
class Step:
    x: torch.Tensor  # [T, in]
    tiles: torch.Tensor  # [N, 3] int32
    token_adapter: list[int]  # [T], -1 = no adapter
    slice_starts: torch.Tensor  # [K + 1] int32
    modules: tuple[str, ...]  # the slices' modules
    module_base: int
    out_buffer: torch.Tensor  # [T, out_total + 3]: out is a column view of it (a row stride past its width)
    out: torch.Tensor  # [T, out_total]


def make_step(
    case: Case, arena: Arena, gen: torch.Generator, shapes: dict[str, tuple[int, int]] = SMALL_SHAPES
) -> Step:
    """Segments of contiguous tokens, one adapter each: distinct = one token per adapter; uniform / zipf = up to 6
    segments over the arena's adapters drawn uniformly / Zipf(1.5); identical = adapter 0 (max_rank in every
    module); none = no adapter (the map holds only padding). padding turns a third of the segments (at least one,
    never all when there are two or more) to -1, rows that no tile covers, and adds three -1 tiles that claim
    every row, the map's tiles shuffled."""
    tokens, num_adapters = case.tokens, len(arena.pages)
    if case.spread == "distinct":
        lengths, adapters = [1] * tokens, list(range(tokens))
    elif tokens == 0:
        lengths, adapters = [], []
    else:
        least = 2 if case.padding and tokens >= 2 else 1  # room for a -1 segment beside an adapter's
        count = int(torch.randint(least, max(least, min(tokens, 6)) + 1, (1,), generator=gen))
        cuts = sorted(torch.randperm(tokens - 1, generator=gen)[: count - 1].add(1).tolist())
        lengths = [b - a for a, b in pairwise([0, *cuts, tokens])]
        if case.spread == "uniform":
            adapters = torch.randint(num_adapters, (count,), generator=gen).tolist()
        elif case.spread == "zipf":
            weights = 1.0 / torch.arange(1, num_adapters + 1, dtype=torch.float64) ** 1.5
            adapters = torch.multinomial(weights, count, replacement=True, generator=gen).tolist()
        elif case.spread == "identical":
            adapters = [0] * count
        else:
            adapters = [-1] * count
    if case.padding and len(adapters) >= 2:
        for g in torch.randperm(len(adapters), generator=gen)[: max(1, len(adapters) // 3)].tolist():
            adapters[g] = -1
    starts = [0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()]
    segments = [(a, b, arena.pages[i] if i >= 0 else -1) for (a, b), i in zip(pairwise(starts), adapters, strict=True)]
    flat = lora_table.tile_map(segments, BLOCK_T)
    tiles = torch.tensor(flat, dtype=torch.int32).view(-1, 3)
    if case.padding:
        tiles = torch.cat([tiles, torch.tensor([[-1, 0, tokens]] * 3, dtype=torch.int32)])
        tiles = tiles[torch.randperm(tiles.shape[0], generator=gen)]
    token_adapter = [i for n, i in zip(lengths, adapters, strict=True) for _ in range(n)]

    modules = lora_table.GROUPS[case.group]
    in_features = shapes[modules[0]][0]
    widths = [shapes[m][1] for m in modules]
    out_buffer = torch.randn(tokens, sum(widths) + 3, generator=gen)
    out_buffer[:, 1] = -0.0  # a rewrite of an entry that should be untouched turns it into +0.0
    out_buffer[[t for t, i in enumerate(token_adapter) if i < 0], 2] = float("nan")  # rows outside the tiles
    out_buffer = out_buffer.to(DEVICE, case.dtype)
    return Step(
        x=torch.randn(tokens, in_features, generator=gen).to(DEVICE, case.dtype),
        tiles=tiles.contiguous().to(DEVICE),
        token_adapter=token_adapter,
        slice_starts=torch.tensor([0, *torch.tensor(widths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE),
        modules=modules,
        module_base=lora_table.MODULE_INDEX[modules[0]],
        out_buffer=out_buffer,
        out=out_buffer[:, 1 : 1 + sum(widths)],
    )


def workspace(case: Case, step: Step) -> torch.Tensor:
    """y pre-filled with NaN, one more of every dimension than needed (their entries must stay NaN)."""
    shape = (case.num_splits + 1, len(step.modules) + 1, case.tokens + 2, 16 * lora_table.groups(case.max_rank) + 3)
    return torch.full(shape, float("nan"), dtype=torch.float32, device=DEVICE)


def written_mask(case: Case, arena: Arena, step: Step, y: torch.Tensor) -> torch.Tensor:
    """Where the shrink writes y: [:num_splits, k, a:b, :r] of every tile (page p >= 0, rows a:b) and slice k."""
    mask = torch.zeros(y.shape, dtype=torch.bool)
    adapter_of_page = {p: i for i, p in enumerate(arena.pages)}
    for page, first, end in step.tiles.tolist():
        if page >= 0:
            for k, module in enumerate(step.modules):
                weights = arena.weights[adapter_of_page[page]].get((case.layer, module))
                if weights is not None:
                    mask[: case.num_splits, k, first:end, : weights[0].shape[0]] = True
    return mask


def loop_lora(case: Case, arena: Arena, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token in float64 from the dense weights: y[k, t, :r] = A_k @ x[t]; out[t, slice k] += B_k @ y[k, t, :r].
    Returns (y [K, T, max_rank], out [T, out_total])."""
    y = torch.zeros(len(step.modules), case.tokens, case.max_rank, dtype=torch.float64)
    out = step.out.double().cpu().clone()
    starts = step.slice_starts.tolist()
    for t, adapter in enumerate(step.token_adapter):
        for k, module in enumerate(step.modules if adapter >= 0 else ()):
            if (case.layer, module) in arena.weights[adapter]:
                a, b = arena.weights[adapter][case.layer, module]
                y[k, t, : a.shape[0]] = a @ step.x[t].double().cpu()
                out[t, starts[k] : starts[k + 1]] += b @ y[k, t, : a.shape[0]]
    return y, out


def untouched_out(case: Case, arena: Arena, step: Step) -> torch.Tensor:
    """[T, out_total + 3] bool: the out_buffer entries no slice of any tile may change (rows without an adapter,
    slices of rank 0, the columns outside out)."""
    keep = torch.ones(step.out_buffer.shape, dtype=torch.bool)
    starts = step.slice_starts.tolist()
    for t, adapter in enumerate(step.token_adapter):
        for k, module in enumerate(step.modules if adapter >= 0 else ()):
            if (case.layer, module) in arena.weights[adapter]:
                keep[t, 1 + starts[k] : 1 + starts[k + 1]] = False
    return keep


def assert_bits_equal(after: torch.Tensor, before: torch.Tensor, where: torch.Tensor) -> None:
    """Bit for bit (NaN-safe) on the entries where ``where`` holds."""
    bits = BITS[after.dtype]
    assert torch.equal(after.cpu().view(bits)[where], before.cpu().view(bits)[where])


def num_adapters_for(case: Case) -> int:
    return max(case.tokens, 1) if case.spread == "distinct" else 6


def launch_args(case: Case, arena: Arena, step: Step) -> dict:
    return dict(layer=case.layer, module_base=step.module_base, table_stride=arena.table_stride, max_rank=case.max_rank)


# ---- the sweep ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sweep_cases())
def test_kernels_match_twins_match_loop(case: Case):
    gen = torch.Generator().manual_seed(case.seed)
    arena = pack_arena(num_adapters_for(case), case.max_rank, case.dtype, gen)
    step = make_step(case, arena, gen)
    common = launch_args(case, arena, step)
    num_slices, max_width = len(step.modules), max(SMALL_SHAPES[m][1] for m in step.modules)
    blocks = BLOCKS[case.blocks]
    y_loop, out_loop = loop_lora(case, arena, step)

    y_twin, y_kernel = workspace(case, step), workspace(case, step)
    sentinel = y_kernel.clone()
    shrink_args = (arena.w, arena.table, step.tiles)
    ref.paged_lora_shrink(step.x, *shrink_args, y_twin, num_slices=num_slices, num_splits=case.num_splits, **common)
    lora_shrink(
        step.x,
        *shrink_args,
        y_kernel,
        num_slices=num_slices,
        num_splits=case.num_splits,
        block_t=BLOCK_T,
        block_k=blocks.get("block_k", 64),
        **common,
    )
    written = written_mask(case, arena, step, y_kernel)
    assert_bits_equal(y_kernel, sentinel, ~written)
    assert_bits_equal(y_twin, sentinel, ~written)
    summed = written[0]  # [K', T', R']: where y[:num_splits].sum(0) is defined
    loop_at = torch.zeros(summed.shape, dtype=torch.float64)
    loop_at[:num_slices, : case.tokens, : case.max_rank] = y_loop
    twin_sum = y_twin[: case.num_splits].sum(0).cpu()
    torch.testing.assert_close(twin_sum[summed].double(), loop_at[summed], **Y_TOL)
    torch.testing.assert_close(y_kernel[: case.num_splits].sum(0).cpu()[summed], twin_sum[summed], **Y_TOL)
    assert torch.equal(y_twin[0].cpu()[summed], twin_sum[summed]), "the twin's y[0] alone is the sum"

    expand_args = (arena.w, arena.table, step.tiles, step.slice_starts)
    cols = slice(1, 1 + step.out.shape[1])  # out's columns in out_buffer
    before, out_twin, out_twin_one = (step.out_buffer.clone() for _ in range(3))
    twin_expand = dict(max_width=max_width, **common)
    ref.paged_lora_expand(y_twin, *expand_args, out_twin[:, cols], num_splits=case.num_splits, **twin_expand)
    ref.paged_lora_expand(y_twin, *expand_args, out_twin_one[:, cols], num_splits=1, **twin_expand)
    lora_expand(
        y_kernel,
        *expand_args,
        step.out,
        max_width=max_width,
        num_splits=case.num_splits,
        block_t=BLOCK_T,
        block_n=blocks.get("block_n", 64),
        **common,
    )
    out_kernel = step.out_buffer
    assert_bits_equal(out_twin_one, out_twin, torch.ones(out_twin.shape, dtype=torch.bool))  # y[0] is the sum
    torch.testing.assert_close(
        out_twin[:, cols].double().cpu(), out_loop, equal_nan=True, **OUT_TOL_VS_LOOP[case.dtype]
    )
    torch.testing.assert_close(out_kernel, out_twin, equal_nan=True, **TOL_VS_TWIN[case.dtype])
    keep = untouched_out(case, arena, step)
    assert_bits_equal(out_kernel, before, keep)
    assert_bits_equal(out_twin, before, keep)


def test_sweep_covers_every_axis_value():
    cases = [p.values[0] for p in sweep_cases()]
    for axis, values in AXES.items():
        assert {getattr(c, axis) for c in cases} >= set(values), axis


def test_packed_arenas_are_scattered_and_mixed():
    """The packer does what the sweep relies on: an adapter's groups on several pages that are not consecutive,
    partial groups, untargeted modules, NaN between groups, and tables that follow lora_table's format."""
    gen = torch.Generator().manual_seed(3)
    arena = pack_arena(4, 32, torch.float16, gen, device="cpu")
    elems_per_page = PAGE_BYTES // 2
    length, num_groups = lora_table.row_len(32), lora_table.groups(32)
    ranks_seen = set()
    for page, dense in zip(arena.pages, arena.weights, strict=True):
        table = arena.table[page * arena.table_stride :][: lora_table.table_len(NUM_LAYERS, 32)].tolist()
        group_pages = set()
        for layer in range(NUM_LAYERS):
            for module, name in enumerate(lora_table.MODULES):
                row = table[(layer * lora_table.NUM_MODULES + module) * length :][:length]
                rank = row[0]
                ranks_seen.add(rank)
                assert rank == (dense[layer, name][0].shape[0] if (layer, name) in dense else 0)
                used = lora_table.groups(rank)
                assert row[1 + used : 1 + num_groups] == [-1] * (num_groups - used)
                assert row[1 + num_groups + used : lora_table.dora_column(32)] == [-1] * (num_groups - used)
                assert row[lora_table.dora_column(32) :] == [-1, -1]  # not DoRA modules
                for start in row[1 : 1 + used] + row[1 + num_groups : 1 + num_groups + used]:
                    group_pages.add(start // elems_per_page)
                if rank:
                    a = dense[layer, name][0]
                    got = arena.w[row[1] : row[1] + min(16, rank) * a.shape[1]].double().view(-1, a.shape[1])
                    assert torch.equal(got, a[:16])
        assert len(group_pages) > 3 and sorted(group_pages) != list(range(min(group_pages), max(group_pages) + 1))
    assert ranks_seen >= {0, 17, 32}
    assert torch.isnan(arena.w).float().mean() > 0.2  # NaN gaps, page tails and unused pages


# ---- focused checks ----------------------------------------------------------------------------------------------


class _OpRecorder(TorchDispatchMode):
    """Records every aten op the code inside it issues."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func, args))
        return func(*args, **(kwargs or {}))


class _LaunchRecorder:
    """Stands for a @triton.jit kernel: ``kernel[grid](*args, **kwargs)`` records (grid, kwargs) and runs nothing."""

    def __init__(self) -> None:
        self.launches: list = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, kwargs))


# ops that make a new tensor, beyond host_work's _ALLOCATIONS (the empty family): factories and copies
_FACTORIES = {"zeros", "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full"}
_FACTORIES |= {"arange", "scalar_tensor", "tensor", "clone", "_to_copy", "empty_like", "empty_strided"}


def _allocates_or_copies_to_device(func, args) -> bool:
    if func in _ALLOCATIONS or func.overloadpacket.__name__ in _FACTORIES:
        return True
    copy_to_device = func.overloadpacket.__name__ == "copy_" and args[0].device.type != "cpu"
    return copy_to_device and args[1].device.type == "cpu"


def test_wrappers_allocate_and_copy_nothing(monkeypatch: pytest.MonkeyPatch):
    """What CUDA graph capture needs: no allocation and no host-to-device copy in either wrapper.

    On the CPU the Triton launches are replaced by recorders: the interpreter itself copies each argument's storage
    to the host and allocates tensors there (triton/runtime/interpreter.py, _init_args_hst), which a GPU launch
    does not, so what this shows there is that the wrappers' own code issues no aten op at all (hence none that
    allocates or copies), and launches once each with the documented grid. With a GPU the real launches run
    inside the recorder and no allocation or host-to-device copy may appear."""
    case = Case(tokens=21, num_splits=3)
    gen = torch.Generator().manual_seed(9)
    arena = pack_arena(6, case.max_rank, case.dtype, gen)
    step = make_step(case, arena, gen)
    common = launch_args(case, arena, step)
    y = workspace(case, step)
    if DEVICE == "cpu":
        shrink_kernel, expand_kernel = _LaunchRecorder(), _LaunchRecorder()
        monkeypatch.setattr(lora_shrink_module, "_lora_shrink_kernel", shrink_kernel)
        monkeypatch.setattr(lora_expand_module, "_lora_expand_kernel", expand_kernel)
    with _OpRecorder() as recorder:
        lora_shrink(step.x, arena.w, arena.table, step.tiles, y, num_slices=3, num_splits=3, **common)
        lora_expand(
            y, arena.w, arena.table, step.tiles, step.slice_starts, step.out, max_width=40, num_splits=3, **common
        )
    bad = [func for func, args in recorder.ops if _allocates_or_copies_to_device(func, args)]
    assert not bad, bad
    if DEVICE == "cpu":
        assert recorder.ops == [], [func for func, _ in recorder.ops]
        num_tiles = step.tiles.shape[0]
        assert [grid for grid, _ in shrink_kernel.launches] == [(num_tiles, 3, 2 * 3)]  # groups(32) * splits
        assert [grid for grid, _ in expand_kernel.launches] == [(num_tiles, 3, 1)]  # cdiv(40, 64)


def test_same_launch_serves_any_map_contents():
    """The map and the inputs change in place between two launches with the same arguments (what a CUDA graph
    replays): each result is the twin's for the contents of the moment, y left as the previous step wrote it."""
    two_steps_through_one_launch(lambda launch: launch)


@pytest.mark.gpu
def test_cuda_graph_replay_matches_twin():
    """Both launches captured in one CUDA graph, replayed over two steps' contents in the same buffers."""

    def capture(launch):
        launch()  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
        return graph.replay

    two_steps_through_one_launch(capture)


def two_steps_through_one_launch(prepare) -> None:
    """prepare(launch) gives what runs a step (the launch itself, or a graph's replay) once the buffers are set."""
    case = Case(dtype=torch.float16, tokens=21, num_splits=2)
    gen = torch.Generator().manual_seed(17)
    arena = pack_arena(6, case.max_rank, case.dtype, gen)
    first = make_step(case, arena, gen)
    second = make_step(dataclasses.replace(case, spread="zipf"), arena, gen)
    rows = max(first.tiles.shape[0], second.tiles.shape[0])
    tiles = torch.tensor([[-1, 0, 0]] * rows, dtype=torch.int32, device=DEVICE)
    x, out = first.x.clone(), first.out_buffer.clone()
    y = workspace(case, first)
    common = launch_args(case, arena, first)

    def launch() -> None:
        lora_shrink(x, arena.w, arena.table, tiles, y, num_slices=3, num_splits=2, **common)
        view = out[:, 1 : 1 + first.out.shape[1]]
        lora_expand(y, arena.w, arena.table, tiles, first.slice_starts, view, max_width=40, num_splits=2, **common)

    run = prepare(launch)
    for step in (first, second):
        tiles.fill_(-1)
        tiles[: step.tiles.shape[0]] = step.tiles
        x.copy_(step.x)
        out.copy_(step.out_buffer)
        run()
        y_twin = workspace(case, step)
        ref.paged_lora_shrink(step.x, arena.w, arena.table, tiles, y_twin, num_slices=3, num_splits=2, **common)
        twin = step.out_buffer.clone()
        view = twin[:, 1 : 1 + step.out.shape[1]]
        ref.paged_lora_expand(y_twin, arena.w, arena.table, tiles, step.slice_starts, view, max_width=40, **common)
        torch.testing.assert_close(out, twin, equal_nan=True, **TOL_VS_TWIN[case.dtype])


@pytest.mark.parametrize(
    "shift_gib",
    [
        pytest.param(4, marks=pytest.mark.slow, id="weights"),  # A and B^T offsets past 2**31 float16 elements
        pytest.param(16, marks=pytest.mark.gpu, id="table"),  # and the table page * table_stride past 2**31
    ],
)
def test_offsets_past_two_to_the_31(shift_gib: int):
    """Arena offsets pass 2**31 (80 GB of float16 is 4e10 elements, 10e9 int64 values): the adapter's pages are
    moved shift_gib GiB up an arena that large, its table's offsets and the map's page shifted to match, and the
    kernels must still match the twin on the unshifted arena (int32 pointer arithmetic would wrap and read
    elsewhere)."""
    if DEVICE == "cpu" and os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") < (shift_gib + 4) << 30:
        pytest.skip(f"needs about {shift_gib + 1} GiB of free memory for the arena")
    case = Case(dtype=torch.float16, tokens=21, spread="identical", padding=False, num_splits=2)
    gen = torch.Generator().manual_seed(23)
    small = pack_arena(1, case.max_rank, case.dtype, gen)
    step = make_step(case, small, gen)
    shift_pages = (shift_gib << 30) // PAGE_BYTES
    shift = shift_pages * PAGE_BYTES // 2  # in float16 elements
    big = torch.empty(shift * 2 + small.w.numel() * 2, dtype=torch.uint8, device=DEVICE)  # not filled: 4+ GiB
    big_w, big_table = big.view(case.dtype), big.view(torch.int64)
    big_w[shift:] = small.w
    page = small.pages[0] + shift_pages
    num_groups, length = lora_table.groups(case.max_rank), lora_table.row_len(case.max_rank)
    table = big_table[page * small.table_stride :][: lora_table.table_len(NUM_LAYERS, case.max_rank)].view(-1, length)
    offsets = table[:, 1 : 1 + 2 * num_groups]
    offsets.copy_(torch.where(offsets >= 0, offsets + shift, offsets))
    assert int(offsets.max()) > 2**31 and (shift_gib < 16 or page * small.table_stride > 2**31)
    tiles = step.tiles.clone()
    tiles[:, 0] = torch.where(tiles[:, 0] >= 0, tiles[:, 0] + shift_pages, tiles[:, 0])
    common = dict(layer=case.layer, module_base=0, table_stride=small.table_stride, max_rank=case.max_rank)
    y_twin, y_kernel = workspace(case, step), workspace(case, step)
    ref.paged_lora_shrink(step.x, small.w, small.table, step.tiles, y_twin, num_slices=3, num_splits=2, **common)
    lora_shrink(step.x, big_w, big_table, tiles, y_kernel, num_slices=3, num_splits=2, **common)
    written = written_mask(case, small, step, y_kernel)[0].to(DEVICE)
    assert written.any()
    torch.testing.assert_close(y_kernel[:2].sum(0)[written], y_twin[:2].sum(0)[written], **Y_TOL)
    out_twin, out_kernel = step.out.clone(), step.out.clone()
    ref.paged_lora_expand(
        y_twin, small.w, small.table, step.tiles, step.slice_starts, out_twin, max_width=40, num_splits=2, **common
    )
    lora_expand(y_kernel, big_w, big_table, tiles, step.slice_starts, out_kernel, max_width=40, num_splits=2, **common)
    torch.testing.assert_close(out_kernel, out_twin, equal_nan=True, **TOL_VS_TWIN[case.dtype])


# ---- the GPU tier ------------------------------------------------------------------------------------------------

# a Llama 3 8B layer; a 512 KiB page holds a 16-row float16 group of the 14336-wide matrices (448 KiB)
LLAMA_8B_SHAPES = {"q": (4096, 4096), "k": (4096, 1024), "v": (4096, 1024), "o": (4096, 4096)}
LLAMA_8B_SHAPES |= {"gate": (4096, 14336), "up": (4096, 14336), "down": (14336, 4096)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group", ["qkv", "gate_up", "down"])
@pytest.mark.parametrize("tokens", [1, 64, 600])
def test_gpu_shapes_kernels_match_twins(dtype: torch.dtype, group: str, tokens: int):
    """8B shapes with the default block sizes; down_proj's 14336 in-features split 4 ways. Expand is fed the
    kernel's y (kernel and twin y differ in summation order, so each expand gets the same y)."""
    num_splits = 4 if group == "down" else 1
    case = Case(dtype=dtype, tokens=tokens, spread="zipf", group=group, num_splits=num_splits, seed=tokens)
    gen = torch.Generator().manual_seed(case.seed)
    arena = pack_arena(6, case.max_rank, dtype, gen, shapes=LLAMA_8B_SHAPES, page_bytes=1 << 19)
    step = make_step(case, arena, gen, shapes=LLAMA_8B_SHAPES)
    common = launch_args(case, arena, step)
    num_slices, max_width = len(step.modules), max(LLAMA_8B_SHAPES[m][1] for m in step.modules)
    y_twin, y_kernel = workspace(case, step), workspace(case, step)
    ref.paged_lora_shrink(step.x, arena.w, arena.table, step.tiles, y_twin, num_slices=num_slices, **common)
    lora_shrink(
        step.x, arena.w, arena.table, step.tiles, y_kernel, num_slices=num_slices, num_splits=num_splits, **common
    )
    written = written_mask(case, arena, step, y_kernel)[0].to(DEVICE)
    torch.testing.assert_close(y_kernel[:num_splits].sum(0)[written], y_twin[0][written], atol=1e-3, rtol=1e-3)
    out_twin, out_kernel = step.out.clone(), step.out.clone()
    expand_args = (arena.w, arena.table, step.tiles, step.slice_starts)
    ref.paged_lora_expand(y_kernel, *expand_args, out_twin, max_width=max_width, num_splits=num_splits, **common)
    lora_expand(y_kernel, *expand_args, out_kernel, max_width=max_width, num_splits=num_splits, **common)
    torch.cuda.synchronize()
    torch.testing.assert_close(out_kernel, out_twin, equal_nan=True, **TOL_VS_TWIN[dtype])
