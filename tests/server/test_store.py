"""The registry store, one suite over both backends: SQLite on a temporary file, and Redis on a real
``redis-server`` that this module starts (``tests.redis_servers``). The fault and persistence tests start, stop and
freeze redis-servers of their own, on free ports. The change feed (``admin.store.change_feed``) is tested here too: it
is the stores' revision heard by another process."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from lora_server.admin.store import (
    SQLITE_FILENAME,
    AdapterRecord,
    RateLimits,
    RegistryStore,
    StoreStatus,
    StoreUnavailableError,
    TenantExistsError,
    TenantRecord,
    UnknownKeyError,
    UnknownTenantError,
    Usage,
    key_id,
)
from lora_server.admin.store.change_feed import PollingFeed, RedisFeed, open_feed
from lora_server.admin.store.keys import (
    API_KEY_PREFIX,
    constant_time_equals,
    generate_api_key,
    hash_api_key,
    verify_api_key,
)
from lora_server.admin.store.open import open_store
from lora_server.admin.store.sqlite import SQLiteStore
from tests.redis_servers import NO_PERSISTENCE, free_port, refuse_writes, stop_redis
from tests.redis_servers import start_redis as start_redis_server

# -- fixtures --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A throwaway redis-server without persistence, for the whole session."""
    port = free_port()
    server = start_redis_server(tmp_path_factory.mktemp("redis"), port, *NO_PERSISTENCE)
    yield f"redis://127.0.0.1:{port}/0"
    stop_redis(server)


@pytest.fixture
def start_redis(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen]]:
    """Starts redis-servers of the test's own (``start_redis(port, *options)``); kills those still running at the
    end (SIGKILL: a server the test left stopped with SIGSTOP would not see SIGTERM)."""
    servers: list[subprocess.Popen] = []

    def start(port: int, *options: str) -> subprocess.Popen:
        servers.append(start_redis_server(tmp_path, port, *options))
        return servers[-1]

    yield start
    for server in servers:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=10)


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


def _redis_store(url: str, **kwargs: Any) -> RegistryStore:
    from lora_server.admin.store.redis import (
        RedisStore,  # imported here: the SQLite tests run without the redis package
    )

    return RedisStore(url, **kwargs)


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


def test_put_adapters_stores_a_batch_as_one_revision(backend: Backend, store: RegistryStore):
    """Each record as put_adapter would store it (a new name keeps its version, a replace gets at least the old one
    plus one), all in one write: the revision moves by one."""
    store.put_adapter(_adapter("sql", "/adapters/sql-1"))
    store.put_adapter(_adapter("sql", "/adapters/sql-2"))  # version 2
    store.put_adapter(_adapter("chat", version=6))
    assert store.revision() == 3
    batch = [
        _adapter("sql", "/adapters/sql-3"),  # replaces version 2: 3
        _adapter("new", "/adapters/new", pinned=True),  # new: 1
        _adapter("chat", version=9),  # replaces 6 with a higher version given: 9
        _adapter("big", version=4),  # new, with its version: 4
    ]
    expected = [
        AdapterRecord("sql", "/adapters/sql-3", 3, False, 1000.0),
        AdapterRecord("new", "/adapters/new", 1, True, 1000.0),
        AdapterRecord("chat", "/adapters/x", 9, False, 1000.0),
        AdapterRecord("big", "/adapters/x", 4, False, 1000.0),
    ]
    assert store.put_adapters(batch) == expected
    assert store.revision() == 4
    assert store.list_adapters() == sorted(expected, key=lambda r: r.name)
    assert backend.open().list_adapters() == sorted(expected, key=lambda r: r.name)  # another replica sees it all
    assert store.put_adapters([]) == [] and store.revision() == 4  # an empty batch changes nothing
    assert store.put_adapters([_adapter("chat")]) == [AdapterRecord("chat", "/adapters/x", 10, False, 1000.0)]
    assert store.revision() == 5


def test_put_adapters_refuses_a_bad_batch_whole(store: RegistryStore):
    store.put_adapter(_adapter("kept"))
    for batch, reason in (
        ([_adapter("sql"), _adapter("bad name")], "invalid adapter name"),
        ([_adapter("sql"), _adapter("kept", version=0)], "version"),
        ([_adapter("sql"), _adapter("chat", path="")], "path"),
        ([_adapter("sql"), _adapter("chat"), _adapter("sql", "/adapters/other")], "'sql' appears more than once"),
    ):
        with pytest.raises(ValueError, match=reason):
            store.put_adapters(batch)
    assert store.list_adapters() == [_adapter("kept")] and store.revision() == 1


def test_concurrent_batches_are_atomic(backend: Backend):
    """Four replicas put the same ten names at once, each batch one atomic write: every name ends at version 4
    (1, then three replaces), in four revisions; a lost update would leave a lower version."""
    names = [f"a{i}" for i in range(10)]

    def put(i: int) -> None:
        backend.open().put_adapters([_adapter(name, f"/adapters/{i}") for name in names])

    _run_threads(4, put)
    store = backend.open()
    assert [(r.name, r.version) for r in store.list_adapters()] == [(name, 4) for name in sorted(names)]
    assert len({r.path for r in store.list_adapters()}) == 1  # every name from the one batch written last
    assert store.revision() == 4


@pytest.mark.parametrize(
    "bad", ["", "-lead", ".lead", "a" * 65, "has space", "a/b", "a:b", "line\n", "é", "a..b", ".."]
)
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
        "acme",
        ("sql", "chat"),
        "chat",
        limits,
    )
    assert store.get_tenant("acme") == record
    assert api_key not in repr(record)  # not readable back from the record
    raw = backend.raw_dump()
    assert record.key_hashes[0] in raw  # we are looking at the right storage ...
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


def test_tenant_share_is_stored_and_changed_atomically_by_field(backend: Backend, store: RegistryStore):
    plain, _ = store.create_tenant("plain", [])
    assert (plain.weight, plain.max_running) == (1.0, 0)  # the defaults: equal shares, no cap
    heavy, key = store.create_tenant("heavy", ["sql"], weight=2.5, max_running=3)
    assert (heavy.weight, heavy.max_running) == (2.5, 3) and store.get_tenant("heavy") == heavy
    assert store.set_share("heavy", max_running=0) == TenantRecord(
        "heavy", ("sql",), None, RateLimits(), heavy.key_hashes, heavy.created_at, weight=2.5, max_running=0
    )
    after = store.set_share("heavy", weight=0.5)
    assert (after.weight, after.max_running) == (0.5, 0)
    assert backend.open().tenant_by_key(key) == after == store.get_tenant("heavy")  # another replica sees it
    for bad in (0, -1, 1001, float("nan"), True, "2"):
        with pytest.raises(ValueError, match="weight"):
            store.set_share("heavy", weight=bad)
        with pytest.raises(ValueError, match="weight"):
            store.create_tenant("other", [], weight=bad)
    with pytest.raises(ValueError, match="max_running"):
        store.set_share("heavy", max_running=-1)
    with pytest.raises(UnknownTenantError):
        store.set_share("nobody", weight=2)
    assert store.get_tenant("heavy") == after and store.get_tenant("other") is None


def test_concurrent_share_and_key_changes_are_not_lost(backend: Backend):
    store = backend.open()
    store.create_tenant("acme", [])

    def change(i: int) -> None:
        mine = backend.open()
        if i == 0:
            mine.issue_key("acme")
        elif i == 1:
            mine.set_share("acme", weight=3)
        else:
            mine.set_share("acme", max_running=4)

    _run_threads(3, change)
    record = store.get_tenant("acme")
    assert (len(record.key_hashes), record.weight, record.max_running) == (2, 3.0, 4)


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


def test_has_tenants(store: RegistryStore):
    assert store.has_tenants() is False
    store.create_tenant("acme", [])
    assert store.has_tenants() is True
    store.delete_tenant("acme")
    assert store.has_tenants() is False


# -- keys by tenant: lookup and rotation -----------------------------------------------------------------------------


def test_key_id_is_the_start_of_the_keys_sha256():
    key = generate_api_key()
    assert key_id(hash_api_key(key)) == hashlib.sha256(key.encode()).hexdigest()[:12]


def test_tenant_by_key_finds_the_holder_of_each_key(store: RegistryStore):
    _, acme_key = store.create_tenant("acme", ["sql"])
    globex, globex_key = store.create_tenant("globex", [])
    acme, second_key = store.issue_key("acme")
    assert store.tenant_by_key(acme_key) == acme and store.tenant_by_key(second_key) == acme
    assert store.tenant_by_key(globex_key) == globex
    for unknown in (generate_api_key(), acme_key + "x", acme_key[:-1], API_KEY_PREFIX, "", "ключ", None, 42):
        assert store.tenant_by_key(unknown) is None
    assert store.delete_tenant("acme")
    assert store.tenant_by_key(acme_key) is None and store.tenant_by_key(second_key) is None
    assert store.tenant_by_key(globex_key) == globex
    # a tenant re-created under the same name gets a new key; the old ones stay dead
    again, new_key = store.create_tenant("acme", [])
    assert store.tenant_by_key(acme_key) is None and store.tenant_by_key(new_key) == again


def test_key_rotation(backend: Backend, store: RegistryStore):
    first, old_key = store.create_tenant("acme", ["sql"])
    assert first.key_hashes == (hash_api_key(old_key),)
    assert first.key_ids == (hashlib.sha256(old_key.encode()).hexdigest()[:12],)
    rotating, new_key = store.issue_key("acme")
    assert new_key.startswith(API_KEY_PREFIX) and new_key != old_key
    assert rotating.key_hashes == (hash_api_key(old_key), hash_api_key(new_key))
    assert (rotating.name, rotating.adapters, rotating.created_at) == (first.name, first.adapters, first.created_at)
    assert store.get_tenant("acme") == rotating
    assert new_key not in backend.raw_dump()
    for key in (old_key, new_key):  # both work while clients move over
        assert store.authenticate("acme", key) == rotating and store.tenant_by_key(key) == rotating
    with pytest.raises(ValueError, match="retire one first"):
        store.issue_key("acme")
    assert store.get_tenant("acme") == rotating

    rotated = store.retire_key("acme", first.key_ids[0])
    assert rotated.key_hashes == (hash_api_key(new_key),) and store.get_tenant("acme") == rotated
    assert store.authenticate("acme", old_key) is None and store.tenant_by_key(old_key) is None
    assert store.authenticate("acme", new_key) == rotated and store.tenant_by_key(new_key) == rotated
    with pytest.raises(UnknownKeyError, match=first.key_ids[0]):
        store.retire_key("acme", first.key_ids[0])
    with pytest.raises(ValueError, match="last key"):
        store.retire_key("acme", rotated.key_ids[0])
    assert store.get_tenant("acme") == rotated

    # the next rotation, retiring the older key again
    _, newest_key = store.issue_key("acme")
    final = store.retire_key("acme", rotated.key_ids[0])
    assert final.key_hashes == (hash_api_key(newest_key),)
    assert store.tenant_by_key(new_key) is None and store.tenant_by_key(newest_key) == final


def test_key_rotation_of_unknown_or_invalid_tenants_is_refused(store: RegistryStore):
    with pytest.raises(UnknownTenantError, match="nobody"):
        store.issue_key("nobody")
    with pytest.raises(UnknownTenantError, match="nobody"):
        store.retire_key("nobody", "0123456789ab")
    with pytest.raises(ValueError, match="invalid tenant name"):
        store.issue_key("has space")
    with pytest.raises(ValueError, match="invalid tenant name"):
        store.retire_key("has space", "0123456789ab")
    assert not store.has_tenants()


def test_concurrent_issue_key_never_exceeds_two_keys(backend: Backend):
    stores = [backend.open(), backend.open()]
    stores[0].create_tenant("acme", [])
    issued: list[str] = []
    refused: list[int] = []

    def worker(i: int) -> None:
        try:
            issued.append(stores[i % 2].issue_key("acme")[1])
        except ValueError:
            refused.append(i)

    _run_threads(8, worker)
    assert (len(issued), len(refused)) == (1, 7)
    assert len(stores[1].get_tenant("acme").key_hashes) == 2
    assert stores[1].tenant_by_key(issued[0]).name == "acme"


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


def test_give_back_settles_a_take(store: RegistryStore):
    taken = store.take("acme", "tokens", 10, 30, now=6000.0)  # window 100: [6000, 6060)
    assert (taken.allowed, taken.remaining, taken.window) == (True, 20, 100)
    store.take("acme", "requests", 3, 30, now=6000.0)
    store.take("globex", "tokens", 7, 30, now=6000.0)
    store.give_back("acme", "tokens", 100, 4)  # took 10, used 6
    assert store.take("acme", "tokens", 0, 30, now=6001.0).remaining == 24
    assert store.take("acme", "requests", 0, 30, now=6001.0).remaining == 27  # other kinds and tenants untouched
    assert store.take("globex", "tokens", 0, 30, now=6001.0).remaining == 23
    store.give_back("acme", "tokens", 100, 1000)  # never below zero: the whole limit fits again, no more
    assert store.take("acme", "tokens", 30, 30, now=6002.0).remaining == 0
    assert not store.take("acme", "tokens", 1, 30, now=6003.0).allowed
    store.give_back("acme", "tokens", 99, 5)  # a window without a counter: nothing happens
    assert store.take("acme", "tokens", 0, 30, now=5990.0).remaining == 30

    later = store.take("acme", "tokens", 5, 30, now=6060.0)  # window 101
    assert (later.remaining, later.window) == (25, 101)
    store.give_back("acme", "tokens", 100, 30)  # the earlier window's settlement leaves this one alone
    assert store.take("acme", "tokens", 0, 30, now=6061.0).remaining == 25
    store.give_back("acme", "tokens", 101, 0)
    assert store.take("acme", "tokens", 0, 30, now=6062.0).remaining == 25


def test_give_back_validates_its_arguments(store: RegistryStore):
    with pytest.raises(ValueError, match="invalid tenant name"):
        store.give_back("a b", "tokens", 100, 1)
    with pytest.raises(ValueError, match="kind"):
        store.give_back("acme", "bytes", 100, 1)
    with pytest.raises(ValueError, match="window"):
        store.give_back("acme", "tokens", "100", 1)
    with pytest.raises(ValueError, match="amount"):
        store.give_back("acme", "tokens", 100, -1)


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
    store.create_tenant("acme", [])
    store.create_tenant("globex", [])
    store.add_usage("acme", "sql", prompt_tokens=10, completion_tokens=5)
    store.add_usage("acme", "sql", prompt_tokens=7, completion_tokens=3, requests=2)
    store.add_usage("acme", None, prompt_tokens=4, completion_tokens=1)
    store.add_usage("globex", "sql", prompt_tokens=100, completion_tokens=100)
    assert store.usage("acme") == {"sql": Usage(3, 17, 8), "": Usage(1, 4, 1)}
    assert store.usage("acme")["sql"].total_tokens == 25
    assert store.usage("globex") == {"sql": Usage(1, 100, 100)}
    store.delete_tenant("acme")  # a tenant's usage goes with it
    assert store.usage("acme") == {} and store.usage("globex") != {}


def test_a_tenant_created_again_starts_at_zero(store: RegistryStore):
    """Usage that arrives after its tenant was deleted (a request that ended late) counts nowhere; a tenant created
    again under the name starts with no usage and full rate-limit windows, whatever its predecessor used."""
    old, _ = store.create_tenant("acme", [])
    store.add_usage("acme", "sql", 10, 5, created_at=old.created_at)
    assert store.take("acme", "requests", 3, 3).allowed
    store.delete_tenant("acme")
    store.add_usage("acme", "sql", 10, 5, created_at=old.created_at)  # late: the tenant is gone
    store.add_usage("acme", "sql", 10, 5)
    assert store.usage("acme") == {}
    time.sleep(0.01)  # another creation time
    new, _ = store.create_tenant("acme", [])
    store.add_usage("acme", "sql", 10, 5, created_at=old.created_at)  # the former tenant's request, later still
    assert store.usage("acme") == {}
    assert store.take("acme", "requests", 3, 3).remaining == 0  # the whole window was the new tenant's
    store.add_usage("acme", "sql", 1, 2, created_at=new.created_at)
    assert store.usage("acme") == {"sql": Usage(1, 1, 2)}


def test_concurrent_usage_is_not_lost(backend: Backend):
    stores = [backend.open(), backend.open()]
    stores[0].create_tenant("acme", [])

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
    with (
        open_store("unused", redis_url=redis_url, redis_prefix=f"a-{uuid.uuid4().hex}:") as a,
        open_store("unused", redis_url=redis_url, redis_prefix=f"b-{uuid.uuid4().hex}:") as b,
    ):
        a.put_adapter(_adapter("sql"))
        a.create_tenant("acme", [])
        assert b.list_adapters() == [] and b.get_tenant("acme") is None
        assert a.take("acme", "requests", 1, 1, now=6000.0).allowed
        assert b.take("acme", "requests", 1, 1, now=6000.0).allowed


def test_status(backend: Backend, store: RegistryStore, tmp_path: Path):
    if backend.name == "sqlite":
        assert store.status() == StoreStatus("sqlite", True, True, str(tmp_path / "data" / SQLITE_FILENAME))
    else:  # the session's redis-server runs with --save "" --appendonly no
        assert store.status() == StoreStatus(
            "redis", True, False, "none: every tenant and adapter is lost when redis restarts"
        )


@pytest.mark.parametrize(
    ("options", "persistent", "detail"),
    [
        (NO_PERSISTENCE, False, "none: every tenant and adapter is lost"),
        (("--save", "", "--appendonly", "yes"), True, "AOF"),
        (("--save", "900 1", "--appendonly", "no"), True, "RDB"),
        (("--save", "900 1", "--appendonly", "yes"), True, "AOF and RDB"),
        # managed Redis refuses CONFIG: INFO shows AOF, but not RDB snapshots
        (("--save", "", "--appendonly", "yes", "--rename-command", "CONFIG", ""), True, "AOF"),
        (("--save", "900 1", "--appendonly", "no", "--rename-command", "CONFIG", ""), None, "unknown: AOF is off"),
    ],
    ids=["none", "aof", "rdb", "aof+rdb", "aof-without-config", "rdb-without-config"],
)
def test_redis_status_tells_whether_data_survives_a_restart(
    start_redis: Callable[..., subprocess.Popen], options: tuple[str, ...], persistent: bool | None, detail: str
):
    port = free_port()
    start_redis(port, *options)
    with _redis_store(f"redis://127.0.0.1:{port}/0") as store:
        status = store.status()
    assert (status.backend, status.reachable, status.persistent) == ("redis", True, persistent)
    assert status.detail.startswith(detail)


# -- the revision and the change feed --------------------------------------------------------------------------------


def _later(delay_s: float, call: Callable[[], object]) -> threading.Timer:
    """``call`` on another thread in ``delay_s`` seconds (join the timer before closing what it uses)."""
    timer = threading.Timer(delay_s, call)
    timer.start()
    return timer


def test_every_change_to_adapters_and_tenants_bumps_the_revision(backend: Backend, store: RegistryStore):
    """One more per write that changed an adapter or a tenant; refused writes, missing names, rate-limit takes and
    usage leave it."""
    assert store.revision() == 0
    steps: list[tuple[Callable[[], object], int]] = [
        (lambda: store.put_adapter(_adapter("sql")), 1),
        (lambda: store.put_adapter(_adapter("sql", "/adapters/sql-2")), 1),  # a new version
        (lambda: store.delete_adapter("sql"), 1),
        (lambda: store.delete_adapter("sql"), 0),
        (lambda: store.create_tenant("acme", ["sql"]), 1),
        (lambda: store.issue_key("acme"), 1),
        (lambda: store.set_share("acme", weight=2.0), 1),
        (lambda: store.retire_key("acme", store.get_tenant("acme").key_ids[0]), 1),
        (lambda: store.take("acme", "requests", 1, 10), 0),
        (lambda: store.add_usage("acme", "sql", 3, 4), 0),
        (lambda: store.delete_tenant("acme"), 1),
        (lambda: store.delete_tenant("acme"), 0),
    ]
    expected = 0
    for step, bump in steps:
        step()
        expected += bump
        assert store.revision() == expected
    refused: list[Callable[[], object]] = [
        lambda: store.create_tenant("globex", []) and store.create_tenant("globex", []),
        lambda: store.issue_key("globex") and store.issue_key("globex"),  # a third key
        lambda: store.retire_key("globex", "000000000000"),
        lambda: store.put_adapter(_adapter("bad name")),
        lambda: store.set_share("nobody", weight=1.0),
    ]
    expected += 2  # globex and its second key
    for write in refused:
        with pytest.raises((ValueError, TenantExistsError, UnknownKeyError, UnknownTenantError)):
            write()
    assert store.revision() == expected
    assert backend.open().revision() == expected  # another replica reads the same revision


def test_the_change_feed_hears_another_replicas_write(backend: Backend):
    """A feed wakes when another store on the same storage writes (Redis: pub/sub, SQLite: polling), within a
    second (the registry's contract); with nothing written it waits out its timeout."""
    listener, writer = backend.open(), backend.open()
    feed = open_feed(listener)
    assert isinstance(feed, RedisFeed if backend.name == "redis" else PollingFeed)
    try:
        seen = listener.revision()
        started = time.monotonic()
        assert feed.wait(seen, timeout=0.3) == seen
        assert time.monotonic() - started >= 0.3
        write = _later(0.2, lambda: writer.put_adapter(_adapter("sql")))
        started = time.monotonic()
        assert feed.wait(seen, timeout=10) == seen + 1
        assert time.monotonic() - started < 1.2  # 0.2 s before the write, then within the second
        write.join()
        writer.create_tenant("acme", [])  # while nobody waits: the next wait returns at once
        assert feed.wait(seen + 1, timeout=10) == seen + 2
    finally:
        feed.close()


def test_a_closed_feed_stops_waiting(backend: Backend):
    store = backend.open()
    feed = open_feed(store)
    feed.wait(-1, timeout=0.1)  # connected
    close = _later(0.2, feed.close)
    started = time.monotonic()
    assert feed.wait(store.revision(), timeout=10) == store.revision()
    assert time.monotonic() - started < 1
    close.join()


def test_redis_feed_reconnects_and_reports_what_changed_meanwhile(start_redis: Callable[..., subprocess.Popen]):
    """Redis goes away under a waiting feed: the wait raises StoreUnavailableError; once Redis is back (empty: its
    revision starts again from 0), the next wait subscribes again and reports the revision it finds."""
    port = free_port()
    server = start_redis(port, *NO_PERSISTENCE)
    store = _redis_store(f"redis://127.0.0.1:{port}/0")
    feed = open_feed(store)
    store.put_adapter(_adapter("sql"))
    store.put_adapter(_adapter("chat"))
    assert feed.wait(0, timeout=1) == 2
    stop = _later(0.2, lambda: stop_redis(server))
    with pytest.raises(StoreUnavailableError, match="redis at 127"):
        feed.wait(2, timeout=10)
    stop.join()
    start_redis(port, *NO_PERSISTENCE)
    store.create_tenant("acme", [])  # the new Redis's revision 1: below what the feed saw, but a change
    assert feed.wait(2, timeout=10) == 1
    delete = _later(0.2, lambda: store.delete_tenant("acme"))
    assert feed.wait(1, timeout=10) == 2
    delete.join()  # the feed may hear the change before the writer has read its answer
    feed.close()
    store.close()


# -- stores written by earlier versions ------------------------------------------------------------------------------

# The schema of version 1 (one key per tenant, in tenants.key_hash), as that version created it.
_SQLITE_SCHEMA_1 = """
CREATE TABLE adapters (name TEXT PRIMARY KEY, path TEXT NOT NULL, version INTEGER NOT NULL, pinned INTEGER NOT NULL,
    created_at REAL NOT NULL);
CREATE TABLE tenants (name TEXT PRIMARY KEY, adapters TEXT NOT NULL, default_adapter TEXT, requests_per_minute INTEGER,
    tokens_per_minute INTEGER, key_hash TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE rate_windows (tenant TEXT NOT NULL, kind TEXT NOT NULL, window_index INTEGER NOT NULL,
    used INTEGER NOT NULL, PRIMARY KEY (tenant, kind, window_index));
CREATE TABLE usage (tenant TEXT NOT NULL, adapter TEXT NOT NULL, requests INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, PRIMARY KEY (tenant, adapter));
PRAGMA journal_mode=WAL;
PRAGMA user_version = 1;
"""


def test_sqlite_file_of_schema_1_is_migrated(tmp_path: Path):
    acme_key, globex_key = generate_api_key(), generate_api_key()
    path = tmp_path / SQLITE_FILENAME
    with closing(sqlite3.connect(path)) as conn:
        conn.executescript(_SQLITE_SCHEMA_1)
        conn.execute("INSERT INTO adapters VALUES ('sql', '/adapters/sql', 3, 1, 1000.0)")
        conn.execute(
            """INSERT INTO tenants VALUES ('acme', '["sql"]', 'sql', 5, 500, ?, 1000.0)""", (hash_api_key(acme_key),)
        )
        conn.execute(
            "INSERT INTO tenants VALUES ('globex', '[]', NULL, NULL, NULL, ?, 1001.0)", (hash_api_key(globex_key),)
        )
        conn.execute("INSERT INTO usage VALUES ('acme', 'sql', 1, 2, 3)")
        conn.execute("INSERT INTO rate_windows VALUES ('acme', 'tokens', 100, 7)")
        conn.commit()
    acme = TenantRecord("acme", ("sql",), "sql", RateLimits(5, 500), (hash_api_key(acme_key),), 1000.0)
    globex = TenantRecord("globex", (), None, RateLimits(), (hash_api_key(globex_key),), 1001.0)

    with open_store(tmp_path) as store:
        assert store.list_tenants() == [acme, globex]
        assert store.authenticate("acme", acme_key) == acme and store.tenant_by_key(acme_key) == acme
        assert store.tenant_by_key(globex_key) == globex
        assert store.list_adapters() == [AdapterRecord("sql", "/adapters/sql", 3, True, 1000.0)]
        assert store.usage("acme") == {"sql": Usage(1, 2, 3)}
        assert store.take("acme", "tokens", 0, 10, now=6000.0).remaining == 3
        _, new_key = store.issue_key("acme")
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 4
        assert "key_hash" not in [row[1] for row in conn.execute("PRAGMA table_info(tenants)")]
        assert sorted(conn.execute("SELECT tenant FROM tenant_keys")) == [("acme",), ("acme",), ("globex",)]
    with open_store(tmp_path) as store:  # opening the migrated file again changes nothing
        assert store.tenant_by_key(new_key).key_hashes == (hash_api_key(acme_key), hash_api_key(new_key))
        assert store.get_tenant("globex") == globex


# Version 2 (keys in tenant_keys, no share per tenant): version 1's tenants table without key_hash.
_SQLITE_SCHEMA_2 = (
    _SQLITE_SCHEMA_1.replace("key_hash TEXT NOT NULL, ", "").replace("user_version = 1", "user_version = 2")
    + "CREATE TABLE tenant_keys (key_hash TEXT PRIMARY KEY, tenant TEXT NOT NULL);"
)


def test_sqlite_file_of_schema_2_gets_the_default_share(tmp_path: Path):
    key = generate_api_key()
    path = tmp_path / SQLITE_FILENAME
    with closing(sqlite3.connect(path)) as conn:
        conn.executescript(_SQLITE_SCHEMA_2)
        conn.execute("""INSERT INTO tenants VALUES ('acme', '["sql"]', 'sql', 5, 500, 1000.0)""")
        conn.execute("INSERT INTO tenant_keys VALUES (?, 'acme')", (hash_api_key(key),))
        conn.commit()
    acme = TenantRecord("acme", ("sql",), "sql", RateLimits(5, 500), (hash_api_key(key),), 1000.0, 1.0, 0)
    with open_store(tmp_path) as store:
        assert store.tenant_by_key(key) == acme
        assert store.revision() == 0  # the revision's table, added by version 4, starts at 0
        assert store.set_share("acme", weight=2, max_running=1).weight == 2.0
        assert store.revision() == 1
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 4
    with open_store(tmp_path) as store:  # opening it again changes nothing
        assert (store.get_tenant("acme").weight, store.get_tenant("acme").max_running) == (2.0, 1)


def test_sqlite_file_of_a_newer_schema_is_refused(tmp_path: Path):
    with closing(sqlite3.connect(tmp_path / SQLITE_FILENAME)) as conn:
        conn.execute("PRAGMA user_version = 99")
    with pytest.raises(RuntimeError, match="schema version 99, written by a newer lora-server"):
        open_store(tmp_path)


def test_redis_tenants_of_the_single_key_format_are_read_and_indexed(redis_url: str):
    import redis

    prefix = f"v1-{uuid.uuid4().hex}:"
    acme_key, globex_key = generate_api_key(), generate_api_key()
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    for name, key, adapters in (("acme", acme_key, ["sql"]), ("globex", globex_key, [])):
        client.hset(
            prefix + "tenants",
            name,
            json.dumps(
                {
                    "name": name,
                    "adapters": adapters,
                    "default_adapter": None,
                    "rate_limits": {"requests_per_minute": 5, "tokens_per_minute": None},
                    "key_hash": hash_api_key(key),
                    "created_at": 1000.0,
                }
            ),
        )
    acme = TenantRecord("acme", ("sql",), None, RateLimits(5), (hash_api_key(acme_key),), 1000.0)
    try:
        with open_store("unused", redis_url=redis_url, redis_prefix=prefix) as store:
            assert client.hgetall(prefix + "keys") == {
                hash_api_key(acme_key): "acme",
                hash_api_key(globex_key): "globex",
            }
            assert store.get_tenant("acme") == acme and store.authenticate("acme", acme_key) == acme
            assert store.tenant_by_key(acme_key) == acme and store.tenant_by_key(globex_key).name == "globex"
            rotated, new_key = store.issue_key("acme")
            assert store.tenant_by_key(acme_key) == rotated and store.tenant_by_key(new_key) == rotated
            assert json.loads(client.hget(prefix + "tenants", "acme"))["key_hashes"] == [
                hash_api_key(acme_key),
                hash_api_key(new_key),
            ]
            assert store.delete_tenant("acme")
            assert client.hgetall(prefix + "keys") == {hash_api_key(globex_key): "globex"}
    finally:
        client.delete(*client.keys(prefix + "*"))
        client.close()


# -- an unreachable backend ------------------------------------------------------------------------------------------

_OPERATIONS: dict[str, Callable[[RegistryStore], object]] = {
    "get_tenant": lambda store: store.get_tenant("acme"),
    "tenant_by_key": lambda store: store.tenant_by_key(generate_api_key()),
    "take": lambda store: store.take("acme", "requests", 1, 100),
    "add_usage": lambda store: store.add_usage("acme", "sql", 1, 1),
    "list_adapters": lambda store: store.list_adapters(),
    "put_adapters": lambda store: store.put_adapters([_adapter("sql"), _adapter("chat")]),
}


def test_stopped_redis_raises_unavailable_and_the_store_recovers(start_redis: Callable[..., subprocess.Popen]):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    server = start_redis(port, *NO_PERSISTENCE)
    store = _redis_store(url)  # the default timeout: 2 s
    store.create_tenant("acme", [])
    for operation in _OPERATIONS.values():
        operation(store)
    stop_redis(server)
    for name, operation in _OPERATIONS.items():
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match=rf"redis at 127\.0\.0\.1:{port}\) is unreachable"):
            operation(store)
        assert time.monotonic() - started < 3, name
    status = store.status()
    assert (status.reachable, status.persistent) == (False, None) and "unreachable" in status.detail
    with pytest.raises(StoreUnavailableError, match="unreachable"):
        _redis_store(url)  # opening a store fails at once too

    start_redis(port, *NO_PERSISTENCE)  # back on the same address (empty: it kept nothing)
    assert store.status().reachable
    _, key = store.create_tenant("acme", [])
    for operation in _OPERATIONS.values():
        operation(store)
    assert store.tenant_by_key(key).name == "acme"
    store.close()


def test_hung_redis_times_out_instead_of_hanging(start_redis: Callable[..., subprocess.Popen]):
    port = free_port()
    server = start_redis(port, *NO_PERSISTENCE)
    store = _redis_store(f"redis://127.0.0.1:{port}/0", timeout=0.3)
    store.create_tenant("acme", [])
    os.kill(server.pid, signal.SIGSTOP)  # accepts connections (the kernel does), answers nothing
    try:
        for name, operation in _OPERATIONS.items():
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="unreachable"):
                operation(store)
            assert time.monotonic() - started < 1.5, name
        assert not store.status().reachable
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert store.get_tenant("acme") is not None
    store.close()


_WRITES: dict[str, Callable[[RegistryStore], object]] = {
    "put_adapter": lambda store: store.put_adapter(_adapter("sql")),
    "put_adapters": lambda store: store.put_adapters([_adapter("sql"), _adapter("chat")]),
    "delete_adapter": lambda store: store.delete_adapter("kept"),
    "create_tenant": lambda store: store.create_tenant("other", []),
    "issue_key": lambda store: store.issue_key("acme"),
    "set_share": lambda store: store.set_share("acme", weight=2.0),
    "delete_tenant": lambda store: store.delete_tenant("acme"),
    "take": lambda store: store.take("acme", "requests", 1, 100),
    "add_usage": lambda store: store.add_usage("acme", "sql", 1, 1),
}


@pytest.mark.parametrize("mode", ["READONLY", "OOM", "MISCONF", "NOREPLICAS"])
def test_redis_refusing_writes_raises_unavailable(start_redis: Callable[..., subprocess.Popen], tmp_path, mode):
    """A reachable Redis that refuses writes (error replies, not a lost connection): every write raises
    StoreUnavailableError in Redis's words, without the values redis-py quotes, and changes nothing; reads go on."""
    port = free_port()
    (tmp_path / "snapshots").mkdir()
    start_redis(port, *NO_PERSISTENCE, "--dir", str(tmp_path / "snapshots"))
    store = _redis_store(f"redis://127.0.0.1:{port}/0")
    store.put_adapter(_adapter("kept"))
    record, key = store.create_tenant("acme", [])
    client = redis.Redis(port=port, decode_responses=True)
    restore = refuse_writes(client, mode, tmp_path / "snapshots")
    try:
        before = store.revision()
        for name, write in _WRITES.items():
            with pytest.raises(StoreUnavailableError, match="refuses writes") as refused:
                write(store)
            assert record.key_hashes[0] not in str(refused.value) and "HSET" not in str(refused.value), name
        assert store.revision() == before and [a.name for a in store.list_adapters()] == ["kept"]
        assert store.tenant_by_key(key) == record and store.usage("acme") == {}
    finally:
        restore()
    assert store.take("acme", "requests", 1, 100).allowed  # writes again once Redis takes them
    client.close()
    store.close()


def test_locked_or_unopenable_sqlite_file_is_unavailable(tmp_path: Path):
    path = tmp_path / SQLITE_FILENAME
    store = SQLiteStore(path, timeout=0.1)
    store.create_tenant("acme", [])
    with closing(sqlite3.connect(path, isolation_level=None)) as other_process:
        other_process.execute("BEGIN IMMEDIATE")  # holds the write lock past the store's timeout
        for write in (
            lambda: store.take("acme", "requests", 1, 10),
            lambda: store.add_usage("acme", None, 1, 1),
            lambda: store.issue_key("acme"),
        ):
            with pytest.raises(StoreUnavailableError, match="database is locked"):
                write()
        assert store.get_tenant("acme") is not None  # WAL: readers do not wait for the writer
        other_process.execute("ROLLBACK")
    assert store.take("acme", "requests", 1, 10).allowed and len(store.issue_key("acme")[0].key_hashes) == 2
    store.close()
    (tmp_path / "a-directory").mkdir()
    with pytest.raises(StoreUnavailableError, match="unable to open"):
        SQLiteStore(tmp_path / "a-directory")
