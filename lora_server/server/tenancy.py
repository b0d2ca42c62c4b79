"""Tenants at the HTTP edge: who a request acts as, and what it costs its tenant.

Who a request acts as (``Callers``): on ``/t/{tenant}/v1`` the tenant whose key it presents; on ``/v1`` a tenant's
key also acts as that tenant (its allow-list, limits, usage and cache salt), ``--api-key`` grants the whole server,
and anonymous callers are let in only while the operator allows it (``TenantPresence``). A request of the whole
server is of no tenant: ``cache_salt`` "", ``tenant_share`` NO_TENANT, no meter.

What it costs (``TenantMeter``): admission takes one request and the most tokens the request can use from the
tenant's per-minute windows (429 with Retry-After when one is used up, nothing taken); the request's end records its
usage and gives the unused tokens back. Store calls block: callers run them in worker threads. A store out of reach
at admission is the caller's StoreUnavailableError (503); at the end, usage not recorded is logged, not raised.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from lora_server.admin.api import presented_key
from lora_server.admin.api.errors import ApiError
from lora_server.admin.store import RateDecision, RegistryStore, StoreUnavailableError, TenantRecord
from lora_server.admin.store.keys import API_KEY_PREFIX, constant_time_equals
from lora_server.config import ServerConfig
from lora_server.engine.request import NO_TENANT, TenantShare
from lora_server.server.openai_serving import Prepared

log = logging.getLogger("lora_server")
TENANTS_CHECK_S = 1.0  # how long "are there tenants?" is trusted for anonymous /v1 access (other replicas)


class TenantPresence:
    """Whether anonymous /v1 access is open: always with ``--allow-anonymous``; otherwise (and without
    ``--api-key``) only while the registry holds no tenant. The answer is kept until ``changed`` (called by this
    server's admin API, and by RegistrySync when another replica changed tenants), for TENANTS_CHECK_S at most, and,
    while the store is unreachable, the last one known."""

    def __init__(self, store: RegistryStore) -> None:
        self.store = store
        self._known: bool | None = None
        self._checked = float("-inf")

    def anonymous_open(self, allow_anonymous: bool) -> bool:
        if allow_anonymous:
            return True
        now = time.monotonic()
        if self._known is None or now - self._checked >= TENANTS_CHECK_S:
            try:
                self._known, self._checked = self.store.has_tenants(), now
            except StoreUnavailableError:
                if self._known is None:
                    raise
        return not self._known

    def changed(self) -> None:
        self._checked = float("-inf")


class Callers:
    """Who a request acts as: the admin (``is_admin``), a /v1 caller (``caller``: a tenant, or None for the whole
    server), a /t/{tenant}/v1 caller (``tenant_of``). Keys are compared in constant time; only keys with the tenant
    keys' prefix are looked up in the store (in a worker thread)."""

    def __init__(self, store: RegistryStore, presence: TenantPresence, settings: ServerConfig, admin_key: str) -> None:
        self.store, self.presence, self.settings, self.admin_key = store, presence, settings, admin_key

    def is_admin(self, request: Request) -> bool:
        return constant_time_equals(presented_key(request), self.admin_key)

    async def caller(self, request: Request) -> TenantRecord | None:
        """Who a /v1 request acts as: the tenant whose key it presents, else None (the --api-key, or anonymous
        access while it is open); 401 otherwise."""
        settings = self.settings
        key = _bearer(request)
        if settings.api_key is not None and key and constant_time_equals(key, settings.api_key):
            return None
        if key.startswith(API_KEY_PREFIX):  # only our tenant keys carry the prefix: nothing else is looked up
            tenant = await run_in_threadpool(self.store.tenant_by_key, key)
            if tenant is not None:
                return tenant
        if settings.api_key is None and await run_in_threadpool(self.presence.anonymous_open, settings.allow_anonymous):
            return None
        raise ApiError(
            401,
            "a valid API key is required: a tenant's key"
            + (
                " or the server's --api-key"
                if settings.api_key
                else " (anonymous /v1 access closes once tenants exist unless the server runs with --allow-anonymous)"
            ),
            "authentication_error",
        )

    async def tenant_of(self, name: str, request: Request) -> TenantRecord:
        """The tenant ``name`` of a /t/{tenant}/v1 request, if the request presents one of its keys; 401 otherwise."""
        key = _bearer(request)
        record = await run_in_threadpool(self.store.authenticate, name, key) if key else None
        if record is None:
            raise ApiError(401, "missing or wrong API key for this tenant", "authentication_error")
        return record


@dataclass
class TenantMeter:
    """A tenant's charge for one HTTP request. At admission it takes one request and the most tokens the request
    can use (its prompts plus n x max_tokens); ``settle`` records the real usage and gives the unused tokens back
    to the window they were taken from."""

    store: RegistryStore
    tenant: str
    created_at: float  # the tenant's: its usage counts for it, not for one created again under its name
    adapter: str | None
    charged_tokens: int
    tokens_window: RateDecision | None
    requests_window: RateDecision | None = None

    @classmethod
    def admit(cls, store: RegistryStore, tenant: TenantRecord, adapter: str | None, prepared: Prepared) -> TenantMeter:
        """Take the request from the tenant's limits (blocking: store calls); 429 with Retry-After when a window
        is used up, 400 when the request could never fit the tokens limit. A refusal takes nothing."""
        limits, amount = tenant.rate_limits, prepared.max_tokens
        if limits.tokens_per_minute is not None and amount > limits.tokens_per_minute:
            raise ApiError(
                400,
                f"this request may use {amount} tokens (prompt plus n x max_tokens), more than the "
                f"tenant's limit of {limits.tokens_per_minute} tokens per minute: lower max_tokens",
                param="max_tokens",
                code="tokens_limit_exceeded",
            )
        requests = None
        if limits.requests_per_minute is not None:
            requests = store.take(tenant.name, "requests", 1, limits.requests_per_minute)
            _refuse_unless_allowed(requests, limits.requests_per_minute, "requests")
        tokens = None
        if limits.tokens_per_minute is not None:
            tokens = store.take(tenant.name, "tokens", amount, limits.tokens_per_minute)
            if not tokens.allowed and requests is not None:
                store.give_back(tenant.name, "requests", requests.window, 1)
            _refuse_unless_allowed(tokens, limits.tokens_per_minute, "tokens")
        return cls(store, tenant.name, tenant.created_at, adapter, amount, tokens, requests)

    def refund(self) -> None:
        """Give back what admission took, for a request refused after it (its grammar did not compile)."""
        try:
            if self.requests_window is not None:
                self.store.give_back(self.tenant, "requests", self.requests_window.window, 1)
            if self.tokens_window is not None:
                self.store.give_back(self.tenant, "tokens", self.tokens_window.window, self.charged_tokens)
        except StoreUnavailableError as exc:
            log.warning("the charge of a refused request of tenant %s not given back: %s", self.tenant, exc)

    def settle(self, prompt_tokens: int, completion_tokens: int) -> None:
        try:
            self.store.add_usage(
                self.tenant, self.adapter, prompt_tokens, completion_tokens, created_at=self.created_at
            )
            unused = self.charged_tokens - prompt_tokens - completion_tokens
            if self.tokens_window is not None and unused > 0:
                self.store.give_back(self.tenant, "tokens", self.tokens_window.window, unused)
        except StoreUnavailableError as exc:
            log.warning(
                "usage of tenant %s not recorded (%d prompt, %d completion tokens): %s",
                self.tenant,
                prompt_tokens,
                completion_tokens,
                exc,
            )


def _refuse_unless_allowed(decision: RateDecision, limit: int, kind: str) -> None:
    if not decision.allowed:
        raise ApiError(
            429,
            f"rate limit of {limit} {kind} per minute reached",
            "rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(max(1, math.ceil(decision.retry_after)))},
        )


def cache_salt(tenant: TenantRecord | None) -> str:
    """The prefix-cache salt of a request: each tenant's cached KV is its own; anonymous and --api-key requests
    share "". Derived here, never taken from the client."""
    return "" if tenant is None else f"tenant:{tenant.name}"


def tenant_share(tenant: TenantRecord | None) -> TenantShare:
    """Whom a request is served for, with the tenant's weight and cap as the registry holds them now; anonymous
    and --api-key requests are one tenant, "" (weight 1, no cap)."""
    if tenant is None:
        return NO_TENANT
    return TenantShare(tenant.name, tenant.weight, tenant.max_running)


def _bearer(request: Request) -> str:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""
