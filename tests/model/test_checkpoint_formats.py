"""Checkpoints the loader cannot read exactly are refused at start, naming why: an HF directory whose config.json
names a quantization method or setting the loader does not implement, a GGUF tensor type that gguf cannot
dequantize, settings and tensors the model does not implement. GGUF types without a resident layout are
dequantized exactly to float32."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from lora_server.config import EngineConfig
from lora_server.errors import ModelLoadError
from lora_server.model.gguf_checkpoint import unpermute_rope_rows
from lora_server.model.loader import open_checkpoint

TINY_CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=16,
    max_position_embeddings=64,
)
# config.json entries of quantized checkpoints whose method the loader does not implement -> the refusal's words
QUANTIZED = {
    "fp8 (HF's FP8 with block scales)": (
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
        "'fp8': not implemented",
    ),
    "bitsandbytes": (
        {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
        "'bitsandbytes': not implemented",
    ),
    "older compressed-tensors": ({"compression_config": {"format": "int-quantized"}}, "None: not implemented"),
    "AWQ GEMV": (
        {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}},
        "'gemv': only AWQ's GEMM",
    ),
}


def _fp8_checkpoint(path, extra: dict) -> None:
    """A tiny Llama whose q projection is stored as float8 codes with a weight_scale beside it (what an FP8
    compressed-tensors checkpoint holds), plus ``extra`` in its config.json."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**TINY_CONFIG, **extra}))
    tensors = {
        "model.embed_tokens.weight": torch.randn(16, 32),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32).to(torch.float8_e4m3fn),
        "model.layers.0.self_attn.q_proj.weight_scale": torch.full((32, 1), 0.01),
    }
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("case", sorted(QUANTIZED))
def test_unimplemented_quantized_checkpoints_are_refused_naming_the_method(tmp_path, case):
    extra, value = QUANTIZED[case]
    _fp8_checkpoint(tmp_path / "model", extra)
    with pytest.raises(ModelLoadError, match=f"= {re.escape(value)}"):
        open_checkpoint(EngineConfig(model=str(tmp_path / "model"), show_progress=False))


def test_an_unknown_quantization_method_is_a_start_up_error(tmp_path):
    """lora-server serve stops before serving, with the reason on stderr and exit status 2."""
    _fp8_checkpoint(tmp_path / "model", QUANTIZED["bitsandbytes"][0])
    cmd = [sys.executable, "-m", "lora_server.cli", "serve", "--model", str(tmp_path / "model")]
    cmd += ["--data-dir", str(tmp_path / "data"), "--port", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "quant_method = 'bitsandbytes': not implemented" in done.stderr


def _gguf(path, tensors: dict[str, tuple[np.ndarray, object]]) -> None:
    """A GGUF file with a tiny Llama's metadata and the given raw tensors (name -> (data, GGML type))."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(16)
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_types_are_dequantized_exactly_or_refused(tmp_path):
    import gguf
    from gguf.quants import dequantize, quantize

    kinds = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    up = quantize(rng.standard_normal((64, 32)).astype(np.float32), kinds.Q4_0)
    q = quantize(rng.standard_normal((32, 32)).astype(np.float32), kinds.Q5_0)
    _gguf(tmp_path / "ok.gguf", {"blk.0.ffn_up.weight": (up, kinds.Q4_0), "blk.0.attn_q.weight": (q, kinds.Q5_0)})
    weights = open_checkpoint(EngineConfig(model=str(tmp_path / "ok.gguf"), show_progress=False)).weights
    cpu = torch.device("cpu")
    assert torch.equal(weights["layers.0.up"].dense(torch.float32, cpu), torch.from_numpy(dequantize(up, kinds.Q4_0)))
    q_rows = unpermute_rope_rows(dequantize(q, kinds.Q5_0), 2)  # llama.cpp's Q row order undone
    assert torch.equal(weights["layers.0.q"].dense(torch.float32, cpu), torch.from_numpy(q_rows))

    q8_1 = np.zeros((64, 40), dtype=np.uint8)  # one Q8_1 block (32 values, 40 bytes) per row: gguf cannot read it
    _gguf(tmp_path / "bad.gguf", {"blk.0.ffn_gate.weight": (q8_1, kinds.Q8_1)})
    with pytest.raises(ModelLoadError, match="blk.0.ffn_gate.weight is of type Q8_1"):
        open_checkpoint(EngineConfig(model=str(tmp_path / "bad.gguf"), show_progress=False))


# config.json settings of the supported architectures that change the forward pass and are not implemented
UNREAD_SETTINGS = {
    "hidden_act": ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    "mlp_bias": ({"mlp_bias": True}, "mlp_bias true"),
    "Llama attention_bias": ({"attention_bias": True}, "attention_bias true"),
    "partial_rotary_factor": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
}


@pytest.mark.parametrize("case", sorted(UNREAD_SETTINGS))
def test_settings_the_model_does_not_implement_are_refused(tmp_path, case):
    extra, named = UNREAD_SETTINGS[case]
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**TINY_CONFIG, **extra}))
    save_file({"model.embed_tokens.weight": torch.randn(16, 32)}, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=named):
        open_checkpoint(EngineConfig(model=str(path), show_progress=False))


def test_hf_tensors_the_loader_does_not_read_are_refused(tmp_path):
    """A bias the Llama forward pass lacks (the MLP's) would be left out silently; RoPE's saved inverse frequencies
    are derived again and may stay."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    tensors = {
        "model.embed_tokens.weight": torch.randn(16, 32),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.randn(8),
    }
    save_file(tensors, str(path / "model.safetensors"))
    assert set(open_checkpoint(EngineConfig(model=str(path), show_progress=False)).weights) == {"embed"}
    tensors["model.layers.0.mlp.up_proj.bias"] = torch.randn(64)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"1 tensor\(s\) this loader does not read \(model.layers.0.mlp.up_proj.bias\)"
    ):
        open_checkpoint(EngineConfig(model=str(path), show_progress=False))


def test_gguf_parts_the_loader_does_not_read_are_refused(tmp_path):
    import gguf

    kinds = gguf.GGMLQuantizationType
    up = np.ones((64, 32), dtype=np.float32)
    _gguf(tmp_path / "bias.gguf", {"blk.0.ffn_up.weight": (up, kinds.F32), "blk.0.attn_q.bias": (up[0], kinds.F32)})
    with pytest.raises(ModelLoadError, match=r"1 tensor\(s\) this loader does not read \(blk.0.attn_q.bias\)"):
        open_checkpoint(EngineConfig(model=str(tmp_path / "bias.gguf"), show_progress=False))

    for key, value, named in [
        ("llama.rope.scaling.type", "yarn", "rope.scaling.type 'yarn'"),
        ("llama.expert_count", 8, "expert_used_count is missing"),  # a mixture of experts without its top k
    ]:
        path = tmp_path / f"{key}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_block_count(1)
        writer.add_embedding_length(32)
        writer.add_head_count(2)
        writer.add_vocab_size(16)
        (writer.add_string if isinstance(value, str) else writer.add_uint32)(key, value)
        writer.add_tensor("blk.0.ffn_up.weight", up, raw_dtype=kinds.F32)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ModelLoadError, match=named):
            open_checkpoint(EngineConfig(model=str(path), show_progress=False))
