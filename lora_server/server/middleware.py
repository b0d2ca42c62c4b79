"""The ASGI middleware of the app, outside its routes: each answers a request in OpenAI's error shape
(``ApiError.body()``) without calling the app, or hands the request on unchanged.

- ``RefuseWhileDraining``: once ``state.draining`` is set (shutdown started), every request but /metrics gets 503
  with Retry-After; requests already in flight finish.
- ``BodyLimit``: a body above ``max_bytes`` is a 413 before it is read whole; a request that carries both
  Content-Length and Transfer-Encoding is a 400 (request smuggling), its connection closed.

The request id middleware (``x-request-id``) is ``lora_server.server.request_id.RequestIds``.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lora_server.admin.api.errors import ApiError


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
