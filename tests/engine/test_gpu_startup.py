"""GPU tier: start-up on a real GPU, with nothing but torch and triton (dummy weights of a small Llama: no GGUF, no
tokenizer). Warm-up compiles every kernel variant before the first request (a random workload compiles nothing
more); the arena is sized from the memory measured at start and a full-budget step fits beside it; pinned host
memory is exactly the size asked for and copies from it run asynchronously. Every test is marked gpu: skipped where
torch sees no CUDA GPU."""

from __future__ import annotations

import importlib
import json
import pkgutil

import pytest
import torch

from lora_server import kernels
from lora_server.bench.engine import write_random_adapters
from lora_server.bench.kernel_aot import serve_random
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.model.arch import PRESETS
from lora_server.model.pinned import pinned_empty
from lora_server.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

# 2,048 positions: serve_random's prompts reach 1,000 tokens
SMALL = {
    **PRESETS["tiny-llama"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "max_position_embeddings": 2048,
}


def _engine(tmp_path, **kw) -> Engine:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL))
    base = dict(model=str(config), load_format="dummy", device="cuda", dtype="bfloat16", show_progress=False)
    engine = Engine(EngineConfig(**{**base, "max_num_seqs": 16, "max_lora_rank": 16, "block_size": 32, **kw}))
    root = tmp_path / "adapters"
    for name in write_random_adapters(root, 2, [8, 16], engine):
        engine.adapters.add(name, root / name)
    return engine


def _compiled_variants() -> int:
    """Kernel variants Triton holds compiled, over every @triton.jit kernel of the kernels package (its per-device
    caches: ``device_caches[device][0]`` is the compiled kernels by key)."""
    from triton.runtime.jit import JITFunction

    total = 0
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"lora_server.kernels.{info.name}")
        for value in vars(module).values():
            if isinstance(value, JITFunction):
                total += sum(len(cache[0]) for cache in value.device_caches.values())
    return total


@pytest.mark.parametrize("quantization", ["none", "int4", "int8"])
def test_no_request_waits_for_a_compiler(tmp_path, quantization):
    engine = _engine(tmp_path, quantization=quantization)
    startup_s = engine.describe().startup_s
    assert {"weights", "warm-up", "graphs"} <= set(startup_s), startup_s
    before = _compiled_variants()
    assert before > 0
    serve_random(engine, 24)
    assert _compiled_variants() == before  # every variant the workload met was compiled at start


def test_the_arena_is_sized_from_what_start_up_measured(tmp_path):
    share = 0.5
    engine = _engine(tmp_path, gpu_memory_utilization=share, max_num_batched_tokens=512)
    info = engine.describe()
    assert info.activation_bytes > 0 and info.graph_bytes > 0
    total = torch.cuda.mem_get_info()[1]
    # the largest step the engine can take: the token budget over every sequence, each with an adapter
    names = engine.adapters.names()
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.generate([[5] * 32] * 16, params, adapters=[names[i % 2] for i in range(16)])
    free, _ = torch.cuda.mem_get_info()
    assert total - free <= share * total * 1.02, (total - free) / total  # what is in use, all told


def test_pinned_memory_is_the_size_asked_for_and_copies_asynchronously():
    nbytes = 80 * 10**6 + 3  # an 80 MB adapter image: torch's pinned allocator would pin 128 MiB
    host = pinned_empty((nbytes,), torch.uint8, torch.device("cuda"))
    assert host.is_pinned() and host.nbytes == nbytes
    host.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        device.copy_(host, non_blocking=True)
        back = pinned_empty((nbytes,), torch.uint8, torch.device("cuda"))
        back.copy_(device, non_blocking=True)
    stream.synchronize()
    assert torch.equal(back, host)
