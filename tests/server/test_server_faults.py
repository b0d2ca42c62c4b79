"""The server process under faults, for real: who may use /v1 once tenants exist; a device fault makes the process
exit non-zero within seconds instead of living on as a zombie; a second SIGTERM stops it at once; a Redis registry
that goes away gives 503s with Retry-After (never hangs or 500s) while what needs no store keeps serving, and
the server recovers by itself when Redis is back."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import sqlite3
import subprocess
import time

import httpx
import pytest
import redis as redis_client

from lora_server.admin.store import SQLITE_FILENAME
from tests.device_fault_server import FAULT_MAX_TOKENS
from tests.redis_servers import NO_PERSISTENCE, refuse_writes, start_redis, stop_redis
from tests.servers import ADMIN, BASE, Server, free_port, write_adapter

CHAT = "/v1/chat/completions"
GOOD_CHAT = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def _shaped(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.slow
def test_a_tenant_key_means_its_tenant_and_anonymous_access_closes(tmp_path):
    s = Server(tmp_path, [tmp_path])  # neither --api-key nor --allow-anonymous
    try:
        assert httpx.post(s.url + CHAT, json=GOOD_CHAT, timeout=60).status_code == 200  # no tenant yet: open
        r = s.admin("POST", "/admin/tenants", json={"name": "narrow", "adapters": ["upper"]})
        key = r.json()["api_key"]
        err = _shaped(httpx.post(s.url + CHAT, json=GOOD_CHAT, timeout=60), 401)  # closed at once
        assert "--allow-anonymous" in err["message"]
        as_tenant = {"Authorization": f"Bearer {key}"}
        models = httpx.get(s.url + "/v1/models", headers=as_tenant).json()["data"]
        assert [m["id"] for m in models] == [BASE, "upper"] and [m["root"] for m in models] == [BASE, "upper"]
        _shaped(httpx.post(s.url + CHAT, json={**GOOD_CHAT, "model": "pirate"}, headers=as_tenant, timeout=60), 403)
        first = httpx.post(s.url + CHAT, json={**GOOD_CHAT, "model": "upper"}, headers=as_tenant, timeout=60).json()
        again = httpx.post(s.url + CHAT, json={**GOOD_CHAT, "model": "upper"}, headers=as_tenant, timeout=60).json()
        # its usage and its cache salt, as on /t/narrow/v1
        usage = s.admin("GET", "/admin/tenants/narrow").json()["usage"]["upper"]
        assert usage == {
            "requests": 2,
            "prompt_tokens": 2 * first["usage"]["prompt_tokens"],
            "completion_tokens": first["usage"]["completion_tokens"] + again["usage"]["completion_tokens"],
        }
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        salts = s.admin("GET", "/admin/pool").json()["kv_tokens_by_salt"]
        assert salts["tenant:narrow"]["prompt_tokens"] == 2 * first["usage"]["prompt_tokens"]
        # key rotation: a second key works at once, the retired one stops
        rotated = s.admin("POST", "/admin/tenants/narrow/keys").json()
        new_key, old_id = rotated["api_key"], rotated["key_ids"][0]
        # the answer says which id the new key has: the one of the two ids that is not the old one
        assert rotated["key_id"] == rotated["key_ids"][1] != old_id and len(rotated["key_ids"]) == 2
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": f"Bearer {new_key}"}).status_code == 200
        assert s.admin("DELETE", f"/admin/tenants/narrow/keys/{old_id}").status_code == 200
        _shaped(httpx.get(s.url + "/v1/models", headers=as_tenant), 401)
        # the admin key sees where adapters come from; callers without it never do
        assert any(m["root"].endswith("/upper") for m in s.admin("GET", "/v1/models").json()["data"])
    finally:
        s.stop()


@pytest.mark.slow
def test_second_sigterm_stops_at_once(tmp_path):
    s = Server(tmp_path, [tmp_path], ["--allow-anonymous", "--shutdown-timeout", "120"])
    body = {**GOOD_CHAT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", s.url + CHAT, json=body, timeout=120) as r:
            lines = r.iter_lines()
            next(lines)
            s.proc.send_signal(signal.SIGTERM)  # drain: would wait up to 120 s for this stream
            deadline = time.monotonic() + 10
            while "draining" not in s.log_text() and time.monotonic() < deadline:
                time.sleep(0.05)
            start = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            s.proc.wait(timeout=15)
            assert time.monotonic() - start < 10
    finally:
        s.stop()


@pytest.mark.slow
def test_device_fault_exits_non_zero_within_seconds(tmp_path):
    s = Server(tmp_path, [tmp_path], ["--allow-anonymous"], module="tests.device_fault_server")
    try:
        assert httpx.post(s.url + CHAT, json=GOOD_CHAT, timeout=60).status_code == 200
        start = time.monotonic()
        err = _shaped(httpx.post(s.url + CHAT, json={**GOOD_CHAT, "max_tokens": FAULT_MAX_TOKENS}, timeout=60), 503)
        assert err["type"] == "service_unavailable" and "illegal memory access" in err["message"]
        with contextlib.suppress(httpx.TransportError):  # until it exits, it never looks healthy
            assert httpx.get(s.url + "/health", timeout=5).status_code == 503
        assert s.proc.wait(timeout=15) == 1
        assert time.monotonic() - start < 10
        assert "engine stopped by an unrecoverable fault" in s.log_text()
    finally:
        s.stop()


def _redis(port: int, data_dir, persistent: bool) -> subprocess.Popen:
    persistence = (
        ["--appendonly", "yes", "--dir", str(data_dir)] if persistent else ["--save", "", "--appendonly", "no"]
    )
    proc = subprocess.Popen(["redis-server", "--port", str(port), *persistence], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while (
        subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() != "PONG"
    ):
        assert time.monotonic() < deadline, "redis-server did not start"
        time.sleep(0.1)
    return proc


@pytest.mark.slow
def test_redis_going_away_gives_503s_and_recovery(tmp_path):
    assert shutil.which("redis-server"), "redis-server is missing: the test set-up installs it (bash .ci/setup --tests)"
    port = free_port()
    redis = _redis(port, tmp_path, persistent=True)
    s = Server(tmp_path, [tmp_path], ["--redis-url", f"redis://127.0.0.1:{port}/0", "--api-key", "global-key"])
    try:
        key = s.admin("POST", "/admin/tenants", json={"name": "acme", "adapters": ["upper"]}).json()["api_key"]
        tenant = {"Authorization": f"Bearer {key}"}
        glob = {"Authorization": "Bearer global-key"}
        assert (
            httpx.post(s.url + "/t/acme/v1/chat/completions", json=GOOD_CHAT, headers=tenant, timeout=60).status_code
            == 200
        )
        assert s.admin("GET", "/admin/pool").json()["store"]["reachable"] is True
        assert "keeps nothing on disk" not in s.log_text()

        redis.terminate()
        redis.wait(timeout=10)
        for path, headers in (("/t/acme/v1/chat/completions", tenant), (CHAT, tenant)):
            start = time.monotonic()
            r = httpx.post(s.url + path, json=GOOD_CHAT, headers=headers, timeout=30)
            err = _shaped(r, 503)
            assert err["code"] == "store_unavailable" and int(r.headers["retry-after"]) >= 1
            assert time.monotonic() - start < 10
        _shaped(s.admin("GET", "/admin/tenants"), 503)
        # what needs no store keeps serving
        assert httpx.post(s.url + CHAT, json=GOOD_CHAT, headers=glob, timeout=60).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 200
        assert s.admin("GET", "/admin/pool").json()["store"]["reachable"] is False

        redis = _redis(port, tmp_path, persistent=True)  # back, with its AOF: the tenant is still there
        deadline = time.monotonic() + 10
        while True:
            r = httpx.post(s.url + "/t/acme/v1/chat/completions", json=GOOD_CHAT, headers=tenant, timeout=60)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200, r.text
        assert s.admin("GET", "/admin/pool").json()["store"]["reachable"] is True
        assert "Traceback" not in s.log_text()
        assert json.loads(s.admin("GET", "/admin/tenants/acme").text)["usage"]["<base>"]["requests"] == 2
    finally:
        s.stop()
        redis.terminate()
        redis.wait(timeout=10)


@pytest.mark.slow
def test_redis_refusing_writes_gives_503s_and_no_half_registration(tmp_path):
    """Redis reachable but refusing writes, each of the four ways: every admin write is a 503 with Retry-After in
    OpenAI's shape (it was a plain 500), and changes nothing: an adapter whose registration the store refused is not
    served (it was, until a restart), one whose removal it refused still is; reads and tenant requests go on."""
    (tmp_path / "snapshots").mkdir()
    port = free_port()
    redis_server = start_redis(tmp_path, port, *NO_PERSISTENCE, "--dir", str(tmp_path / "snapshots"))
    client = redis_client.Redis(port=port, decode_responses=True)
    adapters = tmp_path / "adapters"
    kept, fresh = write_adapter(adapters / "kept", seed=1), write_adapter(adapters / "fresh", seed=2)
    s = Server(tmp_path, [adapters], ["--redis-url", f"redis://127.0.0.1:{port}/0"])
    try:
        assert s.admin("POST", "/admin/adapters", json={"name": "kept", "path": str(kept)}).status_code == 200
        key = s.admin("POST", "/admin/tenants", json={"name": "acme", "adapters": ["kept"]}).json()["api_key"]
        tenant_chat = {**GOOD_CHAT, "model": "kept"}
        writes = [
            ("POST", "/admin/adapters", {"name": "fresh", "path": str(fresh)}),
            ("POST", "/v1/load_lora_adapter", {"lora_name": "fresh", "lora_path": str(fresh)}),
            ("POST", "/admin/adapters", {"name": "kept", "path": str(fresh), "replace": True}),
            ("DELETE", "/admin/adapters/kept", None),
            ("POST", "/v1/unload_lora_adapter", {"lora_name": "kept"}),
            ("POST", "/admin/tenants", {"name": "other", "adapters": []}),
            ("PATCH", "/admin/tenants/acme", {"weight": 2}),
            ("POST", "/admin/tenants/acme/keys", None),
            ("DELETE", "/admin/tenants/acme", None),
        ]
        for mode in ("READONLY", "OOM", "MISCONF", "NOREPLICAS"):
            restore = refuse_writes(client, mode, tmp_path / "snapshots")
            try:
                for method, path, body in writes:
                    r = s.admin(method, path, **({} if body is None else {"json": body}))
                    err = _shaped(r, 503)
                    assert err["code"] == "store_unavailable" and int(r.headers["retry-after"]) >= 1, (mode, path)
                names = {a["name"]: a for a in s.admin("GET", "/admin/adapters").json()["data"]}
                assert "fresh" not in names and names["kept"]["path"] == str(kept), (mode, names)
                assert _served(s) & {"kept", "fresh"} == {"kept"}, mode  # the engine's view: /v1/models to admin
                r = httpx.post(
                    f"{s.url}/t/acme/v1/chat/completions", json=tenant_chat, headers=_bearer(key), timeout=60
                )
                assert r.status_code == 200, (mode, r.text)
                assert [t["name"] for t in s.admin("GET", "/admin/tenants").json()["data"]] == ["acme"]
            finally:
                restore()
        # the store takes writes again: so does the admin API, and what it registers is served
        assert s.admin("POST", "/admin/adapters", json={"name": "fresh", "path": str(fresh)}).status_code == 200
        assert {"kept", "fresh"} <= _served(s)
        assert client.hexists("lora-server:adapters", "fresh")
        assert "Traceback" not in s.log_text()
    finally:
        s.stop()
        client.config_set("save", "")  # else it refuses to stop: its final snapshot would fail
        client.close()
        stop_redis(redis_server)


def _served(s: Server) -> set[str]:
    return {m["id"] for m in s.admin("GET", "/v1/models").json()["data"]}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.slow
def test_reads_do_not_wait_for_another_process_holding_the_sqlite_write_lock(tmp_path):
    """Another process holds the registry file's write lock (a long write, a backup). A tenant's usage, written after
    its request, waits for the lock (up to the store's 10 s); requests that only read the registry do not wait
    behind it (they waited 9.7 s: one connection served reads and writes)."""
    s = Server(tmp_path, [tmp_path])
    try:
        key = s.admin("POST", "/admin/tenants", json={"name": "acme", "adapters": ["upper"]}).json()["api_key"]
        with contextlib.closing(sqlite3.connect(tmp_path / SQLITE_FILENAME, isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")
            chat = httpx.post(f"{s.url}/t/acme/v1/chat/completions", json=GOOD_CHAT, headers=_bearer(key), timeout=60)
            assert chat.status_code == 200, chat.text  # its usage is written after the answer: that write waits
            timings = {}
            for name, method, path, auth in (
                ("tenant models", "GET", "/t/acme/v1/models", _bearer(key)),
                ("tenant key on /v1", "GET", "/v1/models", _bearer(key)),
                ("tenant tokenize", "POST", "/t/acme/tokenize", _bearer(key)),
                ("admin list of tenants", "GET", "/admin/tenants", _bearer(ADMIN)),
                ("admin tenant and usage", "GET", "/admin/tenants/acme", _bearer(ADMIN)),
            ):
                body = {"model": BASE, "prompt": "Hi"} if method == "POST" else None
                start = time.monotonic()
                r = httpx.request(method, s.url + path, json=body, headers=auth, timeout=60)
                timings[name] = time.monotonic() - start
                assert r.status_code == 200, (name, r.text)
            print(f"\nanswered while another process held the lock: { {k: round(v, 3) for k, v in timings.items()} }")
            assert max(timings.values()) < 2.0, timings  # a liveness bound: the lock is held throughout (10 s wait)
            other.execute("ROLLBACK")
    finally:
        s.stop()
