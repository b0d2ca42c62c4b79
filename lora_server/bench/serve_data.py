"""What ``lora-server bench serve`` sends and when: conversations of random words, their adapters and tenants, and
their arrival times.

No tokenizer: prompts are made of common English words, each one token with its leading space for the Llama-family
BPE vocabularies (checked for SmolLM2: N words are N tokens), so a prompt of N words is about N tokens on any server
and exactly N on ours. The lengths the benchmark reports are the ones the server counts (its ``usage``), never
these targets."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

# each " word" is one token of SmolLM2's (GPT-2-style) BPE vocabulary
_WORD_TEXT = """time year people way day man thing woman life child world school state family student group
    country problem
    hand part place case week company system program question work government number night point home water room
    mother area money story fact month lot right study book eye job word business issue side kind head house service
    friend father power hour game line end member law car city community name president team minute idea kid body
    information back parent face others level office door health person art war history party result change morning
    reason research girl guy moment air teacher force education foot boy age policy music market sense nation plan
    college interest death experience effect use class control care field development role effort rate heart drug
    show leader light voice wife police mind price report decision son view relationship town road arm difference
    value building action model season society tax director position player record paper space ground form event
    official matter center couple site project activity star table need court oil situation cost industry figure
    street image phone data picture practice piece land product doctor wall patient worker news test movie north love
    support technology step baby computer type attention film tree source organization hair window evidence
    population truth song goal period staff army box skill bed page river sea sun moon rain snow stone fire wind bird
    fish dog cat horse cow apple bread milk tea wine green blue red black white small large big old new good great
    high long little young early late open hard easy simple clear full"""
WORDS = tuple(_WORD_TEXT.split())


def random_words(rng: random.Random, n: int) -> str:
    """n random words, each with its leading space (so each is one token)."""
    return "".join(" " + rng.choice(WORDS) for _ in range(n))


@dataclass(frozen=True)
class Conversation:
    """One arrival: ``len(user)`` turns sent one after another to ``adapter`` with the tenant key ``tenant`` (an
    index into the keys, or -1 for none). Turn k's messages are the system prompt (if any), the previous turns with
    the answers the server gave, and ``user[k]``; a one-turn conversation without a system prompt is the random
    dataset's single prompt."""

    adapter: str
    tenant: int
    system: str | None
    user: tuple[str, ...]  # [turns] each turn's new text
    words: tuple[int, ...]  # [turns] words in each user text (the target input length)
    max_tokens: tuple[int, ...]  # [turns] the output length asked for


@dataclass(frozen=True)
class TraceSpec:
    """The trace's shape (the flags of the same names)."""

    num_prompts: int  # conversations (one request each in the random dataset)
    input_len: int
    output_len: int
    range_ratio: float  # lengths uniform in [len * (1 - r), len * (1 + r)]
    prefix_len: int = 0  # words shared by every prompt (random dataset)
    turns: int = 1
    system_len: int = 0  # words of each adapter's system prompt (0: none)
    seed: int = 0


def sample_len(rng: random.Random, length: int, ratio: float) -> int:
    """A length uniform in [floor(length * (1 - ratio)), ceil(length * (1 + ratio))], at least 1."""
    low, high = math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))
    return max(1, rng.randint(low, high))


def zipf_weights(n: int, alpha: float) -> list[float]:
    """Zipf popularity of n items in their order: item i's weight 1 / (i + 1) ** alpha (not normalized)."""
    return [1.0 / (i + 1) ** alpha for i in range(n)]


def assign(rng: random.Random, n: int, names: list[str], how: str) -> list[str]:
    """n picks from names: uniformly at random ("random", vLLM's way), in turn ("round-robin"), or by Zipf
    popularity in the names' order ("zipf", or "zipf:ALPHA"; alpha 1.0 by default): names[i] with probability
    proportional to 1 / (i + 1) ** alpha."""
    if how == "round-robin":
        return [names[i % len(names)] for i in range(n)]
    kind, _, alpha = how.partition(":")
    if kind == "zipf":
        return rng.choices(names, weights=zipf_weights(len(names), float(alpha or 1.0)), k=n)
    return [rng.choice(names) for _ in range(n)]


def make_trace(spec: TraceSpec, adapters: list[str], assignment: str, num_tenants: int) -> list[Conversation]:
    """The conversations, all drawn from ``spec.seed``. ``adapters`` are the model names requests are spread over;
    tenants are taken in turn. Each adapter's system prompt is its own (drawn from the seed and its name), so
    conversations of one adapter share it as a prefix, and turn k + 1 extends turn k's messages."""
    rng = random.Random(spec.seed)
    prefix = random_words(rng, spec.prefix_len)
    picks = assign(rng, spec.num_prompts, adapters, assignment)
    systems = {
        name: random_words(random.Random(f"{spec.seed}:{name}"), spec.system_len) if spec.system_len else None
        for name in adapters
    }
    trace = []
    for i, adapter in enumerate(picks):
        words = tuple(sample_len(rng, spec.input_len, spec.range_ratio) for _ in range(spec.turns))
        user = tuple(prefix + random_words(rng, n) for n in words)
        outputs = tuple(sample_len(rng, spec.output_len, spec.range_ratio) for _ in range(spec.turns))
        tenant = i % num_tenants if num_tenants else -1
        trace.append(Conversation(adapter, tenant, systems[adapter], user, words, outputs))
    return trace


def prefix_repetition_trace(
    num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int, seed: int
) -> list[tuple[str, int]]:
    """vLLM's prefix_repetition dataset in words: ``num_prefixes`` random prefixes of ``prefix_len`` words, each
    followed by its own ``suffix_len`` random words in num_prompts // num_prefixes prompts, shuffled; (prompt,
    max_tokens) each."""
    if num_prefixes < 1 or num_prompts < num_prefixes:
        raise ValueError("--prefix-repetition-num-prefixes must be between 1 and --num-prompts")
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prefixes):
        prefix = random_words(rng, prefix_len)
        prompts += [prefix + random_words(rng, suffix_len) for _ in range(num_prompts // num_prefixes)]
    rng.shuffle(prompts)
    return [(p, output_len) for p in prompts]


def custom_trace(
    path: str, num_prompts: int, output_len: int, shuffle: bool, oversample: bool, seed: int
) -> list[tuple[str, int]]:
    """vLLM's custom dataset: the prompts of a JSONL file (one {"prompt": ...} a line), shuffled unless not
    ``shuffle``, the first ``num_prompts``; fewer are drawn again to fill up when ``oversample``; (prompt,
    max_tokens) each. ValueError for a line without a prompt."""
    prompts = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            entry = json.loads(line)
            if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
                raise ValueError(f'{path}:{number}: each line must be a JSON object with a "prompt" string')
            prompts.append(entry["prompt"])
    if not prompts:
        raise ValueError(f"{path} holds no prompt")
    rng = random.Random(seed)
    if shuffle:
        rng.shuffle(prompts)
    chosen = prompts[:num_prompts]
    if oversample and len(chosen) < num_prompts:
        chosen += rng.choices(prompts, k=num_prompts - len(chosen))
    return [(p, output_len) for p in chosen]


def single_turns(prompts: list[tuple[str, int]], adapters: list[str], assignment: str, num_tenants: int, seed: int):
    """Conversations of one turn from (prompt, max_tokens) pairs, adapters and tenants assigned as in make_trace."""
    picks = assign(random.Random(seed), len(prompts), adapters, assignment)
    return [
        Conversation(adapter, i % num_tenants if num_tenants else -1, None, (prompt,), (len(prompt.split()),), (out,))
        for i, ((prompt, out), adapter) in enumerate(zip(prompts, picks, strict=True))
    ]


def ramp_rates(n: int, strategy: str, start: float, end: float) -> list[float]:
    """vLLM's ramp-up: request i's rate, from ``start`` to ``end`` linearly or exponentially in i."""
    progress = [i / max(n - 1, 1) for i in range(n)]
    if strategy == "linear":
        return [start + (end - start) * x for x in progress]
    return [start * (end / start) ** x for x in progress]


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Start offsets (seconds) of n arrivals. ``rate`` inf: all at 0. Otherwise the gaps are gamma distributed with
    shape ``burstiness`` and mean 1 / rate (burstiness 1: a Poisson process; below 1 burstier, above 1 more even,
    inf: constant gaps), then scaled so the last arrival is at exactly n / rate, as vLLM does, so that runs with
    different seeds offer the same load."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    times = varying_arrival_times([rate] * n, burstiness, rng)
    scale = n / rate / times[-1] if times and times[-1] > 0 else 1.0
    return [x * scale for x in times]


def varying_arrival_times(rates: list[float], burstiness: float, rng: random.Random) -> list[float]:
    """Start offsets of arrivals whose gap before arrival i is gamma distributed with shape ``burstiness`` and mean
    1 / rates[i] (a ramp; not rescaled)."""
    times, t = [], 0.0
    for rate in rates:
        t += 1 / rate if math.isinf(burstiness) else rng.gammavariate(burstiness, 1 / (rate * burstiness))
        times.append(t)
    return times
