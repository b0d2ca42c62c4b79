"""Which registry store a server opens: SQLite in its data directory, or Redis when a URL is given."""

from __future__ import annotations

from pathlib import Path

from lora_server.admin.store.base import DEFAULT_REDIS_PREFIX, SQLITE_FILENAME, RegistryStore
from lora_server.admin.store.sqlite import SQLiteStore


def open_store(
    data_dir: str | Path, redis_url: str | None = None, *, redis_prefix: str = DEFAULT_REDIS_PREFIX
) -> RegistryStore:
    """The registry store of a server: Redis at ``redis_url`` under ``redis_prefix`` when a URL is given (replicas
    sharing it share state), else the SQLite file ``data_dir/registry.sqlite3`` (created with its directory)."""
    if redis_url:
        from lora_server.admin.store.redis import RedisStore  # the redis package is needed only with a URL

        return RedisStore(redis_url, prefix=redis_prefix)
    return SQLiteStore(Path(data_dir) / SQLITE_FILENAME)
