"""Stages adapters' weights on the host, off the engine's step: a background thread reads a registered adapter's files
again, checks them against the content hash it was registered with, converts them to the model's dtype and lays
them out in pages (adapters.page_layout), in pinned memory on CUDA so that the device copy (a copy operation of the
pool's, on a side stream) never waits for the host. A DoRA adapter's scales are computed here too, from the base
weights (adapters.dora, through the model's narrow ``row_norms``; on CUDA on a stream of its own). The engine
thread asks for what it needs and takes what is ready; a request whose adapter is not staged yet waits while the
running batch keeps stepping.

Ownership: the loader owns the staged images and the set of contents in flight. Staged images are kept up to
``capacity``, least recently used first out, evicted on the engine thread only (``take_events``), so an image the
pool saw staged is still there when the step's copies run; the images the caller says to keep (pinned adapters',
a fact of the registry and the pool) are never evicted.

The loader thread lives only while there is work: it exits once nothing is pending and the next request starts a
new one. A thread that stays alive after torch has run a parallel region in it keeps an OpenMP team of its own, and
on a small CPU that makes every parallel op of the engine's thread several times slower (measured on 2 cores: a
LoRA segment pass of 6 adapters 0.18 -> 1.5 ms, the engine's batch-24 throughput with adapters down by half)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import torch

from lora_server.adapters.dora import BaseRowNorms, dora_epilogues
from lora_server.adapters.load import load_adapter
from lora_server.adapters.page_layout import PageLayout, vocab_shapes
from lora_server.adapters.peft_format import AdapterError, VocabLora
from lora_server.engine.adapter_registry import AdapterRegistry, content_hash
from lora_server.engine.load_times import LatencyHistogram
from lora_server.engine.reports import Histogram
from lora_server.model.pinned import pinned_empty

log = logging.getLogger("lora_server")


@dataclass(frozen=True, slots=True)
class StagedAdapter:
    adapter_id: int
    layout: PageLayout
    image: torch.Tensor  # uint8 [num_pages, page_bytes], pinned on CUDA
    vocab: VocabLora | None = None  # its embedding / head changes (their rows are in the image; the ids are read here)
    # with tensor parallelism, ranks 1..N-1's images of their shares (the same layout), in rank order; () otherwise
    worker_images: tuple[torch.Tensor, ...] = ()


@dataclass(slots=True)
class LoaderEvents:
    """What changed since the engine thread last asked: contents staged, evicted from the host, failed (why)."""

    staged: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)  # content -> why, naming no path (AdapterError.public)


class AdapterLoader:
    """Stages registered adapters' pages on the host (see the module). ``request`` and ``take_events`` are for the
    engine thread; the work is the loader thread's. ``row_norms``: what DoRA needs of the base weights (None: DoRA
    adapters fail to stage, saying so)."""

    def __init__(
        self,
        registry: AdapterRegistry,
        device: torch.device,
        capacity: int,
        row_norms: BaseRowNorms | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"the loader must be able to stage at least one adapter, got capacity {capacity}")
        self.registry, self.device, self.capacity = registry, device, capacity
        self.form, self.geometry = registry.form, registry.form.geometry
        self.row_norms = row_norms
        self._staged: OrderedDict[int, StagedAdapter] = OrderedDict()  # least recently used first
        self._in_flight: set[int] = set()
        self._failures: dict[int, str] = {}  # why the last staging of a content failed, until it is asked again
        self.num_staged = 0  # stagings done since start (reads from disk)
        self._load_times = LatencyHistogram()  # how long each staging took (disk -> host)
        self._events = LoaderEvents()
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._pending: deque[int] = deque()  # contents to stage, in order
        self._thread: threading.Thread | None = None  # the loader thread while there is work (see the module)
        self._closed = False

    # ---- the engine thread ----------------------------------------------------------------------------------

    def request(self, adapter_id: int) -> None:
        """Stage this content unless it is staged or on its way (a retired one is reported failed)."""
        with self._lock:
            if adapter_id in self._staged:
                self._staged.move_to_end(adapter_id)
                return
            if adapter_id in self._in_flight:
                return
            self._failures.pop(adapter_id, None)
            self._in_flight.add(adapter_id)
            self._pending.append(adapter_id)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="adapter-loader", daemon=True)
                self._thread.start()

    def staged(self, adapter_id: int) -> StagedAdapter | None:
        """The staged image of a content (it counts as a use), or None."""
        with self._lock:
            staged = self._staged.get(adapter_id)
            if staged is not None:
                self._staged.move_to_end(adapter_id)
            return staged

    def forget(self, adapter_id: int) -> None:
        """A retired content: its image goes (a load in flight is dropped when it lands)."""
        with self._lock:
            self._staged.pop(adapter_id, None)

    def failed(self, adapter_ids: Iterable[int]) -> str | None:
        """Why staging one of these contents failed last (None: none has failed since it was last asked for)."""
        with self._lock:
            return next((self._failures[i] for i in adapter_ids if i in self._failures), None)

    def busy(self) -> bool:
        """Whether any content is on its way."""
        with self._lock:
            return bool(self._in_flight)

    def wait(self, timeout: float) -> None:
        """Block until a load lands or fails (or ``timeout`` seconds): for an engine with nothing else to do."""
        with self._done:
            if self._in_flight:
                self._done.wait(timeout)

    def take_events(self, keep: Collection[int] = ()) -> LoaderEvents:
        """Contents staged, failed and evicted since the last call; evicts down to the capacity first, never the
        images of ``keep`` (pinned adapters) nor those that just landed (they get their chance to be loaded)."""
        with self._lock:
            events = self._events
            keep = set(keep) | set(events.staged)
            while len(self._staged) > self.capacity:
                victim = next((i for i in self._staged if i not in keep), None)
                if victim is None:
                    break
                del self._staged[victim]
                events.evicted.append(victim)
            self._events = LoaderEvents()
        return events

    def load_times(self) -> Histogram:
        """How long the stagings took, disk to host memory."""
        with self._lock:
            return self._load_times.figures()

    def staged_ids(self) -> list[int]:
        with self._lock:
            return list(self._staged)

    def close(self) -> None:
        """Stop the loader thread (after the load under way); nothing more is staged."""
        with self._lock:
            self._closed = True
            self._pending.clear()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)

    # ---- the loader thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._pending or self._closed:
                    self._thread = None  # under the lock: a request from now on starts a new thread
                    return
                adapter_id = self._pending.popleft()
            start = time.perf_counter()
            try:
                staged = self._stage(adapter_id)
                error = None
            except AdapterError as exc:  # the reason with its paths to the log, without to the adapter's requests
                log.warning("staging adapter content %d failed: %s", adapter_id, exc)
                staged, error = None, exc.public
            except Exception as exc:  # noqa: BLE001 (any failure to stage fails that adapter's requests, not the loop)
                log.exception("staging adapter %d failed", adapter_id)
                staged, error = None, f"{type(exc).__name__} while its files were read (the server's log says more)"
            with self._done:
                self._in_flight.discard(adapter_id)
                if staged is not None and self.registry.content(adapter_id) is not None:
                    self._staged[adapter_id] = staged
                    self.num_staged += 1
                    self._load_times.observe(time.perf_counter() - start)
                    self._events.staged.append(adapter_id)
                elif error is not None:
                    self._events.failed[adapter_id] = error
                    self._failures[adapter_id] = error
                self._done.notify_all()

    def _stage(self, adapter_id: int) -> StagedAdapter:
        content = self.registry.content(adapter_id)
        if content is None:
            raise AdapterError(f"adapter content {adapter_id} is no longer registered")
        g = self.geometry
        adapter = load_adapter(content.name, content.path, self.form.shapes, g.max_rank, self.registry.allowed_roots)
        # the same bytes are the same weights; other bytes may still hold them (a copy, a re-save)
        if adapter.file_digest != content.file_digest and content_hash(adapter) != content.digest:
            raise AdapterError(
                f"the files of adapter `{content.name}` at {content.path} changed since it was registered; "
                "register it again",
                "its files changed since it was registered",
            )
        dora = None
        if adapter.magnitudes:
            if self.row_norms is None:
                raise AdapterError(f"adapter `{content.name}` is a DoRA adapter, which this engine cannot serve")
            dora = dora_epilogues(adapter, self.row_norms, g.dtype)
        layout = PageLayout(g, content.rank_map, adapter.magnitudes.keys(), vocab_shapes(adapter.vocab))
        image = None  # pinned on CUDA, to its size (lora_server.model.pinned)
        if self.device.type == "cuda":
            image = pinned_empty((layout.num_pages, g.page_bytes), torch.uint8, self.device)
        first, *others = self.form.shards(adapter)  # rank 0's share first (the adapter itself on one device)
        workers = tuple(layout.image(shard) for shard in others)
        return StagedAdapter(adapter_id, layout, layout.image(first, image, dora), adapter.vocab, workers)
