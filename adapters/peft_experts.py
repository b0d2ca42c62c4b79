"""A PEFT adapter's LoRA on a mixture of experts' experts (model.moe), in both layouts PEFT trains:

- per-expert modules (transformers 4.x, whose experts were nn.Linear modules): ``mlp.experts.{e}.gate_proj`` /
  ``up_proj`` / ``down_proj`` (Qwen3-MoE), ``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2`` (Mixtral: gate, up,
  down), an A [r, in] and B [out, r] each, targeted by target_modules;
- fused expert parameters (transformers 5, whose experts are [experts, out, in] parameters): target_parameters
  ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``, one A [r * experts, in] and B [out, r * experts] each
  (PEFT's ParamWrapper: expert e's A is rows e*r .. e*r + r - 1, its B columns e, e + experts, ...). Two targeted
  parameters of one module nest: the first wrapped is ``experts.base_layer.lora_*``, the other ``experts.lora_*``;
  which is which is read from their shapes (gate_up's B has 2 * width rows, down's A width columns). As in PEFT,
  they wrap every sparse layer's experts (layers_to_transform does not apply to target_parameters), and a
  rank_pattern / alpha_pattern key matches ``{layers}.{i}.mlp.experts.gate_up_proj`` (the parameter's path).

LoRA on the router, [experts, hidden], in either layout too: ``mlp.gate`` (``block_sparse_moe.gate``) named by
target_modules (transformers 4.x's nn.Linear router), or target_parameters ``mlp.gate.weight`` (transformers 5's
router parameter); an A [r, hidden] and B [experts, r] a layer, its scaled product added to the router's logits
before the softmax (so it changes which experts a token takes, as in PEFT).

Each is read into (layer, module, expert) -> (A [r, in], B [out, r], scaling) with module gate, up, gate_up (the
fused layout's: one A for both halves), down, or router (expert 0: one a layer). Refused, naming it: DoRA or an
activated LoRA on experts or the router, a target parameter other than those three, an expert without its A or
B, shapes that do not fit."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lora_server.adapters.errors import AdapterError
from lora_server.adapters.lora_types import BaseShapes
from lora_server.adapters.peft_files import FLOAT_DTYPES

ExpertParts = dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor, float]]
TARGET_PARAMETERS = {"gate_up_proj": "gate_up", "down_proj": "down"}  # transformers 5's expert parameters
ROUTER_PARAMETER = "mlp.gate.weight"  # transformers 5's router (Qwen3MoeTopKRouter, MixtralTopKRouter)


@dataclass(frozen=True, slots=True)
class RankRule:
    """How a PEFT config ranks and scales the module at a path (peft_format._plan's rules: r and lora_alpha,
    rank_pattern and alpha_pattern, use_rslora), and what it targets (target_modules as given)."""

    of: Callable[[str], tuple[int, float]]  # full module path -> (rank, scaling)
    targets: object  # target_modules: a list of names, "all-linear" or a regex string
    layers: list[int]  # layers_to_transform's (every layer where absent)

    def targets_path(self, full: str) -> bool:
        targets = self.targets
        if targets == "all-linear":  # transformers 4.x's experts were linear modules: all-linear took them
            return True
        if isinstance(targets, str):
            return re.fullmatch(targets, full) is not None
        return isinstance(targets, list) and any(full == t or full.endswith("." + t) for t in targets)


def _key(layers_paths: tuple[str, ...], rest: str) -> re.Pattern:
    return re.compile(rf"(?:base_model\.model\.)?({'|'.join(map(re.escape, layers_paths))})\.([0-9]{{1,6}})\.{rest}")


def take_expert_lora(
    config: dict, tensors: dict[str, torch.Tensor], base: BaseShapes, layers_paths: tuple[str, ...], rule: RankRule
) -> ExpertParts:
    """Take the adapter's LoRA on the experts out of ``tensors`` (the module's docstring), checked against the
    config and the base; {} for a dense base (whose target_parameters peft_format refuses)."""
    if not base.experts:
        return {}
    parts = _router(config, tensors, base, layers_paths, rule)
    parts.update(_per_expert(tensors, base, layers_paths, rule))
    parts.update(_fused(config, tensors, base, layers_paths, rule))
    if parts and (config.get("use_dora") or config.get("alora_invocation_tokens")):
        what = "use_dora (DoRA)" if config.get("use_dora") else "alora_invocation_tokens (an activated LoRA)"
        raise AdapterError(f"{what} with LoRA on the experts or the router is not served")
    return parts


def _router(
    config: dict, tensors: dict[str, torch.Tensor], base: BaseShapes, layers_paths: tuple[str, ...], rule: RankRule
) -> ExpertParts:
    """The router's LoRA (the module's docstring): targeted by target_parameters (every sparse layer, each of which
    must have it) or by target_modules (the layers it names)."""
    by_parameter = ROUTER_PARAMETER in _parameters(config)
    pattern = _key(layers_paths, r"(mlp|block_sparse_moe)\.gate\.(lora_[AB])(?:\.[\w-]+)?\.weight")
    found: dict[int, dict[str, torch.Tensor]] = {}
    paths: dict[int, str] = {}
    for key in [k for k in tensors if pattern.fullmatch(k)]:
        m = pattern.fullmatch(key)
        assert m is not None
        layers, layer, container, which = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        full = f"{layers}.{layer}.{container}.gate"
        # transformers 5 names every router mlp.gate; 4.x Mixtral's was block_sparse_moe.gate
        if (
            layer >= base.num_layers
            or not base.sparse(layer)
            or container not in ("mlp", base.experts_path.rsplit(".", 1)[0])
        ):
            raise AdapterError(f"{key}: layer {layer} of this base has no router there")
        if not (by_parameter or (layer in rule.layers and rule.targets_path(full))):
            raise AdapterError(f"tensor {key} targets a module the config does not (the router, {full})")
        found.setdefault(layer, {})[which] = tensors.pop(key)
        paths[layer] = full + (".weight" if by_parameter else "")  # what PEFT matches rank_pattern keys against
    if by_parameter:
        missing = [layer for layer in range(base.num_layers) if base.sparse(layer) and layer not in found]
        if missing:
            raise AdapterError(f"layer {missing[0]} router: target_parameters names it, but the adapter has no LoRA")
    parts: ExpertParts = {}
    in_f, out_f = base.expert_features("router")
    for layer, pair in sorted(found.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"layer {layer} router: lacks lora_A or lora_B weights")
        r, scaling = rule.of(paths[layer])
        parts[(layer, "router", 0)] = (
            *_checked(pair["lora_A"], pair["lora_B"], r, in_f, out_f, layer, "router"),
            scaling,
        )
    return parts


def _parameters(config: dict) -> list[str]:
    """target_parameters, each as the served parameter it names (the experts' two, the router's): PEFT wraps the
    parameters whose path ends with a target after a dot; a target naming one layer's (a longer path) is
    refused."""
    targets = config.get("target_parameters") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"target_parameters must be a list of parameter names, got {targets!r}")
    served = [f"mlp.experts.{name}" for name in TARGET_PARAMETERS] + [ROUTER_PARAMETER]
    out = []
    for target in targets:
        # a dotted suffix of one of them, naming the parameter and its module (just "weight" would be every linear's)
        match = [name for name in served if f".{name}".endswith(f".{target}") and target != "weight"]
        if len(match) != 1:
            raise AdapterError(
                f"target_parameters {target!r}: only the experts' {' and '.join(TARGET_PARAMETERS)} and the "
                "router's weight (mlp.gate.weight) are served"
            )
        out.append(match[0])
    return out


def _per_expert(
    tensors: dict[str, torch.Tensor], base: BaseShapes, layers_paths: tuple[str, ...], rule: RankRule
) -> ExpertParts:
    pattern = _key(
        layers_paths, r"(mlp|block_sparse_moe)\.experts\.([0-9]{1,6})\.(\w+)\.(lora_[AB])(?:\.[\w-]+)?\.weight"
    )
    found: dict[tuple[int, str], dict[int, dict[str, torch.Tensor]]] = {}
    paths: dict[tuple[int, str], str] = {}
    for key in [k for k in tensors if pattern.fullmatch(k)]:
        m = pattern.fullmatch(key)
        assert m is not None
        layers, layer, container, expert, name, which = m.groups()
        layer, expert = int(layer), int(expert)
        module = base.expert_modules.get(name)
        if f"{container}.experts" != base.experts_path or module is None:
            raise AdapterError(
                f"{key}: not an expert module of this base (its experts are {base.experts_path}.N with "
                f"{', '.join(base.expert_modules)})"
            )
        if layer not in rule.layers or not base.sparse(layer) or layer >= base.num_layers or expert >= base.experts:
            raise AdapterError(f"{key}: layer {layer} has no expert {expert}, or the config does not target it")
        full = f"{layers}.{layer}.{container}.experts.{expert}.{name}"
        if not rule.targets_path(full):
            raise AdapterError(f"tensor {key} targets a module the config does not")
        found.setdefault((layer, module), {}).setdefault(expert, {})[which] = tensors.pop(key)
        paths[(layer, module)] = f"{layers}.{layer}.{container}.experts.{{}}.{name}"
    parts: ExpertParts = {}
    for (layer, module), experts in sorted(found.items()):
        in_f, out_f = base.expert_features(module)
        for expert in range(base.experts):
            pair = experts.get(expert, {})
            if set(pair) != {"lora_A", "lora_B"}:
                raise AdapterError(f"layer {layer} expert {expert} {module}: lacks lora_A or lora_B weights")
            r, scaling = rule.of(paths[(layer, module)].format(expert))
            parts[(layer, module, expert)] = (
                *_checked(pair["lora_A"], pair["lora_B"], r, in_f, out_f, layer, module),
                scaling,
            )
    return parts


def _fused(
    config: dict, tensors: dict[str, torch.Tensor], base: BaseShapes, layers_paths: tuple[str, ...], rule: RankRule
) -> ExpertParts:
    wanted = {TARGET_PARAMETERS[t.split(".")[-1]] for t in _parameters(config) if t != ROUTER_PARAMETER}
    pattern = _key(layers_paths, r"mlp\.experts\.((?:base_layer\.)*)(lora_[AB])(?:\.[\w-]+)?\.weight")
    found: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    paths: dict[int, str] = {}  # layer -> its experts' module path, what rank_pattern keys match (with the parameter)
    for key in [k for k in tensors if pattern.fullmatch(k)]:
        m = pattern.fullmatch(key)
        assert m is not None
        layer, depth, which = int(m.group(2)), m.group(3).count("base_layer"), m.group(4)
        if not wanted:
            raise AdapterError(f"tensor {key} is LoRA on a parameter the config's target_parameters does not name")
        found.setdefault((layer, depth), {})[which] = tensors.pop(key)
        paths[layer] = f"{m.group(1)}.{layer}.mlp.experts"
    parts: ExpertParts = {}
    seen: set[tuple[int, str]] = set()
    hidden, width, experts = base.hidden, base.expert_width, base.experts
    for (layer, _depth), pair in sorted(found.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"layer {layer} experts: lacks lora_A or lora_B weights")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.dim() != 2 or b.dim() != 2:
            raise AdapterError(f"layer {layer} experts: lora_A and lora_B must be matrices")
        module = "gate_up" if (a.shape[1], b.shape[0]) == (hidden, 2 * width) else "down"
        if module not in wanted or (layer, module) in seen:
            raise AdapterError(
                f"layer {layer} experts: LoRA of shapes {tuple(a.shape)} / {tuple(b.shape)} fits no "
                "targeted parameter (or one twice)"
            )
        if layer >= base.num_layers or not base.sparse(layer):
            raise AdapterError(f"layer {layer} has no experts")
        seen.add((layer, module))
        param = next(name for name, m in TARGET_PARAMETERS.items() if m == module)
        r, scaling = rule.of(f"{paths[layer]}.{param}")  # PEFT matches rank_pattern on module path.parameter
        in_f, out_f = base.expert_features(module)
        _checked(a, b, r * experts, in_f, out_f, layer, module)
        b_by_expert = b.unflatten(1, (r, experts))  # [out, r, experts]: expert e's columns e, e + experts, ...
        for expert in range(experts):
            parts[(layer, module, expert)] = (a[expert * r : (expert + 1) * r], b_by_expert[:, :, expert], scaling)
    sparse = [layer for layer in range(base.num_layers) if base.sparse(layer)]  # every one: see the module docstring
    missing = sorted((layer, m) for layer in sparse for m in wanted if (layer, m) not in seen)
    if missing:
        raise AdapterError(
            f"layer {missing[0][0]} experts {missing[0][1]}: target_parameters names it, but the "
            "adapter has no lora_A / lora_B for it"
        )
    return parts


def _checked(
    a: torch.Tensor, b: torch.Tensor, r: int, in_f: int, out_f: int, layer: int, module: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if a.dtype not in FLOAT_DTYPES or b.dtype not in FLOAT_DTYPES:
        raise AdapterError(f"layer {layer} experts {module}: lora_A is {a.dtype} and lora_B {b.dtype}, not floats")
    if tuple(a.shape) != (r, in_f) or tuple(b.shape) != (out_f, r):
        raise AdapterError(
            f"layer {layer} experts {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not match the "
            f"base ({r}, {in_f}) / ({out_f}, {r})"
        )
    return a, b
