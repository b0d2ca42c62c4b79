"""lora_server.model.sampler.Sampler on tiny hand-made logits: greedy, the temperature/top-k/top-p/min-p masks (support
and empirical frequencies against hand-computed renormalised probabilities), repetition penalty, min_tokens,
seeded batch independence and logprobs."""

from __future__ import annotations

import math
from collections import Counter

import torch

from lora_server.engine.request import Request
from lora_server.model.sampler import Sampler, finite_rows
from lora_server.sampling_params import SamplingParams

V = 5
EOS = 4
PROBS = [0.5, 0.25, 0.15, 0.07, 0.03]  # a fixed distribution: logits = log(p)
LOG_PROBS = [math.log(p) for p in PROBS]


def req(params: SamplingParams, prompt=(0, 1), output=(), rid="r", eos=(EOS,)) -> Request:
    r = Request(rid, list(prompt), params, eos_token_ids=tuple(eos))
    r.token_ids.extend(output)
    return r


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for a chi-square variable with integer df (closed forms, no scipy)."""
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for i in range(1, df // 2):
            term *= (x / 2) / i
            total += term
        return math.exp(-x / 2) * total
    q = math.erfc(math.sqrt(x / 2))
    term, total = math.sqrt(2 * x / math.pi) * math.exp(-x / 2), 0.0
    for i in range(1, (df - 1) // 2 + 1):
        if i > 1:
            term *= x / (2 * i - 1)
        total += term
    return q + total


def test_chi2_sf_reference_values():
    # textbook critical values: P(X > 3.841; df 1) = P(X > 5.991; df 2) = P(X > 9.488; df 4) = 0.05
    assert abs(chi2_sf(3.841, 1) - 0.05) < 1e-3
    assert abs(chi2_sf(5.991, 2) - 0.05) < 1e-3
    assert abs(chi2_sf(7.815, 3) - 0.05) < 1e-3
    assert abs(chi2_sf(9.488, 4) - 0.05) < 1e-3


def assert_frequencies(tokens: list[int], expected: list[float]) -> None:
    """Pearson chi-square goodness of fit; tokens of probability 0 must never occur.

    A p-value threshold of 1e-4 makes a false alarm negligible (the draws are seeded, so the test is deterministic
    anyway) while a wrong renormalisation (e.g. keeping one extra token of probability >= 0.03) moves the
    statistic by hundreds at n = 20000 and fails it."""
    n = len(tokens)
    counts = Counter(tokens)
    support = [t for t, p in enumerate(expected) if p > 0]
    assert set(counts) <= set(support), f"sampled outside the allowed set: {sorted(set(counts) - set(support))}"
    stat = sum((counts.get(t, 0) - n * expected[t]) ** 2 / (n * expected[t]) for t in support)
    df = len(support) - 1
    if df:
        assert chi2_sf(stat, df) > 1e-4, f"chi2 {stat:.1f} (df {df}) counts {dict(counts)} expected {expected}"


def draw(
    logits_row: list[float], params: SamplingParams, n: int = 20000, seeded: bool = False, output=(), prompt=(0, 1)
) -> list[int]:
    """n draws from one distribution as one batch of n rows (unseeded rows use the global generator)."""
    torch.manual_seed(0)
    if seeded:
        # each row a request with its own seed
        requests = [req(SamplingParams(**{**_fields(params), "seed": s}), prompt, output, rid=str(s)) for s in range(n)]
    else:
        requests = [req(params, prompt, output, rid=str(i)) for i in range(n)]
    logits = torch.tensor([logits_row], dtype=torch.float32).expand(n, -1).contiguous()
    return Sampler(len(logits_row)).__call__(logits, requests).token_ids


def _fields(p: SamplingParams) -> dict:
    return {name: getattr(p, name) for name in p.__slots__}


# ---- greedy --------------------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    requests = [req(SamplingParams(temperature=0.0, top_k=3, top_p=0.5), rid=str(i)) for i in range(6)]
    out = Sampler(50)(logits, requests)
    expected = [max(range(50), key=lambda j, row=row: row[j]) for row in logits.tolist()]
    assert out.token_ids == expected
    assert out.logprobs is None and out.top_logprobs is None


def test_padded_vocab_columns_are_ignored():
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, 0.1, 100.0, 100.0]] * 2)
    requests = [req(SamplingParams(temperature=0.0), rid="g"), req(SamplingParams(seed=1), rid="s")]
    out = Sampler(V)(logits, requests)
    assert out.token_ids[0] == 2 and out.token_ids[1] < V
    torch.manual_seed(0)
    many = Sampler(V)(logits[:1].expand(2000, -1), [req(SamplingParams(), rid=str(i)) for i in range(2000)])
    assert max(many.token_ids) < V


# ---- temperature, top-k, top-p, min-p ------------------------------------------------------------------------


def test_temperature_one_samples_softmax():
    assert_frequencies(draw(LOG_PROBS, SamplingParams(temperature=1.0)), PROBS)


def test_temperature_scales_logits():
    logits = [1.0, 0.5, 0.0, -0.5, -1.0]
    expected = softmax([x / 0.7 for x in logits])
    assert_frequencies(draw(logits, SamplingParams(temperature=0.7)), expected)
    expected_hot = softmax([x / 3.0 for x in logits])
    assert_frequencies(draw(logits, SamplingParams(temperature=3.0)), expected_hot)


def test_top_k():
    # keep the 2 largest, renormalise: 0.5 / 0.75, 0.25 / 0.75
    assert_frequencies(draw(LOG_PROBS, SamplingParams(top_k=2)), [2 / 3, 1 / 3, 0, 0, 0])
    assert_frequencies(draw(LOG_PROBS, SamplingParams(top_k=1, seed=None), n=500), [1, 0, 0, 0, 0])
    # top_k -1 and 0 are both off
    assert_frequencies(draw(LOG_PROBS, SamplingParams(top_k=-1)), PROBS)
    assert_frequencies(draw(LOG_PROBS, SamplingParams(top_k=V)), PROBS)


def test_top_k_never_samples_outside_over_many_seeds():
    tokens = draw([0.1, 0.0, 0.3, 0.2, -0.1], SamplingParams(top_k=3), n=5000, seeded=True)
    assert set(tokens) == {0, 2, 3}


def test_top_p():
    # mass ranked above each token: 0, 0.5, 0.75, 0.9, 0.97 -> with top_p 0.8 tokens 0, 1, 2 stay
    assert_frequencies(draw(LOG_PROBS, SamplingParams(top_p=0.8)), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0, 0])
    # top_p 0.4: only the first (it always stays)
    assert set(draw(LOG_PROBS, SamplingParams(top_p=0.4), n=2000, seeded=True)) == {0}
    # top_p 0.95: 0.97 of mass above token 4 -> it goes, the rest stay
    assert_frequencies(draw(LOG_PROBS, SamplingParams(top_p=0.95)), [p / 0.97 for p in PROBS[:4]] + [0])


def test_top_p_order_does_not_follow_token_ids():
    logits = [LOG_PROBS[3], LOG_PROBS[0], LOG_PROBS[4], LOG_PROBS[2], LOG_PROBS[1]]  # shuffled
    expected = [0, 0.5 / 0.9, 0, 0.15 / 0.9, 0.25 / 0.9]
    assert_frequencies(draw(logits, SamplingParams(top_p=0.8)), expected)


def test_top_k_then_top_p_on_the_renormalised_distribution():
    # top_k 3 -> [0.5, 0.25, 0.15] / 0.9 = [0.556, 0.278, 0.167]; mass above token 2 is 0.833 >= 0.8 -> dropped
    assert_frequencies(draw(LOG_PROBS, SamplingParams(top_k=3, top_p=0.8)), [2 / 3, 1 / 3, 0, 0, 0])


def test_min_p():
    # threshold 0.2 * 0.5 = 0.1 keeps 0.5, 0.25, 0.15
    assert_frequencies(draw(LOG_PROBS, SamplingParams(min_p=0.2)), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0, 0])
    # threshold 0.05 keeps 0.07 as well
    assert_frequencies(draw(LOG_PROBS, SamplingParams(min_p=0.1)), [p / 0.97 for p in PROBS[:4]] + [0])


def test_min_p_applies_to_the_tempered_distribution():
    # T = 0.5 squares the probabilities: ratios to the top are 1, 0.25, 0.09, 0.0196, 0.0036 -> min_p 0.05 keeps 3
    sq = [p * p for p in PROBS[:3]]
    expected = [v / sum(sq) for v in sq] + [0, 0]
    assert_frequencies(draw(LOG_PROBS, SamplingParams(temperature=0.5, min_p=0.05)), expected)


def test_masks_never_sample_outside_over_many_seeds():
    for params, allowed in (
        (SamplingParams(top_k=2, temperature=2.0), {0, 1}),
        # T 1.5: p ** (1 / 1.5) renormalised = [0.400, 0.252, 0.179, ...]: 0.652 ranks above 2
        (SamplingParams(top_p=0.6, temperature=1.5), {0, 1}),
        (SamplingParams(min_p=0.4, temperature=1.0), {0, 1}),
    ):
        tokens = draw(LOG_PROBS, params, n=3000, seeded=True)
        assert set(tokens) == allowed, params


# ---- repetition penalty -----------------------------------------------------------------------------------------


def test_repetition_penalty_distribution():
    logits = [1.0, -1.0, 0.5, -0.5, 0.2]
    # prompt [0, 1], output [3, 0]: tokens 0, 1, 3 are penalised once each (positive / 2, negative * 2)
    penalised = [0.5, -2.0, 0.5, -1.0, 0.2]
    tokens = draw(logits, SamplingParams(repetition_penalty=2.0), output=(3, 0))
    assert_frequencies(tokens, softmax(penalised))


def test_repetition_penalty_greedy_probes():
    s = Sampler(V)
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # positive logit divided: 3.0 -> 1.5 loses to 2.0
    assert s(torch.tensor([[3.0, 2.0, 0.0, 0.0, 0.0]]), [req(p, prompt=[0])]).token_ids == [0 + 1]
    # negative logit multiplied: -1.0 -> -2.0 loses to -1.5 (dividing would give -0.5 and win)
    assert s(torch.tensor([[-1.0, -1.5, -9.0, -9.0, -9.0]]), [req(p, prompt=[0])]).token_ids == [1]
    # output tokens count as well as the prompt
    assert s(torch.tensor([[0.0, 0.0, 3.0, 2.0, 0.0]]), [req(p, prompt=[0], output=[2])]).token_ids == [3]
    # a token seen three times is penalised once: 3.0 -> 1.5 still beats 1.4 (3 / 8 would not)
    assert s(torch.tensor([[3.0, 1.4, 0.0, 0.0, 0.0]]), [req(p, prompt=[0, 0], output=[0])]).token_ids == [0]
    # unseen tokens are untouched: 3.0 on an unseen token stays the argmax against a seen 4.0 -> 2.0
    assert s(torch.tensor([[4.0, 3.0, 0.0, 0.0, 0.0]]), [req(p, prompt=[0])]).token_ids == [1]
    # a penalty below 1 rewards repetition: 1.0 / 0.5 = 2.0 beats 1.9
    p_low = SamplingParams(temperature=0.0, repetition_penalty=0.5)
    assert s(torch.tensor([[1.0, 1.9, 0.0, 0.0, 0.0]]), [req(p_low, prompt=[0])]).token_ids == [0]
    # only the penalised row changes in a batch
    out = s(
        torch.tensor([[3.0, 2.0, 0.0, 0.0, 0.0]] * 2),
        [req(p, prompt=[0], rid="a"), req(SamplingParams(temperature=0.0), prompt=[0], rid="b")],
    )
    assert out.token_ids == [1, 0]


# ---- min_tokens -----------------------------------------------------------------------------------------------


def test_min_tokens_bans_eos_and_stop_tokens_greedy():
    s = Sampler(V)
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3], max_tokens=8)
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 10.0]])  # EOS (4) then the stop token (3) are the favourites
    assert s(logits, [req(p, output=[])]).token_ids == [2]
    assert s(logits, [req(p, output=[2])]).token_ids == [2]
    assert s(logits, [req(p, output=[2, 2])]).token_ids == [EOS]  # 2 outputs: allowed again
    # several EOS ids are all banned
    logits2 = torch.tensor([[0.0, 8.0, 2.0, 9.0, 10.0]])
    assert s(logits2, [req(p, output=[], eos=(4, 1))]).token_ids == [2]
    # without min_tokens nothing is banned
    assert s(logits, [req(SamplingParams(temperature=0.0, stop_token_ids=[3]))]).token_ids == [EOS]
    # ignore_eos: EOS is not a stop, so it is not banned; the stop token still is
    p_ignore = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[EOS - 1], ignore_eos=True)
    assert s(logits, [req(p_ignore)]).token_ids == [EOS]
    assert s(torch.tensor([[0.0, 1.0, 2.0, 10.0, 9.0]]), [req(p_ignore)]).token_ids == [EOS]


def test_min_tokens_bans_when_sampling():
    logits = [0.0, 0.0, 0.0, 3.0, 3.0]
    params = SamplingParams(min_tokens=3, stop_token_ids=[3], max_tokens=5)
    tokens = draw(logits, params, n=3000, seeded=True, output=(0,))
    assert set(tokens) == {0, 1, 2}
    tokens = draw(logits, params, n=20000, output=(0, 1, 2))
    assert_frequencies(tokens, softmax(logits))


# ---- seeds ------------------------------------------------------------------------------------------------------


def test_seeded_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    vocab = 64
    rows = torch.randn(4, vocab, generator=g)
    target = SamplingParams(seed=1234, temperature=0.9)
    others = [SamplingParams(temperature=0.0), SamplingParams(top_k=5, top_p=0.9), SamplingParams(min_p=0.1, seed=7)]
    sampler = Sampler(vocab)

    def run(order: list[int], output=(5, 6)) -> int:
        params = [target, *others]
        reqs = [req(params[i], output=output, rid=str(i)) for i in order]
        torch.manual_seed(len(order) * 31 + order[0])  # the global generator differs each call
        out = sampler(rows[order], reqs).token_ids
        return out[order.index(0)]

    alone = run([0])
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1], [1, 0]):
        assert run(order) == alone
    # at a later output position the draw is new but again independent of the batch
    later = [run(order, output=(5, 6, 7)) for order in ([0], [0, 1, 2, 3], [3, 0, 1])]
    assert len(set(later)) == 1


def test_seeded_draws_vary_with_position_and_seed():
    logits = torch.zeros(1, 16)
    sampler = Sampler(16)
    by_position = [sampler(logits, [req(SamplingParams(seed=5), output=[0] * k)]).token_ids[0] for k in range(40)]
    assert len(set(by_position)) > 5  # uniform over 16: 40 positions all equal would be a stuck generator
    by_seed = [sampler(logits, [req(SamplingParams(seed=s))]).token_ids[0] for s in range(40)]
    assert len(set(by_seed)) > 5
    again = [sampler(logits, [req(SamplingParams(seed=s))]).token_ids[0] for s in range(40)]
    assert again == by_seed


def test_seeded_draws_follow_the_distribution():
    assert_frequencies(draw(LOG_PROBS, SamplingParams(), seeded=True), PROBS)


# ---- logprobs ---------------------------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_raw_logits():
    raw = [[2.0, 1.0, 0.5, -1.0, 0.0], [0.3, 0.2, 0.1, 3.0, -2.0], [1.0, 1.5, -0.5, 0.0, 2.5]]
    # penalties, temperature and min_tokens change the choice, never the reported logprobs
    reqs = [
        req(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=3.0), prompt=[0], rid="a"),
        req(SamplingParams(temperature=0.5, top_k=2, logprobs=0, seed=1), rid="b"),
        req(SamplingParams(temperature=0.0, logprobs=5, min_tokens=1, max_tokens=4), prompt=[2], rid="c"),
    ]
    out = Sampler(V)(torch.tensor(raw), reqs)
    lse = [math.log(sum(math.exp(x) for x in row)) for row in raw]
    expected_lp = [[x - lse[i] for x in row] for i, row in enumerate(raw)]
    # row a: token 0 penalised to 2/3 -> argmax is token 1; row c: EOS (4) banned -> argmax is token 1
    assert out.token_ids[0] == 1 and out.token_ids[2] == 1
    assert out.token_ids[1] in (3, 0)  # top_k 2 of row b
    for i, t in enumerate(out.token_ids):
        assert abs(out.logprobs[i] - expected_lp[i][t]) < 1e-5
    tops = out.top_logprobs
    assert [len(t) for t in tops] == [3, 0, 5]
    for i, top in enumerate(tops):
        order = sorted(range(V), key=lambda j, i=i: -expected_lp[i][j])[: len(top)]
        assert [tid for tid, _ in top] == order
        vals = [v for _, v in top]
        assert vals == sorted(vals, reverse=True)
        for tid, v in top:
            assert abs(v - expected_lp[i][tid]) < 1e-5


def test_logprobs_only_when_asked():
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]] * 2)
    s = Sampler(V)
    assert s(logits, [req(SamplingParams(temperature=0.0), rid=str(i)) for i in range(2)]).logprobs is None
    out = s(
        logits,
        [req(SamplingParams(temperature=0.0), rid="a"), req(SamplingParams(temperature=0.0, logprobs=2), rid="b")],
    )
    assert out.top_logprobs[0] == []
    lse = math.log(math.exp(1.0) + 4)
    (first_id, first_lp), (_, second_lp) = out.top_logprobs[1]  # the second place is a four-way tie
    assert first_id == 1 and abs(first_lp - (1.0 - lse)) < 1e-6 and abs(second_lp - (0.0 - lse)) < 1e-6
    assert abs(out.logprobs[1] - (1.0 - lse)) < 1e-6


def test_logprobs_over_padded_vocab_use_the_real_vocab():
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, 0.1, 50.0]])
    out = Sampler(V)(logits, [req(SamplingParams(temperature=0.0, logprobs=1))])
    lse = math.log(sum(math.exp(x) for x in [0.0, 1.0, 2.0, 0.5, 0.1]))
    assert out.token_ids == [2]
    assert abs(out.logprobs[0] - (2.0 - lse)) < 1e-5
    assert out.top_logprobs[0][0][0] == 2


# ---- frequency and presence penalties, logit_bias (vectorized: one scatter of additive terms) ----------------


def test_frequency_presence_and_bias_greedy_probes():
    s = Sampler(V)
    logits = torch.tensor([[2.0, 1.9, 1.0, 0.0, -5.0]])
    # output [0, 0]: token 0 loses 2 * 0.5 + 0.3 = 1.3 -> 0.7 < 1.9
    p = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3)
    assert s(logits, [req(p, output=[0, 0])]).token_ids == [1]
    # output [0]: 2.0 - 0.8 = 1.2 < 1.9; prompt tokens are not penalised (prompt [1]: token 1 keeps 1.9)
    assert s(logits, [req(p, prompt=[1], output=[0])]).token_ids == [1]
    # logit_bias on top of the penalties: token 2 gets +1.5 -> 2.5 beats 2.0; token 0 also biased +0.4 -> 2.4
    pb = SamplingParams(temperature=0.0, logit_bias={2: 1.5, 0: 0.4, 99: 100.0})  # 99 is outside the vocab
    assert s(logits, [req(pb)]).token_ids == [2]
    # penalty and bias on the same token add up: 2.0 - 1.3 + 1.0 = 1.7 < 1.9
    pc = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3, logit_bias={0: 1.0})
    assert s(logits, [req(pc, output=[0, 0])]).token_ids == [1]
    # a batch with one penalised row leaves the other rows' logits alone
    out = s(logits.expand(2, -1), [req(p, output=[0, 0], rid="a"), req(SamplingParams(temperature=0.0), rid="b")])
    assert out.token_ids == [1, 0]


def test_allowed_token_ids_sample_the_renormalised_subset():
    """Only the allowed tokens are drawn, in proportion to their probabilities among themselves; greedy takes the
    likeliest of them (end-of-sequence included only when listed)."""
    assert_frequencies(draw(LOG_PROBS, SamplingParams(allowed_token_ids=(1, 3))), [0, 0.25 / 0.32, 0, 0.07 / 0.32, 0])
    logits = torch.tensor([LOG_PROBS] * 3)
    requests = [
        req(SamplingParams(temperature=0.0, allowed_token_ids=(2, 3)), rid="a"),
        req(SamplingParams(temperature=0.0), rid="b"),  # unrestricted beside a restricted row
        req(SamplingParams(temperature=0.0, allowed_token_ids=(EOS, 99)), rid="c"),  # 99 is outside the vocab
    ]
    assert Sampler(V)(logits, requests).token_ids == [2, 0, EOS]


def test_bad_words_ban_the_token_that_would_complete_one():
    """A one-token word is never drawn; a longer one's last token only right after the rest of it."""
    s = Sampler(V)
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    p = SamplingParams(temperature=0.0, bad_words=((0,), (2, 1)))
    assert s(logits, [req(p, output=[])]).token_ids == [1]  # 0 banned, 1 allowed: the output does not end in 2
    assert s(logits, [req(p, output=[3, 2])]).token_ids == [2]  # after 2, both 0 and 1 are banned
    assert s(logits, [req(p, prompt=[2], output=[])]).token_ids == [1]  # the prompt does not count, as in vLLM
    tokens = draw([0.0] * V, SamplingParams(bad_words=((0,), (4, 3))), n=4000, output=(4,))
    assert_frequencies(tokens, [0, 1 / 3, 1 / 3, 0, 1 / 3])


def test_mixed_batch_keeps_each_rows_semantics():
    # greedy, penalised greedy, banned-by-min_tokens sampled, and a top_k 1 sampled row in one batch
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0, 9.0]] * 4)
    requests = [
        req(SamplingParams(temperature=0.0), rid="g"),
        req(SamplingParams(temperature=0.0, repetition_penalty=4.0), prompt=[4], rid="r"),  # 9 / 4 = 2.25 < 5
        req(SamplingParams(temperature=0.5, top_k=1, min_tokens=3), rid="m"),  # EOS (4) banned -> token 2
        req(SamplingParams(top_k=1, seed=11), rid="k"),
    ]
    assert Sampler(V)(logits, requests).token_ids == [4, 2, 2, 4]


def test_finite_rows_in_both_layouts():
    """A row is finite iff each of its values is: NaN, +inf, -inf and +inf with -inf are caught; a row of values
    whose float32 sum would overflow (3e38 each) is still finite. Row-major and the column-major layout a CPU
    matmul writes give the same answer."""
    big = 3e38
    rows = [
        [0.0, 1.0, -2.0, 5.0],
        [0.0, math.nan, 1.0, 2.0],
        [math.inf, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, -math.inf],
        [math.inf, -math.inf, 0.0, 0.0],
        [big, big, big, big],
        [-big, -big, -big, -big],
    ]
    expected = [True, False, False, False, False, True, True]
    row_major = torch.tensor(rows, dtype=torch.float32)
    column_major = row_major.t().contiguous().t()
    assert column_major.stride(-1) != 1
    for logits in (row_major, column_major):
        assert finite_rows(logits).tolist() == expected
