"""The shared registry store: Redis, for several server replicas (needs the ``redis`` package).

Every key starts with the store's prefix (default ``lora-server:``); stores with the same prefix on one Redis share
all state, stores with different prefixes share nothing.

| key | type | holds |
| --- | --- | --- |
| ``{prefix}adapters`` | hash | adapter name -> AdapterRecord as JSON |
| ``{prefix}tenants`` | hash | tenant name -> TenantRecord as JSON (its keys' hashes, never the keys) |
| ``{prefix}keys`` | hash | key hash -> tenant name, for every key of every tenant |
| ``{prefix}usage:{tenant}`` | hash | ``{adapter}:{requests,prompt_tokens,completion_tokens}`` -> count ('' = base) |
| ``{prefix}rate:{tenant}:{kind}:{window}`` | string | what the window has used; expires after the window |
| ``{prefix}revision`` | string | the store's revision (RegistryStore.revision); absent: 0 |

A tenant's usage and rate windows go when it is deleted, and again when a tenant of that name is created (whatever
a former one's late requests left); usage is added only for the tenant created at the time the caller names.

Every transaction that changes an adapter or a tenant ends by incrementing ``{prefix}revision`` and publishing the new
value on the channel ``{prefix}changes`` (``_BUMP_SCRIPT``): subscribers hear of a change only once it is visible
(``admin.store.change_feed.RedisFeed``).

Names cannot contain ':' (see ``NAME_PATTERN``), so these keys and fields split back unambiguously. Tenant JSON
written before tenants had two keys holds ``"key_hash"`` instead of ``"key_hashes"``; it is read as is, and opening a
store adds the index entries such tenants lack.

Commands are not retried: a write whose answer was lost may have been applied, and running it again could count a
take or usage twice. Connection-level failures become StoreUnavailableError (see ``_reachable``); the client opens a
fresh connection on the next call, so the store recovers by itself once Redis is back.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import redis
from redis.backoff import NoBackoff
from redis.exceptions import BusyLoadingError, MasterDownError, OutOfMemoryError, ReadOnlyError
from redis.retry import Retry

from lora_server.admin.store.base import (
    DEFAULT_REDIS_PREFIX,
    MAX_KEYS_PER_TENANT,
    RATE_KINDS,
    RATE_WINDOW_SECONDS,
    AdapterRecord,
    RateLimits,
    RegistryStore,
    StoreStatus,
    TenantRecord,
    Usage,
)
from lora_server.admin.store.errors import StoreUnavailableError

# Check and increment in one script so that concurrent takes never overshoot and a refused take changes nothing.
# KEYS[1]: the window's counter; ARGV: amount, limit, seconds until the counter may expire. Returns {allowed, used}.
_TAKE_SCRIPT = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local amount = tonumber(ARGV[1])
if used + amount > tonumber(ARGV[2]) then
  return {0, used}
end
used = redis.call('INCRBY', KEYS[1], amount)
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {1, used}
"""
# KEYS[1]: the window's counter; ARGV[1]: amount. A missing counter stays missing (DECRBY would create it, without
# an expiry); an existing one keeps its expiry.
_GIVE_BACK_SCRIPT = """
local used = redis.call('GET', KEYS[1])
if used then
  redis.call('DECRBY', KEYS[1], math.min(tonumber(used), tonumber(ARGV[1])))
end
"""
# KEYS: the key index, the tenants hash; ARGV[1]: a key hash. One round trip for the lookup of every request.
_TENANT_BY_KEY_SCRIPT = """
local name = redis.call('HGET', KEYS[1], ARGV[1])
if not name then
  return false
end
return redis.call('HGET', KEYS[2], name)
"""
# KEYS[1]: the revision; ARGV[1]: the changes channel. Queued last in a write's transaction (MULTI ... EXEC).
_BUMP_SCRIPT = """
local revision = redis.call('INCR', KEYS[1])
redis.call('PUBLISH', ARGV[1], revision)
return revision
"""
_USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens")
# What redis-py raises when Redis cannot serve a command now: no connection, no answer in time, still loading its
# data, or a replica that cannot take writes (after a failover). ResponseError in general means a wrong command.
UNREACHABLE_ERRORS = (redis.ConnectionError, redis.TimeoutError, BusyLoadingError, ReadOnlyError)
# What a reachable Redis answers when it takes no writes now: a replica (READONLY), memory full under noeviction
# (OOM), a failed RDB snapshot with stop-writes-on-bgsave-error (MISCONF), fewer replicas than min-replicas-to-write
# (NOREPLICAS), a replica cut off from its master (MASTERDOWN). redis-py has classes for some; the others arrive as a
# plain ResponseError whose text starts with the code (after "... of pipeline caused error: " in a transaction).
WRITE_REFUSED_ERRORS = (ReadOnlyError, OutOfMemoryError, MasterDownError)
WRITE_REFUSED_CODES = ("MISCONF", "NOREPLICAS")
_PIPELINE_PREFIX = " of pipeline caused error: "  # redis-py's; the command before it holds the values written

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _reachable(hook: Callable[Concatenate[RedisStore, _P], _R]) -> Callable[Concatenate[RedisStore, _P], _R]:
    """The store method ``hook``, raising StoreUnavailableError where Redis could not be reached."""

    @functools.wraps(hook)
    def guarded(self: RedisStore, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return hook(self, *args, **kwargs)
        except redis.ResponseError as exc:
            reason = _redis_reason(exc)
            if not isinstance(exc, WRITE_REFUSED_ERRORS) and not reason.startswith(WRITE_REFUSED_CODES):
                raise  # a wrong command: a bug, not an outage
            message = f"the registry store (redis at {self.address}) refuses writes: {reason}"
            raise StoreUnavailableError(message) from exc
        except UNREACHABLE_ERRORS as exc:
            raise StoreUnavailableError(f"the registry store (redis at {self.address}) is unreachable: {exc}") from exc

    return guarded


def _redis_reason(exc: redis.ResponseError) -> str:
    """Redis's own words, without the command redis-py puts before them (it holds key hashes and records)."""
    return str(exc).rpartition(_PIPELINE_PREFIX)[2]


def _adapter_from_json(text: str) -> AdapterRecord:
    return AdapterRecord(**json.loads(text))


def _tenant_to_json(record: TenantRecord) -> str:
    return json.dumps(asdict(record))  # rate_limits becomes an object, the tuples lists


def _tenant_from_json(text: str) -> TenantRecord:
    fields = json.loads(text)
    key_hashes = fields["key_hashes"] if "key_hashes" in fields else [fields["key_hash"]]
    return TenantRecord(
        name=fields["name"],
        adapters=tuple(fields["adapters"]),
        default_adapter=fields["default_adapter"],
        rate_limits=RateLimits(**fields["rate_limits"]),
        key_hashes=tuple(key_hashes),
        created_at=fields["created_at"],
        weight=fields.get("weight", 1.0),  # JSON written before tenants had a share: the default one
        max_running=fields.get("max_running", 0),
    )


class RedisStore(RegistryStore):
    """``timeout``: seconds to wait for a connection and for each answer before StoreUnavailableError."""

    def __init__(self, url: str, *, prefix: str = DEFAULT_REDIS_PREFIX, timeout: float = 2.0) -> None:
        self.prefix = prefix
        # redis-py's client draws connections from a thread-safe pool, so one client serves all threads.
        self._redis = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
        )
        connection = self._redis.connection_pool.connection_kwargs
        self.address = connection.get("path") or f"{connection.get('host')}:{connection.get('port')}"
        self._take_script = self._redis.register_script(_TAKE_SCRIPT)
        self._give_back_script = self._redis.register_script(_GIVE_BACK_SCRIPT)
        self._tenant_by_key_script = self._redis.register_script(_TENANT_BY_KEY_SCRIPT)
        self._adapters_key = f"{prefix}adapters"
        self._tenants_key = f"{prefix}tenants"
        self._keys_key = f"{prefix}keys"
        self._revision_key = f"{prefix}revision"
        self.changes_channel = f"{prefix}changes"
        self._ping()  # a wrong URL fails at start-up, not on the first request
        self._index_all_keys()

    def _usage_key(self, tenant: str) -> str:
        return f"{self.prefix}usage:{tenant}"

    def _rate_key(self, tenant: str, kind: str, window: int) -> str:
        return f"{self.prefix}rate:{tenant}:{kind}:{window}"

    def _tenant_counters(self, tenant: str) -> list[str]:
        """The keys of a tenant's usage and of the rate windows that may still exist (the last, this and the next:
        ``_take`` keeps one a window past its end; clocks of replicas differ a little)."""
        window = math.floor(time.time() / RATE_WINDOW_SECONDS)
        rates = [self._rate_key(tenant, kind, w) for kind in RATE_KINDS for w in (window - 1, window, window + 1)]
        return [self._usage_key(tenant), *rates]

    def _transaction(self, func: Callable[[redis.client.Pipeline], _R], *watched: str) -> _R:
        """``func(pipe)``'s result once the commands it queued after ``pipe.multi()`` have run as one transaction;
        ``func`` runs again, from its reads, whenever another client changes a ``watched`` key before they do."""
        return cast(_R, self._redis.transaction(cast(Any, func), *watched, value_from_callable=True))

    def _bump(self, pipe: redis.client.Pipeline) -> None:
        """Queue the revision's increment and its announcement (after ``pipe.multi()``, last)."""
        pipe.eval(_BUMP_SCRIPT, 1, self._revision_key, self.changes_channel)

    def pubsub(self) -> redis.client.PubSub:
        """A new subscriber connection of this store's client (for ``admin.store.change_feed.RedisFeed``); the caller
        subscribes it to ``changes_channel`` and closes it."""
        return self._redis.pubsub(ignore_subscribe_messages=True)

    @_reachable
    def _ping(self) -> None:
        self._redis.ping()

    @_reachable
    def _index_all_keys(self) -> None:
        """Add the key index entries that stored tenants lack: those written before the index existed."""

        def index(pipe: redis.client.Pipeline) -> None:
            indexed = set(cast(list[str], pipe.hkeys(self._keys_key)))
            missing = [
                (key_hash, record.name)
                for record in map(_tenant_from_json, cast(list[str], pipe.hvals(self._tenants_key)))
                for key_hash in record.key_hashes
                if key_hash not in indexed
            ]
            pipe.multi()
            if missing:
                pipe.hset(self._keys_key, mapping=dict(missing))

        self._transaction(index, self._tenants_key, self._keys_key)

    def status(self) -> StoreStatus:
        try:
            self._ping()
            persistent, detail = self._persistence()
        except (StoreUnavailableError, redis.RedisError) as exc:
            return StoreStatus(backend="redis", reachable=False, persistent=None, detail=str(exc))
        return StoreStatus(backend="redis", reachable=True, persistent=persistent, detail=detail)

    @_reachable
    def _persistence(self) -> tuple[bool | None, str]:
        """Whether Redis keeps its data across restarts, and how: from its configuration where CONFIG is allowed,
        else (managed Redis often refuses it) from INFO, which shows AOF but not whether RDB snapshots are set up."""
        try:
            aof = self._redis.config_get("appendonly").get("appendonly") == "yes"
            rdb = bool(self._redis.config_get("save").get("save"))
        except redis.ResponseError as refused:
            try:
                aof = bool(self._redis.info("persistence").get("aof_enabled"))
            except redis.ResponseError as info_refused:
                return None, f"unknown: CONFIG and INFO are refused ({refused}; {info_refused})"
            if aof:
                return True, "AOF"
            return None, f"unknown: AOF is off and CONFIG, which shows RDB snapshots, is refused ({refused})"
        if not (aof or rdb):
            return False, "none: every tenant and adapter is lost when redis restarts"
        return True, " and ".join(name for name, on in (("AOF", aof), ("RDB", rdb)) if on)

    def close(self) -> None:
        self._redis.close()

    @_reachable
    def _revision(self) -> int:
        return int(cast(str | None, self._redis.get(self._revision_key)) or 0)

    # -- adapters -------------------------------------------------------------------------------------------------

    def _put_adapter(self, record: AdapterRecord) -> AdapterRecord:
        return self._put_adapters([record])[0]

    @_reachable
    def _put_adapters(self, records: Sequence[AdapterRecord]) -> list[AdapterRecord]:
        def bump_and_store(pipe: redis.client.Pipeline) -> list[AdapterRecord]:
            # executes at once (the pipe is WATCHing): the old records, one per name, None where there is none
            olds = cast(list[str | None], pipe.hmget(self._adapters_key, [r.name for r in records]))
            stored = [
                r if old is None else replace(r, version=max(r.version, json.loads(old)["version"] + 1))
                for r, old in zip(records, olds, strict=True)
            ]
            pipe.multi()
            pipe.hset(self._adapters_key, mapping={r.name: json.dumps(asdict(r)) for r in stored})
            self._bump(pipe)
            return stored

        return self._transaction(bump_and_store, self._adapters_key)

    @_reachable
    def _get_adapter(self, name: str) -> AdapterRecord | None:
        text = self._redis.hget(self._adapters_key, name)
        return None if text is None else _adapter_from_json(cast(str, text))

    @_reachable
    def _list_adapters(self) -> list[AdapterRecord]:
        records = cast(dict[str, str], self._redis.hgetall(self._adapters_key))
        return [_adapter_from_json(records[name]) for name in sorted(records)]

    @_reachable
    def _delete_adapter(self, name: str) -> bool:
        def delete(pipe: redis.client.Pipeline) -> bool:
            exists = pipe.hexists(self._adapters_key, name)
            pipe.multi()
            if exists:
                pipe.hdel(self._adapters_key, name)
                self._bump(pipe)
            return bool(exists)

        return self._transaction(delete, self._adapters_key)

    # -- tenants --------------------------------------------------------------------------------------------------

    @_reachable
    def _insert_tenant(self, record: TenantRecord) -> bool:
        def insert(pipe: redis.client.Pipeline) -> bool:
            exists = pipe.hexists(self._tenants_key, record.name)
            pipe.multi()
            if exists:
                return False
            pipe.hset(self._tenants_key, record.name, _tenant_to_json(record))
            pipe.hset(self._keys_key, mapping=dict.fromkeys(record.key_hashes, record.name))
            pipe.delete(*self._tenant_counters(record.name))  # a former tenant's, if any remain
            self._bump(pipe)
            return True

        return self._transaction(insert, self._tenants_key)

    @_reachable
    def _get_tenant(self, name: str) -> TenantRecord | None:
        text = self._redis.hget(self._tenants_key, name)
        return None if text is None else _tenant_from_json(cast(str, text))

    @_reachable
    def _list_tenants(self) -> list[TenantRecord]:
        records = cast(dict[str, str], self._redis.hgetall(self._tenants_key))
        return [_tenant_from_json(records[name]) for name in sorted(records)]

    @_reachable
    def _has_tenants(self) -> bool:
        return cast(int, self._redis.hlen(self._tenants_key)) > 0

    @_reachable
    def _delete_tenant(self, name: str) -> bool:
        def delete(pipe: redis.client.Pipeline) -> bool:
            text = pipe.hget(self._tenants_key, name)
            pipe.multi()
            pipe.delete(*self._tenant_counters(name))
            if text is None:
                return False
            pipe.hdel(self._tenants_key, name)
            pipe.hdel(self._keys_key, *_tenant_from_json(cast(str, text)).key_hashes)
            self._bump(pipe)
            return True

        return self._transaction(delete, self._tenants_key)

    @_reachable
    def _tenant_by_key_hash(self, key_hash: str) -> TenantRecord | None:
        text = self._tenant_by_key_script(keys=[self._keys_key, self._tenants_key], args=[key_hash])
        return None if text is None else _tenant_from_json(text)

    @_reachable
    def _set_share(self, name: str, weight: float | None, max_running: int | None) -> TenantRecord | None:
        def change(record: TenantRecord) -> TenantRecord:
            return replace(
                record,
                weight=record.weight if weight is None else weight,
                max_running=record.max_running if max_running is None else max_running,
            )

        return self._update_tenant(name, change)

    @_reachable
    def _add_key(self, name: str, key_hash: str) -> TenantRecord | None:
        def add(record: TenantRecord) -> TenantRecord:
            full = len(record.key_hashes) >= MAX_KEYS_PER_TENANT
            return record if full else replace(record, key_hashes=(*record.key_hashes, key_hash))

        return self._update_tenant(name, add)

    @_reachable
    def _remove_key(self, name: str, key_hash: str) -> TenantRecord | None:
        def remove(record: TenantRecord) -> TenantRecord:
            if len(record.key_hashes) == 1:
                return record
            return replace(record, key_hashes=tuple(h for h in record.key_hashes if h != key_hash))

        return self._update_tenant(name, remove)

    def _update_tenant(self, name: str, update: Callable[[TenantRecord], TenantRecord]) -> TenantRecord | None:
        """Replace the tenant's record by ``update(its record)``, and its keys in the key index, in one
        transaction; returns the record afterwards, None if no such tenant."""

        def rewrite(pipe: redis.client.Pipeline) -> TenantRecord | None:
            text = pipe.hget(self._tenants_key, name)
            pipe.multi()
            if text is None:
                return None
            old = _tenant_from_json(cast(str, text))
            new = update(old)
            if new == old:
                return old
            pipe.hset(self._tenants_key, name, _tenant_to_json(new))
            if removed := set(old.key_hashes) - set(new.key_hashes):
                pipe.hdel(self._keys_key, *removed)
            if added := set(new.key_hashes) - set(old.key_hashes):
                pipe.hset(self._keys_key, mapping=dict.fromkeys(added, name))
            self._bump(pipe)
            return new

        return self._transaction(rewrite, self._tenants_key)

    # -- rate limits and usage ------------------------------------------------------------------------------------

    @_reachable
    def _take(
        self, tenant: str, kind: str, window: int, amount: int, limit: int, seconds_left: float
    ) -> tuple[bool, int]:
        # Kept one window past its end, so that a replica whose clock lags a little still finds the counter.
        expire_s = math.ceil(seconds_left) + RATE_WINDOW_SECONDS
        allowed, used = self._take_script(keys=[self._rate_key(tenant, kind, window)], args=[amount, limit, expire_s])
        return bool(allowed), int(used)

    @_reachable
    def _give_back(self, tenant: str, kind: str, window: int, amount: int) -> None:
        self._give_back_script(keys=[self._rate_key(tenant, kind, window)], args=[amount])

    @_reachable
    def _add_usage(self, tenant: str, adapter: str, delta: Usage, created_at: float | None) -> None:
        def add(pipe: redis.client.Pipeline) -> None:
            text = pipe.hget(self._tenants_key, tenant)
            pipe.multi()
            if text is None or (created_at is not None and _tenant_from_json(cast(str, text)).created_at != created_at):
                return
            for field in _USAGE_FIELDS:
                pipe.hincrby(self._usage_key(tenant), f"{adapter}:{field}", getattr(delta, field))

        self._transaction(add, self._tenants_key)

    @_reachable
    def _usage(self, tenant: str) -> dict[str, Usage]:
        counts: dict[str, dict[str, int]] = {}
        for key, value in cast(dict[str, str], self._redis.hgetall(self._usage_key(tenant))).items():
            adapter, _, field = key.rpartition(":")
            counts.setdefault(adapter, {})[field] = int(value)
        return {adapter: Usage(**fields) for adapter, fields in counts.items()}
