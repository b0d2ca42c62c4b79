"""The registry store: what the server knows beyond its command line, shared by its threads and, on one SQLite file or
one Redis prefix, by several server processes.

It holds adapters registered through the admin API, tenants (API keys stored only hashed, up to two per tenant so
that a key can be rotated without downtime), fixed one-minute rate-limit windows and usage counters. ``RegistryStore``
validates its arguments and states the contract; a backend implements the ``_``-prefixed storage hooks atomically.
``admin.store.open`` picks the backend. A revision counter, bumped by every write to adapters and tenants, tells
processes sharing a store that it changed (``admin.store.change_feed``).
"""

from __future__ import annotations

import math
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

from lora_server.admin.store.errors import TenantExistsError, UnknownKeyError, UnknownTenantError
from lora_server.admin.store.keys import API_KEY_PREFIX, generate_api_key, hash_api_key, verify_api_key

# Tenant and adapter names: 1 to 64 ASCII letters, digits, '.', '_' or '-', a letter or digit first, no '..' (a name
# may become a directory's name under an adapter root, and is part of Redis keys and URLs).
NAME_PATTERN = re.compile(r"(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_NAME_SHOWN = 80  # characters of a refused name quoted back
RATE_WINDOW_SECONDS = 60
RATE_KINDS = ("requests", "tokens")
BASE_ADAPTER = ""  # the usage key of requests served by the base model (no adapter)
SQLITE_FILENAME = "registry.sqlite3"
DEFAULT_REDIS_PREFIX = "lora-server:"
MAX_KEYS_PER_TENANT = 2  # the old key and its successor, while clients move over
MAX_TENANT_WEIGHT = 1000.0
KEY_ID_HEX_DIGITS = 12


def is_valid_name(name: object) -> bool:
    return isinstance(name, str) and NAME_PATTERN.fullmatch(name) is not None


def validate_name(name: object, what: str) -> str:
    """``name`` itself if it is a valid tenant or adapter name, else ValueError saying why."""
    if isinstance(name, str) and NAME_PATTERN.fullmatch(name):
        return name
    shown = repr(name[:MAX_NAME_SHOWN]) + ("..." if len(name) > MAX_NAME_SHOWN else "") if isinstance(name, str) else ""
    raise ValueError(
        f"invalid {what} {shown}: use 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit, "
        "without '..'"
    )


def key_id(key_hash: str) -> str:
    """The public id of a stored key: the first 12 hex digits of its digest (``key_hash`` is ``"sha256:<hex>"``).

    It names a key in the admin API and in logs, where the hash itself should not appear; it says nothing useful
    about the key, whose 256 random bits the digest does not reveal.
    """
    return key_hash.rpartition(":")[2][:KEY_ID_HEX_DIGITS]


def _check_kind(kind: object) -> None:
    if kind not in RATE_KINDS:
        raise ValueError(f"rate-limit kind must be one of {RATE_KINDS}, got {kind!r}")


def check_weight(value: object) -> float:
    """A tenant's weight: a number in (0, MAX_TENANT_WEIGHT], else ValueError saying why."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_TENANT_WEIGHT:
        raise ValueError(f"weight must be a number in (0, {MAX_TENANT_WEIGHT:g}], got {value!r}")
    return float(value)


def _check_adapter(record: AdapterRecord) -> None:
    """ValueError saying why unless ``record`` can be stored: a valid name, a path, a positive version."""
    validate_name(record.name, "adapter name")
    if not isinstance(record.path, str) or not record.path:
        raise ValueError("adapter path must be a non-empty string")
    if isinstance(record.version, bool) or not isinstance(record.version, int) or record.version < 1:
        raise ValueError(f"adapter version must be a positive integer, got {record.version!r}")


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
    requests that name no adapter. ``key_hashes`` are the hashes of its API keys, oldest first: one, or two while a
    key is being rotated; each of them authenticates the tenant. The keys themselves are kept nowhere.

    Its share of the engine: ``weight`` (waiting requests are admitted by weighted fair sharing of tokens across
    tenants: weight 2 gets twice the tokens of weight 1 while both wait) and ``max_running``, the most of its
    requests running at once (0: no cap)."""

    name: str
    adapters: tuple[str, ...]
    default_adapter: str | None
    rate_limits: RateLimits
    key_hashes: tuple[str, ...]
    created_at: float  # seconds since the epoch
    weight: float = 1.0
    max_running: int = 0

    def __post_init__(self) -> None:
        if not 1 <= len(self.key_hashes) <= MAX_KEYS_PER_TENANT:
            raise ValueError(f"a tenant holds 1 to {MAX_KEYS_PER_TENANT} keys, got {len(self.key_hashes)}")

    @property
    def key_ids(self) -> tuple[str, ...]:
        """The public ids of the tenant's keys (see ``key_id``), in the order of ``key_hashes``."""
        return tuple(key_id(h) for h in self.key_hashes)


@dataclass(frozen=True, slots=True)
class RateDecision:
    """The answer of ``take``: whether it was allowed, seconds until the window resets, what is left in it, and the
    window's index (for ``give_back``)."""

    allowed: bool
    retry_after: float
    remaining: int
    window: int


@dataclass(frozen=True, slots=True)
class StoreStatus:
    """What ``RegistryStore.status`` found. ``persistent``: whether the backend keeps its data across its own
    restarts (None: could not be told); ``detail`` says how, or why not, or what went wrong."""

    backend: str  # "sqlite" or "redis"
    reachable: bool
    persistent: bool | None
    detail: str


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
    raise ValueError with the reason; reads given a name that cannot exist answer None / False / {}. Every method but
    ``status`` and ``close`` raises StoreUnavailableError when the backend cannot be reached.

    Every write that changes an adapter or a tenant (its record, keys or share) bumps the store's ``revision`` in
    the same atomic step; rate-limit windows and usage do not.
    """

    # -- changes --------------------------------------------------------------------------------------------------

    def revision(self) -> int:
        """The store's revision: 0 for a new store, one more after each write that changed an adapter or a tenant
        (a write refused, or given a name that does not exist, leaves it). Processes sharing the store compare it to
        tell whether they have seen every change (``admin.store.change_feed``). It only grows, except when the storage
        itself is lost (a Redis without persistence that restarts starts again from 0)."""
        return self._revision()

    # -- adapters -------------------------------------------------------------------------------------------------

    def put_adapter(self, record: AdapterRecord) -> AdapterRecord:
        """Insert ``record``, or replace the adapter of that name; returns what was stored.

        A new name is stored with ``record.version``; a replace stores ``max(record.version, old version + 1)``.
        """
        _check_adapter(record)
        return self._put_adapter(record)

    def put_adapters(self, records: Sequence[AdapterRecord]) -> list[AdapterRecord]:
        """``put_adapter`` of each record, in one atomic step that bumps the revision once; returns what was stored,
        in order. Every record is validated before anything is written: one invalid record, or a name that appears
        twice, is a ValueError and nothing changes. An empty batch changes nothing (the revision stays)."""
        seen: set[str] = set()
        for record in records:
            _check_adapter(record)
            if record.name in seen:
                raise ValueError(f"adapter name {record.name!r} appears more than once in the batch")
            seen.add(record.name)
        return self._put_adapters(records) if records else []

    def get_adapter(self, name: str) -> AdapterRecord | None:
        return self._get_adapter(name) if is_valid_name(name) else None

    def list_adapters(self) -> list[AdapterRecord]:
        """All registered adapters, sorted by name."""
        return self._list_adapters()

    def delete_adapter(self, name: str) -> bool:
        """Remove the adapter; False if there was none of that name."""
        return self._delete_adapter(name) if is_valid_name(name) else False

    # -- tenants --------------------------------------------------------------------------------------------------

    def create_tenant(
        self,
        name: str,
        adapters: Sequence[str],
        default_adapter: str | None = None,
        rate_limits: RateLimits | None = None,
        weight: float = 1.0,
        max_running: int = 0,
    ) -> tuple[TenantRecord, str]:
        """Create a tenant with a new API key; returns the record and the plaintext key, which is stored nowhere
        and cannot be read back. Raises TenantExistsError if the name is taken, ValueError on invalid arguments."""
        validate_name(name, "tenant name")
        weight = check_weight(weight)
        _check_count(max_running, "max_running")
        if isinstance(adapters, str):
            raise ValueError("adapters must be a list of adapter names, not a string")
        allowed = tuple(dict.fromkeys(validate_name(a, "adapter name") for a in adapters))
        if default_adapter is not None and default_adapter not in allowed:
            raise ValueError(f"default_adapter {default_adapter!r} is not among the tenant's adapters")
        rate_limits = RateLimits() if rate_limits is None else rate_limits
        if not isinstance(rate_limits, RateLimits):
            raise ValueError(f"rate_limits must be a RateLimits, got {type(rate_limits).__name__}")
        api_key = generate_api_key()
        record = TenantRecord(
            name=name,
            adapters=allowed,
            default_adapter=default_adapter,
            rate_limits=rate_limits,
            key_hashes=(hash_api_key(api_key),),
            created_at=time.time(),
            weight=weight,
            max_running=max_running,
        )
        if not self._insert_tenant(record):
            raise TenantExistsError(name)
        return record, api_key

    def get_tenant(self, name: str) -> TenantRecord | None:
        return self._get_tenant(name) if is_valid_name(name) else None

    def set_share(self, name: str, weight: float | None = None, max_running: int | None = None) -> TenantRecord:
        """Change the tenant's weight and/or cap of running requests (None: leave it); returns the record
        afterwards. Atomic: changes of other fields made at the same time are kept. Raises UnknownTenantError if
        there is no such tenant, ValueError on invalid arguments. Requests already queued keep the share they
        were sent with; later ones carry the new one."""
        validate_name(name, "tenant name")
        if weight is not None:
            weight = check_weight(weight)
        if max_running is not None:
            _check_count(max_running, "max_running")
        record = self._set_share(name, weight, max_running)
        if record is None:
            raise UnknownTenantError(name)
        return record

    def list_tenants(self) -> list[TenantRecord]:
        """All tenants, sorted by name."""
        return self._list_tenants()

    def has_tenants(self) -> bool:
        """Whether any tenant exists (one query, unlike ``list_tenants``)."""
        return self._has_tenants()

    def delete_tenant(self, name: str) -> bool:
        """Remove the tenant (its keys stop working at once), its usage and its rate-limit windows; False if there
        was none of that name."""
        return self._delete_tenant(name) if is_valid_name(name) else False

    def authenticate(self, tenant: str, api_key: str) -> TenantRecord | None:
        """The tenant if ``api_key`` is one of its keys, else None (also for unknown tenants and malformed input).

        Hashes are compared in constant time. Whether a tenant exists is not hidden: tenant names are in URLs.
        """
        if not is_valid_name(tenant) or not isinstance(api_key, str):
            return None
        record = self._get_tenant(tenant)
        return record if record is not None and _holds(record, api_key) else None

    def tenant_by_key(self, api_key: str) -> TenantRecord | None:
        """The tenant that holds ``api_key`` (any of its keys), else None (also for malformed input).

        The backend's index from key hash to tenant finds the candidate in one lookup; the key is then checked
        against the candidate's hashes in constant time, as ``authenticate`` does.
        """
        if not isinstance(api_key, str) or not api_key.startswith(API_KEY_PREFIX):
            return None
        record = self._tenant_by_key_hash(hash_api_key(api_key))
        return record if record is not None and _holds(record, api_key) else None

    def issue_key(self, tenant: str) -> tuple[TenantRecord, str]:
        """Give the tenant one more API key; returns the record afterwards and the plaintext key, which is stored
        nowhere. The tenant's other key keeps working until ``retire_key``.

        Raises UnknownTenantError if there is no such tenant, ValueError if the name is invalid or the tenant holds
        ``MAX_KEYS_PER_TENANT`` keys already.
        """
        validate_name(tenant, "tenant name")
        api_key = generate_api_key()
        key_hash = hash_api_key(api_key)
        record = self._add_key(tenant, key_hash)
        if record is None:
            raise UnknownTenantError(tenant)
        if key_hash not in record.key_hashes:
            raise ValueError(f"tenant {tenant!r} holds {MAX_KEYS_PER_TENANT} keys already: retire one first")
        return record, api_key

    def retire_key(self, tenant: str, key_id: str) -> TenantRecord:
        """Remove the tenant's key whose id (``TenantRecord.key_ids``) is ``key_id``; returns the record afterwards.
        The key stops authenticating at once.

        Raises UnknownTenantError if there is no such tenant, UnknownKeyError if it holds no key of that id,
        ValueError if the name is invalid or that key is the tenant's last one (issue its successor first).
        """
        validate_name(tenant, "tenant name")
        record = self._get_tenant(tenant)
        if record is None:
            raise UnknownTenantError(tenant)
        if key_id not in record.key_ids:
            raise UnknownKeyError(tenant, key_id)
        key_hash = record.key_hashes[record.key_ids.index(key_id)]
        after = self._remove_key(tenant, key_hash)
        if after is None:  # deleted since the read above
            raise UnknownTenantError(tenant)
        if key_hash in after.key_hashes:
            raise ValueError(f"key {key_id!r} is the last key of tenant {tenant!r}: issue its successor first")
        return after

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
        _check_kind(kind)
        _check_count(amount, "amount")
        _check_count(limit, "limit")
        now = time.time() if now is None else now
        window = math.floor(now / RATE_WINDOW_SECONDS)
        retry_after = (window + 1) * RATE_WINDOW_SECONDS - now
        allowed, used = self._take(tenant, kind, window, amount, limit, retry_after)
        return RateDecision(allowed=allowed, retry_after=retry_after, remaining=max(0, limit - used), window=window)

    def give_back(self, tenant: str, kind: str, window: int, amount: int) -> None:
        """Return up to ``amount`` to the tenant's ``kind`` budget of window ``window`` (a ``RateDecision.window``):
        what that window has used drops by ``amount``, but never below 0. Atomic. Nothing happens if the window's
        counter is gone (the window has ended and been cleaned up).

        For settling a take: admission takes an upper bound of a request's tokens, and the unused part is given
        back when the request ends.
        """
        validate_name(tenant, "tenant name")
        _check_kind(kind)
        if isinstance(window, bool) or not isinstance(window, int):
            raise ValueError(f"window must be an integer window index, got {window!r}")
        _check_count(amount, "amount")
        self._give_back(tenant, kind, window, amount)

    # -- usage ----------------------------------------------------------------------------------------------------

    def add_usage(
        self,
        tenant: str,
        adapter: str | None,
        prompt_tokens: int,
        completion_tokens: int,
        requests: int = 1,
        created_at: float | None = None,
    ) -> None:
        """Add to the tenant's counters for ``adapter`` (None: the base model). Atomic. Counted only while the tenant
        exists and, given ``created_at`` (its record's), is the tenant created then: a request that ends after its
        tenant was deleted counts nowhere, never for a tenant created again under the name."""
        validate_name(tenant, "tenant name")
        adapter_key = BASE_ADAPTER if adapter is None else validate_name(adapter, "adapter name")
        delta = Usage(
            requests=_check_count(requests, "requests"),
            prompt_tokens=_check_count(prompt_tokens, "prompt_tokens"),
            completion_tokens=_check_count(completion_tokens, "completion_tokens"),
        )
        self._add_usage(tenant, adapter_key, delta, created_at)

    def usage(self, tenant: str) -> dict[str, Usage]:
        """The tenant's totals per adapter name (``BASE_ADAPTER``, "", for the base model); {} if none."""
        return self._usage(tenant) if is_valid_name(tenant) else {}

    # -- lifetime -------------------------------------------------------------------------------------------------

    @abstractmethod
    def status(self) -> StoreStatus:
        """Whether the backend answers and whether it keeps its data across its own restarts. Never raises."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection; calling it again does nothing."""

    def __enter__(self) -> RegistryStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- storage hooks: arguments are validated; each call is atomic; a hook that changes an adapter or a tenant
    # bumps the revision in the same atomic step --------------------------------------------------------------------

    @abstractmethod
    def _revision(self) -> int: ...

    @abstractmethod
    def _put_adapter(self, record: AdapterRecord) -> AdapterRecord: ...

    @abstractmethod
    def _put_adapters(self, records: Sequence[AdapterRecord]) -> list[AdapterRecord]:
        """``_put_adapter`` of each record (at least one; names distinct), in one atomic step with one bump."""

    @abstractmethod
    def _get_adapter(self, name: str) -> AdapterRecord | None: ...

    @abstractmethod
    def _list_adapters(self) -> list[AdapterRecord]: ...

    @abstractmethod
    def _delete_adapter(self, name: str) -> bool: ...

    @abstractmethod
    def _insert_tenant(self, record: TenantRecord) -> bool:
        """Store a new tenant, its usage and rate-limit windows empty; False (and no change) if the name is
        taken."""

    @abstractmethod
    def _get_tenant(self, name: str) -> TenantRecord | None: ...

    @abstractmethod
    def _list_tenants(self) -> list[TenantRecord]: ...

    @abstractmethod
    def _has_tenants(self) -> bool: ...

    @abstractmethod
    def _delete_tenant(self, name: str) -> bool:
        """Remove the tenant, its keys from the key index, its usage and its rate-limit windows."""

    @abstractmethod
    def _set_share(self, name: str, weight: float | None, max_running: int | None) -> TenantRecord | None:
        """Set the fields given (not None) of the tenant's record; returns it afterwards, None if no such
        tenant."""

    @abstractmethod
    def _tenant_by_key_hash(self, key_hash: str) -> TenantRecord | None:
        """The tenant that the key index names for ``key_hash``, None if it names none."""

    @abstractmethod
    def _add_key(self, name: str, key_hash: str) -> TenantRecord | None:
        """Append ``key_hash`` to the tenant's keys (and to the key index) unless it holds ``MAX_KEYS_PER_TENANT``
        already; returns the record afterwards (without ``key_hash`` if it was full), None if no such tenant."""

    @abstractmethod
    def _remove_key(self, name: str, key_hash: str) -> TenantRecord | None:
        """Remove ``key_hash`` from the tenant's keys (and from the key index) unless it is the last one; returns the
        record afterwards (still with ``key_hash`` if it was the last), None if no such tenant."""

    @abstractmethod
    def _take(
        self, tenant: str, kind: str, window: int, amount: int, limit: int, seconds_left: float
    ) -> tuple[bool, int]:
        """Add ``amount`` to counter (tenant, kind, window) unless that would exceed ``limit``; returns (allowed,
        the counter afterwards). ``seconds_left`` is the window's remaining time, for expiring the counter."""

    @abstractmethod
    def _give_back(self, tenant: str, kind: str, window: int, amount: int) -> None:
        """Subtract ``min(amount, counter)`` from counter (tenant, kind, window) if it exists."""

    @abstractmethod
    def _add_usage(self, tenant: str, adapter: str, delta: Usage, created_at: float | None) -> None:
        """Add ``delta`` if the tenant exists (created at ``created_at``, unless None)."""

    @abstractmethod
    def _usage(self, tenant: str) -> dict[str, Usage]: ...


def _holds(record: TenantRecord, api_key: str) -> bool:
    """Whether ``api_key`` is one of the tenant's keys; every hash is compared, each in constant time."""
    return any([verify_api_key(api_key, h) for h in record.key_hashes])
