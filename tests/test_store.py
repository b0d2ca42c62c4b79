"""The registry store, one suite over both backends: SQLite on a temporary file, and Redis on a real
``redis-server`` that this module starts (skipped where the binary is missing; ``.ci/redis.sh`` installs it)."""

from __future__ import annotations

import shutil
import socket
import sqlite3
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import pytest

from admin.keys import API_KEY_PREFIX, constant_time_equals, generate_api_key, hash_api_key, verify_api_key
from admin.store import (
    SQLITE_FILENAME,
    AdapterRecord,
    RateLimits,
    RegistryStore,
    TenantExistsError,
    Usage,
    open_store,
)

# -- fixtures --------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A throwaway redis-server without persistence, for the whole session."""
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is missing: .ci/setup installs it (.ci/redis.sh)"
    redis = pytest.importorskip("redis", reason="the redis Python package is not installed (pip install redis)")
    workdir = tmp_path_factory.mktemp("redis")
    port = _free_port()
    log = (workdir / "redis.log").open("w")
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)], stdout=log, stderr=subprocess.STDOUT)
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        deadline = time.monotonic() + 10
        while True:
            if server.poll() is not None:
                pytest.fail(f"redis-server exited with {server.returncode}: {(workdir / 'redis.log').read_text()}")
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        server.terminate()
        server.wait(timeout=10)
        log.close()


@dataclass
class Backend:
    name: str
    open: Callable[[], RegistryStore]  # another store on the same storage: a restart, or a second replica
    raw_dump: Callable[[], str]  # everything the backend has stored, as text


def _sqlite_backend(data_dir: Path, opened: list[RegistryStore]) -> Backend:
    def open_() -> RegistryStore:
        opened.append(open_store(data_dir))
        return opened[-1]

    def raw_dump() -> str:
        with closing(sqlite3.connect(data_dir / SQLITE_FILENAME)) as conn:
            sql = "\n".join(conn.iterdump())
        # and the bytes of the database, its WAL and shared-memory files
        files = "".join(p.read_bytes().decode("latin-1") for p in sorted(data_dir.glob(SQLITE_FILENAME + "*")))
        return sql + files

    return Backend("sqlite", open_, raw_dump)


def _redis_backend(url: str, opened: list[RegistryStore]) -> Backend:
    import redis

    prefix = f"test-{uuid.uuid4().hex}:"  # a fresh namespace per test: tests share the server

    def open_() -> RegistryStore:
        opened.append(open_store("unused", redis_url=url, redis_prefix=prefix))
        return opened[-1]

    def raw_dump() -> str:
        client = redis.Redis.from_url(url, decode_responses=True)
        parts = []
        for key in client.scan_iter(match=prefix + "*"):
            value = client.hgetall(key) if client.type(key) == "hash" else client.get(key)
            parts.append(f"{key} {value}")
        client.close()
        return "\n".join(parts)

    return Backend("redis", open_, raw_dump)


@pytest.fixture(params=["sqlite", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    opened: list[RegistryStore] = []
    if request.param == "sqlite":
        yield _sqlite_backend(tmp_path / "data", opened)
    else:
        yield _redis_backend(request.getfixturevalue("redis_url"), opened)
    for store in opened:
        store.close()


@pytest.fixture
def store(backend: Backend) -> RegistryStore:
    return backend.open()


def _adapter(name: str, path: str = "/adapters/x", version: int = 1, pinned: bool = False) -> AdapterRecord:
    return AdapterRecord(name=name, path=path, version=version, pinned=pinned, created_at=1000.0)


def _run_threads(n: int, target: Callable[[int], None]) -> None:
    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


# -- keys ------------------------------------------------------------------------------------------------------------


def test_api_keys_are_random_prefixed_and_verified_by_hash():
    keys = {generate_api_key() for _ in range(100)}
    assert len(keys) == 100
    key = keys.pop()
    assert key.startswith(API_KEY_PREFIX) and len(key) >= len(API_KEY_PREFIX) + 43  # 32 bytes in base64
    assert key not in hash_api_key(key)
    assert verify_api_key(key, hash_api_key(key))
    assert not verify_api_key(key + "x", hash_api_key(key))
    assert constant_time_equals("abc", "abc") and not constant_time_equals("abc", "abd")
    assert not constant_time_equals("ключ", "abc")  # non-ASCII client input compares instead of raising


# -- adapters --------------------------------------------------------------------------------------------------------


def test_adapters_put_get_list_delete(store: RegistryStore):
    assert store.list_adapters() == [] and store.get_adapter("sql") is None
    sql = _adapter("sql", "/adapters/sql", pinned=True)
    assert store.put_adapter(sql) == sql
    store.put_adapter(_adapter("chat.v2", "/adapters/chat"))
    assert store.get_adapter("sql") == sql
    assert [a.name for a in store.list_adapters()] == ["chat.v2", "sql"]
    assert store.delete_adapter("sql") is True
    assert store.delete_adapter("sql") is False
    assert store.get_adapter("sql") is None
    assert [a.name for a in store.list_adapters()] == ["chat.v2"]


def test_adapter_replace_bumps_version(store: RegistryStore):
    store.put_adapter(_adapter("sql", "/adapters/sql-1"))
    second = store.put_adapter(_adapter("sql", "/adapters/sql-2"))
    assert second.version == 2 and second.path == "/adapters/sql-2"
    assert store.get_adapter("sql") == second
    assert store.put_adapter(_adapter("sql", version=7)).version == 7  # a higher version given is kept
    assert store.put_adapter(_adapter("sql")).version == 8
    assert len(store.list_adapters()) == 1
    store.delete_adapter("sql")
    assert store.put_adapter(_adapter("sql")).version == 1  # a new registration after a delete starts over


@pytest.mark.parametrize("bad", ["", "-lead", ".lead", "a" * 65, "has space", "a/b", "a:b", "line\n", "é"])
def test_invalid_names_are_refused(store: RegistryStore, bad: str):
    with pytest.raises(ValueError, match="invalid adapter name"):
        store.put_adapter(_adapter(bad))
    with pytest.raises(ValueError, match="invalid tenant name"):
        store.create_tenant(bad, [])
    with pytest.raises(ValueError, match="invalid adapter name"):
        store.create_tenant("acme", [bad])
    with pytest.raises(ValueError, match="invalid tenant name"):
        store.take(bad, "requests", 1, 10)
    with pytest.raises(ValueError, match="invalid adapter name"):
        store.add_usage("acme", bad, 1, 1)
    assert store.get_adapter(bad) is None and store.get_tenant(bad) is None and store.authenticate(bad, "k") is None
    assert store.list_adapters() == [] and store.list_tenants() == []


def test_longest_valid_name_is_accepted(store: RegistryStore):
    name = "A" + "b_.-9" * 12 + "xyz"
    assert len(name) == 64
    assert store.put_adapter(_adapter(name)).name == name


def test_other_invalid_arguments_are_refused(store: RegistryStore):
    with pytest.raises(ValueError, match="path"):
        store.put_adapter(_adapter("sql", path=""))
    with pytest.raises(ValueError, match="version"):
        store.put_adapter(_adapter("sql", version=0))
    with pytest.raises(ValueError, match="default_adapter"):
        store.create_tenant("acme", ["sql"], default_adapter="chat")
    with pytest.raises(ValueError, match="list of adapter names"):
        store.create_tenant("acme", "sql")
    with pytest.raises(ValueError, match="requests_per_minute"):
        RateLimits(requests_per_minute=0)
    with pytest.raises(ValueError, match="kind"):
        store.take("acme", "bytes", 1, 10)
    with pytest.raises(ValueError, match="amount"):
        store.take("acme", "tokens", -1, 10)
    assert store.get_tenant("acme") is None and store.get_adapter("sql") is None


# -- tenants ---------------------------------------------------------------------------------------------------------


def test_create_tenant_returns_the_key_once_and_stores_only_its_hash(backend: Backend, store: RegistryStore):
    limits = RateLimits(requests_per_minute=60, tokens_per_minute=10_000)
    record, api_key = store.create_tenant("acme", ["sql", "chat", "sql"], default_adapter="chat", rate_limits=limits)
    assert api_key.startswith(API_KEY_PREFIX)
    assert (record.name, record.adapters, record.default_adapter, record.rate_limits) == (
        "acme", ("sql", "chat"), "chat", limits)
    assert store.get_tenant("acme") == record
    assert api_key not in repr(record)  # not readable back from the record
    raw = backend.raw_dump()
    assert record.key_hash in raw  # we are looking at the right storage ...
    assert api_key not in raw  # ... and the key itself is in none of it
    _, other_key = store.create_tenant("globex", [])
    assert other_key != api_key


def test_duplicate_tenant_is_refused_and_the_first_stays(store: RegistryStore):
    first, key = store.create_tenant("acme", ["sql"])
    with pytest.raises(TenantExistsError, match="acme"):
        store.create_tenant("acme", ["chat"])
    assert store.get_tenant("acme") == first
    assert store.authenticate("acme", key) == first


def test_tenants_get_list_delete(store: RegistryStore):
    assert store.list_tenants() == [] and store.get_tenant("acme") is None
    acme, _ = store.create_tenant("acme", ["sql"], default_adapter="sql")
    base, _ = store.create_tenant("base-only", [])
    assert base.adapters == () and base.default_adapter is None and base.rate_limits == RateLimits()
    assert store.list_tenants() == [acme, base]
    assert store.delete_tenant("acme") is True
    assert store.delete_tenant("acme") is False
    assert store.get_tenant("acme") is None
    assert store.list_tenants() == [base]


def test_authenticate(store: RegistryStore):
    acme, acme_key = store.create_tenant("acme", ["sql"])
    globex, globex_key = store.create_tenant("globex", [])
    assert store.authenticate("acme", acme_key) == acme
    assert store.authenticate("globex", globex_key) == globex
    assert store.authenticate("acme", acme_key + "x") is None
    assert store.authenticate("acme", acme_key[:-1]) is None
    assert store.authenticate("acme", "") is None
    assert store.authenticate("acme", "ключ") is None
    assert store.authenticate("acme", globex_key) is None  # another tenant's key
    assert store.authenticate("nobody", acme_key) is None
    store.delete_tenant("acme")
    assert store.authenticate("acme", acme_key) is None
    # a tenant re-created under the same name gets a new key; the old one stays dead
    _, new_key = store.create_tenant("acme", [])
    assert store.authenticate("acme", acme_key) is None and store.authenticate("acme", new_key) is not None


# -- rate limits -----------------------------------------------------------------------------------------------------

# Windows are [60k, 60k + 60): t = 6000.0 opens window 100, which ends at 6060.0.


def test_rate_limit_fixed_window(store: RegistryStore):
    decisions = [store.take("acme", "requests", 1, 3, now=t) for t in (6000.0, 6015.0, 6059.0)]
    assert [d.allowed for d in decisions] == [True, True, True]
    assert [d.remaining for d in decisions] == [2, 1, 0]
    assert [d.retry_after for d in decisions] == pytest.approx([60.0, 45.0, 1.0])
    refused = store.take("acme", "requests", 1, 3, now=6059.75)
    assert (refused.allowed, refused.remaining) == (False, 0)
    assert refused.retry_after == pytest.approx(0.25)
    fresh = store.take("acme", "requests", 1, 3, now=6060.0)  # the next window starts empty
    assert (fresh.allowed, fresh.remaining) == (True, 2)
    assert fresh.retry_after == pytest.approx(60.0)


def test_refused_take_consumes_nothing(store: RegistryStore):
    assert store.take("acme", "tokens", 70, 100, now=6010.0).remaining == 30
    refused = store.take("acme", "tokens", 31, 100, now=6020.0)
    assert (refused.allowed, refused.remaining) == (False, 30)
    assert refused.retry_after == pytest.approx(40.0)
    exact = store.take("acme", "tokens", 30, 100, now=6030.0)  # the refused 31 left all 30 in place
    assert (exact.allowed, exact.remaining) == (True, 0)
    assert not store.take("acme", "tokens", 1, 100, now=6031.0).allowed
    assert store.take("acme", "tokens", 0, 100, now=6032.0).allowed  # taking nothing always fits
    assert not store.take("acme", "tokens", 101, 100, now=6200.0).allowed  # above the limit: never


def test_rate_limits_are_per_tenant_and_kind(store: RegistryStore):
    assert store.take("acme", "requests", 2, 2, now=6000.0).allowed
    assert not store.take("acme", "requests", 1, 2, now=6001.0).allowed
    assert store.take("acme", "tokens", 2, 2, now=6002.0).allowed
    assert store.take("globex", "requests", 2, 2, now=6003.0).allowed


def test_concurrent_takes_are_atomic(backend: Backend):
    stores = [backend.open(), backend.open()]  # two replicas on one storage, four threads each
    allowed = [0] * 8

    def worker(i: int) -> None:
        for _ in range(50):
            allowed[i] += stores[i % 2].take("acme", "requests", 1, 100, now=6030.0).allowed

    _run_threads(8, worker)
    assert sum(allowed) == 100
    last = stores[0].take("acme", "requests", 1, 100, now=6030.0)
    assert (last.allowed, last.remaining) == (False, 0)


# -- usage -----------------------------------------------------------------------------------------------------------


def test_usage_sums_per_adapter(store: RegistryStore):
    assert store.usage("acme") == {}
    store.add_usage("acme", "sql", prompt_tokens=10, completion_tokens=5)
    store.add_usage("acme", "sql", prompt_tokens=7, completion_tokens=3, requests=2)
    store.add_usage("acme", None, prompt_tokens=4, completion_tokens=1)
    store.add_usage("globex", "sql", prompt_tokens=100, completion_tokens=100)
    assert store.usage("acme") == {"sql": Usage(3, 17, 8), "": Usage(1, 4, 1)}
    assert store.usage("acme")["sql"].total_tokens == 25
    assert store.usage("globex") == {"sql": Usage(1, 100, 100)}
    store.create_tenant("acme", [])
    store.delete_tenant("acme")  # a tenant's usage goes with it
    assert store.usage("acme") == {} and store.usage("globex") != {}


def test_concurrent_usage_is_not_lost(backend: Backend):
    stores = [backend.open(), backend.open()]

    def worker(i: int) -> None:
        for _ in range(25):
            stores[i % 2].add_usage("acme", "sql", prompt_tokens=3, completion_tokens=2)

    _run_threads(8, worker)
    assert stores[0].usage("acme") == {"sql": Usage(200, 600, 400)}


# -- persistence and sharing -----------------------------------------------------------------------------------------


def test_reopened_store_keeps_adapters_and_tenants(backend: Backend):
    store = backend.open()
    adapter = store.put_adapter(_adapter("sql", pinned=True))
    tenant, key = store.create_tenant("acme", ["sql"], default_adapter="sql", rate_limits=RateLimits(5, 500))
    store.add_usage("acme", "sql", 1, 2)
    store.close()
    store.close()  # closing twice is harmless
    reopened = backend.open()
    assert reopened.list_adapters() == [adapter]
    assert reopened.list_tenants() == [tenant]
    assert reopened.authenticate("acme", key) == tenant
    assert reopened.usage("acme") == {"sql": Usage(1, 1, 2)}
    assert reopened.put_adapter(_adapter("sql")).version == 2  # versions continue across restarts


def test_two_open_stores_see_each_others_writes(backend: Backend):
    first, second = backend.open(), backend.open()
    first.put_adapter(_adapter("sql"))
    assert second.get_adapter("sql") is not None
    assert second.put_adapter(_adapter("sql")).version == 2
    assert first.get_adapter("sql").version == 2
    _, key = second.create_tenant("acme", [])
    assert first.authenticate("acme", key) is not None
    with pytest.raises(TenantExistsError):
        first.create_tenant("acme", [])
    assert first.delete_tenant("acme") and second.get_tenant("acme") is None


def test_sqlite_file_is_created_in_wal_mode(tmp_path: Path):
    with open_store(tmp_path / "new" / "dir") as store:
        store.put_adapter(_adapter("sql"))
    path = tmp_path / "new" / "dir" / SQLITE_FILENAME
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_redis_prefixes_keep_stores_apart(redis_url: str):
    with open_store("unused", redis_url=redis_url, redis_prefix=f"a-{uuid.uuid4().hex}:") as a, \
            open_store("unused", redis_url=redis_url, redis_prefix=f"b-{uuid.uuid4().hex}:") as b:
        a.put_adapter(_adapter("sql"))
        a.create_tenant("acme", [])
        assert b.list_adapters() == [] and b.get_tenant("acme") is None
        assert a.take("acme", "requests", 1, 1, now=6000.0).allowed
        assert b.take("acme", "requests", 1, 1, now=6000.0).allowed
