"""Tensor parallelism on the CPU (gloo): greedy tokens at TP=2 / TP=3 equal TP=1's and HF transformers' at fp32, the
collectives of a step counted against hand-computed values, the refusals, and a killed worker rank stopping the
engine with an error that names it, within seconds."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from lora_server.adapters.peft_format import AdapterError
from lora_server.config import EngineConfig, ServerConfig
from lora_server.engine import Engine
from lora_server.errors import ConfigError, TensorParallelError
from lora_server.model import sampler
from lora_server.sampling_params import SamplingParams
from tests import test_adapter_keys, test_architectures
from tests.test_adapter_keys import TINY
from tests.test_model_vs_hf import _compare, _hf_logprobs
from tests.test_prompt_logprobs import _check

tiny = test_adapter_keys.tiny  # a random tiny Llama in HF's format and the model (fp32): 2 layers, 4 heads, 2 KV

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


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
    engine.core.runner.close()


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
        engine.core.runner.close()


def test_tp1_runs_without_a_process_group(tiny):
    before = dist.is_initialized()
    assert tiny_engine(tiny[0], 1).core.runner.tp is None
    assert dist.is_initialized() == before


def test_ray_replicas_are_refused_with_tensor_parallelism():
    """Each replica a TP group on a placement group is not built: the combination is refused, not half-served."""
    with pytest.raises(ValueError, match="--ray-replicas with --tensor-parallel-size above 1 is not served yet"):
        ServerConfig(engine=EngineConfig(tensor_parallel_size=2, quantization="none"), ray_replicas=2)


def test_tp3_is_refused_where_the_heads_do_not_divide(tiny):
    with pytest.raises(ConfigError, match=r"num_heads \(4\) and num_kv_heads \(2\)"):
        tiny_engine(tiny[0], 3)


def test_quantized_weights_and_other_unsharded_features_are_refused():
    with pytest.raises(ValueError, match="quantization int8"):
        EngineConfig(tensor_parallel_size=2, quantization="int8", host_kv_bytes=0)
    with pytest.raises(ValueError, match="fp8 KV cache"):
        EngineConfig(tensor_parallel_size=2, quantization="none", host_kv_bytes=0, kv_cache_dtype="fp8")


@pytest.mark.slow
def test_adapters_are_refused(tp2, tmp_path):
    with pytest.raises(AdapterError, match="not served with --tensor-parallel-size 2"):
        tp2.add_adapter("a", tmp_path)


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


@pytest.mark.slow
def test_the_collectives_of_each_step(tp2):
    """Two prompts of 5 and 7 tokens (under the long-prefill cap, 32 // 4), 3 tokens each: one prefill step (12
    tokens) and two decode steps (2 tokens). Per step: the embedding's all-reduce and two per layer (o, down), each
    of [T, hidden] float32; one gather of each rank's [S, ceil(V/2)] logits; one broadcast of the step message."""
    counter = tp2.core.runner.tp.comm.counter
    counter.reset()
    tp2.generate(prompts([5, 7]), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    hidden, layers, vocab_half = TINY["hidden_size"], TINY["num_hidden_layers"], TINY["vocab_size"] // 2
    tokens = 12 + 2 + 2
    assert counter.calls == {"all_reduce": 3 * (2 * layers + 1), "gather": 3, "broadcast": 3}
    # the message: 17 header values, 4 per-token arrays of the runner's most tokens a step (max(32, max_num_seqs
    # 64) = 64), 3 per-sequence arrays of max_num_seqs + 1 (65), 2 values per new block (64 // 16 + 64), int64
    message = (17 + 4 * 64 + 3 * 65 + 2 * (4 + 64)) * 8
    assert counter.bytes == {
        "all_reduce": (2 * layers + 1) * tokens * hidden * 4,
        "gather": 3 * 2 * vocab_half * 4,
        "broadcast": 3 * message,
    }


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
        engine.core.runner.close()


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
        counter = engine.core.runner.tp.comm.counter
        counter.reset()
        assert [o.token_ids for o in engine.generate(prompt, GREEDY)] == expected
        # served from the cache: 8 steps, each sampling (the prompt's last block, then 7 decodes); the first sent
        # its arrays in two broadcasts
        assert counter.calls == {"all_reduce": 8 * (2 * TINY["num_hidden_layers"] + 1), "gather": 8, "broadcast": 9}
    finally:
        engine.core.runner.close()


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
        counters = engine.core.pool.tree.counters
        assert counters["kv_swap_out"] > 0 and counters["kv_swap_in"] > 0, dict(counters)
    finally:
        engine.core.runner.close()


@pytest.mark.slow
def test_a_killed_rank_stops_the_engine_with_an_error_naming_it(tiny):
    engine = tiny_engine(tiny[0], 2)
    runner = engine.core.runner
    pid = runner.tp.workers.pids[0]
    params = SamplingParams(max_tokens=240, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts([5] * 8)):
        engine.add(engine.core.make_request(f"r{i}", prompt, params))
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
def test_embedded_model_tp3_greedy_equals_tp1(engine_fp32):
    """SmolLM2-135M: 9 heads, 3 KV heads; TP=2 is refused, and so are its Q4_1 / Q8_0 blocks as they are (auto);
    TP=3 at fp32 gives TP=1's greedy tokens."""
    config = dict(quantization="none", kv_cache_bytes=64 << 20, host_kv_bytes=0, show_progress=False)
    with pytest.raises(ConfigError, match=r"num_heads \(9\) and num_kv_heads \(3\)"):
        Engine(EngineConfig(tensor_parallel_size=2, **config))
    with pytest.raises(ConfigError, match=r"--quantization auto holds \w+ as int[48]"):  # the GGUF's own blocks
        Engine(EngineConfig(tensor_parallel_size=3, **{**config, "quantization": "auto"}))
    batch = [engine_fp32.core.encode(text) for text in ("The capital of France is", "1, 2, 3, 4,")]
    expected = [o.token_ids for o in engine_fp32.generate(batch, GREEDY)]
    engine = Engine(EngineConfig(tensor_parallel_size=3, **config))
    try:
        assert [o.token_ids for o in engine.generate(batch, GREEDY)] == expected
    finally:
        engine.core.runner.close()


@pytest.mark.slow
def test_a_rank_that_dies_while_the_engine_idles_stops_its_thread(tp2):
    """The engine thread's idle loop looks at the ranks too: the engine is marked dead (the server exits non-zero on
    it) within seconds, naming the rank."""
    tp2.start()
    pid = tp2.core.runner.tp.workers.pids[0]
    os.kill(pid, signal.SIGKILL)
    assert tp2.dead.wait(5.0), "the engine did not stop"
    assert isinstance(tp2.dead_error, TensorParallelError)
    assert f"rank 1 (pid {pid}) was killed by signal 9" in str(tp2.dead_error)
    tp2.shutdown()
