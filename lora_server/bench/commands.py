"""The benchmarks' commands: ``lora-server bench-engine``, ``bench-gpu``, ``bench-spec``, ``bench-pool``,
``bench-fair``, ``bench-long-prefill``, ``bench-quality``, ``bench-tp``, ``bench-staging``, and ``bench NAME``
(vLLM's shape: ``bench serve`` loads any OpenAI-compatible server). Each command's flags and defaults are here;
its work is in its own module of this package, imported when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from lora_server.config import EngineConfig
from lora_server.flags import Commands, add_config_flags, config_from_flags, registry

BENCH_COMMANDS: Commands = {}
command = registry(BENCH_COMMANDS)


def _json_flags(p: argparse.ArgumentParser, name: str) -> None:
    """--out (the results folder) and --json (the figures' path, by default OUT/NAME.json)."""
    p.add_argument("--out", default="results", help="where the JSON goes (default: results, which .gitignore covers)")
    p.add_argument("--json", default=None, help=f"the figures' path (default: OUT/{name}.json)")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _bench_engine_args(p: argparse.ArgumentParser) -> None:
    add_config_flags(
        p, EngineConfig, load_format="dummy", quantization=None, max_num_batched_tokens=8192, kv_cache_bytes=16
    )  # quantization None: none on dummy weights, the checkpoint's own format (auto) with --peer
    p.add_argument(
        "--batch", type=_ints, default=[1, 16, 64, 128], help="batch sizes; takes commas (default: 1,16,64,128)"
    )
    p.add_argument(
        "--adapters",
        type=_ints,
        default=[0, 1, 16, 64],
        help="distinct adapters in the batch; takes commas (default: 0,1,16,64)",
    )
    p.add_argument(
        "--prompt-len", type=_ints, default=[128, 1024], help="prompt lengths; takes commas (default: 128,1024)"
    )
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (default: 128)")
    p.add_argument("--rank", type=int, default=16, help="the benchmark adapters' rank (default: 16)")
    _json_flags(p, "bench-engine")
    p.add_argument("--quick", action="store_true", help="tiny shapes that run on the CPU in seconds")
    p.add_argument(
        "--structured",
        action="store_true",
        help="instead: decode step time with half the batch (the largest --batch) under a JSON schema against none, "
        "on the embedded model",
    )
    p.add_argument("--repeats", type=int, default=3, help="--structured, --peer: runs of each setting (default: 3)")
    p.add_argument(
        "--peer",
        action="store_true",
        help="instead: tokens/s against HF transformers + PEFT (float32) in the same run, on the embedded model in "
        "its default int4 mode, 6 adapters of mixed rank (batches 1 and 24 unless --batch is given)",
    )
    p.add_argument(
        "--ranks", type=_ints, default=[4, 8, 16], help="--peer: the adapters' ranks, round-robin (default: 4,8,16)"
    )
    p.add_argument(
        "--host-work",
        action="store_true",
        help="instead: count the host work of one decode step of the CUDA code path without a GPU (tiny Llama of "
        "--layers layers, the largest --batch and --adapters, --rank): ops, launches, copies, syncs",
    )
    p.add_argument("--layers", type=int, default=32, help="--host-work: the tiny Llama's layers (default: 32)")
    p.add_argument("--steps", type=int, default=3, help="--host-work: decode steps counted (default: 3)")
    p.add_argument(
        "--registered",
        type=_ints,
        default=None,
        help="instead: for each N (takes commas, e.g. 16,2000), register N adapters (time, host memory) and serve "
        "--rounds batches of the first --batch requests whose adapters follow Zipf(--alpha) over them, on the "
        "embedded model",
    )
    p.add_argument("--alpha", type=float, default=1.0, help="--registered: the Zipf exponent (default: 1.0)")
    p.add_argument("--rounds", type=int, default=4, help="--registered: batches served (default: 4)")
    p.add_argument("--trace-seed", type=int, default=0, help="--registered, --loads: the trace's seed (default: 0)")
    p.add_argument(
        "--loads",
        action="store_true",
        help="instead: the decode step time of a batch (the first --batch, 4 adapters) while --load-count other "
        "adapters are registered, staged and loaded, against the same batch with none, on the embedded model",
    )
    p.add_argument("--load-count", type=int, default=8, help="--loads: adapters loaded meanwhile (default: 8)")


@command("bench-engine", "decode throughput against the memory-bandwidth floor", _bench_engine_args)
def _bench_engine(args: argparse.Namespace) -> int:
    from lora_server.bench.engine import bench

    if args.host_work:
        from lora_server.bench.host_work import bench_host_work

        if args.quick:
            args.layers, args.batch, args.adapters, args.steps = 2, [4], [2], 2
        if args.batch == [1, 16, 64, 128] and args.adapters == [0, 1, 16, 64]:  # not given: batch 64, 16 adapters
            args.batch, args.adapters = [64], [16]
        bench_host_work(args)
        return 0
    if args.structured:
        from lora_server.bench.structured import bench_structured

        args.quantization = args.quantization or "none"
        _embedded_model(args)
        if args.quick:
            args.batch, args.output_len, args.repeats = [8], 24, 2
        bench_structured(args, config_from_flags(EngineConfig, args))
        return 0
    if args.registered or args.loads:
        from lora_server.bench.adapters import bench_loads, bench_registered

        _embedded_model(args)
        args.quantization = args.quantization or "auto"
        if args.batch == [1, 16, 64, 128]:  # the defaults of the bandwidth benchmark
            args.batch, args.prompt_len, args.output_len, args.rank = [16], [16], 16, 8
        if args.quick:
            args.batch, args.output_len, args.rounds, args.load_count = [4], 4, 2, 2
        args.max_num_seqs = max(args.max_num_seqs, *args.batch)
        (bench_registered if args.registered else bench_loads)(args, config_from_flags(EngineConfig, args))
        return 0
    if args.peer:
        from lora_server.bench.peer import bench_peer

        _embedded_model(args)
        args.quantization = args.quantization or "auto"
        args.max_lora_rank = max(args.ranks)
        if args.batch == [1, 16, 64, 128]:  # the defaults of the bandwidth benchmark
            args.batch, args.adapters, args.prompt_len, args.output_len = [1, 24], [6], [16], 32
        if args.quick:
            args.batch, args.adapters, args.output_len, args.repeats = [1, 4], [2], 8, 1
        args.max_num_seqs = max(args.max_num_seqs, *args.batch)
        args.max_loras = max(args.max_loras, *args.adapters)
        bench_peer(args, config_from_flags(EngineConfig, args))
        return 0
    if args.quick:
        args.model, args.load_format, args.batch, args.adapters = "tiny-llama", "dummy", [1, 4], [0, 2]
        args.prompt_len, args.output_len, args.kv_cache_bytes, args.rank = [16], 8, 0.05, 8
    elif args.load_format == "dummy" and args.model is None:
        args.model = "llama-3-8b"
    args.quantization = args.quantization or "none"
    bench(args, config_from_flags(EngineConfig, args))
    return 0


def _bench_gpu_args(p: argparse.ArgumentParser) -> None:
    add_config_flags(
        p, EngineConfig, load_format="dummy", model="llama-3-8b", max_num_batched_tokens=8192, kv_cache_bytes=24
    )
    p.add_argument(
        "--modes",
        type=lambda t: t.split(","),
        default=["none", "int8", "int4", "fp8"],
        help="quantization modes, one engine each; takes commas (default: none,int8,int4,fp8; none runs in the "
        "engine's dtype, bfloat16 on CUDA)",
    )
    p.add_argument("--batch", type=_ints, default=[1, 64, 256], help="batch sizes (default: 1,64,256)")
    p.add_argument("--adapters", type=_ints, default=[0, 16, 64], help="distinct adapters (default: 0,16,64)")
    p.add_argument(
        "--prompt-len",
        type=_ints,
        default=[128, 1024],
        help="prompt lengths: the first for every batch and adapter count, the others at batch 1 without adapters "
        "(prefill) (default: 128,1024)",
    )
    p.add_argument("--output-len", type=int, default=64, help="tokens per request (default: 64, as the HF + PEFT peer)")
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank (default: 16)")
    p.add_argument("--out", default="results", help="where the JSON, XML and PNG go (default: results)")
    p.add_argument("--no-tests", dest="tests", action="store_false", help="skip the GPU test tier")
    p.add_argument(
        "--peer-script",
        default=None,
        help="the HF + PEFT peer (the shared bench/peer_hf_peft.py, copied into the checkout), run on CUDA as its "
        "own process (default: none)",
    )
    p.add_argument("--quick", action="store_true", help="a tiny Llama, tiny shapes, no tests: runs on the CPU")


@command(
    "bench-gpu",
    "the GPU acceptance run: the GPU tests, bench-engine per mode, the HF + PEFT peer, goals as JSON and PNG",
    _bench_gpu_args,
)
def _bench_gpu(args: argparse.Namespace) -> int:
    from lora_server.bench.gpu_suite import suite

    args.json = None
    if args.quick:
        args.model, args.batch, args.adapters, args.prompt_len = "tiny-llama", [1, 4], [0, 2], [16, 32]
        args.output_len, args.rank, args.kv_cache_bytes, args.tests = 4, 8, 0.05, False
    summary = suite(args, config_from_flags(EngineConfig, args))
    return 0 if summary["tests"].get("exit_code", 0) == 0 else 1


def _embedded_model(args: argparse.Namespace) -> None:
    """bench-engine's defaults (dummy Llama-3-8B) -> the embedded model."""
    if args.load_format == "dummy":
        args.load_format, args.model, args.kv_cache_bytes = "auto", None, 0.25


def _bench_tp_args(p: argparse.ArgumentParser) -> None:
    add_config_flags(p, EngineConfig, quantization="none", host_kv_bytes=0, kv_cache_bytes=0.25, tensor_parallel_size=2)
    p.add_argument("--batch", type=int, default=4, help="requests in the batch (default: 4)")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (default: 64)")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request (default: 32)")
    p.add_argument("--adapters", type=int, default=0, help="random adapters, request i on i %% K (default: 0)")
    p.add_argument("--adapter-rank", type=int, default=16, help="their rank, on every module (default: 16)")
    _json_flags(p, "bench-tp")


@command(
    "bench-tp", "the step time at --tensor-parallel-size 1 and N on this machine; a step's collectives", _bench_tp_args
)
def _bench_tp(args: argparse.Namespace) -> int:
    from lora_server.bench.tensor_parallel import bench_tp

    bench_tp(args, config_from_flags(EngineConfig, args))
    return 0


def _bench_staging_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shapes", type=lambda t: t.split(","), default=["6.6MB", "80MB"], help="takes commas (default: 6.6MB,80MB)"
    )
    p.add_argument("--registered", type=int, default=2000, help="6.6MB adapters registered (default: 2000)")
    p.add_argument("--large-count", type=int, default=32, help="80MB adapters registered (default: 32)")
    p.add_argument("--staged", type=int, default=32, help="adapters staged per run (default: 32)")
    p.add_argument("--resolutions", type=int, default=50, help="adapters resolved on demand (default: 50)")
    p.add_argument("--workers", type=int, default=2, help="staging workers and registration threads (default: 2)")
    p.add_argument("--tmp", default=None, help="where the adapters are written (default: the system's temp folder)")
    _json_flags(p, "bench-staging")


@command(
    "bench-staging",
    "adapters from files to host pages at Llama-3-8B sizes: registration, on-demand resolution, staging GB/s",
    _bench_staging_args,
)
def _bench_staging(args: argparse.Namespace) -> int:
    from lora_server.bench.staging import bench_staging

    bench_staging(args)
    return 0


def _bench_spec_args(p: argparse.ArgumentParser) -> None:
    add_config_flags(p, EngineConfig, speculative_ngram=5)
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request (default: 64)")
    p.add_argument("--prompts", type=int, default=8, help="input-copying prompts, at most 8 (default: 8)")
    p.add_argument(
        "--large-batch", type=int, default=16, help="the batch run above speculative_max_batch (default: 16)"
    )
    _json_flags(p, "bench-spec")


@command("bench-spec", "prompt-lookup speculative decoding against none: acceptance and TPOT", _bench_spec_args)
def _bench_spec(args: argparse.Namespace) -> int:
    from lora_server.bench.spec import bench

    bench(args, config_from_flags(EngineConfig, args, show_progress=False))
    return 0


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


# bench-pool's trace settings: by default, and with --sweep (light to saturated on this project's 2-core CPU)
DEFAULTS: dict[str, Any] = {"adapters": [20, 100], "alpha": [0.5, 1.0, 1.5], "rate": [0.3, 0.6], "sessions": 24}
SWEEP: dict[str, Any] = {
    "adapters": [16, 2000],
    "alpha": [0.5, 1.0],
    "rate": [0.25, 0.5, 1.0, 2.0, 4.0],
    "sessions": 12,
}


def _bench_pool_args(p: argparse.ArgumentParser) -> None:
    add_config_flags(
        p,
        EngineConfig,
        quantization="none",
        max_num_seqs=16,
        max_num_batched_tokens=256,
        num_kv_blocks=112,
    )
    p.add_argument(
        "--separate-slots",
        type=int,
        default=4,
        help="lru-separate's adapter slots, reserved up front at the largest rank: its --max-loras, as vLLM's "
        "(default: 4, its best at the 112-block budget: 2 and 6 slots queue longer); the arena policies batch up "
        "to --max-loras distinct adapters within the same budget",
    )
    p.add_argument(
        "--kv-blocks",
        dest="num_kv_blocks",
        type=int,
        help="the device budget in KV blocks, adapters included (the same as --num-kv-blocks)",
    )
    p.add_argument(
        "--policies",
        type=lambda t: t.split(","),
        default=["tree-cost", "lru-separate", "lru-unified"],
        help="pool policies to compare; takes commas (default: all three)",
    )
    p.add_argument(
        "--adapters", type=_ints, default=None, help="adapters in the trace (N); takes commas (default: 20,100)"
    )
    p.add_argument(
        "--alpha",
        type=_floats,
        default=None,
        help="Zipf exponents of adapter popularity; takes commas (default: 0.5,1.0,1.5)",
    )
    p.add_argument(
        "--rate",
        type=_floats,
        default=None,
        help="session arrivals per second (Poisson); takes commas (default: 0.3,0.6)",
    )
    p.add_argument("--sessions", type=int, default=None, help="sessions per setting (default: 24; 12 with --sweep)")
    p.add_argument("--turns", type=int, default=3, help="turns per session (default: 3)")
    p.add_argument("--system-tokens", type=int, default=32, help="each adapter's system prompt (default: 32)")
    p.add_argument("--user-tokens", type=int, default=48, help="new tokens per turn (default: 48)")
    p.add_argument("--output-tokens", type=int, default=16, help="answer tokens per turn (default: 16)")
    p.add_argument(
        "--think-s", type=float, default=2.0, help="seconds between a turn's answer and the next turn (default: 2)"
    )
    p.add_argument("--host-blocks", type=int, default=640, help="host-tier KV blocks (default: 640)")
    p.add_argument("--rank", type=int, default=8, help="the trace adapters' rank (default: 8)")
    p.add_argument("--trace-seed", type=int, default=0, help="the trace's random seed (default: 0)")
    p.add_argument(
        "--out", default="results", help="where the JSON and the PNG go (default: results, which .gitignore covers)"
    )
    p.add_argument("--json", default=None, help="the figures' path (default: OUT/bench-pool.json)")
    p.add_argument(
        "--plot", default=None, help="the PNG of TTFT and hit rates, '' for none (default: OUT/bench-pool.png)"
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help=f"the load sweep: N = {','.join(map(str, SWEEP['adapters']))} adapters, alpha "
        f"{','.join(map(str, SWEEP['alpha']))}, rates {','.join(map(str, SWEEP['rate']))} sessions/s (light to "
        f"saturated on a 2-core CPU), {SWEEP['sessions']} sessions each; --adapters, --alpha, --rate and "
        "--sessions given with it win",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="one small setting (N = 20, alpha 1.0, 0.5 sessions/s, 6 sessions of 2 turns): about a minute on a "
        "2-core CPU",
    )


@command("bench-pool", "pool policies side by side on a multi-turn Zipf trace (TTFT, hit rates)", _bench_pool_args)
def _bench_pool(args: argparse.Namespace) -> int:
    from lora_server.bench.pool import bench

    if args.quick:
        args.adapters, args.alpha, args.rate, args.sessions, args.turns = [20], [1.0], [0.5], 6, 2
    elif args.sweep:
        for name, values in SWEEP.items():
            if getattr(args, name) is None:
                setattr(args, name, values)
    for name, values in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, values)
    bench(args, config_from_flags(EngineConfig, args, show_progress=False))
    return 0


def _bench_fair_args(p: argparse.ArgumentParser) -> None:
    add_config_flags(p, EngineConfig, quantization="none", max_num_seqs=8, kv_cache_bytes=0.25, host_kv_bytes=0)
    p.add_argument("--heavy", type=int, default=50, help="the heavy tenant's requests, queued at once (default: 50)")
    p.add_argument("--light", type=int, default=5, help="the light tenant's requests per round (default: 5)")
    p.add_argument("--rounds", type=int, default=4, help="the light tenant's rounds (default: 4)")
    p.add_argument("--gap", type=int, default=12, help="steps between the light tenant's rounds (default: 12)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of every request (default: 32)")
    p.add_argument("--output-len", type=int, default=8, help="tokens generated per request (default: 8)")
    p.add_argument("--trace-seed", dest="trace_seed", type=int, default=0, help="the prompts' seed (default: 0)")
    _json_flags(p, "bench-fair")


@command("bench-fair", "a light tenant's TTFT beside a flooding one, fair sharing on and off", _bench_fair_args)
def _bench_fair(args: argparse.Namespace) -> int:
    from lora_server.bench.fair import bench

    bench(args, config_from_flags(EngineConfig, args, show_progress=False))
    return 0


def _bench_long_prefill_args(p: argparse.ArgumentParser) -> None:
    add_config_flags(p, EngineConfig, quantization="none", kv_cache_bytes=2, host_kv_bytes=0)
    p.add_argument(
        "--lengths", default="500,2000,7000", help="prompt lengths of the cost table (default: 500,2000,7000)"
    )
    p.add_argument("--long-len", type=int, default=7000, help="the long prompt beside the short one (default: 7000)")
    p.add_argument("--short-len", type=int, default=32, help="the short request's prompt tokens (default: 32)")
    p.add_argument(
        "--long-prompts",
        type=int,
        default=4,
        help="long prompts started together for the partial-prefill limit's case (default: 4, enough to fill the "
        "step with a quarter of it each; 1 skips the case)",
    )
    _json_flags(p, "bench-long-prefill")


@command(
    "bench-long-prefill",
    "prefill cost per token by prompt length, and a short request's TTFT beside a long prompt (cap on and off)",
    _bench_long_prefill_args,
)
def _bench_long_prefill(args: argparse.Namespace) -> int:
    from lora_server.bench.long_prefill import bench

    bench(args, config_from_flags(EngineConfig, args, show_progress=False))
    return 0


QUALITY_MODES = "auto,int8,int4,fp8,none+fp8kv"


def _bench_quality_args(p: argparse.ArgumentParser) -> None:
    add_config_flags(p, EngineConfig, quantization=None, kv_cache_bytes=0.25, host_kv_bytes=0)
    p.add_argument(
        "--modes",
        default=QUALITY_MODES,
        help="the modes scored against the reference (--model held unquantized in float32), one engine each; takes "
        "commas; a mode is a --quantization value, +fp8kv adds the fp8 KV cache (none+fp8kv: float weights, fp8 KV "
        f"cache); each runs in --dtype; '' for none (default: {QUALITY_MODES})",
    )
    p.add_argument(
        "--compare",
        nargs="+",
        default=[],
        metavar="PATH",
        help="other checkpoints of --model's model (another GGUF block type, a pre-quantized directory), each read "
        "in its own format (quantization auto) and scored against the reference like a mode (default: none)",
    )
    p.add_argument(
        "--adapters",
        default=None,
        help="adapters scored beside the base model, each against the reference with the same adapter: demo "
        "adapter names or NAME=PATH; takes commas; 'none' for the base model alone (default: every demo adapter "
        "for the embedded model, none for another --model)",
    )
    p.add_argument(
        "--ctx",
        type=int,
        default=512,
        help="tokens per chunk, each a prompt of its own; the second half of each is scored (default: 512, as "
        "llama-perplexity)",
    )
    p.add_argument("--chunks", type=int, default=None, help="score at most this many chunks (default: all)")
    p.add_argument(
        "--text",
        default=None,
        help="the text to score (default: the packaged lora_server/bench/quality_text.txt, ~3,900 words)",
    )
    p.add_argument("--quick", action="store_true", help="--ctx 128 --chunks 2: about a minute on a 2-core CPU")
    _json_flags(p, "bench-quality")


@command(
    "bench-quality",
    "perplexity, KL divergence from the unquantized model and top-1 agreement per quantization mode and adapter "
    "(as llama-perplexity --kl-divergence)",
    _bench_quality_args,
)
def _bench_quality(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lora_server.adapters import demo_adapters
    from lora_server.bench.quality import TEXT_PATH, Plan, bench, checkpoint_mode, parse_mode
    from lora_server.errors import ConfigError

    if args.quantization is not None or args.kv_cache_dtype != "auto":
        raise ConfigError("bench-quality sets each engine's quantization and KV cache: name them in --modes")
    if args.quick:
        args.ctx, args.chunks = 128, 2
    demos = demo_adapters()
    if args.adapters is None:
        specs = list(demos) if args.model is None else []
    else:
        specs = [] if args.adapters == "none" else [s for s in args.adapters.split(",") if s]
    adapters = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if not path and name not in demos:
            raise ConfigError(f"--adapters {name}: no demo adapter of that name ({', '.join(demos)}); use NAME=PATH")
        adapters[name] = path or str(demos[name])
    plan = Plan(
        modes=[parse_mode(m) for m in args.modes.split(",") if m] + [checkpoint_mode(p) for p in args.compare],
        adapters=adapters,
        ctx=args.ctx,
        chunk_limit=args.chunks,
        text_path=Path(args.text) if args.text else TEXT_PATH,
    )
    base = config_from_flags(EngineConfig, args, quantization="none", show_progress=False)
    bench(plan, base, Path(args.json) if args.json else Path(args.out) / "bench-quality.json")
    return 0


def _bench_llamacpp_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary (built from its source)")
    p.add_argument("--model", default=None, help="the GGUF file both serve (default: the embedded model)")
    p.add_argument("--streams", type=_ints, default=[1, 24], help="concurrent streams; takes commas (default: 1,24)")
    p.add_argument("--output-len", type=int, default=64, help="tokens per stream (default: 64)")
    p.add_argument("--passes", type=int, default=2, help="passes per point, the best counts (default: 2)")
    p.add_argument("--threads", type=int, default=None, help="threads of each server (default: the cores)")
    p.add_argument("--adapter", default=None, help="every stream with this adapter of this server (a demo's name)")
    p.add_argument("--adapter-path", default=None, help="--adapter's PEFT directory, where it is not a demo's name")
    p.add_argument("--llama-lora", default=None, help="--adapter converted for llama.cpp (convert_lora_to_gguf.py)")
    p.add_argument("--mixed", action="store_true", help="with --adapter: streams alternate base and adapter")
    _json_flags(p, "bench-llamacpp")


@command(
    "bench-llamacpp",
    "this server and llama.cpp's llama-server on the same GGUF, each alone, through HTTP: tok/s and TPOT",
    _bench_llamacpp_args,
)
def _bench_llamacpp(args: argparse.Namespace) -> int:
    from lora_server.bench.llamacpp import bench

    if args.adapter and not args.llama_lora:
        raise SystemExit("error: --adapter needs --llama-lora (the adapter converted for llama.cpp)")
    bench(args)
    return 0


def _bench_serve_args(p: argparse.ArgumentParser) -> None:
    from lora_server.bench.serve import add_args

    add_args(p)


def _bench_serve(args: argparse.Namespace) -> int:
    from lora_server.bench.serve import main

    return main(args)


# lora-server bench NAME: vLLM's shape (vllm bench serve); engine and pool are bench-engine and bench-pool again
BENCHMARKS = {
    "serve": ("load an OpenAI-compatible server the way vllm bench serve does", _bench_serve_args, _bench_serve),
    "engine": BENCH_COMMANDS["bench-engine"],
    "pool": BENCH_COMMANDS["bench-pool"],
    "fair": BENCH_COMMANDS["bench-fair"],
}


def _bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="benchmark", required=True, metavar="{serve,engine,pool,fair}")
    for name, (help_text, add_args, _) in BENCHMARKS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))


@command("bench", "benchmarks: serve (any OpenAI-compatible server), engine, pool, fair", _bench_args)
def _bench(args: argparse.Namespace) -> int:
    return BENCHMARKS[args.benchmark][2](args)


def _bench_e2e_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick",
        action="store_true",
        help="a tiny Llama (4 layers, hidden 128) on the CPU instead of Llama-3-8B's shape",
    )
    p.add_argument("--adapters", type=int, default=2000, help="adapters written and registered (default: 2000)")
    p.add_argument("--few", type=int, default=16, help="the reference point's adapters (default: 16)")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per point (default: 384; 128 with --quick)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer directory from lora-server export-tokenizer, for machines without the embedded model "
        "(default: exported at the start of the run)",
    )
    p.add_argument(
        "--workdir",
        default=None,
        help="an empty folder for the checkpoint, the adapters and the servers' data, kept (default: a temporary "
        "folder, removed at the end)",
    )
    p.add_argument(
        "--small-arena-gb",
        type=float,
        default=None,
        help="the last point's --kv-cache-gb (default: one full batch's KV and 64 adapters, a quarter to spare)",
    )
    _json_flags(p, "bench-e2e")


@command(
    "bench-e2e",
    "thousands of adapters at the speed of a few: a synthetic checkpoint, N adapters and the real HTTP server under "
    "load, 16 adapters against N uniform and Zipf",
    _bench_e2e_args,
)
def _bench_e2e(args: argparse.Namespace) -> int:
    import sys

    from lora_server.bench.e2e import bench_e2e

    if args.num_prompts is None:
        args.num_prompts = 128 if args.quick else 384
    try:
        bench_e2e(args)
    except RuntimeError as exc:  # a server or a request failed: no figures to trust
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
