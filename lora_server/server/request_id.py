"""``x-request-id``: every HTTP request has an id, the client's (its ``x-request-id`` header) or a generated one; it
comes back in the response's ``x-request-id`` header, prefixes the server's log lines written while the request is
served (uvicorn's access line included), and the completion endpoints derive their response ``id`` from it, as
vLLM does (``cmpl-ID``, ``chatcmpl-ID``). The same middleware, the outermost, notes when the request arrived
(``arrival_time``): where its time to first token starts."""

from __future__ import annotations

import logging
import time
import uuid
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
MAX_LENGTH = 256  # a longer client id is replaced by a generated one (and said so in the log)
LOGGERS = ("lora_server", "uvicorn.access", "uvicorn.error")  # whose lines carry the id
# The request being served by this task or worker thread (starlette copies the context into both); "" outside one.
_current: ContextVar[str] = ContextVar("request_id", default="")
log = logging.getLogger("lora_server")


def request_id(scope: Scope, body_id: str | None = None) -> str:
    """The id the middleware gave this request; ``body_id`` (vLLM's request_id field) instead when the client sent
    no x-request-id header (the header wins, as in vLLM)."""
    state = scope["state"]
    return body_id if body_id is not None and not state["request_id_given"] else state["request_id"]


def arrival_time(scope: Scope) -> float:
    """When the middleware first saw this request (time.monotonic), before its body was read."""
    return scope["state"]["arrival"]


class RequestIds:
    """ASGI middleware: give each HTTP request its id (see the module), keep it in ``scope["state"]`` and the log
    context, and send it back in the response headers; note its arrival in ``scope["state"]`` too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(HEADER, b"").decode("latin-1").strip()
        rid = given if 0 < len(given) <= MAX_LENGTH and given.isprintable() else uuid.uuid4().hex
        token = _current.set(rid)
        if given and rid != given:
            log.warning("x-request-id of %d characters replaced by a generated one", len(given))
        arrival = time.monotonic()
        scope.setdefault("state", {}).update(request_id=rid, request_id_given=rid == given, arrival=arrival)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, rid.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _current.reset(token)


class RequestIdLogFilter(logging.Filter):
    """Prefixes a record's message with ``[ID]`` while a request is being served. uvicorn's access formatter
    builds its line from the record's arguments alone (client address first), so there the address is
    prefixed."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = _current.get()
        if rid and not getattr(record, "request_id", None):
            record.request_id = rid
            if record.name == "uvicorn.access" and isinstance(record.args, tuple) and record.args:
                record.args = (f"[{rid}] {record.args[0]}", *record.args[1:])
            else:
                record.msg = f"[{rid}] {record.msg}"
        return True


def install_log_filter() -> None:
    """Put the filter on the loggers whose lines a request's work writes (idempotent)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RequestIdLogFilter) for f in logger.filters):
            logger.addFilter(RequestIdLogFilter())
