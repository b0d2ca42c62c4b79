"""Weight-only quantized matmuls (kernels/int8_matmul.py, kernels/int4_matmul.py) and the dequantizers
(kernels/dequantize.py), checked against their torch twins (kernels/quant_reference.py), and each twin against a
float64 matmul with the weight dequantized here element by element from the format's contract (the independent
reference); the int4 repacking; the launch table (kernels/quant_tiles.py); then the dispatcher's quantized matmuls
(kernels/ops.py).

The sweep covers dtype, M, (N, K), the group (32, 64, per-channel), the kernel's block sizes (a K block inside one
group, equal to it, or spanning several; K tails), split-K and strided activations: every value of every axis once
against a base case, plus seeded random combinations, each for both formats. For int4 the K block is the weight's
pack width (the nibbles pair within it: 32 = a Q4_1 group, 64 and 128 = the GPU layout), so its cases are those
where that pack fits K and the group. Codes are drawn uniformly (every int8 value, every nibble), and scales so
that y is of order 1. Without a CUDA GPU the kernels run in the Triton interpreter on the CPU; with one, the same
tests run compiled on it.

Tolerances (kernel vs twin; twin vs float64):
- float32: 1e-5 abs + rel for both.
- float16: 2e-3 vs the twin (the kernel rounds each dequantized weight to float16 before the dot, as
  Int8Linear/Int4Linear.dequantize(x.dtype) does), 1e-3 vs float64 (one rounding of y).
- bfloat16: 1.6e-2 (2 ulps) vs the twin (the interpreter also rounds float32 -> bfloat16 toward zero), 8e-3 vs
  float64.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F

from lora_server.kernels import ops
from lora_server.kernels import quant_reference as ref
from lora_server.kernels.dequantize import dequantize_int4, dequantize_int8
from lora_server.kernels.int4_matmul import int4_matmul
from lora_server.kernels.int8_matmul import int8_matmul
from lora_server.kernels.quant_tiles import DEQUANT_MIN_TOKENS, Tiles, choose_tiles, int4_pack_width
from tests.kernel_env import DEVICE, TOL_VS_TWIN, force_path
from tests.kernel_env import TOL_VS_EXACT as TOL_VS_FLOAT64

PER_CHANNEL = 0  # group value meaning group == K


# ---- cases -------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: torch.dtype = torch.float16
    m: int = 3
    shape: tuple[int, int] = (64, 128)  # (N, K)
    group: int = 32  # PER_CHANNEL: one group per row
    block_k: int = 64
    block_n: int = 32
    split_k: int = 1
    strided_x: bool = False  # x a column slice of a wider tensor
    seed: int = 0

    def __str__(self) -> str:
        group = "pc" if self.group == PER_CHANNEL else self.group
        return (
            f"{str(self.dtype).removeprefix('torch.')}-M{self.m}-N{self.shape[0]}-K{self.shape[1]}-g{group}"
            f"-bk{self.block_k}-bn{self.block_n}-sk{self.split_k}{'-strided' if self.strided_x else ''}"
            f"-s{self.seed}"
        )

    @property
    def group_size(self) -> int:
        return self.shape[1] if self.group == PER_CHANNEL else self.group


AXES = {
    "dtype": (torch.float32, torch.float16, torch.bfloat16),
    "m": (1, 3, 16, 33),
    "shape": ((32, 64), (64, 128), (96, 192), (64, 96)),  # K = 96: a K tail for 64-column blocks
    "group": (32, 64, PER_CHANNEL),
    "block_k": (16, 32, 64, 128),
    "block_n": (16, 32),
    "split_k": (1, 2),
    "strided_x": (False, True),
}


def valid(case: Case) -> bool:
    """K splits into groups, and blocks and groups line up (the wrappers assert it)."""
    k, g = case.shape[1], case.group_size
    return k % g == 0 and (g == k or g % case.block_k == 0 or case.block_k % g == 0)


EXTRA_CASES = (  # per-channel with a K tail inside the one group, and K shorter than one block
    Case(shape=(64, 96), group=PER_CHANNEL, block_k=64),
    Case(dtype=torch.float32, m=33, shape=(32, 96), group=PER_CHANNEL, block_k=128, split_k=2),
)


def sweep_cases(num_random: int = 10) -> list[Case]:
    """The base case, each other value of each axis on it, the extra cases, then seeded random valid
    combinations."""
    base = Case()
    cases = [base, *EXTRA_CASES]
    for axis, values in AXES.items():
        for v in values:
            if v != getattr(base, axis):
                case = dataclasses.replace(base, **{axis: v})
                cases.append(case if valid(case) else dataclasses.replace(case, group=PER_CHANNEL))
    rng = random.Random(2024)
    num_fixed = len(cases)
    while len(cases) < num_fixed + num_random:
        case = Case(**{axis: rng.choice(values) for axis, values in AXES.items()}, seed=100 + len(cases))
        if valid(case):
            cases.append(case)
    return cases


def int8_weight(n: int, k: int, group: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight int8 [N, K] uniform in -127..127, scales fp16 [N, K // group] with weights of std ~1/sqrt(K))."""
    qweight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) + 0.5) / (73 * k**0.5)
    return qweight, scales.half()


def int4_weight(n: int, k: int, group: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(packed uint8 [N, K // 2] uniform bytes, scales, mins fp16 [N, K // group]), weights of std ~1/sqrt(K)."""
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=gen) + 0.5) / (4.6 * k**0.5)
    mins = -7.5 * scales * (1 + 0.2 * torch.randn(n, k // group, generator=gen))
    return packed, scales.half(), mins.half()


def make_x(case: Case, gen: torch.Generator) -> torch.Tensor:
    k = case.shape[1]
    x = torch.randn(case.m, 2 * k if case.strided_x else k, generator=gen)
    return x[:, k // 2 : k // 2 + k].to(DEVICE, case.dtype) if case.strided_x else x.to(DEVICE, case.dtype)


# ---- the independent reference -------------------------------------------------------------------------------------


def loop_dequant_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w[n, k] = scales[n, k // group] * qweight[n, k], group by group, float64."""
    q, s = qweight.cpu().double(), scales.cpu().double()
    group = q.shape[1] // s.shape[1]
    w = torch.empty_like(q)
    for g in range(s.shape[1]):
        w[:, g * group : (g + 1) * group] = q[:, g * group : (g + 1) * group] * s[:, g : g + 1]
    return w


def loop_dequant_int4(
    packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, pack: int | None = None
) -> torch.Tensor:
    """Byte j of pack block b holds column b * pack + j in its low nibble and b * pack + j + pack / 2 in its high
    nibble (pack None: the group); column c has scale and min of group c // group; w = scale * code + min,
    float64."""
    p, s, mn = packed.cpu().long(), scales.cpu().double(), mins.cpu().double()
    k = 2 * p.shape[1]
    group = k // s.shape[1]
    pack = group if pack is None else pack
    half = pack // 2
    w = torch.empty(p.shape[0], k, dtype=torch.float64)
    for b in range(k // pack):
        for j in range(half):
            byte = p[:, b * half + j]
            lo, hi = b * pack + j, b * pack + j + half
            w[:, lo] = (byte % 16).double() * s[:, lo // group] + mn[:, lo // group]
            w[:, hi] = (byte // 16).double() * s[:, hi // group] + mn[:, hi // group]
    return w


def formats(n: int, k: int, group: int, gen: torch.Generator, pack: int | None = None):
    """{name: (kernel, twin, float64 weight, weight tensors on DEVICE, layout kwargs)} for both formats of one
    random weight; int4's bytes are read with its nibbles paired within ``pack`` columns (None: the group)."""
    q8 = int8_weight(n, k, group, gen)
    q4 = int4_weight(n, k, group, gen)
    return {
        "int8": (int8_matmul, ref.int8_matmul, loop_dequant_int8(*q8), [t.to(DEVICE) for t in q8], {}),
        "int4": (
            int4_matmul,
            ref.int4_matmul,
            loop_dequant_int4(*q4, pack),
            [t.to(DEVICE) for t in q4],
            {"pack": pack},
        ),
    }


def valid_int4(case: Case) -> bool:
    """The int4 kernel's K step is its pack block (case.block_k): a power of two >= 32 dividing K, each half whole
    groups or the block inside one group (int4_matmul.check_pack)."""
    k, g, pack = case.shape[1], case.group_size, case.block_k
    return pack >= 32 and k % pack == 0 and ((pack // 2) % g == 0 or g % pack == 0)


# ---- the sweep ---------------------------------------------------------------------------------------------------

FORMAT_CASES = [
    pytest.param(case, fmt, id=f"{case}-{fmt}")
    for case in sweep_cases()
    for fmt in ("int8", "int4")
    if fmt == "int8" or valid_int4(case)
]


@pytest.mark.parametrize("case, fmt", FORMAT_CASES)
def test_quant_matmul_matches_twin_matches_float64(case: Case, fmt: str):
    gen = torch.Generator().manual_seed(case.seed)
    n, k = case.shape
    pack = case.block_k if fmt == "int4" else None
    kernel, twin, w64, weight, layout = formats(n, k, case.group_size, gen, pack)[fmt]
    x = make_x(case, gen)

    y_twin = twin(x, *weight, **layout)
    torch.testing.assert_close(y_twin.double().cpu(), x.double().cpu() @ w64.T, **TOL_VS_FLOAT64[case.dtype])
    blocks = layout if fmt == "int4" else {"block_k": case.block_k}
    y = kernel(x, *weight, **blocks, block_n=case.block_n, block_m=16, split_k=case.split_k)
    assert y.dtype == case.dtype and y.shape == (case.m, n)
    torch.testing.assert_close(y, y_twin, **TOL_VS_TWIN[case.dtype])


def test_int4_sweep_covers_every_pack_and_group():
    """The int4 cases run the Q4_1 layout (pack = group = 32), wider packs over several groups (64, 128), a
    pack inside one group (group 64, pack 32) and per-channel weights."""
    int4 = [case for case in sweep_cases() if valid_int4(case)]
    combos = {(c.block_k, c.group) for c in int4}
    assert {(32, 32), (64, 32), (128, 32), (32, 64)} <= combos, combos
    assert any(c.group == PER_CHANNEL for c in int4)


def test_sweep_covers_every_axis_value():
    cases = sweep_cases()
    for axis, values in AXES.items():
        assert {getattr(c, axis) for c in cases} >= set(values), axis
    assert all(valid(c) for c in cases)


# ---- focused checks ----------------------------------------------------------------------------------------------


def test_twins_match_the_quantizer_layout():
    """The twins dequantize a weight the project's quantizer packed to within its rounding, so the layout the
    twins (and kernels) read is the one lora_server.model.quant writes."""
    from lora_server.model.quant import quantize_int4, quantize_int8

    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    for group in (32, None):
        q, s = quantize_int8(w, group)
        torch.testing.assert_close(ref.dequantize_int8(q, s), w, atol=0.02, rtol=0)
    packed, s, mn = quantize_int4(w, 32)
    torch.testing.assert_close(ref.dequantize_int4(packed, s, mn), w, atol=0.25, rtol=0)
    torch.testing.assert_close(
        ref.dequantize_int4(packed, s, mn).double(), loop_dequant_int4(packed, s, mn), atol=0, rtol=0
    )


def test_dequantizers_in_a_dtype_and_over_leading_dims():
    """dequantize_int8 in float16 rounds each exact product once (the float64 dequant rounded to float16); rows
    picked first, or in a [2, N // 2] batch of rows, dequantize as those rows of the whole weight; unpack_int4
    gives the nibbles in column order."""
    gen = torch.Generator().manual_seed(8)
    q, s = int8_weight(8, 64, 32, gen)
    packed, s4, mn = int4_weight(8, 64, 32, gen)
    assert torch.equal(ref.dequantize_int8(q, s, torch.float16), loop_dequant_int8(q, s).half())
    ids = torch.tensor([5, 0, 5])
    for dtype in (torch.float32, torch.bfloat16):
        w8, w4 = ref.dequantize_int8(q, s, dtype), ref.dequantize_int4(packed, s4, mn, dtype)
        assert w8.dtype == dtype and w4.dtype == dtype and w8.shape == w4.shape == (8, 64)
        assert torch.equal(ref.dequantize_int8(q[ids], s[ids], dtype), w8[ids])
        assert torch.equal(ref.dequantize_int4(packed[ids], s4[ids], mn[ids], dtype), w4[ids])
        assert torch.equal(
            ref.dequantize_int8(q.unflatten(0, (2, 4)), s.unflatten(0, (2, 4)), dtype), w8.unflatten(0, (2, 4))
        )
    codes = ref.unpack_int4(packed, 2)
    assert codes.shape == (8, 64)
    assert torch.equal(
        codes.double() * s4.double().repeat_interleave(32, 1) + mn.double().repeat_interleave(32, 1),
        loop_dequant_int4(packed, s4, mn),
    )


def test_repack_int4_hand_values():
    """Codes 0..63 of one row (c % 16 each) in Q4_1 layout (pairs within 32 columns) repacked to pairs within 64
    columns: byte j holds column j (low) and column j + 32 (high); back again gives the same bytes."""
    codes = torch.arange(64).remainder(16).to(torch.uint8)[None, :]  # [1, 64]
    q4_1 = ref.pack_int4(codes, 2)
    assert q4_1[0, 0].item() == 0 | (16 % 16) << 4 and q4_1[0, 5].item() == 5 | (21 % 16) << 4
    wide = ref.repack_int4(q4_1, 32, 64)
    assert [wide[0, j].item() for j in (0, 5, 31)] == [0 | (32 % 16) << 4, 5 | (37 % 16) << 4, 15 | (63 % 16) << 4]
    assert torch.equal(ref.unpack_int4(wide, 1), codes) and torch.equal(ref.repack_int4(wide, 64, 32), q4_1)
    gen = torch.Generator().manual_seed(4)
    packed, s4, mn = int4_weight(8, 256, 32, gen)
    for pack in (64, 128):
        repacked = ref.repack_int4(packed, 32, pack)
        assert torch.equal(ref.dequantize_int4(repacked, s4, mn, pack=pack), ref.dequantize_int4(packed, s4, mn))
        assert torch.equal(loop_dequant_int4(repacked, s4, mn, pack), loop_dequant_int4(packed, s4, mn))


def test_int4_pack_width():
    """The widest pack of 128, 64, 32 dividing K that lines up with the group; the group itself otherwise."""
    assert int4_pack_width(4096, 32) == 128 and int4_pack_width(4096, 128) == 128
    assert int4_pack_width(576, 32) == 64  # SmolLM2's hidden size: 4.5 blocks of 128
    assert int4_pack_width(1536, 32) == 128 and int4_pack_width(96, 32) == 32
    assert int4_pack_width(4096, 4096) == 128  # per-channel: the block lies inside the one group
    assert int4_pack_width(4096, 64) == 128 and int4_pack_width(192, 96) == 32  # blocks of 32 inside groups of 96
    assert int4_pack_width(48, 48) == 48  # nothing fits: the group's own (Q4_1-like) layout
    # fp32 activations: at most 32 (wider K steps spill)
    assert int4_pack_width(4096, 32, 4) == 32 and int4_pack_width(4096, 4096, 4) == 32
    assert int4_pack_width(48, 48, 4) == 48


def test_choose_tiles_hand_values():
    """Buckets by M; split-K until the grid has a program per SM (132), at most 16, two K blocks per split at
    least. Llama-3-8B's projections at batch 1: q|k|v 6144 x 4096 is 96 tiles of 64 columns -> split 2; o 4096 x
    4096 is 64 tiles -> split 4 (2 gives 128 < 132); gate|up 28672 x 4096 is 448 tiles -> no split; down 4096 x
    14336 -> split 4. SmolLM2's o 576 x 576 is 9 tiles and 5 K blocks -> split 2 (4 would leave one block per
    split)."""
    assert choose_tiles(1, 6144, 4096) == Tiles(16, 64, 128, 2, 4, 4)
    assert choose_tiles(1, 4096, 4096).split_k == 4 and choose_tiles(1, 28672, 4096).split_k == 1
    assert choose_tiles(16, 4096, 14336).split_k == 4
    assert choose_tiles(1, 576, 576).split_k == 2
    assert choose_tiles(17, 4096, 4096) == Tiles(32, 64, 128, 4, 4, 3)
    assert choose_tiles(64, 4096, 4096) == Tiles(64, 64, 128, 4, 4, 3)
    assert choose_tiles(128, 6144, 4096) == Tiles(64, 128, 128, 2, 8, 3)  # 2 x 48 tiles
    assert choose_tiles(200, 4096, 4096) == Tiles(64, 128, 64, 2, 8, 3)  # 4 x 32 tiles
    # fp32 activations: 16 x 32 x 32 up to 16 rows, 32 x 32 x 32 beyond (q|k|v at 17 rows: 192 tiles, no split)
    assert choose_tiles(1, 6144, 4096, itemsize=4) == Tiles(16, 32, 32, 1, 4, 3)
    assert choose_tiles(17, 6144, 4096, itemsize=4) == Tiles(32, 32, 32, 1, 4, 3)
    assert choose_tiles(1, 576, 576, itemsize=4) == Tiles(16, 32, 32, 8, 4, 3)  # 18 tiles, 18 K blocks
    assert choose_tiles(1, 4096, 4096, block_k=64).block_k == 64 and choose_tiles(1, 64, 64, num_sms=1).split_k == 1
    assert all(t.split_k <= 16 for t in (choose_tiles(1, 64, 1 << 20), choose_tiles(1, 16, 1 << 16)))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("m", [1, 20, 40, 100, 150])
def test_table_tiles_match_twin(fmt: str, m: int):
    """Each bucket's tiles (and the split-K the table gives a 24-SM device) run the kernels right: int4 in the
    GPU's 128-column pack."""
    gen = torch.Generator().manual_seed(m)
    pack = 128 if fmt == "int4" else None
    kernel, twin, _, weight, layout = formats(96, 512, 32, gen, pack)[fmt]
    tiles = choose_tiles(m, 96, 512, num_sms=24, block_k=pack)
    x = torch.randn(m, 512, generator=gen).to(DEVICE, torch.bfloat16)
    y = kernel(x, *weight, **layout, **tiles.kwargs(with_block_k=fmt == "int8"))
    torch.testing.assert_close(y, twin(x, *weight, **layout), **TOL_VS_TWIN[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [32, 64, PER_CHANNEL])
def test_dequantize_kernels_equal_twins(dtype: torch.dtype, group: int):
    """kernels/dequantize.py = the twins computed in float32 and rounded once to the dtype, bit for bit (bfloat16
    in the interpreter within one ulp: it rounds float32 -> bfloat16 toward zero); int4 in the Q4_1 layout and in
    64- and 128-column packs; N not a multiple of the kernel's block."""
    gen = torch.Generator().manual_seed(group)
    n, k = 70, 256
    g = k if group == PER_CHANNEL else group

    def check(y: torch.Tensor, expected: torch.Tensor) -> None:
        if dtype == torch.bfloat16 and DEVICE == "cpu":
            torch.testing.assert_close(y, expected, atol=0, rtol=2**-7)
        else:
            assert torch.equal(y, expected)

    q8 = [t.to(DEVICE) for t in int8_weight(n, k, g, gen)]
    check(dequantize_int8(*q8, dtype, block_k=64), ref.dequantize_int8(*q8).to(dtype))
    q4 = [t.to(DEVICE) for t in int4_weight(n, k, g, gen)]
    for pack in (None, 64, 128):
        if pack is not None and not ((pack // 2) % g == 0 or g % pack == 0):
            continue
        check(dequantize_int4(*q4, dtype, pack=pack), ref.dequantize_int4(*q4, pack=pack).to(dtype))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_default_blocks_and_empty_input(fmt: str):
    gen = torch.Generator().manual_seed(5)
    kernel, twin, _, weight, _ = formats(64, 256, 32, gen)[fmt]
    x = torch.randn(5, 256, generator=gen).to(DEVICE, torch.float16)
    torch.testing.assert_close(kernel(x, *weight), twin(x, *weight), **TOL_VS_TWIN[torch.float16])
    assert kernel(x[:0], *weight).shape == (0, 64)


def test_misaligned_blocks_are_refused():
    """Groups of 96 with 64-column K blocks would split groups across blocks: both wrappers refuse it."""
    gen = torch.Generator().manual_seed(1)
    formats_96 = formats(32, 192, 96, gen)
    x = torch.randn(2, 192).to(DEVICE)
    with pytest.raises(AssertionError, match="one must divide the other"):
        int8_matmul(x, *formats_96["int8"][3], block_k=64)
    with pytest.raises(AssertionError, match="do not line up"):
        int4_matmul(x, *formats_96["int4"][3], pack=64)
    with pytest.raises(AssertionError, match="a power of two"):
        int4_matmul(x, *formats_96["int4"][3])  # the Q4_1-style pack of one 96-column group


# ---- the dispatcher ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt, pack", [("int8", None), ("int4", None), ("int4", 128)])
def test_dispatch(fmt: str, pack: int | None, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch):
    """ops.int8_matmul / int4_matmul are the kernel wrapper with quant_tiles.choose_tiles' launch plus the bias
    where use_kernels says so, and elsewhere F.linear over the twin's dequantization in x's dtype (for float32 x
    without a bias: the twin itself), bit for bit; the default follows the device (the twins' path on the CPU
    tier)."""
    gen = torch.Generator().manual_seed(9)
    kernel, twin, _, weight, layout = formats(48, 128, 32, gen, pack)[fmt]
    dispatch = {"int8": ops.int8_matmul, "int4": ops.int4_matmul}[fmt]
    x = torch.randn(5, 128, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(48, generator=gen).to(DEVICE, dtype)
    tiles = choose_tiles(
        5,
        48,
        128,
        num_sms=ops._num_sms(x.device),
        block_k=pack or (32 if fmt == "int4" else None),
        itemsize=dtype.itemsize,
    )
    launch = {**layout, **tiles.kwargs(with_block_k=fmt == "int8")}

    default = dispatch(x, *weight, bias, **layout)
    force_path(monkeypatch, "kernels")
    via_kernels = dispatch(x, *weight, bias, **layout)
    assert torch.equal(via_kernels, kernel(x, *weight, **launch) + bias)
    assert torch.equal(dispatch(x, *weight, **layout), kernel(x, *weight, **launch))
    force_path(monkeypatch, "twins")
    via_twins = dispatch(x, *weight, bias, **layout)
    dequantize = {"int8": ref.dequantize_int8, "int4": ref.dequantize_int4}[fmt]
    assert torch.equal(via_twins, F.linear(x, dequantize(*weight, dtype, **layout), bias))
    if dtype == torch.float32:
        assert torch.equal(dispatch(x, *weight, **layout), twin(x, *weight, **layout))
    assert torch.equal(default, via_kernels if ops.use_kernels(DEVICE) else via_twins)
    torch.testing.assert_close(via_kernels, via_twins, **TOL_VS_TWIN[dtype])


@pytest.mark.parametrize("fmt, pack", [("int8", None), ("int4", 128)])
def test_dispatch_prefill_dequantizes(fmt: str, pack: int | None, monkeypatch: pytest.MonkeyPatch):
    """From DEQUANT_MIN_TOKENS rows the kernel path dequantizes the weight (kernels/dequantize.py) and multiplies
    with F.linear: exactly that, and within the twin's tolerance."""
    gen = torch.Generator().manual_seed(11)
    _, twin, _, weight, layout = formats(32, 256, 32, gen, pack)[fmt]
    dispatch = {"int8": ops.int8_matmul, "int4": ops.int4_matmul}[fmt]
    deq = {"int8": dequantize_int8, "int4": dequantize_int4}[fmt]
    x = torch.randn(DEQUANT_MIN_TOKENS, 256, generator=gen).to(DEVICE, torch.bfloat16)
    bias = torch.randn(32, generator=gen).to(DEVICE, torch.bfloat16)
    force_path(monkeypatch, "kernels")
    y = dispatch(x, *weight, bias, **layout)
    assert torch.equal(y, F.linear(x, deq(*weight, torch.bfloat16, **layout), bias))
    y = dispatch(x, *weight, **layout)
    torch.testing.assert_close(y, twin(x, *weight, **layout), **TOL_VS_TWIN[torch.bfloat16])


# ---- real shapes, on the GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt, group, pack", [("int8", None, None), ("int8", 32, None), ("int4", 32, 128)])
def test_quant_matmul_real_shapes(dtype: torch.dtype, fmt: str, group: int | None, pack: int | None):
    """Llama-3-8B's shapes through ops with the table's launches (decode buckets, split-K) and, from 256 rows,
    dequantization + cuBLAS, against the twin."""
    gen = torch.Generator().manual_seed(3)
    for n, k in ((6144, 4096), (4096, 14336)):
        _, twin, _, weight, layout = formats(n, k, group or k, gen, pack)[fmt]  # None: per channel
        dispatch = {"int8": ops.int8_matmul, "int4": ops.int4_matmul}[fmt]
        for m in (1, 7, 16, 33, 64, 100, 256, 1024):
            x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
            torch.testing.assert_close(dispatch(x, *weight, **layout), twin(x, *weight, **layout), **TOL_VS_TWIN[dtype])
