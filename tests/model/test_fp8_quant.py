"""``--quantization fp8`` (W8A8: float8 e4m3 weights with a scale per output channel, activations quantized per
token at each call): the quantizers against hand values and an independent float64 rounding to the e4m3 grid; the
per-token Triton quantization (kernels/fp8_matmul.py, in the interpreter without a GPU) against its twin, bit for
bit; the matmul twin (kernels/quant_reference.fp8_matmul) against a float64 computation from the format's
contract; the module (lora_server.model.quant.Fp8Linear), fusing, the CPU head copy, the loaders; the engine's
greedy agreement with fp32. torch._scaled_mm itself runs only in the GPU tier (compute capability 8.9-9.x)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lora_server.kernels import ops
from lora_server.kernels import quant_reference as ref
from lora_server.kernels.fp8_matmul import quantize_per_token, scaled_mm_supported
from lora_server.model.checkpoint import FloatWeight
from lora_server.model.gguf_checkpoint import GGUFBlocksWeight
from lora_server.model.quant import Fp8Linear, cat_linears, make_linear, quantize_fp8, resident_bytes, tensor_mode
from tests.kernel_env import DEVICE, force_path

CPU = torch.device("cpu")


def e4m3_round(v: np.ndarray) -> np.ndarray:
    """float64 values (|v| <= 448) rounded to the float8 e4m3 grid, ties to even, written from the format: 3
    mantissa bits, so the step is 2**(e - 3) for |v| in [2**e, 2**(e+1)), e >= -6, and 2**-9 below 2**-6."""
    out = np.zeros_like(v)
    for i, x in np.ndenumerate(v):
        if x == 0:
            continue
        e = max(math.floor(math.log2(abs(x))), -6)
        step = 2.0 ** (e - 3)
        out[i] = np.round(x / step) * step  # numpy rounds halves to even
    return out


def float64_fp8_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T the W8A8 way, in float64 from the contract: per-row scales amax / 448 (weights by output row,
    activations by token), values divided by their scale and rounded to e4m3, products summed, both scales
    applied."""
    x64, w64 = x.double().numpy(), w.double().numpy()
    xs = np.maximum(np.abs(x64).max(-1), 1e-12) / 448
    ws = np.maximum(np.abs(w64).max(-1), 1e-12) / 448
    xq = e4m3_round(np.clip(x64 / xs[:, None], -448, 448))
    wq = e4m3_round(np.clip(w64 / ws[:, None], -448, 448))
    return torch.from_numpy((xq @ wq.T) * xs[:, None] * ws[None, :])


# ---- the quantizers -------------------------------------------------------------------------------------------


def test_quantize_fp8_hand_values():
    """Row 0: amax 448 -> scale 1, so the codes are the values rounded to e4m3: 17 is halfway between 16 and 18
    and goes to 16 (even mantissa), 19 to 20, 0.3 to 0.3125 (steps of 2**-5 in [0.25, 0.5)). Row 1: amax 3.5 ->
    scale 3.5 / 448 = 2**-7, codes exact. Row 2: zeros -> the smallest scale, zero codes."""
    w = torch.tensor([[448.0, 17.0, -19.0, 0.3], [-3.5, 1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (3,)
    assert s[0].item() == 1.0 and s[1].item() == 2.0**-7 and s[2].item() == pytest.approx(1e-12 / 448)
    assert q.float().tolist() == [[448.0, 16.0, -20.0, 0.3125], [-448.0, 128.0, 32.0, 0.0], [0.0] * 4]
    xq, xs = ref.quantize_fp8_per_token(w)  # activations follow the same per-row rule
    assert torch.equal(xq.float(), q.float()) and torch.equal(xs, s)


def test_quantize_fp8_random_against_float64_rounding():
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(0)) * 3
    q, s = quantize_fp8(w)
    scales = np.maximum(np.abs(w.double().numpy()).max(-1), 1e-12) / 448
    expected = e4m3_round(np.clip(w.double().numpy() / s.double().numpy()[:, None], -448, 448))
    np.testing.assert_allclose(s.double().numpy(), scales, rtol=1e-7)
    assert np.array_equal(q.float().double().numpy(), expected)
    # within half an e4m3 step (2**-4 relative) of each weight
    err = (ref.dequantize_fp8(q, s).double() - w.double()).abs()
    assert (err <= w.double().abs() * 2**-4 + s.double()[:, None] * 2**-9).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_per_token_kernel_equals_twin(dtype: torch.dtype):
    """The Triton per-token quantization (codes and scales) equals the twin bit for bit: K of 200 in chunks of
    64 (a tail chunk), a strided x, an all-zero row, a row with one large value."""
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 400, generator=gen) * torch.rand(6, 1, generator=gen) * 4
    x = wide[:, 100:300].to(DEVICE, dtype)
    x[2] = 0
    x[4, 7] = 300.0
    q, s = quantize_per_token(x, block_k=64)
    q_twin, s_twin = ref.quantize_fp8_per_token(x)
    assert q.shape == (6, 200) and q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(s, s_twin)
    assert torch.equal(q.view(torch.uint8), q_twin.view(torch.uint8))
    assert quantize_per_token(x[:0])[0].shape == (0, 200)


# ---- the matmul ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_twin_against_float64(dtype: torch.dtype):
    """The twin = the W8A8 product computed in float64 from the format (e4m3 rounding written here), up to its
    float32 accumulation and one rounding to x's dtype."""
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(5, 128, generator=gen) * torch.rand(5, 1, generator=gen) * 3).to(dtype)
    w = torch.randn(48, 128, generator=gen) * 0.05
    q, s = quantize_fp8(w)
    y = ref.fp8_matmul(x, q, s)
    expected = float64_fp8_matmul(x.float(), w)
    assert y.dtype == dtype
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 8e-3, "rtol": 8e-3}
    torch.testing.assert_close(y.double(), expected, **tol)
    # and W8A8 is close to the float product: each operand within half an e4m3 step
    exact = x.double() @ w.double().T
    assert ((y.double() - exact).abs() <= 0.1 * exact.abs().max()).all()


def test_dispatch_is_the_twin_off_hopper(monkeypatch: pytest.MonkeyPatch):
    """Where _scaled_mm does not take the call (the CPU, either path of kernels.ops) ops.fp8_matmul is the twin
    plus the bias, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    x, w, bias = torch.randn(4, 64, generator=gen), torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen)
    q, s = quantize_fp8(w)
    assert not scaled_mm_supported(x, q)
    for path in ("kernels", "twins"):
        force_path(monkeypatch, path)
        assert torch.equal(ops.fp8_matmul(x, q, s, bias), ref.fp8_matmul(x, q, s) + bias)
        assert torch.equal(ops.fp8_matmul(x, q, s), ref.fp8_matmul(x, q, s))


# ---- the module ---------------------------------------------------------------------------------------------------


def test_fp8_linear_module():
    """make_linear(w, "fp8") holds one byte a weight and a float32 scale per row; rows / dequantize are the
    codes times the scales; forward is ops.fp8_matmul; fusing concatenates codes and scales exactly."""
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(6, 64, generator=gen), torch.randn(10, 64, generator=gen)
    la, lb = make_linear(a, "fp8"), make_linear(b, "fp8")
    assert isinstance(la, Fp8Linear) and la.out_features == 6
    assert resident_bytes(la) == 6 * 64 + 6 * 4
    q, s = quantize_fp8(a)
    assert torch.equal(la.dequantize(torch.float32), q.float() * s[:, None])
    assert torch.equal(la.rows(torch.tensor([5, 0]), torch.float32), la.dequantize(torch.float32)[[5, 0]])
    x = torch.randn(3, 64, generator=gen)
    assert torch.equal(la(x), ref.fp8_matmul(x, q, s))
    fused = cat_linears([la, lb], torch.float32)
    assert type(fused) is Fp8Linear and fused.out_features == 16
    assert torch.equal(fused.qweight.float(), torch.cat([la.qweight, lb.qweight]).float())
    assert torch.equal(fused(x), torch.cat([la(x), lb(x)], dim=1))


def test_fp8_quantizes_the_decoder_linears_only():
    """Under fp8 the embedding and output head keep the checkpoint's format (vLLM's choice); under int4 they are
    int8 (a head in 4-bit groups costs the embedded model 16% of its top-1 agreement: bench-quality); other modes
    apply to every tensor."""
    assert tensor_mode("fp8", "layers.3.q") == "fp8" and tensor_mode("fp8", "layers.0.down") == "fp8"
    assert tensor_mode("fp8", "embed") == "auto" and tensor_mode("fp8", "lm_head") == "auto"
    assert tensor_mode("int4", "layers.0.q") == "int4" and tensor_mode("int4", "embed") == "int8"
    assert tensor_mode("int4", "lm_head") == "int8" and tensor_mode("int8", "embed") == "int8"
    assert tensor_mode("none", "lm_head") == "none"


def test_loaders_quantize_to_fp8():
    """HF (float) weights and GGUF blocks both become Fp8Linear under fp8, each the fp8 quantization of the
    float weight (a Q4_1 block: its dequantized values)."""
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    from_float = FloatWeight(lambda: w).linear("fp8", torch.float32, CPU)
    assert isinstance(from_float, Fp8Linear)
    assert torch.equal(from_float.dequantize(torch.float32), make_linear(w, "fp8").dequantize(torch.float32))
    block = np.array([0.5, -1.0], dtype="<f2").tobytes() + bytes(j | ((15 - j) << 4) for j in range(16))
    raw = np.frombuffer(block * 2, dtype=np.uint8).reshape(1, 40)
    gguf = GGUFBlocksWeight("Q4_1", raw)
    module = gguf.linear("fp8", torch.float32, CPU)
    assert isinstance(module, Fp8Linear)
    dense = gguf.dense(torch.float32, CPU)
    assert torch.equal(module.dequantize(torch.float32), make_linear(dense, "fp8").dequantize(torch.float32))


# ---- the engine -----------------------------------------------------------------------------------------------

# Greedy agreement with fp32 on the 5 chat prompts x 24 tokens (the share before each prompt's first divergence), as
# tests/engine/test_engine.py measures the weight-only modes. W8A8 also rounds every activation entering a linear to 3
# mantissa bits, so fp8 agrees less than int8. Measured (x86 CPU, torch 2.13, the twin's numbers; the GGUF's Q4_1
# linears requantized to fp8, its Q8_0 embedding and tied head kept): 55/120 = 0.46, divergences at fp32's ranks
# 1-2, at most 1.22 nats behind (with the embedding and head in fp8 too: 26/120) -> bounds with margin below; a
# wrong scale or layout agrees on ~0 tokens.
FP8_BOUNDS = (0.3, 4, 2.0)  # (min agreement, max fp32 rank of the diverging token, max nats behind fp32's token)


@pytest.mark.slow
def test_fp8_engine_agrees_with_fp32(engine_fp32):
    from lora_server.config import EngineConfig
    from lora_server.engine import Engine
    from lora_server.sampling_params import SamplingParams
    from tests.conftest import CHAT_PROMPTS

    prompts = [engine_fp32.chat_prompt([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:5]]
    ref_out = engine_fp32.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5))
    engine = Engine(EngineConfig(quantization="fp8", kv_cache_bytes=64 << 20, show_progress=False))
    model = engine.model
    assert isinstance(model.layers[0].mlp.down_proj.base, Fp8Linear) and not isinstance(model.embed, Fp8Linear)
    outs = [
        c.token_ids for c in engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    ]
    min_agree, max_rank, max_behind = FP8_BOUNDS
    same = 0
    for out, r in zip(outs, ref_out, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(out, r.token_ids, strict=True)) if a != b), None)
        same += len(out) if first is None else first
        if first is not None:
            top = [t for t, _ in r.logprobs[first].top]
            assert out[first] in top[: max_rank + 1], (first, top)
            assert r.logprobs[first].logprob - dict(r.logprobs[first].top)[out[first]] <= max_behind
    agreement = same / sum(len(r.token_ids) for r in ref_out)
    assert agreement >= min_agree, agreement


# ---- the GPU tier ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_scaled_mm_matches_twin(dtype: torch.dtype):
    """On capability 8.9-9.x: the quantization kernel + torch._scaled_mm against the twin at Llama-3-8B's shapes
    (the kernel rounds the product to bfloat16 once more than the twin)."""
    from lora_server.kernels.fp8_matmul import fp8_matmul

    gen = torch.Generator().manual_seed(6)
    for n, k in ((6144, 4096), (4096, 14336)):
        q, s = quantize_fp8(torch.randn(n, k, generator=gen) * k**-0.5)
        q, s = q.to(DEVICE), s.to(DEVICE)
        for m in (1, 16, 100, 1024):
            x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
            if not scaled_mm_supported(x, q):
                pytest.skip("torch._scaled_mm's row-wise scaling needs compute capability 8.9-9.x")
            torch.testing.assert_close(fp8_matmul(x, q, s), ref.fp8_matmul(x, q, s), atol=2e-2, rtol=2e-2)
