"""compressed-tensors' quantization_config (as its ModelCompressor writes it into config.json) -> QuantScheme.

Read: per config group, pack-quantized (int 4 or 8-bit weights, group or channel scales, symmetric or with zero
points, no activation quantization: W4A16, W8A16), float-quantized (FP8 e4m3 weights, tensor or channel scales,
symmetric; activations none or FP8 dynamic per token: W8A8-FP8) and int-quantized (int8 weights, tensor or channel
scales, symmetric; activations none or int8 dynamic symmetric per token: W8A8-int8). Refused, naming the key:
static activation scales, output activations, kv_cache_scheme, sparsity and transform configs, block or
tensor_group strategies, actorder "group" (its weight_g_idx), group targets that name a module class other than
Linear, and any key this reader does not know. actorder "weight" passes: compressed-tensors documents it as
changing the calibration order only, not the stored format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lora_server.model.prequant.config import QuantScheme, WeightFormat, refuse, refuse_unknown

_TOP_KEYS = frozenset(
    {
        "config_groups", "format", "global_compression_ratio", "ignore", "kv_cache_scheme", "quant_method",
        "quantization_status", "sparsity_config", "transform_config", "moe_sparsity_config", "version",
        # transformers' loading options: how it loads, not what is stored
        "run_compressed", "dequantize", "use_optimized_inference",
    }
)  # fmt: skip
_GROUP_KEYS = frozenset({"targets", "weights", "input_activations", "output_activations", "format"})
# QuantizationArgs' fields. observer and observer_kwargs are calibration's; a weight's scale_dtype and zp_dtype are
# the stored tensors' dtypes, which read_linear checks on the tensors themselves.
_ARG_KEYS = frozenset(
    {
        "num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
        "scale_dtype", "zp_dtype", "observer", "observer_kwargs",
    }
)  # fmt: skip


@dataclass(frozen=True)
class _Args:
    """One QuantizationArgs, defaults filled in as compressed-tensors fills them."""

    where: str  # "config_groups.<name>.weights" ...
    num_bits: int
    type: str
    symmetric: bool
    strategy: str
    group_size: int | None
    dynamic: object
    actorder: object
    block_structure: object
    scale_dtype: object

    def expect(self, field: str, allowed: tuple, why: str) -> None:
        value = getattr(self, field)
        if value not in allowed or type(value) is not type(allowed[0]):  # 4.0 is not 4, nor 1 True
            raise refuse(f"{self.where}.{field}", value, why)


def ct_scheme(spec: dict) -> QuantScheme:
    refuse_unknown(spec, _TOP_KEYS, "")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config", "moe_sparsity_config"):
        if spec.get(key):
            raise refuse(key, spec[key], "not implemented")
    if spec.get("quantization_status") != "compressed":
        raise refuse("quantization_status", spec.get("quantization_status"), "only compressed checkpoints are read")
    groups = spec.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise refuse("config_groups", groups, "expected the config groups, by name")
    parsed = []
    for name, group in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(group, dict):
            raise refuse(where, group, "a preset scheme named by its targets is not expanded here")
        refuse_unknown(group, _GROUP_KEYS, where)
        targets = group.get("targets")
        if not isinstance(targets, list) or not targets:
            raise refuse(f"{where}.targets", targets, "expected a list of module patterns")
        parsed.append((name, tuple(_pattern(f"{where}.targets", t) for t in targets), _group(where, group, spec)))
    ignore = spec.get("ignore") or []
    if not isinstance(ignore, list):
        raise refuse("ignore", ignore, "expected a list of module patterns")
    return QuantScheme("compressed-tensors", tuple(parsed), tuple(_pattern("ignore", p) for p in ignore))


def _pattern(where: str, pattern: object) -> str:
    """A target or ignore entry: "Linear", "re:<regex>" or a module path; another class name is refused (which
    modules are of that class is the model's code, not the file's)."""
    if not isinstance(pattern, str):
        raise refuse(where, pattern, "expected a string")
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as e:
            raise refuse(where, pattern, f"not a regular expression ({e})") from e
    elif pattern != "Linear" and re.fullmatch(r"[A-Z]\w*", pattern):
        raise refuse(where, pattern, "a module class other than Linear is not resolved here")
    return pattern


def _group(where: str, group: dict, spec: dict) -> WeightFormat:
    if group.get("output_activations") is not None:
        raise refuse(f"{where}.output_activations", group["output_activations"], "not implemented")
    fmt = group.get("format") or spec.get("format")
    parse = _FORMATS.get(fmt) if isinstance(fmt, str) else None
    if parse is None:
        raise refuse(f"{where}.format", fmt, f"not implemented (read: {', '.join(_FORMATS)})")
    if group.get("weights") is None:
        raise refuse(f"{where}.weights", None, "a group without weight quantization is not implemented")
    weights = _args(f"{where}.weights", group["weights"])
    weights.expect("dynamic", (False,), "dynamic weight quantization is not implemented")
    weights.expect("block_structure", (None,), "block scales are not implemented")
    if weights.actorder not in (None, False, "weight", "static"):
        raise refuse(f"{where}.weights.actorder", weights.actorder, "group act-order (weight_g_idx) is not read")
    acts = group.get("input_activations")
    return parse(weights, None if acts is None else _args(f"{where}.input_activations", acts))


def _args(where: str, args: object) -> _Args:
    if not isinstance(args, dict):
        raise refuse(where, args, "expected quantization arguments")
    refuse_unknown(args, _ARG_KEYS, where)
    group_size = args.get("group_size")
    strategy = args.get("strategy")
    if strategy is None:  # compressed-tensors' inference of the strategy from the group size
        strategy = "tensor" if group_size is None else "channel" if group_size == -1 else "group"
    return _Args(
        where=where,
        num_bits=args.get("num_bits", 8),
        type=str(args.get("type", "int")).lower(),
        symmetric=args.get("symmetric", True),
        strategy=str(strategy).lower(),
        group_size=group_size,
        dynamic=args.get("dynamic", False),
        actorder=args.get("actorder"),
        block_structure=args.get("block_structure"),
        scale_dtype=args.get("scale_dtype"),
    )


def _packed(w: _Args, acts: _Args | None) -> WeightFormat:
    w.expect("type", ("int",), "pack-quantized weights are read as integers only")
    w.expect("num_bits", (4, 8), "pack-quantized weights are read at 4 and 8 bits only")
    w.expect("strategy", ("group", "channel"), "pack-quantized scales are read per group or per channel only")
    w.expect("symmetric", (True, False), "expected true or false")
    if acts is not None:
        summary = f"{acts.type}{acts.num_bits} {acts.strategy}"
        raise refuse(acts.where, summary, "quantized activations with pack-quantized weights are not implemented")
    group = _group_size(w)
    return WeightFormat("ct_packed", w.num_bits, w.strategy, group, w.symmetric, False, "none")


def _float(w: _Args, acts: _Args | None) -> WeightFormat:
    w.expect("type", ("float",), "float-quantized weights are read as float8 only")
    w.expect("num_bits", (8,), "float-quantized weights are read as float8 e4m3 only")
    w.expect("strategy", ("tensor", "channel"), "float8 weight scales are read per tensor or per channel only")
    w.expect("symmetric", (True,), "asymmetric float8 weights are not implemented")
    return WeightFormat("ct_float", 8, w.strategy, -1, True, False, _dynamic_token(acts, "float", "fp8_token"))


def _int(w: _Args, acts: _Args | None) -> WeightFormat:
    w.expect("type", ("int",), "int-quantized weights are read as integers only")
    w.expect("num_bits", (8,), "int-quantized weights are read at 8 bits only")
    w.expect("strategy", ("tensor", "channel"), "int8 weight scales are read per tensor or per channel only")
    w.expect("symmetric", (True,), "asymmetric int8 weights are not implemented")
    return WeightFormat("ct_int", 8, w.strategy, -1, True, False, _dynamic_token(acts, "int", "int8_token"))


def _dynamic_token(acts: _Args | None, kind: str, name: str) -> str:
    """Activations quantized at each call, per token, symmetric, 8 bits of ``kind`` -> ``name``; none -> "none"."""
    if acts is None:
        return "none"
    acts.expect("dynamic", (True,), "static activation scales (input_scale) are not implemented")
    acts.expect("type", (kind,), f"activations of another type than the weights' ({kind}) are not implemented")
    acts.expect("num_bits", (8,), "activations are read at 8 bits only")
    acts.expect("strategy", ("token",), "activation quantization other than per token is not implemented")
    acts.expect("symmetric", (True,), "asymmetric activation quantization is not implemented")
    acts.expect("scale_dtype", (None,), "a rounded activation scale is not implemented")
    return name


def _group_size(w: _Args) -> int:
    if w.strategy == "channel":
        return -1
    if not isinstance(w.group_size, int) or isinstance(w.group_size, bool) or w.group_size <= 0:
        raise refuse(f"{w.where}.group_size", w.group_size, "expected a positive group size")
    return w.group_size


_FORMATS = {"pack-quantized": _packed, "float-quantized": _float, "int-quantized": _int}
