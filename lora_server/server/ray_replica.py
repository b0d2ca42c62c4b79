"""One engine replica under Ray Serve: the whole single-process server (engine, registry store, the FastAPI app of
``build_app``) in a Serve replica, called in-process by the ingress (``ray_ingress``) through a deployment handle.

The request's adapter is Serve's multiplexed model id: the replica reports the adapters it served last (an LRU of
``max_loras`` names, Serve's ``@serve.multiplexed``), and Serve's router sends a request to a replica that reports
its adapter when one does. Whether the adapter was really on the device is the replica's own pool's fact; each
replica counts it (``stats``).

Adapters: the registry store is the source of truth. The ingress passes a registry epoch with every request; a
replica that sees an epoch it has not seen reconciles its engine with the store first (adds and replaces what the
store records, removes API-registered adapters the store no longer has): idempotent, and a no-op when nothing
changed."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from ray import serve
from starlette.types import Message

from adapters.peft_format import AdapterError
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
    """The first item a replica yields: the app's status and headers, and who answered."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    replica: str


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
            self.engine, self.store, self.app = build(replace(config, admin_key=admin_key), admin_key, "the launcher")
            self.engine.start()
            self.name = serve.get_replica_context().replica_tag
            self.epoch = ""
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
            pool = self.engine.snapshot().pool
            return {
                "replica": self.name,
                "adapter_requests": self.counts.adapter_requests,
                "resident_at_arrival": self.counts.resident_at_arrival,
                "adapter_loads": self.counts.adapter_loads,
                "pool_adapter_hit_rate": pool["adapter_hit_rate"],
                "resident_adapters": pool["resident_adapters"],
            }

        async def forward(
            self, head: RequestHead, body: bytes, model: str, epoch: str
        ) -> AsyncIterator[ResponseHead | bytes]:
            """The app's answer to one request: a ResponseHead, then the body in chunks as the app sends them.
            ``model``: the body's model ("" when it names none)."""
            if epoch != self.epoch:
                await asyncio.to_thread(self._reconcile)
                self.epoch = epoch
            adapter = model if model and self.engine.adapter_info(model) is not None else ""
            if adapter and serve.get_multiplexed_model_id():  # routed by adapter: Serve's router learns it is here
                await self.note_adapter(adapter)
            loading = self._arrive(adapter) if adapter else False
            try:
                async for item in call_asgi(self.app, head, body, self.name):
                    yield item
            finally:
                if loading:
                    self.loading[adapter] -= 1

        def _arrive(self, adapter: str) -> bool:
            """Count an adapter request; True when it found its adapter off the device (it is loading it, or
            waits for an earlier request's load)."""
            info = self.engine.adapter_info(adapter)
            resident = info is not None and info["state"] == "resident"
            self.counts.adapter_requests += 1
            self.counts.resident_at_arrival += resident
            if resident:
                return False
            self.counts.adapter_loads += not self.loading[adapter]
            self.loading[adapter] += 1
            return True

        def _reconcile(self) -> None:
            """Make the engine's adapters what the store records (worker thread)."""
            records = {r.name: r for r in self.store.list_adapters()}
            for name, record in records.items():
                info = self.engine.adapter_info(name)
                if info is None or info["version"] != record.version:
                    try:
                        self.engine.add_adapter(name, record.path, record.pinned, record.version)
                    except AdapterError as exc:
                        log.warning("registered adapter %s could not be loaded: %s", name, exc)
            for name in self.engine.adapter_names():
                info = self.engine.adapter_info(name)
                if info is not None and info["source"] == "api" and name not in records:
                    self.engine.remove_adapter(name)

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
