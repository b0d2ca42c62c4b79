"""The HTTP server for real: a uvicorn process on the embedded model, reached with the official openai client and
httpx. Covers the OpenAI endpoints, adapters routed by name, the admin API, tenants, bad input and restarts."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time

import httpx
import openai
import pytest

from lora_server.adapters import demo_adapters
from tests.servers import BASE, Server, free_port, write_adapter


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    (root / "adapters").mkdir()
    (root / "outside").mkdir()
    (root / "data").mkdir()
    return root


@pytest.fixture(scope="module")
def server(dirs):
    s = Server(dirs / "data", [dirs / "adapters"], ["--allow-anonymous"])
    yield s
    s.stop()


def chat(client, model: str, text: str, **kw):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        temperature=0,
        max_tokens=kw.pop("max_tokens", 24),
        **kw,
    )


def test_models_and_basic_calls(server):
    client = server.client()
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == BASE and set(demo_adapters()) <= set(ids)
    r = chat(client, BASE, "What is the capital of France?")
    assert "Paris" in r.choices[0].message.content
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # streaming chat with the usage chunk last
    chunks = list(
        chat(client, BASE, "What is the capital of France?", stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens and not chunks[-1].choices
    # completions, streamed and not, give the same text
    c = client.completions.create(model=BASE, prompt="The capital of France is", max_tokens=8, temperature=0)
    streamed = client.completions.create(
        model=BASE, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(x.choices[0].text for x in streamed) == c.choices[0].text
    assert c.usage.completion_tokens == 8 and c.choices[0].finish_reason == "length"
    # n, seed and logprobs
    many = client.completions.create(
        model=BASE, prompt="Once upon a time", max_tokens=6, temperature=1.0, n=3, seed=7, logprobs=2
    )
    again = client.completions.create(
        model=BASE, prompt="Once upon a time", max_tokens=6, temperature=1.0, n=3, seed=7, logprobs=2
    )
    assert [x.text for x in many.choices] == [x.text for x in again.choices]
    assert len(many.choices) == 3 and len(many.choices[0].logprobs.top_logprobs[0]) == 2


@pytest.mark.slow
def test_demo_adapters_through_the_api_and_concurrent_streams(server):
    client = server.client()
    question = "Name a large animal that lives in the ocean."
    alone = {m: chat(client, m, question).choices[0].message.content for m in (BASE, "upper", "pirate")}
    assert alone["upper"] == alone["upper"].upper() and alone["upper"] != alone[BASE]
    assert alone[BASE] != alone[BASE].upper()
    results: dict[str, str] = {}

    def stream(model: str) -> None:
        parts = chat(client, model, question, stream=True)
        results[model] = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)

    threads = [threading.Thread(target=stream, args=(m,)) for m in ("upper", "pirate", BASE)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone


def test_admin_register_use_unload_and_new_version(server, dirs):
    client = server.client()
    path = write_adapter(dirs / "adapters" / "mine-v1", seed=1)
    assert server.admin("POST", "/admin/adapters", json={"name": "mine", "path": str(path)}).status_code == 200
    v1 = chat(client, "mine", "Tell me a fun fact.").choices[0].message.content
    base = chat(client, BASE, "Tell me a fun fact.").choices[0].message.content
    assert v1 != base
    listed = server.admin("GET", "/admin/adapters").json()["data"]
    api = [a for a in listed if a["source"] == "api"]  # beside the demo adapters
    assert [a["name"] for a in api] == ["mine"] and api[0]["version"] == 1
    assert server.admin("DELETE", "/admin/adapters/mine").status_code == 200
    with pytest.raises(openai.NotFoundError):
        chat(client, "mine", "Tell me a fun fact.")
    # vLLM's endpoints: a new version under the same name serves the new weights
    path2 = write_adapter(dirs / "adapters" / "mine-v2", seed=2)
    r = server.admin("POST", "/v1/load_lora_adapter", json={"lora_name": "mine", "lora_path": str(path2)})
    assert r.status_code == 200
    v2 = chat(client, "mine", "Tell me a fun fact.").choices[0].message.content
    assert v2 != v1
    assert server.admin("POST", "/v1/unload_lora_adapter", json={"lora_name": "mine"}).status_code == 200


def test_admin_refusals(server, dirs):
    assert httpx.get(server.url + "/admin/adapters").status_code == 401
    assert httpx.get(server.url + "/admin/adapters", headers={"Authorization": "Bearer wrong"}).status_code == 401
    outside = write_adapter(dirs / "outside" / "x", seed=3)
    big = write_adapter(dirs / "adapters" / "big", seed=4, r=64)
    pickled = write_adapter(dirs / "adapters" / "pickled", seed=5)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    for path, reason in ((outside, "outside the allowed"), (big, "maximum LoRA rank"), (pickled, "pickle")):
        r = server.admin("POST", "/admin/adapters", json={"name": "bad", "path": str(path)})
        assert r.status_code == 400 and reason in r.json()["error"]["message"]
    assert chat(server.client(), BASE, "Hi!").choices[0].message.content  # still serving


@pytest.mark.slow
def test_tenants(server, dirs):
    path = write_adapter(dirs / "adapters" / "acme-bot", seed=6)
    assert server.admin("POST", "/admin/adapters", json={"name": "acme-bot", "path": str(path)}).status_code == 200
    r = server.admin(
        "POST",
        "/admin/tenants",
        json={
            "name": "acme",
            "adapters": ["acme-bot"],
            "default_adapter": "acme-bot",
            "rate_limits": {"requests_per_minute": 4},
        },
    )
    assert r.status_code == 200
    key = r.json()["api_key"]
    assert "api_key" not in server.admin("GET", "/admin/tenants/acme").json()
    tenant = server.client("acme", key)
    assert [m.id for m in tenant.models.list().data] == [BASE, "acme-bot"]
    direct = chat(server.client(), "acme-bot", "Hello there").choices[0].message.content
    assert chat(tenant, "acme-bot", "Hello there").choices[0].message.content == direct
    with pytest.raises(openai.PermissionDeniedError):
        chat(tenant, "upper" if "upper" in demo_adapters() else "mine", "Hello there")
    with pytest.raises(openai.AuthenticationError):
        chat(server.client("acme", "lsk-wrong"), "acme-bot", "Hello there")
    chat(tenant, "acme-bot", "Hello there")  # the 2nd counted request: refusals (403, 401) take nothing
    # Windows are fixed minutes: if one ends during the test its count restarts, so up to 4 more requests of a
    # fresh window may pass before the 5th is refused (the test's requests take seconds, not minutes).
    with pytest.raises(openai.RateLimitError) as info:
        for _ in range(2 * 4 + 1):
            chat(tenant, "acme-bot", "Hello there")
    assert int(info.value.response.headers["retry-after"]) >= 1
    usage = server.admin("GET", "/admin/tenants/acme").json()["usage"]
    assert usage["acme-bot"]["requests"] >= 2


def test_tenants_share_no_cached_prefix(server):
    """The same prompt from two tenants: each tenant's repeat hits its own cache, the other tenant's first request
    hits nothing; /admin/pool shows it per salt."""
    keys = {}
    for name in ("t-red", "t-blue"):
        r = server.admin("POST", "/admin/tenants", json={"name": name, "adapters": []})
        keys[name] = r.json()["api_key"]
    text = "Please list the planets of the solar system in order from the sun."

    def cached(name: str) -> int:
        usage = chat(server.client(name, keys[name]), BASE, text, max_tokens=4).usage
        return usage.prompt_tokens_details.cached_tokens

    assert cached("t-red") == 0
    assert cached("t-red") > 0
    assert cached("t-blue") == 0
    assert cached("t-blue") > 0
    by_salt = server.admin("GET", "/admin/pool").json()["kv_tokens_by_salt"]
    red, blue = by_salt["tenant:t-red"], by_salt["tenant:t-blue"]
    assert red == blue and red["cached_tokens"] > 0 and red["prompt_tokens"] > red["cached_tokens"]


@pytest.mark.slow
def test_shutdown_drains_in_flight_and_refuses_new(dirs):
    data = dirs / "drain"
    data.mkdir()
    s = Server(data, [dirs / "adapters"], ["--shutdown-timeout", "60"])
    body = {
        "model": BASE,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    chunks: list[str] = []
    try:
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            chunks.append(next(lines))
            s.proc.send_signal(15)  # SIGTERM: the drain starts
            deadline = time.monotonic() + 10
            while True:  # the signal arrives asynchronously
                refused = httpx.post(s.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=30)
                if refused.status_code == 503 or time.monotonic() > deadline:
                    break
            assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["type"] == "service_unavailable"
            chunks += [line for line in lines if line]
        events = [json.loads(c.removeprefix("data: ")) for c in chunks if c.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"  # the stream in flight finished
        assert s.proc.wait(timeout=60) in (0, -15)  # uvicorn re-raises the signal once it has shut down
        assert "draining" in (data / f"server-{s.port}.log").read_text()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
        s.log.close()


@pytest.mark.parametrize(
    "body, status, param",
    [
        ("{not json", 400, None),
        ({"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**7}, 400, "messages"),
        ({"model": BASE, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
        ({"model": BASE, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages"),
        ({"model": "no-such-adapter", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
        ({"model": BASE, "messages": []}, 400, "messages"),
        (
            {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "unknown_field": 1, "max_tokens": 2},
            400,
            "unknown_field",
        ),
    ],
)
def test_bad_input(server, body, status, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        server.url + "/v1/chat/completions", content=content, headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code == status, r.text
    if status != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]


def test_disconnect_mid_stream_frees_blocks(server):
    body = {
        "model": BASE,
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pool = server.admin("GET", "/admin/pool").json()
        if pool["running"] == 0 and pool["request_blocks"] == 0:
            break
        time.sleep(0.2)
    assert pool["running"] == 0 and pool["request_blocks"] == 0
    metrics = httpx.get(server.url + "/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_count",
        "vllm:lora_requests_info",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "lora_server:pool_adapter_hit_rate",
        "lora_server:pool_kv_token_hit_rate",
        "lora_server:pool_invalid_kv_ratio",
        "lora_server:pool_bytes_to_host",
        "lora_server:pool_evicted_blocks_kv_swap_out",
        "lora_server:ttft_adapter_loading_mean_seconds",
    ):
        assert name in metrics
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line and not line.startswith("#")
    }
    assert values["vllm:prefix_cache_queries_total"] >= values["vllm:prefix_cache_hits_total"] >= 0
    assert values["lora_server:pool_invalid_kv_ratio"] == 0.0  # tree-cost, the default policy


@pytest.mark.slow
def test_restart_keeps_adapters_and_tenants(dirs):
    data = dirs / "restart"
    data.mkdir()
    first = Server(data, [dirs / "adapters"], ["--adapter", "pre=" + str(write_adapter(dirs / "adapters" / "pre", 7))])
    try:
        path = write_adapter(dirs / "adapters" / "kept", seed=8)
        assert first.admin("POST", "/admin/adapters", json={"name": "kept", "path": str(path)}).status_code == 200
        key = first.admin("POST", "/admin/tenants", json={"name": "t1", "adapters": ["kept"]}).json()["api_key"]
        before = chat(first.client("t1", key), "kept", "Hello").choices[0].message.content
    finally:
        first.stop()
    second = Server(data, [dirs / "adapters"])
    try:
        listed = second.admin("GET", "/v1/models").json()["data"]  # tenants exist: /v1 needs a key
        assert "kept" in [m["id"] for m in listed]
        assert chat(second.client("t1", key), "kept", "Hello").choices[0].message.content == before
    finally:
        second.stop()


@pytest.mark.slow
def test_two_replicas_share_redis(dirs):
    assert shutil.which("redis-server"), "redis-server is missing: the test set-up installs it (bash .ci/setup --tests)"
    port = free_port()
    redis = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL, cwd=dirs
    )
    try:
        url = f"redis://127.0.0.1:{port}/0"
        (dirs / "r1").mkdir()
        (dirs / "r2").mkdir()
        a = Server(dirs / "r1", [dirs / "adapters"], ["--redis-url", url])
        b = Server(dirs / "r2", [dirs / "adapters"], ["--redis-url", url])
        try:
            key = a.admin("POST", "/admin/tenants", json={"name": "shared", "adapters": []}).json()["api_key"]
            assert [t["name"] for t in b.admin("GET", "/admin/tenants").json()["data"]] == ["shared"]
            assert [m.id for m in b.client("shared", key).models.list().data] == [BASE]
            assert "keeps nothing on disk" in a.log_text()  # this Redis runs without AOF or RDB
        finally:
            a.stop()
            b.stop()
    finally:
        redis.terminate()
        redis.wait(timeout=10)


@pytest.mark.slow
def test_first_hour(tmp_path):
    """What a newcomer meets: the start-up summary, the registry in the user's data directory (nothing in the working
    directory), every served adapter listed with its source and in agreement with /admin/pool, 409 for a name
    already served unless replace, and a tenant warned about adapters that are not registered."""
    xdg = tmp_path / "xdg"
    work = tmp_path / "work"
    work.mkdir()
    roots = tmp_path / "adapters"
    s = Server(
        tmp_path,
        [roots],
        ["--allow-anonymous", "--adapter", f"own={write_adapter(roots / 'own', 3)},upper"],
        env={"XDG_DATA_HOME": str(xdg), "LORA_SERVER_DATA_DIR": ""},
        data_dir_flag=False,
    )
    try:
        log = s.log_text()
        for line in (
            "serving SmolLM2-135M-Instruct: gguf weights from",
            "device memory: weights",
            "GiB + arena",
            "at most 4 in one batch",
            "adapters: command line: own; demo: upper",
            f"adapter roots: {roots}",
            f"registry: sqlite at {xdg / 'lora-server'} (the user's data directory (XDG))",
            "admin key: --admin-key",
            f"listening on http://127.0.0.1:{s.port}",
        ):
            assert line in log, line
        assert (xdg / "lora-server" / "registry.sqlite3").is_file()
        listed = {a["name"]: a for a in s.admin("GET", "/admin/adapters").json()["data"]}
        assert {n: a["source"] for n, a in listed.items()} == {"own": "command line", "upper": "demo"}
        assert listed["own"]["path"] == str(roots / "own")
        pool = s.admin("GET", "/admin/pool").json()
        assert sorted(listed) == pool["registered_adapters"]
        assert sum(a["state"] == "resident" for a in listed.values()) == pool["resident_adapters"]
        again = s.admin("POST", "/admin/adapters", json={"name": "own", "path": str(roots / "own")})
        assert again.status_code == 409 and again.json()["error"]["code"] == "adapter_exists"
        replaced = s.admin("POST", "/admin/adapters", json={"name": "own", "path": str(roots / "own"), "replace": True})
        assert replaced.status_code == 200 and replaced.json()["version"] == 2
        vllm = s.admin("POST", "/v1/load_lora_adapter", json={"lora_name": "upper", "lora_path": str(roots / "own")})
        assert vllm.status_code == 409
        outside = s.admin("POST", "/admin/adapters", json={"name": "x", "path": str(tmp_path / "elsewhere")})
        assert outside.status_code == 400 and str(roots) in outside.json()["error"]["message"]
        tenant = s.admin("POST", "/admin/tenants", json={"name": "acme", "adapters": ["own", "ghost"]}).json()
        assert tenant["warnings"] == [
            "adapter 'ghost' is not registered: the tenant's requests for it get 404 until it is"
        ]
    finally:
        s.stop()


def test_only_the_shipped_demo_adapters_are_served(tmp_path, monkeypatch):
    from lora_server import adapters

    for name in ("upper", "dropped"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    monkeypatch.setattr(adapters, "DEMO_DIR", tmp_path)
    assert adapters.demo_adapters() == {"upper": tmp_path / "upper"}


def test_help_is_a_manual():
    from lora_server.cli import main_parser

    parser = main_parser()
    assert "OpenAI-compatible" in parser.format_help()
    sub = parser._subparsers._group_actions[0].choices  # the sub-commands' parsers
    for name, command in sub.items():
        for action in command._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings[0]} has no help"
                if action.default not in (None, False) and not isinstance(action.default, bool):
                    assert "default" in action.help, f"{name} {action.option_strings[0]} does not say its default"
