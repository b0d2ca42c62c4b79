"""The registry store: what the server knows beyond its command line, shared by its threads and, on one SQLite file or
one Redis prefix, by several server processes.

It holds adapters registered through the admin API, tenants (API keys stored only hashed), fixed one-minute
rate-limit windows and usage counters. ``RegistryStore`` validates its arguments and states the contract; a backend
implements the ``_``-prefixed storage hooks atomically. ``open_store`` picks the backend.
"""

from __future__ import annotations

import math
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from admin.keys import generate_api_key, hash_api_key, verify_api_key

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
RATE_WINDOW_SECONDS = 60
RATE_KINDS = ("requests", "tokens")
BASE_ADAPTER = ""  # the usage key of requests served by the base model (no adapter)
SQLITE_FILENAME = "registry.sqlite3"
DEFAULT_REDIS_PREFIX = "lora-server:"


class TenantExistsError(Exception):
    """``create_tenant`` was given a name that is already taken."""

    def __init__(self, name: str) -> None:
        super().__init__(f"tenant {name!r} already exists")
        self.name = name


def is_valid_name(name: object) -> bool:
    return isinstance(name, str) and NAME_PATTERN.fullmatch(name) is not None


def validate_name(name: object, what: str) -> str:
    """``name`` itself if it is a valid tenant or adapter name, else ValueError saying why."""
    if isinstance(name, str) and NAME_PATTERN.fullmatch(name):
        return name
    raise ValueError(f"invalid {what} {name!r}: use 1 to 64 letters, digits, '.', '_' or '-', "
                     f"starting with a letter or digit")


def _check_count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class AdapterRecord:
    """An adapter registered through the admin API. ``version`` grows by at least one each time the name is
    registered again, so that KV cached under an older version is never reused."""

    name: str
    path: str
    version: int
    pinned: bool
    created_at: float  # seconds since the epoch


@dataclass(frozen=True, slots=True)
class RateLimits:
    """Per-minute limits of a tenant; None means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        for field in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{field} must be a positive integer or None, got {value!r}")


@dataclass(frozen=True, slots=True)
class TenantRecord:
    """A tenant. ``adapters`` is its allow-list; ``default_adapter`` (one of them, or None for the base model) serves
    requests that name no adapter. Only the hash of its API key is kept."""

    name: str
    adapters: tuple[str, ...]
    default_adapter: str | None
    rate_limits: RateLimits
    key_hash: str
    created_at: float  # seconds since the epoch


@dataclass(frozen=True, slots=True)
class RateDecision:
    """The answer of ``take``: whether it was allowed, seconds until the window resets, and what is left in it."""

    allowed: bool
    retry_after: float
    remaining: int


@dataclass(frozen=True, slots=True)
class Usage:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class RegistryStore(ABC):
    """Adapters, tenants, rate-limit windows and usage, behind one interface.

    Every method is safe to call from several threads at once, and every write is atomic: two stores on the same
    storage (two server replicas) never lose each other's updates. Writes validate names (see ``NAME_PATTERN``) and
    raise ValueError with the reason; reads given a name that cannot exist answer None / False / {}.
    """

    # -- adapters -------------------------------------------------------------------------------------------------

    def put_adapter(self, record: AdapterRecord) -> AdapterRecord:
        """Insert ``record``, or replace the adapter of that name; returns what was stored.

        A new name is stored with ``record.version``; a replace stores ``max(record.version, old version + 1)``.
        """
        validate_name(record.name, "adapter name")
        if not isinstance(record.path, str) or not record.path:
            raise ValueError("adapter path must be a non-empty string")
        if isinstance(record.version, bool) or not isinstance(record.version, int) or record.version < 1:
            raise ValueError(f"adapter version must be a positive integer, got {record.version!r}")
        return self._put_adapter(record)

    def get_adapter(self, name: str) -> AdapterRecord | None:
        return self._get_adapter(name) if is_valid_name(name) else None

    def list_adapters(self) -> list[AdapterRecord]:
        """All registered adapters, sorted by name."""
        return self._list_adapters()

    def delete_adapter(self, name: str) -> bool:
        """Remove the adapter; False if there was none of that name."""
        return self._delete_adapter(name) if is_valid_name(name) else False

    # -- tenants --------------------------------------------------------------------------------------------------

    def create_tenant(self, name: str, adapters: Sequence[str], default_adapter: str | None = None,
                      rate_limits: RateLimits | None = None) -> tuple[TenantRecord, str]:
        """Create a tenant with a new API key; returns the record and the plaintext key, which is stored nowhere
        and cannot be read back. Raises TenantExistsError if the name is taken, ValueError on invalid arguments."""
        validate_name(name, "tenant name")
        if isinstance(adapters, str):
            raise ValueError("adapters must be a list of adapter names, not a string")
        allowed = tuple(dict.fromkeys(validate_name(a, "adapter name") for a in adapters))
        if default_adapter is not None and default_adapter not in allowed:
            raise ValueError(f"default_adapter {default_adapter!r} is not among the tenant's adapters")
        rate_limits = RateLimits() if rate_limits is None else rate_limits
        if not isinstance(rate_limits, RateLimits):
            raise ValueError(f"rate_limits must be a RateLimits, got {type(rate_limits).__name__}")
        api_key = generate_api_key()
        record = TenantRecord(name=name, adapters=allowed, default_adapter=default_adapter, rate_limits=rate_limits,
                              key_hash=hash_api_key(api_key), created_at=time.time())
        if not self._insert_tenant(record):
            raise TenantExistsError(name)
        return record, api_key

    def get_tenant(self, name: str) -> TenantRecord | None:
        return self._get_tenant(name) if is_valid_name(name) else None

    def list_tenants(self) -> list[TenantRecord]:
        """All tenants, sorted by name."""
        return self._list_tenants()

    def delete_tenant(self, name: str) -> bool:
        """Remove the tenant, its usage and its rate-limit windows; False if there was none of that name."""
        return self._delete_tenant(name) if is_valid_name(name) else False

    def authenticate(self, tenant: str, api_key: str) -> TenantRecord | None:
        """The tenant if ``api_key`` is its key, else None (also for unknown tenants and malformed input).

        Hashes are compared in constant time. Whether a tenant exists is not hidden: tenant names are in URLs.
        """
        if not is_valid_name(tenant) or not isinstance(api_key, str):
            return None
        record = self._get_tenant(tenant)
        if record is None or not verify_api_key(api_key, record.key_hash):
            return None
        return record

    # -- rate limits ----------------------------------------------------------------------------------------------

    def take(self, tenant: str, kind: str, amount: int, limit: int, now: float | None = None) -> RateDecision:
        """Take ``amount`` from the tenant's ``kind`` budget ("requests" or "tokens") of the current fixed window.

        Windows are ``[k * 60, (k + 1) * 60)`` seconds since the epoch (``now`` defaults to ``time.time()``). Allowed
        iff what the window has used plus ``amount`` is at most ``limit``; the check and the increment are one atomic
        step, and a refused take consumes nothing. ``retry_after`` is the time left until the window ends (the same
        for allowed and refused takes); ``remaining`` is ``limit`` minus what the window has used after this take.
        An ``amount`` above ``limit`` is never allowed: callers should refuse such requests outright.
        """
        validate_name(tenant, "tenant name")
        if kind not in RATE_KINDS:
            raise ValueError(f"rate-limit kind must be one of {RATE_KINDS}, got {kind!r}")
        _check_count(amount, "amount")
        _check_count(limit, "limit")
        now = time.time() if now is None else now
        window = math.floor(now / RATE_WINDOW_SECONDS)
        retry_after = (window + 1) * RATE_WINDOW_SECONDS - now
        allowed, used = self._take(tenant, kind, window, amount, limit, retry_after)
        return RateDecision(allowed=allowed, retry_after=retry_after, remaining=max(0, limit - used))

    # -- usage ----------------------------------------------------------------------------------------------------

    def add_usage(self, tenant: str, adapter: str | None, prompt_tokens: int, completion_tokens: int,
                  requests: int = 1) -> None:
        """Add to the tenant's counters for ``adapter`` (None: the base model). Atomic."""
        validate_name(tenant, "tenant name")
        adapter_key = BASE_ADAPTER if adapter is None else validate_name(adapter, "adapter name")
        delta = Usage(requests=_check_count(requests, "requests"),
                      prompt_tokens=_check_count(prompt_tokens, "prompt_tokens"),
                      completion_tokens=_check_count(completion_tokens, "completion_tokens"))
        self._add_usage(tenant, adapter_key, delta)

    def usage(self, tenant: str) -> dict[str, Usage]:
        """The tenant's totals per adapter name (``BASE_ADAPTER``, "", for the base model); {} if none."""
        return self._usage(tenant) if is_valid_name(tenant) else {}

    # -- lifetime -------------------------------------------------------------------------------------------------

    @abstractmethod
    def close(self) -> None:
        """Release the connection; calling it again does nothing."""

    def __enter__(self) -> RegistryStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- storage hooks: arguments are validated; each call is atomic -----------------------------------------------

    @abstractmethod
    def _put_adapter(self, record: AdapterRecord) -> AdapterRecord: ...

    @abstractmethod
    def _get_adapter(self, name: str) -> AdapterRecord | None: ...

    @abstractmethod
    def _list_adapters(self) -> list[AdapterRecord]: ...

    @abstractmethod
    def _delete_adapter(self, name: str) -> bool: ...

    @abstractmethod
    def _insert_tenant(self, record: TenantRecord) -> bool:
        """Store a new tenant; False (and no change) if the name is taken."""

    @abstractmethod
    def _get_tenant(self, name: str) -> TenantRecord | None: ...

    @abstractmethod
    def _list_tenants(self) -> list[TenantRecord]: ...

    @abstractmethod
    def _delete_tenant(self, name: str) -> bool: ...

    @abstractmethod
    def _take(self, tenant: str, kind: str, window: int, amount: int, limit: int,
              seconds_left: float) -> tuple[bool, int]:
        """Add ``amount`` to counter (tenant, kind, window) unless that would exceed ``limit``; returns (allowed,
        the counter afterwards). ``seconds_left`` is the window's remaining time, for expiring the counter."""

    @abstractmethod
    def _add_usage(self, tenant: str, adapter: str, delta: Usage) -> None: ...

    @abstractmethod
    def _usage(self, tenant: str) -> dict[str, Usage]: ...


def open_store(data_dir: str | Path, redis_url: str | None = None, *,
               redis_prefix: str = DEFAULT_REDIS_PREFIX) -> RegistryStore:
    """The registry store of a server: Redis at ``redis_url`` under ``redis_prefix`` when a URL is given (replicas
    sharing it share state), else the SQLite file ``data_dir/registry.sqlite3`` (created with its directory)."""
    # The backends import this module, hence the imports here; the redis package is needed only with a URL.
    if redis_url:
        from admin.redis_store import RedisStore

        return RedisStore(redis_url, prefix=redis_prefix)
    from admin.sqlite_store import SQLiteStore

    return SQLiteStore(Path(data_dir) / SQLITE_FILENAME)
