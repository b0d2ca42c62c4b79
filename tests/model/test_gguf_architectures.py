"""GGUF files of the gemma2, gemma3 and phi3 architectures, written from tiny random HF models the way llama.cpp's
converter writes them (convert_hf_to_gguf.py, whose rules _write_gguf follows, each citing its source): the engine
serving the file gives HF eager's greedy tokens on the original model and log-probabilities within 2e-3, over
contexts longer than the sliding windows; the file's ModelArch is the one ModelArch.from_hf_config gives the
original config.json, field by field; transformers' own GGUF reader reads the same tensors as ours from the file.
Files whose settings the engine cannot honour are refused at start, naming the setting."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest
import torch

from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.errors import ModelLoadError
from lora_server.model.arch import PRESETS, ModelArch
from tests.model.test_architectures import FAMILIES, WINDOW, _build, _prompts
from tests.model.test_model_vs_hf import _compare

# name -> (the HF model: FAMILIES' config shape, with what GGUF can say, the GGUF architecture, extra metadata)
GGUF_FAMILIES = {
    # GGUF has no query_pre_attn_scalar: llama.cpp uses head_dim (Google's Gemma 2 2B/9B configs say the same)
    "gemma2": (dict(FAMILIES["gemma2"], query_pre_attn_scalar=16), "gemma2", {}),
    # llama.cpp's Gemma 3 pattern (5 sliding layers, then a full one) needs 6 layers to show a full layer
    "gemma3": (
        {**{k: v for k, v in FAMILIES["gemma3"].items() if k != "layer_types"}, "num_hidden_layers": 6},
        "gemma3",
        {},
    ),
    # FAMILIES' 3 layers (sliding, sliding, full) with the pattern in the file (gemma3.attention.sliding_window_pattern)
    "gemma3-pattern": (FAMILIES["gemma3"], "gemma3", {"pattern": 3}),
    "phi3": (FAMILIES["phi3"], "phi3", {}),
    "phi4-mini": (FAMILIES["phi4-mini"], "phi3", {}),  # partial rotary, LongRoPE, tied embeddings
}
F32_REL = 1e-6  # GGUF stores float metadata (epsilons, factors, caps) as float32


def _build_hf(tmp_path, name: str, monkeypatch):
    """The tiny HF model of GGUF_FAMILIES[name] (saved to tmp_path), built by test_architectures._build."""
    monkeypatch.setitem(FAMILIES, f"gguf-{name}", GGUF_FAMILIES[name][0])
    return _build(tmp_path, f"gguf-{name}")


# ---- the writer: llama.cpp's convert_hf_to_gguf.py (conversion/gemma.py, conversion/phi.py, conversion/base.py) --


def _gemma2_metadata(writer, cfg) -> None:
    """Gemma2Model.set_gguf_parameters (no RoPE base or scaling: llama.cpp's defaults)."""
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_sliding_window(cfg.sliding_window)


def _gemma3_metadata(writer, cfg) -> None:
    """TextModel.set_gguf_parameters (rope_parameters' full_attention: base and linear scaling; sliding_attention:
    rope.freq_base_swa), then Gemma3Model.set_gguf_parameters (final soft-cap where set, the sliding window)."""
    import gguf

    full, local = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    writer.add_rope_freq_base(full["rope_theta"])
    writer.add_rope_freq_base_swa(local["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    if cfg.final_logit_softcapping:
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_sliding_window(cfg.sliding_window)


def _phi3_metadata(writer, cfg) -> None:
    """Phi3MiniModel.set_gguf_parameters: rope.dimension_count int(partial * hidden) // heads, the original
    context, sliding_window 0 where None; LongRoPE's attn_factor from generate_extra_tensors."""
    rope = cfg.rope_parameters
    original = rope.get("original_max_position_embeddings", cfg.original_max_position_embeddings)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(
        int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
    )
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(cfg.sliding_window or 0)
    if rope.get("long_factor"):
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def _tensors(hf_dir, cfg, arch: str):
    """(GGUF name, float32 array) of the checkpoint's safetensors as the converter writes them: names by gguf-py's
    TensorNameMap (ModelBase.map_tensor_name); Gemma 2 drops lm_head (Gemma2Model.filter_tensors); Gemma adds 1 to
    every *norm.weight (Gemma2Model.modify_tensors, Gemma3Model.norm_shift); Phi-3 keeps qkv_proj and gate_up_proj
    fused (attn_qkv, ffn_up) and adds rope_factors_long/short for LongRoPE (Phi3MiniModel.generate_extra_tensors).
    No Q/K row permutation: the converter permutes llama's only (LlamaModel.modify_tensors)."""
    import gguf
    from safetensors.numpy import load_file

    model_arch = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3}[
        arch
    ]
    names = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
    for name, array in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        if arch == "gemma2" and name == "lm_head.weight":
            continue
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            array = array + np.float32(1.0)
        yield names.get_name(name, try_suffixes=(".weight", ".bias")), array.astype(np.float32)
    if arch == "phi3":
        yield from _rope_factor_tensors(cfg)


def _rope_factor_tensors(cfg):
    """Phi3MiniModel.generate_extra_tensors: LongRoPE's factors as float32 tensors, where config.json has them."""
    rope = cfg.rope_parameters
    if rope.get("long_factor"):
        yield "rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)
        yield "rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)


def _write_gguf(hf_dir, cfg, path, arch: str, pattern: int | None = None) -> None:
    """The HF checkpoint in hf_dir as a float32 GGUF of ``arch``, with a made-up BPE vocabulary (prompts here are
    token ids); ``pattern``: gemma3.attention.sliding_window_pattern (which newer llama.cpp reads, the converter does
    not write)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(["<pad>", "<bos>", "<eos>", "a", "b", "ab", *(f"w{i}" for i in range(6, cfg.vocab_size))])
    writer.add_token_types([3, 3, 3] + [1] * (cfg.vocab_size - 3))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)  # gguf.SpecialVocab's, as the converter writes the tokenizer's
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    {"gemma2": _gemma2_metadata, "gemma3": _gemma3_metadata, "phi3": _phi3_metadata}[arch](writer, cfg)
    if pattern is not None:
        writer.add_sliding_window_pattern(pattern)
    for name, array in _tensors(hf_dir, cfg, arch):
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _hf_and_gguf(tmp_path, name: str, monkeypatch):
    """(the HF model, the GGUF file written from its checkpoint)."""
    hf = _build_hf(tmp_path / "hf", name, monkeypatch)
    _, arch, extra = GGUF_FAMILIES[name]
    path = tmp_path / "model.gguf"
    _write_gguf(tmp_path / "hf", hf.config, path, arch, extra.get("pattern"))
    return hf, path


# ---- the file's shape --------------------------------------------------------------------------------------------


def _rope_items(arch: ModelArch) -> dict:
    """rope_scaling as the model reads it: HF's alias "type" and the partial_rotary_factor (held by rotary_dim)
    aside, which a config.json may repeat and a GGUF file has no place for."""
    items = dict(arch.rope_scaling)
    items.pop("partial_rotary_factor", None)
    if "rope_type" in items:
        items.pop("type", None)
    return items


def _assert_same_arch(ours: ModelArch, hf: ModelArch) -> None:
    for field in dataclasses.fields(ModelArch):
        mine, theirs = getattr(ours, field.name), getattr(hf, field.name)
        if field.name == "rope_scaling":
            mine, theirs = _rope_items(ours), _rope_items(hf)
            assert mine.keys() == theirs.keys(), field.name
            for key in mine:
                expected = theirs[key]
                assert mine[key] == (pytest.approx(expected, rel=F32_REL) if key != "rope_type" else expected), key
        elif isinstance(theirs, float):
            assert mine == pytest.approx(theirs, rel=F32_REL), field.name
        else:
            assert mine == theirs, field.name


@pytest.mark.parametrize("name", sorted(GGUF_FAMILIES))
def test_gguf_arch_is_the_hf_config_arch(tmp_path, name, monkeypatch):
    """gguf_arch of the converted file == ModelArch.from_hf_config of the original config.json, field by field."""
    from gguf import GGUFReader

    from lora_server.model.gguf_checkpoint import gguf_arch

    _, path = _hf_and_gguf(tmp_path, name, monkeypatch)
    ours = gguf_arch(GGUFReader(str(path)))
    hf = ModelArch.from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    _assert_same_arch(ours, hf)
    if name != "phi4-mini":  # the windows are real: every test context passes them
        assert any(ours.layer_windows) and WINDOW in ours.layer_windows, ours.layer_windows
    if name.startswith("gemma3"):
        assert 0 in ours.layer_windows and ours.local_rope_theta == 10000.0


# published shapes (config.json values; Gemma 2 27B and Gemma 3 27B for llama.cpp's own attention scale, from
# hidden / heads): their metadata as the converter writes it, no weights
PUBLISHED = {
    "gemma-2-2b": PRESETS["gemma-2-2b"],
    "gemma-2-27b": dict(
        PRESETS["gemma-2-2b"],
        hidden_size=4608,
        intermediate_size=36864,
        num_hidden_layers=46,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        query_pre_attn_scalar=144,
    ),
    "gemma-3-27b": dict(
        architectures=["Gemma3ForCausalLM"],
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=62,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        query_pre_attn_scalar=168,
        vocab_size=262208,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        sliding_window=1024,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling=dict(rope_type="linear", factor=8.0),
        bos_token_id=2,
        eos_token_id=1,
    ),
    "phi-4-mini": PRESETS["phi-4-mini"],
}
MODEL_TYPES = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text", "Phi3ForCausalLM": "phi3"}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_shapes_read_as_their_config(tmp_path, name):
    import gguf
    from transformers import AutoConfig

    from lora_server.model.gguf_checkpoint import gguf_arch

    settings = dict(PUBLISHED[name])
    model_type = MODEL_TYPES[settings["architectures"][0]]
    cfg = AutoConfig.for_model(model_type, **settings)
    arch = {"gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}[model_type]
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    {"gemma2": _gemma2_metadata, "gemma3": _gemma3_metadata, "phi3": _phi3_metadata}[arch](writer, cfg)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    for tensor, array in _rope_factor_tensors(cfg) if arch == "phi3" else ():
        writer.add_tensor(tensor, array)
    if not cfg.tie_word_embeddings:
        writer.add_tensor("output.weight", np.zeros((1, 1), np.float32))  # only its presence is read here
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = gguf_arch(gguf.GGUFReader(str(tmp_path / "m.gguf")))
    _assert_same_arch(ours, ModelArch.from_hf_config(json.loads(cfg.to_json_string())))
    if name.endswith("27b"):  # llama.cpp's LLM_TYPE_27B scale: the config's query_pre_attn_scalar, not head_dim
        assert ours.attn_scale == settings["query_pre_attn_scalar"] ** -0.5 != ours.head_dim**-0.5


# ---- the engine against HF on the original model -----------------------------------------------------------------


# Gemma 2 and the 6-layer Gemma 3 take over a few seconds on the CPU (HF's eager forward, mostly); gemma3-pattern
# keeps Gemma 3's parts (and Gemma's norms, soft-capping aside) in the quick tier
SLOW_ENGINE = ("gemma2", "gemma3")


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_ENGINE else n for n in sorted(GGUF_FAMILIES)]
)
def test_gguf_family_matches_hf(tmp_path, name, monkeypatch):
    hf, path = _hf_and_gguf(tmp_path, name, monkeypatch)
    config = EngineConfig(
        model=str(path),
        device="cpu",
        dtype="float32",
        quantization="none",
        block_size=4,
        num_kv_blocks=256,
        show_progress=False,
    )
    engine = Engine(config)
    assert engine.describe().arch.architecture == GGUF_FAMILIES[name][0]["architectures"][0]
    _compare(engine, hf, _prompts())


# ---- transformers' own reading of the same file ------------------------------------------------------------------

# canonical layer weights -> HF's names (Phi-3's q, k, v and gate, up fused back into qkv_proj and gate_up_proj)
HF_LAYER = {
    "attn_norm": "input_layernorm",
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
HF_GEMMA_NORMS = {
    "mlp_norm": "pre_feedforward_layernorm",
    "post_attn_norm": "post_attention_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
}


def _as_hf_state(ckpt) -> dict[str, torch.Tensor]:
    """Our checkpoint's weights under HF's names, as float32."""
    arch, dense = ckpt.arch, {k: w.dense(torch.float32, torch.device("cpu")) for k, w in ckpt.weights.items()}
    layer_names = dict(HF_LAYER, **(HF_GEMMA_NORMS if arch.gemma_norms else {"mlp_norm": "post_attention_layernorm"}))
    state = {"model.embed_tokens.weight": dense.pop("embed"), "model.norm.weight": dense.pop("norm")}
    if "lm_head" in dense:
        state["lm_head.weight"] = dense.pop("lm_head")
    for i in range(arch.num_layers):
        parts = {key.split(".", 2)[2]: dense.pop(key) for key in list(dense) if key.startswith(f"layers.{i}.")}
        if arch.fused_projections:
            state[f"model.layers.{i}.self_attn.qkv_proj.weight"] = torch.cat([parts.pop(p) for p in "qkv"])
            state[f"model.layers.{i}.mlp.gate_up_proj.weight"] = torch.cat([parts.pop("gate"), parts.pop("up")])
        state.update({f"model.layers.{i}.{layer_names[p]}.weight": w for p, w in parts.items()})
    assert not dense, sorted(dense)
    return state


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3", "phi4-mini"])
def test_transformers_reads_the_same_gguf(tmp_path, name, monkeypatch):
    """transformers' GGUF loader (its Gemma2TensorProcessor subtracts the converter's 1 from Gemma's norms, its
    Phi-3 keeps the fused projections) reads every tensor of the file exactly as ours does, and the shape it reads
    from the metadata; both equal the original checkpoint (Gemma's norms to float32's rounding of w + 1)."""
    from transformers import AutoModelForCausalLM

    from lora_server.model.gguf_checkpoint import open_gguf

    hf, path = _hf_and_gguf(tmp_path, name, monkeypatch)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    ckpt = open_gguf(path)
    ours = _as_hf_state(ckpt)
    their_state = {k: v for k, v in theirs.state_dict().items() if k != "lm_head.weight" or "lm_head.weight" in ours}
    assert ours.keys() == their_state.keys()
    original = hf.state_dict()
    for key, tensor in ours.items():
        assert torch.equal(tensor, their_state[key]), key
        torch.testing.assert_close(tensor, original[key], rtol=0, atol=1e-6, msg=key)
    arch, cfg = ckpt.arch, theirs.config
    read = (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.num_attention_heads)
    assert read == (arch.hidden_size, arch.num_layers, arch.intermediate_size, arch.num_heads)
    assert (cfg.num_key_value_heads, cfg.vocab_size) == (arch.num_kv_heads, arch.vocab_size)
    assert cfg.rms_norm_eps == pytest.approx(arch.rms_norm_eps) and cfg.tie_word_embeddings == arch.tie_word_embeddings
    if arch.gemma_norms:  # transformers reads these two of Gemma's settings from the file too
        assert (cfg.head_dim, cfg.sliding_window) == (arch.head_dim, max(arch.layer_windows))


# ---- refused at start ------------------------------------------------------------------------------------------


def _metadata_only(path, arch: str, keys: dict, tensors: dict[str, np.ndarray] | None = None) -> None:
    """A GGUF of ``arch`` with a small shape, ``keys`` ({arch}.* suffix -> value; None: left out) and ``tensors``."""
    import gguf

    base = {
        "context_length": 256,
        "embedding_length": 64,
        "block_count": 2,
        "feed_forward_length": 96,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "vocab_size": 256,
    }
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {**base, **keys}.items():
        if value is None:
            continue
        kinds = {bool: writer.add_bool, float: writer.add_float32, str: writer.add_string, list: writer.add_array}
        kind = kinds.get(type(value))
        (kind or writer.add_uint32)(f"{arch}.{key}", value)
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


REFUSED = {  # case -> (architecture, {arch}.* keys, LongRoPE factor tensors written, the refusal's words)
    "falcon": ("falcon", {}, (), "GGUF architecture 'falcon' is not supported"),
    "unknown key": ("gemma2", {"logit_scale": 0.5}, (), "gemma2.logit_scale: not read"),
    "non-causal": ("gemma3", {"attention.sliding_window": 8, "attention.causal": False}, (), "gemma3.attention.causal"),
    "gemma3 without a window": ("gemma3", {}, (), "gemma3.attention.sliding_window is missing or 0"),
    "gemma partial rotary": ("gemma2", {"rope.dimension_count": 8}, (), "gemma2.rope.dimension_count 8 differs"),
    "no norm epsilon": ("phi3", {"attention.layer_norm_rms_epsilon": None}, (), "layer_norm_rms_epsilon is missing"),
    "yarn": ("phi3", {"rope.scaling.type": "yarn"}, (), "phi3.rope.scaling.type 'yarn' is not implemented"),
    "one LongRoPE factor": ("phi3", {}, ("short",), "without its rope_factors_long.weight tensor"),
    "LongRoPE, no original context": ("phi3", {}, ("short", "long"), "phi3.rope.scaling.original_context_length"),
    "LongRoPE and linear": (
        "phi3",
        {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0},
        ("short", "long"),
        "LongRoPE factor tensors and rope.scaling.type 'linear'",
    ),
    "pattern of another depth": (
        "gemma3",
        {"attention.sliding_window": 8, "attention.sliding_window_pattern": [True, False, True]},
        (),
        "sliding_window_pattern holds 3 values for 2 layers",
    ),
    "value length": ("gemma3", {"attention.sliding_window": 8, "attention.value_length": 32}, (), "value_length 32"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_gguf_settings_not_honoured_are_refused(tmp_path, case):
    from gguf import GGUFReader

    from lora_server.model.gguf_checkpoint import gguf_arch

    arch, keys, factors, message = REFUSED[case]
    tensors = {f"rope_factors_{f}.weight": np.ones(8, np.float32) for f in factors}  # rope.dimension_count 16
    _metadata_only(tmp_path / "m.gguf", arch, keys, tensors)
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        gguf_arch(GGUFReader(str(tmp_path / "m.gguf")))


def test_a_tensor_read_twice_is_refused(tmp_path):
    """llama.cpp reads Phi-3's q, k, v from attn_qkv or from attn_q, attn_k, attn_v: a file with both is refused."""
    from lora_server.model.gguf_checkpoint import open_gguf

    tensors = {"blk.0.attn_qkv.weight": np.zeros((128, 64), np.float32), "blk.0.attn_q.weight": np.zeros((64, 64))}
    _metadata_only(tmp_path / "m.gguf", "phi3", {}, {k: v.astype(np.float32) for k, v in tensors.items()})
    with pytest.raises(ModelLoadError, match="holds layers.0.q twice"):
        open_gguf(tmp_path / "m.gguf")
