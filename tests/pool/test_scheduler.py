"""lora_server.engine.scheduler.Scheduler driven by hand (schedule(), then update() with chosen tokens; no model):
the token budget split, chunked prefill, max_num_seqs, block amounts, preemption, stop conditions, abort, the queue
bound, and a seeded randomized run checked after every step."""

from __future__ import annotations

import random

import pytest

from lora_server.engine.request import FinishReason, Request, RequestStatus
from lora_server.engine.scheduler import Scheduler
from lora_server.errors import QueueFullError
from lora_server.kv_pool import BlockPool
from lora_server.kv_pool.unified_pool import PoolConfig, UnifiedPool
from lora_server.sampling_params import SamplingParams
from tests.scheduler_setup import scheduler_config

EOS = 2
TOKEN = 7  # an ordinary sampled token


def make(
    budget=100,
    max_num_seqs=8,
    max_model_len=256,
    chunked=True,
    max_waiting=1024,
    num_blocks=64,
    block_size=4,
    policy="lru-unified",
) -> tuple[Scheduler, BlockPool]:
    """A scheduler on a unified pool; lru-unified keeps no KV after a request ends, so the device BlockPool
    returned holds exactly the running requests' blocks."""
    pool = UnifiedPool(PoolConfig(num_blocks, 0, block_size, block_bytes=1, policy=policy))
    config = scheduler_config(
        max_num_seqs, budget, max_model_len, enable_chunked_prefill=chunked, max_waiting_requests=max_waiting
    )
    return Scheduler(config, pool), pool.gpu


def new(rid: str, prompt_len: int, **params) -> Request:
    params.setdefault("max_tokens", 100)
    return Request(rid, [10 + i for i in range(prompt_len)], SamplingParams(**params), eos_token_ids=(EOS,))


def step(sched: Scheduler, tokens: dict[str, int] | None = None):
    """One engine step: schedule, then give every request that reached its last token a token (TOKEN unless
    ``tokens`` names one). Returns ([(id, n)], [preempted ids], [advanced ids])."""
    work = sched.schedule()
    items = [(r.request_id, n) for r, n in work.items]
    sampled = {
        r.request_id: [(tokens or {}).get(r.request_id, TOKEN)]
        for r, n in work.items
        if r.num_computed_tokens + n == r.num_tokens
    }
    advanced = sched.update(work, sampled)
    sched.check_integrity()
    return items, [r.request_id for r in work.preempted], [r.request_id for r in advanced]


# ---- the token budget ----------------------------------------------------------------------------------------


def test_budget_split_decodes_then_running_prefills_then_waiting():
    sched, pool = make(budget=10, block_size=4)
    a, b = new("a", 4), new("b", 3)
    sched.add(a)
    sched.add(b)
    assert step(sched) == ([("a", 4), ("b", 3)], [], ["a", "b"])
    assert (a.num_computed_tokens, a.num_tokens, len(a.block_table)) == (4, 5, 1)
    assert (b.num_computed_tokens, b.num_tokens, len(b.block_table)) == (3, 4, 1)

    c = new("c", 20)
    sched.add(c)
    # decodes a, b (1 each), then c gets the 8 tokens left
    assert step(sched) == ([("a", 1), ("b", 1), ("c", 8)], [], ["a", "b"])
    assert len(a.block_table) == 2  # a computed 5 tokens: ceil(5 / 4)
    assert len(c.block_table) == 2 and c.num_computed_tokens == 8

    d = new("d", 5)
    sched.add(d)
    # the running prefill c takes what the decodes leave; nothing is left for d
    assert step(sched) == ([("a", 1), ("b", 1), ("c", 8)], [], ["a", "b"])
    assert d.status is RequestStatus.WAITING and not d.block_table
    assert len(c.block_table) == 4

    # c finishes its prompt (4 tokens), d gets a first chunk of 4 of its 5 tokens
    assert step(sched) == ([("a", 1), ("b", 1), ("c", 4), ("d", 4)], [], ["a", "b", "c"])
    assert len(c.block_table) == 5 and c.num_output_tokens == 1
    assert d.num_computed_tokens == 4 and d.num_output_tokens == 0 and len(d.block_table) == 1
    # now c is a decode; d finishes its prompt
    assert step(sched) == ([("a", 1), ("b", 1), ("c", 1), ("d", 1)], [], ["a", "b", "c", "d"])
    assert len(d.block_table) == 2  # 5 tokens computed
    assert pool.num_used == sum(len(r.block_table) for r in (a, b, c, d))


def test_waiting_requests_admitted_in_arrival_order():
    sched, _ = make(budget=7)
    for rid in ("x", "y", "z", "w"):
        sched.add(new(rid, 3))
    assert step(sched)[0] == [("x", 3), ("y", 3), ("z", 1)]
    assert [r.request_id for r in sched.waiting] == ["w"]
    assert [r.request_id for r in sched.running] == ["x", "y", "z"]
    assert step(sched)[0] == [("x", 1), ("y", 1), ("z", 2), ("w", 3)]


def test_chunked_prefill_off_admits_only_whole_prompts_in_order():
    sched, _ = make(budget=10, chunked=False)
    for rid, n in (("a", 6), ("b", 6), ("c", 2)):
        sched.add(new(rid, n))
    # b does not fit the 4 tokens left and is not split; c, behind it, does not jump the queue
    assert step(sched)[0] == [("a", 6)]
    assert step(sched)[0] == [("a", 1), ("b", 6), ("c", 2)]

    sched, _ = make(budget=10, chunked=True)
    for rid, n in (("a", 6), ("b", 6), ("c", 2)):
        sched.add(new(rid, n))
    assert step(sched)[0] == [("a", 6), ("b", 4)]
    assert step(sched)[0] == [("a", 1), ("b", 2), ("c", 2)]


def test_long_prompt_chunks_across_steps():
    sched, pool = make(budget=8, block_size=4)
    r = new("r", 21)
    sched.add(r)
    expected_blocks = [2, 4, 6]  # after 8, 16, 21 tokens
    for n, blocks in zip((8, 8, 5), expected_blocks, strict=True):
        items, _, advanced = step(sched)
        assert items == [("r", n)]
        assert len(r.block_table) == blocks and pool.num_used == blocks
        assert advanced == (["r"] if n == 5 else [])
    assert r.num_output_tokens == 1 and r.num_computed_tokens == 21


def test_max_num_seqs():
    sched, _ = make(budget=100, max_num_seqs=2)
    sched.add(new("a", 2, max_tokens=2))
    sched.add(new("b", 2))
    sched.add(new("c", 2))
    assert step(sched)[0] == [("a", 2), ("b", 2)]
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert step(sched)[0] == [("a", 1), ("b", 1)]  # a reaches max_tokens 2 here
    assert step(sched)[0] == [("b", 1), ("c", 2)]


def test_decode_block_growth():
    sched, pool = make(block_size=4)
    r = new("r", 3)
    sched.add(r)
    lengths = []
    for _ in range(8):
        step(sched)
        lengths.append(len(r.block_table))
    # computed tokens after each step: 3, 4, 5, ..., 10 -> ceil(n / 4) blocks
    assert lengths == [1, 1, 2, 2, 2, 2, 3, 3]
    assert pool.num_used == 3


# ---- preemption ------------------------------------------------------------------------------------------------


def test_preemption_of_the_most_recently_admitted():
    sched, pool = make(num_blocks=4, block_size=2)
    a, b = new("a", 3, max_tokens=4), new("b", 3)
    sched.add(a)
    sched.add(b)
    assert step(sched)[0] == [("a", 3), ("b", 3)]
    assert pool.num_free == 0
    assert step(sched)[0] == [("a", 1), ("b", 1)]  # 4 tokens each still fit their 2 blocks
    b_tokens = list(b.token_ids)
    d = new("d", 1)
    sched.add(d)
    # a needs a third block for its 5th token: b (admitted last) is preempted
    items, preempted, _ = step(sched)
    assert items == [("a", 1)] and preempted == ["b"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert b.token_ids == b_tokens  # its tokens are kept for the recompute
    assert [r.request_id for r in sched.waiting] == ["b", "d"]  # to the front, ahead of d
    assert b not in sched.running and len(a.block_table) == 3
    assert pool.num_free == 1  # d would fit, but nobody is admitted in a step that preempted
    assert d.status is RequestStatus.WAITING

    # b needs 3 blocks for its 5 tokens, 1 is free: it waits, and d does not jump it
    items, preempted, advanced = step(sched)
    assert items == [("a", 1)] and preempted == [] and advanced == ["a"]
    assert a.finished and a.finish_reason is FinishReason.LENGTH and pool.num_free == 4
    # a has finished: b is recomputed from all its tokens, then d
    items, _, advanced = step(sched)
    assert items == [("b", 5), ("d", 1)] and advanced == ["b", "d"]
    assert b.num_output_tokens == 3 and len(b.block_table) == 3 and len(d.block_table) == 1
    assert b.token_ids[:5] == b_tokens


def test_preemption_victim_is_the_latest_not_the_neighbour():
    sched, pool = make(num_blocks=3, block_size=2)
    a, b, c = new("a", 2), new("b", 1), new("c", 1)
    for r in (a, b, c):
        sched.add(r)
    step(sched)
    assert pool.num_free == 0
    # a needs a second block; c (admitted last) is the victim, b keeps running
    items, preempted, _ = step(sched)
    assert preempted == ["c"] and items == [("a", 1), ("b", 1)]
    assert b.status is RequestStatus.RUNNING and c.status is RequestStatus.WAITING


def test_preemption_of_several_keeps_arrival_order_in_the_queue():
    sched, pool = make(num_blocks=4, block_size=2)
    reqs = [new("a", 2), new("b", 2), new("c", 1), new("d", 1)]
    for r in reqs:
        sched.add(r)
    step(sched)
    assert pool.num_free == 0
    items, preempted, _ = step(sched)
    assert items == [("a", 1), ("b", 1)] and preempted == ["d", "c"]
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    assert all(len(r.block_table) == 2 for r in reqs[:2])


def test_request_needing_blocks_preempts_itself_when_latest():
    sched, pool = make(num_blocks=2, block_size=2)
    a, b = new("a", 1), new("b", 2)
    sched.add(a)
    sched.add(b)
    step(sched)
    items, preempted, _ = step(sched)
    assert items == [("a", 1)] and preempted == ["b"]
    assert a.status is RequestStatus.RUNNING and len(a.block_table) == 1
    assert pool.num_free == 1


def test_preempted_request_finishes_later():
    sched, pool = make(num_blocks=4, block_size=2)
    a, b = new("a", 3, max_tokens=6), new("b", 3, max_tokens=6)
    sched.add(a)
    sched.add(b)
    for _ in range(40):
        if not sched.has_work():
            break
        step(sched)
    assert a.finished and b.finished
    assert b.num_preemptions >= 1
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert pool.num_free == 4


# ---- stopping ----------------------------------------------------------------------------------------------------


def run_until_done(sched: Scheduler, tokens: list[int], rid: str = "r") -> list[list]:
    """Feed ``tokens`` one per step to request rid until it finishes; returns the steps' advanced lists."""
    out = []
    for t in tokens:
        _, _, advanced = step(sched, {rid: t})
        out.append(advanced)
        if sched.requests.get(rid) is None:
            break
    return out


def test_stop_on_max_tokens():
    sched, pool = make()
    r = new("r", 5, max_tokens=3)
    sched.add(r)
    run_until_done(sched, [TOKEN] * 10)
    assert r.finished and r.finish_reason is FinishReason.LENGTH and r.stop_reason is None
    assert r.output_token_ids == [TOKEN] * 3
    assert r.block_table == [] and pool.num_free == pool.num_blocks
    assert r not in sched.running and "r" not in sched.requests
    assert not sched.has_work()


def test_stop_on_eos():
    sched, pool = make()
    r = new("r", 4)
    sched.add(r)
    advanced = run_until_done(sched, [TOKEN, EOS, TOKEN])
    assert advanced == [["r"], ["r"]]  # the finishing step still reports the request as advanced
    assert r.finish_reason is FinishReason.STOP and r.stop_reason is None
    assert r.output_token_ids == [TOKEN, EOS]
    assert pool.num_free == pool.num_blocks


def test_stop_on_stop_token_ids():
    sched, _ = make()
    r = new("r", 4, stop_token_ids=[9, 11])
    sched.add(r)
    run_until_done(sched, [TOKEN, 11, TOKEN])
    assert r.finish_reason is FinishReason.STOP and r.stop_reason == 11
    assert r.output_token_ids == [TOKEN, 11]


def test_eos_on_the_last_allowed_token_is_a_stop():
    sched, _ = make()
    r = new("r", 4, max_tokens=2)
    sched.add(r)
    run_until_done(sched, [TOKEN, EOS])
    assert r.finish_reason is FinishReason.STOP


def test_ignore_eos():
    sched, _ = make()
    r = new("r", 4, max_tokens=4, ignore_eos=True)
    sched.add(r)
    run_until_done(sched, [EOS] * 10)
    assert r.finish_reason is FinishReason.LENGTH and r.output_token_ids == [EOS] * 4
    # a stop token id still stops with ignore_eos
    sched, _ = make()
    r = new("r", 4, max_tokens=4, ignore_eos=True, stop_token_ids=[EOS])
    sched.add(r)
    run_until_done(sched, [EOS] * 10)
    assert r.finish_reason is FinishReason.STOP and r.stop_reason == EOS and r.num_output_tokens == 1


def test_min_tokens_delays_eos_and_stop_tokens():
    sched, _ = make()
    r = new("r", 4, max_tokens=10, min_tokens=3, stop_token_ids=[9])
    sched.add(r)
    run_until_done(sched, [EOS, 9, TOKEN, EOS, TOKEN])
    assert r.finish_reason is FinishReason.STOP and r.stop_reason is None
    assert r.output_token_ids == [EOS, 9, TOKEN, EOS]
    sched, _ = make()
    r = new("r", 4, max_tokens=10, min_tokens=3, stop_token_ids=[9])
    sched.add(r)
    run_until_done(sched, [9, TOKEN, TOKEN, 9])
    assert r.finish_reason is FinishReason.STOP and r.stop_reason == 9 and r.num_output_tokens == 4


def test_stop_at_max_model_len():
    sched, pool = make(max_model_len=8)
    r = new("r", 6, max_tokens=100)
    sched.add(r)
    run_until_done(sched, [TOKEN] * 10)
    assert r.finish_reason is FinishReason.LENGTH and r.num_tokens == 8 and r.num_output_tokens == 2
    assert pool.num_free == pool.num_blocks


# ---- abort and the queue bound --------------------------------------------------------------------------------------


def test_abort_waiting_and_running():
    sched, pool = make(budget=6, block_size=4)
    a, b, c = new("a", 4), new("b", 6), new("c", 3)
    for r in (a, b, c):
        sched.add(r)
    step(sched)  # a whole, b a chunk of 2; c waits
    assert b.status is RequestStatus.RUNNING and b.num_computed_tokens == 2 and c.status is RequestStatus.WAITING
    used = pool.num_used
    assert sched.abort("c") is c
    assert c.finished and c.finish_reason is FinishReason.ABORT and c not in sched.waiting
    assert pool.num_used == used
    assert sched.abort("b") is b  # a running, partly prefilled request
    assert b.finished and b.finish_reason is FinishReason.ABORT and b.block_table == []
    assert b not in sched.running and pool.num_used == len(a.block_table) == 1
    sched.check_integrity()
    assert sched.abort("b") is None and sched.abort("nope") is None
    items, _, _ = step(sched)
    assert items == [("a", 1)]
    assert sched.abort("a") is a and pool.num_free == pool.num_blocks and not sched.has_work()
    a_again = new("a", 2)  # a finished id can be used again
    sched.add(a_again)
    assert step(sched)[0] == [("a", 2)]


def test_finish_is_idempotent():
    sched, pool = make()
    r = new("r", 3)
    sched.add(r)
    step(sched)
    sched.finish(r, FinishReason.ABORT)
    sched.finish(r, FinishReason.STOP)
    assert r.finish_reason is FinishReason.ABORT and pool.num_free == pool.num_blocks
    sched.check_integrity()


def test_queue_full_at_the_bound():
    sched, _ = make(budget=4, max_waiting=3)
    for i in range(3):
        sched.add(new(f"r{i}", 4))
    with pytest.raises(QueueFullError):
        sched.add(new("r3", 4))
    assert len(sched.waiting) == 3 and "r3" not in sched.requests
    step(sched)  # r0 admitted: room for one more
    sched.add(new("r3", 4))
    with pytest.raises(QueueFullError):
        sched.add(new("r4", 4))
    sched.abort("r3")
    with pytest.raises(ValueError):
        sched.add(new("r0", 1))  # an id in use (r0 is running)
    with pytest.raises(ValueError):
        sched.add(new("r1", 1))  # an id in use (r1 is waiting)
    assert len(sched.waiting) == 2


# ---- randomized ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "chunked,seed,limits", [(True, 0, False), (True, 1, False), (False, 2, False), (True, 3, True)]
)
def test_randomized_run(chunked, seed, limits):
    """``limits``: a long-prefill cap of 8 tokens, one long prompt and two prompts in all prefilling at once."""
    rng = random.Random(seed)
    block_size, num_blocks, max_len = 4, 20, 64
    budget = 24 if chunked else max_len
    max_seqs = 6
    sched, pool = make(
        budget=budget,
        max_num_seqs=max_seqs,
        max_model_len=max_len,
        chunked=chunked,
        max_waiting=8,
        num_blocks=num_blocks,
        block_size=block_size,
    )
    if limits:
        sched.config.long_prefill_token_threshold = 8
        sched.config.max_long_partial_prefills, sched.config.max_num_partial_prefills = 1, 2
    all_requests: list[Request] = []
    rejected = aborted = 0
    for step_no in range(3000):
        if step_no < 300:
            for _ in range(rng.choice((0, 0, 1, 2))):
                prompt_len = rng.randint(1, 40)
                max_tokens = rng.randint(1, 30)
                r = new(
                    f"q{len(all_requests)}",
                    prompt_len,
                    max_tokens=max_tokens,
                    min_tokens=rng.randint(0, min(max_tokens, 3)),
                    ignore_eos=rng.random() < 0.2,
                    stop_token_ids=[5] if rng.random() < 0.3 else [],
                )
                try:
                    sched.add(r)
                except QueueFullError:
                    rejected += 1
                    assert len(sched.waiting) >= 8  # preempted requests may take it past the bound
                    continue
                all_requests.append(r)
        if sched.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(sched.requests))
            assert sched.abort(victim).finish_reason is FinishReason.ABORT
            aborted += 1
            sched.check_integrity()
        if not sched.has_work():
            if step_no >= 300:
                break
            continue

        before_running = list(sched.running)
        before_uncomputed = {r.request_id: r.num_uncomputed_tokens for r in before_running}
        before_waiting = list(sched.waiting)
        work = sched.schedule()
        ids = [r.request_id for r, _ in work.items]
        assert len(ids) == len(set(ids))
        assert all(n >= 1 for _, n in work.items)
        assert work.num_tokens <= budget
        assert len(sched.running) <= max_seqs
        # order: decodes, then running prefills (both in running order), then admitted in arrival order
        kind = [0 if before_uncomputed.get(i) == 1 else 1 if i in before_uncomputed else 2 for i in ids]
        assert kind == sorted(kind)
        for k in (0, 1):  # decodes, then running prefills, each in running order
            old = [r for (r, _), kd in zip(work.items, kind, strict=True) if kd == k]
            assert old == [r for r in before_running if r in old]
        admitted = [r for r, _ in work.items if r not in before_running]
        if not limits:
            assert admitted == before_waiting[: len(admitted)]
        else:  # in line order, prompts over the limits stepped over: at most 2 prefilling, 1 with over 8 left
            assert admitted == [r for r in before_waiting if r in admitted]
            prefilling = [u for u in before_uncomputed.values() if u > 1]
            assert len(admitted) <= max(0, 2 - len(prefilling))
            assert sum(r.num_tokens > 8 for r in admitted) <= max(0, 1 - sum(u > 8 for u in prefilling))
        if work.preempted:
            assert not admitted
            for p in work.preempted:
                assert p.status is RequestStatus.WAITING and p.num_computed_tokens == 0 and not p.block_table
        for r, n in work.items:
            assert n <= r.num_uncomputed_tokens
            if not chunked:
                assert r.num_computed_tokens + n == r.num_tokens  # no partial prefills
            assert len(r.block_table) == pool.blocks_for_tokens(r.num_computed_tokens + n)
        sched.check_integrity()
        if (
            chunked
            and not limits
            and not work.preempted
            and sched.waiting
            and len(sched.running) < max_seqs
            and budget - work.num_tokens > 0
        ):
            # the head of the queue was left out only because its blocks do not fit
            head = next(iter(sched.waiting))
            want = min(head.num_uncomputed_tokens, budget - work.num_tokens)
            assert pool.blocks_for_tokens(want) > pool.num_free

        sampled = {}
        for r, n in work.items:
            if r.num_computed_tokens + n == r.num_tokens:
                sampled[r.request_id] = [
                    rng.choice((EOS, 5, 7, 8, 9, 11, 12, 13, 14, 15)) if rng.random() < 0.3 else rng.randint(20, 40)
                ]
        sched.update(work, sampled)
        sched.check_integrity()
        for r in sched.running:
            assert len(r.block_table) == pool.blocks_for_tokens(r.num_computed_tokens)
            assert r.num_computed_tokens <= r.num_tokens <= max_len
        for r in sched.waiting:
            assert not r.block_table and r.num_computed_tokens == 0
        assert pool.num_used == sum(len(r.block_table) for r in sched.running)
    else:
        pytest.fail("the run did not drain")

    assert pool.num_free == num_blocks and not sched.running and not sched.waiting
    assert sched.num_preemptions > 0 and rejected > 0 and aborted > 0
    for r in all_requests:
        assert r.finished
        p = r.params
        assert r.num_output_tokens <= p.max_tokens and r.num_tokens <= max_len
        if r.finish_reason is FinishReason.LENGTH:
            assert r.num_output_tokens == p.max_tokens or r.num_tokens == max_len
        elif r.finish_reason is FinishReason.STOP:
            last = r.output_token_ids[-1]
            assert r.num_output_tokens >= p.min_tokens
            assert last in p.stop_token_ids or (last == EOS and not p.ignore_eos)
            assert r.stop_reason == (last if last in p.stop_token_ids else None)
        else:
            assert r.finish_reason is FinishReason.ABORT


# ---- a long prompt beside short ones -------------------------------------------------------------------------


def test_a_long_prefill_is_capped_while_others_run_or_wait():
    """Alone, a long prompt takes the whole budget; once a short request waits, the long one computes at most the
    threshold a step, the short one is admitted in the same step and gets its first token there, then decodes
    beside the long one's capped chunks; alone again, the long one takes the whole budget."""
    sched, _ = make(budget=32, block_size=4, num_blocks=64)
    sched.config.long_prefill_token_threshold = 8
    long, short = new("long", 120), new("short", 5, max_tokens=3)
    sched.add(long)
    assert step(sched) == ([("long", 32)], [], [])
    sched.add(short)
    assert step(sched) == ([("long", 8), ("short", 5)], [], ["short"])  # short's first token, one step after arrival
    assert step(sched) == ([("short", 1), ("long", 8)], [], ["short"])
    assert step(sched) == ([("short", 1), ("long", 8)], [], ["short"])  # short's third and last token
    assert short.status is RequestStatus.FINISHED and short.finish_reason is FinishReason.LENGTH
    assert step(sched) == ([("long", 32)], [], [])
    assert long.num_computed_tokens == 32 + 8 * 3 + 32


def test_no_cap_without_a_threshold_or_chunked_prefill():
    sched, _ = make(budget=32, block_size=4, num_blocks=64)
    long, short = new("long", 120), new("short", 5)
    sched.add(long)
    sched.add(short)
    assert step(sched) == ([("long", 32)], [], [])  # threshold 0: the first in line takes the budget
    assert step(sched) == ([("long", 32)], [], [])
    sched, _ = make(budget=200, chunked=False, num_blocks=128)
    sched.config.long_prefill_token_threshold = 8
    a, b = new("a", 60), new("b", 5)
    sched.add(a)
    sched.add(b)
    assert step(sched) == ([("a", 60), ("b", 5)], [], ["a", "b"])


def test_one_long_prefill_at_a_time_and_short_prompts_go_ahead():
    """max_long_partial_prefills 1: a second long prompt waits while the first has more than the threshold left;
    a short prompt behind it is admitted at once; waiting long prompts that cannot start leave the running one
    the whole budget; the second starts in the step after the first's prompt is computed."""
    sched, _ = make(budget=32, block_size=4, num_blocks=128)
    sched.config.long_prefill_token_threshold = 8
    sched.config.max_long_partial_prefills = 1
    l1, l2, short = new("l1", 120), new("l2", 120), new("short", 5, max_tokens=2)
    sched.add(l1)
    sched.add(l2)
    assert step(sched) == ([("l1", 8)], [], [])  # both could start when the cap was set: l1 capped, l2 waits
    assert step(sched) == ([("l1", 32)], [], [])  # l2 cannot start: nobody to leave room for
    sched.add(short)
    assert step(sched) == ([("l1", 8), ("short", 5)], [], ["short"])  # short ahead of l2
    assert step(sched) == ([("short", 1), ("l1", 8)], [], ["short"])
    assert short.status is RequestStatus.FINISHED
    assert step(sched) == ([("l1", 32)], [], [])
    assert l1.num_computed_tokens == 88 and l2.status is RequestStatus.WAITING
    assert step(sched) == ([("l1", 32)], [], ["l1"])  # l1's last 32 prompt tokens, and its first token
    assert step(sched) == ([("l1", 1), ("l2", 8)], [], ["l1"])


def test_at_most_max_num_partial_prefills_prompts_at_once():
    sched, _ = make(budget=32, block_size=4, num_blocks=128)
    sched.config.long_prefill_token_threshold = 8
    sched.config.max_num_partial_prefills = 1
    for rid in "abc":
        sched.add(new(rid, 5, max_tokens=3))
    assert step(sched) == ([("a", 5)], [], ["a"])
    assert step(sched) == ([("a", 1), ("b", 5)], [], ["a", "b"])
    assert step(sched) == ([("a", 1), ("b", 1), ("c", 5)], [], ["a", "b", "c"])
    sched, _ = make(budget=32, block_size=4, num_blocks=128, chunked=False)  # whole prompts: no partial prefills
    sched.config.max_num_partial_prefills = 1
    for rid in "abc":
        sched.add(new(rid, 5, max_tokens=3))
    assert step(sched) == ([("a", 5), ("b", 5), ("c", 5)], [], ["a", "b", "c"])
