"""Decode steps padded to their CUDA graph bucket, run eagerly on the CPU: the embedded model in fp32 with the demo
adapters gives the same greedy tokens as the unpadded batch (whose tokens the HF + PEFT tests check), in the
padded layout the meta stand-in for CUDA runs and in the layout a captured graph reads (block tables at full
width, the LoRA mapping even for a batch without adapters)."""

from __future__ import annotations

import pytest

from lora_server.adapters import demo_adapters
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.model.cuda_graphs import decode_buckets
from lora_server.sampling_params import SamplingParams
from tests.conftest import CHAT_PROMPTS, runner_of

NEW_TOKENS = 8
MIXED = [None, "upper", "pirate", "emoji", None]  # 5 requests: decode steps padded to the bucket of 8
BASE = [None, None, None]  # no adapter: padded to 4


@pytest.fixture(scope="module")
def engine():
    engine = Engine(EngineConfig(quantization="none", kv_cache_bytes=64 << 20, max_model_len=256, show_progress=False))
    for name, path in demo_adapters().items():
        engine.adapters.add(name, path)
    return engine


def _generate(engine: Engine, plan: list[str | None]) -> list[list[int]]:
    prompts = [engine.chat_prompt([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[: len(plan)]]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    return [c.token_ids for c in engine.generate(prompts, params, adapters=plan)]


@pytest.fixture(scope="module")
def unpadded_mixed(engine):
    assert runner_of(engine).decode_buckets == []  # the CPU does not pad
    return _generate(engine, MIXED)


@pytest.fixture(scope="module")
def unpadded_base(engine):
    return _generate(engine, BASE)


@pytest.mark.parametrize(
    ("plan", "graph_layout"),
    [
        pytest.param("mixed", True, id="graph"),
        pytest.param("mixed", False, id="padded", marks=pytest.mark.slow),
        pytest.param("base", True, id="base", marks=pytest.mark.slow),
    ],
)
def test_padded_decode_steps_give_the_unpadded_tokens(request, monkeypatch, engine, plan, graph_layout):
    unpadded = request.getfixturevalue(f"unpadded_{plan}")
    runner = runner_of(engine)
    monkeypatch.setattr(runner, "decode_buckets", decode_buckets(engine.config.max_num_seqs))
    monkeypatch.setattr(runner, "graph_layout", graph_layout)
    prepare, batches = runner.prepare, []

    def spied(items):
        batch, sampling = prepare(items)
        batches.append(batch)
        return batch, sampling

    monkeypatch.setattr(runner, "prepare", spied)
    requests = MIXED if plan == "mixed" else BASE
    assert _generate(engine, requests) == unpadded
    decodes = [b for b in batches if b.num_padding]
    bucket = 8 if plan == "mixed" else 4
    assert len(decodes) >= NEW_TOKENS - 1 and all(b.num_tokens == bucket for b in decodes)
    width = runner.block_tables.width if graph_layout else 1
    assert all(b.block_tables.shape[1] >= width for b in decodes)
    if graph_layout:  # the LoRA mapping a graph was captured with is there even when no row has an adapter
        assert all(b.lora is not None for b in decodes)
    for b in decodes:  # padding rows have no adapter
        segments = [] if b.lora is None else b.lora.host_segments
        assert all(end <= b.num_tokens - b.num_padding for _, end, _ in segments)
