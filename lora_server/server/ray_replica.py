"""One engine replica under Ray Serve: the whole single-process server (engine, registry store, the FastAPI app of
``build_app``) in a Serve replica, called in-process by the ingress (``ray_ingress``) through a deployment handle.

The request's adapter is Serve's multiplexed model id: the replica reports the adapters it served last (an LRU of
``max_loras`` names, Serve's ``@serve.multiplexed``), and Serve's router sends a request to a replica that reports
its adapter when one does. Whether the adapter was really on the device is the replica's own pool's fact; each
replica counts it (``stats``).

Adapters and tenants: the registry store is the source of truth, and each replica follows its changes live
(``RegistrySync``: Redis pub/sub, or polling a shared SQLite file). So that a client of the one address reads its
own writes at once, a replica answers a change with the store's revision after it (``ResponseHead.revision``), the
ingress passes the highest revision it has seen with every request, and a replica behind it catches up before
serving the request."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from ray import serve
from starlette.types import Message

from lora_server.admin.store import StoreUnavailableError
from lora_server.config import ServerConfig
from lora_server.server.serve import build

log = logging.getLogger("lora_server")


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What the ingress forwards of an HTTP request besides its body."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """The first item a replica yields: the app's status and headers, and who answered. ``revision``: after a
    request that changed the registry (``changes_registry``), the store's revision once the change was made; else
    -1."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    replica: str
    revision: int = -1


REGISTRY_CHANGES = ("/admin/", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def changes_registry(head: RequestHead) -> bool:
    """Whether the request may change adapters or tenants (any admin call but a read)."""
    return head.method not in ("GET", "HEAD") and head.path.startswith(REGISTRY_CHANGES)


@dataclass(slots=True)
class ReplicaCounts:
    """What one replica saw of adapter requests (requests whose ``model`` names one of its adapters)."""

    adapter_requests: int = 0
    resident_at_arrival: int = 0  # their adapter was on the device when they reached this replica
    # arrivals that found their adapter off the device while no earlier request for it was still in flight here:
    # each of these made the pool load it
    adapter_loads: int = 0


def replica_class(max_adapters: int) -> type:
    """The deployment's class; ``max_adapters``: how many adapter names a replica reports to Serve's router."""

    class EngineReplica:
        def __init__(self, config: ServerConfig, admin_key: str) -> None:
            logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
            self.server = build(replace(config, admin_key=admin_key), admin_key, "the launcher")
            self.engine, self.app = self.server.engine, self.server.app
            self.server.start()
            self.name = serve.get_replica_context().replica_tag
            self.counts = ReplicaCounts()
            self.loading: Counter[str] = Counter()  # adapter -> its requests in flight that arrived off the device

        @serve.multiplexed(max_num_models_per_replica=max_adapters)
        async def note_adapter(self, model_id: str) -> str:
            """Serve's loader: the pool loads adapters itself, so this only makes Serve report the name."""
            return model_id

        def check_health(self) -> None:
            """Serve's health check: a dead engine fails it, and Serve replaces the replica."""
            if self.engine.dead.is_set():
                raise RuntimeError(f"the engine has stopped: {self.engine.dead_error!r}")

        def stats(self) -> dict[str, Any]:
            stats = self.engine.snapshot().pool.stats
            return {
                "replica": self.name,
                "adapter_requests": self.counts.adapter_requests,
                "resident_at_arrival": self.counts.resident_at_arrival,
                "adapter_loads": self.counts.adapter_loads,
                "pool_adapter_hit_rate": stats.adapter_hit_rate,
                "resident_adapters": stats.resident_adapters,
            }

        async def forward(
            self, head: RequestHead, body: bytes, model: str, revision: int
        ) -> AsyncIterator[ResponseHead | bytes]:
            """The app's answer to one request: a ResponseHead, then the body in chunks as the app sends them.
            ``model``: the body's model ("" when it names none); ``revision``: the registry's revision the
            request must see (changes made through the ingress so far)."""
            if self.server.registry.revision < revision:  # the live feed has not brought it here yet
                await asyncio.to_thread(self._catch_up)
            adapter = model if model and self.engine.adapters.info(model) is not None else ""
            if adapter and serve.get_multiplexed_model_id():  # routed by adapter: Serve's router learns it is here
                await self.note_adapter(adapter)
            loading = self._arrive(adapter) if adapter else False
            try:
                async for item in call_asgi(self.app, head, body, self.name):
                    if isinstance(item, ResponseHead) and item.status < 300 and changes_registry(head):
                        item = replace(item, revision=await asyncio.to_thread(self._store_revision))
                    yield item
            finally:
                if loading:
                    self.loading[adapter] -= 1

        def _catch_up(self) -> None:
            try:
                self.server.registry.catch_up()
            except StoreUnavailableError as exc:  # serve with what it has; the app answers 503 where it needs the store
                log.warning("registry: cannot catch up with the store: %s", exc)

        def _store_revision(self) -> int:
            try:
                return self.server.store.revision()
            except StoreUnavailableError:
                return -1  # the change is made; other replicas get it from the feed

        def _arrive(self, adapter: str) -> bool:
            """Count an adapter request; True when it found its adapter off the device (it is loading it, or
            waits for an earlier request's load)."""
            info = self.engine.adapters.info(adapter)
            resident = info is not None and info.state == "resident"
            self.counts.adapter_requests += 1
            self.counts.resident_at_arrival += resident
            if resident:
                return False
            self.counts.adapter_loads += not self.loading[adapter]
            self.loading[adapter] += 1
            return True

    return EngineReplica


async def call_asgi(app: Any, head: RequestHead, body: bytes, replica: str) -> AsyncIterator[ResponseHead | bytes]:
    """Run one HTTP request through an ASGI app in this process. When the caller stops reading (its client left,
    or Serve cancelled the call) the app sees ``http.disconnect`` and is cancelled."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": head.method,
        "scheme": "http",
        "path": head.path,
        "raw_path": head.path.encode(),
        "root_path": "",
        "query_string": head.query,
        "headers": list(head.headers),
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
    }

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseHead(message["status"], tuple(message.get("headers", ())), replica)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
    finally:
        gone.set()
        if not task.done():
            await asyncio.wait({task}, timeout=1.0)
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # its own errors were answered by the app
