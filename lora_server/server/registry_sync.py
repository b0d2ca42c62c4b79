"""RegistrySync: keeps one server's engine adapters and its tenant caches in step with the registry store that it
shares with other replicas, so that a change made through any replica takes effect on all of them.

The store is the source of truth for adapters registered through the admin API (``source == "api"``); demo and
``--adapter`` adapters are the process's own and are left alone. ``catch_up`` makes the engine serve what the store
records (loads what is new, reloads what has a newer version, another path or another pin, unloads API-registered
adapters the store no longer has) and tells the app to forget what it caches of tenants. ``start`` runs it on a
thread of its own each time the store's change feed (``admin.store.change_feed``) reports a new revision: within
milliseconds over Redis pub/sub, within ``POLL_S`` on a shared SQLite file. A server catches up once when it
starts (``serve.build``), so one that was down has every change made meanwhile.

Changes made by this server's own admin API are applied to its engine and written to the store under ``lock``
(``EngineAdapters.lock``), which ``catch_up`` holds too: a catch-up never sees an adapter in the engine and not yet
in the store, or the reverse, and so never undoes a change under way."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from lora_server.adapters.peft_format import AdapterError
from lora_server.admin.store import AdapterRecord, RegistryStore, StoreUnavailableError
from lora_server.admin.store.change_feed import ChangeFeed, open_feed
from lora_server.engine import Engine
from lora_server.engine.adapter_registry import AdapterSpec

log = logging.getLogger("lora_server")
RESYNC_S = 5.0  # a wait on the feed that hears nothing ends with a read of the revision (a missed wake-up)
RETRY_S = 1.0  # after a failure to reach the store, the next attempt


class RegistrySync:
    """The owner of ``revision``: the store's revision that this server's engine and caches are in step with
    (-1 before the first catch-up). ``tenants_changed`` is called after each catch-up (the app drops what it
    caches of tenants); ``lock`` is shared with the admin API (see the module's docstring)."""

    def __init__(
        self,
        store: RegistryStore,
        engine: Engine,
        lock: threading.Lock,
        tenants_changed: Callable[[], None],
        feed: ChangeFeed | None = None,
    ) -> None:
        self.store, self.engine, self.lock, self.tenants_changed = store, engine, lock, tenants_changed
        self.feed = open_feed(store) if feed is None else feed
        self.revision = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def catch_up(self) -> int:
        """Make the engine's adapters what the store records and drop the tenant caches (blocking: store calls
        and adapter loads, on the calling thread); returns the revision now in step with. Idempotent: a no-op
        on the engine when nothing changed. Raises StoreUnavailableError when the store cannot be reached."""
        with self.lock:
            revision = self.store.revision()  # read first: a change after it wakes the feed again
            records = {r.name: r for r in self.store.list_adapters()}
            stale = [r for r in records.values() if self._stale(r)]
            # the files of all of them read and checked at once, on several threads; then each served
            checks = self.engine.adapters.check_many([AdapterSpec(r.name, r.path, r.pinned) for r in stale])
            for record, checked in zip(stale, checks, strict=True):
                if not isinstance(checked, AdapterError):
                    try:
                        self.engine.adapters.install(
                            checked, record.pinned, record.version, registered_at=record.created_at
                        )
                        continue
                    except AdapterError as exc:  # a pin that does not fit beside those installed before it
                        checked = exc
                log.warning("registered adapter %s could not be loaded: %s", record.name, checked)
            for name in self.engine.adapters.names():
                info = self.engine.adapters.info(name)
                if info is not None and info.source == "api" and name not in records:
                    self.engine.adapters.remove(name)
            self.revision = revision
        self.tenants_changed()
        return revision

    def _stale(self, record: AdapterRecord) -> bool:
        """Whether the engine lacks ``record``'s adapter as recorded: absent, an older version, other files or
        another pin. (An engine version above the record's is the same adapter: versions only grow, and a
        demo adapter of the same name takes the next one when the record is loaded over it.)"""
        info = self.engine.adapters.info(record.name)
        return info is None or info.version < record.version or info.path != record.path or info.pinned != record.pinned

    def start(self) -> None:
        """Follow the store's changes on a daemon thread until ``stop``."""
        self._thread = threading.Thread(target=self._follow, name="registry-sync", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.feed.close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _follow(self) -> None:
        unreachable_since: float | None = None
        while not self._stop.is_set():
            try:
                heard = self.feed.wait(self.revision, RESYNC_S)
                if heard != self.revision and not self._stop.is_set():
                    before = self.revision
                    started = time.monotonic()
                    after = self.catch_up()
                    log.info(
                        "registry: revision %d -> %d, in step in %.3f s", before, after, time.monotonic() - started
                    )
                if unreachable_since is not None:
                    log.info("registry: the store answers again after %.1f s", time.monotonic() - unreachable_since)
                    unreachable_since = None
            except StoreUnavailableError as exc:
                if unreachable_since is None:
                    log.warning("registry: cannot follow the store's changes (retrying): %s", exc)
                    unreachable_since = time.monotonic()
                self._stop.wait(RETRY_S)
