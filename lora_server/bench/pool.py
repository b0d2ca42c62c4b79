"""``lora-server bench-pool``: the unified pool's policies side by side on one multi-turn trace, on the real engine.

The trace. Sessions arrive as a Poisson process (`rate` per second); each picks an adapter by Zipf popularity
(p_i proportional to 1 / i^alpha over N adapters) and runs `turns` turns. Every adapter has its own system prompt;
turn k's prompt is the conversation so far (the previous prompt and the model's answer) plus `user_tokens` new
tokens, and it arrives `think_s` after the previous answer. Answers are greedy, `output_tokens` long (EOS ignored),
so every policy must produce the same tokens (checked: cached KV is exact) and the runs differ only in what the pool
kept. The device budget is tight on purpose: adapters and KV compete for it.

Per policy: mean and p99 TTFT (arrival to first token) with its split into queueing, adapter loading and prefill,
the adapter hit rate (requests whose adapter was resident at admission), the KV-token hit rate (prompt tokens served
from cache), the invalid-KV ratio (GPU KV blocks whose adapter is not resident, sampled every 0.25 s and averaged),
bytes moved each way and evictions by kind."""

from __future__ import annotations

import dataclasses
import heapq
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lora_server.bench.engine import write_random_adapters
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.engine.outputs import RequestTimings
from lora_server.kv_pool.policies import POLICIES as POLICY_CLASSES
from lora_server.model.arena import page_bytes
from lora_server.model.loader import open_checkpoint
from lora_server.sampling_params import SamplingParams

POLICIES = ("tree-cost", "lru-separate", "lru-unified")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class TraceSpec:
    num_adapters: int
    alpha: float  # Zipf exponent of adapter popularity
    rate: float  # sessions per second
    sessions: int
    turns: int = 3
    system_tokens: int = 32  # per adapter, at the start of each of its sessions
    user_tokens: int = 48  # new tokens per turn
    output_tokens: int = 16
    think_s: float = 0.5  # between an answer and the next turn
    seed: int = 0


@dataclass(frozen=True)
class Session:
    adapter: int
    start: float  # arrival of its first turn, seconds after the trace starts
    user: tuple[tuple[int, ...], ...]  # [turns] the new tokens of each turn


def make_trace(spec: TraceSpec, vocab: int) -> tuple[list[tuple[int, ...]], list[Session]]:
    """The adapters' system prompts and the sessions, all from spec.seed."""
    rng = random.Random(spec.seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(10, vocab) for _ in range(n))

    systems = [tokens(spec.system_tokens) for _ in range(spec.num_adapters)]
    weights = [1 / (i + 1) ** spec.alpha for i in range(spec.num_adapters)]
    sessions, t = [], 0.0
    for _ in range(spec.sessions):
        t += rng.expovariate(spec.rate)
        adapter = rng.choices(range(spec.num_adapters), weights)[0]
        sessions.append(Session(adapter, t, tuple(tokens(spec.user_tokens) for _ in range(spec.turns))))
    return systems, sessions


@dataclass
class PolicyResult:
    policy: str
    requests: int
    ttft_mean_s: float
    ttft_p99_s: float
    queueing_mean_s: float
    adapter_loading_mean_s: float
    prefill_mean_s: float
    adapter_hit_rate: float
    kv_token_hit_rate: float
    invalid_kv_ratio: float  # time average
    bytes_to_gpu: int
    bytes_to_host: int
    evicted_blocks: dict[str, int]
    duration_s: float
    # the engine's time over the run (StepTimes): the scheduler and the pool's policy, the pool's copies (KV swaps,
    # adapter loads), the forward passes
    schedule_s: float
    copy_s: float
    forward_s: float
    steps: int
    outputs: dict[str, list[int]] = field(repr=False)  # "session/turn" -> answer tokens


def run_policy(
    engine: Engine,
    adapter_dir: Path,
    names: list[str],
    spec: TraceSpec,
    systems: list[tuple[int, ...]],
    sessions: list[Session],
) -> PolicyResult:
    """Run the trace on a fresh engine (its policy is the engine's) and shut the engine down."""
    config = engine.config
    for name in names:
        engine.adapters.add(name, adapter_dir / name)
    params = SamplingParams(max_tokens=spec.output_tokens, temperature=0, ignore_eos=True)
    engine.generate([list(systems[0]) + [11] * 8], SamplingParams(max_tokens=2), adapters=None)  # warm-up
    start_times = engine.snapshot().step_times  # the trace's steps only: those after it
    history = {i: list(systems[s.adapter]) for i, s in enumerate(sessions)}
    arrivals = [(s.start, i, 0) for i, s in enumerate(sessions)]  # (time, session, turn)
    heapq.heapify(arrivals)
    answers: dict[str, list[int]] = {}  # "session/turn" -> its tokens so far, while it runs
    done: list[RequestTimings] = []  # of the finished requests
    cached_tokens = prompt_tokens = 0  # prompt tokens of the finished requests: from cached KV, in all
    outputs: dict[str, list[int]] = {}
    invalid: list[float] = []
    t0 = time.monotonic()
    next_sample = 0.0
    idle_steps = 0
    while arrivals or engine.has_work():
        now = time.monotonic() - t0
        while arrivals and arrivals[0][0] <= now:
            at, i, turn = heapq.heappop(arrivals)
            history[i] += sessions[i].user[turn]
            request = engine.make_request(
                list(history[i]), params, names[sessions[i].adapter], request_id=f"{i}/{turn}", arrival_time=t0 + at
            )
            answers[request.request_id] = []
            engine.add(request)
        if now >= next_sample:
            invalid.append(engine.snapshot().pool.stats.invalid_kv_ratio)
            next_sample = now + 0.25
        if not engine.has_work():
            time.sleep(max(0.0, min(0.05, arrivals[0][0] - now)))
            continue
        outs = engine.step()
        idle_steps = 0 if outs or engine.snapshot().running else idle_steps + 1
        if idle_steps > 1000:
            raise RuntimeError("the engine admits nothing: the trace does not fit the pool")
        for out in outs:
            answers[out.request_id] += out.token_ids
            if not out.finished:
                continue
            assert out.timings is not None, "a request's last output carries its timings"
            done.append(out.timings)
            cached_tokens += out.num_cached_tokens
            prompt_tokens += out.num_prompt_tokens
            i, turn = map(int, out.request_id.split("/"))
            answer = answers.pop(out.request_id)
            outputs[out.request_id] = answer
            history[i] += answer
            if turn + 1 < spec.turns:
                heapq.heappush(arrivals, (time.monotonic() - t0 + spec.think_s, i, turn + 1))
    duration = time.monotonic() - t0
    engine.check_integrity()
    snapshot = engine.snapshot()
    stats, times = snapshot.pool.stats, snapshot.step_times.since(start_times)
    engine.shutdown()
    splits = [_ttft_split(t) for t in done]
    ttfts = sorted(ttft for ttft, _, _ in splits)
    n = len(done)

    def mean(values: list[float]) -> float:
        return sum(values) / max(1, len(values))

    queueing = [q for _, q, _ in splits]
    adapter = [a for _, _, a in splits]
    prefill = [ttft - q - a for ttft, q, a in splits]
    return PolicyResult(
        policy=config.pool_policy,
        requests=n,
        ttft_mean_s=mean(ttfts),
        ttft_p99_s=ttfts[min(n - 1, int(0.99 * n))] if n else 0.0,
        queueing_mean_s=mean(queueing),
        adapter_loading_mean_s=mean(adapter),
        prefill_mean_s=mean(prefill),
        adapter_hit_rate=sum(not t.adapter_loaded for t in done) / max(1, n),
        kv_token_hit_rate=cached_tokens / max(1, prompt_tokens),
        invalid_kv_ratio=mean(invalid),
        bytes_to_gpu=stats.bytes_to_gpu,
        bytes_to_host=stats.bytes_to_host,
        evicted_blocks=stats.evicted_blocks,
        duration_s=duration,
        schedule_s=times.schedule_s,
        copy_s=times.copy_s,
        forward_s=times.forward_s,
        steps=times.steps,
        outputs=outputs,
    )


def _ttft_split(t: RequestTimings) -> tuple[float, float, float]:
    """A request's TTFT (arrival to first token) and its queueing and adapter-loading parts (the rest is prefill)."""
    assert t.first_admission is not None and t.first_token is not None, "every request of the trace has a token"
    return t.first_token - t.arrival, t.first_admission - t.arrival, t.adapter_load_s


def bench(args, base: EngineConfig) -> dict:
    """Every (adapters, alpha, rate) setting, each policy on the same trace, on engines built from ``base`` (its
    num_kv_blocks the device budget); prints a table, writes --json and --plot.

    The budgets (base.num_kv_blocks, --host-blocks) count blocks of the model's dtype: with --kv-cache-dtype fp8
    the same bytes are cut into that many times more, smaller blocks (4x for fp32, 2x for bf16), so that runs with
    and without fp8 compare at the same memory."""
    settings = [(n, a, r) for n in args.adapters for a in args.alpha for r in args.rate]
    probe = dataclasses.replace(base, max_lora_rank=args.rank)
    arch = open_checkpoint(probe).arch  # reads the file's metadata; weights load lazily
    model_block_bytes = page_bytes(arch, probe.block_size, probe.torch_dtype)
    block_bytes, device = (
        page_bytes(arch, probe.block_size, probe.torch_kv_cache_dtype),
        str(probe.torch_device),
    )
    if probe.num_kv_blocks is not None:
        probe = dataclasses.replace(probe, num_kv_blocks=probe.num_kv_blocks * model_block_bytes // block_bytes)
    results = []
    costs: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        names: list[str] = []
        for n, alpha, rate in settings:
            spec = TraceSpec(
                n,
                alpha,
                rate,
                args.sessions,
                args.turns,
                args.system_tokens,
                args.user_tokens,
                args.output_tokens,
                args.think_s,
                args.trace_seed,
            )
            systems, sessions = make_trace(spec, arch.vocab_size)
            row = {"adapters": n, "alpha": alpha, "rate": rate, "policies": {}}
            for policy in args.policies:
                engine = Engine(
                    dataclasses.replace(
                        probe,
                        pool_policy=policy,
                        host_kv_bytes=args.host_blocks * model_block_bytes,
                        max_loras=args.separate_slots if POLICY_CLASSES[policy].adapter_slots else probe.max_loras,
                    )
                )
                if not names:
                    names = write_random_adapters(Path(tmp), max(args.adapters), args.rank, engine, targets=TARGETS)
                    costs = _copy_costs(engine)
                    print(
                        f"copies measured at start: {costs['h2d_bytes_per_s'] / 1e9:.2f} GB/s to the device, "
                        f"{costs['d2h_bytes_per_s'] / 1e9:.2f} GB/s to the host, "
                        f"{costs['copy_latency_s'] * 1e6:.1f} us a copy; they stall compute: "
                        f"{costs['copies_stall_compute']}",
                        flush=True,
                    )
                print(
                    f"N={n} alpha={alpha} rate={rate}: running {policy} on {len(sessions)} sessions x "
                    f"{spec.turns} turns ...",
                    flush=True,
                )
                res = run_policy(engine, Path(tmp), names[:n], spec, systems, sessions)
                row["policies"][policy] = res
                print(_line(n, alpha, rate, res, "device" if device == "cpu" else "GPU"), flush=True)
            outs = [r.outputs for r in row["policies"].values()]
            row["same_tokens"] = all(o == outs[0] for o in outs)  # exact KV reuse (fp32; bf16 rounding may differ)
            row["ratios"] = _ratios(row["policies"])
            said = ", ".join(f"{k} {v:.2f}" for k, v in row["ratios"].items())
            print(f"  tree-cost / LRU: {said or '-'}; same tokens under every policy: {row['same_tokens']}", flush=True)
            results.append(row)
    report = {
        "device": device,
        "copy_costs": costs,
        "model": base.model or "SmolLM2-135M-Instruct (embedded)",
        "kv_cache_dtype": base.kv_cache_dtype,
        "kv_blocks": probe.num_kv_blocks,
        "host_blocks": args.host_blocks * model_block_bytes // block_bytes,
        "block_bytes": block_bytes,
        "max_loras": base.max_loras,  # the arena policies'
        "separate_slots": args.separate_slots,  # lru-separate's max_loras
        "rank": args.rank,
        "targets": list(TARGETS),
        "sessions": args.sessions,
        "turns": args.turns,
        "settings": [
            {
                **row,
                "policies": {
                    p: {k: v for k, v in asdict(r).items() if k != "outputs"} for p, r in row["policies"].items()
                },
            }
            for row in results
        ],
    }
    out = Path(args.out)
    json_path = Path(args.json) if args.json else out / "bench-pool.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1))
    print(f"figures written to {json_path}")
    if args.plot != "":
        plot(report, Path(args.plot) if args.plot else out / "bench-pool.png")
    return report


def _copy_costs(engine: Engine) -> dict:
    """The copy costs the engine measured at start, as its pool's cost model prices them."""
    c = engine.describe().copy_costs
    return {
        "h2d_bytes_per_s": c.h2d_bytes_per_s,
        "d2h_bytes_per_s": c.d2h_bytes_per_s,
        "copy_latency_s": c.latency_s,
        "copies_stall_compute": c.stalls_compute,
    }


def _ratios(policies: dict[str, PolicyResult]) -> dict[str, float]:
    """tree-cost's mean TTFT over each LRU policy's, and its p99 over lru-separate's (the acceptance ratios)."""
    tc = policies.get("tree-cost")
    if tc is None:
        return {}
    out = {}
    for other, key in (("lru-separate", "ttft_mean_s"), ("lru-unified", "ttft_mean_s"), ("lru-separate", "ttft_p99_s")):
        if other in policies and getattr(policies[other], key) > 0:
            out[f"{key.removeprefix('ttft_').removesuffix('_s')} vs {other}"] = getattr(tc, key) / getattr(
                policies[other], key
            )
    return out


def _line(n: int, alpha: float, rate: float, r: PolicyResult, device: str) -> str:
    """One policy's figures; ``device`` names the pool's device tier ("GPU", or "device" on the CPU, where both
    tiers are host memory)."""
    return (
        f"N={n:<5d} alpha={alpha:<4} rate={rate:<5} {r.policy:<13} TTFT mean {r.ttft_mean_s * 1e3:8.1f} ms  "
        f"p99 {r.ttft_p99_s * 1e3:8.1f} ms  (queue {r.queueing_mean_s * 1e3:7.1f}, adapter "
        f"{r.adapter_loading_mean_s * 1e3:6.1f}, prefill {r.prefill_mean_s * 1e3:7.1f})  adapter hit "
        f"{r.adapter_hit_rate:5.1%}  KV hit {r.kv_token_hit_rate:5.1%}  invalid KV {r.invalid_kv_ratio:5.1%}  "
        f"to {device} {r.bytes_to_gpu / 2**20:7.1f} MiB  to host {r.bytes_to_host / 2**20:7.1f} MiB  "
        f"{r.requests} requests in {r.duration_s:.1f} s (scheduling {r.schedule_s:.2f} s, copies {r.copy_s:.2f} s, "
        f"forward {r.forward_s:.1f} s, {r.steps} steps)"
    )


def plot(report: dict, path: Path) -> None:
    """Mean (solid) and p99 (dashed) TTFT against the session rate, one line per policy, one panel per (N, alpha)
    (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    settings = report["settings"]
    panels = sorted({(s["adapters"], s["alpha"]) for s in settings})
    policies = list(settings[0]["policies"])
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, (n, alpha) in zip(axes[0], panels, strict=True):
        rows = sorted((s for s in settings if (s["adapters"], s["alpha"]) == (n, alpha)), key=lambda s: s["rate"])
        rates = [s["rate"] for s in rows]
        for k, policy in enumerate(policies):
            color = f"C{k}"
            ax.plot(rates, [s["policies"][policy]["ttft_mean_s"] for s in rows], "o-", color=color, label=policy)
            ax.plot(rates, [s["policies"][policy]["ttft_p99_s"] for s in rows], "x--", color=color)
        ax.set_xlabel("sessions per second")
        ax.set_ylabel("TTFT (s): mean solid, p99 dashed")
        ax.set_yscale("log")
        ax.set_title(f"N = {n}, alpha = {alpha}")
    axes[0][0].legend()
    fig.suptitle(
        f"bench-pool on {report['device']}: {report['model']}, {report['kv_blocks']} device KV blocks, "
        f"{report['host_blocks']} host blocks"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}")
