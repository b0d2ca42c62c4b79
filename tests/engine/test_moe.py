"""Mixture-of-experts bases (Qwen3-MoE, Mixtral) and LoRA on their experts, against HF transformers + PEFT at fp32.

Tiny random models of both families in HF's layout (transformers 5 builds them; its save_pretrained writes each
expert's linears, the hub's layout), served in fp32 on the CPU: greedy tokens and their log-probabilities follow HF's
(tests.engine.test_gpu_engine._follows: the engine's tokens teacher-forced through the reference). Adapters of both
layouts PEFT trains: fused expert parameters (target_parameters, transformers 5; the router's too) saved by PEFT
itself, against PEFT, and per-expert modules with the router's (transformers 4.x's layout: experts.N.gate_proj /
w1 ..., gate) written here, against HF with the adapter merged into its weights (see _merged); each alone and all
in one batch with the base and a dense-only adapter; GGUF files, tensor parallelism, speculative decoding and the
prefix cache on them. What the server does not reproduce (a router LoRA the config does not target, another
target parameter, a missing expert, DoRA) is refused, naming it."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from lora_server.adapters.errors import AdapterError
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.model.quant import DenseLinear, Int4CpuLinear, Int8Linear
from lora_server.sampling_params import SamplingParams
from tests.conftest import peft_log_softmax, runner_of
from tests.engine.test_gpu_engine import _follows
from tests.engine.test_synthetic_checkpoints import _int4_round_trip, _int8_round_trip
from tests.model.test_model_vs_hf import LOGPROB_TOL, _hf_logprobs

# fp32 against fp32: log-probabilities within 1e-4, a greedy token at most 2e-4 behind the best (an exact tie
# aside, the same token); the quantized modes keep LOGPROB_TOL: their numbers round
FP32_TOL = 1e-4

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    num_experts_per_tok=2,
)
FAMILIES = {  # HF's config and model classes, what the family adds; Qwen3-MoE's layer 1 keeps a dense MLP
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(head_dim=16, moe_intermediate_size=32, num_experts=8, norm_topk_prob=True, mlp_only_layers=[1]),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
}
# the per-expert layout's module names and container (transformers 4.x): gate, up, down
PER_EXPERT = {
    "qwen3_moe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.experts", ("w1", "w3", "w2")),
}
NEW_TOKENS = 10


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    import transformers

    config_name, model_name, extra = FAMILIES[request.param]
    config = getattr(transformers, config_name)(**COMMON, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # weights large enough that routing and logits are far from uniform
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    path = tmp_path_factory.mktemp(f"moe-{request.param}")
    model.save_pretrained(path, safe_serialization=True)
    return request.param, path, model


def _per_expert_adapter(family: str, model: torch.nn.Module, path: Path, rank: int = 4, alpha: int = 8) -> None:
    """A per-expert adapter as PEFT on transformers 4.x saved them: every expert's gate, up and down its own
    module, the router (then an nn.Linear, ``gate``) and q_proj, random A and B."""
    container, names = PER_EXPERT[family]
    config = model.config
    hidden, experts = config.hidden_size, getattr(config, "num_experts", None) or config.num_local_experts
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    dense = set(getattr(config, "mlp_only_layers", []) or [])
    gen = torch.Generator().manual_seed(11)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        q = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[q + ".lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.3
        tensors[q + ".lora_B.weight"] = torch.randn(hidden, rank, generator=gen) * 0.3
        if layer in dense:  # a dense layer's MLP modules of those names
            shapes = [(hidden, config.intermediate_size)] * 2 + [(config.intermediate_size, hidden)]
            modules = {f"mlp.{name}": shape for name, shape in zip(names, shapes, strict=True)}
        else:
            shapes = [(hidden, width), (hidden, width), (width, hidden)]
            modules = {f"{container}.{e}.{n}": sh for e in range(experts) for n, sh in zip(names, shapes, strict=True)}
            modules[container.rsplit(".", 1)[0] + ".gate"] = (hidden, experts)  # the router
        for module, (in_f, out_f) in modules.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[key + ".lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.3
            tensors[key + ".lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.3
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    cfg = dict(
        peft_type="LORA", r=rank, lora_alpha=alpha, target_modules=["q_proj", "gate", *names], task_type="CAUSAL_LM"
    )
    (path / "adapter_config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def adapters(moe, tmp_path_factory) -> tuple[Path, dict[str, torch.nn.Module]]:
    """Four adapters and a reference model of each: fused expert parameters (PEFT-saved, with o_proj; once more
    with the router's, rank and alpha patterns and layers_to_transform), per-expert modules and the router's
    (written here), dense-only (q_proj, v_proj)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    family, _, model = moe
    root = tmp_path_factory.mktemp("moe-adapters")
    configs = {
        "fused": dict(
            r=4,
            lora_alpha=8,
            target_modules=["o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
        "dense": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        # rank and alpha patterns on the parameters' paths; layers_to_transform, which PEFT applies to
        # target_modules (o_proj of layer 0 only) and not to target_parameters (every sparse layer's experts)
        "fused_ranks": dict(
            r=4,
            lora_alpha=8,
            target_modules=["o_proj"],
            layers_to_transform=[0],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"],
            rank_pattern={"gate_up_proj": 8},
            alpha_pattern={"down_proj": 2},
        ),
    }
    for i, (name, cfg) in enumerate(configs.items()):
        torch.manual_seed(100 + i)
        peft = get_peft_model(copy.deepcopy(model), LoraConfig(init_lora_weights=False, **cfg))
        with torch.no_grad():
            for pname, p in peft.named_parameters():
                if "lora_B" in pname:
                    p.mul_(0.5)
        peft.save_pretrained(root / name)
    _per_expert_adapter(family, model, root / "per_expert")
    references = {
        name: PeftModel.from_pretrained(copy.deepcopy(model), root / name, adapter_name=name).eval() for name in configs
    }
    references["per_expert"] = _merged(model, root / "per_expert")
    return root, references


def _merged(model: torch.nn.Module, adapter: Path, scaling: float = 2.0) -> torch.nn.Module:
    """HF's model with a per-expert adapter's W + scaling * B A written into its weights: the per-expert layout's
    reference. (PEFT 0.21 converts such an adapter on loading, and matches this for Mixtral; for a Qwen3-MoE with a
    dense layer, mlp_only_layers, its converted model computes something else: first tokens 4.5 nats apart.)"""
    from safetensors.torch import load_file

    merged = copy.deepcopy(model)
    width = getattr(model.config, "moe_intermediate_size", None) or model.config.intermediate_size
    tensors = load_file(adapter / "adapter_model.safetensors")
    with torch.no_grad():
        for key in [k for k in tensors if k.endswith("lora_A.weight")]:
            delta = scaling * tensors[key.replace("lora_A", "lora_B")] @ tensors[key]
            path = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            path = path.replace("block_sparse_moe", "mlp").split(".")  # Mixtral's 4.x name, transformers 5's
            if "experts" not in path:
                merged.get_submodule(".".join(path)).weight += delta
                continue
            expert, name = int(path[path.index("experts") + 1]), path[-1]
            experts = merged.model.layers[int(path[2])].mlp.experts
            if name in ("gate_proj", "w1"):
                experts.gate_up_proj[expert, :width] += delta
            elif name in ("up_proj", "w3"):
                experts.gate_up_proj[expert, width:] += delta
            else:
                experts.down_proj[expert] += delta
    return _AsPeft(merged.eval())


class _AsPeft(torch.nn.Module):
    """A merged HF model read as peft_log_softmax reads a PEFT model (the adapter always on)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def set_adapter(self, name: str) -> None:
        pass

    def forward(self, input_ids: torch.Tensor):
        return self.model(input_ids=input_ids)


def _engine(path: Path, **kw) -> Engine:
    config = dict(quantization="none", kv_cache_bytes=16 << 20, block_size=64, show_progress=False, max_lora_rank=8)
    return Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", **{**config, **kw}))


def _prompts(n: int, lengths=(9, 23, 40, 5, 17)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [
        torch.randint(3, COMMON["vocab_size"], (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(n)
    ]


PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)


def test_the_base_follows_hf(moe):
    _, path, model = moe
    engine = _engine(path)
    prompts = _prompts(5)
    for prompt, out in zip(prompts, engine.generate(prompts, PARAMS), strict=True):  # one batch
        _follows(out, prompt, functools.partial(_hf_logprobs, model), FP32_TOL, 2 * FP32_TOL)
    engine.check_integrity()


def _hf_holding(model: torch.nn.Module, quantization: str) -> torch.nn.Module:
    """HF's model holding what the engine holds in ``quantization`` (test_synthetic_checkpoints' twins): every
    expert's matrices and the attention's quantized, int8 per output row or int4 in groups of 32 inputs; the router
    never (model.moe); the embedding and head int8 (quant.tensor_mode)."""
    held = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in held.named_parameters():
            if p.dim() < 2 or name.endswith("mlp.gate.weight"):
                continue
            vocab = "embed_tokens" in name or "lm_head" in name
            twin = _int4_round_trip if quantization == "int4" and not vocab else _int8_round_trip
            p.copy_(torch.stack([twin(m) for m in p]) if p.dim() == 3 else twin(p))
    return held.eval()


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_experts_follow_hf_holding_their_weights(moe, quantization, monkeypatch):
    """The experts held in int8 or int4 like the dense linears, the router as it is. int4 runs on its torch path
    (Int4Linear, float32 arithmetic; what a CPU without torch's int4 op runs): the CPU kernel's bfloat16
    arithmetic (quant.Int4CpuLinear) is checked by the dense models' tests, and on these sharper logits it moves
    log-probabilities by up to ~0.2."""
    _, path, model = moe
    if quantization == "int4":
        monkeypatch.setattr(Int4CpuLinear, "available", staticmethod(lambda: False))
    engine = _engine(path, quantization=quantization)
    assert not any(isinstance(m, Int4CpuLinear) for m in runner_of(engine).model.modules())
    reference = functools.partial(_hf_logprobs, _hf_holding(model, quantization))
    tol = LOGPROB_TOL
    prompts = _prompts(3)
    for prompt, out in zip(prompts, engine.generate(prompts, PARAMS), strict=True):
        _follows(out, prompt, reference, tol, 2 * tol)


def test_each_adapter_and_a_mixed_batch_follow_peft(moe, adapters):
    _, path, _ = moe
    root, references = adapters
    engine = _engine(path, max_loras=4)
    for name in references:
        engine.adapters.add(name, root / name)
    plan = [None, "fused", "per_expert", "dense", "fused", None, "per_expert", "fused_ranks"]
    prompts = _prompts(len(plan))
    for prompt, adapter, out in zip(prompts, plan, engine.generate(prompts, PARAMS, adapters=plan), strict=True):
        reference = references[adapter or "fused"]
        _follows(out, prompt, functools.partial(peft_log_softmax, reference, adapter), FP32_TOL, 2 * FP32_TOL)
    for adapter in references:  # alone, one request each
        prompt = _prompts(1, (13,))[0]
        out = engine.generate([prompt], PARAMS, adapters=[adapter])[0]
        _follows(out, prompt, functools.partial(peft_log_softmax, references[adapter], adapter), FP32_TOL, 2 * FP32_TOL)
    engine.check_integrity()


def _copy_adapter(src: Path, dst: Path, config=None, drop: str | None = None, add: dict | None = None) -> Path:
    from safetensors.torch import load_file

    dst.mkdir(parents=True, exist_ok=True)
    tensors = {k: v for k, v in load_file(src / "adapter_model.safetensors").items() if drop is None or drop not in k}
    tensors.update(add or {})
    save_file(tensors, dst / "adapter_model.safetensors")
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    return dst


def test_what_the_server_does_not_reproduce_is_refused_by_name(moe, adapters, tmp_path):
    family, path, model = moe
    root, _ = adapters
    engine = _engine(path)
    container = PER_EXPERT[family][0].rsplit(".", 1)[0]
    hidden, experts = model.config.hidden_size, model.config.num_local_experts
    router = f"base_model.model.model.layers.0.{container}.gate"
    cases = {
        "router": (  # LoRA on the router where the config does not target it
            _copy_adapter(
                root / "fused",
                tmp_path / "router",
                add={
                    router + ".lora_A.weight": torch.zeros(4, hidden),
                    router + ".lora_B.weight": torch.zeros(experts, 4),
                },
            ),
            "router",
        ),
        "parameter": (  # a target parameter other than the experts' two
            _copy_adapter(root / "fused", tmp_path / "parameter", {"target_parameters": ["self_attn.q_proj.weight"]}),
            "q_proj.weight",
        ),
        "missing": (  # one expert's weights left out
            _copy_adapter(root / "per_expert", tmp_path / "missing", drop=f".{PER_EXPERT[family][0]}.1."),
            "expert 1",
        ),
        "dora": (
            _copy_adapter(root / "per_expert", tmp_path / "dora", {"use_dora": True}),
            "DoRA",
        ),
    }
    for name, (adapter, words) in cases.items():
        with pytest.raises(AdapterError, match=words):
            engine.adapters.add(name, adapter)
    assert engine.adapters.names() == []  # nothing registered by a refusal
    engine.adapters.add("fused", root / "fused")  # and the engine still takes a good one
    assert engine.adapters.names() == ["fused"]


def test_speculative_decoding_and_the_prefix_cache_keep_an_adapters_tokens(moe, adapters):
    """Prompt-lookup drafts verified through the experts, and a second turn from each adapter's cached prefix,
    give the tokens the plain engine gives (greedy), for the base and adapters of both layouts."""
    _, path, _ = moe
    root, _ = adapters
    plan = [None, "fused", "per_expert", "fused_ranks"]
    gen = torch.Generator().manual_seed(3)
    # prompts that repeat themselves: the n-gram drafter finds drafts in them
    prompts = [torch.randint(3, 40, (6,), generator=gen).tolist() * 12 for _ in plan]  # a 64-token block and more
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outputs = {}
    for speculative in (0, 3):
        engine = _engine(path, max_loras=4, speculative_ngram=speculative)
        for name in plan[1:]:
            engine.adapters.add(name, root / name)
        first = engine.generate(prompts, params, adapters=plan)
        again = engine.generate(prompts, params, adapters=plan)  # the same prompts: each adapter's cached prefix
        assert all(out.num_cached_tokens > 0 for out in again)
        assert [o.token_ids for o in again] == [o.token_ids for o in first]
        outputs[speculative] = [o.token_ids for o in first]
        if speculative:  # drafts were proposed, and some were taken
            assert engine.snapshot().spec_accepted_tokens > 0
        engine.check_integrity()
    assert outputs[3] == outputs[0]


# ---- GGUF: what llama.cpp's converter writes (convert_hf_to_gguf.py: LlamaModel for Mixtral, Qwen3MoeModel) ----


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """LlamaModel.permute: a llama file's Q and K rows, interleaved per head for llama.cpp's rotary."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_moe_gguf(family: str, model: torch.nn.Module, path: Path, experts_q8: bool = False) -> None:
    """The HF model as a float32 GGUF as the converter writes it: Mixtral as a llama file with expert_count (Q and
    K rows permuted), Qwen3-MoE as qwen3moe (expert_feed_forward_length); each layer's experts stacked per
    projection (ffn_gate_exps, ffn_up_exps [E, width, hidden], ffn_down_exps [E, hidden, width]), the router
    ffn_gate_inp. A made-up vocabulary: prompts here are token ids. ``experts_q8``: the experts stored as Q8_0
    blocks, and written back into ``model`` as they dequantize (its reference then holds the file's numbers)."""
    import gguf

    cfg = model.config
    arch = "llama" if family == "mixtral" else "qwen3moe"
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(["<pad>", "<bos>", "<eos>", "a", "b", "ab", *(f"w{i}" for i in range(6, cfg.vocab_size))])
    writer.add_token_types([3, 3, 3] + [1] * (cfg.vocab_size - 3))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_expert_feed_forward_length(width)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q, k = state[p + "self_attn.q_proj.weight"], state[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = _llama_permute(q, cfg.num_attention_heads), _llama_permute(k, cfg.num_key_value_heads)
        else:
            writer.add_tensor(b + "attn_q_norm.weight", state[p + "self_attn.q_norm.weight"])
            writer.add_tensor(b + "attn_k_norm.weight", state[p + "self_attn.k_norm.weight"])
        writer.add_tensor(b + "attn_q.weight", q)
        writer.add_tensor(b + "attn_k.weight", k)
        writer.add_tensor(b + "attn_v.weight", state[p + "self_attn.v_proj.weight"])
        writer.add_tensor(b + "attn_output.weight", state[p + "self_attn.o_proj.weight"])
        writer.add_tensor(b + "attn_norm.weight", state[p + "input_layernorm.weight"])
        writer.add_tensor(b + "ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        writer.add_tensor(b + "ffn_gate_inp.weight", state[p + "mlp.gate.weight"])
        gate_up = state[p + "mlp.experts.gate_up_proj"]  # [E, 2 * width, hidden]: gate rows, then up rows
        stacks = {
            "ffn_gate_exps": np.ascontiguousarray(gate_up[:, :width]),
            "ffn_up_exps": np.ascontiguousarray(gate_up[:, width:]),
            "ffn_down_exps": state[p + "mlp.experts.down_proj"],
        }
        for name, array in stacks.items():
            if not experts_q8:
                writer.add_tensor(f"{b}{name}.weight", array)
                continue
            kind = gguf.GGMLQuantizationType.Q8_0
            blocks = gguf.quants.quantize(array, kind)
            writer.add_tensor(f"{b}{name}.weight", blocks, raw_dtype=kind)
            stacks[name] = gguf.quants.dequantize(blocks, kind)
        experts_of = model.model.layers[i].mlp.experts
        with torch.no_grad():
            experts_of.gate_up_proj.copy_(
                torch.from_numpy(np.concatenate([stacks["ffn_gate_exps"], stacks["ffn_up_exps"]], 1))
            )
            experts_of.down_proj.copy_(torch.from_numpy(stacks["ffn_down_exps"]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("experts_q8", [False, True], ids=["f32", "q8_0-experts"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_gguf_file_llama_cpp_writes_follows_hf(family, experts_q8, tmp_path):
    """A mixture of experts from GGUF (every layer sparse, as llama.cpp's qwen3moe and Mixtral are): the same model
    as HF's (holding the Q8_0 experts' numbers where the file stores them so; the engine keeps the blocks), and an
    adapter of it (fused experts, PEFT-saved) against PEFT."""
    import transformers
    from peft import LoraConfig, PeftModel, get_peft_model

    config_name, model_name, extra = FAMILIES[family]
    extra = {k: v for k, v in extra.items() if k != "mlp_only_layers"}
    torch.manual_seed(1)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**COMMON, **extra)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    _write_moe_gguf(family, model, tmp_path / "model.gguf", experts_q8)
    engine = _engine(tmp_path / "model.gguf", max_loras=2, quantization="auto")
    held = runner_of(engine).model.sparse_mlps()[0].gate_up[0]
    assert isinstance(held, Int8Linear if experts_q8 else DenseLinear), type(held)  # Q8_0 blocks kept as they are
    prompts = _prompts(3)
    for prompt, out in zip(prompts, engine.generate(prompts, PARAMS), strict=True):
        _follows(out, prompt, functools.partial(_hf_logprobs, model), FP32_TOL, 2 * FP32_TOL)
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"])
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(init_lora_weights=False, **cfg))
    peft.save_pretrained(tmp_path / "adapter")
    reference = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "adapter", adapter_name="a").eval()
    engine.adapters.add("a", tmp_path / "adapter")
    out = engine.generate([prompts[0]], PARAMS, adapters=["a"])[0]
    _follows(out, prompts[0], functools.partial(peft_log_softmax, reference, "a"), FP32_TOL, 2 * FP32_TOL)
    engine.check_integrity()


@pytest.mark.slow
def test_tp2_splits_the_experts_and_follows_peft(moe, adapters):
    """Tensor parallelism over two ranks: each expert split by its width (and its adapters' LoRA with it), the
    router whole, one all-reduce after the experts (distributed.shard): the mixed batch of
    test_each_adapter_and_a_mixed_batch_follow_peft, against the same references."""
    _, path, _ = moe
    root, references = adapters
    engine = _engine(path, max_loras=4, tensor_parallel_size=2)
    try:
        for name in references:
            engine.adapters.add(name, root / name)
        plan = [None, "fused", "per_expert", "dense", "fused_ranks", None]
        prompts = _prompts(len(plan))
        for prompt, adapter, out in zip(prompts, plan, engine.generate(prompts, PARAMS, adapters=plan), strict=True):
            reference = references[adapter or "fused"]
            _follows(out, prompt, functools.partial(peft_log_softmax, reference, adapter), FP32_TOL, 2 * FP32_TOL)
        engine.check_integrity()
    finally:
        engine.close()
