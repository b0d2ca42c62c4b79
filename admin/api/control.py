"""What the admin API needs from the serving side (``AdapterControl``) and the values it gets back: an adapter just
served (``ServedAdapter``, its registration as ``adapters.served.AdapterInfo``) and the pool's figures
(``PoolFigures``). The router makes the JSON of them; the serving side implements the protocol over the engine
(lora_server.server.engine_adapters), so this package does not import the engine."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from lora_server.adapters.served import AdapterInfo
from lora_server.admin.api.errors import ApiError
from lora_server.json_types import JsonObject

CheckedT = TypeVar("CheckedT")  # the serving side's token for an adapter's checked files


class PoolReportJson(Protocol):
    """The engine's pool report, as the admin API reads it: its JSON."""

    def as_json(self) -> JsonObject: ...


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    """An adapter as ``serve_adapter`` left it served."""

    name: str
    adapter_id: int
    info: AdapterInfo


@dataclass(frozen=True, slots=True)
class PoolFigures:
    """The pool's figures and the scheduler's queues, as the engine thread last published them."""

    pool: PoolReportJson  # kv_tokens_by_salt keys: "" for /v1, "tenant:NAME" per tenant
    num_preemptions: int
    running: int
    waiting: int
    max_loras: int
    registered_adapters: tuple[str, ...]  # every adapter the engine serves


class AdapterControl(Protocol[CheckedT]):
    """What the admin API needs from the serving side. ``lock`` is held while an adapter changes in the engine and
    in the store together, so that whatever else keeps the two in step (a registry sync) sees both or neither.

    Registering is two steps around the store's write: ``check_adapter`` reads and validates the files (ApiError(400)
    with the reason; nothing changes), ``serve_adapter`` then serves what was checked as version ``version`` (it
    reads no file, and under the same hold of ``lock`` it does not fail). ``check_adapters`` checks many (name, path,
    pinned) at once, on several threads: each one's result in order, an ApiError(400) with the reason for one that
    cannot be served; it changes nothing either."""

    lock: threading.Lock

    def check_adapter(self, name: str, path: str, pinned: bool) -> CheckedT: ...
    def check_adapters(self, specs: Sequence[tuple[str, str, bool]]) -> Sequence[CheckedT | ApiError]: ...
    def serve_adapter(self, checked: CheckedT, pinned: bool, version: int) -> ServedAdapter: ...
    def next_version(self, name: str) -> int: ...  # the least version the engine gives the name's next registration
    def unload_adapter(self, name: str) -> bool: ...  # False when the engine does not serve it
    def served_adapters(self) -> list[str]: ...  # every adapter the engine serves: demo, command line and API
    def adapter_info(self, name: str) -> AdapterInfo | None: ...  # None: not served
    def pool_figures(self) -> PoolFigures: ...
    def check_integrity(self) -> None: ...  # AssertionError when the pool's invariants are broken
