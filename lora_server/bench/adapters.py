"""``lora-server bench-engine --registered N,...`` and ``--loads``: what many adapters cost the engine.

--registered: for each N, a fresh engine registers N adapters (timed; the host memory a registration keeps is
measured apart with tracemalloc over up to 200 registrations), then serves ``rounds`` batches whose requests pick
their adapter by Zipf popularity (p_i proportional to 1 / i^alpha) over the N: the decode step time, tokens/s and
mean TTFT, the distinct adapters per batch, the adapters read from disk and loaded into the arena. 16 against
2,000 shows what registering many costs (memory per adapter, a registration's time) and what serving from a long
tail costs (cold adapters read from disk in the background and copied in while the batch runs).

--loads: the decode step time of a running batch while other adapters load (registered from another thread, read
and staged by the loader thread, copied into the arena at the next steps as pinned adapters), against the same
batch with nothing loading."""

from __future__ import annotations

import dataclasses
import gc
import json
import random
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import torch

from lora_server.bench.engine import write_random_adapters
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.engine.request import EngineRequest
from lora_server.sampling_params import SamplingParams

TARGETS = ("q_proj", "v_proj")  # small adapters, so that 2,000 of them stay a few GB on disk


def retained_bytes_per_adapter(engine: Engine, root: Path, names: list[str]) -> float:
    """Python memory a registration keeps (the registry's records: no weights are kept), per adapter, measured with
    tracemalloc over registering ``names`` on ``engine`` (memory the engine holds in the pool's tree is counted at
    its next step: it is small beside this, one node per adapter)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for name in names:
            engine.adapters.add(name, root / name)
        gc.collect()
        return (tracemalloc.get_traced_memory()[0] - before) / len(names)
    finally:
        tracemalloc.stop()


def _decode_steps(engine: Engine, requests: list[EngineRequest]) -> tuple[list[float], list[float]]:
    """Add the requests, step until done; returns the decode steps' times and the requests' times from arrival
    to first token (of those that got one)."""
    for request in requests:
        engine.add(request)
    times: list[float] = []
    ttfts: list[float] = []
    while engine.has_work():
        decoding = engine.snapshot().decoding
        start = time.perf_counter()
        outputs = engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
        for out in outputs:  # a request's last output carries its timings
            ttft = None if out.timings is None else out.timings.ttft_s
            if ttft is not None:
                ttfts.append(ttft)
    return times, ttfts


def bench_registered(args, base: EngineConfig) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        probe = Engine(dataclasses.replace(base, max_lora_rank=args.rank))
        names = write_random_adapters(Path(tmp), max(args.registered), args.rank, probe, targets=TARGETS)
        probe.shutdown()
        del probe
        measured = Engine(base)
        per_adapter = retained_bytes_per_adapter(measured, Path(tmp), names[: min(200, max(args.registered))])
        measured.shutdown()
        del measured
        for n in args.registered:
            engine = Engine(base)
            start = time.perf_counter()
            for name in names[:n]:
                engine.adapters.add(name, Path(tmp) / name)
            register_s = time.perf_counter() - start
            rng = random.Random(args.trace_seed)
            weights = [1 / (i + 1) ** args.alpha for i in range(n)]
            params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
            vocab = engine.describe().arch.vocab_size
            decode: list[float] = []
            distinct: list[int] = []
            ttfts: list[float] = []
            t0 = time.perf_counter()
            tokens = 0
            for round_ in range(args.rounds):
                picks = rng.choices(range(n), weights, k=args.batch[0])
                distinct.append(len(set(picks)))
                requests = [
                    engine.make_request(
                        [rng.randrange(10, vocab) for _ in range(args.prompt_len[0])],
                        params,
                        names[i],
                        request_id=f"r{n}-{round_}-{j}",
                    )
                    for j, i in enumerate(picks)
                ]
                times, firsts = _decode_steps(engine, requests)
                decode += times
                ttfts += firsts
                tokens += len(requests) * args.output_len
            wall = time.perf_counter() - t0
            engine.check_integrity()
            pool = engine.snapshot().pool
            device_bytes = _device_bytes(engine, names[0])
            row = {
                "registered": n,
                "register_s": round(register_s, 2),
                "register_ms_per_adapter": round(register_s / n * 1e3, 2),
                "retained_bytes_per_adapter": round(per_adapter),
                "retained_bytes": round(per_adapter * n),
                "distinct_adapters_per_batch": sum(distinct) / len(distinct),
                "decode_ms_per_step": round(sum(decode) / max(1, len(decode)) * 1e3, 2),
                "output_tok_per_s": round(tokens / wall, 1),
                "ttft_mean_s": round(sum(ttfts) / len(ttfts), 3),
                "stagings_from_disk": pool.device_memory.adapter_stagings,
                "adapter_loads": pool.stats.adapter_bytes_to_gpu // device_bytes,
                "adapter_unloads_blocks": pool.stats.evicted_blocks["adapter_unload"],
                "resident_adapters": pool.stats.resident_adapters,
            }
            rows.append(row)
            print(
                f"registered {n:5d}: {row['register_s']:7.2f} s to register ({row['register_ms_per_adapter']:.2f} ms "
                f"each), keeping {per_adapter * n / 2**20:.1f} MiB of host memory ({per_adapter / 1024:.1f} KiB each, "
                "no weights); Zipf "
                f"{args.alpha} batches of {args.batch[0]}: {row['distinct_adapters_per_batch']:.1f} distinct adapters, "
                f"decode {row['decode_ms_per_step']:.1f} ms/step, {row['output_tok_per_s']:.1f} tok/s in all, "
                f"mean TTFT {row['ttft_mean_s']:.2f} s, {row['stagings_from_disk']} adapters read from disk, "
                f"{row['adapter_loads']} loaded into the arena, {row['resident_adapters']} resident at the end",
                flush=True,
            )
            engine.shutdown()
    result = {
        "model": base.model or "SmolLM2-135M-Instruct (embedded)",
        "quantization": base.quantization,
        "rank": args.rank,
        "targets": TARGETS,
        "batch": args.batch[0],
        "prompt_len": args.prompt_len[0],
        "output_len": args.output_len,
        "rounds": args.rounds,
        "alpha": args.alpha,
        "rows": rows,
    }
    return _write(args, "bench-registered.json", result)


def bench_loads(args, base: EngineConfig) -> dict:
    batch = args.batch[0]
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(base)
        names = write_random_adapters(Path(tmp), 4 + args.load_count, args.rank, engine, targets=TARGETS)
        for name in names[:4]:
            engine.adapters.add(name, Path(tmp) / name)
        params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
        vocab = engine.describe().arch.vocab_size
        rng = random.Random(args.trace_seed)

        def requests(tag: str) -> list[EngineRequest]:
            return [
                engine.make_request(
                    [rng.randrange(10, vocab) for _ in range(args.prompt_len[0])],
                    params,
                    names[i % 4],
                    request_id=f"{tag}-{i}",
                )
                for i in range(batch)
            ]

        _decode_steps(engine, requests("warm"))
        quiet, _ = _decode_steps(engine, requests("quiet"))
        loaded_before = engine.snapshot().pool.stats.adapter_bytes_to_gpu
        done = threading.Event()

        def register() -> None:
            for name in names[4:]:
                if done.is_set():
                    return
                engine.adapters.add(name, Path(tmp) / name, pinned=True)

        thread = threading.Thread(target=register)
        thread.start()
        busy, _ = _decode_steps(engine, requests("busy"))
        done.set()
        thread.join()
        loaded = engine.snapshot().pool.stats.adapter_bytes_to_gpu - loaded_before
        device_bytes = _device_bytes(engine, names[0])
        engine.check_integrity()
        engine.shutdown()

    def stats(times: list[float]) -> dict:
        ordered = sorted(times)
        return {
            "steps": len(times),
            "mean_ms": round(sum(times) / len(times) * 1e3, 2),
            "p50_ms": round(ordered[len(ordered) // 2] * 1e3, 2),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 2),
        }

    result = {
        "batch": batch,
        "no_loads": stats(quiet),
        "while_loading": stats(busy),
        "adapters_loaded": loaded // device_bytes,
        "bytes_loaded": loaded,
    }
    result["mean_ratio"] = round(result["while_loading"]["mean_ms"] / result["no_loads"]["mean_ms"], 3)
    print(
        f"decode step of a batch of {batch} (4 adapters): {result['no_loads']['mean_ms']} ms with no loads, "
        f"{result['while_loading']['mean_ms']} ms while {result['adapters_loaded']} other adapters were registered, "
        f"staged and copied in ({loaded / 2**20:.1f} MiB): x{result['mean_ratio']} (p99 "
        f"{result['no_loads']['p99_ms']} -> {result['while_loading']['p99_ms']} ms)",
        flush=True,
    )
    return _write(args, "bench-loads.json", result)


def _write(args, default: str, result: dict) -> dict:
    result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    path = Path(args.json) if args.json else Path(args.out) / default
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"figures written to {path}")
    return result


def _device_bytes(engine: Engine, name: str) -> int:
    """A registered adapter's bytes on the device."""
    info = engine.adapters.info(name)
    if info is None:
        raise RuntimeError(f"adapter {name} is not registered")
    return info.device_bytes
