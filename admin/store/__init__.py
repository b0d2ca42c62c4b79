"""The registry store: adapters registered through the admin API, tenants and their hashed API keys, rate-limit
windows and usage, shared by a server's threads and by the processes on one SQLite file or one Redis prefix. Every
request's tenant check reads it; it imports no web framework and nothing of the engine.

- ``base``: the contract (``RegistryStore``: validation, then the backends' atomic storage hooks), the records,
  names and errors; re-exported here, the names callers import from ``lora_server.admin.store``.
- ``sqlite``: ``SQLiteStore``, one file in WAL mode (the default, embedded).
- ``redis``: ``RedisStore``, shared by replicas (needs the ``redis`` package; imported only when used).
- ``open``: ``open_store``, which backend a server opens (re-exported here).
- ``change_feed``: ``open_feed``, the wake-up call when the store's revision moves (Redis pub/sub, or polling).
- ``keys``: API keys (generation, hashing, constant-time comparison).

The modules of this package import ``base`` and each other directly, never this ``__init__`` (which imports them):
no cycle. The ``redis`` package is imported only when a Redis store or its feed is opened.
"""

from lora_server.admin.store.base import (
    BASE_ADAPTER,
    DEFAULT_REDIS_PREFIX,
    KEY_ID_HEX_DIGITS,
    MAX_KEYS_PER_TENANT,
    MAX_NAME_SHOWN,
    MAX_TENANT_WEIGHT,
    NAME_PATTERN,
    RATE_KINDS,
    RATE_WINDOW_SECONDS,
    SQLITE_FILENAME,
    AdapterRecord,
    RateDecision,
    RateLimits,
    RegistryStore,
    StoreStatus,
    TenantRecord,
    Usage,
    check_weight,
    is_valid_name,
    key_id,
    validate_name,
)
from lora_server.admin.store.errors import StoreUnavailableError, TenantExistsError, UnknownKeyError, UnknownTenantError
from lora_server.admin.store.open import open_store

__all__ = [
    "BASE_ADAPTER",
    "DEFAULT_REDIS_PREFIX",
    "KEY_ID_HEX_DIGITS",
    "MAX_KEYS_PER_TENANT",
    "MAX_NAME_SHOWN",
    "MAX_TENANT_WEIGHT",
    "NAME_PATTERN",
    "RATE_KINDS",
    "RATE_WINDOW_SECONDS",
    "SQLITE_FILENAME",
    "AdapterRecord",
    "RateDecision",
    "RateLimits",
    "RegistryStore",
    "StoreStatus",
    "StoreUnavailableError",
    "TenantExistsError",
    "TenantRecord",
    "UnknownKeyError",
    "UnknownTenantError",
    "Usage",
    "check_weight",
    "is_valid_name",
    "key_id",
    "open_store",
    "validate_name",
]
