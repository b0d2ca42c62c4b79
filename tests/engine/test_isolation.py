"""One request's failure is that request's alone. A fault injected into one request of a running batch (in its
forward pass, its sampling, its detokenizing) or an adapter whose arithmetic overflows ends that request with
RequestFailedError; every other request finishes with the same tokens as when it runs alone, no block stays held
and the pool's integrity holds. Only a device fault stops the engine, and then every stream learns of it."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import save_file

from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.errors import EngineDeadError, RequestFailedError
from lora_server.sampling_params import SamplingParams
from tests.conftest import CHAT_PROMPTS

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
VICTIM = 2  # index of the prompt whose request fails


@pytest.fixture(scope="module")
def engine():
    e = Engine(EngineConfig(quantization="none", kv_cache_bytes=64 << 20, show_progress=False))
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def prompts(engine):
    return [engine.chat_prompt([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:5]]


@pytest.fixture(scope="module")
def alone(engine, prompts):
    return [engine.generate([p], GREEDY)[0].token_ids for p in prompts]


class Injected(RuntimeError):
    """The fault a test injects (not a device fault: its message names no device error)."""


def _is_victim(request, prompts) -> bool:
    return request.prompt_token_ids == prompts[VICTIM]


def _inject(monkeypatch, engine, prompts, site: str, exc: Exception) -> None:
    core = engine.core
    if site == "forward":
        prepare = core.runner.prepare

        def failing_prepare(items):
            if any(_is_victim(r, prompts) for r, _ in items):
                raise exc
            return prepare(items)

        monkeypatch.setattr(core.runner, "prepare", failing_prepare)
    elif site == "sampling":
        sampler = core.runner.sampler

        def failing_sampler(logits, requests, mask=None):
            if any(_is_victim(r, prompts) for r in requests):
                raise exc
            return sampler(logits, requests, mask)

        monkeypatch.setattr(core.runner, "sampler", failing_sampler)
    else:  # detokenizing its third token
        detokenize = core._detokenize

        def failing_detokenize(request, token):
            if _is_victim(request, prompts) and request.num_output_tokens == 3:
                raise exc
            return detokenize(request, token)

        monkeypatch.setattr(core, "_detokenize", failing_detokenize)


def _assert_clean(engine) -> None:
    engine.check_integrity()
    assert engine.pool_report().request_blocks == 0  # no request holds a block
    assert not engine.has_work()


@pytest.mark.parametrize("site", ["forward", pytest.param("sampling", marks=pytest.mark.slow), "detokenizing"])
def test_failure_in_one_request_fails_it_alone(monkeypatch, engine, prompts, alone, site):
    _inject(monkeypatch, engine, prompts, site, Injected("boom"))
    out = engine.generate(prompts, GREEDY)
    for i, c in enumerate(out):
        if i == VICTIM:
            assert c.finish_reason == "error" and "Injected: boom" in c.error
        else:
            assert c.token_ids == alone[i] and c.error is None
    _assert_clean(engine)
    monkeypatch.undo()
    assert engine.generate([prompts[VICTIM]], GREEDY)[0].token_ids == alone[VICTIM]  # the engine is whole


@pytest.mark.slow
def test_failure_in_a_running_stream_fails_that_stream_alone(monkeypatch, engine, prompts, alone):
    _inject(monkeypatch, engine, prompts, "detokenizing", Injected("mid-stream"))

    async def run() -> list[list[int] | BaseException]:
        async def one(prompt) -> list[int]:
            tokens: list[int] = []
            async for out in engine.add_request(prompt, GREEDY):
                tokens.extend(out.token_ids)
            return tokens

        return await asyncio.gather(*(one(p) for p in prompts), return_exceptions=True)

    try:
        results = asyncio.run(run())
    finally:
        engine.shutdown()  # generate() needs the engine thread stopped
    for i, got in enumerate(results):
        if i == VICTIM:
            assert isinstance(got, RequestFailedError) and got.http_status == 500 and "mid-stream" in got.message
        else:
            assert got == alone[i]
    _assert_clean(engine)
    assert not engine.dead.is_set()


def _overflowing_adapter(path) -> None:
    """A valid PEFT adapter (finite weights, finite scaling) whose product x @ A.T @ B.T overflows float32 in
    layer 0's q_proj: its requests get non-finite logits."""
    path.mkdir()
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {f"{key}.lora_A.weight": torch.full((2, 576), 1e19), f"{key}.lora_B.weight": torch.full((576, 2), 1e19)},
        str(path / "adapter_model.safetensors"),
    )
    (path / "adapter_config.json").write_text(
        json.dumps(dict(peft_type="LORA", r=2, lora_alpha=2, target_modules=["q_proj"], layers_to_transform=[0]))
    )


@pytest.mark.slow
def test_overflowing_adapter_fails_its_request_alone(tmp_path, engine, prompts, alone):
    _overflowing_adapter(tmp_path / "overflow")
    engine.adapters.add("overflow", tmp_path / "overflow")
    try:
        adapters = [None] * len(prompts)
        adapters[VICTIM] = "overflow"
        out = engine.generate(prompts, GREEDY, adapters=adapters)
    finally:
        engine.adapters.remove("overflow")
    assert out[VICTIM].finish_reason == "error" and "non-finite logits" in out[VICTIM].error
    assert [c.token_ids for i, c in enumerate(out) if i != VICTIM] == [a for i, a in enumerate(alone) if i != VICTIM]
    _assert_clean(engine)


@pytest.mark.slow
def test_device_fault_stops_the_engine_and_every_stream_learns_it(monkeypatch, prompts):
    engine = Engine(EngineConfig(quantization="none", kv_cache_bytes=64 << 20, show_progress=False))
    _inject(
        monkeypatch, engine, prompts, "forward", RuntimeError("CUDA error: an illegal memory access was encountered")
    )

    async def run() -> list[BaseException | list[int]]:
        async def one(prompt) -> list[int]:
            return [t async for out in engine.add_request(prompt, GREEDY) for t in out.token_ids]

        return await asyncio.gather(*(one(p) for p in prompts), return_exceptions=True)

    results = asyncio.run(run())
    assert all(isinstance(r, EngineDeadError) and r.http_status == 503 for r in results)
    assert engine.dead.wait(5) and "illegal memory access" in str(engine.dead_error)

    async def after() -> None:
        engine.add_request(prompts[0], GREEDY)

    with pytest.raises(EngineDeadError):
        asyncio.run(after())
    engine.shutdown()
