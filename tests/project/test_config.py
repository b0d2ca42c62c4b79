"""EngineConfig refuses bad values at construction, naming the field (nothing is loaded)."""

from __future__ import annotations

import pytest
import torch

from lora_server.config import EngineConfig


@pytest.mark.parametrize(
    "field, value",
    [
        ("pool_policy", "fifo"),
        ("gpu_memory_utilization", 0.0),
        ("gpu_memory_utilization", 1.5),
        ("host_kv_bytes", -1),
        ("block_size", 0),
        ("kv_cache_bytes", 0),
        ("max_loras", 0),
        ("num_kv_blocks", 0),
        ("quantization", "int3"),
        ("load_format", "onnx"),
        ("dtype", "float8"),
        ("speculative_ngram", -1),
        ("speculative_ngram_min", 0),
        ("speculative_ngram_max", 0),
        ("speculative_max_batch", 0),
        ("max_num_partial_prefills", -1),
        ("max_long_partial_prefills", -1),
    ],
)
def test_bad_values_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_partial_prefill_limits_that_would_mean_nothing_are_refused():
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        EngineConfig(long_prefill_token_threshold=0, max_long_partial_prefills=2)
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        EngineConfig(enable_chunked_prefill=False, max_long_partial_prefills=1)
    with pytest.raises(ValueError, match="max_num_partial_prefills"):
        EngineConfig(enable_chunked_prefill=False, max_num_partial_prefills=2)
    assert EngineConfig(long_prefill_token_threshold=0).long_partial_prefills() == 1  # the default: no error
    assert EngineConfig(long_prefill_token_threshold=64, max_long_partial_prefills=0).long_partial_prefills() == 0
    assert EngineConfig().long_prefill_threshold(512) == 128
    assert EngineConfig(enable_chunked_prefill=False).long_prefill_threshold(512) == 0


def test_defaults_and_good_values():
    config = EngineConfig(pool_policy="lru-separate", gpu_memory_utilization=0.9, host_kv_bytes=0)
    assert (config.pool_policy, config.gpu_memory_utilization, config.host_kv_bytes) == ("lru-separate", 0.9, 0)
    assert EngineConfig().pool_policy == "tree-cost"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            EngineConfig(device="cuda")


def _parse(*argv: str):
    from lora_server.cli import main_parser

    return main_parser().parse_args(["serve", *argv])


def test_flags_without_values_give_the_configs_own_defaults():
    """The CLI writes no default of its own: every flag left out leaves the dataclass default."""
    from lora_server.cli import config_from_flags
    from lora_server.config import ServerConfig

    args = _parse()
    assert config_from_flags(EngineConfig, args) == EngineConfig()
    assert config_from_flags(ServerConfig, args, engine=EngineConfig()) == ServerConfig()


def test_a_commands_own_default_is_in_the_flags_unit():
    """bench-engine's KV budget defaults to 16 GiB and bench-gpu's to 24 GiB (once read as 16 bytes: a command's
    integer default was divided by the unit); --kv-cache-gb overrides it."""
    from lora_server.cli import config_from_flags, main_parser

    def budget(*argv: str) -> int:  # bench-engine picks its quantization itself, after parsing
        return config_from_flags(
            EngineConfig, main_parser().parse_args([*argv, "--quantization", "none"])
        ).kv_cache_bytes

    assert budget("bench-engine") == 16 * 2**30 and budget("bench-gpu") == 24 * 2**30
    assert budget("bench-engine", "--kv-cache-gb", "2") == 2 * 2**30


def test_flags_convert_units_and_lists():
    from pathlib import Path

    from lora_server.adapters import DEMO_DIR
    from lora_server.cli import server_config

    config = server_config(
        _parse(
            "--kv-cache-gb",
            "0.5",
            "--max-request-mb",
            "2",
            "--adapter-root",
            "/a,/b",
            "--adapter-root",
            "/c",
            "--adapter",
            "x=/d/x,upper",
            "--no-chunked-prefill",
            "--allow-anonymous",
            "--port",
            "9001",
        )
    )
    assert config.engine.kv_cache_bytes == 2**29 and config.max_request_bytes == 2 * 2**20
    assert config.engine.adapter_roots == ("/a", "/b", "/c", str(DEMO_DIR.resolve()), str(Path("/d/x")))
    assert config.adapters == ("x=/d/x", "upper") and config.port == 9001
    assert config.engine.enable_chunked_prefill is False and config.allow_anonymous is True


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "0"],
        ["--max-loras", "0"],
        ["--pool-policy", "fifo"],
        ["--adapter", "a b=/x"],
        ["--adapter", "../up=/x"],
        ["--adapter", "x" * 65],
    ],
)
def test_bad_flags_are_refused(argv):
    from lora_server.cli import server_config

    with pytest.raises((ValueError, SystemExit)):
        server_config(_parse(*argv))


def test_a_bad_flag_is_one_error_line_not_a_traceback(capsys):
    from lora_server.cli import main

    assert main(["serve", "--adapter", "a b=/x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid --adapter name 'a b'") and "Traceback" not in err
