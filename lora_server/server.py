"""The HTTP server: OpenAI-compatible endpoints routed by adapter, per-tenant endpoints, the admin API, /health
and /metrics, on FastAPI. Built around one Engine and one registry store; ``build_app`` wires them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from adapters.peft_format import AdapterError
from admin.api import admin_router
from admin.errors import ApiError
from admin.keys import constant_time_equals
from admin.store import RegistryStore, TenantRecord
from lora_server.engine import Engine
from lora_server.errors import LoraServerError, QueueFullError
from lora_server.lora import UnknownAdapterError
from lora_server.metrics import Metrics
from lora_server.openai_serving import OpenAIServing, UsageHook
from lora_server.protocol import ChatCompletionRequest, CompletionRequest


@dataclass
class ServerSettings:
    model_id: str
    admin_key: str
    adapter_roots: list[Path] = field(default_factory=list)
    api_key: str | None = None  # required on the global /v1 endpoints when set


class EngineAdapters:
    """The admin API's view of the engine's adapters (admin.api.AdapterControl)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def load_adapter(self, name: str, path: str) -> dict[str, Any]:
        try:
            handle = self.engine.add_adapter(name, path)
        except AdapterError as exc:
            raise ApiError(400, str(exc), param="path") from exc
        return {"name": name, "adapter_id": handle.adapter_id, **(self.adapter_info(name) or {})}

    def unload_adapter(self, name: str) -> None:
        try:
            self.engine.remove_adapter(name)
        except UnknownAdapterError as exc:
            raise ApiError(404, f"adapter {name!r} is not loaded", param="name", code="model_not_found") from exc

    def adapter_info(self, name: str) -> dict[str, Any] | None:
        lora = self.engine.core.adapters
        try:
            handle = lora.get(name)
        except UnknownAdapterError:
            return None
        slot = lora.resident_slots().get(handle.adapter_id)
        return {"state": "resident" if slot is not None else "registered", "slot": slot,
                "bytes": lora.nbytes(name)}

    def pool_figures(self) -> dict[str, Any]:
        """The unified pool's figures (kv_tokens_by_salt keys: "" for /v1, "tenant:NAME" per tenant), plus the
        scheduler's queues."""
        core = self.engine.core
        return {**self.engine.pool_figures(), "num_preemptions": core.scheduler.num_preemptions,
                "running": len(core.scheduler.running), "waiting": len(core.scheduler.waiting),
                "adapter_slots": core.adapters.max_loras, "registered_adapters": core.adapters.names()}


POOL_GAUGES = ("adapter_hit_rate", "kv_token_hit_rate", "invalid_kv_ratio", "bytes_to_gpu", "bytes_to_host",
               "gpu_free", "gpu_cached", "gpu_in_use", "host_free", "host_cached")


def build_app(engine: Engine, store: RegistryStore, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="lora-server")
    metrics = Metrics(settings.model_id)
    serving = OpenAIServing(engine, settings.model_id, metrics)
    control = EngineAdapters(engine)
    app.state.engine, app.state.store, app.state.control = engine, store, control
    app.state.draining = False  # set when shutdown starts: new requests get 503, in-flight ones finish

    @app.middleware("http")
    async def _refuse_while_draining(request: Request, call_next):
        if app.state.draining and request.url.path != "/metrics":
            err = ApiError(503, "the server is shutting down; retry on another replica", "service_unavailable",
                           headers={"Retry-After": "5"})
            return JSONResponse(err.body(), status_code=503, headers=err.headers)
        return await call_next(request)

    # ---- errors in OpenAI's shape ----------------------------------------------------------------------------

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = "invalid JSON body" if first.get("type") == "json_invalid" else \
            f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
        param = loc[0] if loc and first.get("type") != "json_invalid" else None
        return JSONResponse(ApiError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(LoraServerError)
    async def _engine_error(_: Request, exc: LoraServerError) -> JSONResponse:
        headers = {"Retry-After": "1"} if isinstance(exc, QueueFullError) or exc.http_status == 503 else {}
        err = ApiError(exc.http_status, exc.message, exc.error_type, exc.param, exc.code, headers)
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    # ---- health, metrics, models ---------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if engine.dead_error is not None else 200)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        core, pool = engine.core, engine.pool_figures()
        salts = pool["kv_tokens_by_salt"].values()
        gauges = {"vllm:num_requests_running": len(core.scheduler.running),
                  "vllm:num_requests_waiting": len(core.scheduler.waiting),
                  "vllm:kv_cache_usage_perc": pool["request_blocks"] / pool["gpu_blocks"],
                  "vllm:num_preemptions_total": core.scheduler.num_preemptions,
                  "lora_server:adapters_resident": pool["resident_adapters"],
                  "lora_server:adapters_registered": len(core.adapters.names()),
                  **{f"lora_server:pool_{name}": pool[name] for name in POOL_GAUGES},
                  **{f"lora_server:pool_evicted_blocks_{kind}": n for kind, n in pool["evicted_blocks"].items()},
                  **{f"lora_server:ttft_{part}_mean_seconds": pool["ttft"][f"{part}_mean_s"]
                     for part in ("queueing", "adapter_loading", "prefill")}}
        metrics.set_counter("vllm:prefix_cache_queries_total", sum(s["prompt_tokens"] for s in salts))
        metrics.set_counter("vllm:prefix_cache_hits_total", sum(s["cached_tokens"] for s in salts))
        running = {r.adapter.name for r in core.scheduler.running if r.adapter is not None}
        waiting = {r.adapter.name for r in core.scheduler.waiting if r.adapter is not None}
        info = {"running_lora_adapters": ",".join(sorted(running)), "waiting_lora_adapters": ",".join(sorted(waiting)),
                "max_lora": str(core.adapters.max_loras)}
        return PlainTextResponse(metrics.render(gauges, info, dict), media_type="text/plain; version=0.0.4")

    def models(allowed: list[str] | None) -> dict[str, Any]:
        names = engine.core.adapters.names() if allowed is None else [a for a in allowed
                                                                          if a in engine.core.adapters.names()]
        base = {"id": settings.model_id, "object": "model", "created": 0, "owned_by": "lora-server",
                "root": settings.model_id, "parent": None, "max_model_len": engine.max_model_len}
        data = [base] + [{"id": n, "object": "model", "created": 0, "owned_by": "lora-server",
                          "root": str(engine.core.adapters.path(n)), "parent": settings.model_id} for n in names]
        return {"object": "list", "data": data}

    def resolve(model: str | None, tenant: TenantRecord | None) -> str | None:
        """The adapter a request's ``model`` names (None: the base model); 404 unknown, 403 not allowed."""
        if tenant is not None and not model:
            model = tenant.default_adapter
        if not model or model == settings.model_id:
            return None
        if tenant is not None and model not in tenant.adapters:
            raise ApiError(403, f"model {model!r} is not available to tenant {tenant.name!r}", "permission_error",
                           param="model")
        if model not in engine.core.adapters.names():
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return model

    def check_global_key(request: Request) -> None:
        if settings.api_key is not None and not constant_time_equals(_bearer(request), settings.api_key):
            raise ApiError(401, "a valid API key is required", "authentication_error")

    def tenant_of(name: str, request: Request) -> TenantRecord:
        key = _bearer(request)
        record = store.authenticate(name, key) if key else None
        if record is None:
            raise ApiError(401, "missing or wrong API key for this tenant", "authentication_error")
        return record

    def admit(tenant: TenantRecord | None, adapter: str | None, max_tokens: int | None) -> UsageHook | None:
        """Rate limits (429 with Retry-After), then the usage hook of the tenant."""
        if tenant is None:
            return None
        limits = tenant.rate_limits
        for kind, limit, amount in (("requests", limits.requests_per_minute, 1),
                                    ("tokens", limits.tokens_per_minute, max_tokens or 16)):
            if limit is None:
                continue
            decision = store.take(tenant.name, kind, min(amount, limit), limit)
            if not decision.allowed:
                raise ApiError(429, f"rate limit of {limit} {kind} per minute reached", "rate_limit_error",
                               headers={"Retry-After": str(max(1, math.ceil(decision.retry_after)))})

        def record(prompt_tokens: int, completion_tokens: int) -> None:
            store.add_usage(tenant.name, adapter, prompt_tokens, completion_tokens)
        return record

    async def answer(result: dict[str, Any] | Any) -> Response:
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    async def chat(req: ChatCompletionRequest, tenant: TenantRecord | None) -> Response:
        adapter = resolve(req.model, tenant)
        hook = admit(tenant, adapter, req.max_completion_tokens or req.max_tokens)
        return await answer(await serving.chat(req, adapter, req.model or adapter or settings.model_id, hook,
                                               cache_salt(tenant)))

    async def completion(req: CompletionRequest, tenant: TenantRecord | None) -> Response:
        adapter = resolve(req.model, tenant)
        hook = admit(tenant, adapter, req.max_tokens)
        return await answer(await serving.completion(req, adapter, req.model or adapter or settings.model_id, hook,
                                                     cache_salt(tenant)))

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        check_global_key(request)
        return models(None)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        check_global_key(request)
        return await chat(req, None)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        check_global_key(request)
        return await completion(req, None)

    @app.get("/t/{tenant}/v1/models")
    async def tenant_models(tenant: str, request: Request) -> dict[str, Any]:
        return models(list(tenant_of(tenant, request).adapters))

    @app.post("/t/{tenant}/v1/chat/completions")
    async def tenant_chat(tenant: str, req: ChatCompletionRequest, request: Request) -> Response:
        return await chat(req, tenant_of(tenant, request))

    @app.post("/t/{tenant}/v1/completions")
    async def tenant_completions(tenant: str, req: CompletionRequest, request: Request) -> Response:
        return await completion(req, tenant_of(tenant, request))

    app.include_router(admin_router(store, control, settings.admin_key, settings.adapter_roots))
    return app


def cache_salt(tenant: TenantRecord | None) -> str:
    """The prefix-cache salt of a request: each tenant's cached KV is its own; /v1 requests share "". Derived
    here, never taken from the client."""
    return "" if tenant is None else f"tenant:{tenant.name}"


def _bearer(request: Request) -> str:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""
