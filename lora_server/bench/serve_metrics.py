"""The figures of ``lora-server bench serve``: each request's timings as the client saw them, and the summary under
vLLM's result names (``vllm bench serve``), whole and broken down per adapter and per tenant.

Definitions (vLLM's): TTFT is from sending the request to the first chunk with content; ITL the gaps between
content chunks; TPOT (E2EL - TTFT) / (output tokens - 1) over requests with more than one output token; E2EL from
sending to the end of the stream. Token counts are the server's (``usage`` of the stream's last chunk)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
# vLLM's, reported with --max-concurrency (the second with a finite rate too): the wait for a slot, and E2EL with it
CLIENT_QUEUE_METRICS = ("client_queue_time", "e2el_including_client_queue")
TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
    "client_queue_time": ("Client Queue Time", "Client-side Queueing"),
    "e2el_including_client_queue": ("E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency"),
}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """One request as the client saw it. ``success``: the stream ended with content and no error (a request that
    yields no content has failed). Times in seconds, ``start`` on the benchmark's perf_counter clock."""

    adapter: str
    tenant: str
    start: float = 0.0
    arrival: float | None = None  # when it was due: start - arrival is its wait for a slot (--max-concurrency)
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0  # usage.prompt_tokens, else the words sent
    output_tokens: int = 0  # usage.completion_tokens, else the content chunks received
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    usage_reported: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL
    text: str = ""

    @property
    def tpot(self) -> float:
        """0 for one output token (vLLM's convention for goodput)."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    @property
    def queue_time(self) -> float:
        """vLLM's client_queue_time: from when it was due to when it was sent."""
        return 0.0 if self.arrival is None else self.start - self.arrival


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "e2el:3000"]`` -> SLOs in ms; ValueError says what is wrong."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput takes KEY:VALUE with KEY one of {', '.join(GOODPUT_METRICS)}, got {pair!r}")
        slos[name] = float(value)
        if slos[name] < 0:
            raise ValueError(f"--goodput {name} must be at least 0 ms, got {value}")
    return slos


def _word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def summarize(
    results: list[RequestResult],
    duration: float,
    metrics: list[str],
    percentiles: list[float],
    goodput: dict[str, float],
) -> dict[str, Any]:
    """vLLM's result fields for ``results`` over ``duration`` seconds: completed, failed, token totals, throughputs,
    goodput (None without SLOs), and mean/median/std/pXX (ms) of each chosen metric; plus the cached tokens and
    their share of the input (ours)."""
    ok = [r for r in results if r.success]
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
        "client_queue_time": [r.queue_time for r in ok],
        "e2el_including_client_queue": [r.latency + r.queue_time for r in ok],
    }
    good = sum(all(getattr(r, "latency" if m == "e2el" else m) * 1000 <= slo for m, slo in goodput.items()) for r in ok)
    total_in, total_out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "cached_tokens": cached,
        "cached_token_share": cached / total_in if total_in else 0.0,
        "usage_missing": sum(not r.usage_reported for r in ok),
        **peaks(ok),
        "rtfx": 0.0,  # vLLM's audio figure (input audio seconds per second): no audio here
    }
    for m in metrics:
        data = np.asarray(values[m] or [0.0]) * 1000  # ms; all zero when nothing completed, as vLLM reports
        out[f"mean_{m}_ms"] = float(np.mean(data))
        out[f"median_{m}_ms"] = float(np.median(data))
        out[f"std_{m}_ms"] = float(np.std(data))
        for p in percentiles:
            out[f"p{_word(p)}_{m}_ms"] = float(np.percentile(data, p))
    return out


def peaks(ok: list[RequestResult]) -> dict[str, Any]:
    """vLLM's peak figures of the successful requests: ``max_output_tokens_per_s``, the most output tokens that
    arrived within one second (seconds counted from the first start; a token arrives at start + ttft + the ITLs
    before it), and ``max_concurrent_requests``, the most requests in flight at once (half-open [start, end))."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    first = min(r.start for r in ok)
    seconds = np.zeros(int(np.ceil(max(r.start + r.latency for r in ok) - first)) + 1)
    for r in ok:
        for t in np.cumsum([r.start + r.ttft, *r.itl]):
            if 0 <= int(t - first) < len(seconds):
                seconds[int(t - first)] += 1
    events = sorted([(r.start, 1) for r in ok] + [(r.start + r.latency, -1) for r in ok])
    running, most = 0, 0
    for _, step in events:
        running += step
        most = max(most, running)
    return {"max_output_tokens_per_s": float(seconds.max()), "max_concurrent_requests": most}


def breakdown(
    results: list[RequestResult], key: str, duration: float, metrics: list[str], percentiles: list[float]
) -> dict[str, dict[str, Any]]:
    """The summary of each group of results with the same ``key`` attribute (adapter or tenant), over the whole
    run's duration."""
    groups: dict[str, list[RequestResult]] = {}
    for r in results:
        groups.setdefault(getattr(r, key), []).append(r)
    return {name: summarize(rs, duration, metrics, percentiles, {}) for name, rs in sorted(groups.items())}


def per_request(results: list[RequestResult]) -> dict[str, list[Any]]:
    """vLLM's per-request lists that every result carries: ``latencies`` (E2EL) and ``queue_times`` (the wait for
    a slot), in seconds."""
    return {"latencies": [r.latency for r in results], "queue_times": [r.queue_time for r in results]}


def detailed(results: list[RequestResult]) -> dict[str, list[Any]]:
    """vLLM's per-request lists of --save-detailed, plus cached tokens, adapters and tenants."""
    return {
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "start_times": [r.start for r in results],
        "cached_lens": [r.cached_tokens for r in results],
        "generated_texts": [r.text for r in results],
        "errors": [r.error for r in results],
        "adapters": [r.adapter for r in results],
        "tenants": [r.tenant for r in results],
    }


def format_summary(s: dict[str, Any], metrics: list[str], percentiles: list[float], settings: dict[str, Any]) -> str:
    """The table vLLM prints, plus the cached-token line."""
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:{fmt}}")

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    if settings.get("max_concurrency") is not None:
        row("Maximum request concurrency:", settings["max_concurrency"])
    if settings.get("request_rate") not in (None, "inf"):
        row("Request rate configured (RPS):", settings["request_rate"], ".2f")
    row("Benchmark duration (s):", s["duration"], ".2f")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Cached input tokens:", f"{s['cached_tokens']} ({100 * s['cached_token_share']:.1f}%)")
    row("Request throughput (req/s):", s["request_throughput"], ".2f")
    if s["request_goodput"] is not None:
        row("Request goodput (req/s):", s["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", s["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", s["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", s["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", s["total_token_throughput"], ".2f")
    for m in metrics:
        short, title = TITLES[m]
        lines.append(f"{title:-^50}")
        row(f"Mean {short} (ms):", s[f"mean_{m}_ms"], ".2f")
        row(f"Median {short} (ms):", s[f"median_{m}_ms"], ".2f")
        for p in percentiles:
            row(f"P{_word(p)} {short} (ms):", s[f"p{_word(p)}_{m}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


def format_breakdown(title: str, groups: dict[str, dict[str, Any]], metrics: list[str]) -> str:
    """One line per group: requests, tokens, cached share and the mean of each metric."""
    head = f"{title:<20} {'ok':>5} {'failed':>6} {'out tok':>8} {'cached':>7}" + "".join(
        f" {'mean ' + TITLES[m][0] + ' ms':>15}" for m in metrics
    )
    lines = [head]
    for name, s in groups.items():
        lines.append(
            f"{name[:20]:<20} {s['completed']:>5} {s['failed']:>6} {s['total_output_tokens']:>8} "
            f"{100 * s['cached_token_share']:>6.1f}%" + "".join(f" {s[f'mean_{m}_ms']:>15.2f}" for m in metrics)
        )
    return "\n".join(lines)
