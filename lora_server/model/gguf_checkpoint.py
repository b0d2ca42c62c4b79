"""GGUF files: the llama architecture's metadata and tensors. Quantized tensors keep their blocks: Q4_1 and Q8_0 as
the project's int4 and int8 layouts (which are theirs), Q4_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K as raw blocks
(model.gguf_linear); other types are dequantized exactly to float32 by the gguf package."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from lora_server.errors import ModelLoadError
from lora_server.kernels.gguf_reference import GGUF_BLOCKS
from lora_server.model.arch import ModelArch
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


_GGUF_NAMES = {
    "token_embd": "embed",
    "output_norm": "norm",
    "output": "lm_head",
    "rope_freqs": "rope_freqs",
    "attn_norm": "attn_norm",
    "ffn_norm": "mlp_norm",
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


# GGUF general.architecture -> the HF architecture it was converted from
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def gguf_arch(reader) -> ModelArch:
    """ModelArch from GGUF metadata: llama, qwen2 (q/k/v biases), qwen3 (per-head q/k norms) files."""
    name = _gguf_field(reader, "general.architecture")
    if name not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {name!r} is not supported ({', '.join(GGUF_ARCHITECTURES)})")
    f = lambda key, default=None: _gguf_field(reader, f"{name}.{key}", default)  # noqa: E731
    heads = f("attention.head_count")
    hidden = f("embedding_length")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    scaling: tuple[tuple[str, object], ...] = ()
    rope_scaling = f("rope.scaling.type")
    if rope_scaling == "linear":
        scaling = (("factor", f("rope.scaling.factor")), ("rope_type", "linear"))
    elif rope_scaling not in (None, "none"):
        raise ModelLoadError(f"GGUF {name}.rope.scaling.type {rope_scaling!r} is not implemented (linear only)")
    if f("expert_count"):
        raise ModelLoadError(
            f"GGUF {name}.expert_count {f('expert_count')}: mixture-of-experts models are not implemented"
        )
    rotary, key_length = f("rope.dimension_count"), f("attention.key_length")
    if rotary is not None and key_length is not None and rotary != key_length:
        raise ModelLoadError(
            f"GGUF {name}.rope.dimension_count {rotary} differs from attention.key_length {key_length}: partial "
            "rotary embeddings are not implemented"
        )
    if f("attention.sliding_window"):
        raise ModelLoadError(f"GGUF {name}.attention.sliding_window is set: not read from GGUF files")
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    return ModelArch(
        architecture=GGUF_ARCHITECTURES[name],
        vocab_size=f("vocab_size") or len(tokens.data),
        hidden_size=hidden,
        intermediate_size=f("feed_forward_length"),
        num_layers=f("block_count"),
        num_heads=heads,
        num_kv_heads=f("attention.head_count_kv", heads),
        head_dim=key_length or rotary or hidden // heads,
        rms_norm_eps=float(f("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(f("rope.freq_base", 10000.0)),
        max_position_embeddings=f("context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        rope_scaling=scaling,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
        attention_bias=name == "qwen2",
        family="qwen3" if name == "qwen3" else "llama",
        qk_norm=name == "qwen3",
    )


def unpermute_rope_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (it interleaves each head's two rotary halves) on any row-major array
    whose first axis is the output rows: raw quantized blocks permute the same way since blocks lie within rows."""
    shape = rows.shape
    per_head = shape[0] // n_heads
    return rows.reshape(n_heads, per_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def open_gguf(path: Path) -> Checkpoint:
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch = gguf_arch(reader)
    weights: dict[str, WeightSource] = {}
    unread = []
    for t in reader.tensors:
        canonical = _canonical_gguf_name(t.name, arch)
        if canonical is None:
            unread.append(t.name)
            continue
        kind = t.tensor_type.name
        data = t.data
        # llama.cpp permutes the rows of Q and K for llama files only (its converter's LlamaModel)
        permuted = arch.architecture == "LlamaForCausalLM"
        heads = {"q": arch.num_heads, "k": arch.num_kv_heads}.get(canonical.rsplit(".", 1)[-1]) if permuted else None
        if kind in GGUFBlocksWeight.KINDS:
            source: WeightSource = GGUFBlocksWeight(kind, unpermute_rope_rows(data, heads) if heads else data)
        else:
            if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                try:  # exact: gguf's own dequantization of the blocks to float32
                    data = dequantize(data, t.tensor_type)
                except NotImplementedError as exc:
                    raise ModelLoadError(
                        f"GGUF tensor {t.name} is of type {kind}, which cannot be read: {exc}"
                    ) from exc
            array = np.asarray(data, dtype=np.float32)
            if heads:
                array = unpermute_rope_rows(array, heads)
            source = FloatWeight(functools.partial(tensor_copy, array))
        weights[canonical] = source
    refuse_unread(path, unread)
    return Checkpoint(arch, weights, "gguf", path)


def _canonical_gguf_name(name: str, arch: ModelArch) -> str | None:
    """The canonical name of a GGUF tensor (``blk.N.attn_q.weight`` -> ``layers.N.q``; qwen2's
    ``blk.N.attn_q.bias`` -> ``layers.N.q_bias``; qwen3's ``blk.N.attn_q_norm.weight`` -> ``layers.N.q_norm``);
    None for any other tensor (a bias elsewhere, an expert, a part the architecture lacks)."""
    parts = name.split(".")
    biased = arch.attention_bias and len(parts) == 4 and parts[0] == "blk" and parts[3] == "bias"
    if biased and parts[2] in ("attn_q", "attn_k", "attn_v"):
        return f"layers.{parts[1]}.{parts[2][-1]}_bias"
    if not name.endswith(".weight"):
        return None
    parts = name.removesuffix(".weight").split(".")
    if arch.qk_norm and parts[0] == "blk" and len(parts) == 3 and parts[2] in ("attn_q_norm", "attn_k_norm"):
        return f"layers.{parts[1]}.{parts[2][-6]}_norm"
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_NAMES:
        return f"layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}"
    top_level = parts[0] in ("token_embd", "output_norm", "output", "rope_freqs")
    return _GGUF_NAMES[parts[0]] if len(parts) == 1 and top_level else None
