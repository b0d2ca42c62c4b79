"""Paged attention (kernels/paged_attention.py) and the KV-cache write (kernels/write_kv.py), checked against their
torch twins (kernels/reference.py), and each twin against a plain float64 loop written here from the contract (the
independent reference); then the dispatcher's attention ops (kernels/ops.py).

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

from kernels import ops
from kernels import reference as ref
from kernels.paged_attention import paged_attention
from kernels.write_kv import write_kv_cache
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
    k_cache, v_cache = batch.k_cache.double().cpu(), batch.v_cache.double().cpu()
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
        **blocks,
    )


def run_twin(batch: Batch) -> torch.Tensor:
    return ref.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dispatch_write_then_attend(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch):
    """ops.write_kv_cache and ops.paged_attention are the kernel wrappers where use_kernels says so and the twins
    elsewhere, bit for bit (a decode, a chunk over a cached prefix and a whole prefill in one batch); the default
    follows the device (the twins on the CPU tier)."""
    contexts, counts = [9, 12, 7], [1, 4, 7]
    batch = make_batch(dtype, 4, 32, 4, 2, contexts, counts, seed=12)
    k_new, v_new, slot_mapping = this_steps_kv(batch, contexts, counts, seed=13)
    bits = torch.int32 if dtype == torch.float32 else torch.int16  # the caches hold NaN: compare raw bits

    def step(write, attend) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        write(k_new, v_new, k_cache, v_cache, slot_mapping)
        out = attend(
            batch.q,
            k_cache,
            v_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            batch.scale,
            batch.max_query_len,
        )
        return torch.stack([k_cache, v_cache]).view(bits), out

    def twin_attend(*args) -> torch.Tensor:
        return ref.paged_attention(*args[:-1])

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
    mixing decodes with prefill chunks over cached prefixes."""
    rng = random.Random(7)
    contexts = [rng.randint(900, 1100) for _ in range(8)]
    counts = [1] * 8 if queries == "decode" else [1, 1, 256, 1, 64, contexts[5], 1, 17]
    batch = make_batch(dtype, 16, 128, 32, 8, contexts, counts, seed=11)
    torch.testing.assert_close(run_kernel(batch), run_twin(batch), **TOL_VS_TWIN[dtype])
