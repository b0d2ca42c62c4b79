"""The CPU decode step with each decoder layer in one C call (kernels.cpu_decode.decode_layer_: from the input norm
to gate|up), then SiLU-and-mul and the down projection: the calls model.llama makes one by one, on the same values
in the same order, so the same numbers bit for bit, without the Python and torch glue between them (about ten
calls a layer). With adapters in the step, the layer's C code runs in three parts and each linear's LoRA is added
after it as its wrapper adds it (LoraLinear.add_lora). A model takes it where every layer is the plain Llama block
on int4 weights that the CPU's int4 kernel reads (LayerParts), and a step where it decodes one token of each of at
most CPU_GEMV_MAX_ROWS sequences over a float32 cache."""

from __future__ import annotations

from collections.abc import Sequence
from ctypes import CDLL
from typing import NamedTuple

import torch

from lora_server import envs
from lora_server.kernels import cpu_decode, ops
from lora_server.model.arch import ModelArch
from lora_server.model.batch import ForwardBatch
from lora_server.model.lora import LoraLinear
from lora_server.model.quant import CPU_GEMV_MAX_ROWS, Int4CpuLinear, cpu_gemv_library


class LayerParts(NamedTuple):
    """What the fused step reads of one decoder layer (model.llama.DecoderLayer.fused_parts): its norms' float32
    weights, its four linears' LoRA wrappers (their base modules the int4 weights), its attention's scale, window
    and soft cap."""

    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    eps: float
    qkv: LoraLinear
    o: LoraLinear
    gate_up: LoraLinear
    down: LoraLinear
    scale: float
    window: int
    softcap: float


class FusedDecode:
    """One model's layers as decode_layer_ reads them (built once: ``build``), and its decode steps (``forward``)."""

    def __init__(
        self, lib: CDLL, arch: ModelArch, layers: list[cpu_decode.DecodeLayer], parts: list[LayerParts], group: int
    ) -> None:
        self.lib, self.arch, self.layers, self.parts, self.group = lib, arch, layers, parts, group

    @classmethod
    def build(cls, arch: ModelArch, parts: Sequence[LayerParts | None]) -> FusedDecode | None:
        """The fused layers, or None where the CPU's int4 kernel is not built (or LORA_SERVER_FUSED_DECODE=0) or a
        layer does not qualify: each linear an Int4CpuLinear that int4_gemv reads (gemv), without a bias, all of one
        group size; float32 norm weights; heads of at most 512 (cpu_decode.c's bound)."""
        if not parts or any(p is None for p in parts) or arch.head_dim > 512 or not envs.fused_decode_enabled():
            return None
        lib = cpu_gemv_library()
        if lib is None:
            return None
        layers, groups = [], set()
        for p in parts:
            assert p is not None
            qkv, o, gate_up, down = linears = (p.qkv.base, p.o.base, p.gate_up.base, p.down.base)
            if not all(isinstance(m, Int4CpuLinear) and m.gemv and m.bias is None for m in linears):
                return None
            assert isinstance(qkv, Int4CpuLinear) and isinstance(o, Int4CpuLinear)
            assert isinstance(gate_up, Int4CpuLinear) and isinstance(down, Int4CpuLinear)
            groups |= {m.group_size for m in (qkv, o, gate_up, down)}
            if len(groups) > 1:
                return None
            if not all(w.dtype == torch.float32 and w.is_contiguous() for w in (p.attn_norm, p.mlp_norm)):
                return None
            d = arch.head_dim
            layers.append(
                cpu_decode.DecodeLayer(
                    arch.hidden_size,
                    arch.num_heads,
                    arch.num_kv_heads,
                    d,
                    arch.rotary_dim if 0 < arch.rotary_dim < d else d,
                    arch.intermediate_size,
                    qkv.group_size,
                    p.eps,
                    p.scale,
                    p.softcap,
                    p.window,
                    p.attn_norm.data_ptr(),
                    p.mlp_norm.data_ptr(),
                    qkv.cpu_packed.data_ptr(),
                    o.cpu_packed.data_ptr(),
                    gate_up.cpu_packed.data_ptr(),
                    qkv.scales_and_zeros.data_ptr(),
                    o.scales_and_zeros.data_ptr(),
                    gate_up.scales_and_zeros.data_ptr(),
                )
            )
        return cls(lib, arch, layers, [p for p in parts if p is not None], groups.pop())

    def takes(self, x: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, k: torch.Tensor, fp8: bool) -> bool:
        """Whether this step is one it computes: x [T, hidden] float32, one token of each sequence (T <=
        CPU_GEMV_MAX_ROWS), the rotary rows and the cache (``k``, any layer's; not fp8) float32."""
        t = x.shape[0]
        return (
            batch.max_query_len == 1
            and t == batch.block_tables.shape[0]
            and t <= CPU_GEMV_MAX_ROWS
            and x.dtype == cos.dtype == k.dtype == torch.float32
            and not fp8
            and k.stride(-1) == 1
        )

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, sin_signed: torch.Tensor, kv: Sequence
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers over the embedded rows x [T, hidden] (``takes``): (x, residual), the hidden state x +
        residual with the last MLP's output not yet added, as model.llama's layers hand it on; writes the step's K and
        V into ``kv`` (each layer's LayerKV)."""
        a, t = self.arch, x.shape[0]
        d, heads, kv_heads = a.head_dim, a.num_heads, a.num_kv_heads
        widest = max(a.hidden_size, a.intermediate_size, heads * d)
        qkv, attn = torch.empty(t, (heads + 2 * kv_heads) * d), torch.empty(t, heads * d)
        gate_up = torch.empty(t, 2 * a.intermediate_size)
        scratch = torch.empty(cpu_decode.int4_scratch_bytes(t, widest, self.group), dtype=torch.uint8)
        tables = batch.block_tables.to(torch.int32).contiguous()
        lens = batch.seq_lens.to(torch.int32).contiguous()
        slots = batch.slot_mapping.to(torch.int64).contiguous()
        cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
        k0 = kv[0].k
        step = cpu_decode.DecodeStep(
            t, k0.shape[1], tables.shape[1], *k0.stride()[:3],
            cos.data_ptr(), sin_signed.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            qkv.data_ptr(), attn.data_ptr(), scratch.data_ptr(),
        )  # fmt: skip
        residual, x = x.contiguous(), torch.empty_like(x)
        lib, lora = self.lib, batch.lora
        for i, (layer, p, cache) in enumerate(zip(self.layers, self.parts, kv, strict=True)):
            assert cache.k.stride() == cache.v.stride() == k0.stride()
            if lora is None:
                cpu_decode.decode_layer_(lib, layer, step, x, residual, i > 0, cache.k, cache.v, gate_up)
            else:  # each linear's LoRA added as its wrapper adds it, on the same input and output
                cpu_decode.decode_qkv_(lib, layer, step, x, residual, i > 0)
                p.qkv.add_lora(x, qkv, lora)
                cpu_decode.decode_attention_o_(lib, layer, step, cache.k, cache.v, x)
                p.o.add_lora(attn, x, lora)
                cpu_decode.decode_gate_up_(lib, layer, step, x, residual, gate_up)
                p.gate_up.add_lora(x, gate_up, lora)
            act = ops.silu_and_mul(gate_up).contiguous()
            down = p.down.base
            assert isinstance(down, Int4CpuLinear)
            lib.int4_gemv(act.data_ptr(), t, a.intermediate_size, down.cpu_packed.data_ptr(),
                          down.scales_and_zeros.data_ptr(), a.hidden_size, self.group, scratch.data_ptr(),
                          x.data_ptr())  # fmt: skip
            p.down.add_lora(act, x, lora)
        return x, residual
