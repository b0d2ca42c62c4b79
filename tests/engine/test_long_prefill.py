"""Long prompts beside short ones on the real engine (SmolLM2, fp32): the long-prefill cap and the partial-prefill
limit seen in engine steps (counted by hand from the budget), a short request's greedy tokens unchanged by the
company, and bench-long-prefill's figures (its arithmetic model checked against SmolLM2's published shape)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.engine.request import RequestStatus
from lora_server.sampling_params import SamplingParams
from tests.conftest import scheduler_of

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(10, 40_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.slow
def test_a_short_request_starts_beside_long_prompts(smollm2_path):
    """Budget 512, cap 128, one long prompt at a time. A 7,000-token prompt alone takes 512 tokens; then a
    2,000-token prompt and a 32-token one arrive: the long one computes 128, the second long one waits (over the
    limit), the short one is admitted and has its first token in that same step, and its 4 greedy tokens are those
    it gets alone."""
    engine = Engine(
        EngineConfig(
            quantization="none",
            max_num_batched_tokens=512,
            max_model_len=7100,
            kv_cache_bytes=600 << 20,
            show_progress=False,
        )
    )
    short_prompt = _prompt(32, 3)
    alone = engine.generate([short_prompt], GREEDY, cache_salt="alone")[0].token_ids
    requests = scheduler_of(engine).requests  # the scheduler's state of each request, by id
    long = engine.make_request(_prompt(7000, 1), GREEDY)
    engine.add(long)
    engine.step()
    assert requests[long.request_id].num_computed_tokens == 512
    second = engine.make_request(_prompt(2000, 2), GREEDY)
    short = engine.make_request(short_prompt, GREEDY)
    engine.add(second)
    engine.add(short)
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs[short.request_id].token_ids  # its first token, one step after it arrived
    assert requests[long.request_id].num_computed_tokens == 512 + 128
    assert requests[second.request_id].status is RequestStatus.WAITING
    tokens = list(outputs[short.request_id].token_ids)
    for _ in range(3):
        outputs = {o.request_id: o for o in engine.step()}
        tokens += outputs[short.request_id].token_ids
    assert tokens == alone
    assert requests[long.request_id].num_computed_tokens == 512 + 4 * 128
    assert requests[second.request_id].status is RequestStatus.WAITING
    engine.abort(long.request_id)
    engine.abort(second.request_id)
    engine.check_integrity()


def _flops_per_token(length: int) -> float:
    """SmolLM2-135M's published shape (hidden 576, 30 layers, 9 heads of 64, 3 KV heads, MLP 1536): 2 FLOPs per
    linear weight, 4 per head dimension per earlier key (length / 2 keys on average, causal)."""
    linear = 2 * 30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536)
    return linear + 4 * 30 * 9 * 64 * (length + 1) / 2


@pytest.mark.slow
def test_bench_long_prefill_counts_the_steps(tmp_path):
    """Budget 512, cap 128. One 1,200-token prompt: it takes 512 alone; beside it a short request starts at once
    with the cap; without it the long one takes 512 again, and the short one starts in the step after (176 + 8).
    Four long prompts started together: with one at a time, the first computes 128 and the short one starts the
    next step; with no limit all four compute 128 a step and fill the budget until they are down to their last 48
    tokens (1,200 = 9 x 128 + 48): the short one starts in the 9th step after it came."""
    out = tmp_path / "lp.json"
    cmd = [sys.executable, "-m", "lora_server.cli", "bench-long-prefill", "--lengths", "64,256", "--long-len", "1200"]
    cmd += ["--short-len", "8", "--long-prompts", "4", "--kv-cache-gb", "0.5", "--json", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    costs = figures["prefill"]
    assert [c["tokens"] for c in costs] == [64, 256]
    assert costs[1]["model_ratio"] == pytest.approx(_flops_per_token(256) / _flops_per_token(64), rel=1e-9)
    runs = [
        (r["long_prompts"], r["long_prefill_token_threshold"], r["max_long_partial_prefills"], r["steps"])
        for r in figures["short_beside_long"]
    ]
    assert runs == [(1, 128, 1, 1), (1, 0, 1, 2), (4, 128, 1, 1), (4, 128, 0, 9)]
    assert "beside 4 x 1200-token prompt" in result.stdout
