"""``lora-server bench-spec``: prompt-lookup speculative decoding against none, in the same run.

Input-copying tasks (repeat or correct a given text), greedy. At batch 1 each prompt runs alone on an engine
without speculation and on one with it: time per output token (TPOT: first token to last, over the tokens after
the first), the acceptance rate (accepted drafts / drafts verified) and the tokens each decode step yields. At a
large batch (above speculative_max_batch) the same prompts run together on three engines: without speculation,
with it (it turns itself off: no drafts), and with it forced on (the limit lifted), to show what it would cost.
Every speculating run's tokens are compared with the run without it."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.sampling_params import SamplingParams

TEXTS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. To be "
    "or not to be, that is the question.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make glucose "
    "and oxygen. It takes place in the chloroplasts of the leaves.",
    "Dear team, the meeting on Monday is moved to Tuesday at ten in the morning. Please bring your reports and "
    "the figures for the third quarter. Thank you.",
    "Paris is the capital of France. It is known for the Eiffel Tower, the Louvre museum and its cafes along the "
    "river Seine.",
]
TASKS = ["Repeat the following text exactly:\n{}", "Correct the spelling of the following text:\n{}"]


@dataclass
class SpecPoint:
    batch: int
    mode: str  # "off", "on" (speculative_max_batch as configured) or "forced" (the limit lifted)
    tpot_ms: float  # mean over requests of (last token time - first token time) / (tokens - 1)
    output_tokens: int
    decode_steps: int  # steps after every request's first token
    tokens_per_step: float  # output tokens after the first / decode steps, per request
    drafts: int
    accepted: int
    acceptance: float  # accepted / drafts
    identical: bool  # same tokens as without speculation


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], dict]:
    """Run prompts together to the end, timing each request's outputs."""
    snap = engine.snapshot()
    drafts0, accepted0 = snap.spec_draft_tokens, snap.spec_accepted_tokens
    ids = [f"spec-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add(engine.make_request(p, params, request_id=rid))
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    steps = 0
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter()
        if len(first) == len(ids):
            steps += 1
        for out in outs:
            if out.token_ids:
                tokens[out.request_id].extend(out.token_ids)
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
    engine.check_integrity()
    snap = engine.snapshot()
    tpots = [(last[r] - first[r]) / (len(tokens[r]) - 1) for r in ids if len(tokens[r]) > 1]
    after_first = sum(len(t) - 1 for t in tokens.values())
    figures = dict(
        tpot_ms=1e3 * sum(tpots) / max(1, len(tpots)),
        output_tokens=sum(len(t) for t in tokens.values()),
        decode_steps=steps,
        tokens_per_step=after_first / len(ids) / max(1, steps),
        drafts=snap.spec_draft_tokens - drafts0,
        accepted=snap.spec_accepted_tokens - accepted0,
    )
    return [tokens[r] for r in ids], figures


def _point(batch: int, mode: str, figures: dict, identical: bool) -> SpecPoint:
    drafts, accepted = figures["drafts"], figures["accepted"]
    return SpecPoint(
        batch,
        mode,
        round(figures["tpot_ms"], 2),
        figures["output_tokens"],
        figures["decode_steps"],
        round(figures["tokens_per_step"], 2),
        drafts,
        accepted,
        round(accepted / drafts, 3) if drafts else 0.0,
        identical,
    )


def bench(args, base: EngineConfig) -> dict:
    """Batch 1 over every (task, text) prompt, then all of them (repeated to ``args.large_batch``) at once."""
    k = base.speculative_ngram or 5
    off = Engine(dataclasses.replace(base, speculative_ngram=0))
    on = Engine(dataclasses.replace(base, speculative_ngram=k))
    forced = Engine(dataclasses.replace(base, speculative_ngram=k, speculative_max_batch=args.large_batch))
    texts = [t.format(x) for x in TEXTS for t in TASKS][: args.prompts]
    prompts = [off.chat_prompt([{"role": "user", "content": text}]) for text in texts]
    params = SamplingParams(max_tokens=args.output_len, temperature=0)
    limit = on.config.speculative_max_batch
    print(
        f"bench-spec: prompt lookup, k={k} drafts, n-gram {base.speculative_ngram_min}..{base.speculative_ngram_max}, "
        f"speculative_max_batch {limit}; {len(prompts)} input-copying prompts, greedy, up to {args.output_len} tokens; "
        f"device {off.describe().device}",
        flush=True,
    )
    for engine in (off, on, forced):  # warm-up: first-call costs out of the figures
        _run(engine, prompts[:1], SamplingParams(max_tokens=4, temperature=0))
    points = []
    singles: dict[str, list[dict]] = {"off": [], "on": []}
    identical = True
    for prompt in prompts:
        want, fig_off = _run(off, [prompt], params)
        got, fig_on = _run(on, [prompt], params)
        identical &= got == want
        singles["off"].append(fig_off)
        singles["on"].append(fig_on)
    for mode in ("off", "on"):
        figs = singles[mode]
        merged = {key: sum(f[key] for f in figs) for key in ("output_tokens", "decode_steps", "drafts", "accepted")}
        merged["tpot_ms"] = sum(f["tpot_ms"] for f in figs) / len(figs)
        merged["tokens_per_step"] = sum(f["tokens_per_step"] for f in figs) / len(figs)
        points.append(_point(1, mode, merged, identical))
        print(_row(points[-1]), flush=True)
    batch_prompts = (prompts * -(-args.large_batch // len(prompts)))[: args.large_batch]
    want, fig = _run(off, batch_prompts, params)
    points.append(_point(args.large_batch, "off", fig, True))
    print(_row(points[-1]), flush=True)
    for mode, engine in (("on", on), ("forced", forced)):
        got, fig = _run(engine, batch_prompts, params)
        points.append(_point(args.large_batch, mode, fig, got == want))
        print(_row(points[-1]), flush=True)
    by = {(p.batch, p.mode): p for p in points}
    print(
        f"TPOT ratio (speculation / none): batch 1 {by[1, 'on'].tpot_ms / by[1, 'off'].tpot_ms:.2f}; batch "
        f"{args.large_batch} {by[args.large_batch, 'on'].tpot_ms / by[args.large_batch, 'off'].tpot_ms:.2f} (turned "
        f"off), forced {by[args.large_batch, 'forced'].tpot_ms / by[args.large_batch, 'off'].tpot_ms:.2f}"
    )
    result = dict(
        device=torch.cuda.get_device_name() if off.describe().device.type == "cuda" else "cpu",
        model=base.model,
        quantization=base.quantization,
        k=k,
        speculative_max_batch=limit,
        output_len=args.output_len,
        points=[asdict(p) for p in points],
    )
    json_path = Path(args.json) if args.json else Path(args.out) / "bench-spec.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    print(f"figures written to {json_path}")
    return result


def _row(p: SpecPoint) -> str:
    return (
        f"batch {p.batch:3d}  speculation {p.mode:6s}  TPOT {p.tpot_ms:8.2f} ms  tokens/step {p.tokens_per_step:5.2f}"
        f"  drafts {p.drafts:5d}  accepted {p.accepted:5d} ({p.acceptance:5.1%})  identical {p.identical}"
    )
