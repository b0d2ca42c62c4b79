"""GGUF quantized types kept as their blocks (Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): the torch decoder
(kernels/gguf_reference.py) against gguf.quants.dequantize bit for bit and against blocks spelled out by hand from
llama.cpp's layouts; the twin's matmul against a float64 one; the Triton kernels (kernels/gguf_matmul.py,
kernels/gguf_dequantize.py; in the interpreter without a GPU) against the twin; the module
(lora_server.model.gguf_linear) in the model builder's uses (fusing, the embedding's rows, the CPU head copy, the
module swaps); the loader's modes; whole GGUF files written here with gguf.GGUFWriter, loaded with --quantization
auto, against the same weights dequantized by gguf (a float32 file, and HF transformers' own reading of the file),
and their memory in bits per weight.

Blocks come from random bytes (every code and scale byte; the fp16 fields set to finite values of several
magnitudes, subnormals and negatives included), from gguf.quants.quantize where gguf writes the type (Q4_0, Q5_0,
Q5_1), and from the encoders below for the K-quants (gguf writes none): simple, valid blocks (per-sub-block min and
max, 6-bit or int8 scales), not llama.cpp's search for the best scales."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from lora_server.kernels.gguf_dequantize import gguf_dequantize as kernel_dequantize
from lora_server.kernels.gguf_matmul import gguf_matmul as kernel_matmul
from lora_server.kernels.gguf_reference import GGUF_BLOCKS, dequantize_gguf
from lora_server.kernels.gguf_reference import gguf_matmul as twin_matmul
from lora_server.kernels.quant_tiles import DEQUANT_MIN_TOKENS
from lora_server.model.gguf_checkpoint import GGUFBlocksWeight, unpermute_rope_rows
from lora_server.model.gguf_linear import GGUFBlockLinear, StackedLinear
from lora_server.model.quant import (
    DenseLinear,
    Int4CpuLinear,
    Int4Linear,
    Int8Linear,
    cat_linears,
    cpu_head,
    make_linear,
    resident_bytes,
    swap_for_cpu,
)
from tests.kernel_env import DEVICE, TOL_VS_TWIN, force_path

CPU = torch.device("cpu")
KINDS = sorted(GGUF_BLOCKS)
FP16_FIELDS = {"Q4_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def bits(a: np.ndarray | torch.Tensor) -> np.ndarray:
    """float32 values as their bit patterns: equality of these is equality bit for bit (-0.0 and NaNs included)."""
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    assert a.dtype == np.float32
    return a.view(np.uint32)


def random_blocks(kind: str, rows: int, blocks: int, seed: int, scale: float = 0.01) -> np.ndarray:
    """uint8 [rows, blocks * block_bytes]: random bytes, the fp16 fields random finite values (normal * scale, with
    every 7th a subnormal and every 11th negated or zero)."""
    _, nbytes = GGUF_BLOCKS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks, nbytes), dtype=np.uint8)
    for at in FP16_FIELDS[kind]:
        field = np.abs(rng.standard_normal((rows, blocks))) * scale
        field.flat[::7] = 3e-6  # fp16 subnormal
        field.flat[::11] *= -1
        field.flat[::13] = 0.0
        raw[..., at : at + 2] = field.astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, -1)


# ---- encoders for the K-quants (gguf.quants writes none) ------------------------------------------------------


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _levels(x: np.ndarray, step: np.ndarray, offset: np.ndarray, top: int) -> np.ndarray:
    """round((x + offset) / step) clipped to 0..top, 0 where the step is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.round((x + offset) / step), 0)
    return np.clip(q, 0, top).astype(np.uint8)


def _six_bit(values: np.ndarray, unit: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.clip(np.where(unit > 0, np.round(values / unit), 0), 0, 63).astype(np.uint8)


def pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: eight 6-bit scales and mins [nb, 8] -> 12 bytes [nb, 12] (ggml-quants.c's layout)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def encode_k(w: np.ndarray, kind: str) -> np.ndarray:
    """float [rows, K] (K a multiple of 256) -> Q4_K or Q5_K blocks uint8 [rows, K / 256 * bytes]: per sub-block of
    32, scale = (max - min(min, 0)) / levels and min = -min(min, 0), both in 6 bits of the block's fp16 d and dmin."""
    rows = w.shape[0]
    top = 15 if kind == "Q4_K" else 31
    sub = w.reshape(-1, 8, 32).astype(np.float64)  # [nb, 8, 32]
    low = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - low) / top, -low
    d, dmin = (scale.max(-1) / 63).astype(np.float16), (mins.max(-1) / 63).astype(np.float16)
    sc, mn = _six_bit(scale, d[:, None].astype(np.float64)), _six_bit(mins, dmin[:, None].astype(np.float64))
    step = (d[:, None].astype(np.float64) * sc)[..., None]
    q = _levels(sub, step, (dmin[:, None].astype(np.float64) * mn)[..., None], top).reshape(-1, 256)
    nibbles = (q & 15).reshape(-1, 4, 2, 32)
    qs = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(-1, 128)
    parts = [_f16_bytes(d), _f16_bytes(dmin), pack_k_scales(sc, mn)]
    if kind == "Q5_K":  # bit s of qh[l]: the fifth bit of value 32 s + l
        fifth = (q >> 4).reshape(-1, 8, 32)
        parts.append(sum(fifth[:, s] << s for s in range(8)).astype(np.uint8))
    return np.concatenate([*parts, qs], axis=1).reshape(rows, -1)


def encode_q6_k(w: np.ndarray) -> np.ndarray:
    """float [rows, K] -> Q6_K blocks: per 16 values an int8 scale of the block's fp16 d, codes q - 32 in -32..31."""
    rows = w.shape[0]
    groups = w.reshape(-1, 16, 16).astype(np.float64)  # [nb, 16, 16]
    scale = np.abs(groups).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.clip(np.round(scale / d[:, None].astype(np.float64)), 0, 127), 0)
    step = (d[:, None].astype(np.float64) * sc)[..., None]
    q = _levels(groups, step, 32 * step, 63).reshape(-1, 256)
    low = (q & 15).reshape(-1, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 2, 4, 32)
    qh = sum(high[:, :, t] << (2 * t) for t in range(4)).astype(np.uint8).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1).reshape(rows, -1)


def encode(w: np.ndarray, kind: str) -> np.ndarray:
    """float [rows, K] -> ``kind`` blocks: gguf's quantizer where it has one, the encoders above for K-quants."""
    if kind in ("Q4_K", "Q5_K"):
        return encode_k(w, kind)
    if kind == "Q6_K":
        return encode_q6_k(w)
    return gguf_quantize(np.ascontiguousarray(w, dtype=np.float32), GGMLQuantizationType[kind])


# ---- decoding: bit for bit against gguf, and against hand-built blocks ----------------------------------------


def test_block_table_is_gguf_s():
    for kind in KINDS:
        assert GGUF_BLOCKS[kind] == gguf.GGML_QUANT_SIZES[GGMLQuantizationType[kind]]


@pytest.mark.parametrize("kind", KINDS)
def test_decode_equals_gguf_bit_for_bit(kind):
    """Random blocks, rows of several blocks and the same blocks one by one: every float32 equal to gguf's."""
    raw = random_blocks(kind, rows=12, blocks=3, seed=KINDS.index(kind))
    ref = gguf_dequantize(raw, GGMLQuantizationType[kind])
    assert np.array_equal(bits(dequantize_gguf(torch.from_numpy(raw), kind)), bits(ref))
    one_by_one = raw.reshape(36, -1)  # each block a row of its own
    assert np.array_equal(bits(dequantize_gguf(torch.from_numpy(one_by_one), kind)), bits(ref.reshape(36, -1)))
    for dtype in (torch.float16, torch.bfloat16):  # one rounding of the float32 value
        got = dequantize_gguf(torch.from_numpy(raw), kind, dtype)
        assert torch.equal(got, torch.from_numpy(ref).to(dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_decode_of_encoded_weights(kind):
    """Blocks from a quantizer (gguf's, or the encoders here) decode as gguf does, close to the weights encoded."""
    w = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32)
    raw = encode(w, kind)
    ref = gguf_dequantize(raw, GGMLQuantizationType[kind])
    assert np.array_equal(bits(dequantize_gguf(torch.from_numpy(raw), kind)), bits(ref))
    levels = {"Q4_0": 15, "Q4_K": 15, "Q5_0": 31, "Q5_1": 31, "Q5_K": 31, "Q6_K": 63}[kind]
    assert np.abs(ref - w).max() < 2 * (w.max() - w.min()) / levels  # one step of the coarsest group, with room


def test_q4_k_block_spelled_out():
    """One Q4_K block from llama.cpp's layout: d = 0.5, dmin = 0.25, sub-block scales and mins that use the 6-bit
    fields' high bits; value j = 32 s + l has code (j * 7) % 16, low nibble of qs[32 (j // 64) + l] for even s."""
    sc = np.array([[1, 17, 33, 63, 5, 40, 63, 16]], dtype=np.uint8)
    mn = np.array([[0, 2, 31, 63, 7, 50, 1, 32]], dtype=np.uint8)
    codes = [(j * 7) % 16 for j in range(256)]
    qs = bytes(codes[64 * c + i] | (codes[64 * c + 32 + i] << 4) for c in range(4) for i in range(32))
    block = np.array([0.5, 0.25], dtype="<f2").tobytes() + pack_k_scales(sc, mn).tobytes() + qs
    raw = np.frombuffer(block, dtype=np.uint8).reshape(1, 144)
    expected = [0.5 * sc[0, j // 32] * codes[j] - 0.25 * mn[0, j // 32] for j in range(256)]
    assert dequantize_gguf(torch.from_numpy(raw.copy()), "Q4_K")[0].tolist() == expected
    assert gguf_dequantize(raw, GGMLQuantizationType.Q4_K)[0].tolist() == expected


def test_q6_k_block_spelled_out():
    """One Q6_K block: d = 0.125, int8 scales of both signs; value j's 6-bit code c_j = (j * 5) % 64 stores its low
    four bits in ql[64 a + p] (a = j // 128, p = j % 64; low nibble below 64 within the half), its top two in bits
    2 * ((j % 128) // 32) of qh[32 a + j % 32]; w = d * scale[j // 16] * (c_j - 32)."""
    codes = [(j * 5) % 64 for j in range(256)]
    scales = [-128, -3, 0, 1, 7, 127, -64, 33, 2, -1, 100, 9, -9, 64, 5, -77]
    ql, qh = bytearray(128), bytearray(64)
    for j, c in enumerate(codes):
        a, within = divmod(j, 128)
        ql[64 * a + j % 64] |= (c & 15) << (4 * (within // 64))
        qh[32 * a + j % 32] |= (c >> 4) << (2 * (within // 32))
    block = bytes(ql) + bytes(qh) + np.array(scales, dtype=np.int8).tobytes() + np.array([0.125], "<f2").tobytes()
    raw = np.frombuffer(block, dtype=np.uint8).reshape(1, 210)
    expected = [0.125 * scales[j // 16] * (codes[j] - 32) for j in range(256)]
    assert dequantize_gguf(torch.from_numpy(raw.copy()), "Q6_K")[0].tolist() == expected
    assert gguf_dequantize(raw, GGMLQuantizationType.Q6_K)[0].tolist() == expected


def test_q5_0_and_q5_1_fifth_bit_spelled_out():
    """Q5_0 / Q5_1: bit j of the little-endian uint32 qh is value j's fifth bit (j < 16: qs[j] low nibble)."""
    codes = [(j * 11) % 32 for j in range(32)]
    qh = sum((c >> 4) << j for j, c in enumerate(codes)).to_bytes(4, "little")
    qs = bytes((codes[i] & 15) | ((codes[i + 16] & 15) << 4) for i in range(16))
    q5_0 = np.frombuffer(np.array([0.5], "<f2").tobytes() + qh + qs, dtype=np.uint8).reshape(1, 22)
    q5_1 = np.frombuffer(np.array([0.5, -2.0], "<f2").tobytes() + qh + qs, dtype=np.uint8).reshape(1, 24)
    assert dequantize_gguf(torch.from_numpy(q5_0.copy()), "Q5_0")[0].tolist() == [0.5 * (c - 16) for c in codes]
    assert dequantize_gguf(torch.from_numpy(q5_1.copy()), "Q5_1")[0].tolist() == [0.5 * c - 2 for c in codes]


# ---- the twin's matmul and the Triton kernels ----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_twin_matmul_is_x_times_the_dequantized_weight(kind):
    raw = random_blocks(kind, rows=24, blocks=2, seed=3, scale=0.001)
    w = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[kind])).double()
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(4))
    got = twin_matmul(x, torch.from_numpy(raw), kind)
    torch.testing.assert_close(got.double(), x.double() @ w.T, rtol=1e-5, atol=1e-5 * w.abs().max().item())


# (kind, dtype, M, N, blocks per row, half, block_n, split_k): every kind in each dtype, then the other axes
KERNEL_CASES = [
    *[(kind, dtype, 3, 40, 2, None, 32, 1) for kind in KINDS for dtype in (torch.float32, torch.float16)],
    ("Q4_K", torch.bfloat16, 1, 16, 1, None, 16, 1),
    ("Q6_K", torch.bfloat16, 17, 33, 1, 32, 16, 2),
    ("Q5_K", torch.float32, 16, 24, 2, 16, 16, 2),
    ("Q4_0", torch.float16, 2, 20, 3, None, 16, 1),  # K = 96: steps of 32 columns only
    ("Q5_1", torch.float16, 33, 16, 4, 32, 16, 2),
    ("Q6_K", torch.float32, 4, 48, 2, 16, 32, 4),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_kernel_matches_twin(case):
    kind, dtype, m, n, blocks, half, block_n, split_k = case
    values = GGUF_BLOCKS[kind][0]
    raw = torch.from_numpy(random_blocks(kind, rows=n, blocks=blocks, seed=m + n)).to(DEVICE)
    x = torch.randn(m, blocks * values, generator=torch.Generator().manual_seed(n)).to(DEVICE, dtype)
    got = kernel_matmul(x, raw, kind, half=half, block_n=block_n, split_k=split_k)
    expected = F.linear(x.float(), dequantize_gguf(raw, kind, dtype).float()).to(dtype)
    assert got.dtype == dtype and got.shape == (m, n)
    scale = expected.float().abs().max().item()
    tol = TOL_VS_TWIN[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol["rtol"], atol=tol["atol"] * scale)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_kernel_is_the_twin(kind):
    """Bit for bit in float32 and float16; bfloat16 within one unit in the last place (the interpreter rounds
    float32 -> bfloat16 toward zero, triton issue #11584; compiled code rounds to nearest, bit for bit)."""
    raw = torch.from_numpy(random_blocks(kind, rows=35, blocks=2, seed=7)).to(DEVICE)
    for dtype in (torch.float32, torch.float16):
        assert torch.equal(kernel_dequantize(raw, kind, dtype), dequantize_gguf(raw, kind, dtype))
    got, ref = kernel_dequantize(raw, kind, torch.bfloat16).float(), dequantize_gguf(raw, kind, torch.float32)
    assert ((got - ref).abs() <= ref.abs() * 2**-7).all()


def test_module_takes_the_kernels_where_ops_would(monkeypatch):
    """With the kernels: the decode kernel below DEQUANT_MIN_TOKENS rows, dequantize + F.linear from there, rows
    through the dequantize kernel; all equal to the twin's numbers."""
    force_path(monkeypatch, "kernels")
    raw = torch.from_numpy(random_blocks("Q4_K", rows=32, blocks=1, seed=8)).to(DEVICE)
    module = GGUFBlockLinear("Q4_K", raw, bias=torch.randn(32).to(DEVICE))
    w = dequantize_gguf(raw, "Q4_K")
    for m in (2, DEQUANT_MIN_TOKENS):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(DEVICE)
        scale = w.abs().max().item()
        torch.testing.assert_close(module(x), F.linear(x, w, module.bias), rtol=1e-5, atol=1e-5 * scale)
    ids = torch.tensor([5, 0, 31, 5], device=DEVICE)
    assert torch.equal(module.rows(ids, torch.float32), w[ids])


def test_cuda_path_on_the_stand_in_neither_syncs_nor_copies():
    """The CUDA path (the meta stand-in, instrument.host_work): a fused Q4_K | Q6_K linear launches one decode
    kernel per part in decode and one dequantize kernel per part in prefill, the embedding's rows one; no sync, no
    pageable copy (what CUDA graphs and the decode step's guard need)."""
    from lora_server.instrument.host_work import STAND_IN, no_sync_or_pageable_copy, stand_in_cuda

    def meta(kind: str, rows: int) -> GGUFBlockLinear:
        return GGUFBlockLinear(kind, torch.empty(rows, GGUF_BLOCKS[kind][1], dtype=torch.uint8, device=STAND_IN))

    fused = cat_linears([meta("Q4_K", 32), meta("Q4_K", 16), meta("Q6_K", 16)], torch.bfloat16)
    assert isinstance(fused, StackedLinear) and len(fused.parts) == 2
    with stand_in_cuda():
        for m, kernel in ((3, "_gguf_matmul_kernel"), (DEQUANT_MIN_TOKENS, "_gguf_dequantize_kernel")):
            x = torch.empty(m, 256, dtype=torch.bfloat16, device=STAND_IN)
            with no_sync_or_pageable_copy(STAND_IN) as work:
                assert fused(x).shape == (m, 64)
            assert work.kernel_names == {kernel: 2} and work.syncs == work.h2d_pageable == 0
        ids = torch.zeros(5, dtype=torch.int64, device=STAND_IN)
        with no_sync_or_pageable_copy(STAND_IN) as work:
            assert meta("Q6_K", 64).rows(ids, torch.bfloat16).shape == (5, 256)
        assert work.kernel_names == {"_gguf_dequantize_kernel": 1} and work.syncs == 0


# ---- the module in the model builder's uses --------------------------------------------------------------------


def block_linear(kind: str, rows: int, in_features: int, seed: int) -> GGUFBlockLinear:
    blocks = in_features // GGUF_BLOCKS[kind][0]
    return GGUFBlockLinear(kind, torch.from_numpy(random_blocks(kind, rows, blocks, seed)))


def test_block_linear_surface():
    module = block_linear("Q6_K", rows=20, in_features=512, seed=9)
    w = dequantize_gguf(module.blocks, "Q6_K")
    assert module.out_features == 20 and module.in_features == 512 and w.shape == (20, 512)
    assert torch.equal(module.dequantize(torch.float32), w)
    assert torch.equal(module.rows(torch.tensor([3, 3, 19]), torch.float16), w[[3, 3, 19]].half())
    x = torch.randn(4, 512)
    assert torch.equal(module(x), F.linear(x, w))  # the CPU path: the twin's weight, torch's matmul
    assert resident_bytes(module) == 20 * 2 * 210  # the blocks, nothing else: 6.5625 bits per weight
    module.bias = torch.nn.Parameter(torch.randn(20), requires_grad=False)  # as build_llama sets a bias
    assert torch.equal(module(x), F.linear(x, w, module.bias))


def test_cat_linears_of_one_type_concatenates_rows():
    q, k = block_linear("Q4_K", 16, 256, 10), block_linear("Q4_K", 8, 256, 11)
    k.bias = torch.nn.Parameter(torch.randn(8), requires_grad=False)
    fused = cat_linears([q, k], torch.float32)
    assert isinstance(fused, GGUFBlockLinear) and fused.kind == "Q4_K" and fused.out_features == 24
    rows = torch.cat([q.dequantize(torch.float32), k.dequantize(torch.float32)])
    assert torch.equal(fused.dequantize(torch.float32), rows)
    assert fused.bias is not None and torch.equal(fused.bias, torch.cat([torch.zeros(16), k.bias]))
    assert resident_bytes(fused) == q.blocks.numel() + k.blocks.numel() + 24 * 4  # the blocks and the fused bias


def test_cat_linears_of_mixed_types_keeps_each_part():
    """A Q4_K_M layer: Q4_K q and k (fused into one part), Q6_K v; with a Q8_0 (Int8Linear) part as llama.cpp's
    fallbacks mix in. Each part keeps its format and bytes; the output is theirs side by side."""
    q, k, v = block_linear("Q4_K", 16, 256, 12), block_linear("Q4_K", 8, 256, 13), block_linear("Q6_K", 8, 256, 14)
    fused = cat_linears([q, k, v], torch.float32)
    assert isinstance(fused, StackedLinear) and [type(p) for p in fused.parts] == [GGUFBlockLinear] * 2
    assert [p.kind for p in fused.parts] == ["Q4_K", "Q6_K"] and fused.out_features == 32
    assert resident_bytes(fused) == resident_bytes(q) + resident_bytes(k) + resident_bytes(v)
    x = torch.randn(3, 256)
    torch.testing.assert_close(fused(x), torch.cat([q(x), k(x), v(x)], dim=1), rtol=1e-6, atol=1e-5)
    dense = torch.cat([p.dequantize(torch.float32) for p in (q, k, v)])
    assert torch.equal(fused.dequantize(torch.float32), dense)
    assert torch.equal(fused.rows(torch.tensor([0, 31]), torch.float32), dense[[0, 31]])
    int8 = make_linear(torch.randn(8, 256), "int8")
    mixed = cat_linears([q, int8], torch.float32)
    assert isinstance(mixed, StackedLinear) and [type(p) for p in mixed.parts] == [GGUFBlockLinear, Int8Linear]
    assert torch.equal(mixed(x), torch.cat([q(x), int8(x)], dim=1))


def test_cpu_module_swap_and_head_copy():
    """swap_for_cpu reaches into a StackedLinear (its int4 part becomes an Int4CpuLinear, its blocks stay); a
    tied GGUF-block embedding gets a dense head copy of its exact values (cpu_head)."""
    assert Int4CpuLinear.available()  # the pinned CPU torch has it (tests/model/test_quant.py asserts it too)
    holder = torch.nn.Module()
    holder.qkv = StackedLinear([block_linear("Q5_0", 16, 64, 15), make_linear(torch.randn(16, 64), "int4")])
    swap_for_cpu(holder)
    assert [type(p) for p in holder.qkv.parts] == [GGUFBlockLinear, Int4CpuLinear]
    embed = block_linear("Q6_K", 32, 256, 16)
    head = cpu_head(embed, torch.float32)
    assert isinstance(head, DenseLinear) and torch.equal(head.weight, embed.dequantize(torch.float32))


def test_loader_modes():
    """auto keeps the blocks; the other modes quantize the exact dequantized weight; q/k rows un-permuted."""
    raw = random_blocks("Q5_K", rows=16, blocks=1, seed=17)
    exact = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType.Q5_K))
    weight = GGUFBlocksWeight("Q5_K", raw)
    assert weight.native == "Q5_K"
    kept = weight.linear("auto", torch.float32, CPU)
    assert isinstance(kept, GGUFBlockLinear) and torch.equal(kept.blocks, torch.from_numpy(raw))
    assert torch.equal(weight.dense(torch.float32, CPU), exact)
    none = weight.linear("none", torch.float32, CPU)
    assert isinstance(none, DenseLinear) and torch.equal(none.weight, exact)
    int8 = weight.linear("int8", torch.float32, CPU)
    assert isinstance(int8, Int8Linear) and torch.equal(int8.qweight, make_linear(exact, "int8").qweight)
    assert isinstance(weight.linear("int4", torch.float32, CPU), Int4Linear)
    q_rows = GGUFBlocksWeight("Q5_K", unpermute_rope_rows(raw, 2)).dense(torch.float32, CPU)
    assert torch.equal(q_rows, torch.from_numpy(unpermute_rope_rows(exact.numpy(), 2)))


# ---- whole GGUF files ---------------------------------------------------------------------------------------------

TINY = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, vocab=320)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down Q4_K_M stores in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, columns: int, layers: int, tied: bool) -> str:
    """The type llama.cpp's Q4_K_M gives a llama tensor (llama_tensor_get_type, for these tensors): Q6_K for the
    output head (the embedding when tied), for attn_v and ffn_down in use_more_bits layers, Q4_K elsewhere; rows
    not a multiple of 256 fall back to Q5_0 (for Q4_K) and Q8_0 (for Q6_K)."""
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    more_bits = re.search(r"attn_v|ffn_down", name) is not None and use_more_bits(layer, layers)
    kind = "Q6_K" if name == "output.weight" or (tied and name == "token_embd.weight") or more_bits else "Q4_K"
    return kind if columns % 256 == 0 else {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[kind]


def write_llama_gguf(path, arch: dict, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    """A llama GGUF with ``arch``'s shape, a byte-level tokenizer of made-up tokens (the engine reads one; prompts
    here are token ids) and the given tensors (GGUF name -> (data, type name); quantized data as raw block bytes
    [rows, bytes])."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(["<|end|>", "a", "b", "ab", *(f"w{i}" for i in range(4, arch["vocab"]))])
    writer.add_token_types([3] + [1] * (arch["vocab"] - 1))
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(0)
    writer.add_block_count(arch["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(arch["hidden"])
    writer.add_feed_forward_length(arch["intermediate"])
    writer.add_head_count(arch["heads"])
    writer.add_head_count_kv(arch["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(arch["vocab"])
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_float_tensors(arch: dict, seed: int) -> dict[str, np.ndarray]:
    """A llama's float weights in GGUF names and shapes [out, in] (the Q/K rows in whatever order: the file's)."""
    rng = np.random.default_rng(seed)
    h, i, head_dim = arch["hidden"], arch["intermediate"], arch["hidden"] // arch["heads"]
    shapes = {"token_embd.weight": (arch["vocab"], h)}
    for layer in range(arch["layers"]):
        p = f"blk.{layer}."
        shapes |= {p + "attn_q.weight": (h, h), p + "attn_k.weight": (arch["kv_heads"] * head_dim, h)}
        shapes |= {p + "attn_v.weight": (arch["kv_heads"] * head_dim, h), p + "attn_output.weight": (h, h)}
        shapes |= {p + "ffn_gate.weight": (i, h), p + "ffn_up.weight": (i, h), p + "ffn_down.weight": (h, i)}
    tensors = {name: (rng.standard_normal(shape) * 0.05).astype(np.float32) for name, shape in shapes.items()}
    for layer in range(arch["layers"]):
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{layer}.{norm}.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    tensors["output_norm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    return tensors


def quantized_files(tmp_path, floats: dict[str, np.ndarray], types: dict[str, str], arch: dict):
    """The weights encoded as ``types`` (name -> type; F32 for the rest) in one file, and their gguf
    dequantization as float32 in another: the same model twice, blocks kept and exact floats."""
    quant, exact = {}, {}
    for name, w in floats.items():
        kind = types.get(name, "F32")
        data = w if kind == "F32" else encode(w, kind)
        quant[name] = (data, kind)
        exact[name] = (gguf_dequantize(data, GGMLQuantizationType[kind]) if kind != "F32" else w, "F32")
    write_llama_gguf(tmp_path / "quant.gguf", arch, quant)
    write_llama_gguf(tmp_path / "exact.gguf", arch, exact)
    return tmp_path / "quant.gguf", tmp_path / "exact.gguf"


def linear_bits_per_weight(model) -> tuple[float, dict[str, int]]:
    """Bits per weight of the model's resident linear weights (the embedding, the decoder's linears, an untied
    head; not a CPU head copy), and how many weights each module type holds."""
    untied = not model.arch.tie_word_embeddings  # a tied model's lm_head is the CPU's head copy
    modules = [model.embed, *([model.lm_head] if untied else [])]
    for layer in model.layers:
        modules += [layer.attn.qkv_proj.base, layer.attn.o_proj.base, layer.mlp.gate_up_proj.base]
        modules.append(layer.mlp.down_proj.base)
    weights: dict[str, int] = {}
    total_bytes = total_weights = 0
    for module in modules:
        parts = module.parts if isinstance(module, StackedLinear) else [module]
        for part in parts:
            n = (
                part.out_features * part.in_features
                if isinstance(part, GGUFBlockLinear)
                else part.dequantize(torch.float32).numel()
            )
            name = part.kind if isinstance(part, GGUFBlockLinear) else type(part).__name__
            weights[name] = weights.get(name, 0) + n
            total_weights += n
        total_bytes += resident_bytes(module)
    return total_bytes * 8 / total_weights, weights


def test_types_not_kept_are_still_dequantized_exactly(tmp_path):
    """A type without a block reader (Q3_K here) is what it was: a float weight, gguf's exact float32 values."""
    from lora_server.model.checkpoint import FloatWeight
    from lora_server.model.gguf_checkpoint import open_gguf

    raw = np.random.default_rng(18).integers(0, 256, size=(16, 110), dtype=np.uint8)
    raw[:, 108:110] = np.array([0.01], dtype=np.float16).view(np.uint8)  # d, the block's last field
    # an MLP of 16 rows, the Q3_K weight's (a checkpoint's shapes must agree with its metadata)
    write_llama_gguf(tmp_path / "q3_k.gguf", {**TINY, "intermediate": 16}, {"blk.0.ffn_up.weight": (raw, "Q3_K")})
    weight = open_gguf(tmp_path / "q3_k.gguf").weights["layers.0.up"]
    assert isinstance(weight, FloatWeight)
    exact = gguf_dequantize(raw, GGMLQuantizationType.Q3_K)
    assert np.array_equal(bits(weight.dense(torch.float32, CPU)), bits(exact))


@pytest.mark.slow
def test_k_quant_file_keeps_its_blocks_and_gives_the_dequantized_logits(tmp_path):
    """A tiny llama (dims multiples of 256) typed as llama.cpp's Q4_K_M types it, o_proj in Q5_K (Q5_K_M's
    choice for some layers) so that all three K-quants are read: loaded with quantization auto, every linear keeps
    its blocks (layer 1's q|k|v mixes Q4_K and Q6_K: a StackedLinear), at 4.5-5 bits per weight as the file; its
    log-probabilities equal those of the same weights dequantized by gguf into a float32 file, and HF
    transformers' reading of the quantized file (its own dequantization and Q/K un-permutation)."""
    from transformers import AutoModelForCausalLM

    from lora_server.config import EngineConfig
    from lora_server.engine import Engine

    floats = tiny_float_tensors(TINY, seed=20)
    types = {
        name: ("Q5_K" if "attn_output" in name else q4_k_m_type(name, w.shape[1], TINY["layers"], tied=True))
        for name, w in floats.items()
        if w.ndim == 2
    }
    assert {types["blk.0.attn_v.weight"], types["blk.1.attn_v.weight"]} == {"Q4_K", "Q6_K"}
    quant, exact = quantized_files(tmp_path, floats, types, TINY)

    def engine(path, quantization):
        return Engine(EngineConfig(model=str(path), quantization=quantization, num_kv_blocks=64, show_progress=False))

    kept = engine(quant, "auto")
    model = kept.model
    assert isinstance(model.embed, GGUFBlockLinear) and model.embed.kind == "Q6_K"
    qkv = [layer.attn.qkv_proj.base for layer in model.layers]
    assert isinstance(qkv[0], GGUFBlockLinear) and isinstance(qkv[1], StackedLinear)
    bpw, weights = linear_bits_per_weight(model)
    file_bits = sum(
        gguf.GGML_QUANT_SIZES[GGMLQuantizationType[t]][1] * 8 / 256 * floats[n].size for n, t in types.items()
    )
    assert bpw == pytest.approx(file_bits / sum(weights.values()))  # nothing widened
    assert 4.5 <= bpw <= 5.5, (bpw, weights)

    prompt = [int(t) for t in np.random.default_rng(21).integers(0, TINY["vocab"], 24)]
    ours = kept.full_prompt_logprobs(prompt)
    reference = engine(exact, "none").full_prompt_logprobs(prompt)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-4)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="quant.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    torch.testing.assert_close(ours, hf_logprobs, rtol=0, atol=2e-3)


class _MetaBlocks:
    """A weight source of ``kind`` blocks [rows, cols] on the meta device: the module without the memory."""

    def __init__(self, kind: str, rows: int, cols: int) -> None:
        self.kind, self.rows, self.cols = kind, rows, cols

    def linear(self, mode: str, dtype: torch.dtype, device: torch.device):
        values, nbytes = GGUF_BLOCKS[self.kind]
        return GGUFBlockLinear(
            self.kind, torch.empty(self.rows, self.cols // values * nbytes, dtype=torch.uint8, device=device)
        )

    def dense(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(self.cols, dtype=dtype, device=device)


GGUF_NAMES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up"}
GGUF_NAMES |= {"down": "ffn_down"}


def test_llama_3_8b_q4_k_m_holds_its_file_s_bits_per_weight():
    """Llama-3-8B's shapes typed as Q4_K_M types them, built by the model builder on the meta device (the CUDA path,
    no memory): the linears hold 4.89 bits per weight, what the file holds (llama.cpp's 4.9 GB for 8.03 B)."""
    from lora_server.model.arch import PRESETS, ModelArch
    from lora_server.model.checkpoint import Checkpoint
    from lora_server.model.llama import build_llama

    arch = ModelArch.from_hf_config(PRESETS["llama-3-8b"])
    h, i, kv = arch.hidden_size, arch.intermediate_size, arch.kv_size
    shapes = {"q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h), "gate": (i, h), "up": (i, h), "down": (h, i)}
    weights: dict = {"norm": _MetaBlocks("F32", h, h)}
    for name, gguf_name in (("embed", "token_embd"), ("lm_head", "output")):
        kind = q4_k_m_type(f"{gguf_name}.weight", h, arch.num_layers, tied=False)
        weights[name] = _MetaBlocks(kind, arch.vocab_size, h)
    for layer in range(arch.num_layers):
        for name, (rows, cols) in shapes.items():
            kind = q4_k_m_type(f"blk.{layer}.{GGUF_NAMES[name]}.weight", cols, arch.num_layers, tied=False)
            weights[f"layers.{layer}.{name}"] = _MetaBlocks(kind, rows, cols)
        for norm in ("attn_norm", "mlp_norm"):
            weights[f"layers.{layer}.{norm}"] = _MetaBlocks("F32", h, h)
    model = build_llama(
        Checkpoint(arch, weights, "gguf", None), "auto", torch.bfloat16, torch.device("meta"), 64, False
    )
    bpw, held = linear_bits_per_weight(model)
    assert set(held) == {"Q4_K", "Q6_K"} and sum(held.values()) == 8_029_995_008  # the norms aside
    assert bpw == pytest.approx(4.8935, abs=1e-4)


def copy_metadata(reader, writer) -> None:
    """Every key of a GGUF file's metadata (the architecture, the tokenizer) into a writer, as gguf_new_metadata.py
    copies them."""
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        main = field.types[0]
        writer.add_key_value(key, field.contents(), main, sub_type=field.types[-1] if len(field.types) > 1 else None)


@pytest.mark.slow
def test_smollm2_as_q4_k_m(tmp_path, smollm2_path):
    """The embedded model's weights (Q4_1 / Q8_0, dequantized by gguf) re-encoded as llama.cpp's Q4_K_M would
    encode them: SmolLM2's 576 columns are no multiple of 256, so its q, k, v, o, gate, up and embedding take
    Q4_K_M's fallbacks (Q5_0 for Q4_K, Q8_0 for Q6_K) and only ffn_down is Q4_K / Q6_K. Loaded with quantization
    auto, the linears hold the file's bits per weight exactly (6.16; see docs/quantization.md for K-compatible
    shapes), and give the log-probabilities of the same weights dequantized to float32 (quantization none)."""
    from gguf import GGUFReader

    from lora_server.config import EngineConfig
    from lora_server.engine import Engine

    reader = GGUFReader(str(smollm2_path))
    layers = int(reader.fields["llama.block_count"].contents())
    tied = "output.weight" not in {t.name for t in reader.tensors}
    writer = gguf.GGUFWriter(str(tmp_path / "q4_k_m.gguf"), "llama")
    copy_metadata(reader, writer)
    file_bits = file_weights = 0
    for t in reader.tensors:
        kind = t.tensor_type.name
        w = gguf_dequantize(t.data, t.tensor_type) if kind not in ("F32", "F16") else np.asarray(t.data, np.float32)
        if w.ndim == 2:
            kind = q4_k_m_type(t.name, w.shape[1], layers, tied)
            data = encode(w, kind)
            file_bits, file_weights = file_bits + data.size * 8, file_weights + w.size
        else:
            data = w
        writer.add_tensor(t.name, data, raw_dtype=GGMLQuantizationType[kind if w.ndim == 2 else "F32"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    def engine(quantization: str) -> Engine:
        path = str(tmp_path / "q4_k_m.gguf")
        return Engine(EngineConfig(model=path, quantization=quantization, kv_cache_bytes=32 << 20, show_progress=False))

    kept = engine("auto")
    bpw, held = linear_bits_per_weight(kept.model)
    assert set(held) == {"Q4_K", "Q6_K", "Q5_0", "Int8Linear"}, held
    assert sum(held.values()) == file_weights and bpw == pytest.approx(file_bits / file_weights)
    assert bpw == pytest.approx(6.1587, abs=1e-4)
    prompt = kept.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    ours = kept.full_prompt_logprobs(prompt)
    torch.testing.assert_close(ours, engine("none").full_prompt_logprobs(prompt), rtol=0, atol=1e-4)
