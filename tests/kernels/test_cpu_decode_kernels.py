"""kernels.cpu_decode (the CPU decode step's C kernels) against float64 references: the quantized matmuls against
the weights dequantized in float64 (torch's CPU int4 layout decoded by the twin, which is itself checked against
torch's own int4 kernel), decode attention against the gathered twin in float64, the norm against the reference
norm in float64. Each runs on the build for this CPU and on the portable one (-march=x86-64: the loops without
vector intrinsics), so both code paths of the source are checked."""

from __future__ import annotations

import ctypes
import logging
import platform
import shutil
from pathlib import Path

import pytest
import torch

from lora_server.kernels import cpu_decode
from lora_server.kernels.gathered_attention import gathered_decode_attention
from lora_server.kernels.quant_reference import dequantize_int8
from lora_server.kernels.reference import fused_add_rms_norm, rotary_write_kv

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
BUILDS = ["native"] + (["x86-64"] if platform.machine() == "x86_64" else [])


@pytest.fixture(scope="module", params=BUILDS)
def lib(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    built = cpu_decode.load(tmp_path_factory.mktemp("kernels"), march=request.param)
    assert built is not None
    return built


def torch_layout(codes: torch.Tensor, block: int) -> torch.Tensor:
    """[N, K] codes -> torch's CPU int4 layout for row blocks of ``block`` (int4_gemv's docstring), built by hand."""
    n, k = codes.shape
    t = codes.view(n // block, block, k).to(torch.uint8)
    return (t[:, : block // 2] | (t[:, block // 2 :] << 4)).permute(0, 2, 1).reshape(n, k // 2).contiguous()


def dequantized_int4(codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """[N, K] float64: (code - 8) * scale + zero, straight from the codes."""
    s = scales_and_zeros[..., 0].double().t().repeat_interleave(group, dim=1)
    z = scales_and_zeros[..., 1].double().t().repeat_interleave(group, dim=1)
    return (codes.double() - 8) * s + z


@pytest.mark.parametrize(
    ("m", "n", "k", "group"), [(1, 64, 64, 32), (2, 128, 96, 32), (3, 192, 128, 64), (5, 64, 576, 32)]
)
def test_int4_gemv_matches_its_float64_twin(lib: ctypes.CDLL, m: int, n: int, k: int, group: int) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    codes = torch.randint(0, 16, (n, k), generator=g)
    sz = (torch.rand(k // group, n, 2, generator=g) - 0.5).to(torch.bfloat16)
    packed = torch_layout(codes, 64)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 1, k)  # blocks of very different sizes
    got = cpu_decode.int4_gemv(lib, x, packed, sz, group)
    twin = cpu_decode.int4pack_reference(x.double(), packed, sz, 64, group, exact=False)
    torch.testing.assert_close(got.double(), twin, rtol=1e-5, atol=1e-4)  # float32 sums over K
    # the twin is the float64 product within the fixed point's bound: half a step of each block, times |W| there
    expected = x.double() @ dequantized_int4(codes, sz, group).T
    steps = x.abs().reshape(m, -1, 32).amax(dim=-1).double() / cpu_decode.INT4_XQ_MAX  # [M, K / 32]
    codes_times_scales = (codes.double() * sz[..., 0].double().t().repeat_interleave(group, dim=1)).abs()  # [N, K]
    bound = (steps.repeat_interleave(32, dim=1) / 2) @ codes_times_scales.T
    assert ((twin - expected).abs() <= bound * (1 + 1e-9) + 1e-12).all()


def test_int4_activations_round_each_block_to_16_bits() -> None:
    """Hand-computed: a block whose largest value is 32639 takes its integers as they are; every value of a block
    is within half a step of its fixed point; zeros stay zeros; a non-finite value makes its row's outputs NaN."""
    x = torch.zeros(1, 64)
    x[0, :32] = torch.arange(32) * 1000.0 - 15000.0
    x[0, 0] = 32639.0
    assert torch.equal(cpu_decode.int4_activations(x), x.double())
    y = torch.randn(3, 64)
    step = y.abs().reshape(3, 2, 32).amax(dim=-1).repeat_interleave(32, dim=1).double() / cpu_decode.INT4_XQ_MAX
    assert ((cpu_decode.int4_activations(y) - y.double()).abs() <= step / 2 * (1 + 1e-6)).all()


def test_int4_gemv_takes_zeros_and_propagates_non_finite_values(lib: ctypes.CDLL) -> None:
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (64, 64), generator=g)
    sz = (torch.rand(2, 64, 2, generator=g) - 0.5).to(torch.bfloat16)
    packed = torch_layout(codes, 64)
    x = torch.zeros(3, 64)
    x[1, 40] = float("nan")
    x[2, 3] = float("inf")
    y = cpu_decode.int4_gemv(lib, x, packed, sz, 32)
    assert torch.equal(y[0], torch.zeros(64))
    assert y[1].isnan().all() and not y[2].isfinite().any()


def test_the_twin_reads_the_layout_torch_writes() -> None:
    """int4pack_reference decodes _convert_weight_to_int4pack_for_cpu's bytes as torch's own int4 kernel does."""
    from lora_server.model.quant import int4pack_cpu_block

    block = int4pack_cpu_block()
    if block is None or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("torch's CPU int4 layout is unknown on this machine")
    g = torch.Generator().manual_seed(1)
    n, k = 128, 64
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    sz = (torch.rand(k // 32, n, 2, generator=g) - 0.5).to(torch.bfloat16)
    x = torch.randn(2, k, generator=g).bfloat16()
    torch_result = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz).double()
    twin = cpu_decode.int4pack_reference(x.double(), packed, sz, block, 32)
    torch.testing.assert_close(twin, torch_result, rtol=2e-2, atol=2e-2)  # torch rounds its result to bfloat16
    assert torch.equal(packed.view(torch.uint8).reshape(n, k // 2), torch_layout(codes, block))


@pytest.mark.parametrize(("m", "n", "k", "group"), [(1, 33, 64, 32), (4, 17, 96, 32), (6, 40, 128, 64), (9, 8, 64, 64)])
def test_int8_gemv_matches_the_float64_product(lib: ctypes.CDLL, m: int, n: int, k: int, group: int) -> None:
    g = torch.Generator().manual_seed(m + n + k)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g).half().float()
    x = torch.randn(m, k, generator=g)
    expected = x.double() @ dequantize_int8(q, scales, torch.float64).T
    torch.testing.assert_close(cpu_decode.int8_gemv(lib, x, q, scales).double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size", "window", "softcap"),
    [(9, 3, 64, 16, 0, 0.0), (4, 2, 32, 4, 5, 0.0), (8, 8, 16, 8, 0, 30.0), (6, 2, 64, 16, 3, 20.0)],
)
def test_decode_attention_matches_the_gathered_twin(
    lib: ctypes.CDLL, heads: int, kv_heads: int, dim: int, block_size: int, window: int, softcap: float
) -> None:
    """Sequences of lengths 0 (zeros), 1, a block's tail and several blocks, over a strided cache (the arena's
    pages: each slot's heads lie inside a wider row)."""
    g = torch.Generator().manual_seed(heads * dim + window)
    num_blocks, max_blocks = 24, 6
    wide = torch.randn(2, num_blocks, block_size, kv_heads, dim + 8, generator=g)
    k_cache, v_cache = wide[0, ..., :dim], wide[1, ..., :dim]
    seq_lens = torch.tensor([0, 1, block_size + 3, max_blocks * block_size], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=g)[: 4 * max_blocks].view(4, max_blocks).to(torch.int32)
    q = torch.randn(4, heads, dim, generator=g)
    got = cpu_decode.decode_attention(lib, q, k_cache, v_cache, tables, seq_lens, 0.125, window, softcap)
    live = slice(1, None)
    expected = gathered_decode_attention(
        q[live].double(), k_cache.double(), v_cache.double(), tables[live], seq_lens[live], 0.125,
        window=window, softcap=softcap,
    )  # fmt: skip
    torch.testing.assert_close(got[live].double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[0], torch.zeros(heads, dim))


@pytest.mark.parametrize("add", [True, False])
def test_add_rms_norm_matches_the_reference_norm(lib: ctypes.CDLL, add: bool) -> None:
    g = torch.Generator().manual_seed(int(add))
    x, residual = torch.randn(3, 576, generator=g), torch.randn(3, 576, generator=g)
    weight = torch.randn(576, generator=g)
    x64, residual64 = x.double(), residual.double()
    if add:
        fused_add_rms_norm(x64, residual64, weight.double(), 1e-5)
    else:
        x64 = residual64 * torch.rsqrt(residual64.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    cpu_decode.add_rms_norm_(lib, x, residual, weight, 1e-5, add=add)
    torch.testing.assert_close(residual.double(), residual64, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.double(), x64, rtol=1e-5, atol=1e-5)


def test_the_builds_say_whether_their_products_are_vectorized(tmp_path: Path) -> None:
    """The native build says yes exactly where the CPU has AVX-512; the portable one says no."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    native = cpu_decode.load(tmp_path, march="native")
    assert native is not None and cpu_decode.vectorized(native) == ("avx512f" in flags)
    if platform.machine() == "x86_64":
        portable = cpu_decode.load(tmp_path, march="x86-64")
        assert portable is not None and not cpu_decode.vectorized(portable)


def test_a_compiler_that_fails_leaves_torchs_kernels_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A real compiler that refuses (an unknown -march) gives None and one warning naming the failure."""
    with caplog.at_level(logging.WARNING, logger=cpu_decode.__name__):
        assert cpu_decode.load(tmp_path, march="no-such-cpu") is None
    assert "could not be built" in caplog.text and "no-such-cpu" in caplog.text
    assert list(tmp_path.glob("*.so")) == []


@pytest.mark.parametrize("rotary_dim", [0, 8])
def test_rotary_write_kv_is_the_reference_bit_for_bit(lib: ctypes.CDLL, rotary_dim: int) -> None:
    """Full and partial rotary over heads that are views of a wider q|k|v row, keys and values written to a
    strided cache, a negative slot writing nothing: the same bits as the reference (products rounded, then the
    sum)."""
    g = torch.Generator().manual_seed(rotary_dim)
    tokens, heads, kv_heads, dim, block_size = 3, 4, 2, 16, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    cos, sin = torch.randn(tokens, 1, dim, generator=g), torch.randn(tokens, 1, dim, generator=g)
    caches = torch.randn(2, 5, block_size, kv_heads, dim + 4, generator=g)[..., :dim]  # strided pages
    slots = torch.tensor([6, -1, 17])
    expected_qkv, expected_caches = qkv.clone(), caches.clone()

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qk = t[:, : (heads + kv_heads) * dim].unflatten(1, (heads + kv_heads, dim))
        return qk, t[:, (heads + kv_heads) * dim :].unflatten(1, (kv_heads, dim))

    rotary_write_kv(
        *views(expected_qkv), cos, sin, expected_caches[0], expected_caches[1], slots, rotary_dim=rotary_dim
    )
    qk, v = views(qkv)
    assert cpu_decode.takes_rotary(qk, v, cos, caches[0], None)
    cpu_decode.rotary_write_kv_(lib, qk, v, cos, sin, caches[0], caches[1], slots, rotary_dim)
    assert torch.equal(qkv, expected_qkv)
    assert torch.equal(caches, expected_caches)


def test_the_ops_take_the_library_they_are_given_for_float32_cpu_tensors(lib: ctypes.CDLL) -> None:
    """kernels.ops routes a float32 CPU decode step's attention and norms to the library passed as ``cpu`` (bit for
    bit its result), anything else (bfloat16 here) to the twins, and nothing to it without ``cpu``."""
    from lora_server.kernels import ops, reference

    g = torch.Generator().manual_seed(7)
    x, residual = torch.randn(2, 64, generator=g), torch.randn(2, 64, generator=g)
    weight = torch.randn(64, generator=g)
    via_ops, direct, twin = (x.clone(), residual.clone()), (x.clone(), residual.clone()), (x.clone(), residual.clone())
    ops.fused_add_rms_norm(*via_ops, weight, 1e-6, cpu=lib)
    cpu_decode.add_rms_norm_(lib, *direct, weight, 1e-6, add=True)
    assert all(torch.equal(a, b) for a, b in zip(via_ops, direct, strict=True))
    ops.fused_add_rms_norm(*twin, weight, 1e-6)
    reference_result = (x.clone(), residual.clone())
    reference.fused_add_rms_norm(*reference_result, weight, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(twin, reference_result, strict=True))
    normed = torch.empty_like(x)
    cpu_decode.add_rms_norm_(lib, normed, x, weight, 1e-6, add=False)
    assert torch.equal(ops.rms_norm(x, weight, 1e-6, cpu=lib), normed)
    bf16, w16 = x.bfloat16(), weight.bfloat16()
    assert torch.equal(ops.rms_norm(bf16, w16, 1e-6, cpu=lib), reference.rms_norm(bf16, w16, 1e-6))

    cache = torch.randn(2, 4, 8, 2, 16, generator=g)
    q, tables = torch.randn(2, 4, 16, generator=g), torch.tensor([[3, 1], [0, 7]], dtype=torch.int32)
    lens, starts = torch.tensor([5, 8], dtype=torch.int32), torch.arange(3)
    got = ops.paged_attention(q, cache[0], cache[1], tables, lens, starts, 0.25, 1, cpu=lib)
    direct_out = cpu_decode.decode_attention(lib, q, cache[0], cache[1], tables, lens, 0.25, 0, 0.0)
    assert torch.equal(got, direct_out)
