"""Tool calling end to end on the embedded model.

The engine: requests forced to call (required, a named function), a request whose model calls on its own (auto),
a JSON-schema request and a free request run in one batch, with and without an adapter; every call read back
parses and validates against its function's schema (``jsonschema``), and the free request is unchanged by its batch.

The HTTP server, with the official ``openai`` client: required, named and auto calls, streaming and not, the base
model and an adapter; every call's arguments validate, ``finish_reason`` is ``tool_calls``, and a stream's deltas
join into the calls of the same request answered whole. For ``auto`` the small model calls on its own after one
example call in the conversation (greedy, so the test is deterministic): the call read back is the model's own."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import transformers

from lora_server.adapters import demo_adapters
from lora_server.sampling_params import SamplingParams, StructuredOutput
from lora_server.server.protocol import ChatCompletionRequest
from lora_server.tools.calling import plan_tool_calls
from lora_server.tools.parsers import HERMES
from lora_server.tools.readers import Arguments, CallStart, Text
from tests.engine.test_tool_prompt import HISTORY, TOOLS_TEMPLATE, hf_ids
from tests.engine.test_tool_prompt import TIME as PROMPT_TIME
from tests.engine.test_tool_prompt import WEATHER as PROMPT_WEATHER
from tests.servers import BASE, Server, served

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 32}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


def example_call(city: str, final: str) -> list[dict[str, Any]]:
    """A conversation holding one example call, then a question like the first: greedy, the model answers it
    with a call of its own."""
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    return [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "user", "content": f"What is the weather in {final}?"},
    ]


AUTO_WEATHER = {**WEATHER, "function": {**WEATHER["function"], "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip


def check_calls(calls: list[tuple[str, str]]) -> None:
    """Each call names a given function and its arguments parse and validate against that function's schema."""
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# ---- the engine: one batch --------------------------------------------------------------------------------------


def read(text: str, mode: str) -> tuple[str, list[tuple[str, str]]]:
    reader = HERMES.reader(mode)
    events = reader.feed(text) + reader.finish()
    content = "".join(e.text for e in events if isinstance(e, Text))
    names = [e.name for e in events if isinstance(e, CallStart)]
    arguments = [
        "".join(e.text for e in events if isinstance(e, Arguments) and e.index == i) for i in range(len(names))
    ]
    return content, list(zip(names, arguments, strict=True))


@pytest.fixture(scope="module")
def engine(engine_fp32):
    for name in ("upper", "emoji"):
        engine_fp32.adapters.add(f"tools-{name}", demo_adapters()[name])
    yield engine_fp32
    for name in ("upper", "emoji"):
        engine_fp32.adapters.remove(f"tools-{name}")


def prepared(engine, messages, tools, tool_choice, parallel=None):
    """A chat request's prompt and tool calling, as the server makes them from its body."""
    req = ChatCompletionRequest.model_validate(
        {"messages": messages, "tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel}
    )
    tool_request = req.tool_request()
    assert tool_request is not None
    return engine.chat_prompt(req.template_messages(), tool_request.definitions()), plan_tool_calls(
        tool_request, HERMES
    )


def test_a_named_call_on_the_engine(engine):
    """The quick tier's end-to-end check: one function, forced by name, through the grammar and back."""
    prompt, plan = prepared(engine, [{"role": "user", "content": "Time in Tokyo?"}], [TIME], NAMED, parallel=False)
    [out] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=48, structured=plan.constraint))
    content, calls = read(out.text, "forced")
    assert out.finish_reason == "stop" and content == "" and [name for name, _ in calls] == ["get_time"]
    check_calls(calls)


@pytest.mark.slow
def test_tool_requests_share_a_batch_with_structured_and_free_ones(engine):
    greedy = dict(temperature=0, max_tokens=96)
    required = prepared(engine, ASK, TOOLS, "required", parallel=False)
    named = prepared(engine, ASK, TOOLS, NAMED, parallel=False)
    auto = prepared(engine, example_call("Paris", "Berlin"), [AUTO_WEATHER], "auto")
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}
    json_prompt = engine.chat_prompt([{"role": "user", "content": "A person, as JSON."}])
    free_prompt = engine.chat_prompt([{"role": "user", "content": "Write a haiku about the sea."}])
    batch = [  # (prompt, params, adapter)
        (required[0], SamplingParams(**greedy, structured=required[1].constraint), None),
        (named[0], SamplingParams(**greedy, structured=named[1].constraint), "tools-upper"),
        (required[0], SamplingParams(temperature=0.8, seed=3, max_tokens=96, structured=required[1].constraint), None),
        (auto[0], SamplingParams(**greedy), "tools-emoji"),
        (json_prompt, SamplingParams(**greedy, structured=StructuredOutput.json_schema(person)), None),
        (free_prompt, SamplingParams(max_tokens=12, temperature=0), None),
    ]
    outputs = engine.generate([b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch])
    engine.check_integrity()
    for out in outputs[:3]:  # forced: calls only, one (parallel_tool_calls false), the grammar ended it
        content, calls = read(out.text, "forced")
        assert out.finish_reason == "stop" and content == "" and len(calls) == 1, out.text
        check_calls(calls)
    assert read(outputs[1].text, "forced")[1][0][0] == "get_time"  # the named function, with the adapter
    assert auto[1] is not None and auto[1].mode == "free"
    content, calls = read(outputs[3].text, "free")
    assert calls == [("get_weather", '{"city": "Berlin"}')] and content == "", outputs[3].text
    jsonschema.validate(json.loads(outputs[4].text), person)
    alone = engine.generate([free_prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    assert outputs[5].token_ids == alone.token_ids


# ---- the HTTP server with the openai client ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from served(tmp_path_factory, "tools", ["--allow-anonymous"])


def whole(client: openai.OpenAI, **kw) -> tuple[Any, list[tuple[str, str]], str]:
    """(message, [(name, arguments)], finish_reason) of a request answered whole."""
    r = client.chat.completions.create(**{"temperature": 0, "max_tokens": 160, **kw})
    [choice] = r.choices
    calls = choice.message.tool_calls or []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
    assert len({c.id for c in calls}) == len(calls)
    return choice.message, [(c.function.name, c.function.arguments) for c in calls], choice.finish_reason


def streamed(client: openai.OpenAI, **kw) -> tuple[str | None, list[tuple[str, str]], str, Any]:
    """(content, [(name, arguments)], finish_reason, usage) of the same request streamed: OpenAI's tool-call
    deltas joined by index (id, type and name in a call's first delta, its arguments in pieces after)."""
    kw = {"temperature": 0, "max_tokens": 160, **kw}
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    content, calls, finish = None, {}, None
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        delta = choice.delta
        if delta.content:
            content = (content or "") + delta.content
        for piece in delta.tool_calls or []:
            if piece.index not in calls:
                assert piece.id.startswith("call_") and piece.type == "function" and piece.function.name
                assert piece.index == len(calls)  # calls arrive in order
                calls[piece.index] = [piece.function.name, piece.function.arguments or ""]
            else:
                assert piece.id is None and piece.function.name is None  # the name comes first, once
                calls[piece.index][1] += piece.function.arguments
        if choice.finish_reason is not None:
            assert finish is None and chunk is chunks[-2]
            finish = choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # the usage chunk, last
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, chunks[-1].usage


FORCED = [
    (model, choice, parallel)
    for model in (BASE, "pirate")
    for choice, parallel in (("required", False), ("required", None), (NAMED, None))
]


@pytest.mark.slow
@pytest.mark.parametrize("model, tool_choice, parallel", FORCED)
def test_forced_calls_whole_and_streamed(server, model, tool_choice, parallel):
    client = server.client()
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice)
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    message, calls, finish = whole(client, **kw)
    assert finish == "tool_calls" and message.content is None
    check_calls(calls)
    if parallel is False or tool_choice == NAMED:  # a named function is called once
        assert len(calls) == 1
    if tool_choice == NAMED:
        assert calls[0][0] == "get_time"
    content, streamed_calls, streamed_finish, usage = streamed(client, **kw)
    assert (content, streamed_calls, streamed_finish) == (None, calls, "tool_calls")
    assert usage.completion_tokens > 0


@pytest.mark.slow
def test_a_forced_call_cut_by_max_tokens_ends_length_and_keeps_every_word(server):
    """Cut by max_tokens: finish_reason is ``length`` (never ``tool_calls``), streamed and whole agree, and nothing
    written is dropped: before the function's name is whole (its closing quote) the text is content, word for
    word; after it, the call with its arguments as far as they were written. The reference: the Hermes format
    written by hand, and the text of the tokens the uncut answer generated (greedy: a cut answer is its start)."""
    client = server.client()
    kw = dict(model=BASE, messages=ASK, tools=TOOLS, tool_choice=NAMED)
    full = client.chat.completions.create(**kw, temperature=0, max_tokens=160, logprobs=True)
    [(name, arguments)] = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
    assert full.choices[0].finish_reason == "tool_calls"
    head = f'<tool_call>\n{{"name": "{name}", "arguments": '
    tokens = [t.token for t in full.choices[0].logprobs.content]
    written = ["".join(tokens[:k]) for k in range(len(tokens) + 1)]  # the text of the first k tokens
    assert written[-2].startswith(f"{head}{arguments}}}\n</tool_call>")  # the last token ends the answer
    named = [k for k in range(len(tokens)) if f'"name": "{name}"' in written[k]]
    # cut in the first token, in the name, right after it, inside the arguments, before the last token
    for k in sorted({1, named[0] - 1, named[0], (named[0] + len(tokens)) // 2, len(tokens) - 1}):
        message, calls, finish = whole(client, **kw, max_tokens=k)
        assert finish == "length", (k, written[k], message)
        if k in named:  # the name is whole: a call, its arguments as far as written
            assert message.content is None and calls == [(name, written[k][len(head) :][: len(arguments)])]
        else:
            assert message.content == written[k] and not calls, (k, written[k], message)
        content, streamed_calls, streamed_finish, _ = streamed(client, **kw, max_tokens=k)
        assert (content, streamed_calls, streamed_finish) == (message.content, calls, "length")


@pytest.mark.slow
@pytest.mark.parametrize("model", [BASE, "emoji"])
def test_auto_calls_the_model_makes_on_its_own(server, model):
    client = server.client()
    kw = dict(model=model, messages=example_call("Paris", "Berlin"), tools=[AUTO_WEATHER])  # tool_choice: auto
    message, calls, finish = whole(client, **kw)
    assert finish == "tool_calls" and message.content is None
    assert calls == [("get_weather", '{"city": "Berlin"}')]
    content, streamed_calls, streamed_finish, _ = streamed(client, **kw)
    assert (content, streamed_calls, streamed_finish) == (None, calls, "tool_calls")


@pytest.mark.slow
def test_auto_with_a_strict_function_follows_its_schema(server):
    """The `upper` adapter writes a call that breaks the schema on its own (extra keys, cut at max_tokens: text);
    with strict, the call is written under the grammar once the model starts one, and validates."""
    client = server.client()
    messages = example_call("Paris", "Berlin")
    message, calls, finish = whole(client, model="upper", messages=messages, tools=[AUTO_WEATHER], max_tokens=60)
    assert not calls and "<tool_call>" in (message.content or ""), message  # the model's own, not a valid call
    strict = {**AUTO_WEATHER, "function": {**AUTO_WEATHER["function"], "strict": True}}
    message, calls, finish = whole(client, model="upper", messages=messages, tools=[strict])
    assert finish == "tool_calls" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0][1]), {**SCHEMAS["get_weather"], "required": ["city"]})


@pytest.mark.slow
def test_the_start_up_log_says_how_tool_calls_are_read(server):
    assert (
        "tool calls: the hermes format (from the chat template); the chat template shows no tools: they are written "
        "into the system prompt"
    ) in server.log_text()


@pytest.mark.slow
def test_tool_choice_none_shows_the_tools_and_parses_nothing(server):
    client = server.client()
    messages = example_call("Paris", "Berlin")
    message, calls, finish = whole(client, model=BASE, messages=messages, tools=[AUTO_WEATHER], tool_choice="none")
    assert not calls and finish == "stop" and "<tool_call>" in message.content  # the call, left as text
    # the tools were in the prompt: the same conversation without them is shorter
    usage = [
        client.chat.completions.create(model=BASE, messages=messages, max_tokens=1, **extra).usage.prompt_tokens
        for extra in ({"tools": [AUTO_WEATHER], "tool_choice": "none"}, {})
    ]
    assert usage[0] > usage[1]


@pytest.mark.slow
def test_several_choices_each_make_their_calls(server):
    r = server.client().chat.completions.create(
        model=BASE, messages=ASK, tools=TOOLS, tool_choice="required", n=2, temperature=0.9, seed=5, max_tokens=160
    )
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])


@pytest.mark.slow
def test_a_tool_result_conversation_continues(server):
    """The answer's calls, sent back with their results, make a valid next request (the history is rendered)."""
    client = server.client()
    first = client.chat.completions.create(model=BASE, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=96)  # fmt: skip
    message = first.choices[0].message
    history = [*ASK, message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "18 degrees, sunny"} for c in message.tool_calls]
    second = client.chat.completions.create(model=BASE, messages=history, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=24)  # fmt: skip
    assert second.choices[0].message.content and second.usage.prompt_tokens > first.usage.prompt_tokens


ERRORS = [
    ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}, "tools"),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": -1}}}
            ]
        },
        "tools",
    ),  # noqa: E501
    (  # a keyword the grammar cannot enforce, once it must enforce it
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
                    },
                }
            ],  # noqa: E501
            "tool_choice": "required",
        },
        "tools",
    ),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "guided_regex": "[a-z]+"}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": "required", "min_tokens": 2}, "min_tokens"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"tools": TOOLS, "function_call": {"name": "get_weather"}}, "function_call"),
]


@pytest.mark.slow
@pytest.mark.parametrize("fields, param", ERRORS)
def test_invalid_tool_requests_are_400_naming_the_field(server, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(model=BASE, messages=ASK, max_tokens=4, extra_body=fields)
    error = err.value.body
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", error
    assert err.value.status_code == 400 and error["param"] == param and error["message"], error
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # nothing else changed


@pytest.mark.slow
def test_a_chat_template_of_its_own(tmp_path, smollm2_path):
    """--chat-template with a template that reads tools in a format no parser knows: the server's prompt for a
    conversation with tools and tool history has HF transformers' token count for it; auto is refused (no parser),
    forced calls work (the default format)."""
    template = tmp_path / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    s = Server(tmp_path, [tmp_path], ["--allow-anonymous", "--chat-template", str(template)])
    try:
        client = s.client()
        tools = [PROMPT_WEATHER, PROMPT_TIME]
        r = client.chat.completions.create(model=BASE, messages=HISTORY, tools=tools, tool_choice="none", max_tokens=1)
        hf = transformers.AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
        assert r.usage.prompt_tokens == len(hf_ids(hf, HISTORY, tools, TOOLS_TEMPLATE))
        assert 'tool calls: the model\'s format is unknown: tool_choice "auto" is refused' in s.log_text()
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=BASE, messages=ASK, tools=TOOLS, max_tokens=4)
        assert err.value.body["param"] == "tool_choice"
        kw = dict(model=BASE, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        _, calls, finish = whole(client, **kw)
        assert finish == "tool_calls" and len(calls) == 1
        check_calls(calls)
    finally:
        s.stop()
