"""A bounded soak of a real server: concurrent clients across adapters and tenants, streams dropped midway,
non-streaming clients that time out, and an adapter registered and unloaded in a loop while clients use it and
another process rewrites its weights file in place. Beside them, the attacks of the second round, in a loop:
structured outputs the grammar cannot honour or that cost too much, invalid on-demand names, long prompts, requests
with ambiguous framing, and connections that send nothing. Afterwards: no server error, each attack answered as
expected with no filesystem path shown, nothing running or waiting, no block held by a request, the pool's
integrity intact, and each tenant charged exactly what its clients received (for the tenant whose clients all
finish) or what the engine produced for it (dropped and timed-out requests)."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from collections import Counter

import httpx
import pytest

from tests.servers import BASE, Server, write_adapter

pytestmark = pytest.mark.slow
DURATION_S = 50.0
ADAPTERS = [BASE, "upper", "pirate", "emoji", "reg-a"]
PROMPTS = [
    "Name a large animal.",
    "Write one line about rain.",
    "What is 3 + 4?",
    "Say hello in French.",
    "Give me a color.",
]


class Tally:
    """What the clients saw, shared by their threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.statuses: Counter[str] = Counter()
        self.latencies: list[float] = []
        self.usage: dict[str, list[int]] = {}  # steady tenant: adapter usage key -> [requests, prompt, completion]
        self.flaky_requests = 0
        self.flaky_received = 0
        self.error_events: list[str] = []
        self.attacks: Counter[tuple[str, int]] = Counter()  # (attack, status)
        self.leaks: list[str] = []  # answers to callers without the admin key that show a server path

    def status(self, what: str | int) -> None:
        with self.lock:
            self.statuses[str(what)] += 1


def _chat(rng: random.Random, model: str, max_tokens: int, stream: bool, **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "stream": stream,
        **extra,
    }


def _steady(server: Server, key: str, tally: Tally, stop: float, seed: int) -> None:
    """A tenant client whose every request finishes; it remembers the usage each answer reported."""
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {key}"}
    while time.monotonic() < stop:
        model, stream = rng.choice(ADAPTERS), rng.random() < 0.5
        body = _chat(rng, model, rng.randint(4, 20), stream, stream_options={"include_usage": True})
        start = time.monotonic()
        if stream:
            with httpx.stream(
                "POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120
            ) as r:
                events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
                status = r.status_code
            usage = events[-1].get("usage") if events and status == 200 else None
            if status == 200 and any("error" in e for e in events):
                tally.error_events.append(json.dumps(events[-1])[:300])
        else:
            r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
            status, usage = r.status_code, r.json().get("usage") if r.status_code == 200 else None
        tally.status(status)
        if usage is not None:
            key_name = "<base>" if model == BASE else model
            with tally.lock:
                tally.latencies.append(time.monotonic() - start)
                counts = tally.usage.setdefault(key_name, [0, 0, 0])
                counts[0] += 1
                counts[1] += usage["prompt_tokens"]
                counts[2] += usage["completion_tokens"]


def _dropper(server: Server, key: str, tally: Tally, stop: float) -> None:
    """A tenant client that leaves: streams closed after a few chunks, non-streaming calls that time out."""
    rng = random.Random(100)
    headers = {"Authorization": f"Bearer {key}"}
    while time.monotonic() < stop:
        body = _chat(rng, rng.choice(ADAPTERS), 300, stream=True, ignore_eos=True)
        received, leave_at = 0, rng.randint(2, 6)
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
            tally.status(r.status_code)
            for line in r.iter_lines():
                if '"content"' in line and '"role"' not in line:
                    received += 1
                if received == leave_at:
                    break
        with tally.lock:
            tally.flaky_requests += 1
            tally.flaky_received += received
        try:
            httpx.post(
                server.url + "/v1/chat/completions",
                json=_chat(rng, BASE, 300, False, ignore_eos=True),
                headers=headers,
                timeout=1.5,
            )
            tally.status("finished before the client timeout")
        except httpx.ReadTimeout:
            tally.status("client timeout")
        with tally.lock:
            tally.flaky_requests += 1


def _churn_user(server: Server, tally: Tally, stop: float) -> None:
    """Uses the adapter that is registered and unloaded in a loop: a 404 before the answer, a 400 when its file was
    caught mid-rewrite, or a whole answer."""
    rng = random.Random(200)
    headers = {"Authorization": "Bearer soak-key"}
    while time.monotonic() < stop:
        with httpx.stream(
            "POST",
            server.url + "/v1/chat/completions",
            json=_chat(rng, "churn", 12, True),
            headers=headers,
            timeout=120,
        ) as r:
            events = [x for x in r.iter_lines() if x.startswith("data: {")]
            tally.status(f"churn {r.status_code}")
            if r.status_code == 200 and any('"error"' in e for e in events):
                tally.error_events.append(events[-1][:300])


def _churn(server: Server, paths: list, tally: Tally, stop: float) -> None:
    rng, i = random.Random(300), 0
    while time.monotonic() < stop:
        r = server.admin("POST", "/admin/adapters", json={"name": "churn", "path": str(paths[i % 2])})
        tally.status(f"admin register {r.status_code}")
        time.sleep(rng.uniform(0.5, 2.0))
        r = server.admin("DELETE", "/admin/adapters/churn")
        tally.status(f"admin unload {r.status_code}")
        time.sleep(rng.uniform(0.2, 1.0))
        i += 1


def _rewriter(path, stop: float) -> None:
    """Writes the churn adapter's weights over themselves in place, in two parts (a reader in between sees a short
    file): a memory-mapped read would die of SIGBUS."""
    data, rng = path.read_bytes(), random.Random(400)
    while time.monotonic() < stop:
        with path.open("r+b") as file:
            file.truncate(0)
            file.flush()
            file.write(data[: len(data) // 2])
            file.flush()
            time.sleep(rng.uniform(0.0, 0.05))
            file.write(data[len(data) // 2 :])
        time.sleep(rng.uniform(0.05, 0.5))


def _attacks() -> list[tuple[str, str, dict, int]]:
    """(attack, endpoint, body, the status it must get), each sent by a client with the global key."""
    chat = {"messages": [{"role": "user", "content": "Give me a color."}], "max_tokens": 4}
    schema = {"type": "integer"}
    for _ in range(100):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    long_prompt = "The river runs past the old mill and the bridge. " * 120  # 1,321 tokens (the context: 2,320)
    return [
        ("grammar without end", "chat", {**chat, "guided_grammar": 'root ::= "a" root'}, 400),
        ("schema oneOf", "chat", {**chat, "guided_json": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}, 400),
        (
            "schema recursing without end",
            "chat",
            {**chat, "guided_json": {"properties": {"a": {"$ref": "#"}}, "required": ["a"]}},
            400,
        ),
        ("schema 100 deep", "chat", {**chat, "guided_json": schema}, 400),
        ("257 choices", "chat", {**chat, "guided_choice": [f"c{i}" for i in range(257)]}, 400),
        ("regex of 20 KB", "completions", {"prompt": "x", "max_tokens": 2, "guided_regex": "r" * 20_000}, 400),
        ("on-demand name of 300 characters", "chat", {**chat, "model": "a" * 300}, 400),
        ("on-demand name not ASCII", "chat", {**chat, "model": "café"}, 400),
        ("on-demand name with ..", "chat", {**chat, "model": "od..x"}, 400),
        ("valid guided_json", "chat", {**chat, "max_tokens": 8, "guided_json": {"type": "integer"}}, 200),
        ("long prompt", "completions", {"prompt": long_prompt, "max_tokens": 2}, 200),
    ]


def _attacker(server: Server, tally: Tally, stop: float, private: str) -> None:
    """Sends the attacks in turn; every few rounds, a request with both Content-Length and Transfer-Encoding on a
    raw socket (a 400, the connection closed) and 64 connections that send nothing (the server closes them at its
    head deadline; they are dropped at the end). ``private``: a path no answer may show."""
    headers = {"Authorization": "Bearer soak-key"}
    silent: list[socket.socket] = []
    rounds = 0
    while time.monotonic() < stop:
        for name, endpoint, body, _ in _attacks():
            model = body.get("model", BASE)
            r = httpx.post(
                f"{server.url}/v1/{'chat/' if endpoint == 'chat' else ''}completions",
                json={**body, "model": model},
                headers=headers,
                timeout=120,
            )
            tally.attacks[(name, r.status_code)] += 1
            if private in r.text:
                tally.leaks.append(f"{name}: {r.text[:300]}")
            if time.monotonic() >= stop:
                break
        if rounds % 3 == 0:
            tally.attacks[("content-length with transfer-encoding", _smuggle(server.port))] += 1
            silent += [socket.create_connection(("127.0.0.1", server.port)) for _ in range(64)]
        rounds += 1
    for conn in silent:
        conn.close()


def _smuggle(port: int) -> int:
    """A POST with both framings; returns the status line's code (0: the connection closed unanswered)."""
    body = b'{"model": "x"}'
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
            + f"{len(body):x}\r\n".encode()
            + body
            + b"\r\n0\r\n\r\n"
        )
        reply = conn.recv(4096).split(b" ", 2)
    return int(reply[1]) if len(reply) > 1 and reply[1].isdigit() else 0


def test_soak(tmp_path):
    roots = tmp_path / "adapters"
    roots.mkdir()
    flags = ["--api-key", "soak-key", "--max-num-seqs", "16", "--load-adapters-on-demand"]
    server = Server(tmp_path, [roots], flags)
    try:
        assert (
            server.admin(
                "POST", "/admin/adapters", json={"name": "reg-a", "path": str(write_adapter(roots / "reg-a", seed=11))}
            ).status_code
            == 200
        )
        churn_paths = [write_adapter(roots / f"churn-{i}", seed=20 + i) for i in range(2)]
        keys = {
            name: server.admin("POST", "/admin/tenants", json={"name": name, "adapters": ADAPTERS[1:]}).json()[
                "api_key"
            ]
            for name in ("steady", "flaky")
        }
        tally = Tally()
        stop = time.monotonic() + DURATION_S
        threads = [threading.Thread(target=_steady, args=(server, keys["steady"], tally, stop, i)) for i in range(3)]
        threads += [
            threading.Thread(target=_dropper, args=(server, keys["flaky"], tally, stop)),
            threading.Thread(target=_churn_user, args=(server, tally, stop)),
            threading.Thread(target=_churn, args=(server, churn_paths, tally, stop)),
            threading.Thread(target=_rewriter, args=(churn_paths[0] / "adapter_model.safetensors", stop)),
            threading.Thread(target=_attacker, args=(server, tally, stop, str(tmp_path))),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        total = sum(v for k, v in tally.statuses.items() if not k.startswith("admin"))
        lat = sorted(tally.latencies)
        print(
            f"\nsoak: {total} requests in {DURATION_S:.0f} s, statuses {dict(sorted(tally.statuses.items()))}, "
            f"steady latency p50 {lat[len(lat) // 2]:.2f} s p99 {lat[int(len(lat) * 0.99)]:.2f} s"
        )
        assert not [k for k in tally.statuses if k.isdigit() and int(k) >= 500], tally.statuses
        print(f"attacks: {dict(sorted(tally.attacks.items()))}")
        assert set(tally.statuses) <= {
            "200",
            "client timeout",
            "finished before the client timeout",
            "churn 200",
            "churn 400",  # its weights caught mid-rewrite when it was staged for the request
            "churn 404",
            "admin register 200",
            "admin register 400",  # its weights caught mid-rewrite
            "admin unload 200",
            "admin unload 404",  # the registration before it was a 400
        }, tally.statuses
        expected = {name: status for name, _, _, status in _attacks()} | {"content-length with transfer-encoding": 400}
        assert {name for name, _ in tally.attacks} == set(expected), tally.attacks
        assert all(status == expected[name] for name, status in tally.attacks), tally.attacks
        assert not tally.leaks, tally.leaks
        assert not tally.error_events  # never a 200 followed by an error event
        assert tally.statuses["200"] > 30

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pool = server.admin("GET", "/admin/pool").json()
            if (pool["running"], pool["waiting"], pool["request_blocks"]) == (0, 0, 0):
                break
            time.sleep(0.2)
        assert (pool["running"], pool["waiting"], pool["request_blocks"]) == (0, 0, 0), pool
        assert server.admin("POST", "/admin/pool/check").json() == {"ok": True}
        assert httpx.get(server.url + "/health").status_code == 200

        def usage(tenant: str) -> dict:
            return {
                a: [u["requests"], u["prompt_tokens"], u["completion_tokens"]]
                for a, u in server.admin("GET", f"/admin/tenants/{tenant}").json()["usage"].items()
            }

        deadline = time.monotonic() + 10
        while usage("steady") != tally.usage and time.monotonic() < deadline:
            time.sleep(0.2)  # usage is settled just after each answer
        assert usage("steady") == tally.usage
        flaky = usage("flaky").values()
        assert sum(u[0] for u in flaky) == tally.flaky_requests
        assert sum(u[2] for u in flaky) >= tally.flaky_received
        assert "Traceback" not in server.log_text()
    finally:
        server.stop()
