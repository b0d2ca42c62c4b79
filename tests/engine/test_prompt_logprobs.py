"""Prompt logprobs in the engine against HF transformers + PEFT (fp32): every prompt token's logprob, rank and top-k
equal the reference's log-softmax, across chunked prefill (prompts longer than a step's token budget), the head
worked through a few rows at a time, adapters, a batch that mixes scoring, generating and plain requests, and the
prefix cache (a request that wants prompt logprobs does not reuse cached KV; others still do)."""

from __future__ import annotations

import pytest
import torch

from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.model import sampler
from lora_server.sampling_params import SamplingParams
from tests.conftest import CHAT_PROMPTS, peft_log_softmax

TOL = 2e-3
K = 3


def _check(entries, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i, e in enumerate(entries[1:], start=1):
        row = ref[i - 1]  # the logits at position i - 1 score prompt token i
        assert e.token_id == prompt[i]
        assert abs(e.logprob - row[prompt[i]].item()) <= TOL, i
        value = row[prompt[i]].item()  # its rank, up to the tokens within TOL of it
        assert int((row > value + TOL).sum()) + 1 <= e.rank <= int((row > value - TOL).sum()) + 1, i
        assert len(e.top) == k
        for token, value in e.top:
            assert abs(value - row[token].item()) <= TOL


@pytest.fixture(scope="module")
def engine(peft_dirs):
    """Chunked prefill of 24 tokens a step, and the head scoring 5 prompt rows at a time."""
    e = Engine(
        EngineConfig(
            quantization="none",
            kv_cache_bytes=64 << 20,
            max_num_batched_tokens=24,
            max_lora_rank=16,
            max_loras=4,
            show_progress=False,
        )
    )
    for name in ("qv-r4", "all-r8-rslora"):
        e.adapters.add(name, peft_dirs / name)
    return e


@pytest.fixture
def few_rows_at_a_time(engine, monkeypatch):
    monkeypatch.setattr(sampler, "SCORING_LOGITS_BYTES", 5 * 4 * engine.vocab_size)
    return engine


@pytest.mark.slow
def test_prompt_logprobs_match_peft_in_a_mixed_chunked_batch(few_rows_at_a_time, peft_model):
    engine = few_rows_at_a_time
    prompts = [engine.chat_prompt([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:4]]
    prompts.append(engine.encode(" ".join(CHAT_PROMPTS)))  # about 60 tokens: three chunks
    plan = [  # (prompt, adapter, params)
        (0, None, SamplingParams(max_tokens=0, prompt_logprobs=K)),
        (1, "qv-r4", SamplingParams(max_tokens=0, prompt_logprobs=K)),
        (2, "all-r8-rslora", SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1, logprobs=1)),
        (3, None, SamplingParams(max_tokens=4, temperature=0)),  # a plain request in the same batch
        (4, "qv-r4", SamplingParams(max_tokens=0, prompt_logprobs=0)),
        (4, None, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=K)),
    ]
    outs = engine.generate([prompts[p] for p, _, _ in plan], [sp for _, _, sp in plan], [a for _, a, _ in plan])
    for (p, adapter, params), out in zip(plan, outs, strict=True):
        assert out.finish_reason == "length" and len(out.token_ids) == params.max_tokens
        if params.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        ref = peft_log_softmax(peft_model, adapter, prompts[p] + out.token_ids)
        _check(out.prompt_logprobs, prompts[p], ref, params.prompt_logprobs)
        for step, lp in enumerate(out.logprobs or []):  # generated tokens still get theirs
            assert abs(lp.logprob - ref[len(prompts[p]) - 1 + step, lp.token_id].item()) <= TOL
    engine.check_integrity()
    assert engine.pool_report().request_blocks == 0


@pytest.mark.slow
def test_prompt_logprobs_skip_the_prefix_cache_and_leave_it_to_others(few_rows_at_a_time, peft_model):
    engine = few_rows_at_a_time
    prompt = engine.chat_prompt([{"role": "user", "content": "Tell me about the sea, the sky and the stars."}] * 3)
    [first] = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))  # caches the prompt's KV
    [scored] = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=K))
    assert scored.num_cached_tokens == 0  # its prompt was computed, not read from the cache
    _check(scored.prompt_logprobs, prompt, peft_log_softmax(peft_model, None, prompt), K)
    [again] = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    assert again.num_cached_tokens > 0 and again.token_ids == first.token_ids


def test_scoring_needs_prompt_logprobs():
    from lora_server.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(max_tokens=0)
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(prompt_logprobs=21)
    assert info.value.param == "prompt_logprobs"
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).scores_prompt
