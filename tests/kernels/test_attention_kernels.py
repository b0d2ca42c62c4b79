"""Paged attention (kernels/paged_attention.py) and the KV-cache write (kernels/write_kv.py), checked against their
torch twins (kernels/reference.py), and each twin against a plain float64 loop written here from the contract (the
independent reference); then the dispatcher's attention ops (kernels/ops.py). The fp8 KV format (float8 e4m3, a
scale per KV head) runs through the same checks: the Triton interpreter handles float8 tensors on the CPU, so the
fp8 kernels are tested here under TRITON_INTERPRET=1 as well as on the GPU.

The attention sweep covers dtype, block size, head dim, grouped-query ratio, how many queries each sequence brings
(decode: 1; prefill: the whole context; chunk: any count up to the context) and the kernel's block sizes: every
value of every axis once against a base case, plus seeded random combinations. Each batch holds sequences with
contexts 1, 5, 17 and 40 whose blocks sit in shuffled order in a cache whose unused slots (free blocks, the tails of
last blocks, the block tables' padding) hold NaN, so reading any of them shows up as a NaN in the result. Without a
CUDA GPU the kernels run in the Triton interpreter on the CPU; with one, the same tests run compiled on it.

Tolerances (kernel vs twin; twin vs float64 loop), both rounding to the output dtype once:
- float32: 1e-5 abs + rel for both.
- float16: 2e-3 vs the twin (the kernel also rounds the probabilities to float16 before they meet V on the GPU),
  1e-3 vs the loop.
- bfloat16: 1.6e-2 (2 ulps) vs the twin: the interpreter rounds float32 -> bfloat16 toward zero where the GPU and
  torch round to nearest even; 8e-3 vs the loop.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from lora_server.kernels import ops
from lora_server.kernels import reference as ref
from lora_server.kernels.paged_attention import paged_attention
from lora_server.kernels.write_kv import write_kv_cache
from tests.kernel_env import DEVICE, TOL_VS_TWIN, force_path
from tests.kernel_env import TOL_VS_EXACT as TOL_VS_LOOP

CONTEXTS = (1, 5, 17, 40)


# ---- cases -------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: torch.dtype = torch.float16
    block_size: int = 16
    head_dim: int = 32
    group: int = 2  # query heads per KV head
    num_kv_heads: int = 2
    queries: str = "chunk"  # decode: 1 per sequence; prefill: the whole context; chunk: random in 1..context
    small_blocks: bool = False  # block_m = block_n = 16: several key steps and query tiles even here
    strided_q: bool = False  # q a slice of a fused QKV output (non-contiguous rows)
    seed: int = 0

    def __str__(self) -> str:
        return (
            f"{str(self.dtype).removeprefix('torch.')}-bs{self.block_size}-d{self.head_dim}-g{self.group}"
            f"-kvh{self.num_kv_heads}-{self.queries}{'-small' if self.small_blocks else ''}"
            f"{'-strided' if self.strided_q else ''}-s{self.seed}"
        )


AXES = {
    "dtype": (torch.float32, torch.float16, torch.bfloat16),
    "block_size": (4, 16),
    "head_dim": (16, 32, 64),
    "group": (1, 2, 4),
    "queries": ("decode", "prefill", "chunk"),
    "small_blocks": (False, True),
    "strided_q": (False, True),
}


def sweep_cases(num_random: int = 8) -> list[Case]:
    """The base case, each other value of each axis on it, then seeded random combinations."""
    base = Case()
    cases = [base]
    for axis, values in AXES.items():
        cases += [dataclasses.replace(base, **{axis: v}) for v in values if v != getattr(base, axis)]
    rng = random.Random(4321)
    for i in range(num_random):
        pick = {axis: rng.choice(values) for axis, values in AXES.items()}
        cases.append(Case(**pick, num_kv_heads=rng.choice((1, 2)), seed=100 + i))
    return cases


@dataclasses.dataclass
class Batch:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D], NaN in every slot no sequence owns
    v_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with a free (NaN) block
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_query_len: int
    scale: float
    k_scale: torch.Tensor | None = None  # [KVH] float32 when the caches are fp8: value = stored.float() * scale
    v_scale: torch.Tensor | None = None


def make_batch(
    dtype: torch.dtype,
    block_size: int,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    contexts: list[int],
    query_counts: list[int],
    *,
    seed: int = 0,
    strided_q: bool = False,
    device: str = DEVICE,
) -> Batch:
    """Sequences with the given contexts (KV lengths) and query counts; their blocks are drawn in shuffled order
    from a cache with a few free blocks; unowned slots hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    needed = [(c + block_size - 1) // block_size for c in contexts]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    free_block = order[-1]
    block_tables = torch.full((len(contexts), max(needed) + 1), free_block, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    used = 0
    for b, (context, count) in enumerate(zip(contexts, needed, strict=True)):
        blocks = order[used : used + count]
        used += count
        block_tables[b, :count] = torch.tensor(blocks, dtype=torch.int32)
        for j in range(context):
            k_cache[blocks[j // block_size], j % block_size] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[blocks[j // block_size], j % block_size] = torch.randn(num_kv_heads, head_dim, generator=gen)
    num_tokens = sum(query_counts)
    if strided_q:  # the q columns of a fused [T, (H + 2 KVH) * D] projection output
        qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
        q = qkv[:, : num_heads * head_dim].unflatten(1, (num_heads, head_dim))
    else:
        q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(query_counts).cumsum(0).tolist()], dtype=torch.int32)
    return Batch(
        q.to(device, dtype),
        k_cache.to(device, dtype),
        v_cache.to(device, dtype),
        block_tables.to(device),
        torch.tensor(contexts, dtype=torch.int32, device=device),
        starts.to(device),
        max(query_counts, default=0),
        head_dim**-0.5,
    )


def query_counts_of(case: Case, contexts: tuple[int, ...]) -> list[int]:
    if case.queries == "decode":
        return [1] * len(contexts)
    if case.queries == "prefill":
        return list(contexts)
    rng = random.Random(case.seed)
    return [rng.randint(1, c) for c in contexts]


# ---- the independent reference -------------------------------------------------------------------------------------


def loop_attention(batch: Batch) -> torch.Tensor:
    """Per query, in float64, from the contract: query i of n of sequence b sits at position L - n + i and
    attends to the keys at positions 0 ..= that, key j read from slot j % block_size of block
    block_tables[b, j // block_size]; query head h reads KV head h // (H // KVH). Returns [T, H, D] float64."""
    q = batch.q.double().cpu()
    k_cache, v_cache = batch.k_cache.float().double().cpu(), batch.v_cache.float().double().cpu()
    if batch.k_scale is not None:  # an fp8 cache: each KV head's values times its scale
        k_cache = k_cache * batch.k_scale.double().cpu()[:, None]
        v_cache = v_cache * batch.v_scale.double().cpu()[:, None]
    block_size = k_cache.shape[1]
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    kv_head_of = torch.arange(num_heads) // (num_heads // num_kv_heads)
    out = torch.zeros_like(q)
    starts = batch.query_start_loc.tolist()
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        table = batch.block_tables[b].tolist()
        keys = torch.stack([k_cache[table[j // block_size], j % block_size] for j in range(seq_len)])  # [L, KVH, D]
        values = torch.stack([v_cache[table[j // block_size], j % block_size] for j in range(seq_len)])
        n = starts[b + 1] - starts[b]
        for i in range(n):
            t, visible = starts[b] + i, seq_len - n + i + 1
            k = keys[:visible, kv_head_of]  # [visible, H, D]
            v = values[:visible, kv_head_of]
            scores = torch.einsum("hd,jhd->hj", q[t], k) * batch.scale
            out[t] = torch.einsum("hj,jhd->hd", torch.softmax(scores, dim=-1), v)
    return out


def loop_write_kv(k, v, k_cache, v_cache, slot_mapping):
    """Per token: the cache row at block slot // block_size, offset slot % block_size becomes k[t] (v alike)."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        k_cache[slot // block_size, slot % block_size] = k[t].to(k_cache.dtype)
        v_cache[slot // block_size, slot % block_size] = v[t].to(v_cache.dtype)


def run_kernel(batch: Batch, **blocks) -> torch.Tensor:
    return paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.scale,
        batch.max_query_len,
        batch.k_scale,
        batch.v_scale,
        **blocks,
    )


def run_twin(batch: Batch) -> torch.Tensor:
    return ref.paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.scale,
        batch.k_scale,
        batch.v_scale,
    )


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8 e4m3 value


def fp8_scales(num_kv_heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k_scale, v_scale [KVH] float32 on DEVICE, a different scale in [0.0101, 0.0201) per head: unit normals
    spread from the subnormals (|x| < 2^-6 x scale) up to the clamp at 448 (|x| > ~4.5 at the smallest scale)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple((torch.rand(2, num_kv_heads, generator=gen) * 0.01 + 0.0101).to(DEVICE).unbind(0))  # type: ignore


def to_fp8(batch: Batch, seed: int) -> Batch:
    """The batch with its caches stored as fp8 with per-head scales (NaN slots stay NaN)."""
    k_scale, v_scale = fp8_scales(batch.k_cache.shape[2], seed)

    def store(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (cache.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)

    return dataclasses.replace(
        batch,
        k_cache=store(batch.k_cache, k_scale),
        v_cache=store(batch.v_cache, v_scale),
        k_scale=k_scale,
        v_scale=v_scale,
    )


# ---- the sweep ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sweep_cases(), ids=str)
def test_paged_attention_matches_twin_matches_loop(case: Case):
    batch = make_batch(
        case.dtype,
        case.block_size,
        case.head_dim,
        case.group * case.num_kv_heads,
        case.num_kv_heads,
        list(CONTEXTS),
        query_counts_of(case, CONTEXTS),
        seed=case.seed,
        strided_q=case.strided_q,
    )
    blocks = {"block_m": 16, "block_n": 16} if case.small_blocks else {}
    out_loop = loop_attention(batch)
    out_twin = run_twin(batch)
    torch.testing.assert_close(out_twin.double().cpu(), out_loop, **TOL_VS_LOOP[case.dtype])
    out_kernel = run_kernel(batch, **blocks)
    assert out_kernel.dtype == case.dtype and out_kernel.shape == batch.q.shape
    torch.testing.assert_close(out_kernel, out_twin, **TOL_VS_TWIN[case.dtype])


FP8_CASES = [Case(dtype=d, queries=q) for d in AXES["dtype"] for q in ("decode", "chunk")] + [
    Case(dtype=torch.float32, block_size=4, group=4, queries="prefill", small_blocks=True, strided_q=True, seed=7),
    Case(dtype=torch.bfloat16, head_dim=64, group=1, num_kv_heads=1, queries="prefill", seed=8),
]


@pytest.mark.parametrize("case", FP8_CASES, ids=str)
def test_fp8_paged_attention_matches_twin_matches_loop(case: Case):
    """An fp8 cache (a scale per KV head) read by the kernel and the twin, against the float64 loop over the
    dequantized values: the same tolerances as a cache in q's dtype, since fp8 -> q's dtype is exact and both
    compute in fp32."""
    batch = make_batch(
        torch.float32,
        case.block_size,
        case.head_dim,
        case.group * case.num_kv_heads,
        case.num_kv_heads,
        list(CONTEXTS),
        query_counts_of(case, CONTEXTS),
        seed=case.seed,
        strided_q=case.strided_q,
    )
    batch = to_fp8(dataclasses.replace(batch, q=batch.q.to(case.dtype)), seed=case.seed)
    assert batch.k_cache.dtype == FP8 and torch.isnan(batch.k_cache.float()).any()  # unowned slots still NaN
    blocks = {"block_m": 16, "block_n": 16} if case.small_blocks else {}
    out_twin = run_twin(batch)
    torch.testing.assert_close(out_twin.double().cpu(), loop_attention(batch), **TOL_VS_LOOP[case.dtype])
    out_kernel = run_kernel(batch, **blocks)
    assert out_kernel.dtype == case.dtype and out_kernel.shape == batch.q.shape
    torch.testing.assert_close(out_kernel, out_twin, **TOL_VS_TWIN[case.dtype])


def test_fp8_scales_matter():
    """The scales are applied, each to its own head and tensor: doubling a head's key scale changes that head's
    rows only, and the loop with the doubled scale is what both the twin and the kernel give."""
    batch = to_fp8(make_batch(torch.float32, 4, 16, 4, 2, [9, 17], [3, 17], seed=21), seed=22)
    base = run_twin(batch)
    k_scale = batch.k_scale.clone()
    k_scale[1] *= 2
    doubled = dataclasses.replace(batch, k_scale=k_scale)
    out_twin = run_twin(doubled)
    torch.testing.assert_close(out_twin.double().cpu(), loop_attention(doubled), **TOL_VS_LOOP[torch.float32])
    torch.testing.assert_close(run_kernel(doubled), out_twin, **TOL_VS_TWIN[torch.float32])
    assert torch.equal(out_twin[:, :2], base[:, :2])  # query heads 0-1 read KV head 0
    assert not torch.allclose(out_twin[:, 2:], base[:, 2:], atol=1e-3)


def test_sweep_covers_every_axis_value():
    cases = sweep_cases()
    for axis, values in AXES.items():
        assert {getattr(c, axis) for c in cases} >= set(values), axis


# ---- focused checks ----------------------------------------------------------------------------------------------


def test_every_query_count_of_each_context():
    """One batch with a sequence for each (context, n) pair, n = 1 ..= context, contexts 1, 5 and 17: every
    chunk shape, from decode to a full prefill, in one launch."""
    pairs = [(c, n) for c in (1, 5, 17) for n in range(1, c + 1)]
    batch = make_batch(torch.float32, 4, 16, 4, 2, [c for c, _ in pairs], [n for _, n in pairs], seed=3)
    out_twin = run_twin(batch)
    torch.testing.assert_close(out_twin.double().cpu(), loop_attention(batch), **TOL_VS_LOOP[torch.float32])
    torch.testing.assert_close(run_kernel(batch, block_n=16), out_twin, **TOL_VS_TWIN[torch.float32])


def test_sequence_without_queries_and_larger_max_query_len():
    """A sequence that brings no queries this step is skipped, and a max_query_len above the batch's real maximum
    (a grid with spare programs) gives the same bits."""
    batch = make_batch(torch.float16, 16, 32, 4, 2, [17, 9, 40], [3, 0, 5], seed=5)
    out_twin = run_twin(batch)
    out = run_kernel(batch)
    torch.testing.assert_close(out, out_twin, **TOL_VS_TWIN[torch.float16])
    spare = paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.scale,
        batch.max_query_len + 7,
    )
    assert torch.equal(spare, out)


def test_odd_shapes():
    """A group of 3 heads, head_dim 80 (padded to a 128-wide tile) and a block size of 5: nothing needs powers of
    two but the kernel's own tiles."""
    batch = make_batch(torch.float32, 5, 80, 6, 2, [1, 11, 23], [1, 4, 23], seed=6)
    out_twin = run_twin(batch)
    torch.testing.assert_close(out_twin.double().cpu(), loop_attention(batch), **TOL_VS_LOOP[torch.float32])
    torch.testing.assert_close(run_kernel(batch, block_n=16), out_twin, **TOL_VS_TWIN[torch.float32])


def test_int64_lengths_and_starts():
    batch = make_batch(torch.float32, 4, 16, 2, 1, [5, 17], [2, 17], seed=9)
    out32 = run_kernel(batch)
    out64 = paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens.long(),
        batch.query_start_loc.long(),
        batch.scale,
        batch.max_query_len,
    )
    assert torch.equal(out32, out64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_write_kv_cache_matches_twin_and_loop(dtype: torch.dtype):
    """Keys and values as slices of a fused QKV output (strided), scattered to shuffled slots; every other slot
    keeps its bits; a negative slot (padding) writes nothing."""
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim, tokens = 6, 4, 2, 16, 9
    qkv = torch.randn(tokens, 4 * num_kv_heads * head_dim, generator=gen).to(DEVICE, dtype)
    k = qkv[:, 2 * num_kv_heads * head_dim : 3 * num_kv_heads * head_dim].unflatten(1, (num_kv_heads, head_dim))
    v = qkv[:, 3 * num_kv_heads * head_dim :].unflatten(1, (num_kv_heads, head_dim))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(DEVICE)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)

    twin, kernel, loop = cache.clone(), cache.clone(), cache.clone()
    ref.write_kv_cache(k, v, twin[0], twin[1], slots)
    write_kv_cache(k, v, kernel[0], kernel[1], slots.int())
    loop_write_kv(k, v, loop[0], loop[1], slots)
    assert torch.equal(twin, loop)
    assert torch.equal(kernel, twin)

    padded = cache.clone()
    write_kv_cache(k, v, padded[0], padded[1], torch.where(torch.arange(tokens, device=DEVICE) % 2 == 0, slots, -1))
    expected = cache.clone()
    loop_write_kv(k[::2], v[::2], expected[0], expected[1], slots[::2])
    assert torch.equal(padded, expected)


def check_fp8_storage(stored: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> None:
    """From the e4m3 format itself: stored [T, KVH, D] fp8 is x / scale [KVH] rounded to the nearest e4m3 value (3
    mantissa bits: within 2^-4 relative above 2^-6, within 2^-10 absolute below) or, past 448, exactly +-448."""
    target = x.double().cpu() / scale.double().cpu()[:, None]
    got = stored.float().double().cpu()
    clamped = target.abs() > FP8_MAX
    assert torch.equal(got[clamped], target[clamped].sign() * FP8_MAX)
    err = (got - target).abs()[~clamped]
    bound = torch.maximum(target.abs()[~clamped] * 2**-4, torch.full_like(err, 2**-10))
    assert (err <= bound).all(), (err - bound).max()


def test_fp8_quantize_hand_values():
    """x / scale rounded to e4m3 by hand: 1.0 / 0.5 = 2 exactly; 0.3 / 0.5 = 0.6 lies between 0.5625 and 0.625
    (steps of 2^-4 in [0.5, 1)) and rounds to 0.625; 600 clamps to 448; 0.001 / 0.5 = 0.002 is subnormal (steps
    of 2^-9 = 0.001953125) and rounds to one step; 0 stays 0. Read back, each is times 0.5."""
    x = torch.tensor([1.0, 0.3, 300.0, -300.0, 0.001, 0.0]).reshape(6, 1, 1)
    stored = ref.quantize_kv(x, FP8, torch.tensor([0.5]))
    expected = [2.0, 0.625, 448.0, -448.0, 2**-9, 0.0]
    assert stored.dtype == FP8 and stored.flatten().float().tolist() == expected
    assert ref.dequantize_kv(stored, torch.tensor([0.5])).flatten().tolist() == [e * 0.5 for e in expected]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_fp8_write_kv_cache_matches_twin_and_format(dtype: torch.dtype):
    """Strided keys and values of any magnitude (some clamp, some subnormal) quantized into an fp8 cache with a
    scale per head: the kernel writes the twin's bytes, the twin's values are the e4m3 rounding of x / scale, and
    every other slot keeps its bytes; a negative slot writes nothing."""
    gen = torch.Generator().manual_seed(2)
    num_blocks, block_size, num_kv_heads, head_dim, tokens = 6, 4, 2, 16, 9
    qkv = (torch.randn(tokens, 4 * num_kv_heads * head_dim, generator=gen) * 3).to(DEVICE, dtype)
    k = qkv[:, 2 * num_kv_heads * head_dim : 3 * num_kv_heads * head_dim].unflatten(1, (num_kv_heads, head_dim))
    v = qkv[:, 3 * num_kv_heads * head_dim :].unflatten(1, (num_kv_heads, head_dim))
    k_scale, v_scale = fp8_scales(num_kv_heads, seed=3)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(DEVICE)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, FP8)

    twin, kernel = cache.clone(), cache.clone()
    ref.write_kv_cache(k, v, twin[0], twin[1], slots, k_scale, v_scale)
    write_kv_cache(k, v, kernel[0], kernel[1], slots.int(), k_scale, v_scale)
    assert torch.equal(kernel.view(torch.uint8), twin.view(torch.uint8))
    rows = twin.flatten(1, 2)  # [2, slots, KVH, D]
    check_fp8_storage(rows[0, slots], k, k_scale)
    check_fp8_storage(rows[1, slots], v, v_scale)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(rows[:, untouched].view(torch.uint8), cache.flatten(1, 2)[:, untouched].view(torch.uint8))

    padded = cache.clone()
    keep = torch.arange(tokens, device=DEVICE) % 2 == 0
    write_kv_cache(k, v, padded[0], padded[1], torch.where(keep, slots, -1), k_scale, v_scale)
    expected = cache.clone()
    ref.write_kv_cache(k[keep], v[keep], expected[0], expected[1], slots[keep], k_scale, v_scale)
    assert torch.equal(padded.view(torch.uint8), expected.view(torch.uint8))


def this_steps_kv(batch: Batch, contexts: list[int], counts: list[int], seed: int):
    """(k, v [T, KVH, D], slot_mapping [T]): new keys and values for each sequence's last n positions (this
    step's tokens), in q's dtype."""
    gen = torch.Generator().manual_seed(seed)
    slots = []
    block_size = batch.k_cache.shape[1]
    for b, (seq_len, n) in enumerate(zip(contexts, counts, strict=True)):
        table = batch.block_tables[b].tolist()
        slots += [table[j // block_size] * block_size + j % block_size for j in range(seq_len - n, seq_len)]
    shape = (len(slots), *batch.k_cache.shape[2:])
    k_new = torch.randn(shape, generator=gen).to(DEVICE, batch.q.dtype)
    v_new = torch.randn(shape, generator=gen).to(DEVICE, batch.q.dtype)
    return k_new, v_new, torch.tensor(slots, device=DEVICE)


def test_write_then_attend_round_trip():
    """A prefill chunk written with write_kv_cache and attended with paged_attention gives the same result as the
    twins doing both."""
    batch = make_batch(torch.float16, 4, 32, 4, 2, [12, 7], [4, 7], seed=2)
    k_new, v_new, slot_mapping = this_steps_kv(batch, [12, 7], [4, 7], seed=4)
    twin_k, twin_v = batch.k_cache.clone(), batch.v_cache.clone()
    ref.write_kv_cache(k_new, v_new, twin_k, twin_v, slot_mapping)
    write_kv_cache(k_new, v_new, batch.k_cache, batch.v_cache, slot_mapping)
    out = run_kernel(batch)
    out_twin = ref.paged_attention(
        batch.q, twin_k, twin_v, batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale
    )
    torch.testing.assert_close(out, out_twin, **TOL_VS_TWIN[torch.float16])


# ---- the dispatcher ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-kv", "fp8-kv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dispatch_write_then_attend(dtype: torch.dtype, fp8: bool, monkeypatch: pytest.MonkeyPatch):
    """ops.write_kv_cache and ops.paged_attention are the kernel wrappers where use_kernels says so and the twins
    elsewhere, bit for bit (a decode, a chunk over a cached prefix and a whole prefill in one batch), with caches
    in the model's dtype or fp8 with scales; the default follows the device (the twins on the CPU tier)."""
    contexts, counts = [9, 12, 7], [1, 4, 7]
    batch = make_batch(dtype, 4, 32, 4, 2, contexts, counts, seed=12)
    if fp8:
        batch = to_fp8(batch, seed=14)
    k_new, v_new, slot_mapping = this_steps_kv(batch, contexts, counts, seed=13)
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, FP8: torch.uint8}[batch.k_cache.dtype]
    scales = (batch.k_scale, batch.v_scale)  # the caches hold NaN: compare raw bits

    def step(write, attend) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        write(k_new, v_new, k_cache, v_cache, slot_mapping, *scales)
        out = attend(
            batch.q,
            k_cache,
            v_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            batch.scale,
            batch.max_query_len,
            *scales,
        )
        return torch.stack([k_cache, v_cache]).view(bits), out

    def twin_attend(*args) -> torch.Tensor:
        return ref.paged_attention(*args[:7], *args[8:])  # the twin takes no max_query_len

    default = step(ops.write_kv_cache, ops.paged_attention)
    force_path(monkeypatch, "kernels")
    via_kernels = step(ops.write_kv_cache, ops.paged_attention)
    force_path(monkeypatch, "twins")
    via_twins = step(ops.write_kv_cache, ops.paged_attention)
    direct_kernels = step(write_kv_cache, paged_attention)
    direct_twins = step(ref.write_kv_cache, twin_attend)
    for got, want in (
        (via_kernels, direct_kernels),
        (via_twins, direct_twins),
        (default, via_kernels if ops.use_kernels(DEVICE) else via_twins),
    ):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(via_kernels[0], via_twins[0])
    torch.testing.assert_close(via_kernels[1], via_twins[1], **TOL_VS_TWIN[dtype])


# ---- real shapes, on the GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("queries", ["decode", "mixed"])
def test_paged_attention_real_shapes(dtype: torch.dtype, queries: str):
    """Llama-3-8B heads (32 query, 8 KV, head_dim 128), block size 16, ~1k contexts: a decode step, and a batch
    mixing decodes with prefill chunks over cached prefixes; over a cache in q's dtype and over an fp8 one."""
    rng = random.Random(7)
    contexts = [rng.randint(900, 1100) for _ in range(8)]
    counts = [1] * 8 if queries == "decode" else [1, 1, 256, 1, 64, contexts[5], 1, 17]
    batch = make_batch(dtype, 16, 128, 32, 8, contexts, counts, seed=11)
    torch.testing.assert_close(run_kernel(batch), run_twin(batch), **TOL_VS_TWIN[dtype])
    fp8 = to_fp8(batch, seed=12)  # the same shapes over an fp8 cache
    torch.testing.assert_close(run_kernel(fp8), run_twin(fp8), **TOL_VS_TWIN[dtype])


# ---- the gathered decode path (kernels.gathered_attention: what ops runs for decode steps without the kernels) ----

GATHERED_CASES = [c for c in sweep_cases() if c.queries == "decode"] + [
    Case(dtype=d, queries="decode", group=g, block_size=bs) for d in AXES["dtype"] for g in (1, 4) for bs in (4, 16)
]


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-kv", "fp8-kv"])
@pytest.mark.parametrize("case", GATHERED_CASES, ids=str)
def test_gathered_decode_attention_matches_loop(case: Case, fp8: bool):
    """One query per sequence over caches whose unowned slots and padded table entries hold NaN: the gathered
    path against the float64 loop (NaN anywhere in the result would fail), and ops.paged_attention takes it on
    the CPU."""
    from lora_server.kernels.gathered_attention import gathered_decode_attention

    batch = make_batch(
        case.dtype,
        case.block_size,
        case.head_dim,
        case.group * case.num_kv_heads,
        case.num_kv_heads,
        list(CONTEXTS),
        [1] * len(CONTEXTS),
        seed=case.seed,
        strided_q=case.strided_q,
    )
    if fp8:
        batch = to_fp8(batch, seed=case.seed + 1)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.scale)
    out = gathered_decode_attention(*args, batch.k_scale, batch.v_scale)
    assert out.dtype == case.dtype and out.shape == batch.q.shape
    torch.testing.assert_close(out.double().cpu(), loop_attention(batch), **TOL_VS_LOOP[case.dtype])
    if not ops.use_kernels(DEVICE):
        via_ops = ops.paged_attention(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            batch.scale,
            1,
            batch.k_scale,
            batch.v_scale,
        )
        assert torch.equal(via_ops, out)
