"""Multi-LoRA on the engine side: the adapters the engine knows, which of them sit in the device slots, and the
linear wrapper that adds each token's adapter to a base layer's output.

Residency lives behind acquire()/release() so that the tree pool can take it over."""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from adapters.peft_format import BaseShapes, LoraAdapter, load_peft_adapter
from kernels import lora_ops
from lora_server.errors import InvalidRequestError, LoraServerError
from lora_server.model_arch import ModelArch

# fused linear groups of a Llama layer and the canonical modules (output slices) of each, in order
GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


class UnknownAdapterError(InvalidRequestError):
    http_status = 404

    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{name}` does not exist.", param="model", code="model_not_found")


class NoAdapterSlotError(LoraServerError):
    """Every device slot holds an adapter that running requests use."""


@dataclass(frozen=True, slots=True)
class AdapterHandle:
    """What a request holds: one version of one adapter. A re-registered name gets a new id."""

    name: str
    adapter_id: int


@dataclass(slots=True)
class LoraBatch:
    """Each token's adapter slot for one step, in the two forms the kernels take."""

    seg_starts: torch.Tensor  # [S + 1] int32, segment s is tokens seg_starts[s]:seg_starts[s+1]
    seg_slots: torch.Tensor  # [S] int32, slot of each segment, -1 = no adapter
    slot_ids: torch.Tensor | None  # [T] int32 per token (decode-only steps), else None
    use_triton: bool


class LoraManager:
    """Owns the registered adapters (host copies, any number) and the device slots (max_loras) holding their
    stacked weights. The engine thread alone calls acquire/release; register/unregister may come from any thread."""

    def __init__(self, arch: ModelArch, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype,
                 allowed_roots: list[Path] | None = None) -> None:
        self.shapes = BaseShapes.llama(arch.num_layers, arch.hidden_size, arch.intermediate_size, arch.q_size,
                                       arch.kv_size)
        self.max_loras, self.max_rank, self.device, self.dtype = max_loras, max_rank, device, dtype
        self.allowed_roots = allowed_roots
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._by_name: dict[str, AdapterHandle] = {}
        self._adapters: dict[int, LoraAdapter] = {}  # adapter_id -> weights, while registered or in use
        self._refs: dict[int, int] = {}  # adapter_id -> requests holding it
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # resident adapter_id -> slot, least recent first
        self.ranks = torch.zeros(max_loras, dtype=torch.int32, device=device)  # [slots]
        self.buffers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []  # [layer][group] -> (A, B)
        for _ in range(arch.num_layers):
            layer = {}
            for group, modules in GROUPS.items():
                in_f = self.shapes.features[modules[0]][0]
                out_total = sum(self.shapes.features[m][1] for m in modules)
                layer[group] = (torch.zeros(len(modules), max_loras, max_rank, in_f, dtype=dtype, device=device),
                                torch.zeros(max_loras, out_total, max_rank, dtype=dtype, device=device))
            self.buffers.append(layer)
        self.slice_starts = {g: _starts([self.shapes.features[m][1] for m in ms]) for g, ms in GROUPS.items()}

    # ---- registry ------------------------------------------------------------------------------------------

    def register(self, name: str, path: str | Path) -> AdapterHandle:
        """Validate and read a PEFT directory (raises AdapterError) and make it servable under ``name``; an
        existing name gets a new version, the old one lives on until its requests end."""
        adapter = load_peft_adapter(name, path, self.shapes, self.max_rank, self.allowed_roots)
        with self._lock:
            handle = AdapterHandle(name, next(self._ids))
            old = self._by_name.get(name)
            self._by_name[name] = handle
            self._adapters[handle.adapter_id] = adapter
            self._refs[handle.adapter_id] = 0
            if old is not None:
                self._retire(old.adapter_id)
        return handle

    def unregister(self, name: str) -> None:
        with self._lock:
            handle = self._by_name.pop(name, None)
            if handle is None:
                raise UnknownAdapterError(name)
            self._retire(handle.adapter_id)

    def _retire(self, adapter_id: int) -> None:
        """Forget an adapter version once no request holds it (called with the lock held)."""
        if self._refs.get(adapter_id, 0) == 0 and adapter_id not in {h.adapter_id for h in self._by_name.values()}:
            self._adapters.pop(adapter_id, None)
            self._refs.pop(adapter_id, None)
            slot = self._slot_of.pop(adapter_id, None)
            if slot is not None:
                self.ranks[slot] = 0

    def get(self, name: str) -> AdapterHandle:
        with self._lock:
            handle = self._by_name.get(name)
        if handle is None:
            raise UnknownAdapterError(name)
        return handle

    def nbytes(self, name: str) -> int:
        """Bytes of the host copy (fp32) of an adapter's A and B matrices."""
        handle = self.get(name)
        with self._lock:
            return self._adapters[handle.adapter_id].nbytes

    def path(self, name: str) -> Path:
        """The directory the adapter's current version was read from."""
        handle = self.get(name)
        with self._lock:
            return self._adapters[handle.adapter_id].path

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    def hold(self, handle: AdapterHandle) -> None:
        """A request now refers to this version (taken at admission, so unloading waits for it)."""
        with self._lock:
            if handle.adapter_id not in self._adapters:
                raise UnknownAdapterError(handle.name)
            self._refs[handle.adapter_id] += 1

    def drop(self, handle: AdapterHandle) -> None:
        with self._lock:
            self._refs[handle.adapter_id] -= 1
            self._retire(handle.adapter_id)

    # ---- residency (engine thread) -------------------------------------------------------------------------

    def acquire(self, handle: AdapterHandle, in_use: set[int]) -> int | None:
        """The device slot of the adapter, loading it (evicting the least recently used adapter whose slot no
        running request uses, ``in_use`` being the slots of running requests) if needed; None when every slot is
        busy."""
        slot = self._slot_of.get(handle.adapter_id)
        if slot is not None:
            self._slot_of.move_to_end(handle.adapter_id)
            return slot
        used = set(self._slot_of.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if not free:
            victim = next((a for a, s in self._slot_of.items() if s not in in_use), None)
            if victim is None:
                return None
            free = [self._slot_of.pop(victim)]
        slot = free[0]
        with self._lock:
            adapter = self._adapters[handle.adapter_id]
        self._write_slot(slot, adapter)
        self._slot_of[handle.adapter_id] = slot
        return slot

    def _write_slot(self, slot: int, adapter: LoraAdapter) -> None:
        for layer, groups in enumerate(self.buffers):
            for group, (a_buf, b_buf) in groups.items():
                a_buf[:, slot].zero_()
                b_buf[slot].zero_()
                starts = self.slice_starts[group]
                for k, module in enumerate(GROUPS[group]):
                    pair = adapter.weights.get((layer, module))
                    if pair is None:
                        continue
                    a, b = pair
                    r = a.shape[0]
                    a_buf[k, slot, :r] = a.to(self.dtype)
                    b_buf[slot, starts[k]:starts[k + 1], :r] = b.to(self.dtype)
        self.ranks[slot] = adapter.rank

    def resident_slots(self) -> dict[int, int]:
        return dict(self._slot_of)

    def attach(self, layers: list[dict[str, LoraLinear]]) -> None:
        """Point each layer's LoRA wrappers ([layer][group]) at this manager's stacked buffers."""
        for wrappers, buffers in zip(layers, self.buffers, strict=True):
            for group, wrapper in wrappers.items():
                wrapper.lora_a, wrapper.lora_b = buffers[group]
                wrapper.ranks, wrapper.slice_starts = self.ranks, self.slice_starts[group]


def _starts(widths: list[int]) -> list[int]:
    out = [0]
    for w in widths:
        out.append(out[-1] + w)
    return out


class LoraLinear(nn.Module):
    """A base linear plus each token's LoRA: out = base(x) + (x @ A[slot].T) @ B[slot].T per output slice."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.lora_a: torch.Tensor | None = None  # [K, slots, R, in], set by LoraManager.attach
        self.lora_b: torch.Tensor | None = None  # [slots, out_total, R]
        self.ranks: torch.Tensor | None = None  # [slots] int32
        self.slice_starts: list[int] = []

    def forward(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:  # [T, in] -> [T, out_total]
        out = self.base(x)
        if lora is not None and self.lora_a is not None:
            if lora.slot_ids is not None:
                lora_ops.apply_lora(x, out, self.lora_a, self.lora_b, self.ranks, self.slice_starts,
                                    slot_ids=lora.slot_ids, use_kernels=lora.use_triton)
            else:
                lora_ops.apply_lora(x, out, self.lora_a, self.lora_b, self.ranks, self.slice_starts,
                                    seg_starts=lora.seg_starts, seg_slots=lora.seg_slots,
                                    use_kernels=lora.use_triton)
        return out
