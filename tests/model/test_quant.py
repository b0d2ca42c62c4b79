"""Weight-only quantization (lora_server.model.quant) and the GGUF block reader
(lora_server.model.gguf_checkpoint.GGUFBlocksWeight, unpermute_rope_rows), checked against hand-built tensors and
hand-computed values; gguf.quants.dequantize is the independent reference for the raw GGUF blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from lora_server.model.gguf_checkpoint import GGUFBlocksWeight, unpermute_rope_rows
from lora_server.model.quant import (
    CPU_DEQUANT_MIN_ROWS,
    DenseLinear,
    DequantScratch,
    Int4CpuLinear,
    Int4Linear,
    Int8Linear,
    cat_linears,
    cpu_prefill_dtype,
    int4pack_cpu_block,
    make_linear,
    quantize_int4,
    quantize_int8,
    resident_bytes,
    swap_for_cpu,
    swap_for_cuda,
)

CPU = torch.device("cpu")
BF16_U = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits): |bf16(x) - x| <= 2**-8 * |x|


# ---- reference helpers written from the module docstring, not from the module ------------------------------


def ref_pack_int4(codes: np.ndarray, group: int) -> np.ndarray:
    """codes [out, in] in 0..15 -> packed uint8 [out, in // 2]: within each group byte j = q[j] | q[j + g/2] << 4."""
    out_f, in_f = codes.shape
    half = group // 2
    packed = np.zeros((out_f, in_f // 2), dtype=np.uint8)
    for o in range(out_f):
        for g in range(in_f // group):
            for j in range(half):
                lo = int(codes[o, g * group + j])
                hi = int(codes[o, g * group + j + half])
                packed[o, g * half + j] = lo | (hi << 4)
    return packed


def ref_weight(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None) -> np.ndarray:
    """w[o, i] = scale[o, i // g] * q[o, i] (+ min[o, i // g]) in float64."""
    group = codes.shape[1] // scales.shape[1]
    s = np.repeat(scales.astype(np.float64), group, axis=1)
    w = s * codes.astype(np.float64)
    if mins is not None:
        w = w + np.repeat(mins.astype(np.float64), group, axis=1)
    return w


def random_int4(out_f: int, in_f: int, group: int = 32, seed: int = 0):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, size=(out_f, in_f))
    scales = rng.uniform(0.01, 0.2, size=(out_f, in_f // group)).astype(np.float16)
    mins = rng.uniform(-2.0, 0.5, size=(out_f, in_f // group)).astype(np.float16)
    module = Int4Linear(torch.from_numpy(ref_pack_int4(codes, group)), torch.from_numpy(scales), torch.from_numpy(mins))
    return module, ref_weight(codes, scales, mins), codes, scales, mins


# ---- quantize_int8 ------------------------------------------------------------------------------------------


def test_quantize_int8_per_channel_hand_values():
    w = torch.tensor(
        [
            [15.875, -1.0, 0.3, -15.875],  # amax 15.875 = 127 * 0.125: scale 0.125 exactly
            [0.0, 0.0, 0.0, 0.0],
            [0.0625, 0.5, -0.9921875, 0.0],
        ]
    )  # amax 127 * 2**-7: scale 2**-7 exactly
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.dtype == torch.float16
    assert scales.shape == (3, 1)
    assert scales[0, 0].item() == 0.125 and scales[2, 0].item() == 2.0**-7
    assert q[0].tolist() == [127, -8, 2, -127]  # 0.3 / 0.125 = 2.4 -> 2
    assert q[2].tolist() == [8, 64, -127, 0]
    deq = Int8Linear(q, scales).dequantize(torch.float32)
    assert deq[0].tolist() == [15.875, -1.0, 0.25, -15.875]
    assert deq[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # an all-zero row stays zero
    assert deq[2].tolist() == [0.0625, 0.5, -0.9921875, 0.0]


def test_quantize_int8_group32_hand_values():
    w = torch.zeros(1, 64)
    w[0, 0], w[0, 5], w[0, 31] = 31.75, -0.13, 1.0  # group 0: amax 31.75 = 127 * 0.25
    w[0, 32], w[0, 40] = -0.9921875, 0.5  # group 1: amax 127 * 2**-7
    q, scales = quantize_int8(w, group=32)
    assert scales.shape == (1, 2)
    assert scales.tolist() == [[0.25, 2.0**-7]]
    expected = [0] * 64
    expected[0], expected[5], expected[31] = 127, -1, 4  # -0.13 / 0.25 = -0.52 -> -1
    expected[32], expected[40] = -127, 64
    assert q[0].tolist() == expected


def test_quantize_int8_random_error_bound():
    torch.manual_seed(1)
    w = torch.randn(16, 128) * torch.rand(16, 1) * 4
    for group in (None, 32):
        q, scales = quantize_int8(w, group)
        g = 128 if group is None else group
        assert scales.shape == (16, 128 // g)
        for o in range(16):
            for k in range(128 // g):
                chunk = w[o, k * g : (k + 1) * g].tolist()
                amax = max(abs(v) for v in chunk)
                s = scales[o, k].item()
                assert abs(s - amax / 127.0) <= 2.0**-11 * amax / 127.0 * 1.01  # amax / 127 rounded to fp16
                qs = q[o, k * g : (k + 1) * g].tolist()
                assert all(-127 <= v <= 127 for v in qs)
                assert max(abs(v) for v in qs) == 127  # the largest magnitude maps to the end of the range
                for v, qv in zip(chunk, qs, strict=True):
                    assert abs(qv * s - v) <= 0.5 * s * (1 + 1e-3) + 1e-7


# ---- quantize_int4 ------------------------------------------------------------------------------------------


def test_quantize_int4_hand_values_and_nibble_layout():
    codes = [0, 15, 3, 7, 1, 2, 8, 9, 10, 11, 12, 13, 14, 4, 5, 6, 6, 5, 4, 14, 13, 12, 11, 10, 9, 8, 2, 1, 7, 3, 15, 0]
    w = torch.tensor([[-1.0 + 0.125 * c for c in codes]])  # lo -1, hi 0.875: scale 0.125, min -1, both exact
    packed, scales, mins = quantize_int4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 16)
    assert scales.dtype == torch.float16 and mins.dtype == torch.float16
    assert scales.tolist() == [[0.125]] and mins.tolist() == [[-1.0]]
    # byte j holds element j in the low nibble and element j + 16 in the high nibble
    expected = [codes[j] | (codes[j + 16] << 4) for j in range(16)]
    assert packed[0].tolist() == expected
    assert packed[0, 0].item() == 0x60 and packed[0, 1].item() == 0x5F  # spelled out for the first two bytes
    deq = Int4Linear(packed, scales, mins).dequantize(torch.float32)
    assert deq.tolist() == w.tolist()


def test_quantize_int4_random_error_bound():
    torch.manual_seed(2)
    w = torch.randn(8, 96) * 0.5 + torch.randn(8, 1)
    packed, scales, mins = quantize_int4(w)
    assert packed.shape == (8, 48) and scales.shape == (8, 3) and mins.shape == (8, 3)
    deq = Int4Linear(packed, scales, mins).dequantize(torch.float32)
    for o in range(8):
        for k in range(3):
            chunk = w[o, k * 32 : (k + 1) * 32].tolist()
            lo, hi = min(chunk), max(chunk)
            assert abs(scales[o, k].item() - (hi - lo) / 15.0) <= 2.0**-11 * (hi - lo) / 15.0 * 1.01
            assert mins[o, k].item() == float(np.float16(lo))
            # rounding to the nearest code: half a step, plus what rounding min to fp16 moved it
            bound = 0.5 * scales[o, k].item() + abs(lo - mins[o, k].item()) + 1e-6
            for i, v in enumerate(chunk):
                assert abs(deq[o, k * 32 + i].item() - v) <= bound


def test_quantize_int4_constant_group_is_exact():
    w = torch.full((2, 32), 0.5)
    w[1] = 0.0
    packed, scales, mins = quantize_int4(w)
    assert Int4Linear(packed, scales, mins).dequantize(torch.float32).tolist() == w.tolist()


def test_quantize_int4_rejects_bad_group():
    with pytest.raises(ValueError):
        quantize_int4(torch.zeros(2, 48))


# ---- the linear modules ---------------------------------------------------------------------------------------


def test_int8_linear_hand_values():
    q = torch.tensor([[1, -2, 3, -4], [127, -127, 0, 5]], dtype=torch.int8)
    scales = torch.tensor([[0.5, 2.0], [0.25, 1.0]], dtype=torch.float16)  # group 2
    m = Int8Linear(q, scales, bias=torch.tensor([1.0, -1.0]))
    w = [[0.5, -1.0, 6.0, -8.0], [31.75, -31.75, 0.0, 5.0]]
    assert m.out_features == 2
    assert m.dequantize(torch.float32).tolist() == w
    assert m.dequantize(torch.float16).dtype == torch.float16
    assert m.rows(torch.tensor([1, 0, 1]), torch.float32).tolist() == [w[1], w[0], w[1]]
    y = m(torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]]))
    assert y.tolist() == [[-14.5, -12.75], [1.0, -1.0]]


def test_int4_linear_hand_values():
    # codes row 0: [1,2,3,4 | 15,0,7,8], row 1: [0,0,15,15 | 5,6,9,10]; group 4, byte j = q[j] | q[j+2] << 4
    packed = torch.tensor([[0x31, 0x42, 0x7F, 0x80], [0xF0, 0xF0, 0x95, 0xA6]], dtype=torch.uint8)
    scales = torch.tensor([[0.5, 0.25], [1.0, 2.0]], dtype=torch.float16)
    mins = torch.tensor([[-1.0, 0.5], [-8.0, -10.0]], dtype=torch.float16)
    m = Int4Linear(packed, scales, mins)
    w = [[-0.5, 0.0, 0.5, 1.0, 4.25, 0.5, 2.25, 2.5], [-8.0, -8.0, 7.0, 7.0, 0.0, 2.0, 8.0, 10.0]]
    assert m.out_features == 2
    assert m.dequantize(torch.float32).tolist() == w
    assert m.rows(torch.tensor([1]), torch.float32).tolist() == [w[1]]
    assert m(torch.ones(1, 8)).tolist() == [[10.5, 18.0]]
    assert m(torch.eye(8)).tolist() == torch.tensor(w).t().tolist()
    m.bias = nn.Parameter(torch.tensor([0.5, -0.5]), requires_grad=False)
    assert m(torch.ones(1, 8)).tolist() == [[11.0, 17.5]]


def test_int4_linear_random_matches_reference():
    m, w, *_ = random_int4(24, 96, seed=3)
    assert np.array_equal(m.dequantize(torch.float32).numpy(), w.astype(np.float32))
    ids = torch.tensor([5, 0, 23, 5])
    assert np.array_equal(m.rows(ids, torch.float32).numpy(), w[[5, 0, 23, 5]].astype(np.float32))
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = m(x.float()).double()
    torch.testing.assert_close(y, x @ torch.from_numpy(w).t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantized_linears_on_the_cpu_are_a_linear_over_the_dequantized_weight(dtype: torch.dtype):
    """Without the Triton kernels (the CPU), Int8Linear and Int4Linear compute F.linear(x, dequantize(x.dtype),
    bias), bit for bit, bias included (F.linear folds it into the product, which can differ from adding it after
    in the last bit)."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(7, 96, generator=gen).to(dtype)
    bias = nn.Parameter(torch.randn(24, generator=gen).to(dtype), requires_grad=False)
    int4, *_ = random_int4(24, 96, seed=12)
    for m in (Int8Linear(*quantize_int8(torch.randn(24, 96, generator=gen), 32)), int4):
        for b in (None, bias):
            m.bias = b
            assert torch.equal(m(x), nn.functional.linear(x, m.dequantize(dtype), b))


def test_dense_linear():
    w = torch.tensor([[1.0, 2.0], [3.0, -4.0], [0.5, 0.25]])
    m = DenseLinear(w, torch.tensor([0.0, 1.0, 2.0]))
    assert m.out_features == 3
    assert m(torch.tensor([[1.0, 1.0]])).tolist() == [[3.0, 0.0, 2.75]]
    assert m.rows(torch.tensor([2, 0]), torch.float64).dtype == torch.float64
    assert m.rows(torch.tensor([2, 0]), torch.float32).tolist() == [[0.5, 0.25], [1.0, 2.0]]
    assert m.dequantize(torch.float16).tolist() == w.tolist()


def test_make_linear_modes():
    w = torch.randn(4, 32)
    assert isinstance(make_linear(w, "none"), DenseLinear)
    assert isinstance(make_linear(w, "int8"), Int8Linear)
    assert isinstance(make_linear(w, "int4"), Int4Linear)
    with pytest.raises(ValueError):
        make_linear(w, "int3")


# ---- cat_linears ----------------------------------------------------------------------------------------------


def test_cat_linears_same_format_is_exact():
    torch.manual_seed(4)
    a, b = torch.randn(6, 64), torch.randn(10, 64)
    for mode, cls in (("none", DenseLinear), ("int8", Int8Linear), ("int4", Int4Linear)):
        pa, pb = make_linear(a, mode), make_linear(b, mode)
        fused = cat_linears([pa, pb], torch.float32)
        assert type(fused) is cls and fused.out_features == 16 and fused.bias is None
        expected = torch.cat([pa.dequantize(torch.float32), pb.dequantize(torch.float32)])
        assert torch.equal(fused.dequantize(torch.float32), expected)
    qa, sa = quantize_int8(a, 32)
    qb, sb = quantize_int8(b, 32)
    fused = cat_linears([Int8Linear(qa, sa), Int8Linear(qb, sb)], torch.float32)
    assert type(fused) is Int8Linear and fused.scales.shape == (16, 2)
    assert torch.equal(fused.qweight, torch.cat([qa, qb])) and torch.equal(fused.scales, torch.cat([sa, sb]))


def test_cat_linears_biases_concatenate():
    parts = [
        DenseLinear(torch.ones(2, 4), torch.tensor([1.0, 2.0])),
        DenseLinear(torch.ones(3, 4)),
        DenseLinear(torch.ones(1, 4), torch.tensor([7.0])),
    ]
    fused = cat_linears(parts, torch.float32)
    assert fused.bias.tolist() == [1.0, 2.0, 0.0, 0.0, 0.0, 7.0]
    assert fused(torch.zeros(1, 4)).tolist() == [[1.0, 2.0, 0.0, 0.0, 0.0, 7.0]]


def test_cat_linears_quantized_parts_with_and_without_bias():
    """q has a bias, k does not: the missing bias is zeros (the same as the dense case above, for quantized parts)."""
    torch.manual_seed(5)
    for mode in ("int8", "int4"):
        pq, pk = make_linear(torch.randn(4, 32), mode), make_linear(torch.randn(2, 32), mode)
        pq.bias = nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0]), requires_grad=False)
        fused = cat_linears([pq, pk], torch.float32)
        assert fused.bias.tolist() == [1.0, 2.0, 3.0, 4.0, 0.0, 0.0]


def test_cat_linears_mixed_formats_fall_back_to_int8():
    torch.manual_seed(6)
    a, b, c = torch.randn(4, 64), torch.randn(8, 64), torch.randn(4, 64)
    pa, pb, pc = DenseLinear(a), make_linear(b, "int4"), make_linear(c, "int8")
    pa.bias = nn.Parameter(torch.arange(4.0), requires_grad=False)
    pb.bias = nn.Parameter(torch.arange(8.0), requires_grad=False)
    pc.bias = nn.Parameter(torch.arange(4.0), requires_grad=False)
    fused = cat_linears([pa, pb, pc], torch.float32)
    assert type(fused) is Int8Linear
    assert fused.scales.shape == (16, 1)  # per output channel
    assert fused.bias.tolist() == list(range(4)) + list(range(8)) + list(range(4))
    ref = torch.cat([a, pb.dequantize(torch.float32), pc.dequantize(torch.float32)])
    err = (fused.dequantize(torch.float32) - ref).abs()
    half_step = ref.abs().amax(-1, keepdim=True) / 127 / 2
    assert (err <= half_step * 1.01 + 1e-7).all()
    # int8 parts of different group sizes are also not one format: per-channel int8 as well
    q32 = Int8Linear(*quantize_int8(a, 32))
    fused = cat_linears([q32, make_linear(c, "int8")], torch.float32)
    assert type(fused) is Int8Linear and fused.scales.shape == (8, 1)


# ---- the CPU int4 module swap ------------------------------------------------------------------------------------


def cpu_int4_bound(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Worst-case |Int4CpuLinear(x) - x @ w.T| (float64 [tokens, out]) from bf16 rounding, each step <= 2**-8 rel.

    The kernel computes w' = (q - 8) * bf16(s) + bf16(min + 8 s) on bf16(x), returning bf16. So per weight
    |w' - w| <= u (8 |s| + |min + 8 s| + |w|) (scale, zero and the rounded result), and
    |y' - y| <= u |x| @ |w| + |bf16(x)| @ |w' - w| + u |y| (input rounding, weight error, output rounding)."""
    group = w.shape[1] // scales.shape[1]
    s = scales.double().repeat_interleave(group, 1)
    z = mins.double().repeat_interleave(group, 1) + 8 * s
    w_err = BF16_U * (8 * s.abs() + z.abs() + w.abs())
    xd = x.double()
    y = xd @ w.t()
    xb = x.to(torch.bfloat16).double()
    return BF16_U * xd.abs() @ w.abs().t() + xb.abs() @ w_err.t() + BF16_U * y.abs()


def test_int4_cpu_linear_matches_int4_linear_within_bf16_bound():
    assert Int4CpuLinear.available()
    m, w, _, scales, mins = random_int4(32, 128, seed=7)
    m.bias = nn.Parameter(torch.linspace(-1, 1, 32), requires_grad=False)
    cpu = Int4CpuLinear(m)
    assert cpu.out_features == 32 and cpu.in_features == 128 and cpu.group_size == 32
    wt = torch.from_numpy(w)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1)) * 2
    y = cpu(x)
    assert y.dtype == torch.float32 and y.shape == (5, 32)
    ref = x.double() @ wt.t() + m.bias.double()
    bound = cpu_int4_bound(x, wt, torch.from_numpy(scales), torch.from_numpy(mins))
    # x2 slack for float32 accumulation; a wrong nibble or group layout is off by whole scale steps (>> bound)
    assert ((y.double() - ref).abs() <= 2 * bound + 1e-5).all()

    eye = torch.eye(128)
    w_bound = cpu_int4_bound(eye, wt, torch.from_numpy(scales), torch.from_numpy(mins)).t()
    deq = cpu.dequantize(torch.float32).double()
    assert deq.shape == (32, 128)
    assert ((deq - wt).abs() <= 2 * w_bound + 1e-6).all()
    rows = cpu.rows(torch.tensor([3, 31]), torch.float32).double()
    assert ((rows - wt[[3, 31]]).abs() <= 2 * w_bound[[3, 31]] + 1e-6).all()


def test_int4_cpu_linear_bound_is_tight_enough_to_catch_layout_errors():
    """Guard on the tolerance above: swapping the two nibbles of every byte must break the bound."""
    m, w, codes, scales, mins = random_int4(32, 64, seed=8)
    swapped = (m.packed >> 4) | ((m.packed & 0x0F) << 4)
    cpu = Int4CpuLinear(Int4Linear(swapped, m.scales, m.mins))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    bound = cpu_int4_bound(x, torch.from_numpy(w), torch.from_numpy(scales), torch.from_numpy(mins))
    assert not ((cpu(x).double() - x.double() @ torch.from_numpy(w).t()).abs() <= 2 * bound + 1e-5).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_int4_cpu_prefill_dequantizes_in_the_scratch_dtype(dtype: torch.dtype):
    """From CPU_DEQUANT_MIN_ROWS rows Int4CpuLinear multiplies x by its weight dequantized in the scratch's dtype from
    the kernel's own bfloat16 scale and zero, (q - 8) * bf16(s) + bf16(min + 8 s): in float32, against that weight
    built here from the codes in float64 within float32 accumulation, and far tighter than the kernel's bound; in
    bfloat16 (activations, weight and result rounded), within the kernel's own bound. In column chunks when the
    scratch is small (the same values); below the threshold, or without a scratch, the bf16 kernel. The layout
    probe finds torch's block (32 with AVX2, 64 with AVX512)."""
    block = int4pack_cpu_block()
    assert block in (32, 64)
    m, w_true, codes, scales, mins = random_int4(128, 256, seed=14)
    m.bias = nn.Parameter(torch.linspace(-1, 1, 128), requires_grad=False)
    s = torch.from_numpy(scales).to(torch.bfloat16).double().repeat_interleave(32, 1)
    z = torch.from_numpy(mins.astype(np.float32) + 8 * scales.astype(np.float32)).to(torch.bfloat16).double()
    w = (torch.from_numpy(codes).double() - 8) * s + z.repeat_interleave(32, 1)
    x = torch.randn(CPU_DEQUANT_MIN_ROWS + 3, 256, generator=torch.Generator().manual_seed(2))
    ref = x.double() @ w.t() + m.bias.double()
    whole = Int4CpuLinear(m, DequantScratch(dtype=dtype), block)
    chunked = Int4CpuLinear(m, DequantScratch(cap=256 * block, dtype=dtype), block)  # one row block per chunk
    y = whole(x)
    assert y.dtype == torch.float32
    assert torch.equal(chunked(x), y)
    kernel = Int4CpuLinear(m)  # no scratch: always the kernel
    err_kernel = (kernel(x).double() - ref).abs()
    if dtype == torch.float32:
        assert ((y.double() - ref).abs() <= 1e-5 * (x.double().abs() @ w.abs().t() + 1)).all()
        assert err_kernel.max() > 10 * (y.double() - ref).abs().max()
    else:
        wt = torch.from_numpy(w_true)
        bound = cpu_int4_bound(x, wt, torch.from_numpy(scales), torch.from_numpy(mins))
        truth = x.double() @ wt.t() + m.bias.double()
        assert ((y.double() - truth).abs() <= 2 * bound + 1e-5).all()
        assert (y.double() - ref).abs().max() > 0  # rounded: not the float32 path's numbers
    few = x[: CPU_DEQUANT_MIN_ROWS - 1]
    assert torch.equal(whole(few), kernel(few))


def test_cpu_prefill_dtype_follows_the_cpu_flags():
    """bfloat16 exactly where the CPU's flags (the kernel's /proc/cpuinfo) say it multiplies it natively
    (avx512_bf16 or amx_bf16), float32 elsewhere."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("not Linux: no /proc/cpuinfo to read the CPU's flags from independently of torch")
    flags = {f for line in cpuinfo.read_text().splitlines() if line.startswith("flags") for f in line.split()}
    native = bool(flags & {"avx512_bf16", "amx_bf16"})
    assert cpu_prefill_dtype() == (torch.bfloat16 if native else torch.float32)


def test_swap_for_cpu_replaces_every_int4_linear():
    m1, w1, *_ = random_int4(64, 64, seed=9)  # 64 rows: whole row blocks of the layout (B = 32 or 64)
    m2, w2, *_ = random_int4(16, 32, seed=10)
    int8 = make_linear(torch.randn(16, 64), "int8")
    dense = DenseLinear(torch.randn(16, 64))
    m3, *_ = random_int4(64, 64, seed=15)
    model = nn.ModuleDict({"a": m1, "inner": nn.Sequential(m2, nn.Identity()), "c": int8, "d": dense, "e": m3})
    swap_for_cpu(model)
    assert isinstance(model["a"], Int4CpuLinear) and isinstance(model["inner"][0], Int4CpuLinear)
    assert model["a"].scratch is not None and model["a"].scratch is model["e"].scratch  # one per model
    assert model["inner"][0].scratch is None  # 16 rows do not fill one of the layout's row blocks: kernel only
    assert model["c"] is int8 and model["d"] is dense
    x = torch.randn(3, 64)
    err = (model["a"](x).double() - x.double() @ torch.from_numpy(w1).t()).abs()
    assert (err <= 2 * cpu_int4_bound(x, torch.from_numpy(w1), m1.scales, m1.mins) + 1e-5).all()
    x2 = torch.randn(3, 32)
    err = (model["inner"](x2).double() - x2.double() @ torch.from_numpy(w2).t()).abs()
    assert (err <= 2 * cpu_int4_bound(x2, torch.from_numpy(w2), m2.scales, m2.mins) + 1e-5).all()


def test_int4_repacked_is_the_same_weight():
    """Repacking an Int4Linear (nibbles paired within 64 or 128 columns instead of the group's 32) keeps its codes,
    dequantized weight, rows, output and CPU layout; fusing keeps the pack."""
    m, w, codes, *_ = random_int4(16, 256, seed=11)
    x = torch.randn(3, 256)
    for pack in (64, 128):
        r = m.repacked(pack)
        assert r.pack == pack and r.packed.shape == m.packed.shape and not torch.equal(r.packed, m.packed)
        assert torch.equal(r.codes(), torch.from_numpy(codes).to(torch.uint8))
        assert torch.equal(r.dequantize(torch.float32), m.dequantize(torch.float32))
        assert torch.equal(r.rows(torch.tensor([3, 0]), torch.float32), m.rows(torch.tensor([3, 0]), torch.float32))
        assert torch.equal(r(x), m(x))
        assert torch.equal(Int4CpuLinear(r).cpu_packed, Int4CpuLinear(m).cpu_packed)
        fused = cat_linears([r, m.repacked(pack)], torch.float32)
        assert type(fused) is Int4Linear and fused.pack == pack
        assert torch.equal(fused.dequantize(torch.float32), torch.cat([m.dequantize(torch.float32)] * 2))
    # parts in different layouts are not concatenated byte-wise
    mixed = cat_linears([m, m.repacked(64)], torch.float32)
    assert type(mixed) is Int8Linear


def test_swap_for_cuda_repacks_int4_where_k_allows():
    """The CUDA swap repacks each Int4Linear to quant_tiles.int4_pack_width for the activations' dtype (bf16: K =
    256 -> 128, K = 96 -> the group's own 32, left as it is; fp32: 32 everywhere, left as it is) and leaves other
    modules alone; the weights stay the same."""
    m1, *_ = random_int4(32, 256, seed=12)
    m2, *_ = random_int4(16, 96, seed=13)
    int8 = make_linear(torch.randn(16, 64), "int8")
    model = nn.ModuleDict({"a": m1, "inner": nn.Sequential(m2), "c": int8})
    swap_for_cuda(model, torch.float32)
    assert model["a"] is m1 and model["inner"][0] is m2 and model["c"] is int8
    swap_for_cuda(model, torch.bfloat16)
    assert isinstance(model["a"], Int4Linear) and model["a"].pack == 128
    assert model["inner"][0] is m2 and model["c"] is int8
    assert torch.equal(model["a"].dequantize(torch.float32), m1.dequantize(torch.float32))


def test_resident_bytes_hand_counts():
    w = torch.randn(32, 64)
    assert resident_bytes(DenseLinear(w)) == 32 * 64 * 4
    assert resident_bytes(DenseLinear(w.half(), torch.zeros(32, dtype=torch.float16))) == 32 * 64 * 2 + 32 * 2
    assert resident_bytes(make_linear(w, "int8")) == 32 * 64 + 32 * 2  # int8 codes + one fp16 scale per row
    int4 = make_linear(w, "int4")
    assert resident_bytes(int4) == 32 * 32 + 2 * (32 * 2 * 2)  # nibbles + fp16 scales and mins, 2 groups
    int4.bias = nn.Parameter(torch.zeros(32), requires_grad=False)
    assert resident_bytes(int4) == 32 * 32 + 2 * (32 * 2 * 2) + 32 * 4
    int4.bias = None
    # the same bits re-tiled (out * in / 2 bytes) plus bf16 (scale, zero) pairs per group and row
    assert resident_bytes(Int4CpuLinear(int4)) == 32 * 32 + 2 * 32 * 2 * 2
    model = nn.Sequential(make_linear(w, "int8"), DenseLinear(w))
    assert resident_bytes(model) == 32 * 64 + 32 * 2 + 32 * 64 * 4


# ---- GGUF blocks ------------------------------------------------------------------------------------------------

D_CHOICES = [0.5, 0.125, 0.0625, 1.5, 0.25]
M_CHOICES = [-1.0, -3.25, 0.75, -0.5, 2.0]


def q4_1_rows(rows: int, blocks: int, seed: int):
    """Raw Q4_1 rows built byte by byte, and their values d * q + m (exact in float32 for these d, m)."""
    rng = np.random.default_rng(seed)
    raw, values = [], []
    for _ in range(rows):
        row_bytes, row_vals = b"", []
        for _ in range(blocks):
            d = D_CHOICES[rng.integers(len(D_CHOICES))]
            m = M_CHOICES[rng.integers(len(M_CHOICES))]
            q = [int(v) for v in rng.integers(0, 16, size=32)]
            qs = bytes(q[j] | (q[j + 16] << 4) for j in range(16))
            row_bytes += np.array([d, m], dtype="<f2").tobytes() + qs
            row_vals += [d * v + m for v in q]
        raw.append(np.frombuffer(row_bytes, dtype=np.uint8))
        values.append(row_vals)
    return np.stack(raw), np.array(values)


def q8_0_rows(rows: int, blocks: int, seed: int):
    rng = np.random.default_rng(seed)
    raw, values = [], []
    for _ in range(rows):
        row_bytes, row_vals = b"", []
        for _ in range(blocks):
            d = D_CHOICES[rng.integers(len(D_CHOICES))]
            q = [int(v) for v in rng.integers(-128, 128, size=32)]
            row_bytes += np.array([d], dtype="<f2").tobytes() + np.array(q, dtype=np.int8).tobytes()
            row_vals += [d * v for v in q]
        raw.append(np.frombuffer(row_bytes, dtype=np.uint8))
        values.append(row_vals)
    return np.stack(raw), np.array(values)


def test_q4_1_block_layout_spelled_out():
    """One block: d = 0.5, m = -1, q[j] = j % 16 for j < 16 and 15 - (j % 16) above: byte j = j | (15 - j) << 4."""
    block = np.array([0.5, -1.0], dtype="<f2").tobytes() + bytes(j | ((15 - j) << 4) for j in range(16))
    raw = np.frombuffer(block, dtype=np.uint8).reshape(1, 20)
    expected = [0.5 * j - 1 for j in range(16)] + [0.5 * (15 - j) - 1 for j in range(16)]
    weight = GGUFBlocksWeight("Q4_1", raw)
    assert weight.dense(torch.float32, CPU)[0].tolist() == expected
    assert gguf_dequantize(raw, GGMLQuantizationType.Q4_1)[0].tolist() == expected


def test_gguf_q4_1_weight_hand_values():
    raw, values = q4_1_rows(rows=3, blocks=2, seed=11)
    assert raw.shape == (3, 40)
    weight = GGUFBlocksWeight("Q4_1", raw)
    assert weight.native == "int4"
    lin = weight.linear("auto", torch.float32, CPU)
    assert isinstance(lin, Int4Linear) and lin.scales.shape == (3, 2)
    assert lin.dequantize(torch.float32).numpy().tolist() == values.tolist()
    assert weight.dense(torch.float32, CPU).numpy().tolist() == values.tolist()
    assert weight.dense(torch.float16, CPU).dtype == torch.float16
    assert np.array_equal(gguf_dequantize(raw, GGMLQuantizationType.Q4_1), values.astype(np.float32))
    x = torch.randn(2, 64, dtype=torch.float64)
    torch.testing.assert_close(lin(x.float()).double(), x @ torch.from_numpy(values).t(), rtol=1e-5, atol=1e-4)
    dense = weight.linear("none", torch.float32, CPU)
    assert isinstance(dense, DenseLinear) and dense.weight.numpy().tolist() == values.tolist()
    requant = weight.linear("int8", torch.float32, CPU)
    assert isinstance(requant, Int8Linear)
    half_step = np.abs(values).max(axis=1, keepdims=True) / 127 / 2
    assert (np.abs(requant.dequantize(torch.float32).numpy() - values) <= half_step * 1.01).all()


def test_gguf_q8_0_weight_hand_values():
    raw, values = q8_0_rows(rows=4, blocks=3, seed=12)
    assert raw.shape == (4, 102)
    weight = GGUFBlocksWeight("Q8_0", raw)
    assert weight.native == "int8"
    lin = weight.linear("auto", torch.float32, CPU)
    assert isinstance(lin, Int8Linear) and lin.scales.shape == (4, 3) and lin.qweight.dtype == torch.int8
    assert lin.dequantize(torch.float32).numpy().tolist() == values.tolist()
    assert lin.rows(torch.tensor([2]), torch.float32).numpy().tolist() == [values[2].tolist()]
    assert weight.dense(torch.float32, CPU).numpy().tolist() == values.tolist()
    assert np.array_equal(gguf_dequantize(raw, GGMLQuantizationType.Q8_0), values.astype(np.float32))
    assert isinstance(weight.linear("int8", torch.float32, CPU), Int8Linear)
    requant = weight.linear("int4", torch.float32, CPU)
    assert isinstance(requant, Int4Linear)
    deq = requant.dequantize(torch.float32).numpy()
    for o in range(4):
        for k in range(3):
            chunk = values[o, k * 32 : (k + 1) * 32]
            lo = chunk.min()
            bound = 0.5 * requant.scales[o, k].item() + abs(lo - requant.mins[o, k].item()) + 1e-6
            assert np.abs(deq[o, k * 32 : (k + 1) * 32] - chunk).max() <= bound


# ---- unpermute_rope_rows ------------------------------------------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter applies to HF's Q/K rows."""
    rows_per_head = w.shape[0] // n_head
    return w.reshape(n_head, 2, rows_per_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_llama_cpp_permutation_spelled_out():
    """Sanity of the construction: head_dim 4 interleaves the halves [0, 1 | 2, 3] to [0, 2, 1, 3] per head."""
    w = np.arange(8)
    assert llama_cpp_permute(w, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.parametrize("n_head,head_dim,cols", [(4, 8, 6), (2, 16, 3), (1, 4, 5), (3, 2, 1)])
def test_unpermute_rope_rows_inverts_llama_cpp(n_head, head_dim, cols):
    hf = np.arange(n_head * head_dim * cols, dtype=np.float32).reshape(n_head * head_dim, cols)
    gguf_rows = llama_cpp_permute(hf, n_head)
    if head_dim > 2:
        assert not np.array_equal(gguf_rows, hf)
    assert np.array_equal(unpermute_rope_rows(gguf_rows, n_head), hf)
    vec = np.arange(n_head * head_dim)  # a 1-D bias permutes the same way
    assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(vec, n_head), n_head), vec)


def test_unpermute_rope_rows_on_raw_blocks():
    """Quantized blocks lie within rows, so un-permuting raw block rows gives HF's row order."""
    n_head, head_dim = 2, 8
    raw, values = q4_1_rows(rows=n_head * head_dim, blocks=2, seed=13)
    fixed = unpermute_rope_rows(llama_cpp_permute(raw, n_head), n_head)
    weight = GGUFBlocksWeight("Q4_1", fixed)
    assert weight.dense(torch.float32, CPU).numpy().tolist() == values.tolist()
