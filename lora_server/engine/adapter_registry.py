"""The adapters an engine knows: each name's current version, what each version's weights are (their content hash,
ranks and place on disk), and how many requests hold each. One owner for these facts; whether the weights are
staged on the host is the loader's (engine.adapter_loader), what is on the device and where is the pool's.

Weights are keyed by content: registering reads and validates the files once, hashes the weights with their
scaling, and keeps no weights. Names whose weights are equal share one content id, and so one place in the pool and
one prefix cache (per tenant): re-registering the same weights keeps the cache, other weights under the same name
never share it."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import NamedTuple

from lora_server.adapters.load import adapter_digest, read_adapter
from lora_server.adapters.page_layout import PageLayout, expert_ranks, vocab_shapes
from lora_server.adapters.peft_adapter import PeftAdapter
from lora_server.adapters.peft_files import FilesIdentity
from lora_server.adapters.peft_format import AdapterError
from lora_server.adapters.sources import AdapterSources, source_scheme
from lora_server.engine.openmp import run_ops_alone
from lora_server.errors import UnknownAdapterError
from lora_server.kv_pool import POLICIES, PoolConfig
from lora_server.kv_pool.tree import AdapterKey
from lora_server.model.arena import AdapterForm


@dataclass(frozen=True, slots=True)
class AdapterHandle:
    """What a request holds: one version of one name. ``adapter_id`` names the weights (equal weights, equal id:
    the pool's key); ``version`` counts the registrations of the name (1, 2, ...; or the registry store's own)."""

    name: str
    adapter_id: int
    version: int
    device_nbytes: int  # the bytes of its pages in the arena: its share of the device budget
    pinned: bool = False  # kept on the device once loaded (see kv_pool)
    source: str = "api"  # where it was registered from: "demo", "command line" or "api"
    registered_at: float = 0.0  # when this version was registered (seconds since the epoch)
    invocation_tokens: tuple[int, ...] = ()  # an activated LoRA's (LoraAdapter.invocation_tokens); () otherwise

    @property
    def key(self) -> AdapterKey:
        """The pool's key: the weights', whatever the name or version."""
        return AdapterKey(self.adapter_id)


@dataclass(frozen=True, slots=True)
class CheckedAdapter:
    """An adapter's files read, validated and hashed (``AdapterRegistry.check``): what registering it needs, without
    the weights. Checked but not yet installed, it lets a caller write the registration elsewhere (the registry
    store) between reading the files and serving them, so that both happen or neither."""

    name: str  # the name it is registered under
    path: Path  # the directory its files were read from
    digest: str  # what it serves, hashed (adapters.load.adapter_digest): equal digests, one content
    ranks: tuple[tuple[int, str, int], ...]  # (layer, module, rank) of every module it targets
    num_pages: int
    host_nbytes: int  # its A and B in float32, as read
    invocation_tokens: tuple[int, ...] = field(default=(), kw_only=True)  # an aLoRA's (LoraAdapter's)
    # its largest rank, LoRA on the embedding or head included (0: it has only trainable tokens)
    rank: int = field(default=0, kw_only=True)
    # a PEFT directory's files as read (their stamps: the loader need not hash them again while they hold); None
    # for a GGUF file, hashed whenever it is read again
    identity: FilesIdentity | None = field(default=None, kw_only=True)

    @property
    def rank_map(self) -> dict[tuple[int, str], int]:
        return {(layer, module): r for layer, module, r in self.ranks}


@dataclass(frozen=True, slots=True)
class AdapterContent(CheckedAdapter):
    """One set of weights, registered: its id, and the files (and name) it was last registered from, which the
    loader reads again and checks against the digests."""

    adapter_id: int


class AdapterSpec(NamedTuple):
    """An adapter to register: its name, where its files are, whether it is pinned."""

    name: str
    path: str | Path
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class AdapterChanges:
    """What the pool must learn since it last asked: contents registered, contents retired (ids), and the contents
    pinned now (None: no name changed, so no pin did)."""

    added: list[AdapterHandle]
    retired: list[int]
    pinned: frozenset[int] | None


class AdapterRegistry:
    """Registered adapters, any number of them, as metadata. Thread-safe: HTTP threads register and resolve names,
    the engine thread takes changes, the loader reads contents. A content id lives while a name points to it or a
    request holds it: unloading or replacing a name retires the old weights once their last request ends."""

    def __init__(
        self,
        form: AdapterForm,
        allowed_roots: list[Path] | None,
        pool: PoolConfig,
        sources: AdapterSources | None = None,
    ) -> None:
        """``form``: what adapters are validated against, which the engine refuses and how they are laid out.
        ``allowed_roots``: where a local adapter path must lie (None: anywhere). ``sources``: the URL schemes
        adapters may come from and the cache they are downloaded into (None: none)."""
        self.form, self.geometry, self.pool = form, form.geometry, pool
        self.sources = AdapterSources() if sources is None else sources
        self._local_roots = allowed_roots
        # what registered adapters are read from again (the loader): the local roots, and the cache for URLs
        self.allowed_roots = allowed_roots
        if allowed_roots is not None and self.sources.schemes:
            self.allowed_roots = [*allowed_roots, self.sources.cache_dir]

        def in_use() -> set[Path]:  # the paths a name or a live content reads: their cache entries stay
            with self._lock:
                return {*self._paths.values(), *(c.path for c in self._contents.values())}

        self._in_use = in_use
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._current: dict[str, AdapterHandle] = {}
        self._contents: dict[int, AdapterContent] = {}  # adapter_id -> its content, while live
        self._by_digest: dict[str, int] = {}  # digest -> adapter_id, while live
        self._refs: Counter[int] = Counter()  # adapter_id -> requests holding it
        self._versions: dict[str, int] = {}  # name -> its latest version
        self._paths: dict[str, Path] = {}  # name -> the directory its current version was read from
        self._added: list[AdapterHandle] = []
        self._retired: list[int] = []
        self._changed = False  # names changed since take_changes last looked

    # ---- names (any thread) ---------------------------------------------------------------------------------

    def register(
        self,
        name: str,
        path: str | Path,
        pinned: bool = False,
        version: int | None = None,
        source: str = "api",
        registered_at: float | None = None,
    ) -> AdapterHandle:
        """Validate and read a PEFT directory (AdapterError with the reason), hash its weights and make it the
        current version of ``name``; the old version lives on until its requests end. ``version``: at least one
        above the name's latest (the registry store's version when reloading); default the next one. A pin that
        would take the pinned adapters beyond the pool's share of the device is refused. ``registered_at``: when
        it was registered (the registry store's time when reloading; default now)."""
        return self.install(self.check(name, path, pinned), pinned, version, source, registered_at)

    def check(self, name: str, path: str | Path, pinned: bool = False) -> CheckedAdapter:
        """Read and validate a PEFT directory for ``name`` and hash its weights; AdapterError with the reason, also
        for a pin that would not fit now. Changes nothing but the adapter cache: a URL (``self.sources``) is read
        from its copy there, downloaded first if need be."""
        if source_scheme(path) is None:
            return self._check(name, path, pinned, self._local_roots)
        # a URL: its copy in the adapter cache, downloaded now or reused; a download refused here leaves the cache
        fetched = self.sources.fetch(str(path), self._in_use)
        try:
            return self._check(name, fetched, pinned, self.allowed_roots)
        except AdapterError:
            self.sources.discard(fetched, self._in_use)
            raise

    def _check(self, name: str, path: str | Path, pinned: bool, roots: list[Path] | None) -> CheckedAdapter:
        """check of local files (``roots``: where they may lie)."""
        adapter = read_adapter(name, path, self.form.shapes, self.geometry.max_rank, roots)
        if isinstance(adapter, PeftAdapter):
            adapter.check_weights()
        refusal = self.form.refusal(adapter)
        if refusal:
            raise AdapterError(f"adapter `{name}` cannot be served: {refusal}")
        ranks = adapter.ranks
        checked = CheckedAdapter(
            name,
            adapter.path,
            adapter_digest(adapter),
            tuple((layer, module, r) for (layer, module), r in sorted(ranks.items())),
            PageLayout(
                self.geometry, ranks, adapter.magnitudes.keys(), vocab_shapes(adapter.vocab), expert_ranks(adapter)
            ).num_pages,
            adapter.nbytes,
            invocation_tokens=adapter.invocation_tokens,
            rank=adapter.rank,
            identity=adapter.identity if isinstance(adapter, PeftAdapter) else None,
        )
        if POLICIES[self.pool.policy].adapter_slots and checked.num_pages > self.pool.adapter_slot_blocks:
            raise AdapterError(  # a DoRA adapter at the largest rank on every module: its scales take more pages
                f"adapter `{name}` takes {checked.num_pages} pages; the {self.pool.policy} policy's adapter slots hold "
                f"{self.pool.adapter_slot_blocks} (an adapter of every module at the largest rank, without DoRA or "
                "changes to the embedding or head)"
            )
        if pinned:
            with self._lock:
                self._check_pin(checked.num_pages, self._by_digest.get(checked.digest), self._current.get(name))
        return checked

    def check_many(self, specs: Sequence[AdapterSpec], threads: int) -> list[CheckedAdapter | AdapterError]:
        """``check`` of each adapter, on up to ``threads`` threads at once (reading and hashing files releases the
        interpreter): each one's result in order, the reason where it cannot be served. Changes nothing."""

        def check(spec: AdapterSpec) -> CheckedAdapter | AdapterError:
            try:
                return self.check(spec.name, spec.path, spec.pinned)
            except AdapterError as exc:
                return exc

        if threads <= 1 or len(specs) <= 1:
            return [check(spec) for spec in specs]
        with ThreadPoolExecutor(threads, thread_name_prefix="adapter-check", initializer=run_ops_alone) as pool:
            return list(pool.map(check, specs))

    def next_version(self, name: str) -> int:
        """The least version the next registration of ``name`` gets."""
        with self._lock:
            return self._versions.get(name, 0) + 1

    def install(
        self,
        checked: CheckedAdapter,
        pinned: bool = False,
        version: int | None = None,
        source: str = "api",
        registered_at: float | None = None,
    ) -> AdapterHandle:
        """Make a checked adapter the current version of its name (``register``'s arguments); reads no file. Only
        a pin that no longer fits (pins changed since ``check``) is refused (AdapterError)."""
        name, digest, num_pages = checked.name, checked.digest, checked.num_pages
        with self._lock:
            old = self._current.get(name)
            adapter_id = self._by_digest.get(digest)
            if pinned:
                self._check_pin(num_pages, adapter_id, old)
            new = adapter_id is None
            if adapter_id is None:
                adapter_id = next(self._ids)
                self._by_digest[digest] = adapter_id
            # the latest files the weights were read from
            self._contents[adapter_id] = AdapterContent(
                **{f.name: getattr(checked, f.name) for f in fields(checked)}, adapter_id=adapter_id
            )
            self._paths[name] = checked.path
            number = max(self._versions.get(name, 0) + 1, version or 0)
            handle = AdapterHandle(
                name,
                adapter_id,
                number,
                num_pages * self.geometry.page_bytes,
                pinned,
                source,
                time.time() if registered_at is None else registered_at,
                checked.invocation_tokens,
            )
            self._versions[name] = number
            self._current[name] = handle
            self._changed = True
            if new:
                self._added.append(handle)
            if old is not None and old.adapter_id != adapter_id:
                self._retire_if_unused(old.adapter_id)
        return handle

    def _check_pin(self, num_pages: int, adapter_id: int | None, old: AdapterHandle | None) -> None:
        """Refuse a pin the pool's pin rule refuses (PoolConfig.pin_refusal; called with the lock held)."""
        pinned_ids = {h.adapter_id for h in self._current.values() if h.pinned and h is not old}
        pinned_ids.discard(adapter_id or -1)
        refusal = self.pool.pin_refusal((self._contents[i].num_pages for i in pinned_ids), num_pages)
        if refusal is not None:
            raise AdapterError(refusal)

    def unregister(self, name: str) -> None:
        with self._lock:
            handle = self._current.pop(name, None)
            if handle is None:
                raise UnknownAdapterError(name)
            del self._paths[name]
            self._changed = True
            self._retire_if_unused(handle.adapter_id)

    def get(self, name: str) -> AdapterHandle:
        with self._lock:
            return self._handle(name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._current)

    def names_by_id(self) -> dict[int, list[str]]:
        """adapter_id -> the names that point to it now, sorted."""
        with self._lock:
            out: dict[int, list[str]] = {}
            for name in sorted(self._current):
                out.setdefault(self._current[name].adapter_id, []).append(name)
            return out

    def path(self, name: str) -> Path:
        """The directory the name's current version was read from."""
        with self._lock:
            self._handle(name)
            return self._paths[name]

    def nbytes(self, name: str) -> int:
        """Bytes of the name's A and B matrices in float32, as read."""
        with self._lock:
            return self._contents[self._handle(name).adapter_id].host_nbytes

    def content(self, adapter_id: int) -> AdapterContent | None:
        """A live content (None once retired): what the loader reads and checks."""
        with self._lock:
            return self._contents.get(adapter_id)

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
        """Retire a content no request holds and no name points to (called with the lock held)."""
        if self._refs[adapter_id] > 0 or any(h.adapter_id == adapter_id for h in self._current.values()):
            return
        del self._refs[adapter_id]
        content = self._contents.pop(adapter_id, None)
        if content is not None:
            del self._by_digest[content.digest]
            self._retired.append(adapter_id)

    # ---- the engine thread ----------------------------------------------------------------------------------

    def take_changes(self) -> AdapterChanges:
        """Contents registered and retired since the last call (an id may be in both), and the contents pinned now
        if any name changed (a content is pinned while any name on it is)."""
        with self._lock:
            pinned = None
            if self._changed:
                pinned = frozenset(h.adapter_id for h in self._current.values() if h.pinned)
            changes = AdapterChanges(self._added, self._retired, pinned)
            self._added, self._retired, self._changed = [], [], False
        return changes
