"""The shared registry store: Redis, for several server replicas (needs the ``redis`` package).

Every key starts with the store's prefix (default ``lora-server:``); stores with the same prefix on one Redis share
all state, stores with different prefixes share nothing.

| key | type | holds |
| --- | --- | --- |
| ``{prefix}adapters`` | hash | adapter name -> AdapterRecord as JSON |
| ``{prefix}tenants`` | hash | tenant name -> TenantRecord as JSON (the API key's hash, never the key) |
| ``{prefix}usage:{tenant}`` | hash | ``{adapter}:{requests,prompt_tokens,completion_tokens}`` -> count ('' = base) |
| ``{prefix}rate:{tenant}:{kind}:{window}`` | string | what the window has used; expires after the window |

Names cannot contain ':' (see ``NAME_PATTERN``), so these keys and fields split back unambiguously.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace

import redis

from admin.store import (
    DEFAULT_REDIS_PREFIX,
    RATE_WINDOW_SECONDS,
    AdapterRecord,
    RateLimits,
    RegistryStore,
    TenantRecord,
    Usage,
)

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
_USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens")


def _adapter_from_json(text: str) -> AdapterRecord:
    return AdapterRecord(**json.loads(text))


def _tenant_to_json(record: TenantRecord) -> str:
    return json.dumps(asdict(record))  # rate_limits becomes an object, the adapters tuple a list


def _tenant_from_json(text: str) -> TenantRecord:
    fields = json.loads(text)
    return TenantRecord(name=fields["name"], adapters=tuple(fields["adapters"]),
                        default_adapter=fields["default_adapter"], rate_limits=RateLimits(**fields["rate_limits"]),
                        key_hash=fields["key_hash"], created_at=fields["created_at"])


class RedisStore(RegistryStore):
    def __init__(self, url: str, *, prefix: str = DEFAULT_REDIS_PREFIX) -> None:
        self.prefix = prefix
        # redis-py's client draws connections from a thread-safe pool, so one client serves all threads.
        self._redis = redis.Redis.from_url(url, decode_responses=True)
        self._redis.ping()  # a wrong URL fails at start-up, not on the first request
        self._take_script = self._redis.register_script(_TAKE_SCRIPT)
        self._adapters_key = f"{prefix}adapters"
        self._tenants_key = f"{prefix}tenants"

    def _usage_key(self, tenant: str) -> str:
        return f"{self.prefix}usage:{tenant}"

    def close(self) -> None:
        self._redis.close()

    # -- adapters -------------------------------------------------------------------------------------------------

    def _put_adapter(self, record: AdapterRecord) -> AdapterRecord:
        def bump_and_store(pipe: redis.client.Pipeline) -> AdapterRecord:
            old = pipe.hget(self._adapters_key, record.name)  # executes at once: the pipe is WATCHing
            stored = record
            if old is not None:
                stored = replace(record, version=max(record.version, json.loads(old)["version"] + 1))
            pipe.multi()
            pipe.hset(self._adapters_key, record.name, json.dumps(asdict(stored)))
            return stored

        # Retried from the read whenever another client changes the hash between the read and the write.
        return self._redis.transaction(bump_and_store, self._adapters_key, value_from_callable=True)

    def _get_adapter(self, name: str) -> AdapterRecord | None:
        text = self._redis.hget(self._adapters_key, name)
        return None if text is None else _adapter_from_json(text)

    def _list_adapters(self) -> list[AdapterRecord]:
        records = self._redis.hgetall(self._adapters_key)
        return [_adapter_from_json(records[name]) for name in sorted(records)]

    def _delete_adapter(self, name: str) -> bool:
        return self._redis.hdel(self._adapters_key, name) > 0

    # -- tenants --------------------------------------------------------------------------------------------------

    def _insert_tenant(self, record: TenantRecord) -> bool:
        return bool(self._redis.hsetnx(self._tenants_key, record.name, _tenant_to_json(record)))

    def _get_tenant(self, name: str) -> TenantRecord | None:
        text = self._redis.hget(self._tenants_key, name)
        return None if text is None else _tenant_from_json(text)

    def _list_tenants(self) -> list[TenantRecord]:
        records = self._redis.hgetall(self._tenants_key)
        return [_tenant_from_json(records[name]) for name in sorted(records)]

    def _delete_tenant(self, name: str) -> bool:
        # Rate windows are left to expire on their own (within two minutes).
        pipe = self._redis.pipeline(transaction=True)
        pipe.hdel(self._tenants_key, name)
        pipe.delete(self._usage_key(name))
        deleted, _ = pipe.execute()
        return deleted > 0

    # -- rate limits and usage ------------------------------------------------------------------------------------

    def _take(self, tenant: str, kind: str, window: int, amount: int, limit: int,
              seconds_left: float) -> tuple[bool, int]:
        # Kept one window past its end, so that a replica whose clock lags a little still finds the counter.
        expire_s = math.ceil(seconds_left) + RATE_WINDOW_SECONDS
        allowed, used = self._take_script(keys=[f"{self.prefix}rate:{tenant}:{kind}:{window}"],
                                          args=[amount, limit, expire_s])
        return bool(allowed), int(used)

    def _add_usage(self, tenant: str, adapter: str, delta: Usage) -> None:
        pipe = self._redis.pipeline(transaction=True)
        key = self._usage_key(tenant)
        for field in _USAGE_FIELDS:
            pipe.hincrby(key, f"{adapter}:{field}", getattr(delta, field))
        pipe.execute()

    def _usage(self, tenant: str) -> dict[str, Usage]:
        counts: dict[str, dict[str, int]] = {}
        for key, value in self._redis.hgetall(self._usage_key(tenant)).items():
            adapter, _, field = key.rpartition(":")
            counts.setdefault(adapter, {})[field] = int(value)
        return {adapter: Usage(**fields) for adapter, fields in counts.items()}
