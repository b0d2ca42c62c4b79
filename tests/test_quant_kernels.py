"""Weight-only quantized matmuls (kernels/int8_matmul.py, kernels/int4_matmul.py), checked against their torch
twins (kernels/quant_reference.py), and each twin against a float64 matmul with the weight dequantized here element
by element from the format's contract (the independent reference); then the dispatcher's quantized matmuls
(kernels/ops.py).

The sweep covers dtype, M, (N, K), the group (32, 64, per-channel), the kernel's block sizes (a K block inside one
group, equal to it, or spanning several; K tails), split-K and strided activations: every value of every axis once
against a base case, plus seeded random combinations, each for both formats. Codes are drawn uniformly (every int8
value, every nibble), and scales so that y is of order 1. Without a CUDA GPU the kernels run in the Triton
interpreter on the CPU; with one, the same tests run compiled on it.

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

from kernels import ops
from kernels import quant_reference as ref
from kernels.int4_matmul import int4_matmul
from kernels.int8_matmul import int8_matmul
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


def loop_dequant_int4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Byte j of group g holds column g * group + j in its low nibble and g * group + j + group / 2 in its high
    nibble; w = scale * code + min, float64."""
    p, s, mn = packed.cpu().long(), scales.cpu().double(), mins.cpu().double()
    num_groups = s.shape[1]
    group = 2 * p.shape[1] // num_groups
    half = group // 2
    w = torch.empty(p.shape[0], 2 * p.shape[1], dtype=torch.float64)
    for g in range(num_groups):
        for j in range(half):
            byte = p[:, g * half + j]
            w[:, g * group + j] = (byte % 16).double() * s[:, g] + mn[:, g]
            w[:, g * group + j + half] = (byte // 16).double() * s[:, g] + mn[:, g]
    return w


def formats(n: int, k: int, group: int, gen: torch.Generator):
    """{name: (kernel, twin, float64 weight, weight tensors on DEVICE)} for both formats of one random weight."""
    q8 = int8_weight(n, k, group, gen)
    q4 = int4_weight(n, k, group, gen)
    return {
        "int8": (int8_matmul, ref.int8_matmul, loop_dequant_int8(*q8), [t.to(DEVICE) for t in q8]),
        "int4": (int4_matmul, ref.int4_matmul, loop_dequant_int4(*q4), [t.to(DEVICE) for t in q4]),
    }


# ---- the sweep ---------------------------------------------------------------------------------------------------

# int4 takes block_k // 2 packed bytes per dot, so its kernel needs block_k >= 32 (it asserts that); smaller K blocks
# are int8 cases only
FORMAT_CASES = [
    pytest.param(case, fmt, id=f"{case}-{fmt}")
    for case in sweep_cases()
    for fmt in ("int8", "int4")
    if fmt == "int8" or case.block_k >= 32
]


@pytest.mark.parametrize("case, fmt", FORMAT_CASES)
def test_quant_matmul_matches_twin_matches_float64(case: Case, fmt: str):
    gen = torch.Generator().manual_seed(case.seed)
    n, k = case.shape
    kernel, twin, w64, weight = formats(n, k, case.group_size, gen)[fmt]
    x = make_x(case, gen)

    y_twin = twin(x, *weight)
    torch.testing.assert_close(y_twin.double().cpu(), x.double().cpu() @ w64.T, **TOL_VS_FLOAT64[case.dtype])
    y = kernel(x, *weight, block_k=case.block_k, block_n=case.block_n, block_m=16, split_k=case.split_k)
    assert y.dtype == case.dtype and y.shape == (case.m, n)
    torch.testing.assert_close(y, y_twin, **TOL_VS_TWIN[case.dtype])


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


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_default_blocks_and_empty_input(fmt: str):
    gen = torch.Generator().manual_seed(5)
    kernel, twin, _, weight = formats(64, 256, 32, gen)[fmt]
    x = torch.randn(5, 256, generator=gen).to(DEVICE, torch.float16)
    torch.testing.assert_close(kernel(x, *weight), twin(x, *weight), **TOL_VS_TWIN[torch.float16])
    assert kernel(x[:0], *weight).shape == (0, 64)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_misaligned_blocks_are_refused(fmt: str):
    """Groups of 96 with 64-column K blocks would split groups across blocks: the wrapper refuses it."""
    kernel, _, _, weight = formats(32, 192, 96, torch.Generator().manual_seed(1))[fmt]
    x = torch.randn(2, 192).to(DEVICE)
    with pytest.raises(AssertionError, match="one must divide the other"):
        kernel(x, *weight, block_k=64)


# ---- the dispatcher ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_dispatch(fmt: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch):
    """ops.int8_matmul / int4_matmul are the kernel wrapper plus the bias where use_kernels says so, and elsewhere
    F.linear over the twin's dequantization in x's dtype (for float32 x without a bias: the twin itself), bit for
    bit; the default follows the device (the twins' path on the CPU tier)."""
    gen = torch.Generator().manual_seed(9)
    kernel, twin, _, weight = formats(48, 128, 32, gen)[fmt]
    dispatch = {"int8": ops.int8_matmul, "int4": ops.int4_matmul}[fmt]
    dequantize = {"int8": ref.dequantize_int8, "int4": ref.dequantize_int4}[fmt]
    x = torch.randn(5, 128, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(48, generator=gen).to(DEVICE, dtype)

    default = dispatch(x, *weight, bias)
    force_path(monkeypatch, "kernels")
    via_kernels = dispatch(x, *weight, bias)
    assert torch.equal(via_kernels, kernel(x, *weight) + bias)
    assert torch.equal(dispatch(x, *weight), kernel(x, *weight))
    force_path(monkeypatch, "twins")
    via_twins = dispatch(x, *weight, bias)
    assert torch.equal(via_twins, F.linear(x, dequantize(*weight, dtype), bias))
    if dtype == torch.float32:
        assert torch.equal(dispatch(x, *weight), twin(x, *weight))
    assert torch.equal(default, via_kernels if ops.use_kernels(DEVICE) else via_twins)
    torch.testing.assert_close(via_kernels, via_twins, **TOL_VS_TWIN[dtype])


# ---- real shapes, on the GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt, group", [("int8", 4096), ("int8", 32), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("split_k", [1, 4])
def test_quant_matmul_real_shapes(dtype: torch.dtype, fmt: str, group: int, split_k: int):
    """K = N = 4096 (a 7B/8B model's attention projections) at decode and small-prefill batch sizes."""
    gen = torch.Generator().manual_seed(3)
    kernel, twin, _, weight = formats(4096, 4096, group, gen)[fmt]
    for m in (1, 2, 7, 16, 33, 64):
        x = torch.randn(m, 4096, generator=gen).to(DEVICE, dtype)
        torch.testing.assert_close(kernel(x, *weight, split_k=split_k), twin(x, *weight), **TOL_VS_TWIN[dtype])
