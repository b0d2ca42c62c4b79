"""``lora-server bench-tp``: the engine's step time at --tensor-parallel-size 1 and at N on this machine, on the same
prompts (with ``--adapters K``, request i on adapter i % K, the adapters resident before the clock starts): the
prefill step (every prompt in one step) and the mean decode step, their ratio, whether the greedy tokens are the
same, and the collectives of one decode step at N (calls and bytes per kind, and per layer)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lora_server.bench.engine import _make_resident, write_random_adapters
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.sampling_params import SamplingParams


@dataclass
class TpPoint:
    tensor_parallel_size: int
    num_layers: int
    prefill_step_ms: float  # the step that computes every prompt
    decode_step_ms: float  # mean over the decode steps
    decode_steps: int
    # one decode step's collectives at this size (rank 0's): kind -> calls, kind -> bytes (none at size 1)
    comm_calls: dict[str, int]
    comm_bytes: dict[str, int]
    adapter_bytes: int  # one adapter's pages in this rank's arena (0: no adapter)


def _run(
    config: EngineConfig, prompts: list[list[int]], output_len: int, adapters: int, rank: int
) -> tuple[TpPoint, list[list[int]]]:
    engine = Engine(config)
    try:
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        names: list[str] = []
        adapter_bytes = 0
        with tempfile.TemporaryDirectory() as root:
            if adapters:  # the same seed at every size: the same adapters
                names = write_random_adapters(Path(root), adapters, rank, engine)
                adapter_bytes = max(engine.adapters.add(name, Path(root) / name).device_nbytes for name in names)
                _make_resident(engine, names)
        engine.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm-up
        requests = [
            engine.make_request(p, params, names[i % len(names)] if names else None, request_id=f"tp-{i}")
            for i, p in enumerate(prompts)
        ]
        for request in requests:
            engine.add(request)
        tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
        times: list[float] = []
        calls: dict[str, int] = {}
        nbytes: dict[str, int] = {}
        counter = engine.collectives()
        while engine.has_work():
            if counter is not None:
                counter.reset()
            start = time.perf_counter()
            outputs = engine.step()
            times.append(time.perf_counter() - start)
            for out in outputs:
                tokens[out.request_id].extend(out.token_ids)
            if counter is not None and len(times) == 2:  # the first decode step
                calls, nbytes = dict(counter.calls), dict(counter.bytes)
    finally:
        engine.close()
    decode = times[1:]
    point = TpPoint(
        config.tensor_parallel_size,
        engine.describe().arch.num_layers,
        times[0] * 1e3,
        sum(decode) / max(1, len(decode)) * 1e3,
        len(decode),
        calls,
        nbytes,
        adapter_bytes,
    )
    return point, [tokens[r.request_id] for r in requests]


def bench_tp(args: argparse.Namespace, config: EngineConfig) -> None:
    """Run TP=1, then TP=args.tensor_parallel_size; print the table and write the JSON."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 10000, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]
    one = dataclasses.replace(config, tensor_parallel_size=1)
    base, base_tokens = _run(one, prompts, args.output_len, args.adapters, args.adapter_rank)
    tp, tp_tokens = _run(config, prompts, args.output_len, args.adapters, args.adapter_rank)
    if args.adapters:
        print(
            f"{args.adapters} adapters of rank {args.adapter_rank} on every module, request i on adapter i % "
            f"{args.adapters}"
        )
    print(f"{'TP':>3} {'prefill step ms':>16} {'decode step ms':>15} {'adapter bytes a rank':>21}")
    for p in (base, tp):
        row = f"{p.tensor_parallel_size:>3} {p.prefill_step_ms:>16.2f} {p.decode_step_ms:>15.2f}"
        print(f"{row} {p.adapter_bytes:>21,}")
    ratio_prefill, ratio_decode = tp.prefill_step_ms / base.prefill_step_ms, tp.decode_step_ms / base.decode_step_ms
    print(f"TP={tp.tensor_parallel_size} / TP=1: prefill step x{ratio_prefill:.2f}, decode step x{ratio_decode:.2f}")
    print(f"greedy tokens identical: {base_tokens == tp_tokens}")
    print(
        f"one decode step's collectives at TP={tp.tensor_parallel_size} (rank 0): calls {tp.comm_calls}, "
        f"bytes {tp.comm_bytes}"
    )
    reduces = tp.comm_calls.get("all_reduce", 0)
    if reduces:
        per_layer = (reduces - 1) / tp.num_layers  # the embedding's one, then each layer's
        each = tp.comm_bytes["all_reduce"] // reduces
        print(f"all-reduces: 1 (embedding) + {per_layer:g} per layer x {tp.num_layers} layers, {each} bytes each")
    out = Path(args.json or Path(args.out) / "bench-tp.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    figures = dict(
        points=[asdict(base), asdict(tp)],
        prefill_ratio=ratio_prefill,
        decode_ratio=ratio_decode,
        identical=base_tokens == tp_tokens,
        batch=args.batch,
        adapters=args.adapters,
        adapter_rank=args.adapter_rank,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        threads_per_rank=torch.get_num_threads(),
    )
    out.write_text(json.dumps(figures, indent=2))
    print(f"wrote {out}")
