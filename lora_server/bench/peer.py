"""``lora-server bench-engine --peer``: the engine against HF transformers + PEFT on the same machine, prompts and
adapters, in one run.

Both generate ``output_len`` greedy tokens (EOS ignored) for a batch of random-token prompts, each request with
one of ``adapters`` PEFT adapters of mixed rank (round-robin: a mixed-adapter batch; PEFT's ``adapter_names``).
The peer is HF's own reading of the same checkpoint in float32 (the embedded GGUF, dequantized by transformers);
the engine runs in the mode its flags give (by default the GGUF's own int4 blocks). Throughput counts every
generated token over the whole request time (prefill included) for both. The best of ``repeats`` runs counts. Each
point also gives the share of the engine's greedy tokens equal to the peer's: all of them with ``--quantization
none`` (the same float32 computation), fewer in the quantized modes, where near-ties may go the other way."""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lora_server.bench.engine import write_random_adapters
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.sampling_params import SamplingParams


@dataclass
class PeerPoint:
    batch: int
    adapters: int
    engine_tok_per_s: float
    peer_tok_per_s: float
    ratio: float  # engine / peer: above 1 the engine is faster
    agreement: float  # share of greedy tokens equal to the peer's, up to each prompt's first difference


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> torch.Tensor:  # [batch, prompt_len] int64
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (batch, prompt_len), generator=gen)


Run = tuple[float, list[list[int]]]  # (seconds, each prompt's generated tokens)


def _time_engine(engine: Engine, prompts: torch.Tensor, names: list[str], output_len: int) -> Run:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    adapters = [names[i % len(names)] if names else None for i in range(len(prompts))]
    start = time.perf_counter()
    outs = engine.generate(prompts.tolist(), params, adapters)
    return time.perf_counter() - start, [o.token_ids for o in outs]


def _time_peer(model, prompts: torch.Tensor, names: list[str], output_len: int) -> Run:
    kwargs: dict[str, object] = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    if names:
        kwargs["adapter_names"] = [names[i % len(names)] for i in range(len(prompts))]
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), **kwargs)
    elapsed = time.perf_counter() - start
    assert out.shape == (prompts.shape[0], prompts.shape[1] + output_len), out.shape
    return elapsed, out[:, prompts.shape[1] :].tolist()


def _agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """The share of generated tokens before each prompt's first difference (greedy: 1.0 = the same tokens)."""
    same = 0
    for a, b in zip(ours, theirs, strict=True):
        same += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return same / max(1, sum(len(a) for a in ours))


def _load_peer(config: EngineConfig, root: Path, names: list[str]):
    """HF + PEFT on the engine's checkpoint in float32, with every benchmark adapter loaded."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lora_server.model.loader import default_model_path

    if config.model is None:
        path = default_model_path()
        base = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        base = AutoModelForCausalLM.from_pretrained(config.model, dtype=torch.float32)
    base.generation_config.eos_token_id = None
    base.generation_config.pad_token_id = 0
    if not names:
        return base.eval()
    model = PeftModel.from_pretrained(base, root / names[0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(root / name, adapter_name=name)
    return model.eval()


def bench_peer(args, config: EngineConfig) -> dict:
    engine = Engine(config)
    vocab = engine.describe().arch.vocab_size
    points: list[PeerPoint] = []
    n = max(args.adapters)
    model = "the embedded SmolLM2-135M-Instruct" if config.model is None else config.model
    print(
        f"bench-engine --peer: engine (quantization {config.quantization}, dtype {config.dtype}) against HF "
        f"transformers + PEFT (float32) on {model}, "
        f"{torch.get_num_threads()} threads; prompts of {args.prompt_len[0]} random tokens, {args.output_len} greedy "
        f"tokens each, adapters of ranks {args.ranks} round-robin; best of {args.repeats}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        names = write_random_adapters(Path(tmp), n, args.ranks, engine) if n else []
        for name in names:
            engine.adapters.add(name, Path(tmp) / name)
        peer = _load_peer(config, Path(tmp), names)
        for batch in args.batch:
            for distinct in args.adapters:
                used = names[: min(distinct, batch)] if distinct else []
                prompts = _prompts(batch, args.prompt_len[0], vocab, seed=batch)
                _time_engine(engine, prompts[:, :8], used, 2)  # warm both paths (first-call costs)
                _time_peer(peer, prompts[:, :8], used, 2)
                our_runs = [_time_engine(engine, prompts, used, args.output_len) for _ in range(args.repeats)]
                peer_runs = [_time_peer(peer, prompts, used, args.output_len) for _ in range(args.repeats)]
                ours, theirs = min(t for t, _ in our_runs), min(t for t, _ in peer_runs)
                tokens = batch * args.output_len
                point = PeerPoint(
                    batch,
                    len(used),
                    round(tokens / ours, 1),
                    round(tokens / theirs, 1),
                    round(theirs / ours, 2),
                    round(_agreement(our_runs[0][1], peer_runs[0][1]), 3),
                )
                points.append(point)
                print(
                    f"batch {batch:4d}  adapters {point.adapters:3d}  engine {point.engine_tok_per_s:8.1f} tok/s  "
                    f"HF+PEFT {point.peer_tok_per_s:8.1f} tok/s  ratio {point.ratio:5.2f}x  "
                    f"same tokens {point.agreement:6.1%}",
                    flush=True,
                )
    engine.check_integrity()
    result = dict(
        model=config.model or "SmolLM2-135M-Instruct (embedded GGUF)",
        quantization=config.quantization,
        dtype=config.dtype,
        threads=torch.get_num_threads(),
        prompt_len=args.prompt_len[0],
        output_len=args.output_len,
        ranks=args.ranks,
        points=[asdict(p) for p in points],
    )
    json_path = Path(args.json) if args.json else Path(args.out) / "bench-engine-peer.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    print(f"figures written to {json_path}")
    return result
