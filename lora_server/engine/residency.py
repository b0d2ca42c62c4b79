"""Where a registered adapter stands on its way to the device, asked in one place.

One owner per fact, and none of them here:
- the registry (engine.adapter_registry): names, contents and which names are pinned (a content is pinned while any
  name on it is);
- the loader (engine.adapter_loader): the images staged on the host, what is being staged, what failed;
- the pool (kv_pool.UnifiedPool): residency, the facts its decisions read: each adapter's tier and table page, its
  pin, whether it is staged (so that only adapters whose bytes are ready are loaded), the loads decided and not yet
  taken.

Residency is the engine thread's view over them: ``sync`` carries the registry's changes and the loader's
events into the pool once a step (the only writer of the pool's adapter flags), and the scheduler asks it whether
a request's adapter can be made resident now (``ready``), whether its copy is still under way (``copying``) and
which adapters could not be staged (``take_failures``); the copy step asks it for the bytes of the loads the pool
decided (``images``). Only the engine thread calls it."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from lora_server.engine.adapter_loader import LATER, AdapterLoader, StagedAdapter
from lora_server.engine.adapter_registry import AdapterHandle, AdapterRegistry
from lora_server.kv_pool.tree import AdapterKey, CopyOp, OpKind
from lora_server.kv_pool.unified_pool import UnifiedPool


class Residency:
    def __init__(
        self,
        registry: AdapterRegistry,
        loader: AdapterLoader,
        pool: UnifiedPool,
        adapter_loaded: Callable[[int], bool] | None = None,
    ) -> None:
        """``adapter_loaded(table page)``, where adapter loads are asynchronous (CUDA), says whether an adapter's
        copy into the arena has run (None: loads are done before the step's forward pass)."""
        self.registry, self.loader, self.pool = registry, loader, pool
        self.adapter_loaded = adapter_loaded
        self._failures: dict[int, str] = {}  # content id -> why it could not be staged, until taken
        self._staged_at: dict[int, float] = {}  # content id -> when a sync learned it was staged, while it is

    def sync(self, now: float) -> None:
        """Tell the pool of contents registered and retired (they go with their KV) since the last call, of pins
        that changed (a pinned adapter is staged at once and loaded as room allows), and of what the loader staged,
        evicted from the host or failed to stage. Pinned adapters' images are never evicted."""
        changes = self.registry.take_changes()
        retired = set(changes.retired)
        for handle in changes.added:
            if handle.adapter_id not in retired:
                self.pool.register_adapter(handle.adapter_id, handle.device_nbytes)
        for adapter_id in retired:
            self.pool.drop_adapter(adapter_id)
        if changes.pinned is not None:
            for adapter_id in changes.pinned ^ self.pool.pinned_adapters():
                pinned = adapter_id in changes.pinned
                self.pool.set_pinned(AdapterKey(adapter_id), pinned)
                if pinned:
                    self.loader.request(adapter_id)
        for adapter_id in retired:
            self.loader.forget(adapter_id)
        events = self.loader.take_events(keep=self.pool.pinned_adapters())
        for adapter_id in events.staged:
            self.pool.set_staged(AdapterKey(adapter_id), True)
            self._staged_at[adapter_id] = now
        for adapter_id in [*events.evicted, *retired]:
            if adapter_id in events.evicted:
                self.pool.set_staged(AdapterKey(adapter_id), False)
            self._staged_at.pop(adapter_id, None)
        self._failures.update(events.failed)

    def ready(self, adapter_id: int, priority: float = LATER) -> bool:
        """Whether the adapter can be made resident now: on the device, or staged on the host. If not, the loader
        is asked to stage it, with ``priority`` (the arrival time of the request that waits for it: the earliest
        first)."""
        if self.pool.can_make_resident(AdapterKey(adapter_id)):
            return True
        self.loader.request(adapter_id, priority)
        return False

    def ready_since(self, adapter_id: int, now: float) -> float:
        """Since when a ready adapter has been ready, as far as waiting requests are concerned: the sync that
        learned it was staged, or ``now`` (it was resident, or staged before anyone waited)."""
        return min(now, self._staged_at.get(adapter_id, now))

    def copying(self, table_page: int) -> bool:
        """Whether the adapter at this table page is still being copied into the arena (asynchronous loads only):
        its load is decided but not yet executed, or executed and not yet run. -1 (no adapter): False."""
        if self.adapter_loaded is None or table_page < 0:
            return False
        return table_page in self.pool.pending_adapter_pages() or not self.adapter_loaded(table_page)

    def take_failures(self) -> dict[int, str]:
        """The contents that could not be staged since the last call (id -> why, naming no path)."""
        failures, self._failures = self._failures, {}
        return failures

    def release(self, handle: AdapterHandle) -> None:
        """A request ended: its hold on its adapter's version goes (the registry retires a content nobody holds
        or names; the next sync drops it from the pool)."""
        self.registry.drop(handle)

    def images(self, ops: Iterable[CopyOp]) -> dict[AdapterKey, StagedAdapter]:
        """The staged bytes of each adapter load among ``ops`` (the pool saw them staged this step: still there)."""
        images = {}
        for op in ops:
            if op.kind is OpKind.ADAPTER_LOAD and op.adapter is not None:
                staged = self.loader.staged(op.adapter.adapter_id)
                assert staged is not None, f"adapter {op.adapter} is loaded by the pool but not staged"
                images[op.adapter] = staged
        return images

    def staging(self) -> bool:
        """Whether the loader has an adapter on its way."""
        return self.loader.busy()

    def wait_for_staging(self, timeout: float) -> None:
        """Block until a staging lands or fails (or ``timeout`` seconds): for an engine with nothing else to do."""
        self.loader.wait(timeout)
