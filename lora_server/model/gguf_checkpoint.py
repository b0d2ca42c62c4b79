"""GGUF files as llama.cpp's converter (convert_hf_to_gguf.py) writes them: the llama, qwen2, qwen3, gemma2, gemma3
(text) and phi3 architectures' metadata and tensors. Quantized tensors keep their blocks: Q4_1 and Q8_0 as the
project's int4 and int8 layouts (which are theirs), Q4_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K as raw blocks
(model.gguf_linear); other types are dequantized exactly to float32 by the gguf package.

What the converter changes, undone here so that every tensor reaches the model as HF's checkpoint holds it:
llama's Q and K rows are permuted (LlamaModel.permute; no other architecture's); Gemma's norm weights are stored as
w + 1 (Gemma2Model / Gemma3Model.modify_tensors), read back as w; Phi-3's q|k|v and gate|up stay fused in attn_qkv
and ffn_up (split here by rows); Phi-3's LongRoPE factors are the rope_factors_short / rope_factors_long tensors.
What GGUF does not carry is derived as llama.cpp derives it (llama-model.cpp): Gemma's query_pre_attn_scalar
(head_dim; hidden / heads for the 27B shapes), Gemma 2's layer pattern (every other layer sliding), Gemma 3's
(sliding_window_pattern, else 5 sliding layers then a full one) and its local RoPE base (rope.freq_base_swa, else
10000). A metadata key of the gemma2, gemma3 or phi3 architecture that this reader does not know is a start-up error
naming it: serving without it could be another model, silently."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lora_server.errors import ModelLoadError
from lora_server.kernels.gguf_reference import GGUF_BLOCKS
from lora_server.model.arch import ModelArch, longrope_context
from lora_server.model.checkpoint import Checkpoint, FloatWeight, WeightSource, refuse_unread, tensor_copy
from lora_server.model.checkpoint_checks import (
    MAX_LAYERS,
    MAX_POSITIONS,
    POSITIVE,
    SIZE,
    Int,
    Real,
    TensorShapes,
    about,
    check_arch,
    check_gguf_file,
    check_int,
    check_real,
    head_width,
)
from lora_server.model.gguf_linear import GGUFBlockLinear
from lora_server.model.quant import Int4Linear, Int8Linear, QuantLinear


class GGUFBlocksWeight(WeightSource):
    """A quantized tensor kept as its blocks: rows of raw GGUF blocks, uint8 [out, blocks * block_bytes], rows in
    HF order. Q4_1 and Q8_0 become an Int4Linear or Int8Linear (native "int4", "int8"), the types of
    kernels.gguf_reference.GGUF_BLOCKS a GGUFBlockLinear of the blocks as they are (native: the type's name, which
    no --quantization mode is: only "auto" keeps them). Other modes dequantize exactly, then quantize."""

    BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
    KINDS = (*BLOCK_BYTES, *GGUF_BLOCKS)

    def __init__(self, kind: str, raw: np.ndarray) -> None:
        assert kind in self.KINDS, kind
        self.kind = kind
        self.native = {"Q4_1": "int4", "Q8_0": "int8"}.get(kind, kind)
        self.raw = raw

    def _native_linear(self, device: torch.device) -> QuantLinear:
        rows = self.raw.shape[0]
        if self.kind in GGUF_BLOCKS:
            return GGUFBlockLinear(self.kind, torch.from_numpy(np.array(self.raw)).to(device))
        blocks = torch.from_numpy(np.array(self.raw)).to(device).view(rows, -1, self.BLOCK_BYTES[self.kind])
        scales = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)  # [out, groups]
        if self.kind == "Q4_1":
            mins = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
            return Int4Linear(blocks[..., 4:].reshape(rows, -1).contiguous(), scales, mins)
        return Int8Linear(blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1), scales)

    def dense(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._native_linear(device).dequantize(torch.float32).to(dtype)

    def linear(self, mode: str, dtype: torch.dtype, device: torch.device) -> QuantLinear:
        if mode in ("auto", self.native):
            return self._native_linear(device)
        return super().linear(mode, dtype, device)


# GGUF tensor names (llama.cpp's gguf-py constants.TENSOR_NAMES) -> canonical names (model.checkpoint)
_GGUF_TOP_LEVEL = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head", "rope_freqs": "rope_freqs"}
_GGUF_LAYER = {
    "attn_norm": "attn_norm",
    "ffn_norm": "mlp_norm",  # Gemma's pre_feedforward_layernorm too (FFN_PRE_NORM is blk.N.ffn_norm)
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}
_GGUF_QK_NORMS = {"attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}  # Qwen3, Gemma 3
_GGUF_GEMMA_NORMS = {"post_attention_norm": "post_attn_norm", "post_ffw_norm": "post_mlp_norm"}
_GGUF_FUSED = {"attn_qkv": "qkv", "ffn_up": "gate_up"}  # Phi-3: q|k|v, gate|up by rows (split when read)
_FUSED_PARTS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
# tensors read into the ModelArch, not the weights (Phi-3's LongRoPE factors, [rotary / 2] float32 each)
_ROPE_FACTORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


# GGUF general.architecture -> the HF architecture it was converted from
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
MIXTRAL = "MixtralForCausalLM"  # a llama file with experts (llama.cpp's converter writes Mixtral as llama)
# a mixture of experts' tensors (model.moe): the router, and each projection of every expert stacked [E, out, in]
_GGUF_EXPERTS = {
    "ffn_gate_inp": "router",
    "ffn_gate_exps": "experts.gate",
    "ffn_up_exps": "experts.up",
    "ffn_down_exps": "experts.down",
}


def gguf_architecture(architecture: str) -> str:
    """The GGUF general.architecture a ModelArch.architecture was read from."""
    return "llama" if architecture == MIXTRAL else next(k for k, v in GGUF_ARCHITECTURES.items() if v == architecture)


# every {arch}.* key the reader understands for the families whose unknown keys are refused: what the converter's
# Gemma2Model, Gemma3Model (with TextModel.set_gguf_parameters) and Phi3MiniModel write, and llama.cpp reads
_COMMON_KEYS = {
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "vocab_size",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.dimension_count",
    "rope.freq_base",
    "rope.scaling.type",
    "rope.scaling.factor",
    "attention.sliding_window",
}
_KNOWN_KEYS = {
    "gemma2": _COMMON_KEYS | {"attn_logit_softcapping", "final_logit_softcapping"},
    "gemma3": _COMMON_KEYS
    | {"attn_logit_softcapping", "final_logit_softcapping", "attention.sliding_window_pattern", "rope.freq_base_swa"},
    "phi3": _COMMON_KEYS | {"rope.scaling.original_context_length", "rope.scaling.attn_factor"},
}
# llama.cpp's LLM_TYPE_27B layer counts, whose attention scale is (hidden / heads) ** -0.5 instead of head_dim's
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_SWA_PERIOD = 6  # llama.cpp's default for gemma3 files without attention.sliding_window_pattern
_GEMMA2_SLIDING_WINDOW = 4096  # llama.cpp's default for gemma2 files without attention.sliding_window


class _Meta:
    """One GGUF file's ``{arch}.*`` metadata: get (a default where absent) and require (absent: a start-up error)."""

    def __init__(self, reader, name: str) -> None:
        self.reader, self.name = reader, name

    def get(self, key: str, default=None):
        return _gguf_field(self.reader, f"{self.name}.{key}", default)

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"GGUF {self.name}.{key} is missing: the {self.name} architecture needs it")
        return value

    def size(self, key: str, default: int | None = None, spec: Int = SIZE, required: bool = False):
        """An integer key within ``spec`` (absent: ``default``, or a start-up error where ``required``)."""
        value = self.require(key) if required else self.get(key)
        return default if value is None else check_int(value, f"GGUF {self.name}.{key}", spec)

    def real(self, key: str, default: float | None = None, spec: Real = POSITIVE, required: bool = False):
        """A finite real key within ``spec`` (absent: ``default``, or a start-up error where ``required``)."""
        value = self.require(key) if required else self.get(key)
        return default if value is None else check_real(value, f"GGUF {self.name}.{key}", spec)


def gguf_names(name: str) -> dict[str, str]:
    """ModelArch field -> the {name}.* key that gives it, for messages (checkpoint_checks.check_arch)."""
    keys = dict(
        vocab_size="vocab_size",
        hidden_size="embedding_length",
        intermediate_size="feed_forward_length",
        num_layers="block_count",
        num_heads="attention.head_count",
        num_kv_heads="attention.head_count_kv",
        head_dim="attention.key_length",
        rms_norm_eps="attention.layer_norm_rms_epsilon",
        rope_theta="rope.freq_base",
        max_position_embeddings="context_length",
        rotary_dim="rope.dimension_count",
        rope_scaling="rope.scaling",
        attn_softcap="attn_logit_softcapping",
        final_softcap="final_logit_softcapping",
        local_rope_theta="rope.freq_base_swa",
        num_experts="expert_count",
        moe_intermediate_size="expert_feed_forward_length" if name == "qwen3moe" else "feed_forward_length",
    )
    return {field: f"GGUF {name}.{key}" for field, key in keys.items()}


RACY_S = 2.0  # a file changed this recently may change again within its mtime's tick


def gguf_reader(path: Path):
    """gguf's reader of a file whose layout checkpoint_checks.check_gguf_file passed. The last two files' readers
    are kept, each for one version of its file (device, inode, size, mtime): the tokenizer and the weights read the
    same file, as does an engine built again in the same process, and building a reader parses every token of the
    vocabulary one by one (about 2 s for SmolLM2's 49,152, a third of a server's start). A file changed within
    the last 2 s is read again each time (git's racy-file rule: a rewrite within the clock's tick keeps its mtime)."""
    stat = os.stat(path)
    if time.time() - stat.st_mtime < RACY_S:
        return _reader.__wrapped__(Path(path))
    return _reader(Path(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _reader(path: Path, *stamp: int):
    from gguf import GGUFReader

    check_gguf_file(path)
    try:
        return GGUFReader(str(path))
    except (ValueError, KeyError, IndexError) as exc:  # what gguf's reader raises on a malformed file
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def read_gguf(path: Path) -> tuple[Any, ModelArch]:
    """(gguf's reader, the ModelArch) of a GGUF file, each checked: its layout, its metadata's types, ranges and
    relations, its tokenizer arrays against each other and the vocabulary. Errors name the file."""
    reader = gguf_reader(path)
    with about(path):
        arch = gguf_arch(reader)
        _check_tokenizer_metadata(reader, arch.vocab_size)
    return reader, arch


def gguf_arch(reader) -> ModelArch:
    """ModelArch from GGUF metadata: llama, qwen2 (q/k/v biases), qwen3 (per-head q/k norms), gemma2, gemma3 and
    phi3 files; the same ModelArch as ModelArch.from_hf_config gives the HF config the file was converted from."""
    name = _gguf_field(reader, "general.architecture")
    if not isinstance(name, str) or name not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {name!r} is not supported ({', '.join(GGUF_ARCHITECTURES)})")
    meta = _Meta(reader, name)
    if name in _KNOWN_KEYS:
        _refuse_unknown_keys(reader, name)
    fields = _common_fields(reader, meta)
    if name in ("gemma2", "gemma3"):
        fields.update(_gemma_fields(meta, fields))
    elif name == "phi3":
        fields.update(_phi3_fields(reader, meta, fields))
    else:
        fields.update(_llama_fields(meta, fields))
    arch = ModelArch(**fields)
    check_arch(arch, gguf_names(name))
    return arch


def _refuse_unknown_keys(reader, name: str) -> None:
    prefix = f"{name}."
    unknown = sorted(k for k in reader.fields if k.startswith(prefix) and k[len(prefix) :] not in _KNOWN_KEYS[name])
    if unknown:
        raise ModelLoadError(
            f"GGUF metadata {', '.join(unknown)}: not read for the {name} architecture (it may change the forward "
            "pass, which this server would then not compute)"
        )


def _common_fields(reader, meta: _Meta) -> dict:
    """The fields every architecture reads alike (head_dim and the family's own fields come after)."""
    name = meta.name
    # what the arithmetic below and the per-layer lists need are required and checked first
    heads = meta.size("attention.head_count", required=True)
    hidden = meta.size("embedding_length", required=True)
    layers = meta.size("block_count", spec=Int(high=MAX_LAYERS), required=True)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = meta.size("vocab_size")
    names = {t.name for t in reader.tensors}
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    llama_family = name not in _KNOWN_KEYS  # llama.cpp requires the norm epsilon of gemma2, gemma3, phi3 files
    eps = meta.real("attention.layer_norm_rms_epsilon", 1e-5, required=not llama_family)
    experts = _expert_fields(meta, layers)
    return dict(
        **experts,
        architecture=MIXTRAL if name == "llama" and experts else GGUF_ARCHITECTURES[name],
        vocab_size=vocab if vocab is not None or tokens is None else len(tokens.data),
        hidden_size=hidden,
        intermediate_size=meta.size("feed_forward_length"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=meta.size("attention.head_count_kv", heads),
        rms_norm_eps=eps,
        rope_theta=meta.real("rope.freq_base", 10000.0),
        max_position_embeddings=meta.size("context_length", 4096, Int(high=MAX_POSITIONS)),
        tie_word_embeddings="output.weight" not in names,
        rope_scaling=_rope_scaling(meta),
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
    )


def _expert_fields(meta: _Meta, layers: int) -> dict:
    """ModelArch's mixture-of-experts fields as llama.cpp reads them (llama with expert_count: Mixtral; qwen3moe):
    every layer sparse, a softmax over the experts, the top expert_used_count renormalized (build_moe_ffn's norm_w,
    which both set), experts expert_feed_forward_length wide (llama's: feed_forward_length). What else llama.cpp
    reads of its experts and these files' converters never write is refused by name; {} for a dense file."""
    name = meta.name
    count = meta.size("expert_count", 0, Int(low=0))
    if not count:
        if name == "qwen3moe":
            raise ModelLoadError("GGUF qwen3moe.expert_count is missing: the qwen3moe architecture needs it")
        return {}
    if name not in ("llama", "qwen3moe"):
        raise ModelLoadError(f"GGUF {name}.expert_count {count}: mixture-of-experts {name} files are not implemented")
    for key, allowed in (
        ("expert_shared_count", (0,)),
        ("expert_group_count", (0, 1)),
        ("expert_weights_scale", (0.0, 1.0)),
        ("expert_gating_func", (1,)),  # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        ("expert_weights_norm", (True,)),
    ):
        value = meta.get(key)
        if value is not None and value not in allowed:
            raise ModelLoadError(f"GGUF {name}.{key} {value!r}: not implemented (only {allowed})")
    width_key = "expert_feed_forward_length" if name == "qwen3moe" else "feed_forward_length"
    used = meta.size("expert_used_count", required=True, spec=Int(high=count))
    return dict(
        num_experts=count,
        experts_per_token=used,
        moe_intermediate_size=meta.size(width_key, required=True),
        norm_topk_prob=True,
        dense_layers=(),
    )


def _rope_scaling(meta: _Meta) -> tuple[tuple[str, object], ...]:
    """HF's rope_scaling items of the (global) rotary embedding: linear, none; phi3's longrope comes from its
    factor tensors (_longrope)."""
    kind = meta.get("rope.scaling.type")
    if kind == "linear":
        return (("factor", meta.real("rope.scaling.factor")), ("rope_type", "linear"))
    if kind in (None, "none") or (kind == "longrope" and meta.name == "phi3"):
        return ()
    raise ModelLoadError(f"GGUF {meta.name}.rope.scaling.type {kind!r} is not implemented (linear only)")


def _llama_fields(meta: _Meta, common: dict) -> dict:
    """llama, qwen2, qwen3: head_dim from attention.key_length; full rotary and full attention only."""
    name = meta.name
    rotary, key_length = meta.size("rope.dimension_count"), meta.size("attention.key_length")
    if rotary is not None and key_length is not None and rotary != key_length:
        raise ModelLoadError(
            f"GGUF {name}.rope.dimension_count {rotary} differs from attention.key_length {key_length}: partial "
            "rotary embeddings are not implemented"
        )
    if meta.get("attention.sliding_window"):
        raise ModelLoadError(f"GGUF {name}.attention.sliding_window is set: not read from GGUF files")
    return dict(
        head_dim=key_length or rotary or _head_width(meta, common),
        attention_bias=name == "qwen2",
        family="qwen3" if name in ("qwen3", "qwen3moe") else "llama",
        qk_norm=name in ("qwen3", "qwen3moe"),
    )


def _head_dim(meta: _Meta, common: dict) -> int:
    """attention.key_length (llama.cpp's n_embd_head_k: hidden / heads where absent), equal to value_length."""
    head_dim = meta.size("attention.key_length") or _head_width(meta, common)
    value_length = meta.size("attention.value_length", head_dim)
    if value_length != head_dim:
        raise ModelLoadError(
            f"GGUF {meta.name}.attention.value_length {value_length} differs from the key length {head_dim}: "
            "not implemented"
        )
    return head_dim


def _head_width(meta: _Meta, common: dict) -> int:
    """hidden / heads (llama.cpp's n_embd_head_k where the file gives no key length)."""
    hidden, heads = f"GGUF {meta.name}.embedding_length", f"GGUF {meta.name}.attention.head_count"
    return head_width(common["hidden_size"], common["num_heads"], hidden, heads)


def _gemma_fields(meta: _Meta, common: dict) -> dict:
    """Gemma 2 and Gemma 3 as llama.cpp reads them (llama-model.cpp, LLM_ARCH_GEMMA2 / LLM_ARCH_GEMMA3): GELU-tanh,
    1 + w norms, embeddings times sqrt(hidden), scores scaled by llama.cpp's f_attention_scale, the sliding layers'
    windows; Gemma 3's per-head q/k norms and local RoPE base."""
    name, layers, gemma3 = meta.name, common["num_layers"], meta.name == "gemma3"
    head_dim = _head_dim(meta, common)
    rotary = meta.size("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ModelLoadError(
            f"GGUF {name}.rope.dimension_count {rotary} differs from head_dim {head_dim}: not implemented"
        )
    # GGUF has no query_pre_attn_scalar: llama.cpp's scale is head_dim ** -0.5, (hidden / heads) ** -0.5 for 27B
    scalar = common["hidden_size"] // common["num_heads"] if layers == _GEMMA_27B_LAYERS[name] else head_dim
    window = meta.size("attention.sliding_window", None if gemma3 else _GEMMA2_SLIDING_WINDOW, Int(low=0))
    if gemma3 and not window:
        raise ModelLoadError("GGUF gemma3.attention.sliding_window is missing or 0: llama.cpp requires it for gemma3")
    sliding = _gemma3_sliding_layers(meta, layers) if gemma3 else [i % 2 == 0 for i in range(layers)]
    windows = tuple(window if s else 0 for s in sliding) if window else ()
    return dict(
        head_dim=head_dim,
        family=name,
        qk_norm=gemma3,
        gemma_norms=True,
        activation="gelu_tanh",
        embed_scale=common["hidden_size"] ** 0.5,
        attn_scale=scalar**-0.5,
        # llama.cpp's defaults (llama_hparams) where a gemma2 file lacks them: 50 and 30, Gemma2Config's too. A gemma3
        # file's caps (the converter writes the final one where config.json sets it) apply as HF applies them;
        # llama.cpp's gemma3 graph reads neither
        attn_softcap=meta.real("attn_logit_softcapping", 0.0 if gemma3 else 50.0, Real(closed=True)),
        final_softcap=meta.real("final_logit_softcapping", 0.0 if gemma3 else 30.0, Real(closed=True)),
        layer_windows=windows if any(windows) else (),
        local_rope_theta=meta.real("rope.freq_base_swa", 10000.0) if gemma3 else 0.0,  # unscaled, as HF's
    )


def _gemma3_sliding_layers(meta: _Meta, layers: int) -> list[bool]:
    """Whether each layer slides: attention.sliding_window_pattern per layer (bools) or as llama.cpp's period
    (llama_hparams::set_swa_pattern: layer i slides iff i % n < n - 1; 0: all), default 6 (HF's rule alike)."""
    pattern = meta.get("attention.sliding_window_pattern", _GEMMA3_SWA_PERIOD)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ModelLoadError(
                f"GGUF gemma3.attention.sliding_window_pattern holds {len(pattern)} values for {layers} layers"
            )
        return [bool(p) for p in pattern]
    check_int(pattern, "GGUF gemma3.attention.sliding_window_pattern", Int(low=0, high=MAX_LAYERS))
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]


def _phi3_fields(reader, meta: _Meta, common: dict) -> dict:
    """Phi-3 / Phi-4-mini: fused projections, partial rotary (rope.dimension_count), LongRoPE from the factor
    tensors, a sliding window on every layer. llama.cpp disables Phi-3's window (llama_model_phi3: "Phi SWA is
    currently disabled"); HF applies it, and so does this server, as for the HF checkpoint."""
    head_dim = _head_dim(meta, common)
    rotary = meta.size("rope.dimension_count", head_dim)
    if rotary > head_dim or rotary % 2:
        raise ModelLoadError(f"GGUF phi3.rope.dimension_count {rotary}: not an even width within head_dim {head_dim}")
    window = meta.size("attention.sliding_window", 0, Int(low=0))
    fields = dict(
        head_dim=head_dim,
        family="phi3",
        fused_projections=True,
        rotary_dim=0 if rotary == head_dim else rotary,
        layer_windows=(window,) * common["num_layers"] if window else (),
    )
    factors = {_ROPE_FACTORS[t.name]: _factor_values(t) for t in reader.tensors if t.name in _ROPE_FACTORS}
    kind = meta.get("rope.scaling.type")
    if factors and kind not in (None, "none", "longrope"):
        raise ModelLoadError(f"GGUF phi3 holds LongRoPE factor tensors and rope.scaling.type {kind!r}: which applies?")
    if factors or kind == "longrope":
        fields.update(_longrope(meta, common, factors, rotary))
    return fields


def _longrope(meta: _Meta, common: dict, factors: dict[str, tuple[float, ...]], rotary: int) -> dict:
    """LongRoPE as arch.ModelArch reads HF's: the context capped where the short factors apply, cos and sin times
    the file's rope.scaling.attn_factor (the converter's: HF's formula over context_length / original)."""

    missing = [f"{name} tensor" for name, key in _ROPE_FACTORS.items() if key not in factors]
    if missing:
        raise ModelLoadError(f"GGUF phi3 LongRoPE without its {' and '.join(missing)}")
    if len(factors["long_factor"]) != rotary // 2:
        raise ModelLoadError(f"GGUF phi3 rope_factors_long must hold {rotary // 2} values (the rotary dimensions / 2)")
    original = meta.size("rope.scaling.original_context_length", spec=Int(high=MAX_POSITIONS), required=True)
    rope = {"original_max_position_embeddings": original, "short_factor": factors["short_factor"]}
    if meta.get("rope.scaling.attn_factor") is not None:
        rope["attention_factor"] = meta.real("rope.scaling.attn_factor")
    context, attention = longrope_context(rope, {}, common["max_position_embeddings"], rotary)
    scaling = dict(factors, original_max_position_embeddings=original, rope_type="longrope")
    return dict(
        max_position_embeddings=context, rope_attention_factor=attention, rope_scaling=tuple(sorted(scaling.items()))
    )


def _factor_values(t) -> tuple[float, ...]:
    """A LongRoPE factor tensor's values: float32 or float16, one dimension (checked as finite and positive with
    the rest of the RoPE parameters, checkpoint_checks.check_arch)."""
    from gguf import GGMLQuantizationType

    if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or len(t.shape) != 1:
        raise ModelLoadError(f"GGUF tensor {t.name}: expected one dimension of float32 or float16 factors")
    return tuple(float(x) for x in t.data)


# tokenizer.ggml.* arrays -> the value types their elements may have (gguf.GGUFValueType names)
_TOKENIZER_ARRAYS = {
    "tokenizer.ggml.tokens": ("STRING",),
    "tokenizer.ggml.merges": ("STRING",),
    "tokenizer.ggml.token_type": ("INT8", "UINT8", "INT16", "UINT16", "INT32", "UINT32", "INT64", "UINT64"),
    "tokenizer.ggml.scores": ("FLOAT32", "FLOAT64"),
}


def _check_tokenizer_metadata(reader, vocab_size: int) -> None:
    """The tokenizer arrays the engine's tokenizer reads, where the file has them: of their element types, a token
    type and a score per token, no more tokens than the embedding's rows (a token past them could not be embedded)."""
    from gguf import GGUFValueType

    model = reader.fields.get("tokenizer.ggml.model")
    if model is not None and model.types != [GGUFValueType.STRING]:
        raise ModelLoadError("GGUF tokenizer.ggml.model: expected a string")
    counts = {}
    for key, kinds in _TOKENIZER_ARRAYS.items():
        field = reader.fields.get(key)
        if field is None:
            continue
        types = [t.name for t in field.types]
        if types[:1] != ["ARRAY"] or (len(field.data) and types[1] not in kinds):
            raise ModelLoadError(f"GGUF {key}: expected an array of {' or '.join(kinds)} values, got {types}")
        counts[key] = len(field.data)
    tokens = counts.get("tokenizer.ggml.tokens")
    if tokens is not None and tokens > vocab_size:
        raise ModelLoadError(
            f"GGUF tokenizer.ggml.tokens holds {tokens} tokens, more than the vocabulary's {vocab_size}"
        )
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if tokens is not None and key in counts and counts[key] != tokens:
            raise ModelLoadError(f"GGUF {key} holds {counts[key]} values for {tokens} tokens")


def unpermute_rope_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (it interleaves each head's two rotary halves) on any row-major array
    whose first axis is the output rows: raw quantized blocks permute the same way since blocks lie within rows."""
    shape = rows.shape
    per_head = shape[0] // n_heads
    return rows.reshape(n_heads, per_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def open_gguf(path: Path) -> Checkpoint:
    """The file's tensors (each shape, from its tensor info, checked against the ModelArch before any is read)."""
    reader, arch = read_gguf(path)
    shapes = TensorShapes(arch, gguf_names(reader_architecture(reader)))
    weights: dict[str, WeightSource] = {}
    unread = []
    for t in reader.tensors:
        if arch.fused_projections and t.name in _ROPE_FACTORS:
            continue  # read into the arch (LongRoPE)
        canonical = _canonical_gguf_name(t.name, arch)
        if canonical is None:
            unread.append(t.name)
            continue
        with about(path):
            shapes.check(canonical, tuple(int(d) for d in reversed(t.shape)), t.name)  # ggml's dims: columns first
        sources = _tensor_sources(t, canonical, arch)
        twice = sorted(set(sources) & set(weights))
        if twice:  # Phi-3's attn_qkv beside attn_q, attn_k, attn_v, say
            raise ModelLoadError(f"{path} holds {', '.join(twice)} twice (the second time in {t.name})")
        weights.update(sources)
    refuse_unread(path, unread)
    return Checkpoint(arch, weights, "gguf", path)


def reader_architecture(reader) -> str:
    """The file's general.architecture (gguf_arch has checked it)."""
    return _gguf_field(reader, "general.architecture")


def _tensor_sources(t, canonical: str, arch: ModelArch) -> dict[str, WeightSource]:
    """The weights one GGUF tensor holds, by canonical name: Gemma's norms as w (the file's w + 1, less 1, in
    float32), a fused projection's parts by rows, llama's Q and K rows unpermuted, the rest as they are."""
    prefix, module = canonical.rpartition(".")[::2]
    if prefix.endswith(".experts"):  # every expert's [out, in] stacked: expert e's rows are data[e]
        return {f"{prefix}.{e}.{module}": _weight_source(t, t.data[e]) for e in range(arch.num_experts)}
    if arch.gemma_norms and module.endswith("norm"):
        shifted = _float_array(t) - np.float32(1.0)
        return {canonical: FloatWeight(functools.partial(tensor_copy, shifted))}
    if module in _FUSED_PARTS:  # its rows checked against the parts' (open_gguf)
        parts = arch.part_rows(_FUSED_PARTS[module])
        return {f"{prefix}.{part}": _weight_source(t, t.data[start:end]) for part, start, end in parts}
    # llama.cpp permutes the rows of Q and K for llama files only (its converter's LlamaModel)
    permuted = arch.architecture in ("LlamaForCausalLM", MIXTRAL)
    heads = {"q": arch.num_heads, "k": arch.num_kv_heads}.get(module) if permuted else None
    data = unpermute_rope_rows(t.data, heads) if heads else t.data
    return {canonical: _weight_source(t, data)}


def _weight_source(t, rows: np.ndarray) -> WeightSource:
    """``rows`` of tensor t's data (raw blocks [rows, bytes] or values [rows, ...]) as a WeightSource."""
    kind = t.tensor_type.name
    if kind in GGUFBlocksWeight.KINDS:
        return GGUFBlocksWeight(kind, rows)
    return FloatWeight(functools.partial(tensor_copy, _float_array(t, rows)))


def _float_array(t, data: np.ndarray | None = None) -> np.ndarray:
    """Tensor t's values (or ``data``, rows of them) as float32: exact, by gguf's own dequantization."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = t.data if data is None else data
    if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        try:
            data = dequantize(data, t.tensor_type)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"GGUF tensor {t.name} is of type {t.tensor_type.name}, which cannot be read: {exc}"
            ) from exc
    return np.asarray(data, dtype=np.float32)


def _layer_names(arch: ModelArch) -> dict[str, str]:
    """GGUF layer tensor names (blk.N.<name>.weight) -> canonical, for the architecture's parts only."""
    names = dict(_GGUF_LAYER)
    if arch.fused_projections:  # Phi-3's ffn_up is gate|up; llama.cpp reads attn_qkv or attn_q, attn_k, attn_v
        del names["ffn_gate"]
        names.update(_GGUF_FUSED)
    if arch.gemma_norms:
        names.update(_GGUF_GEMMA_NORMS)
    if arch.qk_norm:
        names.update(_GGUF_QK_NORMS)
    if arch.num_experts:  # every layer sparse (_expert_fields): no dense MLP
        for dense in ("ffn_gate", "ffn_up", "ffn_down"):
            del names[dense]
        names.update(_GGUF_EXPERTS)
    return names


def _canonical_gguf_name(name: str, arch: ModelArch) -> str | None:
    """The canonical name of a GGUF tensor (``blk.N.attn_q.weight`` -> ``layers.N.q``; qwen2's
    ``blk.N.attn_q.bias`` -> ``layers.N.q_bias``; ``blk.N.attn_q_norm.weight`` -> ``layers.N.q_norm``; Phi-3's
    ``blk.N.attn_qkv.weight`` -> ``layers.N.qkv``, split when read); None for any other tensor (a bias elsewhere,
    an expert, a part the architecture lacks)."""
    parts = name.split(".")
    biased = arch.attention_bias and len(parts) == 4 and parts[0] == "blk" and parts[3] == "bias"
    if biased and parts[2] in ("attn_q", "attn_k", "attn_v"):
        return f"layers.{parts[1]}.{parts[2][-1]}_bias"
    if not name.endswith(".weight"):
        return None
    parts = name.removesuffix(".weight").split(".")
    layer_names = _layer_names(arch)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in layer_names:
        return f"layers.{parts[1]}.{layer_names[parts[2]]}"
    # rope_freqs (llama 3's factors) belongs to the llama family's files only
    top_level = {k: v for k, v in _GGUF_TOP_LEVEL.items() if k != "rope_freqs" or arch.family in ("llama", "qwen3")}
    return top_level.get(parts[0]) if len(parts) == 1 else None
