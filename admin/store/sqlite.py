"""The embedded registry store: one SQLite file in WAL mode (readers never wait for the writer).

Two connections per store serve all of the server's threads, each guarded by a lock of its own: one writes, one
reads. Writes run in ``BEGIN IMMEDIATE`` transactions, which take the file's write lock up front, so that several
processes on one file (waiting up to ``timeout`` seconds for each other) also update it atomically. Reads never
wait for a writer, of this process or another: WAL gives them the last committed state, and a write waiting for the
file's lock holds only the writing connection (so a tenant's key is looked up while another process holds the
lock, rather than after the store's timeout). A tenant's keys are rows of ``tenant_keys``, which is
also the index from key hash to tenant.

Schema versions (``PRAGMA user_version``): 1 kept one key hash per tenant in ``tenants.key_hash``; 2 keeps them in
``tenant_keys``; 3 adds each tenant's share of the engine (``weight``, ``max_running``; 1 and 0 for tenants made
before); 4 adds the registry's revision (one row of ``revision``, 0 in a file made before). Opening an older file
migrates it, in one transaction.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from lora_server.admin.store.base import (
    MAX_KEYS_PER_TENANT,
    AdapterRecord,
    RateLimits,
    RegistryStore,
    StoreStatus,
    TenantRecord,
    Usage,
)
from lora_server.admin.store.errors import StoreUnavailableError

SCHEMA_VERSION = 4
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS adapters (
        name TEXT PRIMARY KEY, path TEXT NOT NULL, version INTEGER NOT NULL, pinned INTEGER NOT NULL,
        created_at REAL NOT NULL)""",
    # adapters: a JSON list of names, in the order given
    """CREATE TABLE IF NOT EXISTS tenants (
        name TEXT PRIMARY KEY, adapters TEXT NOT NULL, default_adapter TEXT, requests_per_minute INTEGER,
        tokens_per_minute INTEGER, created_at REAL NOT NULL, weight REAL NOT NULL DEFAULT 1.0,
        max_running INTEGER NOT NULL DEFAULT 0)""",
    # 1 or 2 rows per tenant; rowid order is the order the keys were added in
    "CREATE TABLE IF NOT EXISTS tenant_keys (key_hash TEXT PRIMARY KEY, tenant TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS tenant_keys_by_tenant ON tenant_keys (tenant)",
    # window_index: floor(seconds since the epoch / 60); take() deletes a tenant's older windows as it goes
    """CREATE TABLE IF NOT EXISTS rate_windows (
        tenant TEXT NOT NULL, kind TEXT NOT NULL, window_index INTEGER NOT NULL, used INTEGER NOT NULL,
        PRIMARY KEY (tenant, kind, window_index))""",
    # adapter: '' for the base model
    """CREATE TABLE IF NOT EXISTS usage (
        tenant TEXT NOT NULL, adapter TEXT NOT NULL, requests INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL, PRIMARY KEY (tenant, adapter))""",
    # exactly one row: the store's revision (RegistryStore.revision)
    "CREATE TABLE IF NOT EXISTS revision (id INTEGER PRIMARY KEY CHECK (id = 0), value INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO revision (id, value) VALUES (0, 0)",
)
_ADAPTER_COLUMNS = "name, path, version, pinned, created_at"
_TENANT_COLUMNS_V2 = "name, adapters, default_adapter, requests_per_minute, tokens_per_minute, created_at"
_TENANT_COLUMNS = f"{_TENANT_COLUMNS_V2}, weight, max_running"
# The OperationalErrors that mean the file cannot be used now (busy, gone, unreadable), not that a statement is wrong.
_UNAVAILABLE_MESSAGES = (
    "database is locked",
    "database table is locked",
    "unable to open database file",
    "disk I/O error",
)


def _adapter(row: tuple) -> AdapterRecord:
    name, path, version, pinned, created_at = row
    return AdapterRecord(name=name, path=path, version=version, pinned=bool(pinned), created_at=created_at)


def _select_tenants(conn: sqlite3.Connection, where: str = "", params: tuple = ()) -> list[TenantRecord]:
    """The tenants that ``where`` (a clause on ``tenants``) selects, sorted by name, each with its keys. Run inside
    a transaction, so that both queries see the same state."""
    rows = conn.execute(f"SELECT {_TENANT_COLUMNS} FROM tenants {where} ORDER BY name", params).fetchall()
    key_hashes: dict[str, list[str]] = {}
    for tenant, key_hash in conn.execute(
        f"SELECT tenant, key_hash FROM tenant_keys WHERE tenant IN (SELECT name FROM tenants {where}) ORDER BY rowid",
        params,
    ):
        key_hashes.setdefault(tenant, []).append(key_hash)
    records = []
    for name, adapters, default_adapter, requests_per_minute, tokens_per_minute, created_at, weight, cap in rows:
        records.append(
            TenantRecord(
                name=name,
                adapters=tuple(json.loads(adapters)),
                default_adapter=default_adapter,
                rate_limits=RateLimits(requests_per_minute, tokens_per_minute),
                key_hashes=tuple(key_hashes[name]),
                created_at=created_at,
                weight=weight,
                max_running=cap,
            )
        )
    return records


def _select_tenant(conn: sqlite3.Connection, name: str) -> TenantRecord | None:
    records = _select_tenants(conn, "WHERE name = ?", (name,))
    return records[0] if records else None


def _migrate_from_v1(conn: sqlite3.Connection) -> None:
    """Move each tenant's ``key_hash`` column into ``tenant_keys`` (SQLite before 3.35 cannot drop a column, hence
    the copy into a new ``tenants`` table)."""
    conn.execute("ALTER TABLE tenants RENAME TO tenants_v1")
    for statement in _SCHEMA:
        conn.execute(statement)
    conn.execute(f"INSERT INTO tenants ({_TENANT_COLUMNS_V2}) SELECT {_TENANT_COLUMNS_V2} FROM tenants_v1")
    conn.execute("INSERT INTO tenant_keys (key_hash, tenant) SELECT key_hash, name FROM tenants_v1 ORDER BY name")
    conn.execute("DROP TABLE tenants_v1")


def _migrate_from_v2(conn: sqlite3.Connection) -> None:
    """Give every tenant the default share: weight 1, no cap of running requests."""
    conn.execute("ALTER TABLE tenants ADD COLUMN weight REAL NOT NULL DEFAULT 1.0")
    conn.execute("ALTER TABLE tenants ADD COLUMN max_running INTEGER NOT NULL DEFAULT 0")


class SQLiteStore(RegistryStore):
    def __init__(self, path: str | Path, *, timeout: float = 10.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # the writing connection's
        self._read_lock = threading.Lock()  # the reading connection's
        with self._reachable():
            # isolation_level=None: no implicit transactions; every write below opens its own BEGIN IMMEDIATE.
            self._conn = sqlite3.connect(self.path, timeout=timeout, isolation_level=None, check_same_thread=False)
        self._closed = False
        with self._lock, self._reachable():
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; never corrupt in WAL mode
            self._reader = sqlite3.connect(self.path, timeout=timeout, isolation_level=None, check_same_thread=False)
        with self._transaction() as conn:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"{self.path} has schema version {version}, written by a newer lora-server; "
                    f"this one knows versions up to {SCHEMA_VERSION}"
                )
            if version == 1:
                _migrate_from_v1(conn)  # to the current tenants table at once
            elif version == 2:
                _migrate_from_v2(conn)
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @contextmanager
    def _reachable(self) -> Iterator[None]:
        """Turns SQLite's "the file cannot be used now" errors in the block into StoreUnavailableError."""
        try:
            yield
        except sqlite3.OperationalError as exc:
            if not str(exc).startswith(_UNAVAILABLE_MESSAGES):
                raise
            raise StoreUnavailableError(f"the registry store (sqlite at {self.path}) is unavailable: {exc}") from exc

    @contextmanager
    def _transaction(self, *, write: bool = True) -> Iterator[sqlite3.Connection]:
        """The connection inside one transaction: committed when the block ends, rolled back if it raises. A write
        transaction takes the file's write lock up front; a read one only makes its queries see one state."""
        conn, lock = (self._conn, self._lock) if write else (self._reader, self._read_lock)
        with lock, self._reachable():
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN DEFERRED")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:  # SQLite rolls back by itself after some errors (I/O, full disk)
                    conn.execute("ROLLBACK")
                raise

    @staticmethod
    def _bump(conn: sqlite3.Connection) -> None:
        """Count one change to adapters or tenants (inside the transaction that made it)."""
        conn.execute("UPDATE revision SET value = value + 1")

    def _query(self, sql: str, params: tuple = ()) -> list[tuple]:
        """A read outside any transaction, on the reading connection."""
        with self._read_lock, self._reachable():
            return self._reader.execute(sql, params).fetchall()

    def status(self) -> StoreStatus:
        return StoreStatus(backend="sqlite", reachable=True, persistent=True, detail=str(self.path))

    def close(self) -> None:
        with self._lock, self._read_lock:
            if not self._closed:
                self._conn.close()
                self._reader.close()
                self._closed = True

    def _revision(self) -> int:
        return self._query("SELECT value FROM revision")[0][0]

    # -- adapters -------------------------------------------------------------------------------------------------

    def _put_adapter(self, record: AdapterRecord) -> AdapterRecord:
        return self._put_adapters([record])[0]

    def _put_adapters(self, records: Sequence[AdapterRecord]) -> list[AdapterRecord]:
        stored = []
        with self._transaction() as conn:
            for record in records:
                row = conn.execute("SELECT version FROM adapters WHERE name = ?", (record.name,)).fetchone()
                stored.append(record if row is None else replace(record, version=max(record.version, row[0] + 1)))
            conn.executemany(
                f"INSERT OR REPLACE INTO adapters ({_ADAPTER_COLUMNS}) VALUES (?, ?, ?, ?, ?)",
                [(r.name, r.path, r.version, int(r.pinned), r.created_at) for r in stored],
            )
            self._bump(conn)
        return stored

    def _get_adapter(self, name: str) -> AdapterRecord | None:
        rows = self._query(f"SELECT {_ADAPTER_COLUMNS} FROM adapters WHERE name = ?", (name,))
        return _adapter(rows[0]) if rows else None

    def _list_adapters(self) -> list[AdapterRecord]:
        return [_adapter(row) for row in self._query(f"SELECT {_ADAPTER_COLUMNS} FROM adapters ORDER BY name")]

    def _delete_adapter(self, name: str) -> bool:
        with self._transaction() as conn:
            deleted = conn.execute("DELETE FROM adapters WHERE name = ?", (name,)).rowcount > 0
            if deleted:
                self._bump(conn)
            return deleted

    # -- tenants --------------------------------------------------------------------------------------------------

    def _insert_tenant(self, record: TenantRecord) -> bool:
        with self._transaction() as conn:
            cursor = conn.execute(
                f"INSERT OR IGNORE INTO tenants ({_TENANT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.name,
                    json.dumps(list(record.adapters)),
                    record.default_adapter,
                    record.rate_limits.requests_per_minute,
                    record.rate_limits.tokens_per_minute,
                    record.created_at,
                    record.weight,
                    record.max_running,
                ),
            )
            if cursor.rowcount == 0:
                return False
            conn.execute("DELETE FROM usage WHERE tenant = ?", (record.name,))  # a former tenant's, if any remain
            conn.execute("DELETE FROM rate_windows WHERE tenant = ?", (record.name,))
            conn.executemany(
                "INSERT INTO tenant_keys (key_hash, tenant) VALUES (?, ?)",
                [(key_hash, record.name) for key_hash in record.key_hashes],
            )
            self._bump(conn)
            return True

    def _get_tenant(self, name: str) -> TenantRecord | None:
        with self._transaction(write=False) as conn:
            return _select_tenant(conn, name)

    def _list_tenants(self) -> list[TenantRecord]:
        with self._transaction(write=False) as conn:
            return _select_tenants(conn)

    def _has_tenants(self) -> bool:
        return bool(self._query("SELECT EXISTS (SELECT 1 FROM tenants)")[0][0])

    def _delete_tenant(self, name: str) -> bool:
        with self._transaction() as conn:
            deleted = conn.execute("DELETE FROM tenants WHERE name = ?", (name,)).rowcount > 0
            conn.execute("DELETE FROM tenant_keys WHERE tenant = ?", (name,))
            conn.execute("DELETE FROM usage WHERE tenant = ?", (name,))
            conn.execute("DELETE FROM rate_windows WHERE tenant = ?", (name,))
            if deleted:
                self._bump(conn)
            return deleted

    def _set_share(self, name: str, weight: float | None, max_running: int | None) -> TenantRecord | None:
        with self._transaction() as conn:
            updated = conn.execute(
                "UPDATE tenants SET weight = COALESCE(?, weight), max_running = COALESCE(?, max_running) "
                "WHERE name = ?",
                (weight, max_running, name),
            ).rowcount
            if updated:
                self._bump(conn)
            return _select_tenant(conn, name)

    def _tenant_by_key_hash(self, key_hash: str) -> TenantRecord | None:
        with self._transaction(write=False) as conn:
            records = _select_tenants(
                conn, "WHERE name = (SELECT tenant FROM tenant_keys WHERE key_hash = ?)", (key_hash,)
            )
            return records[0] if records else None

    def _add_key(self, name: str, key_hash: str) -> TenantRecord | None:
        with self._transaction() as conn:
            record = _select_tenant(conn, name)
            if record is None or len(record.key_hashes) >= MAX_KEYS_PER_TENANT:
                return record
            conn.execute("INSERT INTO tenant_keys (key_hash, tenant) VALUES (?, ?)", (key_hash, name))
            self._bump(conn)
            return replace(record, key_hashes=(*record.key_hashes, key_hash))

    def _remove_key(self, name: str, key_hash: str) -> TenantRecord | None:
        with self._transaction() as conn:
            record = _select_tenant(conn, name)
            if record is None or key_hash not in record.key_hashes or len(record.key_hashes) == 1:
                return record
            conn.execute("DELETE FROM tenant_keys WHERE key_hash = ?", (key_hash,))
            self._bump(conn)
            return replace(record, key_hashes=tuple(h for h in record.key_hashes if h != key_hash))

    # -- rate limits and usage ------------------------------------------------------------------------------------

    def _take(
        self, tenant: str, kind: str, window: int, amount: int, limit: int, seconds_left: float
    ) -> tuple[bool, int]:
        key = (tenant, kind, window)
        with self._transaction() as conn:
            conn.execute("DELETE FROM rate_windows WHERE tenant = ? AND kind = ? AND window_index < ?", key)
            row = conn.execute(
                "SELECT used FROM rate_windows WHERE tenant = ? AND kind = ? AND window_index = ?", key
            ).fetchone()
            used = 0 if row is None else row[0]
            if used + amount > limit:
                return False, used
            conn.execute(
                "INSERT INTO rate_windows (tenant, kind, window_index, used) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (tenant, kind, window_index) DO UPDATE SET used = used + excluded.used",
                (*key, amount),
            )
            return True, used + amount

    def _give_back(self, tenant: str, kind: str, window: int, amount: int) -> None:
        with self._transaction() as conn:
            conn.execute(
                "UPDATE rate_windows SET used = MAX(0, used - ?) WHERE tenant = ? AND kind = ? AND window_index = ?",
                (amount, tenant, kind, window),
            )

    def _add_usage(self, tenant: str, adapter: str, delta: Usage, created_at: float | None) -> None:
        with self._transaction() as conn:
            conn.execute(
                "INSERT INTO usage (tenant, adapter, requests, prompt_tokens, completion_tokens) "
                "SELECT :tenant, :adapter, :requests, :prompt, :completion WHERE EXISTS "
                "(SELECT 1 FROM tenants WHERE name = :tenant AND (:created IS NULL OR created_at = :created)) "
                "ON CONFLICT (tenant, adapter) DO UPDATE SET "
                "requests = requests + excluded.requests, prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
                "completion_tokens = completion_tokens + excluded.completion_tokens",
                {
                    "tenant": tenant,
                    "adapter": adapter,
                    "requests": delta.requests,
                    "prompt": delta.prompt_tokens,
                    "completion": delta.completion_tokens,
                    "created": created_at,
                },
            )

    def _usage(self, tenant: str) -> dict[str, Usage]:
        rows = self._query(
            "SELECT adapter, requests, prompt_tokens, completion_tokens FROM usage WHERE tenant = ?", (tenant,)
        )
        return {adapter: Usage(requests, prompt, completion) for adapter, requests, prompt, completion in rows}
