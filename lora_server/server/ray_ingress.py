"""The one address in front of the engine replicas under Ray Serve: every HTTP request (OpenAI API, admin API,
per-tenant endpoints, /health, /metrics) is handed whole to one replica's app (``ray_replica``), and its answer
streamed back.

Routing: with ``routing="adapter"`` the request body's ``model`` is the call's multiplexed model id, so Serve sends
it to a replica that already serves that adapter when there is one; ``"random"`` is Serve's default choice (two
random replicas, the shorter queue), the baseline.

A replica that dies under a request: before the answer started, the client gets a retriable 503 with
``Retry-After``; after a stream started, an error event ends the stream. Serve replaces the replica, and the
router sends later requests to the live ones.

Registry: every replica follows the registry store's changes live (``RegistrySync``). An admin call that changes
adapters or tenants runs on one replica, which answers with the store's revision after the change; the ingress
passes the highest revision it has seen with each request, and a replica that is behind it catches up first, so
a client reads its own writes through the one address at once."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from lora_server.admin.api import presented_key
from lora_server.admin.api.errors import ApiError
from lora_server.admin.store.keys import constant_time_equals
from lora_server.server.ray_replica import RequestHead, ResponseHead

REPLICA_GONE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)
RETRY_AFTER_S = 1
REPLICA_HEADER = "x-lora-server-replica"  # which replica answered (tests and benchmarks read it)


class Ingress:
    """Serve's ingress deployment (one replica: it holds the registry revision of the changes made through it)."""

    def __init__(self, engines: Any, routing: str, admin_key: str, num_replicas: int) -> None:
        self.engines, self.by_adapter = engines, routing == "adapter"
        self.admin_key, self.num_replicas = admin_key, num_replicas
        self.revision = -1  # the highest store revision a replica answered a change with

    async def __call__(self, request: Request) -> Response:
        if request.url.path == "/admin/replicas":
            return await self._replicas(request)
        body = await request.body()
        head = RequestHead(request.method, request.url.path, request.url.query.encode(), tuple(request.headers.raw))
        model = model_of(body) if request.method == "POST" else ""
        call = self.engines.options(stream=True, multiplexed_model_id=model if self.by_adapter else "")
        stream = call.forward.remote(head, body, model, self.revision)
        try:
            first: ResponseHead = await stream.__anext__()
        except REPLICA_GONE as exc:
            return replica_gone(exc)
        self.revision = max(self.revision, first.revision)
        headers = [(k, v) for k, v in first.headers if k.lower() != b"content-length"]
        headers.append((REPLICA_HEADER.encode(), first.replica.encode()))
        if dict(first.headers).get(b"content-type", b"").startswith(b"text/event-stream"):
            response: Response = StreamingResponse(relay_events(stream), status_code=first.status)
        else:
            try:
                content = b"".join([chunk async for chunk in stream])
            except REPLICA_GONE as exc:
                return replica_gone(exc)
            response = Response(content, status_code=first.status)
        response.raw_headers = [h for h in response.raw_headers if h[0] == b"content-length"] + headers
        return response

    async def _replicas(self, request: Request) -> Response:
        """Each live replica's counts (``EngineReplica.stats``), asked until every replica has answered (Serve
        picks the replica; at most 20 calls a replica)."""
        if not constant_time_equals(presented_key(request), self.admin_key):
            err = ApiError(401, "a valid admin key is required (Authorization: Bearer ...)", "authentication_error")
            return JSONResponse(err.body(), status_code=401)
        seen: dict[str, dict[str, Any]] = {}
        for _ in range(20 * self.num_replicas):
            try:
                stats = await self.engines.stats.remote()
            except REPLICA_GONE:
                continue
            seen[stats["replica"]] = stats
            if len(seen) == self.num_replicas:
                break
        return JSONResponse({"data": sorted(seen.values(), key=lambda s: s["replica"])})


def model_of(body: bytes) -> str:
    """The body's ``model`` when it is a JSON object naming one, else "" (no routing preference)."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else ""


def replica_gone(exc: Exception) -> JSONResponse:
    """A retriable 503 for a request whose replica died before it answered."""
    err = ApiError(
        503,
        f"the replica serving this request stopped ({type(exc).__name__}); retry",
        "service_unavailable",
        code="replica_unavailable",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )
    return JSONResponse(err.body(), status_code=503, headers=err.headers)


async def relay_events(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A replica's server-sent events; if the replica dies mid-stream, an error event and ``[DONE]`` end it."""
    try:
        async for chunk in stream:
            yield chunk
    except REPLICA_GONE as exc:
        body = replica_gone(exc).body
        yield b"data: " + bytes(body) + b"\n\ndata: [DONE]\n\n"
