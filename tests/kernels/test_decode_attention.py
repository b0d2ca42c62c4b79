"""Split-KV decode attention (kernels/decode_attention.py: partial outputs per chunk of keys, then a reduce), checked
against its torch twin (kernels.reference.paged_decode_attention) and the twin against a float64 loop written here
from the contract; then the dispatcher's decode path (kernels/ops.py).

The sweep covers dtype, block size, head dim, grouped-query ratio, split count (1: one launch, no reduce; 2, 3, 8:
uneven chunks and chunks past a short sequence's end) and fp8 KV caches with a scale per head, every value of
every axis once against a base case plus seeded random combinations. Each batch holds sequences of lengths 0 (a
padding row), 1, 5, 17, 40 and 70 whose blocks sit in shuffled order in a cache whose unowned slots (free blocks,
the tails of last blocks, the block tables' padding, the padding row's table) hold NaN, so a read of any of them
shows up as NaN. Keys go 16 per loop step (block_n=16), so a 70-key sequence spans several steps and splits.
Tolerances as tests/kernels/test_attention_kernels.py."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from lora_server.kernels import ops
from lora_server.kernels import reference as ref
from lora_server.kernels.decode_attention import MAX_SPLITS, default_num_splits, paged_decode_attention
from tests.kernel_env import DEVICE, TOL_VS_EXACT, TOL_VS_TWIN, force_path
from tests.kernels.test_attention_kernels import Batch, make_batch, to_fp8

CONTEXTS = (0, 1, 5, 17, 40, 70)


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: torch.dtype = torch.float16
    block_size: int = 16
    head_dim: int = 32
    group: int = 2  # query heads per KV head
    num_kv_heads: int = 2
    num_splits: int = 3
    fp8: bool = False
    seed: int = 0

    def __str__(self) -> str:
        return (
            f"{str(self.dtype).removeprefix('torch.')}-bs{self.block_size}-d{self.head_dim}-g{self.group}"
            f"-kvh{self.num_kv_heads}-s{self.num_splits}{'-fp8' if self.fp8 else ''}-seed{self.seed}"
        )


AXES = {
    "dtype": (torch.float32, torch.float16, torch.bfloat16),
    "block_size": (4, 16),
    "head_dim": (16, 32, 80),
    "group": (1, 3, 4, 8),
    "num_splits": (1, 2, 3, 8),
    "fp8": (False, True),
}


def sweep_cases(num_random: int = 6) -> list[Case]:
    """The base case, each other value of each axis on it, then seeded random combinations."""
    base = Case()
    cases = [base]
    for axis, values in AXES.items():
        cases += [dataclasses.replace(base, **{axis: v}) for v in values if v != getattr(base, axis)]
    rng = random.Random(2024)
    for i in range(num_random):
        pick = {axis: rng.choice(values) for axis, values in AXES.items()}
        cases.append(Case(**pick, num_kv_heads=rng.choice((1, 2)), seed=200 + i))
    return cases


def decode_batch(case: Case, contexts: tuple[int, ...] = CONTEXTS) -> Batch:
    batch = make_batch(
        case.dtype,
        case.block_size,
        case.head_dim,
        case.group * case.num_kv_heads,
        case.num_kv_heads,
        list(contexts),
        [1] * len(contexts),
        seed=case.seed,
    )
    return to_fp8(batch, seed=case.seed + 1) if case.fp8 else batch


def loop_decode(batch: Batch) -> torch.Tensor:
    """Per sequence and head, in float64, from the contract: query b sits at position L - 1 and attends to keys
    0 .. L - 1, key j read from slot j % block_size of block block_tables[b, j // block_size] (fp8: times its KV
    head's scale); query head h reads KV head h // (H // KVH); L = 0 gives zeros. Returns [B, H, D] float64."""
    q = batch.q.double().cpu()
    k_cache, v_cache = batch.k_cache.float().double().cpu(), batch.v_cache.float().double().cpu()
    if batch.k_scale is not None:
        k_cache = k_cache * batch.k_scale.double().cpu()[:, None]
        v_cache = v_cache * batch.v_scale.double().cpu()[:, None]
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        table = batch.block_tables[b].tolist()
        for h in range(q.shape[1]):
            keys = [k_cache[table[j // block_size], j % block_size, h // group] for j in range(seq_len)]
            values = [v_cache[table[j // block_size], j % block_size, h // group] for j in range(seq_len)]
            if not keys:
                continue
            weights = torch.softmax(torch.stack(keys) @ q[b, h] * batch.scale, dim=0)
            out[b, h] = weights @ torch.stack(values)
    return out


def run_kernel(batch: Batch, **kwargs) -> torch.Tensor:
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.scale)
    return paged_decode_attention(*args, batch.k_scale, batch.v_scale, **kwargs)


def run_twin(batch: Batch) -> torch.Tensor:
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.scale)
    return ref.paged_decode_attention(*args, batch.k_scale, batch.v_scale)


@pytest.mark.parametrize("case", sweep_cases(), ids=str)
def test_decode_attention_matches_twin_matches_loop(case: Case):
    batch = decode_batch(case)
    out_twin = run_twin(batch)
    torch.testing.assert_close(out_twin.double().cpu(), loop_decode(batch), **TOL_VS_EXACT[case.dtype])
    out = run_kernel(batch, num_splits=case.num_splits, block_n=16)
    assert out.dtype == case.dtype and out.shape == batch.q.shape
    torch.testing.assert_close(out, out_twin, **TOL_VS_TWIN[case.dtype])
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # length 0: zeros, its table (NaN) never read


def test_sweep_covers_every_axis_value():
    cases = sweep_cases()
    for axis, values in AXES.items():
        assert {getattr(c, axis) for c in cases} >= set(values), axis


def test_padded_bucket_gives_the_same_rows():
    """A CUDA-graph bucket: the real batch padded with rows of length 0 whose block tables point at garbage
    (NaN blocks). The real rows keep their bits, the padding rows are zero, with one split and with several."""
    case = Case(dtype=torch.float32, group=4)
    batch = decode_batch(case, contexts=(17, 40, 0, 0, 0))
    real = dataclasses.replace(batch, q=batch.q[:2], block_tables=batch.block_tables[:2], seq_lens=batch.seq_lens[:2])
    for splits in (1, 4):
        padded = run_kernel(batch, num_splits=splits, block_n=16)
        assert torch.equal(padded[:2], run_kernel(real, num_splits=splits, block_n=16))
        assert torch.equal(padded[2:], torch.zeros_like(padded[2:]))


def test_split_counts_agree_and_empty_splits():
    """Any split count gives the one-split result up to fp32 rounding, 32 splits over 5 keys included (most
    chunks empty); int64 lengths and a strided q give the same bits as int32 lengths and a contiguous q."""
    batch = decode_batch(Case(dtype=torch.float32, head_dim=16, group=4, num_kv_heads=1), contexts=(5, 33, 1))
    one = run_kernel(batch, num_splits=1, block_n=16)
    for splits in (2, 5, 32):
        torch.testing.assert_close(run_kernel(batch, num_splits=splits, block_n=16), one, atol=1e-6, rtol=1e-6)
    wide = torch.randn(batch.q.shape[0], batch.q.shape[1], 2 * batch.q.shape[2], device=DEVICE)
    wide[..., : batch.q.shape[2]] = batch.q
    strided = dataclasses.replace(batch, q=wide[..., : batch.q.shape[2]], seq_lens=batch.seq_lens.long())
    assert torch.equal(run_kernel(strided, num_splits=5, block_n=16), run_kernel(batch, num_splits=5, block_n=16))


def test_default_num_splits():
    """About two programs per multiprocessor, at most MAX_SPLITS, at least MIN_KEYS_PER_SPLIT keys each: batch 1 at
    a long context splits, a large batch or a short table does not."""
    cpu = torch.device("cpu")  # no device properties: the H100 guess (132 multiprocessors)
    assert default_num_splits(1, 8, 8192, cpu) == MAX_SPLITS
    assert default_num_splits(1, 8, 1024, cpu) == 8
    assert default_num_splits(4, 8, 8192, cpu) == 9
    assert default_num_splits(64, 8, 8192, cpu) == 1
    assert default_num_splits(1, 8, 100, cpu) == 1


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-kv", "fp8-kv"])
def test_dispatch_decode_path(fp8: bool, monkeypatch: pytest.MonkeyPatch):
    """ops.paged_attention sends a decode step (one query per sequence) to the split-KV kernel with the kernels
    (num_splits passed through) and to the gathered path without; the two agree, zeros for a length-0 row
    included."""
    batch = decode_batch(Case(dtype=torch.float32, fp8=fp8), contexts=(1, 5, 0, 17, 40))
    starts = torch.arange(batch.q.shape[0] + 1, dtype=torch.int32, device=DEVICE)

    def via_ops(**kwargs) -> torch.Tensor:
        return ops.paged_attention(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.seq_lens,
            starts,
            batch.scale,
            1,
            batch.k_scale,
            batch.v_scale,
            **kwargs,
        )

    force_path(monkeypatch, "kernels")
    for splits in (1, 3):
        assert torch.equal(via_ops(num_splits=splits), run_kernel(batch, num_splits=splits))
    kernel = via_ops()
    force_path(monkeypatch, "twins")
    gathered = via_ops()
    torch.testing.assert_close(gathered, kernel, **TOL_VS_TWIN[torch.float32])
    assert torch.equal(gathered[2], torch.zeros_like(gathered[2]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", ["batch1-long", "batch64"])
def test_decode_attention_real_shapes(dtype: torch.dtype, shape: str):
    """Llama-3-8B heads (32 query, 8 KV, head_dim 128), block size 16: batch 1 at 8k tokens and batch 64 at ~1k
    (a few padding rows), default split count, over a cache in q's dtype and an fp8 one."""
    rng = random.Random(5)
    contexts = [8000] if shape == "batch1-long" else [rng.randint(900, 1100) for _ in range(60)] + [0] * 4
    batch = make_batch(dtype, 16, 128, 32, 8, contexts, [1] * len(contexts), seed=3)
    torch.testing.assert_close(run_kernel(batch), run_twin(batch), **TOL_VS_TWIN[dtype])
    fp8 = to_fp8(batch, seed=4)
    torch.testing.assert_close(run_kernel(fp8), run_twin(fp8), **TOL_VS_TWIN[dtype])


def test_strided_fp8_scales_are_refused():
    """The kernels read an fp8 cache's per-head scales with stride 1: a strided view (every other value of a longer
    tensor) would be read as other heads' scales, so it is refused, naming the argument."""
    batch = to_fp8(make_batch(torch.float32, 4, 16, 4, 2, [5], [1]), seed=0)
    strided = torch.stack([batch.k_scale, batch.k_scale], dim=1).reshape(-1)[::2]
    assert torch.equal(strided, batch.k_scale) and not strided.is_contiguous()
    with pytest.raises(AssertionError, match="k_scale"):
        run_kernel(dataclasses.replace(batch, k_scale=strided))
