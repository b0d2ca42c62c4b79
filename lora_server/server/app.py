"""The HTTP server: OpenAI-compatible endpoints routed by adapter, per-tenant endpoints, the admin API, /health
and /metrics, on FastAPI. Built around one Engine and one registry store; ``build_app`` wires them.

Who a request acts as: on ``/t/{tenant}/v1`` the tenant whose key it presents; on ``/v1`` a tenant's key also acts
as that tenant (its allow-list, limits, usage and cache salt), ``--api-key`` grants the whole server, and anonymous
callers are let in only while the operator allows it (``TenantPresence``).

Nothing here blocks the event loop: bodies are parsed, prompts templated and tokenized, and the store is called in
worker threads; engine state is read from the snapshot the engine thread publishes."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lora_server.adapters.peft_format import AdapterError
from lora_server.admin.api import admin_router, checked_name, presented_key, require_admin_key
from lora_server.admin.errors import ApiError
from lora_server.admin.keys import API_KEY_PREFIX, constant_time_equals
from lora_server.admin.store import RateDecision, RegistryStore, StoreUnavailableError, TenantRecord
from lora_server.config import ServerConfig
from lora_server.engine import Engine
from lora_server.engine.adapter_registry import CheckedAdapter, UnknownAdapterError
from lora_server.engine.request import NO_TENANT, TenantShare
from lora_server.errors import LoraServerError
from lora_server.server.metrics import Metrics
from lora_server.server.openai_serving import ClientDisconnected, OpenAIServing, Prepared
from lora_server.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body, validation_message
from lora_server.server.request_id import RequestIds, install_log_filter, request_id
from lora_server.server.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize

log = logging.getLogger("lora_server")
STATUS_PAGE = Path(__file__).with_name("status.html")
# the admin page is never framed by another site (clickjacking) nor read as another type than HTML
ADMIN_PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}
STORE_RETRY_AFTER_S = 2
TENANTS_CHECK_S = 1.0  # how long "are there tenants?" is trusted for anonymous /v1 access (other replicas)
NOT_SERVED = {
    "responses": "use /v1/chat/completions (the Responses API's stored conversations, built-in tools and "
    "reasoning items are not implemented)",
    "embeddings": "the served models are decoder-only chat models and their LoRA adapters, with no pooling head "
    "that makes an embedding",
}


class EngineAdapters:
    """The admin API's view of the engine's adapters (admin.api.AdapterControl). Owns ``lock``: held while an adapter
    changes in the engine and in the registry store together (the admin API) and while a RegistrySync brings the
    engine in step with the store."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.lock = threading.Lock()

    def check_adapter(self, name: str, path: str, pinned: bool) -> CheckedAdapter:
        try:
            return self.engine.check_adapter(name, path, pinned)
        except AdapterError as exc:
            raise ApiError(400, str(exc), param="path") from exc

    def serve_adapter(self, checked: CheckedAdapter, pinned: bool, version: int) -> dict[str, Any]:
        try:
            handle = self.engine.install_adapter(checked, pinned, version)
        except AdapterError as exc:
            raise ApiError(400, str(exc), param="pinned") from exc
        return {"name": handle.name, "adapter_id": handle.adapter_id, **(self.adapter_info(handle.name) or {})}

    def next_version(self, name: str) -> int:
        return self.engine.next_adapter_version(name)

    def unload_adapter(self, name: str) -> bool:
        try:
            self.engine.remove_adapter(name)
        except UnknownAdapterError:
            return False
        return True

    def load_on_demand(self, name: str) -> bool:
        """Register ``<adapter root>/<name>`` under ``name`` if one of the engine's adapter roots has that directory
        (vLLM's filesystem resolver), as this server's own (source "on-demand": not written to the registry
        store, left alone by its sync); True when ``name`` is served afterwards. ``name`` must be a plain name
        (a valid adapter name: the caller checks). ApiError 400 when the directory exists but cannot be served."""
        roots = self.engine.config.adapter_roots or ()
        with self.lock:
            if name in self.engine.adapter_names():
                return True
            for root in roots:
                path = Path(root) / name
                if (path / "adapter_config.json").is_file():
                    try:
                        self.engine.add_adapter(name, path, source="on-demand")
                    except AdapterError as exc:  # the caller may be anyone: the reason without paths
                        log.info("adapter %s from %s cannot be loaded: %s", name, path, exc)
                        raise ApiError(400, f"adapter `{name}` cannot be loaded: {exc.public}", param="model") from exc
                    log.info("adapter %s registered on first use from %s", name, path)
                    return True
        return False

    def served_adapters(self) -> list[str]:
        return self.engine.adapter_names()

    def adapter_info(self, name: str) -> dict[str, Any] | None:
        return self.engine.adapter_info(name)

    def pool_figures(self) -> dict[str, Any]:
        """The unified pool's figures (kv_tokens_by_salt keys: "" for /v1, "tenant:NAME" per tenant), plus the
        scheduler's queues."""
        snap = self.engine.snapshot()
        return {
            **snap.pool,
            "num_preemptions": snap.num_preemptions,
            "running": snap.running,
            "waiting": snap.waiting,
            "max_loras": self.engine.config.max_loras,
            "registered_adapters": self.engine.adapter_names(),
        }

    def check_integrity(self) -> None:
        self.engine.check_integrity()


class BodyLimit:
    """ASGI middleware: a request body above ``max_bytes`` is answered 413 in OpenAI's shape before it is read
    whole (Content-Length is checked first; a chunked body is counted as it arrives). The body read is handed on
    to the app unchanged. A request that carries both Content-Length and Transfer-Encoding is a 400."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if b"content-length" in headers and b"transfer-encoding" in headers:
            await _refuse_framing(scope, receive, send)
            return
        if scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body arrived
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then disconnects, as the app expects

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = ApiError(
            413, f"the request body is larger than {self.max_bytes} bytes", param=None, code="request_too_large"
        )
        await JSONResponse(err.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)


async def _refuse_framing(scope: Scope, receive: Receive, send: Send) -> None:
    """A request with both Content-Length and Transfer-Encoding: which one ends its body is ambiguous (the shape of
    request smuggling through a proxy that reads the other one); RFC 9112 section 6.3 lets a server refuse it, and
    the connection is closed after the 400."""
    err = ApiError(400, "a request must not carry both Content-Length and Transfer-Encoding", param=None)
    await JSONResponse(err.body(), status_code=400, headers={"Connection": "close"})(scope, receive, send)


class RefuseWhileDraining:
    """ASGI middleware: once ``state.draining`` is set, every request but /metrics gets 503 with Retry-After."""

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.state.draining and scope["path"] != "/metrics":
            err = ApiError(
                503,
                "the server is shutting down; retry on another replica",
                "service_unavailable",
                headers={"Retry-After": "5"},
            )
            await JSONResponse(err.body(), status_code=503, headers=err.headers)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def build_app(engine: Engine, store: RegistryStore, settings: ServerConfig, model_id: str, admin_key: str) -> FastAPI:
    """The app of one engine and one registry store; ``model_id`` is the base model's id in the API, ``admin_key``
    the admin API's key."""
    app = FastAPI(
        title="lora-server",
        description="Many LoRA adapters of one base model behind an OpenAI-compatible "
        "API, with an admin API for adapters and tenants.",
        openapi_url=None,  # served below: the admin routes only to the admin key
        docs_url=None,
        redoc_url=None,
    )
    metrics = Metrics(model_id, engine, settings.max_lora_metric_labels)
    serving = OpenAIServing(engine, metrics, settings.tool_call_parser)
    control = EngineAdapters(engine)
    tenants = TenantPresence(store)
    app.state.engine, app.state.store, app.state.control, app.state.tenants = engine, store, control, tenants
    app.state.draining = False  # set when shutdown starts: new requests get 503, in-flight ones finish
    app.add_middleware(RefuseWhileDraining, state=app.state)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)
    if settings.allowed_origins:  # CORS: off unless origins are given
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=list(settings.allowed_methods or ("*",)),
            allow_headers=list(settings.allowed_headers or ("*",)),
            allow_credentials=settings.allow_credentials,
            expose_headers=["x-request-id"],
        )
    app.add_middleware(RequestIds)  # outermost: every answer carries the request's id, refusals included
    install_log_filter()
    started = int(time.time())  # the base model's "created"

    # ---- errors in OpenAI's shape, from every layer -----------------------------------------------------------

    def error(err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        if exc.errors() and exc.errors()[0].get("type") == "json_invalid":
            message, param = "invalid JSON body", None
        return error(ApiError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(
            exc.status_code, "invalid_request_error"
        )
        return error(ApiError(exc.status_code, str(exc.detail), kind, headers=dict(exc.headers or {})))

    @app.exception_handler(LoraServerError)
    async def _engine_error(_: Request, exc: LoraServerError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.http_status in (429, 503) else {}
        return error(ApiError(exc.http_status, exc.message, exc.error_type, exc.param, exc.code, headers))

    @app.exception_handler(StoreUnavailableError)
    async def _store_down(_: Request, exc: StoreUnavailableError) -> JSONResponse:
        log.warning("registry store unavailable: %s", exc)
        return error(
            ApiError(
                503,
                "the registry store is unavailable; retry shortly",
                "service_unavailable",
                code="store_unavailable",
                headers={"Retry-After": str(STORE_RETRY_AFTER_S)},
            )
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error(ApiError(500, "internal server error", "server_error"))

    # ---- health, metrics, models ---------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if engine.dead.is_set() else 200)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type=metrics.content_type)

    def model_card(name: str, show_paths: bool) -> dict[str, Any] | None:
        """One model as /v1/models lists it: the base (created: the server's start) or a served adapter (created:
        its registration); None when ``name`` is neither."""
        if name == model_id:
            return {
                "id": model_id,
                "object": "model",
                "created": started,
                "owned_by": "lora-server",
                "root": model_id,
                "parent": None,
                "max_model_len": engine.max_model_len,
            }
        info = engine.adapter_info(name)
        if info is None:
            return None
        return {
            "id": name,
            "object": "model",
            "created": int(info["registered_at"]),
            "owned_by": "lora-server",
            "root": info["path"] if show_paths else name,
            "parent": model_id,
            "max_model_len": engine.max_model_len,
        }

    def models(allowed: tuple[str, ...] | None, show_paths: bool) -> dict[str, Any]:
        served = engine.adapter_names()
        names = served if allowed is None else [a for a in allowed if a in served]
        cards = (model_card(name, show_paths) for name in [model_id, *names])
        return {"object": "list", "data": [card for card in cards if card is not None]}

    def one_model(name: str, allowed: tuple[str, ...] | None, show_paths: bool) -> dict[str, Any]:
        """GET /v1/models/{id}: the model, or 404 in OpenAI's shape (also for an adapter the caller may not use)."""
        card = model_card(name, show_paths) if allowed is None or name in (model_id, *allowed) else None
        if card is None:
            raise ApiError(
                404, f"The model `{name}` does not exist.", "not_found_error", param="model", code="model_not_found"
            )
        return card

    # ---- who is asking ------------------------------------------------------------------------------------

    def is_admin(request: Request) -> bool:
        return constant_time_equals(presented_key(request), admin_key)

    async def caller(request: Request) -> TenantRecord | None:
        """Who a /v1 request acts as: the tenant whose key it presents, else None (the --api-key, or anonymous
        access while it is open); 401 otherwise."""
        key = _bearer(request)
        if settings.api_key is not None and key and constant_time_equals(key, settings.api_key):
            return None
        if key.startswith(API_KEY_PREFIX):  # only our tenant keys carry the prefix: nothing else is looked up
            tenant = await run_in_threadpool(store.tenant_by_key, key)
            if tenant is not None:
                return tenant
        if settings.api_key is None and await run_in_threadpool(tenants.anonymous_open, settings.allow_anonymous):
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

    async def tenant_of(name: str, request: Request) -> TenantRecord:
        key = _bearer(request)
        record = await run_in_threadpool(store.authenticate, name, key) if key else None
        if record is None:
            raise ApiError(401, "missing or wrong API key for this tenant", "authentication_error")
        return record

    async def resolve(model: str | None, tenant: TenantRecord | None) -> str | None:
        """The adapter a request's ``model`` names (None: the base model); 404 unknown, 403 not allowed. With
        --load-adapters-on-demand, an unknown plain name that an adapter root holds is registered first (off the
        event loop; the tenant's allow-list is checked before, a name that is not a valid adapter name is a 400)."""
        if tenant is not None and not model:
            model = tenant.default_adapter
        if not model or model == model_id:
            return None
        if tenant is not None and model not in tenant.adapters:
            raise ApiError(
                403, f"model {model!r} is not available to tenant {tenant.name!r}", "permission_error", param="model"
            )
        if model in engine.adapter_names():
            return model
        if settings.load_adapters_on_demand:
            checked_name(model, "adapter name", "model")  # the name of a directory under a root: no path in it
            if await run_in_threadpool(control.load_on_demand, model):
                return model
        raise ApiError(
            404, f"The model `{model}` does not exist.", "not_found_error", param="model", code="model_not_found"
        )

    # ---- the completion endpoints ---------------------------------------------------------------------------

    async def complete(kind: str, request: Request, tenant: TenantRecord | None) -> Response:
        raw = await request.body()
        model_cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
        req = await run_in_threadpool(parse_body, raw, model_cls)
        adapter = await resolve(req.model, tenant)
        prepare = serving.prepare_chat if kind == "chat" else serving.prepare_completion
        prepared: Prepared = await run_in_threadpool(
            prepare,  # type: ignore[arg-type]
            req,
            adapter,
            cache_salt(tenant),
            tenant_share(tenant),
            request_id(request.scope, req.request_id),
        )
        try:
            meter = (
                None if tenant is None else await run_in_threadpool(TenantMeter.admit, store, tenant, adapter, prepared)
            )
        except BaseException:
            serving.discard(prepared.requests)
            raise
        try:  # compiled only once admitted: a refused request costs no compile
            await serving.attach_grammars(prepared)
        except BaseException:
            serving.discard(prepared.requests)
            if meter is not None:
                await run_in_threadpool(meter.refund)
            raise
        try:
            result = await serving.run(
                prepared, req.model or adapter or model_id, meter, lambda: _disconnected(request)
            )
        except ClientDisconnected:
            return Response(status_code=499)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        if is_admin(request):
            return models(None, show_paths=True)
        tenant = await caller(request)
        return models(None if tenant is None else tenant.adapters, show_paths=False)

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request) -> dict[str, Any]:
        if is_admin(request):
            return one_model(name, None, show_paths=True)
        tenant = await caller(request)
        return one_model(name, None if tenant is None else tenant.adapters, show_paths=False)

    async def tokenizer_route(request: Request, tenant: TenantRecord | None, detok: bool) -> dict[str, Any]:
        """vLLM's /tokenize and /detokenize for a caller: ``model`` resolved as on the completion endpoints."""
        raw = await request.body()
        if detok:
            body = await run_in_threadpool(parse_body, raw, DetokenizeRequest)
            await resolve(body.model, tenant)
            return await run_in_threadpool(detokenize, engine, body)
        req = await run_in_threadpool(parse_body, raw, TokenizeRequest)
        await resolve(req.model, tenant)
        return await run_in_threadpool(tokenize, engine, req)

    @app.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest))
    async def tokenize_route(request: Request) -> dict[str, Any]:
        return await tokenizer_route(request, await caller(request), detok=False)

    @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize_route(request: Request) -> dict[str, Any]:
        return await tokenizer_route(request, await caller(request), detok=True)

    @app.post("/t/{tenant}/tokenize", openapi_extra=_body_schema(TokenizeRequest))
    async def tenant_tokenize(tenant: str, request: Request) -> dict[str, Any]:
        return await tokenizer_route(request, await tenant_of(tenant, request), detok=False)

    @app.post("/t/{tenant}/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def tenant_detokenize(tenant: str, request: Request) -> dict[str, Any]:
        return await tokenizer_route(request, await tenant_of(tenant, request), detok=True)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await complete("chat", request, await caller(request))

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await complete("completion", request, await caller(request))

    @app.get("/t/{tenant}/v1/models")
    async def tenant_models(tenant: str, request: Request) -> dict[str, Any]:
        return models((await tenant_of(tenant, request)).adapters, show_paths=False)

    @app.get("/t/{tenant}/v1/models/{name:path}")
    async def tenant_model(tenant: str, name: str, request: Request) -> dict[str, Any]:
        return one_model(name, (await tenant_of(tenant, request)).adapters, show_paths=False)

    @app.post("/t/{tenant}/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def tenant_chat(tenant: str, request: Request) -> Response:
        return await complete("chat", request, await tenant_of(tenant, request))

    @app.post("/t/{tenant}/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def tenant_completions(tenant: str, request: Request) -> Response:
        return await complete("completion", request, await tenant_of(tenant, request))

    async def not_served(request: Request) -> JSONResponse:
        """OpenAI routes this server does not serve: a 404 in OpenAI's shape that says so and what to use."""
        route = request.url.path.rsplit("/v1/", 1)[-1]
        why = NOT_SERVED[route]
        return error(ApiError(404, f"/v1/{route} is not served by this server: {why}", "not_found_error"))

    for route in NOT_SERVED:
        for prefix in ("/v1", "/t/{tenant}/v1"):
            app.add_api_route(f"{prefix}/{route}", not_served, methods=["GET", "POST"], include_in_schema=False)

    @app.get("/admin/ui", response_class=HTMLResponse)
    async def status_page(request: Request) -> HTMLResponse:
        """The pool as an operator sees it, refreshed by itself; the browser asks for the admin key (HTTP Basic,
        any user name) and the page reads the admin API with it."""
        require_admin_key(request, admin_key)
        return HTMLResponse(STATUS_PAGE.read_text(), headers=ADMIN_PAGE_HEADERS)

    roots = [Path(r) for r in engine.config.adapter_roots or ()]
    admin = admin_router(store, control, admin_key, roots, model_id, tenants.changed)
    app.include_router(admin)
    _add_body_schemas(app, (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest))
    if settings.docs:
        admin_paths = {"/admin/ui", *(route.path for route in admin.routes if hasattr(route, "path"))}

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi_document(request: Request) -> JSONResponse:
            """The whole API to the admin key; without it, the document leaves the admin routes out."""
            document = app.openapi()
            return JSONResponse(document if is_admin(request) else _without_paths(document, admin_paths))

        @app.get("/docs", include_in_schema=False)
        async def docs() -> HTMLResponse:
            return get_swagger_ui_html(openapi_url="/openapi.json", title="lora-server")

    return app


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


async def _disconnected(request: Request) -> None:
    """Completes when the client has gone away (the body was read already: what is left is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _body_schema(model: type) -> dict[str, Any]:
    """openapi_extra of a route that parses its own body (off the event loop) as ``model``."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    }


def _add_body_schemas(app: FastAPI, models: tuple[type, ...]) -> None:
    """Put the JSON schemas of self-parsed bodies into the app's OpenAPI components (where _body_schema points)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")  # type: ignore[attr-defined]
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


def _without_paths(document: dict[str, Any], hidden: set[str]) -> dict[str, Any]:
    """The OpenAPI document without the ``hidden`` paths, and without the component schemas only they used."""
    paths = {path: item for path, item in document.get("paths", {}).items() if path not in hidden}
    schemas = document.get("components", {}).get("schemas", {})
    used: set[str] = set()
    pending = [paths]
    while pending:  # every schema a kept path reaches, through $refs
        node = pending.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            name = ref.rsplit("/", 1)[-1] if isinstance(ref, str) else None
            if name is not None and name not in used and name in schemas:
                used.add(name)
                pending.append(schemas[name])
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    components = {**document.get("components", {}), "schemas": {k: v for k, v in schemas.items() if k in used}}
    return {**document, "paths": paths, "components": components}
