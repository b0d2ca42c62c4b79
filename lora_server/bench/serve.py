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
import contextlib
import dataclasses
import importlib.util
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from lora_server.bench.serve_data import (
    Conversation,
    TraceSpec,
    arrival_times,
    custom_trace,
    make_trace,
    prefix_repetition_trace,
    ramp_rates,
    single_turns,
    varying_arrival_times,
)
from lora_server.bench.serve_flags import SAMPLING_FLAGS, add_args, check_args
from lora_server.bench.serve_metrics import (
    CLIENT_QUEUE_METRICS,
    METRICS,
    RequestResult,
    breakdown,
    detailed,
    format_breakdown,
    format_summary,
    parse_goodput,
    per_request,
    summarize,
)

__all__ = ["add_args", "main"]  # the CLI's: the flags (serve_flags) and the command

TIMEOUT_S = 6 * 3600.0  # one request's limit (vLLM's)
PROBE_PROMPT = "Hi"  # --probe-request-rate: one-token requests beside the trace


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

    def __init__(
        self,
        http: httpx.AsyncClient,
        url: str,
        chat: bool,
        headers: dict[str, str],
        body: dict[str, Any],
        logprobs: int | None = None,
        count_tokens: Callable[[str], int] | None = None,
    ):
        """``logprobs``: per output token (--logprobs); ``count_tokens``: counts the output of a stream that
        reports no usage (a local tokenizer), else its content chunks are counted."""
        self.http, self.url, self.chat, self.headers, self.body = http, url, chat, headers, body
        self.logprobs, self.count_tokens = logprobs, count_tokens

    async def send(
        self,
        model: str,
        prompt: str | list[dict[str, str]],
        max_tokens: int,
        key: str | None,
        result: RequestResult,
        request_id: str | None = None,
    ) -> None:
        """Stream one request into ``result`` (timings relative to ``result.start``, set here), ``request_id`` as
        its x-request-id. An HTTP error, an error event, a broken connection or a stream without content marks it
        failed, with the reason."""
        body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
        body.update(
            {"messages": prompt, "max_completion_tokens": max_tokens}
            if self.chat
            else {"prompt": prompt, "max_tokens": max_tokens}
        )
        if self.logprobs is not None:
            body.update({"logprobs": True, "top_logprobs": self.logprobs} if self.chat else {"logprobs": self.logprobs})
        body.update(self.body)
        headers = {**self.headers, **({"Authorization": f"Bearer {key}"} if key else {})}
        if request_id is not None:
            headers["x-request-id"] = request_id
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
            result.output_tokens = self.count_tokens(result.text) if self.count_tokens else chunks
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


@dataclass
class Run:
    """What every request of a run shares: the client, the tenants' keys, the slot limit, the x-request-id prefix,
    and the progress bar; ``sent`` counts the requests sent (each one's index in its x-request-id)."""

    client: Client
    keys: list[tuple[str, str]]
    limit: asyncio.Semaphore | None
    id_prefix: str
    bar: tqdm
    sent: int = 0

    async def send(self, model: str, prompt, max_tokens: int, key: str | None, result: RequestResult) -> None:
        """Send one request once a slot is free (its wait is its client queue time)."""
        result.arrival = time.perf_counter()
        index, self.sent = self.sent, self.sent + 1
        async with self.limit if self.limit is not None else contextlib.nullcontext():
            await self.client.send(model, prompt, max_tokens, key, result, f"{self.id_prefix}{index}")


async def run_conversation(run: Run, conv: Conversation, results: list[RequestResult]) -> None:
    """Send the conversation's turns one after another, each with the history so far; after a failed turn the
    rest are not sent and count as failed."""
    tenant, key = run.keys[conv.tenant] if conv.tenant >= 0 else ("-", None)
    messages: list[dict[str, str]] = [{"role": "system", "content": conv.system}] if conv.system else []
    failed = False
    for user, words, max_tokens in zip(conv.user, conv.words, conv.max_tokens, strict=True):
        result = RequestResult(conv.adapter, tenant, prompt_tokens=words)
        results.append(result)
        if failed:
            result.error = "not sent: an earlier turn of its conversation failed"
        else:
            messages.append({"role": "user", "content": user})
            await run.send(conv.adapter, messages if run.client.chat else user, max_tokens, key, result)
            messages.append({"role": "assistant", "content": result.text})
            failed = not result.success
        run.bar.update(1)


def arrivals(
    trace: list[Conversation], rate: float, args: argparse.Namespace, seed: int
) -> tuple[list[float], list[float] | None]:
    """Each conversation's start offset: at ``rate`` (a gamma process of shape --burstiness), or along
    --ramp-up-strategy (then also each one's rate)."""
    rng = random.Random(seed)
    if args.ramp_up_strategy is None:
        return arrival_times(len(trace), rate, args.burstiness, rng), None
    rates = ramp_rates(len(trace), args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps)
    return varying_arrival_times(rates, args.burstiness, rng), rates


async def benchmark(
    run: Run,
    trace: list[Conversation],
    starts: list[float],
    probe_rate: float = 0.0,
    rates: list[float] | None = None,
) -> tuple[list[RequestResult], float, list[RequestResult], list[dict[str, Any]]]:
    """Run the trace: conversation i starts at ``starts[i]``. Returns every request's result (in the order they
    were sent), the run's duration in seconds (from the start, before the first arrival, to the last answer:
    vLLM's), the probes' results (one-token requests every 1 / ``probe_rate`` seconds beside the trace, outside
    the slot limit), and, for a ramp (``rates``: each arrival's), vLLM's rps_change_events: each whole rate it
    reached, with when."""
    results: list[RequestResult] = []
    probes: list[RequestResult] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            result = RequestResult("-", "-")
            probes.append(result)
            model = trace[0].adapter
            key = run.keys[0][1] if run.keys else None
            prompt = [{"role": "user", "content": PROBE_PROMPT}] if run.client.chat else PROBE_PROMPT
            await run.client.send(model, prompt, 1, key, result)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 1 / probe_rate)

    prober = asyncio.create_task(probe()) if probe_rate > 0 else None
    events: list[dict[str, Any]] = []
    begin = time.perf_counter()
    tasks = []
    for i, (conv, at) in enumerate(zip(trace, starts, strict=True)):
        delay = begin + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if rates is not None and (not events or int(rates[i]) > events[-1]["rps"]):
            now = datetime.now().isoformat()
            first = events[-1]["rps"] + 1 if events else int(rates[i])
            events += [{"rps": rps, "timestamp": now} for rps in range(first, int(rates[i]) + 1)]
        tasks.append(asyncio.create_task(run_conversation(run, conv, results)))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - begin
    done.set()
    if prober is not None:
        await prober
    run.bar.close()
    return results, duration, probes, events


async def first_model(http: httpx.AsyncClient, base: str, headers: dict[str, str]) -> str:
    """The first model the server lists at /v1/models."""
    resp = await http.get(base + "/v1/models", headers=headers)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def load_tokenizer(args: argparse.Namespace):
    """--tokenizer as a `tokenizers.Tokenizer` (a local directory with tokenizer.json, or the file), or None."""
    if args.tokenizer is None or args.skip_tokenizer_init:
        return None
    from tokenizers import Tokenizer

    path = Path(args.tokenizer)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"--tokenizer {args.tokenizer}: no tokenizer.json there (only local files are read)")
    return Tokenizer.from_file(str(file))


def fit_to_tokens(tokenizer, conv: Conversation) -> Conversation:
    """The conversation's user texts cut to their target lengths in the tokenizer's tokens (vLLM's random prompts
    are exact in the model's tokens)."""
    texts = []
    for text, n in zip(conv.user, conv.words, strict=True):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        texts.append(tokenizer.decode(ids[:n]) if len(ids) > n else text)
    return dataclasses.replace(conv, user=tuple(texts))


def make_conversations(args: argparse.Namespace, seed: int, adapters: list[str], num_tenants: int, tokenizer):
    """The trace of --dataset-name, drawn from ``seed``."""
    name = args.dataset_name
    if name == "custom":
        prompts = custom_trace(
            args.dataset_path,
            args.num_prompts,
            args.custom_output_len,
            not args.disable_shuffle,
            not args.no_oversample,
            seed,
        )
        return single_turns(prompts, adapters, args.lora_assignment, num_tenants, seed)
    if name == "prefix_repetition":
        prompts = prefix_repetition_trace(
            args.num_prompts,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
            seed,
        )
        return single_turns(prompts, adapters, args.lora_assignment, num_tenants, seed)
    multi = name == "multi-turn"
    spec = TraceSpec(
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        0 if multi else args.random_prefix_len,
        args.turns if multi else 1,
        args.system_prompt_len if multi else 0,
        seed,
    )
    trace = make_trace(spec, adapters, args.lora_assignment, num_tenants)
    return trace if tokenizer is None or multi else [fit_to_tokens(tokenizer, c) for c in trace]


async def prepare_server(run: Run, conv: Conversation, args: argparse.Namespace) -> None:
    """vLLM's ready check (the first request sent until it succeeds, for --ready-check-timeout-sec) and
    --num-warmups requests of it, none of them counted. ValueError when the server never answers it."""
    key = run.keys[conv.tenant][1] if conv.tenant >= 0 else None
    prompt = [{"role": "user", "content": conv.user[0]}] if run.client.chat else conv.user[0]
    deadline = time.monotonic() + args.ready_check_timeout_sec
    while args.ready_check_timeout_sec > 0:
        test = RequestResult(conv.adapter, "-")
        await run.client.send(conv.adapter, prompt, conv.max_tokens[0], key, test)
        if test.success:
            break
        if time.monotonic() > deadline:
            raise ValueError(f"the server did not answer the first request in time: {test.error}")
        await asyncio.sleep(1)
    if args.num_warmups:
        warm = [RequestResult(conv.adapter, "-") for _ in range(args.num_warmups)]
        await asyncio.gather(*(run.send(conv.adapter, prompt, conv.max_tokens[0], key, w) for w in warm))
        run.sent = 0


async def run_all(args: argparse.Namespace, rates: list[float]) -> list[dict[str, Any]]:
    """One result (vLLM's fields, the breakdowns, the settings) per rate, printed as they finish."""
    check_args(args)
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    chat = args.backend == "openai-chat" or (
        args.backend is None and args.endpoint.rstrip("/").endswith("chat/completions")
    )
    backend = args.backend or ("openai-chat" if chat else "openai")
    if args.dataset_name == "multi-turn" and not chat:
        raise ValueError("--dataset-name multi-turn sends messages: use --endpoint /v1/chat/completions")
    if args.dataset_name == "custom" and not chat and not args.skip_chat_template:
        raise ValueError(
            "the custom dataset's prompts go to a completions endpoint as they are only with --skip-chat-template "
            "(no chat template is rendered on the client): give it, or use --backend openai-chat"
        )
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if unknown := [m for m in metrics if m not in (*METRICS, *CLIENT_QUEUE_METRICS)]:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(unknown)}")
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    goodput = parse_goodput(args.goodput)
    keys = tenant_keys(args)
    headers = _pairs(args.header, "--header")
    sampling = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    ignore_eos = args.ignore_eos or args.dataset_name == "random"
    body = {**sampling, **({"ignore_eos": True} if ignore_eos else {}), **(args.extra_body or {})}
    tokenizer = load_tokenizer(args)
    count = None if tokenizer is None else (lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids))
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    timeout = httpx.Timeout(TIMEOUT_S, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, verify=not args.insecure) as http:
        model = args.served_model_name or args.model or await first_model(http, base, {**headers, **_auth(keys)})
        client = Client(http, base + args.endpoint, chat, headers, body, args.logprobs, count)
        out = []
        for i, rate in enumerate(rates):
            # each rate its own prompts (seed + i): a repeated trace would be served from the previous run's cache
            trace = make_conversations(args, args.seed + i, args.lora_modules or [model], len(keys), tokenizer)
            limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
            bar = tqdm(total=sum(len(c.user) for c in trace), disable=args.disable_tqdm, file=sys.stderr)
            run = Run(client, keys, limit, args.request_id_prefix, bar)
            await prepare_server(run, trace[0], args)
            starts, ramp = arrivals(trace, rate, args, args.seed + i)
            results, duration, probes, rps_events = await benchmark(run, trace, starts, args.probe_request_rate, ramp)
            chosen = [m for m in metrics if m in METRICS]
            if args.max_concurrency is not None:  # vLLM reports the client queue only then
                chosen += [m for m in metrics if m == CLIENT_QUEUE_METRICS[0]]
                if math.isfinite(rate) or args.ramp_up_strategy is not None:
                    chosen += [m for m in metrics if m == CLIENT_QUEUE_METRICS[1]]
            settings = {
                "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
                "endpoint_type": backend,  # vLLM's name for the backend, kept beside it
                "backend": backend,
                "label": args.label or backend,
                "model_id": model,
                "tokenizer_id": None if tokenizer is None else args.tokenizer,
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
                **_ramp(args),
                **_pairs(args.metadata, "--metadata"),
            }
            summary = summarize(results, duration, chosen, percentiles, goodput)
            result = {
                **settings,
                **summary,
                **per_request(results),
                **_probe_figures(probes),
                **({"rps_change_events": rps_events} if args.ramp_up_strategy else {}),
                "per_adapter": breakdown(results, "adapter", duration, chosen, percentiles),
                "per_tenant": breakdown(results, "tenant", duration, chosen, percentiles),
                "error_counts": _error_counts(results),
            }
            if args.save_detailed:
                result.update(detailed(results))
            print(format_summary(summary, chosen, percentiles, settings))
            print(format_breakdown("adapter", result["per_adapter"], chosen))
            if keys:
                print(format_breakdown("tenant", result["per_tenant"], chosen))
            for error, n in result["error_counts"].items():
                print(f"{n} x {error}")
            out.append(result)
    return out


def _ramp(args: argparse.Namespace) -> dict[str, Any]:
    if args.ramp_up_strategy is None:
        return {}
    return {
        "ramp_up_strategy": args.ramp_up_strategy,
        "ramp_up_start_rps": args.ramp_up_start_rps,
        "ramp_up_end_rps": args.ramp_up_end_rps,
    }


def _probe_figures(probes: list[RequestResult]) -> dict[str, Any]:
    """vLLM's probe_* figures (only when probes were sent and some succeeded)."""
    latencies = [p.latency for p in probes if p.success]
    if not latencies:
        return {}
    return {
        "probe_completed": len(latencies),
        "probe_failed": len(probes) - len(latencies),
        "probe_median_e2el_ms": float(np.median(latencies)) * 1000,
        "probe_p99_e2el_ms": float(np.percentile(latencies, 99)) * 1000,
        "probe_max_e2el_ms": float(max(latencies)) * 1000,
    }


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
    try:
        results = asyncio.run(run_all(args, rates))
    except (ValueError, OSError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.save_result or args.append_result:
        for result in results:
            path = result_path(args, result, len(results) > 1)
            path.parent.mkdir(parents=True, exist_ok=True)
            if args.append_result and path.is_file() and path.stat().st_size:
                with path.open("a") as file:  # vLLM's: one JSON document a line
                    file.write("\n" + json.dumps(result))
            else:
                path.write_text(json.dumps(result, indent=None if args.append_result else 1))
            print(f"saved {path}")
    if args.plot_rates:
        path = Path(args.plot_file or Path(args.result_dir or ".") / "bench-serve.png")
        plot(results, path)
        print(f"plotted {path}")
    return 0
