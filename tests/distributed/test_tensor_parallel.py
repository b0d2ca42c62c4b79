"""Tensor parallelism on the CPU (gloo): greedy tokens at TP=2 / TP=3 equal TP=1's and HF transformers' at fp32, the
collectives of a step counted against hand-computed values, the refusals, and a killed worker rank stopping the
engine with an error that names it, within seconds."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist

from lora_server.adapters.peft_format import AdapterError, TokenIds
from lora_server.config import EngineConfig
from lora_server.distributed import workers
from lora_server.distributed.step_message import (
    LOAD,
    SWAP_IN,
    SWAP_OUT,
    UNLOAD,
    LoadedAdapter,
    decode_copy_ops,
    encode_copy_ops,
)
from lora_server.distributed.tensor_parallel import TensorParallel
from lora_server.engine import Engine
from lora_server.errors import ConfigError, EngineDeadError, TensorParallelError
from lora_server.kv_pool.tree import AdapterKey, CopyOp, OpKind
from lora_server.model import sampler
from lora_server.sampling_params import SamplingParams
from tests.adapters import test_adapter_keys
from tests.adapters.test_adapter_keys import TINY
from tests.adapters.test_lora_vs_peft import _peft_greedy
from tests.conftest import ADAPTERS, pool_counters, runner_of
from tests.engine.test_prompt_logprobs import _check
from tests.model import test_architectures
from tests.model.test_model_vs_hf import _compare, _hf_logprobs
from tests.servers import BASE, Server, free_port

tiny = test_adapter_keys.tiny  # a random tiny Llama in HF's format and the model (fp32): 2 layers, 4 heads, 2 KV

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
NUM_PAGES_TP3 = 40


def workers_of(engine: Engine) -> workers.WorkerRanks:
    """Rank 0's handle on the worker processes (a test of tensor parallelism's own fault handling)."""
    ranks = runner_of(engine).ranks
    assert isinstance(ranks, TensorParallel)
    return ranks.workers


def tiny_engine(path, tp: int, **kw) -> Engine:
    config = dict(quantization="none", kv_cache_bytes=16 << 20, block_size=16, host_kv_bytes=0, show_progress=False)
    return Engine(EngineConfig(model=str(path), tensor_parallel_size=tp, **{**config, **kw}))


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


def prompts(lengths) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture
def tp2(tiny):
    """The tiny Llama at TP=2, its steps at most 32 tokens (long prompts prefill in chunks); one per test (one
    tensor-parallel engine a process), closed after it."""
    engine = tiny_engine(tiny[0], 2, max_num_batched_tokens=32)
    yield engine
    engine.close()


@pytest.mark.slow
def test_tp2_greedy_equals_tp1_and_hf(tiny, tp2):
    path, model = tiny
    batch = prompts([3, 17, 40, 70])
    one = tiny_engine(path, 1, max_num_batched_tokens=32)
    expected = [o.token_ids for o in one.generate(batch, GREEDY)]
    assert expected == [hf_greedy(model, p, GREEDY.max_tokens) for p in batch]
    assert [o.token_ids for o in tp2.generate(batch, GREEDY)] == expected


@pytest.mark.slow
def test_tp2_speculative_decoding_keeps_the_greedy_tokens(tiny):
    """Drafts verified in one step: several logits rows a request, gathered like one."""
    path, model = tiny
    engine = tiny_engine(path, 2, speculative_ngram=3)
    try:
        batch = [[5, 6, 7, 8] * 6, prompts([20])[0] * 2]
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        assert [o.token_ids for o in engine.generate(batch, params)] == [hf_greedy(model, p, 16) for p in batch]
        assert engine.snapshot().spec_draft_tokens > 0
    finally:
        engine.close()


def test_the_copy_operations_stream_by_hand():
    """The pool's copies as the step message carries them (step_message's layout), values written out by hand, and
    read back in order."""
    ops = [
        CopyOp(OpKind.KV_SWAP_OUT, src=(4, 5), dst=(0, 1)),
        CopyOp(OpKind.ADAPTER_LOAD, dst=(7, 9), adapter=AdapterKey(3)),
        CopyOp(OpKind.ADAPTER_UNLOAD, src=(2, 3), adapter=AdapterKey(1)),
        CopyOp(OpKind.KV_SWAP_IN, src=(1,), dst=(6,)),
    ]
    ranks = {(0, "q"): 8, (1, "down"): 4}  # q is module 0, down module 6
    vocab = {"head_a": (4, 64), "head_rows": (2, 64)}  # pieces 2 and 5
    experts = (((1, "gate_up", 3), 4),)  # layer 1, gate_up (expert module 2), expert 3, rank 4
    loaded = LoadedAdapter(ranks, vocab, TokenIds(None, torch.tensor([5, 38])), experts)
    values = encode_copy_ops(ops, {AdapterKey(3): loaded})
    assert values == [
        *(0, 4, 0, 0, 5, 1),
        *(2, 2, 7, 9, 2, 0, 0, 8, 1, 6, 4, 2, 2, 4, 64, 5, 2, 64, 1, 1, 2, 3, 4, -1, 2, 5, 38),
        *(3, 2),
        *(1, 1, 6),
    ]
    steps = list(decode_copy_ops(values))
    assert [s.kind for s in steps] == [SWAP_OUT, SWAP_OUT, LOAD, UNLOAD, SWAP_IN]
    assert [(s.src, s.dst) for s in steps if s.kind in (SWAP_OUT, SWAP_IN)] == [(4, 0), (5, 1), (1, 6)]
    load, unload = steps[2].adapter, steps[3]
    assert steps[2].pages == (7, 9) and unload.pages == (2,)
    assert load.ranks == ranks and load.vocab == vocab and load.experts == experts and load.token_ids.embed is None
    assert load.token_ids.head.tolist() == [5, 38]


def test_tp1_runs_without_a_process_group(tiny):
    before = dist.is_initialized()
    assert tiny_engine(tiny[0], 1).collectives() is None  # a single rank: no collective, no group
    assert dist.is_initialized() == before


def test_tp3_is_refused_where_the_heads_do_not_divide(tiny):
    with pytest.raises(ConfigError, match=r"num_heads \(4\) and num_kv_heads \(2\)"):
        tiny_engine(tiny[0], 3)


def test_an_fp8_kv_cache_is_refused():
    with pytest.raises(ValueError, match="fp8 KV cache"):
        EngineConfig(tensor_parallel_size=2, quantization="none", host_kv_bytes=0, kv_cache_dtype="fp8")


# adapters of different ranks and targets on the tiny Llama: column-parallel only, row-parallel only, both
TINY_ADAPTERS = {
    "qv-r2": dict(r=2, target_modules=["q_proj", "v_proj"]),
    "all-r4": dict(r=4, target_modules="all-linear"),
    "o-down-r8": dict(r=8, target_modules=["o_proj", "down_proj"]),
    "mlp-r16": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def tiny_peft(tiny, tmp_path_factory):
    """TINY_ADAPTERS saved by PEFT on the tiny Llama (random weights), and HF + PEFT's model holding them all."""
    from peft import LoraConfig, PeftModel

    path, model = tiny
    root = tmp_path_factory.mktemp("tiny-adapters")
    for i, (name, cfg) in enumerate(TINY_ADAPTERS.items()):
        torch.manual_seed(10 + i)
        test_adapter_keys.save_peft(model, LoraConfig(init_lora_weights=False, **cfg), root / name, scale=0.3)
    names = list(TINY_ADAPTERS)
    peft = PeftModel.from_pretrained(copy.deepcopy(model), root / names[0], adapter_name=names[0])
    for name in names[1:]:
        peft.load_adapter(root / name, adapter_name=name)
    return root, peft.eval()


def _drive(engine: Engine, plan: list[tuple[str | None, list[int]]], params: SamplingParams) -> list[list[int]]:
    """Serve ``plan``'s (adapter, prompt) requests in one continuous batch, checking every rank's integrity after
    each step (each rank's arena holds the adapters the pool placed, in the same pages, and the same block tables);
    returns each request's tokens."""
    for i, (adapter, prompt) in enumerate(plan):
        engine.add(engine.make_request(prompt, params, adapter, request_id=f"q{i}"))
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        engine.check_integrity()
    return [tokens[f"q{i}"] for i in range(len(plan))]


@pytest.mark.slow
def test_tp2_mixed_adapters_under_churn_match_tp1_and_peft(tiny, tiny_peft):
    """Four adapters of ranks 2 to 16 (on column-parallel modules, row-parallel ones, both) and the base model in
    mixed batches, through an arena too small to hold them all with their KV: adapters leave the device and come
    back, KV goes to the host tier and back; the integrity check holds on every rank after every step, and every
    request gets TP=1's and HF + PEFT's greedy tokens."""
    path, _ = tiny
    root, peft = tiny_peft
    names = [*TINY_ADAPTERS, None]
    batch = prompts([70, 9, 100, 66, 30])  # blocks of 64 tokens: the long ones leave whole blocks in the cache
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plans = [[(names[(i + round_) % 5], p) for i, p in enumerate(batch)] for round_ in range(3)]
    plans.append(plans[0])  # its prefixes cached under the same adapters, if kept: swapped back in
    expected = [[_peft_greedy(peft, adapter, p, params.max_tokens) for adapter, p in plan] for plan in plans]
    config = dict(block_size=64, num_kv_blocks=12, host_kv_bytes=2 << 20, max_loras=2, max_lora_rank=16)
    for tp in (1, 2):
        engine = tiny_engine(path, tp, **config)
        try:
            handles = [engine.adapters.add(name, root / name) for name in TINY_ADAPTERS]
            for plan, want in zip(plans, expected, strict=True):
                assert _drive(engine, plan, params) == want
            counters = pool_counters(engine)
            print(tp, dict(counters), [h.device_nbytes for h in handles])
            assert counters["adapter_unload"] > 0, dict(counters)  # adapters left the device for others
            assert counters["adapter_bytes_h2d"] > sum(h.device_nbytes for h in handles)  # and came back
            assert counters["kv_swap_out"] > 0 and counters["kv_swap_in"] > 0, dict(counters)
        finally:
            engine.close()


def test_dora_adapters_are_refused(tiny, tmp_path):
    """Under TP DoRA, whose sharding is not built, is refused at registration, naming it."""
    from peft import LoraConfig

    path, model = tiny
    test_adapter_keys.save_peft(model, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True), tmp_path / "dora")
    engine = tiny_engine(path, 2, block_size=64)
    try:
        with pytest.raises(AdapterError, match="DoRA adapters are not served with --tensor-parallel-size 2"):
            engine.adapters.add("dora", tmp_path / "dora")
        assert engine.adapters.names() == []
    finally:
        engine.close()


@pytest.mark.slow
def test_tp2_prompt_logprobs_match_hf(tiny, tp2, monkeypatch):
    """Prompt rows scored through the vocabulary-parallel head 5 at a time (rank 0's slice, which the workers
    follow), across chunked prefill (steps of 32 tokens), beside a request that only generates."""
    path, model = tiny
    monkeypatch.setattr(sampler, "SCORING_LOGITS_BYTES", 5 * 4 * TINY["vocab_size"])
    batch = prompts([40, 9])
    scoring = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=3)
    outs = tp2.generate(batch, [scoring, GREEDY])
    _check(outs[0].prompt_logprobs, batch[0], _hf_logprobs(model, batch[0]), 3)
    assert outs[0].token_ids == hf_greedy(model, batch[0], 3)
    assert outs[1].token_ids == hf_greedy(model, batch[1], GREEDY.max_tokens)


# the step message: 19 header values, 4 per-token arrays of the runner's most tokens a step (max(32, max_num_seqs
# 64) = 64), 3 per-sequence arrays of max_num_seqs + 1 (65) and the adapter runs (3 values per sequence), 2 values per
# new block (64 // 16 + 64), int64
MESSAGE_BYTES = (19 + 4 * 64 + 3 * 65 + 3 * 64 + 2 * (4 + 64)) * 8


@pytest.mark.slow
def test_the_collectives_of_each_step(tp2):
    """Two prompts of 5 and 7 tokens (under the long-prefill cap, 32 // 4), 3 tokens each: one prefill step (12
    tokens) and two decode steps (2 tokens). Per step: the embedding's all-reduce and two per layer (o, down), each
    of [T, hidden] float32; one gather of each rank's [S, ceil(V/2)] logits; one broadcast of the step message."""
    counter = tp2.collectives()
    assert counter is not None
    counter.reset()
    tp2.generate(prompts([5, 7]), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    hidden, layers, vocab_half = TINY["hidden_size"], TINY["num_hidden_layers"], TINY["vocab_size"] // 2
    tokens = 12 + 2 + 2
    assert counter.calls == {"all_reduce": 3 * (2 * layers + 1), "gather": 3, "broadcast": 3, "scatter": 0}
    assert counter.bytes == {
        "all_reduce": (2 * layers + 1) * tokens * hidden * 4,
        "gather": 3 * 2 * vocab_half * 4,
        "broadcast": 3 * MESSAGE_BYTES,
        "scatter": 0,
    }


@pytest.mark.slow
def test_lora_adds_no_collective_and_an_adapter_load_one_scatter(tiny, tiny_peft):
    """The same two requests on an adapter of every module: the LoRA terms add nothing to the collectives (the
    row-parallel ones join the base's all-reduce), and loading the adapter scatters each worker its share of the
    pages once, in the step that uses it; tokens are HF + PEFT's."""
    root, peft = tiny_peft
    engine = tiny_engine(tiny[0], 2, block_size=64, max_num_batched_tokens=32)
    try:
        handle = engine.adapters.add("all-r4", root / "all-r4")
        counter = engine.collectives()
        assert counter is not None
        counter.reset()
        batch = prompts([5, 7])
        outs = engine.generate(batch, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), adapters="all-r4")
        assert [o.token_ids for o in outs] == [_peft_greedy(peft, "all-r4", p, 3) for p in batch]
        hidden, layers, vocab_half = TINY["hidden_size"], TINY["num_hidden_layers"], TINY["vocab_size"] // 2
        assert counter.calls == {"all_reduce": 3 * (2 * layers + 1), "gather": 3, "broadcast": 3, "scatter": 1}
        assert counter.bytes["all_reduce"] == (2 * layers + 1) * (12 + 2 + 2) * hidden * 4
        assert counter.bytes["gather"] == 3 * 2 * vocab_half * 4
        # rank 0 counts the part it gets of the scatter: the size of a worker's share, as many pages as its own
        assert counter.bytes["scatter"] == handle.device_nbytes
    finally:
        engine.close()


@pytest.mark.slow
def test_the_integrity_check_finds_a_rank_out_of_step(tiny, tiny_peft):
    """The check compares every rank's arena and block tables with rank 0's: it passes while they follow, and
    names the rank once rank 0's arena changes behind the workers' backs (an unload they were never sent)."""
    root, _ = tiny_peft
    engine = tiny_engine(tiny[0], 2, block_size=64)
    try:
        engine.adapters.add("qv-r2", root / "qv-r2")
        engine.generate(prompts([5]), GREEDY, adapters="qv-r2")
        runner = runner_of(engine)
        runner.check_ranks()
        (table_page,) = runner.adapters.table_pages()
        runner.adapters.unload(table_page)  # rank 0 alone
        with pytest.raises(AssertionError, match="rank 1's arena or block tables differ from rank 0's"):
            runner.check_ranks()
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(test_architectures.FAMILIES) - {"gemma3"}))
def test_tp2_families_match_hf(tmp_path, name):
    """test_architectures' families at TP=2 (their biases, per-head norms, soft caps, sliding windows, partial
    rotary, fused and tied projections on sharded weights): HF's greedy tokens and log-probabilities."""
    hf = test_architectures._build(tmp_path, name)
    engine = Engine(
        EngineConfig(
            model=str(tmp_path),
            block_size=4,
            num_kv_blocks=256,
            host_kv_bytes=0,
            show_progress=False,
            tensor_parallel_size=2,
        )
    )
    try:
        _compare(engine, hf, test_architectures._prompts())
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(test_architectures.ADAPTER_TARGETS) - {"gemma3"}))
def test_tp2_family_adapters_match_peft(tmp_path, name):
    """test_architectures' mixed batch of two adapters and the base at TP=2: Phi-3's fused qkv_proj and
    gate_up_proj adapters split into their parts, then each part's share; Gemma 2's and Qwen 3's on every module."""
    model = test_architectures.family_with_adapters(tmp_path, name)
    config = dict(block_size=32, num_kv_blocks=128, max_lora_rank=8, host_kv_bytes=0, show_progress=False)
    engine = Engine(EngineConfig(model=str(tmp_path / "base"), tensor_parallel_size=2, **config))
    try:
        for adapter in ("a0", "a1"):
            engine.adapters.add(adapter, tmp_path / adapter)
        test_architectures.assert_mixed_batch_matches_peft(engine, model)
        engine.check_integrity()
    finally:
        engine.close()


def test_tp2_is_refused_on_a_single_kv_head(tmp_path):
    test_architectures._build(tmp_path, "gemma3")  # one KV head
    with pytest.raises(ConfigError, match=r"num_kv_heads \(1\)"):
        Engine(EngineConfig(model=str(tmp_path), host_kv_bytes=0, show_progress=False, tensor_parallel_size=2))


@pytest.mark.slow
def test_a_step_whose_arrays_spill_past_the_message(tiny):
    """A prompt served again from the prefix cache gets its 50 cached blocks' table entries in one step: more than
    the message holds (blocks of 4 tokens, steps of 16), so they follow in a second broadcast; the tokens are HF's."""
    path, model = tiny
    engine = tiny_engine(path, 2, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    try:
        prompt = prompts([200])
        expected = [hf_greedy(model, prompt[0], GREEDY.max_tokens)]
        assert [o.token_ids for o in engine.generate(prompt, GREEDY)] == expected
        counter = engine.collectives()
        assert counter is not None
        counter.reset()
        assert [o.token_ids for o in engine.generate(prompt, GREEDY)] == expected
        # served from the cache: 8 steps, each sampling (the prompt's last block, then 7 decodes); the first sent
        # its arrays in two broadcasts
        calls = {"all_reduce": 8 * (2 * TINY["num_hidden_layers"] + 1), "gather": 8, "broadcast": 9, "scatter": 0}
        assert counter.calls == calls
    finally:
        engine.close()


@pytest.mark.slow
def test_kv_swapped_to_the_host_tier_and_back(tiny):
    """A 16-block arena: four prompts of 96 tokens push each other's cached KV to the host tier, and the first two,
    served again, bring theirs back; the workers make the same swaps on their own arenas and host tiers, so the
    tokens served from swapped-in KV are HF's."""
    path, model = tiny
    engine = tiny_engine(path, 2, num_kv_blocks=16, host_kv_bytes=4 << 20)
    try:
        batch = prompts([96] * 4)
        for prompt in batch + batch[:2]:
            assert engine.generate([prompt], GREEDY)[0].token_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
        counters = pool_counters(engine)
        assert counters["kv_swap_out"] > 0 and counters["kv_swap_in"] > 0, dict(counters)
    finally:
        engine.close()


@pytest.mark.slow
def test_a_killed_rank_stops_the_engine_with_an_error_naming_it(tiny):
    engine = tiny_engine(tiny[0], 2)
    runner = runner_of(engine)
    pid = workers_of(engine).pids[0]
    params = SamplingParams(max_tokens=240, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts([5] * 8)):
        engine.add(engine.make_request(prompt, params, request_id=f"r{i}"))
    for _ in range(3):
        engine.step()
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    killer = threading.Timer(0.2, kill)  # while the engine steps: mid-step or between steps
    killer.start()
    try:
        with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {pid}\) was killed by signal 9"):
            while engine.has_work():
                engine.step()
        elapsed = time.monotonic() - killed_at[0]
        print(f"error {elapsed:.3f} s after the kill")
        assert elapsed < 5.0
    finally:
        killer.join()
        runner.close()
    assert not dist.is_initialized()


@pytest.mark.slow
def test_embedded_model_tp3_mixed_adapters_under_churn(engine_fp32, peft_dirs, peft_model):
    """SmolLM2-135M: 9 heads, 3 KV heads; TP=2 is refused. At TP=3 and fp32, the base model gives TP=1's greedy
    tokens, and the five HF + PEFT adapters of ranks 2 to 16 (conftest.ADAPTERS) and the base in mixed batches,
    through an arena that holds few of them with their KV, give HF + PEFT's; the integrity check holds on every
    rank after every step."""
    config = dict(quantization="none", host_kv_bytes=0, show_progress=False)
    with pytest.raises(ConfigError, match=r"num_heads \(9\) and num_kv_heads \(3\)"):
        Engine(EngineConfig(tensor_parallel_size=2, kv_cache_bytes=64 << 20, **config))
    texts = ("The capital of France is", "1, 2, 3, 4,", "Write a haiku about the sea.")
    batch = [engine_fp32.encode(text) for text in texts]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    base = [o.token_ids for o in engine_fp32.generate(batch[:2], params)]
    engine = Engine(
        EngineConfig(tensor_parallel_size=3, num_kv_blocks=NUM_PAGES_TP3, max_lora_rank=16, max_loras=3, **config)
    )
    try:
        assert [o.token_ids for o in engine.generate(batch[:2], params)] == base
        handles = [engine.adapters.add(name, peft_dirs / name) for name in ADAPTERS]
        names = [*ADAPTERS, None]
        for round_ in range(2):
            plan = [(names[(i + round_) % len(names)], batch[i % 3]) for i in range(len(names))]
            expected = [_peft_greedy(peft_model, adapter, p, params.max_tokens) for adapter, p in plan]
            assert _drive(engine, plan, params) == expected, round_
        counters = pool_counters(engine)
        assert counters["adapter_unload"] > 0, dict(counters)  # adapters left the device for others
        assert counters["adapter_bytes_h2d"] > sum(h.device_nbytes for h in handles)  # and came back
    finally:
        engine.close()


@pytest.mark.slow
def test_an_error_on_rank_0_after_the_step_went_out_stops_the_engine(tiny, tp2, monkeypatch):
    """Rank 0 fails once the workers have the step (they would wait in its collectives for good): the engine stops
    with an error that says so, and closing it does not wait for the workers. A failure before the step leaves
    rank 0 is the step's own: its request fails alone and the engine serves on, HF's tokens."""
    runner = runner_of(tp2)
    prompt = prompts([6])
    real_plan = runner.block_tables.plan
    monkeypatch.setattr(runner.block_tables, "plan", lambda *a: (_ for _ in ()).throw(ValueError("before")))
    out = tp2.generate(prompt, GREEDY)[0]
    assert out.finish_reason == "error" and "before" in str(out.error)
    monkeypatch.setattr(runner.block_tables, "plan", real_plan)
    assert tp2.generate(prompt, GREEDY)[0].token_ids == hf_greedy(tiny[1], prompt[0], GREEDY.max_tokens)
    monkeypatch.setattr(runner.step_inputs, "upload", lambda arrays: (_ for _ in ()).throw(RuntimeError("after")))
    tp2.add(tp2.make_request(prompt[0], GREEDY, request_id="late"))
    with pytest.raises(TensorParallelError, match=r"rank 0 raised RuntimeError\('after'\) after sending the step"):
        while tp2.has_work():
            tp2.step()
    start = time.monotonic()
    runner.close()
    assert time.monotonic() - start < 2.0
    assert all(not p.is_alive() for p in workers_of(tp2).processes)


@pytest.mark.slow
def test_a_rank_that_hangs_alive_stops_the_engine_after_the_step_timeout(tiny, monkeypatch):
    """The backstop for a rank whose heartbeat goes on while its steps do not (a deadlock outside the GIL): a step's
    collectives time out (STEP_TIMEOUT, 2 s here) and the engine stops with an error that says so, never a hang;
    an engine that idles longer than that does not time out (its workers wait for the next message). Here the
    worker is stopped, with the heartbeat's bound raised past the timeout."""
    from lora_server.distributed import group

    monkeypatch.setattr(group, "STEP_TIMEOUT", timedelta(seconds=2))
    engine = tiny_engine(tiny[0], 2)
    runner = runner_of(engine)
    workers_of(engine).answer_timeout_s = 600.0
    try:
        assert engine.generate(prompts([5]), GREEDY)[0].token_ids == hf_greedy(tiny[1], prompts([5])[0], 8)
        time.sleep(3)  # idle past the timeout
        assert engine.generate(prompts([5]), GREEDY)[0].token_ids == hf_greedy(tiny[1], prompts([5])[0], 8)
        pid = workers_of(engine).pids[0]
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        engine.add(engine.make_request(prompts([5])[0], params, request_id="long"))
        engine.step()
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"timed out after 2 s: a rank is alive but no longer takes part"):
            while engine.has_work():
                engine.step()
        assert time.monotonic() - start < 10
    finally:
        runner.close()  # kills the stopped worker
    assert not any(p.is_alive() for p in workers_of(engine).processes)


def _take_no_message(port: int) -> None:
    """Rank 1 of a two-rank group that joins it, then takes no message (as a rank stopped between two steps)."""
    from lora_server.distributed import group

    group.init_group(1, 2, port)
    time.sleep(120)


@pytest.mark.slow
def test_a_message_no_rank_takes_times_out_on_rank_0(monkeypatch):
    """gloo's sender waits until each receiver takes a broadcast or a scatter (4 bytes as well), and the message
    group has no timeout: a rank that never took the next message (stopped, or deadlocked between two steps) held
    rank 0 for ever, and the step timeout's backstop missed it. Rank 0's sends time out after STEP_TIMEOUT (2 s
    here) as a step's collectives do."""
    import torch.multiprocessing as mp

    from lora_server.distributed import group

    monkeypatch.setattr(group, "STEP_TIMEOUT", timedelta(seconds=2))
    port = free_port()
    peer = mp.get_context("spawn").Process(target=_take_no_message, args=(port,), daemon=True)
    peer.start()
    try:
        comm = group.Comm(0, 2)
        comm.messages = group.init_group(0, 2, port)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="timed out after 2 s: a rank is alive but no longer takes part"):
            comm.broadcast(torch.zeros(1))
        assert time.monotonic() - start < 8
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="timed out after 2 s"):
            comm.scatter_from_first([torch.zeros(1), torch.zeros(1)], torch.zeros(1))
        assert time.monotonic() - start < 8
    finally:
        peer.kill()  # its sockets close: the sends still pending in gloo fail, and the group can go
        peer.join()
        group.destroy_group()


def _join_late(port: int, delay: float) -> None:
    """Rank 1 of a two-rank group that joins ``delay`` s late (a worker building a large host tier), takes one
    broadcast and exits with its value."""
    from lora_server.distributed import group

    time.sleep(delay)
    comm = group.Comm(1, 2)
    comm.messages = group.init_group(1, 2, port)
    value = int(comm.broadcast(torch.zeros(1)).item())
    group.destroy_group()
    sys.exit(value)


@pytest.mark.slow
def test_the_join_waits_its_own_timeout_and_a_failed_one_leaves_the_process_able_to_join(monkeypatch):
    """The rendezvous waits JOIN_TIMEOUT, not a step's timeout: a rank that joins 4 s late, with steps timing out
    after 1 s, joins. A join no rank comes to fails naming the wait (TensorParallelError) and leaves nothing behind:
    the next group in this process joins its peer. (With the step timeout at the join, a loaded CI machine's worker
    came late, and the failed join shifted torch's count of groups, which names their keys: every later engine of
    the process waited out its timeout, 10 minutes each.)"""
    import torch.multiprocessing as mp

    from lora_server.distributed import group

    monkeypatch.setattr(group, "JOIN_TIMEOUT", timedelta(seconds=1))
    port = free_port()
    with pytest.raises(TensorParallelError, match=rf"ranks did not all meet at 127.0.0.1:{port} within 1 s \(rank 0\)"):
        group.init_group(0, 2, port)
    assert not dist.is_initialized()
    monkeypatch.setattr(group, "JOIN_TIMEOUT", timedelta(seconds=120))
    monkeypatch.setattr(group, "STEP_TIMEOUT", timedelta(seconds=1))
    port = free_port()
    peer = mp.get_context("spawn").Process(target=_join_late, args=(port, 4.0), daemon=True)
    peer.start()
    try:
        comm = group.Comm(0, 2)
        comm.messages = group.init_group(0, 2, port)
        comm.broadcast(torch.full((1,), 7.0))
        peer.join(60)
        assert peer.exitcode == 7
    finally:
        peer.kill()
        peer.join()
        group.destroy_group()


ANSWER_S = 2.0  # the heartbeat's bound in these tests


@pytest.mark.slow
def test_a_stopped_rank_fails_the_requests_in_flight_naming_it(tiny, monkeypatch, caplog):
    """A worker SIGSTOPped while requests stream (alive: its exit code None, its collectives waiting in rank 0's
    step): its heartbeat stands still, and within the bound the engine is dead, the streams in flight raise an
    error naming that rank and its pid as stopped, and the log names it, long before the step's collective timeout
    (30 s here, 10 minutes by default), which would blame rank 0's collective instead. The stopped worker is
    killed: a SIGCONT later finds it gone."""
    from lora_server.distributed import group

    monkeypatch.setattr(group, "STEP_TIMEOUT", timedelta(seconds=30))
    engine = tiny_engine(tiny[0], 2)
    ranks = workers_of(engine)
    ranks.answer_timeout_s = ANSWER_S
    pid = ranks.pids[0]
    params = SamplingParams(max_tokens=240, temperature=0, ignore_eos=True)

    async def stop_a_rank_mid_stream() -> tuple[float, list[BaseException]]:
        streams = [engine.submit(engine.make_request(p, params)) for p in prompts([5, 9, 13])]
        for stream in streams:
            assert not (await anext(stream)).finished  # every request runs
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()

        async def error_of(stream) -> BaseException:
            with pytest.raises(EngineDeadError) as raised:
                async for _ in stream:
                    pass
            return raised.value

        errors = await asyncio.gather(*map(error_of, streams))
        return time.monotonic() - start, errors

    try:
        elapsed, errors = asyncio.run(asyncio.wait_for(stop_a_rank_mid_stream(), 120))
        print(f"the streams failed {elapsed:.2f} s after the SIGSTOP")
        named = rf"tensor-parallel rank 1 \(pid {pid}\) has not answered for [\d.]+ s \(process state T: stopped\)"
        for error in errors:
            assert re.search(named, str(error)), error
        assert engine.dead.is_set() and re.search(named, str(engine.dead_error))
        assert elapsed < ANSWER_S + 8.0  # generous: the bound, far below the step's timeout
        assert any(re.search(named, r.getMessage()) for r in caplog.records if r.levelno >= logging.ERROR)
        assert ranks.processes[0].exitcode == -signal.SIGKILL  # killed while stopped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    finally:
        with contextlib.suppress(ProcessLookupError):  # a failed test's worker goes on, so that closing ends
            os.kill(pid, signal.SIGCONT)
        engine.shutdown()
        engine.close()


@pytest.mark.slow
def test_a_rank_stopped_while_the_engine_idles_stops_it(tp2):
    """No step in flight: the heartbeat finds the stopped rank all the same, and the engine thread's idle loop stops
    the engine (the server's /health answers 503 from then on, and it exits non-zero) within the bound."""
    ranks = workers_of(tp2)
    ranks.answer_timeout_s = ANSWER_S
    tp2.start()
    pid = ranks.pids[0]
    os.kill(pid, signal.SIGSTOP)
    try:
        assert tp2.dead.wait(ANSWER_S + 8.0), "the engine did not stop"
        assert f"tensor-parallel rank 1 (pid {pid}) has not answered" in str(tp2.dead_error)
    finally:
        with contextlib.suppress(ProcessLookupError):  # a failed test's worker goes on, so that closing ends
            os.kill(pid, signal.SIGCONT)
        tp2.shutdown()


@pytest.mark.slow
def test_a_rank_that_dies_while_the_engine_idles_stops_its_thread(tp2):
    """The engine thread's idle loop looks at the ranks too: the engine is marked dead (the server exits non-zero on
    it) within seconds, naming the rank."""
    tp2.start()
    pid = workers_of(tp2).pids[0]
    os.kill(pid, signal.SIGKILL)
    assert tp2.dead.wait(5.0), "the engine did not stop"
    assert isinstance(tp2.dead_error, TensorParallelError)
    assert f"rank 1 (pid {pid}) was killed by signal 9" in str(tp2.dead_error)
    tp2.shutdown()


def _running(server: Server) -> float:
    """vllm:num_requests_running on the server's /metrics."""
    found = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", httpx.get(server.url + "/metrics").text, re.M)
    assert found is not None
    return float(found[1])


@pytest.mark.slow
def test_a_server_with_a_stopped_rank_answers_errors_naming_it_and_exits(tmp_path):
    """`lora-server serve --tensor-parallel-size 3` on the embedded model, rank 1 SIGSTOPped while a streamed and a
    whole completion run: within the heartbeat's bound (its default) both get errors in OpenAI's shape naming rank 1
    and its pid, /health stops answering 200 (503 until the process exits), the server exits with status 1, and its
    log names rank 1. (Before the heartbeat: 10 minutes of 200s, then rank 2, healthy, was blamed.)"""
    server = Server(tmp_path, [tmp_path], ["--allow-anonymous", "--tensor-parallel-size", "3"])
    started = re.search(r"tensor-parallel ranks started: rank 1 pid (\d+)", server.log_text())
    assert started is not None
    pid = int(started[1])
    body = {"model": BASE, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    streamed: list[tuple[float, dict]] = []  # (when, the error event)
    wholes: list[tuple[float, httpx.Response]] = []
    streaming = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                streaming.set()
                if line.startswith("data: {") and '"error"' in line:
                    streamed.append((time.monotonic(), json.loads(line[len("data: ") :])))

    def whole() -> None:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        wholes.append((time.monotonic(), r))

    threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while not (streaming.is_set() and _running(server) == 2):
            assert time.monotonic() < deadline, "the two requests did not both run"
            time.sleep(0.2)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        health: tuple[float, int | str] | None = None
        while health is None and time.monotonic() - stopped_at < 60:
            try:
                status: int | str = httpx.get(server.url + "/health", timeout=5).status_code
            except httpx.TransportError:
                status = "gone"  # exited already
            if status != 200:
                health = (time.monotonic() - stopped_at, status)
            time.sleep(0.1)
        assert server.proc.wait(timeout=60) == 1
        for thread in threads:
            thread.join(60)
        named = rf"tensor-parallel rank 1 \(pid {pid}\) has not answered for [\d.]+ s \(process state T: stopped\)"
        (streamed_at, event), (whole_at, response) = *streamed, *wholes
        print(f"after the SIGSTOP: streamed error {streamed_at - stopped_at:.2f} s, whole {whole_at - stopped_at:.2f}")
        print(f"/health {health}")
        assert response.status_code == 503
        for error in (event["error"], response.json()["error"]):
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "service_unavailable"
            assert re.search(named, error["message"]), error
        bound = workers.ANSWER_TIMEOUT_S + 20.0  # generous: the bound, not the step's 10 minutes
        assert health is not None and health[0] < bound and health[1] in (503, "gone")
        assert max(streamed_at, whole_at) - stopped_at < bound
        assert re.search(rf"ERROR lora_server: {named}", server.log_text())
    finally:
        with contextlib.suppress(OSError):  # a failed test leaves no stopped worker behind
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                os.kill(pid, signal.SIGKILL)
        server.stop()
        for thread in threads:
            thread.join(60)
