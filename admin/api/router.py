"""The admin API (adapters, tenants, pool figures) as a FastAPI router. Every route needs the admin key as
``Authorization: Bearer ...``, compared in constant time. The serving side is reached through ``AdapterControl``,
so this package does not import the engine."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt

from lora_server.adapters.sources import source_scheme
from lora_server.admin.api.errors import ApiError
from lora_server.admin.store import (
    MAX_TENANT_WEIGHT,
    AdapterRecord,
    RateLimits,
    RegistryStore,
    TenantExistsError,
    TenantRecord,
    UnknownKeyError,
    UnknownTenantError,
    validate_name,
)
from lora_server.admin.store.keys import constant_time_equals


class AdapterControl(Protocol):
    """What the admin API needs from the serving side. ``lock`` is held while an adapter changes in the engine and
    in the store together, so that whatever else keeps the two in step (a registry sync) sees both or neither.

    Registering is two steps around the store's write: ``check_adapter`` reads and validates the files (ApiError(400)
    with the reason; nothing changes), ``serve_adapter`` then serves what was checked as version ``version`` (it
    reads no file, and under the same hold of ``lock`` it does not fail)."""

    lock: threading.Lock

    def check_adapter(self, name: str, path: str, pinned: bool) -> object: ...
    def serve_adapter(self, checked: Any, pinned: bool, version: int) -> dict[str, Any]: ...
    def next_version(self, name: str) -> int: ...  # the least version the engine gives the name's next registration
    def unload_adapter(self, name: str) -> bool: ...  # False when the engine does not serve it
    def served_adapters(self) -> list[str]: ...  # every adapter the engine serves: demo, command line and API
    def adapter_info(self, name: str) -> dict[str, Any] | None: ...  # path, source, version, state...; None: not served
    def pool_figures(self) -> dict[str, Any]: ...
    def check_integrity(self) -> None: ...  # AssertionError when the pool's invariants are broken


class AdapterBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    path: str
    pinned: bool = False
    replace: bool = False  # serve the new weights under a name already served (a new version); else 409


class LoadLoraBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's name for replace


class UnloadLoraBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str


class RateLimitsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests_per_minute: StrictInt | None = Field(default=None, ge=1)
    tokens_per_minute: StrictInt | None = Field(default=None, ge=1)


Weight = StrictInt | StrictFloat  # a tenant's share of the engine's tokens, relative to other tenants'


class TenantBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    adapters: list[str] = Field(default_factory=list)
    default_adapter: str | None = None
    rate_limits: RateLimitsBody | None = None
    weight: Weight = Field(default=1.0, gt=0, le=MAX_TENANT_WEIGHT)
    max_running: StrictInt = Field(default=0, ge=0)  # the most of its requests running at once; 0: no cap


class TenantShareBody(BaseModel):
    """PATCH /admin/tenants/{name}: the fields given change, the others stay."""

    model_config = ConfigDict(extra="forbid")
    weight: Weight | None = Field(default=None, gt=0, le=MAX_TENANT_WEIGHT)
    max_running: StrictInt | None = Field(default=None, ge=0)


def presented_key(request: Request) -> str:
    """The key of ``Authorization: Bearer KEY``, or the password of HTTP Basic (how a browser presents the admin key
    for the status page: it asks for it once and sends it with every /admin request)."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            return ""
    return ""


def require_admin_key(request: Request, admin_key: str) -> None:
    """401 in OpenAI's shape (with a Basic challenge, so a browser asks) unless the request presents the admin key."""
    if not constant_time_equals(presented_key(request), admin_key):
        raise ApiError(
            401,
            "a valid admin key is required (Authorization: Bearer ...)",
            "authentication_error",
            headers={"WWW-Authenticate": 'Basic realm="lora-server admin", charset="UTF-8"'},
        )


def tenant_json(t: TenantRecord) -> dict[str, Any]:
    return {
        "name": t.name,
        "adapters": list(t.adapters),
        "default_adapter": t.default_adapter,
        "rate_limits": {
            "requests_per_minute": t.rate_limits.requests_per_minute,
            "tokens_per_minute": t.rate_limits.tokens_per_minute,
        },
        "weight": t.weight,
        "max_running": t.max_running,
        "key_ids": list(t.key_ids),
        "created_at": t.created_at,
    }


def admin_router(
    store: RegistryStore,
    control: AdapterControl,
    admin_key: str,
    allowed_roots: list[Path],
    base_model_id: str,
    tenants_changed: Callable[[], None],
) -> APIRouter:
    """``base_model_id`` cannot be an adapter's name; ``tenants_changed`` is called after a tenant is created or
    deleted (anonymous /v1 access depends on whether tenants exist)."""

    def require_admin(request: Request) -> None:
        require_admin_key(request, admin_key)

    router = APIRouter(dependencies=[Depends(require_admin)])

    def register(name: str, path: str, pinned: bool, replace: bool) -> dict[str, Any]:
        checked_name(name, "adapter name", "name")
        if name == base_model_id:
            raise ApiError(400, f"{name!r} is the base model's id; choose another adapter name", param="name")
        with control.lock:
            return register_locked(name, path, pinned, replace)

    def register_locked(name: str, path: str, pinned: bool, replace: bool) -> dict[str, Any]:
        if not replace and name in control.served_adapters():
            raise ApiError(
                409,
                f'an adapter named {name!r} is already served; send "replace": true (vLLM: '
                '"load_inplace") to serve new weights under it as a new version',
                param="name",
                code="adapter_exists",
            )
        if source_scheme(path) is not None:  # a URL: the engine downloads it if its scheme is enabled
            source = path
        else:
            resolved = Path(path).expanduser().resolve()
            if not any(resolved.is_relative_to(r) for r in allowed_roots):
                raise ApiError(
                    400,
                    f"adapter path {path} is outside the allowed adapter roots "
                    f"({', '.join(map(str, allowed_roots))}; add one with --adapter-root)",
                    param="path",
                )
            source = str(resolved)
        # files first (a 400 changes nothing), then the store (a 503 changes nothing), then the engine
        checked = control.check_adapter(name, source, pinned)
        old = store.get_adapter(name)
        version = max(1 if old is None else old.version + 1, control.next_version(name))
        record = store.put_adapter(AdapterRecord(name, source, version, pinned, time.time()))
        try:
            info = control.serve_adapter(checked, pinned, record.version)
        except ApiError:  # not expected under the lock; the store is put back as it was
            if old is None:
                store.delete_adapter(name)
            else:
                store.put_adapter(old)
            raise
        return {**info, "version": record.version, "pinned": record.pinned}

    def describe(name: str, record: AdapterRecord | None) -> dict[str, Any] | None:
        """An adapter as the engine serves it, or as the store recorded it ("not loaded": its files failed)."""
        info = control.adapter_info(name)
        if info is not None:
            return {"name": name, **info, "created_at": None if record is None else record.created_at}
        if record is None:
            return None
        return {
            "name": name,
            "path": record.path,
            "source": "api",
            "version": record.version,
            "pinned": record.pinned,
            "state": "not loaded",
            "created_at": record.created_at,
        }

    @router.post("/admin/adapters")
    def add_adapter(body: AdapterBody) -> dict[str, Any]:
        return register(body.name, body.path, body.pinned, body.replace)

    @router.get("/admin/adapters")
    def list_adapters() -> dict[str, Any]:
        """Every served adapter (demo, command line, API) and every recorded one that could not be loaded."""
        records = {r.name: r for r in store.list_adapters()}
        names = sorted(set(control.served_adapters()) | set(records))
        return {"data": [d for n in names if (d := describe(n, records.get(n))) is not None]}

    @router.get("/admin/adapters/{name}")
    def get_adapter(name: str) -> dict[str, Any]:
        checked_name(name, "adapter name", "name")
        found = describe(name, store.get_adapter(name))
        if found is None:
            raise ApiError(
                404, f"adapter {name!r} does not exist", "not_found_error", param="name", code="model_not_found"
            )
        return found

    @router.delete("/admin/adapters/{name}")
    def delete_adapter(name: str) -> dict[str, Any]:
        """Forget its record, then unload it (a store that refuses the write leaves both); a record whose files
        vanished (never loaded) is removed too."""
        checked_name(name, "adapter name", "name")
        with control.lock:
            deleted = store.delete_adapter(name)
            served = control.unload_adapter(name)
        if not deleted and not served:
            raise ApiError(
                404, f"adapter {name!r} does not exist", "not_found_error", param="name", code="model_not_found"
            )
        return {"name": name, "deleted": True}

    @router.post("/v1/load_lora_adapter")
    def load_lora(body: LoadLoraBody) -> dict[str, Any]:
        return register(body.lora_name, body.lora_path, False, body.load_inplace)

    @router.post("/v1/unload_lora_adapter")
    def unload_lora(body: UnloadLoraBody) -> dict[str, Any]:
        return delete_adapter(body.lora_name)

    @router.post("/admin/tenants")
    def create_tenant(body: TenantBody) -> dict[str, Any]:
        checked_name(body.name, "tenant name", "name")
        for adapter in body.adapters:
            checked_name(adapter, "adapter name", "adapters")
        limits = body.rate_limits or RateLimitsBody()
        try:
            record, key = store.create_tenant(
                body.name,
                body.adapters,
                body.default_adapter,
                RateLimits(limits.requests_per_minute, limits.tokens_per_minute),
                body.weight,
                body.max_running,
            )
        except TenantExistsError as exc:
            raise ApiError(409, str(exc), param="name", code="tenant_exists") from exc
        except ValueError as exc:  # the default adapter, a limit: the body's other fields
            raise ApiError(400, str(exc)) from exc
        tenants_changed()
        served = set(control.served_adapters())
        missing = [a for a in record.adapters if a not in served]
        warnings = [
            f"adapter {a!r} is not registered: the tenant's requests for it get 404 until it is" for a in missing
        ]
        return {**tenant_json(record), "api_key": key, "warnings": warnings}

    @router.get("/admin/tenants")
    def list_tenants() -> dict[str, Any]:
        return {"data": [tenant_json(t) for t in store.list_tenants()]}

    @router.get("/admin/tenants/{name}")
    def get_tenant(name: str) -> dict[str, Any]:
        record = store.get_tenant(checked_name(name, "tenant name", "name"))
        if record is None:
            raise _no_tenant(name)
        usage = {a or "<base>": _usage_json(u) for a, u in store.usage(name).items()}
        return {**tenant_json(record), "usage": usage}

    @router.patch("/admin/tenants/{name}")
    def update_tenant(name: str, body: TenantShareBody) -> dict[str, Any]:
        """Change the tenant's weight and/or cap of running requests; its requests sent from then on carry them."""
        if body.weight is None and body.max_running is None:
            raise ApiError(400, "give weight and/or max_running to change")
        try:
            record = store.set_share(checked_name(name, "tenant name", "name"), body.weight, body.max_running)
        except UnknownTenantError as exc:
            raise _no_tenant(name) from exc
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        return tenant_json(record)

    @router.delete("/admin/tenants/{name}")
    def delete_tenant(name: str) -> dict[str, Any]:
        if not store.delete_tenant(checked_name(name, "tenant name", "name")):
            raise _no_tenant(name)
        tenants_changed()
        return {"name": name, "deleted": True}

    @router.post("/admin/tenants/{name}/keys")
    def issue_key(name: str) -> dict[str, Any]:
        """A second key for the tenant (rotation: issue the new one, move clients, retire the old one)."""
        try:
            record, key = store.issue_key(checked_name(name, "tenant name", "name"))
        except UnknownTenantError as exc:
            raise _no_tenant(name) from exc
        except ValueError as exc:
            raise ApiError(409, str(exc), param="name", code="too_many_keys") from exc
        return {**tenant_json(record), "api_key": key}

    @router.delete("/admin/tenants/{name}/keys/{key_id}")
    def retire_key(name: str, key_id: str) -> dict[str, Any]:
        try:
            record = store.retire_key(checked_name(name, "tenant name", "name"), key_id)
        except UnknownTenantError as exc:
            raise _no_tenant(name) from exc
        except UnknownKeyError as exc:
            raise ApiError(404, f"tenant {name!r} has no key {key_id!r}", "not_found_error", param="key_id") from exc
        except ValueError as exc:
            raise ApiError(409, str(exc), param="key_id", code="last_key") from exc
        return tenant_json(record)

    @router.get("/admin/pool")
    def pool() -> dict[str, Any]:
        return {**control.pool_figures(), "store": asdict(store.status())}

    @router.post("/admin/pool/check")
    def check_pool() -> dict[str, Any]:
        """Run the pool's integrity check on the engine thread (free + cached + in use = total, and more)."""
        try:
            control.check_integrity()
        except AssertionError as exc:
            return {"ok": False, "error": str(exc) or "integrity check failed"}
        return {"ok": True}

    return router


def checked_name(name: str, what: str, param: str) -> str:
    """``name`` if it is a valid tenant or adapter name (admin.store.NAME_PATTERN), else a 400 naming ``param``."""
    try:
        return validate_name(name, what)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=param) from exc


def _no_tenant(name: str) -> ApiError:
    return ApiError(404, f"tenant {name!r} does not exist", "not_found_error", param="name")


def _usage_json(u: Any) -> dict[str, int]:
    return {"requests": u.requests, "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens}
