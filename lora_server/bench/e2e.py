"""``lora-server bench-e2e``: thousands of adapters at the speed of a few, end to end through the real HTTP server.

In one run, in a work folder (``--workdir``, else a temporary one):

1. a synthetic HF checkpoint: Llama-3-8B's config.json (32 layers, hidden 4096, intermediate 14336, 32 / 8 heads,
   rope_theta 500000) but for the vocabulary, which is the embedded SmolLM2's tokenizer's (49,152 tokens, exported
   here or carried with ``--tokenizer``; Llama-3's own is 128,256); ``--quick``: a tiny Llama (4 layers, hidden
   128) that runs on the CPU. Weights are bfloat16 draws of N(0, 0.02) taken from one pool of draws at a random
   offset per tensor (far cheaper than drawing each of 8B), norms 1, written in shards of a few layers, so that
   one shard at a time is in memory;
2. ``--adapters`` PEFT adapters in one folder (rank 8 on q_proj and v_proj, bfloat16, each its own weights:
   bench.staging.write_adapters), named adapter-00000... in their popularity order;
3. ``lora-server serve`` on them as a subprocess (``--adapter-dir``: every one registered and staged at start,
   ``--max-loras 64``, the step limits sized for the device, on CUDA ``--gpu-memory-utilization 0.85``), loaded by
   ``bench serve``'s generator in this process: random 128-token prompts, 64 output tokens, ignore-eos, 64
   requests in flight, at four points: the first ``--few`` adapters uniformly (the reference), all of them
   uniformly, all by Zipf popularity (alpha 1), and all uniformly again on a server restarted with a small arena
   (``--kv-cache-gb``: one full batch's KV and 64 adapters, a quarter to spare), where adapters and KV compete;
4. per point: output tok/s, TTFT median and p99, TPOT median, their ratios to the reference, and the share of the
   client's mean TTFT that the server's own split accounts for (queueing + adapter loading + prefill: /admin/pool's
   ``ttft``, read before and after the point, so the mean over the point's requests; the server's TTFT starts when
   the request arrives), with the server's adapter figures (stagings from disk, staged adapters and their bytes,
   loads and activations: the histograms /metrics exports as ``vllm:lora_adapter_load_seconds``). The goals are
   printed met or not beside them; all of it goes to ``--json``. A goal missed is a measurement, not an error."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

from lora_server.adapters.lora_types import BaseShapes
from lora_server.adapters.peft_files import SETTLE_NS
from lora_server.bench.serve import run_all
from lora_server.bench.serve_flags import add_args
from lora_server.bench.staging import write_adapters
from lora_server.distributed.group import free_port
from lora_server.errors import ConfigError
from lora_server.model.arch import PRESETS

KEY = "bench-e2e-admin-key"
PROMPT_TOKENS, OUTPUT_TOKENS, CONCURRENCY, MAX_LORAS = 128, 64, 64, 64
RANK, TARGETS = 8, ("q_proj", "v_proj")
CPU_ARENA_GB = 0.25  # --quick on the CPU: room for every request's KV and many adapters
POOL_DRAWS, SHARD_LAYERS = 1 << 24, 4
CLIENT_FIGURES = ("median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "cached_token_share")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Llama-3-8B's config.json as HF ships it (the preset, which dummy weights use, with the keys HF writes beside it);
# vocab_size, bos and eos come from the tokenizer
LLAMA3_8B = {**PRESETS["llama-3-8b"], "model_type": "llama", "hidden_act": "silu", "torch_dtype": "bfloat16"}
LLAMA3_8B.update(attention_bias=False, rope_scaling=None)
# 4 layers: a page (one 16-token KV block of every layer, float32 on the CPU) must hold 16 rows of the widest module
TINY = {**LLAMA3_8B, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4}
TINY.update(num_attention_heads=4, num_key_value_heads=2)


@dataclass(frozen=True)
class Point:
    name: str
    adapters: int  # requests pick among the first ``adapters`` names
    assignment: str  # bench serve's --lora-assignment
    small_arena: bool = False


def bench_e2e(args: argparse.Namespace) -> dict[str, Any]:
    """The whole run (the module's docstring); returns what it writes to the JSON, beside which the servers' logs
    and bench serve's printout go. ConfigError for flags that cannot run here; RuntimeError when a server or a
    request fails."""
    cuda = torch.cuda.is_available()  # no CUDA context here: the GPU is the server's
    if not args.quick and not cuda:
        raise ConfigError("bench-e2e serves Llama-3-8B's shape on a CUDA GPU; --quick runs a tiny Llama on the CPU")
    if min(args.adapters, args.few, args.num_prompts) < 1 or args.few > args.adapters:
        raise ConfigError("--few, --adapters and --num-prompts must be at least 1, and --few at most --adapters")
    if args.workdir and Path(args.workdir).exists() and any(Path(args.workdir).iterdir()):
        raise ConfigError(f"--workdir {args.workdir} is not empty")
    json_path = Path(args.json) if args.json else Path(args.out) / "bench-e2e.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    (json_path.parent / "bench-e2e-load.log").write_text("")  # bench serve's printout of this run's points
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        work = Path(args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-e2e-")))
        tokenizer, config, phases = write_inputs(args, work)
        small_gb = args.small_arena_gb or small_arena_gb(config, 2 if cuda else 4)  # bfloat16 / float32 KV
        rows, servers = serve_points(args, work, json_path.parent, tokenizer, small_gb, cuda)
    phases["total"] = time.monotonic() - started
    goals = check_goals(rows, args.quick)
    print_report(rows, goals)
    shape = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_key_value_heads", "vocab_size")
    settings: dict[str, Any] = {"model": {k: config[k] for k in shape}, "device": "cuda" if cuda else "cpu"}
    settings.update({k: getattr(args, k) for k in ("adapters", "few", "num_prompts")}, small_arena_gb=small_gb)
    settings.update(rank=RANK, prompt_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS, concurrency=CONCURRENCY)
    report = {"settings": settings, "phases_s": phases, "servers": servers, "points": rows, "goals": goals}
    json_path.write_text(json.dumps(report, indent=1))
    print(f"figures written to {json_path}")
    return report


def write_inputs(args: argparse.Namespace, work: Path) -> tuple[Path, dict[str, Any], dict[str, float]]:
    """The tokenizer (--tokenizer, or exported into WORK/tokenizer), WORK/adapters and WORK/model; returns the
    tokenizer's folder, the model's config.json and the seconds each took."""
    t0 = time.monotonic()
    tokenizer = Path(args.tokenizer) if args.tokenizer else export_tokenizer(work / "tokenizer")
    config = model_config(TINY if args.quick else LLAMA3_8B, tokenizer)
    print(f"writing {args.adapters} adapters (rank {RANK} on {', '.join(TARGETS)}) ...", flush=True)
    t1 = time.monotonic()
    write_adapters(work / "adapters", args.adapters, RANK, TARGETS, base_shapes(config))
    print(f"writing the checkpoint ({config['num_hidden_layers']} layers, hidden {config['hidden_size']}) ...")
    t2 = time.monotonic()
    write_checkpoint(work / "model", config, tokenizer)
    t3 = time.monotonic()
    time.sleep(max(0.0, SETTLE_NS / 1e9 - (t3 - t2)))  # the adapters at rest before they are read (peft_files)
    return tokenizer, config, {"tokenizer": t1 - t0, "adapters": t2 - t1, "checkpoint": t3 - t2}


def serve_points(
    args: argparse.Namespace, work: Path, logs: Path, tokenizer: Path, small_gb: float, cuda: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The four points, the last on a second server with a small arena; returns their figures and the servers'."""
    names = sorted(p.name for p in (work / "adapters").iterdir())
    few, many = args.few, args.adapters
    points = [
        Point(f"{few} uniform", few, "random"),
        Point(f"{many} uniform", many, "random"),
        Point(f"{many} zipf", many, "zipf"),
        Point(f"{many} uniform, small arena", many, "random", small_arena=True),
    ]
    common = ["--model", str(work / "model"), "--quantization", "none", "--adapter-dir", str(work / "adapters")]
    common += ["--max-loras", str(MAX_LORAS), "--admin-key", KEY]
    arenas = {
        False: ["--gpu-memory-utilization", "0.85"] if cuda else ["--kv-cache-gb", str(CPU_ARENA_GB)],
        True: ["--kv-cache-gb", f"{small_gb:.4f}"],
    }
    rows: list[dict[str, Any]] = []
    servers: list[dict[str, Any]] = []
    for small in (False, True):
        flags = [*common, *arenas[small], "--data-dir", str(work / f"data-{len(servers)}")]
        server = Server(flags, logs / f"bench-e2e-serve-{len(servers)}.log")
        try:
            servers.append(server.describe())
            if servers[-1]["registered"] != many:
                raise RuntimeError(
                    f"the server registered {servers[-1]['registered']} of {many} adapters ({server.log})"
                )
            print(
                f"server up in {server.start_s:.1f} s ({' '.join(arenas[small])}): {many} adapters registered in "
                f"{servers[-1]['registration_s']} s, {servers[-1]['staged_at_start']} staged",
                flush=True,
            )
            _load(server.url, names[:few], "random", tokenizer, CONCURRENCY, 8, 999, logs)  # warm-up, not counted
            for seed, point in enumerate(points, start=1):  # each point its own prompts: no cache from another
                if point.small_arena == small:
                    measured = run_point(server, point, names, tokenizer, args.num_prompts, seed, logs)
                    rows.append(figures(point, *measured, rows[0] if rows else None))
                    print(format_row(rows[-1]), flush=True)
        finally:
            server.stop()
    return rows, servers


# ---- the checkpoint and its adapters -------------------------------------------------------------------------


def export_tokenizer(folder: Path) -> Path:
    """The embedded model's tokenizer, exported by ``lora-server export-tokenizer`` into ``folder``."""
    cmd = [sys.executable, "-m", "lora_server.cli", "export-tokenizer", str(folder)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ConfigError(
            f"export-tokenizer failed ({done.stderr.strip()[-300:]}): where the embedded model is not installed, "
            "export it on a machine that has it and pass --tokenizer DIR"
        )
    return folder


def model_config(shape: dict[str, Any], tokenizer: Path) -> dict[str, Any]:
    """``shape``'s config.json with the tokenizer's vocabulary size, BOS and EOS."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    special = json.loads((tokenizer / "tokenizer_config.json").read_text())
    ids = {k: tok.token_to_id(special[k]) for k in ("bos_token", "eos_token") if special.get(k)}
    return {
        **shape,
        "vocab_size": tok.get_vocab_size(),
        "bos_token_id": ids.get("bos_token"),
        "eos_token_id": ids.get("eos_token"),
    }


def base_shapes(config: dict[str, Any]) -> BaseShapes:
    """What the adapters must fit: the model's layers and projection widths."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv = hidden // heads * config["num_key_value_heads"]
    return BaseShapes.llama(config["num_hidden_layers"], hidden, config["intermediate_size"], hidden, kv)


Shard = list[tuple[str, tuple[int, ...]]]  # (HF tensor name, shape) of one file


def hf_shards(config: dict[str, Any]) -> list[Shard]:
    """The checkpoint's tensors in HF's names, SHARD_LAYERS layers a file, the embedding in the first file and the
    final norm and head in the last (torch's [out, in] for the linears)."""
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    features = base_shapes(config).features
    linears = [(f"self_attn.{p}_proj", p) for p in "qkvo"] + [(f"mlp.{p}_proj", p) for p in ("gate", "up", "down")]
    norms = ("input_layernorm", "post_attention_layernorm")
    shards: list[Shard] = []
    for first in range(0, layers, SHARD_LAYERS):
        shard: Shard = []
        for i in range(first, min(first + SHARD_LAYERS, layers)):
            shard += [(f"model.layers.{i}.{m}.weight", features[part][::-1]) for m, part in linears]
            shard += [(f"model.layers.{i}.{norm}.weight", (hidden,)) for norm in norms]
        shards.append(shard)
    shards[0].insert(0, ("model.embed_tokens.weight", (vocab, hidden)))
    shards[-1] += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return shards


def write_checkpoint(folder: Path, config: dict[str, Any], tokenizer: Path) -> None:
    """config.json, the tokenizer's files and the weights in HF's layout (hf_shards, and the index), one file's
    tensors in memory at a time."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, folder / name)
    pool = (torch.randn(POOL_DRAWS, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    rng, shards = random.Random(0), hf_shards(config)
    weight_map, total = {}, 0
    for n, shard in enumerate(shards, start=1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _weight(shape, pool, rng) for name, shape in shard}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def _weight(shape: tuple[int, ...], pool: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """A bfloat16 tensor of ``shape``: ones for a norm (1-d), else the pool's draws from a random offset on,
    wrapping around."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    n, start = math.prod(shape), rng.randrange(pool.numel())
    return pool.repeat((start + n) // pool.numel() + 1)[start : start + n].view(shape)


def small_arena_gb(config: dict[str, Any], dtype_bytes: int) -> float:
    """An arena that holds one full batch's KV (CONCURRENCY requests of prompt + output tokens, in 16-token
    blocks) and MAX_LORAS adapters, with a quarter to spare: adapters and KV compete for it."""
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    kv_width = hidden // config["num_attention_heads"] * config["num_key_value_heads"]
    tokens = CONCURRENCY * math.ceil((PROMPT_TOKENS + OUTPUT_TOKENS) / 16) * 16
    kv = layers * 2 * kv_width * dtype_bytes * tokens
    adapter = layers * RANK * (2 * hidden + hidden + kv_width) * dtype_bytes  # q: hidden -> hidden, v: -> kv_width
    return 1.25 * (kv + MAX_LORAS * adapter) / 2**30


# ---- the server and the load ---------------------------------------------------------------------------------


class Server:
    """``lora-server serve FLAGS`` in its own process, its output in ``log``; healthy once built (RuntimeError
    with the log's tail if it exits or does not come up within ``timeout_s``)."""

    def __init__(self, flags: list[str], log: Path, timeout_s: float = 1200.0) -> None:
        self.flags, self.log, self.port = flags, log, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        start = time.monotonic()
        with log.open("w") as out:  # the child writes to its own copy of the descriptor
            cmd = [sys.executable, "-m", "lora_server.cli", "serve", "--port", str(self.port), *flags]
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            while not self._healthy():
                if self.proc.poll() is not None or time.monotonic() - start > timeout_s:
                    raise RuntimeError(f"the server did not come up; its log ({log}) ends:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - start

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def describe(self) -> dict[str, Any]:
        """The server as it started: its flags, seconds to come up, adapters registered (and, from its log, in how
        long), staged (distinct contents: identical files stage once) and the log's start-up phases."""
        text, pool = self.log.read_text(), self.pool()
        registration = re.search(r"adapters registered from .* in ([\d.]+) s", text)
        startup = re.search(r"start-up: (.*)", text)
        return {
            "flags": ["KEY" if f == KEY else f for f in self.flags],
            "start_s": round(self.start_s, 2),
            "registered": len(pool["registered_adapters"]),
            "registration_s": float(registration.group(1)) if registration else None,
            "staged_at_start": pool["device_memory"]["staged_adapters"],
            "staged_bytes_at_start": pool["device_memory"]["staged_adapter_bytes"],
            "startup": startup.group(1) if startup else None,
            "log": str(self.log),
        }

    def pool(self) -> dict[str, Any]:
        resp = httpx.get(f"{self.url}/admin/pool", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        resp.raise_for_status()
        return resp.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _load(url: str, names: list[str], assignment: str, tokenizer: Path, n: int, output: int, seed: int, logs: Path):
    """One run of bench serve's generator (its own printout goes to LOGS/bench-e2e-load.log): n random prompts of
    PROMPT_TOKENS tokens (cut with ``tokenizer``), ``output`` tokens each, CONCURRENCY in flight, adapters from
    ``names`` by ``assignment``. Returns its result (bench serve's JSON fields)."""
    flags = ["--base-url", url, "--dataset-name", "random", "--random-input-len", str(PROMPT_TOKENS)]
    flags += ["--random-output-len", str(output), "--ignore-eos", "--max-concurrency", str(CONCURRENCY)]
    flags += ["--num-prompts", str(n), "--lora-assignment", assignment, "--tokenizer", str(tokenizer)]
    flags += ["--metric-percentiles", "50,99", "--seed", str(seed), "--disable-tqdm"]
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(flags)
    args.lora_modules = names  # thousands of names: given here rather than on a command line
    with (logs / "bench-e2e-load.log").open("a") as out, contextlib.redirect_stdout(out):
        [result] = asyncio.run(run_all(args, [math.inf]))
    if result["failed"]:
        raise RuntimeError(f"{result['failed']} requests failed: {result['error_counts']}")
    return result


def _idle_pool(server: Server, timeout_s: float = 30.0) -> dict[str, Any]:
    """/admin/pool once the engine is idle and its figures have caught up with it (the engine republishes them at
    most every 0.1 s): two readings 0.25 s apart that agree."""
    pool, deadline = server.pool(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.25)
        pool, last = server.pool(), pool
        if pool["running"] == pool["waiting"] == 0 and pool["ttft"] == last["ttft"]:
            break
    return pool


def run_point(
    server: Server, point: Point, names: list[str], tokenizer: Path, n: int, seed: int, logs: Path
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """bench serve's result for the point, and /admin/pool before and after it."""
    print(f"{point.name}: {n} requests ...", flush=True)
    before = _idle_pool(server)
    result = _load(server.url, names[: point.adapters], point.assignment, tokenizer, n, OUTPUT_TOKENS, seed, logs)
    return result, before, _idle_pool(server)


def _delta_mean(before: dict[str, Any], after: dict[str, Any], key: str) -> float:
    """The mean of ``key`` over the requests added between two readings of a mean over ``requests``."""
    added = after["requests"] - before["requests"]
    return (after[key] * after["requests"] - before[key] * before["requests"]) / max(1, added)


def _histogram(before: dict[str, Any], after: dict[str, Any], kind: str) -> tuple[int, float]:
    """(observations, their mean in seconds) of /admin/pool's adapter_load_seconds[kind] between two readings."""
    b, a = before["adapter_load_seconds"][kind], after["adapter_load_seconds"][kind]
    count = a["count"] - b["count"]
    return count, (a["sum"] - b["sum"]) / max(1, count)


def figures(
    point: Point, result: dict[str, Any], before: dict[str, Any], after: dict[str, Any], ref: dict[str, Any] | None
) -> dict[str, Any]:
    """A point's figures: the client's (bench serve's result), their ratios to ``ref`` (the reference point's
    figures; None: this is it), the server's TTFT split over the point's requests and its adapter figures (counts
    over the point, sizes after it)."""
    split = {
        f"{p}_mean_s": _delta_mean(before["ttft"], after["ttft"], f"{p}_mean_s")
        for p in ("queueing", "adapter_loading", "prefill")
    }
    memory = after["device_memory"]
    loads, activations = _histogram(before, after, "load"), _histogram(before, after, "activate")
    row = {
        "point": point.name,
        "adapters": point.adapters,
        "assignment": result["lora_assignment"],
        "small_arena": point.small_arena,
        "requests": result["completed"],
        "distinct_adapters": len(result["per_adapter"]),  # those the trace picked
        "duration_s": result["duration"],
        "output_tok_s": result["output_throughput"],
        **{k: result[k] for k in CLIENT_FIGURES},
        "server_ttft": {"requests": after["ttft"]["requests"] - before["ttft"]["requests"], **split},
        "split_share": sum(split.values()) * 1000 / result["mean_ttft_ms"],
        "server_adapters": {
            "stagings": memory["adapter_stagings"] - before["device_memory"]["adapter_stagings"],
            "staged_adapters": memory["staged_adapters"],
            "staged_adapter_bytes": memory["staged_adapter_bytes"],
            "staged_adapter_budget_bytes": memory["staged_adapter_budget_bytes"],
            "loads": loads[0],
            "load_mean_s": loads[1],
            "activations": activations[0],
            "activate_mean_s": activations[1],
            "resident_adapters": after["resident_adapters"],
            "adapter_bytes_to_gpu": after["adapter_bytes_to_gpu"] - before["adapter_bytes_to_gpu"],
        },
    }
    ref = ref or row
    row["tok_s_ratio"] = row["output_tok_s"] / ref["output_tok_s"]
    row["median_ttft_ratio"] = row["median_ttft_ms"] / ref["median_ttft_ms"]
    return row


# ---- the report ----------------------------------------------------------------------------------------------

HEADER = (
    f"{'point':<28} {'reqs':>5} {'distinct':>8} {'out tok/s':>10} {'x ref':>6} {'TTFT p50 ms':>11} {'x ref':>6} "
    f"{'TTFT p99 ms':>11} {'TPOT p50 ms':>11} {'split/TTFT':>10}"
)


def format_row(row: dict[str, Any]) -> str:
    t, a = row["server_ttft"], row["server_adapters"]
    return (
        f"{row['point']:<28} {row['requests']:>5} {row['distinct_adapters']:>8} {row['output_tok_s']:>10.1f} "
        f"{row['tok_s_ratio']:>6.2f} {row['median_ttft_ms']:>11.1f} {row['median_ttft_ratio']:>6.2f} "
        f"{row['p99_ttft_ms']:>11.1f} {row['median_tpot_ms']:>11.1f} {row['split_share']:>10.1%}\n"
        f"  server: TTFT {1000 * t['queueing_mean_s']:.1f} queueing + {1000 * t['adapter_loading_mean_s']:.1f} "
        f"adapter loading + {1000 * t['prefill_mean_s']:.1f} prefill ms (means); {a['stagings']} stagings from "
        f"disk, {a['staged_adapters']} staged ({a['staged_adapter_bytes'] / 2**20:.1f} of "
        f"{a['staged_adapter_budget_bytes'] / 2**20:.0f} MiB), {a['activations']} loaded into the arena "
        f"({1000 * a['activate_mean_s']:.2f} ms mean), {a['resident_adapters']} resident after"
    )


def check_goals(rows: list[dict[str, Any]], quick: bool) -> list[dict[str, Any]]:
    """Each goal with its value and whether it is met. On the GPU, the many-adapter points (uniform and Zipf) at
    >= 0.9x the reference's output tok/s and <= 2x its median TTFT; on the CPU (--quick), the uniform one at >= 0.8x
    the tok/s; at every point, the server's split >= 95% of the client's mean TTFT."""
    many = rows[1:2] if quick else rows[1:3]
    wanted = [(row, "tok_s_ratio", 0.8 if quick else 0.9, True) for row in many]
    wanted += [] if quick else [(row, "median_ttft_ratio", 2.0, False) for row in many]
    wanted += [(row, "split_share", 0.95, True) for row in rows]
    return [
        {
            "point": row["point"],
            "figure": key,
            "value": round(row[key], 3),
            "target": f"{'>=' if at_least else '<='} {target}",
            "met": row[key] >= target if at_least else row[key] <= target,
        }
        for row, key, target, at_least in wanted
    ]


def print_report(rows: list[dict[str, Any]], goals: list[dict[str, Any]]) -> None:
    print("\n" + HEADER)
    for row in rows:
        print(format_row(row))
    for g in goals:
        print(f"  [{'met' if g['met'] else 'missed'}] {g['point']}: {g['figure']} {g['value']} (goal {g['target']})")
