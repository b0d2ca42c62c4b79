"""lora-server bench-gpu (the GPU acceptance run in one command): its arithmetic against hand-computed values,
and the command itself run on the CPU at tiny shapes (the GPU figures need the device machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lora_server.bench.engine import prefill_flops_per_token
from lora_server.bench.gpu_suite import evaluate, gpu_test_files, point_lines, suite_points
from lora_server.model.arch import PRESETS, ModelArch

REPO = Path(__file__).resolve().parents[2]
TINY = ModelArch.from_hf_config(PRESETS["tiny-llama"])  # hidden 64, 4 / 2 heads of 16, intermediate 128, 2 layers


def test_prefill_flops_by_hand():
    # multiply-adds per token and layer: q 64x64 = 4096, k and v 64x32 = 2048 each, o 4096, gate, up and down
    # 64x128 = 8192 each -> 36864; attention over (16 + 1) / 2 = 8.5 keys on average, 64 for QK^T and 64 for PV
    # per key -> 1088; flops = 2 x 2 layers x (36864 + 1088)
    assert prefill_flops_per_token(TINY, 16) == 151808


def _point(batch, adapters, prompt, decode_ms, floor_ms, tflops=0.0, total=0.0):
    return dict(
        batch=batch,
        adapters=adapters,
        prompt_len=prompt,
        decode_ms_per_step=decode_ms,
        floor_ms_per_step=floor_ms,
        prefill_tflops=tflops,
        total_tok_per_s=total,
    )


def test_goals_by_hand():
    modes = {
        "none": dict(
            points=[
                _point(1, 0, 128, 6.0, 5.0),  # 1.2x its floor: within 1.25
                _point(1, 1, 128, 7.0, 5.05),  # 1.386x: over 1.35; LoRA: ((7 - 6) - (5.05 - 5)) / 7 = 0.136 > 0.08
                _point(64, 0, 128, 9.0, 7.0),
                _point(64, 16, 128, 10.0, 7.5, total=6400.0),  # 1.333x: within 1.4; ((10 - 9) - 0.5) / 10 = 0.05
                _point(256, 16, 128, 14.0, 7.0),  # 2.0x: over 1.8
                _point(1, 0, 1024, 0.0, 1.0, tflops=500.0),  # 500 of a 1,000 TFLOP/s peak: under 60%
            ]
        ),
        "int4": dict(points=[_point(1, 0, 128, 5.0, 3.0)]),  # 1.667x: over 1.6
        "fp8": dict(points=[]),  # nothing ran
    }
    peer = {"results_tok_s__ms_per_step": {"hf_peft_mixed16_B64": [50.0, 1280.0]}}  # 6400 / 50 = 128x
    goals = {g["goal"]: (g["measured"], g["met"]) for g in evaluate(modes, 1000.0, peer)}
    assert goals == {
        "decode within 1.25x of the floor, batch 1, no adapter [none]": (1.2, True),
        "decode within 1.35x of the floor, batch 1, one adapter [none]": (1.386, False),
        "decode within 1.4x of the floor, batch 64, 16 adapters [none]": (1.333, True),
        "decode within 1.8x of the floor, batch 256, 16 adapters [none]": (2.0, False),
        "int4 decode within 1.6x of its floor, batch 1 [int4]": (1.667, False),
        "fp8 decode within 1.35x of its floor, batch 1 [fp8]": (None, None),
        "LoRA's cost beyond its bytes, batch 1, 1 adapter [none]": (0.136, False),
        "LoRA's cost beyond its bytes, batch 64, 16 adapters [none]": (0.05, True),
        "prefill at 1,024 tokens against the matmul peak [none]": (0.5, False),
        "throughput against HF + PEFT, 16 mixed adapters, batch 64 [none]": (128.0, True),
    }
    no_peer = evaluate(modes, 1000.0, None)[-1]
    assert (no_peer["measured"], no_peer["met"]) == (None, None)


def test_the_suites_points_by_hand():
    """Decode points at the first prompt length (adapters at most the batch, each point once), the longer prompts
    at batch 1 alone; every point printed against its floor."""
    assert suite_points([1, 64, 256], [0, 16, 64], [128, 1024]) == [
        (1, 0, 128),
        (1, 1, 128),
        (64, 0, 128),
        (64, 16, 128),
        (64, 64, 128),
        (256, 0, 128),
        (256, 16, 128),
        (256, 64, 128),
        (1, 0, 1024),
    ]
    [line] = point_lines({"int4": dict(points=[_point(64, 16, 128, 5.0, 4.0)])})
    assert " ".join(line.split()) == "int4 batch 64 adapters 16 prompt 128: decode 5.000 ms, floor 4.000 ms, 1.25x"


@pytest.mark.slow
def test_gpu_test_files_hold_every_gpu_test():
    """The files bench-gpu hands to pytest hold every test that ``-m gpu`` selects in the whole tier."""
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    files = {REPO / line.split("::")[0] for line in collected.splitlines() if "::" in line}
    assert files and files <= set(gpu_test_files(REPO / "tests"))


@pytest.mark.slow
def test_bench_gpu_quick_on_the_cpu(tmp_path):
    """The whole command on a tiny Llama: every mode's points, TFLOP/s consistent with the prefill rate, the goals
    at the run's prompt lengths (those of shapes that did not run recorded as not measured), the PNG drawn."""
    subprocess.run(
        [sys.executable, "-m", "lora_server.cli", "bench-gpu", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    summary = json.loads((tmp_path / "bench-gpu.json").read_text())
    assert list(summary["modes"]) == ["none", "int8", "int4", "fp8"]
    assert summary["tests"]["ran"] is False and summary["device"] == "cpu"
    for mode, result in summary["modes"].items():
        assert result["quantization"] == mode
        assert (tmp_path / f"bench-engine-{mode}.json").exists()
        keys = [(p["batch"], p["adapters"], p["prompt_len"]) for p in result["points"]]
        assert keys == [(1, 0, 16), (1, 1, 16), (4, 0, 16), (4, 2, 16), (1, 0, 32)]
        for p in result["points"]:
            flops = p["prefill_tok_per_s"] * prefill_flops_per_token(TINY, p["prompt_len"]) / 1e12
            assert p["prefill_tflops"] == pytest.approx(flops, abs=1e-4)
            assert p["total_tok_per_s"] > 0 and p["floor_ms_per_step"] > 0
    unmeasured = {g["goal"] for g in summary["goals"] if g["measured"] is None}
    assert unmeasured == {  # the shapes that did not run; the others are measured at the tiny shapes (meaningless)
        "decode within 1.4x of the floor, batch 64, 16 adapters [none]",
        "decode within 1.8x of the floor, batch 256, 16 adapters [none]",
        "LoRA's cost beyond its bytes, batch 64, 16 adapters [none]",
        "throughput against HF + PEFT, 16 mixed adapters, batch 64 [none]",
    }
    assert "prefill at 32 tokens against the matmul peak [none]" in {g["goal"] for g in summary["goals"]}
    assert (tmp_path / "bench-gpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
