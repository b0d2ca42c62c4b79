"""The shape of a Llama-family model, read from an HF config.json, GGUF metadata, or a named preset."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lora_server.errors import ModelLoadError

# Architectures whose forward pass is the Llama one (Qwen2 adds biases on q, k, v).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=[128001, 128009],
    ),
    "tiny-llama": dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


@dataclass(frozen=True, slots=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # HF's rope_scaling dict as sorted items
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"unsupported architecture {arch}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        _refuse_unread_settings(cfg, arch)
        heads = cfg["num_attention_heads"]
        max_pos = cfg.get("max_position_embeddings", 4096)
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
            # Attention is full; capping the context at the window keeps it exact.
            max_pos = min(max_pos, cfg["sliding_window"])
        eos = cfg.get("eos_token_id")
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ("default", "llama3", "linear"):
            raise ModelLoadError(f"unsupported rope_scaling type {rope_type!r}")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta", scaling.get("rope_theta", 10000.0))),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=tuple(sorted((k, v) for k, v in scaling.items() if k != "rope_theta"))
            if rope_type != "default"
            else (),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        )


def _refuse_unread_settings(cfg: dict[str, Any], arch: str) -> None:
    """config.json settings that change these architectures' forward pass and that the model does not implement
    are a start-up error naming them: loading without them would serve another model, silently."""
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise ModelLoadError(f"{arch} with hidden_act {act!r}: only SiLU-gated MLPs are implemented")
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{arch} with mlp_bias true: MLP biases are not implemented")
    if arch == "LlamaForCausalLM" and cfg.get("attention_bias"):
        raise ModelLoadError(f"{arch} with attention_bias true: the output projection's bias is not implemented")
    rotary = cfg.get("partial_rotary_factor", 1.0)
    if rotary != 1.0:
        raise ModelLoadError(
            f"{arch} with partial_rotary_factor {rotary!r}: only full rotary embeddings are implemented"
        )
