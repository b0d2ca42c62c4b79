"""Speculative decoding by prompt lookup: n-gram proposals (hand-computed), the scheduler's draft bookkeeping (KV
of rejected drafts rolled back, their blocks given back, stops inside accepted drafts), the verification rule
against the softmax it must preserve (chi-square), and the engine on the embedded model with and without
speculation (the reference): greedy and seeded outputs identical, with an adapter, in a mixed batch, stops inside
drafts, integrity after every step, and speculation off while the batch is large."""

from __future__ import annotations

import pytest
import torch

from lora_server.adapters import demo_adapters
from lora_server.config import EngineConfig
from lora_server.engine import Engine
from lora_server.engine.ngram import propose_ngram
from lora_server.engine.request import FinishReason, Request
from lora_server.engine.scheduler import Scheduler
from lora_server.kv_pool.unified_pool import PoolConfig, UnifiedPool
from lora_server.model.batch import DraftPosition
from lora_server.model.sampler import Sampler, verify_drafts
from lora_server.sampling_params import SamplingParams
from tests.conftest import CHAT_PROMPTS, scheduler_of
from tests.scheduler_setup import scheduler_config

TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "To be or not to be, that is the question."
)
COPY = "Repeat the following text exactly:\n" + TEXT
MAX_BATCH = 5  # the speculating engine's speculative_max_batch

# ---- proposals -------------------------------------------------------------------------------------------------


def test_ngram_proposals_follow_the_most_recent_longest_match():
    # the last 2-gram [1, 2] occurs at 0: what followed it
    assert propose_ngram([1, 2, 3, 4, 1, 2], 3, 1, 3) == [3, 4, 1]
    assert propose_ngram([1, 2, 3, 4, 1, 2], 1, 1, 3) == [3]
    # [5, 6] occurs at 0 (followed by 7 9 6); the 1-gram [6] last occurred at 4 (followed by 8 5 6)
    tokens = [5, 6, 7, 9, 6, 8, 5, 6]
    assert propose_ngram(tokens, 3, 1, 2) == [7, 9, 6]
    assert propose_ngram(tokens, 3, 1, 1) == [8, 5, 6]
    # the most recent of several occurrences of [1, 2]
    assert propose_ngram([1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 2) == [8, 1]
    assert propose_ngram([1, 2, 3], 4, 2, 4) == []  # no earlier [2, 3], and n=1 is below min_n
    assert propose_ngram([4, 4], 3, 1, 4) == [4]  # the follow-up stops at the end of the sequence
    assert propose_ngram([7], 3, 1, 4) == [] and propose_ngram([1, 1, 1], 0, 1, 4) == []


# ---- the scheduler's bookkeeping -------------------------------------------------------------------------------

EOS = 2


def _scheduler(k: int = 3, block_size: int = 4, max_batch: int = 8) -> Scheduler:
    pool = UnifiedPool(PoolConfig(64, 0, block_size, block_bytes=1, policy="lru-unified"))
    config = scheduler_config(
        8,
        100,
        256,
        speculative_ngram=k,
        ngram_min=1,
        ngram_max=3,
        speculative_max_batch=max_batch,
    )
    return Scheduler(config, pool)


def _prefill(sched: Scheduler, request: Request, first: int) -> None:
    sched.add(request)
    work = sched.schedule()
    assert work.items == [(request, request.num_prompt_tokens)] and not request.draft_token_ids
    sched.update(work, {request.request_id: [first]})


def test_drafts_are_scheduled_with_the_decode_and_rejected_ones_rolled_back():
    sched = _scheduler(k=3, block_size=4)
    r = Request("a", [10, 11, 12, 13, 14, 10, 11], SamplingParams(max_tokens=20), eos_token_ids=(EOS,))
    _prefill(sched, r, 12)  # tokens ... 10 11 12: the 3-gram [10, 11, 12] occurred at 0, followed by 13 14 10
    work = sched.schedule()
    assert work.items == [(r, 4)] and r.draft_token_ids == [13, 14, 10]
    assert len(r.block_table) == 3  # KV for 7 + 4 = 11 tokens: positions 7..10 (the last token and 3 drafts)
    sched.check_integrity()
    # verification kept one draft (13) and corrected the second (99): 14 and 10 were rejected
    advanced = sched.update(work, {"a": [13, 99]})
    assert advanced == [r] and r.output_token_ids == [12, 13, 99] and not r.draft_token_ids
    assert r.num_computed_tokens == 9  # the KV of 10 11 .. 12 13; 99 has none yet, the rejected drafts' is stale
    assert len(r.block_table) == 3  # 10 tokens need 3 blocks: nothing was taken only for rejected drafts
    sched.check_integrity()
    assert (sched.num_draft_tokens, sched.num_accepted_drafts) == (3, 1)


def test_blocks_taken_only_for_rejected_drafts_go_back():
    sched = _scheduler(k=3, block_size=4)
    r = Request("a", [1, 2, 3, 4, 5, 6, 1, 2], SamplingParams(max_tokens=20), eos_token_ids=(EOS,))
    _prefill(sched, r, 3)  # 9 tokens; [1, 2, 3] occurred at 0, followed by 4 5 6
    free_before = sched.pool.gpu.num_free
    work = sched.schedule()
    assert work.items == [(r, 4)] and r.draft_token_ids == [4, 5, 6]
    assert len(r.block_table) == 3 and sched.pool.gpu.num_free == free_before - 1  # positions 8..11
    sched.update(work, {"a": [77]})  # the first draft rejected
    assert r.num_computed_tokens == 9 and r.num_tokens == 10
    assert len(r.block_table) == 3  # 10 tokens: the third block holds the new token's KV next step, it stays
    sched.check_integrity()
    r2 = Request("b", [1, 2, 3, 4, 5, 6, 7, 1, 2, 3], SamplingParams(max_tokens=20), eos_token_ids=(EOS,))
    sched2 = _scheduler(k=3, block_size=4)
    _prefill(sched2, r2, 4)  # 11 tokens, 3 blocks; drafts 5 6 7 reach position 13: a fourth block
    free_before = sched2.pool.gpu.num_free
    work = sched2.schedule()
    assert r2.draft_token_ids == [5, 6, 7] and len(r2.block_table) == 4
    assert sched2.pool.gpu.num_free == free_before - 1
    sched2.update(work, {"b": [0]})  # all rejected: 12 tokens need 3 blocks, the fourth goes back
    assert len(r2.block_table) == 3 and sched2.pool.gpu.num_free == free_before
    assert r2.num_computed_tokens == 11
    sched2.check_integrity()


def test_stop_inside_accepted_drafts_drops_the_rest_and_max_tokens_caps_drafts():
    sched = _scheduler(k=3, block_size=4)
    r = Request("a", [5, 6, EOS, 8, 5], SamplingParams(max_tokens=20), eos_token_ids=(EOS,))
    _prefill(sched, r, 6)  # [5, 6] occurred at 0, followed by EOS 8 5
    work = sched.schedule()
    assert r.draft_token_ids == [EOS, 8, 5]
    sched.update(work, {"a": [EOS, 8, 5, 9]})  # all accepted, but EOS ends it: 8 5 9 are dropped
    assert r.finished and r.finish_reason is FinishReason.STOP and r.output_token_ids == [6, EOS]
    assert not sched.pool.held_blocks()
    sched.check_integrity()
    # max_tokens 3 leaves room for one draft after the first token: the step may not run past it
    r = Request("b", [5, 6, 7, 5], SamplingParams(max_tokens=3), eos_token_ids=(EOS,))
    _prefill(sched, r, 6)
    work = sched.schedule()
    assert work.items == [(r, 2)] and r.draft_token_ids == [7]
    sched.update(work, {"b": [7, 5]})
    assert r.finished and r.finish_reason is FinishReason.LENGTH and r.output_token_ids == [6, 7, 5]
    sched.check_integrity()


def test_no_drafts_while_the_batch_is_large():
    sched = _scheduler(k=3, max_batch=1)
    a = Request("a", [1, 2, 3, 1, 2], SamplingParams(max_tokens=20), eos_token_ids=(EOS,))
    b = Request("b", [4, 5, 6, 4, 5], SamplingParams(max_tokens=20), eos_token_ids=(EOS,))
    sched.add(a)
    sched.add(b)
    work = sched.schedule()
    sched.update(work, {"a": [3], "b": [6]})
    work = sched.schedule()  # two running, above speculative_max_batch 1: plain decodes
    assert work.items == [(a, 1), (b, 1)] and not a.draft_token_ids and not b.draft_token_ids
    sched.update(work, {"a": [EOS], "b": [4]})
    work = sched.schedule()  # one running again: b speculates
    assert work.items == [(b, 4)] and b.draft_token_ids == [5, 6, 4]


# ---- verification keeps the distribution -----------------------------------------------------------------------


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of counts against probs (cells with probability 0 must be empty)."""
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was drawn"
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


def _reference_probs(logits: torch.Tensor, output: list[int], temperature: float, top_k: int, presence: float):
    """The distribution one-by-one sampling draws from, by hand: presence penalty on the output so far, then
    temperature, then the top_k most likely tokens renormalised."""
    logits = logits.double().clone()
    for t in set(output):
        logits[t] -= presence
    logits = logits / temperature
    cut = logits.topk(top_k).values[-1]
    logits[logits < cut] = float("-inf")
    return logits.softmax(-1)


def test_verification_keeps_the_sampled_distribution():
    """A request with two drafts is verified in many independent trials: the first token is distributed as the
    first position's softmax, the second (after an accepted first draft) as the second position's under the
    output that now holds the draft (its presence penalty applies to it), and a draft is accepted with its
    probability. Drafts are chosen neither likely nor unlikely so that acceptance and rejection both happen."""
    torch.manual_seed(1234)
    vocab, trials = 7, 6000
    params = SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.7, max_tokens=8)
    prompt = [3, 5]
    request = Request("r", prompt, params)
    request.token_ids.append(6)  # one output token so far
    request.draft_token_ids = [1, 4]
    logits = torch.tensor([[1.0, 1.2, 0.4, 0.9, 0.3, -1.0, 0.8], [0.5, 1.5, 0.25, 0.1, 1.1, 0.7, 0.9], [0.0] * 7])
    rows = [request, DraftPosition.of(request, 1), DraftPosition.of(request, 2)] * trials
    result = Sampler(vocab)(logits.repeat(trials, 1), rows)
    kept = [verify_drafts(result.token_ids[3 * i : 3 * i + 3], [1, 4]) for i in range(trials)]

    p0 = _reference_probs(logits[0], [6], 0.8, 5, 0.7)
    p1 = _reference_probs(logits[1], [6, 1], 0.8, 5, 0.7)
    first = torch.bincount(torch.tensor([k[0] for k in kept]), minlength=vocab).double()
    after_accept = [k[1] for k in kept if k[0] == 1]
    second = torch.bincount(torch.tensor(after_accept), minlength=vocab).double()
    assert 0.15 < p0[1] < 0.5 and 0.15 < p1[4] < 0.6  # both branches are exercised
    assert _chi_square_p(first, p0) > 1e-3
    assert _chi_square_p(second, p1) > 1e-3
    # a rejected draft's position ends the list with the correction; an accepted one goes on
    assert all((len(k) == 1) == (k[0] != 1) for k in kept)
    assert abs(len(after_accept) / trials - float(p0[1])) < 4 * (0.25 / trials) ** 0.5


def test_greedy_verification_accepts_exactly_the_argmax_chain():
    request = Request("r", [3, 5], SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.5))
    request.draft_token_ids = [2, 0]
    logits = torch.tensor([[0.0, 1.0, 3.0, 0.5], [4.0, 3.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    rows = [request, DraftPosition.of(request, 1), DraftPosition.of(request, 2)]
    tokens = Sampler(4)(logits, rows).token_ids
    # row 0: argmax 2 = draft; row 1 sees 2 in its context: 2's logit is 0 (penalty keeps it 0), argmax 0 = draft;
    # row 2 sees 0 and 2: 3 (1.0) stays the argmax: the bonus token
    assert verify_drafts(tokens, [2, 0]) == [2, 0, 3]
    assert verify_drafts(tokens, [2, 1]) == [2, 0]  # the second draft is not the argmax: corrected to 0
    assert verify_drafts(tokens, [1, 0]) == [2]


# ---- the engine on the embedded model ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(engine_fp32):
    """The reference: the shared fp32 engine, without speculation, with the demo adapter "upper"."""
    if "upper" not in engine_fp32.adapters.names():
        engine_fp32.adapters.add("upper", demo_adapters()["upper"])
    return engine_fp32


@pytest.fixture(scope="module")
def spec():
    engine = Engine(
        EngineConfig(
            quantization="none",
            kv_cache_bytes=64 << 20,
            show_progress=False,
            speculative_ngram=5,
            speculative_max_batch=MAX_BATCH,
        )
    )
    engine.adapters.add("upper", demo_adapters()["upper"])
    return engine


@pytest.fixture(scope="module")
def copy_prompt(plain):
    return plain.chat_prompt([{"role": "user", "content": COPY}])


def _accepted(engine: Engine) -> tuple[int, int]:
    snap = engine.snapshot()
    return snap.spec_draft_tokens, snap.spec_accepted_tokens


@pytest.mark.slow
def test_greedy_copy_is_identical_and_mostly_accepted(plain, spec, copy_prompt):
    """The copying prompt with and without the adapter, in one batch: the same tokens as without speculation,
    and most drafts accepted (the model copies the text, then ends)."""
    params = SamplingParams(max_tokens=32, temperature=0)
    drafts0, accepted0 = _accepted(spec)
    got = spec.generate([copy_prompt, copy_prompt], params, adapters=[None, "upper"])
    drafts, accepted = _accepted(spec)
    want = plain.generate([copy_prompt, copy_prompt], params, adapters=[None, "upper"])
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert want[0].token_ids != want[1].token_ids  # the adapter changes the answer
    drafts, accepted = drafts - drafts0, accepted - accepted0
    assert drafts >= 10 and accepted >= 0.5 * drafts, (drafts, accepted)
    spec.check_integrity()
    assert spec.pool_report().request_blocks == 0


@pytest.mark.slow
def test_mixed_batch_matches_no_speculation(plain, spec, copy_prompt):
    """Five requests in one batch: greedy with and without the adapter, seeded sampling with penalties and
    logprobs (seeded draws depend on the output position only, so the tokens must be the same), a stop token id
    and a stop string (followed by a stop id) that land inside accepted drafts. Every output equals the engine's
    without speculation."""
    chat = plain.chat_prompt([{"role": "user", "content": CHAT_PROMPTS[1]}])
    reference = plain.generate([copy_prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    stop_token = reference.token_ids[14]  # a token the copy reaches mid-way (its first occurrence ends the run)
    stop_text = plain.tokenizer.decode(reference.token_ids[8:10])
    # a stop id just after the stop string: when one step keeps both, the string (earlier) must end the request
    after = next(t for t in reference.token_ids[10:] if t not in reference.token_ids[:10])
    prompts = [copy_prompt, copy_prompt, chat, copy_prompt, copy_prompt]
    params = [
        SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=24, temperature=0),
        SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, presence_penalty=0.5, seed=7, logprobs=2),
        SamplingParams(
            max_tokens=24, temperature=0.6, repetition_penalty=1.1, frequency_penalty=0.2, seed=11, logprobs=1
        ),
        SamplingParams(max_tokens=24, temperature=0, stop=[stop_text], stop_token_ids=[after]),
    ]
    adapters = [None, "upper", None, None, None]
    drafts0, _ = _accepted(spec)
    want = plain.generate(prompts, params, adapters=adapters)
    got = spec.generate(prompts, params, adapters=adapters)
    assert _accepted(spec)[0] > drafts0
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
            w.token_ids,
            w.text,
            w.finish_reason,
            w.stop_reason,
        )
        if w.logprobs is not None:
            assert g.logprobs is not None and len(g.logprobs) == len(w.logprobs)
            for a, b in zip(g.logprobs, w.logprobs, strict=True):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-3
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert got[0].stop_reason == stop_token and got[4].stop_reason == stop_text
    spec.check_integrity()
    assert spec.pool_report().request_blocks == 0


@pytest.mark.slow
def test_integrity_every_step_and_speculation_off_for_a_large_batch(spec, copy_prompt):
    """Stepping by hand: the pool's integrity holds after every step, no request holds a block beyond those its
    tokens need, and no drafts are scheduled while more than MAX_BATCH requests run."""
    short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    long = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    for i in range(MAX_BATCH + 1):
        params = short if i < 2 else long
        spec.add(spec.make_request(copy_prompt, params, "upper" if i == 3 else None, request_id=f"big-{i}"))
    scheduler, bs = scheduler_of(spec), spec.config.block_size
    drafted_while_large = drafted_while_small = 0
    while spec.has_work():
        running = len(scheduler.running)
        before = _accepted(spec)[0]
        spec.step()
        drafted = _accepted(spec)[0] - before
        if running > MAX_BATCH:
            drafted_while_large += drafted
        else:
            drafted_while_small += drafted
        spec.check_integrity()
        for r in scheduler.running:
            assert len(r.block_table) <= -(-r.num_tokens // bs) and r.num_uncomputed_tokens >= 1
    assert drafted_while_large == 0 and drafted_while_small > 0
    assert spec.pool_report().request_blocks == 0


@pytest.mark.slow
def test_tool_calls_are_the_same_with_speculation(plain, spec):
    """Tool calling under speculation, in one batch: a request whose model calls on its own (no grammar: it is
    speculated, its drafts found in the example call of its conversation) and a forced call (its grammar keeps it
    from being speculated) give the tokens they give without speculation, and the calls read back."""
    from tests.engine.test_tool_calling import ASK, AUTO_WEATHER, TOOLS, example_call, prepared, read

    auto_prompt, auto = prepared(plain, example_call("Paris", "Berlin"), [AUTO_WEATHER], "auto")
    forced_prompt, forced = prepared(plain, ASK, TOOLS, "required", parallel=False)
    params = [
        SamplingParams(max_tokens=48, temperature=0),
        SamplingParams(max_tokens=96, temperature=0, structured=forced.constraint),
    ]
    drafts0, accepted0 = _accepted(spec)
    got = spec.generate([auto_prompt, forced_prompt], params)
    drafts, accepted = _accepted(spec)
    want = plain.generate([auto_prompt, forced_prompt], params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert read(got[0].text, auto.mode)[1] == [("get_weather", '{"city": "Berlin"}')]
    assert len(read(got[1].text, forced.mode)[1]) == 1 and got[1].finish_reason == "stop"
    assert drafts > drafts0 and accepted > accepted0  # the auto request was speculated, and drafts were kept
    spec.check_integrity()
