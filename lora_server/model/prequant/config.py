"""config.json's ``quantization_config`` (or ``compression_config``, older compressed-tensors files) -> QuantScheme:
which layout stores each linear layer's weight, with its parameters. Read: AWQ (GEMM packing, 4-bit), GPTQ
(gptq and gptq_v2 checkpoint formats, 4 and 8 bits) and compressed-tensors (pack-quantized, float-quantized,
int-quantized; prequant.ct_config). Strict: a key this parser does not know, or a value it does not implement, is a
ModelLoadError naming the key and the value; a number is never read under a guess (the project's rule: refuse
rather than serve another model)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeGuard

from lora_server.errors import ModelLoadError

# The tensors each layout's quantized module reads, as suffixes of the module path ("model.layers.0.mlp.up_proj").
# A layer's static activation scale (input_scale) is in none of them: read_linear refuses it.
LAYOUT_TENSORS = {
    "awq_gemm": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "gptq_v2": ("qweight", "qzeros", "scales", "g_idx"),
    "ct_packed": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"),
    "ct_float": ("weight", "weight_scale", "weight_zero_point"),
    "ct_int": ("weight", "weight_scale", "weight_zero_point"),
}


@dataclass(frozen=True)
class WeightFormat:
    """How a checkpoint stores one linear layer's weight; prequant.read_linear reads it into a PackedLinear."""

    layout: str  # a key of LAYOUT_TENSORS
    bits: int  # 4 or 8
    strategy: str  # "group" (group scales along the input), "channel" (one per output row), "tensor" (one in all)
    group: int  # input columns per scale when strategy == "group"; -1 otherwise (the whole row)
    sym: bool  # symmetric: the zero point is the middle code (GPTQ stores it anyway: read and checked)
    act_order: bool  # GPTQ desc_act: g_idx may assign input columns to groups out of order
    activations: str  # prequant.packed.ACTIVATIONS: what the scheme does to the layer's input


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's quantization: per config group (AWQ and GPTQ have one, targeting every Linear) the module
    patterns it targets and its WeightFormat, and the modules kept float. A pattern is "Linear" (any linear layer),
    "re:<regex>" (re.match on the module path, as compressed-tensors matches) or an exact module path."""

    method: str  # "awq" | "gptq" | "compressed-tensors"
    groups: tuple[tuple[str, tuple[str, ...], WeightFormat], ...]  # (group name, target patterns, format)
    ignore: tuple[str, ...]  # patterns of modules kept float (AWQ's modules_to_not_convert, as substrings)

    def format_of(self, module: str) -> WeightFormat | None:
        """The format storing ``module`` (an HF module path), or None where the scheme keeps it float. AWQ and GPTQ
        name no modules: their one format covers every linear layer, and read_linear takes a float ``weight`` in the
        file (lm_head, typically) for a layer they left float."""
        if any(pattern_matches(p, module) for p in self.ignore):
            return None
        hits = [(name, fmt) for name, targets, fmt in self.groups if any(pattern_matches(t, module) for t in targets)]
        if len(hits) > 1:
            raise ModelLoadError(
                f"quantization_config: {module} matches the targets of several config groups "
                f"({', '.join(name for name, _ in hits)}); which one stores it is not decided here"
            )
        return hits[0][1] if hits else None

    def consumed(self, module: str) -> list[str]:
        """Full names of the tensors that ``module``'s quantized form reads (those of them in the file): the
        loader counts them as read when read_linear returned a PackedLinear for it. Empty where the scheme keeps
        the module float."""
        fmt = self.format_of(module)
        return [] if fmt is None else [f"{module}.{suffix}" for suffix in LAYOUT_TENSORS[fmt.layout]]


def pattern_matches(pattern: str, module: str) -> bool:
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == module


def refuse(key: str, value: object, why: str) -> ModelLoadError:
    return ModelLoadError(f"config.json quantization_config: {key} = {value!r}: {why}")


def refuse_unknown(spec: dict, known: frozenset[str], where: str) -> None:
    """A key this reader does not know is refused, unless its value is null (not set)."""
    unknown = sorted(k for k in set(spec) - known if spec[k] is not None)
    if unknown:
        raise refuse(
            f"{where}.{unknown[0]}" if where else unknown[0],
            spec[unknown[0]],
            f"not a key this reader knows ({len(unknown)} unknown: {', '.join(unknown)}); it might change the numbers",
        )


def one_of(spec: dict, keys: tuple[str, ...], default: object) -> tuple[str, object]:
    """The value under the first of ``keys`` present (synonyms, as different tools write them), checked to be the
    same under every one of them present: (key, value), or (keys[0], default) where none is."""
    present = [k for k in keys if spec.get(k) is not None]
    values = {repr(_lower(spec[k])) for k in present}
    if len(values) > 1:
        shown = ", ".join(f"{k} = {spec[k]!r}" for k in present)
        raise ModelLoadError(f"config.json quantization_config: {shown} disagree")
    return (present[0], _lower(spec[present[0]])) if present else (keys[0], default)


def _lower(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


# ---- AWQ and GPTQ -----------------------------------------------------------------------------------------------

# How the quantizer ran or which kernel a loader picks: the stored tensors say the same numbers whatever these are.
# GPTQ's act-order permutation, static groups included, is read from g_idx itself; lm_head and the modules_in_block
# lists say which layers were quantized, which the file's tensors say too (read_linear checks each layer's form).
_TOOL_KEYS = frozenset(
    {
        "quant_method", "tokenizer", "dataset", "damp_percent", "damp_auto_increment", "true_sequential",
        "static_groups", "act_group_aware", "mse", "model_seqlen", "block_name_to_quantize",
        "module_name_preceding_first_block", "modules_in_block_to_quantize", "batch_size", "pad_token_id",
        "max_input_length", "cache_block_outputs", "use_cuda_fp16", "use_exllama", "disable_exllama",
        "exllama_config", "backend", "model_name_or_path", "model_file_base_name", "meta", "lm_head", "do_fuse",
        "fuse_max_seq_len", "modules_to_fuse", "pack_impl",
    }
)  # fmt: skip
# Keys whose value is checked: an implemented value passes, any other is refused.
_CHECKED_KEYS = frozenset(
    {
        "bits", "w_bit", "group_size", "q_group_size", "desc_act", "act_order", "sym", "zero_point", "version",
        "format", "checkpoint_format", "is_marlin_format", "modules_to_not_convert", "dynamic", "pack_dtype",
    }
)  # fmt: skip


def awq_scheme(spec: dict) -> QuantScheme:
    """AutoAWQ GEMM: 4-bit, zero points always (``sym``, which transformers' AwqConfig inherits from GPTQConfig and
    writes as true, is not AWQ's: ``zero_point`` is)."""
    refuse_unknown(spec, _TOOL_KEYS | (_CHECKED_KEYS - {"is_marlin_format"}), "")
    _common_checks(spec)
    key, bits = one_of(spec, ("bits", "w_bit"), None)
    if bits != 4 or not _is_int(bits):
        raise refuse(key, bits, "AWQ is read at 4 bits only")
    key, version = one_of(spec, ("version", "format", "checkpoint_format"), "gemm")  # AutoAWQ's default is GEMM
    if version != "gemm":
        raise refuse(key, version, "only AWQ's GEMM packing is read (not gemv, gemv_fast, llm-awq, marlin, ...)")
    if _lower(spec.get("backend")) == "llm-awq":
        raise refuse("backend", spec["backend"], "llm-awq checkpoints pack as gemv_fast, which is not read")
    if spec.get("zero_point", True) is not True:
        raise refuse("zero_point", spec["zero_point"], "AWQ GEMM without zero points is not read")
    key, desc_act = one_of(spec, ("desc_act", "act_order"), False)
    if desc_act:
        raise refuse(key, desc_act, "AWQ has no act-order")
    strategy, group = _group(spec, ("group_size", "q_group_size"))
    not_converted = spec.get("modules_to_not_convert") or []
    if not isinstance(not_converted, list) or not all(isinstance(m, str) for m in not_converted):
        raise refuse("modules_to_not_convert", not_converted, "expected a list of module names")
    fmt = WeightFormat("awq_gemm", 4, strategy, group, False, False, "none")
    # transformers skips a module whose path contains any of these names
    ignore = tuple("re:.*" + re.escape(name) for name in not_converted)
    return QuantScheme("awq", (("awq", ("Linear",), fmt),), ignore)


def gptq_scheme(spec: dict) -> QuantScheme:
    """AutoGPTQ / GPTQModel: 4 or 8 bits, checkpoint_format gptq (v1: stored zero = zero - 1) or gptq_v2 (stored
    zero = zero), desc_act (g_idx), sym (zeros stored anyway; without ``sym`` they are read as stored)."""
    refuse_unknown(spec, _TOOL_KEYS | (_CHECKED_KEYS - {"zero_point", "version", "modules_to_not_convert"}), "")
    _common_checks(spec)
    bits = spec.get("bits")
    if bits not in (4, 8) or not _is_int(bits):
        raise refuse("bits", bits, "GPTQ is read at 4 and 8 bits only")
    key, version = one_of(spec, ("checkpoint_format", "format"), "gptq")
    layouts = {"gptq": "gptq", "gptq_v2": "gptq_v2"}
    if version not in layouts:
        raise refuse(key, version, "only the gptq and gptq_v2 checkpoint formats are read (not marlin, bitblas, ...)")
    if spec.get("is_marlin_format"):
        raise refuse("is_marlin_format", spec["is_marlin_format"], "marlin-packed GPTQ is not read")
    key, desc_act = one_of(spec, ("desc_act", "act_order"), False)
    if not isinstance(desc_act, bool):
        raise refuse(key, desc_act, "expected true or false")
    sym = spec.get("sym", False)
    if not isinstance(sym, bool):
        raise refuse("sym", sym, "expected true or false")
    strategy, group = _group(spec, ("group_size",))
    fmt = WeightFormat(layouts[str(version)], bits, strategy, group, sym, desc_act, "none")
    return QuantScheme("gptq", (("gptq", ("Linear",), fmt),), ())


def _common_checks(spec: dict) -> None:
    if spec.get("dynamic"):
        raise refuse("dynamic", spec["dynamic"], "per-module overrides of the quantization are not implemented")
    if spec.get("pack_dtype") not in (None, "int32"):
        raise refuse("pack_dtype", spec["pack_dtype"], "only int32 packing is read")


def _group(spec: dict, keys: tuple[str, ...]) -> tuple[str, int]:
    key, size = one_of(spec, keys, None)
    if size == -1 and _is_int(size):
        return "channel", -1
    if not _is_int(size) or size <= 0:
        raise refuse(key, size, "expected a positive group size or -1 (per channel)")
    return "group", size


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
