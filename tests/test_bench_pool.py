"""``lora-server bench-pool`` end to end on a tiny dummy model: the trace is what the spec says (hand-checked
counts and Zipf order), every policy runs the same trace to the same tokens, and the report holds the figures
(no timing is asserted: speed is what the benchmark prints)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from lora_server.bench.pool import TraceSpec, make_trace
from lora_server.cli import main


def test_trace_shape_and_popularity():
    spec = TraceSpec(num_adapters=5, alpha=1.5, rate=2.0, sessions=400, turns=3, system_tokens=7, user_tokens=4)
    systems, sessions = make_trace(spec, vocab=1000)
    assert len(systems) == 5 and all(len(s) == 7 for s in systems)
    assert len(sessions) == 400 and all(len(s.user) == 3 and all(len(u) == 4 for u in s.user) for s in sessions)
    starts = [s.start for s in sessions]
    assert starts == sorted(starts)
    assert 400 / starts[-1] == pytest.approx(2.0, rel=0.2)  # Poisson arrivals at the rate
    counts = Counter(s.adapter for s in sessions)
    # Zipf(1.5) over 5: p_1 = 1 / sum(1 / i^1.5) = 0.53, p_5 = 0.05
    assert counts[0] / 400 == pytest.approx(0.53, abs=0.08) and counts[4] / 400 == pytest.approx(0.05, abs=0.04)
    assert make_trace(spec, vocab=1000) == (systems, sessions)  # seeded


def test_bench_pool_runs_every_policy_on_the_same_trace(tmp_path):
    out, png = tmp_path / "pool.json", tmp_path / "pool.png"
    code = main(["bench-pool", "--model", "tiny-llama", "--load-format", "dummy", "--adapters", "6", "--alpha", "1.0",
                 "--rate", "4", "--sessions", "6", "--turns", "2", "--think-s", "0.05", "--kv-blocks", "40",
                 "--host-blocks", "40", "--max-loras", "2", "--json", str(out), "--plot", str(png)])
    assert code == 0
    report = json.loads(out.read_text())
    [setting] = report["settings"]
    assert setting["same_tokens"] is True
    policies = setting["policies"]
    assert list(policies) == ["tree-cost", "lru-separate", "lru-unified"]
    for fig in policies.values():
        assert fig["requests"] == 12
        assert 0 < fig["ttft_mean_s"] <= fig["ttft_p99_s"]
        assert 0 <= fig["adapter_hit_rate"] <= 1 and 0 <= fig["kv_token_hit_rate"] <= 1
    assert policies["tree-cost"]["invalid_kv_ratio"] == 0.0 and policies["lru-unified"]["kv_token_hit_rate"] == 0.0
    assert policies["tree-cost"]["kv_token_hit_rate"] > 0  # second turns reuse the first turns' KV
    assert setting["ttft_ratio_tree_cost_vs_lru_separate"] > 0
    assert png.stat().st_size > 0
