"""Completions echo and prompt logprobs through the openai client against a real server (fp32, as the reference):
the summed logprob of a continuation (echo, max_tokens 0, logprobs: what lm-evaluation-harness sends for
loglikelihood) equals HF transformers' + PEFT's log-softmax over the same tokens within 1e-3, for the base model and
two adapters; lm-eval-style multiple-choice scoring picks HF's likeliest choice on every item; echo with generation,
n and several prompts, streaming, vLLM's prompt_logprobs on both endpoints and the refusals."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.conftest import peft_log_softmax
from tests.servers import BASE, Server

pytestmark = pytest.mark.slow
ADAPTERS = ("qv-r4", "all-r8-rslora")
# (context, continuation): a loglikelihood request each
PAIRS = [
    ("The capital of France is", " Paris, a city on the Seine."),
    ("Water boils at", " one hundred degrees Celsius at sea level."),
    ("def add(a, b):\n    return", " a + b\n"),
]
# multiple choice, lm-eval style: the context, then each choice's summed logprob
ITEMS = [
    ("Question: What is the capital of France?\nAnswer:", [" Paris", " Berlin", " Rome", " Madrid"]),
    ("Question: How many legs does a spider have?\nAnswer:", [" eight", " six", " four", " ten"]),
    ("Question: What color is the sky on a clear day?\nAnswer:", [" blue", " green", " red", " purple"]),
    ("Question: Which animal says moo?\nAnswer:", [" a cow", " a cat", " a dog", " a duck"]),
    ("Question: What is 2 + 2?\nAnswer:", [" 4", " 5", " 22", " 3"]),
    ("Question: What do bees make?\nAnswer:", [" honey", " milk", " silk", " bread"]),
    ("Question: Which planet do we live on?\nAnswer:", [" Earth", " Mars", " Venus", " Jupiter"]),
    ("Question: What is frozen water called?\nAnswer:", [" ice", " steam", " sand", " glass"]),
]
TOL = 1e-3


@pytest.fixture(scope="module")
def server(tmp_path_factory, peft_dirs):
    data = tmp_path_factory.mktemp("echo")
    flags = ["--allow-anonymous", *[a for name in ADAPTERS for a in ("--adapter", f"{name}={peft_dirs / name}")]]
    s = Server(data, [peft_dirs], flags)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenize(hf_smollm2):
    """The server's own token ids of a text (its /tokenize), which the test then scores."""
    del hf_smollm2  # loaded once for the whole module's references

    def ids(server: Server, text: str) -> list[int]:
        r = httpx.post(server.url + "/tokenize", json={"model": BASE, "prompt": text}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    return ids


def _reference(peft_model, adapter: str | None, ids: list[int]) -> torch.Tensor:
    """[len] HF + PEFT's log-probability of each token given the ones before it (the first: 0)."""
    logprobs = peft_log_softmax(peft_model, adapter, ids)
    return torch.cat([torch.zeros(1), logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]])


def _score(client: openai.OpenAI, model: str, prompts: list[list[int]]):
    """lm-eval's loglikelihood request: the tokens as the prompt, echo, no new token, the token's logprob."""
    return client.completions.create(model=model, prompt=prompts, echo=True, max_tokens=0, logprobs=1, temperature=0)


@pytest.mark.parametrize("model", [BASE, *ADAPTERS])
def test_continuation_logprob_equals_hf_and_peft(server, tokenize, peft_model, model):
    adapter = None if model == BASE else model
    client = server.client()
    for context, continuation in PAIRS:
        ctx, cont = tokenize(server, context), tokenize(server, continuation)
        ids = ctx + cont
        reply = _score(client, model, [ids])
        (choice,) = reply.choices
        lp = choice.logprobs
        assert choice.finish_reason == "length" and reply.usage.completion_tokens == 0
        assert reply.usage.prompt_tokens == len(ids) and len(lp.tokens) == len(ids)
        assert choice.text == context + continuation  # the prompt, as the model's text
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
        ours = sum(lp.token_logprobs[len(ctx) :])
        ref = _reference(peft_model, adapter, ids)
        assert abs(ours - ref[len(ctx) :].sum().item()) <= TOL, (model, context)
        # each token's own entry too, and its top_logprobs holds it (and the top 1)
        for i in range(1, len(ids)):
            assert abs(lp.token_logprobs[i] - ref[i].item()) <= TOL
            assert lp.tokens[i] in lp.top_logprobs[i] and 1 <= len(lp.top_logprobs[i]) <= 2


def test_multiple_choice_agrees_with_hf_on_every_item(server, tokenize, peft_model):
    client = server.client()
    for model in (BASE, ADAPTERS[0]):
        adapter = None if model == BASE else model
        for context, choices in ITEMS:
            ctx = tokenize(server, context)
            conts = [tokenize(server, c) for c in choices]
            reply = _score(client, model, [ctx + c for c in conts])  # every choice in one batch request
            ours = [sum(ch.logprobs.token_logprobs[len(ctx) :]) for ch in sorted(reply.choices, key=lambda c: c.index)]
            refs = [_reference(peft_model, adapter, ctx + c)[len(ctx) :].sum().item() for c in conts]
            ranked = sorted(refs, reverse=True)
            assert ranked[0] - ranked[1] > 10 * TOL, (model, context, refs)  # a clear answer: agreement means something
            assert ours.index(max(ours)) == refs.index(max(refs)), (model, context, ours, refs)


def test_echo_with_generation_n_and_two_prompts(server, tokenize, peft_model):
    prompts = ["Once upon a time", "The best way to learn is"]
    reply = server.client().completions.create(
        model=ADAPTERS[1], prompt=prompts, echo=True, max_tokens=3, logprobs=2, n=2, temperature=0, seed=1
    )
    assert len(reply.choices) == 4 and reply.usage.completion_tokens == 12
    for choice in reply.choices:
        prompt = prompts[choice.index // 2]
        ids = tokenize(server, prompt)
        lp = choice.logprobs
        assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + 3
        assert "".join(lp.tokens) == choice.text  # byte-level BPE: each token's text adds up to the text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        assert lp.token_logprobs[0] is None and all(len(top) <= 3 for top in lp.top_logprobs[1:])
        generated = tokenize(server, choice.text[len(prompt) :])
        ref = _reference(peft_model, ADAPTERS[1], ids + generated)
        if len(generated) == 3:  # the generated text tokenizes back to its tokens (almost always)
            for i in range(1, len(ids) + 3):
                assert abs(lp.token_logprobs[i] - ref[i].item()) <= TOL
        assert [e for e in choice.prompt_logprobs[1:] if e] and choice.prompt_logprobs[0] is None  # vLLM's too


def test_streamed_echo_carries_the_prompt_first(server):
    prompt = "A short poem about rain:"
    client = server.client()
    plain = client.completions.create(model=BASE, prompt=prompt, echo=True, max_tokens=4, logprobs=1, temperature=0)
    chunks = list(
        client.completions.create(
            model=BASE, prompt=prompt, echo=True, max_tokens=4, logprobs=1, temperature=0, stream=True
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0].startswith(prompt) and "".join(texts) == plain.choices[0].text
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == plain.choices[0].logprobs.tokens and offsets == plain.choices[0].logprobs.text_offset


def test_vllm_prompt_logprobs_on_both_endpoints(server, tokenize, peft_model):
    ids = tokenize(server, "Rain falls on the green hills.")
    raw = httpx.post(
        server.url + "/v1/completions",
        json={"model": BASE, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0},
        timeout=60,
    ).json()
    ref = _reference(peft_model, None, ids)
    (choice,) = raw["choices"]
    assert choice["logprobs"] is None and choice["prompt_logprobs"][0] is None
    for i, entry in enumerate(choice["prompt_logprobs"][1:], start=1):
        assert str(ids[i]) in entry and len(entry) <= 3  # the token itself and the top 2
        assert abs(entry[str(ids[i])]["logprob"] - ref[i].item()) <= TOL
        assert {1, 2} <= {e["rank"] for e in entry.values()}  # the top 2 by rank, beside the token itself
        assert all(set(e) == {"logprob", "rank", "decoded_token"} for e in entry.values())
    messages = [{"role": "user", "content": "Hi there!"}]
    chat = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": ADAPTERS[0], "messages": messages, "max_tokens": 1, "prompt_logprobs": 0, "n": 2},
        timeout=60,
    ).json()
    chat_ids = httpx.post(server.url + "/tokenize", json={"model": ADAPTERS[0], "messages": messages}).json()["tokens"]
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] == len(chat_ids)
    chat_ref = _reference(peft_model, ADAPTERS[0], chat_ids)
    for i, entry in enumerate(chat["prompt_logprobs"][1:], start=1):
        assert abs(entry[str(chat_ids[i])]["logprob"] - chat_ref[i].item()) <= TOL


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),  # no echo: nothing to answer
        ({"prompt": "Hi", "max_tokens": 2, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "Hi", "max_tokens": 2, "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "Hi", "max_tokens": 2, "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "Hi", "echo": True, "max_tokens": 0, "logprobs": 99}, "logprobs"),
    ],
)
def test_refusals(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"model": BASE, **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
