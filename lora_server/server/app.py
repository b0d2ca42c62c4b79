"""The HTTP server's assembly: ``build_app`` wires one Engine and one registry store into a FastAPI app.

What it puts together, outermost first: the request id (``request_id``), CORS when origins are given, the body limit
and the draining refusal (``middleware``); errors in OpenAI's shape from every layer (``error_handlers``); /health and
/metrics; the OpenAI-compatible endpoints for /v1 and /t/{tenant}/v1 (``openai_routes``), acting as the caller that
``tenancy`` names and metered per tenant; the status page and the admin API (``lora_server.admin.api``) over the
engine's adapters (``engine_adapters``); the OpenAPI document (the admin routes only to the admin key).

Nothing here blocks the event loop: bodies are parsed, prompts templated and tokenized, and the store is called in
worker threads; engine state is read from the snapshot the engine thread publishes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.middleware.cors import CORSMiddleware

from lora_server.admin.api import admin_router, require_admin_key
from lora_server.admin.store import RegistryStore
from lora_server.config import ServerConfig
from lora_server.engine import Engine
from lora_server.server.engine_adapters import EngineAdapters
from lora_server.server.error_handlers import add_error_handlers
from lora_server.server.metrics import Metrics
from lora_server.server.middleware import BodyLimit, RefuseWhileDraining
from lora_server.server.openai_routes import SELF_PARSED_BODIES, add_openai_routes
from lora_server.server.openai_serving import OpenAIServing
from lora_server.server.request_id import RequestIds, install_log_filter
from lora_server.server.tenancy import Callers, TenantPresence

STATUS_PAGE = Path(__file__).with_name("status.html")
# the admin page is never framed by another site (clickjacking) nor read as another type than HTML
ADMIN_PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}


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
    callers = Callers(store, tenants, settings, admin_key)
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
    add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if engine.dead.is_set() else 200)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type=metrics.content_type)

    add_openai_routes(app, engine, store, serving, control, callers, settings, model_id)

    @app.get("/admin/ui", response_class=HTMLResponse)
    async def status_page(request: Request) -> HTMLResponse:
        """The pool as an operator sees it, refreshed by itself; the browser asks for the admin key (HTTP Basic,
        any user name) and the page reads the admin API with it."""
        require_admin_key(request, admin_key)
        return HTMLResponse(STATUS_PAGE.read_text(), headers=ADMIN_PAGE_HEADERS)

    roots = [Path(r) for r in engine.config.adapter_roots or ()]
    admin = admin_router(store, control, admin_key, roots, model_id, tenants.changed)
    app.include_router(admin)
    _add_body_schemas(app, SELF_PARSED_BODIES)
    if settings.docs:
        admin_paths = {"/admin/ui", *(route.path for route in admin.routes if hasattr(route, "path"))}

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi_document(request: Request) -> JSONResponse:
            """The whole API to the admin key; without it, the document leaves the admin routes out."""
            document = app.openapi()
            return JSONResponse(document if callers.is_admin(request) else _without_paths(document, admin_paths))

        @app.get("/docs", include_in_schema=False)
        async def docs() -> HTMLResponse:
            return get_swagger_ui_html(openapi_url="/openapi.json", title="lora-server")

    return app


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
