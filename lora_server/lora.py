"""Multi-LoRA on the engine side: the adapters the engine knows, which of them sit in the device slots, and the
linear wrapper that adds each token's adapter to a base layer's output.

Which adapters sit in the device slots is the unified pool's decision (kv_pool): the engine executes its
ADAPTER_LOAD / ADAPTER_UNLOAD operations here with load() and unload()."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from adapters.peft_format import BaseShapes, LoraAdapter, load_peft_adapter
from kernels import lora_ops
from lora_server.errors import InvalidRequestError
from lora_server.model_arch import ModelArch

# fused linear groups of a Llama layer and the canonical modules (output slices) of each, in order
GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


class UnknownAdapterError(InvalidRequestError):
    http_status = 404

    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{name}` does not exist.", param="model", code="model_not_found")


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
    stacked weights. The engine thread alone calls load/unload/slot_of/take_retired; register/unregister may come
    from any thread."""

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
        self._slot_of: dict[int, int] = {}  # resident adapter_id -> slot (engine thread)
        self._retired: list[int] = []  # versions forgotten since the last take_retired()
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
        """Forget an adapter version once no request holds it (called with the lock held). Its slot, if it has
        one, is freed when the pool unloads it (take_retired tells the engine)."""
        if self._refs.get(adapter_id, 0) == 0 and adapter_id not in {h.adapter_id for h in self._by_name.values()}:
            if self._adapters.pop(adapter_id, None) is not None:
                self._retired.append(adapter_id)
            self._refs.pop(adapter_id, None)

    def take_retired(self) -> list[int]:
        """Adapter ids (versions) that were unloaded or replaced and are no longer used, since the last call."""
        with self._lock:
            retired, self._retired = self._retired, []
        return retired

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

    def device_nbytes(self, adapter_id: int) -> int:
        """Bytes an adapter version's A and B take in the engine's dtype (its share of the device budget)."""
        with self._lock:
            return self._adapters[adapter_id].nbytes * self.dtype.itemsize // 4

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one device slot (max rank, every module): what a fixed slot reserves."""
        return sum(a[:, 0].nbytes + b[0].nbytes for layer in self.buffers for a, b in layer.values())

    def path(self, name: str) -> Path:
        """The directory the adapter's current version was read from."""
        handle = self.get(name)
        with self._lock:
            return self._adapters[handle.adapter_id].path

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    def acquire(self, name: str) -> AdapterHandle:
        """The current version of ``name``, held for a request until ``drop``: unloading or replacing the name
        waits for it, so a request that resolved a version keeps it to its end. UnknownAdapterError if none."""
        with self._lock:
            handle = self._by_name.get(name)
            if handle is None:
                raise UnknownAdapterError(name)
            self._refs[handle.adapter_id] += 1
        return handle

    def drop(self, handle: AdapterHandle) -> None:
        with self._lock:
            self._refs[handle.adapter_id] -= 1
            self._retire(handle.adapter_id)

    # ---- residency (engine thread, driven by the pool) ------------------------------------------------------

    def load(self, adapter_id: int) -> int:
        """Write an adapter version's weights into a free device slot; returns the slot. The pool never keeps
        more adapters resident than there are slots, so a free one exists."""
        assert adapter_id not in self._slot_of, f"adapter {adapter_id} is already in a slot"
        used = set(self._slot_of.values())
        slot = next(s for s in range(self.max_loras) if s not in used)
        with self._lock:
            adapter = self._adapters[adapter_id]
        self._write_slot(slot, adapter)
        self._slot_of[adapter_id] = slot
        return slot

    def unload(self, adapter_id: int) -> None:
        """Free the adapter's slot (its rank becomes 0, so a stale slot id adds nothing)."""
        slot = self._slot_of.pop(adapter_id)
        self.ranks[slot] = 0

    def slot_of(self, adapter_id: int) -> int:
        return self._slot_of[adapter_id]

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
            assert self.lora_b is not None and self.ranks is not None
            if lora.slot_ids is not None:
                lora_ops.apply_lora(x, out, self.lora_a, self.lora_b, self.ranks, self.slice_starts,
                                    slot_ids=lora.slot_ids, use_kernels=lora.use_triton)
            else:
                lora_ops.apply_lora(x, out, self.lora_a, self.lora_b, self.ranks, self.slice_starts,
                                    seg_starts=lora.seg_starts, seg_slots=lora.seg_slots,
                                    use_kernels=lora.use_triton)
        return out
