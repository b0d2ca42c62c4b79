"""The embedded registry store: one SQLite file in WAL mode (readers never wait for the writer).

One connection per store, guarded by a lock, serves all of the server's threads. Writes run in ``BEGIN IMMEDIATE``
transactions, which take the file's write lock up front, so that several processes on one file (waiting up to
``timeout`` seconds for each other) also update it atomically.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from admin.store import AdapterRecord, RateLimits, RegistryStore, TenantRecord, Usage

SCHEMA_VERSION = 1
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS adapters (
        name TEXT PRIMARY KEY, path TEXT NOT NULL, version INTEGER NOT NULL, pinned INTEGER NOT NULL,
        created_at REAL NOT NULL)""",
    # adapters: a JSON list of names, in the order given
    """CREATE TABLE IF NOT EXISTS tenants (
        name TEXT PRIMARY KEY, adapters TEXT NOT NULL, default_adapter TEXT, requests_per_minute INTEGER,
        tokens_per_minute INTEGER, key_hash TEXT NOT NULL, created_at REAL NOT NULL)""",
    # window_index: floor(seconds since the epoch / 60); take() deletes a tenant's older windows as it goes
    """CREATE TABLE IF NOT EXISTS rate_windows (
        tenant TEXT NOT NULL, kind TEXT NOT NULL, window_index INTEGER NOT NULL, used INTEGER NOT NULL,
        PRIMARY KEY (tenant, kind, window_index))""",
    # adapter: '' for the base model
    """CREATE TABLE IF NOT EXISTS usage (
        tenant TEXT NOT NULL, adapter TEXT NOT NULL, requests INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL, PRIMARY KEY (tenant, adapter))""",
)
_ADAPTER_COLUMNS = "name, path, version, pinned, created_at"
_TENANT_COLUMNS = "name, adapters, default_adapter, requests_per_minute, tokens_per_minute, key_hash, created_at"


def _adapter(row: tuple) -> AdapterRecord:
    name, path, version, pinned, created_at = row
    return AdapterRecord(name=name, path=path, version=version, pinned=bool(pinned), created_at=created_at)


def _tenant(row: tuple) -> TenantRecord:
    name, adapters, default_adapter, requests_per_minute, tokens_per_minute, key_hash, created_at = row
    return TenantRecord(name=name, adapters=tuple(json.loads(adapters)), default_adapter=default_adapter,
                        rate_limits=RateLimits(requests_per_minute, tokens_per_minute), key_hash=key_hash,
                        created_at=created_at)


class SQLiteStore(RegistryStore):
    def __init__(self, path: str | Path, *, timeout: float = 10.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # isolation_level=None: no implicit transactions; every write below opens its own BEGIN IMMEDIATE.
        self._conn = sqlite3.connect(self.path, timeout=timeout, isolation_level=None, check_same_thread=False)
        self._closed = False
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; never corrupt in WAL mode
        with self._transaction() as conn:
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """The connection inside one write transaction: committed when the block ends, rolled back if it raises."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _query(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._conn.close()
                self._closed = True

    # -- adapters -------------------------------------------------------------------------------------------------

    def _put_adapter(self, record: AdapterRecord) -> AdapterRecord:
        with self._transaction() as conn:
            row = conn.execute("SELECT version FROM adapters WHERE name = ?", (record.name,)).fetchone()
            if row is not None:
                record = replace(record, version=max(record.version, row[0] + 1))
            conn.execute(f"INSERT OR REPLACE INTO adapters ({_ADAPTER_COLUMNS}) VALUES (?, ?, ?, ?, ?)",
                         (record.name, record.path, record.version, int(record.pinned), record.created_at))
        return record

    def _get_adapter(self, name: str) -> AdapterRecord | None:
        rows = self._query(f"SELECT {_ADAPTER_COLUMNS} FROM adapters WHERE name = ?", (name,))
        return _adapter(rows[0]) if rows else None

    def _list_adapters(self) -> list[AdapterRecord]:
        return [_adapter(row) for row in self._query(f"SELECT {_ADAPTER_COLUMNS} FROM adapters ORDER BY name")]

    def _delete_adapter(self, name: str) -> bool:
        with self._transaction() as conn:
            return conn.execute("DELETE FROM adapters WHERE name = ?", (name,)).rowcount > 0

    # -- tenants --------------------------------------------------------------------------------------------------

    def _insert_tenant(self, record: TenantRecord) -> bool:
        with self._transaction() as conn:
            cursor = conn.execute(
                f"INSERT OR IGNORE INTO tenants ({_TENANT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (record.name, json.dumps(list(record.adapters)), record.default_adapter,
                 record.rate_limits.requests_per_minute, record.rate_limits.tokens_per_minute, record.key_hash,
                 record.created_at))
            return cursor.rowcount > 0

    def _get_tenant(self, name: str) -> TenantRecord | None:
        rows = self._query(f"SELECT {_TENANT_COLUMNS} FROM tenants WHERE name = ?", (name,))
        return _tenant(rows[0]) if rows else None

    def _list_tenants(self) -> list[TenantRecord]:
        return [_tenant(row) for row in self._query(f"SELECT {_TENANT_COLUMNS} FROM tenants ORDER BY name")]

    def _delete_tenant(self, name: str) -> bool:
        with self._transaction() as conn:
            deleted = conn.execute("DELETE FROM tenants WHERE name = ?", (name,)).rowcount > 0
            conn.execute("DELETE FROM usage WHERE tenant = ?", (name,))
            conn.execute("DELETE FROM rate_windows WHERE tenant = ?", (name,))
            return deleted

    # -- rate limits and usage ------------------------------------------------------------------------------------

    def _take(self, tenant: str, kind: str, window: int, amount: int, limit: int,
              seconds_left: float) -> tuple[bool, int]:
        key = (tenant, kind, window)
        with self._transaction() as conn:
            conn.execute("DELETE FROM rate_windows WHERE tenant = ? AND kind = ? AND window_index < ?", key)
            row = conn.execute("SELECT used FROM rate_windows WHERE tenant = ? AND kind = ? AND window_index = ?",
                               key).fetchone()
            used = 0 if row is None else row[0]
            if used + amount > limit:
                return False, used
            conn.execute("INSERT INTO rate_windows (tenant, kind, window_index, used) VALUES (?, ?, ?, ?) "
                         "ON CONFLICT (tenant, kind, window_index) DO UPDATE SET used = used + excluded.used",
                         (*key, amount))
            return True, used + amount

    def _add_usage(self, tenant: str, adapter: str, delta: Usage) -> None:
        with self._transaction() as conn:
            conn.execute(
                "INSERT INTO usage (tenant, adapter, requests, prompt_tokens, completion_tokens) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, adapter) DO UPDATE SET "
                "requests = requests + excluded.requests, prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
                "completion_tokens = completion_tokens + excluded.completion_tokens",
                (tenant, adapter, delta.requests, delta.prompt_tokens, delta.completion_tokens))

    def _usage(self, tenant: str) -> dict[str, Usage]:
        rows = self._query("SELECT adapter, requests, prompt_tokens, completion_tokens FROM usage WHERE tenant = ?",
                           (tenant,))
        return {adapter: Usage(requests, prompt, completion) for adapter, requests, prompt, completion in rows}
