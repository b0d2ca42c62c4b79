"""GGUF quantized blocks read as they are stored: the block table, the torch twin that decodes whole rows of
blocks (vectorized, no loop over blocks) and the twin of kernels/gguf_matmul.py. The decoder is the formats' one
implementation outside the Triton kernels (lora_server.model.gguf_linear dequantizes with it) and equals
gguf.quants.dequantize bit for bit in float32.

A weight is uint8 [N, (K // block) * block_bytes]: each row its K // block blocks, as the GGUF file stores them
(llama.cpp's ggml-common.h), little-endian, fp16 scales:
- Q4_0 (32 values, 18 bytes): d, qs[16]; value j: q = nibble j (qs[j] low for j < 16, qs[j - 16] high above),
  w = d * (q - 8).
- Q5_0 (32, 22): d, qh (uint32: bit j is value j's fifth bit), qs[16]; w = d * (q - 16).
- Q5_1 (32, 24): d, m, qh, qs[16]; w = d * q + m.
- Q4_K (256, 144): d, dmin, scales[12] (eight 6-bit scales sc and mins mn, see k_scales_mins), qs[128]; sub-block
  s = j // 32 of 32 values; qs byte 32 * (j // 64) + j % 32 holds value j in its low nibble when (j // 32) is even,
  its high nibble when odd; w = (d * sc[s]) * q - dmin * mn[s].
- Q5_K (256, 176): d, dmin, scales[12], qh[32], qs[128]; as Q4_K with a fifth bit, bit s of qh[j % 32].
- Q6_K (256, 210): ql[128], qh[64], scales[16] (int8), d; half a = j // 128, p = j % 64: the low four bits are
  ql[64 a + p]'s low nibble for (j % 128) < 64, its high nibble above; the top two are bits 2 * ((j % 128) // 32)
  of qh[32 a + j % 32]; w = (d * scales[j // 16]) * (q - 32).

Why float32 is exact whatever the order of the products: d is an fp16 value (11 significant bits) and every other
factor a small integer, so d * sc * q has at most 11 + 6 + 5 (Q5_K) or 11 + 7 + 5 (Q6_K) significant bits, fewer
than float32's 24: every product is exact, and the one rounding is that of Q4_K's, Q5_K's and Q5_1's sum (a fused
multiply-add rounds the same sum once too). Dequantizing to another dtype rounds that float32 value once."""

from __future__ import annotations

import torch

# type name -> (values per block, bytes per block), as gguf.GGML_QUANT_SIZES
GGUF_BLOCKS = {
    "Q4_0": (32, 18),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte ``offset`` of every block [..., nb, bytes] -> float32 [..., nb, 1]."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, spans: int) -> torch.Tensor:
    """[..., L] bytes in ``spans`` runs -> [..., 2L] codes: each run's low nibbles, then its high nibbles."""
    runs = qs.unflatten(-1, (spans, -1))
    return torch.cat([runs & 0xF, runs >> 4], dim=-1).flatten(-2)


def _bits(qh: torch.Tensor, width: int) -> torch.Tensor:
    """[..., L] bytes -> [..., 8 / width, L] fields of ``width`` bits: [f, i] = (byte i >> f * width) & mask."""
    return torch.stack([(qh >> shift) & ((1 << width) - 1) for shift in range(0, 8, width)], dim=-2)


def k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 scale bytes [..., 12] -> (sc, mn) uint8 [..., 8]: for s < 4 sc = b[s] & 63, mn =
    b[s + 4] & 63; for s >= 4 sc = (b[s + 4] & 15) | (b[s - 4] >> 6) << 4, mn = (b[s + 4] >> 4) | (b[s] >> 6) << 4."""
    low, mid, high = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([low & 63, (high & 15) | ((low >> 6) << 4)], dim=-1)
    mn = torch.cat([mid & 63, (high >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc, mn


def dequantize_gguf(raw: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., nb * block_bytes] rows of ``kind`` blocks -> [..., nb * block] values in ``dtype``: computed in
    float32 as gguf.quants.dequantize does (bit for bit), then rounded once to ``dtype``."""
    values, nbytes = GGUF_BLOCKS[kind]
    b = raw.unflatten(-1, (-1, nbytes))  # [..., nb, bytes]
    d = _f16(b, 208 if kind == "Q6_K" else 0)
    if kind in ("Q4_0", "Q5_0", "Q5_1"):
        offset = {"Q4_0": 2, "Q5_0": 6, "Q5_1": 8}[kind]
        q = _nibbles(b[..., offset:], 1)  # [..., nb, 32]
        if kind != "Q4_0":
            qh = b[..., offset - 4 : offset]  # the uint32, byte i holding bits 8i..8i+7
            q = q | (_bits(qh, 1).transpose(-1, -2).flatten(-2) << 4)
        w = d * (q.float() - {"Q4_0": 8, "Q5_0": 16, "Q5_1": 0}[kind])
        if kind == "Q5_1":
            w = w + _f16(b, 2)
    elif kind in ("Q4_K", "Q5_K"):
        sc, mn = k_scales_mins(b[..., 4:16])
        q = _nibbles(b[..., -128:], 4)  # [..., nb, 256]
        if kind == "Q5_K":
            q = q | (_bits(b[..., 16:48], 1).flatten(-2) << 4)  # bit s of qh[l] is value 32 s + l's
        ds = (d * sc.float()).unsqueeze(-1)  # [..., nb, 8, 1]
        dm = (_f16(b, 2) * mn.float()).unsqueeze(-1)
        w = (ds * q.float().unflatten(-1, (8, 32)) - dm).flatten(-2)
    elif kind == "Q6_K":
        low = _nibbles(b[..., 0:128], 2)  # [..., nb, 256]
        high = _bits(b[..., 128:192].unflatten(-1, (2, 32)), 2).flatten(-3)  # [..., nb, 2 halves, 4, 32] -> 256
        q = (low | (high << 4)).float() - 32
        ds = (d * b[..., 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)  # [..., nb, 16, 1]
        w = (ds * q.unflatten(-1, (16, 16))).flatten(-2)
    else:
        raise ValueError(f"GGUF type {kind} is not read as blocks")
    assert w.shape[-1] == values
    return w.flatten(-2).to(dtype)


def gguf_matmul(x: torch.Tensor, raw: torch.Tensor, kind: str) -> torch.Tensor:
    """y [M, N] in x's dtype = x [M, K] @ dequantize_gguf(raw, kind).T, in float32."""
    return (x.float() @ dequantize_gguf(raw, kind).T).to(x.dtype)
