"""Our loader + model against HF transformers with the same fp32 weights: greedy tokens equal token for token,
and log-probabilities close at every step (|ours - HF| <= 2e-3 on the sampled token and the top 5)."""

from __future__ import annotations

import json

import pytest
import torch

from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.sampling_params import SamplingParams
from tests.conftest import CHAT_PROMPTS

LOGPROB_TOL = 2e-3
NEW_TOKENS = 20


def _hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy decoding with HF's forward (EOS not special, like ignore_eos)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            ids.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([ids[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return ids[len(prompt_ids) :]


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [len, vocab]


def _compare(engine: Engine, hf_model, prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    ours = engine.generate(prompts, params)  # all prompts in one continuous batch
    for prompt, completion in zip(prompts, ours, strict=True):
        assert completion.token_ids == _hf_greedy(hf_model, prompt, NEW_TOKENS)
        ref = _hf_logprobs(hf_model, prompt + completion.token_ids)
        for step, lp in enumerate(completion.logprobs):
            row = ref[len(prompt) - 1 + step]
            assert abs(lp.logprob - row[lp.token_id].item()) <= LOGPROB_TOL
            for token, value in lp.top:
                assert abs(value - row[token].item()) <= LOGPROB_TOL
            assert [t for t, _ in lp.top] == row.topk(5).indices.tolist() or _near_tie(row)


def _near_tie(row: torch.Tensor) -> bool:
    top = row.topk(6).values
    return bool((top[:-1] - top[1:]).min() < LOGPROB_TOL)


@pytest.mark.slow
def test_smollm2_matches_hf_on_chat_prompts(engine_fp32, hf_smollm2):
    prompts = [engine_fp32.chat_prompt([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    assert len(prompts) >= 8
    _compare(engine_fp32, hf_smollm2, prompts)


@pytest.mark.slow
def test_native_gguf_blocks_give_hf_logits(hf_smollm2):
    """quantization=auto keeps the file's Q4_1/Q8_0 blocks (int4/int8 resident); they are the same numbers HF
    dequantizes, so the logits agree too (activations in fp32 except the CPU int4 kernel's bf16 inputs)."""
    engine = Engine(EngineConfig(quantization="auto", kv_cache_bytes=64 << 20, show_progress=False))
    prompt = engine.chat_prompt([{"role": "user", "content": CHAT_PROMPTS[0]}])
    [c] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1))
    ref = _hf_logprobs(hf_smollm2, prompt + c.token_ids)
    diffs = [abs(lp.logprob - ref[len(prompt) - 1 + i, lp.token_id].item()) for i, lp in enumerate(c.logprobs)]
    assert max(diffs) < 0.15, diffs  # bf16 activation rounding in the int4 matmul
    assert c.token_ids == _hf_greedy(hf_smollm2, prompt, 8)


TINY_CONFIGS = {
    "llama3-gqa": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        num_key_value_heads=2,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        tie_word_embeddings=False,
    ),
    "llama-tied-mha": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], num_key_value_heads=4, tie_word_embeddings=True
    ),
    "mistral": dict(
        model_type="mistral",
        architectures=["MistralForCausalLM"],
        num_key_value_heads=1,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "qwen2-bias": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], num_key_value_heads=2, tie_word_embeddings=False
    ),
}


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_tiny_random_models_match_hf(tmp_path, name):
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = dict(TINY_CONFIGS[name])
    cfg = AutoConfig.for_model(
        extra.pop("model_type"),
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if name == "qwen2-bias":
        for layer in hf.model.layers:  # HF initialises biases to zero; make them matter
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")  # several shards
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert json.loads((tmp_path / "config.json").read_text())["architectures"][0] == extra["architectures"][0]
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=4, num_kv_blocks=256, show_progress=False))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 5, 17, 40)]
    _compare(engine, hf, prompts)
