"""The scales of an fp8 KV cache (``--kv-cache-dtype fp8``): one float32 scale per layer, K or V, and KV head,
fixed once at start and never changed, so that cached and swapped blocks stay valid for the engine's life.

The cache stores x / scale clamped to +-448 in float8 e4m3 and reads stored * scale (kernels.reference.quantize_kv).
e4m3 keeps 3 mantissa bits over 2^-6 ... 448 (relative error <= 2^-4) and subnormals down to 2^-9, so the scale
only has to keep the largest values below 448 and the bulk above 2^-6. vLLM's default, scale 1.0 unless a
checkpoint brings calibrated scales, fits no model in particular: SmolLM2-135M's keys after RoPE reach |21| and its
values range from |0.4| (layer 0) to |13| by head, so one scale for every head would put layer 0's small values
among the subnormals, and a model with larger keys (Qwen2's k biases) would saturate.

What we do instead: at start, run the model once over ``CALIBRATION_TOKENS`` seeded random token ids into a
temporary cache of the model's dtype, take each head's largest |K| (after RoPE) and |V|, and set scale =
amax x ``HEADROOM`` / 448. Random text is not real text: on the chat prompts of the tests, SmolLM2's per-head
maxima reach 2.1x the random sequence's (and a LoRA on k/v moves them too), hence a headroom of 16: values may grow
16x past calibration before they clamp, while the subnormal range starts at amax / 1792, below the bulk of every
head. A head whose calibration values are all zero gets scale 1.0."""

from __future__ import annotations

import torch

from lora_server.kernels.reference import FP8_KV_DTYPE
from lora_server.model.arch import ModelArch
from lora_server.model.batch import ForwardBatch
from lora_server.model.llama import LayerKV, LlamaModel

CALIBRATION_TOKENS = 128
HEADROOM = 16.0
CALIBRATION_SEED = 0


@torch.inference_mode()
def calibrate_kv_scales(
    model: LlamaModel, arch: ModelArch, dtype: torch.dtype, device: torch.device, max_tokens: int
) -> torch.Tensor:
    """[layers, 2 (k, v), kv_heads] float32 on ``device``: amax x HEADROOM / 448 per head of one forward pass over
    min(CALIBRATION_TOKENS, max_tokens) seeded random tokens (no adapter)."""
    n = max(1, min(CALIBRATION_TOKENS, max_tokens))
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    token_ids = torch.randint(0, arch.vocab_size, (n,), generator=gen)
    # one sequence in blocks of one token: slot i holds position i
    # [layers, 2, n, 1, kv_heads, head_dim]
    cache = torch.zeros(arch.num_layers, 2, n, 1, arch.num_kv_heads, arch.head_dim, dtype=dtype, device=device)
    positions = torch.arange(n, device=device)
    batch = ForwardBatch(
        input_ids=token_ids.to(device),
        positions=positions,
        slot_mapping=positions,
        block_tables=positions.to(torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        logits_indices=torch.tensor([n - 1], device=device),
        max_query_len=n,
    )
    model(batch, [LayerKV(layer[0], layer[1]) for layer in cache])
    amax = cache.abs().amax(dim=(2, 3, 5)).float()  # [layers, 2, kv_heads]
    return torch.where(amax > 0, amax * HEADROOM / torch.finfo(FP8_KV_DTYPE).max, 1.0)
