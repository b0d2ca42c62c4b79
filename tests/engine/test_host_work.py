"""lora_server.instrument.host_work: the counter against hand-built sequences of ops on the meta stand-in (each count
known in advance), Triton launches counted and not run, the guard (raises on a sync or a pageable copy, passes
otherwise), the sampler's one staging copy and one transfer back, the guard around the real runner's decode step,
and the benchmark on a 2-layer tiny Llama."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from lora_server.bench.host_work import measure, stand_in_engine
from lora_server.engine.request import Request
from lora_server.instrument.host_work import (
    HostWorkCounter,
    HostWorkError,
    counting_triton_launches,
    no_sync_or_pageable_copy,
    stand_in_cuda,
)
from lora_server.model.sampler import Sampler
from lora_server.sampling_params import SamplingParams
from tests.conftest import runner_of

META = torch.device("meta")


@triton.jit
def _fill_kernel(out_ptr, value, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, value, mask=offs < n)


def test_counts_a_known_sequence_of_ops():
    counter = HostWorkCounter("meta", emulate=True)
    with counter:
        x = torch.ones(8, device=META)  # 1 op (a factory: no tensor argument, not a launch)
        y = x * 2  # 1 op, 1 launch
        z = y[2:].view(2, 3)  # views: nothing
        z.add_(1)  # 1 op, 1 launch
        host = torch.arange(8, dtype=torch.float32)  # 1 op on the host
        x.copy_(host)  # 1 op, a pageable host-to-device copy
        staging = torch.empty(8, pin_memory=True)  # 1 op on the host
        x.copy_(staging)  # 1 op, a pinned host-to-device copy
        value = y.sum().item()  # 2 ops: sum (a launch), then a sync
        tokens = y.long().tolist()  # 2 ops: the cast (a launch), then a sync
        empty = (y > 100).nonzero()  # 2 ops: gt (a launch), nonzero (a launch and a sync)
    work = counter.work
    assert (work.ops, work.torch_launches, work.launches) == (13, 6, 0)
    assert (work.h2d, work.h2d_pageable, work.syncs) == (2, 1, 3)
    assert value == 0.0 and tokens == [0] * 8 and empty.shape == (0, 1)  # the stand-in reads back zeros
    assert work.sync_names["nonzero.default"] == 1


def test_triton_launches_are_counted_not_run():
    counter = HostWorkCounter("cpu")
    out = torch.zeros(10)
    with counter, counting_triton_launches(counter, run=False):
        _fill_kernel[(2,)](out, 3.0, 10, BLOCK=8)
        _fill_kernel[(1,)](out, 3.0, 10, BLOCK=16)
    assert counter.work.launches == 2 and counter.work.kernel_names == {"_fill_kernel": 2}
    assert out.eq(0).all()  # nothing ran


def test_guard_raises_on_a_sync():
    def decode(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        if y.max() > 0:  # a hidden sync: bool() of a device tensor
            y = y + 1
        return y

    x = torch.ones(4, device=META)
    with pytest.raises(HostWorkError, match="synchronizes"), no_sync_or_pageable_copy(META):
        decode(x)


def test_guard_raises_on_a_pageable_copy():
    x = torch.ones(4, device=META)
    with pytest.raises(HostWorkError, match="pageable"), no_sync_or_pageable_copy(META):
        x.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))


def test_guard_passes_pinned_copies_and_device_work():
    staging = torch.empty(4, pin_memory=torch.cuda.is_available())
    x = torch.ones(4, device=META)
    with no_sync_or_pageable_copy(META) as work:
        pinned = torch.empty(4, pin_memory=True)
        x.copy_(pinned, non_blocking=True)
        y = torch.where(x > 0, x * 2, x).softmax(-1)
        _ = y.argmax(-1)
    assert work.h2d == 1 and work.h2d_pageable == 0 and work.syncs == 0
    assert work.torch_launches == 5  # gt, mul, where, softmax, argmax, and nothing else
    del staging


def _req(params: SamplingParams, rid: str) -> Request:
    r = Request(rid, [3, 5, 7], params, eos_token_ids=(2,))
    r.token_ids.extend([5, 9])
    return r


@pytest.mark.parametrize(
    ("params", "h2d"),
    [
        ([SamplingParams(temperature=0.0)] * 4, 0),  # greedy only: nothing to stage
        (
            [
                SamplingParams(temperature=0.0),
                SamplingParams(temperature=0.7, top_p=0.9, seed=3, logprobs=2),
                SamplingParams(temperature=1.0, top_k=4, min_p=0.1, repetition_penalty=1.2),
                SamplingParams(frequency_penalty=0.5, presence_penalty=0.1, logit_bias={1: 2.0}, min_tokens=4),
            ],
            1,
        ),
    ],
)
def test_sampler_stages_once_and_reads_back_once(params, h2d):
    sampler = Sampler(32)
    requests = [_req(p, str(i)) for i, p in enumerate(params)]
    counter = HostWorkCounter("meta", emulate=True)
    with stand_in_cuda(), counter:
        logits = torch.empty(len(requests), 40, device=META)
        result = sampler(logits, requests)
    work = counter.work
    assert (work.h2d, work.h2d_pageable, work.syncs) == (h2d, 0, 1), work.summary()
    assert result.token_ids == [0] * len(requests)


def test_guard_counts_syncs_against_those_allowed():
    x = torch.ones(4, device=META)
    with no_sync_or_pageable_copy(META, allowed_syncs=1) as work:
        x.sum().item()
    assert work.syncs == 1
    with pytest.raises(HostWorkError, match="synchronizes"), no_sync_or_pageable_copy(META, allowed_syncs=1):
        x.sum().item()
        x.max().item()


def test_stand_in_emulates_pinned_host_memory():
    with stand_in_cuda():
        pinned = torch.empty(16, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(16, dtype=torch.uint8)
        assert pinned.is_pinned() and pinned[8:].view(torch.int64).is_pinned() and not pageable.is_pinned()
        x = torch.empty(8, dtype=torch.uint8, device=META)
        with no_sync_or_pageable_copy(META) as work:
            x.copy_(pinned[8:], non_blocking=True)
        assert (work.h2d, work.h2d_pageable) == (1, 0)
        with pytest.raises(HostWorkError, match="pageable"), no_sync_or_pageable_copy(META):
            x.copy_(pageable[8:])


@pytest.mark.parametrize(
    ("params", "h2d"),
    [
        (SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), 1),  # the step's one staging copy
        (SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, repetition_penalty=1.1, ignore_eos=True), 2),
    ],
    ids=["greedy", "sampled"],
)
def test_decode_step_of_the_runner_neither_syncs_nor_copies_from_pageable_memory(monkeypatch, params, h2d):
    """The real engine's decode step on the meta stand-in for CUDA, 3 requests padded to their bucket of 4: until
    the sampler reads its tokens back nothing synchronizes, and every host-to-device copy is from pinned memory
    (one for the step's inputs, one more for sampling parameters); the sampler's read back is the step's one sync."""
    with stand_in_engine(2, 3, 2, 8, 8, 4, max_num_seqs=8, params=params) as engine:
        with HostWorkCounter("meta", emulate=True):  # the prefill (the counter reads back zeros)
            engine.step()
        assert engine.snapshot().decoding
        runner = runner_of(engine)
        prepare, sampler = runner.prepare, runner.sampler
        batches, before_sampling = [], []

        def spied_prepare(items):
            batch, sampling = prepare(items)
            batches.append(batch)
            return batch, sampling

        def spied_sampler(logits, rows, mask=None):
            before_sampling.append(work.totals())
            return sampler(logits, rows, mask)

        monkeypatch.setattr(runner, "prepare", spied_prepare)
        monkeypatch.setattr(runner, "sampler", spied_sampler)
        for _ in range(2):
            with no_sync_or_pageable_copy(META, allowed_syncs=1) as work:
                outputs = engine.step()
            # the engine fails a request whose step raised (the guard's error included) and goes on
            assert len(outputs) == 3 and not any(o.error for o in outputs)
            assert (work.syncs, work.h2d, work.h2d_pageable) == (1, h2d, 0), work.summary()
            assert before_sampling[-1]["syncs"] == 0 and before_sampling[-1]["h2d"] == 1
    assert [(b.num_tokens, b.num_padding) for b in batches] == [(4, 1), (4, 1)]


def test_benchmark_counts_a_decode_step_of_the_cuda_path():
    result = measure(layers=2, batch=4, adapters=2, rank=8, prompt_len=8, steps=2)
    step = result.step
    # per layer: shrink and expand for QKV, O, gate-up, down (4 + 4), two norms (the first layer's alone, the others
    # fused with the residual add; the final norm too), rotary with the KV write, decode attention (one split at
    # this short context: no reduce), SiLU-and-multiply
    assert step["kernels"] == {
        "_rms_norm_kernel": 5,
        "_lora_shrink_kernel": 8,
        "_lora_expand_kernel": 8,
        "_rotary_write_kv_kernel": 2,
        "_decode_attention_kernel": 2,
        "_silu_and_mul_kernel": 2,
    }
    # one pinned staging copy (greedy: the sampler stages nothing), one read back; the forward pass neither copies
    # nor syncs, launches every one of the 27 Triton kernels above, and is most of the step's launches
    assert (step["h2d"], step["h2d_pageable"], step["syncs"]) == (1, 0, 1)
    forward = step["forward"]
    assert (forward["h2d"], forward["syncs"]) == (0, 0) and forward["triton_launches"] == 27
    assert result.bucket == 4 and step["launches"] - forward["launches"] < 16
