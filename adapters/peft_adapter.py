"""A PEFT adapter as read from its directory (peft_format.read_peft_adapter): its config applied and every key and
shape checked against the base, its weights still as stored, views of the file's bytes with each module's scaling
beside them. Registering checks their values (``check_weights``) and hashes them (``digest``) without converting
one; staging writes its pages straight from them (PageLayout.image: one copy of each block, scaling and dtype
conversion in it); ``lora()`` converts it into the float32 LoraAdapter that the other paths compute with."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lora_server.adapters.errors import AdapterError
from lora_server.adapters.lora_types import BaseShapes, LoraAdapter, VocabLora
from lora_server.adapters.peft_files import FilesIdentity, SafetensorsFile

_F32_MAX = torch.finfo(torch.float32).max
DIGEST_SCHEME = b"peft-lora-v1;"  # what a digest hashes changes with this


@dataclass(slots=True)
class PeftAdapter:
    """One PEFT adapter, validated but for its weights' values (``check_weights``)."""

    name: str
    path: Path  # its directory, resolved
    rank: int  # its largest rank, the embedding's and head's included
    base: BaseShapes
    # (layer, PEFT module path) -> lora_A [r, in], lora_B [out, r] as stored (views of ``weights_file``), scaling
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]
    weights_file: SafetensorsFile
    identity: FilesIdentity  # its config's and weights' stamps when they were read
    invocation_tokens: tuple[int, ...] = ()  # LoraAdapter.invocation_tokens
    magnitudes: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # LoraAdapter's, float32, checked
    vocab: VocabLora | None = None  # LoraAdapter's, float32, checked
    # LoRA on the experts (adapters.peft_experts): (layer, module, expert) -> A [r, in], B [out, r] as stored, scaling
    experts: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)

    def expert_parts(self) -> dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor, float]]:
        return self.experts

    def scaled_parts(self) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]:
        """(layer, canonical module) -> (A [r, in], B [out, r], scaling), as stored: a fused module's B cut into its
        parts' rows, each with the same A."""
        out = {}
        for (layer, module), (a, b, scaling) in self.modules.items():
            parts = self.base.modules[module]
            widths = [self.base.features[p][1] for p in parts]
            for part, b_part in zip(parts, b.split(widths), strict=True):
                out[(layer, part)] = (a, b_part, scaling)
        return out

    @property
    def ranks(self) -> dict[tuple[int, str], int]:
        """(layer, canonical module) -> rank of every module it targets."""
        return {
            (layer, part): a.shape[0]
            for (layer, module), (a, _, _) in self.modules.items()
            for part in self.base.modules[module]
        }

    @property
    def nbytes(self) -> int:
        """Its bytes as a LoraAdapter (float32, A once per canonical module): LoraAdapter.nbytes."""
        parts = [*self.scaled_parts().values(), *self.experts.values()]
        layers = sum(4 * (a.numel() + b.numel()) for a, b, _ in parts)
        return layers + (0 if self.vocab is None else self.vocab.nbytes)

    def check_weights(self) -> None:
        """AdapterError naming the layer and module of a NaN or Inf in an A or B, or of a B whose product with its
        scaling overflows float32: what converting it to a LoraAdapter would meet. When every value is finite (the
        rule) this is one reduction per stored dtype and a min/max of each B whose scaling could overflow."""
        if not self._finite_at_once():
            for (layer, module), (a, b, _) in sorted(self.modules.items()):
                if not (torch.isfinite(a.float()).all() and torch.isfinite(b.float()).all()):
                    raise AdapterError(f"layer {layer} {module.split('.')[-1]} has NaN or Inf weights")
        for (layer, module, expert), (a, b, scaling) in sorted(self.experts.items()):
            if not (torch.isfinite(a.float()).all() and torch.isfinite(b.float() * scaling).all()):
                raise AdapterError(f"layer {layer} expert {expert} {module} has NaN or Inf weights (or overflows)")
        for (layer, module), (_, b, scaling) in sorted(self.modules.items()):
            if b.numel() == 0 or abs(scaling) * torch.finfo(b.dtype).max < _F32_MAX / 2:
                continue
            low, high = torch.aminmax(b)
            if max(-low.item(), high.item()) * abs(scaling) < _F32_MAX / 2:
                continue
            if not torch.isfinite(b.float() * scaling).all():
                raise AdapterError(
                    f"layer {layer} {module.split('.')[-1]}: lora_B times the scaling {scaling:.3g} (from lora_alpha "
                    f"and r) overflows float32"
                )

    def _finite_at_once(self) -> bool:
        """True when every A and B is finite, shown by one float32 sum per stored dtype over the bytes that hold
        them (a finite sum has finite terms); False means "look tensor by tensor" (a NaN, an Inf, or a sum that
        overflowed, or tensors not where the file's bytes are)."""
        data = self.weights_file.data
        if not data:
            return False
        base = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
        spans: dict[torch.dtype, tuple[int, int]] = {}
        for a, b, _ in self.modules.values():
            for t in (a, b):
                start = t.data_ptr() - base
                if t.numel() == 0:
                    continue
                if not (t.is_contiguous() and start >= 0 and start + t.nbytes <= len(data)):
                    return False
                low, high = spans.get(t.dtype, (start, start + t.nbytes))
                spans[t.dtype] = (min(low, start), max(high, start + t.nbytes))
        for dtype, (start, end) in spans.items():
            if start % dtype.itemsize or (end - start) % dtype.itemsize:
                return False
            values = torch.frombuffer(data, dtype=dtype, count=(end - start) // dtype.itemsize, offset=start)
            if not torch.isfinite(values.sum(dtype=torch.float32)):
                return False
        return True

    def digest(self) -> str:
        """A hash of what decides its outputs: each module's stored A and B (dtype, shape, bytes) and scaling, its
        invocation tokens, DoRA magnitudes, embedding and head changes. Equal weights stored alike hash alike
        whatever the files' other bytes (key names, metadata, config layout)."""
        digest = hashlib.sha256(DIGEST_SCHEME)
        if self.invocation_tokens:
            digest.update(f"alora{list(self.invocation_tokens)};".encode())
        for (layer, module), (a, b, scaling) in sorted(self.modules.items()):
            digest.update(f"{layer}.{module}.{a.dtype}{tuple(a.shape)}.{b.dtype}{tuple(b.shape)}.{scaling!r};".encode())
            digest.update(_bytes(a))
            digest.update(_bytes(b))
        for (layer, module), magnitude in sorted(self.magnitudes.items()):
            digest.update(f"dora.{layer}.{module}.{tuple(magnitude.shape)};".encode())
            digest.update(_bytes(magnitude))
        for (layer, module, expert), (a, b, scaling) in sorted(self.experts.items()):
            digest.update(
                f"expert.{layer}.{module}.{expert}.{a.dtype}{tuple(a.shape)}.{b.dtype}{tuple(b.shape)}".encode()
            )
            digest.update(f".{scaling!r};".encode())
            digest.update(_bytes(a))
            digest.update(_bytes(b))
        for key, tensor in ({} if self.vocab is None else self.vocab.tensors()).items():
            digest.update(f"vocab.{key}.{tensor.dtype}{tuple(tensor.shape)};".encode())
            digest.update(_bytes(tensor))
        return digest.hexdigest()

    def lora(self) -> LoraAdapter:
        """Its weights in float32, each B times its scaling (call check_weights first: this checks nothing)."""
        weights = {}
        for (layer, module), (a, b, scaling) in sorted(self.modules.items()):
            a32, b32 = a.float(), b.float() * scaling
            parts = self.base.modules[module]
            widths = [self.base.features[p][1] for p in parts]
            for part, b_part in zip(parts, b32.split(widths), strict=True):
                weights[(layer, part)] = (a32, b_part.contiguous())
        return LoraAdapter(
            self.name,
            self.path,
            self.rank,
            weights,
            self.invocation_tokens,
            magnitudes=self.magnitudes,
            vocab=self.vocab,
            experts={k: (a.float(), (b.float() * scaling).contiguous()) for k, (a, b, scaling) in self.experts.items()},
        )


def _bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes, row-major (no copy when it is contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data
