"""What every checkpoint reader hands the model builder: each tensor under a canonical name as a WeightSource
(read when asked for), the model's shape, and where it came from.

Canonical names: embed, norm, lm_head, rope_freqs, and per layer ``layers.{i}.`` + attn_norm, mlp_norm, q, k, v,
o, gate, up, down, q_bias, k_bias, v_bias; q_norm, k_norm (per-head norms: Qwen3, Gemma 3); post_attn_norm,
post_mlp_norm (Gemma's norms of the attention's and the MLP's outputs). Fused projections (Phi-3's qkv_proj,
gate_up_proj) come split into q, k, v and gate, up. Weights are [out_features, in_features] in HF's row order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lora_server.errors import ModelLoadError
from lora_server.model.arch import ModelArch
from lora_server.model.quant import QuantLinear, make_linear


class WeightSource:
    """One tensor of a checkpoint, read when asked for. ``native`` names the quantized format the file stores
    ("int4", "int8") or "none" for float weights."""

    native = "none"

    def dense(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def linear(self, mode: str, dtype: torch.dtype, device: torch.device) -> QuantLinear:
        """The weight as a linear module of ``mode`` ("auto" keeps the stored format)."""
        mode = self.native if mode == "auto" else mode
        w = self.dense(torch.float32 if mode != "none" else dtype, device)
        return make_linear(w.to(dtype) if mode == "none" else w, mode)


class FloatWeight(WeightSource):
    def __init__(self, read: Callable[[], torch.Tensor]) -> None:
        self._read = read

    def dense(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._read().to(device=device, dtype=dtype)


@dataclass
class Checkpoint:
    arch: ModelArch
    weights: dict[str, WeightSource]
    format: str  # "hf" | "gguf" | "dummy"
    path: Path | None


def refuse_unread(path: Path, names: list[str]) -> None:
    """Tensors the loader would leave unread are a start-up error naming them: a weight left out (a bias, a norm,
    an expert) is another model served silently."""
    if names:
        shown = ", ".join(sorted(names)[:4]) + (", ..." if len(names) > 4 else "")
        raise ModelLoadError(
            f"{path} holds {len(names)} tensor(s) this loader does not read ({shown}): the architecture has parts "
            "that are not implemented"
        )


def tensor_copy(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array))
