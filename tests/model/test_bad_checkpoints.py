"""No checkpoint can hurt the server: every checkpoint `--model` takes (an HF directory, sharded with its index or
not; a GGUF file; a pre-quantized HF checkpoint; `--load-format dummy` with a config.json) is checked before anything
is sized from it. A bad one stops `serve`, `generate` and `export-tokenizer` with exit status 2 and one `error:`
line naming the file and the setting or tensor at fault: no traceback, no server that reports healthy and then
fails every request, no memory sized from a number nobody checked (a config.json claiming 10**9 layers fails in
the memory of an idle process).

Each bad checkpoint is a good tiny one (built here by transformers or gguf's writer) with one thing changed; the
good ones load (tests/model/test_checkpoint_formats.py and the families' tests serve them)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_server.cli import main
from lora_server.model.arch import PRESETS, ModelArch
from tests.servers import free_port

DROP = object()  # a config change that removes the key
PEAK_RSS_BOUND_KB = 1 << 20  # 1 GiB: an idle serve process; before the checks, 10**9 layers reached 7.9 GB


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny Llama saved by transformers: vocabulary 256, hidden 64, 4 query and 2 key/value heads of 16,
    intermediate 96, 2 layers, untied head; config.json as transformers 5 writes it (head_dim and rope_parameters
    included)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny")
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _variant(tiny: Path, dest: Path, **changes) -> Path:
    """A copy of the tiny checkpoint with config.json's keys changed (DROP: removed)."""
    shutil.copytree(tiny, dest)
    config = json.loads((dest / "config.json").read_text())
    for key, value in changes.items():
        if value is DROP:
            del config[key]
        else:
            config[key] = value
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def _refused(capsys, argv: list[str], file: Path, *named: str) -> str:
    """``lora-server ARGV`` in this process: exit status 2 and exactly one stderr line, an ``error:`` naming ``file``
    and each of ``named``; the line."""
    status = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert str(file) in lines[0], lines[0]
    for word in named:
        assert word in lines[0], lines[0]
    return lines[0]


def _generate(model: Path, *flags: str) -> list[str]:
    return ["generate", "--model", str(model), *flags, "--raw", "--max-tokens", "1", "hello"]


# ---- config.json ------------------------------------------------------------------------------------------------

# case -> (config.json changes, the file the error names, the words it names)
CONFIG_CASES = {
    "vocab_size 10**12": ({"vocab_size": 10**12}, "config.json", ("vocab_size",)),
    "vocab_size 0": ({"vocab_size": 0}, "config.json", ("vocab_size",)),
    "no attention heads": ({"num_attention_heads": 0}, "config.json", ("num_attention_heads",)),
    "no heads and no head_dim": ({"num_attention_heads": 0, "head_dim": DROP}, "config.json", ("num_attention_heads",)),
    "3 key/value heads for 4": ({"num_key_value_heads": 3}, "config.json", ("num_key_value_heads",)),
    "heads that do not divide hidden_size": (
        {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": DROP},
        "config.json",
        ("num_attention_heads", "hidden_size"),
    ),
    "NaN rms_norm_eps": ({"rms_norm_eps": float("nan")}, "config.json", ("rms_norm_eps",)),
    "negative hidden_size": ({"hidden_size": -64}, "config.json", ("hidden_size",)),
    "hidden_size as text": ({"hidden_size": "64"}, "config.json", ("hidden_size",)),
    "no hidden_size": ({"hidden_size": DROP}, "config.json", ("hidden_size",)),
    "half a layer": ({"num_hidden_layers": 2.5}, "config.json", ("num_hidden_layers",)),
    "intermediate_size 0": ({"intermediate_size": 0}, "config.json", ("intermediate_size",)),
    "max_position_embeddings 0": ({"max_position_embeddings": 0}, "config.json", ("max_position_embeddings",)),
    "architectures as text": ({"architectures": "LlamaForCausalLM"}, "config.json", ("architectures",)),
    "eos_token_id as text": ({"eos_token_id": "</s>"}, "config.json", ("eos_token_id",)),
    "negative rope_theta": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}},
        "config.json",
        ("rope_theta",),
    ),
    "infinite rope_theta": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}},
        "config.json",
        ("rope_theta",),
    ),
    "llama3 RoPE without its frequency factors": (
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}},
        "config.json",
        ("low_freq_factor",),
    ),
    # ... and each against the tensors' own shapes, from the safetensors header
    "more layers than the tensors hold": ({"num_hidden_layers": 3}, "config.json", ("num_hidden_layers", "layer 2")),
    "fewer layers than the tensors hold": (
        {"num_hidden_layers": 1},
        "model.safetensors",
        ("num_hidden_layers", "model.layers.1."),
    ),
    "vocab_size other than the embedding's rows": (
        {"vocab_size": 128},
        "model.safetensors",
        ("vocab_size 128", "has shape (256, 64)"),
    ),
    "head_dim other than q_proj's": ({"head_dim": 32}, "model.safetensors", ("head_dim 32", "_proj.weight")),
    "intermediate_size other than the MLP's": (
        {"intermediate_size": 128},
        "model.safetensors",
        ("intermediate_size 128", "mlp."),
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_settings_are_checked_before_use(tiny, tmp_path, capsys, case):
    changes, file, named = CONFIG_CASES[case]
    model = _variant(tiny, tmp_path / "model", **changes)
    _refused(capsys, _generate(model), model / file, *named)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_shipped_shapes_pass_the_checks(name):
    """Every shape the benchmarks and the ahead-of-time compile build (their hub config.json values) passes the
    checks: a check that refuses a good config is a defect too (Phi-4-mini's LongRoPE keeps its
    original_max_position_embeddings at the config's top level, as Phi3Config does; refused once)."""
    arch = ModelArch.from_hf_config(PRESETS[name])
    assert arch.num_layers == PRESETS[name]["num_hidden_layers"]
    if name == "phi-4-mini":  # the context capped at the original 4,096; attention sqrt(1 + ln 32 / ln 4096)
        assert arch.max_position_embeddings == 4096
        assert arch.rope_attention_factor == pytest.approx((17 / 12) ** 0.5)


def test_a_config_that_is_not_a_json_object_is_refused(tiny, tmp_path, capsys):
    model = _variant(tiny, tmp_path / "model")
    (model / "config.json").write_text('{"vocab_size": 256,')
    _refused(capsys, _generate(model), model / "config.json", "not valid JSON")
    (model / "config.json").write_text("[1, 2]")
    _refused(capsys, _generate(model), model / "config.json", "JSON object")


def test_export_tokenizer_checks_the_config_too(tiny, tmp_path, capsys):
    model = _variant(tiny, tmp_path / "model", num_attention_heads=0)
    argv = ["export-tokenizer", str(tmp_path / "out"), "--model", str(model)]
    _refused(capsys, argv, model / "config.json", "num_attention_heads")


def test_a_broken_tokenizer_is_refused_in_one_line(tiny, tmp_path, capsys):
    """A tokenizer.json that is not one (cut short): one error line naming the file (it was a traceback of the
    tokenizers package's plain Exception)."""
    model = _variant(tiny, tmp_path / "model")
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {')
    _refused(capsys, _generate(model), model / "tokenizer.json", "tokenizer")


# ---- safetensors ------------------------------------------------------------------------------------------------


def _rewrite_header(file: Path, change) -> None:
    """The safetensors file with its JSON header changed by ``change(header)``, its data as it was."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def test_cut_or_lying_safetensors_are_refused(tiny, tmp_path, capsys):
    model = _variant(tiny, tmp_path / "model")
    weights = model / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[: len(raw) // 2])
    _refused(capsys, _generate(model), weights, "safetensors")
    weights.write_bytes(raw[:100])  # cut inside the header
    _refused(capsys, _generate(model), weights, "safetensors")
    weights.write_bytes(raw)
    _rewrite_header(weights, lambda h: h["model.embed_tokens.weight"].update(shape=[512, 64]))  # more than its bytes
    _refused(capsys, _generate(model), weights, "safetensors")


def test_integer_weights_without_a_quantization_config_are_refused(tiny, tmp_path, capsys):
    model = _variant(tiny, tmp_path / "model")
    tensors = load_file(model / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int8)
    save_file(tensors, str(model / "model.safetensors"))
    _refused(capsys, _generate(model), model / "model.safetensors", "model.norm.weight", "I8")


@pytest.fixture(scope="module")
def sharded(tiny, tmp_path_factory) -> Path:
    """The tiny Llama in shards of at most 100 KB, with model.safetensors.index.json."""
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("sharded")
    LlamaForCausalLM.from_pretrained(tiny).save_pretrained(path, max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) > 2
    return path


def test_sharded_checkpoints_are_checked_against_their_index(sharded, tmp_path, capsys):
    index_file = "model.safetensors.index.json"
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))

    model = tmp_path / "missing"
    shutil.copytree(sharded, model)
    (model / shards[1]).unlink()
    _refused(capsys, _generate(model), model / index_file, shards[1])

    model = tmp_path / "lying"
    shutil.copytree(sharded, model)
    index = json.loads((model / index_file).read_text())
    name, shard = next((n, s) for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[-1]
    (model / index_file).write_text(json.dumps(index))
    _refused(capsys, _generate(model), model / index_file, name)

    model = tmp_path / "cut"
    shutil.copytree(sharded, model)
    raw = (model / shards[-1]).read_bytes()
    (model / shards[-1]).write_bytes(raw[: len(raw) - 100])
    _refused(capsys, _generate(model), model / shards[-1], "safetensors")

    model = tmp_path / "short"  # a whole shard's layers beyond config.json's count
    shutil.copytree(sharded, model)
    _variant(model, tmp_path / "short-config", num_hidden_layers=1)
    _refused(capsys, _generate(tmp_path / "short-config"), tmp_path / "short-config", "num_hidden_layers")


# ---- pre-quantized --------------------------------------------------------------------------------------------


def test_prequantized_weights_are_checked_against_the_config(tmp_path, capsys):
    from tests.model.test_prequant_models import _hf_llama, _write_quantized

    _write_quantized(_hf_llama(), tmp_path / "model", "awq", 64)  # hidden 128, intermediate 256
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config["intermediate_size"] = 192
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    line = _refused(capsys, _generate(tmp_path / "model"), tmp_path / "model" / "model.safetensors")
    assert "mlp.gate_proj has shape (256, 128)" in line and "intermediate_size 192" in line, line


# ---- GGUF --------------------------------------------------------------------------------------------------------

TINY_GGUF = {  # llama.* metadata of a tiny llama: hidden 32, 4 heads and 2 key/value heads of 8, 1 layer
    "block_count": 1,
    "context_length": 64,
    "embedding_length": 32,
    "feed_forward_length": 64,
    "attention.head_count": 4,
    "attention.head_count_kv": 2,
    "attention.layer_norm_rms_epsilon": 1e-5,
    "vocab_size": 16,
}


def _gguf(path: Path, meta: dict | None = None, rows: dict[str, int] | None = None, token_types: int = 16) -> Path:
    """A tiny llama GGUF, float32 tensors of TINY_GGUF's shapes (``rows``: a tensor's rows changed), a byte-level
    tokenizer of 16 tokens (``token_types`` of them typed), its metadata with ``meta``'s keys changed (None:
    left out; a Python int above 2**32 as uint64, a str as a string)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {**TINY_GGUF, **(meta or {})}.items():
        if value is None:
            continue
        full = f"llama.{key}"
        if isinstance(value, str):
            writer.add_string(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        else:
            (writer.add_uint64 if value >= 1 << 32 else writer.add_uint32)(full, value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(16)])
    writer.add_token_types([1] * token_types)
    shapes = {"token_embd": (16, 32), "output_norm": (32,), "output": (16, 32)}
    shapes |= {f"blk.0.{n}": (32,) for n in ("attn_norm", "ffn_norm")}
    shapes |= {
        "blk.0.attn_q": (32, 32),
        "blk.0.attn_k": (16, 32),
        "blk.0.attn_v": (16, 32),
        "blk.0.attn_output": (32, 32),
    }
    shapes |= {"blk.0.ffn_gate": (64, 32), "blk.0.ffn_up": (64, 32), "blk.0.ffn_down": (32, 64)}
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        shape = ((rows or {}).get(name, shape[0]), *shape[1:])
        writer.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# case -> (_gguf's changes, the words the error names)
GGUF_CASES = {
    "10**9 layers": (dict(meta={"block_count": 10**9}), ("llama.block_count",)),
    "embedding_length as text": (dict(meta={"embedding_length": "32"}), ("llama.embedding_length",)),
    "no embedding_length": (dict(meta={"embedding_length": None}), ("llama.embedding_length",)),
    "3 key/value heads for 4": (dict(meta={"attention.head_count_kv": 3}), ("llama.attention.head_count_kv",)),
    "NaN norm epsilon": (dict(meta={"attention.layer_norm_rms_epsilon": float("nan")}), ("layer_norm_rms_epsilon",)),
    "vocab_size 10**12": (dict(meta={"vocab_size": 10**12}), ("llama.vocab_size",)),
    "vocab_size other than the embedding's rows": (
        dict(meta={"vocab_size": 20}),
        ("token_embd.weight", "llama.vocab_size 20"),
    ),
    "a tensor of another width": (dict(rows={"blk.0.ffn_down": 16}), ("blk.0.ffn_down.weight", "embedding_length")),
    "a token type short": (dict(token_types=15), ("tokenizer.ggml.token_type",)),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_metadata_is_checked_before_use(tmp_path, capsys, case):
    changes, named = GGUF_CASES[case]
    model = _gguf(tmp_path / "m.gguf", **changes)
    _refused(capsys, _generate(model), model, *named)


def test_cut_and_bogus_gguf_files_are_refused(tmp_path, capsys):
    raw = _gguf(tmp_path / "good.gguf").read_bytes()
    cases = {
        "cut in its tensors": raw[: len(raw) - 64],
        "cut in its metadata": raw[:200],
        "not GGUF": b"<html>not found</html>" * 4,
        "empty": b"",
        # an array that claims 2**62 one-byte elements: gguf's reader loops over them past the end of the file
        "a lying array length": b"GGUF"
        + struct.pack("<IQQ", 3, 0, 1)
        + struct.pack("<Q", 9)
        + b"general.x"
        + struct.pack("<IIQ", 9, 0, 1 << 62),
    }
    for case, data in cases.items():
        model = tmp_path / f"{case}.gguf"
        model.write_bytes(data)
        _refused(capsys, _generate(model), model)
        _refused(capsys, ["export-tokenizer", str(tmp_path / "out"), "--model", str(model)], model)


# ---- dummy weights -----------------------------------------------------------------------------------------------


def test_dummy_weights_check_their_config(tiny, tmp_path, capsys):
    model = _variant(tiny, tmp_path / "nan", rms_norm_eps=float("nan"))
    _refused(capsys, _generate(model, "--load-format", "dummy"), model / "config.json", "rms_norm_eps")
    # no tensor bounds a dummy's sizes: weights that cannot fit the device at 4 bits each are refused
    model = _variant(tiny, tmp_path / "huge", vocab_size=(1 << 31) - 1, hidden_size=4096, head_dim=1024)
    _refused(capsys, _generate(model, "--load-format", "dummy"), model / "config.json", "vocab_size", "GiB")


# ---- the real serve command --------------------------------------------------------------------------------------


# Runs argv[2:] and writes its peak RSS (KiB, wait4's rusage) to the file argv[1]. A fresh, small process forks the
# server: Linux counts into a child's peak RSS the memory of whatever forked it (the mm it left at exec), so measured
# from pytest's own process, late in the whole tier, an idle server read as 7.7 GB.
_PEAK_RSS = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _serve_measured(model: Path, data_dir: Path, *flags: str, timeout: float = 120) -> tuple[int, str, int]:
    """``lora-server serve --model MODEL`` in a child process: (exit status, stderr, its peak RSS in KiB). Killed
    after ``timeout`` seconds (a server that started anyway)."""
    cmd = [sys.executable, "-m", "lora_server.cli", "serve", "--model", str(model), *flags]
    cmd += ["--port", str(free_port()), "--data-dir", str(data_dir), "--admin-key", "test-admin-key"]
    peak = data_dir.parent / "peak-rss-kb"
    measured = [sys.executable, "-c", _PEAK_RSS, str(peak), *cmd]
    proc = subprocess.Popen(
        measured, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    timer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
    timer.start()
    try:
        assert proc.stderr is not None
        err = proc.stderr.read()
        proc.wait()
    finally:
        timer.cancel()
        proc.stderr.close()
    return proc.returncode, err, int(peak.read_text())


def _assert_one_error_line(status: int, err: str, *named: str) -> None:
    lines = err.strip().splitlines()
    assert status == 2 and "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    for word in named:
        assert word in lines[0], lines[0]


SERVE_CASES = {  # the defects seen through serve: each started and reported healthy, or dumped a traceback
    "NaN rms_norm_eps": {"rms_norm_eps": float("nan")},
    "vocab_size 10**12": {"vocab_size": 10**12},
    "3 key/value heads for 4": {"num_key_value_heads": 3},
    "hidden_size as text": {"hidden_size": "64"},
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SERVE_CASES))
def test_serve_refuses_a_bad_config_in_one_line(tiny, tmp_path, case):
    model = _variant(tiny, tmp_path / "model", **SERVE_CASES[case])
    status, err, _ = _serve_measured(model, tmp_path / "data")
    _assert_one_error_line(status, err, str(model / "config.json"), next(iter(SERVE_CASES[case])))


@pytest.mark.slow
def test_serve_refuses_cut_files_in_one_line(tiny, tmp_path):
    model = _variant(tiny, tmp_path / "model")
    raw = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    status, err, _ = _serve_measured(model, tmp_path / "data")
    _assert_one_error_line(status, err, str(model / "model.safetensors"))
    gguf_raw = _gguf(tmp_path / "m.gguf").read_bytes()
    (tmp_path / "m.gguf").write_bytes(gguf_raw[: len(gguf_raw) // 2])
    status, err, _ = _serve_measured(tmp_path / "m.gguf", tmp_path / "data")
    _assert_one_error_line(status, err, str(tmp_path / "m.gguf"))


@pytest.mark.slow
def test_a_billion_layers_fail_fast_in_little_memory(tiny, tmp_path):
    """Nothing is built per layer before the layer count is checked: the process stays the size of an idle one
    (about 0.3 GB; 7.9 GB before the checks, an entry per layer built before the tensors were looked at)."""
    model = _variant(tiny, tmp_path / "model", num_hidden_layers=10**9)
    status, err, peak_kb = _serve_measured(model, tmp_path / "data")
    _assert_one_error_line(status, err, str(model / "config.json"), "num_hidden_layers")
    assert peak_kb < PEAK_RSS_BOUND_KB, f"peak RSS {peak_kb} KiB"
    dummy = _variant(tiny, tmp_path / "dummy", num_hidden_layers=10**9)
    status, err, peak_kb = _serve_measured(dummy, tmp_path / "data", "--load-format", "dummy")
    _assert_one_error_line(status, err, str(dummy / "config.json"), "num_hidden_layers")
    assert peak_kb < PEAK_RSS_BOUND_KB, f"peak RSS {peak_kb} KiB"
