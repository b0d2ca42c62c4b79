"""The decode step's small kernels: RMSNorm alone and fused with the residual add (kernels/rms_norm.py),
SiLU-and-multiply (kernels/silu_and_mul.py) and rotary fused with the KV write (kernels/rotary_write_kv.py). Each
kernel against its torch twin (kernels/reference.py), each twin against a float64 computation written here from
the contract (rounding to the dtype exactly where the contract says: those are HF's roundings), the rotary twin
also against HF transformers' own apply_rotary_pos_emb, and the dispatcher (kernels/ops.py) on both paths.

Sweeps: dtype (float32, float16, bfloat16), row counts (1, a few, odd), widths (powers of two and not), strided
rows (slices of a fused projection output), padding rows (slot -1) and fp8 KV caches with a scale per head.
Tolerances: tests/kernel_env.py (kernel vs twin; twin vs float64, one rounding of the output)."""

from __future__ import annotations

import pytest
import torch

from lora_server.kernels import ops
from lora_server.kernels import reference as ref
from lora_server.kernels.reference import FP8_KV_DTYPE
from lora_server.kernels.rms_norm import fused_add_rms_norm, rms_norm
from lora_server.kernels.rotary_write_kv import rotary_write_kv
from lora_server.kernels.silu_and_mul import silu_and_mul
from tests.kernel_env import DEVICE, TOL_VS_EXACT, TOL_VS_TWIN, force_path

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16, FP8_KV_DTYPE: torch.uint8}


def rounded(x64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float64 value rounded to dtype (round to nearest even), back in float64."""
    return x64.to(dtype).double()


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---- RMSNorm -------------------------------------------------------------------------------------------------------


def norm_64(rows: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """From the contract, in float64: y = row / sqrt(mean(row^2) + eps) rounded to the dtype, times weight,
    rounded again (HF: weight * hidden.to(input_dtype))."""
    dtype = rows.dtype
    r = rows.double().cpu()
    y = rounded(r / torch.sqrt((r * r).mean(-1, keepdim=True) + eps), dtype)
    return rounded(weight.double().cpu() * y, dtype)


NORM_SHAPES = [(1, 64), (5, 96), (7, 256), (3, 576)]


@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, int]):
    """Rows of a wider tensor (a row stride past the width), with large and small magnitudes."""
    rows, hidden = shape
    wide = (randn(rows, hidden + 8, seed=1) * torch.logspace(-2, 2, rows)[:, None]).to(DEVICE, dtype)
    x = wide[:, :hidden]
    weight = (1 + randn(hidden, seed=2, scale=0.2)).to(DEVICE, dtype)
    eps = 1e-5
    twin = ref.rms_norm(x, weight, eps)
    torch.testing.assert_close(twin.double().cpu(), norm_64(x, weight, eps), **TOL_VS_EXACT[dtype])
    out = rms_norm(x, weight, eps)
    assert out.dtype == dtype and out.shape == (rows, hidden)
    torch.testing.assert_close(out, twin, **TOL_VS_TWIN[dtype])
    assert torch.equal(wide[:, :hidden], x)  # the input is not touched


@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm(dtype: torch.dtype, shape: tuple[int, int]):
    """residual += x (rounded to the dtype), x = norm(residual): both in place, against the float64 contract."""
    rows, hidden = shape
    x0 = randn(rows, hidden, seed=3).to(DEVICE, dtype)
    residual0 = randn(rows, hidden, seed=4, scale=4.0).to(DEVICE, dtype)
    weight = (1 + randn(hidden, seed=5, scale=0.2)).to(DEVICE, dtype)
    eps = 1e-6
    total = rounded(x0.double().cpu() + residual0.double().cpu(), dtype)  # the sum the contract rounds

    x_twin, res_twin = x0.clone(), residual0.clone()
    ref.fused_add_rms_norm(x_twin, res_twin, weight, eps)
    torch.testing.assert_close(res_twin.double().cpu(), total, atol=0, rtol=0)
    torch.testing.assert_close(x_twin.double().cpu(), norm_64(total.to(dtype), weight, eps), **TOL_VS_EXACT[dtype])

    x, residual = x0.clone(), residual0.clone()
    fused_add_rms_norm(x, residual, weight, eps)
    torch.testing.assert_close(residual, res_twin, **TOL_VS_TWIN[dtype])
    torch.testing.assert_close(x, x_twin, **TOL_VS_TWIN[dtype])


def test_rms_norm_empty_and_equal_to_fused_first_step():
    """No rows: nothing launched, an empty result. With a zero residual, the fused form is the plain norm."""
    weight = torch.ones(64, device=DEVICE)
    assert rms_norm(torch.empty(0, 64, device=DEVICE), weight, 1e-5).shape == (0, 64)
    x = randn(3, 64, seed=6).to(DEVICE)
    residual = torch.zeros_like(x)
    plain = rms_norm(x, weight, 1e-5)
    fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(x, plain)


# ---- SiLU and multiply ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 16), (4, 128), (9, 1536), (3, 100)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype: torch.dtype, shape: tuple[int, int]):
    """out = silu(gate) * up from gate | up, the SiLU rounded to the dtype, then the product (HF's
    act_fn(gate) * up); rows of a wider tensor; a small block so that a row spans several programs."""
    rows, inter = shape
    wide = randn(rows, 2 * inter + 4, seed=7, scale=3.0).to(DEVICE, dtype)
    x = wide[:, : 2 * inter]
    g, up = x.double().cpu().chunk(2, dim=-1)
    expected = rounded(rounded(g / (1 + torch.exp(-g)), dtype) * up, dtype)
    twin = ref.silu_and_mul(x)
    torch.testing.assert_close(twin.double().cpu(), expected, **TOL_VS_EXACT[dtype])
    out = silu_and_mul(x, block=64)
    assert out.shape == (rows, inter) and out.dtype == dtype
    torch.testing.assert_close(out, twin, **TOL_VS_TWIN[dtype])
    assert torch.equal(silu_and_mul(x), out)  # the block size changes nothing


# ---- rotary + KV write ---------------------------------------------------------------------------------------------


def rope_tables(positions: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] in dtype from the angles position * 10000^(-2i/D), HF's cat([freqs, freqs]) layout."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = positions.double()[:, None] * inv[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """From the contract, in float64, pair by pair: out[i] = x[i] c[i] - x[i + D/2] s[i] and out[i + D/2] =
    x[i + D/2] c[i + D/2] + x[i] s[i + D/2], each product rounded to the dtype, then the sum (HF's roundings)."""
    dtype = x.dtype
    x64, c, s = x.double().cpu(), cos.double().cpu()[:, None], sin.double().cpu()[:, None]
    half = x.shape[-1] // 2
    out = torch.empty_like(x64)
    for i in range(x.shape[-1]):
        j, sign = (i + half, -1.0) if i < half else (i - half, 1.0)
        out[..., i] = rounded(
            rounded(x64[..., i] * c[..., i], dtype) + rounded(sign * x64[..., j] * s[..., i], dtype), dtype
        )
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_matches_hf_and_contract(dtype: torch.dtype):
    """The twin's rotation against HF transformers' apply_rotary_pos_emb (bit for bit: the same two roundings)
    and the float64 contract."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    tokens, heads, kv_heads, head_dim = 6, 4, 2, 32
    positions = torch.tensor([0, 1, 7, 100, 4000, 3])
    cos, sin = rope_tables(positions, head_dim, dtype)
    half = head_dim // 2
    sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    qk = randn(tokens, heads + kv_heads, head_dim, seed=8, scale=3.0).to(dtype)
    q_hf, k_hf = apply_rotary_pos_emb(
        qk[None, :, :heads].transpose(1, 2), qk[None, :, heads:].transpose(1, 2), cos[None], sin[None]
    )
    twin = qk.clone()
    ref.apply_rotary_(twin, cos[:, None], sin_signed[:, None])
    assert torch.equal(twin[:, :heads], q_hf[0].transpose(0, 1))
    assert torch.equal(twin[:, heads:], k_hf[0].transpose(0, 1))
    torch.testing.assert_close(twin.double(), rotate_64(qk, cos, sin), atol=0, rtol=0)


def loop_rotary_write_kv(qk, v, cos, sin, k_cache, v_cache, slots, k_scale=None, v_scale=None):
    """The contract token by token: qk rotated in place (rotate_64), then each token with a slot >= 0 writes its
    rotated keys and its values at block slot // block_size, offset slot % block_size (fp8: x / scale rounded
    by torch's own float8 cast, clamped at 448)."""
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    qk.copy_(rotate_64(qk, cos, sin).to(qk.dtype))
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for x, cache, scale in ((qk[t, -kv_heads:], k_cache, k_scale), (v[t], v_cache, v_scale)):
            if scale is not None:  # the fp8 format's contract: x.float() / scale, clamped, cast
                x = (x.float() / scale[:, None]).clamp(-448, 448)
            cache[slot // block_size, slot % block_size] = x.to(cache.dtype)


ROTARY_CASES = [
    # dtype, tokens, heads, kv_heads, head_dim, block_size, fp8
    (torch.float32, 5, 4, 2, 32, 4, False),
    (torch.float16, 1, 8, 1, 16, 16, False),
    (torch.bfloat16, 7, 3, 3, 64, 4, False),
    (torch.float32, 9, 6, 2, 80, 5, False),  # head_dim not a power of two, odd block size
    (torch.float32, 6, 4, 2, 32, 4, True),
    (torch.float16, 5, 2, 2, 16, 4, True),
    (torch.bfloat16, 4, 8, 2, 32, 16, True),
]


@pytest.mark.parametrize("padding", [False, True], ids=["all-rows", "padding-rows"])
@pytest.mark.parametrize(
    "case",
    ROTARY_CASES,
    ids=lambda c: f"{str(c[0])[6:]}-t{c[1]}-h{c[2]}-kv{c[3]}-d{c[4]}-bs{c[5]}{'-fp8' if c[6] else ''}",
)
def test_rotary_write_kv(case, padding: bool):
    """q and k heads as views of a fused QKV output (strided), rotated in place; keys and values scattered to
    shuffled slots, fp8 with a scale per head or in the model's dtype; with padding rows (slot -1) every other
    token writes nothing (its heads are still rotated). The kernel gives the twin's bits (fp8: bytes), the twin
    the float64 loop's, and every slot no token owns keeps its bytes."""
    dtype, tokens, heads, kv_heads, head_dim, block_size, fp8 = case
    num_blocks = (tokens + block_size - 1) // block_size + 2
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=9, scale=3.0).to(DEVICE, dtype)
    positions = torch.randint(0, 2048, (tokens,), generator=torch.Generator().manual_seed(10))
    cos, sin = rope_tables(positions, head_dim, dtype)
    half = head_dim // 2
    sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    cos3, sin3 = cos[:, None].to(DEVICE), sin_signed[:, None].to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(11))[:tokens]
    if padding:
        slots = torch.where(torch.arange(tokens) % 2 == 1, -1, slots)
    slots = slots.to(DEVICE)
    cache_dtype = FP8_KV_DTYPE if fp8 else dtype
    cache = randn(2, num_blocks, block_size, kv_heads, head_dim, seed=12).to(DEVICE).to(cache_dtype)
    scales = (
        tuple((torch.rand(2, kv_heads, generator=torch.Generator().manual_seed(13)) * 0.01 + 0.005).to(DEVICE))
        if fp8
        else (None, None)
    )

    def views(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qk = buf[:, : (heads + kv_heads) * head_dim].unflatten(1, (heads + kv_heads, head_dim))
        return qk, buf[:, (heads + kv_heads) * head_dim :].unflatten(1, (kv_heads, head_dim))

    qkv_twin, cache_twin = qkv.clone(), cache.clone()
    ref.rotary_write_kv(*views(qkv_twin), cos3, sin3, cache_twin[0], cache_twin[1], slots, *scales)
    qkv_kernel, cache_kernel = qkv.clone(), cache.clone()
    rotary_write_kv(*views(qkv_kernel), cos3, sin3, cache_kernel[0], cache_kernel[1], slots.int(), *scales)
    qkv_loop, cache_loop = qkv.clone().cpu(), cache.clone().cpu()
    cpu_scales = tuple(s.cpu() for s in scales) if fp8 else (None, None)
    loop_rotary_write_kv(*views(qkv_loop), cos, sin, cache_loop[0], cache_loop[1], slots.cpu(), *cpu_scales)

    bits = BITS[cache_dtype]
    assert torch.equal(qkv_twin.cpu(), qkv_loop)  # v's columns untouched, q and k rotated as the contract says
    assert torch.equal(cache_twin.cpu().view(bits), cache_loop.view(bits))
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        # the interpreter rounds fp32 -> bf16 toward zero, each product and the sum: within 3 bf16 ulps of the
        # terms (2^-7 relative each) of the twin; the cache holds exactly what the kernel's own keys quantize to
        qk0 = views(qkv)[0].float()
        terms = qk0.abs() + qk0.roll(head_dim // 2, -1).abs()
        assert ((views(qkv_kernel)[0].float() - views(qkv_twin)[0].float()).abs() <= terms * 3 * 2**-7).all()
        assert torch.equal(qkv_kernel[:, (heads + kv_heads) * head_dim :], qkv[:, (heads + kv_heads) * head_dim :])
        cache_twin = cache.clone()
        keys = views(qkv_kernel)[0][:, heads:]
        ref.write_kv_cache(keys, views(qkv)[1], cache_twin[0], cache_twin[1], slots, *scales)
    else:
        assert torch.equal(qkv_kernel, qkv_twin)
    assert torch.equal(cache_kernel.view(bits), cache_twin.view(bits))


# ---- the dispatcher ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dispatch(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch):
    """Each op is its kernel where use_kernels says so and its twin elsewhere, bit for bit; the default follows
    the device (the twins on the CPU tier)."""
    x = randn(3, 64, seed=14).to(DEVICE, dtype)
    residual = randn(3, 64, seed=15).to(DEVICE, dtype)
    weight = (1 + randn(64, seed=16, scale=0.1)).to(DEVICE, dtype)
    qkv = randn(3, 4 * 16, seed=17).to(DEVICE, dtype)
    cos = randn(3, 1, 16, seed=18).to(DEVICE, dtype)
    sin = randn(3, 1, 16, seed=19).to(DEVICE, dtype)
    cache = torch.zeros(2, 2, 4, 1, 16, dtype=dtype, device=DEVICE)
    slots = torch.tensor([5, -1, 2], device=DEVICE)

    def step(rms_norm_op, fused_op, silu_op, rotary_op) -> list[torch.Tensor]:
        xs, rs, buf, kv = x.clone(), residual.clone(), qkv.clone(), cache.clone()
        normed = rms_norm_op(xs, weight, 1e-5)
        fused_op(xs, rs, weight, 1e-5)
        act = silu_op(buf)
        qk, v = buf[:, :48].unflatten(1, (3, 16)), buf[:, 48:].unflatten(1, (1, 16))
        rotary_op(qk, v, cos, sin, kv[0], kv[1], slots)
        return [normed, xs, rs, act, buf, kv]

    via_ops = (ops.rms_norm, ops.fused_add_rms_norm, ops.silu_and_mul, ops.rotary_write_kv)
    default = step(*via_ops)
    force_path(monkeypatch, "kernels")
    via_kernels = step(*via_ops)
    force_path(monkeypatch, "twins")
    via_twins = step(*via_ops)
    direct_kernels = step(rms_norm, fused_add_rms_norm, silu_and_mul, rotary_write_kv)
    direct_twins = step(ref.rms_norm, ref.fused_add_rms_norm, ref.silu_and_mul, ref.rotary_write_kv)
    for got, want in (
        (via_kernels, direct_kernels),
        (via_twins, direct_twins),
        (default, via_kernels if ops.use_kernels(DEVICE) else via_twins),
    ):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for a, b in zip(via_kernels, via_twins, strict=True):
        torch.testing.assert_close(a, b, **TOL_VS_TWIN[dtype])
