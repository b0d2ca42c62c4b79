"""The engine's adapters as its callers change and read them, from any thread (Engine.adapters): registered one
at a time or many (their files read, checked and hashed on the staging workers' threads), staged in host memory
ahead of their requests, removed, described."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from lora_server.adapters.peft_format import AdapterError
from lora_server.adapters.served import AdapterInfo
from lora_server.engine.adapter_loader import AdapterLoader
from lora_server.engine.adapter_registry import AdapterHandle, AdapterRegistry, AdapterSpec, CheckedAdapter
from lora_server.errors import UnknownAdapterError


class AdapterSurface:
    """Over the engine's ``registry`` and ``loader``; ``wake`` is set when staging may let waiting requests run,
    ``resident_pages`` gives the engine thread's last published residency (adapter id -> table page)."""

    def __init__(
        self,
        registry: AdapterRegistry,
        loader: AdapterLoader,
        staging_workers: int,
        wake: threading.Event,
        resident_pages: Callable[[], Mapping[int, int]],
    ) -> None:
        self.registry, self.loader, self.staging_workers = registry, loader, staging_workers
        self._wake, self._resident_pages = wake, resident_pages

    def add(
        self,
        name: str,
        path: str | Path,
        pinned: bool = False,
        version: int | None = None,
        source: str = "api",
        registered_at: float | None = None,
    ) -> AdapterHandle:
        """Register a PEFT LoRA directory under ``name`` (a new version if the name exists; ``version``: at least
        the one given); raises AdapterError with the reason when it cannot be served. A pinned adapter is loaded
        onto the device as soon as there is room and never evicted. Safe while serving: running requests are not
        stalled, and those that hold an older version keep it. ``source`` says where it came from ("demo",
        "command line", "api"); ``registered_at`` when (the registry store's time; default now)."""
        return self.registry.register(name, path, pinned, version, source, registered_at)

    def check(self, name: str, path: str | Path, pinned: bool = False) -> CheckedAdapter:
        """``add`` in two steps, for a caller that records the registration elsewhere in between: read and
        validate the files (AdapterError with the reason; nothing changes), then ``install``."""
        return self.registry.check(name, path, pinned)

    def install(
        self,
        checked: CheckedAdapter,
        pinned: bool = False,
        version: int | None = None,
        registered_at: float | None = None,
    ) -> AdapterHandle:
        """Serve a checked adapter (``add``'s arguments; source "api"); reads no file."""
        return self.registry.install(checked, pinned, version, registered_at=registered_at)

    def next_version(self, name: str) -> int:
        """The least version the next registration of ``name`` gets."""
        return self.registry.next_version(name)

    def check_many(self, specs: Sequence[AdapterSpec]) -> list[CheckedAdapter | AdapterError]:
        """``check`` for many, on several threads (the staging workers' count): each one's result in order,
        an AdapterError with the reason for one that cannot be served. Changes nothing."""
        return self.registry.check_many(specs, self.staging_workers)

    def add_many(self, specs: Sequence[AdapterSpec], source: str = "api") -> list[AdapterHandle | AdapterError]:
        """``add`` for many: their files read, checked and hashed on several threads (the staging workers'
        count), then each served; each one's result in order, an AdapterError with the reason for one that cannot
        be served (the others are served all the same)."""
        registry = self.registry
        results: list[AdapterHandle | AdapterError] = []
        for spec, checked in zip(specs, self.check_many(specs), strict=True):
            if isinstance(checked, AdapterError):
                results.append(checked)
                continue
            try:
                results.append(registry.install(checked, spec.pinned, source=source))
            except AdapterError as exc:  # a pin that no longer fits beside the ones installed before it
                results.append(exc)
        return results

    def stage(self, names: Sequence[str], timeout_s: float = 60.0) -> list[str]:
        """Read these adapters' weights and stage them in host memory now, in order while they fit its budget
        (--cpu-lora-gb, --max-cpu-loras), blocking until they are (or ``timeout_s``): their first requests then
        wait for no disk read. Returns the names staged. UnknownAdapterError for a name that is not registered;
        AdapterError if one cannot be staged."""
        loader = self.loader
        room, staged = loader.budget_bytes, list[str]()
        for name in names:
            handle = self.registry.get(name)
            if handle.device_nbytes > room or len(staged) == (loader.max_images or -1):
                break
            room -= handle.device_nbytes
            staged.append(name)
        ids = [self.registry.get(name).adapter_id for name in staged]
        for adapter_id in ids:
            loader.request(adapter_id)
        deadline = time.monotonic() + timeout_s
        while any(loader.staged(i) is None for i in ids) and time.monotonic() < deadline:
            failed = loader.failed(ids)
            if failed:
                raise AdapterError(failed)
            loader.wait(0.05)
        self._wake.set()
        return staged

    def remove(self, name: str) -> None:
        """New requests for ``name`` fail (UnknownAdapterError); in-flight ones finish, then its memory is freed."""
        self.registry.unregister(name)

    def names(self) -> list[str]:
        return self.registry.names()

    def files(self, name: str) -> Path:
        """The directory the current version of ``name`` was read from (one from a source: the cache's copy, not
        its URL as ``info`` gives it); UnknownAdapterError when it is not registered."""
        return self.registry.path(name)

    def info(self, name: str) -> AdapterInfo | None:
        """Where an adapter's current version is served from: its path, bytes, and table page if resident (None:
        no such adapter)."""
        adapters = self.registry
        try:
            handle, path, nbytes = adapters.get(name), adapters.path(name), adapters.nbytes(name)
        except UnknownAdapterError:
            return None
        page = self._resident_pages().get(handle.adapter_id)
        return AdapterInfo(
            path=adapters.sources.url_of(path) or str(path),  # an adapter from a source: its URL, not the cache's copy
            source=handle.source,
            version=handle.version,
            pinned=handle.pinned,
            registered_at=handle.registered_at,
            state="resident" if page is not None else "registered",
            table_page=page,
            bytes=nbytes,
            device_bytes=handle.device_nbytes,
        )
