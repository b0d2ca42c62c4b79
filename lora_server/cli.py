"""The ``lora-server`` command: one sub-command per job, each registered with its own arguments."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from kv_pool.policies import POLICIES
from lora_server.config import DEVICES, DTYPES, LOAD_FORMATS, QUANTIZATIONS, EngineConfig

POOL_POLICIES = tuple(POLICIES)

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help_text: str, add_args: Callable[[argparse.ArgumentParser], None]):
    def register(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = (help_text, add_args, run)
        return run
    return register


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF dir, .gguf file, or dummy preset (default: embedded SmolLM2)")
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    p.add_argument("--quantization", default="auto", choices=QUANTIZATIONS)
    p.add_argument("--dtype", default="auto", choices=tuple(DTYPES))
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-gb", type=float, default=1.0,
                   help="the pool's device budget for KV blocks and resident adapters")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="on CUDA, use this share of the memory left after loading as the budget instead")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--pool-policy", default="tree-cost", choices=POOL_POLICIES,
                   help="what the unified pool keeps on the device (default: tree-cost, FastLibra's cost model)")
    p.add_argument("--host-kv-gb", type=float, default=1.0, help="host tier for KV swapped out of the device")
    p.add_argument("--max-loras", type=int, default=8, help="adapters resident on the device at once")
    p.add_argument("--max-lora-rank", type=int, default=16)


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    values = dict(model=args.model, load_format=args.load_format, quantization=args.quantization, dtype=args.dtype,
                  device=args.device, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_bytes=int(args.kv_cache_gb * 2**30),
                  enable_chunked_prefill=not args.no_chunked_prefill, pool_policy=args.pool_policy,
                  host_kv_bytes=int(args.host_kv_gb * 2**30), max_loras=args.max_loras,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  max_lora_rank=args.max_lora_rank)
    values.update(overrides)
    return EngineConfig(**values)


def _generate_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--adapter", default=None,
                   help="a demo adapter's NAME, or NAME=PATH of any PEFT LoRA directory (default: the base model)")
    p.add_argument("prompt")


@command("generate", "print the completion of one prompt", _generate_args)
def _generate(args: argparse.Namespace) -> int:
    from lora_server.engine import Engine
    from lora_server.sampling_params import SamplingParams

    engine = Engine(engine_config(args))
    adapter = _register_adapter(engine, args.adapter) if args.adapter else None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    prompt = args.prompt if args.raw else engine.chat_prompt([{"role": "user", "content": args.prompt}])
    [completion] = engine.generate([prompt], params, adapters=adapter)
    print(completion.text)
    return 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _bench_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="dummy preset or config.json (default llama-3-8b), or with --load-format auto a model path "
                        "(default: the embedded SmolLM2)")
    p.add_argument("--load-format", default="dummy", choices=LOAD_FORMATS)
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS)
    p.add_argument("--dtype", default="auto", choices=tuple(DTYPES))
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--batch", type=_ints, default=[1, 16, 64, 128])
    p.add_argument("--adapters", type=_ints, default=[0, 1, 16, 64], help="distinct adapters in the batch")
    p.add_argument("--prompt-len", type=_ints, default=[128, 1024])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-cache-gb", type=float, default=16.0)
    p.add_argument("--json", default=None, help="write the figures to this path")
    p.add_argument("--quick", action="store_true", help="tiny shapes that run on the CPU in seconds")


@command("bench-engine", "decode throughput against the memory-bandwidth floor", _bench_engine_args)
def _bench_engine(args: argparse.Namespace) -> int:
    from lora_server.bench.engine import bench

    if args.quick:
        args.model, args.load_format, args.batch, args.adapters = "tiny-llama", "dummy", [1, 4], [0, 2]
        args.prompt_len, args.output_len, args.kv_cache_gb, args.rank = [16], 8, 0.05, 8
    elif args.load_format == "dummy" and args.model is None:
        args.model = "llama-3-8b"
    bench(args)
    return 0


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _bench_pool_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model path, or a dummy preset with --load-format dummy "
                   "(default: the embedded SmolLM2)")
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                   help="none (default): fp32 on the CPU, so every policy must give the same tokens (the CPU int4 "
                        "kernel rounds activations to bf16, which makes greedy tokens depend on the batch)")
    p.add_argument("--dtype", default="auto", choices=tuple(DTYPES))
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--policies", type=lambda t: t.split(","), default=["tree-cost", "lru-separate", "lru-unified"])
    p.add_argument("--adapters", type=_ints, default=[20, 100], help="adapters in the trace (N)")
    p.add_argument("--alpha", type=_floats, default=[0.5, 1.0, 1.5], help="Zipf exponents of adapter popularity")
    p.add_argument("--rate", type=_floats, default=[0.3, 0.6], help="session arrivals per second (Poisson)")
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=32)
    p.add_argument("--user-tokens", type=int, default=48)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--think-s", type=float, default=2.0)
    p.add_argument("--kv-blocks", type=int, default=112, help="the device budget in KV blocks (adapters included)")
    p.add_argument("--host-blocks", type=int, default=640, help="host-tier KV blocks")
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures to this path")
    p.add_argument("--plot", default="bench-pool.png", help="PNG of TTFT and hit rates ('' for none)")
    p.add_argument("--quick", action="store_true", help="one small setting: under two minutes on the CPU")


@command("bench-pool", "pool policies side by side on a multi-turn Zipf trace (TTFT, hit rates)", _bench_pool_args)
def _bench_pool(args: argparse.Namespace) -> int:
    from lora_server.bench.pool import bench

    if args.quick:
        args.adapters, args.alpha, args.rate, args.sessions, args.turns = [20], [1.0], [0.5], 8, 3
    bench(args)
    return 0


def _serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the base model's id (default: from the model file)")
    p.add_argument("--adapter", action="append", default=None,
                   help="NAME=PATH (or a demo NAME) to load at start; may repeat (default: every demo adapter)")
    p.add_argument("--adapter-root", action="append", default=[],
                   help="a directory the admin API may load adapters from; may repeat (the demo adapters' always)")
    p.add_argument("--admin-key", default=None, help="admin API key (default: $LORA_SERVER_ADMIN_KEY, else random)")
    p.add_argument("--api-key", default=None,
                   help="a key that grants the global /v1 endpoints (tenants' keys act as their tenant there too)")
    p.add_argument("--allow-anonymous", action="store_true",
                   help="keep /v1 open to callers without a key once tenants exist (without this flag and without "
                        "--api-key, /v1 is open only while no tenant exists)")
    p.add_argument("--max-request-mb", type=float, default=4.0,
                   help="request bodies above this size get 413 (default: 4)")
    p.add_argument("--data-dir", default=None, help="registry directory (default: $LORA_SERVER_DATA_DIR)")
    p.add_argument("--redis-url", default=None, help="keep the registry in Redis (several replicas share it)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to drain in-flight requests")


@command("serve", "the OpenAI-compatible HTTP server", _serve_args)
def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from adapters import DEMO_DIR
    from lora_server.server.serve import serve

    preloaded = [spec.partition("=")[2] for spec in args.adapter or [] if "=" in spec]  # the operator's own choice
    roots = tuple(str(Path(r).expanduser().resolve()) for r in [*args.adapter_root, DEMO_DIR, *preloaded])
    return serve(args, engine_config(args, adapter_roots=roots))


def _register_adapter(engine, spec: str) -> str:
    """NAME (a demo adapter) or NAME=PATH -> the registered name."""
    from adapters import demo_adapters
    from lora_server.errors import InvalidRequestError

    name, _, path = spec.partition("=")
    if not path:
        demos = demo_adapters()
        if name not in demos:
            raise InvalidRequestError(f"no demo adapter {name!r} (demo adapters: {', '.join(demos) or 'none'}); "
                                      "use NAME=PATH for a PEFT directory", param="adapter")
        path = str(demos[name])
    engine.add_adapter(name, path)
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lora-server", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text))
    args = parser.parse_args(argv)
    from adapters.peft_format import AdapterError
    from lora_server.errors import LoraServerError

    try:
        return COMMANDS[args.command][2](args)
    except (LoraServerError, AdapterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
