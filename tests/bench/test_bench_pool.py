"""``lora-server bench-pool`` end to end on the tiny dummy model, against figures worked out by hand: the trace's
shape, Poisson arrivals and Zipf shares; every policy's tokens equal; on a budget where nothing is evicted the hit
rates and bytes moved follow from the trace alone; on a tight budget the bytes moved add up to the adapter loads
and KV swaps, and no cache serves more than the trace makes possible. No timing is asserted: speed is what the
benchmark prints."""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter

import pytest

from lora_server.bench.pool import TraceSpec, make_trace
from lora_server.cli import main

# tiny-llama (lora_server/model/arch.py): hidden 64, 4 heads of 16, 2 KV heads, 2 layers, vocab 512; fp32 on the CPU
BLOCK_BYTES = 2 * 2 * 2 * 16 * 16 * 4  # (K, V) x layers x KV heads x head dim x 16 tokens x 4 bytes = 8192
RANK = 8
# An adapter takes arena pages (a page is a block: 2048 floats) packed per adapters.page_layout: its table first
# (2 layers x 7 modules x 5 int64 = 560 bytes: 160 floats aligned), then per layer and fused group A's slices back
# to back, then each slice's B^T, a unit on the next page when the rest of this one is too small. A rank-8 adapter
# on q, k, v, o: per layer qkv A 3 x 8 x 64 = 1536 floats, B^T q 512, k 256, v 256, o A 512, o B^T 512.
# Page 0: table + layer 0's qkv A (1696); page 1: its B^T q, k, v, o A, o B^T (2048); page 2: layer 1's qkv A,
# q B^T (2048); page 3: the rest (1536). 4 pages:
ADAPTER_BLOCKS = 4
ADAPTER_BYTES = ADAPTER_BLOCKS * BLOCK_BYTES  # what a load copies (and the bytes the pool counts)
# lru-separate's fixed slot holds an adapter of every module at the largest rank: per layer also gate|up A
# 2 x 8 x 64 = 1024, gate and up B^T 8 x 128 = 1024 each, down A 8 x 128 = 1024, down B^T 512. Layer 0: pages 0
# (table, qkv A), 1 (B^T q k v, o), 2 (gate|up A, gate B^T), 3 (up B^T, down A), 4 (down B^T 512, then layer 1's
# qkv A 1536); layer 1 then: 5 (B^T q k v, o), 6 (gate|up A, gate B^T), 7 (up B^T, down A), 8 (down B^T). 9 pages:
SLOT_BLOCKS = 9

# The trace of the end-to-end runs: 6 sessions of 2 turns over 6 adapters; a system prompt shorter than a block, so
# no two sessions share a full block, and turn 2 repeats turn 1's prompt and answer.
SYSTEM, USER, OUTPUT, SESSIONS, TURNS = 8, 16, 12, 6, 2
SPEC = TraceSpec(
    num_adapters=6,
    alpha=1.0,
    rate=4.0,
    sessions=SESSIONS,
    turns=TURNS,
    system_tokens=SYSTEM,
    user_tokens=USER,
    output_tokens=OUTPUT,
    think_s=0.05,
)
# Turn 1: prompt 24 tokens, nothing cached. Turn 2: prompt 24 + 12 + 16 = 52 tokens; turn 1 computed KV for its
# prompt and all but its last answer token, 35 tokens: 2 full blocks (32 tokens, answer tokens included) to reuse.
PROMPT_TOKENS = SESSIONS * ((SYSTEM + USER) + (SYSTEM + USER + OUTPUT + USER))
BEST_CACHED_TOKENS = SESSIONS * ((SYSTEM + USER + OUTPUT - 1) // 16 * 16)
BEST_KV_HIT_RATE = BEST_CACHED_TOKENS / PROMPT_TOKENS  # 32 / 76
POLICIES = ["tree-cost", "lru-separate", "lru-unified"]


def test_trace_shape_and_popularity():
    spec = TraceSpec(num_adapters=5, alpha=1.5, rate=2.0, sessions=400, turns=3, system_tokens=7, user_tokens=4)
    systems, sessions = make_trace(spec, vocab=1000)
    assert len(systems) == 5 and all(len(s) == 7 for s in systems)
    assert len(sessions) == 400 and all(len(s.user) == 3 and all(len(u) == 4 for u in s.user) for s in sessions)
    starts = [s.start for s in sessions]
    assert starts == sorted(starts)
    gaps = [b - a for a, b in zip([0.0, *starts], starts, strict=False)]
    # Poisson arrivals: exponential gaps of mean 1 / rate, whose standard deviation equals their mean
    assert statistics.mean(gaps) == pytest.approx(1 / 2.0, rel=0.15)
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.2)
    counts = Counter(s.adapter for s in sessions)
    # Zipf(1.5) over 5: p_i = (1 / i^1.5) / H, H = 1 + 0.354 + 0.192 + 0.125 + 0.089 = 1.760, so p = 0.568, 0.201,
    # 0.109, 0.071, 0.051; each share within 4 binomial standard deviations of 400 draws
    h = sum(1 / i**1.5 for i in range(1, 6))
    for i in range(5):
        p = 1 / (i + 1) ** 1.5 / h
        assert abs(counts[i] / 400 - p) <= 4 * math.sqrt(p * (1 - p) / 400), (i, counts[i], p)
    assert make_trace(spec, vocab=1000) == (systems, sessions)  # seeded


def _bench(tmp_path, kv_blocks: int, max_loras: int, plot: bool = False) -> dict:
    out = tmp_path / f"pool-{kv_blocks}.json"
    png = tmp_path / "pool.png"
    code = main(
        [
            "bench-pool",
            "--model",
            "tiny-llama",
            "--load-format",
            "dummy",
            "--adapters",
            "6",
            "--alpha",
            "1.0",
            "--rate",
            "4",
            "--sessions",
            str(SESSIONS),
            "--turns",
            str(TURNS),
            "--think-s",
            "0.05",
            "--system-tokens",
            str(SYSTEM),
            "--user-tokens",
            str(USER),
            "--output-tokens",
            str(OUTPUT),
            "--rank",
            str(RANK),
            "--kv-blocks",
            str(kv_blocks),
            "--host-blocks",
            "40",
            "--max-loras",
            str(max_loras),
            "--separate-slots",  # lru-separate's slots: as many as the arena policies batch, here
            str(max_loras),
            "--json",
            str(out),
            "--plot",
            str(png) if plot else "",
        ]
    )
    assert code == 0
    if plot:
        assert png.stat().st_size > 0
    report = json.loads(out.read_text())
    assert report["block_bytes"] == BLOCK_BYTES
    [setting] = report["settings"]
    assert setting["same_tokens"] is True  # cached, swapped or recomputed KV never changes a greedy token
    policies = setting["policies"]
    assert list(policies) == POLICIES
    for fig in policies.values():
        assert fig["requests"] == SESSIONS * TURNS
        assert 0 < fig["ttft_mean_s"] <= fig["ttft_p99_s"]  # with 12 requests, p99 is the largest TTFT
    tc, ls, lu = (policies[p] for p in POLICIES)
    assert setting["ratios"] == pytest.approx(
        {
            "mean vs lru-separate": tc["ttft_mean_s"] / ls["ttft_mean_s"],
            "mean vs lru-unified": tc["ttft_mean_s"] / lu["ttft_mean_s"],
            "p99 vs lru-separate": tc["ttft_p99_s"] / ls["ttft_p99_s"],
        }
    )
    for fig in policies.values():  # the engine's time is split into its parts, each within the run
        assert fig["steps"] > 0 and 0 < fig["forward_s"] < fig["duration_s"]
        assert 0 <= fig["schedule_s"] < fig["duration_s"] and 0 <= fig["copy_s"] < fig["duration_s"]
    return policies


@pytest.mark.slow
def test_bench_pool_without_evictions_matches_the_trace(tmp_path):
    """Room for every adapter and all KV: nothing is evicted, so each adapter the trace uses is loaded once (its
    first request misses, every other hits), each turn 2 reuses turn 1's full blocks (not lru-unified, which keeps
    KV only while its request runs), nothing is swapped and no KV outlives its adapter."""
    policies = _bench(tmp_path, kv_blocks=128, max_loras=6)
    _, sessions = make_trace(SPEC, vocab=512)
    used = len({s.adapter for s in sessions})
    for name, fig in policies.items():
        assert fig["adapter_hit_rate"] == pytest.approx(1 - used / (SESSIONS * TURNS)), name
        expected_kv = 0.0 if name == "lru-unified" else BEST_KV_HIT_RATE
        assert fig["kv_token_hit_rate"] == pytest.approx(expected_kv), name
        assert fig["bytes_to_gpu"] == used * ADAPTER_BYTES and fig["bytes_to_host"] == 0, name
        assert fig["invalid_kv_ratio"] == 0.0, name
        assert set(fig["evicted_blocks"].values()) == {0}, name


@pytest.mark.slow
def test_bench_pool_under_pressure_moves_what_it_counts(tmp_path):
    """26 device blocks for two adapter slots (9 each) and the KV of six sessions: adapters are unloaded and reloaded,
    tree-cost swaps KV to the host and back, lru-separate drops it. Whatever the timing, the bytes moved are the
    adapter loads (unloads + those resident at the end: 1 or 2 slots, or up to every adapter used for the unified
    policies) times the adapter's bytes plus KV swap-ins (at most the swap-outs) times the block's bytes; no policy
    serves more cached tokens than the trace offers."""
    policies = _bench(tmp_path, kv_blocks=26, max_loras=2, plot=True)
    _, sessions = make_trace(SPEC, vocab=512)
    used = len({s.adapter for s in sessions})
    for name, fig in policies.items():
        evicted = fig["evicted_blocks"]
        swapped_out = evicted["kv_swap_out"]
        assert fig["bytes_to_host"] == swapped_out * BLOCK_BYTES, name
        if name != "tree-cost":  # only tree-cost has a host tier for KV
            assert swapped_out == 0 and evicted["kv_drop_host"] == 0, name
        blocks = SLOT_BLOCKS if name == "lru-separate" else ADAPTER_BLOCKS
        unloads, rest = divmod(evicted["adapter_unload"], blocks)
        assert rest == 0, (name, evicted)
        resident_at_end = range(1, 3) if name == "lru-separate" else range(1, used + 1)  # slots, or any of those used
        splits = [(unloads + r, fig["bytes_to_gpu"] - (unloads + r) * ADAPTER_BYTES) for r in resident_at_end]
        assert any(
            loads >= used and swap_in >= 0 and swap_in % BLOCK_BYTES == 0 and swap_in // BLOCK_BYTES <= swapped_out
            for loads, swap_in in splits
        ), (name, fig, splits)
        assert 0 <= fig["kv_token_hit_rate"] <= BEST_KV_HIT_RATE + 1e-12, name
        assert 0 <= fig["adapter_hit_rate"] <= 1, name
    assert policies["tree-cost"]["evicted_blocks"]["kv_swap_out"] > 0  # the budget is tight enough to swap
    # tree-cost evicts KV with its adapter, lru-unified keeps KV only while its request (holding the adapter) runs;
    # lru-separate's prefix cache ignores adapters, so its KV may outlive them
    assert policies["tree-cost"]["invalid_kv_ratio"] == 0.0 and policies["lru-unified"]["invalid_kv_ratio"] == 0.0
    assert 0 <= policies["lru-separate"]["invalid_kv_ratio"] <= 1
    assert policies["lru-unified"]["kv_token_hit_rate"] == 0.0
    assert policies["tree-cost"]["kv_token_hit_rate"] > 0  # second turns reuse the first turns' KV (kept or swapped)
