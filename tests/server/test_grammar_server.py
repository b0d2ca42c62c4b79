"""Grammar compilation through a real server process: a tenant's limits are checked before any compile, a grammar
that fails after admission gives the charge back, and cheap routes (/health, the admin API) answer while many slow
compiles are in flight (the compiles run in their own pool, each caller waiting at most its budget)."""

from __future__ import annotations

import random
import string
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.servers import ADMIN, BASE, Server

CHAT = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar-server")
    # slow compiles within reach: large choices allowed, a short budget
    s = Server(root, [root], ["--max-choice-kb", "1024", "--grammar-compile-timeout", "2"])
    yield s
    s.stop()


def _tenant(server: Server, name: str, **limits) -> str:
    r = server.admin("POST", "/admin/tenants", json={"name": name, "adapters": [], "rate_limits": limits})
    assert r.status_code == 200, r.text
    return r.json()["api_key"]


def _chat(server: Server, key: str, **extra) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/chat/completions",
        json={**CHAT, **extra},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def _shaped(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def test_the_rate_limit_is_checked_before_the_grammar_is_compiled(server):
    """A refused request is refused for its rate, not for its grammar: nothing of it was compiled (a regex that
    xgrammar alone finds invalid would otherwise have answered 400)."""
    if time.time() % 60 > 40:  # the two requests must fall in one fixed minute window
        time.sleep(61 - time.time() % 60)
    key = _tenant(server, "one-a-minute", requests_per_minute=1)
    assert _chat(server, key).status_code == 200
    r = _chat(server, key, guided_regex="(unclosed")
    assert r.status_code == 429 and r.headers["Retry-After"], r.text
    assert _shaped(r)["type"] == "rate_limit_error"


def test_a_grammar_refused_after_admission_gives_the_charge_back(server):
    if time.time() % 60 > 40:
        time.sleep(61 - time.time() % 60)
    key = _tenant(server, "refunded", requests_per_minute=1)
    r = _chat(server, key, guided_regex="(unclosed")
    assert r.status_code == 400 and _shaped(r)["param"] == "guided_regex", r.text
    assert _chat(server, key).status_code == 200  # the minute's one request was given back


def _slow_choice(seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_letters, k=3000)) for _ in range(100)]  # ~300 KB: seconds to compile


def test_cheap_routes_answer_while_slow_compiles_are_in_flight(server):
    key = _tenant(server, "compiler")
    results: list[httpx.Response] = []

    def slow(seed: int) -> None:
        results.append(_chat(server, key, guided_choice=_slow_choice(seed)))

    pool = ThreadPoolExecutor(48)
    for seed in range(48):
        pool.submit(slow, seed)
    time.sleep(0.5)  # the bodies are on their way
    worst = 0.0
    while len(results) < 48:
        for path, headers in (("/health", {}), ("/admin/pool", {"Authorization": f"Bearer {ADMIN}"})):
            start = time.monotonic()
            r = httpx.get(server.url + path, headers=headers, timeout=30)
            worst = max(worst, time.monotonic() - start)
            assert r.status_code == 200
        time.sleep(0.2)
    pool.shutdown()
    assert worst < 2.0, f"a cheap route took {worst:.1f} s"  # a liveness bound, not a speed figure
    for r in results:
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert _shaped(r)["code"] == "grammar_too_complex" and _shaped(r)["param"] == "guided_choice"
    assert any(r.status_code == 400 for r in results)
    assert httpx.get(server.url + "/health").status_code == 200
    assert threading.active_count() < 60
