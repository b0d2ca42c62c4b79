"""What the families beyond Llama add to the kernels, each against a float64 loop written here and the kernel
(in the Triton interpreter on the CPU) against its torch twin: sliding-window and soft-capped attention (prefill
chunks and split-KV decode, fp8 caches too), per-head RMSNorm and Gemma's float32-weight order, GELU-tanh-and-mul,
partial rotary embeddings. Tolerances: tests/kernel_env.py."""

from __future__ import annotations

import math

import pytest
import torch

from lora_server.kernels import reference as ref
from lora_server.kernels.decode_attention import paged_decode_attention
from lora_server.kernels.gathered_attention import gathered_decode_attention
from lora_server.kernels.paged_attention import paged_attention
from lora_server.kernels.rms_norm import fused_add_rms_norm, rms_norm, rms_norm_heads_
from lora_server.kernels.rotary_write_kv import rotary_write_kv
from lora_server.kernels.silu_and_mul import silu_and_mul
from tests.kernel_env import DEVICE, TOL_VS_EXACT, TOL_VS_TWIN

H, KVH, D, BLOCK = 4, 2, 16, 4
SCALE = 0.3


def _paged_batch(gen: torch.Generator, fp8: bool = False):
    """Three sequences of 37, 9, 20 keys in shuffled pages, with 5, 9 and 1 new queries."""
    k = torch.randn(64, BLOCK, KVH, D, generator=gen)
    v = torch.randn(64, BLOCK, KVH, D, generator=gen)
    scales = None
    if fp8:
        ks, vs = torch.full((KVH,), 0.01), torch.full((KVH,), 0.02)
        k, v = (k / ks[:, None]).to(ref.FP8_KV_DTYPE), (v / vs[:, None]).to(ref.FP8_KV_DTYPE)
        scales = (ks.to(DEVICE), vs.to(DEVICE))
    tables = torch.randperm(64, generator=gen)[:30].view(3, 10).int()
    seq_lens = torch.tensor([37, 9, 20], dtype=torch.int32)
    starts = torch.tensor([0, 5, 14, 15], dtype=torch.int32)
    q = torch.randn(15, H, D, generator=gen)
    tensors = [t.to(DEVICE) for t in (q, k, v, tables, seq_lens, starts)]
    return tensors, scales


def _exact(q, k, v, tables, seq_lens, starts, scales, window: int, softcap: float) -> torch.Tensor:
    """Float64, one query and head at a time: the definition."""
    k = ref.dequantize_kv(k.cpu(), None if scales is None else scales[0].cpu()).double()
    v = ref.dequantize_kv(v.cpu(), None if scales is None else scales[1].cpu()).double()
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(len(seq_lens)):
        length, first, end = int(seq_lens[b]), int(starts[b]), int(starts[b + 1])
        keys = k[tables[b].long().cpu()].flatten(0, 1)[:length]
        values = v[tables[b].long().cpu()].flatten(0, 1)[:length]
        for t in range(first, end):
            position = length - (end - t)
            for h in range(H):
                s = keys[:, h // (H // KVH)] @ q[t, h].cpu().double() * SCALE
                if softcap:
                    s = torch.tanh(s / softcap) * softcap
                key = torch.arange(length)
                visible = (key <= position) & ((key > position - window) if window else True)
                s[~visible] = -math.inf
                out[t, h] = torch.softmax(s, 0) @ values[:, h // (H // KVH)]
    return out.float()


CASES = [(0, 0.0), (6, 0.0), (0, 5.0), (5, 3.0), (64, 0.0)]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(("window", "softcap"), CASES)
def test_prefill_attention_window_and_softcap(window, softcap, fp8):
    (q, k, v, tables, seq_lens, starts), scales = _paged_batch(torch.Generator().manual_seed(window), fp8)
    ks, vs = scales if scales else (None, None)
    exact = _exact(q, k, v, tables, seq_lens, starts, scales, window, softcap)
    twin = ref.paged_attention(q, k, v, tables, seq_lens, starts, SCALE, ks, vs, window=window, softcap=softcap)
    torch.testing.assert_close(twin.cpu(), exact, **TOL_VS_EXACT[torch.float32])
    kernel = paged_attention(
        q, k, v, tables, seq_lens, starts, SCALE, 9, ks, vs, window=window, softcap=softcap, block_m=16, block_n=16
    )
    torch.testing.assert_close(kernel.cpu(), twin.cpu(), **TOL_VS_TWIN[torch.float32])


@pytest.mark.parametrize(("window", "softcap"), CASES)
def test_decode_attention_window_and_softcap(window, softcap):
    (_, k, v, tables, seq_lens, _), _ = _paged_batch(torch.Generator().manual_seed(7))
    q = torch.randn(3, H, D, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    starts = torch.arange(4, dtype=torch.int32, device=DEVICE)
    exact = _exact(q, k, v, tables, seq_lens, starts, None, window, softcap)
    twin = ref.paged_decode_attention(q, k, v, tables, seq_lens, SCALE, window=window, softcap=softcap)
    torch.testing.assert_close(twin.cpu(), exact, **TOL_VS_EXACT[torch.float32])
    gathered = gathered_decode_attention(q, k, v, tables, seq_lens, SCALE, window=window, softcap=softcap)
    torch.testing.assert_close(gathered.cpu(), exact, **TOL_VS_EXACT[torch.float32])
    for splits in (1, 3):  # one launch, and partials merged by the reduce kernel
        kernel = paged_decode_attention(
            q, k, v, tables, seq_lens, SCALE, window=window, softcap=softcap, num_splits=splits, block_n=16
        )
        torch.testing.assert_close(kernel.cpu(), twin.cpu(), **TOL_VS_TWIN[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_weight_order(dtype):
    """A float32 weight (Gemma's 1 + w) multiplies before the rounding: HF's Gemma2RMSNorm; a weight in x's dtype
    after it (LlamaRMSNorm). Alone, fused with the residual add, and per head in place."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 32, generator=gen).to(dtype)
    residual = torch.randn(6, 32, generator=gen).to(dtype)
    w = 1.0 + torch.randn(32, generator=gen) * 0.3  # float32

    def gemma(rows: torch.Tensor) -> torch.Tensor:  # HF's Gemma2RMSNorm.forward with weight w - 1
        normed = rows.float() * torch.rsqrt(rows.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed * w).to(dtype)

    torch.testing.assert_close(ref.rms_norm(x, w, 1e-6), gemma(x), atol=0, rtol=0)
    torch.testing.assert_close(rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6).cpu(), gemma(x), **TOL_VS_TWIN[dtype])
    for fused in (ref.fused_add_rms_norm, fused_add_rms_norm):
        out, res = x.clone().to(DEVICE), residual.clone().to(DEVICE)
        fused(out, res, w.to(DEVICE), 1e-6)
        torch.testing.assert_close(res.cpu(), (x.float() + residual.float()).to(dtype), **TOL_VS_TWIN[dtype])
        torch.testing.assert_close(out.cpu(), gemma(res.cpu()), **TOL_VS_TWIN[dtype])
    heads = torch.randn(5, 3 + 2, 32, generator=gen).to(dtype)  # [T, q heads + k heads, D], normed in two views
    for norm in (ref.rms_norm_heads_, rms_norm_heads_):
        out = heads.clone().to(DEVICE)
        norm(out[:, :3], w.to(DEVICE), 1e-6)
        torch.testing.assert_close(out[:, :3].cpu(), gemma(heads[:, :3]), **TOL_VS_TWIN[dtype])
        assert torch.equal(out[:, 3:].cpu(), heads[:, 3:])  # the other heads untouched


def test_gelu_tanh_and_mul():
    x = torch.randn(5, 2 * 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    gate, up = x.chunk(2, -1)
    exact = (0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3))) * up).float()
    torch.testing.assert_close(ref.gelu_tanh_and_mul(x.float()), exact, **TOL_VS_EXACT[torch.float32])
    kernel = silu_and_mul(x.float().to(DEVICE), gelu_tanh=True)
    torch.testing.assert_close(kernel.cpu(), exact, **TOL_VS_EXACT[torch.float32])


def test_partial_rotary_matches_hf():
    """rotary_dim R < D: HF's Phi-3 rotates the first R dimensions with rotate_half over them, passes the rest."""
    gen = torch.Generator().manual_seed(0)
    tokens, rot = 3, 12
    qk = torch.randn(tokens, H + KVH, D, generator=gen)
    v = torch.randn(tokens, KVH, D, generator=gen)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    angles = torch.outer(torch.arange(tokens).float(), inv)
    cos = torch.cat([angles.cos(), angles.cos(), torch.ones(tokens, D - rot)], -1)[:, None]
    sin_signed = torch.cat([-angles.sin(), angles.sin(), torch.zeros(tokens, D - rot)], -1)[:, None]
    part = qk[..., :rot]
    halves = torch.cat([-part[..., rot // 2 :], part[..., : rot // 2]], -1)  # HF's rotate_half
    c, s = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    expected = torch.cat([part * c + halves * s, qk[..., rot:]], -1)
    slots = torch.arange(tokens)
    for rotate in (ref.rotary_write_kv, rotary_write_kv):
        out, k_cache, v_cache = qk.clone().to(DEVICE), torch.zeros(2, 4, KVH, D), torch.zeros(2, 4, KVH, D)
        k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
        rotate(
            out,
            v.to(DEVICE),
            cos.to(DEVICE),
            sin_signed.to(DEVICE),
            k_cache,
            v_cache,
            slots.to(DEVICE),
            None,
            None,
            rot,
        )
        torch.testing.assert_close(out.cpu(), expected, **TOL_VS_EXACT[torch.float32])
        torch.testing.assert_close(
            k_cache.view(-1, KVH, D)[:tokens].cpu(), expected[:, H:], **TOL_VS_EXACT[torch.float32]
        )
