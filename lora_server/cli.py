"""``lora-server``: serve many LoRA adapters of one quantized base model behind an OpenAI-compatible API (``serve``),
or run the engine offline (``generate``) and its benchmarks (``bench-engine``, ``bench-pool``).

Every engine and server flag comes from a field of lora_server.config (its help, unit and default live there;
lora_server.flags makes the flags); the benchmarks' commands and their own flags are in lora_server.bench.commands."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from lora_server.bench.commands import BENCH_COMMANDS
from lora_server.config import EngineConfig, ServerConfig
from lora_server.flags import Commands, add_config_flags, config_from_flags, registry

DESCRIPTION = (
    "Serve many LoRA adapters of one quantized base model behind an OpenAI-compatible API (serve), or run "
    "the engine offline (generate) and its benchmarks (bench-engine, bench-pool; bench serve loads any "
    "OpenAI-compatible server). "
    "Run 'lora-server COMMAND --help' for a command's options."
)
COMMANDS: Commands = {}
command = registry(COMMANDS)


def _generate_args(p: argparse.ArgumentParser) -> None:
    add_config_flags(p, EngineConfig)
    p.add_argument("--max-tokens", type=int, default=256, help="the most tokens to generate (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's mass (default: 1, off)")
    p.add_argument("--seed", type=int, default=None, help="the sampling seed (default: none)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument(
        "--adapter",
        default=None,
        help="a demo adapter's NAME, or NAME=PATH of any PEFT LoRA directory (default: the base model)",
    )
    p.add_argument("prompt")


@command("generate", "print the completion of one prompt", _generate_args)
def _generate(args: argparse.Namespace) -> int:
    from lora_server.engine import Engine
    from lora_server.sampling_params import SamplingParams

    engine = Engine(config_from_flags(EngineConfig, args))
    adapter = _register_adapter(engine, args.adapter) if args.adapter else None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    prompt = args.prompt if args.raw else engine.chat_prompt([{"role": "user", "content": args.prompt}])
    [completion] = engine.generate([prompt], params, adapters=adapter)
    print(completion.text)
    return 0


def _export_tokenizer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="the directory to write (created if missing)")
    p.add_argument("--model", default=None, help="the model, as serve's --model (default: the embedded SmolLM2)")
    p.add_argument("--load-format", default="auto", choices=("auto", "hf", "gguf"), help="as serve's (default: auto)")
    p.add_argument("--max-model-len", type=int, default=None, help="as serve's: the model_max_length written")


@command(
    "export-tokenizer",
    "write the served model's tokenizer as an HF tokenizer directory (GGUF models included), for clients that "
    "tokenize locally (vllm bench serve, guidellm, lm-eval)",
    _export_tokenizer_args,
)
def _export_tokenizer(args: argparse.Namespace) -> int:
    from lora_server.engine.tokenizer import Tokenizer
    from lora_server.errors import ModelLoadError
    from lora_server.model.loader import model_files, read_arch

    config = EngineConfig(model=args.model, load_format=args.load_format, max_model_len=args.max_model_len)
    if config.load_format == "dummy":
        raise ModelLoadError("dummy weights have no tokenizer")
    path, fmt = model_files(config)
    longest = read_arch(path, fmt).max_position_embeddings  # checks the file before the tokenizer reads it
    if fmt == "hf" and not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"{path} has no tokenizer.json")
    tokenizer = Tokenizer.from_gguf(path) if fmt == "gguf" else Tokenizer.from_hf_dir(path)
    files = tokenizer.save_pretrained(args.dir, min(config.max_model_len or longest, longest))
    print("\n".join(str(f) for f in files))
    return 0


COMMANDS.update(BENCH_COMMANDS)


def _serve_args(p: argparse.ArgumentParser) -> None:
    add_config_flags(p, EngineConfig)
    add_config_flags(p, ServerConfig)


@command("serve", "the OpenAI-compatible HTTP server (the main job)", _serve_args)
def _serve(args: argparse.Namespace) -> int:
    config = server_config(args)
    if config.ray_replicas:
        from lora_server.server.ray_serve import serve_ray

        return serve_ray(config)
    from lora_server.server.serve import serve

    return serve(config)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server's configuration from its flags. Adapter roots: the ones given, the shipped demo adapters', the
    directories of adapters given with --adapter NAME=PATH and the --adapter-dir folders (the operator's own
    choice)."""
    from pathlib import Path

    from lora_server.adapters import DEMO_DIR
    from lora_server.adapters.sources import source_scheme
    from lora_server.admin.store import validate_name
    from lora_server.errors import ConfigError

    server = config_from_flags(ServerConfig, args, engine=EngineConfig())
    for spec in server.adapters or ():  # the admin API's rule, so that every served name is one it accepts
        try:
            validate_name(spec.partition("=")[0], "--adapter name")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    preloaded = [spec.partition("=")[2] for spec in server.adapters or () if "=" in spec]
    preloaded = [path for path in preloaded if source_scheme(path) is None]  # a URL's copy lies in the adapter cache
    given = config_from_flags(EngineConfig, args).adapter_roots or ()
    dirs = [*given, DEMO_DIR, *preloaded, *(server.adapter_dirs or ())]
    roots = tuple(dict.fromkeys(str(Path(r).expanduser().resolve()) for r in dirs))
    return dataclasses.replace(server, engine=config_from_flags(EngineConfig, args, adapter_roots=roots))


def _register_adapter(engine, spec: str) -> str:
    """NAME (a demo adapter) or NAME=PATH -> the registered name."""
    from lora_server.adapters import demo_adapters
    from lora_server.errors import InvalidRequestError

    name, _, path = spec.partition("=")
    if not path:
        demos = demo_adapters()
        if name not in demos:
            raise InvalidRequestError(
                f"no demo adapter {name!r} (demo adapters: {', '.join(demos) or 'none'}); "
                "use NAME=PATH for a PEFT directory",
                param="adapter",
            )
        path = str(demos[name])
    engine.adapters.add(name, path)
    return name


def main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lora-server", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = main_parser().parse_args(argv)
    from lora_server.adapters.peft_format import AdapterError
    from lora_server.errors import LoraServerError

    try:
        return COMMANDS[args.command][2](args)
    except (LoraServerError, AdapterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
