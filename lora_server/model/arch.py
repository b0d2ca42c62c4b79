"""The shape of a decoder model, read from an HF config.json, GGUF metadata, or a named preset: the Llama family
(Llama 2/3, Mistral, SmolLM2, Qwen2) and the families that differ from it in a few named ways (Qwen3, Gemma 2 and 3,
Phi-3), each difference a field of ModelArch that the model (model.llama) reads. Gemma 3's multimodal checkpoints
(Gemma3ForConditionalGeneration) are served text-only: their language model's shape, from text_config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lora_server.errors import ModelLoadError
from lora_server.model.checkpoint_checks import (
    HF_NAMES,
    MAX_LAYERS,
    Int,
    check_arch,
    check_hf_config,
    check_int,
    check_value,
    head_width,
)

# HF architecture -> family: "llama" is the Llama forward pass (Qwen2 adds biases on q, k, v); the others are
# described by ModelArch's fields (qk_norm, gemma_norms, activation, windows, soft-capping, fused projections...)
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3",
    "MixtralForCausalLM": "llama",
}
# Mixture-of-experts architectures: some or all layers' MLP is a router and num_experts gated MLPs (model.moe)
MOE_ARCHITECTURES = frozenset({"Qwen3MoeForCausalLM", "MixtralForCausalLM"})
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# Image-text models whose language model is served alone: its settings are config.json's text_config, its tensors
# are named under language_model (model.loader), and its vision tower and projector are not loaded. Requests with
# images never reach the model: the HTTP layer refuses image content parts (400).
MULTIMODAL_ARCHITECTURES = frozenset({"Gemma3ForConditionalGeneration"})
GEMMA3_SLIDING_PATTERN = 6  # Gemma 3's default: every sixth layer attends globally
# What transformers' Gemma3TextConfig (configuration_gemma3.py) assumes for a key config.json leaves out; the hub's
# multimodal Gemma 3 configs omit most of them from text_config (gemma-3-4b-it's gives six keys).
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131_072,
    rms_norm_eps=1e-6,
    bos_token_id=2,
    eos_token_id=1,
    tie_word_embeddings=True,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    sliding_window_pattern=GEMMA3_SLIDING_PATTERN,
    rope_theta=1_000_000.0,  # the full-attention layers' RoPE base (default_theta["global"])
    rope_local_base_freq=10_000.0,  # the sliding layers' (default_theta["local"])
)

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
    # the families' shapes, for benchmarks and the ahead-of-time kernel compile (their config.json values)
    "gemma-2-2b": dict(
        architectures=["Gemma2ForCausalLM"],
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=256000,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256,
        sliding_window=4096,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
    ),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"],
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "phi-4-mini": dict(
        architectures=["Phi3ForCausalLM"],
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=200064,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        partial_rotary_factor=0.75,
        rope_theta=10000.0,
        rope_scaling=dict(type="longrope", short_factor=[1.0] * 48, long_factor=[1.0] * 48),
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=199999,
        eos_token_id=199999,
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
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # HF's rope_scaling dict as sorted items (lists as tuples)
    attention_bias: bool = False  # biases on q, k and v (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    family: str = "llama"  # FAMILIES' values
    qk_norm: bool = False  # an RMSNorm over each query and key head before the rotary embedding (Qwen3, Gemma 3)
    gemma_norms: bool = False  # norms scale by 1 + w in float32; a norm after attention and after the MLP too
    activation: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh"
    embed_scale: float = 1.0  # the embeddings times this (Gemma: sqrt(hidden), rounded to the model's dtype)
    attn_scale: float = 0.0  # the scores' scale (0: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float = 0.0  # scores s -> c * tanh(s / c) (0: none)
    final_softcap: float = 0.0  # logits alike
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window (0: full attention); () = all full
    rotary_dim: int = 0  # dimensions of a head the rotary embedding turns (0: all of them)
    local_rope_theta: float = 0.0  # the sliding layers' own RoPE base, unscaled (Gemma 3; 0: as the others)
    rope_attention_factor: float = 1.0  # cos and sin times this (LongRoPE's attention factor)
    fused_projections: bool = False  # the checkpoint stores qkv_proj and gate_up_proj (Phi-3)
    # mixture of experts (MOE_ARCHITECTURES; 0: a dense model): each sparse layer's MLP is a router [experts,
    # hidden] and num_experts gated MLPs of moe_intermediate_size, each token through its experts_per_token
    # best-scored experts, weighted by their softmax probabilities (renormalized over those k with norm_topk_prob)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()  # the layers whose MLP is dense (intermediate_size) in an MoE model

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @property
    def rotary_width(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def query_scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    @property
    def multimodal(self) -> bool:
        """Whether the checkpoint is an image-text model served text-only (MULTIMODAL_ARCHITECTURES)."""
        return self.architecture in MULTIMODAL_ARCHITECTURES

    def part_rows(self, parts: tuple[str, ...]) -> list[tuple[str, int, int]]:
        """(part, first row, end row) of each canonical module in a fused projection's output rows (q | k | v,
        gate | up): where HF and GGUF fused tensors hold each part."""
        widths = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        rows, start = [], 0
        for part in parts:
            end = start + widths.get(part, self.intermediate_size)
            rows.append((part, start, end))
            start = end
        return rows

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        """The model's shape from an HF config.json's dict (a multimodal one's: its language model's, see
        _text_config); settings the model does not implement, and any setting of the wrong type or out of its range,
        are a ModelLoadError naming them (checkpoint_checks: check_hf_config before anything is computed from them,
        check_arch on the result)."""
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"config.json holds a {type(cfg).__name__}, not a JSON object")
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ModelLoadError(f"architectures = {archs!r}: expected a list of class names")
        arch = archs[0]
        if arch not in FAMILIES:
            raise ModelLoadError(f"unsupported architecture {arch}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        family = FAMILIES[arch]
        if arch in MULTIMODAL_ARCHITECTURES:
            cfg = _text_config(cfg, arch)
        if family == "gemma3":
            cfg = {**GEMMA3_TEXT_DEFAULTS, **cfg}
        check_hf_config(cfg)
        _refuse_unread_settings(cfg, arch, family)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or head_width(cfg["hidden_size"], heads, "hidden_size", "num_attention_heads")
        global_rope, local_rope = _rope_parameters(cfg, family)
        rope_type = global_rope.get("rope_type", global_rope.get("type", "default"))
        allowed = ("default", "llama3", "linear") + (("longrope",) if family == "phi3" else ())
        if rope_type not in allowed:
            raise ModelLoadError(f"unsupported rope_scaling type {rope_type!r} for {arch} (implemented: {allowed})")
        rotary = global_rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        rotary_dim = int(head_dim * rotary)
        max_pos = cfg.get("max_position_embeddings", 4096)
        attention_factor = 1.0
        if rope_type == "longrope":
            max_pos, attention_factor = longrope_context(global_rope, cfg, max_pos, rotary_dim)
        eos = cfg.get("eos_token_id")
        gemma = family in ("gemma2", "gemma3")
        num_layers = cfg["num_hidden_layers"]
        moe = _moe_fields(cfg, arch, num_layers) if arch in MOE_ARCHITECTURES else {}
        built = cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(global_rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            rope_scaling=tuple(
                sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in global_rope.items() if k != "rope_theta")
            )
            if rope_type != "default"
            else (),
            attention_bias=arch == "Qwen2ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            family=family,
            qk_norm=family in ("qwen3", "gemma3"),
            gemma_norms=gemma,
            activation="gelu_tanh" if gemma else "silu",
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else 1.0,
            attn_scale=cfg["query_pre_attn_scalar"] ** -0.5 if gemma else 0.0,
            attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
            final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
            layer_windows=_layer_windows(cfg, arch, family, num_layers),
            rotary_dim=rotary_dim if rotary_dim != head_dim else 0,
            local_rope_theta=float(local_rope.get("rope_theta", 0.0)) if local_rope else 0.0,
            rope_attention_factor=attention_factor,
            fused_projections=family == "phi3",
            **moe,
        )
        check_arch(built, HF_NAMES)
        return built


def _moe_fields(cfg: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """ModelArch's mixture-of-experts fields as HF reads config.json: Mixtral's experts are intermediate_size wide,
    every layer sparse, the top k always renormalized; Qwen3-MoE's moe_intermediate_size wide, a layer sparse unless
    it is in mlp_only_layers or (its index + 1) is not a multiple of decoder_sparse_step, renormalized with
    norm_topk_prob (HF's default: false)."""
    dense: tuple[int, ...] = ()
    if arch == "MixtralForCausalLM":
        experts, k = cfg.get("num_local_experts", 8), cfg.get("num_experts_per_tok", 2)
        width, norm = cfg["intermediate_size"], True
    else:
        named = {key: cfg[key] for key in ("num_experts", "num_local_experts") if cfg.get(key) is not None}
        if len(set(map(repr, named.values()))) > 1:  # the hub's key, and transformers 5's name for it
            raise ModelLoadError(
                f"num_experts {named['num_experts']} and num_local_experts {named['num_local_experts']} differ"
            )
        experts, k = next(iter(named.values()), 128), cfg.get("num_experts_per_tok", 8)
        width, norm = cfg.get("moe_intermediate_size", 768), cfg.get("norm_topk_prob", False)
        step, only = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
        check_value(norm, "norm_topk_prob", bool)
        check_int(step, "decoder_sparse_step", Int(high=MAX_LAYERS))
        if not isinstance(only, list) or not all(type(i) is int and 0 <= i < num_layers for i in only):
            raise ModelLoadError(f"mlp_only_layers = {only!r}: expected a list of layer indices below {num_layers}")
        dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    for key, value in (("experts", experts), ("experts per token", k), ("expert width", width)):
        check_int(value, key, Int())
    if k > experts:
        raise ModelLoadError(f"num_experts_per_tok {k} is more than the {experts} experts")
    return dict(
        num_experts=experts, experts_per_token=k, moe_intermediate_size=width, norm_topk_prob=norm, dense_layers=dense
    )


def _text_config(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """A multimodal config.json's language model settings, as transformers reads them: text_config (absent: all
    defaults), with the top level's bos_token_id and eos_token_id where it sets them (GenerationConfig.from_model_config
    takes the top level's, text_config's only where the top level has none). Whether the head is tied differs between
    transformers versions: 5.x reads the top level's tie_word_embeddings (PreTrainedModel.get_expanded_tied_weights_keys
    on the whole model's config), 4.5x text_config's (get_text_config(decoder=True)); both default to true, and a
    config where the two differ is refused rather than served as one of them."""
    text = cfg.get("text_config") or {}
    if not isinstance(text, dict):
        raise ModelLoadError(f"{arch} config.json: text_config must be an object, got {type(text).__name__}")
    top_tie, text_tie = cfg.get("tie_word_embeddings", True), text.get("tie_word_embeddings", True)
    if bool(top_tie) != bool(text_tie):
        raise ModelLoadError(
            f"{arch} config.json: tie_word_embeddings is {top_tie} but text_config's is {text_tie} (absent: true); "
            "transformers 5 ties the output head by the first, 4.5x by the second: set both to the same value"
        )
    merged = {**text, "architectures": [arch], "tie_word_embeddings": bool(top_tie)}
    for key in ("bos_token_id", "eos_token_id"):
        if cfg.get(key) is not None:
            merged[key] = cfg[key]
    return merged


def _rope_parameters(cfg: dict[str, Any], family: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the global layers' RoPE parameters, Gemma 3's sliding layers' or None): HF's rope_scaling / rope_theta
    (config.json as the hub ships it) or transformers 5's rope_parameters, nested per layer type for Gemma 3."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        local = params.get("sliding_attention")
        if local and local.get("rope_type", local.get("type", "default")) != "default":
            raise ModelLoadError(f"RoPE scaling on the sliding-window layers is not implemented: {local}")
        if family == "gemma3":  # Gemma3TextConfig.convert_rope_params_to_dict: the sliding layers' base by default
            local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0), **(local or {})}
        return dict(params.get("full_attention") or {}), local
    scaling = dict(cfg.get("rope_scaling") or params)
    if "rope_theta" in cfg and "rope_theta" not in scaling:
        scaling["rope_theta"] = cfg["rope_theta"]
    original = cfg.get("original_max_position_embeddings")  # Phi-3's config.json holds LongRoPE's at its top level
    if scaling.get("rope_type", scaling.get("type")) == "longrope" and original is not None:
        scaling.setdefault("original_max_position_embeddings", original)
    local = None
    if family == "gemma3":
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    return scaling, local


def longrope_context(rope: dict[str, Any], cfg: dict[str, Any], max_pos: int, rotary_dim: int) -> tuple[int, float]:
    """LongRoPE (Phi-3): (the context, capped at original_max_position_embeddings, where the short factors apply,
    and the attention factor that scales cos and sin, as HF computes it). HF switches to the long factors for a
    whole forward pass once any position passes the original length, which changes the keys already cached; the
    context is capped instead so that every position is rotated as HF rotates it."""
    original = rope.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if not original or original < 2:  # its logarithm divides below
        raise ModelLoadError(f"longrope scaling with original_max_position_embeddings {original!r}: expected 2 or more")
    if len(rope.get("short_factor") or ()) != rotary_dim // 2:
        raise ModelLoadError(f"longrope short_factor must hold {rotary_dim // 2} values (the rotary dimensions / 2)")
    factor = rope.get("factor") or max_pos / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return min(max_pos, original), float(attention)


def _layer_windows(cfg: dict[str, Any], arch: str, family: str, num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), from layer_types where config.json has them, else from
    each family's own rule (HF's): Gemma 2 every other layer from the first, Gemma 3 all but every sixth, Qwen's
    the layers from max_window_layers on with use_sliding_window, Mistral and Phi-3 every layer."""
    window = cfg.get("sliding_window") or 0
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
            raise ModelLoadError(f"layer_types {types!r}: expected full_attention or sliding_attention per layer")
        if "sliding_attention" in types and not window:
            raise ModelLoadError("layer_types names sliding_attention layers but sliding_window is not set")
        windows = [window if t == "sliding_attention" else 0 for t in types]
    elif not window:
        windows = [0] * num_layers
    elif family == "gemma2":
        windows = [window if i % 2 == 0 else 0 for i in range(num_layers)]
    elif family == "gemma3":
        pattern = cfg.get("sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
        windows = [window if (i + 1) % pattern else 0 for i in range(num_layers)]
    elif family == "qwen3" or arch == "Qwen2ForCausalLM":
        first = cfg.get("max_window_layers", 0) if cfg.get("use_sliding_window") else num_layers
        windows = [window if i >= first else 0 for i in range(num_layers)]
    else:
        windows = [window] * num_layers
    return tuple(windows) if any(windows) else ()


def _refuse_unread_settings(cfg: dict[str, Any], arch: str, family: str) -> None:
    """config.json settings that change these architectures' forward pass and that the model does not implement
    are a start-up error naming them: loading without them would serve another model, silently."""
    gemma = family in ("gemma2", "gemma3")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
    expected = "gelu_pytorch_tanh" if gemma else "silu"
    if act != expected:
        raise ModelLoadError(f"{arch} with hidden_act {act!r}: only {expected} is implemented for it")
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{arch} with mlp_bias true: MLP biases are not implemented")
    if arch != "Qwen2ForCausalLM" and cfg.get("attention_bias"):
        raise ModelLoadError(f"{arch} with attention_bias true: attention biases are not implemented for it")
    rotary = cfg.get("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    if rotary != 1.0 and family != "phi3":
        raise ModelLoadError(
            f"{arch} with partial_rotary_factor {rotary!r}: only full rotary embeddings are implemented for it"
        )
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{arch} with use_bidirectional_attention: only causal attention is implemented")
    if gemma and not cfg.get("query_pre_attn_scalar"):
        raise ModelLoadError(f"{arch} without query_pre_attn_scalar: the attention scale is not known")
    if not gemma and (cfg.get("attn_logit_softcapping") or cfg.get("final_logit_softcapping")):
        raise ModelLoadError(f"{arch} with logit soft-capping: implemented for Gemma only")
