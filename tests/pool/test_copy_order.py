"""The runner's copies never race over an arena page (model.copy_order), checked on the CPU by the recording stand-in
for CUDA's streams (instrument.stream_recorder): every access to a page (KV swaps, adapter loads, forward passes) with
its stream and the waits issued, and every two accesses to one page, at least one a write, that no wait orders.

The two races found in review, each driven on a tiny engine until it happens: a KV page swapped out and given to an
adapter load in the same step; an adapter unloaded while its load is in flight and its pages written by the next
forward pass. Each runs twice: with the runner's order (no conflict may be recorded), and with the order the
runner had before (loads never waited for the copy stream, an unload forgot its load's event), where the recorder
must find the race: the check can fail. The recorder itself is checked against orders worked out by hand."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from lora_server.bench.engine import write_random_adapters
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.instrument.stream_recorder import COMPUTE, RecordingStreams, record_copy_order
from lora_server.model.arch import PRESETS
from lora_server.model.copy_order import CopyOrder
from lora_server.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

# ---- the recorder, against orders worked out by hand ----------------------------------------------------------


def test_unordered_writes_to_a_page_conflict():
    rec = RecordingStreams()
    side = rec.new_stream()
    rec.access(side, (), [3], "copy")
    rec.access(COMPUTE, (), [3], "forward")
    assert [(c.page, c.first.what, c.second.what) for c in rec.conflicts] == [(3, "copy", "forward")]


def test_reads_may_overlap_but_a_write_waits_for_every_read():
    rec = RecordingStreams()
    a, b = rec.new_stream(), rec.new_stream()
    rec.access(a, [1], (), "read a")
    rec.access(b, [1], (), "read b")
    assert not rec.conflicts
    rec.wait_stream(COMPUTE, a)  # after read a only
    rec.access(COMPUTE, (), [1], "write")
    assert [(c.first.what, c.second.what) for c in rec.conflicts] == [("read b", "write")]


def test_waits_order_streams_transitively():
    rec = RecordingStreams()
    copy, load = rec.new_stream(), rec.new_stream()
    rec.access(copy, [5], (), "swap-out")
    rec.wait_stream(COMPUTE, copy)
    rec.access(COMPUTE, (), [9], "forward")
    rec.wait_stream(load, COMPUTE)  # load after compute after copy: after the swap-out
    rec.access(load, (), [5], "load")
    assert not rec.conflicts


def test_an_event_orders_what_waits_on_it():
    rec = RecordingStreams()
    load = rec.new_stream()
    rec.access(load, (), [7], "load")
    event = rec.record(load)
    rec.access(load, (), [8], "later load")  # after the event: not covered by it
    rec.wait_event(COMPUTE, event)
    rec.access(COMPUTE, [7], (), "forward")
    assert not rec.conflicts
    rec.access(COMPUTE, [8], (), "forward")
    assert [(c.page, c.first.what) for c in rec.conflicts] == [(8, "later load")]


def test_work_issued_after_the_host_saw_an_event_done_comes_after_it():
    rec = RecordingStreams(load_latency=2)
    load, copy = rec.new_stream(), rec.new_stream()
    rec.access(load, (), [7], "load")
    event = rec.record(load)
    rec.access(load, (), [8], "later load")
    assert not rec.query(event)  # no forward pass since it was recorded
    rec.step += 2
    assert rec.query(event)
    rec.access(copy, (), [7], "swap-in")
    assert not rec.conflicts
    rec.access(copy, (), [8], "swap-in")
    assert [(c.page, c.first.what) for c in rec.conflicts] == [(8, "later load")]


# ---- the runner's order ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _before_the_fix(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The order the runner had before: a load never waited for the copy stream, an unload dropped its load's
    event (both side streams still waited for the compute stream, and it for the copy stream)."""
    load = CopyOrder.adapter_load

    @contextlib.contextmanager
    def adapter_load(self, pages, image):
        self._copied.clear()
        with load(self, pages, image):
            yield

    with monkeypatch.context() as m:
        m.setattr(CopyOrder, "adapter_load", adapter_load)
        m.setattr(CopyOrder, "adapter_unload", lambda self, page: self._in_flight.pop(page, None))
        yield


@pytest.fixture()
def tiny(tmp_path: Path):
    """A tiny dummy Llama (2 layers; a page is 8 KiB) and a factory of engines on it with a small arena and a host
    tier; two rank-8 adapters on every module (9 pages each)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(PRESETS["tiny-llama"]))

    def make(num_pages: int) -> tuple[Engine, list[Path]]:
        engine = Engine(
            EngineConfig(
                model=str(config),
                load_format="dummy",
                quantization="none",
                num_kv_blocks=num_pages,
                host_kv_bytes=1 << 20,
                pool_policy="tree-cost",
                max_lora_rank=8,
                show_progress=False,
            )
        )
        names = write_random_adapters(tmp_path / f"adapters-{num_pages}", 2, 8, engine)
        return engine, [tmp_path / f"adapters-{num_pages}" / n for n in names]

    return make


@pytest.mark.parametrize("order", ["runner", "before the fix"])
def test_a_page_swapped_out_and_loaded_into_in_one_step(tiny, monkeypatch, order):
    """Three base prompts of 40 tokens leave 6 of 10 pages of cached KV; a 9-page adapter then needs them: the pool
    swaps the KV out to the host and hands the pages to the adapter's load in the same list of copies."""
    engine, paths = tiny(10)
    engine.adapters.add("a", paths[0])
    with contextlib.ExitStack() as stack:
        if order == "before the fix":
            stack.enter_context(_before_the_fix(monkeypatch))
        rec = stack.enter_context(record_copy_order(engine))
        for i in range(3):
            engine.generate([[10 + 7 * i + j for j in range(40)]], GREEDY)
        engine.adapters.stage(["a"])
        [out] = engine.generate([[5] * 5], GREEDY, adapters=["a"])
    assert out.finish_reason == "length"
    [load] = rec.accesses_of("adapter load")
    swapped = {p for a in rec.accesses_of("kv swap-out") if a.step == load.step for p in a.reads}
    assert swapped & load.writes, "the scenario did not happen: no page went from a swap-out to a load in one step"
    engine.check_integrity()
    if order == "runner":
        assert not rec.conflicts, [str(c) for c in rec.conflicts]
    else:
        assert {c.page for c in rec.conflicts} == swapped & load.writes


@pytest.mark.parametrize("order", ["runner", "before the fix"])
def test_an_adapter_unloaded_while_its_load_is_in_flight(tiny, monkeypatch, order):
    """A pinned adapter is loaded as soon as it is staged; it is removed while its copy is still in flight (a load
    takes three forward passes here), and a long base prompt's KV takes its pages in the next forward pass."""
    engine, paths = tiny(20)
    with contextlib.ExitStack() as stack:
        if order == "before the fix":
            stack.enter_context(_before_the_fix(monkeypatch))
        rec = stack.enter_context(record_copy_order(engine, load_latency=3))
        engine.adapters.add("p", paths[0], pinned=True)
        engine.adapters.stage(["p"])
        engine.add(engine.make_request([3] * 40, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
        engine.step()
        [load] = rec.accesses_of("adapter load")
        engine.adapters.remove("p")
        engine.add(engine.make_request([7 + j for j in range(150)], GREEDY))
        while engine.has_work():
            engine.step()
    reused = {p for a in rec.accesses_of("forward") if load.step < a.step <= load.step + 2 for p in a.writes}
    assert reused & load.writes, "the scenario did not happen: the unloaded adapter's pages were not written soon"
    engine.check_integrity()
    if order == "runner":
        assert not rec.conflicts, [str(c) for c in rec.conflicts]
        assert rec.event_waits >= 1  # the compute and copy streams waited for the load's event
    else:
        assert rec.conflicts and {c.first.what for c in rec.conflicts} == {"adapter load"}
