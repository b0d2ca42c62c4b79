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
from pathlib import Path

import numpy as np
import torch

from lora_server.errors import ModelLoadError
from lora_server.kernels.gguf_reference import GGUF_BLOCKS
from lora_server.model.arch import ModelArch, longrope_context
from lora_server.model.checkpoint import Checkpoint, FloatWeight, WeightSource, refuse_unread, tensor_copy
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
}
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


def gguf_arch(reader) -> ModelArch:
    """ModelArch from GGUF metadata: llama, qwen2 (q/k/v biases), qwen3 (per-head q/k norms), gemma2, gemma3 and
    phi3 files; the same ModelArch as ModelArch.from_hf_config gives the HF config the file was converted from."""
    name = _gguf_field(reader, "general.architecture")
    if name not in GGUF_ARCHITECTURES:
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
    return ModelArch(**fields)


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
    if meta.get("expert_count"):
        raise ModelLoadError(
            f"GGUF {name}.expert_count {meta.get('expert_count')}: mixture-of-experts models are not implemented"
        )
    heads = meta.get("attention.head_count")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    llama_family = name not in _KNOWN_KEYS  # llama.cpp requires the norm epsilon of gemma2, gemma3, phi3 files
    eps = (
        meta.get("attention.layer_norm_rms_epsilon", 1e-5)
        if llama_family
        else meta.require("attention.layer_norm_rms_epsilon")
    )
    return dict(
        architecture=GGUF_ARCHITECTURES[name],
        vocab_size=meta.get("vocab_size") or len(tokens.data),
        hidden_size=meta.get("embedding_length"),
        intermediate_size=meta.get("feed_forward_length"),
        num_layers=meta.get("block_count"),
        num_heads=heads,
        num_kv_heads=meta.get("attention.head_count_kv", heads),
        rms_norm_eps=float(eps),
        rope_theta=float(meta.get("rope.freq_base", 10000.0)),
        max_position_embeddings=meta.get("context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        rope_scaling=_rope_scaling(meta),
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
    )


def _rope_scaling(meta: _Meta) -> tuple[tuple[str, object], ...]:
    """HF's rope_scaling items of the (global) rotary embedding: linear, none; phi3's longrope comes from its
    factor tensors (_longrope)."""
    kind = meta.get("rope.scaling.type")
    if kind == "linear":
        return (("factor", meta.get("rope.scaling.factor")), ("rope_type", "linear"))
    if kind in (None, "none") or (kind == "longrope" and meta.name == "phi3"):
        return ()
    raise ModelLoadError(f"GGUF {meta.name}.rope.scaling.type {kind!r} is not implemented (linear only)")


def _llama_fields(meta: _Meta, common: dict) -> dict:
    """llama, qwen2, qwen3: head_dim from attention.key_length; full rotary and full attention only."""
    name = meta.name
    rotary, key_length = meta.get("rope.dimension_count"), meta.get("attention.key_length")
    if rotary is not None and key_length is not None and rotary != key_length:
        raise ModelLoadError(
            f"GGUF {name}.rope.dimension_count {rotary} differs from attention.key_length {key_length}: partial "
            "rotary embeddings are not implemented"
        )
    if meta.get("attention.sliding_window"):
        raise ModelLoadError(f"GGUF {name}.attention.sliding_window is set: not read from GGUF files")
    return dict(
        head_dim=key_length or rotary or common["hidden_size"] // common["num_heads"],
        attention_bias=name == "qwen2",
        family="qwen3" if name == "qwen3" else "llama",
        qk_norm=name == "qwen3",
    )


def _head_dim(meta: _Meta, common: dict) -> int:
    """attention.key_length (llama.cpp's n_embd_head_k: hidden / heads where absent), equal to value_length."""
    head_dim = meta.get("attention.key_length") or common["hidden_size"] // common["num_heads"]
    value_length = meta.get("attention.value_length", head_dim)
    if value_length != head_dim:
        raise ModelLoadError(
            f"GGUF {meta.name}.attention.value_length {value_length} differs from the key length {head_dim}: "
            "not implemented"
        )
    return head_dim


def _gemma_fields(meta: _Meta, common: dict) -> dict:
    """Gemma 2 and Gemma 3 as llama.cpp reads them (llama-model.cpp, LLM_ARCH_GEMMA2 / LLM_ARCH_GEMMA3): GELU-tanh,
    1 + w norms, embeddings times sqrt(hidden), scores scaled by llama.cpp's f_attention_scale, the sliding layers'
    windows; Gemma 3's per-head q/k norms and local RoPE base."""
    name, layers, gemma3 = meta.name, common["num_layers"], meta.name == "gemma3"
    head_dim = _head_dim(meta, common)
    rotary = meta.get("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ModelLoadError(
            f"GGUF {name}.rope.dimension_count {rotary} differs from head_dim {head_dim}: not implemented"
        )
    # GGUF has no query_pre_attn_scalar: llama.cpp's scale is head_dim ** -0.5, (hidden / heads) ** -0.5 for 27B
    scalar = common["hidden_size"] // common["num_heads"] if layers == _GEMMA_27B_LAYERS[name] else head_dim
    window = meta.get("attention.sliding_window", None if gemma3 else _GEMMA2_SLIDING_WINDOW)
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
        attn_softcap=float(meta.get("attn_logit_softcapping", 0.0 if gemma3 else 50.0)),
        final_softcap=float(meta.get("final_logit_softcapping", 0.0 if gemma3 else 30.0)),
        layer_windows=windows if any(windows) else (),
        local_rope_theta=float(meta.get("rope.freq_base_swa", 10000.0)) if gemma3 else 0.0,  # unscaled, as HF's
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
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]


def _phi3_fields(reader, meta: _Meta, common: dict) -> dict:
    """Phi-3 / Phi-4-mini: fused projections, partial rotary (rope.dimension_count), LongRoPE from the factor
    tensors, a sliding window on every layer. llama.cpp disables Phi-3's window (llama_model_phi3: "Phi SWA is
    currently disabled"); HF applies it, and so does this server, as for the HF checkpoint."""
    head_dim = _head_dim(meta, common)
    rotary = meta.get("rope.dimension_count", head_dim)
    if rotary > head_dim or rotary % 2:
        raise ModelLoadError(f"GGUF phi3.rope.dimension_count {rotary}: not an even width within head_dim {head_dim}")
    window = meta.get("attention.sliding_window") or 0
    fields = dict(
        head_dim=head_dim,
        family="phi3",
        fused_projections=True,
        rotary_dim=0 if rotary == head_dim else rotary,
        layer_windows=(window,) * common["num_layers"] if window else (),
    )
    factors = {
        _ROPE_FACTORS[t.name]: tuple(float(x) for x in t.data) for t in reader.tensors if t.name in _ROPE_FACTORS
    }
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
    original = meta.require("rope.scaling.original_context_length")
    rope = {"original_max_position_embeddings": original, "short_factor": factors["short_factor"]}
    if meta.get("rope.scaling.attn_factor") is not None:
        rope["attention_factor"] = float(meta.get("rope.scaling.attn_factor"))
    context, attention = longrope_context(rope, {}, common["max_position_embeddings"], rotary)
    scaling = dict(factors, original_max_position_embeddings=original, rope_type="longrope")
    return dict(
        max_position_embeddings=context, rope_attention_factor=attention, rope_scaling=tuple(sorted(scaling.items()))
    )


def unpermute_rope_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (it interleaves each head's two rotary halves) on any row-major array
    whose first axis is the output rows: raw quantized blocks permute the same way since blocks lie within rows."""
    shape = rows.shape
    per_head = shape[0] // n_heads
    return rows.reshape(n_heads, per_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def open_gguf(path: Path) -> Checkpoint:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = gguf_arch(reader)
    weights: dict[str, WeightSource] = {}
    unread = []
    for t in reader.tensors:
        if arch.fused_projections and t.name in _ROPE_FACTORS:
            continue  # read into the arch (LongRoPE)
        canonical = _canonical_gguf_name(t.name, arch)
        if canonical is None:
            unread.append(t.name)
            continue
        sources = _tensor_sources(t, canonical, arch)
        twice = sorted(set(sources) & set(weights))
        if twice:  # Phi-3's attn_qkv beside attn_q, attn_k, attn_v, say
            raise ModelLoadError(f"{path} holds {', '.join(twice)} twice (the second time in {t.name})")
        weights.update(sources)
    refuse_unread(path, unread)
    return Checkpoint(arch, weights, "gguf", path)


def _tensor_sources(t, canonical: str, arch: ModelArch) -> dict[str, WeightSource]:
    """The weights one GGUF tensor holds, by canonical name: Gemma's norms as w (the file's w + 1, less 1, in
    float32), a fused projection's parts by rows, llama's Q and K rows unpermuted, the rest as they are."""
    prefix, module = canonical.rpartition(".")[::2]
    if arch.gemma_norms and module.endswith("norm"):
        shifted = _float_array(t) - np.float32(1.0)
        return {canonical: FloatWeight(functools.partial(tensor_copy, shifted))}
    if module in _FUSED_PARTS:
        parts = arch.part_rows(_FUSED_PARTS[module])
        if t.data.shape[0] != parts[-1][2]:
            raise ModelLoadError(f"GGUF tensor {t.name} has {t.data.shape[0]} rows, not {parts[-1][2]}")
        return {f"{prefix}.{part}": _weight_source(t, t.data[start:end]) for part, start, end in parts}
    # llama.cpp permutes the rows of Q and K for llama files only (its converter's LlamaModel)
    permuted = arch.architecture == "LlamaForCausalLM"
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
