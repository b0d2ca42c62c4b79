"""The CPU decode step's kernels: kernels/cpu_decode.c, built with the machine's C compiler on first use (``-O3
-ffp-contract=off -fopenmp -march=native``, cached by the source's, the flags', the compiler's and the CPU's
fingerprint) and called through ctypes, which lets go of the interpreter lock for the call.

- int4_gemv, int8_gemv: y [M, N] float32 = x [M, K] float32 @ W.T with W decoded in registers, no dequantized copy
  of the weight. int4: x in 16-bit fixed point per block of 32 columns (2^-16 of the block's largest value; torch's
  CPU int4 kernel rounds each activation to bfloat16, 2^-9 of itself), its products with the codes exact integer
  sums (AVX512-VNNI); int8: every product and sum in float32. They serve a few rows (decode; the int4 one reads a
  weight block from cache for each further row, the int8 one once per 4 rows) and torch's kernels beyond. Twins:
  int4pack_reference here (torch's CPU int4 layout, which kernels.quant_reference does not know) and
  kernels.quant_reference.int8_matmul.
- decode_attention: kernels.gathered_attention's result for a float32 cache, one pass per (sequence, head).
- add_rms_norm_: kernels.reference.fused_add_rms_norm (and rms_norm) for float32 rows.
- rotary_write_kv_: kernels.reference.rotary_write_kv for float32 heads and cache, bit for bit.
- decode_layer_: a decoder layer's calls of the above, from its input norm to its gate | up projection, in one
  call (DecodeLayer, DecodeStep: what model.fused_decode builds), bit for bit the calls one by one; or in three
  (decode_qkv_, decode_attention_o_, decode_gate_up_), between which the model adds its adapters' LoRA.

Where there is no compiler, or the build fails, ``load`` returns None and says why once; the callers keep torch's
paths. kernels.ops takes the library where its caller passes it (``cpu=``: the model's norms and attention, where
the model's loader chose it)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")  # each product and sum rounded as written
INT4_BLOCK = 64  # the row block of torch's CPU int4 layout (on AVX-512) that int4_gemv reads
INT4_XQ_MAX = 32639  # cpu_decode.c's fixed-point activations: 127 * 256 + 127, two int8 parts

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_loaded: dict[str, ctypes.CDLL | None] = {}


def _fingerprint(compiler: str, flags: tuple[str, ...]) -> str:
    """What the built library depends on: the source, the flags, the compiler's version and the CPU's features
    (-march=native builds for this CPU)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    cpu = ""
    if Path("/proc/cpuinfo").exists():
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    parts = [SOURCE.read_bytes(), " ".join(flags).encode(), version.encode(), platform.machine().encode(), cpu.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _build(cache_dir: Path, march: str) -> ctypes.CDLL:
    compiler = os.environ.get("CC") or "cc"
    flags = (*FLAGS, f"-march={march}")
    target = cache_dir / f"cpu_decode-{_fingerprint(compiler, flags)}.so"
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:  # built aside, then renamed: other processes too
            built = Path(tmp) / target.name
            subprocess.run(
                [compiler, *flags, "-o", str(built), str(SOURCE)], capture_output=True, text=True, check=True
            )
            os.replace(built, target)
    lib = ctypes.CDLL(str(target))  # after torch: its libgomp.so.1 is the one the library runs on
    lib.int4_gemv.argtypes = [_P, _I, _I, _P, _P, _I, _I, _P, _P]
    lib.int4_gemv.restype = None
    lib.int8_gemv.argtypes = [_P, _I, _I, _P, _P, _I, _I, _P]
    lib.int8_gemv.restype = None
    lib.decode_attention.argtypes = [_P, _P, _P, _L, _L, _L, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I, _F, _P]
    lib.decode_attention.restype = None
    lib.add_rms_norm.argtypes = [_P, _P, _P, _I, _I, _F, _I]
    lib.add_rms_norm.restype = None
    lib.rotary_write_kv.argtypes = [_P, _L, _P, _L, _P, _P, _P, _P, _L, _L, _L, _P, _I, _I, _I, _I, _I, _I]
    lib.rotary_write_kv.restype = None
    lib.decode_layer.argtypes = [_P, _P, _P, _P, _I, _P, _P, _P]
    lib.decode_qkv.argtypes = [_P, _P, _P, _P, _I]
    lib.decode_attention_o.argtypes = [_P, _P, _P, _P, _P]
    lib.decode_gate_up.argtypes = [_P, _P, _P, _P, _P]
    for name in ("decode_layer", "decode_qkv", "decode_attention_o", "decode_gate_up"):
        getattr(lib, name).restype = None
    lib.vectorized.argtypes = []
    lib.vectorized.restype = _I
    return lib


def load(cache_dir: str | Path, march: str = "native") -> ctypes.CDLL | None:
    """The library built for ``march`` (native: this CPU's vector units; x86-64: the portable loops, which the
    tests check too) into ``cache_dir`` on first use, or None where it cannot be built: logged once."""
    key = f"{cache_dir}:{march}"
    if key not in _loaded:
        try:
            _loaded[key] = _build(Path(cache_dir), march)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
            log.warning("the CPU decode kernels could not be built (%s): torch's CPU kernels serve", detail[:500])
            _loaded[key] = None
    return _loaded[key]


def vectorized(lib: ctypes.CDLL) -> bool:
    """Whether the library's matrix-vector products run on AVX-512 with VNNI and VBMI (the int4 one for torch's
    64-row layout only); the portable loops are checked by the tests but slower than torch's kernels, so the model
    does not use them."""
    return bool(lib.vectorized())


def int4_gemv(
    lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """y [M, N] float32 = x [M, K] @ W.T, W [N, K] in torch's CPU int4 layout at row block 64: packed [N / 64, K, 32]
    uint8 (flattened to [N, K / 2]; byte (b, k, d) holds row 64 b + d's code at column k in its low nibble and row
    64 b + 32 + d's in its high one), scales_and_zeros [K / group, N, 2] bfloat16; W = (code - 8) * scale + zero.
    x enters the codes' products in 16-bit fixed point per block of 32 columns (int4_activations); its exact sums
    carry the zeros. Twin: int4pack_reference."""
    m, k = x.shape
    n = scales_and_zeros.shape[1]
    assert n % INT4_BLOCK == 0 and k % group == 0 and group % 32 == 0, (n, k, group)
    assert packed.numel() == n * k // 2, (k, packed.shape)
    assert scales_and_zeros.dtype == torch.bfloat16 and scales_and_zeros.is_contiguous()
    x = x.float().contiguous()
    y = torch.empty(m, n)
    scratch = torch.empty(m * (2 * k + 4 * (k // 32 + k // group)), dtype=torch.uint8)
    lib.int4_gemv(x.data_ptr(), m, k, packed.data_ptr(), scales_and_zeros.data_ptr(), n, group, scratch.data_ptr(),
                  y.data_ptr())  # fmt: skip
    return y


def int4_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 as int4_gemv's products take it, in float64: per block of 32 columns, scale = the block's
    largest |x| / 32639 and x = scale * rint(x * (1 / scale)) (in float32, as cpu_decode.c computes them)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / INT4_XQ_MAX
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = torch.round(blocks * inverse).clamp(-INT4_XQ_MAX, INT4_XQ_MAX)
    return (codes.double() * scale.double()).reshape(x.shape)


def int8_gemv(lib: ctypes.CDLL, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y [M, N] float32 = x [M, K] @ W.T, W = qweight [N, K] int8 * scales [N, K / group] float32 (each scale over
    its group of columns; Q8_0 at group 32)."""
    m, k = x.shape
    n, groups = scales.shape
    group = k // groups
    assert qweight.shape == (n, k) and qweight.dtype == torch.int8 and qweight.is_contiguous()
    assert scales.dtype == torch.float32 and scales.is_contiguous() and group % 32 == 0, (scales.dtype, group)
    x = x.float().contiguous()
    y = torch.empty(m, n)
    lib.int8_gemv(x.data_ptr(), m, k, qweight.data_ptr(), scales.data_ptr(), n, group, y.data_ptr())
    return y


def int4pack_reference(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, block: int, group: int, exact: bool = True
) -> torch.Tensor:
    """x @ W.T for torch's CPU int4 layout at row block ``block``, decoded in torch, the product in x's dtype (float64
    for the sweep tests). ``exact=False`` is int4_gemv's twin: the codes' products take int4_activations(x) and the
    zeros the exact sums, as the kernel does."""
    k = x.shape[1]
    n = scales_and_zeros.shape[1]
    by_block = packed.reshape(n // block, k, block // 2)
    codes = torch.cat([by_block & 0xF, by_block >> 4], dim=-1)  # [N / B, K, B]: row b * B + r at r
    codes = codes.permute(0, 2, 1).reshape(n, k).to(x.dtype)
    scales = scales_and_zeros[..., 0].to(x.dtype).t().repeat_interleave(group, dim=1)  # [N, K]
    zeros = scales_and_zeros[..., 1].to(x.dtype).t().repeat_interleave(group, dim=1)
    if exact:
        return x @ ((codes - 8) * scales + zeros).T
    return int4_activations(x).to(x.dtype) @ (codes * scales).T + x @ (zeros - 8 * scales).T


def takes_attention(q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> bool:
    """Whether decode_attention computes this step's decode attention: float32 queries and cache, no fp8 scales,
    each head's values contiguous."""
    return (
        q.dtype == torch.float32
        and k_cache.dtype == torch.float32
        and k_scale is None
        and q.shape[-1] <= 512
        and k_cache.stride(-1) == 1
    )


def decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """out [B, H, D] float32: kernels.gathered_attention.gathered_decode_attention's result (its docstring) for a
    float32 cache (takes_attention), computed per (sequence, head) with a one-pass softmax."""
    b, h, d = q.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.shape == v_cache.shape, (k_cache.stride(), v_cache.stride())
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty(b, h, d)
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    lib.decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *k_cache.stride()[:3],
                         tables.data_ptr(), lens.data_ptr(), b, h, kv_heads, d, block_size, tables.shape[1], scale,
                         window, softcap, out.data_ptr())  # fmt: skip
    return out


def takes_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether add_rms_norm_ computes this norm: float32 rows, contiguous, a float32 weight."""
    return (
        x.dtype == residual.dtype == weight.dtype == torch.float32
        and x.is_contiguous()
        and residual.is_contiguous()
        and weight.is_contiguous()
        and x.shape == residual.shape
    )


def add_rms_norm_(
    lib: ctypes.CDLL, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, add: bool
) -> None:
    """In place on float32 rows [T, hidden] (takes_norm): residual += x where ``add``, then x = weight *
    (residual * rsqrt(mean(residual^2) + eps)) (without ``add``: x = rms_norm(residual), residual unchanged)."""
    t, hidden = x.shape
    lib.add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), t, hidden, eps, int(add))


def takes_rotary(
    qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None
) -> bool:
    """Whether rotary_write_kv_ computes this step's rotary and KV write: float32 throughout, no fp8 scales, each
    token's heads side by side, the tables' rows contiguous."""
    d = qk.shape[-1]
    return (
        qk.dtype == v.dtype == cos.dtype == k_cache.dtype == torch.float32
        and k_scale is None
        and d <= 512
        and qk.stride()[1:] == (d, 1)
        and v.stride()[1:] == (d, 1)
        and k_cache.stride(-1) == 1
        and cos.is_contiguous()
    )


def rotary_write_kv_(
    lib: ctypes.CDLL,
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    rotary_dim: int,
) -> None:
    """In place, as kernels.reference.rotary_write_kv (takes_rotary): qk [T, H + KVH, D] rotated with cos,
    sin_signed [T, 1, D], its last KVH heads and v [T, KVH, D] written to their slots (negative: none)."""
    t, heads, d = qk.shape
    assert k_cache.stride() == v_cache.stride() and sin_signed.is_contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    width = rotary_dim if 0 < rotary_dim < d else d
    lib.rotary_write_kv(qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0), cos.data_ptr(), sin_signed.data_ptr(),
                        k_cache.data_ptr(), v_cache.data_ptr(), *k_cache.stride()[:3], slots.data_ptr(), t, heads,
                        k_cache.shape[2], d, width, k_cache.shape[1])  # fmt: skip


class DecodeLayer(ctypes.Structure):
    """decode_layer's view of one decoder layer (cpu_decode.c): shapes, and pointers into the layer's norm weights
    and int4 linears (q|k|v, o, gate|up in torch's CPU int4 layout at row block 64, one group size), which its
    builder keeps alive."""

    _fields_ = [
        *((name, _I) for name in ("hidden", "heads", "kv_heads", "head_dim", "rotary_dim", "intermediate", "group")),
        *((name, _F) for name in ("eps", "scale", "softcap")),
        ("window", _I),
        *((name, _P) for name in ("attn_norm", "mlp_norm", "qkv", "o", "gate_up", "qkv_sz", "o_sz", "gate_up_sz")),
    ]


class DecodeStep(ctypes.Structure):
    """decode_layer's view of one decode step, shared by its layers: M rows (one token of each sequence), the caches'
    block size and strides, pointers to the rotary rows, slots, block tables and lengths, and work buffers."""

    _fields_ = [
        *((name, _I) for name in ("M", "block_size", "max_blocks")),
        *((name, _L) for name in ("block_stride", "slot_stride", "head_stride")),
        *((name, _P) for name in ("cos", "sin_signed", "slots", "block_tables", "seq_lens", "qkv", "attn", "scratch")),
    ]


def int4_scratch_bytes(m: int, k: int, group: int) -> int:
    """The scratch int4_gemv fills for m rows of k columns (their int8 parts, block scales and group sums)."""
    return m * (2 * k + 4 * (k // 32 + k // group))


def decode_layer_(
    lib: ctypes.CDLL,
    layer: DecodeLayer,
    step: DecodeStep,
    x: torch.Tensor,
    residual: torch.Tensor,
    add: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    gate_up: torch.Tensor,
) -> None:
    """In place, on float32 rows x, residual [M, hidden] (contiguous): add_rms_norm_ (residual += x where ``add``,
    else residual is the layer's input), q|k|v, rotary and the KV write into k_cache, v_cache (``step``'s strides),
    decode attention, o, add_rms_norm_ into x and residual, and gate|up into gate_up [M, 2 * intermediate]: what
    int4_gemv, rotary_write_kv_, decode_attention and add_rms_norm_ compute one by one, bit for bit."""
    lib.decode_layer(ctypes.byref(layer), ctypes.byref(step), x.data_ptr(), residual.data_ptr(), int(add),
                     k_cache.data_ptr(), v_cache.data_ptr(), gate_up.data_ptr())  # fmt: skip


def decode_qkv_(lib: ctypes.CDLL, layer: DecodeLayer, step: DecodeStep, x: torch.Tensor, residual: torch.Tensor,
                add: bool) -> None:  # fmt: skip
    """decode_layer_'s first part: the input norm into x (and residual, where ``add``), q|k|v into the step's qkv."""
    lib.decode_qkv(ctypes.byref(layer), ctypes.byref(step), x.data_ptr(), residual.data_ptr(), int(add))


def decode_attention_o_(lib: ctypes.CDLL, layer: DecodeLayer, step: DecodeStep, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, o: torch.Tensor) -> None:  # fmt: skip
    """Its second: rotary and the KV write, decode attention into the step's attn, its o projection into o."""
    lib.decode_attention_o(ctypes.byref(layer), ctypes.byref(step), k_cache.data_ptr(), v_cache.data_ptr(),
                           o.data_ptr())  # fmt: skip


def decode_gate_up_(lib: ctypes.CDLL, layer: DecodeLayer, step: DecodeStep, x: torch.Tensor, residual: torch.Tensor,
                    gate_up: torch.Tensor) -> None:  # fmt: skip
    """Its third: residual += x, x = the MLP norm of it, gate|up into gate_up."""
    lib.decode_gate_up(ctypes.byref(layer), ctypes.byref(step), x.data_ptr(), residual.data_ptr(), gate_up.data_ptr())
