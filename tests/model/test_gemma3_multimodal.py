"""Gemma 3 multimodal checkpoints (Gemma3ForConditionalGeneration) served text-only: the language model's shape from
text_config with transformers' Gemma3TextConfig defaults, its tensors read under both layouts transformers reads
(language_model.model.* as the hub's files and transformers' save_pretrained write them; model.language_model.* as
transformers 5 names the modules), the vision tower and projector left unread and said in the log. Against HF eager
at fp32 on a tiny random model: the whole Gemma3ForConditionalGeneration given input_ids only (no pixel_values, no
token_type_ids: Gemma3Model embeds the ids and runs the language model under the causal and sliding-window masks, then
lm_head), greedy tokens and log-probabilities within 2e-3 over contexts longer than the sliding window; PEFT adapters
on the language model in a mixed batch against HF + PEFT; adapters on the vision tower refused, naming the module."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_server.adapters.peft_format import AdapterError, BaseShapes, load_peft_adapter
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.errors import ModelLoadError
from lora_server.model.arch import ModelArch
from lora_server.model.loader import open_checkpoint
from lora_server.sampling_params import SamplingParams
from tests.model.test_architectures import (
    FAMILIES,
    WINDOW,
    _peft_log_softmax,
    _prompts,
    assert_mixed_batch_matches_peft,
)
from tests.model.test_model_vs_hf import _compare, _near_tie

ARCH = "Gemma3ForConditionalGeneration"
IMAGE_TOKEN = 255  # inside the tiny vocabulary, as gemma-3's 262144 is inside its 262208

# gemma-3-4b-it's config.json as the hub ships it (transformers 4.50 saved text_config's differences only)
HUB_4B_CONFIG = {
    "architectures": [ARCH],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


# ---- the shape, from text_config -------------------------------------------------------------------------------


def _hf_text_config(cfg: dict):
    """transformers' own reading of a config.json dict: its Gemma3Config's text_config (defaults applied)."""
    from transformers import Gemma3Config

    kwargs = {k: v for k, v in copy.deepcopy(cfg).items() if k not in ("architectures", "model_type")}
    return Gemma3Config(**kwargs).text_config


def test_hub_config_reads_as_transformers_does():
    """gemma-3-4b-it's config.json leaves most of text_config out: each field as transformers' Gemma3TextConfig
    fills it, and the top level's eos_token_id (GenerationConfig.from_model_config prefers it)."""
    arch = ModelArch.from_hf_config(HUB_4B_CONFIG)
    text = _hf_text_config(HUB_4B_CONFIG)
    assert arch.architecture == ARCH and arch.family == "gemma3" and arch.multimodal
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_layers) == (
        text.vocab_size,
        text.hidden_size,
        text.intermediate_size,
        text.num_hidden_layers,
    )
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (
        text.num_attention_heads,
        text.num_key_value_heads,
        text.head_dim,
    )
    assert arch.query_scale == text.query_pre_attn_scalar**-0.5
    assert arch.rms_norm_eps == text.rms_norm_eps and arch.max_position_embeddings == text.max_position_embeddings
    windows = [text.sliding_window if t == "sliding_attention" else 0 for t in text.layer_types]
    assert list(arch.layer_windows) == windows and windows.count(0) == 5  # every sixth layer global
    full, local = text.rope_parameters["full_attention"], text.rope_parameters["sliding_attention"]
    assert arch.rope_theta == full["rope_theta"] == 1_000_000.0
    assert arch.rope_scaling_dict["rope_type"] == full["rope_type"] == "linear"
    assert arch.rope_scaling_dict["factor"] == full["factor"]
    assert arch.local_rope_theta == local["rope_theta"] == 10_000.0
    assert arch.eos_token_ids == (1, 106) and arch.bos_token_id == text.bos_token_id
    assert arch.tie_word_embeddings and arch.final_softcap == 0.0 and arch.attn_softcap == 0.0


def test_head_tying_that_transformers_versions_disagree_on_is_refused():
    """transformers 5 ties the head by the top level's tie_word_embeddings, 4.5x by text_config's: refused when they
    differ (absent is true for both), served when they agree."""
    for top, text in ((None, False), (False, None), (True, False)):
        cfg = copy.deepcopy(HUB_4B_CONFIG)
        if top is not None:
            cfg["tie_word_embeddings"] = top
        if text is not None:
            cfg["text_config"]["tie_word_embeddings"] = text
        with pytest.raises(ModelLoadError, match="tie_word_embeddings"):
            ModelArch.from_hf_config(cfg)
    cfg = copy.deepcopy(HUB_4B_CONFIG)
    cfg["tie_word_embeddings"] = cfg["text_config"]["tie_word_embeddings"] = False
    assert not ModelArch.from_hf_config(cfg).tie_word_embeddings


def test_text_settings_not_implemented_are_refused():
    cfg = copy.deepcopy(HUB_4B_CONFIG)
    cfg["text_config"]["use_bidirectional_attention"] = True
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        ModelArch.from_hf_config(cfg)


def test_prequantized_multimodal_checkpoint_is_refused(tmp_path):
    cfg = dict(HUB_4B_CONFIG, quantization_config=dict(quant_method="awq", bits=4, group_size=128, version="gemm"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="pre-quantized"):
        open_checkpoint(EngineConfig(model=str(tmp_path), device="cpu"))


# ---- a tiny model, both layouts ----------------------------------------------------------------------------------


def _build(path, tied: bool = True):
    """A tiny random Gemma3ForConditionalGeneration (text_config: test_architectures' gemma3 shape, sliding window
    8; a one-layer SigLIP of 2 x 2 patches pooled into 4 image tokens), norms random too, saved by transformers
    (language_model.model.* names); the model in eval mode."""
    from transformers import AutoModelForImageTextToText, Gemma3Config

    text = {k: v for k, v in FAMILIES["gemma3"].items() if k not in ("model_type", "architectures")}
    text.update(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=tied,
    )
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    cfg = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=IMAGE_TOKEN,
        boi_token_index=253,
        eoi_token_index=254,
        initializer_range=0.2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    hf = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:  # Gemma's 1 + w around zero: random instead, so that every norm matters
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["architectures"] == [ARCH]
    return hf


def _v5_name(name: str) -> str:
    """A saved tensor's name in transformers 5's module layout (what its conversion_mapping renames it to)."""
    for old, new in (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ):
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name


def _rewrite(path, rename) -> dict[str, torch.Tensor]:
    file = path / "model.safetensors"
    tensors = {rename(k): v for k, v in load_file(str(file)).items()}
    save_file(tensors, str(file), metadata={"format": "pt"})
    return tensors


def _engine(path, **kw) -> Engine:
    config = dict(device="cpu", dtype="float32", quantization="none", show_progress=False, block_size=4)
    return Engine(EngineConfig(model=str(path), **{**config, "num_kv_blocks": 256, **kw}))


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "tied"), [("hub", True), ("v5", False)])
def test_text_matches_hf(tmp_path, caplog, layout, tied):
    """The language model against HF's whole model given token ids only, greedy and log-probabilities, contexts
    past the window; the layout the hub's files use (tied head) and transformers 5's (its own lm_head)."""
    from transformers import Gemma3ForConditionalGeneration

    hf = _build(tmp_path, tied)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert ("language_model.lm_head.weight" in names) == (not tied)
    if layout == "v5":
        names = set(_rewrite(tmp_path, _v5_name))
        assert "lm_head.weight" in names and "model.language_model.norm.weight" in names
        reread = Gemma3ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)  # HF reads it too
        for (name, ours), theirs in zip(hf.state_dict().items(), reread.state_dict().values(), strict=True):
            assert torch.equal(ours, theirs), name
    assert any(n.startswith(("vision_tower.", "model.vision_tower.")) for n in names)
    with caplog.at_level(logging.INFO, logger="lora_server.model.loader"):
        engine = _engine(tmp_path)
    said = [r.getMessage() for r in caplog.records if "text only" in r.getMessage()]
    assert len(said) == 1 and "vision tower" in said[0], said
    arch = engine.describe().arch
    assert arch.architecture == ARCH and arch.tie_word_embeddings == tied
    assert any(arch.layer_windows) and arch.max_position_embeddings > WINDOW
    prompts = _prompts()
    assert max(map(len, prompts)) > 2 * WINDOW
    _compare(engine, hf, prompts)


def test_unread_and_duplicate_tensors_are_refused(tmp_path):
    """Beside the vision tower and projector, every tensor is read or refused as for any checkpoint: an unknown
    one, a text model's name (HF reads none into this architecture), the same tensor in both layouts."""
    _build(tmp_path)
    original = load_file(str(tmp_path / "model.safetensors"))
    norm = original["language_model.model.norm.weight"]
    cases = {
        "language_model.model.layers.0.mlp.extra.weight": "does not read",
        "model.norm.weight": "does not read",
        "model.language_model.norm.weight": "twice",
    }
    for extra, reason in cases.items():
        save_file({**original, extra: norm.clone()}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match=reason):
            open_checkpoint(EngineConfig(model=str(tmp_path), device="cpu"))


# ---- adapters ----------------------------------------------------------------------------------------------------

# a regex on the language model (as PEFT writes for VLMs) with a layout-dependent alpha_pattern key; a list of
# modules only the language model has (SigLIP's are q/k/v/out_proj and fc1/fc2)
LANGUAGE_REGEX = r".*language_model.*\.(q_proj|v_proj|o_proj|down_proj)"
ALPHA_PATTERN = {"language_model.layers.1.mlp.down_proj": 40}  # matches model.language_model.layers.1... only
LANGUAGE_LIST = ["gate_proj", "up_proj", "down_proj"]


def _old_adapter_name(key: str) -> str:
    """A PEFT key of transformers 5's layout in the older one (language_model.model.layers...)."""
    return key.replace("base_model.model.model.language_model.", "base_model.model.language_model.model.")


def _save_adapter(hf, path, seed: int, rank: int, targets, **extra):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **extra)
    peft = get_peft_model(hf, config)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    peft.save_pretrained(path)
    return peft.unload()


@pytest.mark.slow
def test_mixed_adapters_match_peft(tmp_path):
    """Two adapters on the language model in one batch with the base: a regex target and an alpha_pattern read
    under transformers 5's names; a list target whose keys are rewritten into the older layout (the same weights:
    served alike). Against HF + PEFT with only each request's adapter active."""
    from peft import PeftModel

    hf = _build(tmp_path / "base")
    hf = _save_adapter(hf, tmp_path / "a0", 100, 8, LANGUAGE_REGEX, alpha_pattern=ALPHA_PATTERN)
    hf = _save_adapter(hf, tmp_path / "a1", 101, 4, LANGUAGE_LIST)
    keys = set(load_file(str(tmp_path / "a0" / "adapter_model.safetensors")))
    assert keys and all(k.startswith("base_model.model.model.language_model.layers.") for k in keys)
    old = tmp_path / "a1-old"
    old.mkdir()
    (old / "adapter_config.json").write_text((tmp_path / "a1" / "adapter_config.json").read_text())
    tensors = load_file(str(tmp_path / "a1" / "adapter_model.safetensors"))
    save_file({_old_adapter_name(k): v for k, v in tensors.items()}, str(old / "adapter_model.safetensors"))
    model = PeftModel.from_pretrained(hf, tmp_path / "a0", adapter_name="a0")
    model.load_adapter(tmp_path / "a1", adapter_name="a1")
    model.eval()

    engine = _engine(tmp_path / "base", block_size=16, num_kv_blocks=128, max_lora_rank=8)
    engine.adapters.add("a0", tmp_path / "a0")
    engine.adapters.add("a1", old)
    assert_mixed_batch_matches_peft(engine, model)


def test_adapter_on_the_vision_tower_serves_its_language_model_part(tmp_path, caplog):
    """PEFT's list target q_proj, v_proj also wraps SigLIP's q_proj and v_proj: those weights act on images only
    (which the server refuses), so the adapter registers with its language-model modules, says so in the log, and
    serves HF + PEFT's text-only tokens."""
    from peft import PeftModel

    hf = _save_adapter(_build(tmp_path / "base"), tmp_path / "qv", 102, 4, ["q_proj", "v_proj"])
    model = PeftModel.from_pretrained(hf, str(tmp_path / "qv"), adapter_name="qv").eval()
    keys = load_file(str(tmp_path / "qv" / "adapter_model.safetensors"))
    assert any(".vision_tower." in k for k in keys) and any(".language_model." in k for k in keys)
    engine = _engine(tmp_path / "base", block_size=16, num_kv_blocks=128, max_lora_rank=8)
    with caplog.at_level(logging.INFO, logger="lora_server"):
        engine.adapters.add("qv", tmp_path / "qv")
    assert any("vision-tower" in r.getMessage() and "model.vision_tower." in r.getMessage() for r in caplog.records)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    out = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), adapters="qv")
    ref = _peft_log_softmax(model, "qv", prompt + out[0].token_ids)
    for step, token in enumerate(out[0].token_ids):
        row = ref[len(prompt) - 1 + step]
        assert token == int(row.argmax()) or _near_tie(row), step


# ---- adapter keys, by hand -------------------------------------------------------------------------------------

SHAPES = BaseShapes.llama(2, 64, 96, 64, 16)


def _hand_adapter(path, keys: list[str], target_modules, rank: int = 2) -> None:
    """A PEFT directory with lora_A / lora_B of q_proj's shapes under each key prefix."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key in keys:
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, 64) * 0.1
        tensors[f"{key}.lora_B.weight"] = torch.randn(64, rank) * 0.1
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = dict(peft_type="LORA", r=rank, lora_alpha=rank, target_modules=target_modules)
    (path / "adapter_config.json").write_text(json.dumps(config))


LAYOUTS = {
    "text": "base_model.model.model.layers.{}.self_attn.q_proj",
    "v5": "base_model.model.model.language_model.layers.{}.self_attn.q_proj",
    "4.5x": "base_model.model.language_model.model.layers.{}.self_attn.q_proj",
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_map_to_the_same_modules(tmp_path, layout):
    keys = [LAYOUTS[layout].format(i) for i in range(2)]
    _hand_adapter(tmp_path, keys, ["q_proj"])
    adapter = load_peft_adapter("a", tmp_path, SHAPES, max_rank=8)
    assert set(adapter.weights) == {(0, "q"), (1, "q")}


def test_language_model_regex_reads_the_keys_layout(tmp_path):
    """A regex target matches the modules' names in the model PEFT wrapped, which the keys' layout gives: PEFT's
    language-model regex selects nothing in a text model (refused there, as PEFT refuses it)."""
    regex = r".*language_model.*\.q_proj"
    for layout in ("v5", "4.5x"):
        _hand_adapter(tmp_path / layout, [LAYOUTS[layout].format(i) for i in range(2)], regex)
        assert set(load_peft_adapter("a", tmp_path / layout, SHAPES, max_rank=8).weights) == {(0, "q"), (1, "q")}
    _hand_adapter(tmp_path / "text", [LAYOUTS["text"].format(i) for i in range(2)], regex)
    with pytest.raises(AdapterError, match="matches no module"):
        load_peft_adapter("a", tmp_path / "text", SHAPES, max_rank=8)
    _hand_adapter(tmp_path / "v5-layer1", [LAYOUTS["v5"].format(1)], r"model\.language_model\.layers\.1\..*q_proj")
    assert set(load_peft_adapter("a", tmp_path / "v5-layer1", SHAPES, max_rank=8).weights) == {(1, "q")}


def test_vision_keys_are_left_out_and_mixed_layouts_refused(tmp_path):
    old_vision = "base_model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj"
    _hand_adapter(tmp_path / "old", [LAYOUTS["4.5x"].format(0), LAYOUTS["4.5x"].format(1), old_vision], ["q_proj"])
    assert set(load_peft_adapter("a", tmp_path / "old", SHAPES, max_rank=8).weights) == {(0, "q"), (1, "q")}
    _hand_adapter(tmp_path / "mixed", [LAYOUTS["v5"].format(0), LAYOUTS["4.5x"].format(1)], ["q_proj"])
    with pytest.raises(AdapterError, match="both"):
        load_peft_adapter("a", tmp_path / "mixed", SHAPES, max_rank=8)
