"""Reading and validating PEFT LoRA adapter directories (adapter_config.json + adapter_model.safetensors), and
converting them into per-module A/B matrices with the scaling folded into B.

Every refusal raises AdapterError with the reason; nothing is loaded or changed when validation fails."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

# PEFT module name (HF Llama naming) -> our canonical module name
TARGETS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
           "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_HF_PATH = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
            "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.(lora_[AB])(?:\.[\w-]+)?"
                  r"\.weight")


class AdapterError(ValueError):
    """An adapter that cannot be served, and why."""


@dataclass(frozen=True, slots=True)
class BaseShapes:
    """What an adapter must fit: the base model's layer count and each module's (in, out) features."""

    num_layers: int
    features: dict[str, tuple[int, int]]  # canonical module -> (in_features, out_features)

    @classmethod
    def llama(cls, num_layers: int, hidden: int, intermediate: int, q_size: int, kv_size: int) -> BaseShapes:
        return cls(num_layers, {"q": (hidden, q_size), "k": (hidden, kv_size), "v": (hidden, kv_size),
                                "o": (q_size, hidden), "gate": (hidden, intermediate), "up": (hidden, intermediate),
                                "down": (intermediate, hidden)})


@dataclass(slots=True)
class LoraAdapter:
    """A validated adapter: for each (layer, module) it targets, A [r, in] and B [out, r] (B already scaled)."""

    name: str
    path: Path
    rank: int  # the largest rank over its modules
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.weights}

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def load_peft_adapter(name: str, path: str | Path, base: BaseShapes, max_rank: int,
                      allowed_roots: list[Path] | None = None) -> LoraAdapter:
    """Validate and read one PEFT LoRA directory. ``allowed_roots`` None means any path is allowed."""
    root = Path(path).expanduser().resolve()
    if allowed_roots is not None and not any(root.is_relative_to(r.expanduser().resolve()) for r in allowed_roots):
        raise AdapterError(f"adapter path {path} is outside the allowed adapter roots")
    if not root.is_dir():
        raise AdapterError(f"adapter path {path} is not a directory")
    weights_file = root / "adapter_model.safetensors"
    if not weights_file.is_file():
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise AdapterError(f"only safetensors adapters are loaded; {', '.join(pickles)} is a pickle file")
        raise AdapterError(f"{path} has no adapter_model.safetensors")
    config_file = root / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterError(f"{path} has no adapter_config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise AdapterError(f"adapter_config.json is not valid JSON: {exc}") from exc
    plan = _plan(config, base, max_rank)
    tensors = _read_safetensors(weights_file)
    return LoraAdapter(name, root, max(r for r, _ in plan.values()), _convert(tensors, plan, base))


def _plan(config: dict, base: BaseShapes, max_rank: int) -> dict[tuple[int, str], tuple[int, float]]:
    """(layer, module) -> (rank, scaling) for every module the config targets, after every config check."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise AdapterError("DoRA adapters (use_dora) are not supported")
    if config.get("modules_to_save"):
        raise AdapterError("modules_to_save is not supported (it replaces whole base modules)")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"bias={config['bias']!r} is not supported: only bias='none'")
    rank, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"r must be a positive integer, got {rank!r}")
    layers = _layers(config, base.num_layers)
    targets = config.get("target_modules")
    candidates = {(layer, module): f"model.layers.{layer}.{_HF_PATH[module]}"
                  for layer in layers for module in _HF_PATH}
    if isinstance(targets, str):
        chosen = {k for k, full in candidates.items() if re.fullmatch(targets, full)}
        if not chosen:
            raise AdapterError(f"target_modules regex {targets!r} matches no module of the base model")
    elif isinstance(targets, list) and targets:
        unknown = [t for t in targets if t.split(".")[-1] not in TARGETS]
        if unknown:
            raise AdapterError(f"target modules {unknown} are not in the base model "
                               f"(supported: {', '.join(TARGETS)})")
        wanted = {TARGETS[t.split(".")[-1]] for t in targets}
        chosen = {k for k in candidates if k[1] in wanted}
    else:
        raise AdapterError("target_modules must be a non-empty list or a regex string")
    plan = {}
    for key in chosen:
        full = candidates[key]
        r = _pattern(config.get("rank_pattern") or {}, full, rank)
        a = _pattern(config.get("alpha_pattern") or {}, full, alpha)
        if r > max_rank:
            raise AdapterError(f"rank {r} is above the server's maximum LoRA rank {max_rank}")
        plan[key] = (r, a / math.sqrt(r) if config.get("use_rslora") else a / r)
    return plan


def _layers(config: dict, num_layers: int) -> list[int]:
    chosen = config.get("layers_to_transform")
    if chosen is None:
        return list(range(num_layers))
    chosen = [chosen] if isinstance(chosen, int) else list(chosen)
    bad = [i for i in chosen if not 0 <= i < num_layers]
    if bad:
        raise AdapterError(f"layers_to_transform {bad} do not exist in the base model ({num_layers} layers)")
    return chosen


def _pattern(patterns: dict, full_name: str, default):
    """PEFT's rank_pattern / alpha_pattern: a key matches a module whose name ends with it (as a regex)."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", full_name):
            return value
    return default


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{path.name} cannot be read: {exc}") from exc


def _convert(tensors: dict[str, torch.Tensor], plan: dict[tuple[int, str], tuple[int, float]],
             base: BaseShapes) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            if "bias" in key:
                raise AdapterError(f"bias terms are not supported ({key})")
            raise AdapterError(f"unexpected tensor {key} in the adapter")
        layer, module = int(m.group(1)), TARGETS.get(m.group(3))
        if module is None or (layer, module) not in plan:
            raise AdapterError(f"tensor {key} targets a module the config does not (or the base lacks)")
        found.setdefault((layer, module), {})[m.group(4)] = tensor
    weights = {}
    for key, (rank, scaling) in sorted(plan.items()):
        pair = found.get(key, {})
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"layer {key[0]} {key[1]}_proj lacks lora_A or lora_B weights")
        a, b = pair["lora_A"].float(), pair["lora_B"].float()
        in_f, out_f = base.features[key[1]]
        if a.shape != (rank, in_f) or b.shape != (out_f, rank):
            raise AdapterError(f"layer {key[0]} {key[1]}_proj: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do "
                               f"not match the base ({rank}, {in_f}) / ({out_f}, {rank})")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"layer {key[0]} {key[1]}_proj has NaN or Inf weights")
        weights[key] = (a, b * scaling)
    return weights
