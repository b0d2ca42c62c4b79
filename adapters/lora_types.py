"""The types an adapter is read into, whatever its format: the base model's shapes it must fit (BaseShapes, with
the PEFT module names of a decoder layer), and a validated adapter's weights as the server computes with them
(LoraAdapter: float32, each module's B already scaled; VocabLora: its changes to the embedding and head), and
``content_hash``, a hash of those weights."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

# A decoder layer's linear modules as PEFT names them (their path in the layer) -> the canonical modules each
# covers. A fused module's adapter (Phi-3's qkv_proj, gate_up_proj) applies to its fused output: lora_B's rows
# split by the canonical modules' widths, each part with the same lora_A.
LLAMA_MODULES: dict[str, tuple[str, ...]] = {
    "self_attn.q_proj": ("q",),
    "self_attn.k_proj": ("k",),
    "self_attn.v_proj": ("v",),
    "self_attn.o_proj": ("o",),
    "mlp.gate_proj": ("gate",),
    "mlp.up_proj": ("up",),
    "mlp.down_proj": ("down",),
}
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("q", "k", "v"),
    "self_attn.o_proj": ("o",),
    "mlp.gate_up_proj": ("gate", "up"),
    "mlp.down_proj": ("down",),
}


@dataclass(frozen=True, slots=True)
class BaseShapes:
    """What an adapter must fit: the base model's layer count, each canonical module's (in, out) features, and the
    modules PEFT names in a layer (LLAMA_MODULES, or FUSED_MODULES for Phi-3's fused projections); for llama.cpp's
    GGUF adapters (adapters.gguf_lora), the base's HF architecture and head width where known ("" and 0: not known)."""

    num_layers: int
    features: dict[str, tuple[int, int]]  # canonical module -> (in_features, out_features)
    modules: dict[str, tuple[str, ...]] = field(default_factory=lambda: LLAMA_MODULES)
    architecture: str = ""  # ModelArch.architecture: which GGUF general.architecture an adapter must name
    head_dim: int = 0  # the heads' width: llama.cpp permutes a llama adapter's Q/K rows per head
    vocab_size: int = 0  # the embedding's rows (0: not known, and no adapter may touch the vocabulary)
    tied_embeddings: bool = False  # the output head is the embedding (tie_word_embeddings)
    # where the engine refuses LoRA on the embedding or head and trainable tokens (VocabLora), why; "" serves them
    vocab_refusal: str = "this engine does not serve them"
    max_positions: int = 0  # the context length, max_position_embeddings (0: not known): what a prompt can hold
    # a mixture of experts (model.moe; 0 experts: a dense base): its experts' width, the layers whose MLP stays
    # dense, where PEFT's per-expert modules are ({experts_path}.N.{name}) and their names -> gate, up, down
    experts: int = 0
    expert_width: int = 0
    dense_layers: tuple[int, ...] = ()
    experts_path: str = "mlp.experts"
    expert_modules: dict[str, str] = field(default_factory=dict)

    @classmethod
    def llama(
        cls,
        num_layers: int,
        hidden: int,
        intermediate: int,
        q_size: int,
        kv_size: int,
        fused: bool = False,
        architecture: str = "",
        head_dim: int = 0,
        vocab_size: int = 0,
        tied_embeddings: bool = False,
        vocab_refusal: str = "this engine does not serve them",
        max_positions: int = 0,
    ) -> BaseShapes:
        return cls(
            num_layers,
            {
                "q": (hidden, q_size),
                "k": (hidden, kv_size),
                "v": (hidden, kv_size),
                "o": (q_size, hidden),
                "gate": (hidden, intermediate),
                "up": (hidden, intermediate),
                "down": (intermediate, hidden),
            },
            FUSED_MODULES if fused else LLAMA_MODULES,
            architecture,
            head_dim,
            vocab_size,
            tied_embeddings,
            vocab_refusal,
            max_positions,
        )

    @property
    def hidden(self) -> int:
        return self.features["q"][0]

    def sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts (ModelArch.sparse)."""
        return self.experts > 0 and layer not in self.dense_layers

    def expert_features(self, module: str) -> tuple[int, int]:
        """(in, out) of an expert's gate, up, gate_up (both halves) or down, or of the router."""
        if module == "router":
            return self.hidden, self.experts
        width = self.expert_width * (2 if module == "gate_up" else 1)
        return (width, self.hidden) if module == "down" else (self.hidden, width)

    def module_features(self, module: str) -> tuple[int, int]:
        """(in, out) of a PEFT module (a path of ``modules``): a fused one's out is its parts' together."""
        parts = self.modules[module]
        return self.features[parts[0]][0], sum(self.features[p][1] for p in parts)


class TokenIds(NamedTuple):
    """The token ids whose rows an adapter replaces (PEFT's trainable tokens), in the embedding and in the output
    head: [n] int64 each, None where it replaces none."""

    embed: torch.Tensor | None = None
    head: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class VocabLora:
    """What an adapter changes of the embedding and the output head, as PEFT computes it, float32 on the host.

    Per token t of a request on this adapter, its embedding (before any embedding scale):
        rows[t]                                   where t is one of embed_tokens' ids (trainable tokens), else
        E[t] + embed_a_t[t] @ embed_b_t           with LoRA on embed_tokens, else E[t]
    Per logits row of hidden state h (before any final soft-cap):
        logits + (h @ head_a.T) @ head_b_t        with LoRA on lm_head, and then
        logits[:, ids] = h @ rows.T               for head_tokens' (ids, rows)."""

    embed_lora: tuple[torch.Tensor, torch.Tensor] | None = None  # lora_embedding_A.T [vocab, r], scaled B.T [r, hidden]
    head_lora: tuple[torch.Tensor, torch.Tensor] | None = None  # lora_A [r, hidden], scaled lora_B.T [r, vocab]
    embed_tokens: tuple[torch.Tensor, torch.Tensor] | None = None  # ids [n] int64, their new rows [n, hidden]
    head_tokens: tuple[torch.Tensor, torch.Tensor] | None = None  # ids [n] int64, the head's new rows [n, hidden]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by a stable name (hashing, sizes, moving to the device)."""
        named = {}
        for field_name in ("embed_lora", "head_lora", "embed_tokens", "head_tokens"):
            pair = getattr(self, field_name)
            if pair is not None:
                named[f"{field_name}.0"], named[f"{field_name}.1"] = pair
        return named

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def token_ids(self) -> TokenIds:
        return TokenIds(
            None if self.embed_tokens is None else self.embed_tokens[0],
            None if self.head_tokens is None else self.head_tokens[0],
        )


@dataclass(slots=True)
class LoraAdapter:
    """A validated adapter: for each (layer, module) it targets, A [r, in] and B [out, r] (B already scaled)."""

    name: str
    path: Path
    rank: int  # the largest rank over its modules
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Activated LoRA (PEFT's alora_invocation_tokens): the adapter applies from the last occurrence of these token
    # ids in the prompt on; empty for an adapter that applies to every token
    invocation_tokens: tuple[int, ...] = ()
    # DoRA (PEFT's use_dora): the learned magnitude m [out] (float32) of every (layer, module) it targets, empty for
    # a plain LoRA; such a module serves m / ||W + B A||_row times (base + LoRA), see adapters.dora
    magnitudes: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    # LoRA on the embedding or the output head, trainable tokens (None: the adapter leaves the vocabulary alone)
    vocab: VocabLora | None = None
    # LoRA on a mixture of experts' experts (adapters.peft_experts): (layer, gate | up | gate_up | down, expert) ->
    # A [r, in], B [out, r] (B scaled), each token's applying on the experts its router picked (model.moe)
    experts: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.weights}

    @property
    def nbytes(self) -> int:
        pairs = [*self.weights.values(), *self.experts.values()]
        layers = sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in pairs)
        return layers + (0 if self.vocab is None else self.vocab.nbytes)

    def expert_parts(self) -> dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor, float]]:
        """(layer, module, expert) -> (A, B, 1.0): PeftAdapter.expert_parts's form."""
        return {key: (a, b, 1.0) for key, (a, b) in self.experts.items()}

    @property
    def ranks(self) -> dict[tuple[int, str], int]:
        """(layer, module) -> rank of every module it targets."""
        return {key: a.shape[0] for key, (a, _) in self.weights.items()}

    def scaled_parts(self) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]:
        """(layer, module) -> (A, B, 1.0): its B is scaled already (PeftAdapter.scaled_parts's form)."""
        return {key: (a, b, 1.0) for key, (a, b) in self.weights.items()}


def content_hash(adapter: LoraAdapter) -> str:
    """A hash of the weights as served: every (layer, module)'s A and scaled B in float32, in a fixed order."""
    digest = hashlib.blake2b(digest_size=16)
    if adapter.invocation_tokens:  # the same weights activated elsewhere compute something else
        digest.update(f"alora{list(adapter.invocation_tokens)};".encode())
    for (layer, module), (a, b) in sorted(adapter.weights.items()):
        digest.update(f"{layer}.{module}.{tuple(a.shape)}.{tuple(b.shape)};".encode())
        digest.update(a.float().contiguous().numpy().tobytes())
        digest.update(b.float().contiguous().numpy().tobytes())
    for (layer, module), magnitude in sorted(adapter.magnitudes.items()):  # DoRA's: the same A, B scale otherwise
        digest.update(f"dora.{layer}.{module}.{tuple(magnitude.shape)};".encode())
        digest.update(magnitude.float().contiguous().numpy().tobytes())
    for (layer, module, expert), (a, b) in sorted(adapter.experts.items()):
        digest.update(f"expert.{layer}.{module}.{expert}.{tuple(a.shape)}.{tuple(b.shape)};".encode())
        digest.update(a.float().contiguous().numpy().tobytes())
        digest.update(b.float().contiguous().numpy().tobytes())
    for key, tensor in ({} if adapter.vocab is None else adapter.vocab.tensors()).items():  # the embedding's, head's
        digest.update(f"vocab.{key}.{tuple(tensor.shape)};".encode())
        digest.update(tensor.contiguous().numpy().tobytes())  # float32 weights, int64 ids
    return digest.hexdigest()
