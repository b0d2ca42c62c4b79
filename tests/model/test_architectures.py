"""The families beyond Llama against HF transformers (eager attention) with the same fp32 weights: small random
checkpoints of each family's config shape (Qwen3, Gemma 2, Gemma 3, Phi-3 and a Phi-4-mini-like one with partial
rotary and LongRoPE, Mistral with a real sliding window), built offline by transformers. Greedy tokens equal token
for token and log-probabilities within 2e-3, over contexts longer than the sliding windows; then in one mixed batch
with PEFT adapters (every projection PEFT targets, Phi-3's fused qkv_proj and gate_up_proj included) against HF +
PEFT with only each request's adapter active."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch

from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.sampling_params import SamplingParams
from tests.model.test_model_vs_hf import LOGPROB_TOL, _compare, _near_tie

WINDOW = 8  # sliding windows of the tiny models: every test context passes it

FAMILIES = {
    "qwen2-bias": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], num_key_value_heads=2, head_dim=16),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], num_key_value_heads=2, head_dim=24),
    "qwen3-sliding": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,  # layer 0 full, layers 1 and 2 windowed
    ),
    "gemma2": dict(
        model_type="gemma2",
        architectures=["Gemma2ForCausalLM"],
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0,  # small caps, so that the capping changes the scores
        final_logit_softcapping=3.0,
    ),
    "gemma3": dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    ),
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], num_key_value_heads=2, sliding_window=WINDOW),
    "phi4-mini": dict(  # Phi-4-mini's shape: partial rotary (0.75), LongRoPE, tied embeddings, GQA
        model_type="phi3",
        architectures=["Phi3ForCausalLM"],
        num_key_value_heads=2,
        partial_rotary_factor=0.75,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.7, 2.5, 4.0],
            "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
        },
        original_max_position_embeddings=128,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
    "mistral-sliding": dict(
        model_type="mistral", architectures=["MistralForCausalLM"], num_key_value_heads=2, sliding_window=WINDOW
    ),
}


def _build(tmp_path, name: str):
    """An HF model of the family's shape with random weights (norm weights and biases random too, so that every
    part matters), saved to tmp_path; the model in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = dict(FAMILIES[name])
    shape = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    shape.setdefault("max_position_embeddings", 512)
    shape.update(extra)
    cfg = AutoConfig.for_model(shape.pop("model_type"), **shape)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname:  # Gemma's zeros (1 + w) and Llama's ones: random around them instead
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == extra["architectures"]
    return hf


def _prompts(lengths=(1, 5, 17, 40)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_matches_hf(tmp_path, name):
    hf = _build(tmp_path, name)
    engine = Engine(EngineConfig(model=str(tmp_path), block_size=4, num_kv_blocks=256, show_progress=False))
    arch = engine.describe().arch
    if "sliding" in name or name in ("gemma2", "gemma3", "phi3"):
        assert any(arch.layer_windows), arch  # windows, not a context cap
        assert arch.max_position_embeddings > WINDOW
    if name == "phi4-mini":  # LongRoPE: the context ends where the short factors do
        assert arch.max_position_embeddings == 128 and arch.rotary_dim == 12
    _compare(engine, hf, _prompts())


# ---- LoRA on top: PEFT adapters in one mixed batch ---------------------------------------------------------

ADAPTER_TARGETS = {
    "qwen3": [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], ["k_proj", "down_proj"]],
    "gemma2": [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], ["v_proj", "up_proj"]],
    "gemma3": [["q_proj", "v_proj", "o_proj", "down_proj"], ["k_proj", "gate_proj", "up_proj"]],
    "phi3": [["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], ["qkv_proj", "down_proj"]],
}


def _peft_log_softmax(model, adapter: str | None, ids: list[int]) -> torch.Tensor:
    with torch.no_grad(), model.disable_adapter() if adapter is None else contextlib.nullcontext():
        if adapter is not None:
            model.set_adapter(adapter)
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def _peft_greedy(model, adapter: str | None, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(_peft_log_softmax(model, adapter, ids)[-1].argmax()))
    return ids[len(prompt) :]


def assert_mixed_batch_matches_peft(engine: Engine, model) -> None:
    """Adapters a0 and a1 (registered in ``engine``, loaded in the PeftModel ``model``) and the base in one batch of
    six prompts: each request's logprobs within LOGPROB_TOL of HF + PEFT with only its adapter active, its greedy
    tokens PEFT's but for near ties; each adapter moves the model (else the check proves nothing)."""
    plan = [None, "a0", "a1", "a0", None, "a1"]
    prompts = _prompts((3, 12, 20, 1, 9, 15))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    outs = engine.generate(prompts, params, adapters=plan)
    for prompt, adapter, out in zip(prompts, plan, outs, strict=True):
        ref = _peft_log_softmax(model, adapter, prompt + out.token_ids)
        if adapter is not None:  # the adapter moves the model, so the comparison proves something
            base = _peft_log_softmax(model, None, prompt + out.token_ids)
            assert (ref - base).abs().max() > 0.05, adapter
        for step, lp in enumerate(out.logprobs):
            row = ref[len(prompt) - 1 + step]
            assert abs(lp.logprob - row[lp.token_id].item()) <= LOGPROB_TOL, (adapter, step)
            assert lp.token_id == int(row.argmax()) or _near_tie(row), (adapter, step)
        assert out.token_ids == _peft_greedy(model, adapter, prompt, 10) or any(
            _near_tie(r) for r in ref[len(prompt) - 1 :]
        ), adapter


def family_with_adapters(tmp_path, name: str):
    """The family's tiny model in tmp_path/base and two PEFT adapters of ranks 8 and 4 on ADAPTER_TARGETS' modules
    in tmp_path/a0, a1; returns HF + PEFT's model holding both."""
    from peft import LoraConfig, PeftModel, get_peft_model

    hf = _build(tmp_path / "base", name)
    for i, targets in enumerate(ADAPTER_TARGETS[name]):
        torch.manual_seed(100 + i)
        rank = (8, 4)[i]
        peft = get_peft_model(
            hf, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        )
        with torch.no_grad():
            for pname, p in peft.named_parameters():
                if "lora_B" in pname:
                    p.mul_(0.5)
        peft.save_pretrained(tmp_path / f"a{i}")
        hf = peft.unload()  # the base back, without the LoRA layers
    model = PeftModel.from_pretrained(hf, tmp_path / "a0", adapter_name="a0")
    model.load_adapter(tmp_path / "a1", adapter_name="a1")
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ADAPTER_TARGETS))
def test_family_mixed_adapters_match_peft(tmp_path, name):
    model = family_with_adapters(tmp_path, name)
    engine = Engine(
        EngineConfig(
            model=str(tmp_path / "base"), block_size=16, num_kv_blocks=128, max_lora_rank=8, show_progress=False
        )
    )
    for adapter in ("a0", "a1"):
        engine.adapters.add(adapter, tmp_path / adapter)
    assert_mixed_batch_matches_peft(engine, model)


# ---- GGUF files of these families --------------------------------------------------------------------------

GGUF_NAMES = {  # HF tensor name pieces -> llama.cpp's (its converter: no Q/K row permutation outside llama)
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _write_gguf(hf, path, arch: str) -> None:
    """hf's float32 weights as llama.cpp names them in a GGUF of ``arch`` (qwen2, qwen3), with a made-up
    tokenizer (prompts here are token ids)."""
    import gguf

    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(["<|end|>", "a", "b", "ab", *(f"w{i}" for i in range(4, cfg.vocab_size))])
    writer.add_token_types([3] + [1] * (cfg.vocab_size - 1))
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(0)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    for name, tensor in hf.state_dict().items():
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{GGUF_LAYER[rest]}"
        else:
            gguf_name = GGUF_NAMES[name]
        writer.add_tensor(gguf_name, tensor.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("name", "arch"), [("qwen2-bias", "qwen2"), ("qwen3", "qwen3")])
def test_gguf_qwen_files_match_hf(tmp_path, name, arch):
    """qwen2 (q/k/v biases) and qwen3 (per-head q/k norms, head_dim from attention.key_length) GGUF files: rows in
    HF's order (llama.cpp permutes Q/K for llama files only), the same tokens and log-probabilities as HF."""
    hf = _build(tmp_path / "hf", name)
    if arch == "qwen2":
        with torch.no_grad():  # HF initialises biases to zero; make them matter
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(std=0.5)
    _write_gguf(hf, tmp_path / "model.gguf", arch)
    engine = Engine(
        EngineConfig(model=str(tmp_path / "model.gguf"), block_size=4, num_kv_blocks=256, show_progress=False)
    )
    assert engine.describe().arch.architecture == FAMILIES[name]["architectures"][0]
    _compare(engine, hf, _prompts())
