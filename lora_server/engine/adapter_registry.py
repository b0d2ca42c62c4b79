"""The adapters an engine knows: each name's current version, every live version's host weights, and how many
requests hold each version. One owner for these facts; what is on the device, and where, is the pool's."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from adapters.peft_format import AdapterError, BaseShapes, LoraAdapter, load_peft_adapter
from kv_pool.tree import AdapterKey
from lora_server.errors import InvalidRequestError


class UnknownAdapterError(InvalidRequestError):
    http_status = 404

    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{name}` does not exist.", param="model", code="model_not_found")


@dataclass(frozen=True, slots=True)
class AdapterHandle:
    """What a request holds: one version of one adapter. Every registration gets a new ``adapter_id``; ``version``
    counts the registrations of its name (1, 2, ...; or the registry store's own when reloaded)."""

    name: str
    adapter_id: int
    version: int
    device_nbytes: int  # its A and B in the device dtype: its share of the device budget
    pinned: bool = False  # kept on the device once loaded (see kv_pool)
    source: str = "api"  # where it was registered from: "demo", "command line" or "api"

    @property
    def key(self) -> AdapterKey:
        return AdapterKey(self.adapter_id, self.version)


@dataclass(frozen=True, slots=True)
class AdapterChanges:
    """What the pool must learn since it last asked: versions registered, versions retired (ids)."""

    added: list[AdapterHandle]
    retired: list[int]


class AdapterRegistry:
    """Registered adapters, any number of them, as host copies. Thread-safe: HTTP threads register and resolve
    names, the engine thread takes changes and weights. A version lives while it is current or a request holds
    it: unloading or replacing a name retires the old version once its last request ends."""

    def __init__(
        self,
        shapes: BaseShapes,
        max_rank: int,
        device_dtype: torch.dtype,
        allowed_roots: list[Path] | None,
        max_pinned: int,
    ) -> None:
        self.shapes, self.max_rank, self.device_dtype = shapes, max_rank, device_dtype
        self.allowed_roots, self.max_pinned = allowed_roots, max_pinned
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._current: dict[str, AdapterHandle] = {}
        self._weights: dict[int, LoraAdapter] = {}  # adapter_id -> host weights, while live
        self._refs: dict[int, int] = {}  # adapter_id -> requests holding it
        self._versions: dict[str, int] = {}  # name -> its latest version
        self._added: list[AdapterHandle] = []
        self._retired: list[int] = []

    # ---- names (any thread) ---------------------------------------------------------------------------------

    def register(
        self, name: str, path: str | Path, pinned: bool = False, version: int | None = None, source: str = "api"
    ) -> AdapterHandle:
        """Validate and read a PEFT directory (AdapterError with the reason) and make it the current version of
        ``name``; the old version lives on until its requests end. ``version``: at least one above the name's
        latest (the registry store's version when reloading); default the next one. A pin beyond ``max_pinned``
        is refused: the device must keep room for the adapters that are not pinned."""
        adapter = load_peft_adapter(name, path, self.shapes, self.max_rank, self.allowed_roots)
        with self._lock:
            old = self._current.get(name)
            pins = sum(h.pinned for h in self._current.values()) - (old is not None and old.pinned)
            if pinned and pins >= self.max_pinned:
                raise AdapterError(
                    f"at most {self.max_pinned} adapters can be pinned (the device keeps a slot for "
                    "the others); unpin one first"
                )
            number = max(self._versions.get(name, 0) + 1, version or 0)
            handle = AdapterHandle(
                name, next(self._ids), number, adapter.nbytes * self.device_dtype.itemsize // 4, pinned, source
            )
            self._versions[name] = number
            self._current[name] = handle
            self._weights[handle.adapter_id] = adapter
            self._refs[handle.adapter_id] = 0
            self._added.append(handle)
            if old is not None:
                self._retire_if_unused(old.adapter_id)
        return handle

    def unregister(self, name: str) -> None:
        with self._lock:
            handle = self._current.pop(name, None)
            if handle is None:
                raise UnknownAdapterError(name)
            self._retire_if_unused(handle.adapter_id)

    def get(self, name: str) -> AdapterHandle:
        with self._lock:
            handle = self._current.get(name)
        if handle is None:
            raise UnknownAdapterError(name)
        return handle

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._current)

    def names_by_id(self) -> dict[int, str]:
        """adapter_id -> name, for every version a name points to now."""
        with self._lock:
            return {h.adapter_id: name for name, h in self._current.items()}

    def path(self, name: str) -> Path:
        """The directory the name's current version was read from."""
        with self._lock:
            return self._weights[self._handle(name).adapter_id].path

    def nbytes(self, name: str) -> int:
        """Bytes of the host copy (fp32) of the current version's A and B matrices."""
        with self._lock:
            return self._weights[self._handle(name).adapter_id].nbytes

    def _handle(self, name: str) -> AdapterHandle:
        handle = self._current.get(name)
        if handle is None:
            raise UnknownAdapterError(name)
        return handle

    # ---- requests (any thread) ------------------------------------------------------------------------------

    def acquire(self, name: str) -> AdapterHandle:
        """The current version of ``name``, held for a request until ``drop``: unloading or replacing the name
        waits for it, so a request that resolved a version keeps it to its end. UnknownAdapterError if none."""
        with self._lock:
            handle = self._handle(name)
            self._refs[handle.adapter_id] += 1
        return handle

    def drop(self, handle: AdapterHandle) -> None:
        with self._lock:
            self._refs[handle.adapter_id] -= 1
            self._retire_if_unused(handle.adapter_id)

    def _retire_if_unused(self, adapter_id: int) -> None:
        """Retire a version no request holds and no name points to (called with the lock held); its weights stay
        until the engine thread takes the retirement, so a load it decided before then still finds them."""
        if (
            adapter_id in self._refs
            and self._refs[adapter_id] == 0
            and adapter_id not in {h.adapter_id for h in self._current.values()}
        ):
            del self._refs[adapter_id]
            self._retired.append(adapter_id)

    # ---- the engine thread ----------------------------------------------------------------------------------

    def take_changes(self) -> AdapterChanges:
        """Versions registered and versions retired since the last call (a version may be in both); the retired
        ones' weights are let go now."""
        with self._lock:
            changes = AdapterChanges(self._added, self._retired)
            self._added, self._retired = [], []
            for adapter_id in changes.retired:
                del self._weights[adapter_id]
        return changes

    def weights(self, adapter_id: int) -> LoraAdapter:
        """A live version's host weights (what an ADAPTER_LOAD copies to the device)."""
        with self._lock:
            return self._weights[adapter_id]
