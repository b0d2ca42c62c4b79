"""The admin API (adapters, tenants, pool figures) as a FastAPI router. Every route needs the admin key as
``Authorization: Bearer ...``, compared in constant time. The serving side is reached through ``AdapterControl``
(``control``), which answers in values whose JSON the router makes, so this package does not import the engine."""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt

from lora_server.adapters.sources import source_scheme
from lora_server.admin.api.control import AdapterControl, CheckedT, PoolFigures, ServedAdapter
from lora_server.admin.api.errors import ApiError
from lora_server.admin.store import (
    MAX_NAME_SHOWN,
    MAX_TENANT_WEIGHT,
    AdapterRecord,
    RateLimits,
    RegistryStore,
    TenantExistsError,
    TenantRecord,
    UnknownKeyError,
    UnknownTenantError,
    Usage,
    key_id,
    validate_name,
)
from lora_server.admin.store.keys import constant_time_equals, hash_api_key

MAX_BATCH_ADAPTERS = 10_000  # adapters of one POST /admin/adapters/batch
MAX_REFUSALS_SHOWN = 20  # refused adapters a batch's error names; the others are counted
SERVED_ALREADY = 'already served (send "replace": true to serve new weights under it as a new version)'


class AdapterBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    path: str
    pinned: bool = False
    replace: bool = False  # serve the new weights under a name already served (a new version); else 409


class AdapterBatchBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    adapters: list[AdapterBody]


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
    control: AdapterControl[CheckedT],
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

    def adapter_name(name: str) -> str:
        """``name`` if an adapter may take it, else a 400 saying why."""
        checked_name(name, "adapter name", "name")
        if name == base_model_id:
            raise ApiError(400, f"{name!r} is the base model's id; choose another adapter name", param="name")
        return name

    def adapter_source(path: str) -> str:
        """Where the adapter is read from: a URL as given (the engine downloads it if its scheme is enabled), or the
        resolved local path; a 400 for a local path outside the allowed roots."""
        if source_scheme(path) is not None:
            return path
        try:
            resolved = Path(path).expanduser().resolve()
        except (ValueError, RuntimeError) as exc:  # a NUL byte; ~user of no such user
            raise ApiError(400, f"adapter path {path!r} cannot be resolved: {exc}", param="path") from exc
        if not any(resolved.is_relative_to(r) for r in allowed_roots):
            raise ApiError(
                400,
                f"adapter path {path} is outside the allowed adapter roots "
                f"({', '.join(map(str, allowed_roots))}; add one with --adapter-root)",
                param="path",
            )
        return str(resolved)

    def register(name: str, path: str, pinned: bool, replace: bool) -> dict[str, Any]:
        adapter_name(name)
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
        source = adapter_source(path)
        # files first (a 400 changes nothing), then the store (a 503 changes nothing), then the engine
        checked = control.check_adapter(name, source, pinned)
        old = store.get_adapter(name)
        record = store.put_adapter(AdapterRecord(name, source, _next_version(name, old, control), pinned, time.time()))
        try:
            served = control.serve_adapter(checked, pinned, record.version)
        except ApiError:  # not expected under the lock; the store is put back as it was
            if old is None:
                store.delete_adapter(name)
            else:
                store.put_adapter(old)
            raise
        return _served_json(served, record)

    def register_batch(items: list[AdapterBody]) -> dict[str, Any]:
        """All or nothing: every item validated (name, path, a name twice, one served without ``replace``), every
        file checked on several threads outside ``lock``; any refusal is one error naming each refused item, and
        nothing changes. Then one store write and each adapter served, under ``lock``."""
        if len(items) > MAX_BATCH_ADAPTERS:
            raise ApiError(
                400,
                f"a batch holds at most {MAX_BATCH_ADAPTERS} adapters, got {len(items)}; send it in several",
                param="adapters",
            )
        refusals: dict[int, str] = {}  # item index -> why it is refused
        conflicts: set[int] = set()  # the items refused only because their name is served
        sources: dict[int, str] = {}
        first: dict[str, int] = {}  # name -> index of its first item
        served = set(control.served_adapters())
        for i, item in enumerate(items):
            try:
                adapter_name(item.name)
                sources[i] = adapter_source(item.path)
            except ApiError as exc:
                refusals[i] = exc.message
                continue
            if item.name in first:
                refusals[i] = f"the same name as adapters[{first[item.name]}]"
            elif not item.replace and item.name in served:
                refusals[i] = SERVED_ALREADY
                conflicts.add(i)
            first.setdefault(item.name, i)
        ok = [i for i in range(len(items)) if i not in refusals]
        checks = control.check_adapters([(items[i].name, sources[i], items[i].pinned) for i in ok])
        checked: dict[int, CheckedT] = {}
        for i, c in zip(ok, checks, strict=True):
            if isinstance(c, ApiError):
                refusals[i] = c.message
            else:
                checked[i] = c
        if refusals:
            raise _batch_refused(items, refusals, conflicts)
        with control.lock:
            served = set(control.served_adapters())  # again: another registration may have come first
            conflicts = {i for i, item in enumerate(items) if not item.replace and item.name in served}
            if conflicts:
                raise _batch_refused(items, dict.fromkeys(conflicts, SERVED_ALREADY), conflicts)
            return install_batch(items, [sources[i] for i in ok], [checked[i] for i in ok], served)

    def install_batch(
        items: list[AdapterBody], sources: list[str], checked: list[CheckedT], served: set[str]
    ) -> dict[str, Any]:
        """The store's one write, then each adapter served (under ``lock``). Only a pin can be refused now (one that
        no longer fits beside those served before it), so pins are served first, new names before replaced ones:
        a refusal then finds as little as can be to undo. It undoes the batch as ``register`` does: the store as it
        was, and the new names served so far unloaded; a replaced name served so far gets its old version back when
        the registry sync reloads it from the store's restored record."""
        olds = {r.name: r for r in store.list_adapters()}
        now = time.time()
        records = [
            AdapterRecord(item.name, source, _next_version(item.name, olds.get(item.name), control), item.pinned, now)
            for item, source in zip(items, sources, strict=True)
        ]
        stored = store.put_adapters(records)
        order = sorted(range(len(items)), key=lambda i: (not items[i].pinned, items[i].name in served))
        answers: dict[int, dict[str, Any]] = {}
        for i in order:
            record = stored[i]
            try:
                answer = control.serve_adapter(checked[i], record.pinned, record.version)
            except ApiError as exc:
                for j in answers:
                    if stored[j].name not in served:
                        control.unload_adapter(stored[j].name)
                store.put_adapters([old for r in stored if (old := olds.get(r.name)) is not None])
                for r in stored:
                    if r.name not in olds:
                        store.delete_adapter(r.name)
                raise _batch_refused(items, {i: exc.message}, set()) from exc
            answers[i] = _served_json(answer, record)
        return {"data": [answers[i] for i in range(len(items))]}

    def describe(name: str, record: AdapterRecord | None) -> dict[str, Any] | None:
        """An adapter as the engine serves it, or as the store recorded it ("not loaded": its files failed)."""
        info = control.adapter_info(name)
        if info is not None:
            return {"name": name, **info.as_json(), "created_at": None if record is None else record.created_at}
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

    @router.post("/admin/adapters/batch")
    def add_adapters(body: AdapterBatchBody) -> dict[str, Any]:
        return register_batch(body.adapters)

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
        return {**tenant_json(record), "api_key": key, "key_id": key_id(hash_api_key(key)), "warnings": warnings}

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
        return {**tenant_json(record), "api_key": key, "key_id": key_id(hash_api_key(key))}  # which id is the new one

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
        return {**_pool_json(control.pool_figures()), "store": asdict(store.status())}

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


def _next_version(name: str, old: AdapterRecord | None, control: AdapterControl[CheckedT]) -> int:
    """The version of the name's next registration: above its record in the store (``old``) and the engine's latest
    (call under ``control.lock``)."""
    return max(1 if old is None else old.version + 1, control.next_version(name))


def _batch_refused(items: Sequence[AdapterBody], refusals: dict[int, str], conflicts: set[int]) -> ApiError:
    """One error for a refused batch, naming each refused item (the first MAX_REFUSALS_SHOWN, then a count): a 409
    when every refusal is a name already served (``conflicts``), else a 400."""
    shown = [f"adapters[{i}] {_shown(items[i].name)}: {refusals[i]}" for i in sorted(refusals)[:MAX_REFUSALS_SHOWN]]
    more = len(refusals) - len(shown)
    message = f"{len(refusals)} of {len(items)} adapters refused, nothing changed: {'; '.join(shown)}" + (
        f"; and {more} more" if more else ""
    )
    if refusals.keys() <= conflicts:
        return ApiError(409, message, param="adapters", code="adapter_exists")
    return ApiError(400, message, param="adapters")


def _shown(name: str) -> str:
    return repr(name[:MAX_NAME_SHOWN]) + ("..." if len(name) > MAX_NAME_SHOWN else "")


def _no_tenant(name: str) -> ApiError:
    return ApiError(404, f"tenant {name!r} does not exist", "not_found_error", param="name")


def _served_json(served: ServedAdapter, record: AdapterRecord) -> dict[str, Any]:
    """An adapter just served, as a registration answers: its name, id and info, version and pin as recorded."""
    return {
        "name": served.name,
        "adapter_id": served.adapter_id,
        **served.info.as_json(),
        "version": record.version,
        "pinned": record.pinned,
    }


def _pool_json(f: PoolFigures) -> dict[str, Any]:
    """GET /admin/pool's figures (the store's status aside): the pool report's JSON, then the queues and adapters."""
    return {
        **f.pool.as_json(),
        "num_preemptions": f.num_preemptions,
        "running": f.running,
        "waiting": f.waiting,
        "max_loras": f.max_loras,
        "registered_adapters": list(f.registered_adapters),
    }


def _usage_json(u: Usage) -> dict[str, int]:
    return {"requests": u.requests, "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens}
