"""``lora-server bench-fair``: time to first token of a light tenant while a heavy one floods the engine, with fair
sharing on and off (the same trace, one engine each, in the same run).

The heavy tenant queues ``--heavy`` requests at once; the light tenant queues ``--light`` requests after the first
step and again every ``--gap`` steps, ``--rounds`` times. Both send random prompts of ``--prompt-len`` tokens and
generate ``--output-len`` tokens (EOS ignored). TTFT is measured on the engine's clock from a request's creation to
its first token, and in engine steps from the step it was queued before."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from lora_server.config import EngineConfig
from lora_server.engine import Engine, TenantShare
from lora_server.engine.outputs import RequestTimings
from lora_server.engine.request import EngineRequest
from lora_server.sampling_params import SamplingParams


@dataclass
class TenantFigures:
    requests: int
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_p50_steps: float
    ttft_p99_steps: float


@dataclass
class PolicyRun:
    fair_sharing: bool
    steps: int
    wall_s: float
    output_tok_per_s: float
    light: TenantFigures
    heavy: TenantFigures


def run_policy(config: EngineConfig, args) -> PolicyRun:
    """The trace on a fresh engine built from ``config``."""
    engine = Engine(config)
    vocab = engine.vocab_size
    gen = torch.Generator().manual_seed(args.trace_seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)

    def make(tenant: str) -> EngineRequest:
        prompt = torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist()
        return engine.make_request(prompt, params, tenant=TenantShare(tenant))

    queued_at: dict[str, int] = {}
    first_step: dict[str, int] = {}
    timings: dict[str, RequestTimings] = {}  # of the finished requests
    requests: dict[str, list[str]] = {"heavy": [], "light": []}  # their ids

    def add(tenant: str, step: int) -> None:
        r = make(tenant)
        engine.add(r)
        queued_at[r.request_id] = step
        requests[tenant].append(r.request_id)

    for _ in range(args.heavy):
        add("heavy", 0)
    light_steps = {1 + i * args.gap for i in range(args.rounds)}
    step = 0
    start = time.perf_counter()
    while engine.has_work() or step <= max(light_steps):
        if step in light_steps:
            for _ in range(args.light):
                add("light", step)
        for out in engine.step():
            if out.token_ids and out.request_id not in first_step:
                first_step[out.request_id] = step
            if out.timings is not None:  # its last output
                timings[out.request_id] = out.timings
        step += 1
    wall = time.perf_counter() - start
    engine.check_integrity()

    def figures(ids: list[str]) -> TenantFigures:
        ttfts = [timings[rid].ttft_s for rid in ids]
        seconds = [s for s in ttfts if s is not None]
        steps = [first_step[rid] - queued_at[rid] + 1 for rid in ids]
        return TenantFigures(
            len(ids),
            round(float(np.percentile(seconds, 50)), 3),
            round(float(np.percentile(seconds, 99)), 3),
            float(np.percentile(steps, 50)),
            round(float(np.percentile(steps, 99)), 1),
        )

    total_out = (args.heavy + args.light * args.rounds) * args.output_len
    return PolicyRun(
        config.fair_sharing,
        step,
        round(wall, 2),
        round(total_out / wall, 1),
        figures(requests["light"]),
        figures(requests["heavy"]),
    )


def bench(args, base: EngineConfig) -> dict:
    config = dataclasses.replace(base, max_model_len=args.prompt_len + args.output_len, max_loras=1)
    print(_header(config, args), flush=True)
    runs = []
    for fair in (True, False):
        run = run_policy(dataclasses.replace(config, fair_sharing=fair), args)
        runs.append(run)
        print(_row(run), flush=True)
    on, off = runs
    ratio = off.light.ttft_p99_s / on.light.ttft_p99_s
    print(
        f"light tenant p99 TTFT: {on.light.ttft_p99_s:.3f} s with fair sharing, {off.light.ttft_p99_s:.3f} s "
        f"without ({ratio:.1f}x); in steps {on.light.ttft_p99_steps:g} vs {off.light.ttft_p99_steps:g}"
    )
    result = dict(
        device=torch.cuda.get_device_name() if config.torch_device.type == "cuda" else "cpu",
        model=config.model,
        quantization=config.quantization,
        trace=dict(
            heavy=args.heavy,
            light=args.light,
            rounds=args.rounds,
            gap=args.gap,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            max_num_seqs=config.max_num_seqs,
        ),
        runs=[asdict(r) for r in runs],
        light_p99_ttft_ratio_off_over_on=round(ratio, 2),
    )
    json_path = Path(args.json) if args.json else Path(args.out) / "bench-fair.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    print(f"figures written to {json_path}")
    return result


def _header(config: EngineConfig, args) -> str:
    return (
        f"bench-fair: {config.model or 'the embedded SmolLM2-135M-Instruct'} (quantization {config.quantization}), "
        f"device {config.torch_device}; {config.max_num_seqs} requests run at once; heavy tenant: {args.heavy} "
        f"requests at step 0; light tenant: {args.light} requests at steps "
        f"{', '.join(str(1 + i * args.gap) for i in range(args.rounds))}; prompts {args.prompt_len} tokens, "
        f"{args.output_len} output tokens each (EOS ignored); TTFT from creation to first token (s) and in steps "
        "(1 = the step it was queued before)"
    )


def _row(run: PolicyRun) -> str:
    name = "fair sharing on " if run.fair_sharing else "fair sharing off"
    light, heavy = run.light, run.heavy
    return (
        f"{name}: light TTFT p50 {light.ttft_p50_s:7.3f} s p99 {light.ttft_p99_s:7.3f} s "
        f"({light.ttft_p50_steps:g}/{light.ttft_p99_steps:g} steps)  heavy TTFT p50 {heavy.ttft_p50_s:7.3f} s "
        f"p99 {heavy.ttft_p99_s:7.3f} s  {run.steps} steps, {run.wall_s} s, {run.output_tok_per_s} tok/s"
    )
