"""``EngineAdapters``: the serving side of the admin API (``lora_server.admin.api.AdapterControl``) over one Engine.

Contract: every method is called from a worker thread, never on the event loop; a refusal the client caused is an
``ApiError`` 400 (nothing changed). ``lock`` is the one lock under which an adapter changes in the engine and in the
registry store together (the admin API) and under which a ``RegistrySync`` brings the engine in step with the store;
``load_on_demand`` takes it too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

from lora_server.adapters.peft_format import AdapterError
from lora_server.adapters.served import AdapterInfo
from lora_server.admin.api.control import PoolFigures, ServedAdapter
from lora_server.admin.api.errors import ApiError
from lora_server.engine import Engine
from lora_server.engine.adapter_registry import AdapterSpec, CheckedAdapter
from lora_server.errors import UnknownAdapterError

log = logging.getLogger("lora_server")


class EngineAdapters:
    """The admin API's view of the engine's adapters (admin.api.AdapterControl). Owns ``lock``: held while an adapter
    changes in the engine and in the registry store together (the admin API) and while a RegistrySync brings the
    engine in step with the store."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.lock = threading.Lock()

    def check_adapter(self, name: str, path: str, pinned: bool) -> CheckedAdapter:
        try:
            return self.engine.adapters.check(name, path, pinned)
        except AdapterError as exc:
            raise ApiError(400, str(exc), param="path") from exc

    def check_adapters(self, specs: Sequence[tuple[str, str, bool]]) -> list[CheckedAdapter | ApiError]:
        """``check_adapter`` of each (name, path, pinned), on several threads (Engine.adapters.check_many): each one's
        result in order, an ApiError 400 with the reason for one that cannot be served. Changes nothing."""
        results = self.engine.adapters.check_many([AdapterSpec(*spec) for spec in specs])
        return [ApiError(400, str(r), param="path") if isinstance(r, AdapterError) else r for r in results]

    def serve_adapter(self, checked: CheckedAdapter, pinned: bool, version: int) -> ServedAdapter:
        """Call under ``lock``: nothing else removes the name before its info is read."""
        try:
            handle = self.engine.adapters.install(checked, pinned, version)
        except AdapterError as exc:
            raise ApiError(400, str(exc), param="pinned") from exc
        info = self.engine.adapters.info(handle.name)
        assert info is not None, f"adapter {handle.name!r} was removed while its lock was held"
        return ServedAdapter(handle.name, handle.adapter_id, info)

    def next_version(self, name: str) -> int:
        return self.engine.adapters.next_version(name)

    def unload_adapter(self, name: str) -> bool:
        try:
            self.engine.adapters.remove(name)
        except UnknownAdapterError:
            return False
        return True

    def load_on_demand(self, name: str) -> bool:
        """Register ``<adapter root>/<name>`` under ``name`` if one of the engine's adapter roots has that directory
        (vLLM's filesystem resolver), as this server's own (source "on-demand": not written to the registry
        store, left alone by its sync); True when ``name`` is served afterwards. ``name`` must be a plain name
        (a valid adapter name: the caller checks). ApiError 400 when the directory exists but cannot be served."""
        roots = self.engine.config.adapter_roots or ()
        with self.lock:
            if name in self.engine.adapters.names():
                return True
            for root in roots:
                path = Path(root) / name
                if (path / "adapter_config.json").is_file():
                    try:
                        self.engine.adapters.add(name, path, source="on-demand")
                    except AdapterError as exc:  # the caller may be anyone: the reason without paths
                        log.info("adapter %s from %s cannot be loaded: %s", name, path, exc)
                        raise ApiError(400, f"adapter `{name}` cannot be loaded: {exc.public}", param="model") from exc
                    log.info("adapter %s registered on first use from %s", name, path)
                    return True
        return False

    def served_adapters(self) -> list[str]:
        return self.engine.adapters.names()

    def adapter_info(self, name: str) -> AdapterInfo | None:
        return self.engine.adapters.info(name)

    def pool_figures(self) -> PoolFigures:
        """The unified pool's report and the scheduler's queues from the engine's last snapshot; the adapters it
        serves now."""
        snap = self.engine.snapshot()
        return PoolFigures(
            pool=snap.pool,
            num_preemptions=snap.num_preemptions,
            running=snap.running,
            waiting=snap.waiting,
            max_loras=self.engine.config.max_loras,
            registered_adapters=tuple(self.engine.adapters.names()),
        )

    def check_integrity(self) -> None:
        self.engine.check_integrity()
