"""The CPU decode step with one C call a layer (model.fused_decode) against the same layers' calls one by one
(LORA_SERVER_FUSED_DECODE=0, the path the model tests check against HF): on the embedded model (Q4_1, int4 on the
CPU) the same tokens and log-probabilities bit for bit, for one sequence and for four decoding together, and with
an adapter's request among them (its steps run the layer in three C calls, the LoRA added between them). Every case
checks that the fused step did run. A model whose layers are not int4 does not take it."""

from __future__ import annotations

import pytest

from lora_server.adapters import demo_adapters
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.model.quant import cpu_gemv_library
from lora_server.sampling_params import SamplingParams
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.skipif(cpu_gemv_library() is None, reason="the CPU's int4 kernel needs AVX-512 VNNI and VBMI")
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    fused, plain = Engine(EngineConfig(show_progress=False)), Engine(EngineConfig(show_progress=False))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LORA_SERVER_FUSED_DECODE", "0")
        assert plain.model.fused_decode() is None  # built now, under the switch
    assert fused.model.fused_decode() is not None
    for engine in (fused, plain):
        engine.adapters.add("pirate", demo_adapters()["pirate"])
    return fused, plain


def _served(engine: Engine, prompts: list[str], adapters: list[str | None], salt: str) -> list:
    ids = [engine.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    outs = engine.generate(ids, PARAMS, adapters=adapters, cache_salt=salt)
    return [(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs]) for o in outs]


@pytest.mark.parametrize(
    "adapters",
    [[None], [None] * 4, ["pirate", None, None]],
    ids=["one", "four", "with-an-adapter"],
)
def test_the_same_tokens_and_logprobs_as_the_calls_one_by_one(engines, adapters, monkeypatch):
    fused, plain = engines
    steps = fused.model.fused_decode()
    assert steps is not None
    ran = []
    forward = steps.forward
    monkeypatch.setattr(steps, "forward", lambda *a: ran.append(a[1].lora is not None) or forward(*a))
    prompts = CHAT_PROMPTS[: len(adapters)]
    assert _served(fused, prompts, adapters, "fused") == _served(plain, prompts, adapters, "plain")
    assert len(ran) >= PARAMS.max_tokens - 1 and any(ran) == any(adapters)  # decode steps, with the adapter's LoRA
    fused.check_integrity()


def test_a_model_not_on_int4_weights_does_not_take_it():
    engine = Engine(EngineConfig(quantization="none", show_progress=False))
    assert engine.model.fused_decode() is None
