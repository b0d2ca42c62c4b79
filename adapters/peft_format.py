"""Reading and validating PEFT LoRA adapter directories (adapter_config.json + adapter_model.safetensors): the
config's meaning (which modules, ranks and scalings; what is refused), every tensor's key and shape checked against
it and the base (read_peft_adapter: a PeftAdapter, its weights as stored), and their conversion into per-module
float32 A/B matrices with the scaling folded into B (load_peft_adapter: a LoraAdapter).

Every refusal raises AdapterError with the reason; nothing is loaded or changed when validation fails."""

from __future__ import annotations

import json
import logging
import math
import re
import reprlib
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lora_server.adapters.errors import AdapterError
from lora_server.adapters.lora_types import (
    FUSED_MODULES,
    LLAMA_MODULES,
    BaseShapes,
    LoraAdapter,
    TokenIds,
    VocabLora,
    content_hash,
)
from lora_server.adapters.peft_adapter import PeftAdapter
from lora_server.adapters.peft_experts import RankRule, take_expert_lora
from lora_server.adapters.peft_files import (
    FLOAT_DTYPES,
    FilesIdentity,
    ReadBuffer,
    SafetensorsFile,
    read_file,
    read_file_into,
)

__all__ = [  # the adapter types, importable from here as before they had a module of their own
    "FUSED_MODULES",
    "LLAMA_MODULES",
    "AdapterError",
    "BaseShapes",
    "LoraAdapter",
    "PeftAdapter",
    "TokenIds",
    "VocabLora",
    "content_hash",
    "load_peft_adapter",
    "read_peft_adapter",
]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_F32_MAX = torch.finfo(torch.float32).max
_JSON_TYPES = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}
log = logging.getLogger("lora_server")
# What a config of an unforeseen shape can raise while _plan interprets it; anything else there is a bug.
_MALFORMED = (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RecursionError, re.error)
# The decoder layers' path in the model PEFT wrapped, which its keys (after base_model.model.) and the names a regex
# target_modules matches start with: a text model's; the language model of Gemma 3 multimodal
# (Gemma3ForConditionalGeneration) as transformers names it now, and as older versions did (their checkpoints'
# layout). An adapter's keys say which one it was trained on.
TEXT_LAYERS = "model.layers"
LAYER_PATHS = (TEXT_LAYERS, "model.language_model.layers", "language_model.model.layers")
_KEY = re.compile(
    rf"(?:base_model\.model\.)?({'|'.join(map(re.escape, LAYER_PATHS))})"
    r"\.([0-9]{1,6})\.(self_attn|mlp)\.(\w+_proj)\.(lora_[AB])(?:\.[\w-]+)?\.weight"
)
# DoRA's magnitude of one module: PEFT saves it without the adapter's name or ".weight" (its loader adds them back)
_MAGNITUDE_KEY = re.compile(
    rf"(?:base_model\.model\.)?({'|'.join(map(re.escape, LAYER_PATHS))})"
    r"\.([0-9]{1,6})\.(self_attn|mlp)\.(\w+_proj)\.lora_magnitude_vector(?:\.[\w-]+)?(?:\.weight)?"
)
# A key on a multimodal model's image side: Gemma 3's vision tower or projector, as either transformers names them
_IMAGE_SIDE = re.compile(r"(?:base_model\.model\.)?((?:model\.)?(?:vision_tower|multi_modal_projector)\..+)")


VOCAB_MODULES = ("embed_tokens", "lm_head")  # the embedding and the output head (VocabLora), as PEFT names them
# Their paths in the model PEFT wrapped (what a regex target_modules and rank/alpha patterns match)
VOCAB_PATHS = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}
_EMBED_LORA_KEY = re.compile(r"(?:base_model\.model\.)?model\.embed_tokens\.lora_embedding_([AB])(?:\.[\w-]+)?")
_HEAD_LORA_KEY = re.compile(r"(?:base_model\.model\.)?lm_head\.lora_([AB])(?:\.[\w-]+)?\.weight")
# PEFT saves the base's own embedding and head beside a LoRA on them (save_embedding_layers): the base's weights
_VOCAB_BASE_KEY = re.compile(r"(?:base_model\.model\.)?(model\.embed_tokens|lm_head)\.base_layer\.weight")
_TOKENS_KEY = re.compile(
    r"(?:base_model\.model\.)?(model\.embed_tokens|lm_head)\.token_adapter\.trainable_tokens_delta(?:\.[\w-]+)?"
)
ALL_LINEAR = "all-linear"  # PEFT's target_modules shorthand: every linear layer but the output head
# Every key of PEFT's LoraConfig (peft 0.21) is in one of three groups (docs/adapters.md, "Which PEFT
# configurations are served"). Keys whose values this loader computes with (_plan):
READ_KEYS = frozenset(
    {
        "peft_type",  # LORA only
        "r",
        "lora_alpha",
        "target_modules",
        "layers_to_transform",
        "layers_pattern",  # "layers" only: Llama's list of decoder layers
        "rank_pattern",
        "alpha_pattern",
        "use_rslora",
        "bias",  # "none" only
        "init_lora_weights",  # the inits that only set the first weights (see _INIT_REWRITES_BASE)
        "alora_invocation_tokens",  # Activated LoRA: LoraAdapter.invocation_tokens (_invocation_tokens)
        "use_dora",  # DoRA: LoraAdapter.magnitudes (_magnitudes)
        "trainable_token_indices",  # PEFT's trainable tokens: LoraAdapter.vocab (_vocab)
        "ensure_weight_tying",  # no effect but beside LoRA on the embedding or head, where it is refused (_plan)
    }
)
# Keys that never change what a loaded adapter computes on a Llama model: metadata, training-only settings, and the
# configurations of inits that leave no trace beyond the saved weights.
NO_EFFECT_KEYS = frozenset(
    {
        "task_type",
        "auto_mapping",
        "peft_version",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "lora_dropout",  # training only
        "fan_in_fan_out",  # PEFT sets it back to false for torch.nn.Linear, which every Llama projection is
        "megatron_config",  # Megatron's parallel linears only; an HF Llama has none
        "megatron_core",
        "loftq_config",  # an init's configuration: init_lora_weights says whether it matters
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "velora_config",  # VeLoRA changes the backward pass only
        "qalora_group_size",  # read only with use_qalora (refused)
        "runtime_config",
    }
)
# Keys that change what PEFT computes and that this loader does not implement: refused when set (anything but
# null, false or empty), the key named.
UNSUPPORTED_KEYS = {
    "exclude_modules": "modules excluded from the targets",
    "layer_replication": "layers replicated into a deeper model",
    "target_parameters": "LoRA on parameters instead of modules",
    "use_qalora": "QA-LoRA (inputs pooled in groups before lora_A)",
    "modules_to_save": "whole base modules replaced by trained copies",
    "lora_bias": "a bias on lora_B",
    "use_bdlora": "block-diagonal LoRA factors",
    "arrow_config": "Arrow routing between adapters",
    "kasa_config": "KaSA (truncated base singular values and a learned diagonal)",
    "monteclora_config": "Monte Carlo LoRA (sampled perturbations of lora_A)",
}
# init_lora_weights values with which PEFT rewrites the base model's weights when it loads the adapter (the base
# becomes the residual of the init), so the adapter does not compute base + B A; the others (and true, false) only
# set the first weights, which the saved ones replace.
_INIT_REWRITES_BASE = ("pissa", "corda", "olora", "loftq")
_INIT_WEIGHTS_ONLY = ("gaussian", "eva", "orthogonal", "lora_ga", "mica")
_LAYERS_PATTERNS: tuple[object, ...] = (None, "layers", ["layers"], [])
# Keys PEFT refuses beside use_dora (its LoraConfig, or its registry of LoRA variants, has no such combination)
_NOT_WITH_DORA = ("alora_invocation_tokens", "velora_config", "megatron_config")


def load_peft_adapter(
    name: str, path: str | Path, base: BaseShapes, max_rank: int, allowed_roots: list[Path] | None = None
) -> LoraAdapter:
    """Validate and read one PEFT LoRA directory into a LoraAdapter (read_peft_adapter, its weights checked and
    converted to float32)."""
    adapter = read_peft_adapter(name, path, base, max_rank, allowed_roots)
    adapter.check_weights()
    return adapter.lora()


def read_peft_adapter(
    name: str,
    path: str | Path,
    base: BaseShapes,
    max_rank: int,
    allowed_roots: list[Path] | None = None,
    read_buffer: ReadBuffer | None = None,
) -> PeftAdapter:
    """Read one PEFT LoRA directory and validate everything but its weights' values (PeftAdapter.check_weights);
    every refusal is an AdapterError (its ``public`` reason names no path). ``allowed_roots`` None means any path is
    allowed; otherwise the directory and each file read from it must resolve (symlinks followed) inside one. Each
    file is read once into memory (peft_files.read_file), so that files rewritten while the server reads them are a
    refusal, never a crash; the weights stay in those bytes: in ``read_buffer`` when given (a staging worker's,
    reused: the adapter's A and B are then valid until its next read; what outlives it is copied)."""
    roots = None if allowed_roots is None else [r.expanduser().resolve() for r in allowed_roots]
    outside = f"outside the allowed adapter roots ({', '.join(map(str, roots or [])) or 'none configured'})"
    root = _resolve(Path(path), f"adapter path {path}", "the adapter's directory")
    if roots is not None and not _within(root, roots):
        raise AdapterError(f"adapter path {path} is {outside}", "the adapter's directory is outside the adapter roots")
    if not root.is_dir():
        raise AdapterError(f"adapter path {path} is not a directory", "the adapter's path is not a directory")
    files = {}
    for file in ("adapter_model.safetensors", "adapter_config.json"):
        files[file] = _resolve(root / file, f"{file} in adapter path {path}", file)
        if roots is not None and not _within(files[file], roots):
            raise AdapterError(f"{file} in adapter path {path} links {outside}", f"{file} links outside the roots")
    if not files["adapter_model.safetensors"].is_file():
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise AdapterError(f"only safetensors adapters are loaded; {', '.join(pickles)} is a pickle file")
        raise AdapterError(f"{path} has no adapter_model.safetensors", "the adapter has no adapter_model.safetensors")
    if not files["adapter_config.json"].is_file():
        raise AdapterError(f"{path} has no adapter_config.json", "the adapter has no adapter_config.json")
    read_ns = time.time_ns()
    config_bytes, config_stamp = read_file(files["adapter_config.json"])
    try:
        config = json.loads(config_bytes.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise AdapterError(f"adapter_config.json is not UTF-8 text: {exc}") from exc
    except (ValueError, RecursionError) as exc:  # a syntax error, an integer over 4300 digits, too deep nesting
        raise AdapterError(f"adapter_config.json is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"adapter_config.json must hold a JSON object, not {_JSON_TYPES[type(config)]}")
    weights = files["adapter_model.safetensors"]
    weights_bytes, weights_stamp = read_file(weights) if read_buffer is None else read_file_into(weights, read_buffer)
    weights_file = SafetensorsFile(weights_bytes)
    tensors = weights_file.views()
    layers = _layers_path(name, tensors)  # before the config: target_modules regexes match the names under it
    try:
        experts = take_expert_lora(config, tensors, base, LAYER_PATHS, _rank_rule(config, base, max_rank))
        if base.experts:  # read by take_expert_lora; a dense base's is refused by _check_keys
            config = {k: v for k, v in config.items() if k != "target_parameters"}
        plan, vocab_plan = _plan(config, base, max_rank, layers, bool(experts))
        token_indices = _token_indices(config, base, vocab_plan)
    except AdapterError:
        raise
    except _MALFORMED as exc:  # a config shape the named checks in _plan miss; only _plan runs in this block
        raise AdapterError(f"adapter_config.json is malformed: {exc}") from exc
    magnitudes = _magnitudes(tensors, plan, base, _flag(config, "use_dora"))
    vocab = _vocab(tensors, vocab_plan, token_indices, base)
    modules = _modules(tensors, plan, base)
    invocation = _invocation_tokens(config, base)
    if invocation and vocab is not None:
        raise AdapterError(
            "alora_invocation_tokens with LoRA on the embedding or head, or trainable tokens: an activated LoRA "
            "applies to the decoder's linear modules only"
        )
    rank = max((r for r, _ in [*plan.values(), *vocab_plan.values()]), default=0)
    rank = max([rank, *(a.shape[0] for a, _, _ in experts.values())])
    return PeftAdapter(
        name,
        root,
        rank,
        base,
        modules,
        weights_file,
        FilesIdentity((config_stamp, weights_stamp), read_ns),
        invocation,
        magnitudes=magnitudes,
        vocab=vocab,
        experts=experts,
    )


def _rank_rule(config: dict, base: BaseShapes, max_rank: int) -> RankRule:
    """_plan's rank and scaling rule and targets, for the experts' LoRA (adapters.peft_experts)."""
    if not base.experts:
        return RankRule(lambda path: (0, 0.0), None, [])
    return RankRule(_rank_scaling(config, max_rank), config.get("target_modules"), _layers(config, base.num_layers))


def _rank_scaling(config: dict, max_rank: int) -> Callable[[str], tuple[int, float]]:
    """The module at a full path -> its (rank, scaling), PEFT's way: r and lora_alpha (defaults 8 and 8), unless a
    rank_pattern / alpha_pattern key matches the path; alpha / r, or alpha / sqrt(r) with use_rslora. A rank above
    ``max_rank`` is refused."""
    rank, alpha = _rank(config.get("r", 8), "r"), _alpha(config.get("lora_alpha", 8), "lora_alpha")
    rank_patterns = _patterns(config, "rank_pattern", _rank)
    alpha_patterns = _patterns(config, "alpha_pattern", _alpha)
    rslora = _flag(config, "use_rslora")

    def of(full: str) -> tuple[int, float]:
        r = int(next((v for p, v in rank_patterns if p.fullmatch(full)), rank))  # _rank checked: an int
        a = next((v for p, v in alpha_patterns if p.fullmatch(full)), alpha)
        if r > max_rank:
            raise AdapterError(f"rank {r} is above the server's maximum LoRA rank {max_rank}")
        return r, a / math.sqrt(r) if rslora else a / r

    return of


def _resolve(path: Path, what: str, public: str) -> Path:
    try:
        return path.expanduser().resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, an unknown ~user, a NUL byte
        raise AdapterError(f"{what} cannot be resolved: {exc}", f"{public} cannot be resolved") from exc


def _within(path: Path, roots: list[Path]) -> bool:
    return any(path.is_relative_to(r) for r in roots)


def _layers_path(name: str, tensors: dict[str, torch.Tensor]) -> str:
    """Which of LAYER_PATHS the adapter's keys name its modules under (TEXT_LAYERS when none does: _modules refuses
    such keys, naming them); keys under two of the paths are refused. LoRA weights on a multimodal model's vision
    tower or projector are taken out of ``tensors`` and said in the log: they act on images only, which this
    server refuses (a 400), so on every request it serves the adapter computes what it computes in PEFT. PEFT's
    list targets (q_proj, v_proj, all-linear) wrap the vision tower's projections of those names too."""
    on_images = [
        k for k in tensors if ("vision_tower" in k or "multi_modal_projector" in k) and _IMAGE_SIDE.fullmatch(k)
    ]
    image = sorted({m.group(1).split(".lora_")[0] for key in on_images if (m := _IMAGE_SIDE.fullmatch(key))})
    if image:
        for key in on_images:
            del tensors[key]
        log.info(
            "adapter %s: LoRA weights on %d vision-tower / projector modules (%s...) not loaded: they act on images,"
            " which this server does not take",
            name,
            len(image),
            image[0],
        )
    paths = sorted({m.group(1) for key in tensors if (m := _KEY.fullmatch(key) or _MAGNITUDE_KEY.fullmatch(key))})
    if len(paths) > 1:
        raise AdapterError(f"the adapter's keys name decoder layers under both {paths[0]} and {paths[1]}")
    return paths[0] if paths else TEXT_LAYERS


def _plan(
    config: dict, base: BaseShapes, max_rank: int, layers_path: str = TEXT_LAYERS, experts: bool = False
) -> tuple[dict[tuple[int, str], tuple[int, float]], dict[str, tuple[int, float]]]:
    """(layer, PEFT module path) -> (rank, scaling) for every decoder module the config targets, and ("embed_tokens"
    or "lm_head") -> (rank, scaling) for the vocabulary modules it targets, after every config check; PEFT's
    semantics, and its defaults (r 8, lora_alpha 8). A regex target_modules, rank_pattern and alpha_pattern
    match the modules' names in the model PEFT wrapped: ``{layers_path}.{layer}.{module path}``, VOCAB_PATHS."""
    _check_keys(config)
    rank_scaling = _rank_scaling(config, max_rank)
    layers = _layers(config, base.num_layers)
    targets = config.get("target_modules")
    if isinstance(targets, str) and config.get("layers_to_transform") is not None:
        raise AdapterError("layers_to_transform cannot be used with a regex target_modules (PEFT refuses it too)")
    names = {path.split(".")[-1]: path for path in base.modules}  # q_proj -> self_attn.q_proj
    if targets == ALL_LINEAR:
        targets = list(names)
    candidates = {  # a mixture of experts' sparse layers have no dense MLP (their experts: peft_experts)
        (layer, path): f"{layers_path}.{layer}.{path}"
        for layer in layers
        for path in base.modules
        if not (base.sparse(layer) and path.startswith("mlp."))
    }
    if isinstance(targets, str):
        regex = _regex(targets, f"target_modules {targets!r}")
        chosen = {k for k, full in candidates.items() if regex.fullmatch(full)}
        vocab = [m for m, full in VOCAB_PATHS.items() if regex.fullmatch(full)]
        if not chosen and not vocab and not experts:
            raise AdapterError(f"target_modules regex {targets!r} matches no module of the base model")
    elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        vocab = sorted({t.split(".")[-1] for t in targets if t.split(".")[-1] in VOCAB_MODULES})
        known = {*names, *VOCAB_MODULES, *base.expert_modules, *(("gate",) if base.experts else ())}  # the router
        unknown = [t for t in targets if t.split(".")[-1] not in known]
        if unknown:
            raise AdapterError(
                f"target modules {unknown} are not in the base model (supported: {', '.join(names)}, "
                f"{', '.join(VOCAB_MODULES)})"
            )
        wanted = {names[t.split(".")[-1]] for t in targets if t.split(".")[-1] in names}
        chosen = {k for k in candidates if k[1] in wanted}
    else:
        raise AdapterError(
            f"target_modules must be a non-empty list of module names or a regex string, got {targets!r}"
        )
    plan: dict[tuple[int, str], tuple[int, float]] = {}
    for key in chosen:
        plan[key] = rank_scaling(candidates[key])
    vocab_plan: dict[str, tuple[int, float]] = {}
    if vocab:
        _check_vocab_served(base, f"target modules {vocab} (LoRA on the embedding or the output head)")
        if layers_path != TEXT_LAYERS:
            raise AdapterError(f"target modules {vocab}: LoRA on the embedding or head of this model is not served")
        if config.get("layers_to_transform") is not None:
            raise AdapterError(f"target modules {vocab} with layers_to_transform: PEFT then skips them; not served")
        if _set(config.get("ensure_weight_tying")):
            raise AdapterError(
                f"ensure_weight_tying with LoRA on {vocab}: PEFT then ties the embedding's LoRA to the head's, "
                "which this server does not"
            )
        if _flag(config, "use_dora"):
            raise AdapterError(f"use_dora with LoRA on {vocab}: DoRA on the embedding or head is not served")
    for module in vocab:
        vocab_plan[module] = rank_scaling(VOCAB_PATHS[module])
    return plan, vocab_plan


def _check_vocab_served(base: BaseShapes, what: str) -> None:
    if base.vocab_refusal or base.vocab_size <= 0:
        raise AdapterError(f"{what}: not served here ({base.vocab_refusal or 'the vocabulary size is not known'})")


def _token_indices(config: dict, base: BaseShapes, vocab_plan: dict[str, tuple[int, float]]) -> dict[str, list[int]]:
    """PEFT's trainable_token_indices as ("embed_tokens" or "lm_head") -> token ids: a list means the embedding's;
    a dict names the modules (by a name ending in embed_tokens or lm_head). Refused: ids that are not distinct
    non-negative integers, ids at or beyond the base's vocabulary (an adapter trained with added tokens: the base
    has no row for them, and the base's tokenizer no text), a module that LoRA also targets."""
    value = config.get("trainable_token_indices")
    if not _set(value):
        return {}
    _check_vocab_served(base, "trainable_token_indices (trainable tokens)")
    if isinstance(value, list):
        entries = {"embed_tokens": value}
    elif isinstance(value, dict):
        entries = {}
        for key, ids in value.items():
            module = key.split(".")[-1]
            if module not in VOCAB_MODULES or module in entries:
                raise AdapterError(
                    f"trainable_token_indices names {key!r}: only the embedding (embed_tokens) and the output head "
                    "(lm_head), once each, are served"
                )
            entries[module] = ids
    else:
        raise AdapterError(f"trainable_token_indices must be a list of token ids or an object, got {value!r}")
    if "lm_head" in entries and _set(config.get("ensure_weight_tying")):
        raise AdapterError("ensure_weight_tying with trainable tokens on lm_head is not served")
    out = {}
    for module, ids in entries.items():
        if not isinstance(ids, list) or not ids or any(type(i) is not int or i < 0 for i in ids):
            raise AdapterError(f"trainable_token_indices[{module!r}] must be a non-empty list of token ids: {ids!r}")
        if len(set(ids)) != len(ids):
            raise AdapterError(f"trainable_token_indices[{module!r}] lists a token id twice")
        beyond = [i for i in ids if i >= base.vocab_size]
        if beyond:
            raise AdapterError(
                f"trainable_token_indices[{module!r}]: {len(beyond)} token id(s) (e.g. {beyond[0]}) are beyond the "
                f"base model's vocabulary of {base.vocab_size} tokens: an adapter trained with added tokens needs "
                "their embeddings and tokenizer, which the base model does not have"
            )
        if module in vocab_plan:
            raise AdapterError(f"trainable_token_indices on {module} that LoRA also targets: not served")
        out[module] = ids
    return out


def _check_keys(config: dict) -> None:
    """Refuse a config that asks PEFT for anything but plain LoRA (or DoRA) on the base's own layers, naming the key:
    another peft_type, a key of UNSUPPORTED_KEYS set, DoRA beside another LoRA variant, a bias, an init that
    rewrites the base weights, another layers_pattern, or a key unknown to this loader set to anything but null,
    false or empty (it may change what PEFT computes)."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not supported: only LORA adapters are served")
    for key in ("use_dora", "use_qalora", "lora_bias"):
        _flag(config, key)
    for key, what in UNSUPPORTED_KEYS.items():
        if _set(config.get(key)):
            raise AdapterError(
                f"adapter_config.json sets {key} ({what}): this server does not implement it, and serving the "
                "adapter without it would not compute what PEFT computes"
            )
    if _flag(config, "use_dora"):
        combined = [k for k in _NOT_WITH_DORA if _set(config.get(k))]
        combined += ["init_lora_weights 'mica'"] if config.get("init_lora_weights") == "mica" else []
        if combined:
            raise AdapterError(
                f"adapter_config.json sets use_dora (DoRA) together with {', '.join(combined)}: PEFT does not "
                "combine them, and neither does this server"
            )
    if config.get("bias", "none") != "none":
        raise AdapterError(f"bias={config['bias']!r} is not supported: only bias='none'")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_INIT_REWRITES_BASE):
        raise AdapterError(
            f"init_lora_weights {init!r}: PEFT rewrites the base model's weights when it loads this adapter, which "
            "this server does not; convert it to a plain LoRA (PEFT's save_pretrained with "
            "path_initial_model_for_weight_conversion)"
        )
    if not isinstance(init, bool) and init not in _INIT_WEIGHTS_ONLY:
        raise AdapterError(f"init_lora_weights {init!r} is not an initialization this server knows")
    if config.get("layers_pattern") not in _LAYERS_PATTERNS:
        raise AdapterError(
            f"layers_pattern {config['layers_pattern']!r} is not supported: the base model's layers are 'layers'"
        )
    known = READ_KEYS | NO_EFFECT_KEYS | UNSUPPORTED_KEYS.keys()
    unknown = sorted(k for k, v in config.items() if k not in known and _set(v))
    if unknown:
        raise AdapterError(
            f"adapter_config.json sets {', '.join(unknown)}, unknown to this server: it may change what PEFT "
            "computes, so the adapter is refused"
        )


def _invocation_tokens(config: dict, base: BaseShapes) -> tuple[int, ...]:
    """PEFT's alora_invocation_tokens: a non-empty list of token ids (absent or null: a plain LoRA) that can occur
    in a prompt (check_invocation_tokens)."""
    value = config.get("alora_invocation_tokens")
    if value is None:
        return ()
    if not isinstance(value, list) or not value or any(type(t) is not int or t < 0 for t in value):
        raise AdapterError(f"alora_invocation_tokens must be a non-empty list of token ids, got {reprlib.repr(value)}")
    return check_invocation_tokens("alora_invocation_tokens", value, base)


def check_invocation_tokens(key: str, tokens: list[int], base: BaseShapes) -> tuple[int, ...]:
    """An aLoRA's invocation sequence (``key``: where the file holds it), refused unless a prompt can hold it: an id
    at or beyond the base's vocabulary is no token of the base's tokenizer, and a sequence longer than the base's
    context fits in no prompt; served anyway, the adapter would silently never apply. Sizes 0 (not known): not
    checked."""
    beyond = [t for t in tokens if t >= base.vocab_size] if base.vocab_size > 0 else []
    if beyond:
        raise AdapterError(
            f"{key}: {len(beyond)} token id(s) (e.g. {reprlib.repr(beyond[0])}) are beyond the base model's vocabulary "
            f"of {base.vocab_size} tokens: the invocation can never occur in a prompt"
        )
    if 0 < base.max_positions < len(tokens):
        raise AdapterError(
            f"{key} holds {len(tokens)} tokens, more than the base model's context of {base.max_positions} positions: "
            "the invocation can never occur in a prompt"
        )
    return tuple(tokens)


def _set(value: object) -> bool:
    """Whether a config value asks for something: anything but null, false, or an empty string, list or object."""
    return value is not None and value is not False and value != "" and value != [] and value != {}


def _flag(config: dict, key: str) -> bool:
    value = config.get(key)
    if value is not None and not isinstance(value, bool):
        raise AdapterError(f"{key} must be true or false, got {value!r}")
    return bool(value)


def _rank(value, what: str) -> int:
    if type(value) is not int or value < 1:  # not isinstance: true is an int to Python but not a rank
        raise AdapterError(f"{what} must be a positive integer, got {value!r}")
    return value


def _alpha(value, what: str) -> float:
    """A finite number a float32 can hold (``not <=`` also refuses NaN; abs() of a huge int does not overflow)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not abs(value) <= _F32_MAX:
        raise AdapterError(f"{what} must be a finite number of magnitude at most {_F32_MAX:.3g}, got {value!r}")
    return float(value)


def _patterns(config: dict, key: str, check) -> list[tuple[re.Pattern, int | float]]:
    """PEFT's rank_pattern / alpha_pattern as (compiled, checked value): a key matches a module whose name ends
    with it (as a regex, after a dot)."""
    patterns = config.get(key)
    if patterns is None:
        return []
    if not isinstance(patterns, dict):
        raise AdapterError(f"{key} must be an object mapping module-name regexes to values, got {patterns!r}")
    return [(_regex(rf"(.*\.)?({k})", f"{key} key {k!r}"), check(v, f"{key}[{k!r}]")) for k, v in patterns.items()]


def _regex(pattern: str, what: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise AdapterError(f"{what} is not a valid regular expression: {exc.msg}") from exc
    except (OverflowError, RecursionError) as exc:  # a{99999999999}; thousands of nested groups
        raise AdapterError(f"{what} is not a valid regular expression: {exc}") from exc


def _layers(config: dict, num_layers: int) -> list[int]:
    """layers_to_transform as a list of layer indices; absent, null or [] means every layer, as in PEFT."""
    value = config.get("layers_to_transform")
    if value is None or value == []:
        return list(range(num_layers))
    chosen = [value] if type(value) is int else value
    if not isinstance(chosen, list) or any(type(i) is not int for i in chosen):
        raise AdapterError(f"layers_to_transform must be a layer index or a list of layer indices, got {value!r}")
    bad = [i for i in chosen if not 0 <= i < num_layers]
    if bad:
        raise AdapterError(f"layers_to_transform {bad} do not exist in the base model ({num_layers} layers)")
    return chosen


def _magnitudes(
    tensors: dict[str, torch.Tensor], plan: dict[tuple[int, str], tuple[int, float]], base: BaseShapes, dora: bool
) -> dict[tuple[int, str], torch.Tensor]:
    """DoRA's magnitudes (lora_magnitude_vector: one [out] per module the config targets) taken out of ``tensors``,
    by canonical (layer, module) in float32: a fused module's split by its parts' widths, as B's rows. Refused: a
    module without one, one of another shape, NaN or Inf, or any magnitude in an adapter without use_dora."""
    found: dict[tuple[int, str], torch.Tensor] = {}
    for key, m in [(k, m) for k in tensors if "lora_magnitude_vector" in k and (m := _MAGNITUDE_KEY.fullmatch(k))]:
        target, tensor = (int(m.group(2)), f"{m.group(3)}.{m.group(4)}"), tensors.pop(key)
        if not dora:
            raise AdapterError(f"tensor {key} is a DoRA magnitude, but adapter_config.json does not set use_dora")
        if target not in plan:
            raise AdapterError(f"tensor {key} targets a module the config does not (or the base lacks)")
        found[target] = tensor
    magnitudes = {}
    for target in sorted(plan) if dora else []:
        layer, module = target
        name, out_f = module.split(".")[-1], base.module_features(module)[1]
        if target not in found:
            raise AdapterError(f"layer {layer} {name} lacks its DoRA magnitude (lora_magnitude_vector)")
        magnitude = _owned(found[target])
        if magnitude.shape != (out_f,):
            raise AdapterError(
                f"layer {layer} {name}: lora_magnitude_vector {tuple(magnitude.shape)} does not match the base "
                f"({out_f},)"
            )
        if not torch.isfinite(magnitude).all():
            raise AdapterError(f"layer {layer} {name} has a NaN or Inf DoRA magnitude")
        parts = base.modules[module]
        for part, m_part in zip(parts, magnitude.split([base.features[p][1] for p in parts]), strict=True):
            magnitudes[(layer, part)] = m_part.contiguous()
    return magnitudes


def _vocab(
    tensors: dict[str, torch.Tensor],
    vocab_plan: dict[str, tuple[int, float]],
    token_indices: dict[str, list[int]],
    base: BaseShapes,
) -> VocabLora | None:
    """The adapter's VocabLora, its tensors taken out of ``tensors`` (float32, scaling folded into B): LoRA on
    embed_tokens (lora_embedding_A [r, vocab], lora_embedding_B [hidden, r]) and lm_head (lora_A [r, hidden],
    lora_B [vocab, r]), trainable tokens' rows (trainable_tokens_delta [n, hidden]: the listed ids' whole new
    rows). With a tied head, the embedding's trainable tokens are the head's too (PEFT ties its token adapter to
    the head's), unless the head has its own. PEFT's copy of the base embedding or head (save_embedding_layers) is
    checked for the base's shape and dropped: the base model's own weights are served."""
    vocab, hidden = base.vocab_size, base.hidden
    lora: dict[str, dict[str, torch.Tensor]] = {}
    deltas: dict[str, torch.Tensor] = {}
    for key in [k for k in tensors if any(f"{module}." in k for module in VOCAB_MODULES)]:
        if m := _EMBED_LORA_KEY.fullmatch(key):
            lora.setdefault("embed_tokens", {})[m.group(1)] = _owned(tensors.pop(key))
        elif m := _HEAD_LORA_KEY.fullmatch(key):
            lora.setdefault("lm_head", {})[m.group(1)] = _owned(tensors.pop(key))
        elif m := _TOKENS_KEY.fullmatch(key):
            deltas[m.group(1).split(".")[-1]] = _owned(tensors.pop(key))
        elif m := _VOCAB_BASE_KEY.fullmatch(key):
            saved = tensors.pop(key)
            if not vocab_plan:
                raise AdapterError(f"tensor {key}: a copy of the base's {m.group(1)}, which no LoRA here targets")
            if tuple(saved.shape) != (vocab, hidden):
                raise AdapterError(
                    f"tensor {key} {tuple(saved.shape)}: the adapter was trained on a model whose {m.group(1)} is not "
                    f"the base's ({vocab}, {hidden}) (a resized vocabulary), which is not served"
                )
    if set(lora) != set(vocab_plan):
        raise AdapterError(
            f"LoRA weights on {sorted(lora) or 'no vocabulary module'} but the config targets "
            f"{sorted(vocab_plan) or 'neither embed_tokens nor lm_head'}"
        )
    shapes = {"embed_tokens": ((vocab,), (hidden,)), "lm_head": ((hidden,), (vocab,))}
    pairs = {}
    for module, (rank, scaling) in vocab_plan.items():
        found = lora[module]
        if set(found) != {"A", "B"}:
            raise AdapterError(f"{module} lacks its LoRA A or B weights")
        a, b = found["A"], found["B"]
        (a_in,), (b_out,) = shapes[module]
        if a.shape != (rank, a_in) or b.shape != (b_out, rank):
            raise AdapterError(
                f"{module}: LoRA A {tuple(a.shape)} / B {tuple(b.shape)} do not match the base ({rank}, {a_in}) / "
                f"({b_out}, {rank})"
            )
        b_t = (b * scaling).t().contiguous()
        if not (torch.isfinite(a).all() and torch.isfinite(b_t).all()):
            raise AdapterError(f"{module} has NaN or Inf LoRA weights (or its B times the scaling overflows)")
        pairs[module] = (a.t().contiguous() if module == "embed_tokens" else a, b_t)
    if set(deltas) - set(token_indices):
        raise AdapterError(f"trainable_tokens_delta of {sorted(set(deltas) - set(token_indices))} the config lacks")
    tokens = {}
    for module, ids in token_indices.items():
        if module not in deltas:
            raise AdapterError(f"trainable_token_indices names {module}, whose trainable_tokens_delta is missing")
        rows = deltas[module]
        if rows.shape != (len(ids), hidden):
            raise AdapterError(
                f"{module} trainable_tokens_delta {tuple(rows.shape)} does not match its {len(ids)} token ids and "
                f"the base's hidden size {hidden}"
            )
        if not torch.isfinite(rows).all():
            raise AdapterError(f"{module} trainable_tokens_delta has NaN or Inf values")
        tokens[module] = (torch.tensor(ids, dtype=torch.int64), rows.contiguous())
    if "lm_head" not in tokens and "embed_tokens" in tokens and base.tied_embeddings:
        tokens["lm_head"] = tokens["embed_tokens"]  # PEFT ties the head's token adapter to the embedding's
    if "lm_head" in tokens and "lm_head" in pairs:
        raise AdapterError("trainable tokens on the (tied) output head together with LoRA on lm_head: not served")
    if not pairs and not tokens:
        return None
    return VocabLora(pairs.get("embed_tokens"), pairs.get("lm_head"), tokens.get("embed_tokens"), tokens.get("lm_head"))


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of the file as float32 in memory of its own (not a view of the bytes read, which a staging worker
    reuses for the next file): DoRA's magnitudes and the vocabulary pieces outlive the read."""
    return tensor.to(torch.float32, copy=True)


def _vocab_key(key: str) -> bool:
    """Whether a tensor key is an adapter's weight on the embedding or the output head."""
    return any(f".{m}." in f".{key}" for m in VOCAB_MODULES)


def _modules(
    tensors: dict[str, torch.Tensor], plan: dict[tuple[int, str], tuple[int, float]], base: BaseShapes
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]:
    """(layer, PEFT module path) -> (lora_A, lora_B, scaling) of every module the plan targets, as stored: every key
    of ``tensors`` must be one of theirs (nothing else may be left by _magnitudes and _vocab), each A and B a
    floating-point tensor of the plan's rank and the base's features."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            if _vocab_key(key):
                raise AdapterError(
                    f"{key}: this weight on the embedding or the output head is not one this server serves"
                )
            if "bias" in key:
                raise AdapterError(f"bias terms are not supported ({key})")
            raise AdapterError(f"unexpected tensor {key} in the adapter")
        layer, module = int(m.group(2)), f"{m.group(3)}.{m.group(4)}"
        if (layer, module) not in plan:
            raise AdapterError(f"tensor {key} targets a module the config does not (or the base lacks)")
        found.setdefault((layer, module), {})[m.group(5)] = tensor
    modules = {}
    for target, (rank, scaling) in sorted(plan.items()):
        layer, module = target
        name = module.split(".")[-1]
        pair = found.get(target, {})
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"layer {layer} {name} lacks lora_A or lora_B weights")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.dtype not in FLOAT_DTYPES or b.dtype not in FLOAT_DTYPES:
            raise AdapterError(
                f"layer {layer} {name}: lora_A is {a.dtype} and lora_B {b.dtype}; LoRA weights are stored as float64, "
                "float32, float16 or bfloat16"
            )
        in_f, out_f = base.module_features(module)
        if a.shape != (rank, in_f) or b.shape != (out_f, rank):
            raise AdapterError(
                f"layer {layer} {name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do "
                f"not match the base ({rank}, {in_f}) / ({out_f}, {rank})"
            )
        modules[target] = (a, b, scaling)
    return modules
