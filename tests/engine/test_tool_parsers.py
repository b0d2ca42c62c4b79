"""Tool-call readers against hand-written outputs of each family (Hermes/Qwen/SmolLM2, Llama 3 JSON, Mistral), free
and grammar-written, whole and fed in pieces (every split gives the same content and calls as the whole text); the
call grammars accept exactly what the readers read back (xgrammar's own matcher, not our reader, is the judge)."""

from __future__ import annotations

import json
import random

import pytest

from lora_server.sampling_params import StructuredOutput
from lora_server.tools.calling import plan_tool_calls
from lora_server.tools.parsers import HERMES, LLAMA3_JSON, MISTRAL, TOOL_PARSERS, parser_for_template
from lora_server.tools.readers import Arguments, CallStart, Text, ToolCallReader
from lora_server.tools.spec import parse_tool_request


def read(reader: ToolCallReader, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list]:
    """(content, [(name, arguments)], events) of an output fed in ``pieces``."""
    events = []
    for piece in pieces:
        events += reader.feed(piece)
    events += reader.finish()
    content = "".join(e.text for e in events if isinstance(e, Text))
    calls: list[list[str]] = []
    for e in events:
        if isinstance(e, CallStart):
            assert e.index == len(calls)
            calls.append([e.name, ""])
        elif isinstance(e, Arguments):
            calls[e.index][1] += e.text
    return content, [(n, a) for n, a in calls], events


def splits(text: str) -> list[list[str]]:
    """The text whole, in pieces of 1 to 7 characters, and in 20 random cuts."""
    out = [[text]] + [[text[i : i + n] for i in range(0, len(text), n)] for n in range(1, 8)]
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


WEATHER = {"city": "Paris", "unit": "celsius"}
W = json.dumps(WEATHER)

# (parser, model output, expected content, expected calls): what each family writes on its own
FREE_CASES = [
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>', "", [("get_weather", W)]),
    (
        "hermes",  # Qwen2.5: text, then parallel calls, one block each
        f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
        "Let me look.\n",
        [("get_weather", W), ("get_time", '{"tz": "Europe/Paris"}')],
    ),
    (
        "hermes",  # SmolLM2's card: one block holding a list, no blanks
        '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call>',
        "",
        [("a", '{"x": 1}'), ("b", "{}")],
    ),
    (
        "hermes",  # arguments written as JSON text, strings holding brackets, quotes and braces
        '<tool_call>{"name": "q", "arguments": "{\\"sql\\": \\"select \\\\\\"}\\\\\\" from [t]\\"}"}</tool_call>',
        "",
        [("q", json.dumps({"sql": 'select "}" from [t]'}))],
    ),
    (
        "hermes",
        "No call here, just <b>html</b> and a <tool_ call.",
        "No call here, just <b>html</b> and a <tool_ call.",
        [],
    ),
    (  # not a call object: the block is content
        "hermes",
        'I think <tool_call>{"nam": 1}</tool_call> bye',
        'I think <tool_call>{"nam": 1}</tool_call> bye',
        [],
    ),
    (  # malformed JSON: content
        "hermes",
        '<tool_call>{"name": "a", "arguments": {"x": tru}}</tool_call>',
        '<tool_call>{"name": "a", "arguments": {"x": tru}}</tool_call>',
        [],
    ),
    (  # cut by max_tokens inside the call: content, as written
        "hermes",
        'ok <tool_call>\n{"name": "get_weather", "argu',
        'ok <tool_call>\n{"name": "get_weather", "argu',
        [],
    ),
    ("hermes", "ends with a marker's start <tool_ca", "ends with a marker's start <tool_ca", []),
    (  # text after the call is content; blanks between calls are not
        "hermes",
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n\nDone.',
        "\n\nDone.",
        [("a", "{}")],
    ),
    (
        "llama3_json",  # Llama 3.1: the answer is the call
        f'{{"name": "get_weather", "parameters": {W}}}',
        "",
        [("get_weather", W)],
    ),
    (
        "llama3_json",  # <|python_tag|> kept (skip_special_tokens false), two calls with ";"
        '<|python_tag|>{"name": "a", "parameters": {"x": "}"}}; {"name": "b", "parameters": {}}',
        "",
        [("a", '{"x": "}"}'), ("b", "{}")],
    ),
    (  # JSON that is no call: content
        "llama3_json",
        '  {"answer": 42, "name": "x"}',
        '  {"answer": 42, "name": "x"}',
        [],
    ),
    (  # calls only at the start: later JSON is content
        "llama3_json",
        'Sure: {"name": "a", "parameters": {}}',
        'Sure: {"name": "a", "parameters": {}}',
        [],
    ),
    (
        "mistral",
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}, {{"name": "b", "arguments": {{"q": "[x]"}}}}]',
        "",
        [("get_weather", W), ("b", '{"q": "[x]"}')],
    ),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {}}]', "Sure. ", [("a", "{}")]),
    ("mistral", "[TOOL_CALLS] no list", "[TOOL_CALLS] no list", []),
    ("mistral", "[TOOL_CALL] is not the marker", "[TOOL_CALL] is not the marker", []),
]


@pytest.mark.parametrize("name, output, content, calls", FREE_CASES)
def test_free_readers_read_each_familys_output(name, output, content, calls):
    for pieces in splits(output):
        got_content, got_calls, events = read(TOOL_PARSERS[name].reader("free"), pieces)
        assert (got_content, got_calls) == (content, calls), pieces
        for _, arguments in got_calls:
            assert isinstance(json.loads(arguments), dict)
        # a free call is told in two events: its start, then its whole arguments
        starts = [i for i, e in enumerate(events) if isinstance(e, CallStart)]
        assert all(isinstance(events[i + 1], Arguments) for i in starts)


def test_text_that_may_begin_a_call_is_held_back_until_known():
    reader = HERMES.reader("free")
    assert reader.feed("Hello <tool") == [Text("Hello ")]
    assert reader.feed("_ca") == []
    assert reader.feed("r") == [Text("<tool_car")]
    assert reader.feed(" <tool_call>{") == [Text(" ")]
    [start, arguments] = reader.feed('"name": "f", "arguments": {"a": [1, {"b": "]}"}]}}')
    assert isinstance(start, CallStart) and start.name == "f" and start.id.startswith("call_") and len(start.id) == 29
    assert arguments == Arguments(0, '{"a": [1, {"b": "]}"}]}')
    assert reader.feed("</tool_call>") == [] and reader.finish() == []


def test_mistral_call_ids_are_nine_letters_or_digits():
    [start, _] = MISTRAL.reader("free").feed('[TOOL_CALLS][{"name": "a", "arguments": {}}]')
    assert isinstance(start, CallStart) and len(start.id) == 9 and start.id.isalnum()


# ---- grammar-written output ---------------------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "get_weather_at"}},  # a name the first one begins
]


def forced_output(parser, calls: list[tuple[str, str]]) -> str:
    """What the call grammar makes a model write, by hand from the family's documented format."""
    written = {
        "hermes": [f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in calls],
        "llama3_json": [f'{{"name": "{n}", "parameters": {a}}}' for n, a in calls],
        "mistral": [f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls],
    }[parser.name]
    return {"hermes": "\n".join(written), "llama3_json": "; ".join(written), "mistral": f"[{', '.join(written)}]"}[
        parser.name
    ]


CALLS = [
    ("get_weather", '{"city": "Pa\\"ris}", "unit": "celsius"}'),
    ("get_weather_at", "{}"),
    ("get_time", "{}"),
]


def _compiled(constraint: StructuredOutput):
    import xgrammar as xgr

    from lora_server.engine.structured import _compact_schemas

    tag = _compact_schemas(json.loads(constraint.spec), constraint.param)
    return xgr.Grammar.from_structural_tag(json.dumps(tag))


def _accepts(constraint: StructuredOutput, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(_compiled(constraint), text)


@pytest.mark.parametrize("parser", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda p: p.name)
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_calls_grammar_and_reader_agree(parser, parallel):
    plan = plan_tool_calls(parse_tool_request(TOOLS, "required", parallel), parser)
    assert plan is not None and plan.mode == "forced" and plan.constraint is not None
    for calls in (CALLS[:1], CALLS[1:2], CALLS):
        output = forced_output(parser, calls)
        assert _accepts(plan.constraint, output) == (parallel or len(calls) == 1), output
        for pieces in splits(output):
            content, read_calls, events = read(plan.reader(), pieces)
            assert content == "" and read_calls == calls
    # arguments outside the schema, a function not given, text around the calls: refused by the grammar
    assert not _accepts(plan.constraint, forced_output(parser, [("get_weather", '{"city": 3}')]))
    assert not _accepts(plan.constraint, forced_output(parser, [("get_weather", '{"unit": "celsius"}')]))
    assert not _accepts(plan.constraint, forced_output(parser, [("get_rain", "{}")]))
    assert not _accepts(plan.constraint, "Sure. " + forced_output(parser, CALLS[:1]))


def test_a_named_function_is_the_only_one_the_grammar_allows_and_once():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    plan = plan_tool_calls(parse_tool_request(TOOLS, choice, None), HERMES)  # parallel calls allowed: still once
    assert plan is not None and plan.constraint is not None
    assert _accepts(plan.constraint, forced_output(HERMES, CALLS[:1]))
    assert not _accepts(plan.constraint, forced_output(HERMES, CALLS[1:2]))
    assert not _accepts(plan.constraint, forced_output(HERMES, [CALLS[0], CALLS[0]]))


def test_forced_arguments_are_told_as_they_come():
    reader = HERMES.reader("forced")
    assert reader.feed('<tool_call>\n{"name": "get_wea') == []
    [start] = reader.feed('ther", "arguments": ')
    assert isinstance(start, CallStart) and start.name == "get_weather"
    assert reader.feed('{"city": "Pa') == [Arguments(0, '{"city": "Pa')]
    assert reader.feed('ris"}}\n</tool') == [Arguments(0, 'ris"}')]
    assert reader.feed("_call>") == [] and reader.finish() == []


# each family's call grammar: the syntax that ends a call, and the one that ends the calls (by hand, as forced_output)
ENDS = {"hermes": ("}\n</tool_call>", ""), "llama3_json": ("}", ""), "mistral": ("}", "]")}


def cut_reading(parser, output: str, calls: list[tuple[str, str]], k: int) -> tuple[str, list[tuple[str, str]]]:
    """(content, calls) that ``output[:k]`` must read as, worked out by hand from where each call's name, arguments
    and end lie in ``output``: a call whose name is whole (its closing quote written) is told with its arguments
    as far as written; the text after the last such call's end is content, word for word (blanks alone after a
    call are not, nor the closing syntax), and the rest of a call's own syntax cut short is neither."""
    suffix, close = ENDS[parser.name]
    told, start = [], 0  # start: where the text after the last told call begins
    for name, arguments in calls:
        name_done = output.index(f'"{name}"', start) + len(name) + 2
        args_at = output.index(arguments, name_done)
        if k < name_done:
            break
        told.append((name, output[args_at : min(k, args_at + len(arguments))]))
        start = output.index(suffix, args_at + len(arguments)) + len(suffix)
    content = output[start:k]
    return ("" if told and (not content.strip() or content == close) else content), told


@pytest.mark.parametrize("parser", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda p: p.name)
def test_a_forced_answer_cut_anywhere_keeps_every_word(parser):
    """max_tokens may cut a forced answer at any character: what was written is told, as calls (their arguments
    as far as written: the answer's finish reason, length, says they are cut) or as content (a call whose name is
    not whole yet), the same whole and streamed."""
    plan = plan_tool_calls(parse_tool_request(TOOLS, "required", True), parser)
    assert plan is not None
    output = forced_output(parser, CALLS)
    for k in range(1, len(output) + 1):
        written, expected = output[:k], cut_reading(parser, output, CALLS, k)
        cuts = sorted(random.Random(k).sample(range(1, k), min(k - 1, 3)))
        for pieces in ([written], list(written), [written[a:b] for a, b in zip([0, *cuts], [*cuts, k], strict=True)]):
            content, calls, _ = read(plan.reader(), pieces)
            assert (content, calls) == expected, (written, pieces)


def test_a_triggered_call_cut_before_its_name_is_whole_is_content():
    """tool_choice auto under the grammar: text, then a call cut anywhere; the text before it stays content."""
    plan = plan_tool_calls(parse_tool_request(TOOLS, "auto", False), HERMES)
    assert plan is not None and plan.mode == "triggered"
    text, call = "Let me check. ", forced_output(HERMES, CALLS[:1])
    for k in range(1, len(call) + 1):
        content, calls = cut_reading(HERMES, call, CALLS[:1], k)
        for pieces in ([text + call[:k]], list(text + call[:k])):
            assert read(plan.reader(), pieces)[:2] == (text + content, calls), pieces


@pytest.mark.parametrize("parser", [HERMES, LLAMA3_JSON], ids=lambda p: p.name)
def test_auto_calls_under_the_grammar_follow_free_text(parser):
    """tool_choice auto with parallel_tool_calls false: free text, then at most one call, under the grammar."""
    plan = plan_tool_calls(parse_tool_request(TOOLS, "auto", False), parser)
    assert plan is not None and plan.mode == "triggered" and plan.constraint is not None
    call = forced_output(parser, CALLS[:1])
    output = "Let me check that. " + call
    assert _accepts(plan.constraint, output) and _accepts(plan.constraint, "No call needed.")
    assert not _accepts(plan.constraint, output + forced_output(parser, CALLS[1:2]))
    for pieces in splits(output):
        content, calls, _ = read(plan.reader(), pieces)
        assert (content, calls) == ("Let me check that. ", CALLS[:1])
    plan = plan_tool_calls(parse_tool_request(TOOLS, "auto", True), parser)
    assert plan is not None and plan.mode == "free" and plan.constraint is None  # no guarantee asked: no grammar


def test_plans_that_cannot_be_kept_are_refused():
    from lora_server.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        plan_tool_calls(parse_tool_request(TOOLS, "auto", None), None)
    assert err.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError) as err:  # Mistral's marker is a special token a grammar cannot write
        plan_tool_calls(parse_tool_request(TOOLS, "auto", False), MISTRAL)
    assert err.value.param == "parallel_tool_calls"
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}]
    with pytest.raises(InvalidRequestError) as err:
        plan_tool_calls(parse_tool_request(strict, "auto", None), MISTRAL)
    assert err.value.param == "tools"
    assert plan_tool_calls(parse_tool_request(TOOLS, "none", None), HERMES) is None
    forced = plan_tool_calls(parse_tool_request(TOOLS, "required", None), None)
    assert forced is not None and forced.parser is HERMES  # forced calls need no parser: the default format's


@pytest.mark.parametrize(
    "template, renders_tools, expected",
    [
        ("{% for m in messages %}{{ m.content }}{% endfor %}", False, "hermes"),  # the default rendering's format
        ("{{ tools }}<tool_call>{{ messages }}", True, "hermes"),
        ("{{ tools }}[TOOL_CALLS]", True, "mistral"),
        ("{{ tools }}<|python_tag|>", True, "llama3_json"),
        ("{{ tools }} a format of its own", True, None),
    ],
)
def test_the_parser_is_chosen_from_the_template(template, renders_tools, expected):
    parser = parser_for_template(template, renders_tools)
    assert (parser and parser.name) == expected
