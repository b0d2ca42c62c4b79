"""``lora-server bench serve``: a load generator for any OpenAI-compatible server (ours, vLLM, ...), with the flags
and result JSON of ``vllm bench serve`` where they apply.

It sends a trace of conversations (lora_server.bench.serve_data) at the arrival times of a Poisson (gamma) process,
at most ``--max-concurrency`` requests at a time, each a streamed completion or chat request with
``stream_options.include_usage``, spread over ``--lora-modules`` (adapters) and tenant keys; it times each request
from the client's side and summarizes (lora_server.bench.serve_metrics). ``--plot-rates`` repeats the run at each
rate (each with its own prompts) and draws latency against throughput. Only httpx and the standard library speak to
the server."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import math
import random
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from lora_server.bench.serve_data import Conversation, TraceSpec, arrival_times, make_trace
from lora_server.bench.serve_metrics import (
    METRICS,
    RequestResult,
    breakdown,
    detailed,
    format_breakdown,
    format_summary,
    parse_goodput,
    summarize,
)

SAMPLING_FLAGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
TIMEOUT_S = 6 * 3600.0  # one request's limit (vLLM's)


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags; their names and defaults are vLLM's where vLLM has them."""
    target = p.add_argument_group("server")
    target.add_argument(
        "--base-url", default=None, help="the server's URL, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)"
    )
    target.add_argument("--host", default="127.0.0.1", help="the server's host without --base-url (default: 127.0.0.1)")
    target.add_argument("--port", type=int, default=8000, help="the server's port without --base-url (default: 8000)")
    target.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="the API path (default: /v1/completions; /v1/chat/completions sends messages)",
    )
    target.add_argument(
        "--backend",
        choices=["openai", "openai-chat"],
        default=None,
        help="the request shape (default: openai-chat when the endpoint ends in chat/completions)",
    )
    target.add_argument(
        "--model",
        default=None,
        help="the model name sent when no --lora-modules are given (default: the first model the server lists)",
    )
    target.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="[NAME=]KEY",
        help="a key sent as 'Authorization: Bearer KEY'; several spread requests over tenants",
    )
    target.add_argument(
        "--tenant-keys",
        default=None,
        metavar="FILE|LIST",
        help="tenants' keys, [NAME=]KEY, one a line in FILE or comma-separated (added to --api-key)",
    )
    target.add_argument("--header", nargs="*", default=None, metavar="KEY=VALUE", help="extra headers on every request")

    load = p.add_argument_group("trace")
    load.add_argument(
        "--dataset-name",
        choices=["random", "multi-turn"],
        default="random",
        help="random: one prompt of random words per request; multi-turn: conversations with a "
        "system prompt per adapter, each turn carrying the previous ones (default: random)",
    )
    load.add_argument(
        "--num-prompts", type=int, default=1000, help="requests (multi-turn: conversations) to send (default: 1000)"
    )
    load.add_argument(
        "--random-input-len",
        type=int,
        default=1024,
        help="words per prompt (multi-turn: per user turn), one token each on Llama vocabularies (default: 1024)",
    )
    load.add_argument("--random-output-len", type=int, default=128, help="max_tokens per request (default: 128)")
    load.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len * (1 - r), len * (1 + r)] (default: 0, fixed)",
    )
    load.add_argument("--random-prefix-len", type=int, default=0, help="words shared by every prompt (default: 0)")
    load.add_argument("--turns", type=int, default=3, help="multi-turn: turns per conversation (default: 3)")
    load.add_argument(
        "--system-prompt-len",
        type=int,
        default=64,
        help="multi-turn: words of each adapter's system prompt (default: 64)",
    )
    load.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="adapter names to spread requests over (default: none, --model only)",
    )
    load.add_argument(
        "--lora-assignment",
        choices=["random", "round-robin"],
        default="random",
        help="how each request (conversation) gets its adapter (default: random, as vLLM)",
    )
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="arrivals per second; inf sends everything at once (default: inf)",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="the gamma shape of the gaps between arrivals: "
        "1 is a Poisson process, below 1 burstier, above 1 more even (default: 1)",
    )
    load.add_argument(
        "--max-concurrency", type=int, default=None, help="the most requests in flight (default: no limit)"
    )
    load.add_argument("--seed", type=int, default=0, help="the trace's random seed (default: 0)")
    load.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask the server to ignore EOS (always on with the random datasets, as in vLLM)",
    )

    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    for name in SAMPLING_FLAGS[1:]:
        kind = int if name == "top_k" else float
        sampling.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help="(default: the server's)")
    sampling.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")

    report = p.add_argument_group("results")
    report.add_argument(
        "--percentile-metrics",
        default=",".join(METRICS),
        help="metrics to report, of ttft,tpot,itl,e2el (default: all four)",
    )
    report.add_argument("--metric-percentiles", default="99", help="percentiles to report, e.g. 50,90,99 (default: 99)")
    report.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs in ms (ttft, tpot, e2el) for the goodput: requests per second meeting all",
    )
    report.add_argument("--save-result", action="store_true", help="write the result JSON")
    report.add_argument("--save-detailed", action="store_true", help="with per-request lists (lengths, times, texts)")
    report.add_argument("--result-dir", default=None, help="where results go (default: the current directory)")
    report.add_argument(
        "--result-filename",
        default=None,
        help="the JSON's name (default: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json)",
    )
    report.add_argument("--label", default=None, help="the result's label (default: the backend)")
    report.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="saved in the result JSON")
    report.add_argument(
        "--plot-rates",
        default=None,
        metavar="RATE[,RATE...]",
        help="run once per request rate and draw latency against throughput (needs matplotlib)",
    )
    report.add_argument("--plot-file", default=None, help="the PNG (default: RESULT_DIR/bench-serve.png)")
    report.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _pairs(items: list[str] | None, what: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{what} takes KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def tenant_keys(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(label, key) of every key given: --api-key, then --tenant-keys (a file if one exists there, else a
    comma-separated list). A key without NAME= is labelled keyN (a key's own trailing '=' padding is no name)."""
    entries = list(args.api_key or [])
    if args.tenant_keys:
        path = Path(args.tenant_keys)
        text = path.read_text() if path.is_file() else args.tenant_keys.replace(",", "\n")
        entries += [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    keys = []
    for i, entry in enumerate(entries):
        name, sep, key = entry.partition("=")
        keys.append((name, key) if name and key.strip("=") else (f"key{i + 1}", entry))
    return keys


class Client:
    """Streams one request at a time per call; the endpoint's shape (completion or chat) fixed at construction."""

    def __init__(self, http: httpx.AsyncClient, url: str, chat: bool, headers: dict[str, str], body: dict[str, Any]):
        self.http, self.url, self.chat, self.headers, self.body = http, url, chat, headers, body

    async def send(
        self, model: str, prompt: str | list[dict[str, str]], max_tokens: int, key: str | None, result: RequestResult
    ) -> None:
        """Stream one request into ``result`` (timings relative to ``result.start``, set here). An HTTP error, an
        error event, a broken connection or a stream without content marks it failed, with the reason."""
        body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
        body.update(
            {"messages": prompt, "max_completion_tokens": max_tokens}
            if self.chat
            else {"prompt": prompt, "max_tokens": max_tokens}
        )
        body.update(self.body)
        headers = {**self.headers, **({"Authorization": f"Bearer {key}"} if key else {})}
        chunks, text = 0, []
        result.start = last = time.perf_counter()
        try:
            async with self.http.stream("POST", self.url, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    result.error = f"HTTP {resp.status_code}: {_error_message(await resp.aread())}"
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    now = time.perf_counter()
                    if data == "[DONE]":
                        last = now
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = f"error event: {_error_message(data.encode())}"
                        return
                    delta = _content(chunk, self.chat)
                    if delta:
                        if chunks == 0:
                            result.ttft = now - result.start
                        else:
                            result.itl.append(now - last)
                        chunks += 1
                        text.append(delta)
                    if chunk.get("usage"):
                        _take_usage(result, chunk["usage"])
                    last = now
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return
        result.latency = last - result.start
        result.text = "".join(text)
        if not result.usage_reported:
            result.output_tokens = chunks
        result.success = bool(result.text)
        if not result.success:
            result.error = "the stream carried no content"


def _content(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    return (choices[0].get("delta") or {}).get("content") or "" if chat else choices[0].get("text") or ""


def _take_usage(result: RequestResult, usage: dict[str, Any]) -> None:
    result.usage_reported = True
    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    result.output_tokens = int(usage.get("completion_tokens") or 0)
    result.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _error_message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:200]


async def run_conversation(
    client: Client,
    conv: Conversation,
    keys: list[tuple[str, str]],
    limit: asyncio.Semaphore | None,
    results: list[RequestResult],
    bar: tqdm,
) -> None:
    """Send the conversation's turns one after another, each with the history so far; after a failed turn the
    rest are not sent and count as failed."""
    tenant, key = keys[conv.tenant] if conv.tenant >= 0 else ("-", None)
    messages: list[dict[str, str]] = [{"role": "system", "content": conv.system}] if conv.system else []
    failed = False
    for user, words, max_tokens in zip(conv.user, conv.words, conv.max_tokens, strict=True):
        result = RequestResult(conv.adapter, tenant, prompt_tokens=words)
        results.append(result)
        if failed:
            result.error = "not sent: an earlier turn of its conversation failed"
        else:
            messages.append({"role": "user", "content": user})
            prompt = messages if client.chat else user
            if limit is None:
                await client.send(conv.adapter, prompt, max_tokens, key, result)
            else:
                async with limit:
                    await client.send(conv.adapter, prompt, max_tokens, key, result)
            messages.append({"role": "assistant", "content": result.text})
            failed = not result.success
        bar.update(1)


async def benchmark(
    client: Client,
    trace: list[Conversation],
    keys: list[tuple[str, str]],
    rate: float,
    burstiness: float,
    max_concurrency: int | None,
    seed: int,
    show_progress: bool,
) -> tuple[list[RequestResult], float]:
    """Run the trace: conversation i starts at its arrival time; returns every request's result (in the order
    they were sent) and the run's duration in seconds (from the start, before the first arrival, to the last
    answer: vLLM's)."""
    starts = arrival_times(len(trace), rate, burstiness, random.Random(seed))
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult] = []
    bar = tqdm(total=sum(len(c.user) for c in trace), disable=not show_progress, file=sys.stderr)
    begin = time.perf_counter()
    tasks = []
    for conv, at in zip(trace, starts, strict=True):
        delay = begin + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(run_conversation(client, conv, keys, limit, results, bar)))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - begin
    bar.close()
    return results, duration


async def first_model(http: httpx.AsyncClient, base: str, headers: dict[str, str]) -> str:
    """The first model the server lists at /v1/models."""
    resp = await http.get(base + "/v1/models", headers=headers)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def run_all(args: argparse.Namespace, rates: list[float]) -> list[dict[str, Any]]:
    """One result (vLLM's fields, the breakdowns, the settings) per rate, printed as they finish."""
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    chat = args.backend == "openai-chat" or (
        args.backend is None and args.endpoint.rstrip("/").endswith("chat/completions")
    )
    if args.dataset_name == "multi-turn" and not chat:
        raise ValueError("--dataset-name multi-turn sends messages: use --endpoint /v1/chat/completions")
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if unknown := [m for m in metrics if m not in METRICS]:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(unknown)} (known: {', '.join(METRICS)})")
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    goodput = parse_goodput(args.goodput)
    keys = tenant_keys(args)
    headers = _pairs(args.header, "--header")
    sampling = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    ignore_eos = args.ignore_eos or args.dataset_name == "random"
    body = {**sampling, **({"ignore_eos": True} if ignore_eos else {}), **(args.extra_body or {})}
    multi = args.dataset_name == "multi-turn"
    spec = TraceSpec(
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        0 if multi else args.random_prefix_len,
        args.turns if multi else 1,
        args.system_prompt_len if multi else 0,
        args.seed,
    )
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT_S, connect=30.0), limits=limits) as http:
        model = args.model or await first_model(http, base, {**headers, **_auth(keys)})
        client = Client(http, base + args.endpoint, chat, headers, body)
        out = []
        for i, rate in enumerate(rates):
            # each rate its own prompts (seed + i): a repeated trace would be served from the previous run's cache
            trace = make_trace(
                dataclasses.replace(spec, seed=args.seed + i),
                args.lora_modules or [model],
                args.lora_assignment,
                len(keys),
            )
            results, duration = await benchmark(
                client, trace, keys, rate, args.burstiness, args.max_concurrency, args.seed + i, not args.disable_tqdm
            )
            settings = {
                "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
                "backend": "openai-chat" if chat else "openai",
                "label": args.label or ("openai-chat" if chat else "openai"),
                "model_id": model,
                "base_url": base,
                "endpoint": args.endpoint,
                "dataset_name": args.dataset_name,
                "num_prompts": args.num_prompts,
                "request_rate": rate if math.isfinite(rate) else "inf",
                "burstiness": args.burstiness,
                "max_concurrency": args.max_concurrency,
                "lora_modules": args.lora_modules,
                "lora_assignment": args.lora_assignment,
                "tenants": [name for name, _ in keys],
                **_pairs(args.metadata, "--metadata"),
            }
            summary = summarize(results, duration, metrics, percentiles, goodput)
            result = {
                **settings,
                **summary,
                "per_adapter": breakdown(results, "adapter", duration, metrics, percentiles),
                "per_tenant": breakdown(results, "tenant", duration, metrics, percentiles),
                "error_counts": _error_counts(results),
            }
            if args.save_detailed:
                result.update(detailed(results))
            print(format_summary(summary, metrics, percentiles, settings))
            print(format_breakdown("adapter", result["per_adapter"], metrics))
            if keys:
                print(format_breakdown("tenant", result["per_tenant"], metrics))
            for error, n in result["error_counts"].items():
                print(f"{n} x {error}")
            out.append(result)
    return out


def _auth(keys: list[tuple[str, str]]) -> dict[str, str]:
    return {"Authorization": f"Bearer {keys[0][1]}"} if keys else {}


def _error_counts(results: list[RequestResult]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        if not r.success:
            counts[r.error] = counts.get(r.error, 0) + 1
    return counts


def result_path(args: argparse.Namespace, result: dict[str, Any], several: bool) -> Path:
    """vLLM's default name, LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json, or --result-filename (with the rate
    added when there are several), under --result-dir."""
    rate = result["request_rate"]
    if args.result_filename:
        name = args.result_filename
        if several:
            stem, dot, ext = name.rpartition(".")
            name = f"{stem}-{rate}qps.{ext}" if dot else f"{name}-{rate}qps"
    else:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        model = str(result["model_id"]).split("/")[-1]
        name = f"{result['label']}-{float(rate)}qps{concurrency}-{model}-{result['date']}.json"
    return Path(args.result_dir or ".") / name


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Latency against output-token throughput, one point per rate: TTFT and E2EL (median and p99 where
    reported)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["output_throughput"] for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, title in ((axes[0], "ttft", "time to first token"), (axes[1], "e2el", "end-to-end latency")):
        for stat in ("median", "p99"):
            key = f"{stat}_{metric}_ms"
            if key in results[0]:
                ax.plot(xs, [r[key] / 1000 for r in results], marker="o", label=stat)
        for x, r in zip(xs, results, strict=True):
            ax.annotate(f"{r['request_rate']}/s", (x, r.get(f"median_{metric}_ms", 0) / 1000), fontsize=8)
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel("seconds")
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{results[0]['model_id']} at {results[0]['base_url']}: latency vs throughput by request rate")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    """Run, print, save and plot; 2 with a message for bad flags or an unreachable server."""
    rates = [float(r) for r in args.plot_rates.split(",")] if args.plot_rates else [args.request_rate]
    if args.plot_rates and importlib.util.find_spec("matplotlib") is None:
        print(
            "error: --plot-rates draws with matplotlib, which is not installed: pip install 'lora-server[bench]'",
            file=sys.stderr,
        )
        return 2
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        print("error: --num-prompts and --max-concurrency must be at least 1", file=sys.stderr)
        return 2
    try:
        results = asyncio.run(run_all(args, rates))
    except (ValueError, OSError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.save_result:
        for result in results:
            path = result_path(args, result, len(results) > 1)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=1))
            print(f"saved {path}")
    if args.plot_rates:
        path = Path(args.plot_file or Path(args.result_dir or ".") / "bench-serve.png")
        plot(results, path)
        print(f"plotted {path}")
    return 0
