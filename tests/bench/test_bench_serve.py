"""``lora-server bench serve``: its arrival process against the gamma distribution's own moments, its prompts against
the real tokenizer, its figures against hand-computed values, its client against hand-written SSE streams, and a
whole run against our real server, whose /metrics counters and per-tenant usage (admin API) are the reference."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import random
import re
import statistics
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lora_server.bench.serve import Client, plot, tenant_keys
from lora_server.bench.serve_data import (
    TraceSpec,
    arrival_times,
    custom_trace,
    make_trace,
    prefix_repetition_trace,
    ramp_rates,
    sample_len,
)
from lora_server.bench.serve_metrics import RequestResult, parse_goodput, peaks, summarize
from lora_server.cli import main, main_parser
from tests.servers import Server

# --- the trace -------------------------------------------------------------------------------------------------


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *times], times, strict=False)]


def test_arrivals_are_a_gamma_process_with_the_asked_rate():
    n, rate = 20000, 5.0
    poisson = arrival_times(n, rate, 1.0, random.Random(1))
    assert poisson[-1] == pytest.approx(n / rate) and poisson == sorted(poisson)
    gaps = _gaps(poisson)
    assert statistics.mean(gaps) == pytest.approx(1 / rate)
    # exponential gaps: coefficient of variation 1, P(gap < mean) = 1 - 1/e
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.04)
    assert sum(g < 1 / rate for g in gaps) / n == pytest.approx(1 - math.exp(-1), abs=0.02)
    # gamma with shape k: coefficient of variation 1 / sqrt(k)
    for k in (0.25, 4.0):
        gaps = _gaps(arrival_times(n, rate, k, random.Random(2)))
        assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1 / math.sqrt(k), rel=0.05)
    assert arrival_times(4, math.inf, 1.0, random.Random(0)) == [0.0] * 4
    assert arrival_times(4, 2.0, math.inf, random.Random(0)) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    with pytest.raises(ValueError):
        arrival_times(4, 2.0, 0.0, random.Random(0))


@pytest.fixture(scope="module")
def tok(smollm2_path):
    """The embedded model's tokenizer: what our server counts prompts with."""
    from lora_server.engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_path)


def test_prompts_have_the_asked_lengths_in_real_tokens(tok):
    spec = TraceSpec(30, 40, 8, 0.5, prefix_len=5, seed=3)
    trace = make_trace(spec, ["a", "b", "c"], "round-robin", 2)
    assert [c.adapter for c in trace[:4]] == ["a", "b", "c", "a"] and [c.tenant for c in trace[:3]] == [0, 1, 0]
    for conv in trace:
        (text,), (words,), (out,) = conv.user, conv.words, conv.max_tokens
        assert len(tok.encode(text, add_special_tokens=False)) == words + 5  # the shared prefix's 5 words too
        assert 20 <= words <= 60 and 4 <= out <= 12 and conv.system is None
    assert len({c.user for c in trace}) == 30  # each prompt its own, after the same 5 words
    assert len({tuple(c.user[0].split()[:5]) for c in trace}) == 1
    assert make_trace(spec, ["a", "b", "c"], "round-robin", 2) == trace  # the seed fixes the trace
    rng = random.Random(0)
    assert {sample_len(rng, 10, 0.0) for _ in range(50)} == {10}


def test_multi_turn_conversations_share_their_adapters_system_prompt(tok):
    trace = make_trace(TraceSpec(12, 10, 4, 0.0, turns=3, system_len=24, seed=0), ["x", "y"], "random", 0)
    systems: dict[str, set] = {}
    for conv in trace:
        systems.setdefault(conv.adapter, set()).add(conv.system)
        assert len(conv.user) == 3 and conv.words == (10, 10, 10) and conv.tenant == -1
        assert len(tok.encode(conv.system, add_special_tokens=False)) == 24
    assert {len(s) for s in systems.values()} == {1} and len(set.union(*systems.values())) == 2


def test_prefix_repetition_and_custom_datasets(tmp_path):
    prompts = prefix_repetition_trace(12, 5, 3, 4, 7, seed=1)
    assert len(prompts) == 12 and {out for _, out in prompts} == {7}
    prefixes = [tuple(p.split()[:5]) for p, _ in prompts]
    assert len(set(prefixes)) == 4 and all(prefixes.count(x) == 3 for x in set(prefixes))
    assert all(len(p.split()) == 8 for p, _ in prompts) and len({p for p, _ in prompts}) == 12
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"p{i}", "extra": 1}) for i in range(5)) + "\n\n")
    assert custom_trace(str(path), 3, 9, shuffle=False, oversample=True, seed=0) == [("p0", 9), ("p1", 9), ("p2", 9)]
    shuffled = [p for p, _ in custom_trace(str(path), 5, 9, shuffle=True, oversample=True, seed=0)]
    assert sorted(shuffled) == [f"p{i}" for i in range(5)]
    assert len(custom_trace(str(path), 8, 9, shuffle=False, oversample=True, seed=0)) == 8  # drawn again to fill up
    assert len(custom_trace(str(path), 8, 9, shuffle=False, oversample=False, seed=0)) == 5
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="prompt"):
        custom_trace(str(path), 1, 9, shuffle=False, oversample=True, seed=0)
    assert ramp_rates(3, "linear", 2, 6) == [2, 4, 6] and ramp_rates(3, "exponential", 1, 9) == [1, 3, 9]


# --- the figures -------------------------------------------------------------------------------------------------


def _result(ttft: float, itl: list[float], out: int, ok: bool = True, adapter: str = "a") -> RequestResult:
    return RequestResult(
        adapter, "-", success=ok, prompt_tokens=10, output_tokens=out, cached_tokens=4, usage_reported=True,
        ttft=ttft, itl=itl, latency=ttft + sum(itl),
    )  # fmt: skip


def test_summary_matches_hand_computed_figures():
    results = [
        _result(0.1, [0.1, 0.1, 0.1], 4),  # e2el 0.4, tpot 0.1
        _result(0.3, [0.2, 0.2, 0.2], 4),  # e2el 0.9, tpot 0.2
        _result(0.2, [], 1),  # e2el 0.2, no tpot (one token)
        _result(0.0, [], 0, ok=False),
    ]
    s = summarize(results, 2.0, ["ttft", "tpot", "itl", "e2el"], [50, 100], {"ttft": 250, "e2el": 500})
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (3, 1, 30, 9)
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 4.5 and s["total_token_throughput"] == 19.5
    assert s["cached_tokens"] == 12 and s["cached_token_share"] == pytest.approx(0.4)
    assert s["request_goodput"] == 1.0  # ttft <= 250 ms and e2el <= 500 ms: the first and the third
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_ttft_ms"] == pytest.approx(200)
    assert s["p100_ttft_ms"] == pytest.approx(300) and s["p50_ttft_ms"] == pytest.approx(200)
    assert s["mean_tpot_ms"] == pytest.approx(150) and s["p100_tpot_ms"] == pytest.approx(200)
    assert s["mean_itl_ms"] == pytest.approx(150) and s["median_itl_ms"] == pytest.approx(150)
    assert s["mean_e2el_ms"] == pytest.approx(500) and s["median_e2el_ms"] == pytest.approx(400)
    assert s["std_ttft_ms"] == pytest.approx(statistics.pstdev([100, 300, 200]))
    none = summarize([_result(0, [], 0, ok=False)], 1.0, ["ttft"], [99], {})
    assert (none["completed"], none["mean_ttft_ms"], none["request_goodput"]) == (0, 0.0, None)
    assert parse_goodput(["ttft:5", "tpot:2.5"]) == {"ttft": 5.0, "tpot": 2.5}
    for bad in (["ttft"], ["itl:3"], ["e2el:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_peak_figures_match_hand_computed_ones():
    """Tokens arrive at start + ttft + the gaps before them; seconds count from the first start."""
    a = RequestResult(
        "a", "-", start=10.0, ttft=0.2, itl=[0.3, 0.3, 0.9], latency=1.7, success=True
    )  # 10.2 10.5 10.8 11.7
    b = RequestResult("a", "-", start=10.5, ttft=0.1, itl=[0.1], latency=0.5, success=True)  # 10.6 10.7; ends 11.0
    c = RequestResult("a", "-", start=11.0, ttft=0.5, itl=[], latency=0.5, success=True)  # 11.5; starts as b ends
    assert peaks([a, b, c]) == {"max_output_tokens_per_s": 5.0, "max_concurrent_requests": 2}
    assert peaks([]) == {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}


# --- the client, on hand-written streams --------------------------------------------------------------------------


def _sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _send(stream: bytes, status: int = 200, chat: bool = True) -> tuple[RequestResult, dict]:
    seen: dict = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content), auth=request.headers.get("authorization"))
        return httpx.Response(status, content=stream, headers={"content-type": "text/event-stream"})

    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            result = RequestResult("a", "t")
            await Client(http, "http://x/v1/chat/completions", chat, {}, {"ignore_eos": True}).send(
                "a", [{"role": "user", "content": "hi"}] if chat else "hi", 5, "k1", result
            )
            return result

    return asyncio.run(go()), seen


def test_client_reads_streams_usage_and_failures():
    usage = {"prompt_tokens": 7, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 3}}
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    ok, body = _send(
        _sse(role, *[{"choices": [{"index": 0, "delta": {"content": t}}]} for t in ("Hel", "lo")],
             {"choices": [], "usage": usage}, "[DONE]")
    )  # fmt: skip
    assert ok.success and ok.text == "Hello" and len(ok.itl) == 1 and 0 <= ok.ttft <= ok.latency
    assert (ok.prompt_tokens, ok.output_tokens, ok.cached_tokens) == (7, 2, 3)
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["max_completion_tokens"] == 5
    assert body["ignore_eos"] and body["auth"] == "Bearer k1"
    # a stream that yields no content has failed, even with usage
    empty, _ = _send(_sse(role, {"choices": [], "usage": {**usage, "completion_tokens": 1}}, "[DONE]"))
    assert not empty.success and "no content" in empty.error
    err, _ = _send(_sse({"error": {"message": "boom", "type": "server_error"}}, "[DONE]"))
    assert not err.success and "boom" in err.error
    bad, _ = _send(json.dumps({"error": {"message": "The model `zz` does not exist."}}).encode(), status=404)
    assert not bad.success and bad.error == "HTTP 404: The model `zz` does not exist."
    # completions; without usage the content chunks are counted
    text, body = _send(_sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}, "[DONE]"), chat=False)
    assert text.success and text.output_tokens == 2 and not text.usage_reported and body["max_tokens"] == 5


def test_cli_has_bench_serve_and_keeps_the_old_benchmarks(capsys, monkeypatch):
    args = main_parser().parse_args(["bench", "serve", "--lora-modules", "a", "b", "--request-rate", "4"])
    assert (args.lora_modules, args.request_rate, args.burstiness, args.num_prompts) == (["a", "b"], 4.0, 1.0, 1000)
    assert main_parser().parse_args(["bench-pool", "--quick"]).quick
    assert main_parser().parse_args(["bench", "engine", "--quick"]).quick
    # every flag says what it does and its default (test_server's rule for the other commands)
    bench = main_parser()._subparsers._group_actions[0].choices["bench"]
    serve = bench._subparsers._group_actions[0].choices["serve"]
    for action in serve._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, action.option_strings
            if action.default not in (None, False):
                assert "default" in action.help, action.option_strings
    given = main_parser().parse_args(
        ["bench", "serve", "--api-key", "k1", "--api-key", "b=k2", "--tenant-keys", "c=k3,k4=="]
    )
    assert tenant_keys(given) == [("key1", "k1"), ("b", "k2"), ("c", "k3"), ("key4", "k4==")]
    # bad flags fail before any request is sent (nothing listens on port 9)
    assert main(["bench", "serve", "--port", "9", "--goodput", "itl:5"]) == 2
    assert main(["bench", "serve", "--port", "9", "--dataset-name", "multi-turn"]) == 2
    assert "chat/completions" in capsys.readouterr().err
    # --plot-rates says what it misses before it sends anything
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a)
    )
    assert main(["bench", "serve", "--port", "9", "--plot-rates", "1,2"]) == 2
    assert "matplotlib" in capsys.readouterr().err


def test_plot_draws_a_png(tmp_path):
    runs = [
        {"request_rate": rate, "output_throughput": tput, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft,
         "median_e2el_ms": 10 * ttft, "p99_e2el_ms": 20 * ttft, "model_id": "m", "base_url": "http://x"}
        for rate, tput, ttft in ((0.5, 4.0, 100.0), (1.0, 7.0, 300.0), ("inf", 9.0, 2000.0))
    ]  # fmt: skip
    plot(runs, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- parity with vllm bench serve: docs/bench-serve.md's tables --------------------------------------------------

README = Path(__file__).resolve().parents[2] / "docs" / "bench-serve.md"


def readme_table(header: str) -> list[list[str]]:
    """The rows (cells) of the docs/bench-serve.md table whose header line is ``header``."""
    lines = README.read_text().splitlines()
    start = lines.index(header) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def serve_parser():
    bench = main_parser()._subparsers._group_actions[0].choices["bench"]
    return bench._subparsers._group_actions[0].choices["serve"]


def test_every_vllm_flag_is_known_as_the_readme_says(capsys):
    table = {row[0].strip("`"): row[1] for row in readme_table("| flag | status | note |")}
    assert set(table.values()) == {"supported", "no effect", "refused", "ours"}
    options = {o for a in serve_parser()._actions for o in a.option_strings} - {"-h", "--help"}
    assert set(table) == options  # docs/bench-serve.md lists exactly the parser's flags
    for flag, status in table.items():
        if status == "refused":
            with pytest.raises(SystemExit):
                main_parser().parse_args(["bench", "serve", flag, "1"])
            assert f"{flag} (vllm bench serve's) is not supported" in capsys.readouterr().err
        elif status == "no effect":
            assert getattr(main_parser().parse_args(["bench", "serve", flag]), flag[2:].replace("-", "_"))
    for backend in ("vllm", "openai", "openai-chat"):
        assert main_parser().parse_args(["bench", "serve", "--backend", backend]).backend == backend
    assert main(["bench", "serve", "--port", "9", "--backend", "tgi"]) == 2
    assert main(["bench", "serve", "--port", "9", "--dataset-name", "sharegpt"]) == 2
    assert "not offered" in capsys.readouterr().err
    assert main(["bench", "serve", "--port", "9", "--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1"]) == 2


def expected_keys(percentiles: list[str]) -> tuple[set[str], set[str]]:
    """docs/bench-serve.md's result keys: (those written in a run with every option on, those never written here)."""
    written, never = set(), set()
    for keys, when in readme_table("| keys | when |"):
        if ": each as" in keys:
            stems, templates = keys.split(": each as")
            names = {
                t.replace("X", stem).replace("NN", p)
                for stem in re.findall(r"`(\w+)`", stems)
                for t in re.findall(r"`(\w+)`", templates)
                for p in (percentiles if "NN" in t else [""])
            }
        else:
            names = set(re.findall(r"`(\w+)`", keys))
        (never if when.startswith("never") else written).update(names)
    return written, never


@pytest.mark.slow
def test_a_run_writes_every_key_of_vllms_result(server, tmp_path, smollm2_path):
    """Every option that adds keys, against our server: the JSON holds every key docs/bench-serve.md lists (and
    none of those it says are never written); the warm-up and the ready check are sent but not counted; requests carry
    their x-request-id; prompts are exact in the exported tokenizer's tokens."""
    from lora_server.engine.tokenizer import Tokenizer

    Tokenizer.from_gguf(smollm2_path).save_pretrained(tmp_path / "tok", 8192)
    before = counters(server)
    r = bench(
        server, tmp_path, "--num-prompts", "6", "--input-len", "8", "--output-len", "3", "--max-concurrency", "2",
        "--ramp-up-strategy", "linear", "--ramp-up-start-rps", "2", "--ramp-up-end-rps", "6",
        "--probe-request-rate", "2", "--goodput", "e2el:3600000", "--num-warmups", "1",
        "--ready-check-timeout-sec", "60", "--tokenizer", str(tmp_path / "tok"), "--logprobs", "1",
        "--request-id-prefix", "parity-", "--metadata", "run=parity", "--metric-percentiles", "50,99",
        "--lora-modules", "upper", "pirate", "--backend", "vllm",
    )  # fmt: skip
    after = counters(server)
    written, never = expected_keys(["50", "99"])
    assert written - set(r) == set() and never & set(r) == set()
    assert r["endpoint_type"] == r["backend"] == "vllm" and r["tokenizer_id"] == str(tmp_path / "tok")
    assert r["completed"] == 6 and r["input_lens"] == [8] * 6 and r["run"] == "parity"
    assert len(r["latencies"]) == len(r["queue_times"]) == 6 and min(r["queue_times"]) >= 0
    assert 1 <= r["max_concurrent_requests"] <= 2 and r["max_output_tokens_per_s"] >= 1
    assert [e["rps"] for e in r["rps_change_events"]] == [2, 3, 4, 5, 6]
    # the server answered the trace, the probes, one warm-up and the ready check's request
    served = after["vllm:request_success_total"] - before["vllm:request_success_total"]
    assert served == 6 + r["probe_completed"] + 1 + 1
    time.sleep(0.5)
    assert all(f"[parity-{i}]" in server.log_text() for i in range(6))


# --- a real server ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("bench-serve"), [], ["--allow-anonymous"])
    yield s
    s.stop()


def counters(server: Server) -> dict[str, float]:
    """The server's counters once it is idle (its engine snapshot is republished every ~0.1 s)."""
    deadline = time.monotonic() + 30
    while True:
        page = httpx.get(server.url + "/metrics", timeout=10).text
        values = {s.name: s.value for f in text_string_to_metric_families(page) for s in f.samples}
        idle = values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            time.sleep(0.3)
            page = httpx.get(server.url + "/metrics", timeout=10).text
            return {s.name: s.value for f in text_string_to_metric_families(page) for s in f.samples}
        time.sleep(0.2)


def bench(server: Server, tmp_path, *flags: str) -> dict:
    out = tmp_path / f"result-{time.monotonic_ns()}.json"
    argv = ["bench", "serve", "--base-url", server.url, "--disable-tqdm", "--save-result", "--save-detailed"]
    assert main([*argv, "--result-filename", str(out), *flags]) == 0
    return json.loads(out.read_text())


def check_orderings(r: dict, percentiles: list[str]) -> None:
    ok = [i for i, e in enumerate(r["errors"]) if not e]
    for i in ok:
        assert 0 < r["ttfts"][i] <= r["latencies"][i] and sum(r["itls"][i]) <= r["latencies"][i] - r["ttfts"][i] + 1e-6
    for m in ("ttft", "tpot", "itl", "e2el"):
        values = [r[f"p{p}_{m}_ms"] for p in percentiles]
        assert values == sorted(values) and r[f"median_{m}_ms"] == pytest.approx(r[f"p50_{m}_ms"])
    for p in percentiles:  # ttft <= e2el for every request, so for every order statistic too
        assert r[f"p{p}_ttft_ms"] <= r[f"p{p}_e2el_ms"]


@pytest.mark.slow
def test_random_trace_against_the_servers_own_counts(server, tmp_path):
    keys = {}
    for name in ("acme", "beta"):
        made = server.admin("POST", "/admin/tenants", json={"name": name, "adapters": ["upper", "pirate", "nope"]})
        keys[name] = made.json()["api_key"]
    before = counters(server)
    r = bench(
        server, tmp_path, "--num-prompts", "12", "--random-input-len", "16", "--random-output-len", "4",
        "--lora-modules", "upper", "pirate", "nope", "--lora-assignment", "round-robin",
        "--tenant-keys", ",".join(f"{n}={k}" for n, k in keys.items()),
        "--metric-percentiles", "25,50,90,99", "--goodput", "e2el:3600000",
    )  # fmt: skip
    after = counters(server)

    def delta(name: str) -> float:
        return after[name] - before[name]

    # the server counted what the benchmark reports; 8 requests to served adapters x 4 tokens (EOS ignored)
    assert r["completed"] == delta("vllm:request_success_total") == 8 and r["failed"] == 4
    assert r["total_output_tokens"] == delta("vllm:generation_tokens_total") == 32
    assert r["total_input_tokens"] == delta("vllm:prompt_tokens_total")
    assert [n for n, e in zip(r["input_lens"], r["errors"], strict=True) if not e] == [16] * 8  # 16 words, 16 tokens
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # an SLO of an hour: every request meets it
    # the unknown adapter's requests failed with the server's 404, and only they
    assert r["per_adapter"]["nope"]["failed"] == 4 and r["per_adapter"]["nope"]["completed"] == 0
    assert {a: r["per_adapter"][a]["completed"] for a in ("upper", "pirate")} == {"upper": 4, "pirate": 4}
    assert all("404" in e for e, a in zip(r["errors"], r["adapters"], strict=True) if a == "nope")
    # per tenant, against the usage the server metered for each tenant (settled off its event loop: polled)
    for name in keys:
        mine = r["per_tenant"][name]
        deadline = time.monotonic() + 10
        while True:
            usage = server.admin("GET", f"/admin/tenants/{name}").json()["usage"].values()
            metered = [sum(u[k] for u in usage) for k in ("requests", "prompt_tokens", "completion_tokens")]
            if metered[0] >= mine["completed"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert metered == [mine["completed"], mine["total_input_tokens"], mine["total_output_tokens"]]
        assert mine["completed"] + mine["failed"] == 6
    check_orderings(r, ["25", "50", "90", "99"])


@pytest.mark.slow
def test_multi_turn_at_a_poisson_rate_reports_the_prefix_cache(server, tmp_path):
    before = counters(server)
    r = bench(
        server, tmp_path, "--endpoint", "/v1/chat/completions", "--dataset-name", "multi-turn",
        "--num-prompts", "4", "--turns", "3", "--system-prompt-len", "40", "--random-input-len", "12",
        "--random-output-len", "3", "--lora-modules", "upper", "pirate", "--request-rate", "8",
        "--max-concurrency", "2", "--metric-percentiles", "50,99", "--seed", "11",
    )  # fmt: skip
    after = counters(server)
    assert r["completed"] == after["vllm:request_success_total"] - before["vllm:request_success_total"] == 12
    assert r["total_output_tokens"] == after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    # the cached tokens the server reported per request add up to its prefix-cache hits; later turns hit
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert r["cached_tokens"] == hits > 0 and r["cached_token_share"] == r["cached_tokens"] / r["total_input_tokens"]
    assert r["request_rate"] == 8.0 and r["max_concurrency"] == 2
    check_orderings(r, ["50", "99"])


# --- Zipf adapter popularity (--lora-assignment zipf) ------------------------------------------------------------


def test_zipf_assignment_follows_its_popularity_in_the_given_order(capsys):
    from collections import Counter

    from lora_server.bench.serve_data import assign
    from lora_server.bench.serve_flags import check_args

    names = [f"a{i}" for i in range(100)]
    n = 50_000
    counts = Counter(assign(random.Random(7), n, names, "zipf"))
    # alpha 1: p_i = (1 / i) / H_100 for the i-th name, H_100 = 5.18738 (by hand: 1 + 1/2 + ... + 1/100)
    assert counts["a0"] / n == pytest.approx(0.19277, abs=0.01)  # 1 / H_100
    assert counts["a1"] / n == pytest.approx(0.09639, abs=0.01)  # 1 / (2 H_100)
    assert counts["a99"] / n == pytest.approx(0.00193, abs=0.002)  # 1 / (100 H_100)
    assert [counts[f"a{i}"] for i in range(5)] == sorted((counts[f"a{i}"] for i in range(5)), reverse=True)
    assert set(counts) <= set(names)
    # alpha 2: p_0 = 1 / (1 + 1/4 + ... + 1/100^2) = 1 / 1.63498; alpha 0: uniform
    assert Counter(assign(random.Random(7), n, names, "zipf:2.0"))["a0"] / n == pytest.approx(0.61163, abs=0.01)
    assert Counter(assign(random.Random(7), n, names, "zipf:0"))["a0"] / n == pytest.approx(0.01, abs=0.003)
    # the other assignments as they were: the same seed, the same trace
    rng = random.Random(3)
    assert assign(random.Random(3), 5, names, "random") == [rng.choice(names) for _ in range(5)]
    assert assign(random.Random(3), 3, names, "round-robin") == ["a0", "a1", "a2"]
    # the flags: --lora-zipf-alpha is the trace's exponent, and goes with zipf only
    args = serve_parser().parse_args(["--lora-assignment", "zipf", "--lora-zipf-alpha", "1.5"])
    check_args(args)
    assert args.lora_assignment == "zipf:1.5"
    args = serve_parser().parse_args(["--lora-assignment", "zipf"])
    check_args(args)
    assert args.lora_assignment == "zipf:1.0"
    assert main(["bench", "serve", "--port", "9", "--lora-zipf-alpha", "2"]) == 2
    assert "--lora-zipf-alpha goes with --lora-assignment zipf" in capsys.readouterr().err
