"""A checkpoint's numbers, checked before anything is sized from them: a setting's type and range where it is read
(config.json's through check_hf_config, GGUF metadata through gguf_checkpoint's typed getters), the relations
between the sizes once they form a ModelArch (check_arch), each tensor's shape, from its file's header, against the
one the ModelArch gives it (TensorShapes), and a GGUF file's layout against its length (check_gguf_file). Every
failure is a ModelLoadError naming the setting or the tensor; `about` puts the file in front of the message.

The bounds are wide of every published model: they stop a number that would size a list, a table or an
allocation past the machine, and the tensors' own shapes check the rest of an HF or GGUF checkpoint's sizes."""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lora_server.errors import ModelLoadError


class ArchSizes(Protocol):
    """What these checks read of a model.arch.ModelArch (which model.arch builds after these checks have passed:
    described here, not imported)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def moe_intermediate_size(self) -> int: ...
    @property
    def q_size(self) -> int: ...
    @property
    def kv_size(self) -> int: ...
    @property
    def rotary_width(self) -> int: ...
    @property
    def rope_scaling_dict(self) -> dict[str, Any]: ...
    @property
    def layer_windows(self) -> tuple[int, ...]: ...
    @property
    def bos_token_id(self) -> int | None: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...


MAX_SIZE = (1 << 31) - 1  # any width, count or token id: the kernels index rows and tokens with int32
MAX_LAYERS = 1 << 12  # the deepest published decoders have under 200 layers
MAX_POSITIONS = 1 << 24  # the longest published contexts are 10M positions; the rotary table is sized from it
MAX_JSON_BYTES = 64 << 20  # config.json and the shard index (real ones: kilobytes to a few megabytes)


@contextlib.contextmanager
def about(path: Path | str) -> Iterator[None]:
    """A ModelLoadError raised inside names ``path`` first (unless its message already starts with a path in it)."""
    try:
        yield
    except ModelLoadError as exc:
        if exc.message.startswith(str(path)):
            raise
        raise ModelLoadError(f"{path}: {exc.message}") from exc


# ---- single values -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Int:
    """An integer setting in [low, high]; ``nullable``: null means "not set" where the reader says so."""

    low: int = 1
    high: int = MAX_SIZE
    nullable: bool = False


@dataclass(frozen=True)
class Real:
    """A finite real setting above ``low`` (at ``low`` too when ``closed``) and at most ``high``."""

    low: float = 0.0
    high: float = math.inf
    closed: bool = False
    nullable: bool = False


SIZE, POSITIVE = Int(), Real()  # the common ranges: an integer in 1..MAX_SIZE, a finite number above 0


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: object, name: str, spec: Int = SIZE) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and spec.low <= value <= spec.high:
        return value
    raise ModelLoadError(f"{name} = {_shown(value)}: expected an integer in {spec.low}..{spec.high}")


def check_real(value: object, name: str, spec: Real = POSITIVE) -> float:
    real = _as_float(value)
    if real is not None and (real >= spec.low if spec.closed else real > spec.low) and real <= spec.high:
        return real
    bound = f"{'at least' if spec.closed else 'above'} {spec.low:g}"
    bound += f" and at most {spec.high:g}" if spec.high < math.inf else ""
    raise ModelLoadError(f"{name} = {_shown(value)}: expected a finite number {bound}")


def _as_float(value: object) -> float | None:
    """A JSON or GGUF number as a finite float; None for anything else (NaN, infinities, text, an integer too large
    for a float)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        real = float(value)
    except OverflowError:
        return None
    return real if math.isfinite(real) else None


def check_value(value: object, name: str, spec: Int | Real | type) -> None:
    if isinstance(spec, Int):
        check_int(value, name, spec)
    elif isinstance(spec, Real):
        check_real(value, name, spec)
    elif not isinstance(value, spec):
        raise ModelLoadError(f"{name} = {_shown(value)}: expected a {spec.__name__}")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def head_width(hidden: int, heads: int, hidden_name: str, heads_name: str) -> int:
    """hidden / heads, the head size where the checkpoint does not give it: heads must divide hidden."""
    if hidden % heads:
        raise ModelLoadError(f"{heads_name} {heads} does not divide {hidden_name} {hidden}, and no head size is given")
    return hidden // heads


# ---- config.json --------------------------------------------------------------------------------------------

# What ModelArch.from_hf_config reads; null is refused unless nullable (read as "not set" there)
_HF_SETTINGS: dict[str, Int | Real | type] = {
    "vocab_size": Int(),
    "hidden_size": Int(),
    "intermediate_size": Int(),
    "num_hidden_layers": Int(high=MAX_LAYERS),
    "num_attention_heads": Int(),
    "num_key_value_heads": Int(nullable=True),
    "head_dim": Int(nullable=True),
    "max_position_embeddings": Int(high=MAX_POSITIONS),
    "original_max_position_embeddings": Int(high=MAX_POSITIONS),
    "sliding_window": Int(low=0, nullable=True),
    "max_window_layers": Int(low=0, high=MAX_LAYERS, nullable=True),
    "sliding_window_pattern": Int(high=MAX_LAYERS),
    "bos_token_id": Int(low=0, nullable=True),
    "rms_norm_eps": Real(),
    "rope_theta": Real(),
    "rope_local_base_freq": Real(),
    "partial_rotary_factor": Real(high=1.0),
    "query_pre_attn_scalar": Real(nullable=True),
    "attn_logit_softcapping": Real(closed=True, nullable=True),
    "final_logit_softcapping": Real(closed=True, nullable=True),
}
HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# a RoPE parameters object's (rope_scaling, rope_parameters, or one of its per-layer-type objects)
_ROPE_SETTINGS: dict[str, Int | Real | type] = {
    "rope_type": str,
    "type": str,
    "rope_theta": Real(),
    "factor": Real(nullable=True),
    "low_freq_factor": Real(),
    "high_freq_factor": Real(),
    "attention_factor": Real(nullable=True),
    "partial_rotary_factor": Real(high=1.0),
    "original_max_position_embeddings": Int(high=MAX_POSITIONS),
}
_LAYER_TYPES = ("full_attention", "sliding_attention")  # rope_parameters nested per layer type (Gemma 3)


def read_json_object(file: Path) -> dict[str, Any]:
    """A JSON file that must hold an object (config.json, the shard index), read within MAX_JSON_BYTES."""
    try:
        size = file.stat().st_size
        if size > MAX_JSON_BYTES:
            raise ModelLoadError(f"{file}: {size} bytes, more than the {MAX_JSON_BYTES} read of a JSON file")
        value = json.loads(file.read_bytes())
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise ModelLoadError(f"{file}: not valid JSON ({type(exc).__name__}: {exc})") from exc
    except OSError as exc:
        raise ModelLoadError(f"{file}: cannot be read ({exc})") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


def check_hf_config(cfg: dict[str, Any]) -> None:
    """config.json's settings (a multimodal one's text model's, defaults merged): the required ones present, each
    of the right type and range, the RoPE parameter objects alike."""
    missing = [key for key in HF_REQUIRED if cfg.get(key) is None]
    if missing:
        raise ModelLoadError(f"{', '.join(missing)} missing (or null)")
    _check_settings(cfg, _HF_SETTINGS, "")
    for flag in ("tie_word_embeddings", "use_sliding_window"):
        if cfg.get(flag) is not None:
            check_value(cfg[flag], flag, bool)
    eos = cfg.get("eos_token_id")
    for i, token in enumerate(eos if isinstance(eos, list) else [] if eos is None else [eos]):
        check_int(token, "eos_token_id" if not isinstance(eos, list) else f"eos_token_id[{i}]", Int(low=0))
    types = cfg.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise ModelLoadError(f"layer_types = {_shown(types)}: expected a list of layer type names")
    for key in ("rope_scaling", "rope_parameters"):
        params = cfg.get(key)
        if params is None:
            continue
        check_value(params, key, dict)
        nested = [t for t in _LAYER_TYPES if t in params]
        for inner in nested:
            if params[inner] is not None:
                check_value(params[inner], f"{key}.{inner}", dict)
                _check_rope(params[inner], f"{key}.{inner}")
        if not nested:
            _check_rope(params, key)


def _check_rope(params: dict[str, Any], where: str) -> None:
    _check_settings(params, _ROPE_SETTINGS, f"{where}.")
    for key in ("short_factor", "long_factor"):
        if params.get(key) is not None:
            check_factors(params[key], f"{where}.{key}")


def check_factors(values: object, name: str) -> None:
    """LongRoPE's per-dimension factors: a list of finite positive numbers."""
    if not isinstance(values, list | tuple) or len(values) > MAX_SIZE:
        raise ModelLoadError(f"{name} = {_shown(values)}: expected a list of numbers")
    for i, value in enumerate(values):
        check_real(value, f"{name}[{i}]")


def _check_settings(cfg: dict[str, Any], specs: Mapping[str, Int | Real | type], prefix: str) -> None:
    for key, spec in specs.items():
        if key not in cfg:
            continue
        if cfg[key] is None:
            if not getattr(spec, "nullable", False):
                raise ModelLoadError(f"{prefix}{key} is null")
            continue
        check_value(cfg[key], prefix + key, spec)


# ---- the shape as a whole -----------------------------------------------------------------------------------

# ModelArch field -> config.json's key, for messages (GGUF files name theirs: gguf_checkpoint.gguf_names)
HF_NAMES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "rotary_dim": "partial_rotary_factor",
}
_ARCH_SIZES = {
    "vocab_size": Int(),
    "hidden_size": Int(),
    "intermediate_size": Int(),
    "num_layers": Int(high=MAX_LAYERS),
    "num_heads": Int(),
    "num_kv_heads": Int(),
    "head_dim": Int(),
    "max_position_embeddings": Int(high=MAX_POSITIONS),
    "rotary_dim": Int(low=0),
}
_ARCH_REALS = {
    "rms_norm_eps": Real(),
    "rope_theta": Real(),
    "rope_attention_factor": Real(),
    "embed_scale": Real(),
    "attn_scale": Real(closed=True),
    "attn_softcap": Real(closed=True),
    "final_softcap": Real(closed=True),
    "local_rope_theta": Real(closed=True),
}
# RoPE scaling type -> the parameters model.llama.rope_inv_freq reads for it
_ROPE_NEEDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "original_max_position_embeddings"),
}


def check_arch(arch: ArchSizes, names: Mapping[str, str]) -> None:
    """A ModelArch's sizes and their relations as the model relies on them: every size positive and bounded, every
    real finite, key/value heads dividing the query heads, an even rotary width within the head, a window per
    layer, the RoPE scaling's parameters. ``names``: ModelArch field -> the checkpoint's name for it."""

    def name(field: str) -> str:
        return names.get(field, field)

    for field, size in _ARCH_SIZES.items():
        check_int(getattr(arch, field), name(field), size)
    for field, real in _ARCH_REALS.items():
        check_real(getattr(arch, field), name(field), real)
    if arch.num_heads % arch.num_kv_heads:
        raise ModelLoadError(
            f"{name('num_kv_heads')} {arch.num_kv_heads} does not divide {name('num_heads')} {arch.num_heads}: "
            "each key/value head serves a whole group of query heads"
        )
    if arch.rotary_width % 2 or arch.rotary_width > arch.head_dim:
        raise ModelLoadError(
            f"{name('rotary_dim')}: the rotary embedding would turn {arch.rotary_width} of a head's {arch.head_dim} "
            "dimensions; expected an even number within the head"
        )
    if arch.layer_windows and len(arch.layer_windows) != arch.num_layers:
        raise ModelLoadError(f"{len(arch.layer_windows)} sliding windows for {arch.num_layers} layers")
    for window in arch.layer_windows:
        check_int(window, "sliding_window", Int(low=0))
    if arch.bos_token_id is not None:
        check_int(arch.bos_token_id, "bos_token_id", Int(low=0))
    for token in arch.eos_token_ids:
        check_int(token, "eos_token_id", Int(low=0))
    _check_rope_scaling(arch.rope_scaling_dict, name("rope_scaling"))


def _check_rope_scaling(scaling: dict[str, Any], where: str) -> None:
    kind = scaling.get("rope_type", scaling.get("type"))
    for key in _ROPE_NEEDS.get(kind, ()):  # type: ignore[arg-type]
        if scaling.get(key) is None:
            raise ModelLoadError(f"{where}: {kind} RoPE scaling without {key}")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor"):
        if scaling.get(key) is not None:
            check_real(scaling[key], f"{where}.{key}")
    if scaling.get("original_max_position_embeddings") is not None:
        check_int(scaling["original_max_position_embeddings"], f"{where}.original_max_position_embeddings")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ModelLoadError(f"{where}: llama3 RoPE scaling's high_freq_factor must be above its low_freq_factor")
    for key in ("short_factor", "long_factor"):
        if scaling.get(key) is not None:
            check_factors(scaling[key], f"{where}.{key}")


# ---- tensors ------------------------------------------------------------------------------------------------


class TensorShapes:
    """Each canonical tensor's shape (model.checkpoint's names; Phi-3's fused qkv and gate_up before the split) as
    a ModelArch makes it, and the check of a tensor's shape from its file's header against it."""

    def __init__(self, arch: ArchSizes, names: Mapping[str, str]) -> None:
        self.arch, self.names = arch, names
        h, q, kv, i, d = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size, arch.head_dim
        qf, kvf, hf, mf = (
            ("num_heads", "head_dim"),
            ("num_kv_heads", "head_dim"),
            ("hidden_size",),
            ("intermediate_size",),
        )
        vocab = ((arch.vocab_size, h), ("vocab_size", "hidden_size"))
        norm = ((h,), hf)
        self.shapes: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
            "embed": vocab,
            "lm_head": vocab,
            "norm": norm,
            "attn_norm": norm,
            "mlp_norm": norm,
            "post_attn_norm": norm,
            "post_mlp_norm": norm,
            "q": ((q, h), qf + hf),
            "k": ((kv, h), kvf + hf),
            "v": ((kv, h), kvf + hf),
            "o": ((h, q), hf + qf),
            "gate": ((i, h), mf + hf),
            "up": ((i, h), mf + hf),
            "down": ((h, i), hf + mf),
            "q_bias": ((q,), qf),
            "k_bias": ((kv,), kvf),
            "v_bias": ((kv,), kvf),
            "q_norm": ((d,), ("head_dim",)),
            "k_norm": ((d,), ("head_dim",)),
            "qkv": ((q + 2 * kv, h), ("num_heads", "num_kv_heads", "head_dim", "hidden_size")),
            "gate_up": ((2 * i, h), mf + hf),
            "rope_freqs": ((arch.rotary_width // 2,), ("head_dim",)),
        }
        e, w = arch.num_experts, arch.moe_intermediate_size
        if e:  # an MoE model's (model.moe): the router, each expert's linears, or all experts' stacked (HF 5's)
            ef, wf = ("num_experts",), ("moe_intermediate_size",)
            self.shapes.update(
                router=((e, h), ef + hf),
                expert_gate=((w, h), wf + hf),
                expert_up=((w, h), wf + hf),
                expert_down=((h, w), hf + wf),
                experts_gate_up=((e, 2 * w, h), ef + wf + hf),
                experts_gate=((e, w, h), ef + wf + hf),  # GGUF's, gate and up stacked apart
                experts_up=((e, w, h), ef + wf + hf),
                experts_down=((e, h, w), ef + hf + wf),
            )

    def check(self, canonical: str, shape: tuple[int, ...], tensor: str) -> None:
        """``tensor`` (the file's name for it) holds ``canonical``: its layer is one of the arch's, its shape the
        arch's."""
        arch = self.arch
        if canonical.startswith("layers."):
            layer = int(canonical.split(".")[1])
            if layer >= arch.num_layers:
                raise ModelLoadError(
                    f"{tensor} belongs to layer {layer}, but {self._name('num_layers')} is {arch.num_layers}"
                )
        expected, fields = self.shapes[shape_key(canonical)]
        if tuple(shape) != expected:
            made = ", ".join(f"{self._name(f)} {getattr(arch, f)}" for f in fields)
            raise ModelLoadError(f"{tensor} has shape {tuple(shape)}, but {made} make it {expected}")

    def check_layers(self, canonical_names: Iterable[str]) -> None:
        """The tensors hold every layer of the arch (where they hold any: a checkpoint without layer tensors
        fails when built, naming the first one it lacks)."""
        present = {int(n.split(".")[1]) for n in canonical_names if n.startswith("layers.")}
        layers = self.arch.num_layers
        if present and len(present) != layers:
            first = min(set(range(layers)) - present)
            raise ModelLoadError(
                f"{self._name('num_layers')} is {layers}, but the tensors hold {len(present)} layer(s): none of "
                f"layer {first}"
            )

    def _name(self, field: str) -> str:
        return self.names.get(field, field)


def shape_key(canonical: str) -> str:
    """TensorShapes' key of a canonical name: its last part; an expert's linear (layers.0.experts.3.gate)
    expert_gate, all experts' stacked (layers.0.experts.gate_up) experts_gate_up."""
    parts = canonical.split(".")
    if len(parts) > 3 and parts[2] == "experts":
        return ("expert_" if parts[3].isdigit() else "experts_") + parts[-1]
    return parts[-1]


# ---- GGUF layout --------------------------------------------------------------------------------------------

_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4
_GGUF_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS


class _Cursor:
    """Reads a GGUF header front to back; reading past the end is a ModelLoadError."""

    def __init__(self, data: mmap.mmap, order: str) -> None:
        self.data, self.pos, self.order = data, 0, order

    def skip(self, n: int, what: str) -> int:
        if n > len(self.data) - self.pos:
            raise ModelLoadError(f"{what} runs past the end of the file ({len(self.data)} bytes): cut short?")
        start, self.pos = self.pos, self.pos + n
        return start

    def uint(self, size: int, what: str) -> int:
        start = self.skip(size, what)
        return int.from_bytes(self.data[start : start + size], "little" if self.order == "<" else "big")

    def string(self, what: str) -> str:
        n = self.uint(8, what)
        start = self.skip(n, what)
        try:
            return self.data[start : start + n].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ModelLoadError(f"{what} is not UTF-8 ({exc})") from exc

    def value(self, kind: int, what: str) -> None:
        if kind in _GGUF_SCALAR_BYTES:
            self.skip(_GGUF_SCALAR_BYTES[kind], what)
        elif kind == _GGUF_STRING:
            self.string(what)
        elif kind == _GGUF_ARRAY:
            element, count = self.uint(4, what), self.uint(8, what)
            if element in _GGUF_SCALAR_BYTES:
                self.skip(count * _GGUF_SCALAR_BYTES[element], what)
            elif element == _GGUF_STRING:
                if count * 8 > len(self.data) - self.pos:  # 8 bytes each at least
                    raise ModelLoadError(f"{what}: {count} strings cannot fit in the rest of the file: cut short?")
                for _ in range(count):
                    self.string(what)
            else:  # ggml reads no nested arrays
                raise ModelLoadError(f"{what} is an array of value type {element}, which is not read")
        else:
            raise ModelLoadError(f"{what} has value type {kind}, which GGUF does not define")


def check_gguf_file(path: Path) -> None:
    """A GGUF file's layout, without reading its tensors: the magic and version, every metadata value and tensor
    description within the file, no key or tensor twice, each tensor of a known type and at most 4 dimensions
    whose data lies inside the file. What passes cannot make gguf's reader loop, recurse or read past the end."""
    if not path.is_file():
        raise ModelLoadError(f"{path} is not a file")
    try:
        size = path.stat().st_size
        if size < 24:
            raise ModelLoadError(f"{path}: not a GGUF file ({size} bytes, shorter than a GGUF header)")
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data, about(path):
            _scan_gguf(data)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read ({exc})") from exc


def _scan_gguf(data: mmap.mmap) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = len(data)
    if data[:4] != b"GGUF":
        raise ModelLoadError("not a GGUF file (it does not start with the GGUF magic)")
    order = "<" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF else ">"  # gguf's reader's byte-order rule
    r = _Cursor(data, order)
    r.skip(4, "the magic")
    version = r.uint(4, "the version")
    if version not in (2, 3):
        raise ModelLoadError(f"GGUF version {version}: versions 2 and 3 are read")
    tensor_count, kv_count = r.uint(8, "the tensor count"), r.uint(8, "the key count")
    if kv_count * 12 + tensor_count * 24 > size:  # a key takes 12 bytes at least, a tensor description 24
        raise ModelLoadError(f"{kv_count} keys and {tensor_count} tensors cannot fit in {size} bytes: cut short?")
    keys: set[str] = set()
    alignment = 32
    for _ in range(kv_count):
        key = r.string("a metadata key")
        if key in keys:
            raise ModelLoadError(f"metadata key {key} appears twice")
        keys.add(key)
        kind = r.uint(4, key)
        if key == "general.alignment":
            alignment = r.uint(4, key) if kind == _GGUF_UINT32 else 0
            if alignment <= 0 or alignment & (alignment - 1):
                raise ModelLoadError("general.alignment: expected a power of two stored as uint32")
        else:
            r.value(kind, f"metadata {key}")
    tensors: dict[str, tuple[int, int]] = {}  # name -> (offset, bytes)
    for _ in range(tensor_count):
        name = r.string("a tensor name")
        n_dims = r.uint(4, name)
        if not 1 <= n_dims <= _GGUF_MAX_DIMS:
            raise ModelLoadError(f"tensor {name} has {n_dims} dimensions (1 to {_GGUF_MAX_DIMS} are read)")
        dims = [r.uint(8, name) for _ in range(n_dims)]
        kind, offset = r.uint(4, name), r.uint(8, name)
        if name in tensors:
            raise ModelLoadError(f"tensor {name} appears twice")
        try:
            block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ModelLoadError(f"tensor {name} has type {kind}, which gguf does not know") from None
        if min(dims) < 1 or dims[0] % block:
            raise ModelLoadError(f"tensor {name} has dimensions {dims}: not whole blocks of {block} values")
        tensors[name] = (offset, math.prod(dims) // block * type_bytes)
    start = -(-r.pos // alignment) * alignment
    for name, (offset, n_bytes) in tensors.items():
        if start + offset + n_bytes > size:
            raise ModelLoadError(
                f"tensor {name}'s data (bytes {start + offset}..{start + offset + n_bytes}) runs past the end of the "
                f"file ({size} bytes): cut short?"
            )
