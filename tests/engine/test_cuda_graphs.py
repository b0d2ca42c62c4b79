"""GPU tier: the decode CUDA graphs. One graph per bucket is captured at start (none with --enforce-eager); a padded
decode batch replayed through its graph gives the hidden states of the same batch run eagerly, bit for bit (the
same kernels on the same inputs); the step's inputs reach the device in one copy from pinned memory and nothing
synchronizes before the sampler reads its tokens back; the engine with graphs gives the tokens of the engine
without. Every test is marked gpu: skipped where torch sees no CUDA GPU."""

from __future__ import annotations

import itertools

import pytest
import torch

from lora_server.adapters import demo_adapters
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.instrument.host_work import no_sync_or_pageable_copy
from lora_server.model.cuda_graphs import decode_buckets
from lora_server.sampling_params import SamplingParams
from tests.conftest import CHAT_PROMPTS, runner_of, scheduler_of

pytestmark = pytest.mark.gpu

MAX_SEQS = 16
PLAN = [None, "upper", "pirate", "emoji", "upper"]  # decode steps padded to the bucket of 8
_IDS = itertools.count()


def _engine(**kw) -> Engine:
    config = EngineConfig(
        device="cuda", dtype="float32", quantization="none", max_num_seqs=MAX_SEQS, show_progress=False, **kw
    )
    engine = Engine(config)
    for name, path in demo_adapters().items():
        engine.adapters.add(name, path)
    return engine


@pytest.fixture(scope="module")
def engine(smollm2_path):  # the embedded model (skipped, saying why, on a GPU machine without it)
    return _engine()


def _prompts(engine: Engine) -> list[list[int]]:
    return [engine.chat_prompt([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[: len(PLAN)]]


def _drain(engine: Engine) -> None:
    """Finish what an earlier test of the module left running (one that failed midway)."""
    while engine.has_work():
        engine.step()


def _decoding(engine: Engine):
    """Add PLAN's requests and step until they all decode; returns the scheduler's running requests."""
    _drain(engine)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    # staged on the host first: else the base request may decode all its tokens while the loader reads the
    # adapters from disk (on a GPU, 32 steps take less time than that read)
    engine.adapters.stage(sorted({a for a in PLAN if a}))
    for prompt, adapter in zip(_prompts(engine), PLAN, strict=True):
        engine.add(engine.make_request(prompt, params, adapter, request_id=f"graph-{next(_IDS)}"))
    ended = []
    while not engine.snapshot().decoding:
        ended += [(out.request_id, out.finish_reason, out.error) for out in engine.step() if out.finished]
    running = list(scheduler_of(engine).running)
    assert len(running) == len(PLAN), ended  # none ended early (a failed adapter load would)
    return running


def test_one_graph_per_bucket_and_none_when_eager(engine):
    graphs = runner_of(engine).graphs
    assert graphs is not None and graphs.buckets == decode_buckets(MAX_SEQS) == [1, 2, 4, 8, 16]
    eager = runner_of(_engine(enforce_eager=True))
    assert eager.graphs is None and eager.decode_buckets == []


@torch.inference_mode()
def test_replay_equals_the_eager_forward(engine):
    running = _decoding(engine)
    runner = runner_of(engine)
    # prepare() outside a step: every next token's KV slot must lie in a block the scheduler already gave (a token
    # that opens a block gets it in the step's schedule); among any 16 steps at most 5 put one of 5 requests there
    while any(r.num_computed_tokens // runner.block_size >= len(r.block_table) for r in running):
        engine.step()
        running = list(scheduler_of(engine).running)
        assert len(running) == len(PLAN)
    batch, _ = runner.prepare([(r, 1) for r in running])
    assert batch.num_tokens == 8 and batch.num_padding == 8 - len(running)
    eager = runner._eager_forward(batch)[: len(running)].clone()  # rewrites the same KV slots with the same values
    graphed = runner.graphs.replay(batch)
    assert graphed is not None
    torch.testing.assert_close(graphed[: len(running)], eager, rtol=0, atol=0)
    while engine.has_work():
        engine.step()


def test_decode_step_copies_once_from_pinned_memory_and_syncs_once(engine):
    _decoding(engine)
    for _ in range(3):
        with no_sync_or_pageable_copy("cuda", allowed_syncs=1) as work:
            engine.step()
        assert work.h2d == 1 and work.h2d_pageable == 0 and work.syncs == 1, work.summary()
    while engine.has_work():
        engine.step()


def test_graphs_give_the_eager_engines_tokens(engine):
    _drain(engine)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    graphed = engine.generate(_prompts(engine), params, adapters=PLAN)
    eager_engine = _engine(enforce_eager=True)
    eager = eager_engine.generate(_prompts(eager_engine), params, adapters=PLAN)
    assert [c.token_ids for c in graphed] == [c.token_ids for c in eager]
