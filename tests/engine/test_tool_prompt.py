"""Tools and tool-call history reach the prompt: the token ids the server builds for a conversation with tools,
assistant tool calls and tool results equal HF transformers' ``apply_chat_template(messages, tools=...,
tokenize=True)`` on the same messages (a template that reads tools), and SmolLM2's own template (which does not)
gets the documented default rendering, written out here by hand. Invalid tools and tool choices are refused with
the request field named."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import transformers

from lora_server.engine.tokenizer import Tokenizer
from lora_server.errors import InvalidRequestError
from lora_server.server.metrics import Metrics
from lora_server.server.openai_serving import OpenAIServing
from lora_server.server.protocol import ChatCompletionRequest, parse_body
from tests.servers import BASE

# A ChatML template that reads everything transformers hands a template about tools: the tool list (tojson with
# json.dumps' options), an assistant's calls (id, name, arguments as an object: .items() fails on JSON text; its
# content, which transformers leaves out when null) and a tool message's tool_call_id and name. Written for this
# test; real ones (Qwen2.5's...) read the same fields.
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}Functions:
{% for tool in tools %}{{ tool | tojson(separators=(',', ':')) }}
{% endfor %}<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}<|im_start|>tool {{ message.tool_call_id }}{% if message.name
  %} ({{ message.name }}){% endif %}
{{ message.content }}<|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{% if message.content is defined %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}[{{ call.id }}] {{ call.function.name }}({% for k, v in
  call.function.arguments.items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}{% endfor %})
{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

# as an OpenAI client sends them: arguments as JSON text, content null beside tool calls
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich and Paris, and the time?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_a1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "unit": "celsius"}'},
            },
            {"id": "call_b2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_c3", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_a1", "content": '{"temp": 4}'},
    {"role": "tool", "tool_call_id": "call_b2", "name": "get_weather", "content": '{"temp": 9}'},
    {"role": "tool", "tool_call_id": "call_c3", "content": "12:00"},
    {"role": "assistant", "content": "4°C in Zürich, 9°C in Paris; it is noon."},
    {"role": "user", "content": "And in Rome?"},
]
CONVERSATIONS = {
    "tools": ([WEATHER, TIME], [{"role": "user", "content": "Weather in Rome?"}]),
    "history": ([WEATHER, TIME], HISTORY),
    "history-no-tools": (None, HISTORY[1:]),
    "text-and-call": (
        [WEATHER],
        [
            {"role": "user", "content": "Rome?"},
            {
                "role": "assistant",
                "content": "Looking it up.",
                "tool_calls": [
                    {
                        "id": "x",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "x", "content": "sunny"},
        ],
    ),
}


def hf_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same conversation as transformers' chat templates take it: each call's arguments as an object."""
    out = copy.deepcopy(messages)
    for message in out:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def body(messages, tools=None, **fields) -> ChatCompletionRequest:
    """The request as the server parses it from its JSON body."""
    raw = {"model": BASE, "messages": messages, **({"tools": tools} if tools is not None else {}), **fields}
    return parse_body(json.dumps(raw).encode(), ChatCompletionRequest)


@pytest.fixture(scope="module")
def hf(smollm2_path: Path):
    return transformers.AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


def hf_ids(tokenizer, messages, tools, chat_template: str | None = None) -> list[int]:
    ids = tokenizer.apply_chat_template(
        hf_messages(messages),
        tools=tools,
        chat_template=chat_template,
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    return list(ids)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_a_template_that_reads_tools_gets_them_as_transformers_passes_them(smollm2_path, hf, name):
    tools, messages = CONVERSATIONS[name]
    ours = Tokenizer.from_gguf(smollm2_path).with_chat_template(TOOLS_TEMPLATE)
    assert ours.template_renders_tools
    req = body(messages, tools)
    tool_request = req.tool_request()
    text = ours.apply_chat_template(
        req.template_messages(), tools=None if tool_request is None else tool_request.definitions()
    )
    expected = hf_ids(hf, messages, tools, TOOLS_TEMPLATE)
    assert ours.encode(text, add_special_tokens=False) == expected
    # what the comparison stands on: the tool list and the calls reached the template
    assert ('{"type":"function","function":{"name":"get_weather"' in text) == bool(tools)
    assert ("get_weather(city=" in text) == any(m.get("tool_calls") for m in messages)


# SmolLM2's template reads no tools: the documented default rendering, by hand
DEFAULT_RENDERING = (
    "<|im_start|>system\n"
    "You are terse.\n\n"
    "You can call functions to help answer. Their definitions, as JSON schemas, are listed between <tools> and "
    "</tools>:\n<tools>\n"
    + json.dumps(WEATHER, ensure_ascii=False)
    + "\n"
    + json.dumps(TIME)
    + "\n</tools>\n\nTo call a function, answer with a <tool_call></tool_call> block holding a JSON object with its "
    'name and arguments, one block per call:\n<tool_call>\n{"name": "<function name>", "arguments": '
    "{<arguments as JSON>}}\n</tool_call><|im_end|>\n"
    "<|im_start|>user\nWeather in Zürich and Paris, and the time?<|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n"
    '<tool_response>\n{"temp": 4}\n</tool_response>\n'
    '<tool_response>\n{"temp": 9}\n</tool_response>\n'
    "<tool_response>\n12:00\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n4°C in Zürich, 9°C in Paris; it is noon.<|im_end|>\n"
    "<|im_start|>user\nAnd in Rome?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def serving(engine_fp32):
    return OpenAIServing(engine_fp32, Metrics(BASE, engine_fp32))


def test_smollm2s_template_gets_the_default_rendering(serving, hf):
    assert not serving.engine.tokenizer.template_renders_tools
    assert serving.tool_parser is not None and serving.tool_parser.name == "hermes"  # the rendering's format
    prepared = serving.prepare_chat(body(HISTORY, [WEATHER, TIME]), None, "")
    try:
        assert (
            list(prepared.requests[0].prompt_token_ids) == hf(DEFAULT_RENDERING, add_special_tokens=False)["input_ids"]
        )
    finally:
        serving.discard(prepared.requests)


def test_a_conversation_without_tools_is_templated_as_before(serving, hf):
    messages = [{"role": "user", "content": "Hi!"}]
    prepared = serving.prepare_chat(body(messages), None, "")
    serving.discard(prepared.requests)
    assert list(prepared.requests[0].prompt_token_ids) == hf_ids(hf, messages, None)
    assert prepared.tool_calling is None


ERRORS = [
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": 3}}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"tools": [WEATHER], "function_call": "auto"}, "function_call"),
]


@pytest.mark.parametrize("fields, param", ERRORS)
def test_invalid_tools_are_refused_naming_the_field(serving, fields, param):
    with pytest.raises(InvalidRequestError) as err:
        serving.prepare_chat(body([{"role": "user", "content": "hi"}], **fields), None, "")
    assert err.value.param == param and err.value.http_status == 400


BAD_HISTORY = [
    {
        "role": "assistant",
        "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{x"}}],
    },
    {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": {"x": 1}}}]},
    {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "user", "content": "hi", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "content": "result without the call it answers"},
    {"role": "user", "content": "hi", "tool_call_id": "a"},
    {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
]


@pytest.mark.parametrize("message", BAD_HISTORY)
def test_invalid_tool_history_is_refused(serving, message):
    with pytest.raises(InvalidRequestError) as err:
        serving.prepare_chat(body([{"role": "user", "content": "hi"}, message]), None, "")
    assert err.value.param == "messages"


def test_tool_choice_none_without_tools_asks_for_nothing(serving):
    prepared = serving.prepare_chat(body([{"role": "user", "content": "hi"}], tool_choice="none"), None, "")
    serving.discard(prepared.requests)
    assert prepared.tool_calling is None
