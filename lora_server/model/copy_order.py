"""CopyOrder: the streams the runner's copies run on, and the waits that keep them from racing over a page.

The runner executes the pool's copy operations (kv_pool.tree.CopyOp) beside the forward pass: KV swaps (arena pages
out to the host tier and back) on one side stream, which the next forward pass waits for on the device; adapter loads
(a staged image into arena pages) on another, which nothing waits for — the scheduler holds an adapter's requests
back until ``loaded`` says its copy has run. The host never blocks on a copy.

The rule: a page is never written on one stream while another stream may still read or write it. Who could:

- the previous forward pass (compute stream) read or wrote every page a step's copies touch: both side streams
  wait for the compute stream's work so far before the step's copies (``begin``);
- a swap-out reads a KV page that the pool frees at once, and a load later in the same list may be given it: the
  load waits for the copy stream's work so far when one of its pages was touched there since ``begin``;
- an adapter unloaded (evicted, dropped, replaced) while its load is in flight leaves pages that a swap-in or the
  next forward pass's KV writes may take: the copy and compute streams wait for that load's event;
- the next forward pass reads swapped-in KV and writes KV into pages a swap-out was reading: the compute stream
  waits for the copy stream (``end``).

A staged image stays referenced here until its copy is known to have run (torch's pinned allocator would keep it
alive by itself, memory pinned to size by lora_server.model.pinned does not).

On the CPU there are no streams: copies run in place, in order, and every adapter is loaded as soon as it is
copied. ``Streams`` is the device API the order needs: torch's CUDA streams and events (``CudaStreams``), or the
stand-in of a machine without a GPU that records every access and checks the order
(lora_server.bench.copy_order)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Streams(Protocol):
    """Streams and events of one device. ``on`` also says which arena pages the work issued inside reads and writes
    (only a recording stand-in uses that)."""

    def current(self) -> Any: ...

    def new_stream(self) -> Any: ...

    def on(
        self, stream: Any, reads: Iterable[int] = (), writes: Iterable[int] = (), what: str = ""
    ) -> contextlib.AbstractContextManager[None]: ...

    def wait_stream(self, waiter: Any, waited: Any) -> None: ...

    def record(self, stream: Any) -> Any: ...

    def wait_event(self, stream: Any, event: Any) -> None: ...

    def query(self, event: Any) -> bool: ...


class CudaStreams:
    """``Streams`` over torch.cuda on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def on(
        self, stream: torch.cuda.Stream, reads: Iterable[int] = (), writes: Iterable[int] = (), what: str = ""
    ) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.stream(stream)

    def wait_stream(self, waiter: torch.cuda.Stream, waited: torch.cuda.Stream) -> None:
        waiter.wait_stream(waited)

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def query(self, event: torch.cuda.Event) -> bool:
        return event.query()


@dataclass(slots=True)
class _Load:
    event: Any  # recorded on the load stream after the copy
    image: torch.Tensor  # the staged image it reads: kept until the copy has run


class CopyOrder:
    """The ordering of one runner's copies (see the module's docstring). Per step: ``begin``, then each copy inside
    ``kv_copy`` or ``adapter_load``, ``adapter_unload`` where an adapter leaves, then ``end`` before the forward
    pass. ``streams`` None: the CPU (no streams; every method orders nothing)."""

    def __init__(self, streams: Streams | None) -> None:
        self.streams = streams
        self._copy = streams.new_stream() if streams is not None else None  # KV swaps: the forward waits for them
        self._load = streams.new_stream() if streams is not None else None  # adapter loads: requests wait
        self._in_flight: dict[int, _Load] = {}  # table page -> its load, until known to have run
        self._retired: list[_Load] = []  # loads of adapters unloaded before their copy was known to have run
        self._copied: set[int] = set()  # pages the copy stream touched since begin()

    @property
    def asynchronous(self) -> bool:
        """Whether adapter loads run behind the host's back (ask ``loaded``)."""
        return self.streams is not None

    def begin(self) -> None:
        """Before a step's copies: the side streams wait for the compute stream's work so far."""
        self._copied.clear()
        if self.streams is None:
            return
        current = self.streams.current()
        self.streams.wait_stream(self._copy, current)
        self.streams.wait_stream(self._load, current)
        self._retired = [load for load in self._retired if not self.streams.query(load.event)]

    @contextlib.contextmanager
    def kv_copy(self, reads: Iterable[int], writes: Iterable[int], what: str) -> Iterator[None]:
        """Within the block: a KV copy that reads arena pages ``reads`` and writes ``writes`` (a swap-out reads,
        a swap-in writes), on the copy stream."""
        reads, writes = tuple(reads), tuple(writes)
        self._copied.update(reads)
        self._copied.update(writes)
        if self.streams is None:
            yield
            return
        with self.streams.on(self._copy, reads, writes, what):
            yield

    @contextlib.contextmanager
    def adapter_load(self, pages: list[int], image: torch.Tensor) -> Iterator[None]:
        """Within the block: an adapter's copy of ``image`` into arena ``pages`` (its table page first), on the
        load stream, after the copy stream's work so far when one of the pages was touched there this step."""
        if self.streams is None:
            yield
            return
        if not self._copied.isdisjoint(pages):
            self.streams.wait_stream(self._load, self._copy)
        with self.streams.on(self._load, (), pages, "adapter load"):
            yield
        self._in_flight[pages[0]] = _Load(self.streams.record(self._load), image)

    def adapter_unload(self, table_page: int) -> None:
        """The adapter whose table is on ``table_page`` left the arena: if its load may still be in flight, the copy
        and compute streams wait for it before they touch its pages."""
        load = self._in_flight.pop(table_page, None)
        if load is None or self.streams is None:
            return
        self.streams.wait_event(self._copy, load.event)
        self.streams.wait_event(self.streams.current(), load.event)
        self._retired.append(load)

    def end(self) -> None:
        """After a step's copies, before its forward pass: the compute stream waits for the copy stream."""
        if self.streams is not None:
            self.streams.wait_stream(self.streams.current(), self._copy)

    def loaded(self, table_page: int) -> bool:
        """Whether the load of the adapter whose table is on ``table_page`` has run (always, on the CPU): a query of
        its event, no sync."""
        load = self._in_flight.get(table_page)
        if load is None:
            return True
        assert self.streams is not None
        if self.streams.query(load.event):
            del self._in_flight[table_page]
            return True
        return False
