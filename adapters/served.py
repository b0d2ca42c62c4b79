"""``AdapterInfo``: what the engine says of an adapter name it serves, as a plain value. The engine builds it
(Engine.adapters.info); the server and the admin API read it. This module imports nothing of the engine, so either
side names the type without importing the other."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lora_server.json_types import JsonObject


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """Where an adapter name's current version is served from."""

    path: str  # its PEFT directory, or the URL it was downloaded from (adapters.sources)
    source: str  # where it was registered from: "demo", "command line", "api" or "on-demand"
    version: int
    pinned: bool
    registered_at: float  # unix seconds
    state: str  # "resident" (its weights on the device) or "registered"
    table_page: int | None  # its table page while resident
    bytes: int  # its weights as registered (host)
    device_bytes: int  # its pages on the device

    def as_json(self) -> JsonObject:
        """The fields by name, in their order (the admin API's adapter JSON)."""
        return asdict(self)
