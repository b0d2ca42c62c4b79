"""``lora-server bench-engine --structured``: what structured output costs a decode step.

The same batch runs with no request constrained and with half of them constrained by a JSON schema (an array of
objects that cannot complete within ``output_len`` tokens, so every request decodes to the end), alternating
``repeats`` times in one run on one engine. The figure is the mean time of the steps where every request decodes
one token, and the ratio half-constrained / none."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.json_types import JsonObject
from lora_server.sampling_params import SamplingParams, StructuredOutput

# an array of people that needs far more than output_len tokens: the grammar never ends a request early
SCHEMA: JsonObject = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
            "role": {"enum": ["admin", "editor", "viewer"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        },
        "required": ["name", "age", "email", "role", "tags"],
    },
    "minItems": 64,
}
PROMPT = "List the people of our team as JSON: name, age, email, role and tags."


def decode_ms_per_step(engine: Engine, batch: int, constrained: int, output_len: int, run: int) -> float:
    """Mean milliseconds of the pure-decode steps of ``batch`` greedy requests, the first ``constrained`` of them
    under SCHEMA (EOS ignored by the others: all decode output_len tokens)."""
    prompt = engine.chat_prompt([{"role": "user", "content": PROMPT}])
    structured = StructuredOutput.json_schema(SCHEMA)
    for i in range(batch):
        params = SamplingParams(
            max_tokens=output_len, temperature=0, ignore_eos=True, structured=structured if i < constrained else None
        )
        engine.add(engine.make_request(prompt, params, request_id=f"structured-{run}-{constrained}-{i}"))
    device = engine.describe().device
    times = []
    while engine.has_work():
        decoding = engine.snapshot().decoding
        _sync(device)
        start = time.perf_counter()
        outputs = engine.step()
        _sync(device)
        if decoding and len(outputs) == batch:
            times.append(time.perf_counter() - start)
    engine.check_integrity()
    return 1e3 * sum(times) / max(1, len(times))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_structured(args, base: EngineConfig) -> dict:
    batch = max(args.batch)
    config = dataclasses.replace(base, max_num_seqs=batch)
    engine = Engine(config)
    info = engine.describe()
    device = torch.cuda.get_device_name() if info.device.type == "cuda" else "cpu"
    print(
        f"bench-engine --structured: {config.model or 'the embedded SmolLM2-135M-Instruct'} (quantization "
        f"{config.quantization}), dtype {info.dtype}, device {device}; batch {batch}, {args.output_len} greedy tokens "
        f"per request; mean time of the steps where every request decodes one token, with none and with half of the "
        f"batch constrained by a JSON schema (xgrammar bitmask filled for the batch in one call, applied before "
        f"sampling), alternating {args.repeats} times",
        flush=True,
    )
    schema = SamplingParams(max_tokens=1, structured=StructuredOutput.json_schema(SCHEMA))
    engine.discard(engine.make_request([10], schema))  # its grammar compiles (and is cached) outside the timing
    decode_ms_per_step(engine, batch, 0, 4, -1)  # warm-up
    none, half = [], []
    for run in range(args.repeats):
        none.append(decode_ms_per_step(engine, batch, 0, args.output_len, run))
        half.append(decode_ms_per_step(engine, batch, batch // 2, args.output_len, run))
        print(f"run {run}: none {none[-1]:.2f} ms/step, half constrained {half[-1]:.2f} ms/step", flush=True)
    mean_none, mean_half = sum(none) / len(none), sum(half) / len(half)
    print(
        f"decode step: none {mean_none:.2f} ms, half constrained {mean_half:.2f} ms, ratio {mean_half / mean_none:.3f}"
    )
    result = dict(
        device=device,
        model=config.model,
        quantization=config.quantization,
        batch=batch,
        output_len=args.output_len,
        none_ms_per_step=none,
        half_constrained_ms_per_step=half,
        ratio=round(mean_half / mean_none, 4),
    )
    json_path = Path(args.json) if args.json else Path(args.out) / "bench-structured.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    print(f"figures written to {json_path}")
    return result
