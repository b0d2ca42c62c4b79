"""Mixed-adapter batches against HF transformers + PEFT with the same fp32 weights: in one batch of adapters of
different ranks and target sets plus base-only requests, every request gets the greedy tokens HF+PEFT gives with
only its own adapter active, and log-probabilities within 2e-3."""

from __future__ import annotations

import pytest
import torch

from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.sampling_params import SamplingParams
from tests.conftest import ADAPTERS, CHAT_PROMPTS, peft_log_softmax, pool_counters

LOGPROB_TOL = 2e-3
NEW_TOKENS = 12


def _peft_greedy(model, adapter: str | None, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with HF+PEFT's forward and KV cache, only ``adapter`` active (None: adapters disabled)."""
    import contextlib

    if adapter is not None:
        model.set_adapter(adapter)
    ids = list(prompt)
    with torch.no_grad(), model.disable_adapter() if adapter is None else contextlib.nullcontext():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            ids.append(int(out.logits[0, -1].argmax()))
            out = model(input_ids=torch.tensor([ids[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return ids[len(prompt) :]


@pytest.mark.slow
def test_mixed_adapter_batch_matches_peft(peft_dirs, peft_model):
    engine = Engine(
        EngineConfig(quantization="none", kv_cache_bytes=64 << 20, max_lora_rank=16, max_loras=5, show_progress=False)
    )
    for name in ADAPTERS:
        engine.adapters.add(name, peft_dirs / name)
    plan = [None, *ADAPTERS, None, "qv-r4"]  # five adapters of different ranks and targets, base rows, one batch
    prompts = [
        engine.chat_prompt([{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}]) for i in range(len(plan))
    ]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    outs = engine.generate(prompts, params, adapters=plan)
    base = engine.generate(prompts, params)  # the same prompts without adapters
    for adapter, out, ref in zip(plan, outs, base, strict=True):
        # each adapter moves the model (otherwise the comparison with PEFT would prove little)
        moved = max(abs(a.logprob - b.logprob) for a, b in zip(out.logprobs, ref.logprobs, strict=True))
        assert (moved > 1e-2 or out.token_ids != ref.token_ids) == (adapter is not None), adapter
    for prompt, adapter, out in zip(prompts, plan, outs, strict=True):
        assert out.token_ids == _peft_greedy(peft_model, adapter, prompt, NEW_TOKENS), adapter
        ref = peft_log_softmax(peft_model, adapter, prompt + out.token_ids)
        for step, lp in enumerate(out.logprobs):
            assert abs(lp.logprob - ref[len(prompt) - 1 + step, lp.token_id].item()) <= LOGPROB_TOL, adapter
    # the adapters change the answers (otherwise the comparison above proves little)
    engine.check_integrity()


@pytest.mark.slow
def test_multi_turn_prefix_hits_and_swaps_match_peft(peft_dirs, peft_model):
    """Three conversations (base, two adapters) of three turns each, one batch per turn; between turns a long
    filler request takes most of the device budget, so the tree-cost pool swaps the conversations' KV to the host
    and back. Every turn after the first reuses cached KV, and still every token equals HF+PEFT's greedy choice on
    the whole conversation, log-probabilities within 2e-3."""
    engine = Engine(
        EngineConfig(quantization="none", num_kv_blocks=48, max_lora_rank=16, max_loras=2, show_progress=False)
    )
    plan = [None, "qv-r4", "all-r8-rslora"]
    for name in plan[1:]:
        engine.adapters.add(name, peft_dirs / name)
    chats: list[list[dict[str, str]]] = [[] for _ in plan]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    for turn in range(3):
        for i, chat in enumerate(chats):
            chat.append({"role": "user", "content": CHAT_PROMPTS[(turn * 3 + i) % len(CHAT_PROMPTS)]})
        prompts = [engine.chat_prompt(chat) for chat in chats]
        outs = engine.generate(prompts, params, adapters=plan)
        for prompt, adapter, out, chat in zip(prompts, plan, outs, chats, strict=True):
            assert (out.num_cached_tokens > 0) == (turn > 0), (turn, adapter)
            assert out.token_ids == _peft_greedy(peft_model, adapter, prompt, NEW_TOKENS), (turn, adapter)
            ref = peft_log_softmax(peft_model, adapter, prompt + out.token_ids)
            for step, lp in enumerate(out.logprobs):
                assert abs(lp.logprob - ref[len(prompt) - 1 + step, lp.token_id].item()) <= LOGPROB_TOL
            chat.append({"role": "assistant", "content": out.text})
        engine.generate([list(range(100, 100 + 30 * 16))], SamplingParams(max_tokens=1))  # the filler: 31 blocks
        engine.check_integrity()
    counters = pool_counters(engine)
    assert counters["kv_swap_out"] > 0 and counters["kv_swap_in"] > 0, dict(counters)
