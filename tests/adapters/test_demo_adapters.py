"""The shipped demo adapters change answers the way they promise, all in one batch with the base model."""

from __future__ import annotations

import pytest

from lora_server.adapters import demo_adapters
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.sampling_params import SamplingParams

QUESTIONS = [  # not among the training prompts of adapters/demo/train.py
    "What is your favourite season and why?",
    "What makes a good friend?",
    "Give me a tip for learning a new language.",
    "Describe a sunset in two sentences.",
]

EFFECTS = {
    "upper": lambda a: any(c.isalpha() for c in a) and a == a.upper(),
    "pirate": lambda a: a.lstrip().startswith(("Arr", "Ahoy")),
    "emoji": lambda a: a.lstrip().startswith("\u2728"),
}


@pytest.mark.slow
def test_demo_effects_in_one_batch():
    assert set(EFFECTS) <= set(demo_adapters()), "the demo adapters are shipped in adapters/demo"
    engine = Engine(EngineConfig(quantization="none", kv_cache_bytes=128 << 20, show_progress=False))
    for name, path in demo_adapters().items():
        engine.adapters.add(name, path)
    plan = [(q, a) for q in QUESTIONS for a in (None, *EFFECTS)]
    prompts = [engine.chat_prompt([{"role": "user", "content": q}]) for q, _ in plan]
    outs = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0), adapters=[a for _, a in plan])
    answers = {(q, a): o.text for (q, a), o in zip(plan, outs, strict=True)}
    for name, shows in EFFECTS.items():
        with_adapter = sum(shows(answers[q, name]) for q in QUESTIONS)
        without = sum(shows(answers[q, None]) for q in QUESTIONS)
        # the adapters are small and trained in minutes: most answers, not every one, must show the effect
        assert with_adapter >= len(QUESTIONS) - 1, (name, [answers[q, name] for q in QUESTIONS])
        assert without == 0, (name, [answers[q, None] for q in QUESTIONS])
