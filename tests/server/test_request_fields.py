"""The request-field audit: every row of lora_server.server.request_fields' table (docs/http-api.md's "Request
fields", checked equal here) is sent through the openai client to a real server. Honoured fields are checked for
their effect against hand-computed expectations (the chat template's text written out by hand and tokenized, greedy
equivalents of sampling cut-offs, counts), no-effect fields for an answer identical to the one without them,
refused fields for a 400 naming them (and a 200 for the values that ask for nothing). Message fields and content
types likewise, on SmolLM2's template (which writes role and content only) and on one that writes names,
reasoning, documents and template variables."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from lora_server.server.request_fields import CHAT, COMPLETIONS, FIELDS, RequestField
from tests.servers import BASE, Server

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parents[2] / "docs" / "http-api.md"
SYSTEM = {"role": "system", "content": "You are terse."}
ASK = {"role": "user", "content": "Name three colours."}
SYSTEM_T, ASK_T = ("system", SYSTEM["content"]), ("user", ASK["content"])
GREEDY = {"temperature": 0, "max_tokens": 8}
PROMPT = "The three primary colours are"
# A template that writes names, reasoning, documents and the variables reasoning_effort and enable_thinking.
RICH_TEMPLATE = (  # newlines as expressions: templates render with trim_blocks, as in transformers
    "{% for m in messages %}<|im_start|>{{ m['role'] }}{% if m['name'] is defined %} ({{ m['name'] }}){% endif %}"
    "{{ '\\n' + m['content'] }}{% if m['reasoning_content'] is defined %} [{{ m['reasoning_content'] }}]{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if documents %}{% for d in documents %}"
    "{{ '<doc>' + d['text'] + '</doc>\\n' }}{% endfor %}{% endif %}"
    "{% if reasoning_effort is defined %}{{ 'effort: ' + reasoning_effort + '\\n' }}{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ 'no thinking\\n' }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("fields")
    s = Server(data, [data], ["--allow-anonymous", "--adapter", "upper"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def rich(tmp_path_factory, smollm2_path):
    """A server whose chat template writes more than role and content, on a model whose tokenizer adds BOS: a
    random tiny Llama in HF's format with SmolLM2's tokenizer (its outputs mean nothing; its prompts are exact)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lora_server.engine.tokenizer import Tokenizer

    data = tmp_path_factory.mktemp("fields-rich")
    model_dir = data / "rich-llama"
    tokenizer = Tokenizer.from_gguf(smollm2_path).with_chat_template(RICH_TEMPLATE)
    tokenizer.add_bos = True
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=tokenizer.vocab_size, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir, model_max_length=2048)
    s = Server(data, [data], ["--allow-anonymous", "--model", str(model_dir)])
    s.model_id = "rich-llama"
    yield s
    s.stop()


def model_of(server: Server) -> str:
    return getattr(server, "model_id", BASE)


def ids(server: Server, text: str, special: bool = False) -> list[int]:
    """The server's token ids of a text, special-token markers included (BOS first only with ``special``)."""
    body = {"model": model_of(server), "prompt": text, "add_special_tokens": special}
    r = httpx.post(server.url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def chat(server: Server, **body):
    extra = {k: body.pop(k) for k in list(body) if k not in ("model", "messages", "stream")}
    return server.client().chat.completions.create(
        model=body.pop("model", model_of(server)),
        messages=body.pop("messages", [SYSTEM, ASK]),
        extra_body=extra,
        **body,
    )


def complete(server: Server, **body):
    extra = {k: body.pop(k) for k in list(body) if k not in ("model", "prompt", "stream")}
    return server.client().completions.create(
        model=body.pop("model", model_of(server)), prompt=body.pop("prompt", PROMPT), extra_body=extra, **body
    )


def send(server: Server, endpoint: str, **body):
    return (chat if endpoint == CHAT else complete)(server, **body)


_PLAIN: dict[tuple[str, int, str], object] = {}


def plain_answer(server: Server, endpoint: str):
    """The answer to the plain greedy request (GREEDY alone) on an endpoint, asked once per server: greedy answers
    are the same each time, and the comparisons below need it often."""
    key = (server.url, server.proc.pid, endpoint)
    if key not in _PLAIN:
        _PLAIN[key] = send(server, endpoint, **GREEDY)
    return _PLAIN[key]


def text_of(reply) -> str:
    choice = reply.choices[0]
    return choice.message.content if hasattr(choice, "message") else choice.text


def chatml(*messages: tuple[str, str], generation: bool = True) -> str:
    """SmolLM2's template written out by hand (a system message first, so no default one)."""
    out = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return out + ("<|im_start|>assistant\n" if generation else "")


def refused(call: Callable[[], object], param: str, words: str = "") -> None:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    error = info.value.body
    assert error["param"] == param, error
    assert words.lower() in error["message"].lower(), error


# ---- the table -----------------------------------------------------------------------------------------------


def readme_rows(heading: str) -> list[list[str]]:
    """The rows of the first table under ``heading`` in docs/http-api.md, cells stripped of backticks."""
    text = README.read_text()
    section = text[text.index(heading) :]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("|") and not set(line) <= set("|- "):
            rows.append([c.strip().replace("`", "") for c in line.strip("|").split("|")])
    return rows[1:]  # the header


def test_readme_table_is_the_code_table():
    rows = readme_rows("### Request fields")
    want = [[f.name, ", ".join(f.endpoints), f.status, f.note] for f in FIELDS]
    assert rows == want


def test_every_row_has_a_case():
    """Adding a field to the table without a case here fails."""
    covered = set(HONOURED) | set(REFUSED_VALUES) | set(NO_EFFECT_VALUES)
    assert {f.name for f in FIELDS} == covered


# ---- refused and no effect: generic ---------------------------------------------------------------------------

REFUSED_VALUES = {
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "Red, green, blue."},
    "web_search_options": {},
    "verbosity": "low",
    "store": True,
    "service_tier": "flex",
    "suffix": " and that is all.",
    "best_of": 3,
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": r"[\n ]*",
    "stream_options.continuous_usage_stats": True,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "spaces_between_special_tokens": False,
    "logits_processors": ["my.module:Processor"],
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "chat_template": "{{ messages[0]['content'] }}",
    "mm_processor_kwargs": {"num_crops": 4},
    "prompt_embeds": "AAAA",
    "kv_transfer_params": {"do_remote_decode": True},
    "vllm_xargs": {"x": 1},
}
NO_EFFECT_VALUES = {
    "user": "user-1234",
    "safety_identifier": "hashed-user",
    "metadata": {"team": "search"},
    "prompt_cache_key": "conversation-7",
    "prompt_cache_retention": "24h",
    "stream_options.include_obfuscation": True,
    "response_format.json_schema.strict": True,
}


def _body(field: RequestField, value: object) -> dict:
    """The request body that sets ``field`` (a nested one inside its parent) to ``value``."""
    if field.name.startswith("stream_options."):
        return {"stream_options": {field.name.split(".")[1]: value}}
    if field.name == "response_format.json_schema.strict":
        schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}
        return {
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": value}}
        }
    return {field.name: value}


CASES = [(f, e) for f in FIELDS for e in f.endpoints]


@pytest.mark.parametrize(
    ("field", "endpoint"), [c for c in CASES if c[0].status == "refused"], ids=lambda x: getattr(x, "name", x)
)
def test_refused_field(server, field, endpoint):
    param = field.name.split(".")[0]
    refused(lambda: send(server, endpoint, **GREEDY, **_body(field, REFUSED_VALUES[field.name])), param, field.name)
    for ok in field.accepts:  # the values that ask for nothing are served, explicit nulls included
        if ok is None and "." in field.name:
            continue
        reply = send(server, endpoint, **GREEDY, **_body(field, ok))
        assert text_of(reply) == text_of(plain_answer(server, endpoint)), field.name
    if field.name == "best_of":  # equal to n asks for nothing either
        assert len(complete(server, **GREEDY, n=2, best_of=2).choices) == 2


@pytest.mark.parametrize(
    ("field", "endpoint"), [c for c in CASES if c[0].status == "no effect"], ids=lambda x: getattr(x, "name", x)
)
def test_no_effect_field(server, field, endpoint):
    value = NO_EFFECT_VALUES[field.name]
    unset = _body(field, False) if field.name == "response_format.json_schema.strict" else {}
    with_it = send(server, endpoint, **GREEDY, **_body(field, value))
    without = send(server, endpoint, **GREEDY, **unset) if unset else plain_answer(server, endpoint)
    assert text_of(with_it) == text_of(without)
    assert with_it.usage.prompt_tokens == without.usage.prompt_tokens


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_unknown_field_is_refused(server, endpoint):
    refused(lambda: send(server, endpoint, **GREEDY, temprature=0.5), "temprature", "unrecognized")
    refused(lambda: send(server, endpoint, **GREEDY, stream_options={"include_usge": True}), "stream_options")
    refused(lambda: send(server, endpoint, **GREEDY, structured_outputs={"jsn": {}}), "structured_outputs")


# ---- honoured: one check each ----------------------------------------------------------------------------------


def _model(s, e):
    base, upper = plain_answer(s, e), send(s, e, model="upper", **GREEDY)
    assert upper.model == "upper" and text_of(upper) != text_of(base)


def _messages(s, e):
    assert chat(s, **GREEDY).usage.prompt_tokens == len(ids(s, chatml(SYSTEM_T, ASK_T)))


def _prompt(s, e):
    assert complete(s, **GREEDY).usage.prompt_tokens == len(ids(s, PROMPT))
    assert complete(s, **GREEDY, prompt=ids(s, PROMPT)).choices[0].text == complete(s, **GREEDY).choices[0].text


def _max_tokens(s, e):
    assert send(s, e, temperature=0, max_tokens=3, ignore_eos=True).usage.completion_tokens == 3


def _max_completion_tokens(s, e):
    assert chat(s, temperature=0, max_tokens=6, max_completion_tokens=2, ignore_eos=True).usage.completion_tokens == 2


def _temperature(s, e):
    hot = send(s, e, temperature=1.5, seed=3, max_tokens=16)
    assert text_of(hot) != text_of(send(s, e, temperature=0, max_tokens=16))


def _top_p(s, e):  # only the likeliest token is left: greedy
    assert text_of(send(s, e, temperature=1, top_p=1e-6, seed=3, max_tokens=16)) == text_of(
        send(s, e, temperature=0, max_tokens=16)
    )


def _top_k(s, e):
    assert text_of(send(s, e, temperature=1, top_k=1, seed=3, max_tokens=16)) == text_of(
        send(s, e, temperature=0, max_tokens=16)
    )


def _min_p(s, e):
    assert text_of(send(s, e, temperature=1, min_p=1.0, seed=3, max_tokens=16)) == text_of(
        send(s, e, temperature=0, max_tokens=16)
    )


def _n(s, e):
    assert len(send(s, e, **GREEDY, n=3).choices) == 3


def _stream(s, e):
    chunks = list(send(s, e, **GREEDY, stream=True))
    texts = [(c.choices[0].delta.content if e == CHAT else c.choices[0].text) or "" for c in chunks if c.choices]
    assert len(chunks) > 2 and "".join(texts) == text_of(plain_answer(s, e))


def _include_usage(s, e):
    chunks = list(send(s, e, **GREEDY, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == plain_answer(s, e).usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def _stop(s, e):
    full = text_of(send(s, e, temperature=0, max_tokens=16))
    word = full.split()[2]
    cut = send(s, e, temperature=0, max_tokens=16, stop=[word])
    assert text_of(cut) == full[: full.index(word)] and cut.choices[0].finish_reason == "stop"
    kept = send(s, e, temperature=0, max_tokens=16, stop=[word], include_stop_str_in_output=True)
    assert text_of(kept) == full[: full.index(word) + len(word)]


def _seed(s, e):
    a, b, c = (text_of(send(s, e, temperature=1.2, max_tokens=16, seed=x)) for x in (5, 5, 6))
    assert a == b != c


def _penalty(name: str, value: float):
    def check(s, e):
        repeat = {"messages": [SYSTEM, {"role": "user", "content": "Write 'ha' twenty times."}]} if e == CHAT else {}
        plain = text_of(send(s, e, temperature=0, max_tokens=24, **repeat))
        assert text_of(send(s, e, temperature=0, max_tokens=24, **repeat, **{name: value})) != plain

    return check


def _logit_bias(s, e):
    (cat,) = ids(s, " cat")
    reply = send(s, e, temperature=0, max_tokens=4, ignore_eos=True, logit_bias={str(cat): 100})
    assert text_of(reply) == " cat" * 4


def _logprobs(s, e):
    if e == CHAT:
        reply = chat(s, **GREEDY, logprobs=True)
        assert len(reply.choices[0].logprobs.content) == reply.usage.completion_tokens
    else:
        reply = complete(s, **GREEDY, logprobs=2)
        assert all(len(t) == 2 for t in reply.choices[0].logprobs.top_logprobs)


def _top_logprobs(s, e):
    reply = chat(s, **GREEDY, logprobs=True, top_logprobs=3)
    assert all(len(t.top_logprobs) == 3 for t in reply.choices[0].logprobs.content)


def _echo(s, e):
    if e == COMPLETIONS:
        assert complete(s, **GREEDY, echo=True).choices[0].text == PROMPT + complete(s, **GREEDY).choices[0].text
        return
    started = [SYSTEM, ASK, {"role": "assistant", "content": "Red,"}]
    go_on = chat(s, **GREEDY, messages=started, continue_final_message=True, add_generation_prompt=False)
    echoed = chat(s, **GREEDY, messages=started, continue_final_message=True, add_generation_prompt=False, echo=True)
    assert text_of(echoed) == "Red," + text_of(go_on)
    assert text_of(chat(s, **GREEDY, echo=True)) == text_of(chat(s, **GREEDY))  # the final message is the user's


def _response_format(s, e):
    reply = send(s, e, temperature=0, max_tokens=40, response_format={"type": "json_object"})
    assert isinstance(json.loads(text_of(reply)), dict)


def _structured(name: str, value, ok: Callable[[str], bool]):
    def check(s, e):
        assert ok(text_of(send(s, e, temperature=0, max_tokens=40, **{name: value})))

    return check


COLOUR = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 10}}, "required": ["colour"]}


def _json_ok(text: str) -> bool:
    jsonschema.validate(json.loads(text), COLOUR)
    return True


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _tools(s, e):
    calls = chat(s, temperature=0, max_tokens=60, tools=[WEATHER], tool_choice="required").choices[0].message
    assert calls.tool_calls and calls.tool_calls[0].function.name == "weather"


def _tool_choice(s, e):
    named = {"type": "function", "function": {"name": "weather"}}
    reply = chat(s, temperature=0, max_tokens=60, tools=[WEATHER], tool_choice=named)
    assert reply.choices[0].finish_reason == "tool_calls"
    none = chat(s, **GREEDY, tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.tool_calls is None


def _parallel_tool_calls(s, e):
    reply = chat(s, temperature=0, max_tokens=120, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert len(reply.choices[0].message.tool_calls) == 1


SHORT_ANSWER = [SYSTEM, {"role": "user", "content": "Say only: yes"}]  # answered in a few tokens, then <|im_end|>


def _short(e: str) -> dict:
    return {"messages": SHORT_ANSWER} if e == CHAT else {"prompt": chatml(SYSTEM_T, ("user", "Say only: yes"))}


def _ignore_eos(s, e):
    short = _short(e)
    assert send(s, e, temperature=0, max_tokens=24, **short).usage.completion_tokens < 24
    assert send(s, e, temperature=0, max_tokens=24, ignore_eos=True, **short).usage.completion_tokens == 24


def _min_tokens(s, e):
    short = _short(e)
    natural = send(s, e, temperature=0, max_tokens=24, **short).usage.completion_tokens
    assert (
        send(s, e, temperature=0, max_tokens=24, min_tokens=natural + 3, **short).usage.completion_tokens >= natural + 3
    )


def _stop_token_ids(s, e):
    (cat,) = ids(s, " cat")
    reply = send(s, e, temperature=0, max_tokens=8, logit_bias={str(cat): 100}, stop_token_ids=[cat])
    assert reply.choices[0].finish_reason == "stop" and reply.model_extra is not None
    assert reply.choices[0].model_extra["stop_reason"] == cat and reply.usage.completion_tokens == 1


def _skip_special_tokens(s, e):
    start = ids(s, "<|im_start|>")[0]  # a special token
    forced = {"temperature": 0, "max_tokens": 2, "ignore_eos": True, "logit_bias": {str(start): 100}}
    assert text_of(send(s, e, **forced)) == ""
    assert text_of(send(s, e, **forced, skip_special_tokens=False)) == "<|im_start|>" * 2


def _allowed_token_ids(s, e):
    allowed = ids(s, " cat") + ids(s, " dog")
    text = text_of(send(s, e, temperature=1, seed=1, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed))
    assert re.fullmatch(r"( cat| dog){6}", text), text


def _bad_words(s, e):
    full = text_of(send(s, e, temperature=0, max_tokens=16))
    word = full.split()[1].strip(",.")
    banned = text_of(send(s, e, temperature=0, max_tokens=16, bad_words=[word]))
    assert word not in banned.split() and banned != full


def _priority(s, e):  # admission order is checked in test_fair_tenants; here: a priority is served as usual
    assert text_of(send(s, e, **GREEDY, priority=-5)) == text_of(plain_answer(s, e))
    refused(lambda: send(s, e, **GREEDY, priority="high"), "priority")


def _prompt_logprobs(s, e):
    if e == CHAT:
        reply = chat(s, **GREEDY, prompt_logprobs=1)
        shown = reply.model_extra["prompt_logprobs"]
    else:
        reply = complete(s, **GREEDY, prompt_logprobs=1)
        shown = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(shown) == reply.usage.prompt_tokens and shown[0] is None and all(shown[1:])


def _truncate_prompt_tokens(s, e):
    assert send(s, e, **GREEDY, truncate_prompt_tokens=5).usage.prompt_tokens == 5
    tail = ids(s, PROMPT)[-3:]
    if e == COMPLETIONS:
        assert text_of(complete(s, **GREEDY, truncate_prompt_tokens=3)) == text_of(complete(s, **GREEDY, prompt=tail))


def _cache_salt(s, e):
    long = {"messages": [SYSTEM, {"role": "user", "content": "Describe the sea. " * 30}]}
    long = long if e == CHAT else {"prompt": "Describe the sea. " * 30}

    def cached(salt):
        reply = send(s, e, temperature=0, max_tokens=1, cache_salt=salt, **long)
        return reply.usage.prompt_tokens_details.cached_tokens

    cached("a")
    assert cached("a") > 0 and cached("b") == 0


def _request_id(s, e):
    assert send(s, e, **GREEDY, request_id="audit-7").id.endswith("-audit-7")
    with_header = s.client().with_options(default_headers={"x-request-id": "from-header"})
    if e == CHAT:
        reply = with_header.chat.completions.create(
            model=BASE, messages=[ASK], extra_body={"request_id": "x"}, **GREEDY
        )
    else:
        reply = with_header.completions.create(model=BASE, prompt=PROMPT, extra_body={"request_id": "x"}, **GREEDY)
    assert reply.id.endswith("-from-header")


def _add_special_tokens(s, e):  # SmolLM2 adds no BOS: checked on the rich server's model, which does
    refused(lambda: send(s, e, **GREEDY, add_special_tokens="maybe"), "add_special_tokens")


def test_add_special_tokens_puts_bos_first(rich):
    text = PROMPT
    assert (
        complete(rich, **GREEDY).usage.prompt_tokens == len(ids(rich, text, special=True)) == len(ids(rich, text)) + 1
    )
    assert complete(rich, **GREEDY, add_special_tokens=False).usage.prompt_tokens == len(ids(rich, text))
    template = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName three colours.<|im_end|>\n"
    plain = len(ids(rich, template + "<|im_start|>assistant\n"))
    assert chat(rich, **GREEDY).usage.prompt_tokens == plain
    assert chat(rich, **GREEDY, add_special_tokens=True).usage.prompt_tokens == plain + 1


def _add_generation_prompt(s, e):
    without = chat(s, **GREEDY, add_generation_prompt=False)
    want = chatml(SYSTEM_T, ASK_T, generation=False)
    assert without.usage.prompt_tokens == len(ids(s, want))


def _continue_final_message(s, e):
    started = [SYSTEM, ASK, {"role": "assistant", "content": "Red, green"}]
    reply = chat(s, **GREEDY, messages=started, continue_final_message=True, add_generation_prompt=False)
    want = chatml(SYSTEM_T, ASK_T, generation=False) + "<|im_start|>assistant\nRed, green"
    assert reply.usage.prompt_tokens == len(ids(s, want))
    refused(lambda: chat(s, **GREEDY, messages=started, continue_final_message=True), "continue_final_message")


def _template_variable(name: str, value, written: str):
    """A variable the rich template writes: 400 on SmolLM2's, on the rich one the prompt gains exactly ``written``."""

    def check(s, e):
        refused(lambda: chat(s, **GREEDY, **{name: value}), name, "does not read")

    check.rich = (name, value, written)  # type: ignore[attr-defined]
    return check


HONOURED: dict[str, Callable] = {
    "model": _model,
    "messages": _messages,
    "prompt": _prompt,
    "max_tokens": _max_tokens,
    "max_completion_tokens": _max_completion_tokens,
    "temperature": _temperature,
    "top_p": _top_p,
    "n": _n,
    "stream": _stream,
    "stream_options": _include_usage,
    "stream_options.include_usage": _include_usage,
    "stop": _stop,
    "seed": _seed,
    "frequency_penalty": _penalty("frequency_penalty", 2.0),
    "presence_penalty": _penalty("presence_penalty", 2.0),
    "logit_bias": _logit_bias,
    "logprobs": _logprobs,
    "top_logprobs": _top_logprobs,
    "echo": _echo,
    "response_format": _response_format,
    "tools": _tools,
    "tool_choice": _tool_choice,
    "parallel_tool_calls": _parallel_tool_calls,
    "reasoning_effort": _template_variable("reasoning_effort", "low", "effort: low\n"),
    "top_k": _top_k,
    "min_p": _min_p,
    "repetition_penalty": _penalty("repetition_penalty", 1.8),
    "ignore_eos": _ignore_eos,
    "min_tokens": _min_tokens,
    "stop_token_ids": _stop_token_ids,
    "skip_special_tokens": _skip_special_tokens,
    "include_stop_str_in_output": _stop,
    "allowed_token_ids": _allowed_token_ids,
    "bad_words": _bad_words,
    "priority": _priority,
    "prompt_logprobs": _prompt_logprobs,
    "truncate_prompt_tokens": _truncate_prompt_tokens,
    "cache_salt": _cache_salt,
    "request_id": _request_id,
    "add_special_tokens": _add_special_tokens,
    "add_generation_prompt": _add_generation_prompt,
    "continue_final_message": _continue_final_message,
    "documents": _template_variable("documents", [{"text": "Sky is blue."}], "<doc>Sky is blue.</doc>\n"),
    "chat_template_kwargs": _template_variable("chat_template_kwargs", {"enable_thinking": False}, "no thinking\n"),
    "guided_json": _structured("guided_json", COLOUR, _json_ok),
    "guided_regex": _structured("guided_regex", r"[0-9]{3}", lambda t: re.fullmatch(r"[0-9]{3}", t) is not None),
    "guided_choice": _structured("guided_choice", ["red", "blue"], lambda t: t in ("red", "blue")),
    "guided_grammar": _structured("guided_grammar", 'root ::= "yes" | "no"', lambda t: t in ("yes", "no")),
    "structured_outputs": _structured("structured_outputs", {"choice": ["up", "down"]}, lambda t: t in ("up", "down")),
}


@pytest.mark.parametrize(
    ("field", "endpoint"), [c for c in CASES if c[0].status == "honoured"], ids=lambda x: getattr(x, "name", x)
)
def test_honoured_field(server, field, endpoint):
    HONOURED[field.name](server, endpoint)


@pytest.mark.parametrize("name", ["reasoning_effort", "documents", "chat_template_kwargs"])
def test_template_variables_reach_a_template_that_reads_them(rich, name):
    key, value, written = HONOURED[name].rich
    plain = chat(rich, **GREEDY).usage.prompt_tokens
    assert chat(rich, **GREEDY, **{key: value}).usage.prompt_tokens == plain + len(ids(rich, written))
    if name == "chat_template_kwargs":
        refused(lambda: chat(rich, **GREEDY, chat_template_kwargs={"enable_thoughts": False}), name, "enable_thoughts")
        refused(lambda: chat(rich, **GREEDY, chat_template_kwargs={"messages": []}), name, "set by the server")


# ---- messages ---------------------------------------------------------------------------------------------------


def test_message_content_parts(server):
    plain = chat(server, **GREEDY).usage.prompt_tokens
    parts = {"role": "user", "content": [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colours."}]}
    assert chat(server, **GREEDY, messages=[SYSTEM, parts]).usage.prompt_tokens == plain
    for part in (
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-1"}},
    ):
        message = {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}
        refused(lambda m=message: chat(server, **GREEDY, messages=[SYSTEM, m]), "messages", part["type"])


def test_assistant_refusal_is_its_text(server):
    said = [SYSTEM, ASK, {"role": "assistant", "content": "I cannot."}, {"role": "user", "content": "Why?"}]
    as_field = [*said[:2], {"role": "assistant", "content": None, "refusal": "I cannot."}, said[3]]
    as_part = [*said[:2], {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]}, said[3]]
    want = chat(server, **GREEDY, messages=said)
    for messages in (as_field, as_part):
        got = chat(server, **GREEDY, messages=messages)
        assert got.usage.prompt_tokens == want.usage.prompt_tokens and text_of(got) == text_of(want)


def test_message_fields_the_template_does_not_write_are_refused(server, rich):
    named = [SYSTEM, {**ASK, "name": "ana"}]
    refused(lambda: chat(server, **GREEDY, messages=named), "messages", "messages[1].name")
    want = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user (ana)\nName three colours.<|im_end|>\n"
    assert chat(rich, **GREEDY, messages=named).usage.prompt_tokens == len(ids(rich, want + "<|im_start|>assistant\n"))
    thought = [SYSTEM, ASK, {"role": "assistant", "content": "Red.", "reasoning_content": "easy"}, ASK]
    refused(lambda: chat(server, **GREEDY, messages=thought), "messages", "messages[2].reasoning_content")
    assert (
        chat(rich, **GREEDY, messages=thought).usage.prompt_tokens
        > chat(
            rich, **GREEDY, messages=[*thought[:2], {"role": "assistant", "content": "Red."}, ASK]
        ).usage.prompt_tokens
    )
    for field, value in (("audio", {"id": "audio-1"}), ("function_call", {"name": "f", "arguments": "{}"})):
        message = {"role": "assistant", "content": "Red.", field: value}
        refused(lambda m=message: chat(server, **GREEDY, messages=[SYSTEM, ASK, m, ASK]), "messages", field)


def test_message_fields_of_no_effect(server):
    """Nulls (as clients send back a whole answer's message), annotations, and a tool message's name (its
    tool_call_id names the call) leave the prompt as it was."""
    said = [SYSTEM, ASK, {"role": "assistant", "content": "Red."}, ASK]
    echoed = [
        *said[:2],
        {"role": "assistant", "content": "Red.", "refusal": None, "audio": None, "annotations": []},
        ASK,
    ]
    assert (
        chat(server, **GREEDY, messages=echoed).usage.prompt_tokens
        == chat(server, **GREEDY, messages=said).usage.prompt_tokens
    )
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    history = [SYSTEM, ASK, {"role": "assistant", "content": None, "tool_calls": [call]}]
    result = {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}
    a = chat(server, **GREEDY, tools=[WEATHER], messages=[*history, result])
    b = chat(server, **GREEDY, tools=[WEATHER], messages=[*history, {**result, "name": "weather"}])
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    refused(
        lambda: chat(server, **GREEDY, messages=[*history, {"role": "tool", "content": "12 C"}]),
        "messages",
        "tool_call_id",
    )
