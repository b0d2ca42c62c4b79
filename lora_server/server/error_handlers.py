"""Errors in OpenAI's shape, from every layer: ``add_error_handlers`` installs the app's exception handlers.

Contract: whatever a route raises, the client gets ``{"error": {"message", "type", "param", "code"}}`` with the
status the error names (``ApiError`` as raised; a body that fails validation 400; Starlette's HTTP errors with their
status; an engine ``LoraServerError`` with its own status, Retry-After on 429 and 503; the registry store out of
reach 503 with Retry-After ``STORE_RETRY_AFTER_S``; anything else 500 "internal server error", logged with its
traceback and never shown to the client).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lora_server.admin.api.errors import ApiError
from lora_server.admin.store import StoreUnavailableError
from lora_server.errors import LoraServerError
from lora_server.server.protocol import validation_message

log = logging.getLogger("lora_server")
STORE_RETRY_AFTER_S = 2


def error_response(err: ApiError) -> JSONResponse:
    """``err`` as the client receives it: its status, its body in OpenAI's shape, its headers."""
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def add_error_handlers(app: FastAPI) -> None:
    """Install the exception handlers that answer every error in OpenAI's shape (see the module)."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        if exc.errors() and exc.errors()[0].get("type") == "json_invalid":
            message, param = "invalid JSON body", None
        return error_response(ApiError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(
            exc.status_code, "invalid_request_error"
        )
        return error_response(ApiError(exc.status_code, str(exc.detail), kind, headers=dict(exc.headers or {})))

    @app.exception_handler(LoraServerError)
    async def _engine_error(_: Request, exc: LoraServerError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.http_status in (429, 503) else {}
        return error_response(ApiError(exc.http_status, exc.message, exc.error_type, exc.param, exc.code, headers))

    @app.exception_handler(StoreUnavailableError)
    async def _store_down(_: Request, exc: StoreUnavailableError) -> JSONResponse:
        log.warning("registry store unavailable: %s", exc)
        return error_response(
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
        return error_response(ApiError(500, "internal server error", "server_error"))
