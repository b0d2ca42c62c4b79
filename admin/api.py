"""The admin API (adapters, tenants, pool figures) as a FastAPI router. Every route needs the admin key as
``Authorization: Bearer ...``, compared in constant time. The serving side is reached through ``AdapterControl``,
so this package does not import the engine."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from admin.errors import ApiError
from admin.keys import constant_time_equals
from admin.store import AdapterRecord, RateLimits, RegistryStore, TenantExistsError, TenantRecord, is_valid_name


class AdapterControl(Protocol):
    """What the admin API needs from the serving side."""

    def load_adapter(self, name: str, path: str) -> dict[str, Any]: ...  # raises ApiError(400) with the reason
    def unload_adapter(self, name: str) -> None: ...  # raises ApiError(404) when unknown
    def adapter_info(self, name: str) -> dict[str, Any] | None: ...
    def pool_figures(self) -> dict[str, Any]: ...


class AdapterBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    path: str
    pinned: bool = False


class LoadLoraBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str


class UnloadLoraBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str


class RateLimitsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests_per_minute: StrictInt | None = Field(default=None, ge=1)
    tokens_per_minute: StrictInt | None = Field(default=None, ge=1)


class TenantBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    adapters: list[str] = Field(default_factory=list)
    default_adapter: str | None = None
    rate_limits: RateLimitsBody | None = None


def tenant_json(t: TenantRecord) -> dict[str, Any]:
    return {"name": t.name, "adapters": list(t.adapters), "default_adapter": t.default_adapter,
            "rate_limits": {"requests_per_minute": t.rate_limits.requests_per_minute,
                            "tokens_per_minute": t.rate_limits.tokens_per_minute},
            "created_at": t.created_at}


def admin_router(store: RegistryStore, control: AdapterControl, admin_key: str, allowed_roots: list[Path]) -> APIRouter:
    def require_admin(request: Request) -> None:
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not constant_time_equals(key.strip(), admin_key):
            raise ApiError(401, "a valid admin key is required (Authorization: Bearer ...)", "authentication_error")

    router = APIRouter(dependencies=[Depends(require_admin)])

    def register(name: str, path: str, pinned: bool) -> dict[str, Any]:
        if not is_valid_name(name):
            raise ApiError(400, f"invalid adapter name {name!r}: use letters, digits, '.', '_' or '-'", param="name")
        resolved = Path(path).expanduser().resolve()
        if not any(resolved.is_relative_to(r) for r in allowed_roots):
            raise ApiError(400, f"adapter path {path} is outside the allowed adapter roots", param="path")
        info = control.load_adapter(name, str(resolved))
        record = store.put_adapter(AdapterRecord(name, str(resolved), 1, pinned, time.time()))
        return {**info, "version": record.version, "pinned": record.pinned}

    @router.post("/admin/adapters")
    def add_adapter(body: AdapterBody) -> dict[str, Any]:
        return register(body.name, body.path, body.pinned)

    @router.get("/admin/adapters")
    def list_adapters() -> dict[str, Any]:
        return {"data": [_adapter_json(r, control) for r in store.list_adapters()]}

    @router.get("/admin/adapters/{name}")
    def get_adapter(name: str) -> dict[str, Any]:
        record = store.get_adapter(name)
        if record is None:
            raise ApiError(404, f"adapter {name!r} does not exist", param="name", code="model_not_found")
        return _adapter_json(record, control)

    @router.delete("/admin/adapters/{name}")
    def delete_adapter(name: str) -> dict[str, Any]:
        control.unload_adapter(name)
        store.delete_adapter(name)
        return {"name": name, "deleted": True}

    @router.post("/v1/load_lora_adapter")
    def load_lora(body: LoadLoraBody) -> dict[str, Any]:
        return register(body.lora_name, body.lora_path, False)

    @router.post("/v1/unload_lora_adapter")
    def unload_lora(body: UnloadLoraBody) -> dict[str, Any]:
        return delete_adapter(body.lora_name)

    @router.post("/admin/tenants")
    def create_tenant(body: TenantBody) -> dict[str, Any]:
        limits = body.rate_limits or RateLimitsBody()
        try:
            record, key = store.create_tenant(body.name, body.adapters, body.default_adapter,
                                              RateLimits(limits.requests_per_minute, limits.tokens_per_minute))
        except TenantExistsError as exc:
            raise ApiError(400, str(exc), param="name") from exc
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        return {**tenant_json(record), "api_key": key}

    @router.get("/admin/tenants")
    def list_tenants() -> dict[str, Any]:
        return {"data": [tenant_json(t) for t in store.list_tenants()]}

    @router.get("/admin/tenants/{name}")
    def get_tenant(name: str) -> dict[str, Any]:
        record = store.get_tenant(name)
        if record is None:
            raise ApiError(404, f"tenant {name!r} does not exist", param="name")
        usage = {a or "<base>": _usage_json(u) for a, u in store.usage(name).items()}
        return {**tenant_json(record), "usage": usage}

    @router.delete("/admin/tenants/{name}")
    def delete_tenant(name: str) -> dict[str, Any]:
        if not store.delete_tenant(name):
            raise ApiError(404, f"tenant {name!r} does not exist", param="name")
        return {"name": name, "deleted": True}

    @router.get("/admin/pool")
    def pool() -> dict[str, Any]:
        return control.pool_figures()

    return router


def _usage_json(u: Any) -> dict[str, int]:
    return {"requests": u.requests, "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens}


def _adapter_json(record: AdapterRecord, control: AdapterControl) -> dict[str, Any]:
    info = control.adapter_info(record.name) or {"state": "not loaded"}
    return {"name": record.name, "path": record.path, "version": record.version, "pinned": record.pinned,
            "created_at": record.created_at, **info}
