"""GPU tier: the engine on CUDA (Triton attention, KV writes, quantized matmuls, LoRA kernels) against HF
transformers (+ PEFT) on the same weights. Skipped where torch sees no CUDA GPU."""

from __future__ import annotations

import pytest
import torch

from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.sampling_params import SamplingParams
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("quantization", ["none", "auto", "int8"])
def test_cuda_engine_matches_cpu_engine(engine_fp32, quantization):
    """fp32 on both devices: tokens equal, logprobs within 1e-2 (TF32 and kernel summation order differ)."""
    cuda = Engine(EngineConfig(device="cuda", dtype="float32", quantization=quantization, show_progress=False))
    cpu = engine_fp32 if quantization == "none" else Engine(EngineConfig(quantization=quantization,
                                                                           show_progress=False))
    prompts = [cpu.chat_prompt([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    for a, b in zip(cuda.generate(prompts, params), cpu.generate(prompts, params), strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-2


def test_cuda_bf16_agrees_with_fp32(engine_fp32):
    cuda = Engine(EngineConfig(device="cuda", dtype="bfloat16", quantization="none", show_progress=False))
    prompts = [engine_fp32.chat_prompt([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ours = [c.token_ids for c in cuda.generate(prompts, params)]
    ref = [c.token_ids for c in engine_fp32.generate(prompts, params)]
    first_tokens_equal = sum(a[0] == b[0] for a, b in zip(ours, ref, strict=True))
    assert first_tokens_equal >= len(prompts) - 1
    assert torch.cuda.is_available()


def test_cuda_swaps_keep_kv_exact(hf_smollm2):
    """Multi-turn chats on a device budget so small that a filler request between turns pushes the cached KV to
    the pinned host tier (copies on the side stream); each turn's greedy tokens still equal HF's on the whole
    conversation."""
    from tests.test_model_vs_hf import _hf_greedy

    cuda = Engine(EngineConfig(device="cuda", dtype="float32", quantization="none", num_kv_blocks=48,
                               show_progress=False))
    chats: list[list[dict[str, str]]] = [[], []]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for turn in range(3):
        for i, chat in enumerate(chats):
            chat.append({"role": "user", "content": CHAT_PROMPTS[turn * 2 + i]})
        prompts = [cuda.chat_prompt(chat) for chat in chats]
        for prompt, out, chat in zip(prompts, cuda.generate(prompts, params), chats, strict=True):
            assert (out.num_cached_tokens > 0) == (turn > 0)
            assert out.token_ids == _hf_greedy(hf_smollm2, prompt, 12)
            chat.append({"role": "assistant", "content": out.text})
        cuda.generate([list(range(100, 100 + 40 * 16))], SamplingParams(max_tokens=1))  # the filler
        cuda.core.check_integrity()
    counters = cuda.core.pool.tree.counters
    assert counters["kv_swap_out"] > 0 and counters["kv_swap_in"] > 0
