"""``lora-server bench-staging``: an adapter's way from its files to host pages, at the sizes a GPU server sees.

No model is loaded: the registry and the loader are built for Llama-3-8B's shapes in bfloat16 with 16-token pages
(2 MiB, every layer's K and V of 16 tokens), as a GPU server has them. For each shape (``SHAPES``: rank 8 on q and
v, 6.6 MiB a file; rank 16 on all seven projections, 80 MiB) it writes distinct PEFT adapters (bfloat16, as PEFT
saves a bfloat16 model's) into a folder and lets them settle, then measures:

- registration: the adapters registered as ``--adapter-dir`` does (files read once, validated, hashed, on the
  staging workers' threads), seconds in all and per adapter;
- on-demand resolution: one adapter registered by name, as a request for an unregistered name does before the
  engine sees it (median and p99 over ``--resolutions`` adapters);
- staging: the registered adapters staged to host pages by 1 and by ``--workers`` workers, GB/s in all and per
  worker, and adapters/s: with the files as registered (their bytes not hashed again), and again with every file
  re-stamped (same bytes, new change time: hashed again, as files replaced by copies are); each into new host
  memory (a host tier filling up: the memory's pages faulted in) and into the buffers evicted images left (a full
  host tier turning over).

GB are 1e9 bytes of the adapters' files."""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from lora_server.adapters.page_layout import PageGeometry
from lora_server.adapters.peft_files import SETTLE_NS
from lora_server.adapters.peft_format import LLAMA_MODULES, BaseShapes
from lora_server.engine.adapter_loader import AdapterLoader
from lora_server.engine.adapter_registry import AdapterRegistry, AdapterSpec
from lora_server.kv_pool import PolicyParams, PoolConfig
from lora_server.model.arena import AdapterForm

# Llama-3-8B: layers, hidden, intermediate, q width, kv width
LLAMA3_8B = BaseShapes.llama(32, 4096, 14336, 4096, 1024)
BLOCK_SIZE, MAX_RANK = 16, 16
SHAPES = {  # name -> (rank, PEFT target modules)
    "6.6MB": (8, ("q_proj", "v_proj")),
    "80MB": (16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
}


def llama3_geometry(dtype: torch.dtype = torch.bfloat16) -> PageGeometry:
    """The page geometry of a Llama-3-8B server: one page is a 16-token KV block of every layer."""
    shapes = LLAMA3_8B
    kv_width = shapes.features["k"][1]
    return PageGeometry(shapes.num_layers * 2 * BLOCK_SIZE * kv_width * dtype.itemsize, dtype, MAX_RANK, shapes)


def write_adapters(
    root: Path, n: int, rank: int, targets: tuple[str, ...], shapes: BaseShapes, seed: int = 0
) -> list[Path]:
    """``n`` PEFT adapter directories of ``rank`` on ``targets`` of every layer, bfloat16, each with weights of
    its own, written fast: random weights drawn once, shifted by the adapter's index, with a first row of A drawn
    for it alone (so that no two adapters are equal)."""
    gen = torch.Generator().manual_seed(seed)
    paths = {m.split(".")[-1]: m for m in LLAMA_MODULES}
    drawn = {}
    for target in targets:
        in_f, out_f = shapes.module_features(paths[target])
        drawn[target] = (
            (torch.randn(rank, in_f, generator=gen) * 0.01).bfloat16(),
            (torch.randn(out_f, rank, generator=gen) * 0.01).bfloat16(),
        )
    config = json.dumps(dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(targets), bias="none"))
    out = []
    for i in range(n):
        tensors = {}
        own = torch.Generator().manual_seed(seed * 1_000_003 + i + 1)
        for layer in range(shapes.num_layers):
            for target, (a, b) in drawn.items():
                key = f"base_model.model.model.layers.{layer}.{paths[target]}"
                a_i = a.roll(i + layer, dims=1)
                a_i[0] = (torch.randn(a.shape[1], generator=own) * 0.01).bfloat16()
                tensors[f"{key}.lora_A.weight"] = a_i
                tensors[f"{key}.lora_B.weight"] = b.roll(i + layer, dims=0)
        path = root / f"adapter-{i:05d}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(config)
        out.append(path)
    return out


def _registry(geometry: PageGeometry) -> AdapterRegistry:
    pool = PoolConfig.for_budget(
        num_gpu_blocks=1 << 20,
        num_host_blocks=0,
        block_size=BLOCK_SIZE,
        block_bytes=geometry.page_bytes,
        policy="tree-cost",
        params=PolicyParams(),
        max_loras=64,
        adapter_slot_bytes=0,
    )
    return AdapterRegistry(AdapterForm(geometry.shapes, geometry), None, pool)


def _stage(registry: AdapterRegistry, ids: list[int], workers: int) -> tuple[float, float]:
    """Seconds for a new loader of ``workers`` workers (room for every image) to stage ``ids`` into new host memory,
    then, every image evicted, again into the buffers they left (a full host tier turning over)."""
    contents = [registry.content(i) for i in ids]
    budget = sum(c.num_pages for c in contents if c is not None) * registry.geometry.page_bytes
    loader = AdapterLoader(registry, torch.device("cpu"), budget, workers=workers)
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        for adapter_id in ids:
            loader.request(adapter_id)
        while loader.busy():
            loader.wait(1.0)
        seconds.append(time.perf_counter() - start)
        failed = loader.failed(ids)
        if failed or len(loader.staged_ids()) != len(ids):
            raise RuntimeError(f"staging failed: {failed or 'not every adapter was staged'}")
        loader.take_events()  # what landed gets its first round
        loader.budget_bytes = 0
        loader.take_events()  # every image evicted: its buffer back for the next
        loader.budget_bytes = budget
    loader.close()
    return seconds[0], seconds[1]


def bench_shape(name: str, args, root: Path) -> dict:
    rank, targets = SHAPES[name]
    geometry = llama3_geometry()
    count = args.registered if name == "6.6MB" else args.large_count
    print(f"{name}: writing {count} adapters (rank {rank} on {', '.join(targets)}) ...", flush=True)
    paths = write_adapters(root, count + args.resolutions, rank, targets, geometry.shapes)
    file_bytes = sum((p / "adapter_model.safetensors").stat().st_size for p in paths[:count]) / count
    time.sleep(SETTLE_NS / 1e9)  # adapters at rest, as on a server's disk (peft_files.FilesIdentity)
    registry = _registry(geometry)
    specs = [AdapterSpec(p.name, p) for p in paths[:count]]
    start = time.perf_counter()
    checked = registry.check_many(specs, args.workers)
    handles = [registry.install(c) for c in checked if not isinstance(c, Exception)]
    register_s = time.perf_counter() - start
    if len(handles) != count:
        raise RuntimeError(f"{count - len(handles)} adapters were refused: {checked[0]}")
    resolve_ms = []
    for path in paths[count:]:
        t0 = time.perf_counter()
        registry.register(path.name, path)
        resolve_ms.append((time.perf_counter() - t0) * 1e3)
    ids = [h.adapter_id for h in handles[: args.staged]]
    staged_bytes = file_bytes * len(ids)
    staging = {}
    for label in ("as registered", "re-stamped"):
        if label == "re-stamped":
            for path in paths[: len(ids)]:
                weights = path / "adapter_model.safetensors"
                os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns))  # ctime moves
        for workers in sorted({1, args.workers}):
            for memory, seconds in zip(("new memory", "reused buffers"), _stage(registry, ids, workers), strict=True):
                staging[f"{label}, {memory}, {workers} worker{'s' if workers > 1 else ''}"] = {
                    "workers": workers,
                    "seconds": round(seconds, 3),
                    "gb_per_s": round(staged_bytes / seconds / 1e9, 3),
                    "gb_per_s_per_worker": round(staged_bytes / seconds / 1e9 / workers, 3),
                    "adapters_per_s": round(len(ids) / seconds, 1),
                }
    row = {
        "shape": name,
        "rank": rank,
        "targets": list(targets),
        "file_bytes": round(file_bytes),
        "registered": count,
        "register_s": round(register_s, 2),
        "register_ms_per_adapter": round(register_s / count * 1e3, 2),
        "register_threads": args.workers,
        "resolve_ms_median": round(statistics.median(resolve_ms), 2),
        "resolve_ms_p99": round(sorted(resolve_ms)[min(len(resolve_ms) - 1, math.ceil(0.99 * len(resolve_ms)) - 1)], 2),
        "staged": len(ids),
        "staging": staging,
    }
    print(
        f"{name} ({file_bytes / 1e6:.1f} MB a file): {count} registered in {register_s:.1f} s "
        f"({row['register_ms_per_adapter']:.1f} ms each, {args.workers} threads); on-demand resolution "
        f"{row['resolve_ms_median']:.1f} ms median, {row['resolve_ms_p99']:.1f} ms p99",
        flush=True,
    )
    for label, figures in staging.items():
        print(
            f"  staging {len(ids)}, {label}: {figures['gb_per_s']:.2f} GB/s ({figures['gb_per_s_per_worker']:.2f} "
            f"per worker), {figures['adapters_per_s']:.0f} adapters/s",
            flush=True,
        )
    return row


def bench_staging(args) -> dict:
    rows = []
    for name in args.shapes:
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            rows.append(bench_shape(name, args, Path(tmp)))
    result = {"geometry": "Llama-3-8B, bfloat16, 16-token pages", "rows": rows, "cpus": len(os.sched_getaffinity(0))}
    path = Path(args.json) if args.json else Path(args.out) / "bench-staging.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"figures written to {path}")
    return result
