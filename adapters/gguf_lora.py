"""LoRA adapters in llama.cpp's GGUF (what its convert_lora_to_gguf.py writes from a PEFT directory), read into the
same LoraAdapter as adapters.peft_format reads the PEFT directory, computing what llama.cpp computes with the file
(src/llama-adapter.cpp, llama-graph.cpp's build_lora_mm):

- ``blk.N.<tensor>.weight.lora_a`` holds A [r, in] and ``.lora_b`` holds B [out, r] (row-major, as PEFT's lora_A
  and lora_B: ggml's ne is the reverse), in F32, F16, BF16 or a quantized type (dequantized by the gguf package);
- the delta is ``scale * B A x`` with scale = adapter.lora.alpha / r, r being each pair's own rank, and 1 when the
  file has no alpha or alpha 0 (llama_adapter_lora_weight::get_scale, at the user scale 1);
- for a llama file the converter permuted the rows of q's and k's lora_B per head, as it permutes the base's
  (LlamaModel.permute): undone here, as model.gguf_checkpoint undoes it for the base, so that B meets HF's rows;
- Phi-3's attn_qkv and ffn_up are fused (q|k|v, gate|up): their lora_B rows split between the parts, A shared;
- adapter.alora.invocation_tokens (uint32s) makes it an activated LoRA (LoraAdapter.invocation_tokens).

Anything else that would change what the adapter computes is refused by name: LoRA on token_embd or output, norm
weights (mergekit-extract-lora's, which llama.cpp skips), unknown adapter.* keys, tensor types the gguf package
cannot dequantize, another architecture than the base's. Other metadata (general.*, the architecture's keys) is
ignored, as llama.cpp ignores it in an adapter. The file is read once into memory, never memory-mapped
(peft_files.read_file), and its header parsed here with llama.cpp's own checks (gguf.cpp): the gguf package's
reader maps the file."""

from __future__ import annotations

import math
import os
import reprlib
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from lora_server.adapters.errors import AdapterError
from lora_server.adapters.lora_types import BaseShapes, LoraAdapter
from lora_server.adapters.peft_files import read_file
from lora_server.adapters.peft_format import _resolve, _within, check_invocation_tokens

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # llama.cpp refuses GGUFv1 and versions after 3 (gguf.cpp)
_DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
_MAX_DIMS = 4  # GGML_MAX_DIMS
_SCALARS = {  # GGUF value type -> its little-endian struct format
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
# The base's HF architecture (ModelArch.architecture) -> the general.architecture llama.cpp's converter writes for
# it (conversion/__init__.py and each model class's model_arch)
GGUF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",  # LlamaModel converts Mistral too
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text model, as convert_lora_to_gguf converts it
    "Phi3ForCausalLM": "phi3",
}
_FUSED_ARCHITECTURES = frozenset({"phi3"})
_PERMUTED_ARCHITECTURES = frozenset({"llama"})  # LlamaModel.undo_permute: its q and k rows
# GGUF layer tensors (blk.N.<name>.weight) -> the PEFT module path they are (ffn_up is Phi-3's gate|up when fused)
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_LEVEL = {"token_embd": "the token embeddings", "output": "the output head"}
# adapter.* keys and what is done with them; any other adapter.* key is refused (it may change what llama.cpp does)
_ADAPTER_KEYS = {
    "adapter.type": "must be lora",
    "adapter.lora.alpha": "the scale's numerator",
    "adapter.alora.invocation_tokens": "LoraAdapter.invocation_tokens",
    "adapter.lora.task_name": "informative: llama.cpp only lists it",
    "adapter.lora.prompt_prefix": "informative: llama.cpp lists it for the client to prepend, and prepends nothing",
}


@dataclass(frozen=True, slots=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major (numpy's), the reverse of ggml's ne
    kind: GGMLQuantizationType
    start: int  # its first byte in the file
    nbytes: int


@dataclass(slots=True)
class _GGUF:
    metadata: dict[str, tuple[GGUFValueType, object]]  # key -> (type; ARRAY: its elements' type, value)
    tensors: dict[str, _TensorInfo]


def load_gguf_adapter(
    name: str, path: str | Path, base: BaseShapes, max_rank: int, allowed_roots: list[Path] | None = None
) -> LoraAdapter:
    """Validate and read one GGUF LoRA file (load_peft_adapter's contract: every refusal an AdapterError whose
    ``public`` reason names no path; ``allowed_roots`` None allows any path, otherwise the file, symlinks resolved,
    must lie inside one)."""
    roots = None if allowed_roots is None else [r.expanduser().resolve() for r in allowed_roots]
    file = _resolve(Path(path), f"adapter path {path}", "the adapter's file")
    if roots is not None and not _within(file, roots):
        outside = f"outside the allowed adapter roots ({', '.join(map(str, roots)) or 'none configured'})"
        raise AdapterError(f"adapter path {path} is {outside}", "the adapter's file is outside the adapter roots")
    if not file.is_file():
        raise AdapterError(f"adapter path {path} is not a file", "the adapter's GGUF path is not a file")
    data, _ = read_file(file)
    gguf = _parse(data)
    arch = _check_metadata(gguf.metadata, base)
    scale_alpha = _alpha(gguf.metadata)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    ranks = []
    for (layer, module), (a_info, b_info) in sorted(_pairs(gguf.tensors, base).items()):
        what = b_info.name.removesuffix(".lora_b")
        in_f, out_f = base.module_features(module)
        rank = a_info.shape[0]
        if rank == 0 or a_info.shape != (rank, in_f) or b_info.shape != (out_f, rank):
            raise AdapterError(
                f"{what}: lora_a {a_info.shape} / lora_b {b_info.shape} do not fit the base's {in_f} inputs and "
                f"{out_f} outputs: lora_a must be [r, {in_f}] and lora_b [{out_f}, r] (ggml's ne reversed)"
            )
        if rank > max_rank:
            raise AdapterError(f"{what}: rank {rank} is above the server's maximum LoRA rank {max_rank}")
        a, b = _tensor(data, a_info), _tensor(data, b_info)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{what} has NaN or Inf weights")
        if arch in _PERMUTED_ARCHITECTURES and module in ("self_attn.q_proj", "self_attn.k_proj"):
            b = _unpermute_rows(b, out_f, base, what)
        scaling = scale_alpha / rank if scale_alpha else 1.0
        b = b * scaling
        if not torch.isfinite(b).all():
            raise AdapterError(f"{what}: lora_b times the scale {scaling:.3g} (alpha / rank) overflows float32")
        parts = base.modules[module]  # a fused module: B's rows split by its parts' widths, A shared
        widths = [base.features[p][1] for p in parts]
        for part, b_part in zip(parts, b.split(widths), strict=True):
            weights[(layer, part)] = (a, b_part.contiguous())
        ranks.append(rank)
    if not weights:
        raise AdapterError("the GGUF adapter holds no LoRA tensors (blk.N.<tensor>.weight.lora_a / .lora_b)")
    invocation = _invocation_tokens(gguf.metadata, base)
    # the path as named (absolute), not the link's target: what it is read from again, whose .gguf says the format
    named = Path(os.path.abspath(Path(path).expanduser()))
    return LoraAdapter(name, named, max(ranks), weights, invocation)


# ---- the file: llama.cpp's gguf.cpp reading rules, over bytes in memory ------------------------------------------


class _Cursor:
    def __init__(self, data: bytes | bytearray) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise AdapterError("the GGUF file ends inside its header (cut short, or not a GGUF file)")
        self.pos += n
        return bytes(self.data[self.pos - n : self.pos])

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self, what: str) -> str:
        raw = self.take(self.scalar("<Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise AdapterError(f"GGUF {what} is not UTF-8: {exc}") from exc


def _parse(data: bytes | bytearray) -> _GGUF:
    """The metadata and tensor directory of a GGUF file's bytes, refused where llama.cpp's gguf_init refuses it."""
    cur = _Cursor(data)
    if data[:4] != _MAGIC:
        raise AdapterError("the adapter file is not a GGUF file (no GGUF magic)")
    cur.take(4)
    version = cur.scalar("<I")
    if version not in _VERSIONS:
        byte_order = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise AdapterError(f"GGUF version {version}{byte_order} is not supported (versions 2 and 3 are)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata: dict[str, tuple[GGUFValueType, object]] = {}
    for _ in range(n_kv):  # each pair takes bytes: a bogus count runs out of file, not of memory
        key = cur.string("metadata key")
        if not key or key in metadata:
            raise AdapterError(f"GGUF metadata key {key!r} is empty or given twice")
        metadata[key] = _value(cur, key)
    alignment = _DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        value_type, value = metadata["general.alignment"]
        if value_type != GGUFValueType.UINT32 or not isinstance(value, int) or value <= 0 or value & (value - 1):
            raise AdapterError(f"GGUF general.alignment must be a uint32 power of two, got {value!r}")
        alignment = value
    infos = []
    for _ in range(n_tensors):
        infos.append(_tensor_info(cur))
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, _TensorInfo] = {}
    expected = 0
    for tensor_name, shape, kind, offset in infos:
        if tensor_name in tensors:
            raise AdapterError(f"GGUF tensor {tensor_name} is given twice")
        if offset != expected:  # gguf.cpp: tensors lie in order, each at the padded end of the one before
            raise AdapterError(f"GGUF tensor {tensor_name} has data offset {offset}, not {expected}")
        block, type_bytes = GGML_QUANT_SIZES[kind]
        nbytes = math.prod(shape[:-1]) * (shape[-1] // block) * type_bytes
        if data_start + offset + nbytes > len(data):
            raise AdapterError(f"GGUF tensor {tensor_name}'s data lies past the end of the file (cut short?)")
        tensors[tensor_name] = _TensorInfo(tensor_name, shape, kind, data_start + offset, nbytes)
        expected = offset + -(-nbytes // alignment) * alignment
    return _GGUF(metadata, tensors)


def _value(cur: _Cursor, key: str) -> tuple[GGUFValueType, object]:
    """One metadata value: (its type, the value); an array's type is its elements' (arrays of arrays: refused)."""
    kind = _value_type(cur.scalar("<I"), key)
    if kind == GGUFValueType.ARRAY:
        kind = _value_type(cur.scalar("<I"), key)
        count = cur.scalar("<Q")
        if kind == GGUFValueType.STRING:
            return kind, [cur.string(key) for _ in range(count)]
        if kind == GGUFValueType.ARRAY:
            raise AdapterError(f"GGUF metadata {key} is an array of arrays, which GGUF does not allow")
        fmt = _SCALARS[kind]
        raw = cur.take(count * struct.calcsize(fmt))
        return kind, np.frombuffer(raw, dtype=np.dtype(fmt)).tolist()
    if kind == GGUFValueType.STRING:
        return kind, cur.string(key)
    return kind, cur.scalar(_SCALARS[kind])


def _value_type(code: int, key: str) -> GGUFValueType:
    try:
        return GGUFValueType(code)
    except ValueError:
        raise AdapterError(f"GGUF metadata {key} has unknown value type {code}") from None


def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    """(name, row-major shape, type, offset in the data section) of one tensor directory entry."""
    name = cur.string("tensor name")
    n_dims = cur.scalar("<I")
    if not 1 <= n_dims <= _MAX_DIMS:
        raise AdapterError(f"GGUF tensor {name} has {n_dims} dimensions (1 to {_MAX_DIMS} allowed)")
    ne = [cur.scalar("<q") for _ in range(n_dims)]
    code = cur.scalar("<I")
    try:
        kind = GGMLQuantizationType(code)
    except ValueError:
        raise AdapterError(f"GGUF tensor {name} has unknown ggml type {code}") from None
    block = GGML_QUANT_SIZES[kind][0]
    if any(n < 0 for n in ne) or ne[0] % block:
        raise AdapterError(f"GGUF tensor {name} has shape {ne} (ggml ne), not whole {kind.name} blocks of {block}")
    return name, tuple(reversed(ne)), kind, cur.scalar("<Q")


def _tensor(data: bytes | bytearray, info: _TensorInfo) -> torch.Tensor:
    """A tensor's values as float32, row-major: exact for F32, F16 and BF16, the gguf package's dequantization
    for quantized types (those it cannot dequantize are refused, by name)."""
    from gguf.quants import dequantize

    raw = np.frombuffer(data, dtype=np.uint8, count=info.nbytes, offset=info.start)
    rows = raw.reshape(*info.shape[:-1], -1)  # [..., bytes per row]
    try:
        values = dequantize(rows, info.kind)
    except NotImplementedError:
        raise AdapterError(f"GGUF tensor {info.name} is of type {info.kind.name}, which cannot be read") from None
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(info.shape))  # a copy: data is read-only


# ---- what the file says -------------------------------------------------------------------------------------------


def _check_metadata(metadata: dict[str, tuple[GGUFValueType, object]], base: BaseShapes) -> str:
    """Refuse a file that is not a LoRA adapter for this base, or whose adapter.* keys this reader does not know;
    its general.architecture."""
    kind = _string(metadata, "general.type")
    if kind != "adapter":
        what = "a model" if kind == "model" else "not an adapter"
        raise AdapterError(f"the GGUF file is {what} (general.type {kind!r}, not 'adapter'): no LoRA adapter")
    adapter_type = _string(metadata, "adapter.type")
    if adapter_type != "lora":
        raise AdapterError(f"GGUF adapter.type {adapter_type!r} is not supported: only 'lora' adapters are served")
    unknown = sorted(k for k in metadata if k.startswith("adapter.") and k not in _ADAPTER_KEYS)
    if unknown:
        raise AdapterError(
            f"GGUF metadata {', '.join(unknown)}: unknown to this server, it may change what the adapter computes"
        )
    split = metadata.get("split.count")
    if split is not None and split[1] != 1:
        raise AdapterError(f"the GGUF file is one part of a split adapter (split.count {split[1]}): merge it first")
    arch = _string(metadata, "general.architecture")
    known = sorted(set(GGUF_ARCHITECTURES.values()))
    if arch not in known:
        raise AdapterError(f"GGUF general.architecture {arch!r} is not supported (supported: {', '.join(known)})")
    mismatch = "llama.cpp refuses it too: model arch and LoRA arch mismatch"
    if base.architecture:
        wanted = GGUF_ARCHITECTURES.get(base.architecture)
        if wanted is None:
            raise AdapterError(f"GGUF LoRA adapters are not supported on a {base.architecture} base model")
        if arch != wanted:
            raise AdapterError(
                f"the GGUF adapter is for the {arch} architecture, the base model is {wanted} "
                f"({base.architecture}): {mismatch}"
            )
    elif ("self_attn.qkv_proj" in base.modules) != (arch in _FUSED_ARCHITECTURES):  # not told: fused says phi3
        fused = "self_attn.qkv_proj" in base.modules
        raise AdapterError(
            f"the GGUF adapter is for the {arch} architecture, whose projections are{'' if not fused else ' not'} "
            f"fused; the base model's are{'' if fused else ' not'} fused: {mismatch}"
        )
    return arch


def _string(metadata: dict[str, tuple[GGUFValueType, object]], key: str) -> str | None:
    if key not in metadata:
        return None
    kind, value = metadata[key]
    if kind != GGUFValueType.STRING or not isinstance(value, str):
        raise AdapterError(f"GGUF {key} must be a string, not a {kind.name.lower()}")
    return value


def _alpha(metadata: dict[str, tuple[GGUFValueType, object]]) -> float:
    """adapter.lora.alpha, a float32 (llama.cpp reads it as one); 0 when absent (then the scale is 1)."""
    if "adapter.lora.alpha" not in metadata:
        return 0.0
    kind, value = metadata["adapter.lora.alpha"]
    if kind != GGUFValueType.FLOAT32 or not isinstance(value, float) or not math.isfinite(value):
        raise AdapterError(f"GGUF adapter.lora.alpha must be a finite float32, got {kind.name.lower()} {value!r}")
    return value


def _invocation_tokens(metadata: dict[str, tuple[GGUFValueType, object]], base: BaseShapes) -> tuple[int, ...]:
    """adapter.alora.invocation_tokens: an array of uint32 token ids, as llama.cpp requires (absent: a plain LoRA),
    that can occur in a prompt (peft_format.check_invocation_tokens)."""
    if "adapter.alora.invocation_tokens" not in metadata:
        return ()
    kind, value = metadata["adapter.alora.invocation_tokens"]
    if kind != GGUFValueType.UINT32 or not isinstance(value, list):
        raise AdapterError(
            f"GGUF adapter.alora.invocation_tokens must be an array of uint32 token ids, got {kind.name.lower()} "
            f"{reprlib.repr(value)}"
        )
    return check_invocation_tokens("GGUF adapter.alora.invocation_tokens", value, base)


def _pairs(tensors: dict[str, _TensorInfo], base: BaseShapes) -> dict[tuple[int, str], tuple[_TensorInfo, _TensorInfo]]:
    """(layer, PEFT module path) -> (lora_a, lora_b) of every LoRA pair in the file; any other tensor refused."""
    fused = "self_attn.qkv_proj" in base.modules
    halves: dict[tuple[int, str], dict[str, _TensorInfo]] = {}
    for tensor_name, info in tensors.items():
        stem, _, half = tensor_name.rpartition(".")
        parts = stem.split(".")
        if parts[0] in _TOP_LEVEL and half in ("lora_a", "lora_b"):
            raise AdapterError(
                f"GGUF tensor {tensor_name}: LoRA on {parts[0]} ({_TOP_LEVEL[parts[0]]}) is not supported"
            )
        if tensor_name.endswith("_norm.weight"):
            raise AdapterError(
                f"GGUF tensor {tensor_name} replaces a norm weight (mergekit-extract-lora writes them; llama.cpp "
                "skips them): not supported, and the adapter without it is not the one trained"
            )
        valid = half in ("lora_a", "lora_b") and len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight"
        if not valid or not parts[1].isdigit() or parts[2] not in _LAYER_TENSORS:
            raise AdapterError(f"unexpected tensor {tensor_name} in the GGUF adapter")
        layer = int(parts[1])
        module = "mlp.gate_up_proj" if fused and parts[2] == "ffn_up" else _LAYER_TENSORS[parts[2]]
        if layer >= base.num_layers or module not in base.modules:
            raise AdapterError(
                f"GGUF tensor {tensor_name} targets a module the base model lacks ({base.num_layers} layers"
                f"{'; q|k|v and gate|up fused' if fused else ''})"
            )
        halves.setdefault((layer, module), {})[half] = info
    pairs = {}
    for (layer, module), pair in halves.items():
        if set(pair) != {"lora_a", "lora_b"}:
            raise AdapterError(f"layer {layer} {module.split('.')[-1]} lacks its lora_a or lora_b tensor")
        pairs[(layer, module)] = (pair["lora_a"], pair["lora_b"])
    return pairs


def _unpermute_rows(b: torch.Tensor, rows: int, base: BaseShapes, what: str) -> torch.Tensor:
    """Undo LlamaModel.permute on lora_B's rows (per head, the rotary halves were interleaved): heads of
    base.head_dim rows each, as model.gguf_checkpoint.unpermute_rope_rows does for the base weights."""
    if base.head_dim <= 0 or rows % base.head_dim or base.head_dim % 2:
        raise AdapterError(
            f"{what}: llama.cpp permuted its rows per attention head, and the base's head width is not known here "
            "(BaseShapes.head_dim), so the permutation cannot be undone"
        )
    heads = rows // base.head_dim
    return b.reshape(heads, base.head_dim // 2, 2, -1).transpose(1, 2).reshape(b.shape)
