"""/metrics on a real server, read with prometheus_client's own text parser: vLLM's names, types and bucket edges,
request counts and token totals hand-counted from the responses, and the engine's state while a stream runs."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import BASE, Server

# copied from vLLM (vllm/v1/metrics/loggers.py: its TTFT edges, INTER_TOKEN_LATENCY_BUCKETS and
# request_latency_buckets), not from our module
INTER_TOKEN = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
REQUEST_LATENCY = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": [
        0.001,
        0.005,
        0.01,
        0.02,
        0.04,
        0.06,
        0.08,
        0.1,
        0.25,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
        40.0,
        80.0,
        160.0,
        640.0,
        2560.0,
    ],
    "vllm:inter_token_latency_seconds": INTER_TOKEN,
    "vllm:request_time_per_output_token_seconds": INTER_TOKEN,
    "vllm:e2e_request_latency_seconds": REQUEST_LATENCY,
    "vllm:request_queue_time_seconds": REQUEST_LATENCY,
}
COUNTERS = (
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:num_preemptions",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # one adapter gets its own lora_name series, the others share "<other>"
    s = Server(tmp_path_factory.mktemp("metrics"), [], ["--allow-anonymous", "--max-lora-metric-labels", "1"])
    yield s
    s.stop()


def scrape(server: Server) -> dict[str, list]:
    """Family name -> its samples, as prometheus_client's parser reads the page."""
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(families, family: str, sample: str | None = None, **labels: str) -> float:
    """The samples called ``sample`` (default: the family's own name, or name_total for a counter) with these
    labels, summed (a histogram's series per lora_name add up)."""
    f = families[family]
    name = sample or (family + "_total" if f.type == "counter" else family)
    found = [s for s in f.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert found or labels, (family, name)  # a series of a given lora_name may not exist yet: 0
    return sum(s.value for s in found)


def wait_idle(server: Server) -> dict:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        families = scrape(server)
        if value(families, "vllm:num_requests_running") == 0 and value(families, "vllm:num_requests_waiting") == 0:
            return families
        time.sleep(0.2)
    raise AssertionError("requests still running 30 s after the traffic")


def test_metrics_page(server):
    before = scrape(server)
    for name in (
        *VLLM_BUCKETS,
        *COUNTERS,
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "lora_server:pool_kv_token_hit_rate",
        "lora_server:ttft_prefill_mean_seconds",
        "lora_server:pool_evicted_blocks_kv_drop",
    ):
        assert {s.labels["model_name"] for s in before[name].samples} == {BASE}, name
    assert {name: before[name].type for name in VLLM_BUCKETS} == dict.fromkeys(VLLM_BUCKETS, "histogram")
    assert {name: before[name].type for name in COUNTERS} == dict.fromkeys(COUNTERS, "counter")
    assert before["vllm:num_requests_running"].type == "gauge"
    for name, edges in VLLM_BUCKETS.items():
        les = [s.labels["le"] for s in before[name].samples if s.name == name + "_bucket"]
        assert les == [*(str(e) for e in edges), "+Inf"], name
    pool = server.admin("GET", "/admin/pool").json()
    (cache,) = before["vllm:cache_config_info"].samples
    assert cache.labels == {"block_size": str(pool["block_size"]), "num_gpu_blocks": str(pool["gpu_blocks"])}
    assert cache.value == 1

    # a long stream for the demo adapter: the engine's state while it runs, then the client leaves
    body = {"model": "upper", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held open: a dropped iterator closes the connection, which aborts the request
        while not next(lines).startswith("data: "):
            pass
        deadline = time.monotonic() + 10
        while value(during := scrape(server), "vllm:num_requests_running") != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert value(during, "vllm:num_requests_running") == 1
        (lora,) = during["vllm:lora_requests_info"].samples
        assert lora.labels == {"running_lora_adapters": "upper", "waiting_lora_adapters": "", "max_lora": "4"}
        assert abs(lora.value - time.time()) < 10  # seconds since the epoch, as vLLM
        assert value(during, "vllm:kv_cache_usage_perc") > 0
    baseline = wait_idle(server)

    # counted traffic: plain and adapter chat, a streamed completion, a repeated prompt (prefix cache hits)
    client = server.client()
    usages = []
    chat = [{"role": "user", "content": "What is the capital of France? Answer in one short sentence please."}]
    for model in (BASE, "upper", BASE):
        usages.append(client.chat.completions.create(model=model, messages=chat, max_tokens=6, temperature=0).usage)
    chunks = list(
        client.completions.create(
            model=BASE,
            prompt="The capital of France is",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usages.append(chunks[-1].usage)
    pirate = client.completions.create(
        model="pirate", prompt="Ahoy", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    usages.append(pirate.usage)
    requests = 5
    after = wait_idle(server)

    def delta(family: str, sample: str | None = None) -> float:
        return value(after, family, sample) - value(baseline, family, sample)

    prompt = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    cached = sum((u.prompt_tokens_details.cached_tokens or 0) if u.prompt_tokens_details else 0 for u in usages)
    decoding = sum(u.completion_tokens > 1 for u in usages)  # requests with a time per output token
    per_request = {
        "vllm:time_to_first_token_seconds": requests,
        "vllm:e2e_request_latency_seconds": requests,
        "vllm:request_queue_time_seconds": requests,
        "vllm:request_time_per_output_token_seconds": decoding,
    }
    for name, count in per_request.items():
        assert delta(name, name + "_count") == count, name
        assert delta(name, name + "_sum") > 0
        # by adapter: the base model's 3 requests, "upper" (the first adapter seen: its own series) 1, "pirate"
        # beyond the one labelled adapter: "<other>"
        by_lora = {
            lora: value(after, name, name + "_count", lora_name=lora)
            - value(baseline, name, name + "_count", lora_name=lora)
            for lora in ("", "upper", "<other>")
        }
        assert sum(by_lora.values()) == count and by_lora["<other>"] == 1 and by_lora["upper"] == 1, (name, by_lora)
    # one gap per output token after a request's first (the engine emits a token per step)
    assert delta("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == generated - requests
    assert delta("vllm:request_success") == requests
    assert delta("vllm:prompt_tokens") == prompt and delta("vllm:generation_tokens") == generated
    assert delta("vllm:prefix_cache_queries") == prompt  # each prompt looked up once
    assert delta("vllm:prefix_cache_hits") == cached > 0  # the repeated chat found its first blocks
    assert value(after, "vllm:num_requests_running") == 0
