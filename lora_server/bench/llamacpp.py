"""``lora-server bench-llamacpp``: this server and llama.cpp's ``llama-server`` side by side on the same GGUF file,
each alone on the machine, through HTTP, in one run.

Each server is started, loaded with ``streams`` concurrent streamed completions of ``output_len`` tokens (greedy,
EOS ignored; prompts of a few words, different per stream), then stopped before the other starts. Per point: the
output tokens over the wall time from the first request sent to the last token (tok/s), and the median TPOT (time
between a stream's first and last token over its tokens after the first). With ``--adapter NAME`` every stream
uses this server's adapter NAME and llama.cpp's ``--llama-lora FILE`` (the same adapter, converted with llama.cpp's
convert_lora_to_gguf.py); with ``--mixed`` streams alternate between the base and the adapter (llama.cpp batches
only requests with equal adapter sets). The best of ``passes`` passes counts for each server. llama.cpp is not a
dependency: ``--llama-server`` names a binary built from its source."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

PROMPTS = ("Tell me about the sea", "Write a short story", "Explain how rain forms", "Describe a busy market")


@dataclass
class Point:
    server: str
    streams: int
    adapter: str  # "none", the adapter's name, or "mixed"
    tok_per_s: float
    tpot_ms: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready at {url} within {timeout:.0f} s")


async def _stream(http: httpx.AsyncClient, url: str, body: dict[str, object]) -> tuple[float, list[float]]:
    """(send time, each content chunk's arrival time) of one streamed completion."""
    sent, arrivals = time.perf_counter(), []
    async with http.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any(c.get("text") for c in chunk.get("choices", [])):
                arrivals.append(time.perf_counter())
    return sent, arrivals


async def _load(base: str, bodies: list[dict[str, object]]) -> tuple[float, float]:
    """(tok/s over the wall time, median TPOT in ms) of the bodies sent at once."""
    async with httpx.AsyncClient(timeout=600) as http:
        results = await asyncio.gather(*(_stream(http, base + "/v1/completions", b) for b in bodies))
    start = min(sent for sent, _ in results)
    end = max(times[-1] for _, times in results if times)
    tokens = sum(len(times) for _, times in results)
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for _, t in results if len(t) > 1]
    return tokens / (end - start), statistics.median(tpots) * 1e3


def _bodies(
    model: str, args: argparse.Namespace, streams: int, lora: str | None, llama: bool
) -> list[dict[str, object]]:
    bodies = []
    for i in range(streams):
        with_adapter = lora is not None and (not args.mixed or i % 2 == 1)
        body: dict[str, object] = {
            "prompt": f"{PROMPTS[i % len(PROMPTS)]} ({i})",
            "max_tokens": args.output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        if llama:  # llama-server: the one loaded adapter (id 0) at scale 1, or at scale 0 for the base
            body["lora"] = [{"id": 0, "scale": 1.0 if with_adapter else 0.0}] if lora is not None else []
        else:
            body["model"] = lora if with_adapter else model
        bodies.append(body)
    return bodies


def _measure(name: str, base: str, model: str, args: argparse.Namespace, lora: str | None) -> list[Point]:
    points = []
    llama = name == "llama.cpp"
    for streams in args.streams:
        label = "none" if lora is None else ("mixed" if args.mixed else str(args.adapter))
        bodies = _bodies(model, args, streams, lora, llama)
        asyncio.run(_load(base, bodies[:1]))  # warm-up, not counted
        runs = [asyncio.run(_load(base, bodies)) for _ in range(args.passes)]
        tok_s, tpot = max(runs)
        points.append(Point(name, streams, label, round(tok_s, 1), round(tpot, 2)))
        print(f"{name:10s} streams {streams:3d} adapter {label:8s} {tok_s:8.1f} tok/s  TPOT {tpot:6.2f} ms", flush=True)
    return points


def _run_server(cmd: list[str], ready: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """The server started with its output in ``log`` (a file: a pipe nobody reads would stall it), once ready."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_ready(ready, proc)
    except RuntimeError as e:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{cmd[0]} did not start ({e}); its last output: {log.read_text()[-2000:]}") from None
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench(args: argparse.Namespace) -> list[Point]:
    from lora_server.model.loader import default_model_path

    gguf = Path(args.model) if args.model else default_model_path()
    threads = str(args.threads or os.cpu_count() or 1)
    points: list[Point] = []

    port = _free_port()
    cmd = [args.llama_server, "-m", str(gguf), "--port", str(port), "-t", threads, "-tb", threads]
    cmd += ["-np", str(max(args.streams)), "-c", str(max(args.streams) * (args.output_len + 64)), "--no-webui"]
    if args.adapter:
        cmd += ["--lora", args.llama_lora, "--lora-init-without-apply"]
    logs = Path(args.out)
    logs.mkdir(parents=True, exist_ok=True)
    proc = _run_server(cmd, f"http://127.0.0.1:{port}/health", logs / "llama-server.log")
    try:
        points += _measure("llama.cpp", f"http://127.0.0.1:{port}", "", args, args.adapter)
    finally:
        _stop(proc)

    port = _free_port()
    with tempfile.TemporaryDirectory() as data:
        env = dict(os.environ, LORA_SERVER_DATA_DIR=data, OMP_NUM_THREADS=threads)
        cmd = [sys.executable, "-m", "lora_server.cli", "serve", "--port", str(port)]
        cmd += ["--model", str(gguf)] if args.model else []  # else the embedded model, with its demo adapters
        cmd += ["--adapter", f"{args.adapter}={args.adapter_path}"] if args.adapter_path else []
        proc = _run_server(cmd, f"http://127.0.0.1:{port}/health", logs / "lora-server.log", env)
        try:
            models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
            base_model = models[0]["id"]
            points += _measure("lora-server", f"http://127.0.0.1:{port}", base_model, args, args.adapter)
        finally:
            _stop(proc)

    by_key = {(p.server, p.streams): p for p in points}
    print("\nratio (lora-server tok/s / llama.cpp tok/s):")
    for streams in args.streams:
        ours, theirs = by_key[("lora-server", streams)], by_key[("llama.cpp", streams)]
        print(f"  streams {streams:3d}: {ours.tok_per_s / theirs.tok_per_s:.2f}x")
    out = Path(args.json) if args.json else Path(args.out) / "bench-llamacpp.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(p) for p in points], indent=2))
    return points
