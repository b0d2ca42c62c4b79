"""The order of the runner's copies, checked on a machine without a GPU: a stand-in for CUDA's streams and events that
records every access to the arena's pages (the pool's copies and the forward pass) with the stream it was issued
on, and reports every two accesses to one page, at least one a write, that no wait orders.

How: vector clocks. Each stream counts the work issued on it; a stream's clock is what it has waited for (its own
work, ``wait_stream``, ``wait_event``) and what the host knew had finished when the work was issued (an event whose
``query`` answered True). Access a happens before access b when b's clock has seen a's place on a's stream. Per
page the last write and the reads since it are kept (a write must come after all of them, a read after the
write): enough, since happening-before is transitive.

An event is done once ``load_latency`` forward passes have been issued after it (or, while nothing computes, on its
``IDLE_QUERIES``-th query), so that adapter loads stay in flight for a few steps, as they would on a GPU while the
batch computes.

``record_copy_order(engine)`` puts a CPU engine's runner on these streams (the CUDA code path of copy ordering
runs; the copies themselves still execute in place on the CPU) and its scheduler on their events, and records the
forward pass's pages: it reads its sequences' blocks and its adapters' pages, it writes the slots of its tokens."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from unittest import mock

import torch

from lora_server.model.copy_order import CopyOrder

if TYPE_CHECKING:
    from lora_server.engine import Engine
    from lora_server.model.batch import ForwardBatch

COMPUTE = 0  # the compute stream (torch's current stream)
IDLE_QUERIES = 8  # queries after which an event is done without forward passes (nothing else to wait for)


def _join(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
    return {s: max(a.get(s, 0), b.get(s, 0)) for s in a.keys() | b.keys()}


@dataclass(frozen=True, slots=True)
class Access:
    stream: int
    place: int  # its position among its stream's accesses (1, 2, ...)
    clock: dict[int, int]  # what it comes after, per stream
    what: str
    step: int  # the forward passes issued before it
    reads: frozenset[int]  # arena pages
    writes: frozenset[int]

    def before(self, other: Access) -> bool:
        return other.clock.get(self.stream, 0) >= self.place


@dataclass(frozen=True, slots=True)
class Conflict:
    page: int
    first: Access
    second: Access

    def __str__(self) -> str:
        a, b = self.first, self.second
        return (
            f"page {self.page}: {a.what} (stream {a.stream}, step {a.step}) and {b.what} (stream {b.stream}, step "
            f"{b.step}) are not ordered"
        )


@dataclass(slots=True)
class _Event:
    clock: dict[int, int]
    step: int  # forward passes issued before it
    queries: int = 0


@dataclass(slots=True)
class _Page:
    write: Access | None = None
    reads: list[Access] = field(default_factory=list)


class RecordingStreams:
    """``model.copy_order.Streams`` for a machine without a GPU: records and checks (see the module's docstring).
    Streams are numbers, COMPUTE the current one."""

    def __init__(self, load_latency: int = 3) -> None:
        self.load_latency = load_latency
        self._clocks: list[dict[int, int]] = [{}]
        self._host: dict[int, int] = {}  # what the host has seen finish
        self._pages: dict[int, _Page] = {}
        self.accesses: list[Access] = []
        self.conflicts: list[Conflict] = []
        self.step = 0
        self.events_recorded = 0
        self.event_waits = 0

    def current(self) -> int:
        return COMPUTE

    def new_stream(self) -> int:
        self._clocks.append({})
        return len(self._clocks) - 1

    @contextlib.contextmanager
    def on(self, stream: int, reads: Iterable[int] = (), writes: Iterable[int] = (), what: str = "") -> Iterator[None]:
        self.access(stream, reads, writes, what)
        yield

    def access(self, stream: int, reads: Iterable[int], writes: Iterable[int], what: str) -> Access:
        """Record work issued on ``stream`` that reads and writes those pages; check it against the pages' history."""
        clock = _join(self._clocks[stream], self._host)
        clock[stream] = clock.get(stream, 0) + 1
        self._clocks[stream] = clock
        writes = frozenset(writes)
        access = Access(stream, clock[stream], dict(clock), what, self.step, frozenset(reads) - writes, writes)
        self.accesses.append(access)
        for page in access.reads:
            state = self._pages.setdefault(page, _Page())
            self._check(page, state.write, access)
            state.reads.append(access)
        for page in access.writes:
            state = self._pages.setdefault(page, _Page())
            self._check(page, state.write, access)
            for read in state.reads:
                self._check(page, read, access)
            state.write, state.reads = access, []
        return access

    def _check(self, page: int, earlier: Access | None, later: Access) -> None:
        if earlier is not None and not earlier.before(later):
            self.conflicts.append(Conflict(page, earlier, later))

    def wait_stream(self, waiter: int, waited: int) -> None:
        self._clocks[waiter] = _join(self._clocks[waiter], self._clocks[waited])

    def record(self, stream: int) -> _Event:
        self.events_recorded += 1
        return _Event(dict(self._clocks[stream]), self.step)

    def wait_event(self, stream: int, event: _Event) -> None:
        self.event_waits += 1
        self._clocks[stream] = _join(self._clocks[stream], event.clock)

    def query(self, event: _Event) -> bool:
        event.queries += 1
        if self.step - event.step < self.load_latency and event.queries < IDLE_QUERIES:
            return False
        self._host = _join(self._host, event.clock)
        return True

    def accesses_of(self, what: str) -> list[Access]:
        return [a for a in self.accesses if a.what == what]


def _forward_pages(engine: Engine, batch: ForwardBatch) -> tuple[set[int], set[int]]:
    """The arena pages a forward pass reads (its sequences' KV blocks, its adapters' pages) and writes (the blocks of
    its tokens' slots)."""
    runner = engine.core.runner
    bs = runner.block_size
    slots = batch.slot_mapping.tolist()
    writes = {s // bs for s in slots if s >= 0}
    tables, lengths = batch.block_tables.tolist(), batch.seq_lens.tolist()
    reads = {page for table, n in zip(tables, lengths, strict=False) for page in table[: -(-n // bs)]}
    if batch.lora is not None:
        for _, _, table_page in batch.lora.host_segments:
            reads.update(runner.adapters.pages_of(table_page))
    return reads, writes


@contextlib.contextmanager
def record_copy_order(engine: Engine, load_latency: int = 3) -> Iterator[RecordingStreams]:
    """Within the block, the engine (on the CPU) orders its copies on recording streams, its scheduler holds an
    adapter's requests back until the recorded load's event is done, and every forward pass is recorded on the
    compute stream. Yields the recorder."""
    core = engine.core
    runner = core.runner
    assert runner.device.type == "cpu", "the recorder stands in for CUDA on the CPU"
    streams = RecordingStreams(load_latency)
    eager = runner._eager_forward

    def recorded_forward(batch: ForwardBatch) -> torch.Tensor:
        reads, writes = _forward_pages(engine, batch)
        streams.access(COMPUTE, reads, writes, "forward")
        streams.step += 1
        return eager(batch)

    before = runner.copy_order, core.residency.adapter_loaded
    runner.copy_order = CopyOrder(streams)
    core.residency.adapter_loaded = runner.adapter_loaded
    try:
        with mock.patch.object(runner, "_eager_forward", recorded_forward):
            yield streams
    finally:
        runner.copy_order, core.residency.adapter_loaded = before
