"""``lora-server bench-engine --host-work``: the host work of one decode step of the engine's CUDA code path,
counted on a machine without a GPU by the stand-in of ``lora_server.instrument.host_work`` (its docstring says how
the CUDA path runs there, and the limits of what is counted)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_server.instrument.host_work import (
    STAND_IN,
    HostWorkCounter,
    StandInConfig,
    counting_forward_passes,
    counting_triton_launches,
    decode_bucket,
    stand_in_cuda,
)

if TYPE_CHECKING:
    from lora_server.engine import Engine
    from lora_server.sampling_params import SamplingParams

# Targets for one decode step at batch 64 / 16 adapters / 32 layers.
TARGET_LAUNCHES_PER_LAYER = 20
TARGET_H2D = 2
TARGET_SYNCS = 1


# ---- the benchmark ----------------------------------------------------------------------------------------------


def tiny_llama_config(layers: int) -> dict[str, Any]:
    """The tiny-llama preset with ``layers`` layers (the acceptance shape: 32)."""
    from lora_server.model.arch import PRESETS

    return {**PRESETS["tiny-llama"], "num_hidden_layers": layers}


@dataclass
class HostWorkResult:
    layers: int
    batch: int
    adapters: int
    rank: int
    bucket: int | None  # the decode bucket the batch is padded to (None: not padded, --enforce-eager)
    # per decode step: HostWork.summary(), host_ms, and the totals of its forward pass alone ("forward"): with CUDA
    # graphs that pass is one graph launch, and the host issues only the rest
    steps: list[dict[str, Any]]
    host_ms: float  # median host time of a decode step, counted (see the module's limits)

    @property
    def step(self) -> dict[str, Any]:
        return self.steps[-1]

    def verdicts(self) -> dict[str, bool]:
        s = self.step
        return dict(
            launches_per_layer=s["launches"] / self.layers <= TARGET_LAUNCHES_PER_LAYER,
            h2d=s["h2d"] <= TARGET_H2D,
            syncs=s["syncs"] <= TARGET_SYNCS,
        )


@contextlib.contextmanager
def stand_in_engine(
    layers: int,
    batch: int,
    adapters: int,
    rank: int,
    prompt_len: int,
    max_tokens: int,
    *,
    max_num_seqs: int | None = None,
    enforce_eager: bool = False,
    params: SamplingParams | None = None,
) -> Iterator[Engine]:
    """Within the block (and ``stand_in_cuda``): an engine on the meta stand-in for CUDA, a tiny Llama of ``layers``
    layers with dummy bf16 weights, holding ``batch`` requests of ``prompt_len`` tokens spread over ``adapters``
    random rank-``rank`` adapters, added and not yet stepped (greedy, ``max_tokens`` each, unless ``params``)."""
    from lora_server.bench.engine import write_random_adapters
    from lora_server.engine import Engine
    from lora_server.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / "config.json"
        cfg_path.write_text(json.dumps(tiny_llama_config(layers)))
        config = StandInConfig(
            model=str(cfg_path),
            load_format="dummy",
            quantization="none",
            device="cpu",
            dtype="bfloat16",
            kv_cache_bytes=64 << 20,
            gpu_memory_utilization=None,
            host_kv_bytes=0,
            max_num_seqs=max_num_seqs or batch,
            max_num_batched_tokens=max(512, batch * prompt_len),
            max_loras=max(1, adapters),
            max_lora_rank=rank,
            max_model_len=prompt_len + max_tokens + 8,
            enforce_eager=enforce_eager,
            show_progress=False,
        )
        with stand_in_cuda():
            engine = Engine(config)
            names = write_random_adapters(Path(tmp), adapters, rank, engine)
            for name in names:
                engine.adapters.add(name, Path(tmp) / name)
            engine.adapters.stage(names)  # the requests' first step finds them on the host
            params = params or SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            for i in range(batch):
                prompt = [10 + (i * 7 + j) % 400 for j in range(prompt_len)]
                engine.add(engine.make_request(prompt, params, names[i % adapters] if adapters else None))
            yield engine


def measure(
    layers: int, batch: int, adapters: int, rank: int, prompt_len: int, steps: int, enforce_eager: bool = False
) -> HostWorkResult:
    """Build the engine on the meta stand-in for CUDA, prefill ``batch`` greedy requests spread over ``adapters``
    rank-``rank`` adapters, then count ``steps`` decode steps one by one (and, apart, each one's forward pass)."""
    with stand_in_engine(layers, batch, adapters, rank, prompt_len, steps + 2, enforce_eager=enforce_eager) as engine:
        counter = HostWorkCounter(STAND_IN.type, emulate=True)
        counted: list[dict[str, Any]] = []
        times: list[float] = []
        with (
            counter,
            counting_triton_launches(counter, run=False),
            counting_forward_passes(engine, counter) as forward_counts,
        ):
            for _ in range(prompt_len + 1):  # the prefill (in chunks, should the budget ask for them)
                if engine.snapshot().decoding:
                    break
                engine.step()
            if not engine.snapshot().decoding:
                raise RuntimeError("the stand-in engine's requests never reached their decode steps")
            for _ in range(steps):
                counter.reset()
                forward_counts.clear()
                start = time.perf_counter()
                engine.step()
                times.append((time.perf_counter() - start) * 1e3)
                summary = counter.work.summary()
                summary["host_ms"] = round(times[-1], 2)
                [summary["forward"]] = forward_counts
                counted.append(summary)
        bucket = decode_bucket(engine, batch)
    return HostWorkResult(layers, batch, adapters, rank, bucket, counted, round(statistics.median(times), 2))


def bench_host_work(args: Any) -> dict[str, Any]:
    """``lora-server bench-engine --host-work``: count, print against the targets, write JSON."""
    batch, adapters = max(args.batch), max(args.adapters)
    eager = bool(getattr(args, "enforce_eager", False))
    result = measure(args.layers, batch, adapters, args.rank, min(args.prompt_len), args.steps, eager)
    step, verdicts = result.step, result.verdicts()
    forward = step["forward"]
    mark = {True: "ok", False: "MISSED"}
    padded = "not padded (--enforce-eager)" if result.bucket is None else f"padded to its bucket of {result.bucket}"
    graphed = (
        "every step runs eagerly"
        if result.bucket is None
        else f"with CUDA graphs the forward is one graph launch: the host issues {step['ops'] - forward['ops']} ops "
        f"and {step['launches'] - forward['launches'] + 1} launches per step"
    )
    print(
        f"bench-engine --host-work: one decode step of the CUDA code path on the meta stand-in (counted, not run); "
        f"tiny Llama, {result.layers} layers, batch {batch} ({padded}), {adapters} distinct rank-{args.rank} "
        f"adapters\n"
        f"eager ops (not views) {step['ops']}; launches {step['launches']} (torch {step['torch_launches']}, "
        f"Triton {step['triton_launches']}) = {step['launches'] / result.layers:.1f} per layer "
        f"(target <= {TARGET_LAUNCHES_PER_LAYER}: {mark[verdicts['launches_per_layer']]})\n"
        f"host-to-device copies {step['h2d']} ({step['h2d_pageable']} from pageable memory; target <= {TARGET_H2D}: "
        f"{mark[verdicts['h2d']]}); syncs {step['syncs']} (target <= {TARGET_SYNCS}: {mark[verdicts['syncs']]})\n"
        f"of which the forward pass: {forward['ops']} ops, {forward['launches']} launches, {forward['h2d']} "
        f"host-to-device copies, {forward['syncs']} syncs; {graphed}\n"
        f"host time {result.host_ms} ms per step (median of {len(result.steps)}; counted, so an overstatement)\n"
        f"Triton kernels {step['kernels']}; syncs {step['sync_ops']}\n"
        f"most frequent ops {step['top_ops']}",
        flush=True,
    )
    out = dataclasses.asdict(result)
    out["targets"] = dict(launches_per_layer=TARGET_LAUNCHES_PER_LAYER, h2d=TARGET_H2D, syncs=TARGET_SYNCS)
    out["verdicts"] = verdicts
    path = Path(args.json) if args.json else Path(args.out) / "bench-host-work.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"figures written to {path}")
    return out
