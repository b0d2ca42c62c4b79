"""``lora-server bench-engine``: offline decode throughput of the real engine against the memory-bandwidth floor.

For each (batch, distinct adapters, prompt length) it runs batch requests of random prompt tokens to
``output_len`` tokens (EOS ignored) and times every pure-decode step. The floor of a decode step is the bytes it
must read once (resident weights + the batch's distinct adapters + the KV of every sequence) over the device copy
bandwidth measured in the same run."""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from lora_server.adapters.peft_format import FUSED_MODULES, LLAMA_MODULES
from lora_server.config import EngineConfig
from lora_server.engine import Engine, ModelInfo
from lora_server.model.arch import ModelArch
from lora_server.sampling_params import SamplingParams

PEFT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class BenchPoint:
    batch: int
    adapters: int
    prompt_len: int
    decode_ms_per_step: float
    output_tok_per_s: float
    floor_ms_per_step: float
    share_of_bandwidth: float  # floor / measured: 1.0 would read every byte once at copy speed
    prefill_tok_per_s: float
    prefill_tflops: float  # prefill_tok_per_s x prefill_flops_per_token
    total_tok_per_s: float  # output tokens over the whole run, prefill included (what HF's generate reports)


def prefill_flops_per_token(arch: ModelArch, prompt_len: int) -> float:
    """Multiply-adds x 2 per prompt token of a prefill of ``prompt_len`` tokens: the decoder's linears (q, k, v,
    o, gate, up, down) and causal attention (QK^T and PV over (prompt_len + 1) / 2 keys on average); the head
    runs on the last token alone and is left out, as are the adapters."""
    h, q, kv, i = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    linears = h * q + 2 * h * kv + q * h + 3 * h * i
    attention = 2 * q * (prompt_len + 1) / 2
    return 2 * arch.num_layers * (linears + attention)


def copy_bandwidth_gbps(device: torch.device, nbytes: int) -> float:
    """Device copy bandwidth counting reads and writes (the figure the floor divides by)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(2):
        b.copy_(a)
    sync_device(device)
    start = time.perf_counter()
    reps = 5
    for _ in range(reps):
        b.copy_(a)
    sync_device(device)
    return 2 * nbytes * reps / (time.perf_counter() - start) / 1e9


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), around a timed region."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def write_random_adapters(
    root: Path,
    n: int,
    rank: int | Sequence[int],
    engine: Engine,
    seed: int = 0,
    targets: tuple[str, ...] = PEFT_TARGETS,
) -> list[str]:
    """n PEFT adapter directories with random weights on `targets` (PEFT module names) of every layer; adapter i
    has rank ``rank``, or ``rank[i % len(rank)]`` for several. On a base with fused projections (Phi-3) a target
    names the fused module that holds it (q_proj -> qkv_proj, gate_proj -> gate_up_proj)."""
    info = engine.describe()
    arch, shapes = info.arch, info.adapter_features
    modules = FUSED_MODULES if arch.fused_projections else LLAMA_MODULES
    chosen = {
        module: parts
        for module, parts in modules.items()
        if any(f"{part}_proj" in targets for part in parts) or module.split(".")[-1] in targets
    }
    gen = torch.Generator().manual_seed(seed)
    ranks = [rank] if isinstance(rank, int) else list(rank)
    names = []
    for i in range(n):
        rank_i = ranks[i % len(ranks)]
        tensors = {}
        experts = arch.num_experts
        on_experts = experts > 0 and any(module.startswith("mlp.") for module in chosen)
        for layer in range(arch.num_layers):
            for module, parts in chosen.items():
                if module.startswith("mlp.") and arch.sparse(layer):
                    continue
                in_f, out_f = shapes[parts[0]][0], sum(shapes[part][1] for part in parts)
                key = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank_i, in_f, generator=gen) * 0.01).half()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(out_f, rank_i, generator=gen) * 0.01).half()
            if on_experts and arch.sparse(layer):  # nested as PEFT saves two parameters of one module
                hidden, width = arch.hidden_size, arch.moe_intermediate_size
                for key, (in_f, out_f) in (("experts.base_layer", (hidden, 2 * width)), ("experts", (width, hidden))):
                    key = f"base_model.model.model.layers.{layer}.mlp.{key}"
                    a = torch.randn(rank_i * experts, in_f, generator=gen) * 0.01
                    tensors[f"{key}.lora_A.weight"] = a.half()
                    tensors[f"{key}.lora_B.weight"] = (
                        torch.randn(out_f, rank_i * experts, generator=gen) * 0.01
                    ).half()
        path = root / f"bench-{i}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(
            json.dumps(
                dict(
                    peft_type="LORA",
                    r=rank_i,
                    lora_alpha=2 * rank_i,
                    target_modules=[module.split(".")[-1] for module in chosen],
                    bias="none",
                    **(
                        {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
                        if on_experts
                        else {}
                    ),
                )
            )
        )
        names.append(path.name)
    return names


def run_point(
    engine: Engine,
    batch: int,
    adapter_names: list[str],
    prompt_len: int,
    output_len: int,
    bandwidth: float,
    adapter_bytes: int,
    rank: int = 0,
) -> BenchPoint:
    """One point; the floor reads the weights once, the batch's distinct adapters once and every sequence's KV; on
    a mixture of experts, the experts (and adapters' experts) the decode steps ran, on average, not all of them."""
    info = engine.describe()
    gen = torch.Generator().manual_seed(batch * 1000 + prompt_len)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(10, info.arch.vocab_size, (prompt_len,), generator=gen).tolist()
        adapter = adapter_names[i % len(adapter_names)] if adapter_names else None
        engine.add(engine.make_request(prompt, params, adapter, request_id=f"bench-{batch}-{i}"))
    decode_times: list[float] = []
    contexts: list[float] = []
    experts_read = [0, 0]  # over the decode steps: experts run, (expert, adapter run) LoRAs (model.moe)
    prefill_time = 0.0
    while engine.has_work():
        before = engine.snapshot()
        sync_device(info.device)
        start = time.perf_counter()
        engine.step()
        sync_device(info.device)
        elapsed = time.perf_counter() - start
        if before.decoding:
            decode_times.append(elapsed)
            contexts.append(before.context_tokens)
            after = engine.snapshot()
            experts_read[0] += after.experts_read - before.experts_read
            experts_read[1] += after.expert_loras_read - before.expert_loras_read
        else:
            prefill_time += elapsed
    engine.check_integrity()
    step = sum(decode_times) / max(1, len(decode_times))
    mean_context = sum(contexts) / max(1, len(contexts))
    steps = max(1, len(decode_times))
    weights, adapters = float(info.weight_bytes), float(adapter_bytes * len(adapter_names))
    if info.expert_bytes:  # a mixture of experts' step reads the experts its tokens took, not all of them
        expert_lora = expert_lora_bytes(info, rank) if adapter_names else 0
        sparse = sum(info.arch.sparse(layer) for layer in range(info.arch.num_layers))
        weights += (experts_read[0] / steps - sparse * info.arch.num_experts) * info.expert_bytes
        adapters += (experts_read[1] / steps - len(adapter_names) * sparse * info.arch.num_experts) * expert_lora
    floor_bytes = weights + adapters + info.kv_bytes_per_token * mean_context
    floor = floor_bytes / (bandwidth * 1e9)
    prefill_rate = batch * prompt_len / prefill_time
    return BenchPoint(
        batch,
        len(adapter_names),
        prompt_len,
        round(step * 1e3, 3),
        round(batch / step, 1),
        round(floor * 1e3, 3),
        round(floor / step, 3),
        round(prefill_rate, 1),
        round(prefill_rate * prefill_flops_per_token(info.arch, prompt_len) / 1e12, 4),
        round(batch * output_len / (prefill_time + sum(decode_times)), 1),
    )


def expert_lora_bytes(info: ModelInfo, rank: int) -> int:
    """One expert's LoRA at ``rank`` on the device (write_random_adapters': gate_up and down): A [r, hidden] and
    B^T [r, 2 * width], A [r, width] and B^T [r, hidden]."""
    hidden, width = info.arch.hidden_size, info.arch.moe_intermediate_size
    return rank * (2 * hidden + 3 * width) * info.dtype.itemsize


def _make_resident(engine: Engine, names: list[str]) -> None:
    """Stage the adapters on the host and serve each a one-token request, so that the points time compute, not
    an adapter's first load (``--loads`` times loads)."""
    if not names:
        return
    engine.adapters.stage(names)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for name in names:
        engine.add(engine.make_request([10, 11], one, name, request_id=f"resident-{name}"))
    while engine.has_work():
        engine.step()


def bench_points(args) -> list[tuple[int, int, int]]:
    """The (batch, adapters, prompt length) points to run: ``args.points`` where given (bench-gpu's), else every
    combination of ``args.prompt_len``, ``args.batch`` and ``args.adapters``."""
    given = getattr(args, "points", None)
    if given is not None:
        return list(given)
    return [(b, n, p) for p in args.prompt_len for b in args.batch for n in args.adapters]


def bench(args, base: EngineConfig) -> dict:
    """Every point of bench_points on an engine built from ``base``, sized for them."""
    config = dataclasses.replace(
        base,
        max_num_seqs=max(args.batch),
        max_loras=max(1, max(args.adapters)),
        max_lora_rank=args.rank,
        max_model_len=max(args.prompt_len) + args.output_len,
    )
    engine = Engine(config)
    info = engine.describe()
    device = info.device
    bandwidth = copy_bandwidth_gbps(device, 256 << 20 if device.type == "cpu" else 2 << 30)
    print(_header(info, config, bandwidth, args), flush=True)
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        names = write_random_adapters(Path(tmp), max(args.adapters), args.rank, engine)
        for name in names:
            engine.adapters.add(name, Path(tmp) / name)
        _make_resident(engine, names)
        # an adapter's bytes as held on the device (model dtype; the host copy is fp32)
        first = engine.adapters.info(names[0]) if names else None
        adapter_bytes = first.device_bytes if first else 0
        for batch, n, prompt_len in bench_points(args):
            point = run_point(
                engine,
                batch,
                names[: min(n, batch)] if n else [],
                prompt_len,
                args.output_len,
                bandwidth,
                adapter_bytes,
                args.rank,
            )
            points.append(point)
            print(_row(point), flush=True)
    result = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        model=config.model,
        quantization=config.quantization,
        dtype=str(info.dtype),
        copy_bandwidth_GBps=round(bandwidth, 1),
        weight_bytes=info.weight_bytes,
        rank=args.rank,
        output_len=args.output_len,
        points=[asdict(p) for p in points],
    )
    json_path = Path(args.json) if args.json else Path(args.out) / "bench-engine.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    print(f"figures written to {json_path}")
    return result


def _header(info: ModelInfo, config: EngineConfig, bandwidth: float, args) -> str:
    a = info.arch
    device = torch.cuda.get_device_name() if info.device.type == "cuda" else "cpu"
    return "\n".join(
        [
            f"bench-engine: {config.model or 'the embedded SmolLM2-135M-Instruct'} ({config.load_format} weights, "
            f"quantization {config.quantization}), {a.num_layers} layers, hidden {a.hidden_size}, "
            f"{a.num_heads}/{a.num_kv_heads} heads, vocab {a.vocab_size}; dtype {info.dtype}, device {device}",
            f"resident weights {info.weight_bytes / 2**30:.2f} GiB; rank-{args.rank} adapters on every projection; "
            f"{args.output_len} tokens per request, EOS ignored",
            f"device copy bandwidth measured now: {bandwidth:.1f} GB/s (reads + writes)",
            "decode: mean time of the steps where every request decodes one token; floor: the bytes such a step "
            "must read once (weights + the batch's distinct adapters + every sequence's KV) / that bandwidth; share: "
            "floor / decode (1.0 = reading every byte once at copy speed); prefill: prompt tokens / time of the other "
            "steps, and its TFLOP/s (decoder linears and causal attention, the head and adapters left out)",
            *(
                [
                    f"mixture of experts: {a.num_experts} experts, top {a.experts_per_token}; the floor counts the "
                    "experts (and adapters' experts) the decode steps ran, on average, not all of them"
                ]
                if a.num_experts
                else []
            ),
        ]
    )


def _row(p: BenchPoint) -> str:
    return (
        f"batch {p.batch:4d}  adapters {p.adapters:3d}  prompt {p.prompt_len:5d}  "
        f"decode {p.decode_ms_per_step:9.3f} ms/step  {p.output_tok_per_s:9.1f} tok/s  "
        f"floor {p.floor_ms_per_step:8.3f} ms  "
        f"share {p.share_of_bandwidth:6.1%}  prefill {p.prefill_tok_per_s:9.1f} tok/s "
        f"{p.prefill_tflops:8.3f} TFLOP/s"
    )
