"""The OpenAI-compatible endpoints, routed by adapter: ``add_openai_routes`` adds them to the app.

/v1 (models, chat/completions, completions) and vLLM's /tokenize and /detokenize act as the caller that
``tenancy.Callers`` names; /t/{tenant}/v1 and /t/{tenant}/(de)tokenize as the tenant whose key is presented. A
request's ``model`` names the base model or an adapter the caller may use (404 unknown, 403 not allowed; with
--load-adapters-on-demand an adapter root's directory is registered on first use). A completion is parsed and
prepared in a worker thread, admitted against its tenant's limits (``TenantMeter``), its grammar compiled only once
admitted, then run: a JSON answer, or an SSE stream; a client that leaves is a 499. The routes of OpenAI's API this
server does not serve (``NOT_SERVED``) answer 404 saying what to use instead. Every error is an ``ApiError``, answered
in OpenAI's shape (``error_handlers``).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from lora_server.admin.api import checked_name
from lora_server.admin.api.errors import ApiError
from lora_server.admin.store import RegistryStore, TenantRecord
from lora_server.config import ServerConfig
from lora_server.engine import Engine
from lora_server.server.engine_adapters import EngineAdapters
from lora_server.server.error_handlers import error_response
from lora_server.server.openai_serving import Arrival, ClientDisconnected, OpenAIServing, Prepared
from lora_server.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from lora_server.server.request_id import arrival_time, request_id
from lora_server.server.tenancy import Callers, TenantMeter, cache_salt, tenant_share
from lora_server.server.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize

NOT_SERVED = {
    "responses": "use /v1/chat/completions (the Responses API's stored conversations, built-in tools and "
    "reasoning items are not implemented)",
    "embeddings": "the served models are decoder-only chat models and their LoRA adapters, with no pooling head "
    "that makes an embedding",
}
# the request bodies the routes parse themselves (off the event loop): their schemas go into the OpenAPI document
SELF_PARSED_BODIES = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)


def add_openai_routes(
    app: FastAPI,
    engine: Engine,
    store: RegistryStore,
    serving: OpenAIServing,
    control: EngineAdapters,
    callers: Callers,
    settings: ServerConfig,
    model_id: str,
) -> None:
    """Add the model, tokenizer and completion routes (for /v1 and /t/{tenant}/v1) and the not-served ones to
    ``app``; ``model_id`` is the base model's id in the API."""
    started = int(time.time())  # the base model's "created"
    is_admin, caller, tenant_of = callers.is_admin, callers.caller, callers.tenant_of

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
        info = engine.adapters.info(name)
        if info is None:
            return None
        return {
            "id": name,
            "object": "model",
            "created": int(info.registered_at),
            "owned_by": "lora-server",
            "root": info.path if show_paths else name,
            "parent": model_id,
            "max_model_len": engine.max_model_len,
        }

    def models(allowed: tuple[str, ...] | None, show_paths: bool) -> dict[str, Any]:
        served = engine.adapters.names()
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
        if model in engine.adapters.names():
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
        resolving = time.monotonic()
        adapter = await resolve(req.model, tenant)
        # its TTFT starts at its arrival; resolving it may have registered its adapter (on first use)
        arrival = Arrival(arrival_time(request.scope), time.monotonic() - resolving)
        prepare = serving.prepare_chat if kind == "chat" else serving.prepare_completion
        prepared: Prepared = await run_in_threadpool(
            prepare,  # type: ignore[arg-type]
            req,
            adapter,
            cache_salt(tenant),
            tenant_share(tenant),
            request_id(request.scope, req.request_id),
            arrival,
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
        return error_response(ApiError(404, f"/v1/{route} is not served by this server: {why}", "not_found_error"))

    for route in NOT_SERVED:
        for prefix in ("/v1", "/t/{tenant}/v1"):
            app.add_api_route(f"{prefix}/{route}", not_served, methods=["GET", "POST"], include_in_schema=False)


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
