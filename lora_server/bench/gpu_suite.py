"""``lora-server bench-gpu``: the GPU acceptance run in one command.

In order: the GPU test tier (``pytest -m gpu`` over the test files that carry the mark, in this checkout), the
device's bf16 matmul peak measured now, ``bench-engine`` once per quantization mode (one engine at a time, its
figures in ``OUT/bench-engine-MODE.json``), the HF + PEFT peer (``--peer-script``: the shared
``peer_hf_peft.py``, run as its own process), then every goal with its measured value in ``OUT/bench-gpu.json`` and
the decode times against their floors in ``OUT/bench-gpu.png``. On the CPU (``--quick``) the same code runs on a
tiny Llama so the CPU tier can check it; the figures then mean nothing for the goals."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

from lora_server.bench.engine import bench, sync_device
from lora_server.config import EngineConfig

REPO = Path(__file__).resolve().parents[2]

# Issue 45's decode goals: (name, mode, (batch, distinct adapters), bound on decode ms over floor ms), at the decode
# prompt length (evaluate's). "none" runs in the engine's dtype (bfloat16 on CUDA).
DECODE_GOALS = (
    ("decode within 1.25x of the floor, batch 1, no adapter", "none", (1, 0), 1.25),
    ("decode within 1.35x of the floor, batch 1, one adapter", "none", (1, 1), 1.35),
    ("decode within 1.4x of the floor, batch 64, 16 adapters", "none", (64, 16), 1.4),
    ("decode within 1.8x of the floor, batch 256, 16 adapters", "none", (256, 16), 1.8),
    ("int4 decode within 1.6x of its floor, batch 1", "int4", (1, 0), 1.6),
    ("fp8 decode within 1.35x of its floor, batch 1", "fp8", (1, 0), 1.35),
)
# LoRA's cost beyond its bytes at (batch, adapters), against the same batch without adapters (lora_cost): at most
# this share of the step with them
LORA_COST_POINTS = ((1, 1), (64, 16))
LORA_COST_SHARE = 0.08
PREFILL_SHARE = 0.6  # prefill at 1,024 tokens (batch 1, no adapter, bf16) against the bf16 matmul peak
PEER_RATIO = 100.0  # engine tokens/s (prefill included) over HF + PEFT's with 16 mixed adapters, batch 64
PEER_KEY = "hf_peft_mixed16_B64"


def matmul_peak_tflops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """The best of 10 timed [n, n] x [n, n] matmuls in ``dtype`` on ``device``, in TFLOP/s."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for i in range(12):
        sync_device(device)
        start = time.perf_counter()
        torch.mm(a, b)
        sync_device(device)
        if i >= 2:  # two warm-up runs
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


def gpu_test_files(tests: Path) -> list[Path]:
    """The test modules under ``tests`` (its sub-folders included) that mark any test ``gpu``: the others need the
    server's packages (FastAPI, uvicorn), which a bare GPU machine may lack."""
    return sorted(p for p in tests.rglob("test_*.py") if "pytest.mark.gpu" in p.read_text())


def run_gpu_tests(out: Path) -> dict[str, Any]:
    """``pytest -m gpu`` over gpu_test_files, its JUnit XML in ``out``: the counts, and the exit code."""
    files = gpu_test_files(REPO / "tests")
    if not files:
        return dict(ran=False, why=f"no tests under {REPO / 'tests'} (an installed package has none)")
    xml = out / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    code = subprocess.call([*cmd, *map(str, files)], cwd=REPO)
    counts = dict(tests=0, failures=0, errors=0, skipped=0)
    if xml.exists():
        for suite in ET.parse(xml).getroot().iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
    return dict(ran=True, exit_code=code, **counts)


def run_peer(script: Path, out: Path) -> dict[str, Any] | None:
    """The HF + PEFT peer script run as its own process with OUT=out; its JSON, or None where it failed."""
    code = subprocess.call([sys.executable, str(script)], env={**os.environ, "OUT": str(out)})
    path = out / "peer_hf_peft.json"
    return json.loads(path.read_text()) if code == 0 and path.exists() else None


def evaluate(
    modes: dict[str, dict],
    peak_tflops: float | None,
    peer: dict | None,
    decode_prompt: int = 128,
    prefill_prompt: int = 1024,
) -> list[dict[str, Any]]:
    """Every goal against the figures: name, measured value, bound and met (None where its mode, point or peer
    did not run). ``modes``: mode -> bench-engine's result (its "points"); the decode goals read the points at
    ``decode_prompt`` tokens, the prefill goal the one at ``prefill_prompt`` (suite_points' first and last)."""
    goals = []
    for name, mode, (batch, adapters), bound in DECODE_GOALS:
        for m in [mode] if mode else list(modes):
            point = _point(modes.get(m), (batch, adapters, decode_prompt))
            ratio = None if point is None else point["decode_ms_per_step"] / point["floor_ms_per_step"]
            goals.append(_goal(f"{name} [{m}]", "x floor", ratio, bound, at_most=True))
    for batch, adapters in LORA_COST_POINTS:
        with_lora = _point(modes.get("none"), (batch, adapters, decode_prompt))
        cost = lora_cost(with_lora, _point(modes.get("none"), (batch, 0, decode_prompt)))
        name = f"LoRA's cost beyond its bytes, batch {batch}, {adapters} adapter{'s' * (adapters > 1)} [none]"
        goals.append(_goal(name, "of the step", cost, LORA_COST_SHARE, at_most=True))
    prefill = _point(modes.get("none"), (1, 0, prefill_prompt))
    share = None if prefill is None or not peak_tflops else prefill["prefill_tflops"] / peak_tflops
    name = f"prefill at {prefill_prompt:,} tokens against the matmul peak [none]"
    goals.append(_goal(name, "share", share, PREFILL_SHARE))
    served = _point(modes.get("none"), (64, 16, decode_prompt))
    theirs = (peer or {}).get("results_tok_s__ms_per_step", {}).get(PEER_KEY)
    ratio = None if served is None or theirs is None else served["total_tok_per_s"] / theirs[0]
    goals.append(_goal("throughput against HF + PEFT, 16 mixed adapters, batch 64 [none]", "x", ratio, PEER_RATIO))
    return goals


def suite_points(batches: list[int], adapters: list[int], prompt_lens: list[int]) -> list[tuple[int, int, int]]:
    """(batch, distinct adapters, prompt length): the decode points, every batch with every adapter count (at most
    the batch) at the first prompt length, then each further prompt length at batch 1 without adapters (its prefill
    rate: a long prompt at every batch would take more KV than the arena holds at the largest and more time than one
    device call has). Each point once."""
    assert prompt_lens, "at least one prompt length"
    first, *longer = prompt_lens
    points = [(b, min(a, b), first) for b in batches for a in adapters] + [(1, 0, n) for n in longer]
    return list(dict.fromkeys(points))


def lora_cost(with_lora: dict | None, without: dict | None) -> float | None:
    """What adapters add to a decode step beyond reading their bytes, as a share of the step with them: (the step's
    time with them - without) - (its floor with them - without), over the step with them; None where a point did
    not run."""
    if with_lora is None or without is None:
        return None
    extra = with_lora["decode_ms_per_step"] - without["decode_ms_per_step"]
    extra_bytes = with_lora["floor_ms_per_step"] - without["floor_ms_per_step"]
    return (extra - extra_bytes) / with_lora["decode_ms_per_step"]


def point_lines(modes: dict[str, dict]) -> list[str]:
    """Each mode's decode points against their floors, one line each (what bench-gpu prints)."""
    lines = []
    for mode, result in modes.items():
        for p in result.get("points", []):
            ratio = p["decode_ms_per_step"] / p["floor_ms_per_step"]
            lines.append(
                f"{mode:5} batch {p['batch']:4} adapters {p['adapters']:3} prompt {p['prompt_len']:5}: decode "
                f"{p['decode_ms_per_step']:8.3f} ms, floor {p['floor_ms_per_step']:8.3f} ms, {ratio:5.2f}x"
            )
    return lines


def _goal(name: str, unit: str, value: float | None, bound: float, at_most: bool = False) -> dict[str, Any]:
    """A goal's record: met when value <= bound (at_most) or >= bound; None where nothing was measured."""
    met = None if value is None else (value <= bound if at_most else value >= bound)
    return dict(goal=name, unit=unit, measured=None if value is None else round(value, 3), bound=bound, met=met)


def _point(result: dict | None, key: tuple[int, int, int]) -> dict | None:
    points = (result or {}).get("points", [])
    return next((p for p in points if (p["batch"], p["adapters"], p["prompt_len"]) == key), None)


def plot(summary: dict, path: Path) -> bool:
    """Decode ms/step (solid) and its floor (dashed) over the batch, one panel per mode, a line per adapter count
    of the largest batch (a smaller batch has min(count, batch) distinct adapters), the shortest prompt; False
    where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = summary["modes"]
    fig, axes = plt.subplots(1, len(modes), figsize=(4.5 * len(modes), 3.8), squeeze=False)
    prompt = 0
    for ax, (mode, result) in zip(axes[0], modes.items(), strict=True):
        points = result["points"]
        prompt, largest = min(p["prompt_len"] for p in points), max(p["batch"] for p in points)
        batches = sorted({p["batch"] for p in points})
        for n in sorted({p["adapters"] for p in points if p["batch"] == largest}):
            row = [p for b in batches if (p := _point(result, (b, min(n, b), prompt))) is not None]
            xs = [p["batch"] for p in row]
            line = ax.plot(xs, [p["decode_ms_per_step"] for p in row], marker="o", label=f"{n} adapters")
            ax.plot(xs, [p["floor_ms_per_step"] for p in row], ls="--", color=line[0].get_color())
        ax.set(title=f"{mode} ({result['dtype']})", xlabel="batch", ylabel="ms per decode step", xscale="log")
        ax.minorticks_off()
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.legend(fontsize=7)
    fig.suptitle(f"{summary['device']}: decode step (solid) against its floor (dashed), prompt {prompt}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def suite(args: argparse.Namespace, base: EngineConfig) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tests = run_gpu_tests(out) if args.tests else dict(ran=False, why="--no-tests")
    print(f"bench-gpu: GPU tests {tests}", flush=True)
    device = torch.device("cuda" if base.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = matmul_peak_tflops(device, dtype, 8192 if device.type == "cuda" else 1024)
    print(f"bench-gpu: {dtype} matmul peak measured now: {peak:.1f} TFLOP/s", flush=True)
    modes: dict[str, dict] = {}
    points = suite_points(args.batch, args.adapters, args.prompt_len)
    for mode in args.modes:
        mode_args = argparse.Namespace(
            **{**vars(args), "json": str(out / f"bench-engine-{mode}.json"), "points": points}
        )
        modes[mode] = bench(mode_args, dataclasses.replace(base, quantization=mode))
        gc.collect()  # the mode's engine, before the next one loads
        if device.type == "cuda":
            torch.cuda.empty_cache()
    peer = None
    if args.peer_script and device.type == "cuda":
        peer = run_peer(Path(args.peer_script), out)
    for line in point_lines(modes):
        print(line)
    goals = evaluate(modes, peak, peer, args.prompt_len[0], args.prompt_len[-1])
    summary: dict[str, Any] = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        matmul_peak_tflops=round(peak, 2),
        tests=tests,
        peer=peer,
        goals=goals,
        modes=modes,
    )
    (out / "bench-gpu.json").write_text(json.dumps(summary, indent=1))
    for g in goals:
        state = {True: "met", False: "MISSED", None: "not measured"}[g["met"]]
        print(f"{g['goal']}: {g['measured']} {g['unit']} (bound {g['bound']}) {state}")
    drawn = plot(summary, out / "bench-gpu.png")
    print(
        f"figures written to {out / 'bench-gpu.json'}" + (" and bench-gpu.png" if drawn else " (no PNG: no matplotlib)")
    )
    return summary


if __name__ == "__main__":  # python -m lora_server.bench.gpu_suite OUT/bench-gpu.json: the PNG, drawn elsewhere
    summary_path = Path(sys.argv[1])
    plot(json.loads(summary_path.read_text()), summary_path.with_suffix(".png"))
