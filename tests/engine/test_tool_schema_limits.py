"""The JSON schemas that enter through ``tools`` are bounded as response_format's are, through a real server: each
tool's parameters deeper than ``--max-json-schema-depth`` or larger than ``--max-json-schema-kb`` is a 400 naming
``tools`` on /v1/chat/completions and /tokenize, in every tool_choice mode and whether or not the tool can be called,
before anything walks the schema (the chat template, the tool prompt, the call grammar, JSON Schema validation), and
the server writes at most one log line for it, never a traceback. A ``$ref`` the grammar cannot follow (a URL, an
anchor, another document) in a schema the grammar enforces is a 400 naming the keyword. A past call's arguments
nested too deep to be written back into the prompt are a 400 naming ``messages``."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.servers import BASE, served

ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
PLAIN = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
HOLE = "the schema goes here"  # where modes() puts the schema's text in a body


def tool(name: str, parameters: Any, strict: bool | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "parameters": parameters}
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def nested(levels: int) -> str:
    """The JSON text of an object schema with ``levels`` properties each inside the last: 2 * levels + 1 objects
    deep (the depth the limit counts). Text: Python's json.dumps cannot write what is nested near its recursion
    limit."""
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "object"}' + "}}" * levels


def modes(bad: str) -> list[tuple[str, str]]:
    """(path, JSON body) of every way a tool's schema (``bad``, JSON text) reaches the server: each tool_choice, the
    bad tool called or not, and /tokenize."""
    only, beside = [tool("f", HOLE)], [tool("g", PLAIN), tool("f", HOLE)]
    chat = [
        {"tools": only},  # auto: free text read by the parser
        {"tools": only, "tool_choice": "none"},
        {"tools": only, "tool_choice": "required"},
        {"tools": only, "tool_choice": "required", "parallel_tool_calls": False},
        {"tools": only, "tool_choice": {"type": "function", "function": {"name": "f"}}},
        {"tools": beside, "tool_choice": {"type": "function", "function": {"name": "g"}}},  # f is never called
        {"tools": [tool("f", HOLE, strict=True)]},  # auto under the grammar
        {"tools": only, "parallel_tool_calls": False},
    ]
    bodies = [("/v1/chat/completions", {"model": BASE, "messages": ASK, "max_tokens": 4, **c}) for c in chat]
    bodies.append(("/tokenize", {"model": BASE, "messages": ASK, "tools": only}))
    return [(path, json.dumps(body).replace(json.dumps(HOLE), bad)) for path, body in bodies]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from served(tmp_path_factory, "tool-schemas", ["--allow-anonymous"])


def post(server, path: str, body: str) -> httpx.Response:
    return httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)


def refused(server, cases: list[tuple[str, str]], says: str) -> str:
    """Each request is a 400 in OpenAI's shape naming ``tools``, its message holding ``says``; the server's log
    lines written meanwhile."""
    before = len(server.log_text())
    for path, body in cases:
        r = post(server, path, body)
        assert r.status_code == 400, (path, body[-200:], r.text[:300])
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["param"] == "tools" and says in error["message"], error
    log = server.log_text()[before:]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # nothing else changed
    return log


@pytest.mark.slow
def test_a_tool_schema_nested_150_deep_is_400_in_every_mode(server):
    """The security review's case: a 6 KB body whose tool parameters nest 150 levels was a 500 writing ~300 KB
    of traceback per request."""
    cases = modes(nested(150))
    assert all(len(body) < 7000 for _, body in cases)
    log = refused(server, cases, "--max-json-schema-depth")
    assert "Traceback" not in log and log.count("\n") <= len(cases), log[:2000]


@pytest.mark.slow
def test_a_tool_schema_up_to_what_the_body_parser_takes_is_400(server):
    """Nested up to what Python's JSON parser takes (past it the body is refused as such, naming no field):
    nothing recurses through a schema before it is bounded, whatever the tool_choice."""
    before = len(server.log_text())
    levels = 470
    while True:
        answers = [post(server, path, body) for path, body in modes(nested(levels))]
        assert all(r.status_code == 400 for r in answers), [r.text[:200] for r in answers]
        params = {r.json()["error"]["param"] for r in answers}
        if params == {None}:  # the body parser's limit, where this walk ends
            assert "nested too deeply" in answers[0].json()["error"]["message"]
            break
        assert params == {"tools"} and levels < 600, [r.text[:200] for r in answers]
        levels += 1
    assert "Traceback" not in server.log_text()[before:]


@pytest.mark.slow
def test_a_tool_schema_over_the_size_limit_is_400_in_every_mode(server):
    words = [f"w{i:06d}-" + "x" * 40 for i in range(1400)]  # ~67 KiB as compact JSON: over the 64 KiB default
    big = {"type": "object", "properties": {"word": {"enum": words}}}
    cases = modes(json.dumps(big))
    log = refused(server, cases, "--max-json-schema-kb")
    assert "Traceback" not in log


@pytest.mark.slow
def test_a_tool_schema_within_the_limits_is_served(server):
    """The bound refuses no more than it must: 15 levels of properties, 31 objects deep (the default limit: 32),
    pass."""
    for path, body in modes(nested(15)):
        r = post(server, path, body)
        assert r.status_code == 200, (path, body[-200:], r.text[:300])


REFS = [
    "http://example.com/city.json",
    "https://example.com/schemas#/$defs/city",
    "city.json",
    "#city",  # an $anchor
]


@pytest.mark.slow
@pytest.mark.parametrize("ref", REFS)
def test_a_ref_the_grammar_cannot_follow_is_400_when_the_grammar_enforces_it(server, ref):
    """Without the refusal the call's arguments came out unconstrained (xgrammar reads such a $ref as any value)."""
    schema = {
        "type": "object",
        "$defs": {"city": {"$anchor": "city", "type": "string", "maxLength": 4}},
        "properties": {"city": {"$ref": ref}},
        "required": ["city"],
    }
    enforced = [
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "f"}}},
    ]
    cases = [
        ("/v1/chat/completions", {"model": BASE, "messages": ASK, "max_tokens": 4, "tools": [tool("f", schema)], **c})
        for c in enforced
    ]
    cases.append(
        ("/v1/chat/completions", {"model": BASE, "messages": ASK, "max_tokens": 4, "tools": [tool("f", schema, True)]})
    )
    for path, body in cases:
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert error["param"] == "tools" and "$ref" in error["message"] and ref in error["message"], error


@pytest.mark.slow
def test_past_call_arguments_nested_too_deep_are_400_naming_messages(server):
    """A past call's arguments are JSON text inside the body: nested up to what the parser takes (nearly 1000
    levels) they were a 500 where the tool prompt wrote them back; past 256 levels they are refused, at 256 served."""
    before = len(server.log_text())

    def ask(levels: int) -> httpx.Response:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * levels + "]" * levels}}
        messages = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "18 degrees"},
        ]
        return httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": BASE, "messages": messages, "max_tokens": 1},
            timeout=60,
        )

    for levels in (257, 600, 980, 985, 990):
        r = ask(levels)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", (levels, r.text[:300])
    assert "Traceback" not in server.log_text()[before:]
    assert ask(256).status_code == 200
