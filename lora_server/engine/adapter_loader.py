"""Stages adapters' weights on the host, off the engine's step: worker threads read a registered adapter's files
again and lay its weights out in pages (adapters.page_layout), in reused buffers that are pinned on CUDA
(model.pinned.ImageBuffers), so that the device copy (a copy operation of the pool's, on a side stream) never waits
for the host. The engine thread asks for what it needs and takes what is ready; a request whose adapter is not
staged yet waits while the running batch keeps stepping.

Staging a PEFT directory is one read of each file and one copy of each weight block into its page, the scaling and
the dtype conversion within that copy (PageLayout.image from the stored weights). The weights are not hashed again
when the files are the bytes registered: same stamps (device, inode, size, times) as the read that hashed them, and
files that had settled before it (peft_files.FilesIdentity); otherwise they are, and files whose weights changed
fail that adapter's requests. A DoRA adapter's scales are computed here from the base weights (adapters.dora,
through the model's narrow ``row_norms``), and with tensor parallelism each rank's share is laid out alike.

Ownership: the loader owns the staged images, what is being staged and in which order, and the file identities it
vouches for. Staged images are kept within ``budget_bytes`` (and ``max_images``, vLLM's count, when set), least
recently used first out, evicted on the engine thread only (``take_events``), so that an image the pool saw staged
is still there when the step's copies run; the images the caller says to keep (pinned adapters', a fact of the
registry and the pool) are never evicted. What waits is staged by priority: the adapters of the earliest waiting
requests first, then pinned adapters.

Workers live only while there is work, and run their torch ops on their own thread (engine.openmp.run_ops_alone):
a thread that stays alive after running a parallel region keeps an OpenMP team, and on a small CPU a second team
makes every parallel op of the engine's thread several times slower (docs/benchmarks.md, "OpenMP teams on a small
CPU")."""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import torch

from lora_server.adapters.dora import BaseRowNorms, dora_epilogues
from lora_server.adapters.load import adapter_digest, read_adapter
from lora_server.adapters.page_layout import ExpertRanks, PageLayout, expert_ranks, vocab_shapes
from lora_server.adapters.peft_adapter import PeftAdapter
from lora_server.adapters.peft_files import FilesIdentity, ReadBuffer
from lora_server.adapters.peft_format import AdapterError, LoraAdapter, VocabLora
from lora_server.engine.adapter_registry import AdapterContent, AdapterRegistry
from lora_server.engine.load_times import LatencyHistogram
from lora_server.engine.openmp import run_ops_alone
from lora_server.engine.reports import Histogram
from lora_server.model.pinned import ImageBuffers

log = logging.getLogger("lora_server")
LATER = math.inf  # the priority of an adapter no request waits for (a pin, a preload)
LAYOUTS_KEPT = 64  # page layouts kept for reuse, one per adapter form (ranks, DoRA modules, vocabulary pieces)


@dataclass(frozen=True, slots=True)
class StagedAdapter:
    adapter_id: int
    layout: PageLayout
    image: torch.Tensor  # uint8 [num_pages, page_bytes], pinned on CUDA
    vocab: VocabLora | None = None  # its embedding / head changes (their rows are in the image; the ids are read here)
    # with tensor parallelism, ranks 1..N-1's images of their shares (the same layout), in rank order; () otherwise
    worker_images: tuple[torch.Tensor, ...] = ()

    @property
    def nbytes(self) -> int:
        """Its host memory: every rank's image."""
        return self.image.nbytes + sum(image.nbytes for image in self.worker_images)


@dataclass(slots=True)
class LoaderEvents:
    """What changed since the engine thread last asked: contents staged, evicted from the host, failed (why)."""

    staged: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)  # content -> why, naming no path (AdapterError.public)


class AdapterLoader:
    """Stages registered adapters' pages on the host (see the module). ``request`` and ``take_events`` are for the
    engine thread; the work is the workers'. ``budget_bytes``: the host memory staged images may take;
    ``max_images``: at most this many of them (None: the bytes alone decide); ``workers``: the most threads
    staging at once; ``row_norms``: what DoRA needs of the base weights (None: DoRA adapters fail to stage, saying
    so)."""

    def __init__(
        self,
        registry: AdapterRegistry,
        device: torch.device,
        budget_bytes: int,
        max_images: int | None = None,
        workers: int = 1,
        row_norms: BaseRowNorms | None = None,
    ) -> None:
        if budget_bytes < 1 or (max_images is not None and max_images < 1) or workers < 1:
            raise ValueError(
                f"the loader needs a budget, room for an image and a worker: got {budget_bytes} bytes, "
                f"{max_images} images, {workers} workers"
            )
        self.registry, self.device = registry, device
        self.budget_bytes, self.max_images, self.workers = budget_bytes, max_images, workers
        self.form, self.geometry = registry.form, registry.form.geometry
        self.row_norms = row_norms
        self.buffers = ImageBuffers(self.geometry.page_bytes, device, budget_bytes)
        self._staged: OrderedDict[int, StagedAdapter] = OrderedDict()  # least recently used first
        self._staged_bytes = 0
        self._in_flight: set[int] = set()  # queued or being staged
        self._queue: list[tuple[float, int, int]] = []  # (priority, arrival, content): a heap, stale entries skipped
        self._priority: dict[int, float] = {}  # content -> its priority while queued (not yet taken by a worker)
        self._order = itertools.count()
        self._vouched: dict[int, FilesIdentity] = {}  # content -> files known to hold its registered weights
        self._layouts: OrderedDict[tuple, PageLayout] = OrderedDict()  # the forms adapters were laid out in (_layout)
        self._failures: dict[int, str] = {}  # why the last staging of a content failed, until it is asked again
        self.num_staged = 0  # stagings done since start (reads from disk)
        self._load_times = LatencyHistogram()  # how long each staging took (disk -> host)
        self._events = LoaderEvents()
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._threads = 0  # workers alive (see the module)
        # what workers read files into, reused from one file to the next (peft_files.ReadBuffer): one per worker
        # alive, kept for the next ones
        self._read_buffers: list[ReadBuffer] = []
        self._closed = False

    # ---- the engine thread ----------------------------------------------------------------------------------

    def request(self, adapter_id: int, priority: float = LATER) -> None:
        """Stage this content unless it is staged or being staged; ``priority`` orders what waits, lowest first
        (the arrival time of the earliest request that waits for it; LATER when none does). A content already
        waiting moves up to the lower of its priorities."""
        with self._lock:
            if adapter_id in self._staged:
                self._staged.move_to_end(adapter_id)
                return
            queued = self._priority.get(adapter_id)
            if adapter_id in self._in_flight and (queued is None or queued <= priority):
                return
            self._failures.pop(adapter_id, None)
            self._in_flight.add(adapter_id)
            self._priority[adapter_id] = priority
            heapq.heappush(self._queue, (priority, next(self._order), adapter_id))
            if self._threads < min(self.workers, len(self._priority)) and not self._closed:
                self._threads += 1
                threading.Thread(target=self._run, name="adapter-loader", daemon=True).start()

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
            staged = self._staged.pop(adapter_id, None)
            if staged is not None:
                self._staged_bytes -= staged.nbytes
            self._vouched.pop(adapter_id, None)

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
        """Contents staged, failed and evicted since the last call; evicts down to the budget first, least recently
        used first, never the images of ``keep`` (pinned adapters) nor those that just landed (they get their
        chance to be loaded)."""
        with self._lock:
            events = self._events
            kept = set(keep) | set(events.staged)
            victims = iter([i for i in self._staged if i not in kept])
            while self._over_budget():
                victim = next(victims, None)
                if victim is None:
                    break
                self._staged_bytes -= self._staged.pop(victim).nbytes
                events.evicted.append(victim)
            self._events = LoaderEvents()
        return events

    def _over_budget(self) -> bool:
        over_count = self.max_images is not None and len(self._staged) > self.max_images
        return over_count or self._staged_bytes > self.budget_bytes

    def load_times(self) -> Histogram:
        """How long the stagings took, disk to host memory."""
        with self._lock:
            return self._load_times.figures()

    def staged_ids(self) -> list[int]:
        with self._lock:
            return list(self._staged)

    def staged_bytes(self) -> int:
        """Host memory the staged images take now."""
        with self._lock:
            return self._staged_bytes

    def close(self) -> None:
        """Stop the workers (after the stagings under way); nothing more is staged."""
        with self._done:
            self._closed = True
            self._queue.clear()
            self._priority.clear()
            self._done.wait_for(lambda: self._threads == 0, timeout=5)

    # ---- the workers ----------------------------------------------------------------------------------------

    def _next(self) -> int | None:
        """The queued content of the lowest priority, taken off the queue (lock held); None when none is left."""
        while self._queue and not self._closed:
            priority, _, adapter_id = heapq.heappop(self._queue)
            if self._priority.get(adapter_id) == priority:
                del self._priority[adapter_id]
                return adapter_id
        return None

    def _run(self) -> None:
        run_ops_alone()
        with self._lock:
            buffer = self._read_buffers.pop() if self._read_buffers else ReadBuffer()
        while True:
            with self._done:
                adapter_id = self._next()
                if adapter_id is None:
                    self._threads -= 1  # under the lock: a request from now on starts a new worker
                    self._read_buffers.append(buffer)
                    self._done.notify_all()
                    return
            start = time.perf_counter()
            try:
                staged = self._stage(adapter_id, buffer)
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
                    self._staged_bytes += staged.nbytes
                    self.num_staged += 1
                    self._load_times.observe(time.perf_counter() - start)
                    self._events.staged.append(adapter_id)
                elif error is not None:
                    self._events.failed[adapter_id] = error
                    self._failures[adapter_id] = error
                self._done.notify_all()

    def _stage(self, adapter_id: int, buffer: ReadBuffer) -> StagedAdapter:
        """The content's pages, its files read into ``buffer`` (the worker's: nothing staged keeps a view of it)."""
        content = self.registry.content(adapter_id)
        if content is None:
            raise AdapterError(f"adapter content {adapter_id} is no longer registered")
        g = self.geometry
        roots = self.registry.allowed_roots
        adapter = read_adapter(content.name, content.path, self.form.shapes, g.max_rank, roots, buffer)
        self._check_unchanged(content, adapter)
        # the float32 weights, for what computes with them: DoRA's scales, each rank's share
        lora = _as_lora(adapter) if adapter.magnitudes or self.form.shards else None
        dora = None
        if adapter.magnitudes:
            if self.row_norms is None:
                raise AdapterError(f"adapter `{content.name}` is a DoRA adapter, which this engine cannot serve")
            assert lora is not None
            dora = dora_epilogues(lora, self.row_norms, g.dtype)
        layout = self._layout(
            content.ranks, adapter.magnitudes.keys(), vocab_shapes(adapter.vocab), expert_ranks(adapter)
        )
        image = self.buffers.take(layout.num_pages)
        if self.form.shards is None:
            return StagedAdapter(adapter_id, layout, layout.image(adapter, image, dora), adapter.vocab)
        assert lora is not None
        first, *others = self.form.shards(lora)  # rank 0's share first
        workers = tuple(layout.image(shard) for shard in others)
        return StagedAdapter(adapter_id, layout, layout.image(first, image, dora), adapter.vocab, workers)

    def _layout(
        self,
        ranks: tuple[tuple[int, str, int], ...],
        dora: Collection[tuple[int, str]],
        vocab: dict[str, tuple[int, int]],
        experts: ExpertRanks = (),
    ) -> PageLayout:
        """The page layout of an adapter of these ranks, DoRA modules and vocabulary pieces: one per form, kept
        (adapters of one shape share it; laying one out costs about as much as staging a small adapter)."""
        key = (ranks, frozenset(dora), tuple(sorted(vocab.items())), experts)
        with self._lock:
            layout = self._layouts.get(key)
            if layout is not None:
                self._layouts.move_to_end(key)
                return layout
        layout = PageLayout(self.geometry, {(layer, m): r for layer, m, r in ranks}, dora, vocab, experts)
        with self._lock:
            self._layouts[key] = layout
            while len(self._layouts) > LAYOUTS_KEPT:
                self._layouts.popitem(last=False)
        return layout

    def _check_unchanged(self, content: AdapterContent, adapter: PeftAdapter | LoraAdapter) -> None:
        """AdapterError unless the files hold the weights registered: their bytes are the ones hashed then (same
        stamps, settled files), or the weights hash as registered (any files: a copy, a re-save), which then
        vouches for these files."""
        identity = adapter.identity if isinstance(adapter, PeftAdapter) else None
        with self._lock:
            vouched = self._vouched.get(content.adapter_id, content.identity)
        if identity is not None and vouched is not None and vouched.same_bytes(identity):
            return
        if adapter_digest(adapter) != content.digest:
            raise AdapterError(
                f"the files of adapter `{content.name}` at {content.path} changed since it was registered; "
                "register it again",
                "its files changed since it was registered",
            )
        if identity is not None:
            with self._lock:
                self._vouched[content.adapter_id] = identity


def _as_lora(adapter: PeftAdapter | LoraAdapter) -> LoraAdapter:
    return adapter.lora() if isinstance(adapter, PeftAdapter) else adapter
