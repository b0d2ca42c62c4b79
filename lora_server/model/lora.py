"""Multi-LoRA in the model: the device slots the LoRA kernels read, each step's token-to-slot mapping, and the linear
wrapper that adds each token's adapter to a base layer's output. Which adapters exist is the registry's
(lora_server.engine.adapter_registry); which of them sit in which slot is the pool's (kv_pool)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from adapters.peft_format import BaseShapes, LoraAdapter
from kernels import ops

# fused linear groups of a Llama layer and the canonical modules (output slices) of each, in order
GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


@dataclass(slots=True)
class LoraBatch:
    """Each token's adapter slot for one step, in the two forms the LoRA ops take (per row where given)."""

    seg_starts: torch.Tensor  # [S + 1] int32, segment s is tokens seg_starts[s]:seg_starts[s+1]
    seg_slots: torch.Tensor  # [S] int32, slot of each segment, -1 = no adapter
    slot_ids: torch.Tensor | None  # [T] int32 per token (decode-only steps), else None
    # the same mapping as host integers, one (start, end, slot, rank) per segment with an adapter; the runner orders
    # a step's requests by slot, so each slot has one segment
    host_segments: list[tuple[int, int, int, int]]


class LoraSlots:
    """The device buffers the LoRA kernels read: ``max_loras`` slots, each holding one adapter's A and B of every
    layer and fused group, stacked at the largest rank. Which adapter sits in which slot is the pool's decision
    (kv_pool): the runner executes its ADAPTER_LOAD / ADAPTER_UNLOAD operations with ``write`` and ``clear``."""

    def __init__(
        self,
        shapes: BaseShapes,
        num_layers: int,
        max_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.max_loras, self.max_rank, self.dtype = max_loras, max_rank, dtype
        self.ranks = torch.zeros(max_loras, dtype=torch.int32, device=device)  # [slots]
        self.rank_of = [0] * max_loras  # the same ranks on the host
        self.buffers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []  # [layer][group] -> (A, B)
        for _ in range(num_layers):
            layer = {}
            for group, modules in GROUPS.items():
                in_f = shapes.features[modules[0]][0]
                out_total = sum(shapes.features[m][1] for m in modules)
                layer[group] = (
                    torch.zeros(len(modules), max_loras, max_rank, in_f, dtype=dtype, device=device),
                    torch.zeros(max_loras, out_total, max_rank, dtype=dtype, device=device),
                )
            self.buffers.append(layer)
        self.slice_starts = {g: _starts([shapes.features[m][1] for m in ms]) for g, ms in GROUPS.items()}
        # what the wrappers hand the ops: the kernels read the slices' bounds from the device, a tensor made once
        # here (a list would be copied from pageable memory at every call); the CPU's segment path takes the list
        self._slice_starts_arg: dict[str, list[int] | torch.Tensor] = (
            dict(self.slice_starts)
            if device.type == "cpu"
            else {g: torch.tensor(s, dtype=torch.int32, device=device) for g, s in self.slice_starts.items()}
        )

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one device slot (max rank, every module): what a fixed slot reserves."""
        return sum(a[:, 0].nbytes + b[0].nbytes for layer in self.buffers for a, b in layer.values())

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put an adapter's weights (in the slots' dtype) into ``slot``, zeros past its rank."""
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
                    b_buf[slot, starts[k] : starts[k + 1], :r] = b.to(self.dtype)
        self.ranks[slot] = adapter.rank
        self.rank_of[slot] = adapter.rank

    def clear(self, slot: int) -> None:
        """Free a slot: its rank becomes 0, so a stale slot id adds nothing."""
        self.ranks[slot] = 0
        self.rank_of[slot] = 0

    def attach(self, layers: list[dict[str, LoraLinear]]) -> None:
        """Point each layer's LoRA wrappers ([layer][group]) at these stacked buffers."""
        for wrappers, buffers in zip(layers, self.buffers, strict=True):
            for group, wrapper in wrappers.items():
                wrapper.lora_a, wrapper.lora_b = buffers[group]
                wrapper.views = {}
                wrapper.ranks, wrapper.slice_starts = self.ranks, self._slice_starts_arg[group]


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
        self.lora_a: torch.Tensor | None = None  # [K, slots, R, in], set by LoraSlots.attach
        self.lora_b: torch.Tensor | None = None  # [slots, out_total, R]
        self.ranks: torch.Tensor | None = None  # [slots] int32
        self.slice_starts: list[int] | torch.Tensor = []  # [K + 1] output slice bounds, a device tensor off the CPU
        self.views: dict = {}  # the CPU's per-slot views of lora_a / lora_b (kernels.segment_lora), made on first use

    def forward(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:  # [T, in] -> [T, out_total]
        out = self.base(x)
        if lora is not None and self.lora_a is not None:
            assert self.lora_b is not None and self.ranks is not None
            # decode-only steps map per row (BGMV), others by segment (SGMV)
            mapping = (
                {"slot_ids": lora.slot_ids}
                if lora.slot_ids is not None
                else {"seg_starts": lora.seg_starts, "seg_slots": lora.seg_slots}
            )
            ops.apply_lora(
                x,
                out,
                self.lora_a,
                self.lora_b,
                self.ranks,
                self.slice_starts,
                **mapping,
                host_segments=lora.host_segments,
                views=self.views,
            )
        return out
