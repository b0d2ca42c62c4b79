"""``lora-server bench-long-prefill``: what a long prompt costs, and what it costs the requests beside it.

1. Prefill cost per token at each of ``--lengths`` (one request, one output token, the engine otherwise idle), next
   to the arithmetic's own growth: per token, the linear layers' work is the same at every length and attention's
   grows with the keys before it, so ``model_ratio`` (the FLOPs per token at that length over the FLOPs per token at
   the first length) is what a kernel-bound prefill's ``ratio`` would be; a ratio above it is waste that grows.
2. A short request's time to first token alone, and next to a ``--long-len`` prompt that started one step before
   it, with the long-prefill cap (``--long-prefill-token-threshold``, default a quarter of the budget) and without
   it (0); then next to ``--long-prompts`` such prompts that started together one step before it, with the
   partial-prefill limit (``--max-long-partial-prefills``, default 1) and without it (0: each long prompt takes
   its capped chunk, and enough of them fill the step). The same trace on a fresh engine each, in the same run."""

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

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


@dataclass
class PrefillCost:
    tokens: int
    seconds: float
    ms_per_token: float
    ratio: float  # ms per token over the first length's
    model_ratio: float  # FLOPs per token over the first length's (linear + attention)


@dataclass
class ShortTTFT:
    long_prompts: int  # started one step before the short request
    long_prefill_token_threshold: int
    max_long_partial_prefills: int
    ttft_s: float
    steps: int  # engine steps from the short request's arrival to its first token
    ratio_to_alone: float


def _prompt(engine: Engine, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, engine.vocab_size, (n,), generator=gen).tolist()


def _flops_per_token(engine: Engine, length: int) -> float:
    """Mean FLOPs per prompt token of a prefill of ``length`` tokens: 2 per linear weight, and attention's 4 per
    head dimension per earlier key (scores and values; causal: length / 2 keys on average)."""
    arch = engine.describe().arch
    h, q, kv = arch.hidden_size, arch.q_size, arch.kv_size
    linear = 2 * arch.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * arch.intermediate_size)
    attention = 4 * arch.num_layers * arch.num_heads * arch.head_dim * (length + 1) / 2
    return linear + attention


def prefill_costs(config: EngineConfig, lengths: list[int]) -> list[PrefillCost]:
    engine = Engine(config)
    engine.generate([_prompt(engine, 64, 0)], ONE_TOKEN)  # warm
    out: list[PrefillCost] = []
    for i, n in enumerate(lengths):
        start = time.perf_counter()
        engine.generate([_prompt(engine, n, 1 + i)], ONE_TOKEN)
        seconds = time.perf_counter() - start
        first = out[0] if out else None
        ms = seconds / n * 1e3
        model = _flops_per_token(engine, n) / _flops_per_token(engine, lengths[0])
        out.append(PrefillCost(n, seconds, ms, ms / first.ms_per_token if first else 1.0, model))
    engine.check_integrity()
    return out


def short_ttft(config: EngineConfig, long_len: int, short_len: int, long_prompts: int) -> tuple[float, int]:
    """(seconds, steps) from the short request's arrival to its first token: alone (``long_prompts`` 0), or one step
    after that many long prompts started together (they are aborted once the short one has its token)."""
    engine = Engine(config)
    engine.generate([_prompt(engine, 64, 0)], ONE_TOKEN)  # warm
    longs = [engine.make_request(_prompt(engine, long_len, 2 + i), ONE_TOKEN) for i in range(long_prompts)]
    for long in longs:
        engine.add(long)
    if longs:
        engine.step()
    short = engine.make_request(_prompt(engine, short_len, 1000), ONE_TOKEN)
    start, steps = time.perf_counter(), 0
    engine.add(short)
    while True:
        steps += 1
        if any(o.request_id == short.request_id and o.token_ids for o in engine.step()):
            break
    seconds = time.perf_counter() - start
    for long in longs:
        engine.abort(long.request_id)
    return seconds, steps


def bench(args, config: EngineConfig) -> dict:
    lengths = [int(x) for x in args.lengths.split(",")]
    config = dataclasses.replace(config, max_model_len=max(max(lengths), args.long_len) + 8)
    costs = prefill_costs(config, lengths)
    print("prefill cost per token (one request, the engine otherwise idle):")
    print(f"{'tokens':>8} {'seconds':>9} {'ms/token':>9} {'ratio':>7} {'FLOPs ratio':>12}")
    for c in costs:
        print(f"{c.tokens:>8} {c.seconds:>9.2f} {c.ms_per_token:>9.2f} {c.ratio:>7.2f} {c.model_ratio:>12.2f}")
    alone, alone_steps = short_ttft(config, args.long_len, args.short_len, 0)
    budget = config.max_num_batched_tokens
    cap, limit = config.long_prefill_threshold(budget), config.long_partial_prefills()
    cases = [(1, cap, limit), (1, 0, limit)]  # one long prompt: the cap, and no cap
    if args.long_prompts > 1 and cap and limit:  # several: the partial-prefill limit, and none
        cases += [(args.long_prompts, cap, limit), (args.long_prompts, cap, 0)]
    runs = []
    for n, threshold, long_limit in cases:
        seconds, steps = short_ttft(
            dataclasses.replace(
                config,
                long_prefill_token_threshold=threshold,
                max_long_partial_prefills=long_limit if threshold else None,  # no cap: no prompt is long
            ),
            args.long_len,
            args.short_len,
            n,
        )
        runs.append(ShortTTFT(n, threshold, long_limit, seconds, steps, seconds / alone))
    print(f"\na {args.short_len}-token request's TTFT: alone {alone:.2f} s ({alone_steps} step)")
    for r in runs:
        how = f"cap {r.long_prefill_token_threshold}" if r.long_prefill_token_threshold else "no cap"
        if r.long_prompts > 1:
            how += f", long prompts at once: {r.max_long_partial_prefills or 'no limit'}"
        print(
            f"  beside {r.long_prompts} x {args.long_len}-token prompt, {how}: {r.ttft_s:.2f} s ({r.steps} steps), "
            f"{r.ratio_to_alone:.1f} x alone"
        )
    figures = {
        "prefill": [asdict(c) for c in costs],
        "short_alone_s": alone,
        "short_beside_long": [asdict(r) for r in runs],
        "long_len": args.long_len,
        "short_len": args.short_len,
        "max_num_batched_tokens": budget,
    }
    path = Path(args.json or Path(args.out) / "bench-long-prefill.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2))
    print(f"\nwrote {path}")
    return figures
