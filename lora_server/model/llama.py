"""The decoder of every supported family over a paged KV cache: Llama 2/3, Mistral, SmolLM2, Qwen2 (q/k/v biases),
and what ModelArch says the others add: Qwen3's and Gemma 3's per-head q/k norms, Gemma's 1 + w norms around both
blocks, GELU-tanh, scaled embeddings and soft-capped logits, sliding-window layers (Gemma, Mistral, Phi-3), partial
rotary and LongRoPE (Phi-3), Gemma 3's own RoPE base for its sliding layers.

Linear layers are QuantLinear modules (dense, int8, int4, fp8); q|k|v and gate|up are fused along the output rows.
The rest of a layer goes through kernels.ops, one call each (a kernel launch on CUDA, the torch twin elsewhere): the
residual add fused into the next RMSNorm (the hidden state travels as x + residual, as in vLLM), rotary fused with
the KV write, attention, the gated activation."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from ctypes import CDLL
from typing import NamedTuple

import torch
from torch import nn
from tqdm import tqdm

from lora_server.errors import ModelLoadError
from lora_server.kernels import ops
from lora_server.model.arch import ModelArch
from lora_server.model.batch import ForwardBatch
from lora_server.model.checkpoint import Checkpoint
from lora_server.model.fused_decode import FusedDecode, LayerParts
from lora_server.model.lora import LoraBatch, LoraLinear, VocabTerms
from lora_server.model.moe import SparseMoE
from lora_server.model.quant import (
    QuantLinear,
    cat_linears,
    cpu_decode_library,
    cpu_head,
    quantizes_activations,
    swap_for_cpu,
    swap_for_cuda,
    tensor_mode,
)


class RMSNorm(nn.Module):
    """weight [hidden] in the model's dtype (Llama's order: normalized, rounded, then scaled), or float32 (Gemma's
    1 + w: scaled in float32, then rounded; ops.rms_norm tells them apart by the weight's dtype)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.cpu_kernels: CDLL | None = None  # kernels.cpu_decode's library, where build_llama chose it

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        return ops.rms_norm(x, self.weight, self.eps, cpu=self.cpu_kernels)

    def heads_(self, x: torch.Tensor) -> None:
        """In place: each head of x [T, heads, head_dim] normalized (the per-head q/k norms)."""
        ops.rms_norm_heads_(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        """In place: residual += x; x = self(residual) (x, residual [T, hidden])."""
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps, cpu=self.cpu_kernels)


def rope_inv_freq(arch: ModelArch, rope_freqs: torch.Tensor | None = None, local: bool = False) -> torch.Tensor:
    """[rotary_width // 2] float32 inverse frequencies, with llama3 / linear scaling, LongRoPE's short factors or
    GGUF's rope_freqs factors; ``local``: Gemma 3's sliding layers (their own base, unscaled)."""
    dim = arch.rotary_width
    theta = arch.local_rope_theta if local else arch.rope_theta
    powers = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv = 1.0 / powers
    scaling = {} if local else arch.rope_scaling_dict
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":  # HF's 1 / (factors * base^(2i/d)); the context is capped where the short factors apply
        inv = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * powers)
    elif kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old_len / low, inv / factor, inv)
        medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv = torch.where(medium, smoothed, inv)
    if rope_freqs is not None:
        inv = inv / rope_freqs.float().to(inv.device)
    return inv


class RopeTable(NamedTuple):
    """One step's rotary factors, gathered once for every layer: cos and sin [T, 1, head_dim] in the model's dtype,
    sin with its first half negated so that rotate_half(x) * sin == x.roll(head_dim // 2, -1) * sin_signed
    (ops.rotary_write_kv applies them with HF's two roundings)."""

    cos: torch.Tensor
    sin_signed: torch.Tensor


class Rotary(nn.Module):
    """Neox-style rotary embedding (HF's rotate_half layout) from a cos/sin table over all positions. With partial
    rotary (arch.rotary_dim), the dimensions past the rotary ones have cos 1 and sin 0: they pass unchanged."""

    cos: torch.Tensor
    sin_signed: torch.Tensor

    def __init__(
        self,
        arch: ModelArch,
        max_positions: int,
        device: torch.device,
        rope_freqs: torch.Tensor | None = None,
        local: bool = False,
    ) -> None:
        super().__init__()
        inv = rope_inv_freq(arch, rope_freqs, local).to(device)
        freqs = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv)
        # [positions, rotary_width]: HF's cat([freqs, freqs]) angles; sin's first half negated (see RopeTable)
        factor = 1.0 if local else arch.rope_attention_factor  # HF's cos() * attention_scaling, in float32
        cos, sin = torch.cat([freqs, freqs], dim=-1).cos() * factor, freqs.sin() * factor
        sin_signed = torch.cat([-sin, sin], dim=-1)
        passed = arch.head_dim - arch.rotary_width
        if passed:
            cos = torch.cat([cos, torch.ones(max_positions, passed, device=device)], dim=-1)
            sin_signed = torch.cat([sin_signed, torch.zeros(max_positions, passed, device=device)], dim=-1)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin_signed", sin_signed, persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTable:  # positions [T]
        return RopeTable(self.cos[positions].to(dtype).unsqueeze(1), self.sin_signed[positions].to(dtype).unsqueeze(1))


class LayerKV(NamedTuple):
    """One layer's paged KV cache: k, v [num_blocks, block_size, KVH, D] in the model's dtype, or float8_e4m3fn with
    k_scale, v_scale [KVH] float32 (a stored value times its head's scale is the key or value)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


class Attention(nn.Module):
    """Self-attention of one layer: q|k|v, the per-head q/k norms where the family has them, the rotary embedding
    fused with the KV write, paged attention (a sliding window where the layer has one, soft-capped scores where
    the family caps them), the output projection."""

    def __init__(
        self,
        arch: ModelArch,
        layer: int,
        qkv: QuantLinear,
        o: QuantLinear,
        qk_norms: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> None:
        super().__init__()
        self.qkv_proj = LoraLinear(qkv, layer, "qkv", (arch.q_size, arch.kv_size, arch.kv_size))
        self.o_proj = LoraLinear(o, layer, "o", (arch.hidden_size,))
        self.q_norm: RMSNorm | None = qk_norms[0] if qk_norms is not None else None
        self.k_norm: RMSNorm | None = qk_norms[1] if qk_norms is not None else None
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        self.scale, self.softcap, self.window = arch.query_scale, arch.attn_softcap, arch.window(layer)
        self.rotary_dim = arch.rotary_dim
        self.cpu_kernels: CDLL | None = None  # kernels.cpu_decode's library, where build_llama chose it

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: RopeTable, kv_cache: LayerKV) -> torch.Tensor:
        qkv = self.qkv_proj(x, batch.lora)  # [T, q_size + 2 * kv_size]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads side by side [T, heads + kv_heads, head_dim]: rotated in place, the keys and values written
        qk = qk.unflatten(-1, (self.num_heads + self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None and self.k_norm is not None:
            self.q_norm.heads_(qk[:, : self.num_heads])
            self.k_norm.heads_(qk[:, self.num_heads :])
        ops.rotary_write_kv(
            qk,
            v,
            rope.cos,
            rope.sin_signed,
            kv_cache.k,
            kv_cache.v,
            batch.slot_mapping,
            kv_cache.k_scale,
            kv_cache.v_scale,
            self.rotary_dim,
            cpu=self.cpu_kernels,
        )
        o = ops.paged_attention(
            qk[:, : self.num_heads],
            kv_cache.k,
            kv_cache.v,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            self.scale,
            batch.max_query_len,
            kv_cache.k_scale,
            kv_cache.v_scale,
            window=self.window,
            softcap=self.softcap,
            cpu=self.cpu_kernels,
        )  # [T, heads, head_dim]
        return self.o_proj(o.flatten(1), batch.lora)


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, gate_up: QuantLinear, down: QuantLinear) -> None:
        super().__init__()
        intermediate = arch.intermediate_size
        self.gate_up_proj = LoraLinear(gate_up, layer, "gate_up", (intermediate, intermediate))
        self.down_proj = LoraLinear(down, layer, "down", (arch.hidden_size,))
        self.act_and_mul = ops.gelu_tanh_and_mul if arch.activation == "gelu_tanh" else ops.silu_and_mul

    def forward(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)  # [T, 2 * intermediate]
        return self.down_proj(self.act_and_mul(gate_up), lora)


class DecoderLayer(nn.Module):
    """A pre-norm block pair; Gemma's post_attn_norm and post_mlp_norm normalize each block's output before it
    joins the residual. ``local_rope``: the layer rotates with the model's local table (Gemma 3's sliding
    layers)."""

    def __init__(
        self,
        attn_norm: RMSNorm,
        attn: Attention,
        mlp_norm: RMSNorm,
        mlp: MLP | SparseMoE,
        post_norms: tuple[RMSNorm, RMSNorm] | None = None,
        local_rope: bool = False,
    ) -> None:
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = attn_norm, attn, mlp_norm, mlp
        self.post_attn_norm: RMSNorm | None = post_norms[0] if post_norms is not None else None
        self.post_mlp_norm: RMSNorm | None = post_norms[1] if post_norms is not None else None
        self.local_rope = local_rope

    def fused_parts(self) -> LayerParts | None:
        """What model.fused_decode reads of this layer, where it is the plain Llama block (no q/k or post norms, one
        rotary table, SiLU, the linears its own LoRA wrappers with the CPU's kernels chosen: not tensor
        parallelism's); else None."""
        attn, mlp = self.attn, self.mlp
        if not isinstance(mlp, MLP):
            return None
        wrappers = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if (
            attn.cpu_kernels is None
            or self.attn_norm.cpu_kernels is None
            or self.mlp_norm.cpu_kernels is None
            or attn.q_norm is not None
            or self.post_attn_norm is not None
            or self.local_rope
            or mlp.act_and_mul is not ops.silu_and_mul
            or any(type(w) is not LoraLinear for w in wrappers)
            or self.attn_norm.eps != self.mlp_norm.eps
        ):
            return None
        return LayerParts(
            self.attn_norm.weight,
            self.mlp_norm.weight,
            self.attn_norm.eps,
            attn.qkv_proj,
            attn.o_proj,
            mlp.gate_up_proj,
            mlp.down_proj,
            attn.scale,
            attn.window,
            attn.softcap,
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, rope: RopeTable, kv_cache: LayerKV
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) [T, hidden] -> the same after this layer: the hidden state is x + residual, the last
        block's output not yet added (residual None: x is the embedding, the first layer)."""
        if residual is None:
            residual, x = x, self.attn_norm(x)
        else:
            self.attn_norm.add_and_norm(x, residual)
        x = self.attn(x, batch, rope, kv_cache)
        if self.post_attn_norm is not None:
            x = self.post_attn_norm(x)
        self.mlp_norm.add_and_norm(x, residual)
        x = self.mlp(x, batch.lora)
        if self.post_mlp_norm is not None:
            x = self.post_mlp_norm(x)
        return x, residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        embed: QuantLinear,
        layers: list[DecoderLayer],
        norm: RMSNorm,
        lm_head: QuantLinear | None,
        rotary: Rotary,
        dtype: torch.dtype,
        local_rotary: Rotary | None = None,
    ) -> None:
        super().__init__()
        self.arch, self.dtype = arch, dtype
        self.embed, self.layers, self.norm, self.rotary = embed, nn.ModuleList(layers), norm, rotary
        self.local_rotary = local_rotary  # Gemma 3's sliding layers' table
        self.lm_head = lm_head  # None: tied to the embedding
        # table page -> that resident adapter's embedding / head changes, or None (set by the runner: its arena)
        self.vocab_terms: Callable[[int], VocabTerms | None] | None = None
        self._fused: FusedDecode | None = None  # fused_decode's, built on first use
        self._fused_built = False

    def forward(self, batch: ForwardBatch, kv_caches: list[LayerKV]) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; writes this step's K and V into the caches."""
        x = self.embed.rows(batch.input_ids, self.dtype)  # [T, hidden]
        vocab_terms = self.vocab_terms
        if batch.lora is not None and vocab_terms is not None:  # adapters' embeddings, before the scale (PEFT)
            for start, end, page in batch.lora.host_segments:
                terms = vocab_terms(page)
                if terms is not None:
                    terms.embed_(x[start:end], batch.input_ids[start:end])
        if self.arch.embed_scale != 1.0:  # Gemma: times sqrt(hidden) rounded to the dtype, as HF's normalizer
            x = x * torch.tensor(self.arch.embed_scale, dtype=self.dtype)
        rope = self.rotary.table(batch.positions, self.dtype)
        local = rope if self.local_rotary is None else self.local_rotary.table(batch.positions, self.dtype)
        residual: torch.Tensor | None = None
        fused = self.fused_decode()
        if fused is not None and fused.takes(x, batch, rope.cos, kv_caches[0].k, kv_caches[0].k_scale is not None):
            x, residual = fused.forward(x, batch, rope.cos, rope.sin_signed, kv_caches)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, batch, local if layer.local_rope else rope, kv_cache)
        if residual is None:
            return self.norm(x)
        self.norm.add_and_norm(x, residual)
        return x

    def fused_decode(self) -> FusedDecode | None:
        """The CPU decode step's layers one C call each (model.fused_decode), built on the first step (after any
        module swap); None where a layer does not qualify. It points into the layers' weights: once a step has run,
        the model's modules and their tensors must not be replaced or moved."""
        if not self._fused_built:
            layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
            self._fused = FusedDecode.build(self.arch, [layer.fused_parts() for layer in layers])
            self._fused_built = True
        return self._fused

    def lora_wrappers(self) -> list[dict[str, LoraLinear]]:
        """[layer][group] -> the LoRA wrapper of each fused linear (groups as in kernels.lora_table.GROUPS; a
        mixture-of-experts layer has no dense gate_up and down: its experts' LoRA is model.moe's)."""
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        wrappers = []
        for layer in layers:
            found = dict(qkv=layer.attn.qkv_proj, o=layer.attn.o_proj)
            if isinstance(layer.mlp, MLP):
                found.update(gate_up=layer.mlp.gate_up_proj, down=layer.mlp.down_proj)
            wrappers.append(found)
        return wrappers

    def sparse_mlps(self) -> list[SparseMoE]:
        """The mixture-of-experts layers' MLPs (empty for a dense model)."""
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]  # type: ignore[union-attr]

    def compute_logits(
        self, hidden: torch.Tensor, segments: Sequence[tuple[int, int, int]] = ()
    ) -> torch.Tensor:  # [S, hidden] -> [S, vocab] float32
        """The head's logits (soft-capped where the family caps them); ``segments``: (first row, end row, table
        page) of the rows that belong to an adapter, whose changes to the head apply before the cap."""
        head = self.lm_head if self.lm_head is not None else self.embed
        logits = head(hidden).float()
        vocab_terms = self.vocab_terms
        for start, end, page in segments:
            terms = None if vocab_terms is None else vocab_terms(page)
            if terms is not None:
                terms.head_(logits[start:end], hidden[start:end])
        cap = self.arch.final_softcap
        return logits if cap <= 0 else torch.tanh(logits / cap) * cap


def build_llama(
    ckpt: Checkpoint,
    quantization: str,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    show_progress: bool = True,
    cpu_head_copy: bool = True,
    exact_kv: bool = True,
) -> LlamaModel:
    """The offline transform: read each checkpoint tensor, quantize it to ``quantization`` ("auto" keeps a GGUF's
    own blocks), fuse q|k|v and gate|up, and place everything on ``device``; on the CPU, the norms and decode
    attention in kernels.cpu_decode unless a linear quantizes its activations or the KV cache is stored rounded
    (``exact_kv`` False: fp8), where a float32 sum in another order than HF's can move a stored code by one step
    (the twins keep HF's order there); int4 linears in torch's
    CPU layout and, with ``cpu_head_copy``, a tied head's own copy (quant.cpu_head); on CUDA, int4 linears in the
    GPU kernel's pack width (quant.swap_for_cuda)."""
    arch, w = ckpt.arch, ckpt.weights
    missing = [n for n in ("embed", "norm") if n not in w] + (
        [] if arch.tie_word_embeddings or "lm_head" in w else ["lm_head"]
    )
    if missing:
        raise ModelLoadError(f"checkpoint lacks {', '.join(missing)}")

    def linear(name: str, bias: str | None = None) -> QuantLinear:
        if name not in w:
            raise ModelLoadError(f"checkpoint lacks {name}")
        module = w[name].linear(tensor_mode(quantization, name), dtype, device)
        if bias is not None and bias in w:
            module.bias = nn.Parameter(w[bias].dense(dtype, device), requires_grad=False)
        return module

    def norm(name: str) -> RMSNorm:
        if name not in w:
            raise ModelLoadError(f"checkpoint lacks {name}")
        if arch.gemma_norms:  # HF's 1 + w in float32, which multiplies before the rounding (RMSNorm)
            return RMSNorm(1.0 + w[name].dense(torch.float32, device), arch.rms_norm_eps)
        return RMSNorm(w[name].dense(dtype, device), arch.rms_norm_eps)

    layers = []
    for i in tqdm(range(arch.num_layers), desc="loading layers", disable=not show_progress, unit="layer"):
        p = f"layers.{i}."
        qkv = cat_linears(
            [linear(p + "q", p + "q_bias"), linear(p + "k", p + "k_bias"), linear(p + "v", p + "v_bias")], dtype
        )
        qk_norms = (norm(p + "q_norm"), norm(p + "k_norm")) if arch.qk_norm else None
        attn = Attention(arch, i, qkv, linear(p + "o"), qk_norms)
        mlp: MLP | SparseMoE
        if arch.sparse(i):
            if p + "router" not in w:
                raise ModelLoadError(f"checkpoint lacks {p}router")
            experts = [f"{p}experts.{e}." for e in range(arch.num_experts)]
            mlp = SparseMoE(
                i,
                w[p + "router"].dense(dtype, device),
                [cat_linears([linear(e + "gate"), linear(e + "up")], dtype) for e in experts],
                [linear(e + "down") for e in experts],
                arch.experts_per_token,
                arch.norm_topk_prob,
            )
        else:
            mlp = MLP(arch, i, cat_linears([linear(p + "gate"), linear(p + "up")], dtype), linear(p + "down"))
        post_norms = (norm(p + "post_attn_norm"), norm(p + "post_mlp_norm")) if arch.gemma_norms else None
        local = arch.local_rope_theta > 0 and arch.window(i) > 0
        layers.append(DecoderLayer(norm(p + "attn_norm"), attn, norm(p + "mlp_norm"), mlp, post_norms, local))
    rope_freqs = w["rope_freqs"].dense(torch.float32, device) if "rope_freqs" in w else None
    lm_head = None if arch.tie_word_embeddings or "lm_head" not in w else linear("lm_head")
    rotary = Rotary(arch, max_positions, device, rope_freqs)
    local_rotary = Rotary(arch, max_positions, device, local=True) if arch.local_rope_theta > 0 else None
    model = LlamaModel(arch, linear("embed"), layers, norm("norm"), lm_head, rotary, dtype, local_rotary)
    if device.type == "cpu":  # the embedding stays as is: it is read by rows, not multiplied
        swap_for_cpu(model, keep=("embed",))
        if model.lm_head is None and cpu_head_copy:  # a tied head multiplies: its own copy (see cpu_head)
            model.lm_head = cpu_head(model.embed, dtype)
        lib = cpu_decode_library() if exact_kv and not quantizes_activations(model) else None
        for module in model.modules():  # the float32 norms and decode attention in kernels.cpu_decode
            if isinstance(module, RMSNorm | Attention):
                module.cpu_kernels = lib
    else:  # CUDA, or the meta device that stands for it (instrument.host_work)
        swap_for_cuda(model, dtype)
    return model
