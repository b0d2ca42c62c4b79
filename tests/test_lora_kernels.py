"""Batched LoRA kernels (kernels/sgmv_*, kernels/bgmv_*), their torch twins (kernels/lora_reference.py) and the
LoRA ops of the dispatcher (kernels/ops.py).

Each kernel is checked against its twin, and each twin against a plain per-token float64 loop written here from the
layout contract (the independent reference), over a seeded sweep: every value of every axis (dtype, max rank, token
count, adapter spread, empty segments, -1 rows, slices, in-features, block sizes) once against a base case, plus
random combinations. Adapter slots get mixed ranks, and A/B/y columns past a slot's rank hold NaN, so reading or
computing them shows up as a NaN in the result. Without a CUDA GPU the kernels run in the Triton interpreter on
the CPU; with one, the same tests run the compiled kernels on it (the interpreter would be set for the whole
session, so it is only asked for where there is no GPU).

Tolerances (kernel vs twin; twin vs float64 loop):
- y (float32 accumulation of exact products, any input dtype): 1e-5 abs + rel for both.
- out, float32: 1e-5 vs the twin, 1e-4 vs the loop.
- out, float16: 2e-3 (2 ulps) vs the twin and vs the loop (y and out are each rounded to float16 once).
- out, bfloat16: 1.6e-2 (2 ulps): the interpreter rounds float32 -> bfloat16 toward zero where the GPU and torch
  round to nearest even, so kernel and twin may differ by one ulp of y and of out.
"""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
import textwrap
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from kernels import lora_reference as ref
from kernels import ops
from kernels.bgmv_expand import bgmv_expand
from kernels.bgmv_shrink import bgmv_shrink
from kernels.sgmv_expand import sgmv_expand
from kernels.sgmv_shrink import sgmv_shrink
from tests.kernel_env import DEVICE, TOL_VS_TWIN, force_path

REPO = Path(__file__).resolve().parents[1]
Y_TOL = {"atol": 1e-5, "rtol": 1e-5}
OUT_TOL_VS_TWIN = TOL_VS_TWIN
OUT_TOL_VS_LOOP = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
SMALL_BLOCKS = {  # several tiles, loop steps and column blocks even at these small shapes; split-K on
    "sgmv_shrink": {"block_t": 16, "block_r": 16, "block_k": 16, "split_k": 2},
    "sgmv_expand": {"block_t": 16, "block_n": 16, "block_r": 16},
    "bgmv_shrink": {"block_r": 4, "block_k": 16, "split_k": 2},
    "bgmv_expand": {"block_n": 16, "block_r": 4},
}
SPREADS = ("distinct", "uniform", "zipf", "identical", "none")


# ---- cases -------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: torch.dtype = torch.float32
    rank: int = 16  # R, the max rank; slots get ranks 1..R
    tokens: int = 17
    spread: str = "uniform"  # how segments (and so tokens) spread over adapter slots, see make_batch
    empty_segments: bool = True
    minus_one_rows: bool = True
    widths: tuple[int, ...] = (48, 16, 16)  # output slice widths, K = len(widths)
    in_features: int = 64
    small_blocks: bool = False
    seed: int = 0

    def __str__(self) -> str:
        return (
            f"{str(self.dtype).removeprefix('torch.')}-r{self.rank}-T{self.tokens}-{self.spread}"
            f"{'-empty' if self.empty_segments else ''}{'-neg' if self.minus_one_rows else ''}"
            f"-w{'_'.join(map(str, self.widths))}-in{self.in_features}{'-small' if self.small_blocks else ''}"
            f"-s{self.seed}"
        )


AXES = {
    "dtype": (torch.float32, torch.float16, torch.bfloat16),
    "rank": (1, 4, 8, 16, 64),
    "tokens": (1, 3, 17, 64, 300),
    "spread": SPREADS,
    "empty_segments": (False, True),
    "minus_one_rows": (False, True),
    "widths": ((96,), (48, 16), (48, 16, 16), (16, 64, 16)),
    "in_features": (32, 64),
    "small_blocks": (False, True),
}


def sweep_cases(num_random: int = 14) -> list[Case]:
    """The base case, each other value of each axis on it, then seeded random combinations."""
    base = Case()
    cases = [base]
    for axis, values in AXES.items():
        cases += [dataclasses.replace(base, **{axis: v}) for v in values if v != getattr(base, axis)]
    rng = random.Random(1234)
    for i in range(num_random):
        pick = {axis: rng.choice(values) for axis, values in AXES.items()}
        if pick["tokens"] == 300 and pick["spread"] == "distinct":
            pick["tokens"] = 64  # 300 distinct slots costs seconds in the interpreter; the axis sweep has one
        cases.append(Case(**pick, seed=100 + i))
    return cases


@dataclasses.dataclass
class Batch:
    x: torch.Tensor  # [T, in]
    lora_a: torch.Tensor  # [K, slots, R, in], NaN past each slot's rank
    lora_b: torch.Tensor  # [slots, out_total, R], NaN past each slot's rank
    ranks: torch.Tensor  # [slots] int32
    slice_starts: list[int]  # [K + 1]
    seg_starts: torch.Tensor  # [S + 1] int32
    seg_slots: torch.Tensor  # [S] int32
    slot_ids: torch.Tensor  # [T] int32, a shuffled per-token mapping (decode tokens interleave adapters)
    out: torch.Tensor  # [T, out_total], the base layer's output before LoRA


def segment_lengths(tokens: int, count: int, gen: torch.Generator) -> list[int]:
    """count positive lengths summing to tokens."""
    cuts = sorted(torch.randperm(tokens - 1, generator=gen)[: count - 1].add(1).tolist())
    bounds = [0, *cuts, tokens]
    return [b - a for a, b in pairwise(bounds)]


def make_batch(case: Case, device: str = DEVICE) -> Batch:
    """Segments of tokens spread over slots: distinct = one token per segment, each its own slot; uniform / zipf
    = up to 6 segments with slots drawn uniformly / Zipf(1.5); identical = all segments one slot; none = all -1.
    minus_one_rows turns some segments to -1; empty_segments adds zero-length segments (some with a real slot)."""
    gen = torch.Generator().manual_seed(case.seed)
    tokens, max_rank, num_slices = case.tokens, case.rank, len(case.widths)
    num_slots = max(8, tokens) if case.spread == "distinct" else 8

    if case.spread == "distinct":
        lengths = [1] * tokens
        slots = torch.randperm(num_slots, generator=gen)[:tokens].tolist()
    else:
        count = int(torch.randint(1, min(tokens, 6) + 1, (1,), generator=gen))
        lengths = segment_lengths(tokens, count, gen)
        if case.spread == "uniform":
            slots = torch.randint(0, num_slots, (count,), generator=gen).tolist()
        elif case.spread == "zipf":
            weights = 1.0 / torch.arange(1, num_slots + 1, dtype=torch.float64) ** 1.5
            slots = torch.multinomial(weights, count, replacement=True, generator=gen).tolist()
        elif case.spread == "identical":
            slots = [int(torch.randint(0, num_slots, (1,), generator=gen))] * count
        else:
            slots = [-1] * count
    if case.minus_one_rows:
        order = torch.randperm(len(slots), generator=gen).tolist()
        for g in order[: max(1, len(slots) // 3)]:
            slots[g] = -1
    if case.empty_segments:
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
            at = int(torch.randint(0, len(lengths) + 1, (1,), generator=gen))
            lengths.insert(at, 0)
            slots.insert(at, int(torch.randint(-1, num_slots, (1,), generator=gen)))

    ranks = torch.randint(1, max_rank + 1, (num_slots,), generator=gen, dtype=torch.int32)
    ranks[0] = max_rank
    x = torch.randn(tokens, case.in_features, generator=gen)
    lora_a = torch.randn(num_slices, num_slots, max_rank, case.in_features, generator=gen) / case.in_features**0.5
    out_total = sum(case.widths)
    lora_b = torch.randn(num_slots, out_total, max_rank, generator=gen) / max_rank**0.5
    for s, r in enumerate(ranks.tolist()):
        lora_a[:, s, r:] = float("nan")
        lora_b[s, :, r:] = float("nan")
    seg_starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seg_slots = torch.tensor(slots, dtype=torch.int32)
    token_slots = torch.repeat_interleave(seg_slots, torch.tensor(lengths, dtype=torch.int64))
    slot_ids = token_slots[torch.randperm(tokens, generator=gen)]
    slice_starts = [0, *torch.tensor(case.widths).cumsum(0).tolist()]
    out = torch.randn(tokens, out_total, generator=gen)
    lora_a, lora_b, ranks = behind_guard_slot(
        lora_a.to(device, case.dtype), lora_b.to(device, case.dtype), ranks.to(device)
    )
    return Batch(
        x.to(device, case.dtype),
        lora_a,
        lora_b,
        ranks,
        slice_starts,
        seg_starts.to(device),
        seg_slots.to(device),
        slot_ids.to(device),
        out.to(device, case.dtype),
    )


def behind_guard_slot(lora_a: torch.Tensor, lora_b: torch.Tensor, ranks: torch.Tensor):
    """(lora_a, lora_b, ranks) as views one slot into buffers whose extra slot in front has full rank and NaN
    weights: a kernel that indexed slot -1 instead of skipping the token would read NaN there rather than
    whatever lies before the allocation. lora_a also becomes non-contiguous (its slot stride skips the guard)."""
    guarded_a = torch.full(
        (lora_a.shape[0], lora_a.shape[1] + 1, *lora_a.shape[2:]),
        float("nan"),
        dtype=lora_a.dtype,
        device=lora_a.device,
    )
    guarded_b = torch.full(
        (lora_b.shape[0] + 1, *lora_b.shape[1:]), float("nan"), dtype=lora_b.dtype, device=lora_b.device
    )
    guarded_ranks = torch.full((ranks.shape[0] + 1,), lora_a.shape[2], dtype=ranks.dtype, device=ranks.device)
    guarded_a[:, 1:] = lora_a
    guarded_b[1:] = lora_b
    guarded_ranks[1:] = ranks
    return guarded_a[:, 1:], guarded_b[1:], guarded_ranks[1:]


# ---- the independent reference -------------------------------------------------------------------------------------


def loop_lora(x, lora_a, lora_b, ranks, slice_starts, token_slots, out):
    """Per token, in float64, from the layout contract: y[k, t, :r] = A[k, s, :r] @ x[t];
    out[t, slice k] += B[s, slice k, :r] @ y[k, t, :r]. Returns (y [K, T, R], out [T, out_total]) in float64."""
    num_slices, _, max_rank, _ = lora_a.shape
    y = torch.zeros(num_slices, x.shape[0], max_rank, dtype=torch.float64)
    new_out = out.double().cpu().clone()
    for t, s in enumerate(token_slots.tolist()):
        if s < 0:
            continue
        r = int(ranks[s])
        for k in range(num_slices):
            a, b = slice_starts[k], slice_starts[k + 1]
            y[k, t, :r] = lora_a[k, s, :r].double().cpu() @ x[t].double().cpu()
            new_out[t, a:b] += lora_b[s, a:b, :r].double().cpu() @ y[k, t, :r]
    return y, new_out


def poison_unread_y(y: torch.Tensor, ranks: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """y with NaN wherever expand must not read: columns past the token's rank, and every column of -1 tokens."""
    y = y.clone()
    for t, s in enumerate(token_slots.tolist()):
        y[:, t, int(ranks[s]) if s >= 0 else 0 :] = float("nan")
    return y


def assert_rows_unchanged(after: torch.Tensor, before: torch.Tensor, rows: torch.Tensor) -> None:
    """Bit for bit (NaN-safe): compares the raw bits of those rows."""
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[after.dtype]
    assert torch.equal(after[rows].view(bits), before[rows].view(bits))


# ---- the sweep ---------------------------------------------------------------------------------------------------


def run_form(batch: Batch, form: str, small_blocks: bool):
    """(shrink kernel, expand kernel, shrink twin, expand twin, per-token slots) of one mapping form."""

    def blocks(name: str) -> dict:
        return SMALL_BLOCKS[name] if small_blocks else {}

    if form == "segmented":
        seg = (batch.seg_starts, batch.seg_slots)
        return (
            lambda: sgmv_shrink(batch.x, batch.lora_a, batch.ranks, *seg, **blocks("sgmv_shrink")),
            lambda y, out: sgmv_expand(
                y, batch.lora_b, batch.ranks, batch.slice_starts, *seg, out, **blocks("sgmv_expand")
            ),
            lambda: ref.sgmv_shrink(batch.x, batch.lora_a, batch.ranks, *seg),
            lambda y, out: ref.sgmv_expand(y, batch.lora_b, batch.ranks, batch.slice_starts, *seg, out),
            ref.segment_slot_ids(*seg),
        )
    ids = batch.slot_ids
    return (
        lambda: bgmv_shrink(batch.x, batch.lora_a, batch.ranks, ids, **blocks("bgmv_shrink")),
        lambda y, out: bgmv_expand(y, batch.lora_b, batch.ranks, batch.slice_starts, ids, out, **blocks("bgmv_expand")),
        lambda: ref.bgmv_shrink(batch.x, batch.lora_a, batch.ranks, ids),
        lambda y, out: ref.bgmv_expand(y, batch.lora_b, batch.ranks, batch.slice_starts, ids, out),
        ids,
    )


def mapping_of(batch: Batch, form: str) -> dict[str, torch.Tensor]:
    if form == "segmented":
        return {"seg_starts": batch.seg_starts, "seg_slots": batch.seg_slots}
    return {"slot_ids": batch.slot_ids}


@pytest.mark.parametrize("form", ["segmented", "per_row"])
@pytest.mark.parametrize("case", sweep_cases(), ids=str)
def test_kernels_match_twins_match_loop(case: Case, form: str):
    batch = make_batch(case)
    shrink, expand, shrink_twin, expand_twin, token_slots = run_form(batch, form, case.small_blocks)
    y_loop, out_loop = loop_lora(
        batch.x, batch.lora_a, batch.lora_b, batch.ranks, batch.slice_starts, token_slots, batch.out
    )

    y_twin = shrink_twin()
    torch.testing.assert_close(y_twin.double().cpu(), y_loop, **Y_TOL)
    y_kernel = shrink()
    assert y_kernel.dtype == torch.float32 and y_kernel.shape == y_loop.shape
    torch.testing.assert_close(y_kernel, y_twin, **Y_TOL)
    assert (y_kernel.cpu()[y_loop == 0] == 0).all(), "columns past the rank and -1 tokens must be exactly 0"

    y_in = poison_unread_y(y_twin, batch.ranks, token_slots)
    out_twin, out_kernel = batch.out.clone(), batch.out.clone()
    expand_twin(y_in, out_twin)
    expand(y_in, out_kernel)
    torch.testing.assert_close(out_twin.double().cpu(), out_loop, **OUT_TOL_VS_LOOP[case.dtype])
    torch.testing.assert_close(out_kernel, out_twin, **OUT_TOL_VS_TWIN[case.dtype])
    no_adapter = token_slots < 0
    assert_rows_unchanged(out_kernel, batch.out, no_adapter)
    assert_rows_unchanged(out_twin, batch.out, no_adapter)


def test_sweep_covers_every_axis_value():
    cases = sweep_cases()
    for axis, values in AXES.items():
        assert {getattr(c, axis) for c in cases} >= set(values), axis


# ---- focused checks ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("form", ["segmented", "per_row"])
def test_minus_one_rows_bitwise_unchanged(dtype: torch.dtype, form: str, monkeypatch: pytest.MonkeyPatch):
    """Rows with slot -1 keep their exact bits, whatever they hold (NaN and inf included), through the kernels
    and through apply_lora."""
    batch = make_batch(Case(dtype=dtype, tokens=40, spread="uniform", minus_one_rows=True, seed=7))
    token_slots = ref.segment_slot_ids(batch.seg_starts, batch.seg_slots) if form == "segmented" else batch.slot_ids
    rows = token_slots < 0
    assert rows.any() and (~rows).any()
    batch.out[rows.nonzero()[0, 0], :3] = torch.tensor([float("nan"), float("inf"), -0.0], dtype=dtype, device=DEVICE)
    mapping = mapping_of(batch, form)
    out = batch.out.clone()
    force_path(monkeypatch, "kernels")
    ops.apply_lora(batch.x, out, batch.lora_a, batch.lora_b, batch.ranks, batch.slice_starts, **mapping)
    assert_rows_unchanged(out, batch.out, rows)
    assert not torch.equal(out[~rows], batch.out[~rows])


@pytest.mark.parametrize("form", ["segmented", "per_row"])
def test_rank_zero_slot_is_a_no_op(form: str):
    """A slot with rank 0 (nothing loaded) gives y = 0 and leaves its rows' out bits as they were."""
    batch = make_batch(Case(spread="identical", minus_one_rows=False, empty_segments=False, seed=3))
    batch.ranks.zero_()
    batch.lora_a.fill_(float("nan"))
    batch.lora_b.fill_(float("nan"))
    shrink, expand, _, _, _ = run_form(batch, form, small_blocks=False)
    y = shrink()
    assert torch.equal(y, torch.zeros_like(y))
    out = batch.out.clone()
    expand(y, out)
    assert_rows_unchanged(out, batch.out, torch.ones(batch.out.shape[0], dtype=torch.bool, device=DEVICE))


@pytest.mark.parametrize("path", ["kernels", "twins"])
def test_empty_batch(path: str, monkeypatch: pytest.MonkeyPatch):
    batch = make_batch(Case(tokens=1, seed=5))
    x, out = batch.x[:0], batch.out[:0]
    force_path(monkeypatch, path)
    y = ops.lora_shrink(x, batch.lora_a, batch.ranks, slot_ids=batch.slot_ids[:0])
    assert y.shape == (3, 0, batch.lora_a.shape[2])
    no_segments = {
        "seg_starts": torch.zeros(1, dtype=torch.int32, device=DEVICE),
        "seg_slots": torch.zeros(0, dtype=torch.int32, device=DEVICE),
    }
    y = ops.lora_shrink(x, batch.lora_a, batch.ranks, **no_segments)
    assert y.shape == (3, 0, batch.lora_a.shape[2])
    ops.lora_expand(y, batch.lora_b, batch.ranks, batch.slice_starts, out, **no_segments)


@pytest.mark.parametrize("form", ["segmented", "per_row"])
def test_slice_starts_as_list_or_tensor(form: str, monkeypatch: pytest.MonkeyPatch):
    """A list, a CPU tensor and a device tensor (on the GPU tier: the no-copy path, whose grid assumes every slice
    may be out_total wide) give the same bits."""
    force_path(monkeypatch, "kernels")
    batch = make_batch(Case(widths=(16, 64, 16), seed=11))
    _, _, shrink_twin, _, token_slots = run_form(batch, form, small_blocks=False)
    y = poison_unread_y(shrink_twin(), batch.ranks, token_slots)
    results = []
    for starts in (
        batch.slice_starts,
        torch.tensor(batch.slice_starts),
        torch.tensor(batch.slice_starts, dtype=torch.int32, device=DEVICE),
    ):
        out = batch.out.clone()
        ops.lora_expand(y, batch.lora_b, batch.ranks, starts, out, **mapping_of(batch, form))
        results.append(out)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_integer_tensors_may_be_int64():
    batch = make_batch(Case(seed=13))
    seg = (batch.seg_starts.long(), batch.seg_slots.long())
    y64 = sgmv_shrink(batch.x, batch.lora_a, batch.ranks.long(), *seg)
    y32 = sgmv_shrink(batch.x, batch.lora_a, batch.ranks, batch.seg_starts, batch.seg_slots)
    assert torch.equal(y64, y32)


# ---- the dispatcher ----------------------------------------------------------------------------------------------


def test_use_kernels_on_cuda_with_triton_only(monkeypatch: pytest.MonkeyPatch):
    """The one switch: a device's type and whether triton is installed, nothing else (the interpreter the CPU
    tier runs the kernel wrappers in does not send the ops to the kernels)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ops.use_kernels("cuda") and ops.use_kernels(torch.device("cuda", 0))
    assert not ops.use_kernels("cpu") and not ops.use_kernels(torch.device("cpu"))
    assert not ops.use_kernels("meta")
    monkeypatch.setitem(sys.modules, "triton", None)  # triton missing: twins on CUDA too
    assert not ops.use_kernels("cuda")


@pytest.mark.parametrize("form", ["segmented", "per_row"])
def test_apply_lora_dispatch(form: str, monkeypatch: pytest.MonkeyPatch):
    """apply_lora is the kernel wrappers where use_kernels says so and the twins elsewhere, bit for bit; the
    default follows the device (the twins on the CPU tier)."""
    batch = make_batch(Case(dtype=torch.float16, tokens=33, spread="zipf", seed=21))
    mapping = mapping_of(batch, form)
    shrink, expand, shrink_twin, expand_twin, token_slots = run_form(batch, form, small_blocks=False)
    _, out_loop = loop_lora(
        batch.x, batch.lora_a, batch.lora_b, batch.ranks, batch.slice_starts, token_slots, batch.out
    )

    def dispatched() -> torch.Tensor:
        out = batch.out.clone()
        ops.apply_lora(batch.x, out, batch.lora_a, batch.lora_b, batch.ranks, batch.slice_starts, **mapping)
        return out

    default = dispatched()
    force_path(monkeypatch, "kernels")
    via_kernels = dispatched()
    force_path(monkeypatch, "twins")
    via_twins = dispatched()
    direct_kernels, direct_twins = batch.out.clone(), batch.out.clone()
    expand(shrink(), direct_kernels)
    expand_twin(shrink_twin(), direct_twins)
    assert torch.equal(via_kernels, direct_kernels) and torch.equal(via_twins, direct_twins)
    assert torch.equal(default, via_kernels if ops.use_kernels(DEVICE) else via_twins)
    torch.testing.assert_close(via_kernels, via_twins, **OUT_TOL_VS_TWIN[torch.float16])
    torch.testing.assert_close(via_twins.double().cpu(), out_loop, **OUT_TOL_VS_LOOP[torch.float16])


def test_exactly_one_mapping_is_given():
    batch = make_batch(Case(seed=2))
    with pytest.raises(AssertionError):
        ops.lora_shrink(batch.x, batch.lora_a, batch.ranks)
    with pytest.raises(AssertionError):
        ops.lora_shrink(
            batch.x,
            batch.lora_a,
            batch.ranks,
            slot_ids=batch.slot_ids,
            seg_starts=batch.seg_starts,
            seg_slots=batch.seg_slots,
        )
    with pytest.raises(AssertionError):
        ops.lora_shrink(batch.x, batch.lora_a, batch.ranks, seg_starts=batch.seg_starts)


# ---- the GPU compiler, without a GPU -------------------------------------------------------------------------------

COMPILE_SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.bgmv_expand import _bgmv_expand_kernel
    from kernels.bgmv_shrink import _bgmv_shrink_kernel
    from kernels.sgmv_expand import _sgmv_expand_kernel
    from kernels.sgmv_shrink import _sgmv_shrink_kernel

    def compile_for_sm90(fn, pointers, constexprs):
        signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32") for name in fn.arg_names}
        consts = {(fn.arg_names.index(name),): value for name, value in constexprs.items()}
        triton.compile(ASTSource(fn, signature, constexprs=consts), target=GPUTarget("cuda", 90, 32))

    for dt in ("fp16", "bf16"):
        ints = {name: "*i32" for name in ("ranks_ptr", "seg_starts_ptr", "seg_slots_ptr", "slot_ids_ptr",
                                          "slice_starts_ptr")}
        tiles = {"tile_seg_ptr": "*i64", "tile_row_ptr": "*i64"}
        for split_k in (1, 2):
            compile_for_sm90(_sgmv_shrink_kernel, {**ints, **tiles, "x_ptr": "*" + dt, "a_ptr": "*" + dt,
                                                   "y_ptr": "*fp32"},
                             dict(BLOCK_T=32, BLOCK_R=16, BLOCK_K=64, SPLIT_K=split_k, DOT_IN_FP32=False,
                                  PRECISION="tf32"))
            compile_for_sm90(_bgmv_shrink_kernel, {**ints, "x_ptr": "*" + dt, "a_ptr": "*" + dt, "y_ptr": "*fp32"},
                             dict(BLOCK_R=16, BLOCK_K=256, SPLIT_K=split_k))
        compile_for_sm90(_sgmv_expand_kernel, {**ints, **tiles, "y_ptr": "*fp32", "b_ptr": "*" + dt,
                                               "out_ptr": "*" + dt},
                         dict(BLOCK_T=32, BLOCK_N=64, BLOCK_R=16, DOT_IN_FP32=False, PRECISION="tf32"))
        compile_for_sm90(_bgmv_expand_kernel, {**ints, "y_ptr": "*fp32", "b_ptr": "*" + dt, "out_ptr": "*" + dt},
                         dict(BLOCK_N=128, BLOCK_R=16))
""")


@pytest.mark.slow
def test_kernels_compile_for_sm90(tmp_path: Path):
    """The interpreter accepts code the GPU compiler rejects (tl.dot shapes, scalar types), so compile each kernel
    to an sm_90 cubin with the ptxas that triton ships; needs no GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]


# ---- the GPU tier ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("widths", [(4096, 1024, 1024), (4096,), (14336, 14336)], ids=str)
@pytest.mark.parametrize("tokens", [1, 64, 2048])
@pytest.mark.parametrize("form", ["segmented", "per_row"])
def test_gpu_shapes_kernels_match_twins(dtype: torch.dtype, widths: tuple[int, ...], tokens: int, form: str):
    case = Case(
        dtype=dtype, rank=16, tokens=tokens, spread="zipf", widths=widths, in_features=4096, seed=tokens + len(widths)
    )
    batch = make_batch(case)  # NaN past each slot's rank: the GPU must not read it either
    shrink, expand, shrink_twin, expand_twin, _ = run_form(batch, form, small_blocks=False)
    y_twin = shrink_twin()
    torch.testing.assert_close(shrink(), y_twin, atol=1e-3, rtol=1e-3)
    out_twin, out_kernel = batch.out.clone(), batch.out.clone()
    expand_twin(y_twin, out_twin)
    expand(y_twin, out_kernel)
    torch.cuda.synchronize()
    torch.testing.assert_close(out_kernel, out_twin, **OUT_TOL_VS_TWIN[dtype])


# ---- the segment path (kernels.segment_lora: what ops runs without the kernels when segments are host integers) --


@pytest.mark.parametrize("case", sweep_cases(), ids=str)
def test_segment_path_matches_loop(case: Case):
    """The segmented mapping as host (start, end, slot, rank) tuples, against the float64 loop: A and B hold NaN
    past each slot's rank (never read), rows without an adapter stay bit for bit, and the views the caller keeps
    give the same result on a second call."""
    from kernels.segment_lora import apply_lora_segments

    batch = make_batch(case)
    starts, slots, ranks = batch.seg_starts.tolist(), batch.seg_slots.tolist(), batch.ranks.tolist()
    segments = [(a, b, s, ranks[s]) for a, b, s in zip(starts, starts[1:], slots, strict=False) if s >= 0]
    token_slots = ref.segment_slot_ids(batch.seg_starts, batch.seg_slots)
    _, out_loop = loop_lora(
        batch.x, batch.lora_a, batch.lora_b, batch.ranks, batch.slice_starts, token_slots, batch.out
    )
    views: dict = {}
    for _ in range(2):
        out = batch.out.clone()
        apply_lora_segments(batch.x, out, batch.lora_a, batch.lora_b, batch.slice_starts, segments, views)
        # half types: y is rounded to the model's dtype and the product added in it (one more rounding than the twin)
        tol = {k: 2 * v for k, v in OUT_TOL_VS_LOOP[case.dtype].items()}
        torch.testing.assert_close(out.double().cpu(), out_loop, **tol)
        assert_rows_unchanged(out, batch.out, token_slots < 0)


def test_apply_lora_takes_the_segment_path_on_the_cpu(monkeypatch: pytest.MonkeyPatch):
    """ops.apply_lora with host segments: the segment path where the kernels do not run (and only there)."""
    import kernels.segment_lora as segment_lora

    batch = make_batch(Case(dtype=torch.float32))
    calls = []
    real = segment_lora.apply_lora_segments
    monkeypatch.setattr(segment_lora, "apply_lora_segments", lambda *a, **k: calls.append(1) or real(*a, **k))
    starts, slots, ranks = batch.seg_starts.tolist(), batch.seg_slots.tolist(), batch.ranks.tolist()
    segments = [(a, b, s, ranks[s]) for a, b, s in zip(starts, starts[1:], slots, strict=False) if s >= 0]
    args = (batch.x, batch.out.clone(), batch.lora_a, batch.lora_b, batch.ranks, batch.slice_starts)
    force_path(monkeypatch, "twins")
    ops.apply_lora(*args, **mapping_of(batch, "segmented"), host_segments=segments)
    assert calls == [1]
    force_path(monkeypatch, "kernels")
    ops.apply_lora(*args, **mapping_of(batch, "segmented"), host_segments=segments)
    assert calls == [1]
