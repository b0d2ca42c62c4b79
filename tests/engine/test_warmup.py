"""Warm-up before serving (model.warmup): the plan of synthetic steps, by hand; the arena's size from measured memory,
by hand; and, in a child process without the Triton interpreter, every kernel variant of every engine shape
compiled for an H100 (sm_90a) and an A100 (sm_80) with the wheel's ptxas (bench.kernel_aot): no compile error,
no block over the target's shared memory, no spill in a 16-bit variant, the LoRA kernels' loads vectorized, and no
variant a random workload meets that warm-up did not compile. The table of registers, shared memory and occupancy
per variant is printed (``pytest -s`` shows it) and written to $OUT or the test's temporary directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.model.arch import PRESETS
from lora_server.model.warmup import MemoryProfile, WarmupShapes, arena_bytes, plan, profile_step, token_buckets

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def test_token_buckets_take_one_count_per_tile_bucket():
    # the tile table's buckets end at 16, 32, 64, 128 and 255 rows; from 256 rows the dequantization path
    assert token_buckets(512) == [16, 32, 64, 128, 255, 256]
    assert token_buckets(40) == [16, 32, 40]
    assert token_buckets(1) == [1]


def test_the_plan_of_a_small_engine():
    shapes = WarmupShapes(8, 512, 4096, 4, (1, 2, 4, 8))
    steps = plan(shapes)
    labels = [s.label for s in steps]
    decode = [f"decode x{n}{lora}" for n in (1, 2, 4, 8) for lora in (" + LoRA", "")]
    prefill = [f"prefill {n}{lora}" for n in (16, 32, 64, 128, 255, 256) for lora in (" + LoRA", "")]
    assert labels == [*decode, "decode, split keys", *prefill, "short query", "profile"]
    by_label = {s.label: s for s in steps}
    assert [(s.context, s.new, s.adapter) for s in by_label["decode x4"].seqs] == [(1, 1, False)] * 4
    assert [(s.context, s.new) for s in by_label["decode, split keys"].seqs] == [(256, 1)]
    assert [(s.context, s.new) for s in by_label["prefill 255 + LoRA"].seqs] == [(1, 255)]
    assert [(s.new, s.adapter) for s in by_label["short query"].seqs] == [(2, True), (1, False)]
    # the profile step: the 512-token budget over the 8 sequences that may run, each sampling
    assert [(s.context, s.new, s.adapter) for s in by_label["profile"].seqs] == [(0, 64, True)] * 8
    assert by_label["profile"].blocks(16) == 8 * 4 and by_label["prefill 256"].blocks(16) == 17


def test_the_plan_without_graphs_adapters_or_a_short_query():
    """Every step eager: decode batch sizes are one per tile bucket of up to max_num_seqs; a model that cannot
    serve adapters warms up without them; 16 query heads per KV head never fit the 16-row query tile."""
    steps = plan(WarmupShapes(48, 100, 60, 16, (), lora=False))
    labels = [s.label for s in steps]
    assert labels == ["decode x16", "decode x32", "decode x48", "decode, split keys"] + [
        f"prefill {n}" for n in (16, 32, 59)
    ] + ["profile"]
    assert not any(seq.adapter for s in steps for seq in s.seqs)
    assert [(s.context, s.new) for s in steps[3].seqs] == [(59, 1)]  # the context is capped by the model's length
    profile = profile_step(WarmupShapes(48, 100, 60, 16, ()))  # 100 tokens over 48 sequences
    assert sorted(s.new for s in profile.seqs) == [2] * 44 + [3] * 4


def test_the_arena_takes_what_the_share_leaves():
    """80 GiB device, 60 GiB free once weights and buffers are in, --gpu-memory-utilization 0.9, 2 GiB of
    activations at the profile step and 0.5 GiB for the decode graphs: 0.9 x 80 - 20 - 2 - 0.5 = 49.5 GiB."""
    profile = MemoryProfile(activations=2 * GIB, graphs=GIB // 2)
    assert arena_bytes(80 * GIB, 60 * GIB, 0.9, profile) == int(49.5 * GIB)
    assert arena_bytes(80 * GIB, 10 * GIB, 0.9, profile) < 0  # the runner refuses to start with a clear error


def test_no_warm_up_on_the_cpu(tmp_path):
    """The CPU runs the torch twins: nothing to compile, the arena is --kv-cache-gb."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(PRESETS["tiny-llama"]))
    engine = Engine(
        EngineConfig(
            model=str(config), load_format="dummy", quantization="none", kv_cache_bytes=4 << 20, show_progress=False
        )
    )
    startup_s, report = engine.describe().startup_s, engine.pool_report()
    assert "warm-up" not in startup_s and "weights" in startup_s
    assert report.gpu_blocks == (4 << 20) // report.block_bytes


@pytest.mark.slow
def test_every_kernel_variant_compiles_for_hopper_and_ampere(tmp_path):
    """bench.kernel_aot over its engine shapes (Llama-3-8B in bf16/fp16, int8/int4/fp8, fp8 KV, LoRA rank 16/64,
    graphs and eager, speculation; SmolLM2 in fp32 and bf16 with its GGUF blocks and without), each followed by a
    random workload, for both targets."""
    out = Path(os.environ.get("OUT", tmp_path)) / "kernel-aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "lora_server.bench.kernel_aot", "--requests", "12", "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    print(run.stdout)
    assert out.exists(), run.stderr[-5000:]
    report = json.loads(out.read_text())
    assert run.returncode == 0 and not any(report["failed"].values()), json.dumps(report["failed"], indent=1)
    for part in report["parts"]:
        kernels = {v["kernel"] for v in part["variants"]}
        assert {"_lora_shrink_kernel", "_lora_expand_kernel", "_paged_attention_kernel"} <= kernels, kernels
        assert {"_decode_attention_kernel", "_int8_matmul_kernel", "_int4_matmul_kernel"} <= kernels, kernels
        assert all(c["warmup"] > 0 for c in part["coverage"].values())


def test_the_parts_of_one_target_merge_into_one():
    """kernel_aot runs a target's shapes in two processes side by side: their parts become one, a variant both met
    once with both halves' shapes, every shape's coverage, the longer half's seconds; other targets as they were."""
    from lora_server.bench.kernel_aot import merge_parts

    def row(variant: str, *shapes: str) -> dict:
        return dict(kernel=variant[0], variant=variant, shapes=list(shapes))

    def part(target: str, rows: list[dict], coverage: dict, collect: float) -> dict:
        return dict(target=target, variants=rows, coverage=coverage, seconds=dict(collect=collect, compile=1.0))

    first = part("sm_90", [row("b1", "s1"), row("a1", "s1")], {"s1": {"warmup": 2}}, 5.0)
    second = part("sm_90", [row("b1", "s2"), row("c1", "s2")], {"s2": {"warmup": 1}}, 7.0)
    other = part("sm_80", [row("a1", "s1", "s2")], {"s1": {"warmup": 1}, "s2": {"warmup": 1}}, 3.0)
    merged = merge_parts([first, second, other])
    assert [p["target"] for p in merged] == ["sm_90", "sm_80"]
    assert merged[0]["variants"] == [row("a1", "s1"), row("b1", "s1", "s2"), row("c1", "s2")]
    assert merged[0]["coverage"] == {"s1": {"warmup": 2}, "s2": {"warmup": 1}}
    assert merged[0]["seconds"] == {"collect": 7.0, "compile": 1.0}
    assert merged[1] == other
    assert first["variants"] == [row("b1", "s1"), row("a1", "s1")]  # the parts given are left as they were
