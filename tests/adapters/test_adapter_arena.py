"""Adapters live in the arena: one buffer of pages for KV and adapter weights, an adapter taking the pages of its
own ranks, as many resident as the pool's policy keeps; weights staged on the host in the background; the prefix
cache keyed by the weights' content; pins bounded by a share of the arena; --max-loras bounding one batch.

Page counts are computed by hand here from the packing rule (adapters.page_layout) for the embedded SmolLM2 in
float32: a page is one KV block, 30 layers x 2 x 16 tokens x 192 = 184,320 floats; a rank-8 adapter on q and v
needs, per layer, A 2 x 8 x 576 and B^T 8 x 576 + 8 x 192 = 15,360 floats, beside its table (30 x 7 x 5 int64 =
8,448 bytes aligned = 2,112 floats): 462,912 floats in blocks of at most 9,216, so 3 pages (2.5 pages of data, and
a page wastes less than a block)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file, save_file

from lora_server.adapters.peft_format import AdapterError
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.instrument.stream_recorder import record_copy_order
from lora_server.sampling_params import SamplingParams
from tests.adapters.test_lora_vs_peft import _peft_greedy
from tests.conftest import ADAPTERS, CHAT_PROMPTS, pool_counters
from tests.servers import write_adapter

PAGE_BYTES = 30 * 2 * 16 * 192 * 4
FILLER_PAGES = 3  # a rank-8 q/v adapter (write_adapter's shape), by hand above
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _engine(num_pages: int, **kw) -> Engine:
    return Engine(
        EngineConfig(quantization="none", num_kv_blocks=num_pages, max_lora_rank=16, show_progress=False, **kw)
    )


@pytest.fixture(scope="module")
def fillers(tmp_path_factory):
    root = tmp_path_factory.mktemp("fillers")
    return [write_adapter(root / f"f{i}", seed=1000 + i, r=8) for i in range(16)]


def _resident(engine: Engine) -> set[int]:
    """The ids of the adapters whose weights are on the device."""
    return set(engine.snapshot().resident_pages)


def _drive(engine: Engine, check=None) -> list:
    """Step until idle, checking the pool's integrity (and ``check``) after every step; returns the outputs."""
    outputs = []
    while engine.has_work():
        outputs += engine.step()
        engine.check_integrity()
        if check is not None:
            check(engine)
    return outputs


def test_an_adapter_takes_the_pages_of_its_ranks(fillers, tmp_path):
    engine = _engine(24)
    assert engine.pool_report().block_bytes == PAGE_BYTES
    small = engine.adapters.add("f", fillers[0])
    big = engine.adapters.add("big", write_adapter(tmp_path / "big", seed=1, r=16))
    # rank 16: A 2 x 16 x 576 and B^T 16 x 768 per layer = 30,720 floats; with the table 922,880: just over 5 pages
    assert small.device_nbytes == FILLER_PAGES * PAGE_BYTES
    assert big.device_nbytes == 6 * PAGE_BYTES
    prompt = engine.chat_prompt([{"role": "user", "content": "Hi"}])
    engine.generate([prompt, prompt], GREEDY, adapters=["f", "big"])
    placement = {p.adapter_id: p for p in engine.pool_report().adapters}
    assert placement[small.adapter_id].weight_blocks == 3 and placement[big.adapter_id].weight_blocks == 6
    stats = engine.pool_report().stats
    assert stats.gpu_free + stats.gpu_cached + stats.gpu_in_use == 24 and stats.gpu_cached >= 9
    engine.check_integrity()


@pytest.mark.slow
def test_churn_through_a_small_arena_matches_peft(peft_dirs, peft_model, fillers):
    """Far more adapters registered (5 of HF + PEFT's and 16 fillers, 63+ pages of weights) than a 40-page arena
    holds, and more than the host keeps staged (4): mixed batches of them churn through the device (tree-cost, KV
    swapped to the host tier and back) and are read from disk again, and every request of the PEFT adapters still
    gets HF + PEFT's greedy tokens. The copies run as on CUDA, on the recording stand-in for its streams
    (instrument.stream_recorder): loads stay in flight for two forward passes, and no two accesses to a page race."""
    engine = _engine(40, max_loras=4, max_cpu_loras=4)
    for name in ADAPTERS:
        engine.adapters.add(name, peft_dirs / name)
    for i, path in enumerate(fillers):
        engine.adapters.add(f"filler-{i}", path)
    names = list(ADAPTERS)
    prompts = [engine.chat_prompt([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:3]]
    expected: dict[tuple[str, int], list[int]] = {}
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with record_copy_order(engine, load_latency=2) as rec:
        for round_ in range(3):
            plan = []
            for i, name in enumerate(names):
                plan += [(name, (i + round_) % 3), (f"filler-{(4 * round_ + i) % 16}", i % 3)]
            outs = engine.generate([prompts[p] for _, p in plan], params, adapters=[a for a, _ in plan])
            for (adapter, p), out in zip(plan, outs, strict=True):
                assert out.finish_reason == "length", (adapter, out.finish_reason)
                if adapter in ADAPTERS:
                    key = (adapter, p)
                    if key not in expected:
                        expected[key] = _peft_greedy(peft_model, adapter, prompts[p], 5)
                    assert out.token_ids == expected[key], (round_, adapter)
            engine.check_integrity()
    counters = pool_counters(engine)
    assert counters["adapter_unload"] > 0, dict(counters)  # adapters left the device for others
    assert counters["kv_swap_out"] > 0 and counters["kv_swap_in"] > 0, dict(counters)  # KV to the host and back
    assert len(rec.accesses_of("adapter load")) > len(ADAPTERS) + 4
    assert not rec.conflicts, [str(c) for c in rec.conflicts[:5]]
    assert engine.pool_report().device_memory.staged_adapters <= 4 + 0  # the host kept at most max_cpu_loras staged


@pytest.mark.slow
def test_adapters_and_kv_trade_pages(fillers):
    """A 24-page arena: six rank-8 adapters (18 pages) and their short prompts' KV fill it; a long base-model
    prompt (17 pages of KV) then pushes adapters out (at most 2 can stay); the six adapters' requests then push the
    long prompt's KV out and bring all six back. The integrity check holds after every step."""
    engine = _engine(24, max_loras=6)
    ids = [engine.adapters.add(f"a{i}", path).adapter_id for i, path in enumerate(fillers[:6])]
    short = engine.chat_prompt([{"role": "user", "content": "Hi"}])  # 13 tokens: one block
    engine.adapters.stage([f"a{i}" for i in range(6)])  # all on the host before the requests: no race with the loader
    _run(engine, [short] * 6, [f"a{i}" for i in range(6)])
    assert _resident(engine) >= set(ids)  # six adapters, 18 pages
    long_prompt = list(range(100, 100 + 16 * 16))  # 256 tokens + 4 output: 17 blocks

    def few_adapters(engine: Engine) -> None:
        held = engine.pool_report().request_blocks
        resident = _resident(engine) & set(ids)
        assert held + FILLER_PAGES * len(resident) <= 24

    _run(engine, [long_prompt], [None], few_adapters)
    assert len(_resident(engine) & set(ids)) <= (24 - 17) // FILLER_PAGES
    _run(engine, [short] * 6, [f"a{i}" for i in range(6)])
    assert _resident(engine) >= set(ids)
    base_kv = next(p for p in engine.pool_report().adapters if p.adapter_id < 0).kv_blocks_gpu
    assert base_kv <= 24 - 6 * FILLER_PAGES  # what the long prompt kept on the device


def _run(engine: Engine, prompts, adapters, check=None) -> list:
    for prompt, adapter in zip(prompts, adapters, strict=True):
        engine.add(engine.make_request(prompt, GREEDY, adapter=adapter))
    return _drive(engine, check)


@pytest.mark.slow
def test_a_request_waits_for_its_adapter_while_the_batch_steps(fillers):
    engine = _engine(24)
    engine.adapters.add("late", fillers[0])
    prompt = engine.chat_prompt([{"role": "user", "content": "Count to ten."}])
    running = engine.make_request(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    engine.add(running)
    [prefilled] = engine.step()  # its prefill
    waiting = engine.make_request(prompt, GREEDY, adapter="late")
    engine.add(waiting)
    [stepped] = engine.step()  # the loader is asked for "late" now: it cannot be on the device yet
    assert stepped.request_id == running.request_id and stepped.num_output_tokens == prefilled.num_output_tokens + 1
    snapshot = engine.snapshot()
    assert snapshot.waiting == 1 and snapshot.waiting_adapters == ("late",)  # not admitted
    outputs = _drive(engine)
    done = {o.request_id: o for o in outputs if o.finished}
    assert done[waiting.request_id].finish_reason == "length" and done[running.request_id].finish_reason == "length"


@pytest.mark.slow
def test_changed_files_fail_their_requests_alone(fillers, tmp_path):
    engine = _engine(24)
    path = write_adapter(tmp_path / "moving", seed=5, r=8)
    engine.adapters.add("moving", path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file({k: v * 2 for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))  # not the same any more
    prompt = engine.chat_prompt([{"role": "user", "content": "Hi"}])
    outs = engine.generate([prompt, prompt], GREEDY, adapters=["moving", None])
    assert outs[0].finish_reason == "error" and "changed since it was registered" in str(outs[0].error)
    assert "adapter `moving`" in outs[0].error and str(tmp_path) not in outs[0].error  # callers may be anyone
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 4
    engine.check_integrity()


@pytest.mark.slow
def test_staged_copies_are_bounded_and_pins_are_kept(fillers):
    engine = _engine(40, max_cpu_loras=2, max_loras=2)
    engine.adapters.add("pin", fillers[0], pinned=True)
    for i in range(1, 6):
        engine.adapters.add(f"a{i}", fillers[i])
    prompt = engine.chat_prompt([{"role": "user", "content": "Hi"}])
    for i in range(1, 6):
        engine.generate([prompt], GREEDY, adapters=f"a{i}")
        report = engine.pool_report()
        [pin] = [p for p in report.adapters if p.name == "pin"]
        assert pin.staged and report.device_memory.staged_adapters <= 2 + 1  # the pin, at most max_cpu_loras others
    assert engine.adapters.info("pin").state == "resident"
    engine.check_integrity()


@pytest.mark.slow
def test_the_prefix_cache_follows_the_weights(fillers, tmp_path):
    """Two names on the same files share one content id and one prefix cache; registering the same weights again
    keeps the cache; other weights under the same name never share it."""
    engine = _engine(40)
    a, b = engine.adapters.add("a", fillers[0]), engine.adapters.add("b", fillers[0])
    assert a.adapter_id == b.adapter_id
    prompt = engine.chat_prompt([{"role": "user", "content": CHAT_PROMPTS[2] * 3}])  # several full blocks
    first = engine.generate([prompt], GREEDY, adapters="a")[0]
    assert first.num_cached_tokens == 0
    assert engine.generate([prompt], GREEDY, adapters="b")[0].num_cached_tokens > 0  # a's KV, same weights
    again = engine.adapters.add("a", fillers[0])
    assert again.adapter_id == a.adapter_id and again.version == 2
    assert engine.generate([prompt], GREEDY, adapters="a")[0].num_cached_tokens > 0
    other = engine.adapters.add("a", fillers[1])
    assert other.adapter_id != a.adapter_id
    assert engine.generate([prompt], GREEDY, adapters="a")[0].num_cached_tokens == 0
    engine.check_integrity()


@pytest.mark.slow
def test_pins_are_refused_beyond_half_the_arena(fillers):
    engine = _engine(20)  # pins may take 10 pages: three rank-8 adapters (9), not four
    for i in range(3):
        engine.adapters.add(f"p{i}", fillers[i], pinned=True)
    with pytest.raises(AdapterError, match="pinned adapters may take 10 of the 20 device pages and 9 are taken"):
        engine.adapters.add("p3", fillers[3], pinned=True)
    engine.adapters.add("p3", fillers[3])  # unpinned: fine
    engine.adapters.add("p0", fillers[0], pinned=False)  # a pin let go ...
    engine.adapters.add("p3", fillers[3], pinned=True)  # ... makes room for another


@pytest.mark.slow
def test_max_loras_bounds_the_adapters_of_one_batch(fillers):
    engine = _engine(40, max_loras=2)
    for i in range(4):
        engine.adapters.add(f"a{i}", fillers[i])
    prompt = engine.chat_prompt([{"role": "user", "content": "Hi"}])
    seen = []

    def at_most_two(engine: Engine) -> None:
        running = engine.snapshot().running_adapters  # distinct
        seen.append(len(running))
        assert len(running) <= 2

    outs = _run(engine, [prompt] * 8, [f"a{i % 4}" for i in range(8)], at_most_two)
    assert max(seen) == 2 and sum(o.finished for o in outs) == 8


@pytest.mark.slow
def test_the_ttft_split_counts_the_wait_for_the_adapter(fillers):
    """A request whose adapter must first be read from disk: its TTFT splits into queueing, adapter loading (its
    wait for the staging, then the copy into the arena) and prefill, which add up to it, the staging's wait
    counted; a second request of the adapter, resident now, waits for nothing of it."""
    engine = _engine(24)
    engine.adapters.add("f", fillers[0])  # registered: its weights are not staged
    prompt = engine.chat_prompt([{"role": "user", "content": "Hi"}])
    timings = []
    for i in range(2):
        engine.add(engine.make_request(prompt, GREEDY, "f", request_id=f"r{i}"))
        timings += [out.timings for out in _drive(engine) if out.timings is not None]
        split = engine.snapshot().pool.ttft
        assert split.requests == i + 1
        mean_ttft = sum(t.ttft_s for t in timings) / len(timings)
        parts = split.queueing_mean_s + split.adapter_loading_mean_s + split.prefill_mean_s
        assert parts == pytest.approx(mean_ttft, rel=1e-9, abs=1e-9) and split.mean_s == pytest.approx(mean_ttft)
        assert min(split.queueing_mean_s, split.adapter_loading_mean_s, split.prefill_mean_s) >= 0
    first, second = timings
    assert first.adapter_wait_s > 0 and first.adapter_loaded  # read, staged, then loaded into the arena
    assert second.adapter_wait_s == 0 and not second.adapter_loaded and second.adapter_load_s == 0
    assert split.adapter_loading_mean_s * 2 == pytest.approx(first.adapter_wait_s + first.adapter_load_s)
