"""The routes and headers clients expect beside the completions, on a real server: vLLM's /tokenize and /detokenize
(ids equal to the engine's, for a prompt, a conversation, an adapter and a tenant), GET /v1/models/{id} with real
``created`` times, x-request-id (echoed or generated, in the response id and the server's log), CORS off by default
and on with --allowed-origins, the routes that are not served, lora-server export-tokenizer (AutoTokenizer gives
the server's ids on 100 strings and its chat template), and a stream that leaves no un-awaited coroutine behind."""

from __future__ import annotations

import random
import re
import subprocess
import sys
import time

import httpx
import pytest

from tests.servers import BASE, Server, write_adapter

pytestmark = pytest.mark.slow
STRINGS_SEED = 26


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("routes")
    (root / "adapters").mkdir()
    started = time.time()
    s = Server(root, [root / "adapters"], ["--allow-anonymous"])
    s.started = started  # type: ignore[attr-defined]
    s.root = root  # type: ignore[attr-defined]
    yield s
    s.stop()


def _tokenize(server: Server, body: dict, path: str = "/tokenize", key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30)


def varied_strings(n: int = 100) -> list[str]:
    """Texts that stress a tokenizer: unicode of several scripts and emoji, digits, whitespace runs, special token
    strings inside text, code, empty-ish ones; fixed by a seed."""
    fixed = [
        "",
        " ",
        "Hello, world!",
        "  leading and trailing  ",
        "tabs\tand\nnewlines\n\n\n",
        "1234567890 3.14159 -42 1e10",
        "数字と日本語のテキスト",
        "Ünïcödé çhàràctèrs — “quotes”",
        "emoji 🎉🚀👍🏽 and flags 🇫🇷",
        "<|im_start|>user\nHi<|im_end|>",
        "text with <|endoftext|> inside",
        "def f(x):\n    return x ** 2  # square",
        "     ",
        "a\u200bzero\u200bwidth",
        "Привет, мир! Γειά σου κόσμε",
        "مرحبا بالعالم",
        "tokens<|im_end|><|im_start|>glued",
        "\r\n\r\nCRLF lines\r\n",
    ]
    rng = random.Random(STRINGS_SEED)
    pieces = [*fixed[2:], "  ", "\n", "123", "🎉", "<|im_start|>", " the", "ß", "\t\t", "0"]
    while len(fixed) < n:
        fixed.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 6))))
    return fixed


def test_tokenize_equals_the_engine(server, engine_fp32):
    """The ids of a prompt equal Engine.encode's, of a conversation Engine.chat_prompt's (what the completion
    endpoints are served with); the adapter changes nothing; token_strs and count are vLLM's."""
    for text in varied_strings(30)[1:]:
        r = _tokenize(server, {"model": BASE, "prompt": text, "return_token_strs": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] == engine_fp32.encode(text) and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == server.client().models.retrieve(BASE).model_extra["max_model_len"]
        assert body["token_strs"] == engine_fp32.tokenizer.convert_ids_to_tokens(body["tokens"])
    messages = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello"}]
    chat = _tokenize(server, {"model": "upper", "messages": [*messages, {"role": "user", "content": "Bye"}]}).json()
    assert chat["tokens"] == engine_fp32.chat_prompt([*messages, {"role": "user", "content": "Bye"}])
    assert chat["token_strs"] is None
    no_gen = _tokenize(server, {"messages": messages, "add_generation_prompt": False}).json()
    assert no_gen["tokens"] == engine_fp32.chat_prompt(messages, add_generation_prompt=False)
    reply = server.client().chat.completions.create(model=BASE, messages=messages, max_tokens=1)
    assert reply.usage.prompt_tokens == len(engine_fp32.chat_prompt(messages))
    text = "Round trip: 数字 🎉 <|im_end|>"
    ids = engine_fp32.encode(text)
    assert httpx.post(server.url + "/detokenize", json={"model": BASE, "tokens": ids}).json() == {"prompt": text}


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"model": BASE}, 400, "messages"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "y"}], "tools": []}, 400, "tools"),
        ("/tokenize", {"messages": [{"role": "user", "content": "y"}], "chat_template": "{{ 1 }}"}, 400, None),
        ("/tokenize", {"messages": [{"role": "user", "content": "y"}], "continue_final_message": True}, 400, None),
        ("/tokenize", {"prompt": 7}, 400, "prompt"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    ],
)
def test_tokenize_refusals(server, path, body, status, param):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    if body.get("chat_template") or body.get("continue_final_message"):
        assert ("chat_template" if body.get("chat_template") else "continue_final_message") in error["message"]


def test_models_by_id_with_real_created_times(server):
    before = time.time()
    path = write_adapter(server.root / "adapters" / "fresh", seed=11)
    assert server.admin("POST", "/admin/adapters", json={"name": "fresh", "path": str(path)}).status_code == 200
    after = time.time()
    client = server.client()
    base = client.models.retrieve(BASE)
    assert base.id == BASE and server.started - 1 <= base.created <= before
    fresh = client.models.retrieve("fresh")
    assert fresh.id == "fresh" and int(before) <= fresh.created <= after
    listed = {m.id: m.created for m in client.models.list().data}
    assert listed[BASE] == base.created and listed["fresh"] == fresh.created
    r = httpx.get(server.url + "/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    key = server.admin("POST", "/admin/tenants", json={"name": "acme", "adapters": ["upper"]}).json()["api_key"]
    tenant = server.client("acme", key)
    assert tenant.models.retrieve("upper").id == "upper"
    for hidden in ("fresh", "pirate"):  # served, but not this tenant's
        r = httpx.get(f"{server.url}/t/acme/v1/models/{hidden}", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 404
    # /tokenize per tenant: its adapters, its key
    assert _tokenize(server, {"model": "upper", "prompt": "hi"}, "/t/acme/tokenize", key).status_code == 200
    assert _tokenize(server, {"model": "pirate", "prompt": "hi"}, "/t/acme/tokenize", key).status_code == 403
    assert _tokenize(server, {"model": "upper", "prompt": "hi"}, "/t/acme/tokenize", "lsk-wrong").status_code == 401
    assert _tokenize(server, {"model": "pirate", "prompt": "hi"}, "/tokenize", key).status_code == 403
    server.admin("DELETE", "/admin/tenants/acme")


def test_request_ids(server):
    body = {"model": BASE, "prompt": "Hi", "max_tokens": 2}
    mine = "trace-0123-abcd"
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"x-request-id": mine}, timeout=60)
    assert r.headers["x-request-id"] == mine and r.json()["id"] == f"cmpl-{mine}"
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    generated = r.headers["x-request-id"]
    assert re.fullmatch("[0-9a-f]{32}", generated) and r.json()["id"] == f"cmpl-{generated}"
    chat = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat, headers={"x-request-id": "s-1"}) as s:
        assert s.headers["x-request-id"] == "s-1"
        assert '"id": "chatcmpl-s-1"' in "".join(s.iter_text())
    for _ in range(2):  # a client that sends one id twice still gets both answered
        assert httpx.post(server.url + "/v1/completions", json=body, headers={"x-request-id": mine}).status_code == 200
    assert httpx.get(server.url + "/health", headers={"x-request-id": "h-9"}).headers["x-request-id"] == "h-9"
    refused = httpx.post(server.url + "/v1/completions", json={**body, "top_p": 7}, headers={"x-request-id": "bad-1"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "bad-1"
    time.sleep(0.5)
    log = server.log_text()
    assert re.search(rf"\[{mine}\].*POST /v1/completions", log) and f"[{generated}]" in log and "[bad-1]" in log


def test_cors_is_off_by_default(server):
    preflight = {"Origin": "http://elsewhere.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(server.url + "/v1/models", headers={"Origin": "http://elsewhere.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_with_allowed_origins(tmp_path):
    flags = ["--allow-anonymous", "--allowed-origins", "http://app.example", "--allowed-methods", "GET,POST"]
    s = Server(tmp_path, [], flags)
    try:
        ok = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
        r = httpx.options(s.url + "/v1/chat/completions", headers=ok)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        r = httpx.options(s.url + "/v1/chat/completions", headers={**ok, "Access-Control-Request-Method": "DELETE"})
        assert r.status_code == 400
        r = httpx.get(s.url + "/v1/models", headers={"Origin": "http://app.example"})
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        assert "x-request-id" in r.headers["access-control-expose-headers"]
        r = httpx.get(s.url + "/v1/models", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers
    finally:
        s.stop()


@pytest.mark.parametrize("route", ["responses", "embeddings"])
def test_routes_not_served_say_so(server, route):
    for path in (f"/v1/{route}", f"/t/anyone/v1/{route}"):
        r = httpx.post(server.url + path, json={"model": BASE, "input": "hi"})
        assert r.status_code == 404
        error = r.json()["error"]
        assert error["type"] == "not_found_error" and f"/v1/{route} is not served" in error["message"]


def test_exported_tokenizer_gives_the_servers_ids(server, tmp_path):
    from transformers import AutoTokenizer

    done = subprocess.run(
        [sys.executable, "-m", "lora_server.cli", "export-tokenizer", str(tmp_path / "tok")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    hf = AutoTokenizer.from_pretrained(tmp_path / "tok")
    strings = varied_strings(100)
    assert len(set(strings)) >= 90
    for text in strings:
        ours = _tokenize(server, {"model": BASE, "prompt": text}).json()["tokens"]
        assert hf(text)["input_ids"] == ours, text
        assert hf.decode(ours) == httpx.post(server.url + "/detokenize", json={"tokens": ours}).json()["prompt"]
    conversations = [
        [{"role": "user", "content": "Hi!"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "数字 🎉"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    ]
    for messages in conversations:
        ours = _tokenize(server, {"model": BASE, "messages": messages}).json()["tokens"]
        theirs = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert list(theirs if isinstance(theirs, list) else theirs["input_ids"]) == ours
    from lora_server.model.loader import default_model_path, read_arch

    assert hf.model_max_length == read_arch(default_model_path(), "gguf").max_position_embeddings


def test_a_stream_leaves_no_unawaited_coroutine(server):
    """A streamed request used to make a coroutine (the disconnect watch of non-streaming requests) that nothing
    awaited: Python warned "coroutine '_disconnected' was never awaited" in the server's log."""
    client = server.client()
    for _ in range(3):  # a few tokens each: an answer left to its end (sampled, no max_tokens) took up to minutes
        messages = [{"role": "user", "content": "Hi"}]
        list(client.chat.completions.create(model=BASE, messages=messages, max_tokens=4, stream=True))
    list(client.completions.create(model=BASE, prompt="Hi", max_tokens=3, stream=True))
    time.sleep(0.5)
    assert "never awaited" not in server.log_text()
