"""EngineConfig refuses bad values at construction, naming the field (nothing is loaded)."""

from __future__ import annotations

import pytest
import torch

from lora_server.config import EngineConfig


@pytest.mark.parametrize("field, value", [
    ("pool_policy", "fifo"), ("gpu_memory_utilization", 0.0), ("gpu_memory_utilization", 1.5),
    ("host_kv_bytes", -1), ("block_size", 0), ("kv_cache_bytes", 0), ("max_loras", 0), ("num_kv_blocks", 0),
    ("quantization", "int3"), ("load_format", "onnx"), ("dtype", "float8"),
])
def test_bad_values_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_defaults_and_good_values():
    config = EngineConfig(pool_policy="lru-separate", gpu_memory_utilization=0.9, host_kv_bytes=0)
    assert (config.pool_policy, config.gpu_memory_utilization, config.host_kv_bytes) == ("lru-separate", 0.9, 0)
    assert EngineConfig().pool_policy == "tree-cost"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            EngineConfig(device="cuda")
